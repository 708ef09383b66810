"""What the simulator reads and writes: traces of jobs, scripted events, and per-job results.

A :class:`Trace` is a list of :class:`SimJob` (a :class:`~loom_proto.jobs.JobSpec` plus its arrival
time, class and home region) and scripted :class:`SimEvent` s (link degradation, cluster
failure, price changes). The simulator (:mod:`loom.sim.engine`) replays it against a platform
under one placement policy and returns a :class:`SimResult`: one :class:`JobRecord` per job and a
timeline of samples, from which :mod:`loom.sim.metrics` computes the figures.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from loom.errors import InvalidInputError
from loom.model.capacity import NodeCapacity
from loom.sched.framework import Outcome, QueueItem
from loom.sched.snapshot import ClusterInfo, Economics, NetMatrix, Snapshot
from loom_proto.jobs import JobSpec
from loom_proto.migrations import MAX_DRAIN_CONCURRENCY

JobClass = Literal["net_training", "training", "inference", "pipeline", "dag", "batch", "probe"]
"""How results are grouped: network-sensitive distributed training, other training, inference
services, pipeline-parallel models, DAG stages, everything else from a production trace, and the
speed probes a policy runs (:mod:`loom.sched.probe`; never a trace's own jobs)."""

EventKind = Literal[
    "link_degrade", "link_restore", "cluster_down", "cluster_up", "cluster_drain", "cluster_undrain", "price"
]
"""``cluster_drain`` closes a cluster to new work (its running jobs stay unless a migration policy
moves them: :mod:`loom.sim.migration`, at most ``concurrency`` at a time, every one left at once
past ``deadline_s``, as ``loom drain`` does); ``cluster_undrain`` opens it again."""

DRAIN_CONCURRENCY = 2
"""Moves of a drain in flight at once unless the event says otherwise (``loom drain``'s default)."""


class EventError(InvalidInputError):
    """A scripted event the simulator cannot replay: a time that is not a finite number of seconds
    >= 0 (a NaN or infinite time would never come up in the event queue), or a factor that is not
    a finite number >= 0 (a link's ``rtt_factor`` > 0)."""


@dataclass(frozen=True, slots=True)
class SimJob:
    """One job of a trace: its spec, when it arrives, its class, and where its submitter is."""

    spec: JobSpec
    arrival_s: float
    job_class: JobClass = "batch"
    home_region: str | None = None
    """The submitter's region (the fixed-home-region baseline places jobs there)."""
    parents: tuple[str, ...] = ()
    """Job ids that must complete before this one is submitted (DAG stages of a trace)."""


@dataclass(frozen=True, slots=True)
class SimEvent:
    """A scripted change at ``at_s``: a link degrades or recovers, a cluster fails or returns, is
    drained or opened again, or a region's price changes (``factor`` multiplies its base price)."""

    at_s: float
    kind: EventKind
    src: str = ""
    dst: str = ""
    cluster: str = ""
    region: str = ""
    rtt_factor: float = 1.0
    bandwidth_factor: float = 1.0
    factor: float = 1.0
    concurrency: int = DRAIN_CONCURRENCY
    """``cluster_drain``: its moves in flight at once (1 to ``MAX_DRAIN_CONCURRENCY``)."""
    deadline_s: float = 0.0
    """``cluster_drain``: seconds after which every job left moves at once, room or not (0: none)."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.at_s) and self.at_s >= 0):
            raise EventError(f"{self.kind} event: at_s must be a finite time >= 0, got {self.at_s}")
        if not 1 <= self.concurrency <= MAX_DRAIN_CONCURRENCY:
            raise EventError(self._bad("concurrency", f"within 1-{MAX_DRAIN_CONCURRENCY}", self.concurrency))
        if not (math.isfinite(self.deadline_s) and self.deadline_s >= 0):
            raise EventError(self._bad("deadline_s", ">= 0", self.deadline_s))
        # A link's bandwidth is never 0 in the model (a link cut off is a cluster down, or a tiny
        # factor): a factor of 0 was accepted and left the bandwidth as it was.
        for name, value in (("rtt_factor", self.rtt_factor), ("bandwidth_factor", self.bandwidth_factor)):
            if not (math.isfinite(value) and value > 0):
                raise EventError(self._bad(name, "> 0", value))
        if not (math.isfinite(self.factor) and self.factor >= 0):
            raise EventError(self._bad("factor", ">= 0", self.factor))

    def _bad(self, name: str, bound: str, value: float) -> str:
        what = "an integer" if name == "concurrency" else "a finite number"
        return f"{self.kind} event at {self.at_s:g} s: {name} must be {what} {bound}, got {value}"


@dataclass
class Trace:
    """Jobs (in arrival order) and scripted events, with where they came from."""

    jobs: list[SimJob]
    events: list[SimEvent] = field(default_factory=list)
    source: str = ""

    def __post_init__(self) -> None:
        self.jobs.sort(key=lambda j: (j.arrival_s, j.spec.job_id))
        self.events.sort(key=lambda e: e.at_s)


@dataclass
class JobRecord:
    """What happened to one job under one policy (times in simulated seconds)."""

    job_id: str
    job_class: JobClass
    tenant: str
    arrival_s: float
    start_s: float | None = None
    end_s: float | None = None
    clusters: tuple[str, ...] = ()
    regions: tuple[str, ...] = ()
    gpus: int = 0
    gpu_model: str = ""
    step_s: float = 0.0
    """Simulated seconds per step where it ran (compute + communication)."""
    compute_step_s: float = 0.0
    """The compute part of a step alone."""
    belief_step_s: float = 0.0
    """What the scheduler expected ``step_s`` to be where it last ran (its profiles and what it had
    learned: ``predict_step_s`` with the snapshot's speeds). Equal to ``step_s`` when timed by belief."""
    belief_compute_step_s: float = 0.0
    """The compute part of :attr:`belief_step_s`."""
    truth_rule: str = ""
    """How the true speed of its slowest part was found (:class:`loom.sim.truth.TrueSpeed` ``rule``:
    ``measured`` or the derivation rules); empty when timed by belief."""
    scu_hours: float = 0.0
    cost: float = 0.0
    """GPU-hours at the regions' prices."""
    transfer_cost: float = 0.0
    """Bytes moved between regions at the clouds' data-transfer prices (:mod:`loom.model.egress`)."""
    cross_region_bytes: float = 0.0
    restarts: int = 0
    rejected: str | None = None

    @property
    def jct_s(self) -> float | None:
        """Completion time: arrival to end (None while unfinished)."""
        return None if self.end_s is None else self.end_s - self.arrival_s

    @property
    def queue_s(self) -> float | None:
        """Queueing delay: arrival to first start."""
        return None if self.start_s is None else self.start_s - self.arrival_s


@dataclass
class Sample:
    """A point of the timeline: GPUs in use, and cross-region bytes moved so far."""

    t_s: float
    gpus_used: int
    gpus_total: int
    cross_region_bytes: float


@dataclass(frozen=True, slots=True)
class ProgressReport:
    """A run's progress report as the simulated agent makes it (the first, a tenth of the way in:
    ``engine.OBSERVE_AT``): what placement's book takes from a ``JobProgress``."""

    t: float
    job_id: str
    fraction: float
    """Share of the job's steps done (its checkpoint's included)."""
    began_s: float
    """When the run's first step began (``JobStarted.started_at``: placement's book measures its
    pace from then)."""


@dataclass
class SimResult:
    """One policy's run over one trace."""

    policy: str
    records: list[JobRecord]
    timeline: list[Sample]
    wall_s: float = 0.0
    decisions: int = 0
    peak_rss_mib: float = 0.0
    notes: list[str] = field(default_factory=list)
    probes: list[JobRecord] = field(default_factory=list)
    """Speed probes the policy ran (:mod:`loom.sched.probe`): kept apart from :attr:`records`, so job
    statistics and comparisons are over the trace's jobs; their GPU-hours and cost count in the totals."""
    migration: dict[str, Any] | None = None
    """The migration policy's figures (:meth:`loom.sim.migration.Migrator.figures`); None without one."""
    reports: list[ProgressReport] = field(default_factory=list)
    """Every run's progress report, in time order (a replay feeds them to placement's book)."""
    plugin_errors: int = 0
    """Decisions a scheduling plugin failed in (an exception: the job stayed queued, as placement
    keeps it, and :attr:`notes` say which): a benchmark whose runs had any is not to be believed."""

    def finished(self) -> Sequence[JobRecord]:
        """Jobs that completed."""
        return [r for r in self.records if r.end_s is not None]


@dataclass
class Platform:
    """What a simulation runs on: nodes, clusters, the measured network, prices, speeds."""

    name: str
    nodes: list[NodeCapacity]
    clusters: dict[str, ClusterInfo]
    net: NetMatrix
    economics: Economics
    speed: dict[tuple[str, str], float]
    """(gpu_model, task_type) -> one GPU's SCU for the task type (the model placement believes)."""
    gpu_memory_gib: dict[str, float]
    half_speed: dict[tuple[str, str], float] = field(default_factory=dict)
    """(gpu_model, task_type) -> the SCU for mixed-precision jobs (family ``…@fp16``); where a key
    is missing, :attr:`speed`'s."""

    def snapshot(self, now: float = 0.0) -> Snapshot:
        """A fresh scheduling snapshot of the idle platform."""
        return Snapshot(
            self.nodes,
            clusters=self.clusters,
            net=self.net,
            economics=self.economics,
            speed=self.speed,
            half_speed=self.half_speed,
            gpu_memory_gib=self.gpu_memory_gib,
            now=now,
        )


class Policy(Protocol):
    """A placement policy: Loom's default profile, or a baseline. Decides for a queue, in order,
    applying each decision to the snapshot before the next job's turn (like
    :meth:`~loom.sched.framework.Framework.schedule_many`)."""

    name: str

    def decide(self, queue: Sequence[QueueItem], snap: Snapshot) -> list[tuple[QueueItem, Outcome]]: ...
