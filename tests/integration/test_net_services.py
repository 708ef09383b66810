"""The network services in this process on real NATS, PostgreSQL and sockets: probe endpoints of the
agents, one probe collector per region (probing through its WAN emulator), network-perception.

The "small" topology (three regions) with 0.2 s probe periods; network-perception scales the core's
time constants to the period, so "periods" below mean the same as with 1 s periods in production.
"""

import asyncio
import contextlib
import json
import math
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
from nats.aio.msg import Msg
from waiting import until as _until

from loom.client import LoomClient
from loom.model.topology import Topology, load_topology
from loom.net.burst import BurstConfig
from loom.netemu import UdpEchoServer, UdpProber
from loom.runtime.servers import NatsServer
from loom.runtime.service import ServiceContext, close_context, open_context
from loom_proto import subjects
from loom_proto.net import LinkDegraded, LinkEventMessage, LinkRecovered, LinkState, TransferObserved
from loom_services.cluster_agent.probes import ProbeResponder
from loom_services.network_perception.service import NetworkPerception
from loom_services.probe_collector.collector import CollectorConfig, ProbeCollector

# Measures wall-clock delays and rates: runs after the parallel part of `make test`, alone.
pytestmark = pytest.mark.timing

PERIOD_S = float(os.environ.get("LOOM_NET_PERIOD_S", "0.2"))
USE2, WEU, SEA1 = "aws-us-east-2", "azure-westeurope", "gcp-asia-southeast1"


@pytest.fixture(scope="module")
def nats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A NATS of this module's own: the durable consumers start from a clean stream."""
    with NatsServer(tmp_path_factory.mktemp("net-nats")) as server:
        yield server.url


@dataclass
class Net:
    """The services as tasks, and what the test saw on the bus."""

    nats_url: str
    database_url: str
    topology: Topology
    tasks: dict[str, tuple[asyncio.Task[None], ServiceContext]] = field(default_factory=dict)
    responders: list[ProbeResponder] = field(default_factory=list)
    events: list[tuple[float, LinkDegraded | LinkRecovered]] = field(default_factory=list)
    states: dict[tuple[str, str], LinkState] = field(default_factory=dict)

    async def start(self, name: str) -> None:
        needs_db = name == "network-perception"
        ctx = await open_context(
            name, nats_url=self.nats_url, database_url=self.database_url if needs_db else None
        )
        service: NetworkPerception | ProbeCollector
        if needs_db:
            service = NetworkPerception(ctx, self.topology, period_s=PERIOD_S, persist_every_s=1.0)
        else:
            config = CollectorConfig(
                period_s=PERIOD_S,
                probe_timeout_s=1.5,
                bandwidth_every_s=2.0,
                bulk_bytes=32 * 1024,
                discover_retry_s=0.2,
            )
            service = ProbeCollector(ctx, self.topology, name.removeprefix("probe-"), config)
        self.tasks[name] = (asyncio.create_task(service.run()), ctx)

    async def stop(self, name: str) -> None:
        task, ctx = self.tasks.pop(name)
        ctx.stopping.set()
        await asyncio.wait_for(task, timeout=15)
        await close_context(ctx)


@pytest.fixture(scope="module")
async def net(nats_url: str, fresh_database: Callable[..., Awaitable[str]]) -> AsyncIterator[Net]:
    topology = load_topology("small")
    n = Net(nats_url, await fresh_database("net"), topology)
    agents = await open_context("agents", nats_url=nats_url, database_url=None)
    for cluster in topology.clusters:
        n.responders.append(await ProbeResponder(agents, cluster=cluster.id, region=cluster.region).start())

    async def on_event(msg: Msg) -> None:
        n.events.append((time.time(), msgspec.json.decode(msg.data, type=LinkEventMessage)))

    async def on_state(msg: Msg) -> None:
        state = msgspec.json.decode(msg.data, type=LinkState)
        n.states[state.src, state.dst] = state

    await agents.nc.subscribe("loom.net.event.*", cb=on_event)
    await agents.nc.subscribe("loom.net.link.*.*", cb=on_state)
    await n.start("network-perception")
    for region in sorted(r.id for r in topology.regions):
        await n.start(f"probe-{region}")
    yield n
    for name in list(n.tasks):
        await n.stop(name)
    for responder in n.responders:
        await responder.close()
    await close_context(agents)


