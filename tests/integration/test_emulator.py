"""The user-space WAN emulator on real loopback sockets: delay, loss, blackhole, bandwidth cap,
changes at run time, and probe samples through it feeding network perception."""

import asyncio
import socket
import statistics
import time

import pytest

from loom.model.topology import load_topology
from loom.net import Expected, Perception
from loom.netemu import (
    LinkParams,
    TcpProbeServer,
    TcpRelay,
    UdpEchoServer,
    UdpRelay,
    WanEmulator,
    tcp_bulk,
    to_sample,
    udp_ping,
)

# Measures wall-clock delays and rates: runs after the parallel part of `make test`, alone.
pytestmark = pytest.mark.timing

SLACK_MS = 50.0
"""Loopback relays add scheduling delay (about a millisecond a hop); a test allows this much."""


@pytest.mark.parametrize("echo_mode", [False, True])
async def test_udp_rtt_through_the_relay_is_the_configured_delay(echo_mode: bool) -> None:
    async with (
        UdpEchoServer() as echo,
        UdpRelay(echo.address, LinkParams(delay_ms=20.0), LinkParams(delay_ms=10.0), echo=echo_mode) as relay,
    ):
        results = await udp_ping(relay.address, count=20, interval_s=0.005, timeout_s=1.0)
    rtts = [r.rtt_ms for r in results]
    assert all(rtt is not None for rtt in rtts)
    assert all(30.0 <= rtt < 30.0 + SLACK_MS for rtt in rtts if rtt is not None)
    assert [r.seq for r in results] == list(range(20))


@pytest.mark.parametrize("echo_mode", [False, True])
async def test_loss_rate_is_roughly_the_configured_one(echo_mode: bool) -> None:
    async with (
        UdpEchoServer() as echo,
        UdpRelay(echo.address, LinkParams(loss=0.25), LinkParams(), seed=11, echo=echo_mode) as relay,
    ):
        results = await udp_ping(relay.address, count=400, interval_s=0.0005, timeout_s=0.3)
        counters = relay.counters
    lost = sum(r.rtt_ms is None for r in results) / len(results)
    # Binomial, n = 400, p = 0.25: the standard deviation is ~0.022; allow four of them.
    assert 0.16 <= lost <= 0.34
    assert counters.forward_dropped == round(lost * 400)
    assert counters.reverse_dropped == 0


class _RecordingEcho(asyncio.DatagramProtocol):
    def __init__(self) -> None:
        self.arrivals: list[float] = []
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.arrivals.append(time.time())
        assert self.transport is not None
        self.transport.sendto(data, addr)


async def test_echo_mode_sends_up_at_once_and_pays_both_delays_on_the_way_back() -> None:
    loop = asyncio.get_running_loop()
    transport, target = await loop.create_datagram_endpoint(_RecordingEcho, local_addr=("127.0.0.1", 0))
    address = transport.get_extra_info("sockname")[:2]
    try:
        async with UdpRelay(
            address, LinkParams(delay_ms=40.0), LinkParams(delay_ms=20.0), echo=True
        ) as relay:
            results = await udp_ping(relay.address, count=10, interval_s=0.01, timeout_s=1.0)
            counters = relay.counters
    finally:
        transport.close()
    assert [r.seq for r in results] == list(range(10))
    rtts = [r.rtt_ms for r in results if r.rtt_ms is not None]
    assert len(rtts) == 10
    assert all(60.0 <= rtt < 60.0 + SLACK_MS for rtt in rtts)
    # The target saw each probe well before the 40 ms forward delay (it goes up at once).
    early = [arrived - r.sent_at for arrived, r in zip(target.arrivals, results, strict=True)]
    assert all(0.0 <= e * 1000.0 < 30.0 for e in early)
    assert (counters.forwarded, counters.returned) == (10, 10)


async def test_blackhole_drops_everything_and_lifting_it_restores_traffic() -> None:
    async with UdpEchoServer() as echo, UdpRelay(echo.address, LinkParams(delay_ms=1.0)) as relay:
        relay.update(blackhole=True)
        dark = await udp_ping(relay.address, count=20, interval_s=0.001, timeout_s=0.2)
        relay.update(blackhole=False)
        light = await udp_ping(relay.address, count=5, interval_s=0.001, timeout_s=1.0)
    assert all(r.rtt_ms is None for r in dark)
    assert all(r.rtt_ms is not None for r in light)


