"""Placement shards by region group on real NATS and PostgreSQL (the small topology).

A regional shard ``eu`` (azure-westeurope: cluster c-weu-a, the only P100s) and the global shard
(c-use2-a, c-sea1-a). Jobs allowed in westeurope only go to ``eu``; the rest go to ``global``,
which never places on c-weu-a while ``eu`` leads. When ``eu``'s process dies, the global shard
takes c-weu-a over through ``eu``'s lease and fence within about a lease TTL, and hands it back
to the next ``eu`` instance, which then follows the runs the global shard placed there; meanwhile
the global shard also places ``eu``'s jobs (it reads ``eu``'s consumers while it holds c-weu-a).
"""

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest
from platform_helpers import Platform
from waiting import until

from loom.client import LoomClient
from loom.runtime.servers import NatsServer
from loom.store import fence
from loom_proto.jobs import Affinity, JobSpec, Resources, Work
from loom_services.placement.service import PlacementService

GROUPS = {"eu": ["azure-westeurope"]}
EU_CLUSTERS = {"c-weu-a"}
GLOBAL_CLUSTERS = {"c-use2-a", "c-sea1-a"}
TTL_S = 2.0
"""The placement services' lease TTL (their default)."""


@pytest.fixture(scope="module")
def nats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A NATS of this module's own: durable consumers start from a clean stream."""
    with NatsServer(tmp_path_factory.mktemp("shard-nats")) as server:
        yield server.url


