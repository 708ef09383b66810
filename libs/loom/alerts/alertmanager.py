"""Prometheus Alertmanager's webhook payload (version 4), read unchanged, as Loom alerts. Pure.

Alertmanager posts ``{"version": "4", "status", "receiver", "groupLabels", "commonLabels",
"commonAnnotations", "externalURL", "groupKey", "truncatedAlerts", "alerts": [...]}``; each alert
has ``status``, ``labels``, ``annotations``, ``startsAt``, ``endsAt``, ``generatorURL`` and
``fingerprint``. Fields Alertmanager may add later are ignored, not refused.

Labels Loom reads (the rest travel in ``labels``): ``region``, ``zone``, ``cluster``, ``node``
(or ``nodename`` / ``hostname``), ``job_id`` (or ``loom_job``; Prometheus's own ``job`` is the
scrape job and is left alone), ``link_src`` + ``link_dst`` (or ``src_region`` + ``dst_region``),
``service`` and ``severity`` (``critical`` / ``page`` → critical, ``info`` / ``none`` → info,
anything else → warning). A label value that cannot be a Loom id (``10.0.0.1:9100``) is kept in
``labels`` only; the alert then names fewer resources, and if none, it is kept unattributed.
"""

from __future__ import annotations

import hashlib
import re
from datetime import datetime

import msgspec

from loom.errors import InvalidInputError
from loom_proto.alerts import Alert, Severity
from loom_proto.codec import DecodeError, decode
from loom_proto.ids import ID_PATTERN

_ID = re.compile(ID_PATTERN)
_FRACTION = re.compile(r"(\.\d{6})\d+")
MAX_ALERTS_PER_PAYLOAD = 1_000
SOURCE = "alertmanager"


class MalformedPayloadError(InvalidInputError):
    """A webhook payload that is not Alertmanager's version 4: answered 400 and dead-lettered."""


class AmAlert(msgspec.Struct, frozen=True, kw_only=True):
    """One alert of the payload (unknown fields ignored)."""

    status: str
    labels: dict[str, str]
    annotations: dict[str, str] = {}
    startsAt: str
    endsAt: str = ""
    generatorURL: str = ""
    fingerprint: str = ""


class AmPayload(msgspec.Struct, frozen=True, kw_only=True):
    """The webhook body (unknown fields ignored)."""

    version: str
    status: str = ""
    receiver: str = ""
    groupKey: str = ""
    alerts: list[AmAlert]


def parse_time(text: str) -> float:
    """RFC 3339 (nanoseconds allowed) -> Unix seconds."""
    try:
        stamp = datetime.fromisoformat(_FRACTION.sub(r"\1", text.strip()).replace("Z", "+00:00"))
    except ValueError as exc:
        raise MalformedPayloadError(f"not an RFC 3339 time: {text[:64]!r}") from exc
    if stamp.tzinfo is None:
        raise MalformedPayloadError(f"time without a zone: {text[:64]!r}")
    return stamp.timestamp()


def _id(labels: dict[str, str], *names: str) -> str | None:
    for name in names:
        value = labels.get(name)
        if value and _ID.search(value):
            return value
    return None


def _severity(labels: dict[str, str]) -> Severity:
    value = labels.get("severity", "").lower()
    if value in ("critical", "page", "error"):
        return "critical"
    if value in ("info", "none"):
        return "info"
    return "warning"


def to_alert(am: AmAlert) -> Alert:
    """One Alertmanager alert as a Loom :class:`Alert`."""
    if am.status not in ("firing", "resolved"):
        raise MalformedPayloadError(f"alert status must be firing or resolved, got {am.status[:32]!r}")
    labels = am.labels
    at = parse_time(am.startsAt)
    if am.status == "resolved" and am.endsAt:
        at = parse_time(am.endsAt)
    fingerprint = am.fingerprint if am.fingerprint and _ID.search(am.fingerprint) else ""
    if not fingerprint:
        fingerprint = hashlib.sha256(repr(sorted(labels.items())).encode()).hexdigest()[:16]
    src, dst = _id(labels, "link_src", "src_region"), _id(labels, "link_dst", "dst_region")
    summary = (
        am.annotations.get("summary") or am.annotations.get("description") or labels.get("alertname", "")
    )
    try:
        return Alert(
            alert_id=f"am-{fingerprint[:40]}-{int(at * 1000)}-{am.status[0]}",
            source=SOURCE,
            severity=_severity(labels),
            summary=summary[:1024],
            region=_id(labels, "region"),
            zone=_id(labels, "zone"),
            cluster=_id(labels, "cluster"),
            node=_id(labels, "node", "nodename", "hostname"),
            link=(src, dst) if src and dst and src != dst else None,
            job_id=_id(labels, "job_id", "loom_job"),
            labels={k[:128]: v[:512] for k, v in list(labels.items())[:64]},
            dedup_key=f"am-{fingerprint[:200]}",
            at=at,
            status="firing" if am.status == "firing" else "resolved",
        )
    except (msgspec.ValidationError, TypeError) as exc:  # belt and braces: Alert's own constraints
        raise MalformedPayloadError(f"alert does not fit Loom's contract: {exc}") from exc


def parse_payload(body: bytes) -> list[Alert]:
    """The alerts of a webhook body; :class:`MalformedPayloadError` says what is wrong."""
    try:
        payload = decode(body, AmPayload)
    except DecodeError as exc:
        raise MalformedPayloadError(f"not an Alertmanager payload: {exc}") from exc
    if payload.version != "4":
        raise MalformedPayloadError(f"payload version must be '4', got {payload.version[:16]!r}")
    if len(payload.alerts) > MAX_ALERTS_PER_PAYLOAD:
        raise MalformedPayloadError(
            f"{len(payload.alerts)} alerts in one payload (at most {MAX_ALERTS_PER_PAYLOAD})"
        )
    return [to_alert(a) for a in payload.alerts]