@pytest.fixture
async def client(net: Net) -> AsyncIterator[LoomClient]:
    c = await LoomClient.connect(net.nats_url)
    yield c
    await c.close()


async def until(check: Callable[[], Awaitable[Any]], timeout_s: float, what: str) -> Any:
    """Poll ``check`` twice a probe period until it returns something truthy."""
    return await _until(check, timeout_s, what, interval_s=PERIOD_S / 2)


async def health(client: LoomClient, name: str) -> dict[str, Any]:
    reply = await client.nc.request(subjects.service_health(name), b"", timeout=2.0)
    body: dict[str, Any] = json.loads(reply.data)
    return body


def close_to(measured: float, expected: float) -> bool:
    # Generous: the relays add scheduling delay and jitter; the point is "the topology's RTT".
    return abs(measured - expected) <= max(0.15 * expected, 20.0)


async def test_every_directed_link_is_measured_near_the_topologys_rtt(net: Net, client: LoomClient) -> None:
    links = {(link.src, link.dst): link.rtt_ms for link in net.topology.links}
    assert len(links) == 6

    async def measured() -> bool:
        points = await client.net_point()
        by_link = {(p["src"], p["dst"]): p for p in points}
        for key, rtt_ms in links.items():
            point = by_link.get(key)
            if point is None or point["stale"]:
                return False
            short = point["windows"][0][0]  # RttStats of the shortest horizon: real probes only
            if short["samples"] < 5 or not close_to(short["p50_ms"], rtt_ms):
                return False
        return all(key in net.states and not net.states[key].stale for key in links)

    await until(measured, 20, "every link measured near its topology RTT")
    for key, rtt_ms in links.items():
        assert close_to(net.states[key].rtt_ms_p50, rtt_ms), (key, net.states[key], rtt_ms)
    stats = await health(client, f"probe-{USE2}")
    assert stats["counts"]["probes_sent"] > 0
    assert stats["links"][SEA1]["up"] and not stats["links"][SEA1]["degraded"]


async def test_a_degraded_link_reroutes_within_two_periods_and_recovers_slower_without_flapping(
    net: Net, client: LoomClient
) -> None:
    direct, detour = [USE2, SEA1], [USE2, WEU, SEA1]

    async def path() -> dict[str, Any]:
        return await client.net_path(USE2, SEA1)

    before = await until(lambda: _path_is(path, direct), 10, "the direct path chosen")
    changes_before = before["changes"]
    seen = len(net.events)

    def link_events(kind: str) -> list[tuple[float, LinkDegraded | LinkRecovered]]:
        return [
            (t, e)
            for t, e in net.events[seen:]
            if (e.src, e.dst) == (USE2, SEA1) and (isinstance(e, LinkDegraded) == (kind == "degraded"))
        ]

    stepped_at = time.time()
    try:
        changed = await client.net_emulate(USE2, SEA1, {"op": "degrade", "rtt_factor": 5, "loss": 0.05})
        assert changed[0]["degraded"]

        async def degraded() -> Any:
            return link_events("degraded")

        [(_, event)] = await until(degraded, 10, "the degraded event")
        rerouted = await until(lambda: _path_is(path, detour), 5, "the path around the degraded link")
        # The path changes in the period that raised the event (the same evaluation), at most two later.
        assert rerouted["changed_at"] - event.at <= 2 * PERIOD_S + 1e-6, (rerouted, event)
        degrade_s = event.at - stepped_at
    finally:
        restored_at = time.time()
        await client.net_emulate(USE2, SEA1, {"op": "restore"})

    async def recovered() -> Any:
        return link_events("recovered")

    [(_, recovery)] = await until(recovered, 40, "the recovered event")
    recover_s = recovery.at - restored_at
    assert recover_s > degrade_s, (recover_s, degrade_s)
    # Back to the direct path eventually, each path change at least ten periods apart.
    back = await until(lambda: _path_is(path, direct), 40, "the direct path again")
    window_periods = (time.time() - restored_at) / PERIOD_S
    recovery_changes = back["changes"] - rerouted["changes"]
    assert recovery_changes <= max(1, math.floor(window_periods / 10)), (recovery_changes, window_periods)
    assert back["changes"] - changes_before == 2
    # One event each way: the link did not flap between degraded and recovered.
    assert len(link_events("degraded")) == 1
    assert len(link_events("recovered")) == 1


