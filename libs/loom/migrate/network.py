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
* :func:`path_between` — the measured path between two regions from the latest link states;
* :class:`DegradedLinks` — the links degraded now, and when their jobs are due to be looked at
  again: a job that stayed when its link degraded (no room elsewhere then, or a move that did not
  pay) is looked at again every ``recheck_s`` while the link stays degraded, so it moves once room
  appears. The service and the simulator keep one each.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterator, Mapping
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

__all__ = ["DegradedLinks", "candidate_of", "path_between", "running_state", "spans"]


def spans(regions: Collection[str], src: str, dst: str) -> bool:
    """Whether a job with parts in ``regions`` talks over the link ``src``–``dst`` (either way)."""
    return src != dst and src in regions and dst in regions


def concerned_by_link(regions: Collection[str], src: str, dst: str, *, users: Collection[str] = ()) -> bool:
    """Whether a running job with parts in ``regions`` is concerned when the link ``src``–``dst``
    changes: it talks over it (:func:`spans`), or it serves ``users`` (an inference job's
    ``affinity.prefer_regions``) at one end from the other. The migration service reviews these
    jobs and the simulator's migrator looks at the same ones."""
    if spans(regions, src, dst):
        return True
    ends = {src, dst}
    here = ends & set(regions)
    return src != dst and bool(here) and bool((ends - here) & set(users))


def users_of(spec: JobSpec) -> tuple[str, ...]:
    """Where an inference job's users are (its ``affinity.prefer_regions``); none for other jobs."""
    return tuple(spec.affinity.prefer_regions) if spec.task_type == "inference" else ()


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


Pair = frozenset[str]
"""A link as the jobs see it: the two regions, either direction."""


class DegradedLinks:
    """The links degraded now (by region pair; a pair stays degraded while either direction is)
    and when each was last reviewed: :meth:`due` names the pairs whose running jobs are to be
    looked at again, every ``recheck_s`` while the pair stays degraded. Not thread-safe: one owner."""

    def __init__(self, recheck_s: float) -> None:
        if not (math.isfinite(recheck_s) and recheck_s > 0):
            raise ValueError(f"recheck_s must be a finite number of seconds > 0, got {recheck_s}")
        self.recheck_s = recheck_s
        self._directions: dict[Pair, set[tuple[str, str]]] = {}
        self._reviewed: dict[Pair, float] = {}

    @staticmethod
    def pair(src: str, dst: str) -> Pair:
        """The pair of a directed link."""
        return frozenset((src, dst))

    def degraded(self, src: str, dst: str, now: float) -> bool:
        """``src`` → ``dst`` degraded (its jobs are reviewed at ``now``). True when the pair was
        not degraded before (a new degradation: review its jobs now)."""
        pair = self.pair(src, dst)
        new = pair not in self._directions
        self._directions.setdefault(pair, set()).add((src, dst))
        if new:
            self._reviewed[pair] = now
        return new

    def recovered(self, src: str, dst: str) -> bool:
        """``src`` → ``dst`` recovered. True when the pair is no longer degraded at all."""
        pair = self.pair(src, dst)
        directions = self._directions.get(pair)
        if directions is None:
            return False
        directions.discard((src, dst))
        if directions:
            return False
        del self._directions[pair]
        self._reviewed.pop(pair, None)
        return True

    def due(self, now: float) -> list[Pair]:
        """The degraded pairs last reviewed ``recheck_s`` or more before ``now`` (by their regions,
        sorted), each counted as reviewed at ``now``."""
        out = [p for p, at in self._reviewed.items() if now - at >= self.recheck_s]
        for p in out:
            self._reviewed[p] = now
        return sorted(out, key=sorted)

    def next_due(self) -> float | None:
        """When the earliest recheck falls due (None: nothing is degraded)."""
        return min(self._reviewed.values()) + self.recheck_s if self._reviewed else None

    def __contains__(self, pair: object) -> bool:
        return pair in self._directions

    def __iter__(self) -> Iterator[Pair]:
        return iter(sorted(self._directions, key=sorted))

    def __len__(self) -> int:
        return len(self._directions)
