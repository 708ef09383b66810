"""One placement cycle, pure: (queue, snapshot, clock) in, every effect out as a :class:`CycleResult`.

This is the in-memory half of a placement (the Kubernetes scheduler's ``schedulingCycle``); the
I/O half belongs to the caller. The placement service applies a result in one PostgreSQL
transaction and publishes its messages; the simulator applies the same result to its clock. Both
call :func:`run_cycle`, so a decision cannot be taken one way in the service and another way in the
simulator.

What a cycle decides, in order:

1. Every queued job, in the framework's queue order, on the snapshot (each decision applied before
   the next job's turn): **placed** (with the victims it preempted and the elastic jobs it shrank),
   **rejected** (only when waiting cannot help: an ``UNRESOLVABLE`` verdict, and, while the set of
   clusters has not settled, only the quota's — a cluster that would fit may simply not have
   reported yet), or **waiting** (retried after a backoff that doubles per cycle it waited, up to
   :attr:`CycleSettings.max_backoff_s`, or at a permit's wake time if sooner).
2. When nothing is left waiting and nothing was preempted (queued jobs, and victims about to be
   queued again, have the first claim on freed GPUs): **grown** —
   elastic jobs below their maximum take free GPUs of their own cluster and GPU model, as far as
   their tenant's quota allows (:func:`grow`).

The reject code comes from the verdict's type (``Status.reject``), never from its words.

Around the cycle, two more rules are pure and shared: :func:`retry_after_failure` (a failed start is
tried again elsewhere, or the job fails) and :func:`expiry_avoid` (which clusters a placement whose
start was never confirmed avoids next).
"""

import dataclasses
import math
import time
from collections.abc import Callable, Collection, Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, Generic, Protocol, TypeVar

import numpy as np

from loom.errors import InvalidInputError
from loom.model.family import job_family
from loom.sched import dag
from loom.sched.elastic import ElasticJob, pace_scale, plan_grow, resized_end_s, with_sizes
from loom.sched.framework import Code, Decision, DecisionRecord, Framework, Outcome, QueueItem
from loom.sched.plugins.data import data_delay_s
from loom.sched.probe import ProbeSettings, check_labels, probe_gate
from loom.sched.quota import QuotaBook, QuotaVerdict, TenantConfig
from loom.sched.snapshot import RunningJob, Snapshot
from loom_proto.jobs import JobSpec, RejectCode, RequeueReason, nul_text

__all__ = [
    "MAX_BACKOFF_S",
    "WAKE_AFTER_S",
    "CycleResult",
    "CycleSettings",
    "Decide",
    "Grown",
    "Pending",
    "Placed",
    "Preempted",
    "Probing",
    "Rejected",
    "Shrunk",
    "Waiting",
    "admission_check",
    "backoff_s",
    "expected_end_s",
    "expiry_avoid",
    "fair_share_of",
    "fold_within",
    "grow",
    "progress_end_s",
    "quota_standing",
    "reading_delay_s",
    "resized_end_s",
    "retry_after_failure",
    "run_cycle",
]


class Pending(Protocol):
    """A queued job as the cycle reads it (the service's ``QueuedJob`` is one)."""

    @property
    def job(self) -> JobSpec: ...

    @property
    def attempt(self) -> int: ...

    @property
    def avoid(self) -> frozenset[str]: ...

    @property
    def tries(self) -> int: ...

    @property
    def fair_share(self) -> float | None:
        """The tenant's share of its quota when the job was queued (its place in the queue among
        equal priorities; see :func:`fair_share_of`); None: not taken yet (then it is now)."""

    @property
    def queued_s(self) -> float | None:
        """When the job was first queued, on the snapshot's clock (how long speed probes may hold
        it, :mod:`loom.sched.probe`); None: not known (then now)."""


P = TypeVar("P", bound=Pending)

WAKE_AFTER_S = 1e-6
"""Added to a permit's patience (:attr:`Waiting.wake_in_s`): the patience is mostly a running job's
predicted end less now, so ``now + wait`` lands a rounding error before or after that end; a wake
before it decided the job again at an instant its GPUs were still held (it gave up the faster
GPU it waited for, a few ulps before they freed)."""


