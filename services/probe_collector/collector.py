"""Probe collector of one region: measures every outgoing link with real sockets and publishes samples.

For each peer region it asks one of the peer's clusters where its probe endpoints are
(``loom.net.endpoints.<cluster>``), then

* every period sends ``probes_per_period`` numbered UDP echo probes, evenly spaced; each answer
  (or timeout) becomes one :class:`~loom_proto.net.ProbeSample` on ``loom.net.probe.<src>.<dst>``
  (RTT, loss and, from the RTT series, jitter);
* every ``bandwidth_every_s`` pushes ``bulk_bytes`` through the TCP endpoint and publishes the
  throughput, as long as the byte budget (a token bucket, ``bulk_budget_bytes_per_hour``) allows.

With ``emulate`` (the local stack), probes to peer ``D`` go through an in-process WAN relay in front
of ``D``'s endpoints, shaped like the topology's measured link ``src -> D``
(:func:`loom.netemu.params_from_link`), so the measured numbers are the topology's. The relay is
controlled on ``loom.net.emu.<src>.<dst>`` (degrade / restore / show) and, for every link of every
collector at once, on ``loom.net.emu.all``. Without ``emulate`` the endpoints are probed directly.
"""

import asyncio
import contextlib
import functools
import itertools
import json
import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import msgspec
import structlog
from nats.aio.msg import Msg

from loom.bus.publisher import Outgoing
from loom.bus.reply import respond
from loom.model.topology import Topology
from loom.net.burst import BURST_PROBE, BurstConfig, BurstPlanner
from loom.net.intensity import UseConfig, dense_overdue_s, dense_plan
from loom.net.samples import TokenBucket
from loom.netemu import (
    BANDWIDTH_SCALE,
    RECEIVE_BUFFER_BYTES,
    LinkParams,
    ProbeResult,
    TcpRelay,
    UdpProber,
    UdpRelay,
    params_from_link,
    receive_buffer_bytes,
    tcp_bulk,
    to_sample,
)
from loom.runtime.service import ServiceContext
from loom_proto import subjects
from loom_proto.codec import DecodeError, decode, encode
from loom_proto.net import LinksInUse, ProbeEndpoints, ProbeSample

log = structlog.get_logger("probe-collector")

Address = tuple[str, int]

_SRTT_GAIN = 0.125
_MAX_PENDING = 10_000
"""Samples waiting to be published at most (more are dropped and counted: the bus is away)."""
_MAX_BANDWIDTH_GBPS = 10_000.0


@dataclass(frozen=True, slots=True)
class CollectorConfig:
    """How often and how hard a collector probes."""

    period_s: float = 1.0
    """One probe period: network-perception evaluates links once per period."""
    probes_per_period: int = 5
    probe_timeout_s: float = 2.0
    """An echo not back within this is a lost probe (also the longest RTT that can be measured)."""
    bandwidth_every_s: float = 30.0
    bulk_bytes: int = 512 * 1024
    """Bytes pushed by one bandwidth probe."""
    bulk_budget_bytes_per_hour: int = 256 * 1024 * 1024
    """Bandwidth probes of all links together never push more than this per hour."""
    emulate: bool = True
    bandwidth_scale: float = BANDWIDTH_SCALE
    """Emulated Mbps per measured Gbps (see :data:`loom.netemu.BANDWIDTH_SCALE`)."""
    discover_retry_s: float = 1.0
    """How often to ask again for a peer's endpoints while none answers."""
    rediscover_after_s: float = 10.0
    """Every probe lost for this long: ask again where the peer's endpoints are (an agent restarted)."""
    shift_ratio: float = 1.5
    """A round closes early, and its sample goes out at once, when its last ``shift_probes``
    answers are all at least this many times (or at most the inverse of) the last sample's RTT
    and agree with each other (see :func:`shift_in_round`): a level shift is reported after
    that many probes, not after a round that also holds probes from before it. The outlier
    filter's ``large_ratio`` (1.5, a link's degrade ratio): an RTT that doubles shows at once."""
    shift_probes: int = 3
    """Answers that make a shift within a round (a majority of a round: one spike never does)."""
    burst: BurstConfig = field(default_factory=BurstConfig)
    """When a link may be lossy, extra probes on it for a moment (:mod:`loom.net.burst`)."""
    burst_queue_ms: float = 20.0
    """Burst probes sent at one tick on one link never take longer than this to pass its
    (emulated) bandwidth: on loopback a 1 Gbps link is emulated at 1 Mbps, and a burst must not
    queue behind itself into losses of its own making."""
    burst_overdue_rtts: float = 3.0
    """A burst probe unanswered after this many smoothed RTTs (at least ``burst_overdue_min_s``)
    counts as lost when the burst policy asks whether the loss is clearly low."""
    burst_overdue_min_s: float = 0.3
    burst_max_per_tick: int = 40
    """Burst probes sent back to back on one link at one tick, emulated or not: probing a real
    echo endpoint directly, 600 back to back overflow a default socket receive buffer (83 of 735
    lost in the direct-burst test here, 344 of 600 in review) and the burst finds loss of its own
    making. A period's burst is at
    most this many per tick, the rest at the period's next ticks."""
    use: UseConfig = field(default_factory=UseConfig)
    """How hard the links running jobs span are probed (:mod:`loom.net.intensity`)."""
    burst_stall_s: float = 0.25
    """A loop lag beyond this (a probe's timeout reported this late, or a send tick missed by
    it) holds new burst episodes for the next period: answers still unread in the socket were
    counted lost, on every link at once."""
    dense_stall_s: float = 0.1
    """An extra probe of a link in use (:mod:`loom.net.intensity`) lost while the loop was late
    for a send tick by more than this (or whose timeout fired ``burst_stall_s`` late) is not
    reported: its answer may have waited unread (or overflowed the socket) while the loop was
    busy. Its deadline is a few RTTs, not the probe timeout, so a stall eats into it."""


