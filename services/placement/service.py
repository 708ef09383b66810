"""Placement: admits submitted jobs, decides where they run, reserves capacity, commands agents.

Sole writer of jobs, job events, the capacity book, reservations and decision records. One
instance per shard leads, through a NATS KV lease; every transaction checks the lease's fencing
token first, so a deposed leader's writes are refused. Every decision is made in one PostgreSQL
transaction together with the inbox claim of the messages that caused it and the outbox rows of
the messages it implies, so a crash at any point neither loses nor doubles a decision.

Decisions come from the scheduling framework (:mod:`loom.sched.framework`) with the default
profile: the same code the simulator and ``loom bench placement`` run.

Submissions are pipelined (:meth:`PlacementService._admit`): while one batch writes and commits,
the next is claimed, inserted and decided in memory on top of the first one's placements (kept
pending in the book until they commit); it writes only once the first has ended, and is rolled
back and redelivered when the first failed. A cycle's writes are one statement
(:func:`loom.store.jobs.apply_cycle`); its messages go out after the commit, sent in commit order
with their acks awaited together (:meth:`loom.store.outbox.OutboxRelay.publish_now`). Where each
batch's time goes is in the health answer's ``pipeline`` (``loom bench e2e`` reports it).

Learned speeds: each single-part run teaches the speed learner (:mod:`loom.model.learn`) what
its job family really gets on its GPU model, once: from its first progress report that carries the
measured compute step (``JobProgress.compute_step_s``; the agent reports every tenth of the
steps), else from its completion (``JobCompleted.observed_step_s``). The observation is stored in
the same transaction as the event (``speed_observations``, keyed by the run, so a redelivery or the
completion after a progress report teaches nothing twice), the learner is rebuilt from those rows
when this instance starts leading, and every cycle's snapshot applies its factors
(``Snapshot.set_learned``). With ``explore_share`` above 0, that share of cycles at most offers
still-uncertain (family, GPU) pairs at an optimistic speed (see the learner's exploration rule).

Shards (:mod:`loom.sched.shards`): with region groups configured, each shard has a leader of its
own and handles only its share. Submissions: every shard reads all of them through durable
consumers of its own (``placement-submitted-<shard>``; the global shard keeps the unsuffixed
names) and acks, without storing anything, those :func:`~loom.sched.shards.route` sends elsewhere
(undecodable ones are the global shard's to reject). Territories: a cluster belongs to the
territory of its region (a group's, or the global shard's); an instance holds its own shard's
territory while it leads, and the global shard's leader also takes a regional territory over
while that shard has no leader and none of its instances waits for it: it acquires that shard's
lease (``placement.<shard>``), claims its fence with that token, loads the territory's nodes,
runs and queued jobs, and runs that shard's durable consumers too (so its submissions are placed
and the events nobody recorded since it died are), until an instance of the shard announces
itself in the lease bucket (key ``standby.<shard>``, renewed by every regional instance that does
not lead): then it stops those consumers, drops the territory from memory and releases the lease.
So ownership is the fence: a territory's row in ``fences`` says which holder, with which token,
may write for its clusters, and every transaction checks the fences of all the
territories the instance holds (:meth:`PlacementService._tx`). An instance's capacity book, runs
and view deltas cover the clusters of the territories it holds only, lifecycle events are
handled by the holder of the event's cluster (the others ack them), and a cycle refuses to
reserve on a cluster it does not hold. Queued jobs are reloaded by the shard they route to.
"""

import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import itertools
import json
import os
import socket
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any, Final

import asyncpg
import msgspec
import nats.errors
import structlog
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.js.errors import BucketNotFoundError, KeyNotFoundError
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode

from loom.bus import BusError, ConsumerRunner, ConsumerSpec, Delivery, stop_runners
from loom.bus.consumer import caught_up, stored_at
from loom.bus.lease import LEASE_BUCKET, LeaderLease
from loom.bus.reply import answerable, respond
from loom.bus.requests_move import replay_left_requests
from loom.errors import InvalidInputError, NotLeaderError, TransientError
from loom.metering.run import bounded
from loom.migrate.checkpoints import Checkpoint, choose, late_report, report_refusal
from loom.migrate.health import (
    Health,
    HealthNotices,
    Liveness,
    PingOutcome,
    affected_jobs,
    classify,
    link_unreachable,
    reachability,
)
from loom.migrate.nodes import Pace, PaceSettings, SuspectNodes, runs_on_nodes
from loom.migrate.queue import options_to_wire, queued_for_part
from loom.migrate.replicas import Replica
from loom.migrate.resume import Resume, resume_point
from loom.model.capacity import NodeCapacity
from loom.model.family import job_family
from loom.model.learn import HeldLessons, LearnSettings, SpeedLearner, run_speed, teaches_while_running
from loom.model.ledger import LedgerCluster
from loom.model.topology import Topology
from loom.runtime.leader import Leadership, lead
from loom.runtime.service import ServiceContext
from loom.sched import dag
from loom.sched.cycle import (
    MAX_BACKOFF_S,
    CycleResult,
    CycleSettings,
    Grown,
    Probing,
    admission_check,
    expiry_avoid,
    fair_share_of,
    fold_within,
    reading_delay_s,
    requeue_avoid,
    retry_after_failure,
    room_taker,
    run_cycle,
    stage_beyond_quota,
)
from loom.sched.framework import Decision, Framework
from loom.sched.framework import Status as Verdict
from loom.sched.plugins.network import AlphaLearner, predict_step_s, users_wait_s
from loom.sched.probe import PROBE_LABEL, ProbeSettings
from loom.sched.profile import build_framework
from loom.sched.quota import OPEN, TenantConfig
from loom.sched.shards import GLOBAL, ShardMap, route, route_of
from loom.sched.snapshot import SEEN_JOBS, Economics, SeenShapes, Snapshot
from loom.security import (
    attempts_scope,
    foreign_cancellation,
    foreign_report,
    received_cancellation,
    report_claim_id,
    tenant_claim_id,
)
from loom.store import failed as failed_store
from loom.store import fence, inbox, moves, outbox, speeds
from loom.store import jobs as repo
from loom.store import ledger as ledger_store
from loom.store import replicas as replica_store
from loom.store.fence import FencedError
from loom.store.pool import ConflictError, transaction, with_retry
from loom.store.roles import tenant_scope
from loom.tasks import cancel_and_wait
from loom.telemetry import metrics as prom
from loom.telemetry import span_name
from loom_proto import subjects
from loom_proto.clusters import (
    MAX_STARTS_PER_MESSAGE,
    MAX_TRACE_VALUE_CHARS,
    ClusterHealthChanged,
    ResizeJob,
    SlowRun,
    StartJob,
    StartJobs,
    StopJob,
)
from loom_proto.codec import DecodeError, check_payload, decode, encode
from loom_proto.ids import InvalidIdError, validate_id
from loom_proto.jobs import (
    JOB_STATES,
    TERMINAL_STATES,
    Affinity,
    JobCancelled,
    JobCheckpointed,
    JobCompleted,
    JobFailed,
    JobPlaced,
    JobProgress,
    JobRejected,
    JobRequeued,
    JobResized,
    JobSpec,
    JobStarted,
    JobSubmitted,
    NodeAllocation,
    PlacedPart,
    RejectCode,
    RequeueReason,
)
from loom_proto.net import LinkState
from loom_proto.view import ViewDelta
from loom_services.placement.book import Book, QueuedJob, Run, queued_from_row, run_from_row

log = structlog.get_logger("placement")
_tracer = trace.get_tracer("loom_services.placement")


def _default_grace(grace_s: float | None) -> float:
    """The lease grace asked for, else 10 s on a replicated bus and none on a single server."""
    if grace_s is not None:
        return grace_s
    return 10.0 if int(os.environ.get("LOOM_STREAM_REPLICAS", "1") or "1") > 1 else 0.0


PRODUCER = "placement"
LIFECYCLE_SUBJECTS = subjects.job_events_of("started", "progress", "checkpointed", "completed", "failed")
"""What placement hears of runs on the JOBS stream; cancellations come from REQUESTS (clients')."""
LifecycleEvent = JobStarted | JobProgress | JobCheckpointed | JobCompleted | JobFailed | JobCancelled
ACK_WAIT_S = 5.0
CANCELLED_PREFIX = subjects.JOBS_CANCELLED_ALL.removesuffix("*")
CANCEL_WAIT_S = 2.0
"""How long a batch of cancellations waits for the runs' events before it to be handled."""
LIFECYCLE_LINGER_S = 0.05
"""How long a fetched lifecycle event waits for others to share its transaction."""
MIN_DECIDE_SLICE = 8
"""The fewest submissions one slice decides (see :func:`decide_slice`)."""
WHATIF_SHARE = 0.25
"""What-ifs take at most about this share of the event loop (``on_whatif`` paces them)."""
LOOPS_STOP_GRACE_S = 5.0
"""How long the lead's loops have to end once cancelled before they are cancelled again
(:func:`loom.tasks.cancel_and_wait`): a territory watcher's cleanup stops consumers and hands a
lease back."""
LOAD_WAIT_S = 10.0
"""How long a drains request waits for a new leader's state to be rebuilt before it reloads the
drains anyway (a load that fails or outlasts this is not waited for longer: the reminder heals)."""


SUBMISSION_BATCH = 500
"""Submissions fetched and handled as one batch at most (one transaction, one cycle, one
statement): a burst's per-batch costs (the transaction, the fence check, the statement, the
acks) spread over more jobs; the bench's raw path fetches as many (``e2e_baseline.BATCH``)."""
ADMITTING = 2
"""Submission batches that may hold a database connection, claimed and inserted, while they wait
for the lock to decide (:meth:`PlacementService._admit`): enough for one to admit while another
decides. A holder of the lock may need a connection of the pool (8) too: the batches waiting for
the lock must leave it some (batches that decided and are writing hold one each as well, but
they wait for no lock, so they end)."""

JOB_TIMINGS_KEPT = 4096
"""Admitted jobs whose path placement keeps for the ``job_timings`` debug section (``loom bench e2e``)."""


def decide_slice(
    jobs: int, per_job_ms: float | None, budget_ms: float, minimum: int = MIN_DECIDE_SLICE
) -> int:
    """How many of ``jobs`` submissions to decide in one go so that a decision, which holds the
    event loop, takes about ``budget_ms`` at most at the recent ``per_job_ms``. All at once on a
    machine with time to spare; in slices under load, so that the lease renewals and health
    answers waiting on the loop are not starved (a 200-job batch at 10 ms a job held the loop 2 s,
    the lease TTL, and the leader lost its lease mid-burst)."""
    if jobs <= minimum or per_job_ms is None or per_job_ms <= 0 or per_job_ms * jobs <= budget_ms:
        return max(jobs, 1)
    return max(minimum, int(budget_ms / per_job_ms))


"""What a new leader waits for the messages a dead one had fetched: short, since handlers in
progress keep their batch alive (the inbox absorbs any redelivery)."""


def rejection(job_id: str, tenant: str, code: RejectCode, reason: str, hint: str = "") -> JobRejected:
    """A JobRejected event stamped now."""
    return JobRejected(
        job_id=job_id[:256], tenant=tenant, code=code, reason=reason[:2048], hint=hint[:2048], at=time.time()
    )


class _Admission:
    """One submission batch's turn (:meth:`PlacementService._admission`): ``claimed`` is set once
    it has claimed and inserted, ``locked`` once it has taken the lock (each also when it gives
    up); the batch handed over after it waits on them."""

    def __init__(self, ahead: "_Admission | None", lock: asyncio.Lock, slots: asyncio.Semaphore) -> None:
        loop = asyncio.get_running_loop()
        self.ahead = ahead
        self.claimed: asyncio.Future[None] = loop.create_future()
        self.locked: asyncio.Future[None] = loop.create_future()
        self.slot = False
        """Whether it holds one of the ``ADMITTING`` slots."""
        self._lock = lock
        self._slots = slots

    async def claim_turn(self) -> None:
        """Wait until the batch handed over before this one has claimed and inserted."""
        if self.ahead is not None and not self.ahead.claimed.done():
            await asyncio.wait([self.ahead.claimed])

    def mark_claimed(self) -> None:
        """Claimed and inserted (or failed to): the batch behind may claim."""
        if not self.claimed.done():
            self.claimed.set_result(None)

    async def take_lock(self) -> None:
        """The lock, once the batch handed over before this one has taken it; the slot goes."""
        if self.ahead is not None and not self.ahead.locked.done():
            await asyncio.wait([self.ahead.locked])
        await self._lock.acquire()
        self.locked.set_result(None)
        self.ahead = None  # no chain of past batches kept alive
        self._slots.release()
        self.slot = False

    def end(self) -> None:
        """Whatever happened, its slot is given back; a turn not yet taken passes on to the batch
        behind when the batch ahead has taken it (a batch that gave up early leaves the chain
        without letting the one behind overtake the one ahead)."""
        ahead, self.ahead = self.ahead, None
        pairs: list[tuple[asyncio.Future[None], asyncio.Future[None] | None]] = [
            (self.claimed, None if ahead is None else ahead.claimed),
            (self.locked, None if ahead is None else ahead.locked),
        ]
        for mine, theirs in pairs:
            if mine.done():
                continue
            if theirs is None or theirs.done():
                mine.set_result(None)
            else:
                theirs.add_done_callback(functools.partial(_resolve, mine))
        if self.slot:
            self._slots.release()
            self.slot = False


def _resolve(future: "asyncio.Future[None]", _: object = None) -> None:
    if not future.done():
        future.set_result(None)


DEFAULT_PROBES: Final = ProbeSettings()
"""Speed probes as the simulator's ``loom`` runs them (:mod:`loom.sched.probe`)."""


SEEN_PAGE_ROWS = 1024
"""Rows a new leader reads at a time for the shapes seen lately (:meth:`PlacementService._load_seen`)."""
SEEN_PAGES = 8
"""At most this many pages: with many shards, a leader remembers fewer of its own jobs rather than
read the whole jobs table at a takeover."""


