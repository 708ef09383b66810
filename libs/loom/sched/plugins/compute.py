"""Compute plugins: SCU fit by task type, trust of newly joined clusters, water-level balance, and
fragmentation over pools (pool and free fit; node fit is :mod:`loom.sched.plugins.node_fit`)."""

from typing import TYPE_CHECKING

import numpy as np

from loom.sched.framework import Candidates, CycleState, QueueItem, StateKey, min_max
from loom.sched.snapshot import FloatArray, IntArray

if TYPE_CHECKING:
    pass


def _clip(a: FloatArray, lo: float, hi: float) -> FloatArray:
    """``np.clip`` of a float array (NaN stays NaN), without its Python-level overhead."""
    clipped: FloatArray = np.minimum(np.maximum(a, lo), hi)
    return clipped


def delivered_speed(state: CycleState, candidates: Candidates) -> FloatArray:
    """Per candidate: one GPU's SCU for the job's task type, times the cluster's trust."""
    snap = state.snapshot
    speed: FloatArray = snap.job_speeds(state.job)[candidates.model] * snap.trust[candidates.cluster]
    return speed


_SPEED_KEY: StateKey[bytes] = StateKey("compute.speed_key")


def speed_key(state: CycleState) -> bytes:
    """What :func:`delivered_speed` reads of the job, as a key: its per-model speed table."""
    key = state.get(_SPEED_KEY, b"")
    if not key:
        key = state.snapshot.job_speeds(state.job).tobytes()
        state.write(_SPEED_KEY, key)
    return key


class ScuFit:
    """Faster GPUs for the job's task type score higher: SCU per GPU x trust x workers given."""

    name = "scu_fit"

    def normalize_key(self, state: CycleState) -> tuple[()]:
        """Normalising reads the raw scores only (see :class:`~loom.sched.framework.ScorePlugin`)."""
        return ()

    def score_key(self, state: CycleState) -> bytes:
        """Raw scores read the job's speeds only (see :class:`~loom.sched.framework.ScorePlugin`)."""
        return speed_key(state)

    def score(self, state: CycleState, candidates: Candidates) -> FloatArray:
        return delivered_speed(state, candidates) * candidates.workers

    def normalize(self, state: CycleState, raw: FloatArray) -> FloatArray:
        top = float(raw.max(initial=0.0))
        return raw / top * 100.0 if top > 0 else np.full(raw.shape, 100.0)


class Trust:
    """How far a cluster's claimed compute is believed: new clusters start low and earn trust."""

    name = "trust"

    def normalize_key(self, state: CycleState) -> tuple[()]:
        """Normalising reads the raw scores only (see :class:`~loom.sched.framework.ScorePlugin`)."""
        return ()

    def score_key(self, state: CycleState) -> tuple[()]:
        """Raw scores read nothing of the job (see :class:`~loom.sched.framework.ScorePlugin`)."""
        return ()

    def score(self, state: CycleState, candidates: Candidates) -> FloatArray:
        trust: FloatArray = state.snapshot.trust[candidates.cluster].astype(np.float64)
        return trust

    def normalize(self, state: CycleState, raw: FloatArray) -> FloatArray:
        return np.clip(raw, 0.0, 1.0) * 100.0


