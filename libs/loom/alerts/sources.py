"""Loom's own events as alerts: which events count, and when a condition starts and ends. Pure.

What exists today and becomes an alert here:

* a link ``degraded`` / ``recovered`` (network perception, ``loom.net.event.*``): a link alert,
  firing / resolved, one fingerprint per undirected link;
* a cluster's view delta turning ``stale`` (heartbeats lost past the TTL) and fresh again; a node
  reported unhealthy and healthy again (``loom.view.delta.*``);
* a job ``failed`` (``loom.jobs.failed.*``) and a job re-queued because its run was lost or never
  started (``loom.jobs.requeued.*`` with cause ``cluster_lost``, ``start_failed``,
  ``start_timeout``; preemption and resizing are decisions, not faults): momentary job alerts;
* dead letters growing: at least ``threshold`` in ``window_s`` (``loom.dlq.>``) fires a ``service``
  alert on ``dead-letters``, resolved when the window holds none;
* a migration the migration service gave up on (``loom.migrations.failed.*``, unless it no longer
  mattered: ``moot``): a momentary job alert;
* placement's classification of a cluster (``loom.placement.cluster_health``): ``suspect`` (one of
  heartbeats and probes lost) fires a warning, ``failed`` (both) a critical alert on the cluster,
  ``healthy`` resolves it, and so does a state placement has not told again for
  ``CLUSTER_HEALTH_LEASE_S`` (:class:`ClusterHealthLeases`);
* a run delivering under half its predicted step rate (``loom.placement.slow``): a momentary job
  alert naming its nodes;
* a Loom service missing its health answer (:class:`HealthWatch`, the correlator asks each watched
  instance on ``loom.health.<instance>``): after ``misses`` answers missed in a row a critical alert
  (an agent's on its cluster, any other on the ``service`` resource of its name), a warning while it
  answers ``degraded: ...``, resolved when it answers ``ok`` again.

What was firing when the correlator stopped is restored with its incidents (``restore`` on each
tracker), so the recovery resolves it.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from loom.alerts.resources import link_name
from loom_proto.alerts import Alert
from loom_proto.clusters import CLUSTER_HEALTH_LEASE_S, ClusterHealthChanged, SlowRun
from loom_proto.jobs import JobFailed, JobRequeued
from loom_proto.migrations import MigrationEvent
from loom_proto.net import LinkDegraded, LinkRecovered
from loom_proto.view import ViewDelta

SOURCE = "loom"
FAULT_REQUEUES = frozenset({"cluster_lost", "node_lost", "start_failed", "start_timeout"})
_MAX_ID = 64
"""Ids keep to [A-Za-z0-9_-]{1,64} (loom_proto.ids)."""


def alert_id(*parts: object) -> str:
    """An id from parts, hashed down when it would pass 64 characters."""
    text = "-".join(str(p) for p in parts).replace(".", "_").replace("~", "_")
    if len(text) <= _MAX_ID:
        return text
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    return f"{text[: _MAX_ID - 17]}-{digest}"


def from_link_event(event: LinkDegraded | LinkRecovered) -> Alert:
    """A link alert: firing on degraded, resolved on recovered (both directions share it)."""
    firing = isinstance(event, LinkDegraded)
    name = link_name(event.src, event.dst)
    return Alert(
        alert_id=alert_id(
            "net", "degraded" if firing else "recovered", event.src, event.dst, int(event.at * 1000)
        ),
        source="network-perception",
        severity="warning",
        summary=f"link {event.src} -> {event.dst} {'degraded' if firing else 'recovered'}: {event.reason}"[
            :1024
        ],
        link=(event.src, event.dst),
        dedup_key=f"loom-link-{name}",
        at=event.at,
        status="firing" if firing else "resolved",
    )


def from_job_failed(event: JobFailed) -> Alert | None:
    """A momentary job alert for a failed run; none for a run Loom stopped itself (a cancel, a
    preemption, a move: its agent reports it ``stopped``)."""
    if event.stopped:
        return None
    return Alert(
        alert_id=alert_id("job-failed", event.job_id, event.attempt),
        source=SOURCE,
        severity="warning",
        summary=f"job {event.job_id} failed on {event.cluster}: {event.reason}"[:1024],
        cluster=None,
        job_id=event.job_id,
        labels={"tenant": event.tenant, "cluster": event.cluster},
        dedup_key=alert_id("job-failed", event.job_id, event.attempt),
        at=event.at,
        momentary=True,
    )


def from_migration_failed(event: MigrationEvent) -> Alert | None:
    """A momentary job alert for a move that did not happen (the migration service's ``failed``);
    None for the other steps of a migration, and for a move that no longer mattered
    (``MigrationEvent.moot``: its run ended by itself first, whose failure if any has its own
    alert, or the operator ended its drain)."""
    if event.kind != "failed" or event.moot:
        return None
    return Alert(
        alert_id=alert_id("migration-failed", event.migration_id),
        source=SOURCE,
        severity="warning",
        summary=f"moving job {event.job_id} off {event.from_cluster} failed ({event.cause}): {event.why}"[
            :1024
        ],
        job_id=event.job_id,
        labels={"tenant": event.tenant, "cluster": event.from_cluster, "cause": event.cause},
        dedup_key=alert_id("migration-failed", event.migration_id),
        at=event.at,
        momentary=True,
    )


def from_job_requeued(event: JobRequeued) -> Alert | None:
    """A momentary job alert for a run lost or never started; None for preemption and resizing."""
    if event.cause not in FAULT_REQUEUES:
        return None
    return Alert(
        alert_id=alert_id("job-requeued", event.job_id, event.attempt),
        source=SOURCE,
        severity="warning",
        summary=f"job {event.job_id} restarted ({event.cause}): {event.reason}"[:1024],
        job_id=event.job_id,
        labels={"tenant": event.tenant, "cause": event.cause},
        dedup_key=alert_id("job-requeued", event.job_id, event.attempt),
        at=event.at,
        momentary=True,
    )


def from_slow_run(event: SlowRun, now: float) -> Alert:
    """A momentary job alert for a run delivering under half its predicted step rate; a run on one
    node names it (a slow node is the likely root), a run on several names its cluster."""
    nodes = sorted(set(event.nodes))
    predicted = f" (predicted {event.predicted_step_s:.3g} s)" if event.predicted_step_s else ""
    labels = {"nodes": ",".join(nodes)[:256]}
    if event.tenant:
        labels["tenant"] = event.tenant
    return Alert(
        alert_id=alert_id("job-slow", event.job_id, event.attempt),
        source=SOURCE,
        severity="warning",
        summary=f"job {event.job_id} runs slowly: {event.observed_step_s:.3g} s a step{predicted}"
        f" on {', '.join(nodes) or 'unknown nodes'}"[:1024],
        job_id=event.job_id,
        cluster=event.cluster,
        node=nodes[0] if len(nodes) == 1 else None,
        labels=labels,
        dedup_key=alert_id("job-slow", event.job_id, event.attempt),
        at=event.at if event.at is not None else now,
        momentary=True,
    )


@dataclass(slots=True)
class ClusterHealthLeases:
    """Placement's cluster classification held as a lease.

    Placement tells an unhealthy state again every ``CLUSTER_HEALTH_RETELL_S`` while it lasts (core
    NATS): a re-told state renews the lease and makes no new alert; a state not heard for
    ``lease_s`` resolves its alert. So neither a correlator restarting when the ``healthy`` notice
    went out, nor a placement restarting while a cluster recovered, leaves the incident open.
    """

    lease_s: float = CLUSTER_HEALTH_LEASE_S
    held: dict[str, tuple[str, float]] = field(default_factory=dict)
    """Cluster -> the unhealthy state last heard and when (``restored``: firing when the correlator
    started, not heard since)."""

    def notice(self, event: ClusterHealthChanged, now: float) -> list[Alert]:
        """The alert a notice makes: none for an unhealthy state re-told."""
        last = self.held.pop(event.cluster, None)
        if event.state != "healthy":
            self.held[event.cluster] = (event.state, now)
            if last is not None and last[0] == event.state:
                return []
        return [from_cluster_health(event)]

    def restore(self, fingerprints: Iterable[str], now: float) -> None:
        """The clusters whose health alerts were firing when the correlator stopped, held from ``now``."""
        for fp in fingerprints:
            if fp.startswith(HEALTH_KEY):
                self.held.setdefault(fp.removeprefix(HEALTH_KEY), ("restored", now))

    def tick(self, now: float, *, teller_silent: bool = False) -> list[Alert]:
        """Resolve the states not heard for ``lease_s``; none while ``teller_silent`` (placement
        itself misses its health answers: its silence says nothing of the clusters, and the
        leases restart when it answers again)."""
        if teller_silent:
            self.held = {c: (state, now) for c, (state, _) in self.held.items()}
            return []
        lapsed = sorted(c for c, (_, at) in self.held.items() if now - at >= self.lease_s)
        out = []
        for cluster in lapsed:
            del self.held[cluster]
            reason = f"placement has not reported it unhealthy for {self.lease_s:g} s"
            out.append(
                from_cluster_health(
                    ClusterHealthChanged(cluster=cluster, state="healthy", reason=reason, at=now)
                )
            )
        return out


HEALTH_KEY = "loom-health-"
"""The fingerprint of a cluster's health alert is this and the cluster."""


def from_cluster_health(event: ClusterHealthChanged) -> Alert:
    """A cluster alert from placement's classification: suspect (warning), failed (critical),
    healthy (resolved); one fingerprint per cluster, so failed after suspect raises its severity."""
    healthy = event.state == "healthy"
    return Alert(
        alert_id=alert_id("health", event.cluster, event.state, int(event.at * 1000)),
        source=SOURCE,
        severity="critical" if event.state == "failed" else "warning",
        summary=f"cluster {event.cluster} {event.state}: {event.reason}"[:1024],
        region=event.region,
        cluster=event.cluster,
        labels={"state": event.state},
        dedup_key=f"{HEALTH_KEY}{event.cluster}",
        at=event.at,
        status="resolved" if healthy else "firing",
    )


AGENT_PREFIX = "agent-"


def health_key(instance: str) -> str:
    """The fingerprint of a Loom service's health alert."""
    return alert_id("loom-svc", instance)


@dataclass(slots=True)
class HealthWatch:
    """A Loom service missing its health answer, or answering ``degraded``, as a condition.

    The service asks each watched instance and reports :meth:`answered` or :meth:`missed`; the
    watch fires after ``misses`` missed answers in a row (one late answer on a busy machine is not
    an outage; one that never answered yet, after ``startup_grace_s``) and resolves at the first
    ``ok``. An agent (``agent-<cluster>``) is named by its
    cluster, so a silent agent joins its cluster's incident; any other by the ``service`` resource.
    """

    misses: int = 3
    startup_grace_s: float = 60.0
    """An instance that never answered yet (still starting) fires only this long after it was
    first asked."""
    missed_in_row: dict[str, int] = field(default_factory=dict)
    firing: dict[str, str] = field(default_factory=dict)
    """instance -> what fires: ``missing`` or the degraded status it answered."""
    first_asked: dict[str, float] = field(default_factory=dict)
    seen: set[str] = field(default_factory=set)
    """Instances that answered at least once."""

    def restore(self, fingerprints: Iterable[str], instances: Iterable[str]) -> None:
        """Of ``instances``, those whose health alert was firing when the correlator stopped: the
        first ``ok`` answer resolves it, as if this run had seen it fire."""
        firing = set(fingerprints)
        for instance in instances:
            if health_key(instance) in firing:
                self.firing.setdefault(instance, "restored")
                self.seen.add(instance)

    def answered(self, instance: str, status: str, now: float) -> list[Alert]:
        """An answer: ``ok`` resolves, anything else (``degraded: postgres unavailable``) fires."""
        self.missed_in_row[instance] = 0
        self.seen.add(instance)
        if status == "ok":
            if instance not in self.firing:
                return []
            del self.firing[instance]
            return [self._alert(instance, "answers ok again", now, firing=False, severity="warning")]
        if self.firing.get(instance) == status:
            return []
        self.firing[instance] = status
        # A dependency down (the runtime's "postgres unavailable"): the server would explain it.
        stands_on = next((s for s in ("postgres", "nats") if f"{s} unavailable" in status), None)
        alert = self._alert(
            instance, f"answers {status}", now, firing=True, severity="warning", stands_on=stands_on
        )
        return [alert]

    def missed(self, instance: str, now: float, timeout_s: float) -> list[Alert]:
        """No answer within ``timeout_s``."""
        count = self.missed_in_row.get(instance, 0) + 1
        self.missed_in_row[instance] = count
        first = self.first_asked.setdefault(instance, now)
        if instance not in self.seen and now - first < self.startup_grace_s:
            return []
        if count < self.misses or self.firing.get(instance) == "missing":
            return []
        self.firing[instance] = "missing"
        summary = f"no health answer {count} times in a row (each within {timeout_s:g} s)"
        # Health questions travel over NATS: many services silent at once is NATS.
        return [self._alert(instance, summary, now, firing=True, severity="critical", stands_on="nats")]

    @staticmethod
    def _alert(
        instance: str, what: str, now: float, *, firing: bool, severity: str, stands_on: str | None = None
    ) -> Alert:
        cluster = instance.removeprefix(AGENT_PREFIX) if instance.startswith(AGENT_PREFIX) else None
        labels = {"instance": instance} if cluster else {"service": instance, "instance": instance}
        if stands_on is not None:
            labels["stands_on"] = stands_on
        return Alert(
            alert_id=alert_id("health", instance, int(now * 1000)),
            source=SOURCE,
            severity="critical" if severity == "critical" else "warning",
            summary=f"Loom service {instance}: {what}"[:1024],
            cluster=cluster,
            labels=labels,
            dedup_key=health_key(instance),
            at=now,
            status="firing" if firing else "resolved",
        )


STALE_KEY = "loom-stale-"
NODE_KEY = "loom-node-"
DLQ_KEY = "loom-dead-letters"


@dataclass(slots=True)
class ConditionTracker:
    """Turns level signals (view deltas, dead letters) into firing / resolved alerts on change."""

    dlq_threshold: int = 10
    dlq_window_s: float = 60.0
    stale: set[str] = field(default_factory=set)
    unhealthy: set[str] = field(default_factory=set)
    dead_letters: deque[float] = field(default_factory=deque)
    dlq_firing: bool = False
    dlq_restored_at: float | None = None
    """When a firing dead-letter alert was restored: it does not resolve before a whole window
    has passed since (the consumer's backlog may not have been delivered yet)."""

    def restore(self, fingerprints: Iterable[str], now: float) -> None:
        """The conditions firing when the correlator stopped (from the incidents' stored
        fingerprints): the view delta or quiet window that ends one resolves it, as if this run had
        seen it start. (The view's consumer is durable: a change made while the correlator was
        down is delivered when it starts.)"""
        for fp in fingerprints:
            if fp.startswith(STALE_KEY):
                self.stale.add(fp.removeprefix(STALE_KEY))
            elif fp.startswith(NODE_KEY):
                self.unhealthy.add(fp.removeprefix(NODE_KEY))
            elif fp == DLQ_KEY:
                self.dlq_firing = True
                self.dlq_restored_at = now

    def view_delta(self, delta: ViewDelta) -> list[Alert]:
        """Alerts for a cluster turning stale or fresh, and for nodes turning unhealthy or healthy."""
        out: list[Alert] = []
        cluster = delta.cluster
        if delta.stale != (cluster in self.stale):
            if delta.stale:
                self.stale.add(cluster)
            else:
                self.stale.discard(cluster)
            out.append(
                Alert(
                    alert_id=alert_id("stale", cluster, int(delta.at * 1000)),
                    source=SOURCE,
                    severity="critical",
                    summary=f"cluster {cluster}: "
                    + ("no heartbeat within its TTL" if delta.stale else "heartbeats back"),
                    region=delta.region,
                    cluster=cluster,
                    dedup_key=f"{STALE_KEY}{cluster}",
                    at=delta.at,
                    status="firing" if delta.stale else "resolved",
                )
            )
        for node in delta.nodes:
            if node.healthy == (node.node not in self.unhealthy):
                continue
            if node.healthy:
                self.unhealthy.discard(node.node)
            else:
                self.unhealthy.add(node.node)
            out.append(
                Alert(
                    alert_id=alert_id("node", node.node, int(delta.at * 1000)),
                    source=SOURCE,
                    severity="warning",
                    summary=f"node {node.node} of {cluster} "
                    + ("healthy again" if node.healthy else "unhealthy"),
                    region=delta.region,
                    cluster=cluster,
                    node=node.node,
                    dedup_key=f"{NODE_KEY}{node.node}",
                    at=delta.at,
                    status="resolved" if node.healthy else "firing",
                )
            )
        return out

    def dead_letter(self, now: float) -> list[Alert]:
        """Count one dead letter; an alert when the window reaches the threshold."""
        self.dead_letters.append(now)
        return self._dlq(now)

    def busy(self) -> bool:
        """Whether :meth:`tick` may change something: dead letters in the window, or the alert firing."""
        return bool(self.dead_letters) or self.dlq_firing

    def tick(self, now: float) -> list[Alert]:
        """The dead-letter alert resolves once its window holds none."""
        return self._dlq(now)

    def _dlq(self, now: float) -> list[Alert]:
        while self.dead_letters and now - self.dead_letters[0] > self.dlq_window_s:
            self.dead_letters.popleft()
        count = len(self.dead_letters)
        if not self.dlq_firing and count >= self.dlq_threshold:
            self.dlq_firing = True
            return [self._dlq_alert(now, f"{count} dead letters in {self.dlq_window_s:g} s", "firing")]
        restored = self.dlq_restored_at
        if self.dlq_firing and count == 0 and (restored is None or now - restored >= self.dlq_window_s):
            self.dlq_firing, self.dlq_restored_at = False, None
            return [self._dlq_alert(now, f"no dead letter for {self.dlq_window_s:g} s", "resolved")]
        return []

    @staticmethod
    def _dlq_alert(now: float, summary: str, status: str) -> Alert:
        return Alert(
            alert_id=alert_id("dlq", status, int(now * 1000)),
            source=SOURCE,
            severity="warning",
            summary=summary,
            labels={"service": "dead-letters"},
            dedup_key=DLQ_KEY,
            at=now,
            status="firing" if status == "firing" else "resolved",
        )
