"""Rare fit: keep the last node with room for a shape only few nodes hold, when that pays.

Packing (:mod:`loom.sched.plugins.packing`) keeps whole the GPUs big gangs need; it does not see a
node's CPU and RAM. On Alibaba's GPU trace (``openb_pod_list_default.csv``, the trace of "Beware of
Fragmentation", Weng et al., ATC 2023) workers asking 120 cores and 720 GiB fit only the two
128-core nodes of the 506-GPU platform; Loom put 88-core workers there for their faster GPUs, and
each 120-core worker arriving after waited for one of them for days, on a platform 4 % busy
(``docs/measurements.md``, 2026-12-05).

A shape ``s`` is *rare* for a job when at most :data:`RARE_SHARE` of the nodes that could ever hold
one of the job's workers could ever hold one of ``s`` (so an 8-GPU worker is not rare beside a
one-GPU one on platforms of 8-GPU nodes; node fit keeps those). Shapes are the ones recently seen
(:class:`~loom.sched.snapshot.SeenShapes`: the latest jobs, in the placement service and the
simulator alike), each with its arrival rate ``λ`` (its first sight not counted: a shape seen once
is not known to come again) over the span ``H`` remembered.

Whether keeping room pays is a trade in job-seconds. For each rare shape, ``A`` is how soon a node
could hold one of its workers (0 when one has room now; else when every job on such a node has
ended, by their predicted ends). A candidate whose workers would take that room, or hold it past
``A``, moves it to ``A'`` (its predicted run ``T`` on the nodes it takes, as the framework packs
them); jobs of ``s`` arriving ``t`` seconds from now, within ``H``, wait ``max(A' − t, 0)`` instead
of ``max(A − t, 0)``: the harm, ``λ·∫(…)dt``. Sent to the fastest candidate that harms nothing, the
job itself runs ``T_alt − T`` longer (:func:`~loom.sched.plugins.network.believed_jct_s`). A
candidate is marked when its harm exceeds that loss and ``T_alt`` is at most
:data:`RARE_MAX_SLOWDOWN` ``x T``; marked candidates score 0, the others 100 (weight
:data:`RARE_FIT_WEIGHT`: the mark decides between them). Nothing is marked when every candidate
harms; then the permit weighs a *wait* instead: for the pool with no node of the shape's that
would end the job soonest (its expected room, :func:`~loom.sched.availability.expected_wait_s`,
plus its run there), the job waits when that ends less than the harm later than starting now, and
only while it has waited less than the harm (ski rental). Without it, keeping a node by filling the
others handed it, at saturation, to whichever job then found it the only room.

**Hold** (the filter, :func:`kept_for_queued`): the marking above counts the arrivals of a shape,
not the jobs of it already queued, and weighs only candidates within :data:`RARE_MAX_SLOWDOWN`.
Where every other place was far slower for the small jobs, one small job after another, none
ending with the next, kept the only node an 8-GPU worker fits from ever being whole while the
8-GPU jobs queued (an outside evaluator: one 8 x H100 node among 120 old GPUs, Loom's mean JCT
22.7 % behind gavel_like's; ``docs/measurements.md``, 2026-12-07). So a node of a rare shape's
holder class, in the pools queued jobs of that shape may use, where one of this job's workers has
room now, is kept from this job when the wait its run there adds to the jobs of the shape exceeds
what the job loses by running where it harms no one now (its fastest run in a pool it may use with
room for it now and none of those nodes, less ``T``). The wait added (:func:`_delays`): the node
frees ``max(T - (A - now), 0)`` later (``A``: now when it has room for the shape now, else its last
predicted end), and the shape's jobs are served in turn on its nodes as they free
(:func:`_waits`): the ``Q`` queued now, then those foreseen at its arrival rate, no more than were
seen; an arrival that finds a node free waits nothing, so the count ends with the queue. Each takes
the nodes that end it soonest, by the queued jobs' run on each (a free node far slower for them is
not room they would take); a job foreseen is one of the last seen again, its run the queued jobs'
scaled by its work over theirs. A node
that still holds the shape beside one of the job's workers is never kept, and a job of the rare
shape itself is not kept (which of those goes first is the queue's order).

Approximations, stated: the marking serves arrivals of ``s`` one at a time (they do not queue
behind each other); a node holds ``s`` again only when every job on it has ended; the hold reads
the job's runs from its work and the GPUs' speed and trust alone (no communication, no dataset),
judges "room now" for the alternative by a pool's free GPUs, and serves the queued jobs of a shape
on all the nodes any of them may use (not each on its own pools), each for their mean run on a node
and their mean width, a node of room for several of their workers as one.
"""

import hashlib
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from loom.sched.allowed import cluster_allowed
from loom.sched.availability import releases
from loom.sched.framework import (
    SUCCESS,
    Candidates,
    Code,
    CycleState,
    Decision,
    Framework,
    StateKey,
    Status,
    pack_workers,
)
from loom.sched.plugins.network import MIN_WAIT_S, believed_jct_s, single_cluster_options, whole_gang_pools
from loom.sched.probe import is_probe
from loom.sched.snapshot import BoolArray, FloatArray, IntArray, RunningJob, Snapshot, WorkerShape
from loom_proto.jobs import JobSpec

RARE_SHARE = 0.25
"""A shape is rare for a job when at most this share of the nodes that could ever hold one of the
job's workers could ever hold one of the shape's."""
RARE_MAX_SLOWDOWN = 2.0
"""The most a job's predicted run may grow (as a factor) for the room it keeps."""
RARE_FIT_WEIGHT = 20.0
"""The profile weight: as much as the other scores together, so that a marked candidate loses to
the best one that spends nothing (measured: ``tests/unit/test_rare_fit.py``)."""

_RARE: StateKey[list["RareShape"]] = StateKey("rare_fit.shapes")
_KEPT: StateKey[IntArray | None] = StateKey("rare_fit.kept_nodes")
_QUEUED_TABLE = "rare_fit.queued"


@dataclass(frozen=True, slots=True)
class Verdict:
    """What a keeping score (``rare_fit``, ``gang_fit``) found for the job's candidates: the harm
    each does to the jobs room is kept for and the job's predicted run there, for its permit."""

    cluster: IntArray
    model: IntArray
    harm: FloatArray
    jct: FloatArray

    def chosen(self, state: CycleState, decision: Decision) -> tuple[float, float, float] | None:
        """(harm, run, waited) of the decision's one pool when it still harms and the job has
        waited less than that harm (by :data:`MIN_WAIT_S`); None when there is nothing to weigh (a
        spread, a pool not scored, no harm, an unknown run, a harm waited out)."""
        if len(decision.parts) != 1:
            return None
        snap = state.snapshot
        part = decision.parts[0]
        c, m = snap.cluster_index.get(part.cluster), snap.model_index.get(part.gpu_model)
        at = np.flatnonzero((self.cluster == c) & (self.model == m))
        if c is None or m is None or not at.size:
            return None
        i = int(at[0])
        harm, run = float(self.harm[i]), float(self.jct[i])
        waited = 0.0 if state.submitted_at is None else max(snap.now - state.submitted_at, 0.0)
        if not harm > 0 or not math.isfinite(run) or harm - waited < MIN_WAIT_S:
            return None
        return harm, run, waited


