"""The alert correlator: alerts in, incidents and rate-limited notifications out. Pure, no I/O.

How an alert travels (:meth:`Correlator.ingest`, then :meth:`Correlator.tick` on a clock):

1. **Dedupe.** Its fingerprint (the source's ``dedup_key``, else source + what it names + its
   labels) already belongs to an open incident: the repeat is counted, nothing else.
2. **Attach.** One of the resources it implicates (:meth:`Placements.implicated`: what it names,
   what that stands on, and for a job alert every node, cluster, region and link the job's parts
   use) is the root of an open incident: it is attached there. A job alert under an open cluster
   or link incident lands here and notifies nobody unless it adds a job the incident did not hold.
3. **Group.** Otherwise it waits up to ``group_wait_s`` with the other unexplained alerts; then
   the waiting alerts are split greedily by root cause (:func:`rank`): the best-scoring resource
   takes every alert it explains, and so on. A group whose best root is a single job (alerts of
   one job, nothing else like them) waits up to ``weak_wait_s`` for company first: a link or a
   node is recognised by several jobs alerting together, and they rarely alert in the same second.
   Each group opens an incident — or, when its root
   stands above the root of an open incident (a cluster above a node), takes that incident over
   (root promoted, one update), or re-opens a recently resolved incident of the same root (relapse).

Root-cause score of a candidate resource: ``explained × √precision``. ``explained`` counts the
waiting alerts it would explain; ``precision`` is how much of what stands on it is alerting:
of its jobs (when job alerts are among those it explains), of a cluster's nodes, of a zone's or
region's clusters, of a region's links. A resource some alert names outright has precision 1.
Ties go to the most specific kind (job, node, cluster, link, zone, region). So jobs on several
clusters degrading together across one link point at the link (a cluster explains only its own
jobs; a region also holds quiet local jobs), a node whose jobs fail points at the node, not at
its cluster (the cluster's other jobs are quiet), and a cluster's node and job storm at the cluster.

Lifecycle: open → acknowledged (:meth:`Correlator.ack`) → resolved: when the root resource
recovers (a ``resolved`` alert naming it), when every stateful alert of the incident has resolved,
or, for incidents held only by momentary alerts (job failures), after ``quiet_s`` without one.
A firing alert whose root was resolved less than ``reopen_s`` ago re-opens that incident.

Time: every window and ordering uses the correlator's clock at receipt (``now``), never the
alert's own stamp, so a source whose clock is off cannot stretch, shrink or reorder windows; a
stamp more than ``max_skew_s`` away from receipt is counted and marked in the timeline.

Notifications: one per incident change — ``opened`` and ``resolved`` at once, ``updated`` at
most once per ``min_update_interval_s`` per incident (changes in between coalesce) — and all of
them through one token bucket of ``max_notifications_per_min`` (an ``opened`` that finds it empty
waits for the next token; ``resolved`` always goes).

Memory is bounded under storms: the waiting list (``max_pending``: a full list is grouped at once),
the fingerprints remembered (``max_fingerprints``, oldest forgotten), the alerts and timeline kept
per incident in detail (counts stay exact), the open incidents (``max_open``: past it, new groups
join one ``overflow`` incident) and the resolved incidents kept (``max_resolved_kept``).
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import msgspec

from loom.alerts.resources import SPECIFICITY, Placements, Resource, describe, link_name
from loom_proto.alerts import (
    MAX_JOBS_LISTED,
    AffectedJob,
    Alert,
    IncidentChange,
    IncidentChangeKind,
    IncidentState,
    RootCandidate,
    Severity,
    TimelineEntry,
)

_SEVERITY_RANK: dict[str, int] = {"info": 0, "warning": 1, "critical": 2}
OVERFLOW: Resource = ("service", "overflow")
SERVERS: frozenset[str] = frozenset({"nats", "postgres"})
"""The servers an alert may say it stands on (:attr:`Signal.stands_on`)."""
"""The root of the incident that takes groups past ``max_open`` open incidents."""


@dataclass(frozen=True, slots=True)
class CorrelatorConfig:
    """The correlator's windows and bounds (seconds, counts)."""

    group_wait_s: float = 0.5
    """How long an unexplained alert waits for others before the waiting ones are grouped."""
    weak_wait_s: float = 10.0
    """How long alerts whose best explanation is one job (no resource alert, no other job alike)
    keep waiting for company before they become that job's own incident."""
    context_s: float = 60.0
    """How long an open single-job incident still counts as evidence when later alerts are grouped
    (its job and a later one share a node: the node takes both)."""
    reopen_s: float = 3_600.0
    """A firing alert of the same root within this long after resolution re-opens the incident."""
    quiet_s: float = 600.0
    """An incident held only by momentary alerts resolves after this long without one."""
    min_update_interval_s: float = 30.0
    max_notifications_per_min: int = 60
    max_skew_s: float = 300.0
    max_pending: int = 20_000
    max_open: int = 2_000
    max_alerts_kept: int = 200
    max_timeline: int = 100
    max_fingerprints: int = 200_000
    max_resolved_kept: int = 1_000


