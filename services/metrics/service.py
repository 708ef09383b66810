"""Metrics: the sole writer of the resource ledger.

Folds heartbeats into the ledger (pure core: :mod:`loom.model.ledger`), persists it in
PostgreSQL, publishes view deltas through the outbox, marks silent clusters stale, and answers
``loom.view.query``. On start it rebuilds the ledger from PostgreSQL.
"""

import asyncio
import hashlib
import itertools
import json
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import msgspec
import structlog
from nats.aio.msg import Msg

from loom.bus import ConsumerRunner, ConsumerSpec, Delivery, stop_runners
from loom.bus.reply import answerable, respond
from loom.errors import InvalidInputError, LoomError
from loom.metering.run import MeteredEvent
from loom.model.ledger import Change, Ledger, LedgerNode
from loom.model.profiles import device_profile
from loom.model.scu import DecayLearner, DeviceProfile, TrustTracker, scu_by_task_type
from loom.runtime.service import ServiceContext
from loom.store import inbox, outbox
from loom.store import ledger as ledger_store
from loom.store import usage as usage_store
from loom.store.pool import transaction
from loom.tasks import cancel_and_wait
from loom.telemetry import metrics as prom
from loom_proto import subjects
from loom_proto.clusters import AcceleratorProfile, ClusterHeartbeat, ClusterProfiles
from loom_proto.codec import encode
from loom_proto.jobs import JobCancelled, JobCompleted, JobFailed, JobPlaced, JobStarted
from loom_proto.view import ModelCapacity, NodeView, RegionSummary, ViewDelta, ViewQuery, ZoneSummary
from loom_services.metrics.metering import Metering

log = structlog.get_logger("metrics")
PRODUCER = "metrics"


USAGE_EVERY = 6
"""Gauge rounds between two refreshes of the usage gauges (30 s at the default 5 s rounds)."""


def _models(models: dict[str, dict[str, int]]) -> list[ModelCapacity]:
    return [ModelCapacity(gpu_model=m, **v) for m, v in sorted(models.items())]


def delta_of(change: Change, now: float, trust: float | None = None) -> ViewDelta:
    """The wire form of a ledger change."""
    return ViewDelta(
        region=change.region,
        cluster=change.cluster,
        version=change.version,
        full=change.full,
        nodes=[
            NodeView(
                node=n.node,
                zone=n.zone,
                gpu_model=n.gpu_model,
                gpus_total=n.gpus_total,
                gpus_used=n.gpus_used,
                cpu_milli=n.cpu_milli,
                memory_mib=n.memory_mib,
                healthy=n.healthy,
                updated_at=n.updated_at,
                gpus_reserved=n.gpus_reserved,
                down=n.down,
            )
            for n in change.nodes
        ],
        removed=list(change.removed),
        stale=change.stale,
        trust=round(trust, 4) if trust is not None else None,
        at=now,
    )