_VERDICT: StateKey[Verdict | None] = StateKey("rare_fit.verdict")


def holds(snap: Snapshot, shape: WorkerShape) -> BoolArray:
    """Per node: whether it is schedulable and could ever hold one worker of ``shape`` (by what it
    has in all; a node that does not report CPU or RAM is not checked on it, as ``resource_fit``
    does). Whether it has room now is :meth:`Snapshot.room`'s."""
    ok = snap.schedulable & (snap.total >= shape.gpus)
    if shape.cpu_milli:
        ok = ok & (~snap.cpu_known | (snap.cpu_cap >= shape.cpu_milli))
    if shape.memory_mib:
        ok = ok & (~snap.mem_known | (snap.mem_cap >= shape.memory_mib))
    return ok


@dataclass(frozen=True, slots=True)
class RareShape:
    """Seen shapes held by the same nodes, as one: the most each of them asks of every resource, how
    many jobs of them were seen, and how many nodes could ever hold one."""

    shape: WorkerShape
    count: int
    holders: int
    nodes: IntArray = field(default_factory=lambda: np.zeros(0, np.int64), compare=False, repr=False)
    """The nodes that could ever hold one of them (schedulable)."""
    key: bytes = field(default=b"", compare=False, repr=False)
    """The holder class (which nodes could ever hold one: :func:`_holder_class`)."""
    works: tuple[float, ...] = field(default=(), compare=False, repr=False)
    """The work of the jobs of them seen whose work is known, oldest first (``SeenShapes.works``)."""


_HOLDERS = "rare_fit.holders"
_RARE_FOR = "rare_fit.rare"


def _holder_class(snap: Snapshot, shape: WorkerShape) -> tuple[bytes, int]:
    """Which schedulable nodes could ever hold one worker of ``shape`` (a digest of the mask: shapes
    held by the same nodes are one class, so 120 and 120.2 cores count together) and how many;
    kept on the snapshot per shape while no node's schedulability changes, and only for shapes
    still seen (``snap.seen``) once the table outgrows them."""
    table: dict[WorkerShape, tuple[int, bytes, int]] = snap.kept.setdefault(_HOLDERS, {})
    version = snap.schedulable_version
    held = table.get(shape)
    if held is not None and held[0] == version:
        return held[1], held[2]
    mask = holds(snap, shape)
    key, count = hashlib.blake2b(mask.tobytes(), digest_size=16).digest(), int(np.count_nonzero(mask))
    if len(table) > 2 * len(snap.seen.counts) + 64:
        for gone in [s for s in table if s not in snap.seen.counts]:
            del table[gone]
    table[shape] = (version, key, count)
    return key, count


def rare_shapes(snap: Snapshot, own: WorkerShape) -> list[RareShape]:
    """The shapes seen lately (``snap.seen``) that are rare for a job of worker shape ``own``,
    grouped by the nodes that hold them, each group seen at least twice (a shape seen once is not
    known to come again: one 120-core task among 200 of Alibaba's 2023 trace kept one-GPU tasks of
    weeks off the only nodes that held it, for no one). Kept on the snapshot per ``own`` until the
    shapes seen or the nodes' schedulability change (a cycle over a long queue asks once a shape)."""
    counts = snap.seen.counts
    if not counts or (len(counts) == 1 and own in counts):
        return []
    cache: dict[WorkerShape, tuple[object, tuple[int, int], list[RareShape]]] = snap.kept.setdefault(
        _RARE_FOR, {}
    )
    stamp = (snap.seen.version, snap.schedulable_version)
    held = cache.get(own)
    if held is not None and held[0] is snap.seen and held[1] == stamp:  # a new leader's is another
        return held[2]
    if len(cache) > 2 * len(counts) + 64:
        cache.clear()
    own_key, mine = _holder_class(snap, own)
    groups: dict[bytes, tuple[list[int], WorkerShape, set[WorkerShape]]] = {}
    for shape, count in counts.items():
        key, holders = _holder_class(snap, shape)
        if key == own_key or holders == 0 or holders > RARE_SHARE * mine:
            continue
        group = groups.get(key)
        if group is None:
            groups[key] = ([count, shape.gpus, shape.cpu_milli, shape.memory_mib, holders], shape, {shape})
        else:
            most = group[0]
            most[0] += count
            most[1] = max(most[1], shape.gpus)
            most[2] = max(most[2], shape.cpu_milli)
            most[3] = max(most[3], shape.memory_mib)
            group[2].add(shape)
    found = [
        RareShape(
            WorkerShape(gpus, cpu, mem),
            count,
            holders,
            np.flatnonzero(holds(snap, first)),
            key,
            tuple(snap.seen.works(shapes)),
        )
        for key, ((count, gpus, cpu, mem, holders), first, shapes) in groups.items()
        if count >= 2
    ]
    cache[own] = (snap.seen, stamp, found)
    return found


def _queued_classes(snap: Snapshot) -> dict[bytes, list[tuple[str, IntArray]]]:
    """The queued jobs by the holder class of their worker shape (:func:`_holder_class`): for each,
    its id and the nodes of that class in the pools its rules allow. Kept on the snapshot until
    the queue's shapes (``Snapshot.queued``'s version) or the nodes' schedulability change; each
    job's entry is kept as long as its shape and pools are (a queue changes one job at a time).
    Which of them still wait is read when asked."""
    stamp = (snap.queued.version, snap.schedulable_version)
    held = snap.kept.get(_QUEUED_TABLE)
    if held is not None and held[0] == stamp:
        table: dict[bytes, list[tuple[str, IntArray]]] = held[1]
        return table
    entries: dict[str, tuple[int, bytes, bytes, IntArray]] = held[2] if held is not None else {}
    fresh: dict[str, tuple[int, bytes, bytes, IntArray]] = {}
    table = {}
    shape_of = snap.free_sum.shape
    for job_id, q in snap.queued.items():
        job = q.job
        if not isinstance(job, JobSpec) or q.pools.shape != shape_of:
            continue
        pools = q.pools.tobytes()
        entry = entries.get(job_id)
        if entry is None or entry[0] != snap.schedulable_version or entry[1] != pools:
            shape = WorkerShape.of(job)
            key, count = _holder_class(snap, shape)
            if not count:
                continue
            nodes = np.flatnonzero(holds(snap, shape))
            nodes = nodes[q.pools[snap.cluster_of[nodes], snap.model_of[nodes]]]
            entry = (snap.schedulable_version, pools, key, nodes)
        fresh[job_id] = entry
        if entry[3].size:
            table.setdefault(entry[2], []).append((job_id, entry[3]))
    snap.kept[_QUEUED_TABLE] = (stamp, table, fresh)
    return table


