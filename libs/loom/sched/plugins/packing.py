"""Packing: keep whole what big jobs need, never at the price of the job's predicted run beyond a
tolerance.

Four plugins, one rule for "as fast": a candidate is judged by the job's *predicted run* on it
(:func:`loom.sched.plugins.network.predicted_jct_s`: compute, all-reduce over the links, an inference
job's round trip to its users, the data delay), not by its GPUs' speed alone, since a pool whose GPUs
are fast but far from the job's users, data or gang peers is not "as fast" (:func:`run_slowdown`).
Pool and free fit also keep the GPU-speed test (:func:`gpu_slowdown`): a candidate must be alike on
both (judged by the predicted run alone, slow GPUs near an inference job's users, believed as fast
as far fast ones, took the packing preference; measured in ``libs/loom/sched/plugins/README.md``).

* :class:`FreeFit` (always): best fit on free GPUs among the candidates tied on both.
* :class:`HoleFit` (always, once a larger job was seen): among the same candidates, one that keeps
  the holes larger jobs need.
* :class:`PoolFit` (under contention): pools a job does not fragment, up to a slowdown bound.
* :class:`NodeFit` (tolerance growing with contention): nodes already in use before whole ones.
"""

from collections.abc import Callable
from typing import Any

import numpy as np

from loom.sched.framework import Candidates, CycleState, StateKey
from loom.sched.plugins.compute import delivered_speed
from loom.sched.plugins.network import network_key, predicted_jct_s
from loom.sched.probe import is_probe
from loom.sched.snapshot import BoolArray, FloatArray, IntArray, Snapshot

POOL_FIT_FROM = 0.4
"""Share of the platform's GPUs in use below which :class:`PoolFit` has no say (unless jobs wait)."""
POOL_FIT_FULL_AT = 0.8
"""Share of the platform's GPUs in use at which :class:`PoolFit` has its full say."""
POOL_FIT_MAX_SLOWDOWN = 2.0
"""Candidates whose predicted run or GPU speed is this many times the best's get no preference from
pool fit."""
POOL_FIT_SPARE = 4.0
"""A pool of at least this many times the job's GPUs is not fragmented by it (no preference)."""
FREE_FIT_TIE = 0.05
"""Candidates whose predicted run and GPU speed are both within this share of the best's are alike
for :class:`FreeFit`."""
HOLE_WEIGHT = 20.0
""":class:`HoleFit`'s raw score per hole weight broken (:func:`holes_broken`): breaking one of the
two holes of a size that asked a tenth of the GPUs of the jobs seen lately scores 0."""
HOLE_SCARCITY = 0.5
"""Each other hole of the same size in the platform halves what breaking one weighs
(:func:`holes_broken`)."""

_LEVEL: StateKey[tuple[tuple[int, int, int], float]] = StateKey("packing.contention_level")
""":func:`contention_level` of a job's state, with the snapshot's moves and queue it was read at."""


