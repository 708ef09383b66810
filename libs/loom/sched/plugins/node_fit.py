"""Node fit: fill nodes already broken before breaking a whole one, never at the price of the job's
predicted completion beyond a tolerance that grows with contention.

Apart from the other fragmentation plugins (:mod:`loom.sched.plugins.compute`) because it judges
"as fast" by the job's predicted run (:func:`loom.sched.plugins.network.predicted_jct_s`: compute,
all-reduce over the links, an inference job's round trip to its users, the data delay), not by the
GPU's speed alone: a pool whose GPUs are fast but far from the job's users or data is not "as fast".
"""

import numpy as np

from loom.sched.framework import Candidates, CycleState
from loom.sched.plugins.compute import FREE_FIT_TIE, POOL_FIT_MAX_SLOWDOWN, contention_level
from loom.sched.plugins.network import network_key, predicted_jct_s
from loom.sched.snapshot import FloatArray, IntArray


class NodeFit:
    """Fill nodes already broken before breaking a whole one: whole free nodes stay for big workers.

    Raw: the share of the job's GPUs the candidate pool could place on nodes that are already in
    use (some but not all of their GPUs free, room for a whole worker, schedulable), from 0 (every
    worker would break a whole free node) to 1. This is the node-level half of fragmentation (as
    Alibaba's "Beware of Fragmentation", ATC 2023, measures it); ``pool_fit`` is the pool-level
    half. A candidate whose predicted run (:func:`predicted_jct_s`) is longer than the best
    candidate's by more than :func:`node_fit_tolerance` gets no preference: within ``FREE_FIT_TIE``
    on a quiet platform (whole nodes abound, so a node's shape is worth no time), up to
    ``POOL_FIT_MAX_SLOWDOWN`` under full contention (:func:`contention_level`). Normalised
    ``100 x raw``: absolute, so candidates that would all break whole nodes stay alike.
    """

    name = "node_fit"

    def score(self, state: CycleState, candidates: Candidates) -> FloatArray:
        by_pool = _broken_room(state)
        pools, gpus = self._per_candidate(state, candidates)
        share: FloatArray = np.minimum(by_pool[pools] / gpus, 1.0)
        slowdown = run_slowdown(state, candidates)
        return np.where(slowdown > node_fit_tolerance(contention_level(state)), 0.0, share)

    def _per_candidate(self, state: CycleState, candidates: Candidates) -> tuple[IntArray, FloatArray]:
        """The candidates' pools and GPUs: within a cycle, kept for the last candidates and GPUs per
        worker seen (they read nothing else)."""
        shared = state.shared
        key = (candidates.signature(), state.per_worker) if shared is not None else None
        if shared is not None:
            held = shared.get("node_fit.candidates")
            if held is not None and held[0] == key:
                found: tuple[IntArray, FloatArray] = held[1]
                return found
        snap = state.snapshot
        pools = candidates.cluster * snap.total_sum.shape[1] + candidates.model
        gpus = np.maximum(candidates.workers * state.per_worker, 1).astype(np.float64)
        if shared is not None:
            shared["node_fit.candidates"] = (key, (pools, gpus))
        return pools, gpus

    def normalize(self, state: CycleState, raw: FloatArray) -> FloatArray:
        scores: FloatArray = 100.0 * np.minimum(np.maximum(raw, 0.0), 1.0)
        return scores


def run_slowdown(state: CycleState, candidates: Candidates) -> FloatArray:
    """Per candidate: its predicted run over the best candidate's (1: the best; inf: no estimate).
    Within a cycle (``state.shared``) kept per :func:`network_key` and candidates, as ``jct``'s raw
    scores are: jobs alike in what the prediction reads share it."""
    shared = state.shared
    key = network_key(state) if shared is not None else None
    slot = signature = None
    if shared is not None and key is not None:
        slot, signature = ("node_fit.slowdown", key), candidates.signature()
        held = shared.get(slot)
        if held is not None and held[0] == signature:
            found: FloatArray = held[1]
            return found
    jct = predicted_jct_s(state, candidates)
    ok = np.isfinite(jct) & (jct > 0)
    slowdown: FloatArray = (
        np.where(ok, jct / float(jct[ok].min()), np.inf) if ok.any() else np.ones(jct.shape)
    )
    if shared is not None and slot is not None:
        shared[slot] = (signature, slowdown)
    return slowdown


def node_fit_tolerance(level: float) -> float:
    """The most a candidate's predicted run may exceed the best's (as a factor) and still get
    :class:`NodeFit`'s preference, at contention ``level`` (:func:`contention_level`): within
    ``FREE_FIT_TIE`` on a quiet platform (packing breaks ties, as ``free_fit``), growing to
    ``POOL_FIT_MAX_SLOWDOWN`` under full contention (a whole node kept for a big worker is then
    worth some time)."""
    tie = 1.0 + FREE_FIT_TIE
    return tie + min(max(level, 0.0), 1.0) * (POOL_FIT_MAX_SLOWDOWN - tie)


def _broken_room(state: CycleState) -> FloatArray:
    """Per pool, the GPUs of whole workers on its nodes in use (some but not all GPUs free,
    schedulable). Within a cycle (``state.shared``) kept per GPUs per worker with the pool versions,
    and recounted only for the pools that changed since."""
    snap = state.snapshot
    per_worker = state.per_worker
    shared = state.shared
    held = shared.get(("node_fit.room", per_worker)) if shared is not None else None
    if held is not None and held[0].size == snap.pool_version.size:
        versions: IntArray = held[0]
        by_pool: FloatArray = held[1]
        stale = np.flatnonzero(versions != snap.pool_version)
        bounds = snap.pool_bounds
        for p in stale.tolist():
            lo, hi = int(bounds[p]), int(bounds[p + 1])
            free = snap.free[lo:hi]
            broken = snap.schedulable[lo:hi] & (free >= per_worker) & (free < snap.total[lo:hi])
            # integers: the sum is exact, as bincount's float one is
            by_pool[p] = float(int(np.add.reduce((free // per_worker)[broken])) * per_worker)
            versions[p] = snap.pool_version[p]
        return by_pool
    broken = snap.schedulable & (snap.free >= per_worker) & (snap.free < snap.total)
    room = np.where(broken, snap.free // per_worker, 0) * per_worker
    size = snap.total_sum.size
    by_pool = np.bincount(snap.pool_of, weights=room, minlength=size)[:size].astype(np.float64)
    if shared is not None:
        shared[("node_fit.room", per_worker)] = (snap.pool_version.copy(), by_pool)
    return by_pool


__all__ = ["NodeFit", "node_fit_tolerance", "run_slowdown"]