MAX_BACKOFF_S: Final = 30.0
"""The longest a waiting job goes without being decided again (its backoff's cap): placement's, and
the simulator's clock for the jobs a post-filter could make room for (``simulate(retry_every_s)``)."""


@dataclass(frozen=True, slots=True)
class CycleSettings:
    """The policy knobs of a cycle."""

    settled: bool = True
    """Whether the set of clusters has been stable long enough to reject a job none can hold (right
    after a start, the cluster that fits may not have reported yet)."""
    backoff_s: float = 0.25
    """A waiting job's first retry delay; doubled per cycle it waited."""
    max_backoff_s: float = MAX_BACKOFF_S
    grow: bool = True
    """Let elastic jobs grow into free GPUs when nothing waits."""


@dataclass(frozen=True, slots=True)
class Probing:
    """What a cycle needs to run speed probes (:func:`loom.sched.probe.probe_gate`)."""

    settings: ProbeSettings
    known: Container[tuple[str, str]]
    """(family, GPU model) cells that need no probe (the learner's :meth:`known_cells`)."""
    in_flight: Mapping[str, int]
    """Family -> its probes that hold its jobs (running, or asked and not yet decided)."""
    log_sd: Callable[[str, str], float] | None = None
    """(family, GPU model) -> the learner's sd of its log speed (only models that could change the
    choice are probed); None: every model not known."""


@dataclass(frozen=True, slots=True)
class Placed(Generic[P]):
    """A job placed: where, and the record of why."""

    pending: P
    decision: Decision
    record: DecisionRecord


@dataclass(frozen=True, slots=True)
class Rejected(Generic[P]):
    """A job that can never run as asked: its typed code, the reason and what to change."""

    pending: P
    code: RejectCode
    reason: str
    hint: str
    record: DecisionRecord


@dataclass(frozen=True, slots=True)
class Waiting(Generic[P]):
    """A job left queued: retried after ``retry_in_s`` (or earlier when capacity changes)."""

    pending: P
    record: DecisionRecord
    retry_in_s: float
    wake_in_s: float | None = None
    """A permit's patience: decide again then even if no capacity changes (None: no such wait)."""
    error: bool = False
    """The verdict was a plugin's failure (a bug or bad state), not a lack of room."""
    held: bool = False
    """Held for its family's speed probes (:mod:`loom.sched.probe`), not decided: no try counted."""


@dataclass(frozen=True, slots=True)
class Preempted:
    """A running job stopped to make room for ``by`` (its GPUs are already back in the snapshot)."""

    job_id: str
    by: str
    plugin: str = "preemption"
    """What stopped it: ``preemption`` (``by`` has a higher priority) or ``rare_room`` (only the
    node it ran on holds ``by``'s worker, and it has room elsewhere: it runs again there)."""


def stage_beyond_quota(
    stages: Mapping[str, JobSpec], tenants: TenantConfig
) -> tuple[str, QuotaVerdict] | None:
    """The first of a DAG's stages (name -> its job) that its tenant's quota could never hold, with
    the quota's verdict; None when each could run. Refused at the DAG's admission: it ran its first
    stages and failed at that one (a newcomer's walk)."""
    quota = QuotaBook(tenants, {})
    for name, job in stages.items():
        verdict = quota.check(job.tenant, max(job.min_workers or job.workers, 1) * job.resources.gpus)
        if verdict.never:
            return name, verdict
    return None


def room_taker(by: str, by_tenant: str | None, victim_tenant: str) -> str:
    """Who a preempted or shrunk job made room for, as its tenant may read it (its history): the
    job's id when it is the same tenant's, else "a job of another tenant" (the id told one tenant
    what another runs)."""
    return by if by_tenant == victim_tenant else "a job of another tenant"


@dataclass(frozen=True, slots=True)
class Shrunk:
    """An elastic running job shrunk to ``workers`` on ``allocations`` to make room for ``by``."""

    job_id: str
    workers: int
    allocations: tuple[tuple[str, int], ...]
    by: str


@dataclass(frozen=True, slots=True)
class Grown:
    """An elastic running job grown into free GPUs: its new workers and full allocations."""

    job_id: str
    cluster: str
    gpu_model: str
    workers: int
    allocations: tuple[tuple[str, int], ...]
    added: tuple[tuple[str, int], ...]
    """GPUs added per node (the rows a store reserves)."""


