"""Discrete-event simulation of a placement policy over a trace, driving the real scheduling core.

:func:`simulate` replays a :class:`~loom.sim.model.Trace` on a :class:`~loom.sim.model.Platform`
under one :class:`~loom.sim.model.Policy` in simulated time. Placement is the policy's own
framework (:mod:`loom.sim.policies`) deciding on one :class:`~loom.sched.snapshot.Snapshot` kept for
the whole run, as the placement service keeps its book's snapshot: decisions take GPUs in it,
completions give them back, and every placed job is in ``snap.running`` (as
``services/placement/book.py`` builds it) so preemption, elastic shrink and affinity see it. The
simulator copies none of the scheduling logic; it only applies decisions as the service does
(victims stopped and requeued, shrunk jobs resized, pipeline parts started together).

**Events** (a heap, in simulated seconds): arrivals, completions, the trace's scripted
:class:`~loom.sim.model.SimEvent` s and periodic samples. All events of one instant are applied,
then one scheduling pass runs, in queue order (the policy's queue sort):

* jobs that arrived (or were requeued) at this instant get one decision each;
* if GPUs were released (a completion, a cluster coming back, preemption leaving room), waiting
  jobs that could use them are retried (``max_decisions_per_event`` decisions a pass; a pass that
  runs out goes on, where it stopped, in a pass at the same instant). Waiting jobs
  are grouped by *shape* (priority, GPUs, CPU and RAM per worker, minimum workers, whether it may
  span, allowed models and clusters, anti-affinity; for spanning gangs also task type, size and a traffic
  class; a spanning gang no pool can ever hold is a shape of its own, since whether any spread of
  it keeps within the span guard's GPU-hours bound hangs on its own compute and traffic, so it is
  decided, and rejected if not, on arrival) and the jobs of a shape are taken as alike for
  feasibility. A shape is retried only if a
  released (cluster, model) pool of it now holds its minimum workers (whole workers per node, and
  for the job retried its CPU and RAM too; gangs that may span: over all its pools, but only while
  no pool of it holds them, as the framework spreads only then; pipelines: over all) and holds more than
  when a job of the shape last failed, or, for a job asking CPU or RAM, a released pool has room for
  it counted with them (whole-worker counts do not say which node freed); once a job of a shape
  finds nothing fits in a pass the rest of it waits, each counted in the queue at its place in the
  queue order (placement decides them and finds the same). A job held back by a permit's choice
  (waiting for faster GPUs) says nothing of the next one: the shape's next job is decided too.
  A permit's patience ends with a wake event deciding that job again even if nothing changed (as
  placement retries it when its backoff, at most that patience, ends).
  These are necessary conditions read from the snapshot, so a retry is skipped only where the
  decision could not have placed the job by free capacity. So waiting jobs are not re-scored
  on every event;
* an arriving job whose shape is known to be possible on this platform, that no pool could hold,
  and for which preemption or elastic shrink could not make room (free GPUs plus those of
  lower-priority preemptible jobs and of shrinkable elastic jobs, per pool: the bound both
  post-filters start from), nor ``rare_room`` move a job (one worker of a rare shape, a
  preemptible job of no higher priority running in one of its pools:
  :func:`~loom.sched.plugins.rare.room_possible`), is queued without a decision;
* when GPUs were released and every ``retry_every_s`` (placement's longest backoff, 30 s), shapes
  for which preemption, elastic shrink or ``rare_room`` could make room get one retry (placement
  retries every queued job when capacity changes, and on its backoff); after a link changes every
  waiting shape gets one (placement weighs the network).

:attr:`SimResult.notes` say how many decisions were made for arrivals and for retries.
Rejected jobs (UNRESOLVABLE) are recorded with the reason and dropped; a DAG stage of a rejected
parent is rejected too.

**Truth and belief.** A job is timed by the *truth* (:mod:`loom.sim.truth`: measured throughput
tables the scheduler cannot see; the packaged Gavel + Lambda tables unless ``simulate(...,
truth=...)`` says otherwise), and the scheduler's *belief* is recorded next to it. The belief is
:func:`loom.sched.plugins.network.predict_step_s` on the decision's parts with the speeds placement
believes (``Snapshot.job_gpu_speed``: SCU x what was learned, x the cluster's trust; a big job's
handicap on untried models ranks candidates only and is not in it):
``compute = step_time_s / speed`` of the slowest part, plus a ring all-reduce over the slowest link
between the parts' regions; exactly what the ``jct`` plugin binds as ``predicted_step_s`` for Loom,
computed here for every policy. The truth is the same network model on the parts' *true* speeds
(:meth:`~loom.sim.truth.Truth.job_speed` of the job's family and batch on each part's GPU model,
at the most GPUs the part holds on one node, for the intra-node scaling; trust is the
scheduler's caution, not the hardware's, so it does not apply), the compute times this run's noise
(:meth:`~loom.sim.truth.Truth.noise_factor` of the job id, attempt and ``seed``). A pipeline's true
step is the planner's step times its bottleneck (slowest stage compute or transfer) recomputed
with the true speeds over the same recomputed with the believed ones. ``truth=BELIEF`` times every
job by the belief (no noise), as the simulator did before truth existed. Either way the run's
``compute_s`` is what it delivered (what a learner observes) and ``belief_compute_s`` what the
scheduler expected.
Communication that declares no latency-bound rounds (``comm.rounds_per_step == 0``) is
taken to overlap the compute (bucketed gradient exchange during the backward pass): the step is
``max(compute, comm)`` instead of the sum. An inference step also waits the mean round trip from
its users (its ``affinity.prefer_regions``) to the lead's region, as the ``jct`` plugin scores it.
Pipelines take the pipeline planner's bottleneck step
(the decision's ``predicted_step_s``). An elastic job given ``w`` of its ``W`` workers runs at
``w / W`` of its speed (as the cluster agent's simulator does). A dataset not held in the lead's
region is copied first: ``after_sync`` jobs hold their GPUs and wait for the copy
(``NetMatrix.transfer_s`` from the holder that delivers it soonest, the data plugin's model);
``while_syncing`` jobs start at once and take :func:`loom.sched.plugins.data.data_delay_s` longer.
A job that restarts in a region it already copied its dataset to does not copy it again. The
duration of a run is ``wait + steps_left x step_s`` (+ the reading delay).

**Changes during a run.** A degraded or restored link re-times the running data-parallel jobs whose
parts span it, and the running inference jobs served from another region than their users (their
step waits the users' round trip); work done so far is kept; pipelines keep their planned step. A
shrunk elastic job is re-timed for its new worker count. A job stopped by preemption (or by
``rare_room``, to make room for a rare worker shape) or by its cluster failing is requeued
(``restarts`` + 1) and resumes from its last checkpoint when ``work.checkpoint_every_steps`` is set,
else from scratch. Progress of running jobs is not reported to preemption (it sees 0), and elastic
jobs are not grown back (only shrunk).

**Records.** ``start_s`` is the first placement (the GPUs are held from then, also while a dataset
is copied); ``arrival_s`` the time the job entered the queue (a DAG stage: when its last parent
completed). ``step_s`` is the simulated (true) seconds per step where it last ran (elastic scaling
included) and ``compute_step_s`` its compute part; ``belief_step_s`` and ``belief_compute_step_s``
what the scheduler expected them to be, ``truth_rule`` how the slowest part's true speed was found.
``scu_hours`` sums GPUs x delivered speed (true speed / noise; by belief: SCU x trust) x hours held,
``cost`` GPUs x the region's price (at the run's start) x hours held, over every run;
``transfer_cost`` the bytes moved between regions (below) at the clouds' list prices for data
transfer (:mod:`loom.model.egress`): a policy's total cost is both.
``cross_region_bytes``: per step of a data-parallel job whose parts span ``k`` > 1 regions,
``2 x bytes_per_step x k`` (a ring all-reduce crosses a region boundary ``k`` times, each
carrying about twice the gradient); per step of a pipeline, the activations of each stage boundary
between regions; plus the dataset's size for each copy to a new region. Tenant quotas are open
(the default profile's quota book admits every tenant).

A trace job with ``stages`` (a DAG job) is split with :func:`loom.sched.dag.expand` into one job
per stage, each released when the stages it depends on have completed.
"""

import dataclasses
import heapq
import math
import resource
import sys
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

from loom.model.capacity import NodeCapacity
from loom.model.egress import ring_price_per_gb, transfer_price_per_gb
from loom.model.family import job_family
from loom.model.learn import HeldLessons, RunSpeed, SpeedLearner, run_speed, teaches_while_running
from loom.model.profiles import speeds_for_model
from loom.model.topology import Topology, load_topology
from loom.sched import dag
from loom.sched.cycle import (
    MAX_BACKOFF_S,
    CycleSettings,
    expected_end_s,
    fair_share_of,
    grow_around,
    progress_end_s,
    quota_standing,
    run_cycle,
)
from loom.sched.elastic import resized_end_s
from loom.sched.framework import Decision, Outcome, QueueItem
from loom.sched.pipeline import transfer_s
from loom.sched.plugins.backfill import Backfill
from loom.sched.plugins.cost import default_economics
from loom.sched.plugins.data import data_delay_s
from loom.sched.plugins.network import predict_step_s, users_wait_s
from loom.sched.plugins.rare import RareFit, RareRoom, hold_possible, room_possible
from loom.sched.probe import ProbeSettings, is_probe, probe_gate
from loom.sched.quota import OPEN, QuotaBook
from loom.sched.snapshot import (
    BoolArray,
    ClusterInfo,
    IntArray,
    NetMatrix,
    RunningJob,
    Snapshot,
    WorkerShape,
    allowed_pools,
)
from loom.sched.staging import staging_plan
from loom.sim.migration import MigrationPolicy, Migrator
from loom.sim.model import (
    JobRecord,
    Platform,
    Policy,
    ProgressReport,
    Sample,
    SimEvent,
    SimJob,
    SimResult,
    Trace,
)
from loom.sim.policies import FrameworkPolicy, OraclePolicy
from loom.sim.truth import BELIEF, BeliefTiming, Truth, load_truth
from loom.sim.workloads import check_regions
from loom_proto.jobs import DataSpec, JobSpec, JobSubmitted

__all__ = ["platform_from_topology", "simulate"]

_COMPLETE: Final = 0
_SCRIPTED: Final = 1
_ARRIVAL: Final = 2
_CONTINUE: Final = 3
_WAKE: Final = 4
_SAMPLE: Final = 5
_OBSERVE: Final = 6
_RETRY: Final = 7
"""Event kinds; at one instant completions are applied first, then samples, lessons and retries. A
wake retries the shape of a waiting job when a permit's wait (``Status.wait_s``: patience running
out) ends; a lesson teaches the speed learner what a run measured (:data:`OBSERVE_AT`); a retry
decides again the queued jobs post-filters could make room for (:data:`RETRY_EVERY_S`)."""
RETRY_EVERY_S: Final = MAX_BACKOFF_S
"""The clock of those retries (placement's longest backoff, :data:`~loom.sched.cycle.MAX_BACKOFF_S`):
a tick every this many seconds from the first event, whatever else happens, while such jobs wait
(none is kept otherwise: a run of months would tick for nothing)."""
OBSERVE_AT: Final = 0.1
"""A run reports progress once it is this share of its way through its steps (the cluster agent
reports every tenth of a run's steps): its predicted end is then re-predicted from its measured pace,
and the compute seconds per step the report carries (``JobProgress.compute_step_s``) teach the speed
learner, once per run."""

MAX_SAMPLES: Final = 100_000
"""The most points a run's timeline keeps (:meth:`_Simulation._thin_timeline`)."""

Pair = tuple[int, int]
"""(cluster index, model index) of the snapshot: one pool of GPUs."""


# ---- platform ---------------------------------------------------------------------------------


def platform_from_topology(
    topology: Topology | None = None, *, nodes: int | None = None, seed: int = 0, name: str | None = None
) -> Platform:
    """A platform from a topology (the packaged default when None): its nodes, clusters (trust 1),
    measured network, the default prices and carbon, and each GPU model's SCU per task type.

    ``nodes``: scale to that many nodes as ``loom bench placement`` does: the topology's clusters
    replicated whole (replica ``k`` of ``c-use2-a`` is ``c-use2-a-r{k}``, same region and zone,
    node ids suffixed ``-r{k}``) while they fit, then one partial replica in which every cluster
    keeps a seeded sample of its nodes in proportion to its size (the model mix holds at any size).
    """
    topology = topology or load_topology()
    records = replicate(topology, nodes, seed) if nodes is not None else _nodes_of(topology, "")
    cluster_ids = sorted({n.cluster for n in records})
    first = {n.cluster: n for n in reversed(records)}
    clusters = {
        cid: ClusterInfo(id=cid, region=first[cid].region, zone=first[cid].zone) for cid in cluster_ids
    }
    models = sorted({n.gpu_model for n in records if n.gpu_model is not None})
    speed: dict[tuple[str, str], float] = {}
    half_speed: dict[tuple[str, str], float] = {}
    memory: dict[str, float] = {}
    for model in models:
        # A model without a profile is unprofiled: counted at the trust floor, never at 1.0.
        tables = speeds_for_model(model)
        speed.update({(model, t): v for t, v in tables.speed.items()})
        half_speed.update({(model, t): v for t, v in tables.half_speed.items()})
        memory[model] = tables.memory_gib
    size = f"-{len(records)}" if nodes is not None else ""
    return Platform(
        name=name or f"{topology.name}{size}",
        nodes=records,
        clusters=clusters,
        net=NetMatrix.from_topology(topology),
        economics=default_economics(),
        speed=speed,
        gpu_memory_gib=memory,
        half_speed=half_speed,
    )


def _nodes_of(
    topology: Topology, suffix: str, keep: dict[str, list[int]] | None = None
) -> list[NodeCapacity]:
    out: list[NodeCapacity] = []
    for cluster in topology.clusters:
        members = [n for n in cluster.nodes if n.gpu_model is not None]
        if keep is not None:
            members = [members[i] for i in keep.get(cluster.id, [])]
        out.extend(
            NodeCapacity(
                node=f"{n.id}{suffix}",
                cluster=f"{cluster.id}{suffix}",
                region=cluster.region,
                zone=cluster.zone,
                gpu_model=n.gpu_model,
                gpus_total=n.gpus,
                cpu_milli=n.cpu_milli,
                memory_mib=n.memory_mib,
            )
            for n in members
        )
    return out


