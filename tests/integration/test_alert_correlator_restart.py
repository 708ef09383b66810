"""An alert correlator restarted while what it alerted on recovers: the incidents resolve.

A NATS of the module's own (the correlator's durable consumers start clean) and a fresh database.
Correlator A opens a link incident, a second link incident and a failed-cluster incident, then
stops. While it is down one link recovers (a JetStream event) and placement's ``healthy`` notice
goes out on core NATS, heard by nobody. Correlator B, started on the same database, must resolve
the recovered link's incident from the replayed event and the cluster's when placement stops
re-telling its state (the lease), and keep the other link's incident open until that link
recovers. Before the incidents kept their firing alerts, B resolved none of them until ``quiet_s``
(10 minutes) passed without alerts, whatever the links did.
"""

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator

import msgspec
import pytest
from waiting import until

from loom.alerts import CorrelatorConfig
from loom.bus import Publisher, connect
from loom.model.topology import load_topology
from loom.runtime.servers import NatsServer
from loom.runtime.service import close_context, open_context
from loom.store import incidents as store
from loom.store.pool import create_pool
from loom_proto import subjects
from loom_proto.alerts import IncidentChange
from loom_proto.clusters import ClusterHealthChanged
from loom_proto.net import LinkDegraded, LinkRecovered
from loom_services.alert_correlator.service import AlertCorrelator

WAIT_S = 20.0
LEASE_S = 3.0
TOPOLOGY = load_topology("small")
USE, WEU, SEA = "aws-us-east-2", "azure-westeurope", "gcp-asia-southeast1"


def _link(a: str, b: str) -> str:
    return f"{min(a, b)}~{max(a, b)}"


