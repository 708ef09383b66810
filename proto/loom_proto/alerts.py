"""Alerts from any source, before correlation into incidents."""

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from loom_proto.ids import Id
from loom_proto.jobs import UnixSeconds

Severity = Literal["info", "warning", "critical"]
AlertStatus = Literal["firing", "resolved"]


class Alert(
    msgspec.Struct, tag_field="kind", tag="alert", forbid_unknown_fields=True, frozen=True, kw_only=True
):
    """Something a monitoring source noticed; ``dedup_key`` groups repeats of the same alert."""

    alert_id: Id
    source: Id
    severity: Severity
    summary: Annotated[str, Meta(max_length=1024)]
    region: Id | None = None
    cluster: Id | None = None
    node: Id | None = None
    link: tuple[Id, Id] | None = None
    labels: Annotated[dict[str, str], Meta(max_length=64)] = {}
    dedup_key: Annotated[str, Meta(max_length=256)] = ""
    at: UnixSeconds
    zone: Id | None = None
    job_id: Id | None = None
    """The Loom job the alert is about (a per-job alert)."""
    status: AlertStatus = "firing"
    """``resolved``: the condition is over (the resource recovered)."""
    momentary: bool = False
    """An event (a job failed), not a condition: it never resolves; it holds an incident open for a
    quiet period only."""


IncidentState = Literal["open", "acknowledged", "resolved"]
IncidentChangeKind = Literal["opened", "updated", "resolved"]


class RootCandidate(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """A resource ranked as the incident's possible root cause, with its score (higher: likelier)."""

    kind: Annotated[str, Meta(max_length=16)]
    name: Annotated[str, Meta(max_length=200)]
    score: Annotated[float, Meta(ge=0)]


class AffectedJob(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """A job an incident hits, with its tenant (None: not in the placements snapshot)."""

    job_id: Id
    tenant: Id | None = None


class TimelineEntry(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """One thing that happened to an incident."""

    at: UnixSeconds
    what: Annotated[str, Meta(max_length=500)]


class IncidentChange(
    msgspec.Struct, tag_field="kind", tag="incident", forbid_unknown_fields=True, frozen=True, kw_only=True
):
    """An incident as it stands after a change, on ``loom.incidents.{opened,updated,resolved}``.

    ``jobs`` lists at most :data:`MAX_JOBS_LISTED` of the ``jobs_total`` jobs it hits.
    """

    incident_id: Id
    change: IncidentChangeKind
    reason: Annotated[str, Meta(max_length=500)]
    state: IncidentState
    root_kind: Annotated[str, Meta(max_length=16)]
    root: Annotated[str, Meta(max_length=200)]
    root_known: bool = True
    """False when the root names a resource Loom does not know (kept, unattributed)."""
    root_reason: Annotated[str, Meta(max_length=500)] = ""
    candidates: Annotated[list[RootCandidate], Meta(max_length=8)] = []
    severity: Severity = "warning"
    summary: Annotated[str, Meta(max_length=1024)] = ""
    jobs: Annotated[list[AffectedJob], Meta(max_length=5_000)] = []
    jobs_total: Annotated[int, Meta(ge=0)] = 0
    tenants: Annotated[list[Id], Meta(max_length=5_000)] = []
    dags: Annotated[list[Id], Meta(max_length=5_000)] = []
    alerts: Annotated[int, Meta(ge=0)] = 0
    """Alerts received for the incident, repeats included."""
    distinct_alerts: Annotated[int, Meta(ge=0)] = 0
    unattributed: bool = False
    opened_at: UnixSeconds
    updated_at: UnixSeconds
    resolved_at: UnixSeconds | None = None
    acked_at: UnixSeconds | None = None
    acked_by: Annotated[str, Meta(max_length=128)] | None = None
    reopened: Annotated[int, Meta(ge=0)] = 0
    version: Annotated[int, Meta(ge=1)] = 1
    merged_into: Id | None = None
    timeline: Annotated[list[TimelineEntry], Meta(max_length=200)] = []


MAX_JOBS_LISTED = 5_000
