"""The alert correlator: a thin shell around :class:`loom.alerts.Correlator`.

In:

* raw alerts on ``loom.alerts.raw.<source>`` (stream ALERTS; a payload that is not an
  :class:`~loom_proto.alerts.Alert`, or whose source is not its subject's, is dead-lettered);
* Alertmanager's webhook (version 4, unchanged) over HTTP (:mod:`.receiver`): parsed, then
  published as raw alerts of source ``alertmanager`` (so they are durable before the 200); a
  malformed payload is answered 400 and dead-lettered on ``loom.dlq.loom.alerts.raw.alertmanager``
  with the reason in ``Loom-Error``;
* Loom's own events (:mod:`loom.alerts.sources`): link degraded / recovered, stale clusters and
  unhealthy nodes from view deltas, failed and lost job runs, failed migrations, dead letters
  growing. These consumers start at new messages: a correlator started late does not replay a week
  of history as alerts. Placement's cluster classification (suspect / failed / healthy) and slow
  runs arrive as core NATS notices (``loom.placement.cluster_health``, ``loom.placement.slow``);
* the health of every watched Loom service (``--watch-health``): asked on ``loom.health.<instance>``
  every ``health_period_s``; missing answers or a ``degraded`` one become alerts
  (:class:`loom.alerts.sources.HealthWatch`).

Out: every incident change on ``loom.incidents.{opened,updated,resolved}`` (message id
``<incident>-v<version>``), to each ``--webhook`` URL (JSON POST, in the core's rate limit), and
into the ``incidents`` table with the stateful alerts each still has firing (restored on start, so
open incidents survive a restart and resolve when those alerts recover, even if they recovered
while the correlator was down: the event consumers are durable, the sources' conditions are
restored, and placement's cluster health is a lease it renews, :class:`ClusterHealthLeases`).
``loom.incidents.ack`` (request-reply) acknowledges one.

Which jobs run where is a snapshot of the placements table, refreshed every ``refresh_s``.
"""

import asyncio
import contextlib
import hashlib
import json
import time
import urllib.request
from collections import deque
from typing import Any

import msgspec
import structlog
from nats import errors as nats_errors
from nats.aio.msg import Msg

from loom.alerts import Correlator, CorrelatorConfig, Inventory, JobPlacement, Notification, Part, Placements
from loom.alerts.alertmanager import SOURCE as ALERTMANAGER
from loom.alerts.alertmanager import MalformedPayloadError, parse_payload
from loom.alerts.correlate import Incident
from loom.alerts.sources import (
    ClusterHealthLeases,
    ConditionTracker,
    HealthWatch,
    from_job_failed,
    from_job_requeued,
    from_link_event,
    from_migration_failed,
    from_slow_run,
)
from loom.bus import ConsumerRunner, ConsumerSpec, Delivery
from loom.bus.connection import BusError
from loom.bus.dlq import NOT_REPLAYABLE_HEADER
from loom.bus.reply import respond
from loom.errors import InvalidInputError
from loom.model.topology import Topology
from loom.runtime.service import ServiceContext
from loom.security.http_token import Token
from loom.store import incidents as store
from loom.store.pool import transaction
from loom.telemetry.metrics import INCIDENTS_OPEN
from loom_proto import subjects
from loom_proto.alerts import Alert
from loom_proto.clusters import CLUSTER_HEALTH_LEASE_S, ClusterHealthChanged, SlowRun
from loom_proto.codec import MAX_PAYLOAD_BYTES
from loom_proto.jobs import JobFailed, JobRequeued
from loom_proto.migrations import MigrationEvent
from loom_proto.net import LinkDegraded, LinkRecovered
from loom_proto.view import ViewDelta
from loom_services.alert_correlator.receiver import Answer, Receiver

log = structlog.get_logger("alert-correlator")

TICK_S = 0.05
IDLE_TICK_S = 0.5
"""The tick period with nothing near to do (:meth:`Correlator.busy`): every input wakes the loop at
once, and the slow tick only resolves long-quiet incidents and refreshes the stats."""
LISTEN_RETRY_S = 5.0
"""While the webhook port is taken, how often the receiver tries to listen again."""
PATH_TTL_S = 30.0
PERSIST_EVERY_S = 1.0
MAX_PATH_QUERIES = 20
"""Path look-ups per placements refresh at most (the rest next time)."""
_LATENCIES_KEPT = 2_000


