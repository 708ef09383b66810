"""Placement's in-memory book: nodes, runs holding GPUs, the network, trust; and the snapshot it builds.

Everything here is rebuilt from PostgreSQL on start (and on becoming leader), then kept in step by
the service's handlers, which change it only after their transaction committed.
"""

import dataclasses
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import asyncpg
import msgspec
from opentelemetry import propagate
from opentelemetry.context import Context

from loom.model.capacity import NodeCapacity
from loom.model.family import job_family
from loom.model.profiles import speeds_for_model
from loom.model.scu import TASK_TYPES, UNPROFILED_SPEED, Precision
from loom.model.topology import Topology
from loom.sched.cycle import expected_end_s, progress_end_s
from loom.sched.elastic import resized_end_s
from loom.sched.quota import OPEN, QuotaBook, TenantConfig
from loom.sched.snapshot import (
    ClusterInfo,
    Economics,
    NetMatrix,
    QueuedShapes,
    RunningJob,
    SeenShapes,
    Snapshot,
    job_precision,
    remap_queued,
)
from loom_proto.jobs import JobSubmitted
from loom_proto.net import LinkState


@dataclass
class QueuedJob:
    """A job accepted and waiting for a placement: the attempt it would be, and where not to go."""

    job: JobSubmitted
    carrier: dict[str, str]
    attempt: int = 1
    avoid: frozenset[str] = frozenset()
    parent: str | None = None
    tries: int = 0
    """Cycles that found no room (backoff grows with it)."""
    not_before: float = 0.0
    """Monotonic time before which a cycle does not retry it (unless capacity changed)."""
    fair_share: float | None = None
    """Its tenant's share of its quota when it was first queued (its place in the queue)."""
    resume_step: int = 0
    """The step the next run starts from: a run lost with its cluster resumes from its checkpoint
    (:func:`loom.migrate.resume.resume_point`)."""
    queued_at: float | None = None
    """Wall seconds when a cycle first saw it (how long speed probes may hold it); None: not yet."""

    @property
    def queued_s(self) -> float | None:
        """:attr:`queued_at` (the cycle's ``Pending.queued_s``)."""
        return self.queued_at

    @property
    def context(self) -> Context:
        """The submission's trace context."""
        return propagate.extract(self.carrier)


@dataclass
class Run:
    """A placed or running attempt: what it holds, for releases, preemption, elastic and quotas."""

    queued: QueuedJob
    attempt: int
    parts: list[tuple[str, str, tuple[tuple[str, int], ...]]]
    """(cluster, gpu_model, allocations), lead first."""
    workers: int
    progress: float = 0.0
    labels: Mapping[str, str] = field(default_factory=dict)
    started_at: float | None = None
    """When it was placed (the snapshot's clock, wall seconds); None when not known."""
    predicted_step_s: float | None = None
    """The decision's predicted seconds per step; None when placement bound none."""
    end_s: float | None = None
    """The predicted end as a resize or the run's progress reports left it (None: from the start,
    :attr:`expected_end_s`)."""
    progress_at_start: float = 0.0
    """Share of the work already done when ``started_at`` was taken (a run restored from the
    store after a restart or leader change is timed from then, for what is left)."""
    delay_s: float = 0.0
    """Seconds before its end beyond its steps (a ``while_syncing`` run's slow reading,
    :func:`loom.sched.cycle.reading_delay_s`); not kept in the store (a restored run is timed from
    its progress reports)."""
    taught: bool = False
    """Whether a progress report of this run has been offered to the speed learner (the store keeps
    one observation per run whatever is offered; this only spares the later reports the offer)."""
    paced: tuple[float, float] | None = None
    """The run's last known point on its agent's clock: (seconds, share of the job's steps done),
    from ``JobStarted.started_at`` (with :attr:`progress_at_start`, the share a resumed run starts
    from) and each progress report; its pace since then re-predicts its end at the next report.
    None until the agent says (a run restored from the store after it started starts from its
    first report after the restore)."""
    _core: RunningJob | None = None

    @property
    def job(self) -> JobSubmitted:
        """The job's spec."""
        return self.queued.job

    @property
    def gpus(self) -> int:
        """GPUs held in all."""
        return sum(g for _, _, allocs in self.parts for _, g in allocs)

    def running_job(self) -> RunningJob:
        """The run as the scheduling core sees it (built once; progress is refreshed by the book)."""
        if self._core is None:
            self._core = self._build_core()
        return self._core

    def _build_core(self) -> RunningJob:
        job = self.job
        lead_cluster, lead_model, _ = self.parts[0]
        return RunningJob(
            job_id=job.job_id,
            tenant=job.tenant,
            priority=job.priority,
            cluster=lead_cluster,
            gpu_model=lead_model,
            allocations=tuple(a for _, _, allocs in self.parts for a in allocs),
            progress=self.progress,
            preemptible=job.preemptible,
            labels=job.labels,
            task_type=job.task_type,
            workers=self.workers,
            # Only single-part, non-pipeline runs are resized (elastic growth and shrink).
            min_workers=job.min_workers if len(self.parts) == 1 and job.pipeline is None else None,
            max_workers=job.workers,
            gpus_per_worker=job.resources.gpus,
            cpu_milli=job.resources.cpu_milli,
            memory_mib=job.resources.memory_mib,
            attempt=self.attempt,
            expected_end_s=self.expected_end_s,
            started_s=self.started_at,
            done_at_start=self.progress_at_start,
            spec=job,
        )

    @property
    def expected_end_s(self) -> float | None:
        """When the run is predicted to end: its placement plus its steps at the predicted step
        (what :mod:`loom.sched.availability` reads); None when either is not known."""
        if self.end_s is not None:
            return self.end_s
        if self.started_at is None:
            return None
        return expected_end_s(
            self.job,
            start_s=self.started_at,
            steps_left=max(1.0 - self.progress_at_start, 0.0) * self.job.work.steps,
            predicted_step_s=self.predicted_step_s,
            workers=self.workers,
            delay_s=self.delay_s,
        )


