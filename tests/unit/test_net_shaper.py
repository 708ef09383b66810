"""The emulator's per-direction shaper, on a clock passed in: delay, jitter, loss, cap, blackhole."""

import random

import pytest

from loom.model.topology import Link
from loom.netemu import BANDWIDTH_SCALE, LinkParams, Shaper, params_from_link
from loom.netemu.emulator import MIN_RTO_S


def test_a_datagram_is_delivered_after_the_delay() -> None:
    shaper = Shaper(LinkParams(delay_ms=25.0))
    assert shaper.datagram(10.0, 100) == pytest.approx(10.025)


def test_jitter_spreads_delivery_with_the_configured_deviation_and_never_before_sending() -> None:
    shaper = Shaper(LinkParams(delay_ms=5.0, jitter_ms=2.0), random.Random(1))
    delays = [shaper.datagram(0.0, 100) for _ in range(5000)]
    values = [d for d in delays if d is not None]
    mean = sum(values) / len(values)
    deviation = (sum((v - mean) ** 2 for v in values) / len(values)) ** 0.5
    assert mean == pytest.approx(0.005, abs=0.0002)
    assert deviation == pytest.approx(0.002, rel=0.1)
    assert min(values) >= 0.0


def test_loss_drops_about_the_configured_fraction() -> None:
    shaper = Shaper(LinkParams(loss=0.2), random.Random(7))
    dropped = sum(shaper.datagram(0.0, 100) is None for _ in range(10_000))
    assert 1800 <= dropped <= 2200


def test_blackhole_drops_everything() -> None:
    shaper = Shaper(LinkParams(delay_ms=1.0, blackhole=True))
    assert all(shaper.datagram(float(i), 100) is None for i in range(100))


def test_bandwidth_cap_serialises_back_to_back_datagrams_and_tail_drops() -> None:
    # 8 Mbps: 1000 bytes take 1 ms on the wire.
    shaper = Shaper(LinkParams(bandwidth_mbps=8.0, queue_ms=5.0))
    times = [shaper.datagram(0.0, 1000) for _ in range(10)]
    assert times[:6] == pytest.approx([0.001 * (i + 1) for i in range(6)])
    assert times[-1] is None  # more than 5 ms of queue: dropped
    # Once the queue has drained, a datagram goes straight through.
    assert shaper.datagram(1.0, 1000) == pytest.approx(1.001)


def test_tcp_loss_becomes_a_retransmission_stall() -> None:
    shaper = Shaper(LinkParams(delay_ms=10.0, loss=1.0))
    assert shaper.chunk(0.0, 1448) == pytest.approx(0.010 + MIN_RTO_S)
    slow = Shaper(LinkParams(delay_ms=100.0, loss=1.0))
    assert slow.chunk(0.0, 1448) == pytest.approx(0.1 + 0.4)  # two round trips of 200 ms


def test_params_are_validated() -> None:
    for bad in ({"loss": 1.5}, {"delay_ms": -1.0}, {"bandwidth_mbps": 0.0}, {"jitter_ms": float("nan")}):
        with pytest.raises(ValueError):
            LinkParams(**bad)  # type: ignore[arg-type]


def test_params_from_a_topology_link() -> None:
    link = Link(
        src="a", dst="b", rtt_ms=100.0, rtt_min_ms=95.0, rtt_max_ms=110.0, rtt_mdev_ms=2.0, bandwidth_gbps=4.0
    )
    params = params_from_link(link)
    assert params.delay_ms == 50.0
    assert params.jitter_ms == pytest.approx(2.0 / 2**0.5)
    assert params.bandwidth_mbps == pytest.approx(4.0 * 1000 * BANDWIDTH_SCALE)
    assert params.loss == 0.0 and not params.blackhole
    unmeasured = params_from_link(
        Link(src="a", dst="b", rtt_ms=10.0, rtt_min_ms=9.0, rtt_max_ms=11.0, rtt_mdev_ms=0.1), loss=0.01
    )
    assert unmeasured.bandwidth_mbps is None and unmeasured.loss == 0.01