class WaterLevel:
    """Balance: prefer the cluster whose GPU use (after this job) stays lowest, so no cluster fills first."""

    name = "water_level"

    def score(self, state: CycleState, candidates: Candidates) -> FloatArray:
        snap = state.snapshot
        c = candidates.cluster
        total_c, adds, room = self._per_candidate(state, candidates)
        free = snap.free_sum.sum(axis=1).astype(np.float64)
        after = (total_c - free[c] + adds) / room
        level: FloatArray = 1.0 - _clip(after, 0.0, 1.0)
        return level

    def _per_candidate(
        self, state: CycleState, candidates: Candidates
    ) -> tuple[FloatArray, IntArray, FloatArray]:
        """Per candidate: its cluster's GPUs, the job's GPUs there, and the divisor; within a cycle
        kept for the last candidates seen (nodes' totals never change)."""
        shared = state.shared
        key = (candidates.signature(), state.per_worker)
        if shared is not None:
            held = shared.get("water_level.candidates")
            if held is not None and held[0] == key:
                found: tuple[FloatArray, IntArray, FloatArray] = held[1]
                return found
        total = state.snapshot.total_sum.sum(axis=1).astype(np.float64)
        total_c = total[candidates.cluster]
        found = (total_c, candidates.workers * state.per_worker, np.maximum(total_c, 1.0))
        if shared is not None:
            shared["water_level.candidates"] = (key, found)
        return found

    def normalize(self, state: CycleState, raw: FloatArray) -> FloatArray:
        return _clip(raw, 0.0, 1.0) * 100.0


POOL_FIT_FROM = 0.4
"""Share of the platform's GPUs in use below which :class:`PoolFit` has no say (unless jobs wait)."""
POOL_FIT_FULL_AT = 0.8
"""Share of the platform's GPUs in use at which :class:`PoolFit` has its full say."""
POOL_FIT_MAX_SLOWDOWN = 2.0
"""Candidates this many times slower per GPU than the fastest get no preference from pool fit."""
POOL_FIT_SPARE = 4.0
"""A pool of at least this many times the job's GPUs is not fragmented by it (no preference)."""


def contention_level(state: CycleState) -> float:
    """How contended the platform is for this job, 0-1: 1 while other jobs wait (the snapshot's
    queue, ``Snapshot.waiting``), else growing from 0 to 1 as the share of the platform's GPUs in use
    goes from :data:`POOL_FIT_FROM` to :data:`POOL_FIT_FULL_AT`. Packing (:class:`PoolFit`, and
    :class:`~loom.sched.plugins.node_fit.NodeFit`) has its say in proportion: on a quiet platform
    whole pools and nodes abound, and keeping them whole is worth no speed."""
    snap = state.snapshot
    shared = state.shared
    total = shared.get("pool_fit.total") if shared is not None else None
    if total is None:
        total = float(snap.total_sum.sum())  # nodes' totals never change
        if shared is not None:
            shared["pool_fit.total"] = total
    used = 1.0 - float(snap.free_sum.sum()) / total if total > 0 else 0.0
    level = min(max((used - POOL_FIT_FROM) / (POOL_FIT_FULL_AT - POOL_FIT_FROM), 0.0), 1.0)
    if snap.waiting_count(exclude=state.job.job_id) > 0:
        level = 1.0  # a queue: contention whatever the share in use
    return level