async def _path_is(path: Callable[[], Awaitable[dict[str, Any]]], nodes: list[str]) -> dict[str, Any] | None:
    answer = await path()
    return answer if answer["path"] and answer["path"]["nodes"] == nodes else None


async def test_bad_samples_are_dropped_and_counted_by_reason(net: Net, client: LoomClient) -> None:
    before = await health(client, "network-perception")
    js = client.nc.jetstream()
    now = time.time()
    negative = {"kind": "probe", "src": USE2, "dst": WEU, "probe": "udp_echo", "seq": 1, "sent_at": now}
    await js.publish(subjects.probe_sample(USE2, WEU), json.dumps({**negative, "rtt_ms": -5.0}).encode())
    unknown = {**negative, "dst": "mars", "rtt_ms": 10.0}
    await js.publish(subjects.probe_sample(USE2, "mars"), json.dumps(unknown).encode())
    await js.publish(subjects.probe_sample(USE2, WEU), b"not json")

    def grew(stats: dict[str, Any], group: str, reason: str) -> bool:
        return int(stats[group].get(reason, 0)) > int(before[group].get(reason, 0))

    async def counted() -> bool:
        stats = await health(client, "network-perception")
        return (
            grew(stats, "dropped", "negative")
            and grew(stats, "dropped", "unknown_endpoint")
            and grew(stats, "refused", "undecodable")
        )

    await until(counted, 5, "the bad samples counted")
    points = await client.net_point()
    assert all(p["rtt_ms"] is None or p["rtt_ms"] >= 0 for p in points)
    assert {(p["src"], p["dst"]) for p in points} == {(link.src, link.dst) for link in net.topology.links}


async def test_a_restarted_network_perception_resumes_its_learned_records(
    net: Net, client: LoomClient
) -> None:
    await net.stop("network-perception")  # persists on the way out
    ctx = await open_context("reader", nats_url=net.nats_url, database_url=net.database_url)
    try:
        rows = await ctx.db.fetch("SELECT src, dst, record FROM net_link_records")
    finally:
        await close_context(ctx)
    saved = {(r["src"], r["dst"]): json.loads(r["record"])["baseline_rtt_ms"] for r in rows}
    assert len(saved) == 6
    await net.start("network-perception")

    async def restored() -> dict[str, Any] | None:
        try:
            stats = await health(client, "network-perception")
        except Exception:  # not answering yet
            return None
        return stats if stats.get("restored") else None

    stats = await until(restored, 10, "network-perception restarted")
    assert stats["restored"] == 6
    point = await client.net_point(src=USE2, dst=WEU)
    # The learned baseline, not the topology's prior (the baseline moves slowly: 600 periods).
    assert point["baseline_rtt_ms"] == pytest.approx(saved[USE2, WEU], rel=0.02)