async def test_parameters_change_at_run_time() -> None:
    async with UdpEchoServer() as echo, UdpRelay(echo.address, LinkParams(delay_ms=2.0)) as relay:
        fast = await udp_ping(relay.address, count=5, interval_s=0.001)
        relay.set_params(LinkParams(delay_ms=40.0))
        assert relay.forward.delay_ms == relay.reverse.delay_ms == 40.0
        slow = await udp_ping(relay.address, count=5, interval_s=0.001)
    assert max(r.rtt_ms or 0.0 for r in fast) < 4.0 + SLACK_MS
    assert min(r.rtt_ms or 0.0 for r in slow) >= 80.0


async def test_bandwidth_cap_limits_tcp_bulk_throughput() -> None:
    async with TcpProbeServer() as server, TcpRelay(server.address, LinkParams(bandwidth_mbps=8.0)) as relay:
        capped = await tcp_bulk(relay.address, 400_000, timeout_s=10.0)
        relay.update(bandwidth_mbps=None)
        uncapped = await tcp_bulk(relay.address, 4_000_000, timeout_s=10.0)
    assert capped.nbytes == 400_000
    assert 4.0 <= capped.mbps <= 8.0 * 1.05
    assert uncapped.mbps > 4 * capped.mbps


async def test_tcp_blackhole_stalls_the_stream_until_lifted() -> None:
    async with TcpProbeServer() as server, TcpRelay(server.address, LinkParams(delay_ms=1.0)) as relay:
        relay.update(blackhole=True)
        with pytest.raises(TimeoutError):
            await tcp_bulk(relay.address, 10_000, timeout_s=0.3)
        relay.update(blackhole=False)
        result = await tcp_bulk(relay.address, 10_000, timeout_s=5.0)
    assert result.nbytes == 10_000


async def test_emulated_wan_probes_feed_perception_with_the_topology_rtts() -> None:
    topology = load_topology("small")
    regions = [r.id for r in topology.regions][:2]
    src, dst = regions
    link = topology.link(src, dst)
    assert link is not None
    perception = Perception(regions, expected={(src, dst): Expected.from_link(link)})
    async with WanEmulator(topology, regions, seed=3) as wan:
        forward, _ = wan.link_params(src, dst)
        assert forward.delay_ms == pytest.approx(link.rtt_ms / 2)
        results = await udp_ping(wan.udp_address(src, dst), count=15, interval_s=0.01, timeout_s=2.0)
    now = 0.0
    for result in results:
        now = result.sent_at + (result.rtt_ms or 2000.0) / 1000.0  # when its answer (or timeout) came
        assert perception.ingest(to_sample(src, dst, result), now) is None
    perception.tick(now)
    point = perception.point_link(src, dst, now)
    measured = statistics.median(r.rtt_ms for r in results if r.rtt_ms is not None)
    tolerance = 3 * link.rtt_mdev_ms
    assert link.rtt_ms - tolerance <= measured < link.rtt_ms + tolerance + SLACK_MS
    assert point.rtt_ms == pytest.approx(measured, rel=0.05)
    assert not point.stale


async def test_relays_close_cleanly_with_connections_open() -> None:
    server = await TcpProbeServer().start()
    relay = await TcpRelay(server.address, LinkParams(delay_ms=1.0, blackhole=True)).start()
    reader, writer = await asyncio.open_connection(*relay.address)
    writer.write(b"ECHO\nhello")
    await writer.drain()
    await asyncio.wait_for(relay.close(), 5.0)
    await asyncio.wait_for(server.close(), 5.0)
    assert await asyncio.wait_for(reader.read(), 5.0) == b""
    writer.close()


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
async def test_a_threaded_udp_echo_answers_with_the_loop_blocked_and_its_thread_ends_on_close(
    host: str,
) -> None:
    """The cluster agents' echo (``threaded``): its own thread answers, so a probe is answered
    while the event loop is blocked; closing wakes the thread out of ``recvfrom`` and ends it."""
    echo = await UdpEchoServer(host, threaded=True).start()
    target = ("127.0.0.1", echo.address[1])
    thread = echo._thread
    assert thread is not None and thread.is_alive()
    client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        results = await udp_ping(target, count=20, interval_s=0.001, timeout_s=1.0)
        assert [r.seq for r in results] == list(range(20))
        assert all(r.rtt_ms is not None for r in results)
        client.settimeout(2.0)
        # Blocking this loop (no await until the answer is read): only the echo's thread can answer.
        client.sendto(b"while the loop is blocked", target)
        assert client.recv(64) == b"while the loop is blocked"
    finally:
        client.close()
        await echo.close()
    assert not thread.is_alive()
    # Closed: the port answers no more.
    lost = await udp_ping(target, count=2, interval_s=0.001, timeout_s=0.2)
    assert all(r.rtt_ms is None for r in lost)
