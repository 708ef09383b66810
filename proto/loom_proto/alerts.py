"""Alerts from any source, before correlation into incidents."""

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from loom_proto.ids import Id
from loom_proto.jobs import UnixSeconds

Severity = Literal["info", "warning", "critical"]


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