class PlacementService:
    """The placement service's state and handlers; :meth:`run` is the service body."""

    decide_ms_per_job: float | None = None
    """Recent wall milliseconds a cycle took per job (smoothed): how big a slice of submissions
    to decide at once (:func:`decide_slice`)."""

    # PLR0915: the service's state, each piece named and documented where it is made.
    def __init__(  # noqa: PLR0915
        self,
        ctx: ServiceContext,
        *,
        batch: int = SUBMISSION_BATCH,
        settle_s: float = 5.0,
        shard: str = "global",
        topology: Topology | None = None,
        tenants: TenantConfig | None = None,
        profile: Mapping[str, Any] | None = None,
        economics: Economics | None = None,
        confirm_timeout_s: float = 60.0,
        max_attempts: int = 3,
        lease_ttl_s: float = 2.0,
        lease_grace_s: float | None = None,
        holder: str | None = None,
        explore_share: float = 0.0,
        probe: ProbeSettings | None = DEFAULT_PROBES,
        region_groups: Mapping[str, Sequence[str]] | None = None,
        failover_ttl_s: float = 10.0,
        failover_period_s: float = 0.5,
        liveness_period_s: float = 1.0,
        pace: PaceSettings | None = None,
    ) -> None:
        self.ctx = ctx
        self.pool = ctx.db
        self.relay = outbox.OutboxRelay(self.pool, ctx.publisher, PRODUCER)
        self.tenants = tenants or OPEN
        self.book = Book(topology, economics, self.tenants)
        self.queue: dict[str, QueuedJob] = {}
        self.lock = asyncio.Lock()
        self._admitting = asyncio.Semaphore(ADMITTING)
        self._admit_tail: _Admission | None = None
        """The turn of the latest submission batch handed over (see :meth:`_admission`)."""
        self.wake = asyncio.Event()
        self.capacity_changed = True
        self.batch = batch
        # A job that fits no known cluster is rejected only once the set of clusters has been
        # stable for ``settle_s``: right after a start (or a cluster joining) the capacity book
        # may simply not know the cluster that fits yet.
        self.settle_s = settle_s
        self.settled_at = time.monotonic() + settle_s
        self.stats = ctx.stats
        self.shard = validate_id(shard, "shard")
        self._register_gauges()
        self.shard_map = ShardMap.build(region_groups, topology)
        """Region groups: which shard a job routes to and whose territory a region is."""
        if self.shard != GLOBAL and self.shard not in self.shard_map.groups:
            raise InvalidInputError(
                f"shard {self.shard!r} has no region group;"
                f" groups: {', '.join(self.shard_map.regional) or 'none'}"
            )
        self.held: dict[str, int] = {}
        """Territories this instance holds while it leads, with the fencing token of each (its own
        shard's, and regional ones the global shard took over)."""
        self.fenced_territories: set[str] = set()
        """Held territories whose fence refused a transaction: their watcher hands them back."""
        self._loaded = asyncio.Event()
        """Set once this leader's state is rebuilt from the store (cleared as it starts leading; set
        again as a term ends, its load cut short or not: nobody waits for a load that stopped)."""
        self.region_of: dict[str, str] = dict(self.shard_map.cluster_regions)
        """Cluster -> region, from the topology, the store and the view (whose territory a cluster is)."""
        self.holder = holder or f"{socket.gethostname()}-{os.getpid()}"
        self.token = 0
        self.leadership = Leadership(shard=self.shard, holder=self.holder)
        # lease_grace_s: how long past its TTL the leader keeps leading while the lease bucket has
        # no leader (a NATS cluster electing one: 4-9 s); fenced writes make it safe
        # (loom.bus.lease, "Grace").
        # Default: 10 s on a replicated bus (LOOM_STREAM_REPLICAS > 1: the bucket's leader can die
        # with its node), none on a single server, whose bucket has no leader only while the server
        # itself is gone (the grace then delayed a cut-off shard's territory hand-over in
        # test_placement_shards).
        self.lease_ttl_s, self.lease_grace_s = lease_ttl_s, _default_grace(lease_grace_s)
        self.learner = SpeedLearner(LearnSettings(explore_share=explore_share))
        """What each job family really gets on each GPU model (rebuilt from the store on leading)."""
        # A big job's bet on GPU models its family never ran on, as the simulator weighs it.
        self.book.risk = (self.learner.settings.risk_gpu_hours, self.learner.settings.risk_factor)
        self.held_lessons: HeldLessons[tuple[str, int], speeds.SpeedObservation] = HeldLessons()
        """Slow runs' mid-run lessons waiting for another node to agree (:class:`HeldLessons`)."""
        self.probe = probe
        """Speed probes before deciding a job whose family never ran on a GPU model it may use
        (:mod:`loom.sched.probe`, as the simulator's ``loom``); None: none."""
        self.alpha = AlphaLearner()
        """Compute's share of each task type's step time, learned from completed runs (joint score)."""
        self.framework: Framework = build_framework(
            profile, context={"alpha_learner": self.alpha, "economics": economics or Economics()}
        )
        self.confirm_timeout_s = confirm_timeout_s
        self.max_attempts = max_attempts
        self.failover = _Failover(
            ttl_s=failover_ttl_s,
            period_s=failover_period_s,
            liveness_period_s=liveness_period_s,
            nodes=_NodeWatch(Pace(pace or PaceSettings())),
        )
        self.waiting_reasons: dict[str, str] = {}
        self._sending: set[asyncio.Task[int]] = set()
        self._lifecycle_lock = asyncio.Lock()
        """One lifecycle batch at a time (:meth:`on_lifecycle`: two consumers feed it)."""
        self._batches: dict[int, _Batch] = {}
        """Submission batches decided and still writing, by sequence (see :meth:`_admit`)."""
        self._tail: _Batch | None = None
        self._seq = 0
        self.stats["pipeline"] = {"batches": 0, "overlapped": 0, "discarded": 0, "ms": {}}
        self.phases = Phases(self.stats["pipeline"]["ms"])
        """Where a submission batch's time goes (``loom bench e2e`` reports it)."""
        self.job_timings: deque[tuple[str, float, float, dict[str, float]]] = deque(maxlen=JOB_TIMINGS_KEPT)
        """The path of the last admitted jobs: (job id, stored in the stream, received by the
        consumer, its batch's stamps), wall-clock seconds; the ``job_timings`` debug section."""
        ctx.debug["job_timings"] = self.job_timings_of
        live = getattr(ctx, "live_stats", None)  # the pure tests' stand-in context has none
        if live is not None:
            live.append(self._suspect_nodes)
        self.stats.update(
            {
                "placed": 0,
                "rejected": 0,
                "queued": 0,
                "released": 0,
                "requeued": 0,
                "preempted": 0,
                "resized": 0,
                "nodes": {"lost": {}, "requeued": 0, "slow": 0, "suspect": {}},
            }
        )
        self.stats["leadership"] = self.leadership
        self.stats["failover"] = {"health": {}, "failed": {}, "requeued": 0, "pings": 0}
        self.stats["shard"] = {"territories": [], "routed_elsewhere": 0, "foreign_events": 0}

    # ---- compatibility views -------------------------------------------------------------------

    @property
    def nodes(self) -> dict[str, Any]:
        """The capacity book (node -> NodeCapacity)."""
        return self.book.nodes

    @property
    def cluster_trust(self) -> dict[str, float]:
        """How far each cluster's claimed compute is believed, from the view."""
        return self.book.trust

    # ---- start-up and leadership ---------------------------------------------------------------

    async def load(self) -> None:
        """Rebuild the book and the queue from PostgreSQL, then publish leftovers."""
        self.book.nodes = self._owned_nodes(await repo.load_nodes(self.pool))
        self.book.pending.clear()
        self.book.invalidate()
        self.learner = await speeds.load_learner(self.pool, self.learner.settings)
        self._adopt_learned()
        self.book.clear_runs()
        now = time.time()
        for row in await repo.active_runs(self.pool):
            if not self._owns_cluster(row["cluster"]):
                continue  # a run belongs to the holder of its lead cluster
            self.book.add_run(
                run_from_row(row, self.book.nodes, now=now, step_s=self.book.believed_step_s), from_store=True
            )
        # Clusters the ledger holds stale: the view delta that said so may be acked already.
        self.failover.restore(
            [c for c in await ledger_store.load_clusters(self.pool) if self._owns_region(c.region)]
        )
        self.failover.drained = frozenset(await moves.drained_clusters(self.pool))
        # Clusters a previous leader classified failed: closed at once, not when this leader's
        # pings and the view say so again (meanwhile it would place the jobs just failed over
        # back there). Each returns as any failed cluster does (its agent answers again, or its
        # heartbeats resume).
        recorded = [c for c in await failed_store.failed_clusters(self.pool) if self._owns_cluster(c.cluster)]
        self.failover.adopt(recorded)
        for c in recorded:
            reason = self.failover.failed[c.cluster].reason
            self.stats["failover"]["failed"][c.cluster] = {"at": c.failed_at, "reason": reason}
        self.book.close(self.failover.closed_why())
        # Jobs queued under an earlier lead may have been placed or cancelled by another leader
        # meanwhile: the queue, what waits and the queued shapes all come from the store again.
        self.book.leave_queue([*self.book.waiting, *self.book.queued])
        self.queue.clear()
        for row in await repo.queued_jobs(self.pool):
            q = queued_from_row(row)
            if self._routed_here(q.job):
                self.queue[q.job.job_id] = q
        # The shapes seen lately (rare_fit keeps room for the rare ones): the latest jobs this
        # shard routes, as an earlier leader saw them arrive.
        await self._load_seen()
        await self.relay.flush()
        self.capacity_changed = True
        self.stats["queued"] = len(self.queue)
        log.info(
            "state rebuilt", nodes=len(self.book.nodes), runs=len(self.book.runs), queued=len(self.queue)
        )

    async def _load_seen(self) -> None:
        """The shapes seen lately (``Book.seen``): the latest :data:`SEEN_JOBS` jobs this instance's
        shards decide, as an earlier leader saw them arrive, read a page at a time (other shards'
        jobs, DAG jobs, whose stages placement decides, and stages waiting or cancelled before they
        were decided are skipped) and at most :data:`SEEN_PAGES` pages (a takeover reads no more)."""
        found: list[tuple[JobSubmitted, float]] = []
        before: tuple[datetime, str] | None = None
        for _ in range(SEEN_PAGES):
            rows = await repo.recent_jobs(self.pool, SEEN_PAGE_ROWS, before=before)
            for row in rows:
                if row["state"] == "waiting" or (
                    row["parent"] is not None and row["state"] == "cancelled" and row["never_placed"]
                ):
                    continue  # a DAG stage not decided yet, or never (its DAG failed first)
                job = msgspec.json.decode(row["spec"], type=JobSubmitted)
                if job.pipeline is None and not job.stages and self._routed_here(job):
                    found.append((job, float(row["at"])))
            if len(found) >= SEEN_JOBS or len(rows) < SEEN_PAGE_ROWS:
                break
            before = (rows[-1]["submitted_at"], str(rows[-1]["job_id"]))
        seen = SeenShapes()
        for job, at in reversed(found[:SEEN_JOBS]):  # oldest first, as they came
            seen.note_job(job, at)
        self.book.seen = seen

    def _register_gauges(self) -> None:
        """The queue's Prometheus gauges, read at scrape time only (nothing spent between scrapes)."""
        prom.QUEUE_DEPTH.labels(self.shard).set_function(lambda: len(self.queue))
        prom.QUEUE_AGE.labels(self.shard).set_function(self._oldest_queued_age_s)

    def _oldest_queued_age_s(self) -> float:
        """Seconds since the oldest queued job was submitted (by its submitter's clock); 0 when none."""
        submitted = [q.job.submitted_at for q in list(self.queue.values()) if q.job.submitted_at > 0]
        return max(time.time() - min(submitted), 0.0) if submitted else 0.0

    async def run(self) -> None:
        """Follow links and answer queries always; lead the shard whenever this instance can."""
        query_sub = await self.ctx.nc.subscribe(
            subjects.JOBS_QUERY, queue="placement-query", cb=self.on_query
        )
        tenant_query_sub = await self.ctx.nc.subscribe(
            subjects.JOBS_QUERY_TENANTS, queue="placement-query", cb=self.on_query
        )
        link_sub = await self.ctx.nc.subscribe(subjects.LINK_STATES_ALL, cb=self.on_link)
        drains_sub = await self.ctx.nc.subscribe(subjects.MIGRATE_DRAINS_CHANGED, cb=self.on_drains_changed)
        migrate_sub = await self.ctx.nc.subscribe(subjects.PLACEMENT_MIGRATE, cb=self.on_migrate)
        whatif_sub = await self.ctx.nc.subscribe(subjects.PLACEMENT_WHATIF, cb=self.on_whatif)
        attempts_sub = await self.ctx.nc.subscribe(
            subjects.PLACEMENT_ATTEMPTS, queue="placement-query", cb=self.on_attempts
        )
        announcer = (
            self.ctx.watchdog.supervise("standby-announcer", self._announce_standby)
            if self.shard != GLOBAL
            else None
        )
        try:
            await lead(
                self.ctx.nc.jetstream(),
                self.pool,
                shard=self.shard,
                holder=self.holder,
                body=self._lead,
                stopping=self.ctx.stopping,
                leadership=self.leadership,
                ttl_s=self.lease_ttl_s,
                renew_s=self.lease_ttl_s / 4,
                poll_s=min(0.2, self.lease_ttl_s / 10),
                grace_s=self.lease_grace_s,
            )
        finally:
            if announcer is not None:
                await cancel_and_wait([announcer])
            await query_sub.unsubscribe()
            await tenant_query_sub.unsubscribe()
            await link_sub.unsubscribe()
            await drains_sub.unsubscribe()
            await migrate_sub.unsubscribe()
            await whatif_sub.unsubscribe()
            await attempts_sub.unsubscribe()

    async def _lead(self, token: int) -> None:
        """The leader's work: consume submissions, view deltas and lifecycle events until cancelled."""
        self.token = token
        self._loaded.clear()
        self.held = {self.shard: token}
        try:
            self._territory_stats()
            await self.load()
            self._loaded.set()
            await self._lead_loaded()
        finally:
            # On every way out, a load cut short by the lease's loss included: this instance holds
            # nothing, and a drain confirmation waiting for the load (on_drains_changed) stops
            # waiting (and answers nothing: it leads nothing now).
            self.held = {}
            self.fenced_territories.clear()
            self._territory_stats()
            self._loaded.set()

    async def _lead_loaded(self) -> None:
        """The leader's work once its state is loaded: its consumers and loops until cancelled."""
        await self._replay_left_requests(self.shard)
        runners = self._consumers(self.shard)
        # Together: on a NATS cluster a consumer whose Raft leader just died cannot be updated
        # until its group elects another (4-9 s); the others need not wait for it.
        started = await asyncio.gather(*(runner.start() for runner in runners), return_exceptions=True)
        failed = [outcome for outcome in started if isinstance(outcome, BaseException)]
        if failed:
            for runner, outcome in zip(runners, started, strict=True):
                if outcome is None:
                    await runner.stop()
            raise failed[0]
        # Supervised (loom.runtime.watchdog): a loop that dies is logged, restarted, shown in health.
        watchdog = self.ctx.watchdog
        loops = [watchdog.watch_consumer(runner.spec.durable, runner) for runner in runners]
        loops += [
            watchdog.supervise("requeue", self._requeue_loop),
            watchdog.supervise("expiry", self._expiry_loop),
            watchdog.supervise("failover", self._failover_loop),
            watchdog.supervise("liveness", self._liveness_loop),
        ]
        if self.shard == GLOBAL:
            loops += [
                watchdog.supervise(f"territory-{t}", functools.partial(self._watch_territory, t))
                for t in self.shard_map.regional
            ]
        relay_stop = asyncio.Event()
        relay = watchdog.supervise(
            "outbox-relay", functools.partial(self.relay.run, relay_stop), finishes=True
        )
        try:
            await asyncio.Event().wait()  # until cancelled: the lease was lost or we are stopping
        finally:
            try:
                # A grace long enough for a territory watcher's own cleanup (its consumers'
                # stops, the territory's lease handed back) before a loop is cancelled again.
                await cancel_and_wait(loops, grace_s=LOOPS_STOP_GRACE_S)
                await stop_runners(reversed(runners))
                await asyncio.gather(*self._sending, return_exceptions=True)
            finally:
                # Whatever cut the above short, the relay sends what was committed and ends.
                relay_stop.set()
                self.relay.kick()
                await asyncio.wait([relay])

    def _consumers(self, shard: str, *, idle_fetch_timeout_s: float = 2.0) -> list[ConsumerRunner[Any]]:
        """The durable consumers of ``shard``: view deltas, lifecycle events, submissions (the
        global leader also runs a leaderless regional shard's while it holds its territory, with a
        short idle fetch so that they stop, and the territory is handed back, within moments)."""
        return [
            ConsumerRunner(
                self.ctx.nc,
                ConsumerSpec(
                    stream="VIEW",
                    durable=self._durable("placement-view", shard),
                    filter_subjects=[subjects.VIEW_DELTAS_ALL],
                    ack_wait_s=ACK_WAIT_S,
                ),
                ViewDelta,
                handler=self.on_view_delta,
                publisher=self.ctx.publisher,
                idle_fetch_timeout_s=idle_fetch_timeout_s,
            ),
            # Runs' events, and clients' cancellations: one handler, one batch at a time (its lock).
            self._lifecycle_runner(
                "JOBS", "placement-lifecycle", LIFECYCLE_SUBJECTS, shard, idle_fetch_timeout_s
            ),
            self._lifecycle_runner(
                "REQUESTS", "placement-cancelled", [subjects.JOBS_CANCELLED_ALL], shard, idle_fetch_timeout_s
            ),
            ConsumerRunner(
                self.ctx.nc,
                ConsumerSpec(
                    stream="REQUESTS",
                    durable=self._durable("placement-submitted", shard),
                    filter_subjects=[subjects.JOBS_SUBMITTED_ALL],
                    batch=self.batch,
                    ack_wait_s=ACK_WAIT_S,
                ),
                bytes,
                batch_handler=self.on_submitted,
                publisher=self.ctx.publisher,
                idle_fetch_timeout_s=idle_fetch_timeout_s,
                # The next batch is fetched, admitted and decided while this one writes, and the
                # one after it admitted while that one decides (see _admit).
                pipeline=3,
                # One standing pull request: what arrives while batches are handled is the next
                # batch at once (no fetch round trip); no linger either, as a burst gathers its
                # batches while the ones before are handled, and a lone job goes at once.
                callback_pull=True,
                linger_s=0.0,
            ),
        ]

    async def _replay_left_requests(self, shard: str) -> None:
        """Before ``shard``'s consumers move to REQUESTS: the requests an older layout left unread
        in JOBS (:func:`loom.bus.requests_move.replay_left_requests`; nothing once moved)."""
        await replay_left_requests(
            self.ctx.nc.jetstream(),
            submitted_durable=self._durable("placement-submitted", shard),
            lifecycle_durable=self._durable("placement-lifecycle", shard),
        )

    def _lifecycle_runner(
        self, stream: str, name: str, filters: list[str], shard: str, idle_fetch_timeout_s: float
    ) -> ConsumerRunner[bytes]:
        return ConsumerRunner(
            self.ctx.nc,
            ConsumerSpec(
                stream=stream,
                durable=self._durable(name, shard),
                filter_subjects=filters,
                batch=self.batch,
                ack_wait_s=ACK_WAIT_S,
            ),
            bytes,
            batch_handler=self.on_lifecycle,
            publisher=self.ctx.publisher,
            idle_fetch_timeout_s=idle_fetch_timeout_s,
            callback_pull=True,
            # A few lifecycle events a transaction at a low rate, not one each (a start confirms
            # a reservation; an end frees GPUs a moment later, no more).
            linger_s=LIFECYCLE_LINGER_S,
        )

    @contextlib.asynccontextmanager
    async def _tx(self, checked: dict[str, int] | None = None) -> AsyncIterator[asyncpg.Connection]:
        """A transaction that first proves this instance still leads (the fence). ``checked`` is
        given the fences proved (shard -> token), each share-locked until the transaction ends."""
        try:
            async with transaction(self.pool) as conn:
                await fence.check(conn, self.shard, self.token)
                if checked is not None:
                    checked[self.shard] = self.token
                for territory, token in list(self.held.items()):
                    if territory == self.shard:
                        continue
                    try:
                        await fence.check(conn, territory, token)
                        if checked is not None:
                            checked[territory] = token
                    except FencedError:
                        # Its shard is back (a newer token): the territory is not ours any more.
                        # Its watcher stops that shard's consumers first, then drops it (dropped
                        # at once, those consumers would ack the shard's messages unhandled).
                        self.fenced_territories.add(territory)
                        raise
                yield conn
        except FencedError as exc:
            # Not the leader any more (a newer one claimed the fence; this instance's lease is lost
            # or about to be, which stops its consumers): the message is redelivered, normally to
            # the new leader, and not counted toward dead-lettering (NotLeaderError): a fenced
            # instance naks whatever it still fetches, and after a NATS cluster's leases leader
            # died that used up messages' delivery budgets.
            self.stats["fenced"] = self.stats.get("fenced", 0) + 1
            raise NotLeaderError(f"fenced: {exc}") from exc

    def _suspect_nodes(self) -> dict[str, Any]:
        """``suspect_nodes`` for the health answer: each node closed to new work now after a slow
        run, with why and until when (``loom status`` lists them: a pool closed for ten minutes
        showed nowhere but in explain's "nodes unschedulable")."""
        suspects = self.failover.nodes.suspects
        now = time.time()
        return {
            "suspect_nodes": {
                node: {"why": suspects.why.get(node, ""), "until": round(until, 1)}
                for node, until in sorted(suspects.until.items())
                if until > now
            }
        }

    # ---- shards and territories ------------------------------------------------------------------

    @staticmethod
    def _durable(name: str, shard: str) -> str:
        """A consumer's durable name for ``shard``: the global shard keeps the historical names."""
        return name if shard == GLOBAL else f"{name}-{shard}"

    def _routed_here(self, job: JobSubmitted) -> bool:
        """Whether this instance admits and places ``job`` (:func:`loom.sched.shards.route`): the
        job's shard is one whose territory it holds."""
        return route(job, self.shard_map) in self.held

    def _routed_elsewhere(self, payload: bytes) -> bool:
        """Whether a submission's payload routes it to a shard this instance does not hold, read
        from its affinities alone (:class:`_RouteFields`). False when that cannot be read: then
        the strict decode decides, so a regional shard skips exactly what it skipped after
        decoding it all (what it cannot decode, or what is routed elsewhere; the global shard
        refuses what is unreadable, and never takes this path)."""
        try:
            fields = _ROUTE_FIELDS.decode(payload)
        except (msgspec.DecodeError, RecursionError):
            return False
        shard = route_of(fields.affinity, [stage.affinity for stage in fields.stages], self.shard_map)
        return shard not in self.held

    def _owns_region(self, region: str | None) -> bool:
        """Whether a region's territory is held by this instance (only while it leads)."""
        return self.shard_map.shard_of_region(region) in self.held

    def _owns_cluster(self, cluster: str) -> bool:
        """Whether a cluster's territory is held by this instance (a cluster of unknown region is
        the global shard's)."""
        return self._owns_region(self.region_of.get(cluster))

    def _handles(self, event: LifecycleEvent) -> bool:
        """Whether this instance records a lifecycle event: the holder of the event's cluster does;
        a cancellation (no cluster) is recorded by the global shard and by a shard that knows the
        job (the event table keeps one copy: its id is the message's)."""
        if isinstance(event, JobCancelled):
            return self.shard == GLOBAL or event.job_id in self.book.runs or event.job_id in self.queue
        return self._owns_cluster(event.cluster)

    def _owned_nodes(self, nodes: Mapping[str, NodeCapacity]) -> dict[str, NodeCapacity]:
        """The nodes of the territories held (and every node's region learned on the way)."""
        for cap in nodes.values():
            self.region_of[cap.cluster] = cap.region
        return {name: cap for name, cap in nodes.items() if self._owns_region(cap.region)}

    def _check_owned(self, clusters: Iterable[str]) -> None:
        """Refuse a reservation on a cluster of a territory this instance does not hold. The book
        holds only those, so this is a guard: the cycle is decided again on a reloaded book."""
        foreign = sorted({c for c in clusters if not self._owns_cluster(c)})
        if foreign:
            self.stats["shard"]["foreign_reservations"] = (
                self.stats["shard"].get("foreign_reservations", 0) + 1
            )
            raise ConflictError(f"shard {self.shard} does not hold cluster(s) {', '.join(foreign)}")

    def _territory_stats(self) -> None:
        self.stats["shard"]["territories"] = sorted(self.held)

    async def _announce_standby(self) -> None:
        """A regional instance that does not lead says so in the lease bucket (``standby.<shard>``,
        expiring with the bucket's TTL), so the global shard hands the territory back."""
        kv = None
        while True:
            if not self.leadership.is_leader:
                try:
                    kv = kv or await self.ctx.nc.jetstream().key_value(LEASE_BUCKET)
                    await kv.put(f"standby.{self.shard}", self.holder.encode())
                except (BucketNotFoundError, nats.errors.Error, TimeoutError, OSError) as exc:
                    log.debug("standby announcement failed", shard=self.shard, error=str(exc))
            await asyncio.sleep(self.lease_ttl_s / 4)

    async def _standby_waiting(self, territory: str) -> bool:
        """Whether an instance of ``territory``'s own shard announced itself within the TTL."""
        try:
            kv = await self.ctx.nc.jetstream().key_value(LEASE_BUCKET)
            await kv.get(f"standby.{territory}")
        except KeyNotFoundError:
            return False
        except (BucketNotFoundError, nats.errors.Error, TimeoutError, OSError):
            return False
        return True

    async def _watch_territory(self, territory: str) -> None:
        """The global leader's take-over of a regional territory whose shard has no leader: its
        lease, then its fence, then its clusters; handed back when one of its instances waits."""
        poll_s = min(0.2, self.lease_ttl_s / 10)
        lease = LeaderLease(
            self.ctx.nc.jetstream(),
            territory,
            f"{self.holder}@{self.shard}",
            ttl_s=self.lease_ttl_s,
            renew_s=self.lease_ttl_s / 4,
            poll_s=poll_s,
        )
        try:
            while True:
                token = await lease.acquire()  # returns once the shard's own lease is gone
                if await self._standby_waiting(territory) or not await fence.claim(
                    self.pool, territory, token, lease.holder_id
                ):
                    await lease.release()  # its shard is coming back: let it in
                    await asyncio.sleep(self.lease_ttl_s)
                    continue
                async with self.lock:
                    await self._drain()
                    await self._adopt_territory(territory, token)
                # Its shard's consumers too: its submissions and the events no one recorded since
                # it died wait there (and, first, what an older layout left unread in JOBS).
                await self._replay_left_requests(territory)
                runners = self._consumers(territory, idle_fetch_timeout_s=poll_s)
                watchers: list[asyncio.Task[None]] = []
                try:
                    for runner in runners:
                        await runner.start()
                        watchers.append(self.ctx.watchdog.watch_consumer(runner.spec.durable, runner))
                    # Polled: the signal (a key in NATS appearing) has no event to wait on here.
                    while not lease.lost.is_set() and territory not in self.fenced_territories:
                        if await self._standby_waiting(territory):
                            break
                        await asyncio.sleep(poll_s)
                finally:
                    await cancel_and_wait(watchers)
                    # Together and shielded: a cancellation cuts none of the territory's stops short.
                    await stop_runners(reversed(runners))
                async with self.lock:
                    await self._drain()
                    self._drop_territory(territory)
                self.fenced_territories.discard(territory)
                await lease.release()
                log.info("territory handed back", territory=territory, shard=self.shard, token=token)
        finally:
            self._drop_territory(territory)
            self.fenced_territories.discard(territory)
            await lease.release()

    async def _adopt_territory(self, territory: str, token: int) -> None:
        """Hold a regional territory (its fence is claimed): its nodes and runs from the store."""
        nodes = await repo.load_nodes(self.pool)
        rows = await repo.active_runs(self.pool)
        queued = [queued_from_row(row) for row in await repo.queued_jobs(self.pool)]
        for cap in nodes.values():
            self.region_of[cap.cluster] = cap.region
        theirs = {n: c for n, c in nodes.items() if self.shard_map.shard_of_region(c.region) == territory}
        self.book.nodes.update(theirs)
        now = time.time()
        for row in rows:
            region = self.region_of.get(row["cluster"])
            if self.shard_map.shard_of_region(region) == territory and row["job_id"] not in self.book.runs:
                self.book.add_run(
                    run_from_row(row, self.book.nodes, now=now, step_s=self.book.believed_step_s),
                    from_store=True,
                )
        for q in queued:
            if route(q.job, self.shard_map) == territory and q.job.job_id not in self.queue:
                self.queue[q.job.job_id] = q
        self.held[territory] = token
        self.book.invalidate()
        self._territory_stats()
        self.stats["shard"]["takeovers"] = self.stats["shard"].get("takeovers", 0) + 1
        self.capacity_changed = True
        self.wake.set()
        log.info(
            "territory taken over", territory=territory, shard=self.shard, token=token, nodes=len(theirs)
        )

    def _drop_territory(self, territory: str) -> None:
        """Stop holding a regional territory: its nodes and runs leave the book (no await)."""
        if self.held.pop(territory, None) is None:
            return
        for name in [
            n for n, c in self.book.nodes.items() if self.shard_map.shard_of_region(c.region) == territory
        ]:
            del self.book.nodes[name]
        for job_id, run in list(self.book.runs.items()):
            if self.shard_map.shard_of_region(self.region_of.get(run.parts[0][0])) == territory:
                self.book.drop_run(job_id)
        for job_id, q in list(self.queue.items()):
            if route(q.job, self.shard_map) == territory:
                del self.queue[job_id]  # its shard reloads it from the store
                self.waiting_reasons.pop(job_id, None)
                self.book.leave_queue((job_id,))  # no longer part of this instance's queue
        self.stats["queued"] = len(self.queue)
        self.book.invalidate()
        self._territory_stats()
        self.capacity_changed = True
        self.wake.set()

    # ---- submissions ---------------------------------------------------------------------------

    async def on_submitted(self, deliveries: list[Delivery[bytes]]) -> Sequence[BaseException | None]:
        """Validate a batch of submissions, then admit and place the valid ones in one transaction."""
        handled_at = time.time()
        outcomes: list[BaseException | None] = [None] * len(deliveries)
        accepted: list[tuple[Delivery[bytes], JobSubmitted]] = []
        for i, d in enumerate(deliveries):
            tenant = d.subject.rsplit(".", 1)[-1]
            try:
                validate_id(tenant, "tenant")
            except InvalidIdError as exc:
                if self.shard == GLOBAL:  # what cannot be routed is the global shard's to refuse
                    outcomes[i] = InvalidInputError(f"submission on subject {d.subject!r}: {exc}")
                continue
            job: JobSubmitted | None = None
            if self.shard != GLOBAL and self._routed_elsewhere(d.message):
                # A regional shard reads (and acks) every submission: one routed to another
                # shard is recognised from its affinities alone, without the strict decode.
                self.stats["shard"]["routed_elsewhere"] += 1
                continue
            try:
                job = decode(d.message, JobSubmitted)
                if not self._routed_here(job):
                    self.stats["shard"]["routed_elsewhere"] += 1
                    continue  # acked: another shard admits it
                if job.tenant != tenant:
                    raise DecodeError(
                        f"tenant {job.tenant!r} in the job differs from {tenant!r} in the subject"
                    )
                admission_check(job)
            except (DecodeError, InvalidInputError) as exc:
                if job is None and self.shard != GLOBAL:
                    continue
                code: RejectCode = "cyclic" if isinstance(exc, dag.DagCycleError) else "invalid"
                outcomes[i] = await self._reject_invalid(d, tenant, str(exc), code)
                continue
            accepted.append((d, job))
        # Under load, in slices that each hold the event loop about an eighth of the lease TTL.
        size = decide_slice(len(accepted), self.decide_ms_per_job, self.lease_ttl_s * 1000 / 8)
        for start in range(0, len(accepted), size):
            part = accepted[start : start + size]
            try:
                await self._retrying(functools.partial(self._admit, part, handled_at), locked=False)
            except Exception as exc:
                for d, _ in part:
                    outcomes[deliveries.index(d)] = exc
        return outcomes

    async def _reject_invalid(
        self, d: Delivery[bytes], tenant: str, reason: str, code: RejectCode
    ) -> BaseException | None:
        """Tell the submitter why the payload is unusable; nothing is stored."""
        # The payload's job id first: the message id is the submitter's to choose (the SDK's has a
        # random part), and the submitter waits for a rejection of its job id.
        job_id = _payload_job_id(d.message) or d.msg_id or f"seq-{d.stream_seq}"
        event = rejection(job_id, tenant, code, f"invalid job submission: {reason}")
        log.warning("submission rejected", job_id=job_id, tenant=tenant, reason=reason)
        # The submitter's trace shows the refusal as an error, not as a message handled.
        d.span.set_status(Status(StatusCode.ERROR, f"rejected ({code}): {reason}"[:512]))
        try:
            await self.ctx.publisher.publish(
                subjects.job_event("rejected", tenant),
                event,
                msg_id=f"rejected-{d.msg_id or 'seq'}-{d.stream_seq}",
                parent=d.context,
            )
        except BusError as exc:
            return exc
        self.stats["rejected"] += 1
        return None

    async def _admit(
        self, accepted: list[tuple[Delivery[bytes], JobSubmitted]], handled_at: float = 0.0
    ) -> None:
        """One batch of submissions in one transaction: claim, insert, decide, write, commit.

        Pipelined (:class:`_Batch`): the transaction begins and the batch is claimed and inserted
        before the in-memory lock is taken (the admission reads and changes no in-memory state), so
        a batch admits while the one before it decides. The lock is then held until the cycle has
        decided; unless the cycle preempted, shrank, grew or must rebuild the snapshot, it is let
        go, so the next batch decides on top of this one's placements (listed in the snapshot, and
        in ``Book.pending`` should it be rebuilt) while this one writes and commits. A batch writes
        its decisions only once the batch decided before it has ended (so batches commit in the
        order they decided), and is rolled back (its messages naked by the consumer) when that one
        failed.

        ``handled_at``: when the consumer handed the batch over; it and the batch's later stamps
        (``admitted``: claimed and inserted, ``cycle``: the lock taken, ``decided``,
        ``committed``, ``sent``: its messages handed to NATS) go to :attr:`job_timings` for every
        job of a batch that committed.
        """
        batch: _Batch | None = None
        stamps = {"handled": handled_at}
        phases = self.phases
        with contextlib.suppress(AttributeError, TypeError):  # how long the oldest waited in the stream
            oldest = min(d.msg.metadata.timestamp.timestamp() for d, _ in accepted)
            phases.add("stream_to_handler", time.time() - oldest)
        # Territories change under the lock only; the jobs routed here are checked again once it
        # is taken (a shard handed back meanwhile admits its jobs itself, from its own consumer).
        accepted = [(d, job) for d, job in accepted if self._routed_here(job)]
        if not accepted:
            return
        locked = False
        shards = {route(job, self.shard_map) for _, job in accepted}

        def decided(applied: "Applied", considered: list[QueuedJob]) -> None:
            nonlocal batch, locked
            stamps["decided"] = time.time()
            batch = self._open_batch(applied, considered)
            if locked and applied.pipelinable:
                self.lock.release()
                locked = False

        waited_from = time.perf_counter()
        async with self._admission() as turn:

            async def lock(checked: Mapping[str, int]) -> None:
                nonlocal locked
                await turn.take_lock()
                locked = True
                stamps["cycle"] = time.time()
                # Every job's shard still held, under the fence token this transaction proved (and
                # share-locks): not handed back since, nor dropped before the check and taken over
                # again since (its fence then unchecked here).
                if any(t not in checked or self.held.get(t) != checked[t] for t in shards):
                    raise NotLeaderError("a territory changed hands while the batch was admitted")

            try:
                await self._admit_batch(
                    accepted, turn, lock, decided, lambda: self._turn(batch), stamps, waited_from
                )
                if batch is not None:
                    self._close_batch(batch, ok=True)
                self._note_timings(accepted, stamps)
            except BaseException:
                if batch is not None:
                    self._fail_batch(batch)
                raise
            finally:
                if locked:
                    self.lock.release()

    @contextlib.asynccontextmanager
    async def _admission(self) -> AsyncIterator["_Admission"]:
        """A submission batch's turn among the batches handed over, taken as it is handed over
        (:class:`_Admission`): it claims and inserts after the batch before it has (so an earlier
        batch never waits on a later one's rows: the same message or job id in both, as when the
        global shard and a territory it holds both admit a submission), and takes the lock after
        that batch has. Until it has the lock it holds one of ``ADMITTING`` slots."""
        ours = _Admission(self._admit_tail, self.lock, self._admitting)
        self._admit_tail = ours
        try:
            await self._admitting.acquire()
            ours.slot = True
            yield ours
        finally:
            ours.end()
            if self._admit_tail is ours:
                self._admit_tail = None

    async def _admit_batch(  # noqa: PLR0917
        self,
        accepted: list[tuple[Delivery[bytes], JobSubmitted]],
        admission: "_Admission",
        lock: Callable[[Mapping[str, int]], Awaitable[None]],
        decided: Callable[["Applied", list[QueuedJob]], None],
        turn: Callable[[], Awaitable[None]],
        stamps: dict[str, float],
        waited_from: float,
    ) -> None:
        phases = self.phases
        await admission.claim_turn()  # holding no connection meanwhile
        t = phases.since("admit_wait", waited_from)
        now = time.time()
        checked: dict[str, int] = {}
        async with self._tx(checked) as conn:
            t = phases.since("begin", t)
            try:
                fresh_jobs, dup_rejects = await self._insert_batch(conn, accepted, now)
            finally:
                admission.mark_claimed()  # the batch behind may claim now (its rows cannot wait on ours)
            t = phases.since("admit", t)
            stamps["admitted"] = time.time()
            await lock(checked)
            t = phases.since("lock_wait", t)
            # One cycle over the new jobs and the queued ones whose backoff ended, in queue order
            # (a newcomer does not jump a waiting job of higher priority).
            due = self._due(besides=[q.job.job_id for q in fresh_jobs])
            considered = fresh_jobs + due

            def on_decided(applied: Applied) -> None:
                nonlocal t
                t = phases.since("decide", t)  # with locking the queued rows
                decided(applied, considered)

            async def on_turn() -> None:
                nonlocal t
                await turn()  # the batch decided before this one has ended
                t = phases.since("turn", t)

            applied = await self._schedule(
                conn,
                considered,
                backlog=len(self.queue) - len(due),
                grow=False,
                decided=on_decided,
                turn=on_turn,
                inserted=frozenset(q.job.job_id for q in fresh_jobs),
            )
            t = phases.since("write", t)
        t = phases.since("commit", t)
        stamps["committed"] = time.time()
        self._commit(applied, considered)
        self._send(dup_rejects + applied.messages, lambda: stamps.__setitem__("sent", time.time()))
        phases.since("adopt", t)
        phases.add("jobs", len(considered))

    async def _insert_batch(
        self, conn: asyncpg.Connection, accepted: list[tuple[Delivery[bytes], JobSubmitted]], now: float
    ) -> tuple[list[QueuedJob], list[outbox.OutboxMessage]]:
        """A batch's admission in its transaction (no in-memory state read or changed): claim the
        messages, insert the new jobs with their submitted events and a DAG's stages. Returns the
        jobs to decide (new plain jobs, ready stages) and the rejections of duplicate job ids."""
        queued_children: list[QueuedJob] = []
        bare = [d.msg_id or f"REQUESTS-{d.stream_seq}" for d, _ in accepted]
        msg_ids = [tenant_claim_id(d.subject, mid) for (d, _), mid in zip(accepted, bare, strict=True)]
        fresh = await inbox.claim_scoped(conn, PRODUCER, msg_ids, bare)
        candidates: list[QueuedJob] = []
        dup_rejects: list[outbox.OutboxMessage] = []
        new_rows: list[repo.NewJob] = []
        taken: set[str] = set()
        for (d, submitted), msg_id in zip(accepted, msg_ids, strict=True):
            if msg_id not in fresh or msg_id in taken:
                # Handled before (its decision and messages are already durable), or the same
                # message twice in this batch (a redelivery): nothing to answer.
                continue
            taken.add(msg_id)
            job = (
                submitted if submitted.submitted_at else msgspec.structs.replace(submitted, submitted_at=now)
            )
            carrier: dict[str, str] = {}
            propagate.inject(carrier, context=d.context)
            state = "running" if job.stages else "queued"
            new_rows.append(
                repo.NewJob(
                    job.job_id,
                    job.tenant,
                    encode(job),
                    job.submitted_at,
                    carrier,
                    state,
                    None,
                    job.priority,
                )
            )
            candidates.append(QueuedJob(job, carrier))
        # With each new job's submitted event.
        inserted = await repo.insert_jobs(conn, new_rows, submitted_events=True)
        admitted: list[QueuedJob] = []
        seen: set[str] = set()
        for q in candidates:
            # One job id twice in one batch (two messages, distinct ids): the first is the job,
            # the other a duplicate, never a second admission of the same row.
            if q.job.job_id in inserted and q.job.job_id not in seen:
                seen.add(q.job.job_id)
                admitted.append(q)
            else:
                reason = f"job id {q.job.job_id!r} was already submitted; choose a new job id"
                dup_rejects.append(
                    outbox.message(
                        subjects.job_event("rejected", q.job.tenant),
                        rejection(q.job.job_id, q.job.tenant, "duplicate", reason),
                        f"{q.job.job_id}:rejected:duplicate:{hash_carrier(q)}",
                        context=q.context,
                    )
                )
        plain = [q for q in admitted if not q.job.stages]
        for q in admitted:
            if q.job.stages:
                queued_children += await self._expand_dag(conn, q)
        await outbox.add(conn, PRODUCER, dup_rejects)
        fresh_jobs = plain + queued_children
        return fresh_jobs, dup_rejects

    def _stage_never_fits(self, stages: Mapping[str, JobSpec]) -> tuple[str, Verdict] | None:
        """The first of a DAG's stages (name -> its job) that could never run as asked on this
        platform, with why (:meth:`Framework.never_fits`); None when each could, or while the
        clusters have not settled (an agent not yet heard from may hold what a stage needs: the
        cycle rejects nothing then either)."""
        if time.monotonic() < self.settled_at:
            return None
        return self.framework.stage_never_fits(stages, self.book.snapshot(time.time()))

    async def _expand_dag(self, conn: asyncpg.Connection, q: QueuedJob) -> list[QueuedJob]:
        """Insert a DAG job's stages: those without dependencies are queued, the rest wait."""
        children = dag.expand(q.job)  # validated at admission (cycle.admission_check)
        deps = dag.dependencies(q.job.stages)
        by_stage = {c.labels[dag.STAGE_LABEL]: c for c in children}
        taken = await repo.existing_jobs(conn, [c.job_id for c in children])
        # A stage more than its tenant's quota could ever hold, or that no cluster could ever
        # hold as asked: refused whole, now, rather than after the stages before it ran.
        beyond = stage_beyond_quota(by_stage, self.book.tenants)
        never = None if taken or beyond else self._stage_never_fits(by_stage)
        if taken or beyond or never:
            # A stage's job id is someone else's job already: refuse the DAG rather than run it
            # without that stage.
            code: RejectCode = "invalid"
            reason = (
                f"stage job id(s) {', '.join(sorted(taken))} already exist; choose another job id for the DAG"
            )
            if beyond is not None and not taken:
                stage, verdict = beyond
                code = "unknown_tenant" if verdict.unknown_tenant else "quota"
                reason = f"stage {stage}: {verdict.reason}"
            elif never is not None:
                stage, status = never
                code, reason = status.reject, f"stage {stage}: {status.reason}"
            hint = never[1].hint if never is not None and not taken and beyond is None else ""
            await repo.set_state(conn, [q.job.job_id], "rejected", ["running"], reason)
            event = rejection(q.job.job_id, q.job.tenant, code, reason, hint)
            msg_id = f"{q.job.job_id}:rejected"
            await repo.append_events(
                conn, [repo.JobEventRow(q.job.job_id, "rejected", msg_id, encode(event), event.at)]
            )
            await outbox.add(
                conn,
                PRODUCER,
                [
                    outbox.message(
                        subjects.job_event("rejected", q.job.tenant), event, msg_id, context=q.context
                    )
                ],
            )
            return []
        rows = []
        ready: list[QueuedJob] = []
        for stage, child in by_stage.items():
            state = "queued" if not deps.get(stage) else "waiting"
            rows.append(
                repo.NewJob(
                    child.job_id,
                    child.tenant,
                    encode(child),
                    child.submitted_at,
                    q.carrier,
                    state,
                    q.job.job_id,
                    child.priority,
                )
            )
            if state == "queued":
                ready.append(QueuedJob(child, q.carrier, parent=q.job.job_id))
        await repo.insert_jobs(conn, rows)
        return ready

    # ---- the scheduling cycle --------------------------------------------------------------------

    async def _schedule(
        self,
        conn: asyncpg.Connection,
        jobs: list[QueuedJob],
        *,
        backlog: int | Sequence[JobSpec] = 0,
        grow: bool = True,
        decided: Callable[["Applied"], None] = lambda _: None,
        turn: Callable[[], Awaitable[None]] = lambda: asyncio.sleep(0),
        inserted: frozenset[str] = frozenset(),
    ) -> "Applied":
        """One cycle (:func:`loom.sched.cycle.run_cycle`) over ``jobs`` on the kept snapshot, and all
        it implies written in this transaction: batched statements for jobs, reservations, decision
        records, events and the outbox. The book itself changes only after the commit
        (:meth:`_commit`). ``backlog``: jobs queued but not in this cycle, or their number
        (growth leaves them the pools they could use; given a number, it waits for them).
        ``decided`` is told the cycle's outcome as soon as it is decided; then ``turn`` is awaited
        before anything is written (a pipelined batch waits there for the batch before it to end:
        written earlier, this batch's row locks, on nodes both reserve, could block that batch's
        writes while this one waits for it). ``inserted``: jobs this transaction inserted (no one
        else sees them: nothing to lock)."""
        vanished: list[str] = []
        if jobs:
            # Only jobs still queued in the store take part (a stage cancelled or a job finished while
            # it waited here is dropped); their rows stay locked until this cycle commits.
            still = inserted | await repo.lock_queued(
                conn, [q.job.job_id for q in jobs if q.job.job_id not in inserted]
            )
            vanished = [q.job.job_id for q in jobs if q.job.job_id not in still]
            jobs = [q for q in jobs if q.job.job_id in still]
        if not jobs and not grow:
            applied = Applied(vanished=vanished)
            decided(applied)
            await turn()
            return applied
        wall = time.time()
        applied = self._decide(jobs, now=wall, backlog=backlog, grow=grow)
        applied.vanished += vanished
        decided(applied)
        await turn()
        result = applied.cycle
        if result.empty:
            return applied
        snap = self.book.snapshot(wall)
        now = wall
        # Shrunk elastic jobs and preempted victims first: their GPUs are what the new
        # reservations take.
        tenant_of = {q.job.job_id: q.job.tenant for q in jobs}
        for shrunk in result.shrunk:
            await self._shrink(
                conn,
                job_id=shrunk.job_id,
                workers=shrunk.workers,
                allocations=shrunk.allocations,
                by=shrunk.by,
                by_tenant=tenant_of.get(shrunk.by),
                result=applied,
            )
        victims = sorted(p.job_id for p in result.preempted if p.job_id in self.book.runs)
        # A victim resumes from its newest checkpoint, as a run lost with its cluster does (and as
        # the simulator times it); it restarted from step 0, its checkpoints unread.
        recorded = await moves.checkpoints_of(conn, victims) if victims else {}
        copies = await replica_store.ready_replicas(conn, victims) if victims else {}
        for preempted in result.preempted:
            run = self.book.runs.get(preempted.job_id)
            if run is not None:
                by = room_taker(preempted.by, tenant_of.get(preempted.by), run.job.tenant)
                resume = _resume_of(
                    run,
                    recorded.get(run.job.job_id, []),
                    copies.get(run.job.job_id, []),
                    unreachable=self.failover.failed,
                )
                why = (
                    f"stopped to make room for {by}, whose worker only its node holds, as it has room"
                    f" elsewhere now; {resume.why}"
                    if preempted.plugin == "rare_room"
                    else f"preempted by {by}; {resume.why}"
                )
                await self._give_up(
                    conn,
                    run,
                    "preempted",
                    why,
                    avoid=(),
                    result=applied,
                    resume_step=resume.step,
                )
        await self._write(conn, applied, now, snap)
        if result.probes:
            await self._insert_probes(conn, jobs, applied, now)
        return applied

    async def _write(
        self,
        conn: asyncpg.Connection,
        applied: "Applied",
        now: float,
        snap: Snapshot,
    ) -> None:
        """What a cycle placed, rejected, left waiting and grew: reservations, jobs, decision
        records, events and the outbox (timed in ``phases``): one statement in all
        (:func:`loom.store.jobs.apply_cycle`) unless the cycle grew a job or rejected a DAG's
        stage, then one batched statement each, in the order the DAG's settling reads them."""
        result = applied.cycle
        reservations = []
        deadlines = []
        placed_rows = []
        for p in result.placed:
            q, d = p.pending, p.decision
            for part in d.parts:
                reservations.append((q.job.job_id, q.attempt, part.cluster, part.allocations))
                deadlines.append(now + self.confirm_timeout_s + d.start_after_s)
            placed_rows.append((q.job.job_id, d.lead.cluster, q.attempt, now, d.workers))
            p.record.notes.append(self._speed_note(q.job, d.lead.gpu_model, snap))
        self._check_owned(cluster for _, _, cluster, _ in reservations)
        phases = self.phases
        t = time.perf_counter()
        rejected = [(r.pending.job.job_id, r.reason) for r in result.rejected]
        decisions = (
            [
                (p.pending.job.job_id, p.pending.attempt, "placed", p.record.to_dict(raw=False))
                for p in result.placed
            ]
            + [
                (r.pending.job.job_id, r.pending.attempt, "rejected", r.record.to_dict(raw=False))
                for r in result.rejected
            ]
            + [
                (w.pending.job.job_id, w.pending.attempt, "waiting", w.record.to_dict(raw=False))
                for w in result.waiting
                if self.waiting_reasons.get(w.pending.job.job_id) != w.record.reason
            ]
        )
        t = phases.since("write_decisions", t)  # their records, built
        if not result.grown and not any(r.pending.parent for r in result.rejected):
            # Nothing in this cycle reads what it writes (no DAG settled, nothing grown): all of
            # it in one statement.
            await self._cycle_messages(conn, applied, now)
            t = phases.since("write_messages", t)
            await repo.apply_cycle(
                conn,
                reservations=reservations,
                confirm_by=deadlines,
                placed=placed_rows,
                rejected=rejected,
                decisions=decisions,
                events=applied.events,
                outbox_rows=(
                    PRODUCER,
                    [(m.msg_id, m.subject, m.payload, m.headers) for m in applied.messages],
                ),
            )
            phases.since("write_statement", t)
            return
        await repo.reserve(conn, reservations, deadlines)
        await repo.mark_placed(conn, placed_rows)
        await repo.mark_rejected(conn, rejected)
        await repo.record_decisions(conn, decisions)
        await self._cycle_messages(conn, applied, now)  # after the rejections: a DAG reads them
        await repo.append_events(conn, applied.events)
        await outbox.add(conn, PRODUCER, applied.messages)
        phases.since("write_statements", t)

    async def _cycle_messages(self, conn: asyncpg.Connection, applied: "Applied", now: float) -> None:
        """The messages and events of a cycle's placements and rejections (settling the DAG of a
        rejected stage), and its growth written."""
        result = applied.cycle
        starts: list[PendingStart] = []
        for p in result.placed:
            placed_message, job_starts, placed_event = self._placement_messages(p.pending, p.decision, now)
            applied.messages.append(placed_message)
            starts += job_starts
            applied.events.append(placed_event)
        # The cycle's starts after its placed events: one message per cluster (StartJobs).
        applied.messages += start_messages(starts)
        for r in result.rejected:
            q = r.pending
            event = rejection(q.job.job_id, q.job.tenant, r.code, r.reason, r.hint)
            msg_id = f"{q.job.job_id}:rejected"
            applied.messages.append(
                outbox.message(subjects.job_event("rejected", q.job.tenant), event, msg_id, context=q.context)
            )
            applied.events.append(repo.JobEventRow(q.job.job_id, "rejected", msg_id, encode(event), now))
            if q.parent:
                applied.messages += await self._settle_dag(conn, q.parent, applied)
        for g in result.grown:
            await self._grow(conn, g, now, applied)

    def _decide(
        self, jobs: list[QueuedJob], *, now: float, backlog: int | Sequence[JobSpec] = 0, grow: bool = True
    ) -> "Applied":
        """The cycle itself, in memory: the kept snapshot at ``now`` (wall seconds), the learned
        speeds (optimistic ones on an exploring cycle), and :func:`~loom.sched.cycle.run_cycle`.
        Returns what the store must then write: the cycle, the runs it placed (built and listed in
        the snapshot as it went) and whether the snapshot must be rebuilt after the commit."""
        snap = self.book.snapshot(now)
        for q in jobs:
            if q.fair_share is None:
                q.fair_share = fair_share_of(snap, q.job.tenant)
            if q.queued_at is None:
                # Its submission (the client's clock, capped at now): a placement that restarts or
                # takes over a territory does not hold a job for probes longer than the first would.
                q.queued_at = min(q.job.submitted_at or now, now)
        if self.learner.settings.explore_share > 0:
            # Optimistic factors for this cycle only when the exploration budget allows.
            offered = self.learner.factors(explore=True)
            if offered != snap.learned:
                snap.set_learned(offered)
        settings = CycleSettings(
            settled=time.monotonic() >= self.settled_at,
            max_backoff_s=MAX_BACKOFF_S,
            grow=grow,
        )
        runs: dict[str, Run] = {}

        def placed(q: QueuedJob, d: Decision) -> None:
            # The run as the book will hold it once committed, listed in the snapshot now so that
            # the cycle's later jobs see it running (the simulator lists each start at once too).
            # A run resumed from a checkpoint has that share of its steps behind it: its predicted
            # end counts the steps left, and its pace is measured from there (as the simulator's).
            resumed = min(max(q.resume_step / max(q.job.work.steps, 1), 0.0), 1.0)
            steps_left = (1.0 - resumed) * q.job.work.steps
            run = Run(
                queued=q,
                attempt=q.attempt,
                parts=[(part.cluster, part.gpu_model, part.allocations) for part in d.parts],
                workers=d.workers,
                progress=resumed,
                labels=q.job.labels,
                started_at=now + d.start_after_s,
                predicted_step_s=d.predicted_step_s,
                progress_at_start=resumed,
                delay_s=reading_delay_s(q.job, d, steps_left=steps_left, workers=d.workers),
            )
            runs[q.job.job_id] = run
            snap.running.append(run.running_job())

        probing = None
        if self.probe is not None:
            learner = self.learner
            probing = Probing(
                self.probe,
                learner.known_cells(),
                # Only a hold reads them (off by default): no pass over the queue each cycle for nothing.
                self._probes_in_flight() if self.probe.hold_s > 0 else {},
                log_sd=lambda family, model: learner.estimate(family, model).log_sd,
            )
        result = run_cycle(
            self.framework, jobs, snap, settings=settings, backlog=backlog, placed=placed, probing=probing
        )
        if jobs:
            per_job = result.decide_ms / len(jobs)
            last = self.decide_ms_per_job
            self.decide_ms_per_job = per_job if last is None else 0.7 * last + 0.3 * per_job
        taken_back = fold_within(result, snap)
        for job_id in taken_back:
            runs.pop(job_id, None)
        for p in result.placed:
            d, run = p.decision, runs[p.pending.job.job_id]
            if d.workers != run.workers:  # shrunk later in the cycle (fold_within)
                run.parts = [(part.cluster, part.gpu_model, part.allocations) for part in d.parts]
                run.workers = d.workers
                run._core = None
        for run in runs.values():
            self.book.add_pending(run)  # until its transaction commits (or fails)
        if not result.empty:
            self.stats["last_cycle"] = {"jobs": len(jobs), "decide_ms": round(result.decide_ms, 1)}
            prom.DECISIONS.labels(self.shard).inc(len(jobs))
            prom.DECISION_LATENCY.labels(self.shard).observe(result.decide_ms / 1000.0)
        # A run taken back had its quota counted in the snapshot: rebuild it after the commit.
        return Applied(cycle=result, runs=runs, stale=bool(taken_back), at=now)

    def _probes_in_flight(self) -> dict[str, int]:
        """Family -> its speed probes that hold its jobs here: placed or running, or queued and not
        yet decided (one that found no room queues on without holding anyone, as in the simulator)."""
        families: Counter[str] = Counter()
        undecided = (q.job for q in self.queue.values() if q.tries == 0)
        for job in itertools.chain(undecided, (r.job for r in self.book.runs.values())):
            if PROBE_LABEL in job.labels:
                families[job_family(job)] += 1
        return dict(families)

    async def _insert_probes(
        self, conn: asyncpg.Connection, asked: Sequence[QueuedJob], applied: "Applied", now: float
    ) -> None:
        """Insert the speed probes a cycle asked for (queued, with their submitted events, in the
        trace of the job that asked): a probe id that exists already (asked before) is not a second
        probe. Each joins the queue once the transaction commits (``released_children``)."""
        by_id = {q.job.job_id: q for q in asked}
        rows, queued = [], []
        for spec in applied.cycle.probes:
            asker = by_id.get(spec.labels[PROBE_LABEL])
            carrier = dict(asker.carrier) if asker is not None else {}
            job = JobSubmitted(**{f: getattr(spec, f) for f in spec.__struct_fields__}, submitted_at=now)
            rows.append(
                repo.NewJob(job.job_id, job.tenant, encode(job), now, carrier, "queued", None, job.priority)
            )
            queued.append(QueuedJob(job, carrier))
            applied.probes_asked.append((job_family(job), spec.resources.gpu_models[0]))
        inserted = await repo.insert_jobs(conn, rows, submitted_events=True)
        applied.released_children += [q for q in queued if q.job.job_id in inserted]
        self.stats["probes"] = self.stats.get("probes", 0) + len(inserted)

    async def _grow(self, conn: asyncpg.Connection, g: Grown, now: float, applied: "Applied") -> None:
        """Write one elastic job's growth (the cycle already took the GPUs in the snapshot)."""
        run = self.book.runs.get(g.job_id)
        # The run must still be this attempt, placed or running (its row stays locked).
        if run is None or not await repo.lock_active(conn, g.job_id, run.attempt):
            applied.stale = True  # the snapshot grew a run that is gone: rebuild it after the commit
            return
        await repo.grow(conn, g.job_id, run.attempt, g.cluster, g.added)
        count = await repo.set_workers(conn, g.job_id, run.attempt, g.workers)
        allocations = [NodeAllocation(node=n, gpus=k) for n, k in g.allocations]
        resize = ResizeJob(job_id=g.job_id, attempt=run.attempt, workers=g.workers, allocations=allocations)
        event = JobResized(
            job_id=g.job_id,
            tenant=run.job.tenant,
            cluster=g.cluster,
            attempt=run.attempt,
            workers=g.workers,
            allocations=allocations,
            reason="grew into freed capacity",
            at=now,
        )
        applied.messages.append(
            outbox.message(
                subjects.cluster_command(g.cluster, "resize"),
                resize,
                f"{g.job_id}:resize:{run.attempt}:{count}",
                context=run.queued.context,
            )
        )
        msg_id = f"{g.job_id}:resized:{run.attempt}:{count}"
        applied.messages.append(
            outbox.message(
                subjects.job_event("resized", run.job.tenant), event, msg_id, context=run.queued.context
            )
        )
        applied.events.append(repo.JobEventRow(g.job_id, "resized", msg_id, encode(event), now))
        applied.grown.append((g.job_id, [(g.cluster, g.gpu_model, g.allocations)], g.workers))

    def _placement_messages(
        self, q: QueuedJob, d: Decision, now: float
    ) -> tuple[outbox.OutboxMessage, list["PendingStart"], repo.JobEventRow]:
        """A placement's ``placed`` event, its start commands (one per part, sent by
        :func:`start_messages`) and its event row."""
        job = q.job
        parts = [
            PlacedPart(
                cluster=p.cluster,
                region=p.region,
                gpu_model=p.gpu_model,
                allocations=[NodeAllocation(node=n, gpus=g) for n, g in p.allocations],
                layers=p.layers,
            )
            for p in d.parts
        ]
        lead = parts[0]
        placed = JobPlaced(
            job_id=job.job_id,
            tenant=job.tenant,
            cluster=lead.cluster,
            region=lead.region,
            gpu_model=lead.gpu_model,
            allocations=lead.allocations,
            attempt=q.attempt,
            placed_at=now,
            submitted_at=job.submitted_at,
            workers=d.workers,
            parts=parts if len(parts) > 1 else [],
            predicted_step_s=d.predicted_step_s,
            sync=d.sync,
            score=min(max(d.score, 0.0), 100.0),
        )
        msg_id = f"{job.job_id}:placed:{q.attempt}"
        context = q.context
        message = outbox.message(subjects.job_placed(job.tenant), placed, msg_id, context=context)
        spec = _spec_of(job)
        starts = []
        for i, part in enumerate(parts):
            start = StartJob(
                resume_from_step=q.resume_step,
                job_id=job.job_id,
                spec=spec,
                gpu_model=part.gpu_model,
                allocations=part.allocations,
                attempt=q.attempt,
                role="lead" if i == 0 else "member",
                slowdown=d.slowdown,
                workers=d.workers if d.workers != job.workers else None,
                start_after_s=d.start_after_s,
            )
            start_id = f"{job.job_id}:start:{q.attempt}" + ("" if i == 0 else f":{part.cluster}")
            starts.append(PendingStart(part.cluster, start, start_id, context))
        # The event row holds the placed message's own bytes (encoded once).
        return message, starts, repo.JobEventRow(job.job_id, "placed", msg_id, message.payload, now)

    async def _give_up(
        self,
        conn: asyncpg.Connection,
        run: Run,
        cause: RequeueReason,
        reason: str,
        *,
        avoid: Sequence[str],
        result: "Applied",
        resume_step: int = 0,
        from_cluster: str = "",
    ) -> None:
        """Requeue a run's job (next attempt), release its GPUs and stop it on every cluster it holds.

        Nothing happens when the attempt had already moved on (it finished meanwhile).
        ``resume_step``: the step the next run resumes from.
        """
        job = run.job
        next_avoid = requeue_avoid(cause, avoid, run.queued.avoid)
        released = await repo.requeue(
            conn,
            job.job_id,
            run.attempt,
            sorted(next_avoid),
            unstarted_only=cause == "start_timeout",
            resume_step=resume_step,
        )
        if released is None:
            result.vanished.append(job.job_id)
            return
        event = JobRequeued(
            job_id=job.job_id,
            tenant=job.tenant,
            attempt=run.attempt + 1,
            cause=cause,
            reason=reason[:2048],
            avoid_clusters=sorted(next_avoid),
            from_cluster=from_cluster,
            at=time.time(),
        )
        msg_id = f"{job.job_id}:requeued:{run.attempt + 1}"
        result.messages.append(
            outbox.message(
                subjects.job_event("requeued", job.tenant), event, msg_id, context=run.queued.context
            )
        )
        result.events.append(repo.JobEventRow(job.job_id, "requeued", msg_id, encode(event), event.at))
        for cluster, _, _ in run.parts:
            stop = StopJob(job_id=job.job_id, attempt=run.attempt, reason=reason[:1024])
            result.messages.append(
                outbox.message(
                    subjects.cluster_command(cluster, "stop"),
                    stop,
                    f"{job.job_id}:stop:{run.attempt}:{cluster}",
                    context=run.queued.context,
                )
            )
        again = dataclasses.replace(
            run.queued,
            attempt=run.attempt + 1,
            avoid=next_avoid,
            tries=0,
            resume_step=resume_step,
        )
        result.requeued.append((run, again, cause))

    async def _shrink(
        self,
        conn: asyncpg.Connection,
        *,
        job_id: str,
        workers: int,
        allocations: tuple[tuple[str, int], ...],
        by: str,
        by_tenant: str | None = None,
        result: "Applied",
    ) -> None:
        """Give back an elastic run's surplus workers and tell its agent (the decision counts them)."""
        run = self.book.runs[job_id]
        by = room_taker(by, by_tenant, run.job.tenant)
        cluster, model, held = run.parts[0]
        if not await repo.lock_active(conn, job_id, run.attempt):
            raise ConflictError(f"{job_id} ended while it was being shrunk")
        # Against what this cycle already left it (two jobs may each shrink it once).
        old = result.current.get(job_id, held)
        new = dict(allocations)
        freed = [(n, g - new.get(n, 0)) for n, g in old if g > new.get(n, 0)]
        await repo.shrink(conn, job_id, run.attempt, freed)
        tag = await repo.set_workers(conn, job_id, run.attempt, workers)
        result.current[job_id] = allocations
        now = time.time()
        nodes = [NodeAllocation(node=n, gpus=g) for n, g in allocations]
        result.messages.append(
            outbox.message(
                subjects.cluster_command(cluster, "resize"),
                ResizeJob(job_id=job_id, attempt=run.attempt, workers=workers, allocations=nodes),
                f"{job_id}:resize:{run.attempt}:{tag}",  # the run's resize count
                context=run.queued.context,
            )
        )
        event = JobResized(
            job_id=job_id,
            tenant=run.job.tenant,
            cluster=cluster,
            attempt=run.attempt,
            workers=workers,
            allocations=nodes,
            reason=f"shrank to make room for {by}",
            at=now,
        )
        msg_id = f"{job_id}:resized:{run.attempt}:{tag}"
        result.messages.append(
            outbox.message(
                subjects.job_event("resized", run.job.tenant), event, msg_id, context=run.queued.context
            )
        )
        result.events.append(repo.JobEventRow(job_id, "resized", msg_id, encode(event), now))
        result.shrunk = [s for s in result.shrunk if s[0] != job_id]
        result.shrunk.append((job_id, [(cluster, model, allocations)], workers))

    def _due(self, *, everyone: bool = False, besides: Iterable[str] = ()) -> list[QueuedJob]:
        """Queued jobs whose backoff has ended (every queued job with ``everyone``), but ``besides``."""
        now = time.monotonic()
        skip = set(besides)
        for batch in self._batches.values():
            skip |= batch.jobs  # decided, still writing: its outcome is not adopted yet
        return [
            q for q in self.queue.values() if (everyone or q.not_before <= now) and q.job.job_id not in skip
        ]

    def _adopt_waiting(self, cycle: CycleResult[QueuedJob]) -> None:
        """A committed cycle's waiting jobs: their backoff, and their reason for ``loom explain``."""
        now = time.monotonic()
        for w in cycle.waiting:
            q = w.pending
            if not w.held:  # a hold for speed probes is no try: its backoff starts when decided
                q.tries += 1
            q.not_before = now + w.retry_in_s
            self.waiting_reasons[q.job.job_id] = w.record.reason
            if q.tries == 1 and not w.held and PROBE_LABEL in q.job.labels:
                # A speed probe with no room holds no one any more (_probes_in_flight): the jobs
                # it held are decided again now, not when their wait for it would have ended.
                self.capacity_changed = True
        if any(PROBE_LABEL in r.pending.job.labels for r in cycle.rejected):
            self.capacity_changed = True  # a rejected probe holds no one: they are decided now

    # One flat adoption of every kind of effect, in the order the book must take them.
    def _commit(self, applied: "Applied", considered: list[QueuedJob]) -> None:  # noqa: PLR0912
        """Adopt a committed cycle's outcome in memory (no await in here)."""
        gone = set(applied.vanished)
        for job_id in gone:
            if self.queue.pop(job_id, None) is not None:
                # A queued job left (cancelled): what it could have used may go to others, or to
                # elastic jobs' growth, at the next cycle over everyone (it waited for a completion).
                self.capacity_changed = True
                self.wake.set()
            self.book.leave_queue((job_id,))
        considered = [q for q in considered if q.job.job_id not in gone]
        for run, done in applied.learned:
            self._learn_alpha(run, done)
        if applied.observed:
            for observation in applied.observed:
                observation.teach(self.learner)
            self._adopt_learned()
        for family, gpu_model in applied.probes_asked:
            self.learner.probe_asked(family, gpu_model)
        for job_id, attempt in applied.taught:
            taught = self.book.runs.get(job_id)
            if taught is not None and taught.attempt == attempt:
                taught.taught = True  # committed: its later progress reports need not offer it again
        for job_id, parts, workers in applied.shrunk + applied.grown:
            if job_id in self.book.runs:
                resized_at = applied.at or time.time()
                self.book.resize_run(job_id, parts, workers, now=resized_at)
                self.failover.nodes.pace.resized(job_id, resized_at)  # its pace starts again
                self.stats["resized"] += 1
        for run, again, cause in applied.requeued:
            if self.book.drop_run(run.job.job_id, run.attempt, in_snapshot=cause == "preempted") is not None:
                self.queue[again.job.job_id] = again
                self.stats["requeued"] += 1
                if cause == "preempted":
                    self.stats["preempted"] += 1
        cycle = applied.cycle
        for p in cycle.placed:
            # Built by the cycle (``_decide``), which already took its GPUs and listed it.
            self.book.add_run(applied.runs[p.pending.job.job_id], in_snapshot=True)
        settled = {p.pending.job.job_id for p in cycle.placed} | {
            r.pending.job.job_id for r in cycle.rejected
        }
        for q in considered:
            if q.job.job_id in settled:
                self.queue.pop(q.job.job_id, None)
                self.waiting_reasons.pop(q.job.job_id, None)
            elif q.job.job_id not in self.queue or self.queue[q.job.job_id] is q:
                self.queue[q.job.job_id] = q
        self._adopt_waiting(cycle)
        for q in applied.released_children:
            self.queue[q.job.job_id] = q
        if applied.stale:
            self.book.invalidate()
        self.stats["placed"] += len(cycle.placed)
        self.stats["rejected"] += len(cycle.rejected)
        self.stats["queued"] = len(self.queue)
        for outcome, count in (
            ("placed", len(cycle.placed)),
            ("rejected", len(cycle.rejected)),
            ("waiting", len(cycle.waiting)),
            ("requeued", len(applied.requeued)),
            ("preempted", sum(1 for _, _, cause in applied.requeued if cause == "preempted")),
            ("resized", len(applied.shrunk) + len(applied.grown)),
        ):
            if count:
                prom.PLACEMENTS.labels(self.shard, outcome).inc(count)
        if cycle.preempted or cycle.shrunk or applied.stale:
            # What the victims gave back beyond the new placement is free now: every queued job
            # gets a look at it in the next cycle (as released capacity always does).
            self.capacity_changed = True
        if applied.requeued or applied.released_children or self.capacity_changed:
            self.wake.set()

    # ---- the submission pipeline ---------------------------------------------------------------

    def _open_batch(self, applied: "Applied", considered: list[QueuedJob]) -> "_Batch":
        """Register a batch that has just decided (no await since its cycle ran)."""
        self._seq += 1
        batch = _Batch(
            seq=self._seq,
            before=self._tail,
            done=asyncio.get_running_loop().create_future(),
            jobs={q.job.job_id for q in considered},
            runs=set(applied.runs),
        )
        self._batches[batch.seq] = batch
        self._tail = batch
        pipeline = self.stats["pipeline"]
        pipeline["batches"] += 1
        if len(self._batches) > 1:
            pipeline["overlapped"] += 1
        return batch

    async def _turn(self, batch: "_Batch | None") -> None:
        """Wait until the batch decided before ``batch`` has ended; refuse to commit a batch that
        was decided on top of one whose write failed."""
        if batch is None:
            return
        if batch.before is not None and not batch.before.done.done():
            await asyncio.wait([batch.before.done])
        if batch.doomed:
            raise TransientError(
                f"batch {batch.seq} was decided on top of a batch whose write failed; handled again"
            )

    def _close_batch(self, batch: "_Batch", *, ok: bool) -> None:
        self._batches.pop(batch.seq, None)
        batch.before = None  # ended: no chain of past batches is kept alive
        if self._tail is batch:
            self._tail = None
        if not batch.done.done():
            batch.done.set_result(ok)

    def _fail_batch(self, batch: "_Batch") -> None:
        """A batch's write failed (its transaction rolled back): so must every batch decided on top
        of it; their placements leave the snapshot, which is rebuilt from the book (no await)."""
        if batch.seq not in self._batches:
            return
        doomed = [b for b in self._batches.values() if b.seq > batch.seq and not b.doomed]
        for b in doomed:
            b.doomed = True
        gone = [batch, *doomed]
        self.book.forget_pending(job_id for b in gone for job_id in b.runs)
        for b in gone:
            # A fresh job of a discarded batch is not queued here: it comes back with its message.
            self.book.leave_queue([j for j in b.jobs if j not in self.queue])
        self.stats["pipeline"]["discarded"] += len(doomed)
        self._close_batch(batch, ok=False)

    async def _drain(self) -> None:
        """Under the lock: wait until every batch still writing has ended (committed or failed)."""
        while self._batches:
            await asyncio.wait([b.done for b in self._batches.values()])

    def _note_timings(
        self, accepted: list[tuple[Delivery[bytes], JobSubmitted]], stamps: dict[str, float]
    ) -> None:
        """Keep the path of a committed batch's jobs (``sent`` is added when its messages go out)."""
        for d, job in accepted:
            try:
                stored = d.msg.metadata.timestamp.timestamp()
            except (AttributeError, TypeError, ValueError):  # a delivery not from JetStream (tests)
                stored = 0.0
            self.job_timings.append((job.job_id, stored, d.received_at, stamps))

    def job_timings_of(self, prefix: str) -> dict[str, dict[str, float]]:
        """The ``job_timings`` debug section: each kept job whose id starts with ``prefix``, its
        stamps (wall-clock seconds): ``stored`` (in the stream), ``received`` (by the consumer),
        ``handled`` (its batch handed to placement), ``admitted``, ``cycle``, ``decided``,
        ``committed``, ``sent`` (see :meth:`_admit`)."""
        return {
            job_id: {"stored": stored, "received": received, **stamps}
            for job_id, stored, received, stamps in list(self.job_timings)
            if job_id.startswith(prefix)
        }

    async def _requeue_loop(self) -> None:
        """Retry queued jobs when capacity changed, and each job when its backoff ends."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), timeout=0.5)
            self.wake.clear()
            try:
                # Freed capacity goes to queued jobs first; elastic jobs grow into what is left.
                changed, self.capacity_changed = self.capacity_changed, False
                if self.queue or changed:
                    t = time.perf_counter()
                    try:
                        async with self.lock:
                            # Submission batches wait from here: timed as ``requeue_locked``.
                            t = self.phases.since("requeue_lock_wait", t)
                            await self._drain()
                            await self._retrying(functools.partial(self._requeue_cycle, everyone=changed))
                            self.phases.since("requeue_locked", t)
                    except BaseException:
                        self.capacity_changed = self.capacity_changed or changed  # not seen yet
                        raise
                    # What a failed publish left goes out with the relay's next round, soon.
                    self.relay.kick()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("requeue cycle failed", error=repr(exc))

    async def _requeue_cycle(self, *, everyone: bool = False) -> None:
        """A cycle over the queued jobs whose backoff ended; after capacity changed (``everyone``),
        over all of them, and elastic jobs may grow when nothing is left waiting."""
        due = self._due(everyone=everyone)
        grow = everyone
        if not due and not (grow and not self.queue):
            return
        async with self._tx() as conn:
            # The queued jobs not due yet, by name: growth leaves the pools they could use to them.
            due_ids = {q.job.job_id for q in due}
            backlog = [q.job for q in self.queue.values() if q.job.job_id not in due_ids]
            applied = await self._schedule(conn, due, backlog=backlog, grow=grow)
        self._commit(applied, due)
        self._send(applied.messages)

    async def _expiry_loop(self) -> None:
        """Give up placements whose agent never confirmed the start; place them again elsewhere."""
        period = max(min(self.confirm_timeout_s / 4, 5.0), 0.2)
        while True:
            await asyncio.sleep(period)
            try:
                rows = await repo.expired_reservations(self.pool)
                if not rows:
                    continue
                async with self.lock:
                    await self._drain()
                    await self._retrying(functools.partial(self._expire, rows))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("expiry cycle failed", error=repr(exc))

    async def _expire(self, rows: Sequence[asyncpg.Record]) -> None:
        result = Applied()
        async with self._tx() as conn:
            for row in rows:
                run = self.book.runs.get(row["job_id"])
                if run is None or run.attempt != row["attempt"]:
                    continue
                clusters = list(row["clusters"])
                await self._give_up(
                    conn,
                    run,
                    "start_timeout",
                    f"no start confirmed by {', '.join(clusters)} within {self.confirm_timeout_s:g} s",
                    avoid=expiry_avoid(clusters, attempt=run.attempt, max_attempts=self.max_attempts),
                    result=result,
                )
            await repo.append_events(conn, result.events)
            await outbox.add(conn, PRODUCER, result.messages)
        self._commit(result, [])
        self._send(result.messages)

    # ---- failover ------------------------------------------------------------------------------

    def cluster_health(self, now: float | None = None) -> dict[str, Health]:
        """Every owned cluster that is not healthy: suspect or failed (:mod:`loom.migrate.health`)."""
        now = time.time() if now is None else now
        clusters = set(self.failover.stale_since) | {c.cluster for c in self.book.nodes.values()}
        reach = reachability(self.failover.link_down)
        out: dict[str, Health] = {}
        for cluster in clusters:
            region = self.region_of.get(cluster)
            since = self.failover.stale_since.get(cluster)
            health = classify(
                cluster,
                # The stale flag says the TTL has passed; the loss has lasted that long and more.
                heartbeat_lost_s=None if since is None else self.failover.ttl_s + max(now - since, 0.0),
                ttl_s=self.failover.ttl_s,
                probes_reach=None if region is None else reach.get(region),
                region=region,
                agent_gone_s=self.failover.liveness.gone_s(cluster, now),
            )
            if health.state != "healthy":
                out[cluster] = health
        return out

    async def _failover_loop(self) -> None:
        """Re-place the runs of clusters classified failed (heartbeats and probes both lost)."""
        while True:
            await asyncio.sleep(self.failover.period_s)
            try:
                health = self.cluster_health()
                self.stats["failover"]["health"] = {
                    c: f"{h.state}: {h.reason}" for c, h in sorted(health.items())
                }
                await self._announce_health(health)
                for cluster, h in health.items():
                    if h.failed and cluster not in self.failover.failed:
                        self.failover.failed[cluster] = h
                        self.failover.failed_at[cluster] = time.time()
                        self.stats["failover"]["failed"][cluster] = {"at": time.time(), "reason": h.reason}
                        log.warning("cluster failed", cluster=cluster, reason=h.reason)
                self.failover.returned(self.failover.liveness.answered_at)
                await self._persist_failed()
                # A failed cluster takes no new work (the view closes it only once stale); nor
                # does a suspect node until its time runs out.
                changed = self.book.close(self.failover.closed_why())
                changed |= self.book.suspect(self.failover.nodes.suspects.active(time.time()))
                if changed:
                    self.stats["nodes"]["suspect"] = dict(self.failover.nodes.suspects.why)
                    self.capacity_changed = True
                    self.wake.set()
                if not self._on_failed_clusters():
                    continue
                async with self.lock:
                    await self._drain()
                    await self._retrying(self._fail_over)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("failover cycle failed", error=repr(exc))

    async def _announce_health(self, health: Mapping[str, Health]) -> None:
        """Tell the alert correlator (core NATS ``loom.placement.cluster_health``) each cluster whose
        classification changed: suspect, failed, or healthy again (:class:`HealthNotices` says
        which, and when)."""
        now = time.time()
        notices = self.failover.notices.due(health, now, settled=time.monotonic() >= self.settled_at)
        for h in notices:
            change = ClusterHealthChanged(
                cluster=h.cluster,
                state=h.state,
                reason=h.reason[:512],
                region=self.region_of.get(h.cluster),
                at=now,
            )
            try:
                await self.ctx.nc.publish(subjects.PLACEMENT_CLUSTER_HEALTH, msgspec.json.encode(change))
            except Exception as exc:  # retried next cycle: the state is not recorded as told
                log.info("cluster health notice not sent", cluster=h.cluster, error=repr(exc))
                continue
            self.failover.notices.told(h, now)

    async def _persist_failed(self) -> None:
        """Record the clusters newly classified failed, forget those that returned (for the next
        leader: :mod:`loom.store.failed`); a write that fails is done at the next period."""
        failover = self.failover
        new = [
            failed_store.FailedCluster(c, h.reason, failover.failed_at.get(c, time.time()))
            for c, h in failover.failed.items()
            if c not in failover.persisted
        ]
        gone = sorted(failover.persisted - set(failover.failed))
        if not new and not gone:
            return
        try:
            await failed_store.record_failed(self.pool, new)
            await failed_store.forget_failed(self.pool, gone)
        except Exception as exc:
            log.warning("failed clusters not recorded", error=repr(exc))
            return
        failover.persisted = (failover.persisted - set(gone)) | {c.cluster for c in new}

    async def _liveness_loop(self) -> None:
        """Ping every owned cluster's agent each period (:class:`loom.migrate.health.Liveness`)."""
        while True:
            await asyncio.sleep(self.failover.liveness_period_s)
            clusters = sorted(set(self.failover.stale_since) | {c.cluster for c in self.book.nodes.values()})
            self.failover.liveness.forget(clusters)
            now = time.time()
            outcomes = await asyncio.gather(*(self._ping(c) for c in clusters))
            self.stats["failover"]["pings"] += len(clusters)
            self.failover.liveness.record_round(now, dict(zip(clusters, outcomes, strict=True)))

    async def _ping(self, cluster: str) -> PingOutcome:
        """One liveness ping: answered, no responders (the agent's connection is gone), or timeout
        (a slow agent, or our own connection in trouble: no evidence either way)."""
        try:
            await self.ctx.nc.request(
                subjects.agent_alive(cluster), b"", timeout=self.failover.liveness_period_s
            )
        except NoRespondersError:
            return "no_responders"
        except Exception:
            return "timeout"
        return "answered"

    def _on_failed_clusters(self) -> dict[str, str]:
        """Job -> the failed cluster it has a part (lead or member) on (:func:`affected_jobs`)."""
        if not self.failover.failed:
            return {}  # nothing failed: no need to walk every run (this runs every period)
        return affected_jobs(
            {job_id: [p[0] for p in run.parts] for job_id, run in self.book.runs.items()},
            self.failover.failed,
        )

    async def _fail_over(self) -> None:
        """Requeue (next attempt) every run with a part on a failed cluster, release its GPUs, send
        its old attempt a stop on every cluster it held; the cycles place it again. Idempotent: a
        run already given up is no longer in the book, and the store refuses a moved-on attempt."""
        result = Applied()
        hit = self._on_failed_clusters()
        lost = {j: (self.book.runs[j], c, self.failover.failed[c]) for j, c in hit.items()}
        async with self._tx() as conn:
            recorded = await moves.checkpoints_of(conn, sorted(lost))
            copies = await replica_store.ready_replicas(conn, sorted(lost))
            for job_id, (run, cluster, health) in sorted(lost.items()):
                # A failed cluster's checkpoints went with it: its replicas elsewhere are read.
                resume = _resume_of(
                    run, recorded.get(job_id, []), copies.get(job_id, []), unreachable=self.failover.failed
                )
                await self._give_up(
                    conn,
                    run,
                    "cluster_lost",
                    f"cluster {cluster} failed: {health.reason}; {resume.why}",
                    avoid=[],
                    result=result,
                    resume_step=resume.step,
                    from_cluster=cluster,
                )
            await repo.append_events(conn, result.events)
            await outbox.add(conn, PRODUCER, result.messages)
        self._commit(result, [])
        self._send(result.messages)
        self.stats["failover"]["requeued"] += len(result.requeued)
        if result.requeued:
            log.warning("runs failed over", runs=len(result.requeued))
            self.capacity_changed = True
            self.wake.set()

    # ---- drains and moves (the migration service asks) ------------------------------------------

    async def on_drains_changed(self, msg: Msg) -> None:
        """The drained clusters changed (``loom drain`` / ``undrain``): reload them from the store.

        Asked as a request (the migration service does before it answers a drain or undrain), a
        leading instance answers once its book has them, with its shard, its holder id and the
        territories it holds with their fence tokens: the migration service waits for the leader
        of every live shard (a decision made after the answer offers none of a drained cluster's
        nodes, so a job submitted after ``loom drain`` returned is placed there by no shard). A
        leader still loading its state is waited for first: its load may have read the drains
        before the change, and this reload must come after it. Only a leader with its state loaded
        answers (one still loading after ``LOAD_WAIT_S``, or whose term ended meanwhile, does not)."""
        if msg.reply and self.held and not self._loaded.is_set():
            # Set once the load ended either way (a lost lease's cut-short load too).
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._loaded.wait(), LOAD_WAIT_S)
        try:
            closed = await moves.drained_clusters(self.pool)
        except Exception as exc:  # the next notice (or a restart) reloads them
            log.warning("drained clusters not reloaded", error=repr(exc))
            return
        self.failover.drained = frozenset(closed)
        if self.book.close(self.failover.closed_why()):
            log.info("drained clusters changed", closed=sorted(closed))
            self.stats["drained"] = sorted(closed)
            self.capacity_changed = True
            self.wake.set()
        held = dict(self.held)
        # Only a leader answers for territories: one whose load failed, or whose lease went while it
        # waited, answers nothing (the migration service names its shard as not confirmed).
        if msg.reply and held and self.leadership.is_leader and self._loaded.is_set():
            answer = {
                "ok": True,
                "shard": self.shard,
                "holder": self.holder,
                "territories": held,
                "drained": sorted(closed),
            }
            await respond(msg, json.dumps(answer).encode())

    async def on_attempts(self, msg: Msg) -> None:
        """``loom.placement.attempts``: job -> [state, current attempt], from the store (a returning
        agent fences its old runs with it). An agent is told of its own cluster's runs only, and an
        answer goes only to an inbox (:func:`loom.security.attempts_scope`): before, an agent could
        ask about any job of any tenant."""
        answer, held_on = attempts_scope(msg.reply)
        if not answer:
            return
        try:
            request = json.loads(msg.data or b"{}")
            states = await moves.job_states(
                self.pool, [str(j) for j in request["job_ids"]][:10_000], held_on=held_on
            )
            reply = {"ok": True, "result": {j: [state, attempt] for j, (state, attempt) in states.items()}}
        except Exception as exc:  # any bad request gets an answer, never a crash
            reply = {"ok": False, "error": str(exc)}
        await respond(msg, json.dumps(reply).encode())

    async def on_migrate(self, msg: Msg) -> None:
        """``loom.placement.migrate``: give a run up so that its job is placed again elsewhere, from
        ``resume_step`` (its checkpoint), avoiding ``avoid``. Only the instance holding the run
        answers; the attempt fences it (an attempt that moved on changes nothing)."""
        try:
            request = json.loads(msg.data or b"{}")
            job_id = str(request["job_id"])
            attempt = int(request["attempt"])
            resume_step = max(int(request.get("resume_step", 0)), 0)
            reason = str(request.get("reason", "migrated"))
            avoid = [str(c) for c in request.get("avoid", [])]
            from_cluster = str(request.get("from_cluster", ""))
        except (ValueError, KeyError, TypeError) as exc:
            await respond(msg, json.dumps({"ok": False, "error": f"bad request: {exc}"}).encode())
            return
        run = self.book.runs.get(job_id)
        if not self.held or run is None or run.attempt != attempt:
            return  # not this instance's run (or not a live one): the store tells the asker
        moved: list[bool] = []

        async def move() -> None:
            moved.clear()
            result = Applied()
            current = self.book.runs.get(job_id)
            if current is None or current.attempt != attempt:
                return
            async with self._tx() as conn:
                await self._give_up(
                    conn,
                    current,
                    "migrated",
                    reason,
                    avoid=avoid,
                    result=result,
                    resume_step=resume_step,
                    from_cluster=from_cluster,
                )
                await repo.append_events(conn, result.events)
                await outbox.add(conn, PRODUCER, result.messages)
            self._commit(result, [])
            self._send(result.messages)
            moved.append(bool(result.requeued))
            if result.requeued:
                self.capacity_changed = True
                self.wake.set()

        try:
            async with self.lock:
                await self._drain()
                await self._retrying(move)
        except Exception as exc:
            await respond(msg, json.dumps({"ok": False, "error": repr(exc)}).encode())
            return
        self.stats["migrated"] = self.stats.get("migrated", 0) + sum(moved)
        await respond(msg, json.dumps({"ok": True, "requeued": bool(moved and moved[0])}).encode())

    async def on_whatif(self, msg: Msg) -> None:
        """``loom.placement.whatif``: where the framework would place a running job now, as a new
        placement with its own run's GPUs counted free (the migration service's candidate), and its
        current placement's predicted step under the links known now. No side effects: the
        snapshot gets the run's GPUs back only for the question. Only the instance holding the run
        answers."""
        try:
            request = json.loads(msg.data or b"{}")
            job_id = str(request["job_id"])
            avoid = [str(c) for c in request.get("avoid", [])]
        except (ValueError, KeyError, TypeError) as exc:
            await respond(msg, json.dumps({"ok": False, "error": f"bad request: {exc}"}).encode())
            return
        run = self.book.runs.get(job_id)
        if not self.held or run is None:
            return  # not this instance's run
        spent = 0.0
        try:
            async with self.lock:
                t = time.perf_counter()
                reply = self._whatif(run, avoid)
                spent = time.perf_counter() - t
        except Exception as exc:  # any question gets an answer, never a crash
            reply = {"ok": False, "error": repr(exc)}
        await respond(msg, json.dumps(reply).encode())
        # Paced: what-ifs come one at a time (one subscription) and a review asks them back to
        # back, each a framework run in this event loop; without a pause they took most of it and
        # every await of a submission's path waited behind one (p50 placement latency 17 -> 100 ms
        # under four reviews, `python -m loom_benchmarks.whatif_load`).
        await asyncio.sleep(spent * (1.0 / WHATIF_SHARE - 1.0))

    def _whatif(self, run: Run, avoid: Sequence[str]) -> dict[str, Any]:
        snap = self.book.snapshot(time.time())
        spec = _spec_of(run.job)
        per_worker = max(spec.resources.gpus, 1)
        allocations = [a for _, _, allocs in run.parts for a in allocs]
        running = snap.running
        snap.give_back(allocations, per_worker)
        snap.running = [r for r in running if r.job_id != spec.job_id]
        try:
            # What a move's next attempt avoids: the clusters asked, no more
            # (loom.sched.cycle.requeue_avoid), so the verdict names where the move goes.
            outcome = self.framework.schedule(spec, snap, avoid_clusters=avoid, apply=False)
            regions = [
                snap.clusters[snap.cluster_index[c]].region
                for c, _, _ in run.parts
                if c in snap.cluster_index
            ]
            speeds = [
                snap.job_gpu_speed(spec, model) * float(snap.trust[snap.cluster_index[c]])
                for c, model, _ in run.parts
                if c in snap.cluster_index
            ]
            here = predict_step_s(
                spec, speeds=speeds, regions=regions, net=snap.net, workers=run.workers
            ).step_s
            if spec.pipeline is not None:
                # A pipeline's step is its slowest stage or hop, as its candidates are timed (timed
                # as one data-parallel gang it was 60x too slow here, so every move looked a gain).
                # Its own GPUs were given back above: the planner gets exactly those.
                here = self.framework.pipeline_step_now(spec, run.parts, snap) or run.predicted_step_s or here
            # An inference step waits for its users (as the simulator times it, and the jct plugin
            # scores it): a degraded link to them slows it here, and a candidate near them gains.
            here += users_wait_s(spec, regions[0], snap.net) if regions else 0.0
        finally:
            snap.running = running
            snap.take(allocations, per_worker)
        current = {
            "clusters": [c for c, _, _ in run.parts],
            "regions": regions,
            "attempt": run.attempt,
            "step_s": here,
            "placed_step_s": run.predicted_step_s,
        }
        d = outcome.decision
        if d is not None and (d.victims or d.shrunk):
            self.book.invalidate()  # a post-filter gave others' GPUs back: rebuild, keep nothing of it
            d = None  # a move that needs preemption is no candidate for a voluntary migration
        if d is None:
            return {"ok": True, "current": current, "candidate": None, "why": outcome.status.reason}
        lead = d.lead.cluster
        lead_region = snap.clusters[snap.cluster_index[lead]].region
        there = d.predicted_step_s
        candidate = {
            "cluster": lead,
            "region": lead_region,
            "clusters": [p.cluster for p in d.parts],
            "step_s": there + users_wait_s(spec, lead_region, snap.net) if there is not None else None,
            "start_after_s": d.start_after_s,
            # The queue the move would deprive (the benefit rule's queue's loss), by the rule the
            # simulator's migrator applies to its own queue.
            "queued": options_to_wire(queued_for_part(snap, spec.job_id, d.lead)),
        }
        return {"ok": True, "current": current, "candidate": candidate}

    def _send(self, messages: list[outbox.OutboxMessage], on_sent: Callable[[], None] | None = None) -> None:
        """Publish a committed cycle's messages in the background (the outbox has them anyway);
        ``on_sent`` is called once they are handed to NATS (before their acks)."""
        if not messages:
            return
        task = asyncio.create_task(self._publish(messages, on_sent))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _publish(
        self, messages: list[outbox.OutboxMessage], on_sent: Callable[[], None] | None = None
    ) -> int:
        t = time.perf_counter()
        sent = await self.relay.publish_now(messages, on_sent=on_sent)
        self.phases.since("publish", t)
        return sent

    async def _retrying(
        self, cycle: Callable[[], Awaitable[None]], attempts: int = 3, *, locked: bool = True
    ) -> None:
        """Run a decision cycle; when it lost a race for capacity, reload the book and decide again.

        ``locked``: the caller holds the lock with no batch writing (requeue, expiry); a submission
        batch takes the lock itself, so its reload takes it and waits for the batches still writing.
        """
        for attempt in range(1, attempts + 1):
            try:
                await cycle()
                return
            except ConflictError:
                self.book.invalidate()
                self.stats["conflicts"] = self.stats.get("conflicts", 0) + 1
                log.info("decision lost a race for capacity; deciding again on a fresh book", attempt=attempt)
                if locked:
                    await self._reload_nodes()
                else:
                    async with self.lock:
                        await self._drain()
                        await self._reload_nodes()
                if attempt == attempts:
                    raise
            except BaseException:
                # Whatever the cycle took in the kept snapshot was not committed (the placements
                # of batches still writing before it stay pending, and so do those of a cycle that
                # holds the lock now: a submission batch fails before it takes it, too).
                if not self._batches and (locked or not self.lock.locked()):
                    self.book.forget_pending(list(self.book.pending))
                self.book.invalidate()
                raise

    async def _reload_nodes(self) -> None:
        """The capacity book from the store, with the runs' CPU, RAM and usage applied on top
        (with no batch writing: what is pending then is what failed cycles placed)."""
        self.book.forget_pending(list(self.book.pending))
        fresh = self._owned_nodes(await repo.load_nodes(self.pool))
        runs = list(self.book.runs.values())
        self.book.nodes = fresh
        self.book.clear_runs()
        for run in runs:
            self.book.add_run(run, from_store=True)

    # ---- capacity ------------------------------------------------------------------------------

    async def on_view_delta(self, d: Delivery[ViewDelta]) -> None:
        """Follow the ledger: node totals, models and whether a node takes new work."""
        delta = d.message
        self.region_of[delta.cluster] = delta.region
        if delta.trust is not None:
            if self.book.trust.get(delta.cluster) != delta.trust:
                self.book.invalidate()
            self.book.trust[delta.cluster] = delta.trust
            self.stats["trust"] = dict(sorted(self.book.trust.items()))
        if not self._owns_region(delta.region):
            return  # another shard's cluster: its holder follows it
        self.failover.follow(delta)
        nodes = self.book.nodes
        if not any(c.cluster == delta.cluster for c in nodes.values()):
            self.settled_at = time.monotonic() + self.settle_s
        changed = view_changes(nodes, delta)
        if not changed:
            await self._nodes_lost(delta)  # a closed node (drained) may still fail under its runs
            return
        async with self._tx() as conn:
            if not self._owns_region(delta.region):
                return  # handed back meanwhile: its shard follows it
            await repo.upsert_nodes(conn, delta.version, changed)
        # Totals and schedulability come from the view; reservations are placement's, taken as
        # they are at this moment (no await below), so a cycle committed meanwhile is kept.
        self.book.invalidate()
        for cap in changed:
            current = self.book.nodes.get(cap.node)
            self.book.nodes[cap.node] = dataclasses.replace(
                cap,
                gpus_reserved=current.gpus_reserved if current else 0,
                cpu_reserved=current.cpu_reserved if current else 0,
                memory_reserved=current.memory_reserved if current else 0,
            )
        closed = sum(1 for c in self.book.nodes.values() if c.cluster == delta.cluster and not c.schedulable)
        self.stats.setdefault("unschedulable_nodes", {})[delta.cluster] = closed
        self.capacity_changed = True
        self.wake.set()
        await self._nodes_lost(delta)

    async def _nodes_lost(self, delta: ViewDelta) -> None:
        """Nodes the delta reports down, or dropped from a cluster that still heartbeats, lose
        the runs on them: each is given up like a failed-over cluster's run (next attempt, the old
        one fenced and stopped, resumed from its best checkpoint, placed again by the cycles)."""
        if delta.stale:
            return  # the whole cluster is silent: the failover path decides (heartbeats and probes)
        lost = {n.node: "reported down by its agent" for n in delta.nodes if n.down}
        lost.update(dict.fromkeys(delta.removed, "dropped from its cluster's inventory"))
        if not lost:
            return
        nodes_of = {
            job_id: [node for _, _, allocs in run.parts for node, _ in allocs]
            for job_id, run in self.book.runs.items()
        }
        hit = runs_on_nodes(nodes_of, lost)
        if not hit:
            return
        self.stats["nodes"]["lost"].update({node: lost[node] for node in set(hit.values())})
        async with self.lock:
            await self._drain()
            await self._retrying(functools.partial(self._fail_nodes, hit, lost, delta.cluster))

    async def _fail_nodes(self, hit: Mapping[str, str], why: Mapping[str, str], cluster: str) -> None:
        """Give up each run of ``hit`` (job -> its failed node), as :meth:`_fail_over` does for a
        cluster. Idempotent: a run already given up is no longer in the book, or another attempt."""
        result = Applied()
        lost = {j: self.book.runs[j] for j in hit if j in self.book.runs}
        async with self._tx() as conn:
            recorded = await moves.checkpoints_of(conn, sorted(lost))
            for job_id, run in sorted(lost.items()):
                node = hit[job_id]
                resume = _resume_of(run, recorded.get(job_id, []))
                await self._give_up(
                    conn,
                    run,
                    "node_lost",
                    f"node {node} of {cluster} failed ({why[node]}); {resume.why}",
                    avoid=[],
                    result=result,
                    resume_step=resume.step,
                    from_cluster=cluster,
                )
            await repo.append_events(conn, result.events)
            await outbox.add(conn, PRODUCER, result.messages)
        self._commit(result, [])
        self._send(result.messages)
        self.stats["nodes"]["requeued"] += len(result.requeued)
        if result.requeued:
            log.warning("runs lost with their node", runs=len(result.requeued), cluster=cluster)
            self.capacity_changed = True
            self.wake.set()

    async def _watch_pace(self, events: Sequence[LifecycleEvent]) -> None:
        """Progress reports with an observed step feed :class:`Pace`; a run delivering under half
        its predicted step rate over the window makes its nodes suspect (no new placements there
        for a while) and is reported once per attempt on ``loom.placement.slow`` for the
        migration service to decide, with the benefit rule, whether it moves."""
        now = time.time()
        for e in events:
            if not isinstance(e, JobProgress) or e.observed_step_s is None:
                continue
            run = self.book.runs.get(e.job_id)
            if run is None or run.attempt != e.attempt:
                continue
            self.failover.nodes.pace.record(e.job_id, e.attempt, e.at, e.observed_step_s)
            if (e.job_id, e.attempt) in self.failover.nodes.told:
                continue
            # A run with fewer workers than asked runs slower by that share, as expected.
            scale = max(run.job.workers, 1) / max(run.workers, 1) if run.job.pipeline is None else 1.0
            predicted = run.predicted_step_s * scale if run.predicted_step_s else None
            slow = self.failover.nodes.pace.slow(e.job_id, e.attempt, predicted, now)
            if slow is None:
                continue
            self.failover.nodes.told.add((e.job_id, e.attempt))
            nodes = sorted({node for _, _, allocs in run.parts for node, _ in allocs})
            self.failover.nodes.suspects.mark(
                nodes, now + self.failover.nodes.pace.settings.suspect_s, f"{e.job_id}: {slow.reason}"
            )
            if self.book.suspect(self.failover.nodes.suspects.active(now)):
                self.capacity_changed = True
                self.wake.set()
            self.stats["nodes"]["slow"] += 1
            self.stats["nodes"]["suspect"] = dict(self.failover.nodes.suspects.why)
            log.warning("slow run", job_id=e.job_id, attempt=e.attempt, nodes=nodes, reason=slow.reason)
            report = SlowRun(
                job_id=e.job_id,
                attempt=e.attempt,
                observed_step_s=slow.observed_step_s,
                predicted_step_s=slow.predicted_step_s or None,
                nodes=nodes,
                reason=slow.reason[:512],
                tenant=run.job.tenant,
                cluster=run.parts[0][0] if run.parts else None,
                at=now,
            )
            with contextlib.suppress(Exception):  # a lost report: the nodes are suspect anyway
                await self.ctx.nc.publish(subjects.PLACEMENT_SLOW, msgspec.json.encode(report))

    async def on_link(self, msg: Msg) -> None:
        """A link-state event from network perception: the network every cycle scores with."""
        try:
            link = decode(msg.data, LinkState)
        except DecodeError as exc:
            log.warning("bad link state ignored", subject=msg.subject, error=str(exc))
            return
        before = (
            self.book.link_degraded(link.src, link.dst),
            self.failover.link_down.get((link.src, link.dst)),
        )
        self.book.on_link(link)
        self.failover.link_down[(link.src, link.dst)] = link_unreachable(
            stale=link.stale, loss_rate=link.loss_rate, lost_run=link.lost_run
        )
        after = (self.book.link_degraded(link.src, link.dst), self.failover.link_down[(link.src, link.dst)])
        if after != before:
            # A link degraded, recovered, lost or found: every waiting job is decided again, as the
            # simulator does at a link's change (each window's small moves of the figures do not).
            self.capacity_changed = True
        self.stats["links"] = self.stats.get("links", 0) + 1

    # ---- lifecycle -----------------------------------------------------------------------------

    # Every lifecycle kind's write in one transaction; split, the transaction would be spread thin.
    async def on_lifecycle(self, deliveries: list[Delivery[bytes]]) -> Sequence[BaseException | None]:
        """Record what agents report and clients cancel; a finished run gives its GPUs back; a
        retryable failure is re-placed. Two consumers feed it (runs' events on JOBS, cancellations
        on REQUESTS): their batches are handled one at a time, as one consumer's were."""
        if deliveries and all(d.subject.startswith(CANCELLED_PREFIX) for d in deliveries):
            await self._runs_caught_up()
        async with self._lifecycle_lock:
            return await self._on_lifecycle(deliveries)

    async def _runs_caught_up(self) -> None:
        """Before a batch of cancellations: wait (at most :data:`CANCEL_WAIT_S`) until the runs'
        events stored before it are handled. From another stream, a cancellation could otherwise be
        handled before a completion reported earlier, and a job that completed be recorded as
        cancelled (one stream kept them in order before the REQUESTS stream)."""
        durable = self._durable("placement-lifecycle", self.shard)
        await caught_up(self.ctx.nc.jetstream(), "JOBS", durable, within_s=CANCEL_WAIT_S)

    async def _on_lifecycle(  # noqa: PLR0915
        self, deliveries: list[Delivery[bytes]]
    ) -> Sequence[BaseException | None]:
        outcomes: list[BaseException | None] = [None] * len(deliveries)
        events: list[tuple[LifecycleEvent, str]] = []
        index_of: dict[str, int] = {}
        refused: dict[str, str] = {}
        """Reports refused (message id -> why): dead-lettered once the rest commits."""
        ignored: dict[str, str] = {}
        """Late checkpoints of runs that ended (message id -> why): acknowledged, not recorded."""
        reporter_at: dict[int, str] = {}
        """Position in ``events`` of a report -> the reporting cluster its subject names: judged
        per delivery (a forged report shares its claim id with the genuine one it copies)."""
        delivery_of: list[int] = []
        """Position in ``events`` -> the delivery's index."""
        foreign_at: dict[int, str] = {}
        """Reports of another cluster's run (position in ``events`` -> why): dead-lettered."""
        for i, d in enumerate(deliveries):
            try:
                event: LifecycleEvent = decode(d.message, LifecycleEvent)  # type: ignore[arg-type]
            except DecodeError as exc:
                outcomes[i] = InvalidInputError(f"lifecycle event on {d.subject}: {exc}")
                continue
            if not self._handles(event):
                self.stats["shard"]["foreign_events"] += 1
                continue  # acked: the holder of the event's cluster records it (or refuses it)
            reporter = subjects.report_cluster(d.subject)
            why = foreign_report(reporter, getattr(event, "cluster", None))
            if isinstance(event, JobCancelled):
                event, refusal = received_cancellation(d.subject, event, stored_at(d))
                why = why or refusal
            if why is not None:
                log.warning("report refused", subject=d.subject, job_id=event.job_id, reason=why)
                outcomes[i] = InvalidInputError(why)
                continue
            mid = _lifecycle_claim_id(d, event, reporter)
            if reporter is not None:
                reporter_at[len(events)] = reporter
                event = bounded(event, stored_at(d))  # as metering counts it
            delivery_of.append(i)
            events.append((event, mid))
        if not events:
            return outcomes

        async def apply() -> None:  # noqa: PLR0912, PLR0915
            result = Applied()
            finished: list[tuple[str, int]] = []
            async with self._tx() as conn:
                # Again here: a territory handed back meanwhile is not written for (its shard has
                # these events in its own consumer).
                handled = [p for p, (e, _) in enumerate(events) if self._handles(e)]
                foreign_at.clear()
                foreign_at.update(
                    await _foreign_reports(
                        conn, [(p, events[p][0], reporter_at[p]) for p in handled if p in reporter_at]
                    )
                )
                kept = [p for p in handled if p not in foreign_at]
                index_of.clear()
                index_of.update({events[p][1]: delivery_of[p] for p in kept})
                mine = [events[p] for p in kept]
                refused.clear()
                refused.update(await _foreign_cancels(conn, mine))
                mine = [(e, mid) for e, mid in mine if mid not in refused]
                checkpoints, late = await _refused_checkpoints(conn, mine)
                late.update(await _late_cancels(conn, [(e, mid) for e, mid in mine if mid not in refused]))
                refused.update(checkpoints)
                mine = [(e, mid) for e, mid in mine if mid not in refused and mid not in late]
                ignored.clear()
                ignored.update(late)
                fresh = await repo.append_events(
                    conn,
                    [repo.JobEventRow(e.job_id, _kind(e), mid, encode(e), _at(e)) for e, mid in mine],
                )
                new = [e for e, mid in mine if mid in fresh]
                await moves.record_checkpoints(conn, _checkpoint_rows(new))
                await repo.confirm(conn, [(e.job_id, e.attempt) for e in new if isinstance(e, JobStarted)])
                reports = [e for e in new if isinstance(e, JobProgress)]
                # A checkpoint at a step is progress too (agents report progress every tenth of a
                # run, checkpoints often come between: the jobs list lagged the checkpoints).
                await repo.set_progress(
                    conn,
                    [(r.job_id, r.attempt, r.step / r.steps) for r in reports]
                    + [
                        (e.job_id, e.attempt, e.step / run.job.work.steps)
                        for e in new
                        if isinstance(e, JobCheckpointed)
                        and (run := self.book.runs.get(e.job_id)) is not None
                        and run.attempt == e.attempt
                        and run.job.work.steps > 0
                    ],
                )
                for run_key, observation in self._progress_observations(new):
                    result.observed.append(observation)
                    result.taught.append(run_key)
                for e in new:
                    if isinstance(e, JobCancelled):
                        await self._cancel(conn, e.job_id, e.reason or "cancelled", result, finished)
                for e in new:
                    if not isinstance(e, JobCompleted | JobFailed):
                        continue
                    run = self.book.runs.get(e.job_id)
                    if (
                        isinstance(e, JobFailed)
                        and run is not None
                        and retry_after_failure(
                            retryable=e.retryable,
                            attempt=e.attempt,
                            current_attempt=run.attempt,
                            max_attempts=self.max_attempts,
                        )
                    ):
                        await self._give_up(
                            conn, run, "start_failed", e.reason, avoid=[e.cluster], result=result
                        )
                        continue
                    state = "completed" if isinstance(e, JobCompleted) else "failed"
                    reason = e.reason if isinstance(e, JobFailed) else None
                    if isinstance(e, JobCompleted) and run is not None and run.attempt == e.attempt:
                        result.learned.append((run, e))
                        seen = self._speed_observation(run, e.observed_step_s)
                        if seen is not None:
                            result.observed.append(seen)
                    moved = await repo.finish(conn, e.job_id, e.attempt, state, reason)
                    waiting = self.queue.get(e.job_id)
                    if moved and waiting is not None and waiting.attempt == e.attempt + 1:
                        # It completed after being given up: done, not to be placed again.
                        result.vanished.append(e.job_id)
                    released = await repo.release(conn, e.job_id, e.attempt)
                    if run is not None and run.attempt == e.attempt:
                        # Member parts on other clusters hold their GPUs until told to stop.
                        for cluster, _, _ in run.parts[1:]:
                            stop = StopJob(job_id=e.job_id, attempt=e.attempt, reason=f"the job {state}")
                            result.messages.append(
                                outbox.message(
                                    subjects.cluster_command(cluster, "stop"),
                                    stop,
                                    f"{e.job_id}:stop:{e.attempt}:{cluster}",
                                    context=run.queued.context,
                                )
                            )
                    if released or run is not None:
                        finished.append((e.job_id, e.attempt))
                    parent = run.queued.parent if run is not None else await _parent_of(conn, e.job_id)
                    if parent:
                        result.messages.extend(await self._settle_dag(conn, parent, result))
                result.observed = await speeds.record(conn, result.observed)
                await repo.append_events(conn, result.events)
                await outbox.add(conn, PRODUCER, result.messages)
            # Committed: adopt it (no await below).
            # In stream order: a start, then its reports (the book keeps only its run's attempt and
            # a report beyond the last, so a late or earlier attempt's report changes nothing).
            now = time.time()
            for e in new:
                if isinstance(e, JobStarted):
                    self.book.set_began(e.job_id, e.attempt, e.started_at)
                elif isinstance(e, JobProgress):
                    self.book.set_progress(e.job_id, e.step / e.steps, attempt=e.attempt, now=now, at=e.at)
            for job_id, attempt in finished:
                if self.book.drop_run(job_id, attempt) is not None:
                    self.stats["released"] += 1
            self._commit(result, [])
            self._send(result.messages)
            if finished:
                self.capacity_changed = True
                self.wake.set()

        try:
            await with_retry(apply)
        except Exception as exc:
            return [o if o is not None else exc for o in outcomes]
        # Only what was recorded: a forged report of another cluster's run (refused) marked that
        # run's nodes suspect and its run slow.
        await self._watch_pace(
            [e for p, (e, mid) in enumerate(events) if p not in foreign_at and mid not in refused]
        )
        for position, why in foreign_at.items():
            log.warning("report refused", msg_id=events[position][1], reason=why)
            outcomes[delivery_of[position]] = InvalidInputError(why)
        for mid, why in refused.items():
            log.warning("report refused", msg_id=mid, reason=why)
            outcomes[index_of[mid]] = InvalidInputError(why)
        for mid, why in ignored.items():
            log.info("late checkpoint ignored", msg_id=mid, reason=why)
        self.stats["late_checkpoints"] = self.stats.get("late_checkpoints", 0) + len(ignored)
        return outcomes

    async def _cancel(
        self,
        conn: asyncpg.Connection,
        job_id: str,
        reason: str,
        result: "Applied",
        finished: list[tuple[str, int]],
        *,
        settle: bool = True,
    ) -> None:
        """End a job on a ``cancelled`` event: a queued job leaves the queue; a running one is told
        to stop on every cluster it runs on (its attempt fenced) and gives its GPUs back; a DAG's
        unfinished stages are cancelled with it. A finished job stays as it ended. A DAG stage
        cancelled on its own settles its DAG (``settle``; not when its DAG's cancellation cascades):
        before, a queued stage cancelled so left its DAG "running" for ever."""
        run = self.book.runs.get(job_id)
        parent = run.queued.parent if run is not None else None
        ended = False
        if run is not None:
            if ended := await repo.finish(conn, job_id, run.attempt, "cancelled", reason):
                await repo.release(conn, job_id, run.attempt)
                for cluster in dict.fromkeys(part[0] for part in run.parts):
                    stop = StopJob(job_id=job_id, attempt=run.attempt, reason=f"cancelled: {reason}"[:1024])
                    result.messages.append(
                        outbox.message(
                            subjects.cluster_command(cluster, "stop"),
                            stop,
                            f"{job_id}:stop:{run.attempt}:{cluster}",
                            context=run.queued.context,
                        )
                    )
                finished.append((job_id, run.attempt))
        elif await repo.set_state(conn, [job_id], "cancelled", ["queued", "waiting"], reason):
            ended = True
            result.vanished.append(job_id)
        kids = await repo.children(conn, job_id)
        for kid in kids:
            if kid["state"] not in TERMINAL_STATES:
                why = f"the DAG {job_id} was cancelled"
                await self._cancel(conn, kid["job_id"], why, result, finished, settle=False)
        if kids:  # a DAG is "running" while its stages run, with no run of its own
            await repo.set_state(conn, [job_id], "cancelled", ["running"], reason)
        if settle and ended:
            parent = parent or await _parent_of(conn, job_id)
            if parent:
                result.messages.extend(await self._settle_dag(conn, parent, result))

    def _progress_observations(
        self, events: Sequence[LifecycleEvent]
    ) -> list[tuple[tuple[str, int], speeds.SpeedObservation]]:
        """What running work says of its families' speeds: the first progress report of a run that
        carries its measured compute step (``JobProgress.compute_step_s``) teaches, as its completion
        would have; the store keeps one observation per run (:func:`speeds.run_event_id`). Each with
        its run (job, attempt), marked as taught once the batch commits."""
        out: list[tuple[tuple[str, int], speeds.SpeedObservation]] = []
        for e in events:
            if not isinstance(e, JobProgress) or e.compute_step_s is None:
                continue
            run = self.book.runs.get(e.job_id)
            if run is None or run.attempt != e.attempt or run.taught:
                continue
            observation = self._speed_observation(run, e.compute_step_s)
            if observation is None:
                continue
            if teaches_while_running(e.compute_step_s, run.predicted_step_s):
                out.append(((e.job_id, e.attempt), observation))
                continue
            # As slow as the slow-node rule flags: held until runs on other nodes of the model
            # agree (then it is the model, taught now), else its completion teaches.
            cell, node = (observation.family, observation.gpu_model), run.parts[0][2][0][0]
            released = self.held_lessons.hold(
                cell, node, (e.job_id, e.attempt), observation, live=self._run_live
            )
            taught = {k for k, _ in out}  # another report of this batch may have released them already
            out += [(k, held) for k, held in released if k not in taught]
        return out

    def _run_live(self, key: tuple[str, int]) -> bool:
        """Whether ``(job id, attempt)`` is a run the book holds now, not taught yet (a taught
        run's lesson was measured against the old belief: it agrees with nothing new)."""
        run = self.book.runs.get(key[0])
        return run is not None and run.attempt == key[1] and not run.taught

    def _speed_observation(self, run: Run, observed_step_s: float | None) -> speeds.SpeedObservation | None:
        """What a run that measured ``observed_step_s`` (compute seconds per step) says of its
        family's speed on its GPU model, or None (the rule is :func:`loom.model.learn.run_speed`'s,
        the simulator's too). Keyed by the run, so its progress and its completion teach once."""
        job = run.job
        seen = run_speed(
            job,
            [model for _, model, _ in run.parts],
            observed_step_s,
            pipeline=job.pipeline is not None,
            prior_speed=self.book.speed,
        )
        if seen is None:
            return None
        return speeds.SpeedObservation(
            event_id=speeds.run_event_id(job.job_id, run.attempt),
            job_id=job.job_id,
            family=seen.family,
            gpu_model=seen.gpu_model,
            prior_speed=seen.prior_speed,
            observed_speed=seen.observed_speed,
        )

    def _adopt_learned(self) -> None:
        """Give the book (and so every cycle's snapshot) the learner's current factors."""
        self.book.set_learned(self.learner.factors(), self.learner.steady_cells())
        self.stats["learned_speeds"] = {
            f"{e.family}@{e.gpu_model}": {
                "factor": round(e.factor, 4),
                "log_sd": round(e.log_sd, 4),
                "runs": e.runs,
            }
            for e in self.learner.estimates()
        }

    def _speed_note(self, job: JobSubmitted, gpu_model: str, snap: Snapshot) -> str:
        """The speed factor this decision used for the job on its chosen model, for ``loom explain``."""
        family = job_family(job)
        estimate = self.learner.estimate(family, gpu_model)
        used = snap.learned.get((family, gpu_model), 1.0)
        risk = ""
        if snap.risk is not None and snap.job_at_risk(job):
            risk = (
                f"; a job of {snap.risk[0]:g}+ GPU-hours: GPU models its family has no steady runs on"
                f" counted at x{snap.risk[1]:g} in the choice"
                + (" (this one among them)" if (family, gpu_model) not in snap.measured else "")
            )
        if estimate.source == "prior" and used == 1.0:
            return f"speed of family {family} on {gpu_model}: the profile's (nothing learned yet){risk}"
        text = (
            f"speed of family {family} on {gpu_model}: x{used:.3g} the profile's"
            f" (learned x{estimate.factor:.3g} ±{estimate.log_sd:.0%},"
            f" {estimate.runs} run(s), {estimate.source})"
        )
        if abs(used - estimate.factor) > 1e-9 * max(used, 1.0):
            text += "; explored: offered optimistically while uncertain"
        return text + risk

    def _learn_alpha(self, run: Run, done: JobCompleted) -> None:
        """Teach the joint score how much of this task type's step time is compute."""
        job = run.job
        cluster, model, allocs = run.parts[0]
        lead_gpus = sum(g for _, g in allocs)
        if not done.gpu_seconds or not lead_gpus or run.queued.attempt != run.attempt:
            return
        steps = job.work.steps
        if run.attempt > 1:
            return  # a resumed run's time covers only part of the steps; skip rather than guess
        observed = done.gpu_seconds / lead_gpus / steps
        speed = self.book.speed(model, job.task_type) * self.book.trust.get(cluster, 1.0)
        self.alpha.observe(job.task_type, job.work.step_time_s / max(speed, 1e-9), observed)
        self.stats["alpha"] = {t: round(self.alpha.alpha(t), 3) for t in sorted(self.alpha.as_dict())}

    async def _settle_dag(
        self, conn: asyncpg.Connection, parent: str, result: "Applied"
    ) -> list[outbox.OutboxMessage]:
        """Move a DAG forward after one of its stages ended: queue stages now ready, finish the DAG."""
        row = await repo.job_row(conn, parent)
        if row is None or row["state"] != "running":
            return []
        spec = msgspec.json.decode(row["spec"], type=JobSubmitted)
        kids = await repo.children(conn, parent)
        by_stage = {}
        for kid in kids:
            child = msgspec.json.decode(kid["spec"], type=JobSubmitted)
            by_stage[child.labels.get(dag.STAGE_LABEL, kid["job_id"])] = (kid, child)
        states = {stage: kid["state"] for stage, (kid, _) in by_stage.items()}
        # Jobs that ended in this very transaction show in the rows read (same transaction).
        step = dag.advance(spec.stages, states)
        carrier = json.loads(row["trace_context"])
        # The DAG's own events continue the DAG's trace, whatever trace settled it (a cycle's).
        context = propagate.extract(carrier)
        now = time.time()
        messages: list[outbox.OutboxMessage] = []
        if step.failed_stage is not None:
            bad = step.failed_stage
            await repo.set_state(
                conn,
                [by_stage[s][0]["job_id"] for s in step.cancel],
                "cancelled",
                ["waiting", "queued"],
                f"stage {bad} of {parent} did not complete",
            )
            result.vanished += [by_stage[s][0]["job_id"] for s in step.cancel]
            reason = f"stage {bad} ended {states[bad]}"
            await repo.set_state(conn, [parent], "failed", ["running"], reason)
            event = JobFailed(
                job_id=parent,
                tenant=spec.tenant,
                cluster=by_stage[bad][0]["cluster"] or "none",
                reason=reason,
                at=now,
            )
            msg_id = f"{parent}:failed:1"
            messages.append(
                outbox.message(subjects.job_event("failed", spec.tenant), event, msg_id, context=context)
            )
            result.events.append(repo.JobEventRow(parent, "failed", msg_id, encode(event), now))
            return messages
        if step.completed:
            await repo.set_state(conn, [parent], "completed", ["running"])
            last = max(by_stage.values(), key=lambda kc: kc[0]["job_id"])[0]
            event_c = JobCompleted(
                job_id=parent, tenant=spec.tenant, cluster=last["cluster"] or "none", at=now
            )
            msg_id = f"{parent}:completed:1"
            messages.append(
                outbox.message(subjects.job_event("completed", spec.tenant), event_c, msg_id, context=context)
            )
            result.events.append(repo.JobEventRow(parent, "completed", msg_id, encode(event_c), now))
            return messages
        moved = await repo.set_state(
            conn, [by_stage[s][0]["job_id"] for s in step.ready], "queued", ["waiting"]
        )
        for s in step.ready:
            kid, child = by_stage[s]
            if kid["job_id"] in moved:
                result.released_children.append(QueuedJob(child, carrier, parent=parent))
        return messages

    # ---- queries -------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _reader(self, tenant: str | None) -> AsyncIterator[asyncpg.Pool | asyncpg.Connection]:
        """The pool, or for a tenant a transaction under row-level security as that tenant."""
        if tenant is None:
            yield self.pool
            return
        async with tenant_scope(self.pool, tenant) as conn:
            yield conn

    @staticmethod
    async def _tenant_query(
        db: asyncpg.Pool | asyncpg.Connection, op: str, request: dict[str, Any]
    ) -> object:
        """The job queries: get, list, counts, explain."""
        if op == "get":
            return await repo.get_job(db, str(request["job_id"]))
        if op == "list":
            return await repo.list_jobs(
                db,
                tenant=request.get("tenant"),
                state=request.get("state"),
                limit=int(request.get("limit", 100)),
            )
        if op == "counts":
            return await repo.count_by_state(db)
        job_id = str(request["job_id"])
        return {"job": await repo.get_job(db, job_id), "decisions": await repo.decisions_of(db, job_id)}

    async def on_query(self, msg: Msg) -> None:
        """``loom.jobs.query``: get, list, counts, or explain (every decision record of a job).

        On ``loom.jobs.query.<tenant>`` (the only one a tenant's credentials reach) the answer
        holds that tenant's jobs only: another tenant's job is not found, counts are refused."""
        if not answerable(msg):  # a reply that is no inbox: dropped (loom.bus.reply)
            return
        scope = (
            msg.subject.removeprefix(f"{subjects.JOBS_QUERY}.")
            if msg.subject != subjects.JOBS_QUERY
            else None
        )
        try:
            request = _query_request(msg.data or b"{}")
            op = request["op"]
            tenant = scope if scope is not None else request.get("tenant")
            if scope is not None and op not in ("get", "list", "explain"):
                raise ValueError(f"{op!r} is not open to a tenant")
            if scope is not None and request.get("tenant") not in (None, scope):
                # Another tenant's list asked on a tenant's subject: it answered with the asker's
                # own jobs (`loom jobs --tenant nobody` listed them all); now nothing, as for the
                # operator's list of a tenant without jobs.
                request = {**request, "limit": 0}
            if op in ("get", "list", "counts", "explain"):
                # For a tenant (its own query subject, or a request naming one): row-level
                # security shows that tenant's rows only, another tenant's job is not found.
                async with self._reader(None if tenant is None else str(tenant)) as db:
                    result: object = await self._tenant_query(db, op, {**request, "tenant": tenant})
            elif op == "learned":
                learner = await speeds.load_learner(self.pool, self.learner.settings)
                steady, spreads = learner.steady_cells(), learner.spreads()
                result = [
                    {
                        **msgspec.to_builtins(e),
                        # How far the family's runs on one model disagree, and whether comparative
                        # advantage acts on this cell's ratios (loom.sched.plugins.advantage).
                        "spread": spreads.get(e.family),
                        "steady": (e.family, e.gpu_model) in steady,
                    }
                    for e in learner.estimates()
                ]
            elif op == "leader":
                result = dataclasses.asdict(self.leadership)
            else:
                raise ValueError(f"unknown op {op!r}")
            reply = {"ok": True, "result": result}
        except Exception as exc:  # any bad request gets an answer, never a crash
            reply = {"ok": False, "error": str(exc)}
        await respond(msg, json.dumps(reply).encode())


