"""Network-driven rescheduling on real NATS, PostgreSQL and sockets: a link degraded five-fold with
the WAN emulator (what ``loom net degrade`` sends) moves exactly the job whose benefit exceeds its
cost; restoring the link does not bring it back inside the cool-down.

In this process: probe responders of the three clusters, one probe collector per region (0.2 s
probe periods, through its emulator), network perception, metrics, placement, the migration
service and the agents of the "small" topology. T4s are only in c-weu-a (10, westeurope) and
c-sea1-a (4, asia-southeast1): two gangs that accept T4 or G2 are made to span that link while
c-use2-a (G2s) is away, then c-use2-a joins, and the link is degraded.
"""

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import asyncpg
import msgspec
import pytest
from nats.aio.msg import Msg
from platform_helpers import Platform
from waiting import until

from loom.client import LoomClient
from loom.model.topology import load_topology
from loom.runtime.service import ServiceContext, close_context, open_context
from loom.sched.profile import DEFAULT_PLUGINS
from loom_proto import subjects
from loom_proto.jobs import Communication, JobSpec, Resources, Work
from loom_proto.net import LinkDegraded, LinkEventMessage, LinkRecovered, LinkState
from loom_services.cluster_agent.probes import ProbeResponder
from loom_services.network_perception.service import NetworkPerception
from loom_services.probe_collector.collector import CollectorConfig, ProbeCollector

# Asserts a chain of wall-clock delays (decided within 3 probe periods): run alone, after the
# parallel part, where a loaded machine does not stretch the periods (`make test`).
pytestmark = [pytest.mark.slow, pytest.mark.timing]

PERIOD_S = float(os.environ.get("LOOM_NETMIG_PERIOD_S", "0.2"))
RTT_FACTOR = float(os.environ.get("LOOM_NETMIG_RTT_FACTOR", "5"))
"""The degradation (``loom net degrade … --rtt-factor``); 5 unless measuring another."""
"""Probe period of the test (0.2 s; set the variable to 1.0 to measure at the default)."""
LOSS = float(os.environ.get("LOOM_NETMIG_LOSS", "0"))
"""With a loss (``loom net degrade … --loss``, e.g. 0.03), the link loses that share of its probes
instead of its RTT growing: the gangs spanning it make it a link in use, probed densely."""
WEU, SEA1, USE2 = "azure-westeurope", "gcp-asia-southeast1", "aws-us-east-2"


@pytest.fixture
def nats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from loom.runtime.servers import NatsServer

    with NatsServer(tmp_path_factory.mktemp("netmig-nats")) as server:
        yield server.url


@pytest.fixture
async def stack(
    nats_url: str, fresh_database: Callable[..., Awaitable[str]], tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[Platform, list[tuple[asyncio.Task[None], ServiceContext]]]]:
    p = Platform(nats_url, await fresh_database("netmig"), tmp_path_factory.mktemp("agents"))
    # Without the span guard: a spread of P100s and V100s would otherwise wait (its GPU-hours
    # bound against V100s alone), and this test needs two gangs that span one link.
    plugins = [name for name in DEFAULT_PLUGINS if name != "span_guard"]
    p.placement = {"failover_ttl_s": 30.0, "profile": {"plugins": plugins}}
    # Links only: c-use2-a joins mid-test, and its G2s would draw the long gang by themselves
    # (backflow, tests/integration/test_migration_triggers.py); here nothing moves but for the link.
    p.migration = {"review_clusters": False}
    topology = load_topology("small")
    net: list[tuple[asyncio.Task[None], ServiceContext]] = []
    probes = await open_context("probes", nats_url=nats_url, database_url=None)
    responders = [
        await ProbeResponder(probes, cluster=c.id, region=c.region).start() for c in topology.clusters
    ]
    ctx = await open_context("network-perception", nats_url=nats_url, database_url=p.database_url)
    perception = NetworkPerception(ctx, topology, period_s=PERIOD_S, persist_every_s=1.0)
    net.append((asyncio.create_task(perception.run()), ctx))
    config = CollectorConfig(
        period_s=PERIOD_S,
        probe_timeout_s=1.5,
        bandwidth_every_s=2.0,
        bulk_bytes=32 * 1024,
        discover_retry_s=0.2,
    )
    for region in sorted(r.id for r in topology.regions):
        cctx = await open_context(f"probe-{region}", nats_url=nats_url, database_url=None)
        net.append((asyncio.create_task(ProbeCollector(cctx, topology, region, config).run()), cctx))
    yield p, net
    await asyncio.gather(*(p.stop(name) for name in list(p.tasks)))
    for task, c in net:
        c.stopping.set()
        await asyncio.wait_for(task, timeout=15)
        await close_context(c)
    for responder in responders:
        await responder.close()
    await close_context(probes)