def kept_for_queued(state: CycleState, rare: Sequence["RareShape"]) -> IntArray:
    """The nodes kept from this job for the queued jobs of a worker shape rare for it, in job-seconds:
    a node of the shape's holder class, in the pools such queued jobs may use (speed probes aside),
    where one of this job's workers has room now, is kept when the wait the job's run ``T`` there
    adds to the shape's jobs (:func:`_delays`: the node frees ``max(T - (A - now), 0)`` later, ``A``
    now when it has room for the shape now, else its last predicted end; the jobs queued and those
    foreseen served in turn on the nodes as they free) exceeds what the job loses by running where
    it harms no one now (its fastest run in a pool it may use with room for it now and no such
    node, less ``T``; nothing is kept when there is none). A node that still holds the shape beside
    one of the job's workers is never kept. Empty when no such job waits."""
    snap, job = state.snapshot, state.job
    none = np.zeros(0, dtype=np.int64)
    if not snap.waiting_count(exclude=job.job_id):
        return none
    own = WorkerShape.of(job)
    harm: dict[int, float] = {}
    run_of: dict[int, float] = {}
    work_s = float(job.work.steps) * float(job.work.step_time_s)
    speeds: FloatArray | None = None
    ends: FloatArray | None = None
    horizon = snap.seen.span_s(snap.now)
    for group in rare:
        entries = _waiting_entries(snap, group, exclude=job.job_id)
        if not entries:
            continue
        nodes = np.unique(np.concatenate([mine for _, mine in entries]))
        shape = group.shape
        # Room for the shape now (the node frees now), and still beside one of this job's workers:
        # taking such a node delays no one.
        room_now = snap.schedulable[nodes] & (
            snap.room(nodes, shape.gpus, shape.cpu_milli, shape.memory_mib) > 0
        )
        beside = room_now.copy()
        if beside.any():
            left = np.array(
                [_left_holds(snap, int(n), shape, 1, own) for n in nodes[beside].tolist()], dtype=np.bool_
            )
            beside[np.flatnonzero(beside)[~left]] = False
        # Only where one of this job's workers has room now can it delay anyone.
        lands = snap.schedulable[nodes] & (snap.room(nodes, own.gpus, own.cpu_milli, own.memory_mib) > 0)
        if not (lands & ~beside).any():
            continue
        queued_runs = _shape_run(snap, entries, nodes)
        if queued_runs is None:
            continue  # none of them can run on these nodes: no wait for them to add to
        if ends is None:
            ends = node_ends(snap)
            speeds = snap.believed_speeds(job)
        frees = np.where(
            room_now,
            0.0,
            np.where(_never_frees(snap, ends, nodes), math.inf, np.maximum(ends[nodes] - snap.now, 0.0)),
        )
        assert speeds is not None
        speed = speeds[snap.model_of[nodes]] * snap.trust[snap.cluster_of[nodes]]
        run_s = np.where(speed > 0, work_s / np.maximum(speed, 1e-12), math.inf)
        # A busy node none of whose jobs has a predicted end never frees in this count: no harm
        # there (its room for the shape is not expected, whatever this job does).
        never = ~np.isfinite(frees) | ~np.isfinite(run_s) | beside | ~lands
        later = np.where(never, 0.0, np.maximum(run_s - frees, 0.0))
        turns = Turns(
            len(entries),
            float(queued_runs.per_node.min()),
            arrival_rate(group.count, horizon),
            group.count - 1,
            queued_runs.workers,
            _foreseen_sizes(group, group.count - 1, queued_runs.work_s),
        )
        delays = _delays(frees, later, turns, queued_runs.per_node)
        for n, delay, run in zip(nodes.tolist(), delays.tolist(), run_s.tolist(), strict=True):
            if delay > 0:
                harm[n] = harm.get(n, 0.0) + delay
                run_of[n] = run
    if not harm:
        return none
    assert speeds is not None
    alt = _run_elsewhere_s(state, np.fromiter(harm, np.int64, len(harm)), speeds, work_s)
    if not math.isfinite(alt):
        return none
    kept = [n for n in harm if harm[n] > alt - run_of[n]]
    return np.array(sorted(kept), dtype=np.int64) if kept else none


def _run_elsewhere_s(state: CycleState, held: IntArray, speeds: FloatArray, work_s: float) -> float:
    """The job's fastest run where it harms no one now: a pool its rules allow with room now for
    its workers, whole on its nodes, and none of the ``held`` nodes; ``inf`` when there is none."""
    snap, own = state.snapshot, WorkerShape.of(state.job)
    pools = state.allowed_pools() & (snap.free_sum >= state.min_workers * state.per_worker)
    pools[snap.cluster_of[held], snap.model_of[held]] = False
    best = math.inf
    for c, m in zip(*np.nonzero(pools), strict=True):
        nodes, _ = snap.node_slice(int(c), int(m))
        nodes = nodes[snap.schedulable[nodes]]
        if int(snap.room(nodes, own.gpus, own.cpu_milli, own.memory_mib).sum()) < state.min_workers:
            continue
        speed = float(speeds[m] * snap.trust[c])
        if speed > 0:
            best = min(best, work_s / speed)
    return best


def _waiting_entries(snap: Snapshot, group: "RareShape", exclude: str = "") -> list[tuple[str, IntArray]]:
    """Per queued job of ``group``'s holder class still waiting (not a speed probe, not
    ``exclude``): its id and the nodes of that class in the pools it may use
    (:func:`_queued_classes`)."""
    waiting, probes = snap.waiting, snap.probes
    return [
        (job_id, nodes)
        for job_id, nodes in _queued_classes(snap).get(group.key, ())
        if job_id != exclude and job_id in waiting and job_id not in probes
    ]


SERVED_SAMPLE = 256
"""The most queued jobs, and the most foreseen, :func:`_waits` serves one by one (more queued are
counted in proportion)."""
RUN_SAMPLE = 16
"""How many of a rare shape's queued jobs give its runs per node and workers (:func:`_shape_run`)."""


def _never_frees(snap: Snapshot, ends: FloatArray, nodes: IntArray) -> BoolArray:
    """Busy nodes none of whose jobs has a predicted end."""
    never: BoolArray = np.isneginf(ends[nodes]) & (snap.free[nodes] < snap.total[nodes])
    return never


class QueuedRuns(NamedTuple):
    """A rare shape's queued jobs as :func:`_waits` serves them (:func:`_shape_run`)."""

    workers: int
    """Their mean workers (rounded)."""
    per_node: FloatArray
    """Per node, their mean run there (``inf`` where none of them has a speed)."""
    work_s: float
    """Their mean work (steps x reference step time)."""


def _shape_run(snap: Snapshot, entries: Sequence[tuple[str, IntArray]], nodes: IntArray) -> QueuedRuns | None:
    """A rare shape's queued jobs (``entries``: :func:`_waiting_entries`, the first
    :data:`RUN_SAMPLE`) on ``nodes``; None when none of them can run there. A node's run is the mean
    over the sampled jobs that may use it (a node only a short one may use looks fast for all), or
    over all sampled where none may (only a job past the sample may: it is served there all the
    same); ``inf`` where no sampled job has a speed there."""
    works: list[float] = []
    workers: list[int] = []
    total = np.zeros(nodes.size, dtype=np.float64)
    users = np.zeros(nodes.size, dtype=np.int64)
    anyone = np.zeros(nodes.size, dtype=np.float64)
    timed = np.zeros(nodes.size, dtype=np.int64)
    for job_id, mine in entries[:RUN_SAMPLE]:
        q = snap.queued.get(job_id)
        job = q.job if q is not None else None
        if not isinstance(job, JobSpec) or not mine.size:
            continue
        speed = snap.believed_speeds(job)[snap.model_of[nodes]] * snap.trust[snap.cluster_of[nodes]]
        usable = np.isin(nodes, mine) & (speed > 0)
        if not usable.any():
            continue
        work = float(job.work.steps) * float(job.work.step_time_s)
        works.append(work)
        workers.append(max(job.workers, 1))
        total[usable] += work / speed[usable]
        users[usable] += 1
        fast = speed > 0
        anyone[fast] += work / speed[fast]
        timed[fast] += 1
    if not works:
        return None
    per_node = np.where(
        users > 0,
        total / np.maximum(users, 1),
        np.where(timed > 0, anyone / np.maximum(timed, 1), math.inf),
    )
    return QueuedRuns(max(round(sum(workers) / len(works)), 1), per_node, sum(works) / len(works))