def contention_level(state: CycleState) -> float:
    """How contended the platform is for this job, 0-1: 1 while other jobs wait (the snapshot's
    queue, ``Snapshot.waiting``; speed probes aside, ``Snapshot.work_waiting``: a probe waiting for
    the one GPU model it measures made a platform at 7 % use look full, and a gang then took a pool
    half as fast to keep a larger one whole; only jobs that could use one of this job's allowed
    pools, ``Snapshot.queue_for``: a job waiting for GPU models or clusters this one cannot take
    waits for nothing its choice changes), else growing from 0 to 1 as the share of the
    platform's GPUs in use goes from :data:`POOL_FIT_FROM` to :data:`POOL_FIT_FULL_AT`. Packing
    (:class:`PoolFit`, :class:`NodeFit`) has its say in proportion: on a quiet platform whole pools
    and nodes abound, and keeping them whole is worth no time."""
    snap = state.snapshot
    # Kept in the job's state once its pre-filters have fixed the pools it may use
    # (``policy_mask``), while the pools' free GPUs (``Snapshot.moves``) and the queue stand as
    # they were: a job's scorers ask several times. The queue is known by its sizes: within one
    # job's state only the job itself joins it, and shapes are written for the job alone. The
    # post-filters that narrow ``model_mask`` in place put it back before scoring; a plugin that
    # asks while it is narrowed would need it in the key.
    version = (snap.moves, len(snap.waiting), len(snap.queued)) if state.policy_mask is not None else None
    if version is not None:
        held = state.get(_LEVEL, ((-1, -1, -1), 0.0))
        if held[0] == version:
            return held[1]
    shared = state.shared
    total = shared.get("pool_fit.total") if shared is not None else None
    if total is None:
        total = float(snap.total_sum.sum())  # nodes' totals never change
        if shared is not None:
            shared["pool_fit.total"] = total
    used = 1.0 - float(snap.free_sum.sum()) / total if total > 0 else 0.0
    level = min(max((used - POOL_FIT_FROM) / (POOL_FIT_FULL_AT - POOL_FIT_FROM), 0.0), 1.0)
    if level < 1.0 and snap.queue_for(state.allowed_pools(), exclude=state.job.job_id):
        # A queue for GPUs this job could take: contention whatever the share in use (a speed
        # probe is no queue, nor a job waiting only for pools this one cannot use).
        level = 1.0
    if version is not None:
        state.write(_LEVEL, (version, level))
    return level


def run_slowdown(state: CycleState, candidates: Candidates) -> FloatArray:
    """Per candidate: its predicted run over the best candidate's (1: the best; inf: no estimate).
    Within a cycle (``state.shared``) kept per :func:`network_key` and candidates, as ``jct``'s raw
    scores are: jobs alike in what the prediction reads share it."""

    def compute() -> FloatArray:
        jct = predicted_jct_s(state, candidates)
        ok = np.isfinite(jct) & (jct > 0)
        slowdown: FloatArray = (
            np.where(ok, jct / float(jct[ok].min()), np.inf) if ok.any() else np.ones(jct.shape)
        )
        return slowdown

    return _kept_per_network(state, candidates, "packing.slowdown", compute)


def _kept_per_network(
    state: CycleState, candidates: Candidates, name: str, compute: Callable[[], FloatArray]
) -> FloatArray:
    """``compute()``, kept within a cycle (``state.shared``) under ``name`` per :func:`network_key`
    and the candidates (computed afresh outside a cycle, or for a job with no such key); the array
    kept is shared: do not change it."""
    shared = state.shared
    key = network_key(state) if shared is not None else None
    if shared is None or key is None:
        return compute()
    slot, signature = (name, key), candidates.signature()
    held = shared.get(slot)
    if held is not None and held[0] == signature:
        found: FloatArray = held[1]
        return found
    value = compute()
    shared[slot] = (signature, value)
    return value


def gpu_slowdown(state: CycleState, candidates: Candidates) -> FloatArray:
    """Per candidate: the fastest candidate's delivered speed for the job over its own (1: as fast
    as the fastest GPU; inf: no speed)."""
    speed = delivered_speed(state, candidates)
    top = float(speed.max(initial=0.0))
    with np.errstate(divide="ignore"):
        slowdown: FloatArray = np.where(speed > 0, top / np.maximum(speed, 1e-300), np.inf)
    return slowdown


def alike_in_speed(state: CycleState, candidates: Candidates) -> BoolArray:
    """Per candidate: tied with the best for :class:`FreeFit` and :class:`HoleFit`, its predicted
    run (:func:`run_slowdown`) and its GPU speed (:func:`gpu_slowdown`) both within
    :data:`FREE_FIT_TIE` of the best's."""
    tied: BoolArray = speed_slowdown(state, candidates) <= 1.0 + FREE_FIT_TIE
    return tied