def _gang(job_id: str, workers: int, *, steps: int, models: list[str]) -> JobSpec:
    # A large model: its checkpoint (100 GB) costs ~200 s to save and ~500 s to send over a WAN
    # link, so a move pays only for a job with much work left. 2 s of reference compute per step
    # (4.7 s on a T4, 2.9 s on a P100; the agents run at 10x), one 10 MB all-reduce a step.
    return JobSpec(
        job_id=job_id,
        tenant="t1",
        workers=workers,
        allow_multi_cluster=True,
        labels={"checkpoint_bytes": "100000000000"},
        resources=Resources(gpus=2, gpu_models=models),
        work=Work(steps=steps, step_time_s=2.0, checkpoint_every_steps=5),
        comm=Communication(bytes_per_step=10_000_000, rounds_per_step=1),
    )


async def _job(client: LoomClient, job_id: str) -> dict[str, Any]:
    job = await client.job(job_id)
    assert job is not None
    return job


# PLR0915: one scenario, step by step.
async def test_a_degraded_link_moves_only_the_job_that_gains_more_than_it_costs_and_restore_does_not_bounce(  # noqa: PLR0915
    stack: tuple[Platform, list[tuple[asyncio.Task[None], ServiceContext]]],
) -> None:
    platform, _ = stack
    platform.time_scale = 10.0
    await platform.start("metrics")
    await platform.start("placement")
    await platform.start("migration")
    await platform.start("agent-c-weu-a")
    await platform.start("agent-c-sea1-a")
    client = await LoomClient.connect(platform.nats_url)
    db = await asyncpg.connect(platform.database_url)
    events: list[tuple[float, LinkEventMessage]] = []

    async def on_event(msg: Msg) -> None:
        events.append((time.time(), msgspec.json.decode(msg.data, type=LinkEventMessage)))  # type: ignore[arg-type]

    await client.nc.subscribe(subjects.NET_EVENTS_ALL, cb=on_event)
    ticks: list[float] = []  # perception's link states of the degraded link: the stack's own clock
    measured: list[float] = []  # ... those of them that were measured (not stale)

    async def on_tick(msg: Msg) -> None:
        ticks.append(time.time())
        if not msgspec.json.decode(msg.data, type=LinkState).stale:
            measured.append(ticks[-1])

    await client.nc.subscribe(subjects.link_state(WEU, SEA1), cb=on_tick)
    try:
        await until(lambda: _known(db, 2), 30, "c-weu-a and c-sea1-a known")
        # Only c-weu-a and c-sea1-a are up. 6 two-GPU workers of T4 (c-weu-a holds 5, c-sea1-a 2):
        # the short gang spans the link ...
        await client.submit(_gang("short", 6, steps=40, models=["T4", "G2"]))
        short = await until(lambda: _running(client, "short"), 15, "the short gang running")
        # ... and so does the long one: 5 two-GPU workers of P100 or V100M16 (c-weu-a holds 2
        # P100 ones, c-sea1-a 4 V100M16 ones). Nothing either waits for would free room.
        await client.submit(_gang("long", 5, steps=5000, models=["P100", "V100M16", "G2"]))
        long = await until(lambda: _running(client, "long"), 30, "the long gang running")
        for job in (short, long):
            assert _clusters(job) == {"c-weu-a", "c-sea1-a"}, job
        # G2s appear in us-east-2 while both run; nothing moves without a trigger.
        await platform.start("agent-c-use2-a")
        await until(lambda: _known(db, 3), 15, "c-use2-a known")

        # The link has been measured for a few periods (a step shows against a known level; the
        # jobs can be placed before the probes of a fresh stack have seen the link at all).
        await until(lambda: _enough(measured, 3), 10 * PERIOD_S + 10, "the link measured")
        degraded_at = time.time()
        change: dict[str, Any] = {"loss": LOSS} if LOSS else {"rtt_factor": RTT_FACTOR}
        changed = await client.net_emulate(WEU, SEA1, {"op": "degrade", **change})
        assert changed[0]["degraded"]
        # Timed from when the emulator changed the link, not from the request's sending (its trip
        # through NATS counted against the detection: 2.21 periods on a loaded CI run).
        assert degraded_at <= changed[0]["changed_at"] <= time.time()
        degraded_at = changed[0]["changed_at"]
        event_at = await until(
            lambda: _event_at(events, LinkDegraded, WEU, SEA1),
            60 * PERIOD_S + 10,
            "the link's degraded event",
        )
        planned = await until(
            lambda: db.fetchrow("SELECT * FROM migrations WHERE cause = 'network'"), 10, "a network move"
        )
        decided_s = planned["planned_at"].timestamp() - event_at
        verdicts = {
            r["job_id"]: r
            for r in await db.fetch("SELECT * FROM migration_verdicts WHERE trigger = 'link_degraded'")
        }
        assert planned["job_id"] == "long"
        assert verdicts["long"]["decision"] == "move" and verdicts["long"]["target"] == "c-use2-a"
        assert verdicts["long"]["gain_s"] > verdicts["long"]["threshold_s"] > verdicts["long"]["cost_s"]
        assert verdicts["short"]["decision"] == "stay", dict(verdicts["short"])
        assert verdicts["short"]["gain_s"] < verdicts["short"]["threshold_s"]
        assert "stays" in verdicts["short"]["reason"]
        # Within 3 probe periods of the event, the decision is taken (the move then runs its course).
        assert decided_s <= 3 * PERIOD_S + 0.5, decided_s
        # From the change to the event: one round trip at the new RTT (the first answer showing
        # it), then at most 2 probe periods (the rounds that close on the shift, the filter, the
        # evaluation on the confirming sample). Periods are counted on the stack's clock: where
        # perception's ticks fell behind the wall (a loaded machine), the periods it lost are not
        # the chain's.
        new_rtt_s = (changed[0]["forward"]["delay_ms"] + changed[0]["reverse"]["delay_ms"]) / 1000.0
        elapsed_s = planned["planned_at"].timestamp() - degraded_at
        lived = sum(degraded_at < t <= planned["planned_at"].timestamp() for t in ticks)
        lag = max(elapsed_s / PERIOD_S - lived - 1.0, 0.0)  # one tick of phase is not a lag
        probing = (event_at - degraded_at - new_rtt_s) / PERIOD_S - lag
        if not LOSS:
            assert probing <= 2.0, (probing, lag, event_at - degraded_at)
        else:
            # A loss shows only as probes past their deadline (printed below, not asserted: how
            # many periods depends on chance); the links the gangs span were probed densely.
            collectors = {c.name: c.stats["counts"] for _, c in stack[1] if c.name.startswith("probe-")}
            assert collectors[f"probe-{WEU}"]["dense_probes_sent"] > 0, collectors
        moved = await until(lambda: _running(client, "long", attempt=2), 20, "the long gang moved")
        moved_s = time.time() - degraded_at
        assert _clusters(moved) == {"c-use2-a"}
        # The move completes on the next attempt's start (the migration service hears it a moment
        # after the job runs there).
        row = await until(
            lambda: db.fetchrow("SELECT * FROM migrations WHERE job_id = 'long' AND state = 'completed'"),
            10,
            "the move completed",
        )
        # Nothing lost: it resumed from the step its run had reached (the on-demand checkpoint's).
        assert row["state"] == "completed" and row["lost_steps"] == 0
        assert (await _job(client, "short"))["attempt"] == 1

        # Restore: the link recovers; the long gang stays where it went (cool-down), the short
        # one is not moved either.
        await client.net_emulate(WEU, SEA1, {"op": "restore"})
        # A loss is over only once the loss windows say so (the 10 s one clean, then the 10 s
        # hold): about twice as long as an RTT's return.
        recover_s = 15 + (20 * PERIOD_S if LOSS else 0.0)
        await until(
            lambda: _event_at(events, LinkRecovered, WEU, SEA1), recover_s, "the link's recovered event"
        )
        await until(
            lambda: db.fetchval("SELECT count(*) FROM migration_verdicts WHERE trigger = 'link_improved'"),
            5,
            "the recovery reviewed",
        )
        await asyncio.sleep(1.0)
        back = await db.fetchrow(
            "SELECT * FROM migration_verdicts WHERE trigger = 'link_improved' AND job_id = 'long'"
        )
        assert back is not None and back["decision"] == "stay" and "cool-down" in back["reason"], dict(
            back or {}
        )
        assert await db.fetchval("SELECT count(*) FROM migrations") == 1
        after = await _job(client, "long")
        assert after["attempt"] == 2 and _clusters(after) == {"c-use2-a"}
        print(
            json.dumps(
                {
                    "decided_after_event_s": round(decided_s, 3),
                    "period_s": PERIOD_S,
                    "rtt_factor": None if LOSS else RTT_FACTOR,
                    "loss": LOSS or None,
                    "event_reason": next(
                        e.reason
                        for _, e in events
                        if isinstance(e, LinkDegraded) and (e.src, e.dst) == (WEU, SEA1)
                    ),
                    "dense_probes": {
                        c.name: {
                            k: c.stats["counts"].get(k) for k in ("dense_probes_sent", "dense_probes_lost")
                        }
                        for _, c in stack[1]
                        if c.name.startswith("probe-")
                    },
                    "new_rtt_s": round(new_rtt_s, 3),
                    "event_periods_after_rtt": round(probing, 2),
                    "verdict_after_change_periods": round(elapsed_s / PERIOD_S, 2),
                    "stack_lag_periods": round(lag, 2),
                    "event_after_degrade_s": round(event_at - degraded_at, 3),
                    "moved_after_degrade_s": round(moved_s, 3),
                    "long": {k: verdicts["long"][k] for k in ("gain_s", "cost_s", "threshold_s")},
                    "short": {k: verdicts["short"][k] for k in ("gain_s", "cost_s", "threshold_s")},
                }
            )
        )
    finally:
        await db.close()
        await client.close()