def _foreseen_sizes(group: RareShape, foreseen: int, queued_work_s: float) -> tuple[float, ...]:
    """The runs of ``group``'s jobs still to come as multiples of the queued ones' (sampled): the
    last ``foreseen`` of those seen, again, in the order they came (none when the work of either is
    not known). The queued jobs give how the runs spread over the nodes, those seen the sizes: one
    long job queued taken for every arrival of a burst of short ones kept 1-GPU jobs of 3 h off an
    H100 that the 8-GPU jobs to come would take for minutes (an outside evaluator's `bigtiny`,
    bursts, load 1.5), and a mean work, its heavy tail, did likewise."""
    works = group.works[-foreseen:] if foreseen > 0 else ()
    if not works or not (math.isfinite(queued_work_s) and queued_work_s > 0):
        return ()
    sizes = tuple(work / queued_work_s for work in works)
    return sizes if all(math.isfinite(size) for size in sizes) else ()


@dataclass(frozen=True, slots=True)
class Turns:
    """A rare shape's jobs served in turn on its nodes (:func:`_waits`): ``queued`` now, each
    ``workers`` nodes at once for ``run_s``, then ``foreseen`` more arriving ``1 / rate`` seconds
    apart (none when ``rate`` is 0)."""

    queued: int
    run_s: float
    rate: float = 0.0
    foreseen: int = 0
    workers: int = 1
    foreseen_sizes: tuple[float, ...] = ()
    """The runs of the jobs foreseen, in turn, as multiples of a queued one's (:func:`_foreseen_sizes`;
    none: alike)."""

    def jobs(self) -> int:
        """How many jobs :func:`_waits` serves one by one."""
        return min(self.queued, SERVED_SAMPLE) + (min(self.foreseen, SERVED_SAMPLE) if self.rate > 0 else 0)


def _waits(frees: FloatArray, turns: Turns, runs: FloatArray | None = None) -> tuple[float, FloatArray]:
    """``turns``' jobs served in turn, each taking the ``workers`` nodes that free first (``frees``:
    seconds from now, ``inf`` never) and starting when the last of them frees (an arrival not
    before it comes: one that finds nodes free waits nothing, so the count ends with the queue).
    With ``runs`` (per node, the jobs' run there) the nodes are not alike: a job takes the
    ``workers`` nodes of one run that end it soonest, and what it loses is its wait plus its run
    beyond the fastest nodes' (a queued 8-GPU job does not take a T4 node that frees now for a run
    17x its H100 run an hour away; counted as alike, free T4 nodes made every wait for the H100
    nothing). Their losses in all, in seconds (beyond :data:`SERVED_SAMPLE` queued, the first
    served and counted in proportion), and how many each node serves."""
    served = np.zeros(frees.size, dtype=np.float64)
    width = turns.workers
    if runs is None:
        runs = np.full(frees.size, turns.run_s)
    heaps: dict[float, list[tuple[float, int]]] = {}
    for i, (f, r) in enumerate(zip(frees.tolist(), runs.tolist(), strict=True)):
        if math.isfinite(f) and math.isfinite(r):
            heaps.setdefault(r, []).append((f, i))
    heaps = {r: heap for r, heap in heaps.items() if len(heap) >= width}
    if not heaps:
        return math.inf, served
    fastest = min(heaps)
    for heap in heaps.values():
        heapq.heapify(heap)
    placed = min(turns.queued, SERVED_SAMPLE)
    scale = turns.queued / placed if placed else 0.0
    arrivals = [0.0] * placed
    if turns.rate > 0:
        arrivals += [k / turns.rate for k in range(1, min(turns.foreseen, SERVED_SAMPLE) + 1)]
    total = 0.0
    sizes = turns.foreseen_sizes
    ready = {run_s: _gang_ready(heap, width) for run_s, heap in heaps.items()}
    for n, arrives in enumerate(arrivals):
        size = 1.0 if n < placed or not sizes else sizes[(n - placed) % len(sizes)]
        run_s = _soonest_end(ready, arrives, size)
        if run_s is None:
            return math.inf, served
        heap = heaps[run_s]
        taken = [heapq.heappop(heap) for _ in range(width)]
        start = max(taken[-1][0], arrives)
        weight = scale if n < placed else 1.0
        total += (start - arrives + (run_s - fastest) * size) * weight
        for _, i in taken:
            served[i] += weight
            heapq.heappush(heap, (start + run_s * size, i))
        ready[run_s] = _gang_ready(heap, width)
    return total, served


def _gang_ready(heap: list[tuple[float, int]], width: int) -> float:
    """When the ``width`` nodes of a run's heap that free first have all freed (the heap unchanged)."""
    if width == 1:
        return heap[0][0]
    first = [heapq.heappop(heap) for _ in range(width)]
    for item in first:
        heapq.heappush(heap, item)
    return first[-1][0]


def _soonest_end(ready: dict[float, float], arrives: float, size: float) -> float | None:
    """The run of the nodes that end a job arriving at ``arrives``, whose run is ``size`` x a node's,
    soonest (``ready``: per run, when a gang's nodes of it have freed); on a tie the slower run (the
    faster nodes are left for the next, and the choice is the same whatever the nodes' order).
    None when none ends it."""
    best_run, best_end = None, math.inf
    for run_s, free_at in ready.items():
        end = max(free_at, arrives) + run_s * size
        if end < best_end or (end == best_end and best_run is not None and run_s > best_run):
            best_run, best_end = run_s, end
    return best_run


def _delays(frees: FloatArray, later: FloatArray, turns: Turns, runs: FloatArray | None = None) -> FloatArray:
    """Per node with ``later`` > 0, how much longer in all ``turns``' jobs wait (:func:`_waits`)
    when that node frees ``later`` seconds after it would: the queued ones and those foreseen while
    the queue empties, served in turn on the nodes as they free (an outside evaluator's 8-GPU
    trains, whose own arrivals took 83 % of their only node, waited 5.5 h each while 4-GPU jobs took
    its halves, each weighed against the trains queued at the time alone). Only a node that serves
    one of them can delay them; a delay there may move them to other nodes (the schedule is served
    again). Only the nodes that free first can serve any: the schedule runs on those."""
    out = np.zeros(frees.size, dtype=np.float64)
    if runs is None:
        runs = np.full(frees.size, turns.run_s)
    keep = _first_to_free(frees, runs, turns.jobs() * turns.workers + 1)  # a delayed node: one more
    near, near_later, near_runs = frees[keep], later[keep], runs[keep]
    base, served = _waits(near, turns, near_runs)
    if not math.isfinite(base):
        return out
    for i in np.flatnonzero((served > 0) & (near_later > 0)).tolist():
        moved = near.copy()
        moved[i] += near_later[i]
        out[keep[i]] = max(_waits(moved, turns, near_runs)[0] - base, 0.0)
    return out