class Held(msgspec.Struct, frozen=True, kw_only=True):
    """What an open incident holds beyond its published record, persisted with it so a restarted
    correlator resolves it as this one would have: the stateful alerts still firing (fingerprint,
    whether it names the root) and when its last momentary alert came."""

    firing: list[tuple[str, bool]] = []
    last_momentary_at: float | None = None


@dataclass(frozen=True, slots=True)
class Signal:
    """An alert as the correlator sees it."""

    fingerprint: str
    source: str
    severity: Severity
    summary: str
    resource: Resource | None
    job_id: str | None
    firing: bool
    momentary: bool
    at: float
    tenant: str | None = None
    """The job's tenant as Loom's own event gave it (a job alert the correlator made itself, never
    a label of a raw alert): listed for the job when placement no longer holds it."""
    stands_on: Resource | None = None
    """A server the alert's resource depends on and that would explain it (label ``stands_on``:
    ``nats`` for a service missing its health answers, ``postgres`` for one reporting it
    unavailable): many services alerting at once group under that server, not one incident each."""


def _resource_of(alert: Alert) -> Resource | None:
    if alert.node:
        return ("node", alert.node)
    if alert.cluster:
        return ("cluster", alert.cluster)
    if alert.link:
        return ("link", link_name(*alert.link))
    if alert.zone:
        return ("zone", alert.zone)
    if alert.region:
        return ("region", alert.region)
    service = alert.labels.get("service")
    if service:
        return ("service", service)
    return None


def fingerprint_of(alert: Alert) -> str:
    """The source's ``dedup_key``, else a hash of the source, what it names and its labels."""
    if alert.dedup_key:
        return alert.dedup_key
    named = (alert.source, alert.region, alert.zone, alert.cluster, alert.node, alert.link, alert.job_id)
    labels = sorted(alert.labels.items())
    return hashlib.sha256(repr((named, labels)).encode()).hexdigest()[:32]


def signal_of(alert: Alert, *, own: bool = False) -> Signal:
    """The correlator's view of a wire alert (``own``: one it made from Loom's own events, whose
    ``tenant`` label is the job's)."""
    resource = _resource_of(alert)
    if resource is None and alert.job_id is None:
        # Names nothing: kept, grouped by source and alert name, unattributed.
        resource = ("service", f"{alert.source}:{alert.labels.get('alertname', 'unnamed')}")
    return Signal(
        fingerprint=fingerprint_of(alert),
        source=alert.source,
        severity=alert.severity,
        summary=alert.summary,
        resource=resource,
        job_id=alert.job_id,
        firing=alert.status == "firing",
        momentary=alert.momentary,
        at=alert.at,
        tenant=(alert.labels.get("tenant") or None) if own and alert.job_id is not None else None,
        stands_on=("server", alert.labels["stands_on"]) if alert.labels.get("stands_on") in SERVERS else None,
    )


@dataclass(slots=True)
class SeenAlert:
    """One distinct alert of an incident."""

    summary: str
    source: str
    first_at: float
    last_at: float
    count: int = 1