QUERY_OPS = ("get", "list", "counts", "explain", "learned", "leader")
MAX_QUERY_LIMIT = 10_000


def _query_request(data: bytes) -> dict[str, Any]:
    """A job query's request, checked: ValueError says what is wrong in the asker's terms (they got
    Python's and PostgreSQL's own words: "'list' object has no attribute 'get'", "LIMIT must not be
    negative")."""
    try:
        request = json.loads(data)
    except ValueError as exc:
        raise ValueError(f'a query is a JSON object, e.g. {{"op": "get", "job_id": "j-1"}}: {exc}') from exc
    if not isinstance(request, dict):
        raise ValueError('a query is a JSON object, e.g. {"op": "get", "job_id": "j-1"}')
    op = request.setdefault("op", "list")
    if op not in QUERY_OPS:
        raise ValueError(f"unknown op {op!r}; one of {', '.join(QUERY_OPS)}")
    if op in ("get", "explain") and not isinstance(request.get("job_id"), str):
        raise ValueError(f"op {op!r} needs a job_id (a string)")
    for key in ("tenant", "state"):
        if request.get(key) is not None and not isinstance(request[key], str):
            raise ValueError(f"{key} must be a string")
    if request.get("state") is not None and request["state"] not in JOB_STATES:
        # It answered an empty list: as if no job were in that state.
        raise ValueError(f"unknown job state {request['state']!r}; one of {', '.join(JOB_STATES)}")
    limit = request.get("limit", 100)
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"limit must be a whole number of at least 1, got {limit!r}")
    request["limit"] = min(limit, MAX_QUERY_LIMIT)  # the newest that many, as before
    return request