def _first_to_free(frees: FloatArray, runs: FloatArray, count: int) -> IntArray:
    """The ``count`` nodes that free first among the nodes of each run (the only ones a schedule in
    turn can reach: a job takes the soonest of a run before any later one), by when they free."""
    ok = np.flatnonzero(np.isfinite(frees) & np.isfinite(runs))
    order = ok[np.lexsort((frees[ok], runs[ok]))]
    by_run = runs[order]
    starts = np.flatnonzero(np.r_[True, by_run[1:] != by_run[:-1]])
    rank = np.arange(order.size) - np.repeat(starts, np.diff(np.r_[starts, order.size]))
    kept = np.sort(order[rank < count])
    return kept[np.argsort(frees[kept], kind="stable")]


def hold_possible(snap: Snapshot, own: WorkerShape) -> bool:
    """Whether :func:`kept_for_queued` could keep a node from a job of worker shape ``own`` now:
    a job of a shape rare for it waits (speed probes aside). Whether it then does depends on the
    job's own run, so two jobs of one shape may find different room (the simulator decides each)."""
    rare = rare_shapes(snap, own)
    return bool(rare and snap.waiting) and any(_waiting_entries(snap, group) for group in rare)


def arrival_rate(count: int, span_s: float) -> float:
    """Jobs per second of a shape seen ``count`` times over ``span_s`` seconds, its first sight not
    counted (the clock starts there): 0 for a shape seen once."""
    return max(count - 1, 0) / span_s if span_s > 0 else 0.0


class RareFit:
    """Score: 0 for a candidate that would take the last room for a rare shape seen lately when that
    costs the jobs of that shape more waiting than it saves this job, 100 otherwise; permit: when
    every candidate would, wait for a pool that would not if that costs the job less (see the
    module)."""

    name = "rare_fit"

    def pre_filter(self, state: CycleState) -> Status:
        """SKIP unless a shape seen lately is rare for this job (most platforms and workloads: no
        job asks more CPU or RAM than most nodes have)."""
        if state.job.pipeline is not None:
            return Status(Code.SKIP)
        rare = rare_shapes(state.snapshot, WorkerShape.of(state.job))
        if not rare:
            return Status(Code.SKIP)
        state.write(_RARE, rare)
        state.write(_KEPT, kept_for_queued(state, rare))
        return SUCCESS

    def filter(self, state: CycleState, nodes: IntArray) -> BoolArray:
        """Not a node kept for a queued job of a rarer worker shape (:func:`kept_for_queued`)."""
        kept = state.get(_KEPT, None)
        if kept is None or not kept.size:
            return np.ones(nodes.size, dtype=np.bool_)
        return ~np.isin(nodes, kept)

    def filter_key(self, state: CycleState) -> bytes:
        """The nodes kept: the filter's answer depends on nothing else of the job."""
        kept = state.get(_KEPT, None)
        return b"" if kept is None else kept.tobytes()

    def describe(self, state: CycleState) -> str:
        kept = state.get(_KEPT, None)
        if kept is None or not kept.size:
            return ""
        return f"not a node kept for a queued job of a rarer worker shape ({kept.size} kept)"

    def score(self, state: CycleState, candidates: Candidates) -> FloatArray:
        return self.marked(state, candidates).astype(np.float64)

    def marked(self, state: CycleState, candidates: Candidates) -> BoolArray:
        """Per candidate: whether it is marked (it delays room for a rare shape, and the jobs of
        that shape would wait longer for it than the job loses elsewhere)."""
        k = len(candidates)
        none = np.zeros(k, dtype=np.bool_)
        rare = state.get(_RARE, [])
        if not k or not rare:
            return none
        snap = state.snapshot
        jct = believed_jct_s(state, candidates)  # believed: a hold predicts runs and harm
        ok = np.isfinite(jct) & (jct > 0)
        own = WorkerShape.of(state.job)
        harm = np.zeros(k, dtype=np.float64)
        ends: FloatArray | None = None
        lands: dict[int, tuple[IntArray, IntArray]] = {}
        pools = candidates.cluster * snap.total_sum.shape[1] + candidates.model
        horizon = snap.seen.span_s(snap.now)
        for group in rare:
            shape = group.shape
            rate = arrival_rate(group.count, horizon)
            could = group.nodes
            if rate <= 0 or not could.size:
                continue
            if ends is None:
                ends = node_ends(snap)
            room = snap.schedulable[could] & (
                snap.room(could, shape.gpus, shape.cpu_milli, shape.memory_mib) > 0
            )
            back = np.where(room, 0.0, np.maximum(ends[could] - snap.now, 0.0))  # room again after
            soonest = float(back.min())
            near = np.flatnonzero(ok & np.isin(pools, snap.pool_of[could]))
            for i in near.tolist():
                if i not in lands:
                    lands[i] = lands_on(candidates, i)
                nodes, workers = lands[i]
                after: FloatArray | None = None
                where = np.minimum(np.searchsorted(could, nodes), could.size - 1)  # could ascends
                for node, n, j in zip(nodes.tolist(), workers.tolist(), where.tolist(), strict=True):
                    if int(could[j]) != node or (back[j] == 0.0 and _left_holds(snap, node, shape, n, own)):
                        continue
                    if after is None:
                        after = back.copy()
                    after[j] = max(after[j], float(jct[i]))
                if after is not None:
                    harm[i] += wait_caused(rate, soonest, float(after.min()), horizon)
        spends = harm > 0
        alt = ok & ~spends
        state.write(
            _VERDICT,
            Verdict(candidates.cluster, candidates.model, harm, jct),
        )
        if not spends.any() or not alt.any():
            return none  # nothing to keep now, or nowhere else to go now (the permit weighs a wait)
        best_alt = float(jct[alt].min())
        safe = np.where(ok, jct, 1.0)
        loss = np.maximum(best_alt - safe, 0.0)
        marked: BoolArray = spends & ok & (best_alt <= RARE_MAX_SLOWDOWN * safe) & (harm > loss)
        return marked

    def permit(self, state: CycleState, decision: Decision) -> Status:
        """When the chosen candidate would take the last room for a rare shape (nothing else has room
        now, or nothing within :data:`RARE_MAX_SLOWDOWN` of its run, or its harm was less than the
        loss elsewhere now), the job may wait for a pool with no node of that shape's: it waits when
        that pool's expected room plus its run there ends less than the harm later than starting
        now, and while it has waited less than the harm (ski rental: a wait never costs more than the
        start it avoids); a pool with room now passes (the score chose). A second outside
        evaluation found the candidates more than 2x slower counted as "somewhere else", so a
        75-hour job took the last 128-core node with nothing weighed.
        Keeping a node by filling every other one otherwise hands it, at saturation, to whichever
        job finds it the only room: the longest of a batch under shortest-first (an outside
        evaluator: a 64-core job of 120 h took the one kept 128-core node and five 120-core jobs
        waited 56-64 h more each)."""
        verdict = state.get(_VERDICT, None)
        weighed = verdict.chosen(state, decision) if verdict is not None else None
        if weighed is None:
            return SUCCESS
        snap = state.snapshot
        harm, run, waited = weighed
        pools = whole_gang_pools(state, decision.workers)
        for group in state.get(_RARE, []):
            pools[snap.cluster_of[group.nodes], snap.model_of[group.nodes]] = False
        options = single_cluster_options(state, pools, decision.workers, within_s=RARE_MAX_SLOWDOWN * run)
        if not options:
            return SUCCESS
        best = min(options, key=lambda o: o.completion_s)
        loss = best.completion_s - run
        if loss >= harm or best.wait_s < MIN_WAIT_S:
            return SUCCESS
        wait = min(best.wait_s, harm - waited)
        return Status(
            Code.UNSCHEDULABLE,
            f"keeping the last node with room for a rarer worker shape: its jobs would wait"
            f" {harm:.0f} s more in all; waiting for {snap.models[best.model]} in"
            f" {snap.clusters[best.cluster].id} (room expected in {best.wait_s:.0f} s)",
            wait_s=wait,
        )

    def normalize(self, state: CycleState, raw: FloatArray) -> FloatArray:
        scores: FloatArray = 100.0 * (1.0 - np.minimum(np.maximum(raw, 0.0), 1.0))
        return scores