def speed_slowdown(state: CycleState, candidates: Candidates) -> FloatArray:
    """Per candidate: the larger of its :func:`run_slowdown` and its :func:`gpu_slowdown`. Within a
    cycle kept as :func:`run_slowdown` is (per :func:`network_key` and candidates: the key holds
    the job's speeds, and clusters' trust is fixed for a cycle); do not change the array."""
    return _kept_per_network(
        state,
        candidates,
        "packing.speed_slowdown",
        lambda: np.maximum(run_slowdown(state, candidates), gpu_slowdown(state, candidates)),
    )


class PoolFit:
    """Under contention, a pool the job does not fragment: large pools stay whole for large gangs.

    Raw: the candidate pool's GPUs in all (busy or not) over ``POOL_FIT_SPARE x`` the job's GPUs,
    capped at 1: every pool at least four times the job's size is alike, and among smaller ones the
    smallest that holds the job is preferred (best fit over pools, as packing is best fit over
    nodes); a candidate whose predicted run (:func:`run_slowdown`) or GPU speed
    (:func:`gpu_slowdown`) is more than ``POOL_FIT_MAX_SLOWDOWN`` times the best's gets no
    preference (a job's time is not traded for a pool's shape). Normalised ``100 x (1 - level x
    raw)``, ``level`` being :func:`contention_level`. A quiet platform lets speed and the network
    decide; a contended one keeps the pools only large gangs fit for them. Measured with ``loom
    bench contention`` (thresholds chosen on its truth-timed cells, 5 seeds).
    """

    name = "pool_fit"

    def score_key(self, state: CycleState) -> tuple[object, ...] | None:
        """Raw scores read what the predicted run reads (:func:`network_key`; None: not keyed), GPUs
        per worker and pool totals (normalising reads the platform's use and the queue:
        :meth:`normalize_key`)."""
        key = network_key(state)
        return None if key is None else (key, state.per_worker)

    def score(self, state: CycleState, candidates: Candidates) -> FloatArray:
        snap = state.snapshot
        gpus = np.maximum(candidates.workers * state.per_worker, 1)
        size = snap.total_sum[candidates.cluster, candidates.model].astype(np.float64)
        share: FloatArray = np.minimum(size / (POOL_FIT_SPARE * gpus), 1.0)
        # Much slower runs are no fit: best fit must not trade a job's time for a pool's shape.
        return np.where(speed_slowdown(state, candidates) > POOL_FIT_MAX_SLOWDOWN, 1.0, share)

    def level(self, state: CycleState) -> float:
        """How much pool fit has its say now, 0-1: :func:`contention_level`."""
        return contention_level(state)

    def normalize_key(self, state: CycleState) -> float:
        """Normalising reads the raw scores and :meth:`level` only."""
        return self.level(state)

    def normalize(self, state: CycleState, raw: FloatArray) -> FloatArray:
        scores: FloatArray = 100.0 * (1.0 - self.level(state) * np.minimum(np.maximum(raw, 0.0), 1.0))
        return scores


