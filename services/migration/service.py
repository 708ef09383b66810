"""The migration service: drains clusters, moves jobs at checkpoint boundaries, records every move.

Thin around the pure core (:mod:`loom.migrate.drain`, :mod:`loom.migrate.checkpoints`):

* **Drains** (``loom drain`` / ``loom undrain``, request-reply on ``loom.migrate.drain``): an
  unknown cluster is refused, and so is a drain that would leave some job without feasible GPUs
  elsewhere (unless forced). A drain is a row in ``cluster_drains``; placement loads the drained
  clusters and offers none of their nodes (this service tells it on ``loom.migrate.drains``, and
  answers the drain once the leader of every placement shard leading now confirms, naming any
  that did not; again every few seconds while drains exist). The
  drain loop then moves the cluster's running jobs, largest benefit first, at most
  ``concurrency`` in flight, each only on room placement's what-if finds in that pass (a verdict
  from an earlier pass is asked for again in the job's turn, and once more as the move is about
  to start): each move is *planned* (a
  checkpoint asked of the run's lead agent), *started* once that checkpoint is recorded (placement
  gives the run up, ``loom.placement.migrate``, and queues the job again from the checkpoint's
  step, avoiding the drained cluster) and *completed* when the next attempt starts elsewhere.
  Jobs that declare no checkpoints would restart from step 0: they move only at the deadline.
  A job placement's what-if finds no room for off the drained cluster keeps running there and
  waits for capacity (asked again every ``drain_retry_s``; listed with what it needs in the
  ``drains`` query and as a ``stay`` verdict): it moves when room appears, or at the deadline.
* **Failovers**: placement re-places the runs of a failed cluster, or of a failed node, itself
  (one path, in the service that owns reservations); this service records each as a migration
  (cause ``failover``) from the ``requeued`` event and completes it when the next attempt starts.
* **Voluntary moves** — the benefit rule (:mod:`loom.migrate.benefit`) decides each, with every
  verdict recorded (``migration_verdicts``: ``loom explain``, ``loom job``, ``loom migrations
  --verdicts``): a link degraded or recovered (cause ``network``); a cluster joined, returned
  from a failure, grew, or its drain ended (``backflow``: only moves *to* it count,
  :mod:`loom.migrate.backflow`); a run placement reports slow (``slow_node``: its observed step
  where it is). The budget bounds them per cluster and link; cool-down and hysteresis apply.
  Each is judged again as it is to start (its checkpoint written, :meth:`_still_pays`): one that
  no longer pays (its room taken meanwhile, its gain shrunk) fails as moot and the job stays.

* **Checkpoint replicas** (:mod:`loom.migrate.replicas`): each running job's latest checkpoint
  is copied, in the background and at most ``replica_concurrency`` copies at once, to another
  cluster chosen by the measured path from its cluster and that cluster's byte budget; the first
  copy sends the full checkpoint, later ones the delta. A copy is timed, not moved: it waits the
  path's transfer time (RTT + bytes at the measured bandwidth less loss) divided by
  ``time_scale``, the agents' simulated seconds per wall second, so that it runs on the same clock
  as the work that wrote the checkpoint; it fails when its path goes down meanwhile. Each is a row
  of ``checkpoint_replicas``; a lost run resumes from it (placement, :func:`choose`).

Every step is a row in ``migrations`` written in one transaction with the outbox row of its
``loom.migrations.<kind>.<tenant>`` event (in the job's trace), so a restarted service resumes
from its records: a planned move whose checkpoint came meanwhile is started, one whose run was
already given up is marked started, and placement's attempt fence makes a repeated request
change nothing.
"""

import asyncio
import contextlib
import functools
import json
import math
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import msgspec
import nats.errors
import structlog
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from opentelemetry import propagate

from loom.bus import ConsumerRunner, ConsumerSpec, Delivery
from loom.bus.lease import lease_holders
from loom.bus.reply import answerable, respond
from loom.migrate import backflow, benefit
from loom.migrate.checkpoints import Checkpoint, choose
from loom.migrate.drain import (
    DrainJob,
    ShardConfirmation,
    ShardReply,
    drain_refusal,
    needs,
    next_move_id,
    pick_moves,
    placeable,
    room_off,
    shard_confirmation,
    waiting_for_capacity,
)
from loom.migrate.network import (
    DegradedLinks,
    candidate_of,
    concerned_by_link,
    path_between,
    running_state,
    users_of,
)
from loom.migrate.queue import options_from_wire
from loom.migrate.replicas import (
    REPLICA_CONCURRENCY,
    Held,
    ReplicaSettings,
    Site,
    changed_fraction_of,
    checkpoint_interval_s,
    path_of,
    plan_copy,
)
from loom.net.intensity import links_in_use
from loom.runtime.service import ServiceContext
from loom.store import fence, moves, outbox
from loom.store import replicas as replica_store
from loom.store.pool import transaction
from loom.tasks import cancel_and_wait
from loom_proto import subjects
from loom_proto.clusters import CheckpointJob, ClusterHealthChanged
from loom_proto.codec import DecodeError, decode, encode
from loom_proto.jobs import Affinity, JobRequeued, JobSpec, JobStarted
from loom_proto.migrations import MAX_DRAIN_CONCURRENCY, MigrationEvent, MigrationKind
from loom_proto.net import LinkEventMessage, LinkInUse, LinkRecovered, LinksInUse, LinkState

log = structlog.get_logger("migration")

UNMEASURED_PATH = benefit.PathState(rtt_ms=250.0, bandwidth_gbps=1.0)
"""A path network perception has not measured yet (a region just joined): a slow WAN link."""

PRODUCER = "migration"
EVENTS_LINGER_S = 0.1
"""How long a fetched job event waits for others to share its handling (at 50 jobs/s each start
had its own round of the consumer and the store)."""

VOLUNTARY_CAUSES = ("network", "backflow", "slow_node")
"""Moves the benefit rule chose (not forced): the budget counts them, the moves loop advances them."""

JobEvent = JobRequeued | JobStarted


Said = dict[tuple[str, Any], tuple[str, str | None]]
"""(job, what it was reviewed about) -> its last recorded verdict there: (decision, target)."""


def _news(records: list[moves.VerdictRow], said: Said, key: object) -> list[moves.VerdictRow]:
    """The verdicts worth recording again about ``key``: every move, and a stay or a deferral
    that differs from the job's last recorded verdict there (None: every verdict)."""
    if key is None:
        return records
    return [r for r in records if r.decision == "move" or said.get((r.job_id, key)) != (r.decision, r.target)]


def _remember(records: Sequence[moves.VerdictRow], said: Said, key: object) -> None:
    """Note the verdicts recorded about ``key`` (None: nothing to note)."""
    if key is not None:
        said.update(((r.job_id, key), (r.decision, r.target)) for r in records)


@dataclass(frozen=True)
class MigrationSettings:
    """How the service paces drains."""

    poll_s: float = 0.25
    """Drain loop period (and the network-moves loop's) while there is work: a drain, a planned move."""
    idle_poll_s: float = 2.0
    """Their period with nothing to do: this process wakes them at once when it opens a drain or
    plans a move; this slow poll only finds what another process wrote to the store. Also the
    replica loop's period while no running job has a checkpoint (a checkpoint report wakes it)."""
    checkpoint_timeout_s: float = 10.0
    """A move waits this long for the checkpoint it asked for, then asks again."""
    ask_timeout_s: float = 3.0
    """How long a request to placement waits for its answer."""
    notice_every_s: float = 5.0
    """While drains exist, placement is reminded of them this often (a lost notice heals)."""
    notice_confirm_s: float = 1.0
    """A drain or undrain is answered once the leader of every placement shard that leads now
    confirms it reloaded the drained clusters, or after this long without all their answers (the
    answer names the shards that did not; placement down: it loads them when it starts)."""
    drain_retry_s: float = 2.0
    """A drained cluster's job that no placement elsewhere had room for (it waits for capacity,
    running where it is) is asked about again this often: it moves as soon as room appears."""
    use_every_s: float = 5.0
    """While running jobs span links, the links in use (``loom.net.use``) are announced this
    often (jobs that ended are noticed by then); a job's start announces at once."""
    use_ttl_s: float = 20.0
    """An announced link stays in use this long unless announced again (a lost message heals)."""
    use_gap_s: float = 1.0
    """At least this long between two looks at the running jobs' links."""
    use_idle_s: float = 60.0
    """With no link in use, the store is looked at only this often (a start wakes it at once):
    the platform at rest pays nothing for dense probing."""
    review_delay_s: float = 0.1
    """A link event is reviewed this long after it arrives (placement takes the link's new state
    from the same tick first, so its what-if prices the path as measured now)."""
    rule: benefit.MigrationSettings = field(default_factory=benefit.MigrationSettings)
    """The move-or-stay rule (margins, hysteresis, cool-down)."""
    per_cluster: int = 4
    """Network moves and backflow in flight touching one cluster at most."""
    per_link: int = 4
    """Network moves and backflow in flight over one region pair at most."""
    replica_poll_s: float = 0.5
    """Checkpoint replica loop period."""
    replica_concurrency: int = REPLICA_CONCURRENCY
    """Replica copies in flight at most."""
    replicas: ReplicaSettings = field(default_factory=ReplicaSettings)
    """Where replicas go (byte budgets) and the incremental rule."""
    time_scale: float = 60.0
    """The agents' simulated seconds per wall second: a copy's transfer time is waited divided by
    it (the agents' default; ``loom up`` passes its ``--time-scale``; 1 for real clusters)."""
    review_clusters: bool = True
    """Review running jobs when a cluster joins, returns (after a failure) or grows, and when a
    drain ends (backflow); off: only links, slow nodes, failures and drains move work."""
    clusters_every_s: float = 2.0
    """How often the schedulable GPUs per cluster are read (a join is seen within this)."""
    improve_share: float = backflow.DEFAULT_IMPROVE_SHARE
    """A cluster whose schedulable GPUs grew by this share improved."""
    join_settle_s: float = 12.0
    join_recheck_s: float = 3.0
    """A cluster that joined (or returned) is reviewed again every ``join_recheck_s`` for
    ``join_settle_s`` while the framework places its candidates elsewhere: its GPUs show in the
    view from its first heartbeat, but placement may still hold it closed for a moment (a failed
    cluster reopens on its own reading of the agent), and a review then would find nothing
    moving there, for good."""