ROOM_MARGIN_S = 1800.0
"""A move to make room must save at least this many job-seconds more than it costs: the beliefs it
is weighed by (speeds, predicted ends) err, and a stop is not undone."""
ROOM_MAX_MOVED = 4
"""The most jobs ``rare_room`` moves off one node for one job."""
ROOM_MAX_NODES = 8
"""The most nodes ``rare_room`` looks at for one job (those with the most free GPUs first): a
decision's cost is bounded however many nodes could hold the job."""


def room_possible(snap: Snapshot, worker: WorkerShape) -> bool:
    """A bound :class:`RareRoom` starts from (a necessary condition, read by the simulator before it
    skips a waiting job's decision): the job's worker is rare beside some shape, that is, at most
    :data:`RARE_SHARE` of the schedulable nodes with GPUs could ever hold one. Whether a stoppable
    job runs where it would fit is the caller's to check."""
    _, holders = _holder_class(snap, worker)
    if holders == 0:
        return False
    nodes = int(np.count_nonzero(snap.schedulable & (snap.total > 0)))
    return holders <= RARE_SHARE * nodes


@dataclass(frozen=True, slots=True)
class _Move:
    """Running jobs, on one node, that could make room there for the deciding one by running
    elsewhere now, and the job-seconds that saves."""

    net_s: float
    positions: tuple[int, ...]
    node: int


@dataclass(slots=True)
class _Look:
    """What one ``rare_room`` decision reads once: the nodes no other queued job could use (None
    until asked), and per job rules the nodes they allow."""

    could: BoolArray
    deciding: str
    free_of_queue: BoolArray | None = None
    allowed: dict[tuple[object, ...], BoolArray] = field(default_factory=dict)


class RareRoom:
    """Post-filter: when nothing has room for a job of a rare worker shape, move the jobs of a
    common shape off a node that would then hold it, if they have room elsewhere now and the moves
    save more job-seconds than they cost.

    ``rare_fit`` keeps such a node only for shapes seen at least twice; the first job of a rare
    shape, or one arriving after the node was taken for a run of days, waits for that run to end
    (an outside evaluator: on a 120-GPU platform with one 128-core node, Loom was 126-177 % behind
    compute-only greedy on Alibaba's multi-GPU tasks, a 120-core task waiting 5.5 days behind an
    88-core one that ran there). The job deciding is *rare* beside a running job when at most
    :data:`RARE_SHARE` of the nodes that could ever hold the running job's worker could ever hold
    its own (:func:`holds`, every schedulable node, whatever either job allows: the same rule as
    ``rare_fit``). A running job may be moved when it is preemptible, of no higher priority, one
    worker on one node, and a node that could never hold the deciding job's worker has room for it
    now in a pool its rules allow, a node no other queued job could use (a queued job whose shape
    is not known could use any: a job moved in this cycle is one, so one cycle moves for one job).
    On each node that could hold the deciding job (at most :data:`ROOM_MAX_NODES`, most free GPUs
    first), the cheapest such jobs are taken, at most :data:`ROOM_MAX_MOVED`, until the node would
    hold it.

    The trade, in job-seconds by the scheduler's beliefs: the deciding job starts now instead of
    when the soonest node that could hold it empties (the latest predicted end of the jobs on it),
    at most when the moved jobs would have ended; each moved job, restarted from its last
    checkpoint (from its start when it keeps none) on the fastest such node, ends
    ``(share left + share redone) x its run there`` from now instead of at its predicted end (its
    run there: its own pace so far, scaled by the two GPUs' speeds for it). The move is made when
    the first exceeds the second by more than :data:`ROOM_MARGIN_S`; the node that saves most. The
    moved jobs are stopped as preemption stops one (the cycle requeues them; they count in the
    queue from then) and placed again by their own decisions."""

    name = "rare_room"

    def post_filter(self, state: CycleState, framework: Framework) -> Decision | None:
        snap = state.snapshot
        job = state.job
        if not snap.running or job.pipeline is not None or is_probe(job.labels) or state.min_workers != 1:
            return None
        own = WorkerShape.of(job)
        if not room_possible(snap, own):
            return None
        _, mine = _holder_class(snap, own)
        could = _holds_mask(snap, own)
        pools = state.allowed_pools()
        here = could & pools[snap.cluster_of, snap.model_of]
        if not here.any():
            return None
        ends = node_ends(snap)
        soonest = float(ends[here].min())
        gain = soonest - snap.now
        if not math.isfinite(gain) or gain <= ROOM_MARGIN_S:
            return None
        on_node = _runs_on_nodes(snap)
        nodes = [n for n in np.flatnonzero(here).tolist() if snap.node_ids[n] in on_node]
        nodes.sort(key=lambda n: (-int(snap.free[n]), n))
        look = _Look(could=could, deciding=job.job_id)
        best: _Move | None = None
        for node in nodes[:ROOM_MAX_NODES]:
            move = self._node_move(
                state, node, on_node[snap.node_ids[node]], own=own, mine=mine, look=look, gain=gain
            )
            if move is not None and (best is None or move.net_s > best.net_s):
                best = move
        if best is None:
            return None
        return self._decide(state, framework, best)

    def _node_move(
        self,
        state: CycleState,
        node: int,
        positions: Sequence[int],
        *,
        own: WorkerShape,
        mine: int,
        look: _Look,
        gain: float,
    ) -> _Move | None:
        """The jobs to move off ``node`` so that it holds the deciding job, cheapest first, and what
        that saves (None: it does not pay, or no set of them qualifies)."""
        snap, job = state.snapshot, state.job
        options: list[tuple[float, int]] = []
        for position in positions:
            run = snap.running[position]
            if not _movable(snap, run, job, mine):
                continue
            target = _room_elsewhere(snap, run, look, node)
            if target is not None:
                options.append((_move_loss_s(snap, run, node, target), position))
        options.sort()
        chosen: list[int] = []
        freed = WorkerShape(0, 0, 0)
        for _, position in options[:ROOM_MAX_MOVED]:
            run = snap.running[position]
            chosen.append(position)
            freed = WorkerShape(
                freed.gpus + run.gpus_per_worker,
                freed.cpu_milli + run.cpu_milli,
                freed.memory_mib + run.memory_mib,
            )
            if _holds_after(snap, node, freed, own):
                break
        else:
            return None
        left = max([(snap.running[p].expected_end_s or 0.0) - snap.now for p in chosen] + [0.0])
        # The deciding job waits at most until these jobs have ended (the node holds it then).
        saved = min(gain, left)
        cost = {p: max(loss, 0.0) for loss, p in options}
        if saved - sum(cost[p] for p in chosen) <= ROOM_MARGIN_S:
            return None  # not even with each job's room as if the others took none
        # Each moved job's room elsewhere, the ones before it placed there first.
        taken: list[tuple[int, RunningJob]] = []
        loss = 0.0
        try:
            for position in chosen:
                run = snap.running[position]
                target = _room_elsewhere(snap, run, look, node)
                if target is None:
                    return None
                loss += max(_move_loss_s(snap, run, node, target), 0.0)
                snap.take([(snap.node_ids[target], run.gpus_per_worker)], *_per_worker(run))
                taken.append((target, run))
        finally:
            for target, run in taken:
                snap.give_back([(snap.node_ids[target], run.gpus_per_worker)], *_per_worker(run))
        net = saved - loss
        if net <= ROOM_MARGIN_S:
            return None
        return _Move(net_s=net, positions=tuple(chosen), node=node)

    def _decide(self, state: CycleState, framework: Framework, move: _Move) -> Decision | None:
        """Stop the chosen jobs (their GPUs, CPU and RAM back in the snapshot; each counts in the
        queue from now, as it will once requeued) and place the deciding job on their node's pool;
        undone if that does not hold it after all."""
        snap = state.snapshot
        before = snap.running
        runs = [before[p] for p in move.positions]
        for run in runs:
            snap.give_back(run.allocations, run.gpus_per_worker, run.cpu_milli, run.memory_mib)
        gone = set(move.positions)
        snap.running = [r for i, r in enumerate(before) if i not in gone]
        c, m = int(snap.cluster_of[move.node]), int(snap.model_of[move.node])
        saved, model_saved = state.cluster_mask, state.model_mask.copy()
        mask = np.zeros_like(saved)
        mask[c] = True
        state.cluster_mask = mask
        state.model_mask[:] = False
        state.model_mask[m] = True
        try:
            candidates = framework.find_candidates(state)
        finally:
            state.cluster_mask, state.model_mask = saved, model_saved
        joined = [r.job_id for r in runs if r.job_id not in snap.waiting]

        def undo() -> None:
            for run in runs:
                snap.take(run.allocations, run.gpus_per_worker, run.cpu_milli, run.memory_mib)
            snap.running = before
            for job_id in joined:
                snap.waiting.discard(job_id)

        if len(candidates) == 0:
            undo()
            return None
        totals = framework.score(state, candidates)
        decision = framework.choose(state, candidates, totals)
        for job_id in joined:
            snap.join_queue(job_id)
        decision.victims = tuple(sorted(r.job_id for r in runs))
        decision.undo = undo
        return decision


