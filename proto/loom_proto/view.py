"""The resource view the metrics service publishes: ledger changes per cluster."""

from typing import Annotated

import msgspec
from msgspec import Meta

from loom_proto.ids import Id
from loom_proto.jobs import GpuModel, UnixSeconds


class NodeView(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """One node in the ledger: where it is, what it has, how much is in use, and how fresh that is."""

    node: Id
    zone: Id
    gpu_model: GpuModel | None = None
    gpus_total: Annotated[int, Meta(ge=0)] = 0
    gpus_used: Annotated[int, Meta(ge=0)] = 0
    cpu_milli: Annotated[int, Meta(ge=0)] = 0
    memory_mib: Annotated[int, Meta(ge=0)] = 0
    healthy: bool = True
    updated_at: UnixSeconds
    gpus_reserved: Annotated[int, Meta(ge=0)] = 0
    """Promised by placement and not yet confirmed started by the agent."""
    down: bool = False
    """Its agent reports it failed: the parts running on it are lost (placement re-places them)."""


class ViewDelta(
    msgspec.Struct, tag_field="kind", tag="view_delta", forbid_unknown_fields=True, frozen=True, kw_only=True
):
    """What changed in one cluster's part of the ledger; ``version`` grows with every change."""

    region: Id
    cluster: Id
    version: Annotated[int, Meta(ge=1)]
    full: bool = False
    """True when ``nodes`` is the cluster's complete node list (readers replace, not merge)."""
    nodes: list[NodeView] = []
    removed: list[Id] = []
    stale: bool = False
    """True when the cluster stopped heartbeating within its TTL: offer none of its capacity."""
    trust: Annotated[float, Meta(ge=0, le=1)] | None = None
    """How far the cluster's claimed compute is believed (new clusters start low); a placement input."""
    at: UnixSeconds


class ModelCapacity(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """GPUs of one model in an area: all of them, those free to place on, those promised."""

    gpu_model: GpuModel
    gpus_total: Annotated[int, Meta(ge=0)]
    gpus_available: Annotated[int, Meta(ge=0)]
    gpus_reserved: Annotated[int, Meta(ge=0)] = 0


class ZoneSummary(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Capacity of one availability zone."""

    zone: Id
    models: list[ModelCapacity]
    scu_total: Annotated[float, Meta(ge=0)]
    scu_available: Annotated[float, Meta(ge=0)]


class RegionSummary(
    msgspec.Struct,
    tag_field="kind",
    tag="region_summary",
    forbid_unknown_fields=True,
    frozen=True,
    kw_only=True,
):
    """Capacity of one region and its zones, for pruning: skip a region that cannot fit a job."""

    region: Id
    models: list[ModelCapacity]
    zones: list[ZoneSummary]
    scu_total: Annotated[float, Meta(ge=0)]
    scu_available: Annotated[float, Meta(ge=0)]
    reference_gpu: str = ""
    """The accelerator one SCU is defined by."""
    at: UnixSeconds


class ViewQuery(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """A ``loom.view.query`` request (request-reply, the metrics service answers); every filter optional."""

    region: str | None = None
    zone: str | None = None
    gpu_model: str | None = None
    min_free_gpus: int = 0
    fresh_only: bool = False
    nodes: bool = True