class EmulatorRequest:
    """A request on ``loom.net.emu.*``: ``op`` is ``degrade``, ``restore`` or ``show``."""

    def __init__(self, body: dict[str, Any]) -> None:
        op = body.get("op", "show")
        if op not in ("degrade", "restore", "show"):
            raise ValueError(f"unknown op {op!r}: degrade, restore or show")
        self.op: str = op
        self.rtt_ms = _optional_number(body, "rtt_ms", 0.0, 60_000.0)
        self.rtt_factor = _optional_number(body, "rtt_factor", 0.0, 1_000.0)
        self.loss = _optional_number(body, "loss", 0.0, 1.0)
        self.gbps = _optional_number(body, "gbps", 1e-6, 10_000.0)
        if self.rtt_ms is not None and self.rtt_factor is not None:
            raise ValueError("give rtt_ms or rtt_factor, not both")


def _optional_number(body: dict[str, Any], key: str, low: float, high: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise ValueError(f"{key} must be a number within {low}..{high}, got {value!r}")
    return float(value)


def round_sample(src: str, dst: str, results: Sequence[ProbeResult]) -> ProbeSample:
    """One sample for a round of UDP echo probes: median RTT, mean successive RTT difference, loss.

    Stamped with the round's newest probe (its sequence number and send time): a lost probe's
    result comes only at its timeout, after answers to later probes, so a round holding it may
    also hold probes older than the last round's; stamped with its oldest, such a round would be
    "not newer" than the last one and network perception would drop it — and with it the loss,
    which is why losses were seen so late."""
    rtts = [r.rtt_ms for r in results if r.rtt_ms is not None]
    jitter = statistics.fmean(abs(b - a) for a, b in itertools.pairwise(rtts)) if len(rtts) >= 2 else None
    newest = max(results, key=lambda r: r.seq)
    return msgspec.structs.replace(
        to_sample(src, dst, newest),
        rtt_ms=statistics.median(rtts) if rtts else None,
        sent=len(results),
        lost=len(results) - len(rtts),
        jitter_ms=jitter,
    )


def dense_phase_s(region: str, regions: Sequence[str], interval_s: float) -> float:
    """How long after a send tick a collector sends its extra probes (:mod:`loom.net.intensity`):
    the collectors share the first half of the tick in turn, by region, so their extra probes
    reach a peer's endpoint one collector's batch at a time, and before the next tick."""
    ordered = sorted(set(regions) | {region})
    return 0.5 * interval_s * ordered.index(region) / len(ordered)


def send_grid(now_s: float, interval_s: float) -> float:
    """Seconds from the wall-clock time ``now_s`` to the next multiple of ``interval_s`` (0 on one):
    where every collector's send ticks fall, whenever it started."""
    if interval_s <= 0:
        return 0.0
    return (-now_s) % interval_s


SHIFT_SPREAD = 0.35
"""Answers that make a shift agree: each within this fraction of their median's distance from the
reference (the same consistency the outlier filter asks of a level shift)."""


def shift_in_round(
    results: Sequence[ProbeResult], reference_ms: float | None, ratio: float, probes: int
) -> bool:
    """The last ``probes`` results of a round are all answers, all ``ratio`` times the reference
    or more (or all at most its inverse), and agree with each other: a level shift in progress."""
    if reference_ms is None or reference_ms <= 0 or ratio <= 1.0 or probes < 2 or len(results) < probes:
        return False
    rtts = [r.rtt_ms for r in results[-probes:]]
    values = sorted(v for v in rtts if v is not None)
    if len(values) < probes:
        return False
    high = all(v >= ratio * reference_ms for v in values)
    low = all(v * ratio <= reference_ms for v in values)
    if not (high or low):
        return False
    centre = values[len(values) // 2]
    return max(centre - values[0], values[-1] - centre) <= SHIFT_SPREAD * abs(centre - reference_ms)


class RoundBuilder:
    """Groups a link's probe results into rounds, one sample each (:func:`round_sample`).

    A round is ``probes`` results; it also closes once its last ``shift_probes`` answers show a
    level shift against the last sample's RTT (:func:`shift_in_round`), and the round after such
    a one closes after ``shift_probes`` answers too if they again show the shift (against the
    level before it): two samples at the new level sooner, each still the median of several
    probes. Such samples are *urgent* (published at once)."""

    def __init__(self, src: str, dst: str, probes: int, shift_ratio: float, shift_probes: int) -> None:
        self.src, self.dst = src, dst
        self.probes = max(probes, 1)
        self.shift_ratio = shift_ratio
        self.shift_probes = shift_probes
        self.results: list[ProbeResult] = []
        self.last_rtt_ms: float | None = None
        """The RTT of the last round's sample (what a shift within a round is measured against)."""
        self.short_round = False
        """The last round closed on a shift."""
        self.before_shift_ms: float | None = None
        """The last sample's RTT before that shift."""

    def steady(self, rtt_ms: float) -> bool:
        """An answer of ``rtt_ms`` cannot close the round early: no shift is going on (the last
        round was not a shift's) and it is within ``shift_ratio`` of the last sample's RTT either
        way (or there is no last sample yet: no shift without one), so :func:`shift_in_round`
        cannot hold for any run of answers that ends with it."""
        if self.short_round:
            return False
        reference = self.last_rtt_ms
        if reference is None or reference <= 0:
            return True
        ratio = self.shift_ratio
        return rtt_ms < ratio * reference and rtt_ms * ratio > reference

    def add(self, result: ProbeResult) -> list[tuple[ProbeSample, bool]]:
        """Add one result; the samples of the rounds it closes, each with whether it is urgent
        (a round that closes on a shift reports the median and jitter of the ``shift_probes``
        answers that show it, and the probes and losses of the whole round)."""
        results = self.results
        results.append(result)
        full = len(results) >= self.probes
        shift = self.shift_probes >= 2 and shift_in_round(
            results, self.last_rtt_ms, self.shift_ratio, self.shift_probes
        )
        # The round after a shift closes early only if the shift goes on: its answers again all
        # far from the level before it (and agreeing), so two early samples are 2 x shift_probes
        # answers in a row, never one burst and whatever follows it.
        follow = self.short_round and shift_in_round(
            results, self.before_shift_ms, self.shift_ratio, self.shift_probes
        )
        if follow:
            shift = False
        if not (full or shift or follow):
            return []
        sample = round_sample(self.src, self.dst, results)
        if shift and len(results) > self.shift_probes:
            # The RTT and jitter are the shift's answers' (the ones before it are the old level,
            # already reported); the probe and loss counts are the whole round's. Never a sample
            # of its own for the one or two answers before a shift: a lone probe is no median.
            shifted = round_sample(self.src, self.dst, results[-self.shift_probes :])
            sample = msgspec.structs.replace(sample, rtt_ms=shifted.rtt_ms, jitter_ms=shifted.jitter_ms)
        out = [(sample, shift or follow)]
        self.results = []
        self.short_round = shift
        if shift:
            self.before_shift_ms = self.last_rtt_ms
        if sample.rtt_ms is not None:
            self.last_rtt_ms = sample.rtt_ms
        return out


def burst_sample(src: str, dst: str, results: Sequence[ProbeResult]) -> ProbeSample:
    """One sample for a period's burst probes of a link (:data:`~loom.net.burst.BURST_PROBE`):
    their probe and loss counts, stamped with the newest; the RTT is their median (network
    perception takes only the counts) and no jitter (probes sent back to back have none to tell)."""
    sample = round_sample(src, dst, results)
    return msgspec.structs.replace(sample, probe=BURST_PROBE, jitter_ms=None)


class _BurstBatch:
    __slots__ = ("expected", "results", "sealed")

    def __init__(self) -> None:
        self.expected = 0
        self.results: list[ProbeResult] = []
        self.sealed = False


class BurstRounds:
    """A link's burst probes, one sample for each period's (:func:`burst_sample`).

    A period's batch closes (:meth:`seal`) when the next period starts, and its sample goes out
    once every probe of it is answered or timed out, in the order the periods were sent: each
    sample is stamped with its newest probe, so a later period's sample never overtakes an
    earlier one (network perception drops a sample not newer than the last of its kind)."""

    def __init__(self, src: str, dst: str) -> None:
        self.src, self.dst = src, dst
        self._open: _BurstBatch | None = None
        self._batches: deque[_BurstBatch] = deque()
        self._owner: dict[int, _BurstBatch] = {}
        self._deadline: dict[int, float] = {}

    def sent(self, seq: int, deadline_s: float | None = None) -> None:
        """Probe ``seq`` went out as part of this period's burst (counted lost ``deadline_s``
        after it was sent, where given)."""
        batch = self._open
        if batch is None:
            batch = self._open = _BurstBatch()
            self._batches.append(batch)
        batch.expected += 1
        self._owner[seq] = batch
        if deadline_s is not None:
            self._deadline[seq] = deadline_s

    def deadline_s(self, seq: int) -> float | None:
        """The deadline probe ``seq`` went out with (None: none given, or no longer waiting)."""
        return self._deadline.get(seq)

    def owns(self, seq: int) -> bool:
        """``seq`` is a burst probe still waiting for its result."""
        return seq in self._owner

    def add(self, result: ProbeResult) -> list[ProbeSample]:
        """A burst probe's result; the samples it completes."""
        batch = self._owner.pop(result.seq, None)
        self._deadline.pop(result.seq, None)
        if batch is None:
            return []
        batch.results.append(result)
        return self._ready()

    def drop(self, seq: int) -> list[ProbeSample]:
        """Probe ``seq``'s result says nothing (its timeout fired late: its answer may be waiting
        unread); its batch counts it neither sent nor lost. The samples this completes."""
        batch = self._owner.pop(seq, None)
        self._deadline.pop(seq, None)
        if batch is None:
            return []
        batch.expected -= 1
        return self._ready()

    def seal(self) -> list[ProbeSample]:
        """The period is over: no more probes join its batch; the samples now complete."""
        if self._open is not None:
            self._open.sealed = True
            self._open = None
        return self._ready()

    def _ready(self) -> list[ProbeSample]:
        out = []
        batches = self._batches
        while batches and batches[0].sealed and len(batches[0].results) >= batches[0].expected:
            batch = batches.popleft()
            if batch.results:
                out.append(burst_sample(self.src, self.dst, batch.results))
        return out


def degraded(
    base_forward: LinkParams, base_reverse: LinkParams, request: EmulatorRequest, bandwidth_scale: float
) -> tuple[LinkParams, LinkParams]:
    """The link's parameters under a degrade request, relative to its measured (base) parameters.

    The RTT is split evenly between the directions; the loss is applied to the forward direction
    only, so a round trip loses exactly that share of probes.
    """
    forward, reverse = base_forward, base_reverse
    rtt_ms = request.rtt_ms
    if request.rtt_factor is not None:
        rtt_ms = (base_forward.delay_ms + base_reverse.delay_ms) * request.rtt_factor
    if rtt_ms is not None:
        forward = replace(forward, delay_ms=rtt_ms / 2.0)
        reverse = replace(reverse, delay_ms=rtt_ms / 2.0)
    if request.loss is not None:
        forward = replace(forward, loss=request.loss)
    if request.gbps is not None:
        mbps = request.gbps * 1000.0 * bandwidth_scale
        forward = replace(forward, bandwidth_mbps=mbps)
        reverse = replace(reverse, bandwidth_mbps=mbps)
    return forward, reverse


class PeerLink:
    """One outgoing link ``src -> dst``: where its probes go, and (emulated) the relays that shape it."""

    def __init__(self, src: str, dst: str, base_forward: LinkParams, base_reverse: LinkParams) -> None:
        self.src = src
        self.dst = dst
        self.base_forward = base_forward
        self.base_reverse = base_reverse
        self.forward = base_forward
        self.reverse = base_reverse
        self.endpoints: ProbeEndpoints | None = None
        self.udp_relay: UdpRelay | None = None
        self.tcp_relay: TcpRelay | None = None
        self.srtt_ms: float | None = None
        self.last_answer_at = 0.0
        self.seq = 0

    def set_params(self, forward: LinkParams, reverse: LinkParams) -> None:
        """Shape the link like this from now on (kept across a relay rebuild)."""
        self.forward, self.reverse = forward, reverse
        for relay in (self.udp_relay, self.tcp_relay):
            if relay is not None:
                relay.set_params(forward, reverse)

    def describe(self, bandwidth_scale: float = BANDWIDTH_SCALE) -> dict[str, Any]:
        """The link's emulation, for replies and health stats; ``wan_gbps`` is the forward
        bandwidth on the WAN's scale (what ``loom net links`` shows), the relays' Mbps being
        ``bandwidth_scale`` of it on loopback."""
        mbps = self.forward.bandwidth_mbps
        return {
            "src": self.src,
            "dst": self.dst,
            "up": self.endpoints is not None,
            "forward": asdict(self.forward),
            "reverse": asdict(self.reverse),
            "wan_gbps": None if mbps is None else mbps / 1000.0 / bandwidth_scale,
            "degraded": (self.forward, self.reverse) != (self.base_forward, self.base_reverse),
        }


class ProbeCollector:
    """The collector of one region; :meth:`run` is the service body."""

    def __init__(
        self,
        ctx: ServiceContext,
        topology: Topology,
        region: str,
        config: CollectorConfig | None = None,
    ) -> None:
        topology.region(region)  # refuses an unknown region
        self.ctx = ctx
        self.topology = topology
        self.region = region
        self.config = config or CollectorConfig()
        self.epoch = int(time.time() * 1000)
        self.pending: list[ProbeSample] = []
        """Samples completed and not published yet (at most ``_MAX_PENDING`` of them)."""
        budget = float(self.config.bulk_budget_bytes_per_hour)
        self.budget = TokenBucket(budget / 3600.0, budget, budget, time.time())
        self.links: dict[str, PeerLink] = {}
        self.probing: dict[str, UdpProber] = {}
        self.burst = BurstPlanner(self.config.burst.for_period(self.config.period_s))
        self.burst_rounds: dict[str, BurstRounds] = {}
        """The burst probes of the links being probed now, by peer region."""
        self._burst_left: dict[str, int] = {}
        """Burst probes still to send this period, by peer region."""
        self.in_use: dict[str, float] = {}
        """Peer regions whose link running jobs span (``loom.net.use``), until when (monotonic)."""
        self.dense_rounds: dict[str, BurstRounds] = {}
        """The extra probes of the links in use being probed now, by peer region."""
        self._dense: dict[str, tuple[int, float]] = {}
        """This period's extra probes a tick on each link in use, and their deadline (s)."""
        self._tick_due: float | None = None
        """When the next send tick is due (loop time)."""
        self._stalls: deque[tuple[float, float]] = deque(maxlen=64)
        """The latest stretches (wall s) in which the loop was late for a send tick by more
        than ``dense_stall_s``: an extra probe lost across one is no evidence."""
        self._holds: dict[str, Callable[[int, float], bool]] = {}
        """Each new prober's ``hold`` (:class:`UdpProber`), made with its result handler."""
        self._stalled = False
        """The loop lagged beyond ``burst_stall_s`` since the last period's burst plan."""
        self._flush = asyncio.Event()
        """Set by a send tick with samples pending (the samples completed by then go out together),
        or at once by a sample showing a level shift."""
        for peer in sorted(r.id for r in topology.regions):
            link = topology.link(region, peer)
            if peer == region or link is None or not self._clusters_of(peer):
                continue
            forward = params_from_link(link, bandwidth_scale=self.config.bandwidth_scale)
            back = topology.link(peer, region)
            reverse = forward
            if back is not None and back.bandwidth_gbps is not None:
                reverse = replace(
                    forward, bandwidth_mbps=back.bandwidth_gbps * 1000.0 * self.config.bandwidth_scale
                )
            self.links[peer] = PeerLink(region, peer, forward, reverse)
        self.counts = {
            "probes_sent": 0,
            "probes_lost": 0,
            "samples_published": 0,
            "samples_dropped_queue_full": 0,
            "shift_rounds": 0,
            "publish_failures": 0,
            "bulk_probes": 0,
            "bulk_bytes": 0,
            "bulk_skipped_budget": 0,
            "bulk_failures": 0,
            "burst_probes_sent": 0,
            "burst_probes_lost": 0,
            "burst_samples": 0,
            "burst_episodes": 0,
            "burst_ended_bad": 0,
            "burst_ended_good": 0,
            "burst_ended_capped": 0,
            "burst_active": 0,
            "burst_held": 0,
            "send_ticks_late": 0,
            "probes_lost_late": 0,
            "dense_probes_sent": 0,
            "dense_probes_lost": 0,
            "dense_probes_dropped_late": 0,
            "dense_samples": 0,
            "links_in_use": 0,
        }
        ctx.stats.update({"region": region, "counts": self.counts, "links": {}})

    def _clusters_of(self, region: str) -> list[str]:
        return sorted(c.id for c in self.topology.clusters if c.region == region)

    async def run(self) -> None:
        """Probe every peer until asked to stop."""
        nc = self.ctx.nc
        effective = receive_buffer_bytes()
        if effective is not None and effective < RECEIVE_BUFFER_BYTES:
            log.warning(
                "probe receive buffers capped (net.core.rmem_max): dense probes may overflow them",
                asked_bytes=RECEIVE_BUFFER_BYTES,
                so_rcvbuf=effective,
            )
        subs = [
            await nc.subscribe(subjects.net_emulator_region(self.region), cb=self.on_control),
            await nc.subscribe(subjects.NET_EMU_ALL, cb=self.on_control),
            await nc.subscribe(subjects.NET_USE, cb=self.on_use),
        ]
        watchdog = self.ctx.watchdog
        tasks = [
            watchdog.supervise("publish-samples", self._publish_loop),
            watchdog.supervise("send-probes", self._send_loop),
        ]
        tasks += [
            watchdog.supervise(f"probe-{link.dst}", functools.partial(self._peer, link))
            for link in self.links.values()
        ]
        self._refresh_stats()
        log.info("collector started", region=self.region, peers=sorted(self.links))
        try:
            await self.ctx.stopping.wait()
        finally:
            for sub in subs:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for link in self.links.values():
                await self._close_relays(link)

    # ---- discovery and relays -----------------------------------------------------------------

    async def discover(self, peer: str) -> ProbeEndpoints | None:
        """Ask the peer region's clusters, in order, where their probe endpoints are."""
        for cluster in self._clusters_of(peer):
            try:
                reply = await self.ctx.nc.request(subjects.net_endpoints(cluster), b"", timeout=0.5)
                endpoints = decode(reply.data, ProbeEndpoints)
            except (DecodeError, Exception):  # no agent there (yet), or a bad answer: try the next
                continue
            if endpoints.region == peer:
                return endpoints
        return None

    async def _targets(self, link: PeerLink, endpoints: ProbeEndpoints) -> tuple[Address, Address]:
        udp: Address = (endpoints.host, endpoints.udp_port)
        tcp: Address = (endpoints.host, endpoints.tcp_port)
        if not self.config.emulate:
            return udp, tcp
        await self._close_relays(link)
        link.udp_relay = await UdpRelay(udp, link.forward, link.reverse, echo=True).start()
        link.tcp_relay = await TcpRelay(tcp, link.forward, link.reverse).start()
        return link.udp_relay.address, link.tcp_relay.address

    async def _close_relays(self, link: PeerLink) -> None:
        relays: list[UdpRelay | TcpRelay | None] = [link.udp_relay, link.tcp_relay]
        link.udp_relay = link.tcp_relay = None
        for relay in relays:
            if relay is not None:
                with contextlib.suppress(Exception):
                    await relay.close()

    # ---- probing ------------------------------------------------------------------------------

    async def _peer(self, link: PeerLink) -> None:
        """Find the peer, probe it; find it again when it stops answering (its agent restarted)."""
        config = self.config
        while True:
            endpoints = await self.discover(link.dst)
            if endpoints is None:
                await asyncio.sleep(config.discover_retry_s)  # polling for an agent to appear
                continue
            udp, tcp = await self._targets(link, endpoints)
            link.endpoints = endpoints
            link.last_answer_at = time.monotonic()
            self._refresh_stats()
            log.info("probing peer", src=link.src, dst=link.dst, udp=udp, tcp=tcp)
            # Emulated, the prober sends through the link's relay in this process (no socket hop),
            # and an answer that cannot close a round early waits for the link's next send tick
            # instead of waking the collector when it arrives (its RTT is the same; see _holds).
            on_result = self._result_handler(link)
            async with UdpProber(
                udp,
                timeout_s=config.probe_timeout_s,
                on_result=on_result,
                relay=link.udp_relay,
                hold=self._holds.pop(link.dst, None),
            ) as prober:
                self.probing[link.dst] = prober
                jobs = [asyncio.create_task(self._bulk_loop(link, tcp))]
                try:
                    await self._watch(link)
                finally:
                    self.probing.pop(link.dst, None)
                    for job in jobs:
                        job.cancel()
                    await asyncio.gather(*jobs, return_exceptions=True)
            link.endpoints = None
            self._refresh_stats()

    async def _watch(self, link: PeerLink) -> None:
        """Return when nothing came back for ``rediscover_after_s`` and the peer's endpoints moved."""
        config = self.config
        while True:
            await asyncio.sleep(config.rediscover_after_s / 2)  # a periodic check, not a synchronisation
            if time.monotonic() - link.last_answer_at < config.rediscover_after_s:
                continue
            endpoints = await self.discover(link.dst)
            if endpoints is not None and endpoints != link.endpoints:
                log.info("peer endpoints moved", src=link.src, dst=link.dst)
                return

    async def _send_loop(self) -> None:
        # One clock for every link: each tick sends the next probe to every peer being probed, so
        # the collector wakes ``probes_per_period`` times a period, not that many times per link.
        # A period's burst probes (if a link has one) go out after the steady ones, from its first
        # tick on, as many per tick as the link passes (``burst_queue_ms``, ``burst_max_per_tick``).
        # After a stall the missed ticks are not made up: the clock restarts from now, and that
        # tick sends no burst probes (back-to-back ticks would each send a burst share at once).
        # Ticks fall on a grid of the wall clock (send_grid), the same in every collector: a peer's
        # probe endpoint gets the probes of all the collectors at once, and is woken once for them.
        loop = asyncio.get_running_loop()
        ticks = max(self.config.probes_per_period, 1)
        interval_s = self.config.period_s / ticks
        phase_s = dense_phase_s(self.region, [r.id for r in self.topology.regions], interval_s)
        due = loop.time() + send_grid(time.time(), interval_s)
        for tick in itertools.count():
            lag = loop.time() - due
            late = lag > interval_s
            next_due = due + interval_s
            if late:
                # This tick goes now; the next one back on the grid, at least half a tick later.
                next_due = loop.time() + interval_s / 2 + send_grid(time.time() + interval_s / 2, interval_s)
                self.counts["send_ticks_late"] += 1
            if lag > self.config.burst_stall_s:
                self._stalled = True
            if lag > self.config.dense_stall_s:
                now = time.time()
                self._stalls.append((now - lag, now))
            for prober in list(self.probing.values()):
                prober.flush()  # answers held for this tick come first, as had they woken the loop
            if tick % ticks == 0:
                self._plan_dense()
                self._plan_bursts()
            for prober in list(self.probing.values()):
                prober.send()
                self.counts["probes_sent"] += 1
            if self._burst_left and not late:
                self._send_bursts(ticks - tick % ticks)
            if self._dense and not late:
                # At this collector's own phase of the tick: every collector's extra probes on
                # the grid itself would land on a peer's endpoint at once (fan-in).
                loop.call_later(phase_s, self._send_dense)
            if self.pending:
                self._flush.set()
            due = self._tick_due = next_due
            await asyncio.sleep(max(due - loop.time(), 0.0))  # pacing the probes

    def _plan_bursts(self) -> None:
        """At a period's start: close the last period's burst batches, ask the policy for this one's."""
        config = self.config
        self._burst_left = {}
        for rounds in self.burst_rounds.values():
            for sample in rounds.seal():
                self._enqueue_burst(sample)
        overdue: dict[str, float] = {}
        for dst in self.probing:
            if dst in self._dense:
                continue  # probed densely: its verdict needs no burst
            srtt = self.links[dst].srtt_ms
            wait = config.probe_timeout_s if srtt is None else config.burst_overdue_rtts * srtt / 1000.0
            overdue[dst] = min(max(wait, config.burst_overdue_min_s), config.probe_timeout_s)
        ticks = max(config.probes_per_period, 1)
        limits = {dst: self._burst_per_tick(self.links[dst]) * ticks for dst in overdue}
        lagging, self._stalled = self._stalled, False
        plan = self.burst.plan(time.time(), overdue, lagging=lagging, limits=limits)
        self._burst_left = {dst: n for dst, n in plan.items() if dst in self.probing}
        # The planner's totals survive a link's reset: cumulative, never backwards.
        self.counts.update(self.burst.counts())

    def _send_bursts(self, ticks_left: int) -> None:
        """This tick's share of each link's burst, at most what its bandwidth passes in ``burst_queue_ms``."""
        for dst, left in list(self._burst_left.items()):
            prober, rounds = self.probing.get(dst), self.burst_rounds.get(dst)
            if prober is None or rounds is None:
                del self._burst_left[dst]
                continue
            # As many as the link passes at once: the burst's verdict comes one probe timeout
            # after its last probe, so sooner sent is sooner known.
            count = min(left, self._burst_per_tick(self.links[dst]))
            at = time.time()
            for _ in range(count):
                rounds.sent(prober.send())
            self.burst.on_sent(dst, at, count)
            self.counts["burst_probes_sent"] += count
            if left > count and ticks_left > 1:
                self._burst_left[dst] = left - count
            else:
                del self._burst_left[dst]

    def _plan_dense(self) -> None:
        """At a period's start: the extra probes a tick of each link in use being probed
        (:func:`~loom.net.intensity.dense_plan`, within the collector's budget) and their deadline."""
        config = self.config
        now = time.monotonic()
        self.in_use = {dst: until for dst, until in self.in_use.items() if until > now}
        self.counts["links_in_use"] = len(self.in_use)
        used = [dst for dst in self.in_use if dst in self.probing and dst in self.dense_rounds]
        ticks = max(config.probes_per_period, 1)
        limits = {dst: self._burst_per_tick(self.links[dst], config.use.max_per_tick) * ticks for dst in used}
        plan = dense_plan(used, config.use, config.period_s, limits)
        self._dense = {
            dst: (
                math.ceil(count / ticks),
                dense_overdue_s(self.links[dst].srtt_ms, config.use, config.probe_timeout_s),
            )
            for dst, count in plan.items()
        }

    def _send_dense(self) -> None:
        """This tick's extra probes on each link in use: one batch, one sample once all are in."""
        for dst, (count, overdue_s) in self._dense.items():
            prober, rounds = self.probing.get(dst), self.dense_rounds.get(dst)
            if prober is None or rounds is None:
                continue
            for _ in range(count):
                rounds.sent(prober.send(timeout_s=overdue_s), overdue_s)
            self.counts["dense_probes_sent"] += count
            for sample in rounds.seal():
                self._enqueue_dense(sample)

    def _stalled_since(self, at: float) -> bool:
        """The loop was late for a send tick at some time since ``at`` (wall s), or is now
        (the tick not yet run: a timeout due before it runs first when the loop resumes)."""
        if self._stalls and self._stalls[-1][1] >= at:
            return True
        due = self._tick_due
        return due is not None and asyncio.get_running_loop().time() - due > self.config.dense_stall_s

    def _enqueue_dense(self, sample: ProbeSample) -> None:
        self.counts["dense_samples"] += 1
        self._enqueue(sample)

    async def on_use(self, msg: Msg) -> None:
        """``loom.net.use``: the links running jobs span now; this collector's are probed densely."""
        try:
            use = decode(msg.data, LinksInUse)
        except DecodeError:
            return
        until = time.monotonic() + use.ttl_s
        self.in_use = {u.dst: until for u in use.links if u.src == self.region and u.dst in self.links}
        self.counts["links_in_use"] = len(self.in_use)

    def _burst_per_tick(self, link: PeerLink, most: int | None = None) -> int:
        """Burst probes one tick sends on ``link``: ``burst_max_per_tick`` (or ``most``), and
        emulated no more than the link passes in ``burst_queue_ms``."""
        most = max(self.config.burst_max_per_tick if most is None else most, 1)
        mbps = min(
            (m for m in (link.forward.bandwidth_mbps, link.reverse.bandwidth_mbps) if m is not None),
            default=None,
        )
        if mbps is None or not self.config.emulate:
            return most
        bits = 8.0 * 64  # a probe's payload (UdpProber's default)
        return min(max(int(mbps * 1e6 * self.config.burst_queue_ms / 1000.0 / bits), 1), most)

    def _enqueue_burst(self, sample: ProbeSample) -> None:
        self.counts["burst_samples"] += 1
        self._enqueue(sample)

    def _result_handler(self, link: PeerLink) -> Callable[[ProbeResult], None]:
        # One sample per round of ``probes_per_period`` probes (median RTT, the round's jitter and
        # loss): a fifth of the messages of one sample per probe, and a single spike in a round does
        # not move the RTT. Called by the prober as each result completes (no task per link).
        rounds = RoundBuilder(
            link.src,
            link.dst,
            self.config.probes_per_period,
            self.config.shift_ratio,
            self.config.shift_probes,
        )
        # A new prober numbers its probes from 0: its bursts start afresh too.
        bursts = self.burst_rounds[link.dst] = BurstRounds(link.src, link.dst)
        dense = self.dense_rounds[link.dst] = BurstRounds(link.src, link.dst)
        self.burst.reset(link.dst)
        self._burst_left.pop(link.dst, None)
        planner = self.burst

        def hold(seq: int, rtt_ms: float) -> bool:
            # A burst probe's answer, or one that cannot close its round early: it only joins a
            # sample that goes out at a send tick anyway, so it waits for the link's next tick.
            return bursts.owns(seq) or dense.owns(seq) or rounds.steady(rtt_ms)

        self._holds[link.dst] = hold

        def on_result(result: ProbeResult) -> None:
            if link.dst not in self.probing:
                return  # the prober is closing: its outstanding probes are not the link's losses
            lost = result.rtt_ms is None
            if dense.owns(result.seq):
                self._dense_result(link, dense, result)
                return
            burst = bursts.owns(result.seq)
            if lost:
                self.counts["burst_probes_lost" if burst else "probes_lost"] += 1
                if time.time() - result.sent_at - self.config.probe_timeout_s > self.config.burst_stall_s:
                    # Its timeout fired late: the loop stalled, and an answer may be in the socket.
                    self._stalled = True
                    self.counts["probes_lost_late"] += 1
            else:
                link.last_answer_at = time.monotonic()
            planner.on_result(link.dst, time.time(), lost, burst, result.sent_at)
            if burst:
                for sample in bursts.add(result):
                    self._enqueue_burst(sample)
                return
            if result.rtt_ms is not None:
                srtt = link.srtt_ms
                link.srtt_ms = result.rtt_ms if srtt is None else srtt + _SRTT_GAIN * (result.rtt_ms - srtt)
            for sample, urgent in rounds.add(result):
                self._enqueue(sample, urgent=urgent)

        return on_result

    def _dense_result(self, link: PeerLink, dense: BurstRounds, result: ProbeResult) -> None:
        """An extra probe's result on a link in use: counted (not timed: its deadline is its own)."""
        config = self.config
        deadline_s = dense.deadline_s(result.seq)
        if result.rtt_ms is not None:
            link.last_answer_at = time.monotonic()
        if self._stalled_since(result.sent_at) or (
            result.rtt_ms is None
            and time.time() - result.sent_at - (config.probe_timeout_s if deadline_s is None else deadline_s)
            > config.burst_stall_s
        ):
            # The loop stalled in its lifetime (or its timeout fired late): a lost one's answer may
            # be unread in the socket, so it is no evidence of loss; a stall is the collector's, not
            # the link's. The answered ones sent across it go too: keeping them alone would bias
            # the loss of the probes that stall saw down.
            samples = dense.drop(result.seq)
            self.counts["dense_probes_dropped_late"] += 1
        else:
            samples = dense.add(result)
            if result.rtt_ms is None:
                self.counts["dense_probes_lost"] += 1
        for sample in samples:
            self._enqueue_dense(sample)

    async def _bulk_loop(self, link: PeerLink, target: Address) -> None:
        config = self.config
        if config.bandwidth_every_s <= 0 or config.bulk_bytes <= 0:
            return
        # Links start their bulk probes spread over the interval, so they do not share a bottleneck.
        index = sorted(self.links).index(link.dst)
        await asyncio.sleep(config.bandwidth_every_s * (index + 1) / (len(self.links) + 1))
        while True:
            await self.measure_bandwidth(link, target)
            await asyncio.sleep(config.bandwidth_every_s)  # the bandwidth probe schedule

    async def measure_bandwidth(self, link: PeerLink, target: Address) -> ProbeSample | None:
        """One bulk transfer within the byte budget; the sample published, or None."""
        config = self.config
        nbytes = config.bulk_bytes
        if not self.budget.take(time.time(), float(nbytes)):
            self.counts["bulk_skipped_budget"] += 1
            return None
        sent_at = time.time()
        try:
            result = await tcp_bulk(target, nbytes, timeout_s=max(30.0, 10 * config.period_s))
        except (OSError, TimeoutError, ConnectionError) as exc:
            self.counts["bulk_failures"] += 1
            log.info("bulk probe failed", src=link.src, dst=link.dst, error=repr(exc))
            return None
        self.counts["bulk_probes"] += 1
        self.counts["bulk_bytes"] += result.nbytes
        # The timing includes the round trip of the final OK; take it out (never below a tenth).
        rtt_s = (link.srtt_ms or 0.0) / 1000.0
        seconds = max(result.seconds - rtt_s, result.seconds * 0.1)
        gbps = result.nbytes * 8.0 / seconds / 1e9
        if config.emulate:
            gbps /= config.bandwidth_scale  # back from the loopback scale to the WAN's
        link.seq += 1
        sample = ProbeSample(
            src=link.src,
            dst=link.dst,
            probe="tcp_bulk",
            seq=link.seq,
            sent_at=sent_at,
            bandwidth_gbps=min(gbps, _MAX_BANDWIDTH_GBPS),
            bytes_sent=result.nbytes,
        )
        self._enqueue(sample)
        return sample

    def _enqueue(self, sample: ProbeSample, *, urgent: bool = False) -> None:
        if len(self.pending) >= _MAX_PENDING:
            self.counts["samples_dropped_queue_full"] += 1
            return
        self.pending.append(sample)
        if urgent:
            self.counts["shift_rounds"] += 1
            self._flush.set()  # a shift goes out now, not at the next send tick

    async def _publish_loop(self) -> None:
        # The samples completed by a send tick (those of the answers it hands over included) go
        # out together at that tick (at most a tick, a fifth of a period by default, after they
        # completed): concurrent publishes, each acknowledged, whose acks come back together
        # instead of one wake-up each. One event, so a batch costs the loop one round to start.
        while True:
            await self._flush.wait()
            self._flush.clear()
            batch, self.pending = self.pending, []
            if batch:
                await self._publish(batch)

    async def _publish(self, samples: list[ProbeSample]) -> None:
        # One batch, the acks awaited together (Publisher.publish_batch), one attempt each: a
        # sample is worth little later, so one that fails is counted and not sent again.
        messages = [
            Outgoing(
                subjects.probe_sample(sample.src, sample.dst),
                encode(sample),
                f"probe-{sample.src}-{sample.dst}-{sample.probe}-{self.epoch}-{sample.seq}",
                {},
            )
            for sample in samples
        ]
        try:
            outcomes = await self.ctx.publisher.publish_batch(messages)
        except Exception as exc:
            outcomes = [exc] * len(messages)
        failed = [error for error in outcomes if error is not None]
        if failed:
            self.counts["publish_failures"] += len(failed)
            log.warning("sample publish failed", failed=len(failed), error=repr(failed[0]))
        self.counts["samples_published"] += len(outcomes) - len(failed)

    # ---- emulator control ---------------------------------------------------------------------

    async def on_control(self, msg: Msg) -> None:
        """``loom.net.emu.<src>.<dst>`` (one link) or ``loom.net.emu.all`` (every link here)."""
        try:
            body = json.loads(msg.data or b"{}")
            if not isinstance(body, dict):
                raise ValueError("the request must be a JSON object")
            request = EmulatorRequest(body)
            if msg.subject == subjects.NET_EMU_ALL:
                if request.op == "degrade":
                    raise ValueError("degrade one link at a time: loom.net.emu.<src>.<dst>")
                targets = list(self.links.values())
            else:
                dst = msg.subject.rsplit(".", 1)[-1]
                if dst not in self.links:
                    raise ValueError(f"{self.region} has no probed link to {dst!r}")
                targets = [self.links[dst]]
            if not self.config.emulate and request.op != "show":
                raise ValueError("this collector probes directly: there is no emulator to change")
            changed_at = time.time()
            for link in targets:
                if request.op == "restore":
                    link.set_params(link.base_forward, link.base_reverse)
                elif request.op == "degrade":
                    scale = self.config.bandwidth_scale
                    link.set_params(*degraded(link.base_forward, link.base_reverse, request, scale))
                if request.op != "show":
                    log.info("emulated link changed", op=request.op, src=link.src, dst=link.dst)
            self._refresh_stats()
            # Each link says when the change took effect here: what follows it is timed from it,
            # not from when the asker sent it (the request's own trip counted against detection).
            reply: dict[str, Any] = {
                "ok": True,
                "result": [
                    {**link.describe(self.config.bandwidth_scale), "changed_at": changed_at}
                    for link in targets
                ],
            }
        except (ValueError, json.JSONDecodeError) as exc:
            reply = {"ok": False, "error": str(exc)}
        await respond(msg, json.dumps(reply).encode())

    def _refresh_stats(self) -> None:
        self.ctx.stats["links"] = {
            dst: link.describe(self.config.bandwidth_scale) for dst, link in self.links.items()
        }