def _per_worker(run: RunningJob) -> tuple[int, int, int]:
    return run.gpus_per_worker, run.cpu_milli, run.memory_mib


def _movable(snap: Snapshot, run: RunningJob, job: JobSpec, mine: int) -> bool:
    """Whether ``rare_room`` may move ``run`` for ``job`` (of ``mine`` holder nodes): known,
    preemptible, of no higher priority, one worker on one node, its end predicted, and ``job`` rare
    beside it."""
    spec = run.spec
    if (
        spec is None
        or not run.preemptible
        or run.priority > job.priority
        or run.workers != 1
        or len(run.allocations) != 1
        or run.expected_end_s is None
        or spec.pipeline is not None
    ):
        return False
    _, holders = _holder_class(snap, WorkerShape(run.gpus_per_worker, run.cpu_milli, run.memory_mib))
    return mine <= RARE_SHARE * holders


def _move_loss_s(snap: Snapshot, run: RunningJob, node: int, target: int) -> float:
    """How much later ``run`` ends if it is stopped now on ``node`` and run again on ``target``
    (negative: sooner): from its last checkpoint (from its start when it keeps none), the share of
    its work left and the share redone, at its own pace so far (its predicted end since it began;
    the scheduler's speeds when its start is not known) scaled by the two GPUs' speeds for it."""
    spec = run.spec
    assert spec is not None
    speeds = snap.believed_speeds(spec)  # a running job: as believed (no big-job handicap)
    here = float(speeds[snap.model_of[node]] * snap.trust[snap.cluster_of[node]])
    there = float(speeds[snap.model_of[target]] * snap.trust[snap.cluster_of[target]])
    if here <= 0 or there <= 0:
        return math.inf
    end = run.expected_end_s if run.expected_end_s is not None else snap.now
    left_s = max(end - snap.now, 0.0)
    if run.started_s is not None and end > run.started_s and run.done_at_start < 1.0:
        per_share = (end - run.started_s) / (1.0 - run.done_at_start)
    else:
        per_share = spec.work.steps * spec.work.step_time_s / here
    share_left = min(left_s / per_share, 1.0) if per_share > 0 else 1.0
    done = 1.0 - share_left
    every = spec.work.checkpoint_every_steps
    redone = done if every <= 0 else min(every / spec.work.steps, done)
    return (share_left + redone) * per_share * here / there - left_s


def _runs_on_nodes(snap: Snapshot) -> dict[str, list[int]]:
    """Node id -> positions in ``snap.running`` of the runs of one allocation there (what
    :class:`RareRoom` may move), kept per running list (the same object at the same length)."""
    running = snap.running
    held = snap.kept.get("rare_room.on_node")
    if held is not None and held[0] is running and held[1] == len(running):
        found: dict[str, list[int]] = held[2]
        return found
    table: dict[str, list[int]] = {}
    for position, run in enumerate(running):
        if len(run.allocations) == 1:
            table.setdefault(run.allocations[0][0], []).append(position)
    snap.kept["rare_room.on_node"] = (running, len(running), table)
    return table


def _holds_after(snap: Snapshot, node: int, freed: WorkerShape, own: WorkerShape) -> bool:
    """Whether ``node`` holds one worker of ``own`` once jobs holding ``freed`` there have left."""
    if int(snap.free[node]) + freed.gpus < own.gpus:
        return False
    if own.cpu_milli and snap.cpu_known[node] and int(snap.cpu_free[node]) + freed.cpu_milli < own.cpu_milli:
        return False
    return not (
        own.memory_mib
        and snap.mem_known[node]
        and int(snap.mem_free[node]) + freed.memory_mib < own.memory_mib
    )


