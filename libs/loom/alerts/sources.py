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
  alert on ``dead-letters``, resolved when the window holds none.

Not published by any service today, so not consumed: placement's ``suspect`` / ``failed`` cluster
classification (internal to placement; the stale view delta is the signal it starts from), a job
running slowly, migrations failing, a service missing its health answer.
"""

from __future__ import annotations

import hashlib
from collections import deque
from dataclasses import dataclass, field

from loom.alerts.resources import link_name
from loom_proto.alerts import Alert
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
    None for the other steps of a migration."""
    if event.kind != "failed":
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


@dataclass(slots=True)
class ConditionTracker:
    """Turns level signals (view deltas, dead letters) into firing / resolved alerts on change."""

    dlq_threshold: int = 10
    dlq_window_s: float = 60.0
    stale: set[str] = field(default_factory=set)
    unhealthy: set[str] = field(default_factory=set)
    dead_letters: deque[float] = field(default_factory=deque)
    dlq_firing: bool = False

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
                    dedup_key=f"loom-stale-{cluster}",
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
                    dedup_key=f"loom-node-{node.node}",
                    at=delta.at,
                    status="resolved" if node.healthy else "firing",
                )
            )
        return out

    def dead_letter(self, now: float) -> list[Alert]:
        """Count one dead letter; an alert when the window reaches the threshold."""
        self.dead_letters.append(now)
        return self._dlq(now)

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
        if self.dlq_firing and count == 0:
            self.dlq_firing = False
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
            dedup_key="loom-dead-letters",
            at=now,
            status="firing" if status == "firing" else "resolved",
        )
