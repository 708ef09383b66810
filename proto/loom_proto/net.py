"""Network measurements: raw probe samples and the link state derived from them."""

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from loom_proto.ids import Id
from loom_proto.jobs import UnixSeconds

ProbeKind = Literal["udp_echo", "tcp_echo", "tcp_bulk", "udp_burst"]
"""``udp_burst``: the extra UDP echo probes of a loss burst (:mod:`loom.net.burst`), one sample per
period of a link's burst; network perception counts their probes and ignores their RTT."""

NonNegative = Annotated[float, Meta(ge=0)]


class ProbeSample(
    msgspec.Struct, tag_field="kind", tag="probe", forbid_unknown_fields=True, frozen=True, kw_only=True
):
    """One probe round from ``src`` to ``dst``; a lost probe has ``rtt_ms`` None."""

    src: Id
    dst: Id
    probe: ProbeKind
    seq: Annotated[int, Meta(ge=0)]
    sent_at: UnixSeconds
    rtt_ms: Annotated[float, Meta(ge=0, le=60_000)] | None = None
    sent: Annotated[int, Meta(ge=1)] = 1
    lost: Annotated[int, Meta(ge=0)] = 0
    jitter_ms: Annotated[float, Meta(ge=0, le=60_000)] | None = None
    bandwidth_gbps: Annotated[float, Meta(ge=0, le=10_000)] | None = None
    bytes_sent: Annotated[int, Meta(ge=0)] = 0


class RawProbeSample(msgspec.Struct, tag_field="kind", tag="probe", frozen=True, kw_only=True):
    """A :class:`ProbeSample` as sent, read without the contract's bounds (network perception's view).

    Admission is the core's job, so a negative RTT reaches it and is counted under its reason
    instead of failing to decode. Keep the fields in step with :class:`ProbeSample`.
    """

    src: str
    dst: str
    probe: str
    seq: int
    sent_at: float
    rtt_ms: float | None = None
    sent: int = 1
    lost: int = 0
    jitter_ms: float | None = None
    bandwidth_gbps: float | None = None
    bytes_sent: int = 0


class LinkState(
    msgspec.Struct, tag_field="kind", tag="link", forbid_unknown_fields=True, frozen=True, kw_only=True
):
    """The network-perception service's current view of one directed link."""

    src: Id
    dst: Id
    rtt_ms_p50: NonNegative
    rtt_ms_p95: NonNegative
    rtt_ms_p99: NonNegative
    jitter_ms: NonNegative
    loss_rate: Annotated[float, Meta(ge=0, le=1)]
    bandwidth_gbps: NonNegative | None = None
    rtt_ms_forecast: NonNegative | None = None
    cost: NonNegative
    stale: bool = False
    degraded: bool = False
    updated_at: UnixSeconds
    lost_run: Annotated[int, Meta(ge=0)] = 0
    """Probes lost in a row up to now (0 once one answers): a blackhole shows here within a couple
    of probe periods, long before the loss window's rate reaches it."""


class LinkDegraded(
    msgspec.Struct, tag_field="kind", tag="degraded", forbid_unknown_fields=True, frozen=True, kw_only=True
):
    """A link crossed its degrade thresholds (RTT against its baseline, loss, or unreachable)."""

    src: Id
    dst: Id
    at: UnixSeconds
    reason: Annotated[str, Meta(max_length=500)]
    rtt_ms: NonNegative | None = None
    """The RTT estimate when the event was raised (None where none is known)."""
    baseline_rtt_ms: NonNegative
    loss_rate: Annotated[float, Meta(ge=0, le=1)]


class LinkRecovered(
    msgspec.Struct, tag_field="kind", tag="recovered", forbid_unknown_fields=True, frozen=True, kw_only=True
):
    """A degraded link stayed within its (stricter) recover thresholds for the hold time."""

    src: Id
    dst: Id
    at: UnixSeconds
    reason: Annotated[str, Meta(max_length=500)]
    rtt_ms: NonNegative | None = None
    baseline_rtt_ms: NonNegative
    loss_rate: Annotated[float, Meta(ge=0, le=1)]


LinkEventMessage = LinkDegraded | LinkRecovered
"""What ``loom.net.event.<kind>`` carries, told apart by ``kind``."""


class ProbeEndpoints(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Where a cluster answers probes: the reply on ``loom.net.endpoints.<cluster>``."""

    cluster: Id
    region: Id
    host: Annotated[str, Meta(min_length=1, max_length=253)]
    udp_port: Annotated[int, Meta(ge=1, le=65_535)]
    """UDP echo."""
    tcp_port: Annotated[int, Meta(ge=1, le=65_535)]
    """TCP echo / bulk (``ECHO``, ``UP <n>``, ``DOWN <n>``)."""


class TransferObserved(
    msgspec.Struct, tag_field="kind", tag="transfer", forbid_unknown_fields=True, frozen=True, kw_only=True
):
    """A job moved data between regions at this throughput (reported by whoever moved it).

    Network perception compares it with what the link was expected to carry and adjusts the
    link's weight, so paths that deliver less than their probes promise cost more.
    """

    src: Id
    dst: Id
    job_id: Id | None = None
    transfer_bytes: Annotated[int, Meta(ge=0)]
    seconds: Annotated[float, Meta(gt=0, le=7 * 86_400)]
    expected_gbps: Annotated[float, Meta(gt=0, le=10_000)] | None = None
    at: UnixSeconds

    @property
    def observed_gbps(self) -> float:
        """Throughput achieved, in gigabits per second."""
        return self.transfer_bytes * 8 / self.seconds / 1e9


class LinkInUse(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """One directed link a running job's parts span, and how many such jobs."""

    src: Id
    dst: Id
    jobs: Annotated[int, Meta(ge=1)] = 1


class LinksInUse(
    msgspec.Struct,
    tag_field="kind",
    tag="links_in_use",
    forbid_unknown_fields=True,
    frozen=True,
    kw_only=True,
):
    """The links running jobs depend on now (``loom.net.use``): probe collectors probe them
    densely (``loom.net.intensity``). Repeated while any is in use, once empty when none is left;
    a link not repeated within ``ttl_s`` is no longer in use."""

    links: Annotated[list[LinkInUse], Meta(max_length=10_000)]
    ttl_s: Annotated[float, Meta(gt=0, le=3_600)]
    at: UnixSeconds