@dataclasses.dataclass(frozen=True)
class PendingStart:
    """One part's start command, decided in a cycle and not yet sent (:func:`start_messages`)."""

    cluster: str
    command: StartJob
    msg_id: str
    """The id a lone start goes under (``<job>:start:<attempt>[:<cluster>]``)."""
    context: Context
    """The job's trace context."""


MAX_BATCH_BYTES = 128 * 1024
"""The most encoded start commands one :class:`StartJobs` carries, half the agents' decode limit
(``loom_proto.codec.MAX_PAYLOAD_BYTES``): the traces and the envelope fit in the rest."""

TRACE_KEYS = ("traceparent", "tracestate")


def batch_carrier(carrier: Mapping[str, str]) -> dict[str, str]:
    """A start's W3C trace context as a batch carries it: ``traceparent`` and ``tracestate`` only,
    each only within the contract's ``MAX_TRACE_VALUE_CHARS`` (a tenant's long ``tracestate`` is
    dropped here, so it can never make a batch, and the other tenants' starts in it, unreadable)."""
    return {k: v for k in TRACE_KEYS if (v := carrier.get(k)) is not None and len(v) <= MAX_TRACE_VALUE_CHARS}


def start_chunks(pending: Sequence[PendingStart]) -> list[list[PendingStart]]:
    """One cluster's starts of a cycle in order, cut into batches of at most
    ``MAX_STARTS_PER_MESSAGE`` starts and ``MAX_BATCH_BYTES`` of encoded commands; a start larger
    than that on its own is a chunk of one (it goes as a lone :class:`StartJob`)."""
    chunks: list[list[PendingStart]] = []
    current: list[PendingStart] = []
    size = 0
    for one in pending:
        n = len(msgspec.json.encode(one.command))
        if current and (len(current) >= MAX_STARTS_PER_MESSAGE or size + n > MAX_BATCH_BYTES):
            chunks.append(current)
            current, size = [], 0
        current.append(one)
        size += n
    if current:
        chunks.append(current)
    return chunks


