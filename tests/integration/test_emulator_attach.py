"""A prober in the relay's own process sends through it without a socket hop
(:meth:`loom.netemu.UdpRelay.attach`), as the probe collector's probers do."""

import asyncio

import pytest

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