class SubjectMismatchError(InvalidInputError):
    """A raw alert whose ``source`` is not the one its subject names."""


class AlertCorrelator:
    """The service; :meth:`run` is its body."""

    def __init__(
        self,
        ctx: ServiceContext,
        topology: Topology,
        *,
        config: CorrelatorConfig | None = None,
        http_host: str = "127.0.0.1",
        http_port: int | None = 9095,
        webhooks: list[str] | None = None,
        refresh_s: float = 2.0,
        dlq_threshold: int = 10,
        watch_health: list[str] | None = None,
        health_period_s: float = 5.0,
        health_timeout_s: float = 2.0,
        health_misses: int = 3,
        cluster_health_lease_s: float = CLUSTER_HEALTH_LEASE_S,
        http_token: Token = None,
    ) -> None:
        self.ctx = ctx
        self.inventory = Inventory.from_topology(topology)
        self.core = Correlator(Placements(self.inventory), config)
        self.conditions = ConditionTracker(dlq_threshold=dlq_threshold)
        self.watch_health = sorted(set(watch_health or []) - {ctx.name})
        self.placement_instances = [i for i in self.watch_health if i.startswith("placement")]
        """The watched instances that tell cluster health (:class:`ClusterHealthLeases`)."""
        self.health = HealthWatch(misses=health_misses)
        self.cluster_health = ClusterHealthLeases(lease_s=cluster_health_lease_s)
        self.health_period_s = health_period_s
        self.health_timeout_s = health_timeout_s
        self.http_host = http_host
        self.http_port = http_port
        self.webhooks = list(webhooks or [])
        self.refresh_s = refresh_s
        self.receiver = Receiver(self.on_webhook, max_body_bytes=MAX_PAYLOAD_BYTES, token=http_token)
        self.latencies_ms: deque[float] = deque(maxlen=_LATENCIES_KEPT)
        self.counts: dict[str, int] = {"published": 0, "webhooks_sent": 0, "webhooks_failed": 0}
        self.http_error: str | None = None
        self._sending: set[asyncio.Task[None]] = set()
        self._notified = False
        self._flushed_at = 0.0
        self._wake = asyncio.Event()
        """Set by every input: the tick loop runs at once, then at ``TICK_S`` while busy."""
        self.paths: dict[tuple[str, str], tuple[tuple[str, ...], float]] = {}
        """(src, dst) regions -> network perception's chosen path and when it was asked (monotonic)."""

    # ---- state ---------------------------------------------------------------------------------

    async def restore(self) -> int:
        """Open incidents, and those resolved within the re-open window, back into the core."""
        rows = await store.restorable(self.ctx.db, resolved_since_s=self.core.config.reopen_s)
        firing: set[str] = set()
        for change, held in rows:
            incident = Incident.from_change(change, held)
            self.core.restore(incident)
            firing |= incident.active
        # The sources resolve what was firing as if this run had seen it start.
        self.conditions.restore(firing, time.time())
        self.health.restore(firing, self.watch_health)
        self.cluster_health.restore(firing, time.time())
        return len(rows)

    async def refresh_placements(self) -> None:
        """A new snapshot of which jobs run where (parts grouped per job)."""
        rows = await store.placed_parts(self.ctx.db)
        parts: dict[str, tuple[str, str | None, list[Part]]] = {}
        for r in rows:
            entry = parts.setdefault(r["job_id"], (r["tenant"], r["parent"], []))
            entry[2].append(Part(r["cluster"], tuple(r["nodes"])))
        jobs = [JobPlacement(job_id, t, tuple(p), parent=parent) for job_id, (t, parent, p) in parts.items()]
        pairs: set[tuple[str, str]] = set()
        for job in jobs:
            regions = sorted({self.inventory.region_of_cluster.get(p.cluster, "") for p in job.parts} - {""})
            pairs.update((a, b) for i, a in enumerate(regions) for b in regions[i + 1 :])
        await self._refresh_paths(pairs)
        paths = {pair: nodes for pair, (nodes, _) in self.paths.items()}
        self.core.set_placements(Placements(self.inventory, jobs, paths=paths))

    async def _refresh_paths(self, pairs: set[tuple[str, str]]) -> None:
        """Network perception's chosen path of each region pair jobs span (cached ``PATH_TTL_S``;
        no answer: the direct link alone)."""
        now = time.monotonic()
        due = sorted(p for p in pairs if now - self.paths.get(p, ((), -PATH_TTL_S))[1] >= PATH_TTL_S)
        for src, dst in due[:MAX_PATH_QUERIES]:
            nodes: tuple[str, ...] = ()
            try:
                reply = await self.ctx.nc.request(
                    subjects.NET_QUERY_PATH, json.dumps({"src": src, "dst": dst}).encode(), timeout=0.5
                )
                answer = json.loads(reply.data)
                chosen = (answer.get("result") or {}).get("path") if answer.get("ok") else None
                if chosen and isinstance(chosen.get("nodes"), list):
                    nodes = tuple(str(n) for n in chosen["nodes"])
            except (TimeoutError, nats_errors.Error, json.JSONDecodeError, AttributeError):
                pass  # network perception not running or not answering: direct links only
            self.paths[src, dst] = (nodes, now)

    def _stats(self) -> None:
        lat = sorted(self.latencies_ms)
        self.ctx.stats.update(
            {
                "http_port": self.receiver.port,
                "http_error": self.http_error,
                "open_incidents": len(self.core.open_by_root),
                "incidents_in_memory": len(self.core.incidents),
                "waiting_alerts": len(self.core.waiting),
                "placed_jobs": len(self.core.placements.jobs),
                "correlation_ms_p50": round(lat[len(lat) // 2], 2) if lat else None,
                "correlation_ms_p99": round(lat[min(len(lat) - 1, int(len(lat) * 0.99))], 2) if lat else None,
                "core": dict(self.core.counts),
                "http": dict(self.receiver.counts),
                **self.counts,
            }
        )

    # ---- the loop ------------------------------------------------------------------------------

    async def run(self) -> None:
        """Consume, correlate, publish and persist until asked to stop."""
        restored = await self.restore()
        await self.refresh_placements()
        log.info("alert correlator starting", restored=restored, placed_jobs=len(self.core.placements.jobs))
        nc, pub = self.ctx.nc, self.ctx.publisher

        def follow(
            name: str, stream: str, filters: list[str], kind: Any, handler: Any, *, new_only: bool = True
        ) -> ConsumerRunner[Any]:
            """The durable consumer ``alert-correlator-<name>`` of ``filters`` on ``stream``: Loom's
            own events from now on (``new_only``); raw alerts from where it left off."""
            spec = ConsumerSpec(
                stream=stream,
                durable=f"alert-correlator-{name}",
                filter_subjects=filters,
                deliver_new_only=new_only,
            )
            return ConsumerRunner(nc, spec, kind, handler=handler, publisher=pub)

        runners: dict[str, ConsumerRunner[Any]] = {
            "raw": follow("raw", "ALERTS", [subjects.ALERTS_RAW_ALL], Alert, self.on_raw, new_only=False),
            "net": follow(
                "net", "NET", [subjects.NET_EVENTS_ALL], LinkDegraded | LinkRecovered, self.on_link_event
            ),
            "view": follow("view", "VIEW", [subjects.VIEW_DELTAS_ALL], ViewDelta, self.on_view_delta),
            "jobs": follow(
                "jobs",
                "JOBS",
                subjects.job_events_of("failed", "requeued"),
                JobFailed | JobRequeued,
                self.on_job_event,
            ),
            "dlq": follow("dlq", "DLQ", [subjects.DEAD_LETTERS], bytes, self.on_dead_letter),
            "migrations": follow(
                "migrations",
                "MIGRATIONS",
                [subjects.MIGRATIONS_FAILED_ALL],
                MigrationEvent,
                self.on_migration_event,
            ),
        }
        for runner in runners.values():
            await runner.start()
        subs = [
            await nc.subscribe(subjects.INCIDENTS_ACK, cb=self.on_ack),
            await nc.subscribe(subjects.PLACEMENT_CLUSTER_HEALTH, cb=self.on_cluster_health),
            await nc.subscribe(subjects.PLACEMENT_SLOW, cb=self.on_slow_run),
        ]
        watchdog = self.ctx.watchdog
        loops = [watchdog.watch_consumer(name, r) for name, r in runners.items()]
        if self.http_port is not None:
            # Degraded, not ok, while Alertmanager cannot reach it (another stack holds the port).
            watchdog.condition("webhook", lambda: self.http_error)
            await self._listen(retry=False)
            if self.http_error is not None:
                loops.append(watchdog.supervise("webhook", self._listen, finishes=True))
        loops.append(watchdog.supervise("tick", self._tick_loop))
        loops.append(watchdog.supervise("placements", self._refresh_loop))
        if self.watch_health:
            loops.append(watchdog.supervise("health", self._health_loop))
        self._stats()
        try:
            await self.ctx.stopping.wait()
        finally:
            for task in loops:
                task.cancel()
            await asyncio.gather(*loops, return_exceptions=True)
            await self.receiver.close()
            for sub in subs:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
            await asyncio.gather(*(runner.stop() for runner in runners.values()))
            with contextlib.suppress(Exception):
                await self.flush()
            if self._sending:
                await asyncio.wait(self._sending, timeout=5)

    async def _listen(self, *, retry: bool = True) -> None:
        """Listen for Alertmanager's webhook; with ``retry``, try again every ``LISTEN_RETRY_S``
        until the port is free (the bus is correlated meanwhile; health says why it is degraded)."""
        assert self.http_port is not None
        while True:
            try:
                port = await self.receiver.start(self.http_host, self.http_port)
            except OSError as exc:
                error = f"webhook receiver cannot listen on {self.http_host}:{self.http_port}: {exc}"
                if error != self.http_error:
                    log.warning("webhook receiver not started", error=error)
                self.http_error = error
                if not retry:
                    return
                await asyncio.sleep(LISTEN_RETRY_S)
                continue
            self.http_error = None
            log.info("alertmanager webhook receiver listening", host=self.http_host, port=port)
            return

    def busy(self) -> bool:
        """Whether the next ticks have work (else the loop ticks every ``IDLE_TICK_S``)."""
        return self._notified or self.core.busy() or self.conditions.busy()

    async def _tick_loop(self) -> None:
        while True:
            if self.busy():
                await asyncio.sleep(TICK_S)
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), IDLE_TICK_S)
            self._wake.clear()
            now = time.time()
            # Placement silent (every instance of it watched misses its health answers): the
            # clusters' states it told are not lapsing.
            tellers = self.placement_instances
            silent = bool(tellers) and all(self.health.firing.get(i) == "missing" for i in tellers)
            for alert in self.conditions.tick(now) + self.cluster_health.tick(now, teller_silent=silent):
                await self._emit(self.core.ingest(alert, now))
            await self._emit(self.core.tick(now))
            # Persist at once after a notification, else once a second: a storm's alert counts do
            # not rewrite the incident's row twenty times a second.
            if self._notified or time.monotonic() - self._flushed_at >= PERSIST_EVERY_S:
                await self.flush()
            self._stats()
            self._gauge_open()

    def _gauge_open(self) -> None:
        """``loom_incidents_open`` by severity, for Prometheus and the overview dashboard."""
        counts = {"info": 0, "warning": 0, "critical": 0}
        for inc in self.core.open_incidents():
            counts[inc.severity] = counts.get(inc.severity, 0) + 1
        for severity, n in counts.items():
            INCIDENTS_OPEN.labels(severity=severity).set(n)

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            await self.refresh_placements()

    # ---- inputs --------------------------------------------------------------------------------

    async def _ingest(self, alert: Alert, *, own: bool = False) -> None:
        """``own``: an alert made here from Loom's own job and migration events."""
        started = time.perf_counter()
        notes = self.core.ingest(alert, time.time(), own=own)
        self.latencies_ms.append((time.perf_counter() - started) * 1000)
        self._wake.set()
        await self._emit(notes)

    async def on_raw(self, d: Delivery[Alert]) -> None:
        """A raw alert; its source must be its subject's."""
        if d.subject != subjects.alert_raw(d.message.source):
            raise SubjectMismatchError(f"alert of source {d.message.source!r} on {d.subject}")
        await self._ingest(d.message)

    async def on_link_event(self, d: Delivery[LinkDegraded | LinkRecovered]) -> None:
        """A link degraded or recovered."""
        await self._ingest(from_link_event(d.message))

    async def on_view_delta(self, d: Delivery[ViewDelta]) -> None:
        """A cluster's ledger change: staleness and node health."""
        for alert in self.conditions.view_delta(d.message):
            await self._ingest(alert)

    async def on_job_event(self, d: Delivery[JobFailed | JobRequeued]) -> None:
        """A job's run failed or was lost."""
        event = d.message
        reporter = subjects.report_cluster(d.subject)
        placed = self.core.placements.jobs.get(event.job_id)
        if (
            isinstance(event, JobFailed)
            and reporter is not None
            and (
                reporter != event.cluster
                or (placed is not None and reporter not in {p.cluster for p in placed.parts})
            )
        ):
            # An agent's report of a run on another cluster (as its subject or the placements it
            # knows tell): placement refuses it, and it raised a "job failed" alert (taking the
            # run's alert key first) for a job that agent does not run.
            log.warning("foreign failure report ignored", subject=d.subject, job_id=event.job_id)
            return
        alert = from_job_failed(event) if isinstance(event, JobFailed) else from_job_requeued(event)
        if alert is not None:
            # A requeue is placement's word; a failed run is mostly an agent's report, which may
            # name any tenant: its tenant is never taken for the job's.
            await self._ingest(alert, own=isinstance(event, JobRequeued))

    async def on_migration_event(self, d: Delivery[MigrationEvent]) -> None:
        """A job's move that did not happen (the migration service gave up on it)."""
        alert = from_migration_failed(d.message)
        if alert is not None:
            await self._ingest(alert, own=True)

    async def on_cluster_health(self, msg: Msg) -> None:
        """Placement's classification of a cluster changed (core NATS); a bad notice is logged."""
        try:
            event = msgspec.json.decode(msg.data, type=ClusterHealthChanged)
        except msgspec.ValidationError as exc:
            log.info("bad cluster health notice ignored", error=str(exc))
            return
        for alert in self.cluster_health.notice(event, time.time()):
            await self._ingest(alert)

    async def on_slow_run(self, msg: Msg) -> None:
        """A run delivering under half its predicted rate (core NATS); a bad notice is logged."""
        try:
            event = msgspec.json.decode(msg.data, type=SlowRun)
        except msgspec.ValidationError as exc:
            log.info("bad slow-run notice ignored", error=str(exc))
            return
        await self._ingest(from_slow_run(event, time.time()))

    async def _health_loop(self) -> None:
        """Ask every watched instance for its health each period, all at once."""
        while True:
            await asyncio.sleep(self.health_period_s)
            await self.check_health()

    async def check_health(self) -> None:
        """One round of health questions; answers and misses go through :class:`HealthWatch`."""
        answers = await asyncio.gather(*(self._ask_health(name) for name in self.watch_health))
        now = time.time()
        for name, status in zip(self.watch_health, answers, strict=True):
            if status is None:
                alerts = self.health.missed(name, now, self.health_timeout_s)
            else:
                alerts = self.health.answered(name, status, now)
            for alert in alerts:
                await self._ingest(alert)

    async def _ask_health(self, name: str) -> str | None:
        """The instance's status (``ok``, ``degraded: ...``), or None when it did not answer."""
        try:
            reply = await self.ctx.nc.request(
                subjects.service_health(name), b"", timeout=self.health_timeout_s
            )
            answer = json.loads(reply.data)
        except (TimeoutError, nats_errors.Error, ValueError):
            return None
        return str(answer.get("status", "ok")) if isinstance(answer, dict) else None

    async def on_dead_letter(self, d: Delivery[bytes]) -> None:
        """Count dead letters (the correlator's own included)."""
        for alert in self.conditions.dead_letter(time.time()):
            await self._ingest(alert)
        self._wake.set()  # the dead-letter window now needs ticking

    async def on_webhook(self, body: bytes) -> Answer:
        """Alertmanager's POST: published as raw alerts, or refused with 400 and dead-lettered."""
        try:
            alerts = parse_payload(body)
        except MalformedPayloadError as exc:
            await self._dead_letter_webhook(body, exc)
            return Answer(400, {"error": str(exc)[:500]})
        subject = subjects.alert_raw(ALERTMANAGER)
        try:
            await asyncio.gather(*(self.ctx.publisher.publish(subject, a, msg_id=a.alert_id) for a in alerts))
        except BusError as exc:
            log.warning("webhook alerts not published", error=str(exc))
            return Answer(503, {"error": "Loom's bus cannot take the alerts now; retry"})
        return Answer(200, {"accepted": len(alerts)})

    async def _dead_letter_webhook(self, body: bytes, error: Exception) -> None:
        original = subjects.alert_raw(ALERTMANAGER)
        digest = hashlib.sha256(body).hexdigest()[:32]
        headers = {
            "Loom-Error": str(error)[:1024],
            "Loom-Error-Type": type(error).__name__,
            "Loom-Original-Subject": original,
            "Loom-Consumer": "alert-correlator-http",
            "Loom-Failures": "1",
            NOT_REPLAYABLE_HEADER: "Alertmanager's HTTP payload, not a bus message: the bus takes Loom's"
            " alerts only; fix the payload (or Alertmanager) and POST it to the webhook again",
        }
        try:
            await self.ctx.publisher.publish_bytes(
                subjects.dead_letter(original),
                body[:MAX_PAYLOAD_BYTES],
                msg_id=f"dlq-http-{digest}",
                headers=headers,
            )
        except BusError as exc:
            log.error("malformed webhook payload not dead-lettered", error=str(exc))

    async def on_ack(self, msg: Msg) -> None:
        """``{incident_id, by}`` -> acknowledge; replies ``{ok, incident}`` or ``{ok: false, error}``."""
        try:
            body = json.loads(msg.data or b"{}")
            incident_id = str(body["incident_id"])
            note = self.core.ack(incident_id, str(body.get("by") or "someone")[:128], time.time())
            if note is not None:
                await self._emit([note])
            await self.flush()
            inc = self.core.incidents[incident_id]
            reply: dict[str, Any] = {"ok": True, "changed": note is not None, "state": inc.state}
        except KeyError:
            reply = {
                "ok": False,
                "code": "unknown",
                "error": "no such incident in the correlator (resolved long ago?)",
            }
        except (json.JSONDecodeError, TypeError, ValueError) as exc:
            reply = {"ok": False, "error": f"bad request: {exc}"}
        await respond(msg, json.dumps(reply).encode())

    # ---- outputs -------------------------------------------------------------------------------

    async def _emit(self, notes: list[Notification]) -> None:
        self._notified = self._notified or bool(notes)
        for note in notes:
            inc = note.incident
            await self.ctx.publisher.publish(
                subjects.incident(note.kind), inc, msg_id=f"{inc.incident_id}-v{inc.version}"
            )
            self.counts["published"] += 1
            if self.webhooks:
                payload = msgspec.json.encode(inc)
                for url in self.webhooks:
                    task = asyncio.create_task(self._post(url, payload))
                    self._sending.add(task)
                    task.add_done_callback(self._sending.discard)

    async def _post(self, url: str, payload: bytes) -> None:
        def send() -> None:
            request = urllib.request.Request(
                url, data=payload, headers={"Content-Type": "application/json"}, method="POST"
            )
            with urllib.request.urlopen(request, timeout=5):
                pass

        try:
            await asyncio.to_thread(send)
            self.counts["webhooks_sent"] += 1
        except OSError as exc:
            self.counts["webhooks_failed"] += 1
            log.warning("incident webhook failed", url=url, error=str(exc))

    async def flush(self) -> None:
        """Persist the incidents changed since the last flush."""
        self._notified, self._flushed_at = False, time.monotonic()
        changed = self.core.take_changed()
        if not changed:
            return
        records = [
            inc.change("resolved" if inc.state == "resolved" else "updated", "persisted") for inc in changed
        ]
        held = {inc.incident_id: inc.held() for inc in changed if inc.is_open}
        async with transaction(self.ctx.db) as conn:
            await store.save_incidents(conn, records, held)