def start_messages(starts: Sequence[PendingStart]) -> list[outbox.OutboxMessage]:
    """A cycle's start commands as outbox messages: a cluster's lone start as a :class:`StartJob`
    under its own id (as always); several as :class:`StartJobs` of at most
    ``MAX_STARTS_PER_MESSAGE`` starts and ``MAX_BATCH_BYTES`` each (:func:`start_chunks`; a start
    too large to share one goes alone), in decision order, under an id derived from the ids of the
    starts it carries (a cycle decided again after a rollback sends the same batch under the same
    id; any other batch carrying a start again is harmless: agents carry out a start once).

    Every start in a batch continues its own job's trace: a PRODUCER span of its own (named as
    the lone start's publish would be) is recorded in that trace, and its context travels in
    ``traces``. The batch message itself carries no job's trace."""
    by_cluster: dict[str, list[PendingStart]] = {}
    for start in starts:
        by_cluster.setdefault(start.cluster, []).append(start)
    messages = []
    for cluster, pending in by_cluster.items():
        subject = subjects.cluster_command(cluster, "starts")
        for chunk in start_chunks(pending):
            if len(chunk) == 1:
                one = chunk[0]
                messages.append(
                    outbox.message(
                        subjects.cluster_command(cluster, "start"),
                        one.command,
                        one.msg_id,
                        context=one.context,
                    )
                )
                continue
            traces = []
            for one in chunk:
                carrier: dict[str, str] = {}
                span = _tracer.start_span(
                    span_name("publish", subject),
                    context=one.context,
                    kind=SpanKind.PRODUCER,
                    attributes={
                        "messaging.system": "nats",
                        "messaging.operation.type": "publish",
                        "messaging.destination.name": subject,
                        "messaging.message.id": one.msg_id,
                    },
                )
                propagate.inject(carrier, context=trace.set_span_in_context(span, one.context))
                span.end()
                traces.append(batch_carrier(carrier))
            digest = hashlib.sha256("\n".join(one.msg_id for one in chunk).encode()).hexdigest()[:32]
            messages.append(
                outbox.message(
                    subject,
                    StartJobs(starts=[one.command for one in chunk], traces=traces),
                    f"{cluster}:starts:{digest}",
                    context=Context(),
                )
            )
    return messages


