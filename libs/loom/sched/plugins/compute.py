"""Compute plugins: SCU fit by task type, trust of newly joined clusters, and water-level balance."""

import numpy as np

from loom.sched.framework import Candidates, CycleState, QueueItem, min_max
from loom.sched.snapshot import FloatArray


def delivered_speed(state: CycleState, candidates: Candidates) -> FloatArray:
    """Per candidate: one GPU's SCU for the job's task type, times the cluster's trust."""
    snap = state.snapshot
    speed: FloatArray = snap.job_speeds(state.job)[candidates.model] * snap.trust[candidates.cluster]
    return speed


class ScuFit:
    """Faster GPUs for the job's task type score higher: SCU per GPU x trust x workers given."""

    name = "scu_fit"

    def score(self, state: CycleState, candidates: Candidates) -> FloatArray:
        return delivered_speed(state, candidates) * candidates.workers

    def normalize(self, state: CycleState, raw: FloatArray) -> FloatArray:
        top = float(raw.max(initial=0.0))
        return raw / top * 100.0 if top > 0 else np.full(raw.shape, 100.0)


class Trust:
    """How far a cluster's claimed compute is believed: new clusters start low and earn trust."""

    name = "trust"

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
        total = snap.total_sum.sum(axis=1).astype(np.float64)
        free = snap.free_sum.sum(axis=1).astype(np.float64)
        c = candidates.cluster
        after = (total[c] - free[c] + candidates.workers * state.per_worker) / np.maximum(total[c], 1.0)
        level: FloatArray = 1.0 - np.clip(after, 0.0, 1.0)
        return level

    def normalize(self, state: CycleState, raw: FloatArray) -> FloatArray:
        return np.clip(raw, 0.0, 1.0) * 100.0


class PriorityFairShare:
    """Queue sort: priority first, then the tenant's fair share (least used first), then arrival."""

    name = "priority_fair_share"

    def sort_key(self, item: QueueItem) -> tuple[float, float, float, str]:
        return (-item.job.priority, item.fair_share, item.submitted_at, item.job.job_id)


__all__ = ["PriorityFairShare", "ScuFit", "Trust", "WaterLevel", "delivered_speed", "min_max"]