class FreeFit:
    """Best fit on free GPUs among the fastest candidates: the pool left with the fewest free GPUs.

    Raw: the GPUs the candidate pool would have free once the job's are taken, over the most any
    tied candidate would have, from 0 (the job fills the pool) to 1; a candidate is tied when both
    its predicted run (:func:`run_slowdown`) and its GPU speed (:func:`gpu_slowdown`) are within
    :data:`FREE_FIT_TIE` of the best's; the others get 1 (no preference: time is never traded for
    packing). Normalised ``100 x (1 - raw)``. Always on,
    unlike :class:`PoolFit` (which judges pools by their size, and only under contention): small
    jobs fill the pool that is already fullest, so pools with many free GPUs stay whole for the
    gangs that only they can hold, before any queue forms. This is Gavel's tie-break (Narayanan et
    al., OSDI 2020) and kube-scheduler's MostAllocated over pools. Measured on the truth-timed
    grid, Philly-like trace, ~64 GPUs, 20 seeds: without it 16-GPU gangs queued 2.6x longer than
    under ``gavel_like`` at half load (553 vs 211 min).
    """

    name = "free_fit"

    def score(self, state: CycleState, candidates: Candidates) -> FloatArray:
        snap = state.snapshot
        gpus = np.maximum(candidates.workers * state.per_worker, 1).astype(np.float64)
        free = snap.free_sum[candidates.cluster, candidates.model].astype(np.float64)
        left = np.maximum(free - gpus, 0.0)
        tied = alike_in_speed(state, candidates)
        top = float(left[tied].max(initial=0.0))
        share: FloatArray = np.minimum(left / top, 1.0) if top > 0 else np.zeros(left.shape)
        return np.where(tied, share, 1.0)

    def normalize(self, state: CycleState, raw: FloatArray) -> FloatArray:
        scores: FloatArray = 100.0 * (1.0 - np.minimum(np.maximum(raw, 0.0), 1.0))
        return scores


class HoleFit:
    """Among the fastest candidates, one that leaves the holes larger jobs seen lately need.

    Best fit (:class:`FreeFit`) alone breaks them: with 24 and 16 free GPUs of one model in two
    clusters and 16-GPU gangs arriving, an 8-GPU job best-fits the 16, and the next 16-GPU gang
    leaves no room for the one after it (an outside evaluator's long-tailed gangs on the 63-GPU
    grid platform: Loom 10-16 % behind first fit, which happened to take the 24).

    Raw: :data:`HOLE_WEIGHT` x the holes the candidate breaks (:func:`holes_broken`), capped at 1,
    for candidates tied as :class:`FreeFit` ties them (predicted run and GPU speed within
    :data:`FREE_FIT_TIE` of the best's); the others get 1, as if they broke every hole (keeping a
    hole never sends a job to slower GPUs: time is not traded for packing).
    GPUs held by running speed probes count as free (a probe ends within minutes). Normalised
    ``100 x (1 - raw)``: absolute, so candidates that break nothing stay alike and best fit decides
    among them. Always on; nothing to say until a job larger than this one was seen."""

    name = "hole_fit"

    def score(self, state: CycleState, candidates: Candidates) -> FloatArray:
        snap = state.snapshot
        k = len(candidates)
        gpus = np.maximum(candidates.workers * state.per_worker, 1).astype(np.float64)
        if not k or not any(size > float(gpus.min()) for size in snap.seen.gangs):
            return np.zeros(k)
        # A probe's GPUs are back within minutes: its pool's hole is there. (Counting every GPU
        # that running jobs give back within the job's predicted run instead was tried: an
        # outside evaluator's cells came out worse, 63-GPU Philly-like 0.3 -2.8 -> -5.6 %.)
        probing = _probe_gpus(snap)
        pools = snap.free_sum.astype(np.float64) + (probing if probing is not None else 0.0)
        free = pools[candidates.cluster, candidates.model]
        left = np.maximum(free - gpus, 0.0)
        broken = holes_broken(snap, free, left, gpus, pools)
        if broken is None:
            return np.zeros(k)
        return np.where(alike_in_speed(state, candidates), np.minimum(HOLE_WEIGHT * broken, 1.0), 1.0)

    def normalize(self, state: CycleState, raw: FloatArray) -> FloatArray:
        scores: FloatArray = 100.0 * (1.0 - np.minimum(np.maximum(raw, 0.0), 1.0))
        return scores