@dataclasses.dataclass
class Applied:
    """What one transaction wrote, to adopt in memory after it commits."""

    cycle: CycleResult[QueuedJob] = dataclasses.field(default_factory=CycleResult)
    """The decisions of the cycle this transaction applied (empty for lifecycle and expiry)."""
    requeued: list[tuple[Run, QueuedJob, RequeueReason]] = dataclasses.field(default_factory=list)
    released_children: list[QueuedJob] = dataclasses.field(default_factory=list)
    vanished: list[str] = dataclasses.field(default_factory=list)
    """Jobs that turned out not to be queued (or running) any more: dropped from the queue."""
    current: dict[str, tuple[tuple[str, int], ...]] = dataclasses.field(default_factory=dict)
    """Elastic runs' allocations as this transaction left them."""
    learned: list[tuple[Run, JobCompleted]] = dataclasses.field(default_factory=list)
    observed: list[speeds.SpeedObservation] = dataclasses.field(default_factory=list)
    """Speed observations recorded in this transaction (new ones only, after the write)."""
    taught: list[tuple[str, int]] = dataclasses.field(default_factory=list)
    """Runs (job, attempt) whose progress report offered their speed observation."""
    probes_asked: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    """(family, GPU model) cells whose speed probe this transaction inserted (or found asked)."""
    shrunk: list[tuple[str, list[tuple[str, str, tuple[tuple[str, int], ...]]], int]] = dataclasses.field(
        default_factory=list
    )
    grown: list[tuple[str, list[tuple[str, str, tuple[tuple[str, int], ...]]], int]] = dataclasses.field(
        default_factory=list
    )
    stale: bool = False
    """The cycle's snapshot took something the store refused (a run that ended): rebuild it."""
    at: float | None = None
    """The cycle's clock (wall seconds; resized runs' predicted ends are counted from it)."""
    runs: dict[str, Run] = dataclasses.field(default_factory=dict)
    """The runs the cycle placed, as the book adopts them (built and listed by ``_decide``)."""
    messages: list[outbox.OutboxMessage] = dataclasses.field(default_factory=list)
    events: list[repo.JobEventRow] = dataclasses.field(default_factory=list)

    @property
    def pipelinable(self) -> bool:
        """Whether the next batch may decide before this one commits: its cycle only placed,
        rejected or left waiting (preemption, shrinking and growth change running jobs, which the
        book adopts only on commit; a stale snapshot must be rebuilt first), and rejected no DAG
        stage (settling the DAG writes its other stages' rows, which the next batch may lock as
        due queued jobs and hold while it waits for this one to end)."""
        c = self.cycle
        return not (
            self.stale or c.preempted or c.shrunk or c.grown or any(r.pending.parent for r in c.rejected)
        )