@dataclass
class CycleResult(Generic[P]):
    """Every effect of one cycle, in the order they were decided."""

    placed: list[Placed[P]] = field(default_factory=list)
    rejected: list[Rejected[P]] = field(default_factory=list)
    waiting: list[Waiting[P]] = field(default_factory=list)
    preempted: list[Preempted] = field(default_factory=list)
    shrunk: list[Shrunk] = field(default_factory=list)
    grown: list[Grown] = field(default_factory=list)
    probes: list[JobSpec] = field(default_factory=list)
    """Speed probes to submit (:mod:`loom.sched.probe`); the jobs that asked for them are waiting."""
    decide_ms: float = 0.0
    """Wall time the decisions took (a figure for the caller's stats; no decision reads it)."""

    @property
    def empty(self) -> bool:
        """Nothing was decided (no job considered, nothing grown)."""
        return not (self.placed or self.rejected or self.waiting or self.grown or self.probes)


def fair_share_of(snap: Snapshot, tenant: str) -> float:
    """A tenant's dominant share of its quota now (GPUs held over its nominal; 0 without a quota
    book). Taken once, when a job is queued, so a job keeps its place in the queue while its tenant's
    other jobs start and end (the placement service and the simulator both do so)."""
    return snap.quota.fair_share(tenant) if snap.quota is not None else 0.0


def quota_standing(snap: Snapshot, tenant: str) -> bool | None:
    """:attr:`QueueItem.own_quota`: None when the quota book lists no quota (no tenant borrows),
    else whether ``tenant`` has one of its own (with quotas listed, a tenant at or over its quota
    borrows, and so does one without a quota, whatever it holds)."""
    if snap.quota is None or not snap.quota.config.tenants:
        return None
    return tenant in snap.quota.config.tenants


def backoff_s(tries: int, settings: CycleSettings) -> float:
    """How long a job that has waited through ``tries`` cycles waits before the next one."""
    return float(min(settings.backoff_s * 2.0 ** min(tries, 16), settings.max_backoff_s))


Decide = Callable[[Sequence[QueueItem], Snapshot], Sequence[tuple[QueueItem, Outcome]]]
"""A policy's decisions for a queue on a snapshot, in its queue order, each applied to the
snapshot before the next (what :meth:`Framework.schedule_many` does)."""


def run_cycle(
    framework: Framework | Decide,
    queue: Sequence[P],
    snap: Snapshot,
    *,
    settings: CycleSettings = CycleSettings(),
    backlog: int | Sequence[JobSpec] = 0,
    placed: Callable[[P, Decision], None] | None = None,
    probing: Probing | None = None,
) -> CycleResult[P]:
    """Decide ``queue`` on ``snap`` (which takes every decision, as the next job sees it).

    ``framework``: the scheduling framework (its :meth:`~Framework.schedule_many`), or any
    :data:`Decide` (the simulator's baselines, which decide one job at a time).

    ``backlog``: jobs still queued that this cycle does not consider (their backoff has not
    ended), or only their number: growth leaves the pools they or this cycle's waiting jobs
    could use to them (:meth:`Framework.wanted_pools`; given a number, it waits for them all).
    ``placed``: called after each placement before the next job's turn,
    to list the new run in ``snap.running`` (the affinity, availability and preemption
    plugins read that list): a later job of the cycle sees the earlier ones running. A job's place
    in the queue is its ``submitted_at`` (0 without one) and, among equal priorities, its fair
    share taken when it was queued (``Pending.fair_share``), else the tenant's now.

    ``probing``: run speed probes (:func:`loom.sched.probe.probe_gate`) before deciding: a job whose
    family never ran on a GPU model it may use asks for probes (``CycleResult.probes``) and waits,
    as does one whose family has probes in flight, up to the hold; None: no probes.
    """
    result: CycleResult[P] = CycleResult()
    by_id: dict[str, P] = {}
    items: list[QueueItem] = []
    if probing is not None:
        queue = _gate_probes(result, queue, snap, probing)
    for p in queue:
        job = p.job
        if job.job_id in by_id:
            continue
        by_id[job.job_id] = p
        items.append(
            QueueItem(
                job=job,
                submitted_at=float(getattr(job, "submitted_at", 0.0) or 0.0),
                fair_share=p.fair_share if p.fair_share is not None else fair_share_of(snap, job.tenant),
                attempts=p.attempt,
                own_quota=quota_standing(snap, job.tenant),
            )
        )
    avoid = {job_id: p.avoid for job_id, p in by_id.items() if p.avoid}
    started = time.perf_counter()
    if not items:
        outcomes: Sequence[tuple[QueueItem, Outcome]] = []
    elif isinstance(framework, Framework):
        hook = None
        if placed is not None:
            on_placed = placed

            def hook(item: QueueItem, decision: Decision) -> None:
                on_placed(by_id[item.job.job_id], decision)

        outcomes = framework.schedule_many(items, snap, avoid=avoid, placed=hook)
    else:
        # A Decide is given the whole queue (its order is its own): ``placed`` hears of each
        # placement after them all (the simulator decides one job per cycle, so it is the same).
        outcomes = framework(items, snap)
        if placed is not None:
            for item, outcome in outcomes:
                if outcome.decision is not None:
                    placed(by_id[item.job.job_id], outcome.decision)
    for item, outcome in outcomes:
        _classify(result, by_id[item.job.job_id], outcome, settings)
    # Queued jobs have the first claim on free GPUs: growth leaves every pool a waiting job could
    # use to it (it waited for all while any job waited: an H100 job that no cluster could hold
    # kept every elastic job small), and waits while this cycle's victims are to be queued again.
    if settings.grow and not result.preempted and growable(snap):
        result.grown = _grow_around(framework, result, snap, backlog)
    result.decide_ms = (time.perf_counter() - started) * 1000
    return result