class PoolFit:
    """Under contention, a pool the job does not fragment: large pools stay whole for large gangs.

    Raw: the candidate pool's GPUs in all (busy or not) over ``POOL_FIT_SPARE x`` the job's GPUs,
    capped at 1: every pool at least four times the job's size is alike, and among smaller ones
    the smallest that holds the job is preferred (best fit over pools, as packing is best fit over
    nodes); a pool whose GPUs are more than ``POOL_FIT_MAX_SLOWDOWN`` times slower for the job than
    the fastest candidate's gets no preference (a job's speed is not traded for a pool's shape).
    Normalised ``100 x (1 - level x raw)``: ``level`` is 1 while other jobs wait (the snapshot's
    queue, ``Snapshot.waiting``), else it grows from 0 to 1 as the share of the platform's GPUs in
    use goes from ``POOL_FIT_FROM`` to ``POOL_FIT_FULL_AT``. A quiet platform lets speed and the
    network decide; a contended one keeps the pools only large gangs fit for them. Measured with
    ``loom bench contention`` (thresholds chosen on its truth-timed cells, 5 seeds).
    """

    name = "pool_fit"

    def score_key(self, state: CycleState) -> tuple[bytes, int]:
        """Raw scores read the job's speeds and GPUs per worker, and pool totals (normalising
        reads the platform's use and the queue: :meth:`normalize_key`)."""
        return speed_key(state), state.per_worker

    def score(self, state: CycleState, candidates: Candidates) -> FloatArray:
        snap = state.snapshot
        gpus = np.maximum(candidates.workers * state.per_worker, 1)
        size = snap.total_sum[candidates.cluster, candidates.model].astype(np.float64)
        share: FloatArray = np.minimum(size / (POOL_FIT_SPARE * gpus), 1.0)
        speed = delivered_speed(state, candidates)
        # Much slower GPUs are no fit: best fit must not trade a job's speed for a pool's shape.
        slow = speed * POOL_FIT_MAX_SLOWDOWN < float(speed.max(initial=0.0))
        return np.where(slow, 1.0, share)

    def level(self, state: CycleState) -> float:
        """How much pool fit has its say now, 0-1: :func:`contention_level`."""
        return contention_level(state)

    def normalize_key(self, state: CycleState) -> float:
        """Normalising reads the raw scores and :meth:`level` only."""
        return self.level(state)

    def normalize(self, state: CycleState, raw: FloatArray) -> FloatArray:
        scores: FloatArray = 100.0 * (1.0 - self.level(state) * _clip(raw, 0.0, 1.0))
        return scores


FREE_FIT_TIE = 0.05
"""Candidates within this share of the fastest candidate's speed are alike for :class:`FreeFit`."""


class FreeFit:
    """Best fit on free GPUs among the fastest candidates: the pool left with the fewest free GPUs.

    Raw: the GPUs the candidate pool would have free once the job's are taken, over the most any
    tied candidate would have, from 0 (the job fills the pool) to 1; candidates more than
    :data:`FREE_FIT_TIE` slower for the job than the fastest get 1 (no preference: speed is never
    traded for packing). Normalised ``100 x (1 - raw)``. Always on, unlike :class:`PoolFit` (which
    judges pools by their size, and only under contention): small jobs fill the pool that is
    already fullest, so pools with many free GPUs stay whole for the gangs that only they can
    hold, before any queue forms. This is Gavel's tie-break (Narayanan et al., OSDI 2020) and
    kube-scheduler's MostAllocated over pools. Measured on the truth-timed grid, Philly-like
    trace, ~64 GPUs, 20 seeds: without it 16-GPU gangs queued 2.6x longer than under
    ``gavel_like`` at half load (553 vs 211 min).
    """

    name = "free_fit"

    def score(self, state: CycleState, candidates: Candidates) -> FloatArray:
        snap = state.snapshot
        gpus = np.maximum(candidates.workers * state.per_worker, 1).astype(np.float64)
        free = snap.free_sum[candidates.cluster, candidates.model].astype(np.float64)
        left = np.maximum(free - gpus, 0.0)
        speed = delivered_speed(state, candidates)
        tied = speed * (1.0 + FREE_FIT_TIE) >= float(speed.max(initial=0.0))
        top = float(left[tied].max(initial=0.0))
        share: FloatArray = np.minimum(left / top, 1.0) if top > 0 else np.zeros(left.shape)
        return np.where(tied, share, 1.0)

    def normalize(self, state: CycleState, raw: FloatArray) -> FloatArray:
        scores: FloatArray = 100.0 * (1.0 - _clip(raw, 0.0, 1.0))
        return scores


class PriorityFairShare:
    """Queue sort: priority first, then the tenant's fair share (least used first), then arrival."""

    name = "priority_fair_share"

    def sort_key(self, item: QueueItem) -> tuple[float, float, float, str]:
        return (-item.job.priority, item.fair_share, item.submitted_at, item.job.job_id)


__all__ = [
    "PoolFit",
    "PriorityFairShare",
    "ScuFit",
    "Trust",
    "WaterLevel",
    "contention_level",
    "delivered_speed",
    "min_max",
    "speed_key",
]
