"""A link that stays degraded is looked at again (real NATS, PostgreSQL and sockets): a gang that
had nowhere better to go when its link degraded moves once a better place appears, while the link
is still degraded — with no other trigger (cluster reviews are off), only the recheck every
``rule.recheck_s``. Then, with the link recovered, nothing is looked at again.

The stack of ``test_network_migration`` (probe responders and collectors, network perception,
metrics, placement, the migration service, the "small" topology's agents)."""

import asyncio
import itertools
import time

import asyncpg
import msgspec
import pytest
from nats.aio.msg import Msg
from test_network_migration import (  # noqa: F401  (fixtures)
    SEA1,
    WEU,
    _clusters,
    _enough,
    _event_at,
    _gang,
    _known,
    _running,
    nats_url,
    stack,
)
from waiting import until

from loom.client import LoomClient
from loom.migrate.benefit import MigrationSettings as Rule
from loom_proto import subjects
from loom_proto.net import LinkDegraded, LinkEventMessage, LinkRecovered, LinkState

pytestmark = pytest.mark.slow

RECHECK_S = 1.0


# PLR0915: one scenario, step by step.
async def test_a_gang_with_nowhere_better_when_its_link_degraded_moves_at_a_recheck_once_a_place_appears(  # noqa: PLR0915
    stack: tuple,  # type: ignore[type-arg]  # noqa: F811 - the imported fixture
) -> None:
    platform, _ = stack
    platform.time_scale = 10.0
    platform.migration = {**platform.migration, "rule": Rule(recheck_s=RECHECK_S)}
    await platform.start("metrics")
    await platform.start("placement")
    migration = await platform.start("migration")
    await platform.start("agent-c-weu-a")
    await platform.start("agent-c-sea1-a")
    client = await LoomClient.connect(platform.nats_url)
    db = await asyncpg.connect(platform.database_url)
    events: list[tuple[float, LinkEventMessage]] = []
    measured: list[float] = []

    async def on_event(msg: Msg) -> None:
        events.append((time.time(), msgspec.json.decode(msg.data, type=LinkEventMessage)))  # type: ignore[arg-type]

    async def on_tick(msg: Msg) -> None:
        if not msgspec.json.decode(msg.data, type=LinkState).stale:
            measured.append(time.time())

    await client.nc.subscribe(subjects.NET_EVENTS_ALL, cb=on_event)
    await client.nc.subscribe(subjects.link_state(WEU, SEA1), cb=on_tick)
    try:
        await until(lambda: _known(db, 2), 30, "c-weu-a and c-sea1-a known")
        # The long gang spans westeurope and asia-southeast1 (c-use2-a's G2s are not there yet).
        await client.submit(_gang("long", 5, steps=5000, models=["P100", "V100M16", "G2"]))
        long = await until(lambda: _running(client, "long"), 30, "the long gang running")
        assert _clusters(long) == {"c-weu-a", "c-sea1-a"}, long
        await until(lambda: _enough(measured, 3), 30, "the link measured")
        await client.net_emulate(WEU, SEA1, {"op": "degrade", "rtt_factor": 5.0})
        await until(lambda: _event_at(events, LinkDegraded, WEU, SEA1), 30, "the link's degraded event")
        first = await until(
            lambda: db.fetchrow("SELECT * FROM migration_verdicts WHERE job_id = 'long'"), 10, "a verdict"
        )
        # Nowhere better now: it stays (no room elsewhere, or only where it runs).
        assert first["decision"] == "stay" and first["target"] in (None, "c-weu-a", "c-sea1-a"), dict(first)
        rechecks = migration.stats["rechecks"]
        await asyncio.sleep(3 * RECHECK_S)
        assert migration.stats["rechecks"] > rechecks  # looked at again while degraded
        assert await db.fetchval("SELECT count(*) FROM migrations") == 0
        # The other direction degrades too (each end measures it; the emulated delay reached it
        # only at times): the same episode, reviewed again, records no second alike stay (it did,
        # when that event came after the first review).
        await client.net_emulate(SEA1, WEU, {"op": "degrade", "rtt_factor": 5.0})
        await until(lambda: _event_at(events, LinkDegraded, SEA1, WEU), 30, "the other direction degraded")
        await asyncio.sleep(2 * RECHECK_S)
        # A stay is recorded again only when it differs (its target) from the last one recorded.
        rows = await db.fetch(
            "SELECT decision, target FROM migration_verdicts WHERE job_id = 'long' ORDER BY id"
        )
        assert migration.stats["rechecks"] >= 2  # looks that could each have written a row
        assert all(a != b for a, b in itertools.pairwise(rows)), rows

        # G2s appear in us-east-2: no cluster review runs (off), the recheck finds them.
        await platform.start("agent-c-use2-a")
        await until(lambda: _known(db, 3), 15, "c-use2-a known")
        planned = await until(
            lambda: db.fetchrow("SELECT * FROM migrations WHERE job_id = 'long'"), 30, "the long gang's move"
        )
        assert planned["cause"] == "network", dict(planned)
        moved = await until(lambda: _running(client, "long", attempt=2), 30, "the long gang moved")
        assert _clusters(moved) == {"c-use2-a"}
        verdict = await db.fetchrow(
            "SELECT * FROM migration_verdicts WHERE job_id = 'long' AND decision = 'move'"
        )
        assert verdict["trigger"] == "link_degraded" and verdict["target"] == "c-use2-a"
        assert verdict["gain_s"] > verdict["threshold_s"]

        # Recovered: the link is no longer looked at.
        await client.net_emulate(WEU, SEA1, {"op": "restore"})
        await client.net_emulate(SEA1, WEU, {"op": "restore"})
        await until(lambda: _event_at(events, LinkRecovered, WEU, SEA1), 30, "the link's recovered event")

        async def nothing_degraded() -> bool:
            return len(migration.degraded) == 0

        await until(nothing_degraded, 30, "both directions recovered")
        rechecks = migration.stats["rechecks"]
        await asyncio.sleep(3 * RECHECK_S)
        assert migration.stats["rechecks"] == rechecks
    finally:
        await db.close()
        await client.close()
