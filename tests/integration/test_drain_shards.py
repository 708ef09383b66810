"""A drain (or undrain) is confirmed by the leader of every placement shard, on real NATS and
PostgreSQL (the small topology).

Two placement shards: ``eu`` (azure-westeurope: c-weu-a) and ``global`` (the other regions), and
the migration service. The eu instance's reload of the drained clusters can be held back (a gate
in front of its handler, as a slow or busy leader would be): while it is, a drain's answer says
``placement_confirmed: false`` and names ``eu`` as the shard that did not confirm, and eu's book
still offers c-weu-a; once every live leader answered, the answer names both. A shard that once
had a leader and has none now is named as leaderless (it loads the drains when it leads again),
and a territory the global leader took over is confirmed by it.
"""

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest
from nats.aio.msg import Msg
from platform_helpers import Platform
from waiting import until

from loom.client import LoomClient
from loom.runtime.servers import NatsServer
from loom.store import fence
from loom_proto import subjects
from loom_services.placement.service import PlacementService

GROUPS = {"eu": ["azure-westeurope"]}
DRAINED = "c-weu-a"
"""The eu shard's only cluster."""
TTL_S = 2.0
"""The placement services' lease TTL (their default)."""


@pytest.fixture(scope="module")
def nats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with NatsServer(tmp_path_factory.mktemp("drain-shard-nats")) as server:
        yield server.url


@pytest.fixture(scope="module")
def eu_gate() -> Iterator[asyncio.Event]:
    """Open: the eu instances reload the drains (and answer) as they get the notice; closed: they
    wait in front of their handler until it opens again. The global shard is never held."""
    gate = asyncio.Event()
    gate.set()
    original = PlacementService.on_drains_changed

    async def gated(self: PlacementService, msg: Msg) -> None:
        if self.shard == "eu":
            await gate.wait()
        await original(self, msg)

    with pytest.MonkeyPatch.context() as patch:
        # On the class, before the services subscribe: each binds its handler when it starts.
        patch.setattr(PlacementService, "on_drains_changed", gated)
        yield gate
    gate.set()


@pytest.fixture(scope="module")
async def platform(
    nats_url: str,
    fresh_database: Callable[..., Awaitable[str]],
    tmp_path_factory: pytest.TempPathFactory,
    eu_gate: asyncio.Event,
) -> AsyncIterator[Platform]:
    p = Platform(nats_url, await fresh_database("drainshards"), tmp_path_factory.mktemp("agents"))
    for name in ("metrics", f"agent-{DRAINED}", "agent-c-sea1-a"):
        await p.start(name)
    yield p
    eu_gate.set()
    for name in list(p.tasks):
        with contextlib.suppress(Exception):
            await p.stop(name)


@pytest.fixture(scope="module")
async def shards(platform: Platform) -> dict[str, PlacementService]:
    platform.placement = {"region_groups": GROUPS}
    started = {"global": await platform.start("placement")}
    platform.placement = {"region_groups": GROUPS, "shard": "eu"}
    started["eu"] = await platform.start("placement-eu")
    platform.placement = {}
    # Ample time for every answer on a loaded machine (an answer comes as soon as all confirmed;
    # only the test that holds eu's back waits it out).
    platform.migration = {"notice_confirm_s": 5.0}
    await platform.start("migration")

    async def ready() -> bool:
        _, ctx = platform.tasks["metrics"]
        known = await ctx.db.fetchval(
            "SELECT count(DISTINCT cluster) FROM node_allocations WHERE cluster = ANY($1::text[])",
            [DRAINED, "c-sea1-a"],
        )
        return known == 2 and all(s.leadership.is_leader and s._loaded.is_set() for s in started.values())

    await until(ready, 20, "both shards leading and both clusters known")
    return started


@pytest.fixture
async def client(platform: Platform) -> AsyncIterator[LoomClient]:
    c = await LoomClient.connect(platform.nats_url)
    yield c
    await c.close()