def replicate(topology: Topology, nodes: int, seed: int) -> list[NodeCapacity]:
    """``nodes`` node records: the topology's clusters replicated whole (ids suffixed ``-r{k}``),
    then one partial replica keeping a seeded sample of every cluster in proportion to its size."""
    rng = np.random.default_rng(seed)
    sizes = {c.id: sum(1 for n in c.nodes if n.gpu_model is not None) for c in topology.clusters}
    sizes = {cid: s for cid, s in sizes.items() if s}
    per_replica = sum(sizes.values())
    whole, left = divmod(max(nodes, 0), per_replica)
    ids = list(sizes)
    exact = np.array([sizes[cid] * left / per_replica for cid in ids])
    share = np.floor(exact).astype(np.int64)
    for k in np.argsort(-(exact - share), kind="stable")[: left - int(share.sum())]:
        share[k] += 1
    out: list[NodeCapacity] = []
    for replica in range(whole):
        out.extend(_nodes_of(topology, f"-r{replica}" if replica else ""))
    keep = {
        cid: sorted(rng.choice(sizes[cid], size=int(share[k]), replace=False).tolist())
        for k, cid in enumerate(ids)
    }
    out.extend(_nodes_of(topology, f"-r{whole}" if whole else "", keep))
    return out


# ---- the simulation's own books ----------------------------------------------------------------


@dataclass(eq=False)
class _Shape:
    """Waiting jobs that are alike for placement: same priority, GPUs, CPU and RAM per worker,
    minimum workers, spanning, allowed models and clusters. Their feasibility is read from the
    snapshot's aggregates."""

    key: tuple[Any, ...]
    pools: BoolArray
    """(cluster, model) pools the shape may use (its hard rules; CPU and RAM are not checked)."""
    need: int
    """GPUs it needs at least: in one pool, or over all its pools when it may span clusters."""
    per_worker: int
    spans: bool
    pipeline: bool
    priority: int
    index: int
    worker: WorkerShape | None = None
    """One worker's GPUs, CPU and RAM when its jobs start with one worker (what ``rare_room`` may
    make room for); None otherwise."""
    apart: bool = False
    """Its jobs keep apart from running jobs (``affinity.apart_from_jobs``), or the policy keeps
    pools for waiting gangs (``backfill``): a failure may be that rule's, which lifts when such a
    job ends (or a claim is given up) without any pool gaining workers, so none is taken as final
    (it is retried whenever capacity changes and a pool of it holds it, as placement retries every
    queued job)."""
    heap: list[tuple[tuple[Any, ...], int, str]] = field(default_factory=list)
    seen: IntArray | None = None
    """Workers each pool held when a job of this shape last failed: it is retried only once a
    pool of it holds more (None: no failure since its last placement)."""
    resolvable: bool = False
    """A job of this shape got an answer other than UNRESOLVABLE: the platform can hold it."""
    queued: bool = True
    """The last job of this shape left waiting found nothing fits (so it joined the queue the
    framework counts), rather than being held back by a permit's choice."""
    refused: bool = False
    """The last job of this shape left waiting had a decision refused by a permit (room made by
    preemption or a shrink, say, that its own run did not pay for): says nothing of the next job."""


@dataclass(eq=False)
class _Run:
    """One attempt of a job holding GPUs."""

    decision: Decision
    core: RunningJob
    pairs: list[Pair]
    lead_pair: Pair
    lead_gpus: int
    """GPUs of the lead part (what preemption frees where the run leads)."""
    gpus: int
    placed_s: float
    compute_start_s: float
    seg_start_s: float
    seg_steps: float
    end_s: float
    step_s: float
    """Seconds per step here (elastic scaling included)."""
    compute_s: float
    """TRUE compute seconds per step (unscaled): what the run delivered, what a learner observes."""
    raw_step_s: float
    """True seconds per step with every worker (what the alpha learner observes)."""
    speeds: list[float]
    """Per part, the speed the scheduler believed (``Snapshot.job_gpu_speed`` x trust)."""
    true_speeds: list[float]
    """Per part, the true per-GPU speed (:mod:`loom.sim.truth`; the believed one when timing by belief)."""
    noise: float
    """This run's run-to-run factor on the compute step (1.0 when timing by belief)."""
    belief_compute_s: float
    """Compute seconds per step the scheduler expected (``predict_step_s`` with :attr:`speeds`)."""
    belief_step_s: float
    """Seconds per step with every worker the scheduler expected."""
    regions: list[str]
    pipeline: bool
    cross_bytes_per_step: float
    cross_cost_per_step: float
    """USD the bytes a step moves between regions cost (:mod:`loom.model.egress`)."""
    scu_rate: float
    """Sum over parts of GPUs x delivered speed (true speed / noise; SCU x trust by belief)."""
    cost_rate: float
    """Sum over parts of GPUs x price per GPU-hour (at the run's start)."""
    acct_s: float
    """Accounting (GPU-hours, cost) is settled up to here."""
    paced: tuple[float, float] | None = None
    """(when, share of the job's steps done) its pace is measured from, as placement's book keeps
    it (``Run.paced``): its first step at start, its report after; None after a resize (measured
    afresh from its next report)."""
    serial: int = 0
    """This run's number within the simulation (its lesson event names it)."""
    taught: bool = False
    """Whether the run has taught the speed learner (once per run: at its first progress report, or
    at completion when it had none)."""

    def progress(self, now: float) -> float:
        """Steps of the current segment done by ``now``."""
        begin = max(self.seg_start_s, self.compute_start_s)
        if now <= begin or self.end_s <= begin:
            return self.seg_steps if now >= self.end_s else 0.0
        return self.seg_steps * min((now - begin) / (self.end_s - begin), 1.0)


@dataclass(eq=False)
class _Job:
    sim: SimJob
    spec: JobSpec
    record: JobRecord
    shape: _Shape
    item: QueueItem
    key: tuple[Any, ...]
    steps_left: float
    index: int
    parents_left: int = 0
    children: list[str] = field(default_factory=list)
    run: _Run | None = None
    generation: int = 0
    data_regions: set[str] = field(default_factory=set)
    staged: dict[str, float] = field(default_factory=dict)
    """Region -> when the dataset's staging copy there is done (``stage_data``: begun when queued)."""
    done: bool = False
    first_s: float | None = None
    """When it first arrived (a job held for speed probes enters the queue later)."""
    entered: bool = False
    """Whether it entered the queue (a held job's later arrival events are then stale)."""

    # What a cycle reads of a queued job (loom.sched.cycle.Pending).
    @property
    def job(self) -> JobSpec:
        return self.item.job

    @property
    def attempt(self) -> int:
        return self.item.attempts

    @property
    def avoid(self) -> frozenset[str]:
        return frozenset()

    @property
    def tries(self) -> int:
        return 0

    @property
    def fair_share(self) -> float | None:
        return self.item.fair_share

    @property
    def queued_s(self) -> float | None:
        return self.first_s


@dataclass(slots=True)
class _Event:
    """Something that happens at ``t``; the heap orders ``(t, kind, seq)``."""

    t: float
    kind: int
    seq: int
    job_id: str = ""
    generation: int = 0
    run: int = 0
    """A lesson's run (:attr:`_Run.serial`): resizes and retimings raise the job's generation but
    keep the run."""
    scripted: SimEvent | None = None


_CYCLE = CycleSettings(settled=True, grow=False)
"""The simulator's cycles: the platform is known from the start (a job no cluster holds is rejected
at once), and growth is decided by the pass (:meth:`_Simulation._grow`) once nothing waits."""


def _overlaps(spec: JobSpec) -> bool:
    """Communication without latency-bound rounds overlaps the compute (see the module docstring)."""
    return spec.comm is not None and spec.comm.rounds_per_step == 0


def _copy_net(net: NetMatrix) -> NetMatrix:
    return NetMatrix(
        net.regions, net.rtt_ms.copy(), net.bandwidth_gbps.copy(), net.loss.copy(), net.degraded.copy()
    )


def _default_sort_key(item: QueueItem) -> tuple[Any, ...]:
    return (-item.job.priority, item.submitted_at, item.job.job_id)


@dataclass(slots=True)
class _PassState:
    """One scheduling pass (:meth:`_Simulation._pass`), kept whole across a budget's end."""

    pairs: set[Pair]
    """Pools released since the pass before, and those a decision of this pass released in a pass
    that decides the whole queue (see ``whole``)."""
    retry_post: bool
    retry_all: bool
    heap: list[tuple[tuple[Any, ...], int, int, "_Job | _Shape"]] = field(default_factory=list)
    """Jobs that arrived and shapes that are due, in queue order."""
    failed: set[int] = field(default_factory=set)
    """Shapes a job of which found nothing fits in this pass: the rest of them wait."""
    decided: set[str] = field(default_factory=set)
    set_aside: list[tuple["_Shape", tuple[Any, ...]]] = field(default_factory=list)
    """Jobs decided in this pass taken off their shape's heap, so that its next job is decided:
    a job held back by a permit's choice says nothing of the next one (placement decides every
    queued job after capacity changed). Put back once the pass is over."""
    started: bool = False
    """Whether the due shapes were read (once, when the pass began)."""
    due: set[int] = field(default_factory=set)
    """The shapes due when the pass began (their queued jobs are those placement decides), and
    those that came due by a release in it (see ``whole``)."""
    whole: bool = False
    """Capacity changed before the pass (or the network did): placement's cycle decides every
    queued job, so GPUs released by a decision in it are open to the queued jobs after it."""