def _gate_probes(result: CycleResult[P], queue: Sequence[P], snap: Snapshot, probing: Probing) -> list[P]:
    """Speed probes (:func:`~loom.sched.probe.probe_gate`) for each queued job in turn: the probes
    it asks for join ``result.probes`` (and count as known and in flight for the later jobs), and a
    job held for them waits. Returns the jobs to decide."""
    asked: set[tuple[str, str]] = set()
    cells = _Known(probing.known, asked)
    in_flight = dict(probing.in_flight)
    out: list[P] = []
    for p in queue:
        queued_s = p.queued_s if p.queued_s is not None else snap.now
        gate = probe_gate(
            p.job,
            snap,
            known=cells,
            probing=in_flight,
            queued_s=queued_s,
            settings=probing.settings,
            log_sd=probing.log_sd,
        )
        for spec in gate.probes:
            family = job_family(spec)
            asked.add((family, spec.resources.gpu_models[0]))
            in_flight[family] = in_flight.get(family, 0) + 1
            result.probes.append(spec)
        if gate.hold_s is None:
            out.append(p)
            continue
        record = DecisionRecord(p.job.job_id, snap.now, "waiting", gate.reason, {}, [], {}, [])
        result.waiting.append(Waiting(p, record, gate.hold_s, gate.hold_s, held=True))
    return out


@dataclass(frozen=True, slots=True)
class _Known:
    """Cells known before the cycle, and those its probes were asked for."""

    before: Container[tuple[str, str]]
    now: set[tuple[str, str]]

    def __contains__(self, cell: object) -> bool:
        return cell in self.now or cell in self.before


def _classify(result: CycleResult[P], p: P, outcome: Outcome, settings: CycleSettings) -> None:
    decision = outcome.decision
    status = outcome.status
    if decision is not None:
        result.placed.append(Placed(p, decision, outcome.record))
        by = p.job.job_id
        result.preempted += [
            Preempted(victim, by, decision.room_by or "preemption") for victim in decision.victims
        ]
        result.shrunk += [Shrunk(job_id, w, allocs, by) for job_id, w, allocs in decision.shrunk]
        return
    # Only the quota's verdict is final before the clusters settled: it does not depend on them.
    if status.code == Code.UNRESOLVABLE and (
        settings.settled or status.reject in ("quota", "unknown_tenant")
    ):
        reason = outcome.record.reason or status.reason
        result.rejected.append(Rejected(p, status.reject, reason, status.hint, outcome.record))
        return
    retry = backoff_s(p.tries, settings)
    wake = status.wait_s + WAKE_AFTER_S if status.code == Code.UNSCHEDULABLE and status.wait_s > 0 else None
    if wake is not None:
        retry = min(retry, wake)  # a permit's patience ends then even if nothing changes
    result.waiting.append(Waiting(p, outcome.record, retry, wake, error=status.code == Code.ERROR))


