"""Preemption: which running jobs to stop so a job of higher priority fits, doing the least damage.

Only preemptible jobs of strictly lower priority may be stopped, and a gang is stopped whole (all
its allocations freed), since a gang missing workers cannot run. :func:`select_victims` picks
victims on one cluster and GPU model; :func:`choose` compares those picks across several.
"""

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["Preemption", "RunningJob", "choose", "select_victims"]


@dataclass(frozen=True, slots=True)
class RunningJob:
    """A job holding GPUs: what preemption needs to weigh stopping it."""

    job_id: str
    tenant: str
    priority: int
    progress: float
    """Fraction of its work done, 0 to 1 (what a stop may throw away since the last checkpoint)."""
    preemptible: bool
    cluster: str
    gpu_model: str
    allocations: tuple[tuple[str, int], ...]
    """(node, gpus) it holds; all are freed when it is stopped."""


@dataclass(frozen=True, slots=True)
class Preemption:
    """Stop ``victims`` on ``cluster``'s ``gpu_model`` GPUs, and the job fits there."""

    cluster: str
    gpu_model: str
    victims: tuple[RunningJob, ...]

    @property
    def damage(self) -> tuple[int, int, float]:
        """Smaller is better: (victims, highest victim priority or -1, total progress lost)."""
        return (
            len(self.victims),
            max((v.priority for v in self.victims), default=-1),
            sum(v.progress for v in self.victims),
        )


def _fits(free: Mapping[str, int], victims: Iterable[RunningJob], gpus_per_worker: int, workers: int) -> bool:
    # ``pack_workers`` places each node's whole workers independently, so it succeeds exactly when
    # the nodes hold enough whole workers: a sum, no sort.
    freed = dict(free)
    for victim in victims:
        for node, gpus in victim.allocations:
            freed[node] = freed.get(node, 0) + gpus
    return sum(v // gpus_per_worker for v in freed.values()) >= workers


def select_victims(
    *,
    priority: int,
    gpus_per_worker: int,
    workers: int,
    free: Mapping[str, int],
    running: Sequence[RunningJob],
) -> tuple[RunningJob, ...] | None:
    """Jobs to stop so ``workers`` x ``gpus_per_worker`` fit on these nodes; () if they fit already.

    ``free`` and ``running`` describe one cluster and GPU model. Candidates (preemptible, lower
    priority) are taken cheapest first, by (priority, progress, job id), until the job fits; then,
    last taken first, any victim the job fits without is spared, so no single victim is unneeded.
    None when stopping every candidate is not enough.
    """
    g = gpus_per_worker
    freed = dict(free)
    # Whole workers that fit, kept up to date as victims are added and spared: each change costs
    # only the victim's nodes (``_fits`` recounts every node; this is the same count, incrementally).
    whole = sum(v // g for v in freed.values())
    if whole >= workers:
        return ()

    def move(job: RunningJob, sign: int) -> None:
        nonlocal whole
        for node, gpus in job.allocations:
            before = freed.get(node, 0)
            freed[node] = before + sign * gpus
            whole += freed[node] // g - before // g

    candidates = sorted(
        (job for job in running if job.preemptible and job.priority < priority),
        key=lambda job: (job.priority, job.progress, job.job_id),
    )
    victims: list[RunningJob] = []
    for candidate in candidates:
        victims.append(candidate)
        move(candidate, +1)
        if whole >= workers:
            break
    else:
        return None
    for victim in reversed(victims[:-1]):
        move(victim, -1)
        if whole >= workers:
            victims = [v for v in victims if v is not victim]
        else:
            move(victim, +1)
    return tuple(victims)


def choose(
    *,
    priority: int,
    gpus_per_worker: int,
    workers: int,
    free_by_group: Mapping[tuple[str, str], Mapping[str, int]],
    running: Sequence[RunningJob],
) -> Preemption | None:
    """The (cluster, GPU model) where preemption does the least damage; None if none can make room.

    ``free_by_group`` maps each allowed (cluster, model) to its free GPUs per node; ``running``
    may hold jobs of every group (each is matched by its ``cluster`` and ``gpu_model``). Damage is
    compared by :attr:`Preemption.damage`, then by (cluster, model) for a stable answer.
    """
    by_group: dict[tuple[str, str], list[RunningJob]] = {}
    for job in running:
        by_group.setdefault((job.cluster, job.gpu_model), []).append(job)
    best: Preemption | None = None
    for cluster, model in sorted(free_by_group):
        victims = select_victims(
            priority=priority,
            gpus_per_worker=gpus_per_worker,
            workers=workers,
            free=free_by_group[(cluster, model)],
            running=by_group.get((cluster, model), ()),
        )
        if victims is None:
            continue
        option = Preemption(cluster=cluster, gpu_model=model, victims=victims)
        if best is None or option.damage < best.damage:
            best = option
    return best