class MetricsService:
    """Ledger writer; :meth:`run` is the service body."""

    def __init__(
        self,
        ctx: ServiceContext,
        *,
        expire_every_s: float = 1.0,
        summary_every_s: float = 1.0,
        scu_per_gpu: Callable[[str], float] | None = None,
        reference_gpu: str = "",
        known_models: frozenset[str] | None = None,
        claimed_speed: Callable[[str, str], float] | None = None,
        reference_profile: DeviceProfile | None = None,
        price: Callable[[str, float], float] | None = None,
        gauges_every_s: float = 5.0,
    ) -> None:
        self.ctx = ctx
        self.gauges_every_s = gauges_every_s
        # The reservation overlay and the learning follow the metering consumer's deliveries
        # (one consumer of the lifecycle events, not two).
        self.metering = Metering(ctx, price or (lambda _region, _at: 0.0), on_folded=self.on_job_events)
        self.pool = ctx.db
        self.ledger = Ledger(known_models=known_models)
        self.summary_every_s = summary_every_s
        self.scu_per_gpu = scu_per_gpu or (lambda _model: 1.0)
        self.claimed_speed = claimed_speed
        self.reference_profile = reference_profile
        self.profile_tables: dict[str, dict[str, dict[str, float]]] = {}
        self.trust: dict[str, TrustTracker] = {}
        self.decay: dict[tuple[str, str], DecayLearner] = {}
        self.reference_gpu = reference_gpu
        self.published_summaries: dict[str, bytes] = {}
        self.relay = outbox.OutboxRelay(self.pool, ctx.publisher, PRODUCER)
        self.expire_every_s = expire_every_s
        self.lock = asyncio.Lock()
        ctx.stats.update({"heartbeats": 0, "refused": self.ledger.refused})

    async def load(self) -> None:
        """Rebuild the ledger from PostgreSQL."""
        clusters = await ledger_store.load_clusters(self.pool)
        nodes = await ledger_store.load_nodes(self.pool)
        self.ledger.load(clusters, nodes)
        self.trust.update(await ledger_store.load_trust(self.pool))
        self.decay.update(await ledger_store.load_decay(self.pool))
        for cluster_id, profiles in (await ledger_store.load_profiles(self.pool)).items():
            table = self._scu_table(profiles)
            if table is not None:
                self._adopt_scu(cluster_id, table)
        # Placement's unconfirmed reservations (read, never written, here) show as reserved.
        for run, allocations in (await ledger_store.unconfirmed_reservations(self.pool)).items():
            self.ledger.reserve(run, allocations)
        await self.relay.flush()
        self.ctx.stats.update({"heartbeats": self.ctx.stats["heartbeats"], "refused": self.ledger.refused})
        log.info("ledger rebuilt", clusters=len(clusters), nodes=len(nodes))

    async def run(self) -> None:
        """Consume heartbeats and expire silent clusters until asked to stop."""
        await self.load()
        runner: ConsumerRunner[ClusterHeartbeat] = ConsumerRunner(
            self.ctx.nc,
            ConsumerSpec(
                stream="CLUSTERS", durable="metrics-heartbeats", filter_subjects=[subjects.HEARTBEATS_ALL]
            ),
            ClusterHeartbeat,
            handler=self.on_heartbeat,
            publisher=self.ctx.publisher,
            callback_pull=True,
        )
        profiles: ConsumerRunner[ClusterProfiles] = ConsumerRunner(
            self.ctx.nc,
            ConsumerSpec(
                stream="CLUSTERS", durable="metrics-profiles", filter_subjects=[subjects.PROFILES_ALL]
            ),
            ClusterProfiles,
            handler=self.on_profiles,
            publisher=self.ctx.publisher,
        )
        metering = self.metering.runners()
        query_sub = await self.ctx.nc.subscribe(subjects.VIEW_QUERY, cb=self.on_query)
        await runner.start()
        await profiles.start()
        for runner_ in metering:
            await runner_.start()
        watchdog = self.ctx.watchdog
        loops = [
            watchdog.watch_consumer("heartbeats", runner),
            watchdog.watch_consumer("profiles", profiles),
            watchdog.watch_consumer("metering", metering[0]),
            watchdog.watch_consumer("metering-cancelled", metering[1]),
            watchdog.supervise("gauges", self._gauge_loop),
            watchdog.supervise("expire", self._expire_loop),
            watchdog.supervise("summaries", self._summary_loop),
        ]
        try:
            await self.ctx.stopping.wait()
        finally:
            await cancel_and_wait(loops)
            await query_sub.unsubscribe()
            await stop_runners([*metering, profiles, runner])

    async def _gauge_loop(self) -> None:
        """Refresh the capacity gauges every ``gauges_every_s``, the usage gauges every
        ``USAGE_EVERY`` rounds (they sum the whole usage table)."""
        rounds = 0
        while True:
            try:
                await self.refresh_gauges(usage=rounds % USAGE_EVERY == 0)
            except Exception as exc:  # the next round tries again
                log.warning("gauge refresh failed", error=repr(exc))
            rounds += 1
            await asyncio.sleep(self.gauges_every_s)

    async def refresh_gauges(self, *, usage: bool = True) -> None:
        """Capacity per cluster from the ledger; with ``usage``, usage per tenant, team, region
        and model from the metered rows."""
        for cluster in list(self.ledger.clusters.values()):
            nodes = [self.ledger.nodes[n] for n in cluster.nodes if n in self.ledger.nodes]
            total = sum(n.gpus_total for n in nodes)
            free = sum(n.gpus_free for n in nodes)
            labels = (cluster.region, cluster.cluster)
            prom.CLUSTER_GPUS.labels(*labels).set(total)
            prom.CLUSTER_FREE_GPUS.labels(*labels).set(free)
            prom.CLUSTER_WATER_LEVEL.labels(*labels).set((total - free) / total if total else 0.0)
            prom.CLUSTER_STALE.labels(*labels).set(1 if cluster.stale else 0)
        self.ctx.stats["metering"] = dict(self.metering.counts)
        if not usage:
            return
        for row in await usage_store.usage_totals(self.pool):
            key = (row["tenant"], row["team"], row["region"], row["gpu_model"])
            prom.USAGE_GPU_SECONDS.labels(*key).set(int(row["gpu_ms"]) / 1000.0)
            prom.USAGE_COST.labels(*key).set(float(row["cost"]))

    async def on_job_events(self, events: Sequence[MeteredEvent], fresh: Sequence[MeteredEvent]) -> None:
        """Placements show as reserved until the run starts (or ends without starting); a
        completed run teaches trust and decay.

        Fed by the metering consumer (:attr:`Metering.on_folded`) once a batch committed. Only a
        ``placed`` new to the inbox (in ``fresh``) reserves, so a placement delivered again after
        its run started cannot reserve its GPUs a second time; a start or an end settles whether
        new or not (settling is idempotent, and a run :meth:`load` restored from placement's
        reservations is settled by the redelivered start that metering had already counted).
        Every completion is offered to :meth:`_learn`, which claims it in its own inbox (a
        learning that failed is retried with the redelivery).

        Reserved GPUs are an overlay on the ledger, shown by queries and region summaries; they
        are not sent as view deltas, whose readers (placement) keep their own reservations.
        """
        new = {id(e) for e in fresh}
        for event in events:
            if isinstance(event, JobPlaced):
                if id(event) in new:
                    self.ledger.reserve(
                        f"{event.job_id}:{event.attempt}", [(a.node, a.gpus) for a in event.allocations]
                    )
            elif isinstance(event, JobCancelled):
                for run in [r for r in self.ledger.reservations if r.startswith(f"{event.job_id}:")]:
                    self.ledger.settle(run)
            elif isinstance(event, JobStarted | JobCompleted | JobFailed):
                self.ledger.settle(f"{event.job_id}:{event.attempt}")
        for event in events:
            if isinstance(event, JobCompleted):
                await self._learn(event)

    async def on_profiles(self, d: Delivery[ClusterProfiles]) -> None:
        """Store what a cluster's accelerators deliver and derive their SCU per task type."""
        message = d.message
        if d.subject != subjects.cluster_profiles(message.cluster):
            raise InvalidInputError(f"profiles of {message.cluster} published on {d.subject}")
        table = self._scu_table(message.profiles)
        if table is None:
            return
        async with transaction(self.pool) as conn:
            await ledger_store.save_profiles(
                conn, message.cluster, message.source, message.measured_at, message.profiles
            )
        self._adopt_scu(message.cluster, table)

    def _adopt_scu(self, cluster_id: str, table: dict[str, dict[str, float]]) -> None:
        self.profile_tables[cluster_id] = table
        self.ledger.published_models[cluster_id] = frozenset(table)
        cluster = self.ledger.clusters.get(cluster_id)
        if cluster is not None:
            cluster.scu = table

    def _scu_table(self, profiles: Sequence[AcceleratorProfile]) -> dict[str, dict[str, float]] | None:
        """SCU per GPU by model and task type, with the decay learned so far."""
        if self.reference_profile is None:
            return None
        table: dict[str, dict[str, float]] = {}
        for p in profiles:
            device = device_profile(p)
            decay = {t: learner.factor for (m, t), learner in self.decay.items() if m == p.gpu_model}
            scus = scu_by_task_type(device, reference=self.reference_profile, decay=decay)
            table[p.gpu_model] = {t: round(v, 4) for t, v in scus.items()}
        return table

    async def _learn(self, event: JobCompleted) -> None:
        """Compare what a finished run delivered with what its cluster's profile claimed.

        The cluster's trust rises as its jobs confirm the claim and falls when they fall short;
        the (model, task type) decay factor learns the gap between benchmark and real work.
        """
        if (
            self.claimed_speed is None
            or event.delivered_speed is None
            or event.gpu_model is None
            or event.task_type is None
            or event.cluster not in self.ledger.clusters
        ):
            return
        try:
            claimed = self.claimed_speed(event.gpu_model, event.task_type)
            tracker = self.trust.get(event.cluster, TrustTracker()).observe(event.delivered_speed, claimed)
            key = (event.gpu_model, event.task_type)
            learner = self.decay.get(key, DecayLearner()).observe(event.delivered_speed, claimed)
        except LoomError as exc:  # e.g. a model without a profile: nothing to learn from
            log.info("no learning from run", job_id=event.job_id, reason=str(exc))
            return
        async with transaction(self.pool) as conn:
            # A redelivered completion must not teach twice.
            if not await inbox.claim(conn, "metrics-learn", f"{event.job_id}:{event.attempt}"):
                return
            await ledger_store.save_learning(conn, event.cluster, tracker, key, learner)
        self.trust[event.cluster] = tracker
        self.decay[key] = learner
        self.ledger.clusters[event.cluster].trust = tracker.trust

    def _delta_message(self, change: Change) -> outbox.OutboxMessage:
        cluster = self.ledger.clusters.get(change.cluster)
        return outbox.message(
            subjects.view_delta(change.region),
            delta_of(change, time.time(), cluster.trust if cluster else None),
            f"view-{change.cluster}-{change.version}",
        )

    async def _summary_loop(self) -> None:
        """Publish each region's summary when it changed (checked every ``summary_every_s``)."""
        while True:
            await asyncio.sleep(self.summary_every_s)
            try:
                await self.publish_summaries()
            except Exception as exc:
                log.warning("summary publish failed", error=repr(exc))

    async def publish_summaries(self) -> int:
        """Publish the summaries that changed since last time; returns how many went out."""
        sent = 0
        dirty = self.ledger.take_dirty_regions()
        if not dirty:
            return 0
        for region, s in sorted(self.ledger.summaries(self.scu_per_gpu, dirty).items()):
            summary = RegionSummary(
                region=region,
                models=_models(s["models"]),
                zones=[
                    ZoneSummary(
                        zone=zone,
                        models=_models(z["models"]),
                        scu_total=round(z["scu_total"], 3),
                        scu_available=round(z["scu_available"], 3),
                    )
                    for zone, z in sorted(s["zones"].items())
                ],
                scu_total=round(s["scu_total"], 3),
                scu_available=round(s["scu_available"], 3),
                reference_gpu=self.reference_gpu,
                at=0.0,
            )
            body = encode(summary)
            if self.published_summaries.get(region) == body:
                continue
            digest = hashlib.sha256(body).hexdigest()[:16]
            await self.ctx.publisher.publish(
                subjects.view_summary(region),
                msgspec.structs.replace(summary, at=time.time()),
                msg_id=f"summary-{region}-{digest}",
            )
            self.published_summaries[region] = body
            sent += 1
        return sent

    async def on_heartbeat(self, d: Delivery[ClusterHeartbeat]) -> None:
        """Fold one heartbeat in, persist the change and publish it."""
        hb = d.message
        if d.subject != subjects.cluster_heartbeat(hb.cluster):
            self.ledger.refused["subject_mismatch"] += 1
            log.warning("heartbeat refused", reason="cluster differs from subject", subject=d.subject)
            return
        async with self.lock:
            snapshot = _snapshot(self.ledger, hb)
            applied = self.ledger.apply(hb, time.time())
            self.ctx.stats["heartbeats"] += 1
            if applied.ignored:
                log.info("heartbeat ignored", cluster=hb.cluster, reason=applied.ignored)
            for problem in applied.node_errors:
                log.warning("heartbeat node refused", cluster=hb.cluster, reason=problem)
            try:
                await self._persist([applied.change] if applied.change else [], hb.cluster)
            except BaseException:
                _restore(self.ledger, hb.cluster, snapshot)
                raise
        await self.relay.flush()

    async def _persist(self, changes: Sequence[Change], cluster_id: str) -> None:
        async with transaction(self.pool) as conn:
            await ledger_store.write_cluster(conn, self.ledger.clusters[cluster_id])
            for change in changes:
                if change.nodes:
                    await ledger_store.write_nodes(conn, change.nodes)
                if change.removed:
                    await ledger_store.delete_nodes(conn, list(change.removed))
                await outbox.add(conn, PRODUCER, [self._delta_message(change)])

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(self.expire_every_s)
            try:
                async with self.lock:
                    changes = self.ledger.expire(time.time())
                    for change in changes:
                        log.warning("cluster stale", cluster=change.cluster)
                        await self._persist([change], change.cluster)
                if changes:
                    await self.relay.flush()
            except Exception as exc:
                log.warning("expiry failed", error=repr(exc))

    async def on_query(self, msg: Msg) -> None:
        """``loom.view.query``: the tree, filtered.

        Request (all optional): ``region``, ``zone``, ``gpu_model``, ``min_free_gpus``,
        ``fresh_only``, ``nodes`` (false leaves node lists out).
        """
        if not answerable(msg):  # a reply that is no inbox: dropped (loom.bus.reply)
            return
        try:
            request = msgspec.json.decode(msg.data or b"{}", type=ViewQuery)
            reply = {
                "ok": True,
                "result": self.ledger.query(
                    now=time.time(),
                    region=request.region,
                    zone=request.zone,
                    gpu_model=request.gpu_model,
                    min_free_gpus=request.min_free_gpus,
                    fresh_only=request.fresh_only,
                    with_nodes=request.nodes,
                ),
            }
        except Exception as exc:
            reply = {"ok": False, "error": str(exc)}
        await respond(msg, json.dumps(reply).encode())


