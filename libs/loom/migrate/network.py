"""Network-driven rescheduling and backflow: which running jobs a link's change concerns, and the
inputs of :func:`loom.migrate.benefit.decide` for each (pure, no I/O).

The migration service hears network perception's ``loom.net.event.degraded`` / ``recovered`` and
the link states; for a changed link it looks at every running job whose parts sit at both of its
ends (a cross-cluster gang, a pipeline's stages), asks placement where the scheduling framework
would place the job now (``loom.placement.whatif``), and decides with the measured path between
the job's lead cluster and that candidate. This module turns those answers into the decision's
inputs:

* :func:`spans` — whether a job's regions span a link (either direction);
* :func:`running_state` — a :class:`~loom.migrate.benefit.RunningJobState` from the job's row,
  the what-if's current step and its move history (cool-down, hysteresis);
* :func:`candidate_of` — the what-if's candidate as a :class:`~loom.migrate.benefit.Candidate`;
* :func:`path_between` — the measured path between two regions from the latest link states.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from typing import Any

from loom.migrate.benefit import (
    LOCAL_PATH,
    Candidate,
    PathState,
    RunningJobState,
    checkpoint_bytes_of,
    job_class_of,
)
from loom_proto.jobs import JobSpec
from loom_proto.net import LinkState

__all__ = ["candidate_of", "path_between", "running_state", "spans"]


def spans(regions: Collection[str], src: str, dst: str) -> bool:
    """Whether a job with parts in ``regions`` talks over the link ``src``–``dst`` (either way)."""
    return src != dst and src in regions and dst in regions


def path_between(
    links: Mapping[tuple[str, str], LinkState], src: str, dst: str, *, default_bandwidth_gbps: float = 1.0
) -> PathState | None:
    """The measured path from region ``src`` to ``dst``: local inside one region; else the direct
    link's latest state (the reverse direction's when only it is known); None when neither is."""
    if src == dst:
        return LOCAL_PATH
    link = links.get((src, dst)) or links.get((dst, src))
    if link is None:
        return None
    return PathState.of([link], default_bandwidth_gbps=default_bandwidth_gbps)


def running_state(
    spec: JobSpec,
    *,
    attempt: int,
    progress: float,
    cluster: str,
    region: str,
    step_s: float,
    checkpoint_step: int | None,
    moves: int,
    last_moved_s: float | None,
) -> RunningJobState:
    """A running job as the decision reads it: its predicted step ``step_s`` where it runs now
    (the what-if's, under the links known now), its progress and checkpoints, its move history."""
    steps = spec.work.steps
    return RunningJobState(
        job_id=spec.job_id,
        job_class=job_class_of(spec),
        cluster=cluster,
        region=region,
        steps=steps,
        steps_done=min(max(progress, 0.0), 1.0) * steps,
        step_s=step_s if step_s > 0 else math.inf,
        checkpoint_every_steps=spec.work.checkpoint_every_steps,
        checkpoint_step=checkpoint_step,
        checkpoint_bytes=checkpoint_bytes_of(spec),
        attempt=attempt,
        moves=moves,
        last_moved_s=last_moved_s,
    )


def candidate_of(answer: Mapping[str, Any] | None) -> Candidate | None:
    """The what-if's candidate placement (None: no placement elsewhere has room for it now)."""
    if not answer or answer.get("step_s") is None:
        return None
    return Candidate(
        cluster=str(answer["cluster"]),
        region=str(answer["region"]),
        step_s=float(answer["step_s"]),
        start_after_s=float(answer.get("start_after_s") or 0.0),
    )
