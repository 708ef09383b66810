"""When GPUs free up: expected waits per (cluster, GPU model) pool, from running jobs' predicted ends.

Whether a job should start now on slower GPUs, wait for faster ones, or span clusters depends on
how long the better option is away. The running jobs say it: each :class:`~loom.sched.snapshot.
RunningJob` may carry ``expected_end_s``, the snapshot clock's second at which it is predicted to
end (the simulator and the placement service's book fill it from the run's start, steps and
predicted step). :func:`releases` turns them into one time-ordered list of node releases per pool;
:func:`expected_wait_s` walks it until a pool's schedulable nodes have room for a gang (whole
workers per node, as :meth:`Snapshot.room` counts GPUs) plus what jobs queued ahead of it claim;
given the queued jobs ahead of it (``queue``, from :func:`queue_for_pool`), each of them takes its
room first at each release, and gives it back after its run.

Rules of the estimate, each a plain choice:

* a running job without ``expected_end_s`` never releases (nothing is known; waiting for it is
  priced as forever, so no decision waits on it);
* a job past its predicted end releases now (it is about to end);
* an unschedulable node never counts;
* CPU and RAM are not counted (a lower bound on the wait, like the simulator's retry test).

The release lists are built once per snapshot and running list (``id`` and length, as the
preemption plugin keys its table) and reused by every decision of the cycle; a job's nodes are
looked up once while its running record stays the same object.
"""

import dataclasses
import heapq
import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from loom.sched.snapshot import BoolArray, FloatArray, IntArray, QueuedShape, RunningJob, Snapshot

__all__ = [
    "Releases",
    "Reservation",
    "WaitBook",
    "expected_wait_s",
    "queue_for_pool",
    "releases",
    "room_at_s",
    "sole_pool_of_queued",
]


@dataclass(frozen=True, slots=True)
class Releases:
    """Every known release of GPUs by a running job, sorted by pool and then time.

    Pool ``p``'s releases are ``start[p]:start[p + 1]`` of ``node``, ``at_s`` and ``gpus``.
    """

    node: IntArray
    at_s: FloatArray
    gpus: IntArray
    start: IntArray


_CACHE: "weakref.WeakKeyDictionary[Snapshot, tuple[list[RunningJob], int, Releases]]" = (
    weakref.WeakKeyDictionary()
)
"""Per snapshot: the running list the releases were built from (held, so that no later list can
take its address and pass for it), its length then, and the releases."""

_Entry = tuple[RunningJob, list[int], list[int]]

_PER_JOB: "weakref.WeakKeyDictionary[Snapshot, dict[str, _Entry]]" = weakref.WeakKeyDictionary()
"""Per snapshot, each running job's nodes and GPUs, kept across running lists while the job's
record is the same object (a changed run, resized or restarted, is a new record), so that a new
list costs a pass over its jobs, not over every allocation again."""


def releases(snap: Snapshot) -> Releases:
    """The snapshot's running jobs' releases per pool (cached per running list: the same list
    object, held by the cache, at the same length, as the preemption plugin keys its table). Ends
    are as predicted; one already past counts as now where a wait is computed."""
    running = snap.running
    held = _CACHE.get(snap)
    if held is not None and held[0] is running and held[1] == len(running):
        return held[2]
    known = _PER_JOB.get(snap, {})
    index = snap.node_index
    current: dict[str, _Entry] = {}
    for job in running:
        end = job.expected_end_s
        if end is None or not math.isfinite(end):
            continue
        entry = known.get(job.job_id)
        if entry is None or entry[0] is not job:
            pairs = [(index.get(node, -1), g) for node, g in job.allocations]
            entry = (
                job,
                [i for i, g in pairs if i >= 0 and g > 0],
                [g for i, g in pairs if i >= 0 and g > 0],
            )
        current[job.job_id] = entry
    _PER_JOB[snap] = current
    counts = [len(e[1]) for e in current.values()]
    total = sum(counts)
    node_arr = np.fromiter((i for e in current.values() for i in e[1]), np.int64, total)
    ends = np.fromiter((float(e[0].expected_end_s or 0.0) for e in current.values()), np.float64, len(counts))
    at = np.repeat(ends, counts)
    gpus = np.fromiter((g for e in current.values() for g in e[2]), np.int64, total)
    pool = snap.pool_of[node_arr] if node_arr.size else np.zeros(0, np.int64)
    order = np.lexsort((at, pool))
    pools = snap.pool_version.size
    built = Releases(
        node=node_arr[order],
        at_s=at[order],
        gpus=gpus[order],
        start=np.searchsorted(pool[order], np.arange(pools + 1)).astype(np.int64),
    )
    _CACHE[snap] = (running, len(running), built)
    return built