class Book:
    """Nodes, runs, links and trust as placement knows them; :meth:`snapshot` is a cycle's input."""

    def __init__(
        self,
        topology: Topology | None = None,
        economics: Economics | None = None,
        tenants: TenantConfig | None = None,
    ) -> None:
        self.nodes: dict[str, NodeCapacity] = {}
        self.waiting: set[str] = set()
        """The queue as the scheduling core counts it (``Snapshot.waiting``): jobs nothing fitted,
        until placed or rejected; the service discards a job that leaves the queue otherwise
        (cancelled, finished, or its territory handed back)."""
        self.probes: set[str] = set()
        """Speed probes known to the queue (``Snapshot.probes``), kept across snapshots."""
        self.seen = SeenShapes()
        """The latest jobs' worker shapes (``Snapshot.seen``), kept across snapshots as :attr:`waiting`
        is; a new leader's ``load`` fills it from the jobs table."""
        self.queued = QueuedShapes()
        """The queued jobs' shapes (``Snapshot.queued``), kept across snapshots as :attr:`waiting`
        is (a rebuilt snapshot re-indexes their pools by its clusters and models: ``_queued_order``);
        dropped with a job's place in :attr:`waiting`."""
        self._queued_order: tuple[list[str], list[str]] = ([], [])
        """The cluster ids and GPU models the shapes' pools are indexed by (the last snapshot's)."""
        self.tenants = tenants or OPEN
        """Tenant quotas: every snapshot carries a book of them with what each tenant holds."""
        self.runs: dict[str, Run] = {}
        self.trust: dict[str, float] = {}
        self.economics = economics or Economics()
        self.net = NetMatrix.from_topology(topology) if topology is not None else NetMatrix([])
        self._speed: dict[tuple[str, str], float] = {}
        self._half_speed: dict[tuple[str, str], float] = {}
        self._memory: dict[str, float] = {}
        self._usage: dict[str, int] = {}
        """GPUs held per tenant, kept in step with the runs."""
        self._snap: Snapshot | None = None
        """Kept between cycles and updated in step with the book; rebuilt after anything else."""
        self.pending: dict[str, Run] = {}
        """Runs a cycle placed whose transaction has not committed yet (a batch still writing
        while the next one decides): a rebuilt snapshot lists them too, so no later cycle offers
        their GPUs again. :meth:`add_run` adopts one on commit; :meth:`forget_pending` drops those
        of a batch whose write failed."""
        self.closed: dict[str, str] = {}
        """Clusters closed to new work (drained by ``loom drain``, or failed) -> why: their nodes
        take no new work; change with :meth:`close`."""
        self.suspect_nodes: frozenset[str] = frozenset()
        """Nodes a slow run made suspect: no new work there for a while; change with :meth:`suspect`."""
        self.learned: dict[tuple[str, str], float] = {}
        """(job family, gpu_model) -> learned speed factor the snapshot applies (see
        :mod:`loom.model.learn`); change it with :meth:`set_learned`."""
        self.measured: frozenset[tuple[str, str]] = frozenset()
        """The cells of :attr:`learned` that runs of their own measured (``Snapshot.measured``)."""
        self.risk: tuple[float, float] = (0.0, 1.0)
        """``Snapshot.set_risk``'s GPU-hours and factor (the learner's settings; the service sets
        them): off until set."""

    def clear_runs(self) -> None:
        """Forget every run (before rebuilding them from the store); pending ones are kept."""
        self.runs.clear()
        self._usage.clear()
        self.invalidate()

    def invalidate(self) -> None:
        """The next cycle rebuilds its snapshot from the book (after changes made outside cycles)."""
        self._snap = None

    # ---- runs ----------------------------------------------------------------------------------

    def add_run(self, run: Run, *, in_snapshot: bool = False, from_store: bool = False) -> None:
        """A committed placement: its GPUs (and workers' CPU and RAM) are promised.

        ``in_snapshot``: the cycle that decided it already took the GPUs in the kept snapshot and
        listed the run in its running jobs.
        ``from_store``: the run was read back from PostgreSQL, whose capacity book already counts
        its GPUs; only its CPU, RAM and tenant usage are added.
        """
        self.runs[run.job.job_id] = run
        self._reserve(run, +1, gpus=not from_store)
        if self.pending.get(run.job.job_id) is run:
            del self.pending[run.job.job_id]
            in_snapshot = True  # a snapshot rebuilt since the cycle listed it as pending
        if self._snap is None:
            return
        if in_snapshot:
            return
        self._list(self._snap, run)

    def add_pending(self, run: Run) -> None:
        """A run a cycle just placed in the kept snapshot, its transaction still to commit."""
        self.pending[run.job.job_id] = run

    def leave_queue(self, job_ids: Iterable[str]) -> None:
        """These jobs left the queue otherwise than by a decision (cancelled, finished, handed
        back): out of :attr:`waiting` and their shapes out of :attr:`queued`."""
        for job_id in job_ids:
            self.waiting.discard(job_id)
            self.queued.pop(job_id, None)

    def forget_pending(self, job_ids: Iterable[str]) -> None:
        """A batch's write failed: its placements are not taken; the next cycle rebuilds the snapshot."""
        for job_id in job_ids:
            self.pending.pop(job_id, None)
        self.invalidate()

    @staticmethod
    def _list(snap: Snapshot, run: Run) -> None:
        """Take a run's GPUs, CPU, RAM and quota in a snapshot, and list it as running."""
        core = run.running_job()
        snap.take(core.allocations, core.gpus_per_worker, core.cpu_milli, core.memory_mib)
        if snap.quota is not None:
            snap.quota.take(run.job.tenant, run.gpus)
        snap.running.append(core)

    def drop_run(self, job_id: str, attempt: int | None = None, *, in_snapshot: bool = False) -> Run | None:
        """The run ended or was given up; its promises are withdrawn. None if unknown (or another attempt).

        ``in_snapshot``: the cycle that preempted it already gave its GPUs back in the kept snapshot.
        """
        run = self.runs.get(job_id)
        if run is None or (attempt is not None and run.attempt != attempt):
            return None
        del self.runs[job_id]
        self._reserve(run, -1)
        if self._snap is not None:
            core = run.running_job()
            if not in_snapshot:
                self._snap.give_back(core.allocations, core.gpus_per_worker, core.cpu_milli, core.memory_mib)
            if self._snap.quota is not None:
                # A preemption gives the victim's GPUs back in the snapshot, not its quota: here.
                self._snap.quota.give(run.job.tenant, run.gpus)
            self._snap.running = [r for r in self._snap.running if r.job_id != job_id]
        return run

    def set_began(self, job_id: str, attempt: int, at: float) -> None:
        """The agent started the run's work at ``at`` (its clock): its pace is measured from then."""
        run = self.runs.get(job_id)
        if run is not None and run.attempt == attempt and run.paced is None:
            run.paced = (at, run.progress_at_start)

    def set_progress(
        self,
        job_id: str,
        fraction: float,
        *,
        attempt: int | None = None,
        now: float | None = None,
        at: float | None = None,
    ) -> None:
        """A run reported progress: preemption prefers victims that lose least. Given the service's
        clock ``now`` and the report's ``at`` (the agent's clock), its end is re-predicted from its
        pace since its previous report, or since it began (:func:`loom.sched.cycle.progress_end_s`),
        so waits for its GPUs (:mod:`loom.sched.availability`) follow what it really does, not what
        placement believed when it placed it. The pace is added to ``now``, when the report is
        applied (the report's transit makes the end that much late). Both clocks are wall clocks:
        a sim agent that runs jobs ``time_scale`` x faster than their job clock (the demo's 60)
        makes paced ends wall seconds where ends from beliefs are job-clock seconds; with a real
        backend (scale 1) they agree."""
        run = self.runs.get(job_id)
        if run is None or fraction <= run.progress or (attempt is not None and attempt != run.attempt):
            return
        run.progress = fraction
        end = None
        if now is not None and at is not None:
            if run.paced is not None:
                then, done_then = run.paced
                end = progress_end_s(now_s=now, done=fraction, elapsed_s=at - then, done_before=done_then)
            run.paced = (at, fraction)
            if end is not None:
                run.end_s = end
        if run._core is not None:
            old = run._core
            run._core = dataclasses.replace(
                old, progress=fraction, expected_end_s=end if end is not None else old.expected_end_s
            )
            if self._snap is not None:
                self._snap.running = [run._core if r is old else r for r in self._snap.running]

    def resize_run(
        self,
        job_id: str,
        parts: list[tuple[str, str, tuple[tuple[str, int], ...]]],
        workers: int,
        *,
        now: float,
    ) -> None:
        """An elastic run's allocation changed at ``now``: what is left of it is predicted to take
        longer or shorter in proportion (:func:`loom.sched.elastic.resized_end_s`)."""
        run = self.runs[job_id]
        end = resized_end_s(run.running_job(), workers, now)
        self._reserve(run, -1)
        run.parts = parts
        run.workers = workers
        run.end_s = end
        run.paced = None  # its pace changes with its size: measured afresh from its next report
        run._core = None
        self._reserve(run, +1)
        self.invalidate()

    def _reserve(self, run: Run, sign: int, *, gpus: bool = True) -> None:
        res = run.job.resources
        tenant = run.job.tenant
        self._usage[tenant] = max(self._usage.get(tenant, 0) + sign * run.gpus, 0)
        for _, _, allocs in run.parts:
            for node, held in allocs:
                cap = self.nodes.get(node)
                if cap is None:
                    continue
                workers = held // max(res.gpus, 1)
                self.nodes[node] = dataclasses.replace(
                    cap,
                    gpus_reserved=max(cap.gpus_reserved + sign * held, 0) if gpus else cap.gpus_reserved,
                    cpu_reserved=max(cap.cpu_reserved + sign * res.cpu_milli * workers, 0),
                    memory_reserved=max(cap.memory_reserved + sign * res.memory_mib * workers, 0),
                )

    def usage_by_tenant(self) -> dict[str, int]:
        """GPUs held per tenant (the quota book's input)."""
        return {t: g for t, g in self._usage.items() if g > 0}

    # ---- network -------------------------------------------------------------------------------

    def on_link(self, link: LinkState) -> None:
        """Adopt a link-state event (regions unknown to the topology are added)."""
        for region in (link.src, link.dst):
            if region not in self.net.index:
                self._add_region(region)
        self.net.set_link(
            link.src,
            link.dst,
            rtt_ms=link.rtt_ms_forecast or link.rtt_ms_p50
            if not link.stale
            else max(link.rtt_ms_p50, 1.0) * 2,
            bandwidth_gbps=link.bandwidth_gbps,
            loss=link.loss_rate,
            degraded=link.degraded or link.stale,
        )

    def link_degraded(self, src: str, dst: str) -> bool | None:
        """Whether the book holds the link from ``src`` to ``dst`` degraded (or stale); None for a
        region it does not know."""
        i, j = self.net.index.get(src), self.net.index.get(dst)
        if i is None or j is None:
            return None
        return bool(self.net.degraded[i, j])

    def _add_region(self, region: str) -> None:
        self.invalidate()
        old = self.net
        regions = [*old.regions, region]
        new = NetMatrix(regions)
        n = len(old.regions)
        new.rtt_ms[:n, :n] = old.rtt_ms
        new.bandwidth_gbps[:n, :n] = old.bandwidth_gbps
        new.loss[:n, :n] = old.loss
        new.degraded[:n, :n] = old.degraded
        self.net = new

    # ---- snapshot ------------------------------------------------------------------------------

    def _speeds(self, models: Iterable[str]) -> dict[tuple[str, str], float]:
        for model in models:
            if (model, TASK_TYPES[0]) in self._speed:
                continue
            # A model without a profile is unprofiled: counted at the trust floor, never at 1.0.
            tables = speeds_for_model(model)
            self._speed.update({(model, t): v for t, v in tables.speed.items()})
            self._half_speed.update({(model, t): v for t, v in tables.half_speed.items()})
            self._memory[model] = tables.memory_gib
        return self._speed

    def speed(self, model: str, task_type: str, precision: Precision = "fp32") -> float:
        """One GPU's SCU for a task type at a precision (:data:`~loom.model.scu.UNPROFILED_SPEED` for
        a model the library does not know): what a job's learned factor multiplies, as the snapshot's
        :meth:`~loom.sched.snapshot.Snapshot.believed_speeds` does."""
        table = self._speeds([model])
        fp32 = table.get((model, task_type), UNPROFILED_SPEED)
        if precision == "fp16":
            return self._half_speed.get((model, task_type), fp32)
        return fp32

    def believed_step_s(self, job: JobSubmitted, model: str, workers: int) -> float | None:
        """Seconds per step placement believes ``job`` takes on ``model`` with ``workers``: its
        reference step over the GPU's SCU for the job (task type, precision, learned factor, as
        ``Snapshot.job_gpu_speed`` reads them), an elastic job with fewer workers slower in
        proportion (compute only; no network). None for an unknown model or no speed."""
        if not model:
            return None
        speed = self.speed(model, job.task_type, job_precision(job))
        speed *= self.learned.get((job_family(job), model), 1.0)
        if speed <= 0:
            return None
        return job.work.step_time_s / speed * max(job.workers, 1) / max(workers, 1)

    def set_learned(
        self, learned: dict[tuple[str, str], float], measured: Iterable[tuple[str, str]] | None = None
    ) -> None:
        """Adopt new learned speed factors and the cells runs of their own measured
        (``Snapshot.measured``; None keeps those adopted before): the kept snapshot applies them
        from its next cycle."""
        cells = self.measured if measured is None else frozenset(measured)
        if learned == self.learned and cells == self.measured:
            return
        self.learned = dict(learned)
        self.measured = cells
        if self._snap is not None:
            self._snap.set_learned(self.learned, self.measured)

    def close(self, clusters: Mapping[str, str]) -> bool:
        """Set the closed clusters (cluster -> why: ``"drained"``, ``"failed"``); True when that
        changed them (the next cycle rebuilds its snapshot)."""
        closed = dict(clusters)
        if closed == self.closed:
            return False
        self.closed = closed
        self.invalidate()
        return True

    def suspect(self, nodes: Iterable[str]) -> bool:
        """Set the suspect nodes (:class:`loom.migrate.nodes.SuspectNodes`); True when that changed them."""
        suspect = frozenset(nodes)
        if suspect == self.suspect_nodes:
            return False
        self.suspect_nodes = suspect
        self.invalidate()
        return True

    def snapshot(self, now: float) -> Snapshot:
        """The cycle's input: nodes, clusters with trust, runs, network, prices and speeds.

        The same object is handed to every cycle while nothing outside cycles changed the book:
        decisions taken in it stay taken (they are committed, or the book is rebuilt).
        """
        if self._snap is not None:
            self._snap.now = now
            self._snap.net = self.net
            self._snap.seen = self.seen  # a new leader's load replaces it
            return self._snap
        clusters: dict[str, ClusterInfo] = {}
        models: set[str] = set()
        for cap in self.nodes.values():
            if cap.gpu_model is not None:
                models.add(cap.gpu_model)
            if cap.cluster not in clusters:
                clusters[cap.cluster] = ClusterInfo(
                    id=cap.cluster, region=cap.region, zone=cap.zone, trust=self.trust.get(cap.cluster, 1.0)
                )
        for region in {c.region for c in clusters.values()}:
            if region not in self.net.index:
                self._add_region(region)
        nodes = [
            dataclasses.replace(cap, schedulable=False)
            if cap.schedulable and (cap.cluster in self.closed or cap.node in self.suspect_nodes)
            else cap
            for cap in self.nodes.values()
        ]
        self._snap = Snapshot(
            nodes,
            clusters=clusters,
            running=[r.running_job() for r in self.runs.values()],
            net=self.net,
            economics=self.economics,
            speed=self._speeds(models),
            half_speed=self._half_speed,
            gpu_memory_gib=self._memory,
            learned=self.learned,
            now=now,
        )
        self._snap.measured = self.measured
        self._snap.set_risk(*self.risk)
        self._snap.closed = dict(self.closed)
        self._snap.quota = QuotaBook(self.tenants, self.usage_by_tenant())
        self._snap.waiting = self.waiting  # the same set: the framework keeps it across snapshots
        self._snap.probes = self.probes
        self._snap.seen = self.seen
        # The same shapes, re-indexed by this snapshot's pools (the framework adds to them).
        remap_queued(self.queued, *self._queued_order, self._snap)
        self._queued_order = ([c.id for c in self._snap.clusters], list(self._snap.models))
        self._snap.queued = self.queued
        for run in self.pending.values():
            self._list(self._snap, run)
        return self._snap


