"""rare_room on the real stack: a job is stopped off the only node a rare-shaped job fits and runs
again elsewhere, through placement, the agents, NATS and PostgreSQL.

The small topology's c-use2-a has one V100M32 node of 8 GPUs and 768 GiB (the only node a worker of
700 GiB fits) and four G2 nodes of 8 GPUs and 384 GiB."""

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest
from platform_helpers import Platform
from waiting import until

from loom.client import LoomClient
from loom.runtime.servers import NatsServer
from loom.sched.framework import DecisionRecord
from loom_proto.jobs import Affinity, JobSpec, Resources, Work
from tests.integration.test_placement_engine import events_of, in_state


@pytest.fixture(scope="module")
def nats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with NatsServer(tmp_path_factory.mktemp("rare-room-nats")) as server:
        yield server.url


@pytest.fixture(scope="module")
async def platform(
    nats_url: str,
    fresh_database: Callable[..., Awaitable[str]],
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[Platform]:
    p = Platform(nats_url, await fresh_database("rareroom"), tmp_path_factory.mktemp("rare-room-agents"))
    for name in ("metrics", "placement", "agent-c-use2-a"):
        await p.start(name)
    yield p
    for name in list(p.tasks):
        await p.stop(name)


@pytest.fixture
async def client(platform: Platform) -> AsyncIterator[LoomClient]:
    c = await LoomClient.connect(platform.nats_url)
    yield c
    await c.close()


def _async(check: Callable[[], bool]) -> Callable[[], Awaitable[bool]]:
    async def wrapped() -> bool:
        return check()

    return wrapped


async def test_a_job_with_room_elsewhere_is_stopped_for_a_worker_only_its_node_holds(
    client: LoomClient, platform: Platform
) -> None:
    placement = platform.services["placement"]

    def joined() -> bool:
        # A job asking for a cluster placement does not know yet is rejected (once its book has
        # settled): wait until placement itself holds the agent's six nodes.
        return sum(1 for cap in placement.book.nodes.values() if cap.cluster == "c-use2-a") == 6

    await until(_async(joined), 30, "placement to know c-use2-a's six nodes")
    use2 = Affinity(clusters=["c-use2-a"])
    long = Work(steps=1_000_000, step_time_s=10.0, checkpoint_every_steps=100)
    # The four G2 nodes busy for ~2,400,000 s: "anywhere" then takes the V100M32 node.
    for i in range(4):
        g2 = Resources(gpus=8, cpu_milli=4000, gpu_models=["G2"])
        await client.submit(JobSpec(job_id=f"fill-{i}", tenant="t1", resources=g2, affinity=use2, work=long))
    for i in range(4):
        await until(in_state(client, f"fill-{i}", "running"), 30, f"fill-{i} running")
    eight = Resources(gpus=8, cpu_milli=4000)
    # ~1,000,000 s on a V100M32 against ~240,000 s on a G2, which frees in ~2,400,000 s: it starts now.
    shorter = Work(steps=100_000, step_time_s=10.0, checkpoint_every_steps=100)
    await client.submit(JobSpec(job_id="anywhere", tenant="t1", resources=eight, affinity=use2, work=shorter))
    first = await until(in_state(client, "anywhere", "running"), 30, "anywhere running")
    assert events_of(first, "placed")[0]["gpu_model"] == "V100M32"
    # One G2 node frees; then a 700-GiB worker arrives: only the V100M32 node could ever hold it.
    await client.cancel("fill-0")
    await until(in_state(client, "fill-0", "cancelled"), 30, "fill-0 cancelled")
    rare = Resources(gpus=8, cpu_milli=8000, memory_mib=700 * 1024)
    await client.submit(
        JobSpec(
            job_id="rare", tenant="t1", resources=rare, affinity=use2, work=Work(steps=50, step_time_s=5.0)
        )
    )
    got = await until(in_state(client, "rare", "running", "completed"), 30, "rare placed")
    assert events_of(got, "placed")[0]["gpu_model"] == "V100M32"

    async def moved() -> Any:
        job = await client.job("anywhere")
        placed = events_of(job, "placed") if job else []
        return job if job and len(placed) >= 2 and job["state"] in ("placed", "running") else None

    job = await until(moved, 30, "anywhere placed again")
    requeued = events_of(job, "requeued")
    assert len(requeued) == 1 and requeued[0]["cause"] == "preempted"
    assert requeued[0]["reason"].startswith(
        "stopped to make room for rare, whose worker only its node holds, as it has room elsewhere now;"
    ), requeued[0]["reason"]
    assert events_of(job, "placed")[1]["gpu_model"] == "G2"
    explained = await client.explain("rare")
    notes = DecisionRecord.from_dict(explained["decisions"][0]["record"]).notes
    assert any("rare_room: made room by stopping anywhere" in n for n in notes), notes