def expected_wait_s(
    snap: Snapshot,
    cluster: int,
    model: int,
    workers: int,
    per_worker: int = 1,
    *,
    ahead_gpus: int = 0,
    queue: Sequence[tuple[int, int, float]] = (),
) -> float:
    """Seconds from ``snap.now`` until pool (``cluster``, ``model``) has room for ``workers`` workers
    of ``per_worker`` GPUs each (whole workers per node), after ``ahead_gpus`` GPUs have gone to jobs
    waiting ahead (claims), and after the queued jobs ahead, ``queue`` (each its workers, GPUs per
    worker and run there, in queue order), have taken what fits them: at now and at each release,
    each of them still unserved takes its room (whole workers per node, nodes in order) where the
    pool has it, in queue order, before this job looks (as the scheduler's passes go: a job ahead
    that does not fit leaves the room to the jobs behind it), and gives it back after its run
    (never, when its run is ``inf``). 0 when it has room now, ``inf`` when the known releases never
    make enough."""
    per_worker = max(per_worker, 1)
    need = workers + math.ceil(max(ahead_gpus, 0) / per_worker)
    pool = snap.pool(cluster, model)
    schedulable = snap.schedulable[pool]
    free = np.where(schedulable, snap.free[pool], 0).astype(np.int64)
    if queue:
        return _wait_behind_queue(snap, (cluster, model), (free, schedulable), (need, per_worker), queue)
    room = int((free // per_worker).sum())
    if room >= need:
        return 0.0
    rel = releases(snap)
    p = cluster * snap.free_sum.shape[1] + model
    lo, hi = int(rel.start[p]), int(rel.start[p + 1])
    offset = pool.start
    for k in range(lo, hi):
        j = int(rel.node[k]) - offset
        if not schedulable[j]:
            continue
        before = int(free[j]) // per_worker
        free[j] = min(int(free[j]) + int(rel.gpus[k]), int(snap.total[offset + j]))
        room += int(free[j]) // per_worker - before
        if room >= need:
            return max(float(rel.at_s[k]) - snap.now, 0.0)
    return math.inf


def _serve(
    free: IntArray, pending: list[tuple[int, int, float]], at_s: float, ends: list[tuple[float, int, int]]
) -> list[tuple[int, int, float]]:
    """Give each pending job (workers, GPUs per worker, run), in order, its room in ``free`` where
    it fits whole (taken from ``free``; its nodes' GPUs pushed on the heap ``ends`` as releases at
    ``at_s`` + its run, when finite); the jobs still pending."""
    left: list[tuple[int, int, float]] = []
    for workers, each, run_s in pending:
        fits = free // each
        if int(fits.sum()) < workers:
            left.append((workers, each, run_s))
            continue
        take = np.minimum(fits, np.maximum(workers - (np.cumsum(fits) - fits), 0)) * each
        free -= take
        if math.isfinite(run_s):
            for node in np.flatnonzero(take).tolist():
                heapq.heappush(ends, (at_s + run_s, node, int(take[node])))
    return left


def _wait_behind_queue(
    snap: Snapshot,
    where: tuple[int, int],
    nodes: tuple[IntArray, BoolArray],
    gang: tuple[int, int],
    queue: Sequence[tuple[int, int, float]],
) -> float:
    """:func:`expected_wait_s` with queued jobs ahead served first at now and at each release:
    pool ``where`` (cluster, model), its ``nodes`` (free GPUs, schedulable), ``gang`` (workers
    needed, GPUs per worker)."""
    cluster, model = where
    free, schedulable = nodes
    need, per_worker = gang
    now = snap.now
    ends: list[tuple[float, int, int]] = []
    pending = _serve(free, [(max(w, 1), max(g, 1), r) for w, g, r in queue], now, ends)
    if int((free // per_worker).sum()) >= need:
        return 0.0
    pool = snap.pool(cluster, model)
    rel = releases(snap)
    p = cluster * snap.free_sum.shape[1] + model
    lo, hi = int(rel.start[p]), int(rel.start[p + 1])
    offset = pool.start
    events = ends
    events += [
        (max(float(rel.at_s[k]), now), int(rel.node[k]) - offset, int(rel.gpus[k]))
        for k in range(lo, hi)
        if schedulable[int(rel.node[k]) - offset]
    ]
    heapq.heapify(events)
    total = snap.total[pool]
    while events:
        at_s, j, gpus = heapq.heappop(events)
        free[j] = min(int(free[j]) + gpus, int(total[j]))
        if events and events[0][0] == at_s:
            continue  # releases at one instant are seen together
        if pending:
            pending = _serve(free, pending, at_s, events)
        if int((free // per_worker).sum()) >= need:
            return max(at_s - now, 0.0)
    return math.inf


_ALONE: "weakref.WeakKeyDictionary[Snapshot, dict[tuple[int, int], _AloneTable]]" = (
    weakref.WeakKeyDictionary()
)
"""Per snapshot and (workers, GPUs per worker): each pool's :func:`expected_wait_s` alone."""


@dataclass(slots=True)
class _AloneTable:
    """A job shape's wait alone in every pool, as of the releases, clock and pool versions held."""

    releases: Releases
    now: float
    versions: IntArray
    waits: FloatArray
    stamp: int = 0
    """Bumped whenever a wait changes: the per-job soonest waits read from it (``best``) hold while
    it stays."""
    best: dict[str, tuple[int, bytes, float]] = dataclasses.field(default_factory=dict)
    """Job id -> (stamp, its pools' bytes, its soonest wait over its pools)."""


def alone_waits(snap: Snapshot, workers: int, per_worker: int) -> tuple[FloatArray, _AloneTable]:
    """Each pool's :func:`expected_wait_s` for ``workers`` of ``per_worker`` GPUs, no one ahead, as a
    (cluster, model) array; kept per snapshot and recomputed only for the pools whose nodes changed
    (``Snapshot.pool_version``), all of them when the running jobs or the clock moved."""
    tables = _ALONE.get(snap)
    if tables is None:
        tables = _ALONE[snap] = {}
    rel = releases(snap)
    shape = snap.free_sum.shape
    table = tables.get((workers, per_worker))
    if table is None or table.releases is not rel or table.now != snap.now or table.waits.shape != shape:
        table = tables[(workers, per_worker)] = _AloneTable(
            rel, snap.now, snap.pool_version.copy(), np.full(shape, np.nan), stamp=0
        )
        stale = np.arange(snap.pool_version.size)
    else:
        stale = np.flatnonzero(table.versions != snap.pool_version)
    if stale.size:
        m_count = shape[1]
        for p in stale.tolist():
            c, m = divmod(p, m_count)
            table.waits[c, m] = expected_wait_s(snap, c, m, workers, per_worker)
        table.versions[stale] = snap.pool_version[stale]
        table.stamp += 1
    return table.waits, table


def _soonest_alone(snap: Snapshot, shape: QueuedShape) -> tuple[FloatArray, float]:
    """``shape``'s wait alone per pool and the soonest over the pools its rules allow."""
    waits, table = alone_waits(snap, shape.workers, max(shape.per_worker, 1))
    pools = shape.pools
    if pools.shape != waits.shape:
        return waits, math.inf
    held = table.best.get(shape.job_id)
    raw = pools.tobytes()
    if held is not None and held[0] == table.stamp and held[1] == raw:
        return waits, held[2]
    best = float(waits[pools].min()) if pools.any() else math.inf
    table.best[shape.job_id] = (table.stamp, raw, best)
    return waits, best


@dataclass(slots=True)
class _SoleTable:
    """Per snapshot: the queued jobs that have each pool as their only one."""

    key: tuple[object, ...]
    jobs_of: dict[int, list[str]]
    """The flat index of a pool -> the ids of the queued jobs whose only pool it is."""


_SOLE: "weakref.WeakKeyDictionary[Snapshot, _SoleTable]" = weakref.WeakKeyDictionary()


def _sole_table(snap: Snapshot) -> _SoleTable:
    """:class:`_SoleTable` of ``snap``, rebuilt when the queued shapes, the clock, the releases or
    the pools changed (shapes of one (workers, GPUs per worker, allowed pools) are judged once).
    Which of those jobs still wait, and which are probes, is read when asked."""
    rel = releases(snap)
    key = (snap.queued.version, snap.now, id(rel), snap.pool_version.tobytes())
    table = _SOLE.get(snap)
    if table is not None and table.key == key:
        return table
    jobs_of: dict[int, list[str]] = {}
    judged: dict[tuple[int, int, bytes], int] = {}
    for shape in snap.queued.values():
        if shape.pools.shape != snap.free_sum.shape:
            continue
        group = (shape.workers, shape.per_worker, shape.pools.tobytes())
        sole = judged.get(group)
        if sole is None:
            waits, _ = _soonest_alone(snap, shape)
            usable = np.flatnonzero(np.isfinite(waits) & shape.pools)
            sole = judged[group] = int(usable[0]) if usable.size == 1 else -1
        if sole >= 0:
            jobs_of.setdefault(sole, []).append(shape.job_id)
    table = _SOLE[snap] = _SoleTable(key, jobs_of)
    return table


def sole_pool_of_queued(snap: Snapshot, cluster: int, model: int, *, exclude: str = "") -> bool:
    """Whether some job still queued (``Snapshot.queued`` and ``waiting``; not a speed probe; other
    than ``exclude``) has pool (``cluster``, ``model``) as the only pool its rules allow where the
    known releases ever make room for it (:func:`expected_wait_s` alone finite there and nowhere
    else; a pool held by jobs with no predicted end reads as never, so such a job may have another
    pool in fact). Kept per snapshot (:class:`_SoleTable`)."""
    flat = cluster * snap.free_sum.shape[1] + model
    # As the queue is read elsewhere: only jobs still waiting (a shape may outlive its job), no
    # speed probes (one waits for the one GPU model it measures, by design).
    return any(
        job_id != exclude and job_id in snap.waiting and job_id not in snap.probes
        for job_id in _sole_table(snap).jobs_of.get(flat, ())
    )


def queue_for_pool(
    snap: Snapshot, ahead: Sequence[QueuedShape], cluster: int, model: int
) -> list[tuple[int, int, float]]:
    """Of the queued jobs ``ahead`` (in queue order), the ones pool (``cluster``, ``model``) would
    serve: their rules allow it and no other pool they may use is expected to have room for them
    sooner (:func:`expected_wait_s`, each alone; a queued job takes the first room it fits, so one
    with room due elsewhere first does not take this pool's releases); each as (workers, GPUs per
    worker, its run there: work over the job's speed on the model times the cluster's trust, ``inf``
    when not known), for ``expected_wait_s(queue=...)``. The waits alone are kept per snapshot
    (:func:`alone_waits`): they do not hang on the job being decided."""
    served: list[tuple[int, int, float]] = []
    model_name = snap.models[model]
    for shape in ahead:
        if shape.pools.shape != snap.free_sum.shape or not shape.pools[cluster, model]:
            continue
        waits, soonest = _soonest_alone(snap, shape)
        here = float(waits[cluster, model])
        if not math.isfinite(here):
            continue  # never room here for it: it takes none of this pool's releases
        if here > 0.0 and soonest < here:
            continue  # room sooner in another pool it may use
        run_s = math.inf
        if shape.job is not None and math.isfinite(shape.work_s):
            speed = snap.job_gpu_speed(shape.job, model_name) * float(snap.trust[cluster])
            run_s = shape.work_s / speed if speed > 0 else math.inf
        served.append((shape.workers, shape.per_worker, run_s))
    return served


def room_at_s(snap: Snapshot, cluster: int, model: int, at_s: float, per_worker: int = 1) -> int:
    """Workers of ``per_worker`` GPUs pool (``cluster``, ``model``)'s schedulable nodes will have
    room for at ``at_s`` (the snapshot's clock): free now plus every known release by then."""
    per_worker = max(per_worker, 1)
    pool = snap.pool(cluster, model)
    schedulable = snap.schedulable[pool]
    free = np.where(schedulable, snap.free[pool], 0).astype(np.int64)
    rel = releases(snap)
    p = cluster * snap.free_sum.shape[1] + model
    lo, hi = int(rel.start[p]), int(rel.start[p + 1])
    due = lo + int(np.searchsorted(rel.at_s[lo:hi], at_s, side="right"))
    if due > lo:
        nodes = rel.node[lo:due] - pool.start
        np.add.at(free, nodes, rel.gpus[lo:due])
        free = np.minimum(free, snap.total[pool])
        free = np.where(schedulable, free, 0)
    return int((free // per_worker).sum())


@dataclass(frozen=True, slots=True)
class Reservation:
    """A waiting job's claim on the pool it waits for, from when it is expected to have room there."""

    job_id: str
    priority: int
    submitted_at: float
    cluster: str
    gpu_model: str
    workers: int
    per_worker: int
    start_s: float
    """When the pool is expected to have room for it (the snapshot's clock)."""
    expires_s: float
    """Dropped after this unless renewed (the job was decided again and still waits)."""
    run_s: float = math.inf
    """Its predicted run there once started (with its dataset's copy): how long it holds the GPUs
    it claims (``inf``: not known)."""

    @property
    def gpus(self) -> int:
        """GPUs the job needs there."""
        return self.workers * self.per_worker

    def ahead_of(self, priority: int, submitted_at: float | None, job_id: str) -> bool:
        """Whether the reserving job comes before a job of this priority and submission time in
        the queue (higher priority, or equal and submitted earlier, or at the same time with a
        smaller job id: of two jobs, one comes first; not the job itself)."""
        if job_id == self.job_id:
            return False
        if self.priority != priority:
            return self.priority > priority
        if submitted_at is None:
            return True
        return (self.submitted_at, self.job_id) < (submitted_at, job_id)


MIN_RESERVATION_S = 600.0
"""A reservation lives at least this long past its expected start unless renewed or used."""


class WaitBook:
    """Which jobs wait for which pool: one :class:`Reservation` per waiting job (a new claim of a job
    replaces its old one). Shared by the plugins that decide to wait (the span guard, the backfill
    post-filter), which read the GPUs claimed ahead of a job on a pool as part of its wait, and by
    the one that keeps each pool for the first job in queue order waiting for it (backfill). Pure:
    no I/O, no clock but the snapshot's."""

    def __init__(self) -> None:
        self.claims: dict[str, Reservation] = {}
        self._soonest = math.inf
        """No claim expires before this (a claim renewed or dropped since may leave it early):
        :meth:`expire`, run on every decision, looks at the claims only once it has passed."""

    def placed(self, job_id: str) -> Reservation | None:
        """The job was placed: its claim (now given up), or None. (Which jobs wait at all is the
        snapshot's queue, ``Snapshot.waiting``.)"""
        return self.drop(job_id)

    def reserve(self, reservation: Reservation) -> None:
        """Record (or renew) a job's claim."""
        self.claims[reservation.job_id] = reservation
        self._soonest = min(self._soonest, reservation.expires_s)

    def drop(self, job_id: str) -> Reservation | None:
        """Forget a job's claim (it was placed, or gave up); the claim, or None."""
        return self.claims.pop(job_id, None)

    def expire(self, now: float) -> None:
        """Forget claims not renewed in time (their job left the queue, or is decided no more)."""
        if not now > self._soonest:
            return
        stale = [job_id for job_id, held in self.claims.items() if held.expires_s < now]
        for job_id in stale:
            del self.claims[job_id]
        self._soonest = min((held.expires_s for held in self.claims.values()), default=math.inf)

    def ahead(self, priority: int, submitted_at: float | None, job_id: str) -> list[Reservation]:
        """Claims of jobs ahead of this one in queue order."""
        return [r for r in self.claims.values() if r.ahead_of(priority, submitted_at, job_id)]

    def first_ahead(self, priority: int, submitted_at: float | None, job_id: str) -> list[Reservation]:
        """Per pool, the claim first in queue order, where it is ahead of this job (EASY backfilling
        keeps a pool for that one only)."""
        first: dict[tuple[str, str], Reservation] = {}
        for r in self.ahead(priority, submitted_at, job_id):
            key = (r.cluster, r.gpu_model)
            held = first.get(key)
            if held is None or r.ahead_of(held.priority, held.submitted_at, held.job_id):
                first[key] = r
        return list(first.values())

    def __len__(self) -> int:
        return len(self.claims)