def queued_from_row(row: asyncpg.Record) -> QueuedJob:
    """A queue entry from a ``jobs`` row (the next attempt is one more than the row's)."""
    return QueuedJob(
        job=msgspec.json.decode(row["spec"], type=JobSubmitted),
        carrier=json.loads(row["trace_context"]),
        attempt=int(row["attempt"]) + 1,
        avoid=frozenset(row["avoid_clusters"] or ()),
        parent=row["parent"],
        resume_step=int(row.get("resume_step") or 0),
    )


def run_from_row(
    row: asyncpg.Record,
    nodes: Mapping[str, NodeCapacity],
    *,
    now: float | None = None,
    step_s: Callable[[JobSubmitted, str, int], float | None] | None = None,
) -> Run:
    """A run from :func:`loom.store.jobs.active_runs`' row.

    The store keeps no predicted end: given ``now`` and ``step_s`` (the believed seconds per step
    of the job on the lead's GPU model with its workers), the run is timed from ``now`` for the
    work its progress says is left, so waits computed from running jobs' ends
    (:mod:`loom.sched.availability`) stay finite across a restart or a change of leader.
    """
    queued = queued_from_row(row)
    queued.attempt = int(row["attempt"])
    by_cluster: dict[str, list[tuple[str, int]]] = {}
    for node, cluster, gpus in zip(row["nodes"], row["clusters"], row["gpus"], strict=True):
        by_cluster.setdefault(cluster, []).append((node, int(gpus)))
    lead = row["cluster"]
    order = sorted(by_cluster, key=lambda c: (c != lead, c))
    parts = []
    for cluster in order:
        allocs = tuple(by_cluster[cluster])
        model = next((nodes[n].gpu_model for n, _ in allocs if n in nodes and nodes[n].gpu_model), "") or ""
        parts.append((cluster, model, allocs))
    job = queued.job
    workers = int(row["workers"] or job.workers)
    believed = step_s(job, parts[0][1], workers) if step_s is not None and parts else None
    # A decision's predicted step is the gang's as asked; the believed step at fewer workers is
    # taken back to that (expected_end_s scales it again for the workers the run has).
    scale = max(job.workers, 1) / max(workers, 1) if job.pipeline is None else 1.0
    return Run(
        queued=queued,
        attempt=int(row["attempt"]),
        parts=parts,
        workers=workers,
        progress=float(row["progress"]),
        labels=job.labels,
        started_at=now if step_s is not None else None,
        predicted_step_s=believed / scale if believed is not None else None,
        progress_at_start=float(row["progress"]),
    )
