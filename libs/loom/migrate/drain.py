"""Draining a cluster: whether it may be drained, which jobs move first, how many at once (pure).

The migration service closes a drained cluster to new placements and moves its jobs a few at a
time, each at a checkpoint boundary. This module holds the decisions:

* :func:`drain_refusal` — a drain is refused when some job on the cluster has no feasible GPUs
  on any other open cluster (``--force`` overrides it);
* :func:`order_moves` — which jobs move first: the largest net benefit first, ranked like every
  other migration plan (:func:`loom.migrate.benefit.rank_key`);
* :func:`next_moves` — how many more may start now, under the drain's concurrency.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from loom.migrate.benefit import MigrationVerdict, rank_key


@dataclass(frozen=True, slots=True)
class DrainJob:
    """A running job with a part on the cluster being drained."""

    job_id: str
    attempt: int
    gpus: int
    gpu_models: tuple[str, ...]
    """GPU models the job accepts (empty: any)."""
    steps: int
    step: int
    """Steps done (from its progress)."""
    step_time_s: float
    checkpoint_every_steps: int

    @property
    def remaining_gpu_s(self) -> float:
        """GPU-seconds the job still needs (reference speed)."""
        return max(self.steps - self.step, 0) * self.step_time_s * self.gpus


def drain_refusal(
    cluster: str,
    jobs: Iterable[DrainJob],
    gpus_by_cluster: Mapping[str, Mapping[str, int]],
    closed: Collection[str],
) -> str | None:
    """Why draining ``cluster`` is refused (it holds some job's only feasible GPUs), or None."""
    shut = set(closed) | {cluster}
    stuck: list[str] = []
    for job in jobs:
        open_gpus = sum(
            n
            for c, models in gpus_by_cluster.items()
            if c not in shut
            for model, n in models.items()
            if not job.gpu_models or model in job.gpu_models
        )
        if open_gpus < job.gpus:
            wants = "/".join(job.gpu_models) or "any"
            stuck.append(f"{job.job_id} ({job.gpus} x {wants}: {open_gpus} on other open clusters)")
    if not stuck:
        return None
    return (
        f"draining {cluster} would leave {len(stuck)} job(s) without feasible GPUs elsewhere: "
        + ", ".join(stuck[:5])
        + (" ..." if len(stuck) > 5 else "")
        + " (use --force to drain anyway)"
    )


def order_moves(
    jobs: Iterable[DrainJob], verdicts: Mapping[str, MigrationVerdict] | None = None
) -> list[DrainJob]:
    """Largest benefit first, by the planners' one ranking (:func:`loom.migrate.benefit.rank_key`):
    the jobs with a verdict that names a target (the service asks placement's what-if for each and
    decides with the ``drain`` trigger) by net benefit, largest first; then the others (no answer,
    no room elsewhere now) by the GPU-seconds they still need, most first (they lose the most if the
    drain's deadline catches them); ties by id."""
    placed = {job_id: v for job_id, v in (verdicts or {}).items() if v.target is not None}
    judged = [j for j in jobs if j.job_id in placed]
    unjudged = [j for j in jobs if j.job_id not in placed]
    judged.sort(key=lambda j: rank_key(placed[j.job_id]))
    unjudged.sort(key=lambda j: (-j.remaining_gpu_s, j.job_id))
    return judged + unjudged


def next_moves(
    ordered: Sequence[DrainJob], *, in_flight: int, concurrency: int, past_deadline: bool
) -> list[DrainJob]:
    """The moves to start now: up to ``concurrency`` in flight, all at once past the deadline.

    A job that declares no checkpoints would restart from step 0: it waits for the deadline."""
    movable = [j for j in ordered if j.checkpoint_every_steps > 0 or past_deadline]
    if past_deadline:
        return movable
    return movable[: max(concurrency - in_flight, 0)]
