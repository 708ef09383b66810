"""What one scheduling cycle decides on: nodes as numpy arrays, clusters, the network and prices.

Nodes are sorted by cluster, then GPU model, then id, so each cluster and each (cluster, model)
pool is one contiguous slice of every array; per pool aggregates (free GPUs, the most free on one
node) let the framework prune whole regions, zones and clusters before it looks at a single node,
and then look only at the nodes of the pools left. :meth:`Snapshot.take` applies a
decision so the next job of the same cycle sees the GPUs as used; aggregates are kept in step.
"""

import bisect
import dataclasses
import math
from collections.abc import Container, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from loom.model.capacity import NodeCapacity
from loom.model.family import HasLabels, is_half_precision, job_family
from loom.model.scu import Precision
from loom.model.topology import Topology
from loom.sched.quota import QuotaBook
from loom_proto.jobs import JobSpec

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]

INTRA_REGION_RTT_MS = 1.0
"""Round trip between two clusters of one region when nothing better is known."""
INTRA_REGION_GBPS = 100.0
"""Bandwidth between two clusters of one region when nothing better is known."""
UNKNOWN_LINK_RTT_MS = 300.0
"""Priced for a pair of regions with no measured path: conservative, never free."""
UNKNOWN_LINK_GBPS = 0.1


@dataclass(frozen=True, slots=True)
class ClusterInfo:
    """A cluster as scheduling sees it: where it is and how far its claimed compute is believed."""

    id: str
    region: str
    zone: str
    trust: float = 1.0
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RunningJob:
    """A job holding GPUs now: for affinity, preemption, elastic resizing and balance."""

    job_id: str
    tenant: str
    priority: int
    cluster: str
    gpu_model: str
    allocations: tuple[tuple[str, int], ...]
    progress: float = 0.0
    preemptible: bool = True
    labels: Mapping[str, str] = field(default_factory=dict)
    task_type: str = "training_compute"
    """What its speeds are read for (:meth:`Snapshot.job_speeds`), as the job's spec says."""
    workers: int = 1
    min_workers: int | None = None
    max_workers: int = 1
    gpus_per_worker: int = 1
    cpu_milli: int = 0
    """Per worker."""
    memory_mib: int = 0
    """Per worker."""
    attempt: int = 1
    expected_end_s: float | None = None
    """When the run is predicted to end, in seconds on the snapshot's clock (``Snapshot.now``);
    None when not known. What :mod:`loom.sched.availability` reads to tell when GPUs free up."""
    started_s: float | None = None
    """When the run began, on the snapshot's clock (None: not known); with :attr:`done_at_start`
    and :attr:`expected_end_s`, its pace so far."""
    done_at_start: float = 0.0
    """Share of the job's steps done when the run began (a run resumed from a checkpoint)."""
    spec: JobSpec | None = field(default=None, compare=False, repr=False)
    """The job as submitted (its work, checkpoints and hard rules: what moving it to make room
    weighs, :class:`~loom.sched.plugins.rare.RareRoom`); None when not known."""

    @property
    def gpus(self) -> int:
        """GPUs the job holds in all."""
        return sum(g for _, g in self.allocations)


class NetMatrix:
    """Region-to-region round trip, bandwidth and loss: measured paths, or conservative guesses."""

    def __init__(
        self,
        regions: Sequence[str],
        rtt_ms: FloatArray | None = None,
        bandwidth_gbps: FloatArray | None = None,
        loss: FloatArray | None = None,
        degraded: BoolArray | None = None,
    ) -> None:
        self.regions = tuple(regions)
        self.index = {r: i for i, r in enumerate(self.regions)}
        n = len(self.regions)
        self.rtt_ms = rtt_ms if rtt_ms is not None else np.full((n, n), UNKNOWN_LINK_RTT_MS)
        self.bandwidth_gbps = (
            bandwidth_gbps if bandwidth_gbps is not None else np.full((n, n), UNKNOWN_LINK_GBPS)
        )
        self.loss = loss if loss is not None else np.zeros((n, n))
        self.degraded = degraded if degraded is not None else np.zeros((n, n), dtype=np.bool_)
        np.fill_diagonal(self.rtt_ms, INTRA_REGION_RTT_MS)
        np.fill_diagonal(self.bandwidth_gbps, INTRA_REGION_GBPS)

    @classmethod
    def from_topology(cls, topology: Topology) -> "NetMatrix":
        """The topology's measured figures (the prior before probes report)."""
        regions = [r.id for r in topology.regions]
        matrix = cls(regions)
        for link in topology.links:
            i, j = matrix.index[link.src], matrix.index[link.dst]
            matrix.rtt_ms[i, j] = link.rtt_ms
            matrix.bandwidth_gbps[i, j] = link.bandwidth_gbps
        matrix.fill_missing_with_paths()
        return matrix

    def set_link(
        self,
        src: str,
        dst: str,
        *,
        rtt_ms: float,
        bandwidth_gbps: float | None,
        loss: float = 0.0,
        degraded: bool = False,
    ) -> None:
        """Adopt one measured link (regions not known yet are ignored)."""
        i, j = self.index.get(src), self.index.get(dst)
        if i is None or j is None or i == j:
            return
        self.rtt_ms[i, j] = rtt_ms
        if bandwidth_gbps is not None and bandwidth_gbps > 0:
            self.bandwidth_gbps[i, j] = bandwidth_gbps
        self.loss[i, j] = loss
        self.degraded[i, j] = degraded

    def fill_missing_with_paths(self) -> None:
        """Pairs without a direct link get the best two-hop relay (rtt adds up, bandwidth is the min)."""
        n = len(self.regions)
        unknown = self.rtt_ms >= UNKNOWN_LINK_RTT_MS
        for i in range(n):
            for j in range(n):
                if i == j or not unknown[i, j]:
                    continue
                via = [
                    (
                        self.rtt_ms[i, k] + self.rtt_ms[k, j],
                        min(self.bandwidth_gbps[i, k], self.bandwidth_gbps[k, j]),
                    )
                    for k in range(n)
                    if k not in (i, j) and not unknown[i, k] and not unknown[k, j]
                ]
                if via:
                    rtt, bw = min(via)
                    self.rtt_ms[i, j] = rtt
                    self.bandwidth_gbps[i, j] = bw

    def link(self, src: str, dst: str) -> tuple[float, float]:
        """(rtt_ms, bandwidth_gbps) between two regions; conservative when either is unknown."""
        i, j = self.index.get(src), self.index.get(dst)
        if i is None or j is None:
            return (
                (INTRA_REGION_RTT_MS, INTRA_REGION_GBPS)
                if src == dst
                else (UNKNOWN_LINK_RTT_MS, UNKNOWN_LINK_GBPS)
            )
        return float(self.rtt_ms[i, j]), float(self.bandwidth_gbps[i, j])

    def transfer_s(self, src: str, dst: str, gigabytes: float) -> float:
        """Seconds to move ``gigabytes`` from one region to another (one round trip plus the bytes)."""
        if src == dst or gigabytes <= 0:
            return 0.0
        rtt, gbps = self.link(src, dst)
        return rtt / 1000.0 + gigabytes * 8.0 / max(gbps, 1e-6)


