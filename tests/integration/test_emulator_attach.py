"""A prober in the relay's own process sends through it without a socket hop
(:meth:`loom.netemu.UdpRelay.attach`), as the probe collector's probers do."""

import asyncio

import pytest
from waiting import until

from loom.netemu import LinkParams, UdpEchoServer, UdpProber, UdpRelay

# Measures wall-clock delays: runs after the parallel part of `make test`, alone.
pytestmark = pytest.mark.timing

SLACK_MS = 50.0
"""Scheduling delay a test allows on top of the configured one."""


@pytest.mark.parametrize("echo_mode", [False, True])
async def test_a_prober_attached_to_its_relay_in_process_measures_the_configured_delay(
    echo_mode: bool,
) -> None:
    async with (
        UdpEchoServer() as echo,
        UdpRelay(echo.address, LinkParams(delay_ms=20.0), LinkParams(delay_ms=10.0), echo=echo_mode) as relay,
    ):
        async with UdpProber(relay.address, timeout_s=1.0, relay=relay) as prober:
            for i in range(20):
                if i:
                    await asyncio.sleep(0.005)
                prober.send()
            results = [await asyncio.wait_for(prober.results.get(), 2.0) for _ in range(20)]
        # The relay shaped and counted them as it does a client on the loopback.
        assert (relay.counters.forwarded, relay.counters.returned) == (20, 20)
    rtts = [r.rtt_ms for r in results if r.rtt_ms is not None]
    assert len(rtts) == 20
    assert all(30.0 <= rtt < 30.0 + SLACK_MS for rtt in rtts)
    assert sorted(r.seq for r in results) == list(range(20))


async def test_an_attached_client_detached_or_on_a_closed_relay_sends_nothing() -> None:
    answers: list[bytes] = []
    async with UdpEchoServer() as echo, UdpRelay(echo.address, LinkParams(delay_ms=1.0)) as relay:
        client = relay.attach(answers.append)
        client.send(b"first-datagram!!")
        await asyncio.sleep(0.2)
        assert answers == [b"first-datagram!!"]
        client.detach()
        client.send(b"after-detaching")
        await asyncio.sleep(0.1)
        assert answers == [b"first-datagram!!"]
        assert relay.counters.forward_dropped == 1
        other = relay.attach(answers.append)
    other.send(b"after-closing")  # the relay is closed now
    assert relay.counters.forward_dropped == 2
    assert answers == [b"first-datagram!!"]


async def test_an_answer_the_prober_may_hold_waits_for_its_next_send_and_keeps_its_rtt() -> None:
    """``hold``: the answer is taken from the relay when it is shaped (no timer), handed over at
    the next send, with the RTT it arrived with, not the time it waited."""
    offered: list[tuple[int, float]] = []

    def hold(seq: int, rtt_ms: float) -> bool:
        offered.append((seq, rtt_ms))
        return True

    async with (
        UdpEchoServer() as echo,
        UdpRelay(echo.address, LinkParams(delay_ms=20.0), LinkParams(delay_ms=10.0), echo=True) as relay,
        UdpProber(relay.address, timeout_s=5.0, relay=relay, hold=hold) as prober,
    ):
        first = prober.send()

        async def taken() -> bool:
            return relay.counters.returned == 1

        await until(taken, 2.0, "the echo to reach the relay")
        await asyncio.sleep(0.2)  # well past its 30 ms: held all the same
        assert prober.results.empty() and prober.outstanding == 1
        second = prober.send()  # hands the first answer over before sending
        result = prober.results.get_nowait()
    assert (result.seq, second) == (first, first + 1)
    assert result.rtt_ms is not None and 30.0 <= result.rtt_ms < 30.0 + SLACK_MS
    assert offered[0][0] == first and offered[0][1] == result.rtt_ms


async def test_a_held_answer_that_arrived_before_the_timeout_is_no_loss_and_one_not_held_comes_alone() -> (
    None
):
    """A probe's timeout hands over the held answers first (no next send needed); an answer
    ``hold`` refuses is handed over when it arrives, as without ``hold``."""
    async with (
        UdpEchoServer() as echo,
        UdpRelay(echo.address, LinkParams(delay_ms=20.0), LinkParams(delay_ms=10.0), echo=True) as relay,
        UdpProber(relay.address, timeout_s=0.3, relay=relay, hold=lambda seq, _rtt: seq == 0) as prober,
    ):
        prober.send()
        prober.send()
        results = [await asyncio.wait_for(prober.results.get(), 2.0) for _ in range(2)]
    # Probe 1 (not held) came alone after about 30 ms; probe 0 (held) when its timeout fired.
    assert [r.seq for r in results] == [1, 0]
    assert all(r.rtt_ms is not None and 30.0 <= r.rtt_ms < 30.0 + SLACK_MS for r in results)