async def _enough(items: list[float], count: int) -> bool:
    return len(items) >= count


async def _known(db: asyncpg.Connection, clusters: int) -> bool:
    known = await db.fetchval(
        """SELECT count(DISTINCT a.cluster) FROM node_allocations a
           JOIN ledger_nodes n ON n.node = a.node WHERE n.healthy AND a.schedulable"""
    )
    return bool(known >= clusters)


async def _running(client: LoomClient, job_id: str, attempt: int = 1) -> dict[str, Any] | None:
    job = await client.job(job_id)
    return job if job and job["state"] == "running" and job["attempt"] == attempt else None


async def _done(client: LoomClient, job_id: str) -> bool:
    job = await client.job(job_id)
    return bool(job and job["state"] == "completed")


async def _progressed(client: LoomClient, job_id: str, fraction: float) -> bool:
    job = await client.job(job_id)
    return bool(job and job["progress"] >= fraction)


def _clusters(job: dict[str, Any]) -> set[str]:
    """The clusters of the job's latest placement."""
    placed = [e["event"] for e in job["events"] if e["kind"] == "placed"]
    return {p["cluster"] for p in placed[-1]["parts"]} or {placed[-1]["cluster"]}


async def _event_at(
    events: list[tuple[float, LinkEventMessage]], kind: type, src: str, dst: str
) -> float | None:
    for at, e in events:
        if isinstance(e, kind) and (e.src, e.dst) == (src, dst):
            return at
    return None