@dataclasses.dataclass
class _Failover:
    """What placement knows of cluster failures (see :mod:`loom.migrate.health`)."""

    ttl_s: float
    """The heartbeat TTL the failure rule counts with: a stale view delta says it has passed."""
    period_s: float
    liveness_period_s: float = 1.0
    """How often placement pings each owned cluster's agent."""
    nodes: "_NodeWatch" = dataclasses.field(default_factory=lambda: _NodeWatch(Pace()))
    """Node scope: failed nodes' runs are given up; slow runs make their nodes suspect."""
    liveness: Liveness = dataclasses.field(default_factory=Liveness)
    """Runs of *no responders* to each owned cluster's agent ping (the fast agent signal)."""
    stale_since: dict[str, float] = dataclasses.field(default_factory=dict)
    """Owned clusters the view says are stale (heartbeats lost past their TTL): since when (wall s)."""
    link_down: dict[tuple[str, str], bool] = dataclasses.field(default_factory=dict)
    """(src, dst) region links: whether network perception says its probes do not get through."""
    failed: dict[str, Health] = dataclasses.field(default_factory=dict)
    """Clusters classified failed (heartbeats and probes both lost) until their heartbeats resume."""
    failed_at: dict[str, float] = dataclasses.field(default_factory=dict)
    """When each failed cluster was classified failed (wall s)."""
    drained: frozenset[str] = frozenset()
    """Clusters drained by ``loom drain`` (closed to new work, like failed ones)."""
    notices: HealthNotices = dataclasses.field(default_factory=HealthNotices)
    """What ``loom.placement.cluster_health`` has told of each cluster."""
    persisted: set[str] = dataclasses.field(default_factory=set)
    """Failed clusters recorded in the store for the next leader (:mod:`loom.store.failed`)."""

    def closed(self) -> frozenset[str]:
        """Clusters that take no new work: drained or failed."""
        return self.drained | frozenset(self.failed)

    def closed_why(self) -> dict[str, str]:
        """:meth:`closed` with why each takes no new work (what explanations name)."""
        return {**dict.fromkeys(self.drained, "drained"), **dict.fromkeys(self.failed, "failed")}

    def returned(self, answered_at: Mapping[str, float]) -> None:
        """A cluster failed on its agent's connection alone (the view never marked it stale) whose
        agent answers again has returned; one the view holds stale returns with its heartbeats."""
        for cluster in [c for c in self.failed if c not in self.stale_since]:
            if answered_at.get(cluster, 0.0) > self.failed_at.get(cluster, 0.0):
                del self.failed[cluster]
                self.failed_at.pop(cluster, None)
                log.warning("failed cluster returned", cluster=cluster)

    def restore(self, clusters: Sequence[LedgerCluster]) -> None:
        """On leading: the stale clusters the ledger persisted, stale since their TTL after their
        last heartbeat (so the loss is timed from that heartbeat)."""
        self.stale_since.clear()
        self.failed.clear()
        self.failed_at.clear()
        for c in clusters:
            if c.stale:
                self.stale_since[c.cluster] = c.last_heartbeat_at + self.ttl_s

    def adopt(self, recorded: Sequence[failed_store.FailedCluster]) -> None:
        """On leading, after :meth:`restore`: the clusters a previous leader classified failed."""
        self.persisted = {c.cluster for c in recorded}
        for c in recorded:
            self.failed[c.cluster] = Health(
                c.cluster, "failed", f"{c.reason} (classified by the previous leader)"
            )
            self.failed_at[c.cluster] = c.failed_at

    def follow(self, delta: ViewDelta) -> None:
        """Track an owned cluster's staleness from its view delta."""
        if delta.stale:
            self.stale_since.setdefault(delta.cluster, delta.at)
        elif delta.cluster in self.stale_since:
            # Heartbeats resumed: its orphaned runs were sent stops when it was failed over (on the
            # agent's durable command consumer), and their reports of old attempts are ignored.
            del self.stale_since[delta.cluster]
            self.failed_at.pop(delta.cluster, None)
            if self.failed.pop(delta.cluster, None) is not None:
                log.warning("failed cluster returned", cluster=delta.cluster)


