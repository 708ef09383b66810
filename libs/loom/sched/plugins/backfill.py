"""Backfill: a waiting gang keeps the pool it waits for; jobs behind it use it only if that costs it nothing.

Without this, under contention a large gang starves: whenever GPUs free in the only pools that can
hold it, smaller jobs that arrived later take them first (the queue places every job that fits),
and the gang's room never forms. This is EASY backfilling over Loom's pools:

* **Post-filter** (nothing fits the job now): the job claims the pool it is expected to finish
  soonest in, wait plus run (:func:`loom.sched.plugins.network.single_cluster_options`: running jobs'
  predicted ends), in the shared :class:`~loom.sched.availability.WaitBook`. The span guard claims
  the pool a gang it told to wait waits for. Nothing is placed here (preemption runs next).
* **Pre-filter and filter**: each pool is kept for the claim on it first in queue order (higher
  priority, then earlier submission). For a job behind it, the pool is left out unless the job
  is predicted to end there before the claim's expected start, or the pool still has room for the
  claimant at that time after this job took its GPUs (:func:`loom.sched.availability.room_at_s`).
  The filter reads only the nodes' pools, and says so with ``filter_key`` (the pools left out), so
  the framework's per-pool counts stay cached.
* **Reserve / unreserve**: a job that is placed gives its claim up (restored if the decision is
  refused later in the cycle).

Claims expire when not renewed (:attr:`~loom.sched.availability.Reservation.expires_s`: twice the
expected wait plus 10 minutes past the decision), so a job that left the queue frees its pool.
Pipelines are planned from free GPUs by the pipeline planner and neither claim nor are kept out.
"""

import math

import numpy as np

from loom.sched.availability import Reservation, WaitBook, room_at_s
from loom.sched.framework import CycleState, Decision, Framework, StateKey, Status
from loom.sched.plugins.network import (
    INTRA_CLUSTER_GBPS,
    INTRA_CLUSTER_RTT_MS,
    allreduce_s,
    claim,
    single_cluster_options,
    whole_gang_pools,
)
from loom.sched.probe import is_probe
from loom.sched.snapshot import BoolArray, IntArray

_KEPT: StateKey[frozenset[int]] = StateKey("backfill.kept_pools")
_GIVEN_UP: StateKey[Reservation | None] = StateKey("backfill.given_up")


class WaitingJobs:
    """Reserve: a placed job gives up its claim in the shared wait book (a span guard's or a
    backfill's), restored if the decision is refused later. Places nothing and keeps no pool:
    :class:`Backfill` does that too. (Which jobs wait is the snapshot's queue, ``Snapshot.waiting``.)"""

    name = "waiting_jobs"

    def __init__(self, book: WaitBook | None = None) -> None:
        self.book = book if book is not None else WaitBook()

    def pre_filter(self, state: CycleState) -> Status:
        """Forget the claims not renewed in time (a job cancelled, rejected or placed elsewhere
        while held back: nothing else drops its claim). Filters nothing."""
        self.book.expire(state.snapshot.now)
        return Status()

    def reserve(self, state: CycleState, decision: Decision) -> Status:
        # A what-if places nothing: the job's claim stays.
        state.write(_GIVEN_UP, self.book.placed(state.job.job_id) if state.applying else None)
        return Status()

    def unreserve(self, state: CycleState, decision: Decision) -> None:
        given_up = state.get(_GIVEN_UP, None)
        state.write(_GIVEN_UP, None)
        # A permit that refused the decision may have claimed another pool since: that claim is newer.
        if isinstance(given_up, Reservation) and given_up.job_id not in self.book.claims:
            self.book.reserve(given_up)


class Backfill(WaitingJobs):
    """Pre-filter, filter, post-filter, reserve: pools claimed by waiting gangs (see the module)."""

    name = "backfill"

    # ---- keeping claimed pools ---------------------------------------------------------------

    def pre_filter(self, state: CycleState) -> Status:
        job, snap = state.job, state.snapshot
        self.book.expire(snap.now)
        kept: set[int] = set()
        if job.pipeline is None and len(self.book):
            m_count = snap.free_sum.shape[1]
            gpus = state.min_workers * state.per_worker
            for held in self.book.first_ahead(job.priority, state.submitted_at, job.job_id):
                c = snap.cluster_index.get(held.cluster)
                m = snap.model_index.get(held.gpu_model)
                if c is None or m is None:
                    continue
                if snap.now + self._run_s(state, c, m) <= held.start_s:
                    continue  # done before the claimant is expected to start
                room = room_at_s(snap, c, m, held.start_s, held.per_worker)
                if room - math.ceil(gpus / held.per_worker) >= held.workers:
                    continue  # the claimant still has room then
                kept.add(c * m_count + m)
        state.write(_KEPT, frozenset(kept))
        return Status()

    def filter(self, state: CycleState, nodes: IntArray) -> BoolArray:
        kept = state.get(_KEPT, frozenset())
        if not kept:
            return np.ones(nodes.size, dtype=np.bool_)
        pools = state.snapshot.pool_of[nodes]
        allowed: BoolArray = ~np.isin(pools, np.fromiter(kept, np.int64, len(kept)))
        return allowed

    def filter_key(self, state: CycleState) -> frozenset[int]:
        """The pools kept for others: the filter's answer depends on nothing else of the job."""
        return state.get(_KEPT, frozenset())

    def describe(self, state: CycleState) -> str:
        kept = state.get(_KEPT, frozenset())
        return f"not a pool kept for a gang ahead ({len(kept)} kept)" if kept else ""

    def _run_s(self, state: CycleState, c: int, m: int) -> float:
        """The job's run alone in pool (c, m): steps x (compute there + all-reduce in the cluster)."""
        job, snap = state.job, state.snapshot
        speed = float(snap.believed_speeds(job)[m] * snap.trust[c])
        comm = 0.0
        if job.comm is not None:
            comm = float(
                allreduce_s(
                    float(job.comm.bytes_per_step),
                    float(job.comm.rounds_per_step),
                    INTRA_CLUSTER_RTT_MS,
                    INTRA_CLUSTER_GBPS,
                    state.min_workers,
                )
            )
        return job.work.steps * (job.work.step_time_s / max(speed, 1e-9) + comm)

    # ---- claiming ------------------------------------------------------------------------------

    def post_filter(self, state: CycleState, framework: Framework) -> Decision | None:
        """Nothing fits now: claim the pool the job is expected to finish soonest in (its dataset's
        copy there counted, as the span guard counts it). Places nothing."""
        if state.job.pipeline is not None or is_probe(state.job.labels):
            return None  # a speed probe runs only in room that is free: it claims no pool
        workers = state.min_workers
        options = single_cluster_options(
            state, whole_gang_pools(state, workers), workers, book=self.book, with_data=True
        )
        if options:
            claim(state, self.book, options[0], workers)
        return None