class MigrationService:
    """The migration service's handlers and loops; :meth:`run` is the service body."""

    def __init__(self, ctx: ServiceContext, settings: MigrationSettings | None = None) -> None:
        self.ctx = ctx
        self.pool = ctx.db
        self.settings = settings or MigrationSettings()
        self.relay = outbox.OutboxRelay(self.pool, ctx.publisher, PRODUCER)
        self._noticed_at = 0.0
        self.stats = ctx.stats
        self.stats.update(
            {
                "planned": 0,
                "started": 0,
                "completed": 0,
                "failed": 0,
                "drains": [],
                "reviews": 0,
                "rechecks": 0,
                "verdicts": {"move": 0, "stay": 0, "deferred": 0},
                "replicas": {"started": 0, "ready": 0, "failed": 0, "bytes_sent": 0, "unplaced": {}},
                "cluster_reviews": 0,
                "slow_reviews": 0,
            }
        )
        self.links: dict[tuple[str, str], LinkState] = {}
        """The latest state of every link network perception published."""
        self._link_events: asyncio.Queue[LinkEventMessage] = asyncio.Queue()
        self.degraded = DegradedLinks(self.settings.rule.recheck_s)
        """The links degraded now (monotonic clock): their jobs are looked at again every
        ``rule.recheck_s`` while they stay degraded."""
        self._link_said: Said = {}
        """(job, degraded region pair) -> the job's last recorded verdict (decision, target) on it."""
        self._cluster_said: Said = {}
        """(job, cluster reviewed) -> the job's last recorded verdict (decision, target) in that
        cluster's reviews: a recheck of a joined cluster records only what changed."""
        self._avoid: dict[str, list[str]] = {}
        """migration id -> clusters its re-placement avoids (a network move's source parts)."""
        self._copies: dict[tuple[str, int, int, str], asyncio.Task[None]] = {}
        """Replica copies in flight: (job, attempt, step, target cluster) -> its timed task."""
        self._drain_judged: dict[str, dict[tuple[str, int], benefit.MigrationVerdict]] = {}
        """drained cluster -> (job, attempt) -> its ``drain`` verdict (the drain's order)."""
        self._drain_judged_at: dict[tuple[str, str, int], float] = {}
        """(drained cluster, job, attempt) -> when its verdict was judged (monotonic s): a verdict
        without room elsewhere is judged again after ``drain_retry_s``."""
        self._start_held_at: dict[str, float] = {}
        """migration id -> when its drain move, about to start, found no room elsewhere (monotonic
        s): it is asked again after ``drain_retry_s``."""
        self._drain_waiting: dict[str, dict[tuple[str, int], dict[str, Any]]] = {}
        """drained cluster -> (job, attempt) -> why it waits for capacity (``loom drain``,
        ``drains`` query): job_id, needs, why, since."""
        self._cluster_reviews: dict[str, tuple[benefit.Trigger, str]] = {}
        """cluster -> (trigger, what happened) still to review: joined, returned, improved, undrained."""
        self._failed: set[str] = set()
        """Clusters placement last said failed (``loom.placement.cluster_health``)."""
        self._review_after: dict[str, float] = {}
        """cluster -> when its pending review is due (a cool-down holding back a move there ends)."""
        self._joined_at: dict[str, float] = {}
        """cluster -> when it was last seen joining or returning (wall s): rechecked while settling."""
        self._slow: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._wake_drains = asyncio.Event()
        """Set when this process opens or ends a drain: the idle drain loop looks at once."""
        self._replicas_idle = False
        """The last replica pass found no running job with a checkpoint and no copy: the loop
        waits ``idle_poll_s`` or until a checkpoint is reported (``_wake_replicas``)."""
        self._wake_replicas = asyncio.Event()
        self._replicas_due_until = 0.0
        """After a checkpoint report the replica loop keeps its pace this long (monotonic s):
        placement records the checkpoint a moment after the report this service hears."""
        self._wake_moves = asyncio.Event()
        """Set when this process records a move: the idle moves loop looks at once."""
        self._wake_use = asyncio.Event()
        """Set by a job's start: the links in use are announced again at once."""

    async def run(self) -> None:
        """Consume job events, answer drain requests and queries, drive drains, until stopped."""
        await self.relay.flush()
        events: ConsumerRunner[bytes] = ConsumerRunner(
            self.ctx.nc,
            ConsumerSpec(
                stream="JOBS",
                durable="migration-jobs",
                filter_subjects=subjects.job_events_of("requeued", "started"),
                batch=200,
            ),
            bytes,
            batch_handler=self.on_job_events,
            publisher=self.ctx.publisher,
            callback_pull=True,
            linger_s=EVENTS_LINGER_S,  # starts and requeues a batch at a time, not each alone
        )
        drain_sub = await self.ctx.nc.subscribe(subjects.MIGRATE_DRAIN, queue="migration", cb=self.on_drain)
        query_sub = await self.ctx.nc.subscribe(subjects.MIGRATE_QUERY, queue="migration", cb=self.on_query)
        link_sub = await self.ctx.nc.subscribe(subjects.LINK_STATES_ALL, cb=self.on_link)
        net_sub = await self.ctx.nc.subscribe(subjects.NET_EVENTS_ALL, cb=self.on_net_event)
        slow_sub = await self.ctx.nc.subscribe(subjects.PLACEMENT_SLOW, cb=self.on_slow)
        health_sub = await self.ctx.nc.subscribe(subjects.PLACEMENT_CLUSTER_HEALTH, cb=self.on_cluster_health)
        checkpoint_subs = [
            await self.ctx.nc.subscribe(subject, cb=self.on_checkpointed)
            for subject in subjects.job_events_of("checkpointed")
        ]
        await events.start()
        watchdog = self.ctx.watchdog
        relay_stop = asyncio.Event()
        loops = [
            watchdog.watch_consumer("job-events", events),
            watchdog.supervise("drains", self._drain_loop),
            watchdog.supervise("network", self._network_loop),
            watchdog.supervise("network-moves", self._moves_loop),
            watchdog.supervise("replicas", self._replica_loop),
            watchdog.supervise("clusters", self._clusters_loop),
            watchdog.supervise("slow-runs", self._slow_loop),
            watchdog.supervise("links-in-use", self._use_loop),
            watchdog.supervise("outbox-relay", functools.partial(self.relay.run, relay_stop), finishes=True),
        ]
        try:
            await self.ctx.stopping.wait()
        finally:
            relay_stop.set()
            await cancel_and_wait(loops)
            for copy in list(self._copies.values()):
                copy.cancel()  # recorded as copying: a restarted service times it again
            await asyncio.gather(*self._copies.values(), return_exceptions=True)
            await drain_sub.unsubscribe()
            await query_sub.unsubscribe()
            await link_sub.unsubscribe()
            await net_sub.unsubscribe()
            await slow_sub.unsubscribe()
            await health_sub.unsubscribe()
            for sub in checkpoint_subs:
                await sub.unsubscribe()
            await events.stop()

    # ---- failovers (recorded from placement's events) -----------------------------------------

    async def on_job_events(self, deliveries: list[Delivery[bytes]]) -> Sequence[BaseException | None]:
        """A run lost with its cluster starts a failover migration; a next attempt's start ends
        every open migration of the job's earlier attempts (a job that ended meanwhile: the sweep,
        :meth:`_end_moot`)."""
        decoded: list[JobEvent] = []
        for d in deliveries:
            try:
                event: JobEvent = decode(d.message, JobEvent)  # type: ignore[arg-type]
            except DecodeError:
                continue  # placement dead-letters bad lifecycle events; nothing to record here
            if isinstance(event, JobStarted) and subjects.report_cluster(d.subject) not in (
                None,
                event.cluster,
            ):
                continue  # an agent's start of a run on another cluster (placement refuses it too)
            if isinstance(event, JobStarted):
                self._wake_use.set()  # a job may span a link now: announce it
            # A first attempt's start ends no migration (a migration leaves an attempt >= 1 for a
            # later one: migrations.from_attempt >= 1): most starts need no transaction at all.
            if isinstance(event, JobStarted) and event.attempt <= 1:
                continue
            decoded.append(event)
        if not decoded:
            return [None] * len(deliveries)
        messages: list[outbox.OutboxMessage] = []
        async with transaction(self.pool) as conn:
            # Consecutive starts end their migrations in one statement per round (a job's second
            # start in the run is in the next round), in event order; a failover between them is
            # recorded in its place.
            starts: list[JobStarted] = []
            for e in decoded:
                if isinstance(e, JobRequeued) and e.cause in ("cluster_lost", "node_lost"):
                    messages += await self._complete_moves(conn, starts)
                    starts = []
                    messages += await self._record_failover(conn, e)
                elif isinstance(e, JobStarted):
                    starts.append(e)
            messages += await self._complete_moves(conn, starts)
            if messages:
                await outbox.add(conn, PRODUCER, messages)
        await self._publish(messages)
        return [None] * len(deliveries)

    async def _end_moot(self) -> None:
        """Fail the open migrations of every job that has ended (a failed-over run's late
        completion finished it, a cancellation): a sweep every few seconds, read from the store,
        since a job's end event may reach this service before placement has recorded the end (or
        before the failover it ends was recorded), and reading every job's end would cost each job
        a round here."""
        async with transaction(self.pool) as conn:
            rows = await moves.end_moot(conn)
            messages = [self._message(row, "failed", moot=True) for row in rows]
            if messages:
                await outbox.add(conn, PRODUCER, messages)
        for row in rows:
            self._start_held_at.pop(row["migration_id"], None)
        if messages:
            await self._publish(messages)

    async def _complete_moves(
        self, conn: asyncpg.Connection, starts: list[JobStarted]
    ) -> list[outbox.OutboxMessage]:
        """The migrations that ``starts`` (in order) end, and their ``completed`` messages."""
        rounds: list[dict[str, JobStarted]] = []
        for e in starts:
            for taken in rounds:
                if e.job_id not in taken:
                    break
            else:
                taken = {}
                rounds.append(taken)
            taken[e.job_id] = e
        messages: list[outbox.OutboxMessage] = []
        for taken in rounds:
            rows = await moves.complete_many(conn, [(e.job_id, e.attempt, e.cluster) for e in taken.values()])
            messages += [
                self._message(row, "completed")
                if row["state"] == "completed"
                else self._message(row, "failed", moot=True)
                for row in rows
            ]
        return messages

    async def _record_failover(self, conn: asyncpg.Connection, e: JobRequeued) -> list[outbox.OutboxMessage]:
        job = await conn.fetchrow(
            "SELECT tenant, spec, progress, resume_step, cluster, trace_context FROM jobs WHERE job_id = $1",
            e.job_id,
        )
        if job is None:
            return []
        steps = int(json.loads(job["spec"]).get("work", {}).get("steps", 0))
        done = int(float(job["progress"]) * steps + 1e-6)
        resume_step = int(job["resume_step"])
        # None while a move of that run is open (it is marked started when its pass sees the run
        # given up); after failed ones (an undrain's) the next id: a replayed event records nothing.
        migration_id = next_move_id(
            e.job_id, e.attempt - 1, await moves.moves_of_run(conn, e.job_id, e.attempt - 1)
        )
        if migration_id is None:
            return []
        new = await moves.plan(
            conn,
            migration_id=migration_id,
            job_id=e.job_id,
            tenant=e.tenant,
            cause="failover",
            state="started",
            from_cluster=e.from_cluster or job["cluster"] or "unknown",
            from_attempt=e.attempt - 1,
            steps=steps,
            why=e.reason,
            trace_context=json.loads(job["trace_context"]),
            resume_step=resume_step,
            lost_steps=max(done - resume_step, 0),
        )
        if not new:
            return []
        row = await conn.fetchrow("SELECT * FROM migrations WHERE migration_id = $1", migration_id)
        return [self._message(row, "planned"), self._message(row, "started")]

    # ---- drains --------------------------------------------------------------------------------

    async def on_drain(self, msg: Msg) -> None:
        """``loom.migrate.drain``: drain or undrain a cluster; the answer says why when refused."""
        try:
            request = json.loads(msg.data or b"{}")
            reply = await self._drain_request(request)
        except Exception as exc:  # any bad request gets an answer, never a crash
            reply = {"ok": False, "code": "error", "error": repr(exc)}
        await respond(msg, json.dumps(reply).encode())

    async def _drain_request(self, request: Mapping[str, Any]) -> dict[str, Any]:
        op = request.get("op", "drain")
        cluster = str(request["cluster"])
        known = await moves.known_clusters(self.pool)
        if cluster not in known:
            return {
                "ok": False,
                "code": "unknown_cluster",
                "error": f"unknown cluster {cluster!r} (known: {', '.join(sorted(known)) or 'none'})",
            }
        if op == "undrain":
            async with transaction(self.pool) as conn:
                was = await moves.end_drain(conn, cluster)
                messages = []
                for row in await moves.open_migrations(conn, cluster):
                    if row["cause"] == "drain" and row["state"] == "planned":
                        failed = await moves.fail(conn, row["migration_id"], f"the drain of {cluster} ended")
                        if failed is not None:
                            messages.append(self._message(failed, "failed", moot=True))
                        self._start_held_at.pop(row["migration_id"], None)
                await outbox.add(conn, PRODUCER, messages)
            await self._publish(messages)
            confirmation = await self._confirm()
            self._drain_judged.pop(cluster, None)
            for key in [k for k in self._drain_judged_at if k[0] == cluster]:
                del self._drain_judged_at[key]
            self._drain_waiting.pop(cluster, None)
            if was:  # work may flow back, gradually and where the benefit rule says so
                self._cluster_reviews[cluster] = ("cluster_joined", f"drain of {cluster} ended")
                # Reviewed now: a cool-down of one job, held back in an earlier review, postponed
                # the whole cluster's next review (up to 30 min), every later undrain's with it.
                self._review_after.pop(cluster, None)
            log.info("cluster undrained", cluster=cluster, was_drained=was)
            return {
                "ok": True,
                "cluster": cluster,
                "was_drained": was,
                "placement_confirmed": confirmation.complete,
                "shards": confirmation.to_json(),
            }
        if op != "drain":
            return {"ok": False, "code": "bad_request", "error": f"unknown op {op!r}"}
        try:
            concurrency = int(request.get("concurrency", 2))
            deadline_s = float(request.get("deadline_s", 0.0))
        except (TypeError, ValueError):
            return {"ok": False, "code": "bad_request", "error": "concurrency and deadline_s must be numbers"}
        force = bool(request.get("force", False))
        if not 1 <= concurrency <= MAX_DRAIN_CONCURRENCY:
            error = f"concurrency must be within 1-{MAX_DRAIN_CONCURRENCY}, got {concurrency}"
            return {"ok": False, "code": "bad_request", "error": error}
        if not 0 <= deadline_s < math.inf:
            return {
                "ok": False,
                "code": "bad_request",
                "error": f"deadline_s must be a finite number >= 0, got {deadline_s}",
            }
        runs = await moves.runs_on(self.pool, cluster)
        jobs = [_drain_job(r) for r in runs]
        closed = await moves.drained_clusters(self.pool)
        refusal = drain_refusal(cluster, jobs, known, closed, await replica_store.cluster_regions(self.pool))
        if refusal is not None and not force:
            return {"ok": False, "code": "refused", "error": refusal}
        async with transaction(self.pool) as conn:
            new = await moves.start_drain(
                conn, cluster, concurrency=concurrency, deadline_s=deadline_s, forced=force
            )
        confirmation = await self._confirm()
        log.info("cluster draining", cluster=cluster, jobs=len(jobs), concurrency=concurrency, forced=force)
        return {
            "ok": True,
            "cluster": cluster,
            "jobs": len(jobs),
            "new": new,
            "concurrency": concurrency,
            "deadline_s": deadline_s,
            "forced_past": refusal,
            "placement_confirmed": confirmation.complete,
            "shards": confirmation.to_json(),
        }

    async def _notice(self) -> None:
        """Tell placement the drained clusters changed (it reloads them from the store); a plain
        reminder, answered by nobody (:meth:`_confirm` is the one a drain's answer waits for)."""
        self._noticed_at = time.monotonic()
        self._wake_drains.set()
        await self.ctx.nc.publish(subjects.MIGRATE_DRAINS_CHANGED, b"")

    async def _confirm(self) -> ShardConfirmation:
        """Tell placement the drained clusters changed and wait, up to ``notice_confirm_s``, until
        the leader of *every* placement shard that leads now has reloaded them, so that a drain's
        answer means the cluster is closed: a job submitted after ``loom drain`` returned is placed
        there by no shard. (A plain notice raced the next submission: the bench's late job could
        land on the drained cluster and be moved off it at its first checkpoint. The first answer
        alone was not enough either with several shards: another shard's leader, the one holding
        the cluster perhaps, could still place there.)

        The shards are those a fence was ever claimed for (``fences``); the live ones, those whose
        lease is held now. The request goes out after both are read, and so after the drain was
        committed: a shard whose leader starts later loads the drains when it starts, and one
        with no leader needs no answer (listed as leaderless). Each leader answers with the
        territories it holds and their fence tokens (:func:`shard_confirmation` counts an answer
        only from a token at least the one read, not a deposed leader's)."""
        self._noticed_at = time.monotonic()
        self._wake_drains.set()
        live: dict[str, int] | None
        leaderless: list[str] = []
        try:
            tokens = await fence.tokens(self.pool)
            holders = await lease_holders(self.ctx.nc.jetstream(), tokens)
            live = {t: token for t, token in tokens.items() if holders.get(t) is not None}
            leaderless = [t for t in tokens if holders.get(t) is None]
        except Exception as exc:  # the store or the bus: wait for whoever answers, confirm nothing
            log.warning("placement shards leading now not read", error=repr(exc))
            live = None
        replies: list[ShardReply] = []
        done = asyncio.Event()

        async def on_reply(msg: Msg) -> None:
            try:
                answer = json.loads(msg.data or b"{}")
            except ValueError:
                return
            reply = ShardReply.parse(answer) if isinstance(answer, dict) else None
            if reply is None:
                return
            replies.append(reply)
            if live is not None and not shard_confirmation(live, leaderless, replies).unconfirmed:
                done.set()

        sub: Subscription | None = None
        try:
            # Inside: with the connection closed or draining the subscription fails too, and the
            # drain (committed already) is answered as not confirmed, not with an error.
            sub = await self.ctx.nc.subscribe(self.ctx.nc.new_inbox(), cb=on_reply)
            await self.ctx.nc.publish(subjects.MIGRATE_DRAINS_CHANGED, b"", reply=sub.subject)
            if live is None or live:  # with no live leader, nobody will answer: no wait
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(done.wait(), self.settings.notice_confirm_s)
        except nats.errors.Error as exc:  # the notice did not go out: nobody confirmed
            log.warning("drains notice not sent", error=repr(exc))
        finally:
            if sub is not None:
                with contextlib.suppress(nats.errors.Error):
                    await sub.unsubscribe()
        confirmation = shard_confirmation(live, leaderless, replies)
        if not confirmation.complete:
            log.info(
                "placement did not confirm the drained clusters everywhere",
                confirmed=confirmation.confirmed,
                unconfirmed=confirmation.unconfirmed,
                leaderless=confirmation.leaderless,
                known=confirmation.known,
            )
        return confirmation

    async def _pause(self, wake: asyncio.Event, busy: bool, period_s: float | None = None) -> None:
        """A loop's wait between passes: ``period_s`` (default ``poll_s``) while it has work, else
        until ``wake`` is set or ``idle_poll_s`` passed (a store poll at 4 Hz with nothing to do is
        most of this service's CPU at rest). The caller clears ``wake`` before reading the store."""
        if busy:
            await asyncio.sleep(self.settings.poll_s if period_s is None else period_s)
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(wake.wait(), self.settings.idle_poll_s)

    async def _drain_loop(self) -> None:
        busy = True
        while True:
            await self._pause(self._wake_drains, busy)
            self._wake_drains.clear()
            busy = True  # a failed pass polls again soon
            try:
                drains = await moves.drains(self.pool)
                busy = bool(drains)
                self.stats["drains"] = [
                    {k: d[k] for k in ("cluster", "state", "concurrency", "deadline_s")} for d in drains
                ]
                if drains and time.monotonic() - self._noticed_at >= self.settings.notice_every_s:
                    await self._notice()
                await self.drain_pass(drains)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("drain cycle failed", error=repr(exc))

    async def drain_pass(self, drains: Sequence[Mapping[str, Any]] | None = None) -> None:
        """One pass over every draining cluster (``drains``: their rows, read from the store when
        None): the drain loop's body, each ``poll_s`` while drains exist."""
        for d in await moves.drains(self.pool) if drains is None else drains:
            if d["state"] == "draining":
                await self._drain_step(d)

    async def _drain_step(self, drain: Mapping[str, Any]) -> None:
        """One pass over a draining cluster: advance its moves, plan more up to its concurrency."""
        cluster = str(drain["cluster"])
        deadline_s = float(drain["deadline_s"])
        past_deadline = deadline_s > 0 and time.time() > float(drain["started_at"]) + deadline_s
        runs = {r["job_id"]: r for r in await moves.runs_on(self.pool, cluster)}
        open_rows = [m for m in await moves.open_migrations(self.pool, cluster) if m["cause"] == "drain"]
        in_flight = 0
        for m in open_rows:
            if m["state"] == "planned":
                still_open = await self._advance(m, cluster, past_deadline=past_deadline)
            else:
                still_open = True  # started: completed when the next attempt starts elsewhere
            in_flight += still_open
        moving = {m["job_id"] for m in open_rows}
        candidates = [
            _drain_job(r) for r in runs.values() if r["state"] == "running" and r["job_id"] not in moving
        ]
        # Drained once nothing runs there and every move has completed (its job started
        # elsewhere); past the deadline, once nothing runs there and no move is still to leave:
        # a job given up then may wait in the queue for room elsewhere for long, which is the
        # job's wait, not the cluster's (its move completes when it starts elsewhere).
        leaving = [m for m in open_rows if m["state"] == "planned" or not past_deadline]
        if not runs and not leaving:
            async with transaction(self.pool) as conn:
                await moves.mark_drained(conn, cluster)
            log.info("cluster drained", cluster=cluster)
            return
        free = past_deadline or in_flight < int(drain["concurrency"])
        rows = [runs[j.job_id] for j in candidates]
        pass_at = time.monotonic()
        verdicts = await self._drain_verdicts(cluster, rows) if free else {}
        # A move starts only on room placement finds now: a verdict from an earlier pass (a job
        # that waited for its turn) is asked for again first; each round asks about one job at
        # least, and a job asked in this pass is fresh, so this ends.
        chosen: list[DrainJob] = []
        for _ in range(len(candidates) + 1):
            judged_at = self._drain_judged_at
            pick = pick_moves(
                cluster,
                candidates,
                verdicts,
                fresh={
                    j.job_id
                    for j in candidates
                    if judged_at.get((cluster, j.job_id, j.attempt), -1.0) >= pass_at
                },
                in_flight=in_flight,
                concurrency=int(drain["concurrency"]),
                past_deadline=past_deadline,
            )
            chosen = pick.move
            if not pick.ask_again:
                break
            again = {(j.job_id, j.attempt) for j in pick.ask_again}
            self.stats["drain_asked_again"] = self.stats.get("drain_asked_again", 0) + len(again)
            verdicts = await self._drain_verdicts(cluster, rows, again=again)
        room = placeable(cluster, verdicts)
        if free:
            await self._note_waiting(
                cluster, candidates=candidates, chosen=chosen, room=room, verdicts=verdicts
            )
        records = [
            self._verdict_row(verdicts[job.job_id], runs[job.job_id], "move", "")
            for job in chosen
            if job.job_id in verdicts and verdicts[job.job_id].move
        ]
        if records:
            async with transaction(self.pool) as conn:
                await moves.record_verdicts(conn, records)
        for job in chosen:
            await self._plan(job, runs[job.job_id], cluster)

    async def _drain_verdicts(
        self, cluster: str, rows: Sequence[asyncpg.Record], *, again: Collection[tuple[str, int]] = ()
    ) -> dict[str, benefit.MigrationVerdict]:
        """The ``drain`` verdict of each candidate of a drain (placement's what-if, the benefit
        rule's numbers): the drain moves them largest net benefit first, ranked like every other
        plan (:func:`loom.migrate.benefit.rank_key`). A run is judged once, asked again after
        ``drain_retry_s`` when it had no room elsewhere, and asked again when ``again`` names it
        (its turn came: it moves on room found now, :func:`loom.migrate.drain.pick_moves`); a run
        asked again without an answer loses its verdict (it does not move on the old one)."""
        judged = self._drain_judged.setdefault(cluster, {})
        live = {(r["job_id"], int(r["attempt"])) for r in rows}
        for key in [k for k in judged if k not in live]:
            del judged[key]
            self._drain_judged_at.pop((cluster, *key), None)
        now_m = time.monotonic()
        retry = {  # no room elsewhere when judged: asked again, room may have appeared
            key
            for key, v in judged.items()
            if (v.target is None or v.target == cluster)
            and now_m - self._drain_judged_at.get((cluster, *key), 0.0) >= self.settings.drain_retry_s
        } | (set(again) & live)
        todo = [r for r in rows if (key := (r["job_id"], int(r["attempt"]))) not in judged or key in retry]
        if todo:
            checkpoints = await moves.checkpoints_of(self.pool, [r["job_id"] for r in todo])
            history = await moves.move_history(self.pool, [r["job_id"] for r in todo])
            now = time.time()
            for r in todo:
                found = await self._judge(
                    r,
                    "drain",
                    checkpoints=checkpoints.get(r["job_id"], []),
                    history=history.get(r["job_id"], (0, None, "")),
                    now=now,
                    step_s=None,
                    off=cluster,
                )
                key = (r["job_id"], int(r["attempt"]))
                if found is not None:
                    judged[key] = found[0]
                    self._drain_judged_at[cluster, *key] = now_m
                elif key in again:
                    judged.pop(key, None)
                    self._drain_judged_at.pop((cluster, *key), None)
        return {job_id: v for (job_id, _), v in judged.items()}

    async def _note_waiting(
        self,
        cluster: str,
        *,
        candidates: Sequence[DrainJob],
        chosen: Sequence[DrainJob],
        room: set[str],
        verdicts: Mapping[str, benefit.MigrationVerdict],
    ) -> None:
        """Say which of a drain's jobs wait for capacity (no placement elsewhere has room for them
        now): kept for ``loom drain`` (the ``drains`` query), logged, and recorded once per run as
        a ``drain`` verdict (``stay``, no target, the reason with what it needs) for ``loom
        migrations --verdicts`` and ``loom explain``. A job that found room leaves the list."""
        moving = {j.job_id for j in chosen}
        left = [j for j in candidates if j.job_id not in moving]
        if all(j.job_id in room for j in left):
            self._drain_waiting[cluster] = {}
            return
        known = await moves.known_clusters(self.pool)
        closed = await moves.drained_clusters(self.pool)
        regions = await replica_store.cluster_regions(self.pool)
        why = waiting_for_capacity(cluster, left, room, known, closed, regions=regions)
        waiting = self._drain_waiting.setdefault(cluster, {})
        now = time.time()
        kept: dict[tuple[str, int], dict[str, Any]] = {}
        records = []
        for job in left:
            if job.job_id not in why:
                continue
            key = (job.job_id, job.attempt)
            before = waiting.get(key)
            kept[key] = {
                "job_id": job.job_id,
                "attempt": job.attempt,
                "needs": needs(job),
                "why": why[job.job_id],
                "since": before["since"] if before else now,
            }
            if before is None and job.job_id in verdicts:  # judged: placement answered, no room
                records.append(
                    moves.VerdictRow(
                        job_id=job.job_id,
                        attempt=job.attempt,
                        trigger="drain",
                        decision="stay",
                        source=cluster,
                        target=None,
                        reason=why[job.job_id],
                        gain_s=None,
                        cost_s=None,
                        threshold_s=None,
                        margin_s=None,
                        link="",
                    )
                )
                log.info("drain waits for capacity", cluster=cluster, job_id=job.job_id, needs=needs(job))
        self._drain_waiting[cluster] = kept
        if records:
            async with transaction(self.pool) as conn:
                await moves.record_verdicts(conn, records)

    async def _plan(self, job: DrainJob, run: asyncpg.Record, cluster: str) -> None:
        """Plan one move: record it and ask the run's lead agent for a checkpoint now. A run whose
        earlier moves failed (an undrain failed them while planned) is planned again under the next
        id (:func:`loom.migrate.drain.next_move_id`): a cluster drained again empties."""
        context = json.loads(run["trace_context"])
        async with transaction(self.pool) as conn:
            if not await moves.hold_drain(conn, cluster):
                return  # undrained since this pass read the drains: nothing to plan, nothing left open
            migration_id = next_move_id(
                job.job_id, job.attempt, await moves.moves_of_run(conn, job.job_id, job.attempt)
            )
            if migration_id is None:
                return
            new = await moves.plan(
                conn,
                migration_id=migration_id,
                job_id=job.job_id,
                tenant=run["tenant"],
                cause="drain",
                state="planned",
                from_cluster=cluster,
                from_attempt=job.attempt,
                steps=job.steps,
                why=(
                    f"drain of {cluster}: {job.remaining_gpu_s:.0f} GPU-s left to run"
                    f" (largest benefit first); waits for a checkpoint at step >= {job.step}"
                ),
                trace_context=context,
                resume_step=job.step,
            )
            if not new:
                return
            row = await conn.fetchrow("SELECT * FROM migrations WHERE migration_id = $1", migration_id)
            messages = [
                self._message(row, "planned"),
                outbox.message(
                    subjects.cluster_command(run["lead"], "checkpoint"),
                    CheckpointJob(job_id=job.job_id, attempt=job.attempt),
                    f"{migration_id}:checkpoint",
                    context=propagate.extract(context),
                ),
            ]
            await outbox.add(conn, PRODUCER, messages)
        self.stats["planned"] += 1
        await self._publish(messages)

    async def _advance(
        self, m: asyncpg.Record, cluster: str, *, past_deadline: bool, avoid: Sequence[str] | None = None
    ) -> bool:
        """A planned move: start it once its checkpoint is recorded. Returns whether it is still open."""
        job_id, attempt = m["job_id"], m["from_attempt"]
        state, current = (await moves.job_states(self.pool, [job_id])).get(job_id, ("gone", attempt))
        if current != attempt or state not in ("placed", "running"):
            return await self._settle_moved_on(m, state, current)
        recorded = (await moves.checkpoints_of(self.pool, [job_id])).get(job_id, [])
        chosen = choose([c for c in recorded if c.attempt == attempt])
        waited_s = time.time() - float(m["planned_at"].timestamp())
        wanted = int(m["resume_step"])
        if chosen is not None and chosen.checkpoint is not None and chosen.step >= wanted:
            if m["cause"] == "drain" and not past_deadline and not await self._room_elsewhere(m, cluster):
                return True  # its room went while its checkpoint was taken: it keeps running, and waits
            if m["cause"] in VOLUNTARY_CAUSES and not await self._still_pays(m):
                return False  # judged again as it is to start: it no longer pays, the job stays
            why = (
                f"drain of {cluster}: {chosen.why}" if m["cause"] == "drain" else f"{m['why']}; {chosen.why}"
            )
            await self._ask_move(m, cluster, chosen.step, why, avoid=avoid)
        elif wanted == 0 and m["cause"] in VOLUNTARY_CAUSES:
            # No step done yet: nothing to save, it restarts from step 0 losing nothing.
            if not await self._still_pays(m):
                return False
            await self._ask_move(m, cluster, 0, f"{m['why']}; no step done yet", avoid=avoid)
        elif past_deadline:
            step = chosen.step if chosen is not None else 0
            why = chosen.why if chosen is not None else "restarts from step 0 (no checkpoint recorded)"
            await self._ask_move(m, cluster, step, f"drain of {cluster} past its deadline: {why}")
        elif waited_s > self.settings.checkpoint_timeout_s:
            # The request (or its report) may be lost: ask again, under a new id.
            n = int(waited_s // self.settings.checkpoint_timeout_s)
            lead = await self.pool.fetchval("SELECT cluster FROM jobs WHERE job_id = $1", job_id)
            if lead:
                await self.ctx.publisher.publish(
                    subjects.cluster_command(lead, "checkpoint"),
                    CheckpointJob(job_id=job_id, attempt=attempt),
                    msg_id=f"{m['migration_id']}:checkpoint:{n}",
                )
        return True

    async def _still_pays(self, m: asyncpg.Record) -> bool:
        """Whether a planned voluntary move still pays as it is about to start (its checkpoint
        written): the benefit rule again, on the trigger it was decided on, with placement's what-if
        now. Between the verdict and the checkpoint other work may take the room it was to use (the
        run would be given up and the job queued without GPUs) or the gain may shrink; then the move
        fails (``moot``: nothing went wrong, no alert) with why, a ``stay`` verdict is recorded and
        the job keeps running. The simulator takes the same second look (:mod:`loom.sim.migration`).
        A ``node_slow`` move (its observed step is not kept) and a move whose verdict or what-if
        cannot be read are carried out as planned."""
        job_id, attempt = m["job_id"], int(m["from_attempt"])
        said = await moves.move_verdict(self.pool, job_id, attempt)
        if said is None or said["trigger"] == "node_slow":
            return True
        runs = await moves.running_spans(self.pool, [job_id])
        if not runs:
            return True  # placed, not yet running (no live reservation to judge from): as planned
        run = runs[0]
        judged = await self._judge(
            run,
            said["trigger"],
            checkpoints=(await moves.checkpoints_of(self.pool, [job_id])).get(job_id, []),
            history=(await moves.move_history(self.pool, [job_id])).get(job_id, (0, None, "")),
            now=time.time(),
            step_s=None,
        )
        if judged is None:
            return True
        verdict = judged[0]
        if m["cause"] == "backflow" and said["target"]:
            verdict = backflow.toward(verdict, said["target"])
        if verdict.move:
            return True
        why = f"not started: judged again at its start, it no longer pays ({verdict.reason})"
        async with transaction(self.pool) as conn:
            row = await moves.fail(conn, m["migration_id"], why)
            if row is None:
                return False  # settled meanwhile
            await moves.record_verdicts(conn, [self._verdict_row(verdict, run, "stay", said["link"])])
            messages = [self._message(row, "failed", moot=True)]
            await outbox.add(conn, PRODUCER, messages)
        self._avoid.pop(m["migration_id"], None)
        self.stats["dropped_at_start"] = self.stats.get("dropped_at_start", 0) + 1
        log.info(
            "move dropped at its start", job_id=job_id, migration_id=m["migration_id"], why=verdict.reason
        )
        await self._publish(messages)
        return False

    async def _room_elsewhere(self, m: asyncpg.Record, cluster: str) -> bool:
        """Whether placement's what-if places a drain move's job off ``cluster`` now, asked as the
        move is about to start (its checkpoint recorded): room found when the move was picked may
        have been taken while the checkpoint was written. Without room (or without an answer) the
        planned move waits, the job running where it is, and is asked about again after
        ``drain_retry_s``; it holds its slot under the drain's concurrency, and past the deadline
        it starts anyway."""
        job_id, migration_id = m["job_id"], m["migration_id"]
        held_at = self._start_held_at.get(migration_id)
        if held_at is not None and time.monotonic() - held_at < self.settings.drain_retry_s:
            return False
        answer = await self._whatif(job_id)
        candidate = (answer or {}).get("candidate")
        if candidate is not None and room_off(cluster, candidate.get("clusters") or [candidate["cluster"]]):
            self._start_held_at.pop(migration_id, None)
            return True
        self._start_held_at[migration_id] = time.monotonic()
        self.stats["drain_start_held"] = self.stats.get("drain_start_held", 0) + 1
        log.info("drain move waits for room elsewhere", job_id=job_id, cluster=cluster)
        return False

    async def _settle_moved_on(self, m: asyncpg.Record, state: str, current: int) -> bool:
        """The run of a planned move is no longer live: it was given up (by our request, whose
        answer was lost, or a failover) or it ended."""
        attempt = m["from_attempt"]
        self._start_held_at.pop(m["migration_id"], None)  # it starts no more: no hold to keep
        messages: list[outbox.OutboxMessage] = []
        async with transaction(self.pool) as conn:
            if current > attempt or state == "queued":
                resume = await conn.fetchval("SELECT resume_step FROM jobs WHERE job_id = $1", m["job_id"])
                row = await moves.mark_started(
                    conn, m["migration_id"], resume_step=int(resume or 0), lost_steps=0, why=m["why"]
                )
                if row is not None:
                    messages.append(self._message(row, "started"))
                still_open = True
            else:
                row = await moves.fail(conn, m["migration_id"], f"the run ended ({state}) before it moved")
                if row is not None:
                    messages.append(self._message(row, "failed", moot=True))
                still_open = False
            await outbox.add(conn, PRODUCER, messages)
        await self._publish(messages)
        return still_open

    async def _ask_move(
        self, m: asyncpg.Record, cluster: str, step: int, why: str, *, avoid: Sequence[str] | None = None
    ) -> None:
        """Ask placement to give the run up and queue the job again from ``step``, avoiding ``cluster``."""
        request = {
            "job_id": m["job_id"],
            "attempt": m["from_attempt"],
            "resume_step": step,
            "reason": why[:1024],
            "avoid": list(avoid) if avoid is not None else [cluster],
            "from_cluster": cluster,
        }
        try:
            reply = await self.ctx.nc.request(
                subjects.PLACEMENT_MIGRATE, json.dumps(request).encode(), timeout=self.settings.ask_timeout_s
            )
            answer = json.loads(reply.data)
        except Exception as exc:  # no answer: the next pass reads the store and asks again if need be
            log.info("move not answered", job_id=m["job_id"], error=repr(exc))
            return
        if not answer.get("ok") or not answer.get("requeued"):
            log.info("move not done", job_id=m["job_id"], answer=answer)
            return
        progress = await self.pool.fetchval("SELECT progress FROM jobs WHERE job_id = $1", m["job_id"])
        lost = max(int(float(progress or 0.0) * int(m["steps"]) + 1e-6) - step, 0)
        async with transaction(self.pool) as conn:
            row = await moves.mark_started(
                conn, m["migration_id"], resume_step=step, lost_steps=lost, why=why
            )
            messages = [self._message(row, "started")] if row is not None else []
            await outbox.add(conn, PRODUCER, messages)
        self._start_held_at.pop(m["migration_id"], None)  # started (past a deadline, too)
        self.stats["started"] += len(messages)
        await self._publish(messages)

    # ---- network-driven moves ------------------------------------------------------------------

    async def on_checkpointed(self, _msg: Msg) -> None:
        """An agent reported a checkpoint (core NATS, unread): the replica loop looks soon."""
        self._replicas_due_until = time.monotonic() + self.settings.idle_poll_s
        self._wake_replicas.set()

    async def on_link(self, msg: Msg) -> None:
        """``loom.net.link.<src>.<dst>``: keep the latest measured state of each link."""
        try:
            state = decode(msg.data, LinkState)
        except DecodeError:
            return
        self.links[state.src, state.dst] = state

    async def on_net_event(self, msg: Msg) -> None:
        """``loom.net.event.degraded`` / ``recovered``: review the jobs the link concerns."""
        try:
            event: LinkEventMessage = decode(msg.data, LinkEventMessage)  # type: ignore[arg-type]
        except DecodeError:
            return
        self._link_events.put_nowait(event)

    async def _network_loop(self) -> None:
        """Review each link event's jobs, in order; between events, the jobs of the links still
        degraded when their recheck falls due (one loop: two reviews never plan the same job)."""
        while True:
            due_at = self.degraded.next_due()
            timeout = None if due_at is None else max(due_at - time.monotonic(), 0.0)
            try:
                # An event already queued comes before a recheck (it may be the link's recovery).
                event = (
                    self._link_events.get_nowait()
                    if not self._link_events.empty()
                    else await asyncio.wait_for(self._link_events.get(), timeout)
                )
            except TimeoutError:
                for pair in self.degraded.due(time.monotonic()):
                    src, dst = sorted(pair)
                    try:
                        await self.recheck_link(src, dst)
                    except asyncio.CancelledError:
                        raise
                    except Exception as exc:
                        log.warning("link recheck failed", src=src, dst=dst, error=repr(exc))
                continue
            await asyncio.sleep(self.settings.review_delay_s)
            try:
                await self.review_link(event)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("link review failed", src=event.src, dst=event.dst, error=repr(exc))

    async def _use_loop(self) -> None:
        """Announce the links running jobs span (``loom.net.use``, :func:`links_in_use`): every
        ``use_every_s`` while any is, once empty when the last job spanning one is gone; with
        none, look again only on a job's start or after ``use_idle_s``."""
        settings = self.settings
        announced = False
        while True:
            self._wake_use.clear()
            try:
                use = links_in_use(await moves.spanned_regions(self.pool))
                if use or announced:
                    message = LinksInUse(
                        links=[LinkInUse(src=s, dst=d, jobs=n) for (s, d), n in sorted(use.items())],
                        ttl_s=settings.use_ttl_s,
                        at=time.time(),
                    )
                    await self.ctx.nc.publish(subjects.NET_USE, encode(message))
                announced = bool(use)
                self.stats["links_in_use"] = len(use)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("links in use not announced", error=repr(exc))
                announced = True  # look again soon
            # A burst of starts costs one look a ``use_gap_s``, not one each.
            await asyncio.sleep(settings.use_gap_s)  # pacing the store's reads
            wait = (settings.use_every_s if announced else settings.use_idle_s) - settings.use_gap_s
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake_use.wait(), max(wait, 0.0))

    async def review_link(self, event: LinkEventMessage) -> list[benefit.MigrationVerdict]:
        """Decide, for every running job whose parts span the link, whether it moves (degraded:
        ``link_degraded``; recovered: ``link_improved``, which also looks at the jobs moved off
        it, so the cool-down and hysteresis keep them from bouncing back); start the moves the
        budget allows, through the drains' path (checkpoint, give up, re-place); record every
        verdict with its numbers."""
        recovered = isinstance(event, LinkRecovered)
        again = False
        if recovered:
            self.degraded.recovered(event.src, event.dst)
        else:
            # The other direction of a pair already degraded (each direction is measured and
            # reported on its own) is the same episode: a stay or deferral is recorded again only
            # when it differs, as at a recheck (it was recorded twice over, alike, when the second
            # direction's event came after the first review).
            again = not self.degraded.degraded(event.src, event.dst, time.monotonic())
        return await self._review_link(event.src, event.dst, recovered=recovered, recheck=again)

    async def recheck_link(self, src: str, dst: str) -> list[benefit.MigrationVerdict]:
        """A link still degraded ``rule.recheck_s`` after its last review: its jobs again, as for
        the degradation (``link_degraded``). A job that stayed then — no room elsewhere, or a move
        that did not pay — moves once the benefit rule says so; a stay or deferral is recorded
        again only when it differs from the job's last one on this link."""
        self.stats["rechecks"] += 1
        return await self._review_link(src, dst, recovered=False, recheck=True)

    async def _review_link(
        self, src: str, dst: str, *, recovered: bool, recheck: bool = False
    ) -> list[benefit.MigrationVerdict]:
        trigger: benefit.Trigger = "link_improved" if recovered else "link_degraded"
        link = f"{src}->{dst}"
        rows = await moves.running_spans(self.pool)
        open_ids = {m["job_id"] for m in await moves.open_migrations(self.pool)}
        pair = DegradedLinks.pair(src, dst)
        concerned = []
        if recovered:
            # The jobs that left this link when it degraded (their last move a network one, off
            # it): the recovery may draw them back. The jobs still over it only gain; the
            # simulator's migrator looks at the same ones (before, every job whose last move was
            # a network one, off any link, and every job over this one, were reviewed).
            history = await moves.move_history(self.pool, [r["job_id"] for r in rows])
            left = await moves.links_left(self.pool, [r["job_id"] for r in rows])
            for r in rows:
                last = history.get(r["job_id"], (0, None, ""))[2]
                off = frozenset(left.get(r["job_id"], "").split("->", 1))
                if r["job_id"] not in open_ids and last == "network" and off == pair:
                    concerned.append(r)
        else:
            for r in rows:
                users = users_of(_spec(r))
                if r["job_id"] not in open_ids and concerned_by_link(
                    set(r["regions"]), src, dst, users=users
                ):
                    concerned.append(r)
        self.stats["reviews"] += 1
        plan = await self._review(
            concerned, trigger, about=f"link {link}", link=link, cause="network", recheck=recheck
        )
        # Forget what no recheck will compare with: the link recovered, the job moved or left it.
        # A recovered direction of a pair still degraded looks at the jobs moved off the link, not
        # the ones still on it: what those were told stands (forgetting it there recorded a
        # second alike stay when that direction degraded again).
        still = {r["job_id"] for r in concerned}
        moving = {v.job_id for v in plan.start}
        for job_id, on in list(self._link_said):
            gone = not recovered and job_id not in still
            if on == pair and (pair not in self.degraded or gone or job_id in moving):
                del self._link_said[job_id, on]
        return [*plan.start, *(v for v, _ in plan.deferred), *plan.stay]

    async def _review(
        self,
        concerned: Sequence[asyncpg.Record],
        trigger: benefit.Trigger,
        *,
        about: str,
        cause: str,
        link: str = "",
        toward: str | None = None,
        observed_step_s: Mapping[str, float] | None = None,
        recheck: bool = False,
    ) -> benefit.Plan:
        """Decide with the benefit rule, for each of the ``concerned`` running jobs (``running_spans``
        rows), whether it moves on ``trigger``; plan the moves the budget allows (largest net
        benefit first), record every verdict, and plan each move to start (checkpoint, give up,
        re-place). ``toward``: only a move to that cluster counts (a cluster joined or improved).
        ``observed_step_s``: job -> its step as observed (a slow node), instead of the predicted one.
        ``recheck``: a degraded link's jobs looked at again; a stay or deferral is recorded only when
        the job's last recorded verdict on that link differed (decision or target)."""
        empty = benefit.Plan(start=[], deferred=[], stay=[])
        if not concerned:
            return empty
        checkpoints = await moves.checkpoints_of(self.pool, [r["job_id"] for r in concerned])
        history = await moves.move_history(self.pool, [r["job_id"] for r in concerned])
        now = time.time()
        verdicts: list[benefit.MigrationVerdict] = []
        context: dict[str, tuple[asyncpg.Record, dict[str, Any]]] = {}
        regions: dict[str, str] = {}
        for r in concerned:
            judged = await self._judge(
                r,
                trigger,
                checkpoints=checkpoints.get(r["job_id"], []),
                history=history.get(r["job_id"], (0, None, "")),
                now=now,
                step_s=(observed_step_s or {}).get(r["job_id"]),
            )
            if judged is None:
                continue
            verdict, avoid, step, where = judged
            if toward is not None:
                verdict = backflow.toward(verdict, toward)
            verdicts.append(verdict)
            context[r["job_id"]] = (r, {"avoid": avoid, "step": step})
            regions.update(where)
        budget = benefit.MigrationBudget(
            per_cluster=self.settings.per_cluster, per_link=self.settings.per_link
        )
        for m in await moves.open_migrations(self.pool):
            if m["cause"] in VOLUNTARY_CAUSES:
                budget.clusters[m["from_cluster"]] += 1
        plan = benefit.plan_migrations(verdicts, regions, budget)
        records = [self._verdict_row(v, context[v.job_id][0], "move", link) for v in plan.start]
        records += [
            self._verdict_row(v, context[v.job_id][0], "deferred", link, why) for v, why in plan.deferred
        ]
        records += [self._verdict_row(v, context[v.job_id][0], "stay", link) for v in plan.stay]
        pair = frozenset(link.split("->")) if link and trigger == "link_degraded" else None
        # A link's recheck, and a cluster's reviews (a joined one is looked at again every few
        # seconds while it settles), record a stay or a deferral only when it differs from the
        # job's last recorded verdict there (the numbers move a little at every look).
        records = _news(records, self._link_said, pair if recheck else None)
        records = _news(records, self._cluster_said, toward)
        async with transaction(self.pool) as conn:
            await moves.record_verdicts(conn, records)
        _remember(records, self._link_said, pair)
        _remember(records, self._cluster_said, toward)
        for record in records:
            self.stats["verdicts"][record.decision] += 1
        for v in plan.start:
            r, extra = context[v.job_id]
            await self._plan_network(v, r, extra["step"], extra["avoid"], about, cause=cause)
        log.info(
            "jobs reviewed",
            about=about,
            trigger=trigger,
            moves=[v.job_id for v in plan.start],
            stays=[v.job_id for v in plan.stay],
            deferred=[v.job_id for v, _ in plan.deferred],
        )
        return plan

    async def _judge(
        self,
        r: asyncpg.Record,
        trigger: benefit.Trigger,
        *,
        checkpoints: Sequence[Checkpoint],
        history: tuple[int, float | None, str],
        now: float,
        step_s: float | None,
        off: str | None = None,
    ) -> tuple[benefit.MigrationVerdict, list[str], int, dict[str, str]] | None:
        """One job's verdict from placement's what-if (None: no answer, looked at next time), with
        the clusters its re-placement avoids, the step it is at and cluster -> region of both ends.
        ``off``: a cluster the job must leave (a drain): a candidate with any part on it is no room
        (a gang spanning it re-placed where it is, its member part still there), so the verdict
        is to stay, waiting for capacity elsewhere."""
        answer = await self._whatif(r["job_id"])
        if answer is None:
            return None
        current, candidate = answer["current"], candidate_of(answer.get("candidate"))
        if off is not None and candidate is not None:
            parts = (answer.get("candidate") or {}).get("clusters") or [candidate.cluster]
            if not room_off(off, parts):
                candidate = None
        lead = (current.get("clusters") or [r["lead"]])[0]
        lead_region = (current.get("regions") or [""])[0]
        spec = _spec(r)
        chosen = choose([c for c in checkpoints if c.attempt == r["attempt"]])
        n_moves, last_moved, _ = history
        job = running_state(
            spec,
            attempt=int(r["attempt"]),
            progress=float(r["progress"]),
            cluster=lead,
            region=lead_region,
            step_s=step_s if step_s is not None else float(current.get("step_s") or 0.0),
            checkpoint_step=chosen.step if chosen is not None and chosen.checkpoint is not None else None,
            moves=n_moves,
            last_moved_s=last_moved,
        )
        if candidate is not None and set(answer["candidate"].get("clusters", [])) == set(
            current.get("clusters", [])
        ):
            path: benefit.PathState | None = benefit.LOCAL_PATH  # it would be placed where it is
        else:
            path = path_between(self.links, lead_region, candidate.region) if candidate is not None else None
        # The queue the move would deprive there (the queue's loss), as placement sees it.
        queued = options_from_wire((answer.get("candidate") or {}).get("queued"))
        verdict = benefit.decide(
            job,
            candidate,
            path or UNMEASURED_PATH,
            now_s=now,
            trigger=trigger,
            settings=self.settings.rule,
            queued=queued,
        )
        if trigger == "node_slow":
            avoid: list[str] = []  # its suspect nodes are closed; the rest of its cluster is not
        else:
            avoid = [c for c in current.get("clusters", []) if candidate is None or c != candidate.cluster]
        where = {lead: lead_region}
        if candidate is not None:
            where[candidate.cluster] = candidate.region
        return verdict, avoid, int(job.steps_done), where

    def _verdict_row(
        self, v: benefit.MigrationVerdict, r: asyncpg.Record, decision: str, link: str, why: str = ""
    ) -> moves.VerdictRow:
        return moves.VerdictRow(
            job_id=v.job_id,
            attempt=int(r["attempt"]),
            trigger=v.trigger,
            decision=decision,
            source=v.source,
            target=v.target,
            reason=v.reason + (f"; deferred: {why}" if why else ""),
            gain_s=v.gain_s,
            cost_s=v.cost.total_s if v.cost is not None else None,
            threshold_s=v.threshold_s,
            margin_s=v.margin_s,
            link=link,
        )

    async def _whatif(self, job_id: str) -> dict[str, Any] | None:
        """Placement's what-if for a running job (None: no answer, the job is looked at next time)."""
        try:
            reply = await self.ctx.nc.request(
                subjects.PLACEMENT_WHATIF,
                json.dumps({"job_id": job_id}).encode(),
                timeout=self.settings.ask_timeout_s,
            )
            answer: dict[str, Any] = json.loads(reply.data)
        except Exception as exc:
            log.info("what-if not answered", job_id=job_id, error=repr(exc))
            return None
        return answer if answer.get("ok") else None

    async def _plan_network(
        self,
        v: benefit.MigrationVerdict,
        run: asyncpg.Record,
        step: int,
        avoid: list[str],
        about: str,
        *,
        cause: str = "network",
    ) -> None:
        """Plan a voluntary move (``network``: a link or a slow node; ``backflow``: a cluster joined,
        returned or improved): record it and ask the run's lead agent for a checkpoint now (the
        moves loop then gives the run up once that checkpoint is recorded)."""
        attempt = int(run["attempt"])
        context = json.loads(run["trace_context"])
        steps = int(json.loads(run["spec"]).get("work", {}).get("steps", 0))
        async with transaction(self.pool) as conn:
            # After a failed move of this run (a drain's, undrained) the next id: see _plan.
            migration_id = next_move_id(v.job_id, attempt, await moves.moves_of_run(conn, v.job_id, attempt))
            if migration_id is None:
                return
            new = await moves.plan(
                conn,
                migration_id=migration_id,
                job_id=v.job_id,
                tenant=run["tenant"],
                cause=cause,
                state="planned",
                from_cluster=v.source,
                from_attempt=attempt,
                steps=steps,
                why=f"{about} ({v.trigger}): {v.reason}",
                trace_context=context,
                resume_step=step,
            )
            if not new:
                return
            row = await conn.fetchrow("SELECT * FROM migrations WHERE migration_id = $1", migration_id)
            messages = [
                self._message(row, "planned"),
                outbox.message(
                    subjects.cluster_command(run["lead"], "checkpoint"),
                    CheckpointJob(job_id=v.job_id, attempt=attempt),
                    f"{migration_id}:checkpoint",
                    context=propagate.extract(context),
                ),
            ]
            await outbox.add(conn, PRODUCER, messages)
        self._avoid[migration_id] = avoid
        self.stats["planned"] += 1
        await self._publish(messages)

    async def _moves_loop(self) -> None:
        """Advance planned network and backflow moves (a drain's are advanced by its own loop)."""
        busy = True
        while True:
            await self._pause(self._wake_moves, busy)
            self._wake_moves.clear()
            busy = True  # a failed pass polls again soon
            try:
                planned = [
                    m
                    for m in await moves.open_migrations(self.pool)
                    if m["cause"] in VOLUNTARY_CAUSES and m["state"] == "planned"
                ]
                busy = bool(planned)
                for m in planned:
                    avoid = self._avoid.get(m["migration_id"], [m["from_cluster"]])
                    await self._advance(m, m["from_cluster"], past_deadline=False, avoid=avoid)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("moves cycle failed", error=repr(exc))

    # ---- checkpoint replicas -------------------------------------------------------------------

    async def _replica_loop(self) -> None:
        while True:
            idle = self._replicas_idle and not self._copies and time.monotonic() >= self._replicas_due_until
            await self._pause(self._wake_replicas, not idle, self.settings.replica_poll_s)
            self._wake_replicas.clear()
            self._replicas_idle = False  # a failed pass polls again soon
            try:
                await self.replicate()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("replica cycle failed", error=repr(exc))

    async def _time_recorded(self, copying: list[asyncpg.Record], free: int) -> tuple[dict[str, str], int]:
        """Time the copies recorded in flight that this process does not time (it restarted), up
        to ``free``; returns the cluster regions (read only if one was due) and how many started."""
        untimed = [
            row
            for row in copying
            if (row["job_id"], row["attempt"], row["step"], row["cluster"]) not in self._copies
        ][:free]
        regions = await replica_store.cluster_regions(self.pool) if untimed else {}
        for row in untimed:
            self._time_copy(
                (row["job_id"], row["attempt"], row["step"], row["cluster"]),
                float(row["transfer_s"]),
                regions.get(row["source_cluster"], ""),
                regions.get(row["cluster"], ""),
            )
        return regions, len(untimed)

    async def replicate(self) -> int:
        """Start the replica copies that are due, up to the concurrency left; returns how many.

        Copies recorded in flight but not timed by this process (it restarted) are timed again
        first; then every running job whose latest checkpoint has no replica yet (those with no
        replica at all first), one copy per job at a time."""
        free = self.settings.replica_concurrency - len(self._copies)
        if free <= 0:
            return 0
        copying = await replica_store.copying(self.pool)
        # The regions are read only when a copy may start: an idle pass is two cheap reads.
        regions, started = await self._time_recorded(copying, free)
        if started >= free:
            return started
        latest = await replica_store.latest_checkpoints(self.pool)
        self._replicas_idle = not latest and not copying and not self._copies
        if not latest:
            return started
        regions = regions or await replica_store.cluster_regions(self.pool)
        sites = await replica_store.live_sites(self.pool)
        held = await replica_store.held(self.pool)
        have = {(h.job_id, h.attempt, h.step) for h in held}
        replicated = {h.job_id for h in held}
        busy = {key[0] for key in self._copies}
        unplaced: dict[str, str] = {}
        for c in sorted(latest, key=lambda c: (c.job_id in replicated, c.job_id)):
            if started >= free:
                break
            if (c.job_id, c.attempt, c.step) in have or c.job_id in busy:
                continue
            fields = {k: v for k, v in c.spec.items() if k in JobSpec.__struct_fields__}
            try:
                spec = msgspec.convert(fields, JobSpec)
            except msgspec.ValidationError as exc:  # one odd row must not stop every job's copies
                unplaced[c.job_id] = f"spec not read: {exc}"
                continue
            source = Site(c.cluster, regions.get(c.cluster, ""))
            plan, skipped = plan_copy(
                job_id=c.job_id,
                attempt=c.attempt,
                step=c.step,
                source=source,
                full_bytes=float(c.checkpoint_bytes) or benefit.checkpoint_bytes_of(spec),
                checkpoint_every_steps=spec.work.checkpoint_every_steps,
                changed_fraction=changed_fraction_of(spec.labels, self.settings.replicas.changed_fraction),
                sites=sites,
                path=functools.partial(path_of, self.links),
                held=held,
                settings=self.settings.replicas,
                interval_s=checkpoint_interval_s(
                    step=c.step,
                    at_s=c.at_s,
                    previous_step=c.previous_step,
                    previous_at_s=c.previous_at_s,
                    checkpoint_every_steps=spec.work.checkpoint_every_steps,
                    time_scale=self.settings.time_scale,
                ),
            )
            if plan is None:
                unplaced[c.job_id] = "; ".join(skipped) or "no other cluster"
                continue
            uri = f"replica://{plan.target}/{c.job_id}/{c.attempt}/{c.step}"
            async with transaction(self.pool) as conn:
                recorded = await replica_store.start_copy(conn, plan, c, uri)
            if not recorded:
                continue
            held.append(
                Held(
                    c.job_id,
                    c.attempt,
                    c.step,
                    plan.target,
                    plan.stored_bytes,
                    time.time(),
                    False,
                    ready=False,
                )
            )
            held = [h for h in held if h not in plan.evict]
            key = (c.job_id, c.attempt, c.step, plan.target)
            self._time_copy(key, plan.transfer_s, source.region, regions.get(plan.target, ""))
            self.stats["replicas"]["started"] += 1
            self.stats["replicas"]["bytes_sent"] += round(plan.transfer_bytes)
            log.debug("replica copy started", job_id=c.job_id, step=c.step, to=plan.target, why=plan.why)
            started += 1
        self.stats["replicas"]["unplaced"] = unplaced
        return started

    def _time_copy(
        self, key: tuple[str, int, int, str], transfer_s: float, src_region: str, dst_region: str
    ) -> None:
        """Wait the copy's transfer time on the agents' clock, then record it ready (or failed when
        its path went down meanwhile)."""

        async def copy() -> None:
            try:
                await asyncio.sleep(max(transfer_s, 0.0) / max(self.settings.time_scale, 1e-9))
                ok = (
                    not src_region
                    or not dst_region
                    or path_of(self.links, src_region, dst_region) is not None
                )
                why = "" if ok else f"the path {src_region}->{dst_region} went down during the copy"
                async with transaction(self.pool) as conn:
                    done = await replica_store.finish_copy(conn, *key, ok=ok, why=why)
                if done:
                    self.stats["replicas"]["ready" if ok else "failed"] += 1
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # left copying: the loop times it again
                log.warning("replica copy not recorded", key=key, error=repr(exc))
            finally:
                self._copies.pop(key, None)

        self._copies[key] = asyncio.create_task(copy())

    # ---- clusters joining, returning, improving; drains ending (backflow) ---------------------

    async def _clusters_loop(self) -> None:
        """Read the schedulable GPUs per cluster every few seconds; review the running jobs on each
        join, return or growth, and after each undrain. A review whose moves the budget deferred
        is done again at the next reading: work flows back a few moves at a time; one whose jobs
        a cool-down held back (they just failed over or drained off, and the move would pay) is
        done again when the earliest such cool-down ends."""
        seen: dict[str, int] | None = None  # the first reading is the baseline: nothing joined
        while True:
            if seen is not None:
                await asyncio.sleep(self.settings.clusters_every_s)
            try:
                await self._end_moot()
                known = await moves.known_clusters(self.pool)
                gpus = {cluster: sum(models.values()) for cluster, models in known.items()}
                if seen is not None and self.settings.review_clusters:
                    for cluster, trigger in backflow.cluster_triggers(
                        seen, gpus, improve_share=self.settings.improve_share
                    ).items():
                        what = "joined" if trigger == "cluster_joined" else "improved"
                        what += f" ({seen.get(cluster, 0)} -> {gpus[cluster]} schedulable GPUs)"
                        self._cluster_reviews.setdefault(cluster, (trigger, f"cluster {cluster} {what}"))
                        if trigger == "cluster_joined":
                            self._joined_at[cluster] = time.time()
                seen = gpus
                closed = await moves.drained_clusters(self.pool)
                for cluster, (trigger, about) in list(self._cluster_reviews.items()):
                    if self._review_after.get(cluster, 0.0) > time.time():
                        continue  # a cool-down holds its jobs back yet
                    del self._cluster_reviews[cluster]
                    self._review_after.pop(cluster, None)
                    if cluster in closed or not self.settings.review_clusters:
                        continue
                    plan = await self.review_cluster(cluster, trigger, about)
                    held = backflow.held_until(plan.stay, cluster)
                    recheck = backflow.settling_recheck(
                        plan.stay,
                        cluster,
                        joined_at=self._joined_at.get(cluster) if trigger == "cluster_joined" else None,
                        now=time.time(),
                        settle_s=self.settings.join_settle_s,
                        recheck_s=self.settings.join_recheck_s,
                    )
                    again = bool(plan.deferred) or held is not None or recheck is not None
                    if again:
                        # Deferred by the budget: again at the next reading; held by a cool-down
                        # (a job that just failed over or drained off): again when it ends; a
                        # cluster just back that placement may not have reopened yet: again soon.
                        self._cluster_reviews.setdefault(cluster, (trigger, about))
                        if not plan.deferred:
                            self._review_after[cluster] = min(t for t in (held, recheck) if t is not None)
                    self._reviews_of(cluster, ended=not again)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("cluster review failed", error=repr(exc))
                await asyncio.sleep(self.settings.clusters_every_s)

    def _reviews_of(self, cluster: str, *, ended: bool) -> None:
        """A cluster's reviews ``ended`` (none is due again): the next one records every verdict
        afresh (what was said in these is forgotten)."""
        for key in [k for k in self._cluster_said if k[1] == cluster] if ended else []:
            del self._cluster_said[key]

    async def review_cluster(self, cluster: str, trigger: benefit.Trigger, about: str) -> benefit.Plan:
        """Decide, for every running job with no part on ``cluster`` (and no move open), whether it
        moves there (``cluster_joined`` / ``cluster_improved``): the benefit rule against the
        framework's placement now, a move elsewhere counting as a stay (:func:`backflow.toward`);
        the moves start as backflow under the budget, the cool-down and the hysteresis."""
        rows = await moves.running_spans(self.pool)
        open_ids = {m["job_id"] for m in await moves.open_migrations(self.pool)}
        elsewhere = set(backflow.not_on({r["job_id"]: r["clusters"] for r in rows}, cluster))
        concerned = [r for r in rows if r["job_id"] in elsewhere and r["job_id"] not in open_ids]
        self.stats["cluster_reviews"] += 1
        return await self._review(concerned, trigger, about=about, cause="backflow", toward=cluster)

    # ---- slow nodes (placement tells) -----------------------------------------------------------

    async def on_cluster_health(self, msg: Msg) -> None:
        """``loom.placement.cluster_health``: a cluster placement found failed and now healthy again
        is reviewed as a returning one (``cluster_joined``), as a reading of its schedulable GPUs
        would find it back from none. A failure shorter than the readings' period was seen by no
        reading, and the jobs it moved never flowed back (a CI run: failed and back within 1 s)."""
        try:
            change = msgspec.json.decode(msg.data, type=ClusterHealthChanged)
        except msgspec.DecodeError as exc:
            log.info("bad cluster health ignored", error=repr(exc))
            return
        if change.state == "failed":
            self._failed.add(change.cluster)
        elif change.state == "healthy" and change.cluster in self._failed:
            self._failed.discard(change.cluster)
            if self.settings.review_clusters:
                about = f"cluster {change.cluster} returned from a failure"
                self._cluster_reviews.setdefault(change.cluster, ("cluster_joined", about))
                self._joined_at[change.cluster] = time.time()

    async def on_slow(self, msg: Msg) -> None:
        """``loom.placement.slow``: a run delivers under half its predicted step rate; review it."""
        try:
            report = json.loads(msg.data)
            self._slow.put_nowait(
                {
                    "job_id": str(report["job_id"]),
                    "attempt": int(report["attempt"]),
                    "observed_step_s": float(report["observed_step_s"]),
                    "nodes": [str(n) for n in report.get("nodes", [])],
                    "reason": str(report.get("reason", ""))[:512],
                }
            )
        except (ValueError, KeyError, TypeError) as exc:
            log.info("bad slow-run report ignored", error=repr(exc))

    async def _slow_loop(self) -> None:
        while True:
            report = await self._slow.get()
            try:
                await self.review_slow(report)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("slow-run review failed", job_id=report["job_id"], error=repr(exc))

    async def review_slow(self, report: Mapping[str, Any]) -> benefit.Plan:
        """A slow run (trigger ``node_slow``): the benefit rule with its observed step where it runs
        (its suspect nodes closed to the what-if), moved when that pays, by the same path."""
        rows = [
            r
            for r in await moves.running_spans(self.pool)
            if r["job_id"] == report["job_id"] and int(r["attempt"]) == report["attempt"]
        ]
        if rows and any(m["job_id"] == report["job_id"] for m in await moves.open_migrations(self.pool)):
            rows = []
        self.stats["slow_reviews"] += 1
        nodes = ", ".join(report["nodes"]) or "its nodes"
        return await self._review(
            rows,
            "node_slow",
            about=f"slow node(s) {nodes}: {report['reason']}",
            cause="slow_node",
            observed_step_s={report["job_id"]: report["observed_step_s"]},
        )

    # ---- queries and events --------------------------------------------------------------------

    async def on_query(self, msg: Msg) -> None:
        """``loom.migrate.query``: ``list`` (migrations, of a job or from a cluster) or ``drains``."""
        if not answerable(msg):  # a reply that is no inbox: dropped (loom.bus.reply)
            return
        try:
            request = json.loads(msg.data or b"{}")
            op = request.get("op", "list")
            if op == "list":
                result: object = await moves.list_migrations(
                    self.pool,
                    job_id=request.get("job_id"),
                    cluster=request.get("cluster"),
                    limit=min(int(request.get("limit", 200)), 10_000),
                )
            elif op == "drains":
                result = [
                    {**d, "waiting": list(self._drain_waiting.get(d["cluster"], {}).values())}
                    for d in await moves.drains(self.pool)
                ]
            elif op == "replicas":
                result = await replica_store.list_replicas(
                    self.pool,
                    job_id=request.get("job_id"),
                    cluster=request.get("cluster"),
                    limit=min(int(request.get("limit", 200)), 10_000),
                )
            elif op == "verdicts":
                result = await moves.list_verdicts(
                    self.pool, job_id=request.get("job_id"), limit=min(int(request.get("limit", 200)), 10_000)
                )
            else:
                raise ValueError(f"unknown op {op!r}")
            reply = {"ok": True, "result": result}
        except Exception as exc:  # any bad request gets an answer, never a crash
            reply = {"ok": False, "error": str(exc)}
        await respond(msg, json.dumps(reply).encode())

    def _message(
        self, row: asyncpg.Record, kind: MigrationKind, *, moot: bool = False
    ) -> outbox.OutboxMessage:
        """The migration event of ``row`` at ``kind``, in the job's trace (``moot``: a ``failed``
        move that no longer mattered, :attr:`MigrationEvent.moot`)."""
        event = MigrationEvent(
            migration_id=row["migration_id"],
            kind=kind,
            job_id=row["job_id"],
            tenant=row["tenant"],
            cause=row["cause"],
            from_cluster=row["from_cluster"],
            to_cluster=row["to_cluster"] or "",
            from_attempt=row["from_attempt"],
            resume_step=row["resume_step"],
            steps=max(int(row["steps"]), 0),
            progress_lost_steps=max(int(row["lost_steps"]), 0),
            why=row["why"][:2048],
            moot=moot,
            at=time.time(),
        )
        if kind in ("completed", "failed"):
            self.stats[kind] += 1
        context = propagate.extract(json.loads(row["trace_context"]))
        return outbox.message(
            subjects.migration_event(kind, row["tenant"]),
            event,
            f"{row['migration_id']}:{kind}",
            context=context,
        )

    async def _publish(self, messages: list[outbox.OutboxMessage]) -> None:
        # Every move this process records is published here: the moves loop looks at once.
        self._wake_moves.set()
        if messages:
            with contextlib.suppress(Exception):  # the relay sends what did not go now
                await self.relay.publish_now(messages)