def _holds_mask(snap: Snapshot, shape: WorkerShape) -> BoolArray:
    """:func:`holds` of ``shape``, kept per shape while no node's schedulability changes (a pure
    function of the nodes: what is kept changes no answer)."""
    table: dict[WorkerShape, tuple[int, BoolArray]] = snap.kept.setdefault("rare_room.holds", {})
    held = table.get(shape)
    if held is not None and held[0] == snap.schedulable_version:
        return held[1]
    if len(table) > 64:
        table.clear()
    mask = holds(snap, shape)
    table[shape] = (snap.schedulable_version, mask)
    return mask


def _free_of_queue(snap: Snapshot, deciding: str) -> BoolArray:
    """Per node: whether no queued job other than ``deciding`` (speed probes aside) could use it:
    its rules allow the node's pool and the node could ever hold its worker. A queued job whose
    shape is not known (a job just stopped to be moved, one its pre-filters refused) could use
    any node."""
    used = np.zeros(len(snap.node_ids), dtype=np.bool_)
    groups: dict[tuple[WorkerShape, bytes], BoolArray] = {}
    for job_id in snap.waiting:
        if job_id == deciding or job_id in snap.probes:
            continue
        queued = snap.queued.get(job_id)
        res = getattr(queued.job, "resources", None) if queued is not None else None
        if queued is None or res is None or queued.pools.shape != snap.free_sum.shape:
            return np.zeros(len(snap.node_ids), dtype=np.bool_)
        shape = WorkerShape(int(res.gpus), int(res.cpu_milli), int(res.memory_mib))
        groups.setdefault((shape, queued.pools.tobytes()), queued.pools)
    for (shape, _), pools in groups.items():
        used |= _holds_mask(snap, shape) & pools[snap.cluster_of, snap.model_of]
    free: BoolArray = ~used
    return free


def _room_elsewhere(snap: Snapshot, run: RunningJob, look: _Look, node: int) -> int | None:
    """The fastest node for ``run``'s job (by its speeds and the cluster's trust) with room for one
    of its workers now, that could never hold the deciding job's worker, is not ``node``, lies in a
    pool the job's hard rules allow (clusters and regions, GPU models and device memory), and that
    no other queued job could use (:func:`_free_of_queue`); None when there is none."""
    spec = run.spec
    assert spec is not None
    res, aff = spec.resources, spec.affinity
    rules = (
        tuple(sorted(m.upper() for m in res.gpu_models)),
        res.gpu_memory_gib,
        tuple(aff.clusters),
        tuple(aff.regions),
        tuple(aff.avoid_clusters),
        tuple(aff.avoid_regions),
    )
    allowed = look.allowed.get(rules)
    if allowed is None:
        wanted = {m.upper() for m in res.gpu_models}
        models = np.array(
            [
                (not wanted or m.upper() in wanted)
                and (res.gpu_memory_gib <= 0 or snap.gpu_memory_gib.get(m, 0.0) >= res.gpu_memory_gib)
                for m in snap.models
            ],
            dtype=np.bool_,
        )
        clusters = np.array([cluster_allowed(aff, c.id, c.region) for c in snap.clusters], dtype=np.bool_)
        if look.free_of_queue is None:
            look.free_of_queue = _free_of_queue(snap, look.deciding)
        allowed = (
            snap.schedulable
            & ~look.could
            & look.free_of_queue
            & clusters[snap.cluster_of]
            & models[snap.model_of]
        )
        look.allowed[rules] = allowed
    nodes = np.flatnonzero(allowed)
    nodes = nodes[nodes != node]
    if not nodes.size:
        return None
    nodes = nodes[snap.room(nodes, *_per_worker(run)) > 0]
    if not nodes.size:
        return None
    speed = snap.believed_speeds(spec)[snap.model_of[nodes]] * snap.trust[snap.cluster_of[nodes]]
    return int(nodes[int(np.argmax(speed))])


def _left_holds(snap: Snapshot, node: int, shape: WorkerShape, workers: int, job: WorkerShape) -> bool:
    """Whether ``node`` still holds one worker of ``shape`` once ``workers`` workers of ``job``'s
    shape are on it."""
    if int(snap.free[node]) - workers * job.gpus < shape.gpus:
        return False
    if (
        shape.cpu_milli
        and snap.cpu_known[node]
        and int(snap.cpu_free[node]) - workers * job.cpu_milli < shape.cpu_milli
    ):
        return False
    return not (
        shape.memory_mib
        and snap.mem_known[node]
        and int(snap.mem_free[node]) - workers * job.memory_mib < shape.memory_mib
    )


def wait_caused(rate: float, before_s: float, after_s: float, horizon_s: float) -> float:
    """Expected job-seconds jobs of a shape arriving at ``rate`` per second over the next
    ``horizon_s`` seconds wait longer for room once the soonest room for them is ``after_s``
    seconds away instead of ``before_s``: a job arriving ``t`` seconds from now waits
    ``max(room - t, 0)`` (one arrival at a time, as rare shapes come). The horizon is the span the
    rate was measured over: no more arrivals are foreseen than were seen."""
    if after_s <= before_s or rate <= 0 or horizon_s <= 0:
        return 0.0
    if math.isinf(after_s):
        return math.inf
    return rate * (_waited(after_s, horizon_s) - _waited(before_s, horizon_s))


def _waited(room_s: float, horizon_s: float) -> float:
    """``∫ max(room_s - t, 0) dt`` over ``t`` in ``[0, horizon_s]``."""
    m = min(room_s, horizon_s)
    return room_s * m - m * m / 2.0


def lands_on(candidates: Candidates, i: int) -> tuple[IntArray, IntArray]:
    """The nodes candidate ``i``'s workers would take and how many on each: the framework's own
    choice (:func:`~loom.sched.framework.pack_workers`, what ``Framework.pack`` does)."""
    nodes, room = candidates.nodes_of(i)
    taken = pack_workers(nodes, room, int(candidates.workers[i]))
    return (
        np.array([n for n, _ in taken], dtype=np.int64),
        np.array([w for _, w in taken], dtype=np.int64),
    )


def node_ends(snap: Snapshot) -> FloatArray:
    """Per node: the latest predicted end (on the snapshot's clock) of the jobs running on it, -inf
    for a node nothing runs on, from the running jobs' releases (:func:`releases`, kept per running
    list; a job whose end is not known is not in them, so its node counts as freeing up when its
    other jobs end: the harm is then under-, never over-counted)."""
    rel = releases(snap)
    held = snap.kept.get("rare_fit.ends")
    if held is not None and held[0] is rel:
        found: FloatArray = held[1]
        return found
    ends = np.full(len(snap.node_ids), -math.inf, dtype=np.float64)
    if rel.node.size:
        np.maximum.at(ends, rel.node, rel.at_s)
    snap.kept["rare_fit.ends"] = (rel, ends)
    return ends


__all__ = [
    "RARE_FIT_WEIGHT",
    "RARE_MAX_SLOWDOWN",
    "RARE_SHARE",
    "ROOM_MARGIN_S",
    "RareFit",
    "RareRoom",
    "RareShape",
    "Verdict",
    "arrival_rate",
    "hold_possible",
    "holds",
    "lands_on",
    "node_ends",
    "rare_shapes",
    "room_possible",
    "wait_caused",
]