@pytest.fixture(scope="module")
def own_nats(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with NatsServer(tmp_path_factory.mktemp("nats-correlator-restart")) as server:
        yield server.url


@pytest.fixture(scope="module")
async def database_url(fresh_database: Callable[..., Awaitable[str]]) -> str:
    return await fresh_database("correlator_restart")


async def _start(nats_url: str, database_url: str) -> tuple[AlertCorrelator, asyncio.Task[None]]:
    ctx = await open_context("alert-correlator", nats_url=nats_url, database_url=database_url)
    service = AlertCorrelator(
        ctx,
        TOPOLOGY,
        config=CorrelatorConfig(group_wait_s=0.2, min_update_interval_s=0.5),
        http_port=None,
        refresh_s=0.5,
        cluster_health_lease_s=LEASE_S,
    )
    return service, asyncio.create_task(service.run())


async def _stop(service: AlertCorrelator, task: asyncio.Task[None]) -> None:
    service.ctx.stopping.set()
    await asyncio.wait_for(task, timeout=15)
    await close_context(service.ctx)


async def _links_held(database_url: str, root: str) -> bool:
    """Whether the incident rooted at ``root`` persisted both its link alerts as firing."""
    pool = await create_pool(database_url)
    try:
        held = await pool.fetchval("SELECT held FROM incidents WHERE root = $1", root)
    finally:
        await pool.close()
    return held is not None and held.count("loom-link-") == 2


async def _stored(database_url: str) -> dict[str, IncidentChange]:
    pool = await create_pool(database_url)
    try:
        return {i.root: i for i in await store.list_incidents(pool)}
    finally:
        await pool.close()


async def test_incidents_whose_alerts_recovered_while_the_correlator_was_down_resolve_after_it_restarts(
    own_nats: str, database_url: str
) -> None:
    nc = await connect(own_nats, "fake-sources")
    publisher = Publisher(nc)
    failed = ClusterHealthChanged(cluster="c-weu-a", state="failed", reason="both lost", region=WEU, at=2.0)

    async def placement_retelling() -> None:  # as placement does while the cluster stays failed
        while True:
            await nc.publish(subjects.PLACEMENT_CLUSTER_HEALTH, msgspec.json.encode(failed))
            await asyncio.sleep(LEASE_S / 3)

    try:
        first, task = await _start(own_nats, database_url)
        await until(lambda: _consuming(first), WAIT_S, "correlator A consuming")
        for src in (USE, WEU):  # two links into one region: one incident, rooted at the region
            degraded = LinkDegraded(
                src=src, dst=SEA, at=1.0, reason="rtt 3x", rtt_ms=600, baseline_rtt_ms=200, loss_rate=0.0
            )
            await publisher.publish(subjects.net_event("degraded"), degraded, msg_id=f"deg-{src}")
        teller = asyncio.create_task(placement_retelling())

        async def both_open_and_stored() -> bool:
            rows = await _stored(database_url)
            return all(r in rows and rows[r].state == "open" for r in (SEA, "c-weu-a"))

        await until(
            both_open_and_stored, WAIT_S, "the region's and the cluster's incidents open and persisted"
        )

        await until(lambda: _links_held(database_url, SEA), WAIT_S, "the region's firing alerts persisted")
        teller.cancel()
        await _stop(first, task)

        # While no correlator runs: one link recovers, placement says the cluster is healthy.
        recovered = LinkRecovered(src=USE, dst=SEA, at=3.0, reason="back", baseline_rtt_ms=200, loss_rate=0.0)
        await publisher.publish(subjects.net_event("recovered"), recovered, msg_id="rec-use")
        healthy = ClusterHealthChanged(cluster="c-weu-a", state="healthy", region=WEU, at=3.0)
        await nc.publish(subjects.PLACEMENT_CLUSTER_HEALTH, msgspec.json.encode(healthy))  # heard by nobody

        started = time.time()
        second, task = await _start(own_nats, database_url)
        try:

            async def cluster_resolved() -> IncidentChange | None:
                row = (await _stored(database_url)).get("c-weu-a")
                return row if row is not None and row.state == "resolved" else None

            lapsed = await until(
                cluster_resolved, WAIT_S, "the cluster's incident resolved when its lease lapsed"
            )
            assert (
                lapsed.resolved_at is not None and lapsed.resolved_at >= started + LEASE_S - 0.5
            )  # the lease
            # One of the region's links is still degraded: its incident stays open ...
            assert second.core.counts["resolved_alerts"] >= 2  # the replayed recovery and the lapse
            region = second.core.incidents[(await _stored(database_url))[SEA].incident_id]
            assert region.is_open and region.active == {f"loom-link-{_link(WEU, SEA)}"}
            # ... until that link recovers too.
            back = LinkRecovered(src=WEU, dst=SEA, at=4.0, reason="back", baseline_rtt_ms=200, loss_rate=0.0)
            await publisher.publish(subjects.net_event("recovered"), back, msg_id="rec-weu")

            async def region_resolved() -> IncidentChange | None:
                row = (await _stored(database_url))[SEA]
                return row if row.state == "resolved" else None

            done = await until(
                region_resolved, WAIT_S, "the region's incident resolved once its links recovered"
            )
            assert any("every alert resolved" in t.what for t in done.timeline)
        finally:
            await _stop(second, task)
    finally:
        await nc.drain()


async def test_a_cluster_state_placement_keeps_telling_holds_its_incident_open(
    own_nats: str, database_url: str
) -> None:
    """The lease lapses only for a state nobody re-tells: one told again within it stays firing."""
    nc = await connect(own_nats, "fake-placement")
    service, task = await _start(own_nats, database_url)
    try:
        await until(lambda: _consuming(service), WAIT_S, "the correlator consuming")
        failed = ClusterHealthChanged(
            cluster="c-sea1-a", state="suspect", reason="probes lost", region=SEA, at=5.0
        )
        await nc.publish(subjects.PLACEMENT_CLUSTER_HEALTH, msgspec.json.encode(failed))

        async def opened() -> bool:
            row = (await _stored(database_url)).get("c-sea1-a")
            return row is not None and row.state == "open"

        await until(opened, WAIT_S, "the suspect cluster's incident")
        for _ in range(4):  # re-told every LEASE_S / 2: 2 leases' time without lapsing
            await asyncio.sleep(LEASE_S / 2)
            await nc.publish(subjects.PLACEMENT_CLUSTER_HEALTH, msgspec.json.encode(failed))
        assert (await _stored(database_url))["c-sea1-a"].state == "open"
        assert service.core.counts["received"] == 1  # re-tells renew the lease, they are not alerts

        async def lapsed() -> bool:
            return (await _stored(database_url))["c-sea1-a"].state == "resolved"

        await until(lapsed, WAIT_S, "resolved once placement stopped telling it")
    finally:
        await _stop(service, task)
        await nc.drain()


async def _consuming(service: AlertCorrelator) -> bool:
    return bool(service.ctx.stats.get("http")) or "open_incidents" in service.ctx.stats