async def test_a_slow_job_transfer_makes_its_link_cost_more(net: Net, client: LoomClient) -> None:
    async def cost_of(src: str, dst: str) -> float:
        (point,) = [p for p in await client.net_point() if (p["src"], p["dst"]) == (src, dst)]
        return float(point["cost"])

    await until(lambda: _positive(cost_of(SEA1, WEU)), 10, "the link to be priced")
    before_stats = await health(client, "network-perception")
    before = await cost_of(SEA1, WEU)
    # 1 GB in 80 s is 0.1 Gbit/s where the link was expected to carry 1 Gbit/s: ten times slower.
    transfer = TransferObserved(
        src=SEA1,
        dst=WEU,
        job_id="slow-copy",
        transfer_bytes=10**9,
        seconds=80.0,
        expected_gbps=1.0,
        at=time.time(),
    )
    await client.nc.jetstream().publish(
        subjects.net_transfer(SEA1, WEU),
        msgspec.json.encode(transfer),
        headers={"Nats-Msg-Id": "transfer-slow-copy"},
    )

    async def counted() -> bool:
        stats = await health(client, "network-perception")
        return int(stats["transfers"]) > int(before_stats["transfers"])

    await until(counted, 5, "the transfer to be folded in")

    async def pricier() -> float | None:
        cost = await cost_of(SEA1, WEU)
        return cost if cost > before * 1.05 else None

    await until(pricier, 5, "the link's cost to rise after the slow transfer")


async def _positive(value: Awaitable[float]) -> bool:
    return await value > 0


async def test_a_link_losing_3_percent_is_degraded_soon_after_its_first_lost_probe(
    net: Net, client: LoomClient
) -> None:
    """Loss bursts (issue 15 item 3, "loss > 1 %"): at 5 probes a period a link losing 3 % shows its
    first lost probe after ~7 periods, and its steady probes alone take ~38 periods on average to
    make that loss significant (a quarter not within 60); the collector's burst makes it within a
    few periods of the first lost probe, through the same loss rule."""
    # LOOM_NET_REST_S: first leave the stack at rest this long and print what the collectors sent.
    rest_s = float(os.environ.get("LOOM_NET_REST_S", "0"))
    if rest_s > 0:
        started = {r.id: (await health(client, f"probe-{r.id}"))["counts"] for r in net.topology.regions}
        await asyncio.sleep(rest_s)  # the rest being measured, not a synchronisation
        for region, counts in started.items():
            now = (await health(client, f"probe-{region}"))["counts"]
            print(
                f"at rest {rest_s:.0f} s, probe-{region}: "
                + ", ".join(
                    f"{key} {now[key] - counts[key]}"
                    for key in ("probes_sent", "probes_lost", "burst_episodes", "burst_probes_sent")
                )
            )
    name = f"probe-{WEU}"
    before = (await health(client, name))["counts"]
    seen = len(net.events)

    def degraded() -> list[tuple[float, LinkDegraded | LinkRecovered]]:
        return [
            (t, e)
            for t, e in net.events[seen:]
            if (e.src, e.dst) == (WEU, SEA1) and isinstance(e, LinkDegraded)
        ]

    stepped_at = time.time()
    try:
        await client.net_emulate(WEU, SEA1, {"op": "degrade", "loss": 0.03})
        [(_, event)] = await until(lambda: _ready(degraded()), 60 * PERIOD_S + 3.0, "the degraded event")
    finally:
        await client.net_emulate(WEU, SEA1, {"op": "restore"})
    assert "loss" in event.reason, event.reason

    async def burst_counted() -> dict[str, int] | None:
        # The episode's samples are counted as its round closes, which may come just after the
        # event (the loss rule can also tip on a steady sample while a burst is on the way).
        counts: dict[str, int] = (await health(client, name))["counts"]
        return counts if counts["burst_samples"] > before["burst_samples"] else None

    after = await until(burst_counted, 10 * PERIOD_S + 3.0, "the burst's samples counted")
    assert after["burst_episodes"] > before["burst_episodes"]
    assert after["burst_probes_sent"] - before["burst_probes_sent"] <= 2 * BurstConfig().max_per_episode
    print(  # the figure for the README: periods from the change to the event
        f"loss 3 %: degraded {(event.at - stepped_at) / PERIOD_S:.1f} periods after the change "
        f"({event.reason}); burst probes {after['burst_probes_sent'] - before['burst_probes_sent']}, "
        f"episodes {after['burst_episodes'] - before['burst_episodes']}"
    )


async def _ready(value: list[Any]) -> list[Any] | None:
    return value or None