@dataclass(slots=True)
class Incident:
    """Alerts grouped under one root resource."""

    incident_id: str
    root: Resource
    root_known: bool
    root_reason: str
    candidates: list[tuple[Resource, float]]
    opened_at: float
    updated_at: float
    severity: Severity = "warning"
    summary: str = ""
    state: IncidentState = "open"
    resolved_at: float | None = None
    acked_at: float | None = None
    acked_by: str | None = None
    jobs: dict[str, str | None] = field(default_factory=dict)
    dags: set[str] = field(default_factory=set)
    active: set[str] = field(default_factory=set)
    """Fingerprints of stateful alerts still firing."""
    active_root: set[str] = field(default_factory=set)
    """Those of them naming the root itself: the root has recovered when the last one resolves."""
    unheard: set[str] = field(default_factory=set)
    """Of :attr:`active`, those restored from the persisted record and not heard firing since: an
    incident held only by them resolves after ``quiet_s`` without an alert, as before they were
    kept (their recovery may never come: a stream's retention passed, a service no longer
    watched), unless it comes first."""
    alerts: dict[str, SeenAlert] = field(default_factory=dict)
    alert_count: int = 0
    distinct_alerts: int = 0
    last_momentary_at: float | None = None
    timeline: deque[TimelineEntry] = field(default_factory=deque)
    reopened: int = 0
    open_since: float | None = None
    """When it last became open (its opening, or its last re-opening; None: ``opened_at``)."""
    version: int = 0
    merged_into: str | None = None
    dirty: str = ""
    """Why an update is due (empty: none)."""
    notified_at: float = -math.inf
    opened_sent: bool = False

    @property
    def is_open(self) -> bool:
        """Open or acknowledged (alerts still attach)."""
        return self.state != "resolved"

    def held(self) -> Held:
        """What to persist beside the record (:class:`Held`)."""
        return Held(
            firing=sorted((fp, fp in self.active_root) for fp in self.active),
            last_momentary_at=self.last_momentary_at,
        )

    @classmethod
    def from_change(cls, change: IncidentChange, held: Held | None = None) -> Incident:
        """An incident back from its persisted record and what it held (:meth:`held`): the
        recovery of the alerts still firing resolves it, as it would have before the restart.
        Without ``held`` (a record an older version wrote) nothing is known to fire, and
        ``quiet_s`` without alerts resolves it."""
        root: Resource = (change.root_kind, change.root)  # type: ignore[assignment]  # kinds are ours
        firing = held.firing if held is not None and change.state != "resolved" else []
        return cls(
            incident_id=change.incident_id,
            root=root,
            root_known=change.root_known,
            root_reason=change.root_reason,
            candidates=[((c.kind, c.name), c.score) for c in change.candidates],  # type: ignore[misc]
            opened_at=change.opened_at,
            updated_at=change.updated_at,
            severity=change.severity,
            summary=change.summary,
            state=change.state,
            resolved_at=change.resolved_at,
            acked_at=change.acked_at,
            acked_by=change.acked_by,
            jobs={j.job_id: j.tenant for j in change.jobs},
            dags=set(change.dags),
            active={fp for fp, _ in firing},
            active_root={fp for fp, root_named in firing if root_named},
            unheard={fp for fp, _ in firing},
            alert_count=change.alerts,
            distinct_alerts=change.distinct_alerts,
            last_momentary_at=held.last_momentary_at if held is not None else change.updated_at,
            timeline=deque(change.timeline),
            reopened=change.reopened,
            version=change.version,
            merged_into=change.merged_into,
            opened_sent=True,
            notified_at=change.updated_at,
        )

    def change(self, kind: IncidentChangeKind, reason: str) -> IncidentChange:
        """The incident as a notification of ``kind``."""
        listed = sorted(self.jobs.items())[:MAX_JOBS_LISTED]
        tenants = sorted({t for t in self.jobs.values() if t is not None})[:MAX_JOBS_LISTED]
        return IncidentChange(
            incident_id=self.incident_id,
            change=kind,
            reason=reason[:500],
            state=self.state,
            root_kind=self.root[0],
            root=self.root[1][:200],
            root_known=self.root_known,
            root_reason=self.root_reason[:500],
            candidates=[
                RootCandidate(kind=r[0], name=r[1][:200], score=round(max(s, 0.0), 4))
                for r, s in self.candidates[:8]
            ],
            severity=self.severity,
            summary=self.summary[:1024],
            jobs=[AffectedJob(job_id=j, tenant=t) for j, t in listed],
            jobs_total=len(self.jobs),
            tenants=tenants,
            dags=sorted(self.dags)[:MAX_JOBS_LISTED],
            alerts=self.alert_count,
            distinct_alerts=self.distinct_alerts,
            unattributed=not self.jobs,
            opened_at=self.opened_at,
            updated_at=self.updated_at,
            resolved_at=self.resolved_at,
            acked_at=self.acked_at,
            acked_by=self.acked_by,
            reopened=self.reopened,
            version=max(self.version, 1),
            merged_into=self.merged_into,
            timeline=list(self.timeline)[-200:],
        )


@dataclass(frozen=True, slots=True)
class Notification:
    """One incident change to publish (and send to webhooks)."""

    kind: IncidentChangeKind
    incident: IncidentChange


@dataclass(slots=True)
class _Waiting:
    signal: Signal
    implicated: frozenset[Resource]
    received_at: float


@dataclass(slots=True)
class _Evidence:
    """What the waiting alerts say about each resource they implicate."""

    explained: Counter[Resource] = field(default_factory=Counter)
    jobs_hit: dict[Resource, set[str]] = field(default_factory=dict)
    nodes_hit: dict[Resource, set[str]] = field(default_factory=dict)
    clusters_hit: dict[Resource, set[str]] = field(default_factory=dict)
    links_hit: dict[Resource, set[str]] = field(default_factory=dict)
    named: set[Resource] = field(default_factory=set)

    def add(self, signal: Signal, implicated: frozenset[Resource], cluster_of_node: dict[str, str]) -> None:
        """Count one alert."""
        if signal.resource is not None:
            self.named.add(signal.resource)
        kind, name = signal.resource if signal.resource is not None else ("", "")
        hit_cluster = name if kind == "cluster" else cluster_of_node.get(name) if kind == "node" else None
        for r in implicated:
            self.explained[r] += 1
            if signal.job_id is not None:
                self.jobs_hit.setdefault(r, set()).add(signal.job_id)
            if kind == "node":
                self.nodes_hit.setdefault(r, set()).add(name)
            if hit_cluster is not None:
                self.clusters_hit.setdefault(r, set()).add(hit_cluster)
            if kind == "link":
                self.links_hit.setdefault(r, set()).add(name)


def _share(hit: set[str] | None, total: int) -> float | None:
    return None if not hit else len(hit) / max(total, len(hit))