def growable(snap: Snapshot) -> bool:
    """Whether any running elastic job is below its maximum (growth has something to do)."""
    return any(r.min_workers is not None and r.workers < r.max_workers for r in snap.running)


def _grow_around(
    framework: Framework | Decide, result: CycleResult[P], snap: Snapshot, backlog: int | Sequence[JobSpec]
) -> list[Grown]:
    """:func:`grow` outside the pools the cycle's waiting jobs and the ``backlog`` could use
    (nothing while any waits, when only the backlog's number is known or the policy cannot say
    which pools a job could use: a simulator baseline)."""
    waiting = [w.pending.job for w in result.waiting if not w.held]  # held: as in the simulator
    jobs = waiting if isinstance(backlog, int) else [*waiting, *backlog]
    if isinstance(backlog, int) and backlog:
        return []
    return grow_around(framework, jobs, snap)


def grow_around(
    framework: Framework | Decide | None, waiting: Sequence[JobSpec], snap: Snapshot
) -> list[Grown]:
    """:func:`grow` outside the pools ``waiting`` jobs could use, and not for the tenants whose
    quota they need; with jobs waiting and a policy that cannot say which pools a job could use
    (a simulator baseline), nothing grows. The service's cycle and the simulator's passes both
    grow by this rule."""
    if not waiting:
        return grow(snap)
    if not isinstance(framework, Framework):
        return []
    wanted: set[tuple[str, str]] = set()
    for job in waiting:
        wanted |= framework.wanted_pools(job, snap)
    return grow(snap, leave=wanted, hold=_quota_sharers(snap, waiting))


def _quota_sharers(snap: Snapshot, jobs: Sequence[JobSpec]) -> set[str]:
    """The tenants whose quota a waiting job of ``jobs`` needs: their own, and their cohorts'
    members' (growth elsewhere would take it: an elastic job grew to its tenant's whole quota and
    the tenant's waiting T4 job was then refused for quota)."""
    book = snap.quota
    if book is None:
        return set()
    tenants = {job.tenant for job in jobs}
    cohorts = {q.cohort for t in tenants if (q := book.config.tenants.get(t)) is not None and q.cohort}
    return tenants | {name for name, q in book.config.tenants.items() if q.cohort in cohorts}


def grow(
    snap: Snapshot, *, leave: Collection[tuple[str, str]] = (), hold: Collection[str] = ()
) -> list[Grown]:
    """Elastic running jobs below their maximum take free GPUs on their own cluster and GPU model
    (:func:`loom.sched.elastic.plan_grow`: higher priority first, peers in turn), as far as their
    tenant's quota allows, except in the pools of ``leave`` (cluster, GPU model: those a queued job
    could use), and not for the tenants of ``hold`` (a queued job needs their quota). The snapshot
    takes the GPUs, the quota book counts them, and its running list shows the new sizes."""
    book = snap.quota
    groups: dict[tuple[str, str], list[ElasticJob]] = {}
    by_id: dict[str, RunningJob] = {}
    for r in snap.running:
        if (
            r.min_workers is None
            or r.workers >= r.max_workers
            or (r.cluster, r.gpu_model) in leave
            or r.tenant in hold
        ):
            continue
        g = max(r.gpus_per_worker, 1)
        room = r.max_workers - r.workers
        if book is not None:
            while room > 0 and not book.check(r.tenant, room * g).ok:
                room -= 1
        if room <= 0:
            continue
        by_id[r.job_id] = r
        groups.setdefault((r.cluster, r.gpu_model), []).append(
            ElasticJob(
                job_id=r.job_id,
                priority=r.priority,
                gpus_per_worker=g,
                min_workers=min(r.min_workers, r.workers),
                max_workers=r.workers + room,
                workers=r.workers,
                cluster=r.cluster,
                allocations=r.allocations,
            )
        )
    grown: list[Grown] = []
    for (cluster, model), jobs in sorted(groups.items()):
        c, m = snap.cluster_index.get(cluster), snap.model_index.get(model)
        if c is None or m is None:
            continue
        nodes, _ = snap.node_slice(c, m)
        nodes = nodes[snap.schedulable[nodes] & (snap.free[nodes] > 0)]
        free = {snap.node_ids[i]: int(snap.free[i]) for i in nodes.tolist()}
        if not free:
            continue
        for plan in plan_grow(jobs, {cluster: free}):
            added = tuple((n, g) for n, g in plan.delta_allocations if g > 0)
            if not added:
                continue
            r = by_id[plan.job_id]
            snap.take(added, r.gpus_per_worker, r.cpu_milli, r.memory_mib)
            if book is not None:
                book.take(r.tenant, sum(g for _, g in added))
            grown.append(Grown(plan.job_id, cluster, model, plan.workers, plan.allocations, added))
    if grown:
        snap.running = with_sizes(
            snap.running, {g.job_id: (g.workers, g.allocations) for g in grown}, snap.now
        )
    return grown