def _spec(row: asyncpg.Record) -> JobSpec:
    """The job spec a run's row holds (its stored fields a spec knows)."""
    fields = {k: v for k, v in json.loads(row["spec"]).items() if k in JobSpec.__struct_fields__}
    return msgspec.convert(fields, JobSpec)


def _drain_job(row: asyncpg.Record) -> DrainJob:
    """A drain candidate from a ``runs_on`` row."""
    spec = json.loads(row["spec"])
    work = spec.get("work", {})
    resources = spec.get("resources", {})
    steps = int(work.get("steps", 1))
    gpus = int(resources.get("gpus", 1)) * max(int(spec.get("workers", 1) or 1), 1)
    pipeline = bool(spec.get("pipeline"))
    if pipeline:  # its stages' GPUs come from its layers, not from resources
        gpus = max(int(row.get("gpus_held") or 0), 1)
    return DrainJob(
        job_id=row["job_id"],
        attempt=int(row["attempt"]),
        gpus=gpus,
        gpu_models=tuple(resources.get("gpu_models") or ()),
        steps=steps,
        step=int(float(row["progress"]) * steps + 1e-6),
        step_time_s=float(work.get("step_time_s", 1.0)),
        checkpoint_every_steps=int(work.get("checkpoint_every_steps", 0)),
        affinity=msgspec.convert(spec.get("affinity") or {}, Affinity),
        pipeline=pipeline,
    )