@contextlib.asynccontextmanager
async def _direct_probing(
    nats_url: str, name: str, config: CollectorConfig
) -> AsyncIterator[tuple[ProbeCollector, UdpProber]]:
    """A collector probing a real echo endpoint directly (no emulator) on its send loop."""
    ctx = await open_context(name, nats_url=nats_url, database_url=None)
    sender: asyncio.Task[None] | None = None
    try:
        collector = ProbeCollector(ctx, load_topology("small"), WEU, config)
        link = collector.links[SEA1]
        async with (
            UdpEchoServer() as echo,
            UdpProber(
                echo.address, timeout_s=config.probe_timeout_s, on_result=collector._result_handler(link)
            ) as prober,
        ):
            collector.probing[SEA1] = prober
            sender = asyncio.create_task(collector._send_loop())
            yield collector, prober
    finally:
        if sender is not None:
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)
        await close_context(ctx)


async def test_an_unemulated_burst_on_a_healthy_link_loses_almost_nothing_and_ends_good(
    nats_url: str,
) -> None:
    """Probing a real echo endpoint directly (no emulator): a burst goes out at most
    ``burst_max_per_tick`` probes a tick, so a healthy link's burst does not overflow the echo
    socket's receive buffer (600 back to back lost more than half) and ends *good*."""
    per_tick = int(os.environ.get("LOOM_BURST_MAX_PER_TICK", CollectorConfig().burst_max_per_tick))
    config = CollectorConfig(
        period_s=PERIOD_S,
        probe_timeout_s=1.5,
        emulate=False,
        bandwidth_every_s=0,
        burst_max_per_tick=per_tick,
    )
    async with _direct_probing(nats_url, "probe-direct-test", config) as (collector, _prober):
        await asyncio.sleep(3 * PERIOD_S)  # some steady probes first: a healthy window

        async def started() -> bool:
            # One lost probe: suspicion (again if a lagging loop held the period).
            if not collector.burst.counts()["burst_episodes"]:
                collector.burst.on_result(SEA1, time.time(), True)
                return False
            return True

        await until(started, 20 * PERIOD_S, "an episode to start")

        async def ended() -> dict[str, int] | None:
            counts = collector.burst.counts()
            done = sum(counts[f"burst_ended_{r}"] for r in ("bad", "good", "capped"))
            return counts if done else None

        counts = await until(ended, 40 * PERIOD_S + 5.0, "the burst to end")
        sent, lost = collector.counts["burst_probes_sent"], collector.counts["burst_probes_lost"]
        print(f"direct burst, {per_tick} a tick: {sent} sent, {lost} lost, ends {counts}")
        assert sent >= BurstConfig().for_period(PERIOD_S).link.short_loss_probes
        assert lost <= max(2, sent // 100), (sent, lost)
        assert counts["burst_ended_good"] == 1 and counts["burst_ended_bad"] == 0


async def test_a_loop_stall_neither_bursts_back_to_back_nor_starts_an_episode(nats_url: str) -> None:
    """A stall of the collector's loop longer than the probe timeout: the probes' answers wait in
    the sockets while their timers fire late, counted lost. The send clock restarts instead of
    firing the missed ticks back to back, and the next period holds new burst episodes."""
    config = CollectorConfig(period_s=PERIOD_S, probe_timeout_s=1.0, emulate=False, bandwidth_every_s=0)
    async with _direct_probing(nats_url, "probe-stall-test", config) as (collector, prober):
        await asyncio.sleep(3 * PERIOD_S)  # a healthy window first
        sent = collector.counts["probes_sent"]
        for _ in range(3):
            prober.send()
        time.sleep(config.probe_timeout_s + 0.5)  # noqa: ASYNC251 -- the stall under test: the loop blocked
        await asyncio.sleep(5 * PERIOD_S)
        counts = collector.counts
        ticks = counts["probes_sent"] - sent
        assert counts["probes_lost_late"] >= 1 and counts["send_ticks_late"] >= 1
        assert ticks <= 5 * config.probes_per_period + 3, ticks  # no missed ticks made up
        burst = collector.burst.counts()
        assert burst["burst_held"] >= 1 and burst["burst_episodes"] == 0, burst