def retry_after_failure(
    *, retryable: bool, attempt: int, current_attempt: int | None, max_attempts: int
) -> bool:
    """Whether a failed run is placed again (next attempt, avoiding the cluster it failed on) rather
    than the job failing: only a retryable failure of the attempt that runs now, while attempts are
    left."""
    return retryable and current_attempt == attempt and attempt < max_attempts


def expiry_avoid(clusters: Iterable[str], *, attempt: int, max_attempts: int) -> tuple[str, ...]:
    """Clusters a placement whose start was never confirmed avoids on its next attempt: the ones
    that did not confirm, while attempts are left (then any cluster may take it again, as a
    preference the framework drops when nothing else fits)."""
    return tuple(sorted(set(clusters))) if attempt < max_attempts else ()


def requeue_avoid(cause: RequeueReason, asked: Iterable[str], carried: Iterable[str]) -> frozenset[str]:
    """Clusters a requeued job's next attempt avoids. A move (cause ``migrated``: a drain, a
    network or slow-node move, backflow) avoids what it asks, for that attempt only, as the
    migration service's what-if priced it (carrying earlier attempts' avoids named a target the
    job then avoided, and a job a drain moved off never flowed back after the undrain); a failure
    adds what it asks to what earlier attempts avoided."""
    return frozenset(asked) if cause == "migrated" else frozenset(asked) | frozenset(carried)


def expected_end_s(
    job: JobSpec,
    *,
    start_s: float,
    steps_left: float,
    predicted_step_s: float | None,
    workers: int,
    delay_s: float = 0.0,
) -> float | None:
    """When a run is predicted to end, on the caller's clock: its start plus any delay before its
    first step, plus its steps left at the decision's predicted step, an elastic job given fewer
    workers than it asked for slower in proportion (the prediction is for the gang as asked). None
    without a prediction. What placement's book and the simulator both put in
    ``RunningJob.expected_end_s`` (read by :mod:`loom.sched.availability`)."""
    if not predicted_step_s:
        return None
    return start_s + delay_s + max(steps_left, 0.0) * predicted_step_s * pace_scale(job, workers)


def reading_delay_s(job: JobSpec, decision: Decision, *, steps_left: float, workers: int) -> float:
    """Seconds a ``while_syncing`` run's slow reading adds before it ends, as believed at its
    decision: :func:`loom.sched.plugins.data.data_delay_s` of the steps left at the decision's
    predicted step (an elastic job given fewer workers slower in proportion, as
    :func:`expected_end_s`) and the plan's first copy. 0 for any other run (an ``after_sync``
    run's copy is its decision's ``start_after_s``). Placement's book adds it to a run's predicted
    end as the simulator does (its belief of the same delay), so a job waiting on that run's GPUs
    is woken at the same time on both sides (a hunt found the book 1.7 s early)."""
    sync = decision.sync
    if sync is None or sync.start != "while_syncing" or not decision.predicted_step_s:
        return 0.0
    run_s = max(steps_left, 0.0) * decision.predicted_step_s * pace_scale(job, workers)
    return float(data_delay_s(run_s, np.asarray(sync.initial_s, dtype=np.float64), "while_syncing"))