def rank(
    waiting: Iterable[tuple[Signal, frozenset[Resource]]], placements: Placements
) -> list[tuple[Resource, float]]:
    """Root-cause candidates of a set of alerts, best first, with their scores (module docstring)."""
    inv = placements.inventory
    ev = _Evidence()
    for signal, implicated in waiting:
        ev.add(signal, implicated, inv.cluster_of_node)
    nodes_of, clusters_of = placements.children()
    scored: list[tuple[float, int, str, Resource]] = []
    for r, count in ev.explained.items():
        precision = 1.0
        if r not in ev.named and r[0] != "job":
            kind = r[0]
            shares = [
                _share(ev.jobs_hit.get(r), len(placements.jobs_on(r))),
                _share(ev.nodes_hit.get(r), len(nodes_of.get(r[1], ()))) if kind == "cluster" else None,
                _share(ev.nodes_hit.get(r), sum(len(nodes_of.get(c, ())) for c in clusters_of.get(r, ())))
                if kind in ("zone", "region")
                else None,
                _share(ev.clusters_hit.get(r), len(clusters_of.get(r, ())))
                if kind in ("zone", "region")
                else None,
                _share(ev.links_hit.get(r), len(inv.regions) - 1) if kind == "region" else None,
            ]
            precision = min((x for x in shares if x is not None), default=1.0)
        score = count * math.sqrt(precision)
        scored.append((score, SPECIFICITY.get(r[0], 9), r[1], r))
    scored.sort(key=lambda s: (-s[0], s[1], s[2]))
    return [(r, score) for score, _, _, r in scored]