async def _ask(client: LoomClient, request: dict[str, Any]) -> dict[str, Any]:
    reply = await client.nc.request(subjects.MIGRATE_DRAIN, json.dumps(request).encode(), timeout=10)
    answer: dict[str, Any] = json.loads(reply.data)
    return answer


async def test_a_drain_and_an_undrain_are_confirmed_by_both_shards_and_a_leaderless_one_is_named(
    platform: Platform, shards: dict[str, PlacementService], client: LoomClient
) -> None:
    g, eu = shards["global"], shards["eu"]
    # A shard that led once and has no leader now (its lease is nobody's): named, not waited for.
    _, ctx = platform.tasks["metrics"]
    assert await fence.claim(ctx.db, "retired", 1, "an instance long gone")

    drained = await _ask(client, {"op": "drain", "cluster": DRAINED})
    assert drained["ok"] is True, drained
    assert drained["placement_confirmed"] is True
    assert drained["shards"]["confirmed"] == ["eu", "global"]
    assert drained["shards"]["unconfirmed"] == []
    assert drained["shards"]["leaderless"] == ["retired"]
    assert drained["shards"]["by"] == {"eu": "placement-eu (eu)", "global": "placement (global)"}
    # Confirmed means reloaded: both books have it closed when the answer comes.
    assert DRAINED in eu.book.closed and DRAINED in g.book.closed

    undrained = await _ask(client, {"op": "undrain", "cluster": DRAINED})
    assert undrained["ok"] is True and undrained["was_drained"] is True
    assert undrained["placement_confirmed"] is True
    assert undrained["shards"]["confirmed"] == ["eu", "global"]
    assert DRAINED not in eu.book.closed and DRAINED not in g.book.closed


async def test_with_one_shards_answer_withheld_the_drain_is_not_confirmed_and_names_it(
    shards: dict[str, PlacementService], client: LoomClient, eu_gate: asyncio.Event
) -> None:
    g, eu = shards["global"], shards["eu"]
    eu_gate.clear()  # eu's leader does not get to reload (nor answer) until the gate opens
    try:
        drained = await _ask(client, {"op": "drain", "cluster": DRAINED})
        assert drained["ok"] is True, drained
        assert drained["placement_confirmed"] is False
        assert drained["shards"]["confirmed"] == ["global"]
        assert drained["shards"]["unconfirmed"] == ["eu"]
        # Truthful: the shard that holds c-weu-a has not closed it yet.
        assert DRAINED not in eu.book.closed
        assert DRAINED in g.book.closed
    finally:
        eu_gate.set()

    async def eu_closed() -> bool:
        return DRAINED in eu.book.closed

    await until(eu_closed, 10, "the eu shard to reload the drains once let through")
    undrained = await _ask(client, {"op": "undrain", "cluster": DRAINED})
    assert undrained["placement_confirmed"] is True
    assert undrained["shards"]["confirmed"] == ["eu", "global"]
    assert DRAINED not in eu.book.closed


async def test_a_territory_taken_over_by_the_global_leader_is_confirmed_by_it(
    platform: Platform, shards: dict[str, PlacementService], client: LoomClient
) -> None:
    g = shards["global"]
    # A graceful stop: eu's lease is released. Under a loaded CI run it once took over 15 s (alone: < 1 s).
    await platform.stop("placement-eu", timeout_s=60.0)

    async def global_holds_eu() -> bool:
        return "eu" in g.held

    await until(global_holds_eu, 3 * TTL_S + 5.0, "the global shard to take c-weu-a over")
    drained = await _ask(client, {"op": "drain", "cluster": DRAINED})
    assert drained["placement_confirmed"] is True
    assert drained["shards"]["confirmed"] == ["eu", "global"]
    assert drained["shards"]["by"]["eu"] == "placement (global)"
    assert DRAINED in g.book.closed
    undrained = await _ask(client, {"op": "undrain", "cluster": DRAINED})
    assert undrained["placement_confirmed"] is True
    assert DRAINED not in g.book.closed