@dataclasses.dataclass
class _NodeWatch:
    """Node scope: the runs' observed pace, the suspect nodes, the runs already reported slow."""

    pace: Pace
    suspects: SuspectNodes = dataclasses.field(default_factory=SuspectNodes)
    told: set[tuple[str, int]] = dataclasses.field(default_factory=set)
    """Runs reported slow to the migration service (once per attempt)."""


class Phases:
    """Count, total and largest value of each named phase (milliseconds, or a count such as
    ``jobs``), kept in a plain dict so the health answer carries them."""

    def __init__(self, into: dict[str, list[float]]) -> None:
        self.into = into

    def add(self, name: str, value_s: float) -> None:
        """One observation of ``name``: ``value_s`` seconds (any number for a count)."""
        value = value_s * 1000 if name != "jobs" else value_s
        entry = self.into.setdefault(name, [0, 0.0, 0.0])
        entry[0] += 1
        entry[1] = round(entry[1] + value, 3)
        entry[2] = round(max(entry[2], value), 3)

    def since(self, name: str, start: float) -> float:
        """Add the time since ``start`` (``time.perf_counter``) as ``name``; returns now."""
        now = time.perf_counter()
        self.add(name, now - start)
        return now


@dataclasses.dataclass(eq=False)
class _Batch:
    """A submission batch between its decision and the end of its transaction.

    Its cycle's placements are in the kept snapshot (and ``Book.pending``); the next batch decides
    on top of them while this one writes. ``before`` is the batch decided just before it: this one
    commits only once that one has ended, and not at all when that one failed (``doomed``)."""

    seq: int
    before: "_Batch | None"
    done: "asyncio.Future[bool]"
    """Set when the batch ends: True committed, False rolled back."""
    jobs: set[str]
    """Every job its cycle considered (kept out of later batches' cycles until it ends)."""
    runs: set[str]
    """Jobs its cycle placed (pending in the book until it commits)."""
    doomed: bool = False


def _checkpoint_rows(events: Iterable["LifecycleEvent"]) -> list[moves.CheckpointRow]:
    """The checkpoint records of the checkpoint reports among ``events``."""
    return [
        moves.CheckpointRow(
            e.job_id, e.attempt, e.step, e.cluster, e.checkpoint_uri, e.checkpoint_bytes, e.checksum, e.at
        )
        for e in events
        if isinstance(e, JobCheckpointed)
    ]


def _resume_of(
    run: Run,
    recorded: Sequence[Checkpoint],
    replicas: Sequence[Replica] = (),
    *,
    unreachable: Collection[str] = (),
) -> Resume:
    """Where a run lost with its cluster resumes: its newest checkpoint that verifies and can be
    read (not on an ``unreachable`` cluster), its replica elsewhere, the previous one, step 0
    (:func:`loom.migrate.checkpoints.choose`); with none recorded, from its progress."""
    work = run.job.work
    chosen = choose(recorded, last_step=max(work.steps - 1, 0), replicas=replicas, unreachable=unreachable)
    if chosen is not None:
        return Resume(chosen.step, chosen.why)
    return resume_point(
        steps=work.steps,
        checkpoint_every_steps=work.checkpoint_every_steps,
        progress=run.progress,
        checkpoint_step=None,
    )


def _lifecycle_claim_id(d: Delivery[bytes], event: "LifecycleEvent", reporter: str | None) -> str:
    """The id a lifecycle message is claimed and recorded under: a tenant's cancellation's within
    its tenant (:func:`loom.security.tenant_claim_id`), an agent's report's bound to what it
    reports (:func:`loom.security.report_claim_id`), a service's event's as it was sent."""
    if isinstance(event, JobCancelled):
        return tenant_claim_id(d.subject, d.msg_id or f"REQUESTS-{d.stream_seq}")
    if reporter is not None:
        return report_claim_id(d.subject, event, d.msg_id)
    return d.msg_id or f"JOBS-{d.stream_seq}"


async def _foreign_reports(
    conn: asyncpg.Connection, reports: Sequence[tuple[int, "LifecycleEvent", str]]
) -> dict[int, str]:
    """Agent reports ``(key, event, reporting cluster)`` whose subject's cluster holds no part of
    that attempt's run (issue 18: an agent's credentials may report only on its own cluster's
    subjects, so this is where another cluster's job is told apart): key -> why
    (:func:`loom.security.foreign_report`). Keyed per delivery, not by claim id: a forged report
    shares its id with the genuine one it copies, and in one batch the later one decided for both
    (a forged completion after the genuine one left the job running, its GPUs held)."""
    if not reports:
        return {}
    rows = await conn.fetch(
        """SELECT job_id, attempt, array_agg(DISTINCT cluster) AS clusters FROM reservations
           WHERE job_id = ANY($1::text[]) GROUP BY job_id, attempt""",
        sorted({e.job_id for _, e, _ in reports}),
    )
    run_clusters = {(r["job_id"], r["attempt"]): set(r["clusters"]) for r in rows}
    out: dict[int, str] = {}
    for key, e, reporter in reports:
        attempt = getattr(e, "attempt", None)
        why = foreign_report(
            reporter, getattr(e, "cluster", None), run_clusters.get((e.job_id, attempt), set())
        )
        if why is not None:
            out[key] = why
    return out


async def _foreign_cancels(
    conn: asyncpg.Connection, events: Sequence[tuple["LifecycleEvent", str]]
) -> dict[str, str]:
    """Cancellations naming a job of another tenant, or no job at all (message id -> why): a
    tenant's credentials publish cancellations on its own subject only (the event's tenant is
    checked against it), so this is where another tenant's job is told apart."""
    cancels = [(e, mid) for e, mid in events if isinstance(e, JobCancelled)]
    if not cancels:
        return {}
    # Locked to the transaction's end: a job another tenant submits meanwhile cannot be the one
    # this cancels (it is not there yet, so the cancellation is of no job and refused).
    owners = await repo.tenants_of(conn, sorted({e.job_id for e, _ in cancels}), lock=True)
    # A job not stored is refused too: stored, the cancellation would name a job someone may
    # submit later.
    return {
        mid: why
        for e, mid in cancels
        if (why := foreign_cancellation(e.tenant, e.job_id, owners.get(e.job_id))) is not None
    }


async def _late_cancels(
    conn: asyncpg.Connection, events: Sequence[tuple["LifecycleEvent", str]]
) -> dict[str, str]:
    """Cancellations of jobs that had already ended (message id -> why): acknowledged, not
    recorded (a "cancelled" row after "rejected" or "completed" read as though it took effect)."""
    cancels = [(e, mid) for e, mid in events if isinstance(e, JobCancelled)]
    if not cancels:
        return {}
    states = await moves.job_states(conn, sorted({e.job_id for e, _ in cancels}))
    return {
        mid: f"job {e.job_id} had already ended ({state}): nothing to cancel"
        for e, mid in cancels
        if (state := states.get(e.job_id, ("", 0))[0]) in TERMINAL_STATES
    }


async def _refused_checkpoints(
    conn: asyncpg.Connection, events: Sequence[tuple["LifecycleEvent", str]]
) -> tuple[dict[str, str], dict[str, str]]:
    """New checkpoint reports that must not be recorded: message id -> why
    (:func:`loom.migrate.checkpoints.report_refusal`), as (refused: an unknown job or an attempt
    that is not the live one, dead-lettered; late: a checkpoint of the live attempt of a job that
    has ended, as a run stopped by a cancel reports while it stops: acknowledged, not recorded)."""
    reports = [(e, mid) for e, mid in events if isinstance(e, JobCheckpointed)]
    if not reports:
        return {}, {}
    known = {
        r["msg_id"]
        for r in await conn.fetch(
            "SELECT msg_id FROM job_events WHERE msg_id = ANY($1::text[])", [mid for _, mid in reports]
        )
    }
    fresh = [(e, mid) for e, mid in reports if mid not in known]
    states = await moves.job_states(conn, sorted({e.job_id for e, _ in fresh}))
    out: dict[str, str] = {}
    late: dict[str, str] = {}
    for e, mid in fresh:
        state, attempt = states.get(e.job_id, (None, None))
        why = report_refusal(job_state=state, current_attempt=attempt, attempt=e.attempt)
        if why is not None:
            late_one = late_report(job_state=state, current_attempt=attempt, attempt=e.attempt)
            (late if late_one else out)[mid] = why
    return out, late


async def _parent_of(conn: asyncpg.Connection, job_id: str) -> str | None:
    row = await repo.job_row(conn, job_id)
    return row["parent"] if row is not None else None


def _book_differs(old: Any, new: Any) -> bool:
    """Whether a node's entry in the capacity book changes (reservations aside)."""
    if old is None:
        return True
    keys = ("cluster", "region", "zone", "gpu_model", "gpus_total", "schedulable", "cpu_milli", "memory_mib")
    return any(getattr(old, k) != getattr(new, k) for k in keys)


def _spec_of(job: JobSubmitted) -> JobSpec:
    fields = {f: getattr(job, f) for f in JobSpec.__struct_fields__}
    return JobSpec(**fields)


def _kind(event: LifecycleEvent) -> str:
    return str(event.__struct_config__.tag)


def _at(event: LifecycleEvent) -> float:
    return event.started_at if isinstance(event, JobStarted) else event.at


def view_changes(nodes: Mapping[str, NodeCapacity], delta: ViewDelta) -> list[NodeCapacity]:
    """The book's nodes a view delta changes (totals, model, schedulability; reservations kept).

    Listed nodes take the delta's values (schedulable when healthy and the cluster is not stale);
    unlisted nodes of the cluster close when the delta is stale, removes them or is a full list.
    A cluster that comes back from stale is announced whole (the ledger republishes every node
    then), so the nodes staleness closed open again, by their own health, for any leader."""
    changed: list[NodeCapacity] = []
    listed = set()
    for n in delta.nodes:
        listed.add(n.node)
        old = nodes.get(n.node)
        changed.append(
            NodeCapacity(
                node=n.node,
                cluster=delta.cluster,
                region=delta.region,
                zone=n.zone,
                gpu_model=n.gpu_model,
                gpus_total=n.gpus_total,
                gpus_reserved=old.gpus_reserved if old else 0,
                schedulable=n.healthy and not delta.stale,
                cpu_milli=n.cpu_milli,
                memory_mib=n.memory_mib,
            )
        )
    gone = set(delta.removed)
    for cap in nodes.values():
        if cap.cluster != delta.cluster or cap.node in listed:
            continue
        if delta.stale or cap.node in gone or delta.full:
            changed.append(dataclasses.replace(cap, schedulable=False))
    # Only what placement decides on: a delta that just moves used or reserved GPUs changes nothing here.
    return [cap for cap in changed if _book_differs(nodes.get(cap.node), cap)]


class _StageRoute(msgspec.Struct):
    """What routing reads of a DAG stage."""

    affinity: Affinity = Affinity()


class _RouteFields(msgspec.Struct):
    """What routing reads of a submission (:func:`loom.sched.shards.route_of`); every other field
    is skipped unparsed. Any payload :class:`JobSubmitted` decodes, this decodes, to the same
    route (a subset of its fields, of the same types)."""

    affinity: Affinity = Affinity()
    stages: list[_StageRoute] = []


_ROUTE_FIELDS = msgspec.json.Decoder(_RouteFields)


def _payload_job_id(payload: bytes) -> str | None:
    try:
        check_payload(payload)  # not a RecursionError on a hostile payload: no job id to be had
        value = json.loads(payload)
    except (ValueError, RecursionError):
        return None
    job_id = value.get("job_id") if isinstance(value, dict) else None
    if not isinstance(job_id, str):
        return None
    try:
        return validate_id(job_id, "job id")  # what a rejection can name (a subject token)
    except InvalidIdError:
        return None


def hash_carrier(q: QueuedJob) -> str:
    """A short token, the same in every process (``hash()`` is salted), for a duplicate's rejection id."""
    return hashlib.sha256(f"{q.job.job_id}:{q.job.submitted_at!r}".encode()).hexdigest()[:12]


__all__ = ["Applied", "PlacementService", "QueuedJob", "rejection"]