class Correlator:
    """Incidents from alerts (module docstring); feed :meth:`ingest`, call :meth:`tick` regularly."""

    def __init__(self, placements: Placements, config: CorrelatorConfig | None = None) -> None:
        self.placements = placements
        self.config = config or CorrelatorConfig()
        self.incidents: dict[str, Incident] = {}
        self.open_by_root: dict[Resource, str] = {}
        self.resolved_by_root: dict[Resource, str] = {}
        self.fingerprints: dict[str, str] = {}
        self.waiting: list[_Waiting] = []
        self.counts: Counter[str] = Counter()
        self._seq = 0
        self._tokens = float(self.config.max_notifications_per_min)
        self._tokens_at: float | None = None
        self._queued_opens: deque[str] = deque()
        self._changed: set[str] = set()
        """Incidents changed since the caller last took them (:meth:`take_changed`, to persist)."""
        self._above_of: dict[Resource, frozenset[Resource]] = {}
        """Open roots -> what each stands on; ``_under`` is its inverse (what stands under a resource)."""
        self._under: dict[Resource, set[Resource]] = {}
        self._held = 0
        """The first ``_held`` waiting alerts are a lone job's, waiting for company until ``_regroup_at``."""
        self._regroup_at = math.inf

    # ---- input ---------------------------------------------------------------------------------

    def set_placements(self, placements: Placements) -> None:
        """A newer snapshot of which jobs run where."""
        self.placements = placements
        for root, inc_id in list(self.open_by_root.items()):
            self._close_root(root)
            self._open_root(root, inc_id)

    def ingest(self, alert: Alert | Signal, now: float, *, own: bool = False) -> list[Notification]:
        """Take one alert received at ``now`` (the correlator's clock); ``own``: made by the
        correlator from Loom's own events (:func:`signal_of`)."""
        signal = signal_of(alert, own=own) if isinstance(alert, Alert) else alert
        self.counts["received"] += 1
        skewed = abs(signal.at - now) > self.config.max_skew_s
        if skewed:
            self.counts["skewed"] += 1
        if not signal.firing:
            return self._resolved_alert(signal, now)
        known = self.fingerprints.get(signal.fingerprint)
        if known is not None:
            inc = self.incidents.get(known)
            if inc is not None and inc.is_open:
                self.counts["deduplicated"] += 1
                self._record(inc, signal, now, skewed)
                return []
        implicated = self.placements.implicated(signal.resource, signal.job_id)
        if signal.stands_on is not None:
            implicated = implicated | {signal.stands_on}
        inc = self._open_incident_over(implicated)
        if inc is not None:
            self.counts["attached"] += 1
            self._attach(inc, signal, now, skewed)
            return []
        self.waiting.append(_Waiting(signal, implicated, now))
        if skewed:
            self.counts["skewed_waiting"] += 1
        if len(self.waiting) >= self.config.max_pending:
            return self._group(now, force=True)
        return []

    def ack(self, incident_id: str, by: str, now: float) -> Notification | None:
        """Acknowledge an open incident; its ``updated`` notification (None if nothing changed)."""
        inc = self.incidents.get(incident_id)
        if inc is None:
            raise KeyError(incident_id)
        if inc.state != "open":
            return None
        inc.state, inc.acked_at, inc.acked_by = "acknowledged", now, by
        self._timeline(inc, now, f"acknowledged by {by}")
        return self._notify(inc, "updated", f"acknowledged by {by}", now, force=True)

    def resolve(self, incident_id: str, why: str, now: float) -> list[Notification]:
        """Resolve an incident by hand (an operator, or the end of a benchmark trial)."""
        inc = self.incidents.get(incident_id)
        if inc is None:
            raise KeyError(incident_id)
        return self._resolve(inc, now, why)

    def tick(self, now: float) -> list[Notification]:
        """Group the alerts that waited long enough, resolve quiet incidents, send due updates."""
        out: list[Notification] = []
        held = min(self._held, len(self.waiting))
        fresh_due = (
            len(self.waiting) > held and now - self.waiting[held].received_at >= self.config.group_wait_s
        )
        if fresh_due or (held and now >= self._regroup_at):
            out.extend(self._group(now))
        for inc_id in list(self.open_by_root.values()):
            inc = self.incidents[inc_id]
            if (
                not inc.active
                and inc.last_momentary_at is not None
                and now - inc.last_momentary_at >= self.config.quiet_s
            ):
                out.extend(self._resolve(inc, now, f"no alert for {self.config.quiet_s:g} s"))
            elif inc.active and inc.active <= inc.unheard and now - inc.updated_at >= self.config.quiet_s:
                # Held only by alerts restored at start and not heard since: the quiet rule.
                why = f"no alert for {self.config.quiet_s:g} s (none heard since the correlator restarted)"
                out.extend(self._resolve(inc, now, why))
        self._refill(now)
        while self._queued_opens and self._tokens >= 1:
            queued = self.incidents.get(self._queued_opens.popleft())
            if queued is not None and not queued.opened_sent and queued.is_open:
                note = self._notify(queued, "opened", queued.dirty or "opened", now)
                if note is not None:
                    out.append(note)
        for inc_id in list(self.open_by_root.values()):
            inc = self.incidents[inc_id]
            if inc.dirty and inc.opened_sent and now - inc.notified_at >= self.config.min_update_interval_s:
                note = self._notify(inc, "updated", inc.dirty, now)
                if note is not None:
                    out.append(note)
        self._evict()
        return out

    def busy(self) -> bool:
        """Whether :meth:`tick` has near work: alerts waiting to be grouped, opens queued behind
        the rate limit, incidents changed since the last :meth:`take_changed`, or an open
        incident with an update to send. Otherwise a tick can only resolve an incident quiet for
        ``quiet_s`` or evict resolved ones, and the caller may tick slowly."""
        return bool(
            self.waiting
            or self._queued_opens
            or self._changed
            or any(self.incidents[i].dirty for i in self.open_by_root.values())
        )

    def take_changed(self) -> list[Incident]:
        """Incidents changed since the last call (for the service to persist)."""
        changed = [self.incidents[i] for i in sorted(self._changed) if i in self.incidents]
        self._changed.clear()
        return changed

    def open_incidents(self) -> list[Incident]:
        """Open and acknowledged incidents, oldest first."""
        return sorted((self.incidents[i] for i in self.open_by_root.values()), key=lambda inc: inc.opened_at)

    # ---- correlation ---------------------------------------------------------------------------

    def _open_incident_over(self, implicated: frozenset[Resource]) -> Incident | None:
        over = [self.incidents[self.open_by_root[r]] for r in implicated if r in self.open_by_root]
        if not over:
            return None
        # The most specific root; between equals, the oldest (the same one on every run).
        return min(over, key=lambda inc: (SPECIFICITY.get(inc.root[0], 9), inc.opened_at, inc.incident_id))

    def _group(self, now: float, *, force: bool = False) -> list[Notification]:
        out: list[Notification] = []
        waiting, self.waiting = self.waiting, []
        held: list[_Waiting] = []
        context = self._context(now)
        for component in _components(waiting):
            part = component
            while part:
                touched = frozenset().union(*(w.implicated for w in part))
                # A link incident is evidence for link alerts only: a region whose links fail one
                # by one is the region; a cluster failing in a region with a link down is the cluster.
                linked = _links_only(part)
                near = [c for c in context if c[1] & touched and (linked or c[0].resource is None)]
                ranked = rank([(w.signal, w.implicated) for w in part] + near, self.placements)
                # The best root that explains a waiting alert (context alone forms nothing).
                root, score = next((r, sc) for r, sc in ranked if any(r in w.implicated for w in part))
                group = [w for w in part if root in w.implicated]
                part = [w for w in part if root not in w.implicated]
                if (
                    root[0] == "job"
                    and not force
                    and now - min(w.received_at for w in group) < self.config.weak_wait_s
                ):
                    held.extend(group)  # a lone job's alerts wait for company a while longer
                    continue
                out.extend(self._form(root, ranked[:5], score, group, now, links_only=_links_only(group)))
        held.sort(key=lambda w: w.received_at)
        self.waiting = held + self.waiting
        self._held = len(held)
        self._regroup_at = held[0].received_at + self.config.weak_wait_s if held else math.inf
        return out

    def _context(self, now: float) -> list[tuple[Signal, frozenset[Resource]]]:
        """Open incidents of the last ``context_s`` rooted at one job or one link, as evidence for
        grouping: jobs that alerted further apart than ``weak_wait_s`` still point at the link or
        node they share, and a region's links failing a few seconds apart at the region, as they
        would had they alerted together (its link incidents are then taken over). (Not a cluster's
        incident: a region of one cluster would take every later alert of that region.)"""
        out: list[tuple[Signal, frozenset[Resource]]] = []
        for root, inc_id in self.open_by_root.items():
            if root[0] not in ("job", "link"):
                continue
            inc = self.incidents[inc_id]
            since = inc.open_since if inc.open_since is not None else inc.opened_at
            if now - since > self.config.context_s:
                continue
            if root[0] == "job":
                signal = Signal(inc.incident_id, "context", inc.severity, "", None, root[1], True, True, now)
                out.append((signal, self.placements.implicated(None, root[1])))
            else:
                signal = Signal(inc.incident_id, "context", inc.severity, "", root, None, True, True, now)
                out.append((signal, self.placements.implicated(root, None)))
        return out

    def _form(
        self,
        root: Resource,
        candidates: list[tuple[Resource, float]],
        score: float,
        group: list[_Waiting],
        now: float,
        *,
        links_only: bool = False,
    ) -> list[Notification]:
        reason = self._reason(root, candidates, group)
        # An open incident this root stands above (a node's, when the root is its cluster): take it
        # over. Links' alerts that found a region (through its open link incidents) take over its
        # link incidents only, not a node's or a cluster's of the region that alerted before.
        narrow = links_only and root[0] in ("region", "zone")
        below = [
            self.incidents[self.open_by_root[r]]
            for r in self._under.get(root, ())
            if not narrow or r[0] == "link"
        ]
        if below:
            below.sort(key=lambda inc: (inc.opened_at, inc.incident_id))
            return self._take_over(
                below, root=root, reason=reason, candidates=candidates, group=group, now=now
            )
        relapsed = self.incidents.get(self.resolved_by_root.get(root, ""))
        if (
            relapsed is not None
            and relapsed.resolved_at is not None
            and now - relapsed.resolved_at <= self.config.reopen_s
        ):
            return self._reopen(relapsed, reason, candidates, group, now)
        if len(self.open_by_root) >= self.config.max_open and root != OVERFLOW:
            self.counts["overflowed"] += len(group)
            return self._form(OVERFLOW, [(OVERFLOW, score)], score, group, now)
        self._seq += 1
        inc = Incident(
            incident_id=f"inc-{int(now * 1000):x}-{self._seq}",
            root=root,
            root_known=self.placements.inventory.knows(root),
            root_reason=reason,
            candidates=candidates,
            opened_at=now,
            updated_at=now,
        )
        self.incidents[inc.incident_id] = inc
        self._open_root(root, inc.incident_id)
        self.counts["incidents"] += 1
        self._timeline(inc, now, f"opened on {describe(root)}: {reason}")
        self._add_jobs(inc, self.placements.jobs_on(root), now)
        self._attach_group(inc, group, now)
        inc.summary = f"{describe(root)}: {group[0].signal.summary}" if group else describe(root)
        inc.dirty = ""
        note = self._notify(inc, "opened", reason, now)
        if note is None:
            self._queued_opens.append(inc.incident_id)
        return [note] if note is not None else []

    def _open_root(self, root: Resource, inc_id: str) -> None:
        self.open_by_root[root] = inc_id
        above = self.placements.implicated(root if root[0] != "job" else None, _job(root)) | {root}
        self._above_of[root] = above
        for r in above:
            self._under.setdefault(r, set()).add(root)

    def _close_root(self, root: Resource) -> None:
        self.open_by_root.pop(root, None)
        for r in self._above_of.pop(root, frozenset()):
            under = self._under.get(r)
            if under is not None:
                under.discard(root)
                if not under:
                    del self._under[r]

    def _attach_group(self, inc: Incident, group: list[_Waiting], now: float) -> None:
        for w in group:
            self._attach(inc, w.signal, now, abs(w.signal.at - w.received_at) > self.config.max_skew_s)

    def _take_over(
        self,
        below: list[Incident],
        *,
        root: Resource,
        reason: str,
        candidates: list[tuple[Resource, float]],
        group: list[_Waiting],
        now: float,
    ) -> list[Notification]:
        out: list[Notification] = []
        inc = below[0]
        if inc.root != root:
            old = inc.root
            self._close_root(old)
            inc.root, inc.root_reason, inc.candidates = root, reason, candidates
            inc.active_root.clear()
            inc.root_known = self.placements.inventory.knows(root)
            self._open_root(root, inc.incident_id)
            self._mark(inc, f"root cause now {describe(root)} (was {describe(old)})", now)
            self.counts["promoted"] += 1
        for other in below[1:]:
            out.extend(self._merge(other, inc, now))
        self._add_jobs(inc, self.placements.jobs_on(root), now)
        self._attach_group(inc, group, now)
        return out

    def _reopen(
        self,
        inc: Incident,
        reason: str,
        candidates: list[tuple[Resource, float]],
        group: list[_Waiting],
        now: float,
    ) -> list[Notification]:
        root = inc.root
        del self.resolved_by_root[root]
        inc.state, inc.resolved_at, inc.acked_at, inc.acked_by = "open", None, None, None
        inc.reopened += 1
        inc.open_since = now
        inc.root_reason, inc.candidates = reason, candidates
        self._open_root(root, inc.incident_id)
        self._timeline(inc, now, f"re-opened: {describe(root)} relapsed")
        self.counts["reopened"] += 1
        self._add_jobs(inc, self.placements.jobs_on(root), now)
        self._attach_group(inc, group, now)
        inc.dirty = ""
        note = self._notify(inc, "opened", f"re-opened: {describe(root)} relapsed", now, force=True)
        return [note] if note is not None else []

    def _reason(self, root: Resource, candidates: list[tuple[Resource, float]], group: list[_Waiting]) -> str:
        jobs = {w.signal.job_id for w in group if w.signal.job_id is not None}
        named = sum(1 for w in group if w.signal.resource == root)
        parts = [f"when it opened, it explained the {len(group)} alert(s) grouped then"]
        if named:
            parts.append(f"{named} name it")
        if jobs:
            parts.append(f"{len(jobs)} alerting job(s) use it")
        if len(candidates) > 1:
            runner_up, score = candidates[1]
            parts.append(f"next: {describe(runner_up)} ({score:.2f} vs {candidates[0][1]:.2f})")
        return "; ".join(parts)

    def _merge(self, other: Incident, into: Incident, now: float) -> list[Notification]:
        self._close_root(other.root)
        for fp in other.alerts:
            self.fingerprints[fp] = into.incident_id
        into.active |= other.active
        into.unheard |= other.unheard
        into.alert_count += other.alert_count
        into.distinct_alerts += other.distinct_alerts
        self._add_jobs(into, other.jobs, now, known=other.jobs)
        other.merged_into = into.incident_id
        self.counts["merged"] += 1
        return self._resolve(other, now, f"merged into {into.incident_id}")

    def _attach(self, inc: Incident, signal: Signal, now: float, skewed: bool) -> None:
        fp = signal.fingerprint
        self._remember(fp, inc.incident_id)
        seen = inc.alerts.get(fp)
        if seen is None:
            inc.distinct_alerts += 1
            if len(inc.alerts) < self.config.max_alerts_kept:
                inc.alerts[fp] = SeenAlert(signal.summary, signal.source, now, now)
            if len(inc.alerts) <= 20:
                self._timeline(
                    inc, now, f"{signal.source}: {signal.summary}" + (" (clock skewed)" if skewed else "")
                )
        self._record(inc, signal, now, skewed)
        if _SEVERITY_RANK[signal.severity] > _SEVERITY_RANK[inc.severity]:
            inc.severity = signal.severity
            self._mark(inc, f"severity {signal.severity}", now)
        if signal.job_id is not None:
            self._add_jobs(inc, [signal.job_id], now, known={signal.job_id: signal.tenant})

    def _record(self, inc: Incident, signal: Signal, now: float, skewed: bool) -> None:
        inc.alert_count += 1
        seen = inc.alerts.get(signal.fingerprint)
        if seen is not None and seen.last_at != now:
            seen.last_at = now
            seen.count += 1
        if signal.momentary:
            inc.last_momentary_at = now
        else:
            inc.unheard.discard(signal.fingerprint)
            inc.active.add(signal.fingerprint)
            if signal.resource == inc.root:
                inc.active_root.add(signal.fingerprint)
        inc.updated_at = now
        self._changed.add(inc.incident_id)

    def _add_jobs(
        self,
        inc: Incident,
        jobs: Iterable[str],
        now: float,
        *,
        known: Mapping[str, str | None] | None = None,
    ) -> None:
        """``known``: tenants already known for some of the jobs (placement may no longer hold
        a job that ended)."""
        added = 0
        for job_id in jobs:
            if job_id in inc.jobs:
                if inc.jobs[job_id] is None and (tenant := (known or {}).get(job_id)) is not None:
                    inc.jobs[job_id] = tenant  # named by a later alert of Loom's own
                    self._changed.add(inc.incident_id)
                continue
            inc.jobs[job_id] = self.placements.tenant_of(job_id) or (known or {}).get(job_id)
            placed = self.placements.jobs.get(job_id)
            if placed is not None and placed.parent:
                inc.dags.add(placed.parent)
            added += 1
        if added and inc.opened_sent:
            self._mark(inc, f"{added} more job(s) affected ({len(inc.jobs)} in all)", now)

    def _resolved_alert(self, signal: Signal, now: float) -> list[Notification]:
        self.counts["resolved_alerts"] += 1
        inc_id = self.fingerprints.get(signal.fingerprint)
        inc = self.incidents.get(inc_id) if inc_id is not None else None
        if signal.resource is not None and signal.resource in self.open_by_root:
            # About the root itself: recovered once no other alert naming it still fires.
            root_inc = self.incidents[self.open_by_root[signal.resource]]
            root_inc.active.discard(signal.fingerprint)
            root_inc.active_root.discard(signal.fingerprint)
            root_inc.updated_at = now
            self._changed.add(root_inc.incident_id)
            if root_inc.active_root:
                return []
            return self._resolve(root_inc, now, f"{describe(signal.resource)} recovered")
        self.waiting = [w for w in self.waiting if w.signal.fingerprint != signal.fingerprint]
        if inc is None or not inc.is_open:
            return []
        inc.active.discard(signal.fingerprint)
        inc.updated_at = now
        self._changed.add(inc.incident_id)
        if not inc.active and (
            inc.last_momentary_at is None or now - inc.last_momentary_at >= self.config.quiet_s
        ):
            return self._resolve(inc, now, "every alert resolved")
        return []

    def _resolve(self, inc: Incident, now: float, why: str) -> list[Notification]:
        if not inc.is_open:
            return []
        self._close_root(inc.root)
        inc.state, inc.resolved_at, inc.dirty = "resolved", now, ""
        inc.active.clear()
        inc.active_root.clear()
        inc.unheard.clear()
        if inc.merged_into is None:
            self.resolved_by_root[inc.root] = inc.incident_id
        self._timeline(inc, now, f"resolved: {why}")
        self.counts["resolved"] += 1
        if not inc.opened_sent:  # never announced (waiting for a token): say nothing of it
            return []
        note = self._notify(inc, "resolved", why, now, force=True)
        return [note] if note is not None else []

    # ---- notifications -------------------------------------------------------------------------

    def _mark(self, inc: Incident, why: str, now: float) -> None:
        self._timeline(inc, now, why)
        inc.dirty = why if not inc.dirty else f"{inc.dirty}; {why}"[:500]

    def _refill(self, now: float) -> None:
        rate_per_s = self.config.max_notifications_per_min / 60.0
        if self._tokens_at is not None:
            self._tokens = min(
                float(self.config.max_notifications_per_min),
                self._tokens + (now - self._tokens_at) * rate_per_s,
            )
        self._tokens_at = now

    def _notify(
        self, inc: Incident, kind: IncidentChangeKind, why: str, now: float, *, force: bool = False
    ) -> Notification | None:
        self._refill(now)
        if self._tokens < 1 and not force:
            self.counts["notifications_deferred"] += 1
            return None
        self._tokens -= 1
        inc.version += 1
        inc.notified_at = now
        inc.dirty = ""
        if kind == "opened":
            inc.opened_sent = True
        self._changed.add(inc.incident_id)
        self.counts[f"notified_{kind}"] += 1
        return Notification(kind, inc.change(kind, why))

    # ---- bookkeeping ---------------------------------------------------------------------------

    def _timeline(self, inc: Incident, now: float, what: str) -> None:
        inc.timeline.append(TimelineEntry(at=now, what=what[:500]))
        while len(inc.timeline) > self.config.max_timeline:
            inc.timeline.popleft()
        self._changed.add(inc.incident_id)

    def _remember(self, fp: str, inc_id: str) -> None:
        self.fingerprints.pop(fp, None)
        self.fingerprints[fp] = inc_id
        while len(self.fingerprints) > self.config.max_fingerprints:
            del self.fingerprints[next(iter(self.fingerprints))]

    def _evict(self) -> None:
        resolved = [i for i, inc in self.incidents.items() if not inc.is_open]
        for inc_id in resolved[: max(len(resolved) - self.config.max_resolved_kept, 0)]:
            inc = self.incidents.pop(inc_id)
            if self.resolved_by_root.get(inc.root) == inc_id:
                del self.resolved_by_root[inc.root]

    def restore(self, incident: Incident) -> None:
        """Take back an incident persisted by an earlier run (open ones keep attracting alerts)."""
        self.incidents[incident.incident_id] = incident
        incident.opened_sent = True
        if incident.is_open:
            self._open_root(incident.root, incident.incident_id)
            for fp in sorted(incident.active):
                self._remember(fp, incident.incident_id)
        elif incident.merged_into is None:
            self.resolved_by_root[incident.root] = incident.incident_id


def _links_only(waiting: Iterable[_Waiting]) -> bool:
    """Whether every one of these alerts names a link."""
    return all(w.signal.resource is not None and w.signal.resource[0] == "link" for w in waiting)


def _components(waiting: list[_Waiting]) -> list[list[_Waiting]]:
    """Waiting alerts split into sets that share no implicated resource (ranked apart: a storm of
    unrelated alerts costs linear time, not quadratic)."""
    parent: dict[Resource, Resource] = {}

    def find(r: Resource) -> Resource:
        while parent.setdefault(r, r) != r:
            parent[r] = parent[parent[r]]
            r = parent[r]
        return r

    for w in waiting:
        first: Resource | None = None
        for r in w.implicated:
            if first is None:
                first = find(r)
            else:
                parent[find(r)] = first
                first = find(first)
    parts: dict[Resource | None, list[_Waiting]] = {}
    for w in waiting:
        key = find(next(iter(w.implicated))) if w.implicated else None
        parts.setdefault(key, []).append(w)
    return list(parts.values())


def _job(r: Resource) -> str | None:
    return r[1] if r[0] == "job" else None