class _Simulation:
    """The state of one run; :meth:`run` plays the events."""

    # PLR0915: the run's state, initialised in one place.
    def __init__(  # noqa: PLR0915
        self,
        trace: Trace,
        platform: Platform,
        policy: Policy,
        *,
        sample_every_s: float,
        retry_every_s: float,
        max_decisions_per_event: int,
        horizon_s: float | None,
        learner: SpeedLearner | None = None,
        truth: Truth | None = None,
        seed: int = 0,
        migration: MigrationPolicy | None = None,
        stage_data: bool = False,
    ) -> None:
        self.truth = truth
        """Where true speeds come from; None: time by the scheduler's belief."""
        self.stage_data = stage_data
        """Copy a queued job's dataset while it waits (:func:`loom.sched.staging.staging_plan`)."""
        self.seed = seed
        self.policy = policy
        self.fast = policy if isinstance(policy, FrameworkPolicy) else None
        own = self.fast.speed_learner if self.fast is not None else None
        knows = isinstance(policy, OraclePolicy)  # the truth is its learned table: nothing to learn
        self.held_lessons: HeldLessons[tuple[str, int], _Run] = HeldLessons()
        """Slow runs' mid-run lessons waiting for another node to agree (:class:`HeldLessons`)."""
        self.speed_learner = (
            (learner if learner is not None else own) if truth is not None and not knows else None
        )
        """Learns each family's speed per GPU model from completed runs (see :meth:`_learn_speed`): the
        one given, else the policy's own (``FrameworkPolicy.speed_learner``); none when jobs are timed
        by the belief (a run then delivers exactly what was believed: there is nothing to learn) or
        for the oracle (whose learned table is the truth, set once by its ``prepare``)."""
        self.probe: ProbeSettings | None = (
            getattr(self.fast, "probe", None) if self.speed_learner is not None else None
        )
        """Speed probes (:mod:`loom.sched.probe`) of a learning policy that probes (``loom``)."""
        self.probing: dict[str, int] = {}
        """Family -> its probes that hold its jobs: running, or not yet decided."""
        self.holding: set[str] = set()
        """Probes that hold their family's jobs (:meth:`_probe_done` lets go)."""
        self.held: dict[str, list[_Job]] = {}
        """Family -> jobs held out of the queue for its probes."""
        self.probes: list[_Job] = []
        """Probe jobs (their records are kept apart from the trace's: ``SimResult.probes``)."""
        self.sort_key = self.fast.sort_key if self.fast is not None else _default_sort_key
        self.sample_every_s = sample_every_s
        self.retry_every_s = retry_every_s
        """The clock of the retries of queued jobs that post-filters could make room for (0: none;
        see :data:`RETRY_EVERY_S`)."""
        self.budget = max(int(max_decisions_per_event), 1)
        self.horizon_s = horizon_s
        self.platform = platform
        self.notes: list[str] = []
        self.plugin_errors = 0
        self.heap: list[tuple[float, int, int, _Event]] = []
        self.seq = 0
        self.pending = 0
        """Events in the heap other than samples."""
        self.runs_started = 0
        """Runs started so far (each run's :attr:`_Run.serial`)."""
        self.t = 0.0
        self.decisions = 0
        self.retries = 0
        """Decisions for jobs that had waited (the rest are for arriving or requeued jobs)."""
        self.skipped = 0
        """Arriving or requeued jobs queued without a decision (they could not have fitted)."""
        self.jobs: dict[str, _Job] = {}
        self.order: list[_Job] = []
        self.shapes: dict[tuple[Any, ...], _Shape] = {}
        self.beyond: dict[tuple[Any, ...], bool] = {}
        """Per spanning gang shape: no pool it may use can ever hold it (:meth:`_beyond_every_pool`)."""
        self.waiting: dict[tuple[Any, ...], _Shape] = {}
        """Shapes with jobs waiting."""
        self.fresh: list[_Job] = []
        self.dirty: set[Pair] = set()
        self.started_in_pass: set[str] = set()
        """Jobs this pass started: a later job of it that shrinks one frees nothing for the queue
        (placement settles a shrink of its cycle's own placement as a smaller placement,
        :func:`~loom.sched.cycle.fold_within`, and retries no one for it)."""
        self.released: set[Pair] = set()
        """Pools a decision's preemption or shrinks released (read right after it, :meth:`_pass`)."""
        self.suspended: _PassState | None = None
        """A pass whose budget ran out: the pass at the same instant takes it up where it stopped
        (the same queue, the same jobs decided), as placement's one cycle decides every queued job."""
        self.retry_post = False
        self.retry_all = False
        """The network changed: every waiting shape is retried once (within the budget)."""
        self.wakes: dict[str, float] = {}
        """Job id -> when its queued wake fires (one per job)."""
        self.reports: list[ProgressReport] = []
        """Each run's progress report (:attr:`SimResult.reports`)."""
        self.woken: set[str] = set()
        """Jobs whose permit wait ended, to be decided in this pass whatever changed (never
        skipped as "nothing fits its shape": the wait was the choice, placement decides it)."""
        self.by_cluster: dict[str, set[str]] = {}
        self.spanning: set[str] = set()
        self.serving: set[str] = set()
        """Running inference jobs whose users are in another region than their lead (their step
        waits the users' round trip: re-timed when a link changes)."""
        """Running data-parallel jobs whose parts span regions (re-timed when a link changes)."""
        self.freeable: dict[int, IntArray] = {}
        """Priority -> per (cluster, model) pool, GPUs of preemptible running jobs' lead parts
        (what preemption could free for a job of higher priority)."""
        self.spare: dict[int, IntArray] = {}
        """Priority -> per pool, GPUs elastic running jobs hold above their minimum (what a shrink
        could free for a job of that priority or higher)."""
        self.whole: dict[int, IntArray] = {}
        """Workers of that many GPUs the free GPUs of each pool hold (see :meth:`_workers`)."""
        self.holders = Counter[tuple[str, int]]()
        """("freeable" or "spare", priority) -> running jobs counted there."""
        self.rare_room = self.fast is not None and any(
            isinstance(post, RareRoom) for post in self.fast.framework.post_filters
        )
        """The policy may move a running job to make room for a rare worker shape (``rare_room``):
        a waiting job of such a shape is then decided, not skipped, while one could."""
        self.rare_hold = self.fast is not None and any(
            isinstance(f, RareFit) for f in self.fast.framework.filters
        )
        """The policy may keep a node from a job for queued jobs of a rarer worker shape (``rare_fit``'s
        hold): whether it does reads the job's own run, so while one could, a job of a shape that
        found nothing fits is not taken for every job of that shape (:meth:`_may_be_held`)."""
        self.kept_pools = self.fast is not None and any(
            isinstance(f, Backfill) for f in self.fast.framework.filters
        )
        """The policy keeps pools for waiting gangs (``backfill``): a job may fail with room there
        (see :attr:`_Shape.apart`)."""
        self.gpus_used = 0
        self.elastic = 0
        """Elastic runs holding GPUs (growth is looked for only when there are some)."""
        self.cross_bytes = 0.0
        self.staged_copies = 0
        self.timeline: list[Sample] = []
        self.samples_thinned = 0
        """How many times the timeline was thinned (:meth:`_thin_timeline`)."""
        first = min([j.arrival_s for j in trace.jobs] + [e.at_s for e in trace.events], default=0.0)
        self.t = first
        self.snap = platform.snapshot(now=first)
        if self.speed_learner is not None:
            # A big job's bet on GPU models its family never ran on, as placement weighs it.
            settings = self.speed_learner.settings
            self.snap.set_risk(settings.risk_gpu_hours, settings.risk_factor)
        self.snap.quota = QuotaBook(OPEN, {})
        """What each tenant holds (an open platform: no quotas), as placement's book keeps it: the
        tenants' fair shares, which order the queue, are read from it."""
        self.snap.net = _copy_net(platform.net)
        self.base_net = _copy_net(platform.net)
        self.schedulable0 = self.snap.schedulable.copy()
        self.running_list = self.snap.running
        self.position: dict[str, int] = {r.job_id: i for i, r in enumerate(self.running_list)}
        self.retired: list[list[RunningJob]] = []
        """Running lists replaced, emptied but kept alive (see :meth:`_drop_running`)."""
        self.trust = {c.id: float(self.snap.trust[i]) for i, c in enumerate(self.snap.clusters)}
        self._expand(trace)
        self.migrator = Migrator(self, migration) if migration is not None else None
        """Moves running jobs at failures, link changes and drains (None: the engine as before)."""
        if self.fast is not None:
            self.fast.prepare(self.snap, [job.spec for job in self.order], truth, seed)
        for job in self.order:
            if job.parents_left == 0 and not job.done:
                self._push(_Event(job.sim.arrival_s, _ARRIVAL, 0, job_id=job.sim.spec.job_id))
        for event in trace.events:
            self._push(_Event(event.at_s, _SCRIPTED, 0, scripted=event))
        if sample_every_s > 0:
            self._push(_Event(first, _SAMPLE, 0))
        self.retry_origin = first
        """Where the retry clock's ticks count from (``retry_origin + k x retry_every_s``)."""
        self.retry_due: float | None = None
        """The retry tick scheduled (None: none, as nothing waited after the last pass)."""

    # ---- setup ---------------------------------------------------------------------------------

    def _expand(self, trace: Trace) -> None:
        """Jobs of the trace (DAG jobs split into stages), their records and dependencies."""
        expanded: list[SimJob] = []
        refused: dict[str, str] = {}  # DAG job id -> why it is refused whole (no stage runs)
        for sim in trace.jobs:
            if not sim.spec.stages:
                expanded.append(sim)
                continue
            stages, why = self._stages(sim)
            if why is not None:
                expanded.append(sim)
                refused[sim.spec.job_id] = why
            expanded += stages
        for sim in expanded:
            spec = self.fast.admit(sim) if self.fast is not None else sim.spec
            record = JobRecord(
                job_id=spec.job_id, job_class=sim.job_class, tenant=spec.tenant, arrival_s=sim.arrival_s
            )
            item = QueueItem(job=spec, submitted_at=sim.arrival_s)
            job = _Job(
                sim=sim,
                spec=spec,
                record=record,
                shape=self._shape_of(spec),
                item=item,
                key=self.sort_key(item),
                steps_left=float(spec.work.steps),
                index=len(self.order),
            )
            self.order.append(job)
            if spec.job_id in self.jobs:
                record.rejected = f"job id {spec.job_id} appears twice in the trace"
                job.done = True
                continue
            if spec.stages:
                record.rejected = refused.get(spec.job_id, "not a valid DAG job: it has stages")
                job.done = True
            self.jobs[spec.job_id] = job
        for job in self.order:
            if job.done:
                continue
            for parent in job.sim.parents:
                if parent in self.jobs and self.jobs[parent] is not job:
                    self.jobs[parent].children.append(job.spec.job_id)
                    job.parents_left += 1
                else:
                    self.notes.append(f"{job.spec.job_id}: unknown parent {parent} ignored")

    def _stages(self, sim: SimJob) -> tuple[list[SimJob], str | None]:
        """A DAG job's stages (:func:`loom.sched.dag.expand`), each with the stages it waits for;
        or none, and why the DAG is refused whole: not a valid DAG, or a stage that could never
        run here (as placement refuses it at admission, before any stage runs; the simulator ran
        the stages before it, and rejected only it when its turn came)."""
        try:
            submitted = JobSubmitted(**{f: getattr(sim.spec, f) for f in sim.spec.__struct_fields__})
            children = dag.expand(submitted)
        except dag.DagError as exc:
            return [], f"not a valid DAG job: {exc}"
        never = self._stage_never_fits(children)
        if never is not None:
            return [], never
        deps = dag.dependencies(sim.spec.stages)
        return [
            dataclasses.replace(
                sim,
                spec=child,
                job_class="dag",
                parents=sim.parents
                + tuple(dag.stage_job_id(sim.spec.job_id, d) for d in deps[child.labels[dag.STAGE_LABEL]]),
            )
            for child in children
        ], None

    def _stage_never_fits(self, children: Sequence[JobSubmitted]) -> str | None:
        """Why a DAG is refused whole because one of its stages could never run as asked on this
        platform (placement's admission rule, :meth:`Framework.never_fits`), or None; only for a
        policy that is a scheduling framework (a baseline runs what it can)."""
        if self.fast is None:
            return None
        stages = {child.labels[dag.STAGE_LABEL]: child for child in children}
        found = self.fast.framework.stage_never_fits(stages, self.snap)
        return None if found is None else f"stage {found[0]}: {found[1].reason}"

    def _shape_of(self, spec: JobSpec) -> _Shape:
        res = spec.resources
        aff = spec.affinity
        spans = spec.allow_multi_cluster or spec.pipeline is not None
        min_workers = min(spec.min_workers or spec.workers, spec.workers)
        if spec.pipeline is not None:
            layers = tuple((la.compute_s, la.memory_gib, la.activation_mb) for la in spec.pipeline.layers)
            need, per_worker = 1, 1
            what: tuple[Any, ...] = ("pipeline", layers, spec.pipeline.max_stages)
        else:
            need, per_worker = res.gpus * min_workers, res.gpus
            # The span guard judges gangs with communication by their task type's speeds: a refused
            # one must not hold back a job of the same size without it.
            what = ("gang", res.gpus, min_workers, spec.comm is not None, spec.task_type)
            if spans:
                # Whether a spread is acceptable depends on the traffic against the compute (the
                # span guard): spanning gangs are alike only within a class of both.
                bytes_per_step = spec.comm.bytes_per_step if spec.comm is not None else 0
                what += (spec.task_type, spec.workers, round(math.log2(1 + bytes_per_step) / 2))
        key = (
            spec.priority,
            spans,
            *what,
            tuple(sorted(m.upper() for m in res.gpu_models)),
            res.gpu_memory_gib,
            # A worker's CPU and RAM: the pools' free GPUs say nothing of them, so a job that failed
            # for want of a node with 120 cores must not hold back one of the same GPUs that needs
            # 8 (on Alibaba's multi-GPU trace such jobs waited days while dozens of nodes were free).
            res.cpu_milli,
            res.memory_mib,
            tuple(aff.clusters),
            tuple(aff.regions),
            tuple(aff.avoid_clusters),
            tuple(aff.avoid_regions),
            tuple(sorted(aff.apart_from_jobs.items())),
            # A tenant keeps apart from its own jobs only (`jobs_labelled`): the same rule leaves
            # two tenants' jobs different clusters, so their failures stand for each other's no more.
            spec.tenant if aff.apart_from_jobs else None,
        )
        if spans and spec.pipeline is None and self._beyond_every_pool(key, spec, res.gpus, min_workers):
            # No pool can ever hold the gang: whether any spread keeps within the span guard's
            # GPU-hours bound (else it is rejected, span_inflation) hangs on the job's own compute,
            # traffic and learned speeds, not only its shape. Each such job is its own shape, so it
            # is decided on arrival (a verdict for one job never stands in for another's).
            key += ("own", spec.job_id)
        shape = self.shapes.get(key)
        if shape is None:
            shape = _Shape(
                key=key,
                pools=self._pools(spec),
                need=need,
                per_worker=per_worker,
                spans=spans,
                pipeline=spec.pipeline is not None,
                priority=spec.priority,
                index=len(self.shapes),
                worker=(
                    WorkerShape(res.gpus, res.cpu_milli, res.memory_mib)
                    if min_workers == 1 and spec.pipeline is None
                    else None
                ),
                apart=bool(aff.apart_from_jobs) or self.kept_pools,
            )
            self.shapes[key] = shape
        return shape

    def _beyond_every_pool(self, key: tuple[Any, ...], spec: JobSpec, per_worker: int, workers: int) -> bool:
        """Whether no pool the (spanning) shape ``key`` may use holds ``workers`` of ``per_worker``
        GPUs on its nodes, every node counted (what the span guard's pre-filter judges from)."""
        known = self.beyond.get(key)
        if known is None:
            snap = self.snap
            table = np.zeros_like(snap.free_sum)
            if snap.node_ids:
                np.add.at(table, (snap.cluster_of, snap.model_of), snap.total // max(per_worker, 1))
            pools = self._pools(spec)
            known = self.beyond[key] = pools.shape != table.shape or not bool(
                (pools & (table >= workers)).any()
            )
        return known

    def _pools(self, spec: JobSpec) -> BoolArray:
        clusters, models = allowed_pools(self.snap, spec)
        pools: BoolArray = clusters[:, None] & models[None, :]
        return pools

    # ---- the event loop ------------------------------------------------------------------------

    def _push(self, event: _Event) -> None:
        self.seq += 1
        event.seq = self.seq
        if event.kind not in (_SAMPLE, _RETRY):
            self.pending += 1
        heapq.heappush(self.heap, (event.t, event.kind, self.seq, event))

    # PLR0912, PLR0915: the event loop: one branch per event kind.
    def run(self) -> None:  # noqa: PLR0912, PLR0915
        """Play every event up to the horizon (or until nothing is left to happen)."""
        horizon = self.horizon_s
        while self.heap:
            t = self.heap[0][0]
            if horizon is not None and t > horizon:
                break
            self.t = t
            sample = False
            observed_only = True
            while self.heap and self.heap[0][0] == t:
                event = heapq.heappop(self.heap)[3]
                if event.kind == _OBSERVE:
                    self.pending -= 1
                    self._observe(event)
                    continue
                observed_only = False
                if event.kind == _SAMPLE:
                    sample = True
                    continue
                if event.kind == _RETRY:
                    self.retry_due = None
                    self.retry_post = True
                    continue
                if event.kind == _WAKE:
                    if self.wakes.get(event.job_id) == event.t:  # not cancelled or replaced
                        self._wake(event)
                    continue
                self.pending -= 1
                if event.kind == _COMPLETE:
                    self._complete(event)
                elif event.kind == _SCRIPTED and event.scripted is not None:
                    self._scripted(event.scripted)
                elif event.kind == _ARRIVAL:
                    self._arrive(self.jobs[event.job_id])
            if observed_only:
                continue  # a speed learnt: the next event's pass decides with it
            if sample and self.migrator is not None:
                self.migrator.on_sample()
            self._pass()
            if self.migrator is not None and self.suspended is None and self.migrator.after_pass():
                self._pass()  # the moves freed GPUs the queue may use
            if sample:
                self._sample()
                if len(self.timeline) >= MAX_SAMPLES:
                    self._thin_timeline()
                nxt = t + self.sample_every_s
                if self.pending > 0 or (horizon is not None and nxt <= horizon):
                    self._push(_Event(nxt, _SAMPLE, 0))
            self._arm_retry()
        end = self.t if horizon is None else max(self.t, horizon)
        for job in self.order:
            if job.run is not None:
                self._settle(job, job.run, end)

    def _arm_retry(self) -> None:
        """After a pass: while jobs wait that post-filters could make room for (what a tick retries:
        :meth:`_may_make_room`), the retry clock's next tick is scheduled (one at a time)."""
        if self.retry_every_s <= 0 or self.retry_due is not None or not self.waiting:
            return
        if not any(shape.heap and self._may_make_room(shape) for shape in self.waiting.values()):
            return
        every = self.retry_every_s
        due = self.retry_origin + (math.floor((self.t - self.retry_origin) / every) + 1) * every
        if due <= self.t:  # at a tick, rounding may give that tick again: never the same instant
            due += every
        if self.pending <= 0 and (self.horizon_s is None or due > self.horizon_s):
            return  # nothing else will happen: the last pass's verdict stands (no tick without end)
        self.retry_due = due
        self._push(_Event(due, _RETRY, 0))

    # ---- scheduling ----------------------------------------------------------------------------

    def _arrive(self, job: _Job) -> None:
        if job.done or job.run is not None or job.entered:
            return
        if job.first_s is None:
            job.first_s = self.t
            job.record.arrival_s = self.t
            # Its tenant's share when it is queued, as placement takes it (cycle.fair_share_of); a
            # job held for speed probes keeps its arrival's place, as placement keeps it.
            share = fair_share_of(self.snap, job.spec.tenant)
            # Its place in the queue is its submission's: a DAG's stage, released when its parents
            # end, keeps its DAG's (placement's rule: dag.expand copies the DAG's submitted_at).
            submitted = min(job.sim.arrival_s, self.t)
            job.item = dataclasses.replace(
                job.item,
                submitted_at=submitted,
                fair_share=share,
                own_quota=quota_standing(self.snap, job.spec.tenant),
            )
            job.key = self.sort_key(job.item)
        if self.probe is not None and self._held_for_probes(job, job.item.submitted_at):
            return
        job.entered = True
        self.fresh.append(job)

    def _held_for_probes(self, job: _Job, queued_s: float) -> bool:
        """Speed probes (:mod:`loom.sched.probe`), by the rule placement's cycle follows: submit the
        probes ``job`` calls for, and hold it out of the queue while its family's probes are in flight
        (until they end, or ``hold_s`` after it arrived). True when it is held."""
        learner, settings = self.speed_learner, self.probe
        if learner is None or settings is None:
            return False
        self.snap.now = self.t
        gate = probe_gate(
            job.spec,
            self.snap,
            known=learner.known_cells(),
            log_sd=lambda family, model: learner.estimate(family, model).log_sd,
            probing=self.probing,
            queued_s=queued_s,
            settings=settings,
        )
        for spec in gate.probes:
            family = job_family(spec)
            learner.probe_asked(family, spec.resources.gpu_models[0])
            if spec.job_id in self.jobs:
                continue
            sim = SimJob(spec, self.t, "probe", job.sim.home_region)
            probe = _Job(
                sim=sim,
                spec=spec,
                record=JobRecord(job_id=spec.job_id, job_class="probe", tenant=spec.tenant, arrival_s=self.t),
                shape=self._shape_of(spec),
                item=QueueItem(job=spec, submitted_at=self.t),
                key=(),
                steps_left=float(spec.work.steps),
                index=len(self.order) + len(self.probes),
            )
            probe.key = self.sort_key(probe.item)
            self.jobs[spec.job_id] = probe
            self.probes.append(probe)
            self.probing[family] = self.probing.get(family, 0) + 1
            self.holding.add(spec.job_id)
            self._push(_Event(self.t, _ARRIVAL, 0, job_id=spec.job_id))
        if gate.hold_s is None:
            return False
        self.held.setdefault(job_family(job.spec), []).append(job)
        self._push(_Event(self.t + gate.hold_s, _ARRIVAL, 0, job_id=job.spec.job_id))
        return True

    def _probe_done(self, job: _Job) -> None:
        """A probe ended (completed or rejected), or found no room at its first decision (it queues
        on, and no longer holds anyone): when its family has none left holding, the jobs held for
        them are queued now."""
        if job.spec.job_id not in self.holding:
            return
        self.holding.discard(job.spec.job_id)
        family = job_family(job.spec)
        left = self.probing.get(family, 0) - 1
        if left > 0:
            self.probing[family] = left
            return
        self.probing.pop(family, None)
        for held in self.held.pop(family, []):
            self._arrive(held)

    # PLR0912/PLR0915: one scheduling pass, its steps in order (module docstring).
    def _pass(self) -> None:  # noqa: PLR0912, PLR0915
        """One scheduling pass at this instant (see the module docstring)."""
        state, self.suspended = self.suspended, None
        if state is None:
            state = self._new_pass()
            if state is None:
                return
        pairs, retry_post, retry_all = state.pairs, state.retry_post, state.retry_all

        def room(shape: _Shape) -> bool:
            # Placement retries every queued job when capacity changes, post-filters included (a
            # freed GPU may complete what preemption or a shrink would make room for).
            return (retry_post or bool(pairs)) and self._may_make_room(shape)

        def chosen(shape: _Shape) -> bool:
            # Its last decision held it back by a permit's choice while room was there (e.g. the
            # span guard waiting for faster GPUs, without a wake): placement retries every queued
            # job when capacity changes, and for this one the retry is no foregone failure (the
            # pool it waited for may have gone to another job, the wait no longer pay).
            return bool(pairs) and not shape.queued

        def due(shape: _Shape) -> bool:
            return bool(shape.heap) and (
                retry_all
                or chosen(shape)
                or (bool(pairs) and self._fits(shape, pairs) and self._better(shape, pairs))
                or (bool(pairs) and shape.apart and self._fits(shape, None))
                or room(shape)
            )

        heap, failed, decided, set_aside = state.heap, state.failed, state.decided, state.set_aside
        if not state.started:
            state.started = True
            shapes = [s for s in self.waiting.values() if due(s)]
            state.due = {s.index for s in shapes}
            heap += [(s.heap[0][0], 1, s.index, s) for s in shapes]
            heapq.heapify(heap)

        def next_up(shape: _Shape) -> tuple[Any, ...] | None:
            """The key of the shape's first job not decided yet in this pass (None: none is left)."""
            while shape.heap and shape.heap[0][2] in decided:
                set_aside.append((shape, heapq.heappop(shape.heap)))
            return shape.heap[0][0] if shape.heap else None

        def reopen(released: set[Pair], after: tuple[Any, ...]) -> None:
            """The decision just made released GPUs (its preemption's victims, its shrinks) in a
            pass that decides the whole queue (capacity changed before it: placement's cycle then
            decides every queued job once, in queue order). The jobs after it that may use them
            are decided at their places; those before it had their turn (nothing fitted then)."""
            pairs.update(released)
            for shape in list(self.waiting.values()):
                if shape.pools.shape == self.snap.free_sum.shape and not any(
                    shape.pools[c, m] for c, m in released
                ):
                    continue
                failed.discard(shape.index)
                if shape.index in state.due:
                    continue  # its next job is in the heap already, or it has none left
                state.due.add(shape.index)
                for entry in sorted(shape.heap):
                    if entry[0] >= after:
                        break
                    if entry[2] not in decided:
                        # Its turn came before the release: it found nothing fits, and is counted.
                        self._count_queued(entry[2], decided)
                if (key := next_up(shape)) is not None:
                    heapq.heappush(heap, (key, 1, shape.index, shape))

        budget = self.budget
        while heap:
            popped, _, _, ref = heapq.heappop(heap)
            if isinstance(ref, _Job):
                job = ref
                if job.done or job.run is not None:
                    continue
                shape = job.shape
                woken = job.spec.job_id in self.woken
                self.woken.discard(job.spec.job_id)
                # A job whose shape's last one found nothing fits, where nothing changed since, is
                # queued without a decision. Not when that one was held back by a permit's choice
                # (waiting for faster GPUs): that choice reads the job's own place in the queue and
                # what the jobs ahead claimed, so this one may choose otherwise, as placement's
                # decision for it does. Nor a job whose permit wait just ended: placement decides
                # it then (a spanning gang told to wait for one cluster, woken, was skipped as
                # "fits no one cluster" and never started).
                if (
                    not woken
                    and shape.queued
                    and (
                        shape.index in failed
                        or (
                            shape.resolvable
                            and not (self._fits(shape, None) and self._better(shape, None, job))
                            and not self._may_make_room(shape)
                            and not self._may_be_held(shape)
                        )
                    )
                ):
                    self.skipped += 1
                    # The skipped decision would have found nothing fits: the job is queued as the
                    # framework counts the queue (Snapshot.waiting), as placement's is, and is not
                    # decided again in this pass (placement decides it once).
                    decided.add(job.spec.job_id)
                    if job.spec.pipeline is None:  # a pipeline is never counted (_join_queue)
                        # Seen now, as placement's decision of it would note it (rare_fit).
                        self.snap.seen.note_job(job.spec, self.t)
                        self.snap.join_queue(job.spec.job_id, probe=is_probe(job.spec.labels))
                        self._record_queued(job)
                    self._stage(job)
                    self._wait(job)
                    continue
                if budget <= 0:
                    heapq.heappush(heap, (popped, 0, job.index, job))
                    self._suspend(state)
                    return
            else:
                shape = ref
                # A shape due when the pass began stays due for the whole pass: placement decides
                # all its queued jobs (those that find nothing fits are counted in the queue below).
                if shape.index not in state.due and not due(shape):
                    continue
                head = next_up(shape)
                if head is None:
                    continue
                if head != popped:
                    # A shape can be in the heap twice (its fresh job's decision pushed it again):
                    # its next job is decided at that job's place in the queue order, not earlier.
                    heapq.heappush(heap, (head, 1, shape.index, shape))
                    continue
                if shape.index in failed:
                    # Nothing fits the shape now. Placement decides every queued job after
                    # capacity changed, so each of them counts in the queue from here, in its
                    # place, as its decision would count it (one held back by a permit's choice
                    # before was not counted); no decision is made.
                    self._count_queued(shape.heap[0][2], decided)
                    if (key := next_up(shape)) is not None:
                        heapq.heappush(heap, (key, 1, shape.index, shape))
                    continue
                job = self.jobs[shape.heap[0][2]]
                if not (retry_all or chosen(shape) or room(shape) or shape.apart or self._holds(job, pairs)):
                    failed.add(shape.index)
                    heapq.heappush(heap, (head, 1, shape.index, shape))  # counted next
                    continue
                if budget <= 0:
                    heapq.heappush(heap, (head, 1, shape.index, shape))
                    self._suspend(state)
                    return
                self.retries += 1
                heapq.heappop(shape.heap)
                if not shape.heap:
                    self.waiting.pop(shape.key, None)
            decided.add(job.spec.job_id)
            budget -= 1
            self.released.clear()
            if self._decide(job):
                shape.seen = None
                if state.whole and self.released:
                    reopen(set(self.released), popped)
            elif (
                not job.done
                and shape.queued
                and not shape.refused
                and not self._may_move_for(shape)
                and not self._may_be_held(shape)
            ):
                # Nothing fitted: nor will it for the rest of the shape. (done: rejected, e.g. a
                # spread now too costly; refused: a decision made room, preemption or a shrink, and
                # a permit refused it for this job's own sake, so the next job may take it; one
                # rare_room may move jobs for: its verdict reads the queue, which the jobs between
                # them in the queue order change.)
                failed.add(shape.index)
                shape.seen = None if shape.apart else self._workers(shape.per_worker).copy()
            if (key := next_up(shape)) is not None:
                heapq.heappush(heap, (key, 1, shape.index, shape))
        self._put_aside_back(state)
        if self.fresh or self.dirty or self.retry_post or self.retry_all:
            self._push(_Event(self.t, _CONTINUE, 0))
        elif pairs and self.elastic:
            self._grow()

    def _new_pass(self) -> _PassState | None:
        """A pass over what happened since the last one (None: nothing to decide)."""
        pairs, self.dirty = self.dirty, set()
        retry_post, self.retry_post = self.retry_post, False
        retry_all, self.retry_all = self.retry_all, False
        fresh, self.fresh = self.fresh, []
        self.started_in_pass = set()
        if not fresh and not (self.waiting and (pairs or retry_post or retry_all)):
            if pairs and not self.waiting and self.elastic:
                self._grow()
            return None
        state = _PassState(pairs, retry_post, retry_all, whole=bool(pairs) or retry_all)
        state.heap += [(job.key, 0, job.index, job) for job in fresh]
        return state

    def _suspend(self, state: _PassState) -> None:
        """The pass ran out of budget: the one at the same instant takes it up (nothing happens in
        between: what it released or queued waits for the pass after it, as placement's next
        cycle)."""
        self.suspended = state
        self._push(_Event(self.t, _CONTINUE, 0))

    def _put_aside_back(self, state: _PassState) -> None:
        """The pass is over: the jobs it decided go back to their shapes' heaps."""
        for shape, entry in state.set_aside:
            heapq.heappush(shape.heap, entry)
            self.waiting[shape.key] = shape
        state.set_aside.clear()

    def _count_queued(self, job_id: str, decided: set[str]) -> None:
        """A queued job whose decision in this pass would find nothing fits: decided without one,
        and counted in the queue (``Snapshot.waiting``, its queued shape) as that decision would."""
        decided.add(job_id)
        self.skipped += 1
        self._join_queue(self.jobs[job_id])

    def _join_queue(self, job: _Job) -> None:
        """``job`` counts in the queue (``Snapshot.waiting``, its queued shape), as the framework's
        decision that found nothing fits counts it: a pipeline never (``schedule_pipeline`` queues
        none; the simulator counted skipped ones, and jobs decided behind them saw a queue placement
        did not)."""
        if job.spec.pipeline is not None or job.spec.job_id in self.snap.waiting:
            return
        # Seen, as the framework notes every job it decides (``rare_fit`` reads how often shapes come).
        self.snap.seen.note_job(job.spec, self.t)
        self.snap.join_queue(job.spec.job_id, probe=is_probe(job.spec.labels))
        self._record_queued(job)

    def _record_queued(self, job: _Job) -> None:
        """A skipped job's shape in the queue (``Snapshot.queued``), by the framework's own rule
        (:meth:`~loom.sched.framework.Framework.queued_shape`: its pre-filters' pools; none for a
        pipeline), as its decision would have recorded it."""
        if self.fast is None:
            return
        item = job.item
        shape = self.fast.framework.queued_shape(job.spec, self.snap, job.key, submitted_at=item.submitted_at)
        if shape is not None:
            self.snap.queued[job.spec.job_id] = shape

    def _decide(self, job: _Job) -> bool:
        """One decision for ``job`` by the cycle the service runs (:func:`loom.sched.cycle.run_cycle`,
        one job long: the pass decides the order); True when it was placed. A job left waiting is
        queued."""
        snap = self.snap
        snap.now = self.t
        self.decisions += 1
        result = run_cycle(self.decide, [job], snap, settings=_CYCLE)
        placed = result.placed[0].decision if result.placed else None
        self._adopt_running_list(placed)
        if placed is not None:
            job.shape.resolvable = True
            self._start(job, placed)
            return True
        if result.rejected:
            self._reject(job, result.rejected[0].reason)
            return False
        job.shape.resolvable = True
        # Nothing fitted (not a permit's choice; the job may still be in the queue from before).
        job.shape.queued = any(w.record.queued for w in result.waiting)
        job.shape.refused = any(w.record.refused for w in result.waiting)
        if job.shape.queued:
            self._stage(job)
        for waiting in result.waiting:
            if waiting.error:
                self.plugin_errors += 1
                self.notes.append(f"{job.spec.job_id}: {waiting.record.reason}")
            if waiting.wake_in_s is not None:
                # A permit's patience ends then even if no capacity changes: decide again at that time.
                at = self.t + waiting.wake_in_s
                queued = self.wakes.get(job.spec.job_id)
                if at > self.t and (queued is None or at < queued):
                    if queued is not None:
                        self.pending -= 1  # the later wake is replaced
                    self.wakes[job.spec.job_id] = at
                    self._push(_Event(at, _WAKE, 0, job_id=job.spec.job_id))
        self._wait(job)
        return False

    def decide(self, items: Sequence[QueueItem], snap: Snapshot) -> list[tuple[QueueItem, Outcome]]:
        """The policy's decisions, one job at a time (the item's own queue-order time kept)."""
        out: list[tuple[QueueItem, Outcome]] = []
        for given in items:
            item = self.jobs[given.job.job_id].item
            if self.fast is not None:
                out.append((item, self.fast.decide_one(item, snap)))
            else:
                out += self.policy.decide([item], snap)
        return out

    def _grow(self) -> None:
        """GPUs came free: elastic runs below their maximum grow into them outside the pools a
        waiting job could use, by the rule the service's cycle applies
        (:func:`loom.sched.cycle.grow_around`; before, the simulator grew only once nothing
        waited, and the service around the waiting jobs, so a run could be larger in one)."""
        # The snapshot's clock is the pass's: a grown run's predicted end is rescaled from now
        # (resized_end_s), not from the time of the last decision.
        self.snap.now = self.t
        waiting = [
            job.spec
            for shape in self.waiting.values()
            for _, _, job_id in shape.heap
            if (job := self.jobs[job_id]).run is None and not job.done
        ]
        grown = grow_around(self.fast.framework if self.fast is not None else None, waiting, self.snap)
        if not grown:
            return
        self._adopt_running_list(None)
        for g in grown:
            self._resize(g.job_id, g.workers, g.allocations)

    def _wake(self, event: _Event) -> None:
        """A job's permit wait ended: it is decided again in this pass, on its own (placement
        retries the job when its backoff, at most that wait, ends), taken out of its shape's heap."""
        del self.wakes[event.job_id]
        self.pending -= 1
        job = self.jobs.get(event.job_id)
        if job is None or job.done or job.run is not None:
            return
        shape = job.shape
        kept = [entry for entry in shape.heap if entry[2] != job.spec.job_id]
        if len(kept) == len(shape.heap):
            return  # not queued (still held for its speed probes)
        heapq.heapify(kept)
        shape.heap[:] = kept
        if not kept:
            self.waiting.pop(shape.key, None)
        self.woken.add(job.spec.job_id)
        self.fresh.append(job)

    def _cancel_wake(self, job: _Job) -> None:
        """The job started: a wake queued for it would only stretch the run (it stays in the heap,
        ignored, and no longer counts as something left to happen)."""
        if self.wakes.pop(job.spec.job_id, None) is not None:
            self.pending -= 1

    def _wait(self, job: _Job) -> None:
        shape = job.shape
        heapq.heappush(shape.heap, (job.key, job.index, job.spec.job_id))
        self.waiting[shape.key] = shape
        if job.spec.job_id in self.holding:
            self._probe_done(job)  # no room for it now: the jobs it held go ahead on what is known

    def _reject(self, job: _Job, reason: str) -> None:
        job.record.rejected = reason
        job.done = True
        self.snap.waiting.discard(job.spec.job_id)
        self.snap.queued.pop(job.spec.job_id, None)
        for child in job.children:
            kid = self.jobs[child]
            if not kid.done:
                self._reject(kid, f"parent {job.spec.job_id} was rejected")
        if is_probe(job.spec.labels):
            self._probe_done(job)

    def _fits(self, shape: _Shape, pairs: Iterable[Pair] | None) -> bool:
        """Whether the free GPUs of the shape's pools hold its minimum workers (whole workers per
        node; CPU and RAM not counted: a necessary condition), looking only at ``pairs`` (pools just
        released) when given. A gang that may span clusters counts its workers over all its pools."""
        pools = shape.pools
        workers = self._workers(shape.per_worker)
        if pools.shape != workers.shape:
            return True
        need = max(shape.need // max(shape.per_worker, 1), 1)
        whole = bool((pools & (workers >= need)).any())
        # A gang is spread only while no pool holds it (the framework's rule): while one does, a
        # gang that may span is retried on the events a one-cluster gang is (else spanning allowed
        # would change when its decisions are taken, not only what they may choose).
        spread = shape.spans and (shape.pipeline or not whole)
        if pairs is None:
            return whole or (spread and self._span_workers(shape, workers) >= need)
        for c, m in pairs:
            if not pools[c, m] or workers[c, m] < (1 if spread else need):
                continue
            return not spread or self._span_workers(shape, workers) >= need
        return False

    def _whole(self, shape: _Shape) -> bool:
        """Whether one pool of the shape holds its minimum workers on its free GPUs now."""
        workers = self._workers(shape.per_worker)
        need = max(shape.need // max(shape.per_worker, 1), 1)
        return shape.pools.shape == workers.shape and bool((shape.pools & (workers >= need)).any())

    @staticmethod
    def _span_workers(shape: _Shape, workers: IntArray) -> int:
        """Workers a spanning shape could get from ``workers`` per pool: a gang's spread takes one
        GPU model per cluster (its best pool there), a pipeline any of them."""
        held = np.where(shape.pools, workers, 0)
        return int(held.sum() if shape.pipeline else held.max(axis=1, initial=0).sum())

    def _improved(self, shape: _Shape, pairs: Iterable[Pair] | None) -> bool:
        """Whether a pool of the shape (one of ``pairs`` when given) holds more workers than when a
        job of the shape last failed."""
        seen = shape.seen
        if seen is None:
            return True
        workers = self._workers(shape.per_worker)
        if pairs is None:
            return bool((shape.pools & (workers > seen)).any())
        return any(shape.pools[c, m] and workers[c, m] > seen[c, m] for c, m in pairs)

    def _better(self, shape: _Shape, pairs: Iterable[Pair] | None, job: "_Job | None" = None) -> bool:
        """Whether a job of the shape (``job``, else the first waiting) may fit now where it did not
        when one last failed: a pool holds more whole workers by GPUs (:meth:`_improved`), or, for
        a job asking CPU or RAM, a pool (one of ``pairs`` when given) has room for it counted with
        them (:meth:`_holds`): whole-worker counts say nothing of which node freed, so a node of
        enough cores may come free while the count stays where it was."""
        if self._improved(shape, pairs):
            return True
        if job is None:
            if not shape.heap:
                return False
            job = self.jobs[shape.heap[0][2]]
        res = job.spec.resources
        if not (res.cpu_milli or res.memory_mib):
            return False
        if pairs is None:
            pairs = [(int(c), int(m)) for c, m in zip(*np.nonzero(shape.pools), strict=True)]
        return self._holds(job, pairs)

    def _workers(self, per_worker: int) -> IntArray:
        """Per pool, how many workers of ``per_worker`` GPUs its free GPUs hold, node by node (kept
        up to date by :meth:`_touch` for every size asked for once)."""
        snap = self.snap
        if per_worker <= 1:
            return snap.free_sum
        table = self.whole.get(per_worker)
        if table is None:
            table = np.zeros_like(snap.free_sum)
            if snap.node_ids:
                usable = np.where(snap.schedulable, snap.free, 0) // per_worker
                np.add.at(table, (snap.cluster_of, snap.model_of), usable)
            self.whole[per_worker] = table
        return table

    def _touch(self, pairs: Iterable[Pair]) -> None:
        """The free GPUs of these pools changed: recount their whole workers."""
        if not self.whole:
            return
        snap = self.snap
        for c, m in pairs:
            idx, _ = snap.node_slice(c, m)
            usable = np.where(snap.schedulable[idx], snap.free[idx], 0)
            for per_worker, table in self.whole.items():
                table[c, m] = int((usable // per_worker).sum())

    def _holds(self, job: _Job, pairs: Iterable[Pair]) -> bool:
        """Whether one of the released pools ``pairs`` now has free room for all of ``job``'s
        minimum workers, counted node by node with their CPU and RAM as the framework counts them
        (a necessary condition; always True for pipelines, and for gangs that may span clusters
        while no pool of theirs holds them: a spread, not one of ``pairs``, is what they get)."""
        shape = job.shape
        if shape.spans and (shape.pipeline or not self._whole(shape)):
            return True
        snap = self.snap
        res = job.spec.resources
        g = max(res.gpus, 1)
        cpu, mem = res.cpu_milli, res.memory_mib
        need = shape.need // g
        for c, m in pairs:
            if not shape.pools[c, m] or snap.free_sum[c, m] < shape.need:
                continue
            idx, _ = snap.node_slice(c, m)
            idx = idx[snap.schedulable[idx]]
            if int(snap.room(idx, g, cpu, mem).sum()) >= need:
                return True
        return False

    def _may_make_room(self, shape: _Shape) -> bool:
        """Whether preemption or elastic shrink could make room for the shape in one of its pools:
        free GPUs plus those of lower-priority preemptible jobs and of shrinkable elastic jobs of no
        higher priority reach its need (the bound both post-filters start from; a necessary
        condition). Pipelines are neither preempted for nor shrunk for."""
        if shape.pipeline:
            return False
        p = shape.priority
        extra: IntArray | None = None
        for (kind, q), count in self.holders.items():
            if count <= 0 or (q >= p if kind == "freeable" else q > p):
                continue
            more = (self.freeable if kind == "freeable" else self.spare)[q]
            extra = more.copy() if extra is None else extra + more
        free = self.snap.free_sum
        if extra is not None:
            if extra.shape != free.shape or shape.pools.shape != free.shape:
                return True
            if bool((shape.pools & (free + extra >= shape.need)).any()):
                return True
        return self._may_move_for(shape)

    def _may_be_held(self, shape: _Shape) -> bool:
        """Whether ``rare_fit``'s hold could keep a node from a job of the shape now (a job of a
        worker shape rare for it waits: :func:`~loom.sched.plugins.rare.hold_possible`): the next
        job of the shape, of another run, may then find room where this one did not (a review: a
        four-GPU job of 1,000 steps kept off the only 8-GPU node found nothing, and one of 150
        steps, which ends before that node frees, was counted queued though placement places it)."""
        if not self.rare_hold:
            return False
        worker = shape.worker or WorkerShape(max(shape.per_worker, 1))
        return hold_possible(self.snap, worker)

    def _may_move_for(self, shape: _Shape) -> bool:
        """Whether ``rare_room`` (:class:`~loom.sched.plugins.rare.RareRoom`) could move a running
        job to make room for the shape: the policy has it, the shape is one worker of a rare shape
        (:func:`~loom.sched.plugins.rare.room_possible`), and a preemptible job of no higher
        priority runs in one of its pools (the bound the post-filter starts from)."""
        if not self.rare_room or shape.worker is None or shape.pools.shape != self.snap.free_sum.shape:
            return False
        p = shape.priority
        if not any(
            count > 0 and kind == "freeable" and q <= p and bool((self.freeable[q] > 0)[shape.pools].any())
            for (kind, q), count in self.holders.items()
        ):
            return False
        return room_possible(self.snap, shape.worker)

    # ---- runs ----------------------------------------------------------------------------------

    # PLR0915: a start's bookkeeping across snapshot, run and timeline.
    def _start(self, job: _Job, d: Decision) -> None:  # noqa: PLR0915
        self._cancel_wake(job)
        self.started_in_pass.add(job.spec.job_id)
        snap = self.snap
        spec = job.spec
        now = self.t
        # The decision is applied for good: its undo (which holds the running jobs as they were)
        # would only keep memory alive.
        d.undo = None
        for victim in d.victims:
            self._stop(victim, given_back=True)
        for job_id, workers, allocations in d.shrunk:
            self._resize(job_id, workers, allocations)
        parts = d.parts
        pipeline = any(p.layers is not None for p in parts)
        speeds = [snap.job_gpu_speed(spec, p.gpu_model) * self.trust.get(p.cluster, 1.0) for p in parts]
        regions = [p.region for p in parts]
        belief_compute_s, belief_step_s = self._step(spec, d, speeds, regions, pipeline)
        true_speeds, noise, rule = self._true_speeds(job, d)
        if self.truth is None:
            compute_s, raw_step_s = belief_compute_s, belief_step_s
        else:
            compute_s, raw_step_s = self._true_step(spec, d, speeds, true_speeds, regions, pipeline, noise)
        scale = spec.workers / d.workers if (not pipeline and 0 < d.workers != spec.workers) else 1.0
        step_s = raw_step_s * scale
        snap.staged.pop(spec.job_id, None)  # its copies are job.data_regions' from here on
        wait_s, extra_s, copy_bytes, belief_extra_s = self._data(
            job, regions[0], job.steps_left * step_s, d, job.steps_left * belief_step_s * scale
        )
        if self.migrator is not None:
            # A moved or re-placed run first gets its checkpoint (saved, copied, restarted).
            wait_s += self.migrator.start_delay(
                job, d, gpus=sum(sum(g for _, g in p.allocations) for p in parts)
            )
        gpus_by_part = [sum(g for _, g in p.allocations) for p in parts]
        gpus = sum(gpus_by_part)
        distinct = list(dict.fromkeys(regions))
        econ = snap.economics
        run = _Run(
            decision=d,
            core=self._core(job, d, pipeline, step_s=belief_step_s * scale, delay_s=wait_s + belief_extra_s),
            pairs=sorted({(snap.cluster_index[p.cluster], snap.model_index[p.gpu_model]) for p in parts}),
            lead_pair=(snap.cluster_index[parts[0].cluster], snap.model_index[parts[0].gpu_model]),
            lead_gpus=gpus_by_part[0],
            gpus=gpus,
            placed_s=now,
            compute_start_s=now + wait_s,
            seg_start_s=now,
            seg_steps=job.steps_left,
            end_s=now + wait_s + job.steps_left * step_s + extra_s,
            step_s=step_s,
            compute_s=compute_s,
            raw_step_s=raw_step_s,
            speeds=speeds,
            true_speeds=true_speeds,
            noise=noise,
            belief_compute_s=belief_compute_s,
            belief_step_s=belief_step_s,
            regions=regions,
            pipeline=pipeline,
            cross_bytes_per_step=self._cross_bytes_per_step(spec, d, distinct, pipeline),
            cross_cost_per_step=self._cross_bytes_per_step(spec, d, distinct, pipeline, priced=True),
            scu_rate=sum(g * s / noise for g, s in zip(gpus_by_part, true_speeds, strict=True)),
            cost_rate=sum(g * econ.price(p.region, now) for g, p in zip(gpus_by_part, parts, strict=True)),
            acct_s=now,
            paced=(now + wait_s, 1.0 - job.steps_left / max(spec.work.steps, 1)),
        )
        job.run = run
        rec = job.record
        if rec.start_s is None:
            rec.start_s = now
        rec.clusters = tuple(p.cluster for p in parts)
        rec.regions = tuple(distinct)
        rec.gpus = gpus
        rec.gpu_model = parts[0].gpu_model
        rec.step_s = step_s
        rec.compute_step_s = compute_s * scale
        rec.belief_step_s = belief_step_s * scale
        rec.belief_compute_step_s = belief_compute_s * scale
        rec.truth_rule = rule
        if copy_bytes:
            rec.cross_region_bytes += copy_bytes
            self.cross_bytes += copy_bytes
            assert spec.data is not None  # only a dataset is copied
            rec.transfer_cost += copy_bytes / 1e9 * self._copy_price(spec.data, parts[0].region)
        self.running_list.append(run.core)
        self.position[spec.job_id] = len(self.running_list) - 1
        for p in parts:
            self.by_cluster.setdefault(p.cluster, set()).add(spec.job_id)
        if len(distinct) > 1 and not pipeline:
            self.spanning.add(spec.job_id)
        users = spec.affinity.prefer_regions
        if spec.task_type == "inference" and users and any(u != regions[0] for u in users):
            self.serving.add(spec.job_id)
        self._count(run, +1)
        self._touch(run.pairs)
        self.gpus_used += gpus
        if run.core.min_workers is not None:
            self.elastic += 1
        job.generation += 1
        self._push(_Event(run.end_s, _COMPLETE, 0, job_id=spec.job_id, generation=job.generation))
        # Its first progress report: every run's end is re-predicted from it, and it teaches the
        # speed learner of a policy that learns.
        at = run.compute_start_s + OBSERVE_AT * (run.end_s - run.compute_start_s)
        self.runs_started += 1
        run.serial = self.runs_started
        self._push(_Event(at, _OBSERVE, 0, job_id=spec.job_id, run=run.serial))

    def _true_speeds(self, job: _Job, d: Decision) -> tuple[list[float], float, str]:
        """Per part the true per-GPU speed (at the most GPUs the part holds on one node), this run's noise,
        and the derivation rule of the slowest part ("" when timing by belief: the believed speeds)."""
        truth = self.truth
        spec = job.spec
        if truth is None:
            trusts = [self.trust.get(p.cluster, 1.0) for p in d.parts]
            return (
                [
                    self.snap.job_gpu_speed(spec, p.gpu_model) * t
                    for p, t in zip(d.parts, trusts, strict=True)
                ],
                1.0,
                "",
            )
        found = []
        for p in d.parts:
            per_node: dict[str, int] = {}
            for node, gpus in p.allocations:
                per_node[node] = per_node.get(node, 0) + gpus
            # A synchronous step waits for the node holding most of the job's GPUs: the lowest
            # per-GPU throughput (intra-node scaling only falls with more GPUs).
            n = max(per_node.values(), default=max(spec.resources.gpus, 1))
            found.append(
                truth.job_speed(
                    spec, p.gpu_model, gpus_per_node=n, job_id=spec.job_id, name=spec.name, seed=self.seed
                )
            )
        slowest = min(found, key=lambda t: t.speed)
        noise = truth.noise_factor(
            spec.job_id, job.record.restarts + 1, family=slowest.family, seed=self.seed
        )
        return [t.speed for t in found], noise, slowest.rule

    def _true_step(  # noqa: PLR0917 - the belief's inputs and the truth's, side by side
        self,
        spec: JobSpec,
        d: Decision,
        speeds: Sequence[float],
        true_speeds: Sequence[float],
        regions: Sequence[str],
        pipeline: bool,
        noise: float,
    ) -> tuple[float, float]:
        """(compute seconds, wall seconds) of one step with every worker, by the truth.

        Data parallel: :meth:`_step` on the true speeds, the compute times ``noise``. A pipeline:
        the planner's step (the belief) times the ratio of its bottleneck recomputed with the true
        speeds (compute times ``noise``) over the same recomputed with the believed ones.
        """
        if not pipeline:
            return self._step(spec, d, true_speeds, regions, pipeline, noise)
        belief_compute, belief_step = self._step(spec, d, speeds, regions, pipeline)
        ratio = self._bottleneck(spec, d, true_speeds, noise) / max(
            self._bottleneck(spec, d, speeds, 1.0), 1e-12
        )
        return belief_compute * ratio, belief_step * ratio

    def _bottleneck(self, spec: JobSpec, d: Decision, speeds: Sequence[float], noise: float) -> float:
        """A pipeline's slowest stage (compute, or transfer to the next) with these per-GPU speeds."""
        if spec.pipeline is None:
            return 1.0
        layers = spec.pipeline.layers
        worst = 0.0
        for k, (part, speed) in enumerate(zip(d.parts, speeds, strict=True)):
            if part.layers is None:
                continue
            first, last = part.layers
            gpus = max(sum(g for _, g in part.allocations), 1)
            compute = sum(la.compute_s for la in layers[first : last + 1]) / (gpus * max(speed, 1e-9)) * noise
            worst = max(worst, compute)
            if k + 1 < len(d.parts):
                rtt_ms, bandwidth_gbps = self.snap.net.link(part.region, d.parts[k + 1].region)[:2]
                worst = max(
                    worst,
                    transfer_s(layers[min(last, len(layers) - 1)].activation_mb, rtt_ms, bandwidth_gbps),
                )
        return worst

    def _step(  # noqa: PLR0917 - the decision's parts as the network model reads them
        self,
        spec: JobSpec,
        d: Decision,
        speeds: Sequence[float],
        regions: Sequence[str],
        pipeline: bool,
        noise: float = 1.0,
    ) -> tuple[float, float]:
        """(compute seconds, wall seconds) of one step with every worker; ``noise`` scales the compute."""
        if pipeline:
            step = d.predicted_step_s if d.predicted_step_s else spec.work.step_time_s
            return step / max(d.slowdown, 1.0), step
        estimate = predict_step_s(spec, speeds=speeds, regions=regions, net=self.snap.net, workers=d.workers)
        compute, comm = estimate.compute_s * noise, estimate.comm_s
        wall = max(compute, comm) if _overlaps(spec) else compute + comm
        if regions:
            # An inference step answers its users: the mean round trip from where they are counts
            # per step (the same model the jct plugin scores with), whatever policy placed it.
            wall += users_wait_s(spec, regions[0], self.snap.net)
        return compute, wall

    def _stage(self, job: _Job) -> None:
        """``stage_data``: a queued job's dataset is copied to where it will most likely run, from
        now (:func:`loom.sched.staging.staging_plan`; once per job and region). The bytes count
        when the copy begins, used or not."""
        if not self.stage_data or job.spec.data is None:
            return
        plan = staging_plan(job.spec, self.snap, copied=frozenset(job.staged) | frozenset(job.data_regions))
        if plan is None:
            return
        job.staged[plan.dst] = self.t + plan.sync_s
        self.snap.staged[job.spec.job_id] = job.staged  # the data plugin's copy times read it
        copied = plan.size_gb * 1e9
        job.record.cross_region_bytes += copied
        job.record.transfer_cost += plan.size_gb * transfer_price_per_gb(plan.src, plan.dst)
        self.cross_bytes += copied
        self.staged_copies += 1

    def _data(
        self, job: _Job, lead: str, run_s: float, d: Decision, belief_run_s: float
    ) -> tuple[float, float, float, float]:
        """(seconds waited before starting, seconds added while reading remotely, bytes copied, and
        the seconds the scheduler expects reading remotely to add: from ``belief_run_s``, the run as
        it believes it, so no truth reaches the running job's predicted end)."""
        data = job.spec.data
        if data is None:
            return 0.0, 0.0, 0.0, 0.0
        if lead in (data.region, *data.replicas) or lead in job.data_regions:
            return 0.0, 0.0, 0.0, 0.0
        job.data_regions.add(lead)
        sync_s = self._nearest_holder(data, lead)[1]
        copied = data.size_gb * 1e9
        if lead in job.staged:  # staged while it queued: what is left of that copy (counted then)
            left = max(job.staged[lead] - self.t, 0.0)
            if data.start == "after_sync":
                # The permit's wait is the whole copy (data_locality, the only WAIT): it began earlier.
                return left, 0.0, 0.0, 0.0
            sync_s, copied = left, 0.0
        if data.start == "after_sync":
            return max(sync_s, d.start_after_s), 0.0, copied, 0.0
        extra = float(data_delay_s(run_s, np.array(sync_s), "while_syncing"))
        believed = float(data_delay_s(belief_run_s, np.array(sync_s), "while_syncing"))
        return 0.0, extra, copied, believed

    def _nearest_holder(self, data: DataSpec, region: str) -> tuple[str, float]:
        """Where a copy of the dataset to ``region`` comes from: the holder (its home region or a
        replica) nearest in transfer time, and that time (seconds). Timed and billed from it."""
        return min(
            ((h, self.snap.net.transfer_s(h, region, data.size_gb)) for h in (data.region, *data.replicas)),
            key=lambda held: held[1],
        )

    def _copy_price(self, data: DataSpec, region: str) -> float:
        """USD per GB of a dataset's copy to ``region``, from the holder it comes from."""
        return transfer_price_per_gb(self._nearest_holder(data, region)[0], region)

    @staticmethod
    def _cross_bytes_per_step(
        spec: JobSpec, d: Decision, regions: Sequence[str], pipeline: bool, *, priced: bool = False
    ) -> float:
        """Bytes a step moves between regions (module docstring); ``priced``: what they cost, USD
        (each boundary at its price, :func:`loom.model.egress.transfer_price_per_gb`)."""
        if pipeline and spec.pipeline is not None:
            layers = spec.pipeline.layers
            total = 0.0
            for a, b in zip(d.parts, d.parts[1:], strict=False):
                if a.region != b.region and a.layers is not None:
                    moved = layers[min(a.layers[1], len(layers) - 1)].activation_mb * 1e6
                    total += moved * transfer_price_per_gb(a.region, b.region) / 1e9 if priced else moved
            return total
        if len(regions) > 1 and spec.comm is not None:
            moved = 2.0 * spec.comm.bytes_per_step * len(regions)
            return moved * ring_price_per_gb(list(regions)) / 1e9 if priced else moved
        return 0.0

    def _core(self, job: _Job, d: Decision, pipeline: bool, *, step_s: float, delay_s: float) -> RunningJob:
        """The run as the scheduling core sees it (as the placement service's book builds it).

        Its ``expected_end_s`` is what placement believes, never the truth the simulator times the
        run by: now, plus the data delay, plus the steps left at the decision's predicted step
        (scaled for an elastic job given fewer workers), or at ``step_s`` (the believed step) when
        the policy bound no prediction.
        """
        spec = job.spec
        lead = d.parts[0]
        end_s = expected_end_s(
            spec,
            start_s=self.t,
            delay_s=delay_s,
            steps_left=job.steps_left,
            predicted_step_s=d.predicted_step_s,
            workers=d.workers,
        )
        return RunningJob(
            job_id=spec.job_id,
            tenant=spec.tenant,
            priority=spec.priority,
            cluster=lead.cluster,
            gpu_model=lead.gpu_model,
            allocations=tuple(d.allocations),
            preemptible=spec.preemptible,
            labels=spec.labels,
            task_type=spec.task_type,
            workers=d.workers,
            min_workers=spec.min_workers if len(d.parts) == 1 and not pipeline else None,
            max_workers=spec.workers,
            gpus_per_worker=spec.resources.gpus,
            cpu_milli=spec.resources.cpu_milli,
            memory_mib=spec.resources.memory_mib,
            attempt=job.record.restarts + 1,
            expected_end_s=end_s if end_s is not None else self.t + delay_s + job.steps_left * step_s,
            started_s=self.t,
            done_at_start=max(1.0 - job.steps_left / spec.work.steps, 0.0),
            spec=spec,
        )

    def _count(self, run: _Run, sign: int) -> None:
        """Add (+1) or take off (-1) what the run could give to preemption or elastic shrink."""
        core = run.core
        pair = run.lead_pair
        if core.preemptible:
            self._hold("freeable", core.priority, pair, run.lead_gpus, sign)
        if core.min_workers is not None and core.workers > core.min_workers:
            spare = (core.workers - core.min_workers) * core.gpus_per_worker
            self._hold("spare", core.priority, pair, spare, sign)

    def _hold(self, kind: str, priority: int, pair: Pair, gpus: int, sign: int) -> None:
        books = self.freeable if kind == "freeable" else self.spare
        pools = books.get(priority)
        if pools is None:
            pools = books[priority] = np.zeros_like(self.snap.free_sum)
        pools[pair] += sign * gpus
        self.holders[(kind, priority)] += sign

    def _settle(self, job: _Job, run: _Run, now: float) -> float:
        """Account GPU-hours, cost and cross-region bytes up to ``now``; the steps done since the
        segment began (they are taken off ``steps_left``)."""
        hours = max(now - run.acct_s, 0.0) / 3600.0
        rec = job.record
        rec.scu_hours += run.scu_rate * hours
        rec.cost += run.cost_rate * hours
        run.acct_s = now
        done = run.progress(now)
        moved = done * run.cross_bytes_per_step
        rec.cross_region_bytes += moved
        rec.transfer_cost += done * run.cross_cost_per_step
        self.cross_bytes += moved
        job.steps_left = max(job.steps_left - done, 0.0)
        run.seg_start_s = now
        run.seg_steps = job.steps_left
        return done

    def _release(self, job: _Job, run: _Run, *, given_back: bool) -> None:
        """The run no longer holds GPUs: out of the snapshot and the books."""
        spec = job.spec
        if not given_back:
            core = run.core
            self.snap.give_back(core.allocations, core.gpus_per_worker, core.cpu_milli, core.memory_mib)
            self._drop_running(spec.job_id)
        else:
            self.position.pop(spec.job_id, None)
        for p in run.decision.parts:
            members = self.by_cluster.get(p.cluster)
            if members is not None:
                members.discard(spec.job_id)
        self.spanning.discard(spec.job_id)
        self.serving.discard(spec.job_id)
        self._count(run, -1)
        self.gpus_used -= run.gpus
        if self.snap.quota is not None:
            self.snap.quota.give(spec.tenant, run.gpus)
        if run.core.min_workers is not None:
            self.elastic -= 1
        self.dirty.update(run.pairs)
        self.released.update(run.pairs)
        self._touch(run.pairs)
        job.run = None
        job.generation += 1

    def _complete(self, event: _Event) -> None:
        job = self.jobs[event.job_id]
        run = job.run
        if run is None or event.generation != job.generation:
            return
        self._settle(job, run, self.t)
        job.steps_left = 0.0
        job.record.end_s = self.t
        job.done = True
        self._release(job, run, given_back=False)
        learner = self.fast.learner if self.fast is not None else None
        probe = is_probe(job.spec.labels)
        if learner is not None and job.record.restarts == 0 and not run.pipeline:
            learner.observe(job.spec.task_type, run.compute_s, run.raw_step_s)
        if self.speed_learner is not None and not run.taught:
            run.taught = True
            self._learn_speed(self.speed_learner, job.spec, run)
        for child in job.children:
            kid = self.jobs[child]
            kid.parents_left -= 1
            if kid.parents_left == 0 and not kid.done:
                self._push(_Event(max(self.t, kid.sim.arrival_s), _ARRIVAL, 0, job_id=child))
        if probe:
            self._probe_done(job)

    def _observe(self, event: _Event) -> None:
        """A run's first progress report (:data:`OBSERVE_AT`): its end is re-predicted from its pace
        (every policy: what agents report is the platform's, not a policy's), and its measured
        compute step teaches a learning policy's speed learner now, not only when it completes."""
        job = self.jobs[event.job_id]
        run = job.run
        if run is None or run.serial != event.run:
            return  # another run (or none) since: a resize or retiming keeps the run, and its lesson
        report = self._repredict_end(job, run)
        if report is not None:
            self.reports.append(report)
        if run.taught or self.speed_learner is None:
            return
        # Against the step the decision bound (compute plus exchange), as placement compares with
        # its run's ``predicted_step_s``; None (nothing bound) teaches, there as here.
        if teaches_while_running(run.compute_s, run.decision.predicted_step_s):
            run.taught = True
            self._learn_speed(self.speed_learner, job.spec, run)
            return
        # As slow as the slow-node rule flags: held until runs on other nodes of the model agree
        # (then it is the model, taught now), else its completion teaches.
        cell = self._cell(job.spec, run)
        if cell is None:
            return
        node = run.decision.parts[0].allocations[0][0]
        for (held_id, _), held in self.held_lessons.hold(
            cell, node, (job.spec.job_id, run.serial), run, live=self._run_live
        ):  # live ones only: none taught yet
            held.taught = True
            self._learn_speed(self.speed_learner, self.jobs[held_id].spec, held)

    def _run_live(self, key: tuple[str, int]) -> bool:
        """Whether the run ``(job id, serial)`` is the job's current run, not taught yet (a taught
        run's lesson was measured against the old belief: it agrees with nothing new)."""
        run = self.jobs[key[0]].run
        return run is not None and run.serial == key[1] and not run.taught

    def _cell(self, spec: JobSpec, run: _Run) -> tuple[str, str] | None:
        """The (family, GPU model) a run's lesson is about (None: it teaches nothing)."""
        seen = self._run_speed(spec, run)
        return None if seen is None else (seen.family, seen.gpu_model)

    def _run_speed(self, spec: JobSpec, run: _Run) -> RunSpeed | None:
        """What a run says of its family's speed (:func:`loom.model.learn.run_speed`)."""
        return run_speed(
            spec,
            [p.gpu_model for p in run.decision.parts],
            run.compute_s,
            pipeline=run.pipeline,
            prior_speed=self.snap.gpu_speed,
        )

    def _repredict_end(self, job: _Job, run: _Run) -> ProgressReport | None:
        """The run's progress report, taken as placement's book takes it
        (``PlacementBook.set_progress``): its progress, and its end re-predicted from its pace since
        it was last measured (its first step, or an earlier report; nothing after a resize, which
        measures it afresh from this report) by :func:`~loom.sched.cycle.progress_end_s`. Before,
        the simulator measured the pace since its own last re-timing, which placement cannot know,
        and kept progress at 0 (preemption, which prefers victims that lose least, chose others).
        Returns the report (None: the run is not listed, or has no steps to make)."""
        i = self.position.get(job.spec.job_id)
        old = self.running_list
        if i is None or i >= len(old) or old[i].job_id != job.spec.job_id or run.seg_steps <= 0:
            return None
        steps = float(job.spec.work.steps)
        done = 1.0 - (job.steps_left - run.progress(self.t)) / steps  # steps_left: at the segment's start
        end = None
        if run.paced is not None:
            then, done_then = run.paced
            end = progress_end_s(now_s=self.t, done=done, elapsed_s=self.t - then, done_before=done_then)
        run.paced = (self.t, done)
        report = ProgressReport(self.t, job.spec.job_id, done, run.compute_start_s)
        progress = max(old[i].progress, done)
        if (end is None or end == old[i].expected_end_s) and progress == old[i].progress:
            return report
        new = old.copy()
        new[i] = run.core = dataclasses.replace(
            old[i], expected_end_s=end if end is not None else old[i].expected_end_s, progress=progress
        )
        self.running_list = new
        self.snap.running = new
        self._retire(old)
        return report

    def _learn_speed(self, learner: SpeedLearner, spec: JobSpec, run: _Run) -> None:
        """Teach the speed learner what a run's family got on its GPU model, and apply it.

        ``run.compute_s`` is the true compute seconds per step the run had (with every worker, at
        the slowest part's pace); which runs teach is :func:`loom.model.learn.run_speed`'s rule,
        the one placement follows.
        """
        seen = self._run_speed(spec, run)
        if seen is None:
            return
        learner.observe(
            seen.family, seen.gpu_model, prior_speed=seen.prior_speed, observed_speed=seen.observed_speed
        )
        self.snap.set_learned(learner.factors(), learner.steady_cells())

    def wake_at(self, t: float) -> None:
        """An instant at ``t`` (a pass, then the migration policy's look) even if nothing else
        happens then: a drain's move in flight lands, and the drain may start the next."""
        self._push(_Event(t, _CONTINUE, 0))

    def requeue(self, job_id: str, *, keep_progress: bool) -> None:
        """Give a running job's run up and queue the job again (a drain past its deadline with no
        room anywhere): from the step it reached with ``keep_progress`` (an on-demand save), else
        from its last checkpoint."""
        self._stop(job_id, given_back=False, keep_progress=keep_progress)

    def _stop(self, job_id: str, *, given_back: bool, keep_progress: bool = False) -> None:
        """Stop a run (preempted, or its cluster failed) and requeue the job from its last checkpoint
        (``keep_progress``: from where it is)."""
        job = self.jobs.get(job_id)
        if job is None or job.run is None:
            return
        self._end_run(job, job.run, keep_progress=keep_progress, given_back=given_back)
        self.fresh.append(job)

    def _end_run(self, job: _Job, run: _Run, *, keep_progress: bool, given_back: bool) -> None:
        """A run given up before its end: settled now, back to its last checkpoint unless
        ``keep_progress``, its GPUs released, one restart more."""
        self._settle(job, run, self.t)
        if not keep_progress:
            steps = job.spec.work.steps
            every = job.spec.work.checkpoint_every_steps
            done = steps - job.steps_left
            kept = math.floor(done / every) * every if every > 0 else 0
            job.steps_left = float(steps - min(kept, steps))
        self._release(job, run, given_back=given_back)
        job.record.restarts += 1
        job.item = dataclasses.replace(job.item, attempts=job.record.restarts)

    def _resize(self, job_id: str, workers: int, allocations: tuple[tuple[str, int], ...]) -> None:
        """An elastic run shrunk to make room or grown into free GPUs (the snapshot already gave its
        GPUs back, or took the new ones)."""
        job = self.jobs.get(job_id)
        if job is None or job.run is None:
            return
        run = job.run
        self._settle(job, run, self.t)
        run.paced = None  # its pace changes with its size: measured afresh from its next report
        self._count(run, -1)
        i = self.position.get(job_id)
        if i is not None and self.running_list[i].job_id == job_id:
            run.core = self.running_list[i]  # as the shrink or growth left it (its end rescaled)
        else:
            run.core = dataclasses.replace(
                run.core,
                workers=workers,
                allocations=allocations,
                expected_end_s=resized_end_s(run.core, workers, self.t),
            )
        lead = run.decision.parts[0]
        part = dataclasses.replace(lead, allocations=tuple(allocations))
        run.decision = dataclasses.replace(run.decision, parts=[part], workers=workers)
        old = run.gpus
        run.gpus = run.lead_gpus = sum(g for _, g in allocations)
        if run.gpus < old:
            if self.snap.quota is not None:
                # A shrink gives GPUs back in the snapshot, not the tenant's quota (growth took it).
                self.snap.quota.give(job.spec.tenant, old - run.gpus)
            # What the shrink freed beyond the new placement is free for the queue (placement
            # retries every queued job after a shrink, as after any release), unless the run
            # started in this pass (see started_in_pass).
            if job_id not in self.started_in_pass:
                self.dirty.update(run.pairs)
                self.released.update(run.pairs)
        self._count(run, +1)
        self._touch(run.pairs)
        self.gpus_used += run.gpus - old
        run.scu_rate = run.gpus * run.true_speeds[0] / run.noise
        run.cost_rate = run.cost_rate * run.gpus / max(old, 1)
        spec = job.spec
        run.belief_compute_s, run.belief_step_s = self._step(
            spec, run.decision, run.speeds, run.regions, run.pipeline
        )
        compute_s, raw = self._run_step(job, run)
        scale = spec.workers / workers if workers else 1.0
        self._retime(job, run, raw * scale)
        run.compute_s, run.raw_step_s = compute_s, raw
        job.record.gpus = run.gpus
        job.record.step_s = run.step_s
        job.record.compute_step_s = compute_s * scale
        job.record.belief_step_s = run.belief_step_s * scale
        job.record.belief_compute_step_s = run.belief_compute_s * scale

    def _run_step(self, job: _Job, run: _Run) -> tuple[float, float]:
        """(compute, wall) seconds of one step of a run as it is placed now, by the truth (or belief)."""
        if self.truth is None:
            return self._step(job.spec, run.decision, run.speeds, run.regions, run.pipeline)
        return self._true_step(
            job.spec, run.decision, run.speeds, run.true_speeds, run.regions, run.pipeline, run.noise
        )

    def _retime(self, job: _Job, run: _Run, step_s: float) -> None:
        """Run the rest of the current segment at ``step_s`` per step (accounting settled first)."""
        now = self.t
        begin = max(now, run.compute_start_s)
        left_s = max(run.end_s - max(now, run.compute_start_s), 0.0)
        ratio = step_s / run.step_s if run.step_s > 0 else 1.0
        self._settle(job, run, now)
        run.step_s = step_s
        run.end_s = begin + left_s * ratio
        job.generation += 1
        self._push(_Event(run.end_s, _COMPLETE, 0, job_id=job.spec.job_id, generation=job.generation))

    # ---- the running list ------------------------------------------------------------------------

    def _adopt_running_list(self, decision: Decision | None) -> None:
        """Take over the running jobs a decision left in ``snap.running``.

        Preemption removes its victims and elastic shrink replaces the jobs it shrank, each by
        building a new list; the same change is made to a copy of our list (victims swapped out,
        shrunk jobs replaced in place) so positions stay known without a pass over every running
        job. Both lists are then retired (see :meth:`_drop_running`).
        """
        current = self.snap.running
        old = self.running_list
        if current is old:
            return
        new = old.copy()
        ok = decision is not None
        if decision is not None:
            for job_id, _, _ in decision.shrunk:
                i = self.position.get(job_id)
                ok = ok and i is not None and i < len(current) and current[i].job_id == job_id
                if ok and i is not None:
                    new[i] = current[i]
            for victim in decision.victims if ok else ():
                self._swap_out(new, victim)
        if not ok or len(new) != len(current):
            new = list(current)
            self.position = {r.job_id: i for i, r in enumerate(new)}
        self.running_list = new
        self.snap.running = new
        self._retire(old)
        self._retire(current)

    def _swap_out(self, running: list[RunningJob], job_id: str) -> None:
        """Remove ``job_id`` from ``running`` (our list, positions in :attr:`position`): the last
        entry takes its place."""
        i = self.position.pop(job_id, None)
        if i is None or i >= len(running) or running[i].job_id != job_id:
            return
        last = running.pop()
        if i < len(running):
            running[i] = last
            self.position[last.job_id] = i

    def _drop_running(self, job_id: str) -> None:
        """Take a finished run out of ``snap.running``.

        The preemption plugin caches its table of running jobs under ``(id(list), len(list))``,
        so a list is never shrunk in place (its length could come back with other contents): the
        run leaves through a new list, and the old one is emptied and kept alive so that no later
        list can be allocated at its address.
        """
        old = self.running_list
        i = self.position.get(job_id)
        if i is None or i >= len(old) or old[i].job_id != job_id:
            new = [r for r in old if r.job_id != job_id]
            self.position = {r.job_id: k for k, r in enumerate(new)}
        else:
            new = old.copy()
            self._swap_out(new, job_id)
        self.running_list = new
        self.snap.running = new
        self._retire(old)

    def _retire(self, old: list[RunningJob]) -> None:
        old.clear()
        self.retired.append(old)

    # ---- scripted events -------------------------------------------------------------------------

    def _scripted(self, event: SimEvent) -> None:
        if self.migrator is not None:
            self.migrator.before_event(event)
        if event.kind in ("link_degrade", "link_restore"):
            self._link(event)
        elif event.kind == "cluster_down":
            self._cluster(event.cluster, up=False)
        elif event.kind == "cluster_up":
            self._cluster(event.cluster, up=True)
        elif event.kind in ("cluster_drain", "cluster_undrain"):
            self._drain(event.cluster, drained=event.kind == "cluster_drain")
        elif event.kind == "price":
            self._price(event)
        if self.migrator is not None:
            self.migrator.after_event(event)

    def _link_pairs(self, event: SimEvent) -> list[tuple[str, str]]:
        if event.src and event.dst:
            return [(event.src, event.dst), (event.dst, event.src)]
        region = event.region or event.src or event.dst
        return [
            pair
            for other in self.snap.net.regions
            if other != region
            for pair in ((region, other), (other, region))
        ]

    def _link(self, event: SimEvent) -> None:
        net, base = self.snap.net, self.base_net
        for src, dst in self._link_pairs(event):
            i, j = net.index.get(src), net.index.get(dst)
            if i is None or j is None or i == j:
                continue
            if event.kind == "link_degrade":
                net.set_link(
                    src,
                    dst,
                    rtt_ms=float(net.rtt_ms[i, j]) * event.rtt_factor,
                    bandwidth_gbps=float(net.bandwidth_gbps[i, j]) * event.bandwidth_factor,
                    loss=float(net.loss[i, j]),
                    degraded=True,
                )
            else:
                net.set_link(
                    src,
                    dst,
                    rtt_ms=float(base.rtt_ms[i, j]),
                    bandwidth_gbps=float(base.bandwidth_gbps[i, j]),
                    loss=float(base.loss[i, j]),
                    degraded=bool(base.degraded[i, j]),
                )
        # Placement weighs the network: what waits may be placed differently now.
        for shape in self.waiting.values():
            shape.seen = None
        self.retry_all = bool(self.waiting)
        for job_id in sorted(self.spanning | self.serving):
            job = self.jobs[job_id]
            run = job.run
            if run is None:
                continue
            _, raw = self._run_step(job, run)
            _, run.belief_step_s = self._step(job.spec, run.decision, run.speeds, run.regions, run.pipeline)
            workers = run.decision.workers
            scale = job.spec.workers / workers if workers and workers != job.spec.workers else 1.0
            if abs(raw * scale - run.step_s) > 1e-12 * max(run.step_s, 1.0):
                self._retime(job, run, raw * scale)
                run.raw_step_s = raw
                job.record.step_s = run.step_s
            job.record.belief_step_s = run.belief_step_s * scale

    def _cluster(self, cluster: str, *, up: bool) -> None:
        snap = self.snap
        c = snap.cluster_index.get(cluster)
        if c is None:
            self.notes.append(f"scripted event for unknown cluster {cluster} ignored")
            return
        start, stop = snap.slices[c]
        if up:
            snap.set_schedulable(c, self.schedulable0[start:stop])
        else:
            for job_id in sorted(self.by_cluster.get(cluster, set())):
                self._stop(job_id, given_back=False)
            snap.set_schedulable(c, False)
        for m in range(len(snap.models)):
            pool = snap.pool(c, m)
            if up and pool.stop > pool.start:
                self.dirty.add((c, m))
        self._touch([(c, m) for m in range(len(snap.models))])

    def _drain(self, cluster: str, *, drained: bool) -> None:
        """Close a cluster to new work (its runs go on) or open it again."""
        snap = self.snap
        c = snap.cluster_index.get(cluster)
        if c is None:
            self.notes.append(f"scripted event for unknown cluster {cluster} ignored")
            return
        start, stop = snap.slices[c]
        snap.set_schedulable(c, False if drained else self.schedulable0[start:stop])
        if not drained:
            self.dirty.update(
                (c, m) for m in range(len(snap.models)) if snap.pool(c, m).stop > snap.pool(c, m).start
            )
        self._touch([(c, m) for m in range(len(snap.models))])

    def believed_step_s(self, spec: JobSpec, d: Decision) -> float:
        """Seconds per step the scheduler expects of ``spec`` on ``d`` now (its speeds x trust,
        the links as they are now, an elastic job's worker count): what a migration is weighed by."""
        speeds = [
            self.snap.job_gpu_speed(spec, p.gpu_model) * self.trust.get(p.cluster, 1.0) for p in d.parts
        ]
        _, wall = self._step(spec, d, speeds, [p.region for p in d.parts], False)
        scale = spec.workers / d.workers if 0 < d.workers != spec.workers else 1.0
        return wall * scale

    def data_wait_s(self, job_id: str, region: str) -> float:
        """Seconds a start in ``region`` would wait for the job's dataset (0 where it is, was
        copied, or is read while it syncs)."""
        job = self.jobs[job_id]
        data = job.spec.data
        if data is None or data.start != "after_sync":
            return 0.0
        if region in (data.region, *data.replicas) or region in job.data_regions:
            return 0.0
        if region in job.staged:
            return max(job.staged[region] - self.t, 0.0)
        return self._nearest_holder(data, region)[1]

    def move(self, job_id: str, d: Decision, *, keep_progress: bool) -> None:
        """Move a running job to ``d`` (a decision taken without applying it): its run stops, the
        steps since its last checkpoint are lost unless ``keep_progress`` (an on-demand save), and
        it starts at once on ``d``'s GPUs (the migration policy adds the checkpoint's delay)."""
        job = self.jobs[job_id]
        run = job.run
        if run is None:
            return
        self._end_run(job, run, keep_progress=keep_progress, given_back=False)
        res = job.spec.resources
        for part in d.parts:
            self.snap.take(part.allocations, res.gpus, res.cpu_milli, res.memory_mib)
        if self.snap.quota is not None:
            self.snap.quota.take(job.spec.tenant, sum(g for _, g in d.allocations))
        self._start(job, d)

    def _price(self, event: SimEvent) -> None:
        snap = self.snap
        base = self.platform.economics.price_per_gpu_hour
        prices = dict(snap.economics.price_per_gpu_hour)
        for region in [event.region] if event.region else list(snap.regions):
            prices[region] = base.get(region, 2.0) * event.factor
        snap.economics = dataclasses.replace(snap.economics, price_per_gpu_hour=prices)

    # ---- results ---------------------------------------------------------------------------------

    def _thin_timeline(self) -> None:
        """A run far longer than its arrival span (a job of years, say, or every job at t = 0 for
        days) would sample every ``sample_every_s`` until its end, without bound in time and
        memory: past :data:`MAX_SAMPLES` every other sample is dropped and the interval doubles,
        so the timeline stays within that many points (utilisation is then time-weighted over the
        coarser points). Only such runs are touched: below the cap, nothing changes."""
        self.timeline = self.timeline[::2]
        self.sample_every_s *= 2
        self.samples_thinned += 1

    def _sample(self) -> None:
        snap = self.snap
        in_flight = 0.0
        for job_id in self.spanning:
            run = self.jobs[job_id].run
            if run is not None:
                in_flight += run.progress(self.t) * run.cross_bytes_per_step
        self.timeline.append(
            Sample(
                t_s=self.t,
                gpus_used=self.gpus_used,
                gpus_total=int(snap.total[snap.schedulable].sum()),
                cross_region_bytes=self.cross_bytes + in_flight,
            )
        )


def simulate(
    trace: Trace,
    platform: Platform,
    policy: Policy,
    *,
    seed: int = 0,
    sample_every_s: float = 300.0,
    retry_every_s: float = RETRY_EVERY_S,
    max_decisions_per_event: int = 64,
    horizon_s: float | None = None,
    learner: SpeedLearner | None = None,
    truth: Truth | BeliefTiming | None = None,
    migration: MigrationPolicy | None = None,
    stage_data: bool = False,
) -> SimResult:
    """Replay ``trace`` on ``platform`` under ``policy``; one :class:`JobRecord` per job (in trace
    order, DAG jobs as their stages) and a sample of GPU use every ``sample_every_s``.

    Deterministic: the same trace, platform and policy (with the same seed) give the same result.
    The engine draws no random numbers; ``seed`` is recorded in the notes for the policy's and the
    trace's seeds to be reported with the result. ``horizon_s``: stop at that simulated time (jobs
    still running have ``end_s`` None, their use so far accounted); None: run until every job has
    completed, been rejected, or can never start (it stays queued).

    A job whose home region, dataset region or replica is not a region of the platform (its
    network or clusters) is refused up front: :class:`~loom.sim.workloads.WorkloadError` names it.

    ``truth``: where jobs' true speeds come from (see the module docstring): a
    :class:`~loom.sim.truth.Truth` (e.g. ``load_truth(path)``), None for the packaged tables
    (:func:`~loom.sim.truth.load_truth`), or :data:`~loom.sim.truth.BELIEF` to time every job by the
    scheduler's own belief (the model before truth existed; no noise), kept for comparison. Noise
    is seeded by ``seed``, each job's id and attempt.

    ``learner``: a speed learner (:mod:`loom.model.learn`) taught by every completed single-part run,
    whose factors every later decision uses (``Snapshot.set_learned``), as placement does; None:
    the policy's own (``FrameworkPolicy.speed_learner``: ``loom`` and ``gavel_like`` learn, the
    other baselines do not). Nothing is learned when jobs are timed by belief (``truth=BELIEF``: a
    run delivers what was believed) nor by the ``oracle`` (its learned table is the truth).

    ``migration``: move running jobs at failures, link changes and drains by a
    :class:`~loom.sim.migration.MigrationPolicy` (``on``: the benefit rule of
    :mod:`loom.migrate.benefit`; ``never``; ``always``); its figures are in ``SimResult.migration``.
    None: the engine as before (a failed cluster's jobs are requeued and restart at once).

    ``retry_every_s``: the clock on which the queued jobs that preemption, an elastic shrink or
    ``rare_room`` could make room for are decided again, whatever else happens (placement's
    backoff, :data:`RETRY_EVERY_S`); 0: only when something happens. Until 2026-12-07 this retry came with
    each sample of GPU use, so a grid cell's results hung on its sampling interval (its arrival
    span / 200): one cell of an outside evaluator moved 13 % between sampling every 600 s and every
    704 s.

    ``stage_data``: a job queued with its dataset elsewhere has it copied, from then, to the region
    :func:`loom.sched.staging.staging_plan` names; a start there waits only for what is left of the
    copy (the placement service does not stage yet: off by default, so runs measure what it does).
    """
    check_regions(trace, {*platform.net.regions, *(c.region for c in platform.clusters.values())})
    started = time.perf_counter()
    sim = _Simulation(
        trace,
        platform,
        policy,
        sample_every_s=sample_every_s,
        retry_every_s=retry_every_s,
        max_decisions_per_event=max_decisions_per_event,
        horizon_s=horizon_s,
        learner=learner,
        truth=None if truth is BELIEF else (truth if isinstance(truth, Truth) else load_truth()),
        seed=seed,
        migration=migration,
        stage_data=stage_data,
    )
    sim.run()
    wall_s = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak_mib = peak / (1024 * 1024 if sys.platform == "darwin" else 1024)
    return SimResult(
        policy=policy.name,
        records=[job.record for job in sim.order],
        probes=[job.record for job in sim.probes],
        timeline=sim.timeline,
        wall_s=wall_s,
        decisions=sim.decisions,
        peak_rss_mib=round(peak_mib, 1),
        notes=[
            f"seed {seed}",
            "timed by belief (truth=BELIEF)"
            if sim.truth is None
            else f"timed by truth: {sim.truth.source or 'a Truth given by the caller'}",
            f"decisions: {sim.decisions - sim.retries} for arriving or requeued jobs, {sim.retries} retries"
            f" of waiting jobs; {sim.skipped} arrivals queued without one (no room and none to make)",
            *([f"staging: {sim.staged_copies} dataset copies begun while jobs queued"] if stage_data else []),
            *sim.notes,
        ],
        migration=sim.migrator.figures() if sim.migrator is not None else None,
        reports=sim.reports,
        plugin_errors=sim.plugin_errors,
    )