_NODE_FIELDS = (
    "zone",
    "gpu_model",
    "gpus_total",
    "gpus_used",
    "cpu_milli",
    "memory_mib",
    "healthy",
    "down",
    "updated_at",
)
"""What :meth:`Ledger.apply` may change on a node it already holds."""

_CLUSTER_FIELDS = (
    "agent_epoch",
    "last_seq",
    "interval_s",
    "last_heartbeat_at",
    "stale",
    "volatility",
    "version",
)
"""What :meth:`Ledger.apply` may change on a cluster it already holds (besides its node set)."""

_NodeUndo = tuple[LedgerNode, tuple[Any, ...]]
_Undo = tuple[tuple[Any, ...] | None, set[str], dict[str, _NodeUndo]]


def _snapshot(ledger: Ledger, hb: ClusterHeartbeat) -> _Undo:
    """What undoing ``hb``'s apply needs: the cluster's fields and node set, and the fields of
    each node the heartbeat can change (those it names; every node of the cluster for a full
    heartbeat, which removes the nodes it does not list). Nothing else changes in an apply, so a
    delta heartbeat of a 1,000-node cluster saves a handful of nodes, not the whole cluster."""
    cluster = ledger.clusters.get(hb.cluster)
    if cluster is None:
        return (None, set(), {})
    if hb.full:
        names: Iterable[str] = cluster.nodes
    else:
        names = itertools.chain((n.node for n in hb.nodes), hb.removed)
    nodes: dict[str, _NodeUndo] = {}
    for name in names:
        node = ledger.nodes.get(name)
        if node is not None and node.cluster == hb.cluster:
            nodes[name] = (node, tuple(getattr(node, f) for f in _NODE_FIELDS))
    fields = tuple(getattr(cluster, f) for f in _CLUSTER_FIELDS)
    return (fields, set(cluster.nodes), nodes)


def _restore(ledger: Ledger, cluster_id: str, snapshot: _Undo) -> None:
    """Undo an apply whose persistence failed, so the redelivery is applied afresh."""
    fields, node_set, nodes = snapshot
    current = ledger.clusters.get(cluster_id)
    if current is None:
        return
    for name in current.nodes - node_set:  # added by the apply
        ledger.nodes.pop(name, None)
    if fields is None:  # the apply created the cluster
        ledger.clusters.pop(cluster_id, None)
        return
    for name, (node, values) in nodes.items():
        for f, v in zip(_NODE_FIELDS, values, strict=True):
            setattr(node, f, v)
        ledger.nodes[name] = node  # back, if the apply removed it
    for f, v in zip(_CLUSTER_FIELDS, fields, strict=True):
        setattr(current, f, v)
    current.nodes = node_set