@dataclass(frozen=True, slots=True)
class Economics:
    """Price and carbon by region and hour of day (UTC): the inputs of the cost and energy plugin."""

    price_per_gpu_hour: Mapping[str, float] = field(default_factory=dict)
    """Base price of one GPU-hour of the reference accelerator per region (the SCU-hour price)."""
    hourly_price_factor: Mapping[str, Sequence[float]] = field(default_factory=dict)
    """24 multipliers per region (off-peak discounts); missing means flat."""
    carbon_g_per_kwh: Mapping[str, Sequence[float]] = field(default_factory=dict)
    """Grid carbon intensity per region, 24 hourly values (or one)."""
    gpu_power_kw: Mapping[str, float] = field(default_factory=dict)
    """Board power per GPU model; 0.3 kW when unknown."""

    def price(self, region: str, now: float) -> float:
        """Price per reference-GPU-hour in ``region`` at ``now``."""
        base = self.price_per_gpu_hour.get(region, 2.0)
        factors = self.hourly_price_factor.get(region)
        return base * (factors[int(now // 3600) % len(factors)] if factors else 1.0)

    def carbon(self, region: str, now: float) -> float:
        """Grams of CO2 per kWh in ``region`` at ``now`` (400 when unknown)."""
        values = self.carbon_g_per_kwh.get(region)
        return float(values[int(now // 3600) % len(values)]) if values else 400.0


def job_precision(job: HasLabels) -> Precision:
    """``fp16`` for a mixed-precision job (its family ends in ``@fp16``: see
    :func:`loom.model.family.family_of`), else ``fp32``; read from the labels without folding."""
    return "fp16" if is_half_precision(job.labels.get("precision", "")) else "fp32"


def allowed_pools(snap: "Snapshot", job: JobSpec) -> tuple[BoolArray, BoolArray]:
    """(per cluster, per GPU model of ``snap``) whether ``job``'s rules allow it: its affinity's
    clusters and regions (and those it avoids), and its GPU models and GPU memory. The free capacity
    of now is not counted."""
    res = job.resources
    aff = job.affinity
    wanted = {m.upper() for m in res.gpu_models}
    models = np.array(
        [
            (not wanted or m.upper() in wanted) and snap.gpu_memory_gib.get(m, 0.0) >= res.gpu_memory_gib
            for m in snap.models
        ],
        dtype=np.bool_,
    )
    clusters = np.array(
        [
            (not aff.clusters or c.id in aff.clusters)
            and (not aff.regions or c.region in aff.regions)
            and c.id not in aff.avoid_clusters
            and c.region not in aff.avoid_regions
            for c in snap.clusters
        ],
        dtype=np.bool_,
    )
    return clusters, models


SEEN_JOBS = 256
"""How many of the latest jobs :class:`SeenShapes` remembers (what ``rare_fit`` reads)."""
SEEN_MIN_SPAN_S = 3600.0
"""The shortest span :meth:`SeenShapes.span_s` gives: a shape seen twice within a minute is not
taken as arriving every thirty seconds."""


@dataclass(frozen=True, slots=True)
class WorkerShape:
    """What one worker of a job takes on its node: GPUs, CPU (milli-cores) and RAM (MiB; 0: not
    asked)."""

    gpus: int
    cpu_milli: int = 0
    memory_mib: int = 0

    @classmethod
    def of(cls, job: JobSpec) -> "WorkerShape":
        res = job.resources
        return cls(int(res.gpus), int(res.cpu_milli), int(res.memory_mib))


def workers_fit(
    shape: WorkerShape,
    gpus: IntArray,
    *,
    cpu: tuple[IntArray, BoolArray] | None = None,
    mem: tuple[IntArray, BoolArray] | None = None,
) -> IntArray:
    """Workers of ``shape`` that nodes with these free ``gpus``, and (free, known) ``cpu`` and
    ``mem``, each hold: by GPUs, then by CPU and RAM where the node reports them (None: not
    limited). :meth:`Snapshot.room`'s rule, for room now, once idle or after a job took some."""
    workers: IntArray = gpus // shape.gpus
    if cpu is not None and shape.cpu_milli:
        workers = np.where(cpu[1], np.minimum(workers, cpu[0] // shape.cpu_milli), workers)
    if mem is not None and shape.memory_mib:
        workers = np.where(mem[1], np.minimum(workers, mem[0] // shape.memory_mib), workers)
    return workers


class SeenShapes:
    """The worker shapes of the latest :data:`SEEN_JOBS` jobs decided, each with when it was first
    seen: how many of them had each shape (:attr:`counts`), over what span (:meth:`span_s`). Kept
    across snapshots by the caller (the placement service's book, the simulator's one snapshot);
    the framework notes every job it decides (:meth:`note`), the simulator the jobs it skips too.
    What ``rare_fit`` reads to keep the last node with room for a shape only few nodes hold,
    ``hole_fit`` the holes larger jobs need, ``gang_fit`` room for gangs of several nodes."""

    def __init__(self, limit: int = SEEN_JOBS) -> None:
        self.limit = max(int(limit), 1)
        self._jobs: dict[str, tuple[WorkerShape, float, int, int, float]] = {}
        self.counts: dict[WorkerShape, int] = {}
        """Shape -> how many of the remembered jobs have it."""
        self.gangs: dict[int, int] = {}
        """A job's GPUs in all (workers x GPUs per worker) -> how many of the remembered jobs ask
        that many (what ``hole_fit`` keeps holes for)."""
        self.teams: dict[tuple[WorkerShape, int], int] = {}
        """(worker shape, workers needed at once) of the remembered jobs that need two workers or
        more at once -> how many (what ``gang_fit`` keeps node room for)."""
        self.version = 0
        """How many times what is remembered changed (caches of figures over it read it)."""

    def __len__(self) -> int:
        return len(self._jobs)

    def note(
        self,
        job_id: str,
        shape: WorkerShape,
        now: float,
        *,
        gpus: int = 0,
        workers: int = 1,
        work_s: float = math.nan,
    ) -> None:
        """``job_id`` was seen with ``shape`` at ``now``, asking ``gpus`` GPUs in all (0: the
        shape's) over ``workers`` workers and ``work_s`` of work (NaN: not known); once per job
        (the first sight counts), the oldest forgotten beyond :attr:`limit`."""
        if job_id in self._jobs:
            return
        gang = int(gpus) if gpus > 0 else shape.gpus
        team = max(int(workers), 1)
        work = float(work_s) if math.isfinite(work_s) and work_s >= 0 else math.nan
        self._jobs[job_id] = (shape, float(now), gang, team, work)
        self.counts[shape] = self.counts.get(shape, 0) + 1
        self.gangs[gang] = self.gangs.get(gang, 0) + 1
        if team > 1:
            self.teams[shape, team] = self.teams.get((shape, team), 0) + 1
        self.version += 1
        while len(self._jobs) > self.limit:
            _old, (gone, _at, size, many, _work) = next(iter(self._jobs.items()))
            del self._jobs[_old]
            _forget(self.counts, gone)
            _forget(self.gangs, size)
            if many > 1:
                _forget(self.teams, (gone, many))

    def note_job(self, job: JobSpec, now: float) -> None:
        """:meth:`note` of ``job`` with its worker shape (:meth:`WorkerShape.of`), its GPUs in all
        and the workers it needs at once (an elastic job's fewest: it may start with them)."""
        workers = max(int(job.workers), 1)
        least = min(int(job.min_workers), workers) if job.min_workers is not None else workers
        self.note(
            job.job_id,
            WorkerShape.of(job),
            now,
            gpus=workers * int(job.resources.gpus),
            workers=max(least, 1),
            work_s=float(job.work.steps) * float(job.work.step_time_s),
        )

    def works(self, shapes: Container[WorkerShape]) -> list[float]:
        """The work (steps x reference step time, seconds) of the remembered jobs of ``shapes`` whose
        work is known, oldest first: what the jobs of those shapes still to come are expected to ask
        (``rare_fit``)."""
        return [
            work
            for shape, _at, _gang, _team, work in self._jobs.values()
            if shape in shapes and not math.isnan(work)
        ]

    def span_s(self, now: float) -> float:
        """Seconds from the oldest job remembered to ``now``, at least :data:`SEEN_MIN_SPAN_S`."""
        if not self._jobs:
            return SEEN_MIN_SPAN_S
        oldest = next(iter(self._jobs.values()))[1]
        return max(float(now) - oldest, SEEN_MIN_SPAN_S)


def _forget(counts: dict[Any, int], key: Any) -> None:
    """One fewer of ``key`` in ``counts`` (gone at 0)."""
    left = counts[key] - 1
    if left:
        counts[key] = left
    else:
        del counts[key]


@dataclass(frozen=True, slots=True)
class QueuedShape:
    """A queued job as the jobs behind it see it: its queue key (the framework's queue order, lower
    first), the workers it starts with and GPUs per worker, the (cluster, GPU model) pools its
    rules allow (``pools[c, m]``; the free capacity of now not counted), and its work (to time its
    run where it would start)."""

    job_id: str
    key: tuple[Any, ...]
    workers: int
    per_worker: int
    pools: BoolArray
    job: HasLabels | None = None
    """The job (its believed speeds per GPU model: :meth:`Snapshot.believed_speeds`); None: its run
    is not known."""
    work_s: float = math.inf
    """Its steps x reference step time: a run of ``work_s / speed`` on GPUs of that speed."""


class QueuedShapes(dict[str, QueuedShape]):
    """``Snapshot.queued``: job id -> :class:`QueuedShape`, with a counter of its changes (``version``)
    so that its queue order is sorted once per change, not once per reader
    (:meth:`Snapshot.queue_ahead`), and how many queued jobs need each (GPUs per worker, workers) of
    two workers or more (:attr:`teams`, kept as entries come and go: what ``gang_fit`` reads of the
    queue without a pass over it)."""

    version: int = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self.teams: dict[tuple[int, int], int] = {}
        """(GPUs per worker, workers) of the entries with two workers or more -> how many."""
        if args or kwargs:
            self.update(*args, **kwargs)

    def _count(self, shape: QueuedShape, step: int) -> None:
        if shape.workers < 2:
            return
        # Read through __dict__: unpickling sets the items before the attributes.
        teams: dict[tuple[int, int], int] = self.__dict__.setdefault("teams", {})
        key = (shape.per_worker, shape.workers)
        left = teams.get(key, 0) + step
        if left > 0:
            teams[key] = left
        else:
            teams.pop(key, None)

    def __setitem__(self, key: str, value: QueuedShape) -> None:
        self.version += 1
        old = super().get(key)
        if old is not None:
            self._count(old, -1)
        self._count(value, 1)
        super().__setitem__(key, value)

    def __delitem__(self, key: str) -> None:
        self.version += 1
        self._count(super().__getitem__(key), -1)
        super().__delitem__(key)

    def pop(self, key: str, *default: Any) -> Any:
        self.version += 1
        if key in self:
            shape = super().pop(key)
            self._count(shape, -1)
            return shape
        return super().pop(key, *default)

    def popitem(self) -> tuple[str, QueuedShape]:
        self.version += 1
        key, shape = super().popitem()
        self._count(shape, -1)
        return key, shape

    def clear(self) -> None:
        self.version += 1
        self.__dict__["teams"] = {}
        super().clear()

    def update(self, *args: Any, **kwargs: Any) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value
        self.version += 1

    def setdefault(self, key: str, default: QueuedShape) -> QueuedShape:
        if key not in self:
            self[key] = default
        self.version += 1
        return super().__getitem__(key)

    # dict's own |= would bypass __setitem__ (and so the version and the gang counts); typeshed's
    # overloaded dict.__or__ admits no plain override, hence the ignore.
    def __ior__(self, other: Any) -> "QueuedShapes":  # type: ignore[override,misc]
        self.update(other)
        return self


def remap_queued(
    queued: "QueuedShapes", clusters: Sequence[str], models: Sequence[str], snap: "Snapshot"
) -> None:
    """Re-index in place each shape's ``pools``, indexed by ``clusters`` (ids) x ``models`` (the order
    of the snapshot they were recorded in), by ``snap``'s order: a pool kept keeps its flag, a pool
    new to ``snap`` is not allowed (the job's next decision records it anew)."""
    new_c = [c.id for c in snap.clusters]
    new_m = list(snap.models)
    if list(clusters) == new_c and list(models) == new_m:
        return
    c_at = {cid: i for i, cid in enumerate(clusters)}
    m_at = {m: i for i, m in enumerate(models)}
    rows = np.array([c_at.get(cid, -1) for cid in new_c], dtype=np.int64)
    cols = np.array([m_at.get(m, -1) for m in new_m], dtype=np.int64)
    for job_id, shape in list(queued.items()):
        old = shape.pools
        pools = np.zeros((len(new_c), len(new_m)), dtype=np.bool_)
        if old.shape == (len(clusters), len(models)) and rows.size and cols.size:
            keep_r, keep_c = rows >= 0, cols >= 0
            sub = old[np.ix_(rows[keep_r], cols[keep_c])]
            pools[np.ix_(np.flatnonzero(keep_r), np.flatnonzero(keep_c))] = sub
        queued[job_id] = dataclasses.replace(shape, pools=pools)


class Snapshot:
    """Nodes as arrays sorted by cluster, their clusters, what runs where, the network and prices."""

    # PLR0915: the cycle's arrays, built in one pass over the nodes.
    def __init__(  # noqa: PLR0915
        self,
        nodes: Iterable[NodeCapacity],
        *,
        clusters: Mapping[str, ClusterInfo] | None = None,
        running: Sequence[RunningJob] = (),
        net: NetMatrix | None = None,
        economics: Economics | None = None,
        speed: Mapping[tuple[str, str], float] | None = None,
        gpu_memory_gib: Mapping[str, float] | None = None,
        learned: Mapping[tuple[str, str], float] | None = None,
        now: float = 0.0,
        half_speed: Mapping[tuple[str, str], float] | None = None,
    ) -> None:
        caps = sorted(
            (c for c in nodes if c.gpu_model is not None),
            key=lambda c: (c.cluster, c.gpu_model or "", c.node),
        )
        self.now = now
        self._running_ids: tuple[list[RunningJob], int, set[str]] | None = None
        self.waiting: set[str] = set()
        """The queue: jobs decided at least once and neither placed nor rejected since (kept by
        :meth:`~loom.sched.framework.Framework.schedule`; the caller removes jobs that leave the
        queue otherwise). What the plugins that price a queue read (:meth:`waiting_count`)."""
        self.closed: dict[str, str] = {}
        """Cluster id -> why its nodes take no new work now (``"drained"``, ``"failed"``), as the
        caller that marked them unschedulable knows it; what explanations name (empty: unknown)."""
        self.probes: set[str] = set()
        """Jobs known to be speed probes (``loom.sched.probe``: one per (family, GPU model) cell,
        so few), noted by the framework when one joins the queue; kept across snapshots as
        :attr:`waiting` is. A probe waiting for the one GPU model it measures says nothing about how
        scarce the pools are (:meth:`work_waiting`)."""
        self.queued: QueuedShapes = QueuedShapes()
        """Job id -> what a queued job needs and may use, in queue order (:class:`QueuedShape`),
        recorded by the framework when nothing fits the job; read only for jobs still in
        :attr:`waiting` (an entry may outlive its job's place in the queue: :meth:`queue_ahead`)."""
        self._queue_order: (
            tuple[Mapping[str, QueuedShape], int, tuple[list[tuple[Any, ...]], list[QueuedShape]] | None]
            | None
        ) = None
        self.seen = SeenShapes()
        """The worker shapes of the latest jobs decided (:class:`SeenShapes`), kept across snapshots
        by the caller as :attr:`waiting` is."""
        self.staged: dict[str, dict[str, float]] = {}
        """Job id -> region -> when a copy of its dataset begun while it queued is there (the data
        plugin counts only what is left of it: :mod:`loom.sched.staging`). Kept by the caller."""
        self.quota: QuotaBook | None = None
        """GPUs each tenant holds against its quota, kept with the snapshot: the quota plugin checks
        and takes from it, so a cycle's decisions count against the next job's quota at once. None:
        an open platform (no quotas)."""
        cluster_ids = sorted({c.cluster for c in caps} | set(clusters or {}))
        given = clusters or {}
        first = {c.cluster: c for c in reversed(caps)}
        self.clusters: list[ClusterInfo] = [
            given.get(cid) or ClusterInfo(id=cid, region=first[cid].region, zone=first[cid].zone)
            for cid in cluster_ids
        ]
        self.cluster_index = {c.id: i for i, c in enumerate(self.clusters)}
        self.models: list[str] = sorted({c.gpu_model for c in caps if c.gpu_model is not None})
        self.model_index = {m: i for i, m in enumerate(self.models)}
        regions = sorted({c.region for c in self.clusters} | set(net.regions if net else ()))
        self.net = net if net is not None else NetMatrix(regions)
        self.regions: list[str] = list(self.net.regions) + [r for r in regions if r not in self.net.index]
        self.region_index = {r: i for i, r in enumerate(self.regions)}
        self.economics = economics or Economics()
        self.running: list[RunningJob] = list(running)
        self.speed = dict(speed or {})
        """(gpu_model, task_type) -> delivered speed of one GPU relative to the reference (SCU)."""
        self.half_speed = dict(half_speed or {})
        """(gpu_model, task_type) -> the same for mixed-precision jobs (family ``…@fp16``: the SCU
        with the fp16 weights); where a key is missing, :attr:`speed`'s."""
        self._speed_by_task: dict[tuple[str, Precision], FloatArray] = {}
        self.learned: dict[tuple[str, str], float] = dict(learned or {})
        """(job family, gpu_model) -> learned factor on the SCU speed: what jobs of that family
        delivered on that model over what the profile predicted (see :mod:`loom.model.family`).
        Change it only through :meth:`set_learned`, which keeps the per-job speed tables true."""
        self.measured: frozenset[tuple[str, str]] = frozenset()
        """(family, GPU model) cells whose learned factor rests on runs of their own (a speed
        probe's included), of a family whose runs on one model agree
        (:meth:`~loom.model.learn.SpeedLearner.steady_cells`): :meth:`set_learned`."""
        self.risk: tuple[float, float] | None = None
        """(GPU-hours, factor): a job of at least that many reference GPU-hours weighs the GPU models
        its family has no :attr:`measured` cell on at that factor of their speed, once it has one
        (:meth:`set_risk`; ``LearnSettings.risk_gpu_hours``); None: off."""
        self._speed_by_job: dict[tuple[str, str, Precision, bool], FloatArray] = {}
        self._steady: tuple[frozenset[tuple[str, str]], frozenset[str]] | None = None
        self.gpu_memory_gib = dict(gpu_memory_gib or {})

        n = len(caps)
        self.node_ids: list[str] = [c.node for c in caps]
        self.node_index = {nid: i for i, nid in enumerate(self.node_ids)}
        self.cluster_of = np.fromiter((self.cluster_index[c.cluster] for c in caps), np.int64, n)
        self.model_of = np.fromiter((self.model_index[c.gpu_model or ""] for c in caps), np.int64, n)
        self.total = np.fromiter((c.gpus_total for c in caps), np.int64, n)
        self.free = np.fromiter((c.gpus_free for c in caps), np.int64, n)
        self.cpu_free = np.fromiter((max(c.cpu_milli - c.cpu_reserved, 0) for c in caps), np.int64, n)
        self.mem_free = np.fromiter((max(c.memory_mib - c.memory_reserved, 0) for c in caps), np.int64, n)
        self.cpu_cap = np.fromiter((c.cpu_milli for c in caps), np.int64, n)
        """Each node's CPU (milli-cores): what is given back never raises its free CPU above it."""
        self.mem_cap = np.fromiter((c.memory_mib for c in caps), np.int64, n)
        self.cpu_known = np.fromiter((c.cpu_milli > 0 for c in caps), np.bool_, n)
        self.mem_known = np.fromiter((c.memory_mib > 0 for c in caps), np.bool_, n)
        self.schedulable = np.fromiter((c.schedulable for c in caps), np.bool_, n)
        self.schedulable_version = 0
        """How many times :meth:`set_schedulable` changed :attr:`schedulable` (caches of figures over
        nodes' totals read it)."""
        self.kept: dict[Hashable, Any] = {}
        """Figures a plugin keeps with the snapshot (``rare_fit``'s nodes per worker shape, while no
        node's schedulability changes: :attr:`schedulable_version`, and its rare shapes per job
        shape, while :attr:`seen` does not change either); each checks its own entries are still
        true before reuse."""
        c_count = len(self.clusters)
        self.slices: list[tuple[int, int]] = [(0, 0)] * c_count
        if n:
            bounds = np.searchsorted(self.cluster_of, np.arange(c_count + 1))
            self.slices = [(int(bounds[i]), int(bounds[i + 1])) for i in range(c_count)]
        self.cluster_region = np.array([self.region_index[c.region] for c in self.clusters], dtype=np.int64)
        self.trust = np.array([c.trust for c in self.clusters], dtype=np.float64)
        zones: dict[tuple[str, str], int] = {}
        self.cluster_zone = np.array(
            [zones.setdefault((c.region, c.zone), len(zones)) for c in self.clusters], dtype=np.int64
        )
        self.zone_count = len(zones)
        m_count = max(len(self.models), 1)
        self.pool_of: IntArray = self.cluster_of * m_count + self.model_of
        """Per node, its (cluster, model) pool: ``cluster x models + model``, never decreasing."""
        self.pool_bounds: IntArray = np.searchsorted(self.pool_of, np.arange(c_count * m_count + 1))
        """Pool ``p``'s nodes are ``pool_bounds[p]:pool_bounds[p + 1]``."""
        self.pool_version: IntArray = np.zeros(c_count * m_count, np.int64)
        """Per pool, how many times its nodes' free resources or schedulability changed: caches of
        per-pool figures (the framework's workers per job shape) recompute only the pools that moved.
        Change nodes only through :meth:`take`, :meth:`give_back` and :meth:`set_schedulable`."""
        self.moves = 0
        """How many times any pool's free resources or schedulability changed (the sum of
        :attr:`pool_version`, as one number: figures read off every pool check it)."""
        self.free_sum = np.zeros((c_count, m_count), np.int64)
        self.total_sum = np.zeros((c_count, m_count), np.int64)
        self.max_free = np.zeros((c_count, m_count), np.int64)
        usable = np.where(self.schedulable, self.free, 0)
        if n:
            np.add.at(self.free_sum, (self.cluster_of, self.model_of), usable)
            np.add.at(self.total_sum, (self.cluster_of, self.model_of), self.total)
            np.maximum.at(self.max_free, (self.cluster_of, self.model_of), usable)
        self.labels_by_cluster: dict[str, list[RunningJob]] = {}
        for job in self.running:
            self.labels_by_cluster.setdefault(job.cluster, []).append(job)

    # ---- lookups -------------------------------------------------------------------------------

    def pool(self, cluster: int, model: int) -> slice:
        """The slice of every node array that holds the cluster's nodes of one model."""
        p = cluster * self.free_sum.shape[1] + model
        return slice(int(self.pool_bounds[p]), int(self.pool_bounds[p + 1]))

    def node_slice(self, cluster: int, model: int) -> tuple[IntArray, slice]:
        """Indices of the cluster's nodes of one model (absolute), and the cluster's slice."""
        pool = self.pool(cluster, model)
        return np.arange(pool.start, pool.stop, dtype=np.int64), slice(*self.slices[cluster])

    def gpu_speed(self, model: str, task_type: str, precision: Precision = "fp32") -> float:
        """One GPU's delivered speed for a task type relative to the reference.

        The builders of speed tables (the simulator's platform, the placement book) fill every
        model they have nodes of, an unprofiled one at :data:`~loom.model.scu.UNPROFILED_SPEED`
        (:func:`loom.model.profiles.speeds_for_model`); a model missing from a table handed in
        by hand (tests, benchmarks) reads as the reference, 1.0.
        """
        if precision == "fp16":
            half = self.half_speed.get((model, task_type))
            if half is not None:
                return half
        return self.speed.get((model, task_type), 1.0)

    def speeds(self, task_type: str, precision: Precision = "fp32") -> FloatArray:
        """Every model's per-GPU speed for a task type, indexed like :attr:`models` (cached)."""
        key = (task_type, precision)
        table = self._speed_by_task.get(key)
        if table is None:
            table = np.array([self.gpu_speed(m, task_type, precision) for m in self.models], dtype=np.float64)
            self._speed_by_task[key] = table
        return table

    def set_learned(
        self,
        learned: Mapping[tuple[str, str], float],
        measured: Iterable[tuple[str, str]] | None = None,
    ) -> None:
        """Adopt new learned factors (replacing all of them); per-job speed tables are rebuilt.
        ``measured``: the (family, GPU model) cells runs of their own measured (:attr:`measured`;
        None keeps the cells adopted before)."""
        self.learned = dict(learned)
        if measured is not None:
            self.measured = frozenset(measured)
        self._speed_by_job.clear()

    def set_risk(self, gpu_hours: float, factor: float) -> None:
        """Set :attr:`risk` (off when ``gpu_hours`` is 0 or ``factor`` 1); per-job speed tables are
        rebuilt."""
        self.risk = (gpu_hours, factor) if gpu_hours > 0 and factor < 1 else None
        self._speed_by_job.clear()

    def at_risk(self, job: HasLabels, family: str) -> bool:
        """Whether :attr:`risk` weighs on ``job``'s :meth:`job_speeds`: a job spec (a running job's
        record has no work) of at least its GPU-hours at the reference speed, not a pipeline (whose
        plan is timed with the speeds it is chosen by), whose family has a :attr:`measured` cell on
        some GPU model of this snapshot."""
        if self.risk is None or not family or family not in self._steady_families():
            return False
        work, resources = getattr(job, "work", None), getattr(job, "resources", None)
        if work is None or resources is None or getattr(job, "pipeline", None) is not None:
            return False
        gpu_h = (
            float(work.steps * work.step_time_s * max(getattr(job, "workers", 1), 1) * resources.gpus)
            / 3600.0
        )
        return gpu_h >= self.risk[0]

    def job_at_risk(self, job: HasLabels) -> bool:
        """:meth:`at_risk` with the family :meth:`job_speeds` reads (none while nothing is learned)."""
        return self.at_risk(job, job_family(job) if self.learned else "")

    def _steady_families(self) -> frozenset[str]:
        """The families with a :attr:`measured` cell on a GPU model of this snapshot (kept while
        :attr:`measured` is the same set)."""
        if self._steady is None or self._steady[0] is not self.measured:
            models = set(self.models)
            self._steady = (self.measured, frozenset(f for f, m in self.measured if m in models))
            self._speed_by_job.clear()  # handicapped tables read the cells
        return self._steady[1]

    def job_speeds(self, job: HasLabels) -> FloatArray:
        """Every model's per-GPU speed *for ranking this job's candidate GPUs*, indexed like
        :attr:`models` (cached per family).

        :meth:`believed_speeds`, except that a big job's speeds on the models its family never ran
        on steadily are weighed down by :attr:`risk` (:meth:`at_risk`). The scores read this
        (``compute.delivered_speed``: SCU fit, the joint and JCT scores, cost, the packing
        slowdowns), and so do the relative speeds ``advantage`` weighs and where a dataset is
        staged. Everything that predicts how long a run takes reads :meth:`believed_speeds`: the
        job's predicted step, whether waiting for another pool ends it sooner
        (``single_cluster_options``), the span guard's GPU-hours bound, the rare and gang holds
        (``network.believed_jct_s``), queued and running jobs' runs, backfill, moves and speed
        probes. So the handicap tilts which GPUs a big job takes among those it may start on,
        never whether it waits, a hold, a bound or a prediction.
        """
        family = job_family(job) if self.learned else ""
        return self._job_table(job, family, self.at_risk(job, family))

    def believed_speeds(self, job: HasLabels) -> FloatArray:
        """Every model's per-GPU speed *for this job* as believed, indexed like :attr:`models`
        (cached per family): the task type's SCU speed (:meth:`speeds`, with the fp16 weights for a
        mixed-precision job: family ``…@fp16``) times what was learned for the job's family on each
        model (1.0 where nothing was)."""
        return self._job_table(job, job_family(job) if self.learned else "", False)

    def _job_table(self, job: HasLabels, family: str, risky: bool) -> FloatArray:
        task_type = job.task_type
        precision = job_precision(job)
        key = (family, task_type, precision, risky)
        table = self._speed_by_job.get(key)
        if table is None:
            table = self.speeds(task_type, precision)
            if family:
                factors = [self.learned.get((family, m), 1.0) for m in self.models]
                if risky and self.risk is not None:
                    handicap = self.risk[1]
                    factors = [
                        f if (family, m) in self.measured else f * handicap
                        for f, m in zip(factors, self.models, strict=True)
                    ]
                table = table * np.asarray(factors, dtype=np.float64)
            self._speed_by_job[key] = table
        return table

    def job_gpu_speed(self, job: HasLabels, model: str) -> float:
        """One GPU's believed speed for this job (:meth:`believed_speeds` of one model;
        :meth:`gpu_speed` for a model no node of the snapshot has): what its predicted step reads."""
        index = self.model_index.get(model)
        if index is None:
            return self.gpu_speed(model, job.task_type, job_precision(job))
        return float(self.believed_speeds(job)[index])

    def room(
        self,
        nodes: "IntArray | slice",
        per_worker: int,
        cpu_milli: int = 0,
        memory_mib: int = 0,
        *,
        idle: bool = False,
    ) -> IntArray:
        """Workers of a shape each of ``nodes`` could take by its free GPUs, CPU and RAM (with
        ``idle``, all of them: once its jobs end; a node whose CPU or RAM is not known is limited
        by its GPUs only); schedulability aside."""
        cpu = ((self.cpu_cap if idle else self.cpu_free)[nodes], self.cpu_known[nodes]) if cpu_milli else None
        mem = (
            ((self.mem_cap if idle else self.mem_free)[nodes], self.mem_known[nodes]) if memory_mib else None
        )
        gpus = (self.total if idle else self.free)[nodes]
        return workers_fit(WorkerShape(per_worker, cpu_milli, memory_mib), gpus, cpu=cpu, mem=mem)

    def region_of(self, cluster: int) -> str:
        """The region id of cluster index ``cluster``."""
        return self.clusters[cluster].region

    # ---- the cycle's own decisions -----------------------------------------------------------

    def running_ids(self) -> set[str]:
        """Ids of the jobs in :attr:`running`, kept across appends to the same list (a cycle lists
        each placement by appending): a queue of one costs no pass over every running job. A new
        list, or a shorter one, is counted afresh."""
        run = self.running
        held = self._running_ids
        if held is not None and held[0] is run and held[1] <= len(run):
            ids = held[2]
            ids.update(r.job_id for r in run[held[1] :])
        else:
            ids = {r.job_id for r in run}
        self._running_ids = (run, len(run), ids)
        return ids

    def join_queue(self, job_id: str, *, probe: bool = False) -> None:
        """``job_id`` counts in the queue (:attr:`waiting`); ``probe``: it is a speed probe, noted in
        :attr:`probes` (the framework's decisions and the simulator's skipped ones alike)."""
        self.waiting.add(job_id)
        if probe:
            self.probes.add(job_id)

    def waiting_count(self, exclude: str = "") -> int:
        """Jobs in the queue (:attr:`waiting`) other than ``exclude``."""
        return len(self.waiting) - (exclude in self.waiting)

    def work_waiting(self, exclude: str = "") -> int:
        """Jobs in the queue other than ``exclude`` and other than speed probes (:attr:`probes`):
        the queue of work that wants GPUs, which packing reads as contention."""
        waiting, count = self.waiting, self.waiting_count(exclude)
        if not count or not self.probes:
            return count
        return count - sum(1 for job_id in self.probes if job_id in waiting and job_id != exclude)

    def queue_for(self, pools: BoolArray, exclude: str = "") -> bool:
        """Whether a job of the queue other than ``exclude`` (speed probes aside:
        :meth:`work_waiting`) could use one of ``pools`` (a job's allowed (cluster, GPU model)
        pools, ``CycleState.allowed_pools``). A job waiting only for GPU models or clusters outside
        them waits for nothing the job deciding could take. A queued job without a shape
        (:attr:`queued`: a pipeline, or one its pre-filters refused) counts, as does one whose
        shape was taken on other pools (another platform's arrays)."""
        if not self.work_waiting(exclude):
            return False
        queued, probes = self.queued, self.probes
        for job_id in self.waiting:
            if job_id == exclude or job_id in probes:
                continue
            shape = queued.get(job_id)
            if shape is None or shape.pools.shape != pools.shape or bool((shape.pools & pools).any()):
                return True
        return False

    def queue_ahead(
        self,
        key: tuple[Any, ...],
        job_id: str,
        *,
        limit: int | None = None,
        skip: Container[str] = (),
    ) -> list["QueuedShape"]:
        """The queued jobs (:attr:`waiting`, with a :attr:`queued` shape) whose queue key comes
        before ``key``, in queue order (not the job ``job_id`` itself, nor those in ``skip``), the
        first ``limit`` of them. Keys of another order (a different tuple shape) never compare: such
        entries count as not ahead. Forgets entries whose job left the queue. The queue's order is
        sorted once per change of :attr:`queued` (a bisection finds what is ahead)."""
        queued = self.queued
        if len(queued) > 2 * len(self.waiting) + 64:
            for stale in [j for j in queued if j not in self.waiting]:
                del queued[stale]
        order = self._queue_sorted()
        shapes: Iterable[QueuedShape]
        try:
            if order is None:
                raise TypeError
            keys, ordered = order
            shapes = ordered[: bisect.bisect_left(keys, key)]
        except TypeError:
            # Keys of different shapes: only those comparable to ``key`` (sorted among themselves).
            comparable: list[QueuedShape] = []
            for shape in queued.values():
                try:
                    if shape.key < key:
                        comparable.append(shape)
                except TypeError:
                    continue
            try:
                comparable.sort(key=lambda s: s.key)
            except TypeError:
                comparable = [s for s in comparable if len(s.key) == len(key) and type(s.key) is type(key)]
                try:
                    comparable.sort(key=lambda s: s.key)
                except TypeError:
                    comparable = []
            shapes = comparable
        waiting = self.waiting
        ahead: list[QueuedShape] = []
        for shape in shapes:
            if limit is not None and len(ahead) >= limit:
                break
            other = shape.job_id
            if other == job_id or other not in waiting or other in skip:
                continue
            ahead.append(shape)
        return ahead

    def queue_order(self) -> list["QueuedShape"]:
        """The queued jobs (:attr:`waiting`, with a :attr:`queued` shape) in queue order (job-id
        order when their keys do not all compare)."""
        order = self._queue_sorted()
        waiting = self.waiting
        if order is None:
            return [self.queued[j] for j in sorted(waiting) if j in self.queued]
        return [shape for shape in order[1] if shape.job_id in waiting]

    def _queue_sorted(self) -> tuple[list[tuple[Any, ...]], list["QueuedShape"]] | None:
        """:attr:`queued` in queue order (keys, shapes), kept until it changes; None when its keys
        do not all compare."""
        queued = self.queued
        version = getattr(queued, "version", -1)  # a plain dict (assigned by a caller): never kept
        held = self._queue_order
        if held is not None and held[0] is queued and held[1] == version >= 0:
            return held[2]
        built: tuple[list[tuple[Any, ...]], list[QueuedShape]] | None
        try:
            ordered = sorted(queued.values(), key=lambda s: s.key)
            built = ([s.key for s in ordered], ordered)
        except TypeError:
            built = None
        self._queue_order = (queued, version, built)
        return built

    def take(
        self,
        allocations: Iterable[tuple[str, int]],
        gpus_per_worker: int = 1,
        cpu_milli: int = 0,
        memory_mib: int = 0,
    ) -> None:
        """Account for GPUs (and each worker's CPU and RAM) given to a job in this cycle."""
        self._move(allocations, -1, gpus_per_worker, cpu_milli, memory_mib)

    def give_back(
        self,
        allocations: Iterable[tuple[str, int]],
        gpus_per_worker: int = 1,
        cpu_milli: int = 0,
        memory_mib: int = 0,
    ) -> None:
        """Return GPUs to the pool (a preempted or shrunk job), within the cycle."""
        self._move(allocations, 1, gpus_per_worker, cpu_milli, memory_mib)

    def _move(
        self, allocations: Iterable[tuple[str, int]], sign: int, per_worker: int, cpu: int, mem: int
    ) -> None:
        touched: set[tuple[int, int]] = set()
        for node, gpus in allocations:
            i = self.node_index.get(node)
            if i is None:
                continue
            self.free[i] = min(max(self.free[i] + sign * gpus, 0), self.total[i])
            workers = math.ceil(gpus / max(per_worker, 1))
            # Capped both ways: a take clamped at 0 (a node given more than it had) gives back no
            # more than the node has (a simulator's snapshot, kept across a run, showed a node with
            # 90 cores free of 32 after a pipeline stage asked three times what it had).
            if cpu:
                self.cpu_free[i] = min(max(self.cpu_free[i] + sign * cpu * workers, 0), self.cpu_cap[i])
            if mem:
                self.mem_free[i] = min(max(self.mem_free[i] + sign * mem * workers, 0), self.mem_cap[i])
            touched.add((int(self.cluster_of[i]), int(self.model_of[i])))
        for c, m in touched:
            self._refresh(c, m)

    def set_schedulable(self, cluster: int, schedulable: BoolArray | bool) -> None:
        """Whether each node of cluster index ``cluster`` takes work (one flag for all, or one per
        node in node order); its pools' aggregates follow."""
        start, stop = self.slices[cluster]
        self.schedulable[start:stop] = schedulable
        self.schedulable_version += 1
        for m in range(self.free_sum.shape[1]):
            self._refresh(cluster, m)

    def _refresh(self, c: int, m: int) -> None:
        """Pool (c, m)'s free GPUs on schedulable nodes and its largest, after its nodes changed."""
        pool = self.pool(c, m)
        usable = np.where(self.schedulable[pool], self.free[pool], 0)
        self.free_sum[c, m] = int(usable.sum())
        self.max_free[c, m] = int(usable.max()) if usable.size else 0
        self.pool_version[c * self.free_sum.shape[1] + m] += 1
        self.moves += 1