@pytest.fixture(scope="module")
async def platform(
    nats_url: str,
    fresh_database: Callable[..., Awaitable[str]],
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[Platform]:
    p = Platform(nats_url, await fresh_database("shards"), tmp_path_factory.mktemp("agents"))
    for name in ("metrics", "agent-c-use2-a", "agent-c-weu-a", "agent-c-sea1-a"):
        await p.start(name)
    yield p
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

    async def both_lead() -> bool:
        return all(s.leadership.is_leader for s in started.values())

    await until(both_lead, 20, "both shards to lead")
    return started


@pytest.fixture
async def client(platform: Platform) -> AsyncIterator[LoomClient]:
    c = await LoomClient.connect(platform.nats_url)
    yield c
    await c.close()


def spec(job_id: str, *, steps: int = 100_000, step_time_s: float = 86_400.0, **kwargs: Any) -> JobSpec:
    models = kwargs.pop("gpu_models", [])
    return JobSpec(
        job_id=job_id,
        tenant="t1",
        resources=Resources(gpus=1, gpu_models=models),
        work=Work(steps=steps, step_time_s=step_time_s),
        affinity=Affinity(**kwargs),
    )


async def placed(client: LoomClient, ids: list[str]) -> dict[str, str] | None:
    clusters = {}
    for job_id in ids:
        job = await client.job(job_id)
        if not job or job["state"] not in ("placed", "running"):
            return None
        clusters[job_id] = job["cluster"]
    return clusters


def clusters_of_book(service: PlacementService) -> set[str]:
    return {cap.cluster for cap in service.book.nodes.values()}


def clusters_of_runs(service: PlacementService) -> set[str]:
    return {cluster for run in service.book.runs.values() for cluster, _, _ in run.parts}


async def test_two_shards_never_place_on_the_same_cluster(
    shards: dict[str, PlacementService], client: LoomClient
) -> None:
    eu_ids = [f"eu-{i}" for i in range(6)]
    global_ids = [f"anywhere-{i}" for i in range(6)]
    for job_id in eu_ids:
        await client.submit(spec(job_id, regions=["azure-westeurope"], gpu_models=["T4"]))  # P100s stay free
    for job_id in global_ids:
        # Allowed everywhere and preferring westeurope: the global shard still keeps off c-weu-a.
        await client.submit(spec(job_id, prefer_regions=["azure-westeurope"]))
    where = await until(lambda: placed(client, eu_ids + global_ids), 30, "all twelve jobs placed")

    assert {where[j] for j in eu_ids} == EU_CLUSTERS
    assert {where[j] for j in global_ids} <= GLOBAL_CLUSTERS
    g, eu = shards["global"], shards["eu"]
    assert clusters_of_book(eu) == EU_CLUSTERS
    assert clusters_of_book(g) == GLOBAL_CLUSTERS
    assert set(eu.book.runs) == set(eu_ids)
    assert set(global_ids) <= set(g.book.runs) and not set(eu_ids) & set(g.book.runs)
    assert clusters_of_runs(eu).isdisjoint(clusters_of_runs(g))
    assert g.held.keys() == {"global"} and eu.held.keys() == {"eu"}
    assert eu.stats["shard"]["routed_elsewhere"] >= len(global_ids)
    assert g.stats["shard"]["routed_elsewhere"] >= len(eu_ids)
    # Each shard's lifecycle consumer acked the other's events (the agents' starts) unrecorded:
    # waited for, as the starts come after the placements the wait above saw (CI once looked first).

    async def both_saw_foreign() -> bool:
        return g.stats["shard"]["foreign_events"] > 0 and eu.stats["shard"]["foreign_events"] > 0

    await until(both_saw_foreign, 30, "each shard to ack the other's events")


async def test_a_dead_regional_shards_clusters_go_to_global_within_the_ttl_and_come_back(
    platform: Platform, shards: dict[str, PlacementService], client: LoomClient
) -> None:
    g = shards["global"]
    _, eu_ctx = platform.tasks["placement-eu"]
    loop = asyncio.get_running_loop()
    died_at = loop.time()
    await eu_ctx.nc.close()  # the process is cut off: no renewal, no release, no more writes

    async def global_holds_eu() -> bool:
        return "eu" in g.held

    await until(global_holds_eu, TTL_S + 3.0, "the global shard to take c-weu-a over")
    took_s = loop.time() - died_at
    print(f"c-weu-a taken over {took_s:.2f} s after the eu shard was cut off (lease TTL {TTL_S} s)")
    assert took_s < TTL_S + 3.0
    assert clusters_of_book(g) >= EU_CLUSTERS
    assert {"eu-0", "eu-5"} <= set(g.book.runs), "the runs on c-weu-a came with it"
    token = g.held["eu"]
    assert await platform_fence(platform, "eu") == token

    # Only c-weu-a has P100s: a job allowed everywhere can now be placed there by the global shard,
    # and runs long enough (about 10 s of wall time) to end after the hand-back.
    await client.submit(spec("p100-job", steps=200, step_time_s=100.0, gpu_models=["P100"]))
    # And eu's own jobs keep being placed: the global shard reads eu's consumer while it holds c-weu-a.
    await client.submit(spec("eu-late", regions=["azure-westeurope"], gpu_models=["T4"]))
    where = await until(lambda: placed(client, ["p100-job", "eu-late"]), 20, "p100-job and eu-late placed")
    assert where == {"p100-job": "c-weu-a", "eu-late": "c-weu-a"}
    assert {"p100-job", "eu-late"} <= set(g.book.runs)

    # A new eu instance announces itself: the global shard hands c-weu-a back at once.
    platform.placement = {"region_groups": GROUPS, "shard": "eu"}
    eu2: PlacementService = await platform.start("placement-eu2")
    platform.placement = {}

    async def handed_back() -> bool:
        # Leading, and its state rebuilt from the store (the runs on c-weu-a are among it).
        return eu2.leadership.is_leader and "eu" not in g.held and "eu-0" in eu2.book.runs

    await until(handed_back, 15, "c-weu-a back with the eu shard")
    # (The cut-off instance may still be winding down its consumers: its fence is what stops it.)
    assert clusters_of_book(g) == GLOBAL_CLUSTERS and clusters_of_book(eu2) == EU_CLUSTERS
    assert not {"p100-job", "eu-late"} & set(g.book.runs)
    assert {"p100-job", "eu-late", "eu-0"} <= set(eu2.book.runs), "the new leader follows every run there"
    assert await platform_fence(platform, "eu") == eu2.leadership.token

    # The global shard's run ends on c-weu-a: the eu shard, which holds the cluster now, records it.
    done = await until(_state(client, "p100-job", "completed"), 40, "p100-job completed")
    assert done["cluster"] == "c-weu-a"
    assert "p100-job" not in eu2.book.runs


async def platform_fence(platform: Platform, shard: str) -> int:
    _, ctx = platform.tasks["metrics"]
    async with ctx.db.acquire() as conn:
        token: int = await conn.fetchval("SELECT token FROM fences WHERE shard = $1", shard)
    return token


def _state(client: LoomClient, job_id: str, wanted: str) -> Callable[[], Awaitable[Any]]:
    async def check() -> Any:
        job = await client.job(job_id)
        return job if job and job["state"] == wanted else None

    return check


async def test_a_territory_whose_fence_moves_on_is_given_up_before_anything_is_written_for_it(
    platform: Platform, shards: dict[str, PlacementService], client: LoomClient
) -> None:
    g = shards["global"]
    await platform.stop("placement-eu2")  # a graceful stop: eu's lease is released, global takes over

    async def global_holds_eu() -> bool:
        return "eu" in g.held

    await until(global_holds_eu, 3 * TTL_S + 5.0, "the global shard to take c-weu-a over again")
    # A newer eu leader claims the fence behind the global shard's back (as after a long pause of
    # the global leader): its next transaction must be refused and the territory given up.
    _, ctx = platform.tasks["metrics"]
    newer = g.held["eu"] + 1000
    assert await fence.claim(ctx.db, "eu", newer, "someone-newer")
    fenced_before = g.stats.get("fenced", 0)
    await client.submit(spec("after-fence", gpu_models=["P100"]))

    async def given_up() -> bool:
        return "eu" not in g.held

    await until(given_up, 15, "the global shard to give c-weu-a up")
    assert g.stats.get("fenced", 0) > fenced_before
    assert clusters_of_book(g) == GLOBAL_CLUSTERS
    assert await platform_fence(platform, "eu") == newer, "the newer claim stands"
    # Nothing of the refused transaction (which placed the job on c-weu-a, the only P100s) was
    # written: redelivered, the job is admitted again and waits, as c-weu-a is not the global
    # shard's any more.
    job = await until(_state(client, "after-fence", "queued"), 15, "after-fence admitted")
    waiting = await until(lambda: _has_decision(client, "after-fence"), 15, "a decision for after-fence")
    assert waiting["outcome"] == "waiting" and "c-weu-a" not in waiting["record"]["pruned"]
    job = await client.job("after-fence")
    assert job is not None and job["state"] == "queued" and job["cluster"] is None
    assert [e["kind"] for e in job["events"]] == ["submitted"]
    assert "eu" not in g.held, "the global shard cannot claim eu's fence again with an older token"


async def _has_decision(client: LoomClient, job_id: str) -> Any:
    decisions = (await client.explain(job_id))["decisions"]
    return decisions[-1] if decisions else None