def holes_broken(
    snap: Snapshot, free: FloatArray, left: FloatArray, gpus: FloatArray, pools: FloatArray | None = None
) -> FloatArray | None:
    """Per candidate pool (``free`` GPUs now, ``left`` once the job's ``gpus`` are taken): the
    holes it breaks for the larger jobs seen lately (:attr:`SeenShapes.gangs`, every job's GPUs in
    all), each size weighted by its share of the GPUs those jobs asked and by how scarce its holes
    are in the platform's pools now: ``sum_s share_s x (free // s - left // s) x
    HOLE_SCARCITY ** (holes_s - 1)``. A size whose last hole this is weighs in full, one with a
    second hole elsewhere half, one with ten holes nothing to speak of. ``gpus`` per candidate
    (an elastic job's candidates may differ): a candidate is charged only for sizes above its own.
    ``pools``: free GPUs per (cluster, model) pool to count holes in (default the snapshot's; the
    plugin adds what running speed probes hold). None when no larger job was seen (or none fits any
    pool now)."""
    seen = snap.seen
    least = float(gpus.min()) if gpus.size else 0.0
    larger = [(size, count) for size, count in seen.gangs.items() if size > least]
    if not larger:
        return None
    pools = (snap.free_sum.astype(np.float64) if pools is None else pools).ravel()
    # Only pools that hold a hole of some larger size, and sizes some pool holds, can count.
    pools = pools[pools >= min(size for size, _ in larger)]
    top = float(pools.max(initial=0.0))
    larger = [(size, count) for size, count in larger if size <= top]
    if not larger:
        return None
    demand = float(sum(size * count for size, count in seen.gangs.items()))
    larger.sort()
    sizes = np.array([size for size, _ in larger], dtype=np.float64)[:, None]
    share = np.array([size * count for size, count in larger], dtype=np.float64) / demand
    holes = np.floor_divide(pools[None, :], sizes).sum(axis=1)
    # Only sizes larger than the candidate's own GPUs (an elastic job's candidates differ). The
    # last hole of a size matters; one of many hardly: that all the others are taken before one
    # frees grows unlikely fast with their number.
    lost = (np.floor_divide(free[None, :], sizes) - np.floor_divide(left[None, :], sizes)) * (
        sizes > gpus[None, :]
    )
    weight = np.where(holes > 0, share * HOLE_SCARCITY ** np.maximum(holes - 1.0, 0.0), 0.0)
    broken: FloatArray = (weight[:, None] * lost).sum(axis=0)
    return broken if broken.any() else None


_PROBES = "hole_fit.probes"


def _probe_gpus(snap: Snapshot) -> FloatArray | None:
    """GPUs per (cluster, model) pool that running speed probes (:func:`loom.sched.probe.is_probe`)
    hold on schedulable nodes, None when none does. Kept on the snapshot per running list: a list
    that only grew since (a cycle appends each run it places) is scanned from where it was left
    (a list that loses a run is replaced, never changed in place, by every writer of
    ``snap.running``), so a decision costs no pass over every running job."""
    running = snap.running
    held: tuple[list[Any], int, FloatArray | None, int] | None = snap.kept.get(_PROBES)
    start, by_pool = 0, None
    if held is not None and held[0] is running and held[3] == snap.schedulable_version:
        if held[1] == len(running):
            return held[2]
        if held[1] < len(running):
            start, by_pool = held[1], (None if held[2] is None else held[2].copy())
    for run in running[start:]:
        if not is_probe(run.labels):
            continue
        for node, gpus in run.allocations:
            i = snap.node_index.get(node)
            if i is None or not snap.schedulable[i]:
                continue
            if by_pool is None:
                by_pool = np.zeros(snap.free_sum.shape, dtype=np.float64)
            by_pool[snap.cluster_of[i], snap.model_of[i]] += gpus
    snap.kept[_PROBES] = (running, len(running), by_pool, snap.schedulable_version)
    return by_pool


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


__all__ = [
    "FREE_FIT_TIE",
    "HOLE_WEIGHT",
    "POOL_FIT_MAX_SLOWDOWN",
    "FreeFit",
    "HoleFit",
    "NodeFit",
    "PoolFit",
    "contention_level",
    "holes_broken",
    "node_fit_tolerance",
    "run_slowdown",
]