def progress_end_s(*, now_s: float, done: float, elapsed_s: float, done_before: float) -> float | None:
    """A running job's end re-predicted from its own measured pace, on the caller's clock: the share
    of its steps done went from ``done_before`` to ``done`` (0-1) in ``elapsed_s`` seconds (measured
    on the reporting agent's clock, so no clock skew enters), and the rest goes at that pace. None
    when the report cannot tell (nothing done in that time, or no time passed).

    A run's measured pace replaces the decision's prediction, which came from beliefs: a job several
    times slower than believed would otherwise look "about to end" for most of its run, and a gang
    would wait for its GPUs (:mod:`loom.sched.availability`). What placement's book does at every
    progress report (the pace since the previous one) and the simulator at its run's report
    (``loom.sim.engine.OBSERVE_AT``: the pace since the run began)."""
    share = done - done_before
    if not (elapsed_s > 0 and math.isfinite(elapsed_s)) or not share > 0:
        return None
    return now_s + elapsed_s * max(1.0 - done, 0.0) / share


def fold_within(result: CycleResult[P], snap: Snapshot | None = None) -> set[str]:
    """A run placed by this cycle and then shrunk or preempted by a later job of it is settled
    within the cycle, since it has not started: a shrink becomes the placement's size (its part's
    allocations and workers), a preemption takes the placement back (the job waits, as if never
    placed). Returns the job ids taken back. ``result`` is changed in place.

    The snapshot the cycle ran on (``snap``) counted each placement in its tenant's quota, and a
    shrink or a preemption gives GPUs back in the snapshot but not in the quota (a started run's
    quota is given back when its run is resized or dropped); here the tenant gets back what the
    shrink took from a placement, and a placement taken back whole. Without it a tenant whose job
    was shrunk within its own cycle kept the difference in its quota for good (queued behind
    others by a fair share it did not hold, refused by a quota it did not use)."""
    quota = snap.quota if snap is not None else None
    placed = {p.pending.job.job_id: p for p in result.placed}
    undone = {pre.job_id for pre in result.preempted if pre.job_id in placed}
    for s in result.shrunk:
        p = placed.get(s.job_id)
        if p is None or s.job_id in undone:
            continue
        d = p.decision
        before = sum(g for _, g in d.parts[0].allocations)
        d.parts[0] = dataclasses.replace(d.parts[0], allocations=s.allocations)
        d.workers = s.workers
        if quota is not None:
            quota.give(p.pending.job.tenant, max(before - sum(g for _, g in s.allocations), 0))
    if quota is not None:
        for job_id in sorted(undone):
            quota.give(
                placed[job_id].pending.job.tenant, sum(g for _, g in placed[job_id].decision.allocations)
            )
    if undone:
        result.placed = [p for p in result.placed if p.pending.job.job_id not in undone]
        result.waiting += [
            Waiting(placed[job_id].pending, placed[job_id].record, 0.0) for job_id in sorted(undone)
        ]
    result.preempted = [pre for pre in result.preempted if pre.job_id not in placed]
    result.shrunk = [s for s in result.shrunk if s.job_id not in placed]
    return undone


def admission_check(job: JobSpec) -> None:
    """Refuse at admission what no cluster state could fix: bad DAGs (a cycle is
    :class:`~loom.sched.dag.DagCycleError`), elastic bounds, pipelines with gangs;
    :class:`~loom.errors.InvalidInputError` says what to change."""
    if (where := nul_text(job)) is not None:
        raise InvalidInputError(f"{where} holds a NUL character (\\u0000), which stored text cannot hold")
    if job.min_workers is not None and job.min_workers > job.workers:
        raise InvalidInputError(
            f"min_workers ({job.min_workers}) is more than workers ({job.workers}); workers is the maximum"
        )
    if job.stages:
        dag.validate(job.stages)
        for stage in job.stages:
            dag.stage_job_id(job.job_id, stage.name)
    if job.pipeline is not None and job.stages:
        raise InvalidInputError("a job is either a pipeline (layers) or a DAG (stages), not both")
    check_labels(job.labels)
    if job.pipeline is not None and (job.min_workers is not None or job.workers != 1):
        raise InvalidInputError(
            "a pipeline job sizes its stages from its layers: leave workers and min_workers out"
        )
    if job.pipeline is not None and job.resources.gpus != 1:
        # Accepted before, and silently ignored: a newcomer's 4 got 12 GPUs.
        raise InvalidInputError(
            f"a pipeline job sizes each stage's GPUs from its layers' memory: leave resources.gpus out"
            f" (it is {job.resources.gpus}); resources.gpu_models still chooses the GPU models"
        )
