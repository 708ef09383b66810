"""Compute plugins: SCU fit by task type, trust of newly joined clusters, water-level balance, and
the queue sort. Packing (pool, free and node fit) is :mod:`loom.sched.plugins.packing`."""

import numpy as np

from loom.sched.framework import Candidates, CycleState, QueueItem, StateKey, min_max
from loom.sched.snapshot import FloatArray, IntArray


def _clip(a: FloatArray, lo: float, hi: float) -> FloatArray:
    """``np.clip`` of a float array (NaN stays NaN), without its Python-level overhead."""
    clipped: FloatArray = np.minimum(np.maximum(a, lo), hi)
    return clipped


def delivered_speed(state: CycleState, candidates: Candidates) -> FloatArray:
    """Per candidate: one GPU's SCU for the job's task type, times the cluster's trust."""
    snap = state.snapshot
    speed: FloatArray = snap.job_speeds(state.job)[candidates.model] * snap.trust[candidates.cluster]
    return speed


def believed_speed(state: CycleState, candidates: Candidates) -> FloatArray:
    """:func:`delivered_speed` at the believed speeds (``Snapshot.believed_speeds``: without the
    big-job handicap, which only ranks candidates): for what predicts a run's length."""
    snap = state.snapshot
    speed: FloatArray = snap.believed_speeds(state.job)[candidates.model] * snap.trust[candidates.cluster]
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


class PriorityFairShare:
    """Queue sort: priority first, then the tenant's fair share (least used first), then arrival."""

    name = "priority_fair_share"

    def sort_key(self, item: QueueItem) -> tuple[float, float, float, str]:
        return (-item.job.priority, item.fair_share, item.submitted_at, item.job.job_id)


__all__ = [
    "PriorityFairShare",
    "ScuFit",
    "Trust",
    "WaterLevel",
    "believed_speed",
    "delivered_speed",
    "min_max",
    "speed_key",
]
