"""Checkpoint replicas on real NATS and PostgreSQL: the migration service copies a running job's
latest checkpoint to another cluster (full, then incremental), and when the job's cluster fails
the job resumes from the replica's step on the other cluster, not from step 0, its history
saying so.

Metrics, placement, the migration service and two agents run in this process
(tests/platform_helpers.py); the cluster is failed as in test_failover.py: its agent stopped and
the link states network perception would publish for its region turned stale.
"""

import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import asyncpg
import pytest
from platform_helpers import Platform
from waiting import until

from loom.client import LoomClient
from loom_proto import subjects
from loom_proto.codec import encode
from loom_proto.jobs import JobSpec, Resources, Work
from loom_proto.net import LinkState

pytestmark = pytest.mark.slow

DEAD, ALIVE = "c-weu-a", "c-sea1-a"
DEAD_REGION, ALIVE_REGION = "azure-westeurope", "gcp-asia-southeast1"
JOB = "rep-1"
CHECKPOINT_BYTES = 4_000_000_000


@pytest.fixture(scope="module")
def nats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from loom.runtime.servers import NatsServer

    with NatsServer(tmp_path_factory.mktemp("replicas-nats")) as server:
        yield server.url


@pytest.fixture
async def platform(
    nats_url: str, fresh_database: Callable[..., Awaitable[str]], tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Platform]:
    p = Platform(nats_url, await fresh_database("replicas"), tmp_path_factory.mktemp("agents"))
    p.placement = {"failover_ttl_s": 4.0, "failover_period_s": 0.2}
    yield p
    for name in list(p.tasks):
        await p.stop(name)


async def _publish_links(client: LoomClient, *, dead_reachable: bool) -> None:
    """The two regions' links, 10 Gbps and 150 ms; the dead region's stale once it is failed."""
    for src, dst in ((DEAD_REGION, ALIVE_REGION), (ALIVE_REGION, DEAD_REGION)):
        state = LinkState(
            src=src,
            dst=dst,
            rtt_ms_p50=150.0,
            rtt_ms_p95=160.0,
            rtt_ms_p99=170.0,
            jitter_ms=1.0,
            loss_rate=0.0,
            bandwidth_gbps=10.0,
            cost=100.0,
            stale=not dead_reachable,
            updated_at=time.time(),
        )
        await client.nc.publish(subjects.link_state(src, dst), encode(state))
    await client.nc.flush()


async def test_a_failed_cluster_s_job_resumes_from_its_replica_in_another_cluster(platform: Platform) -> None:
    await platform.start("metrics")
    await platform.start("placement")
    await platform.start("migration")
    await platform.start(f"agent-{DEAD}")
    client = await LoomClient.connect(platform.nats_url)
    db = await asyncpg.connect(platform.database_url)
    try:
        await _publish_links(client, dead_reachable=True)
        # 100 steps of 0.1 s wall (200 s at 2000x), a checkpoint every 10 steps (1 s wall).
        await client.submit(
            JobSpec(
                job_id=JOB,
                tenant="t1",
                resources=Resources(gpus=1, gpu_models=["T4"]),
                work=Work(steps=100, step_time_s=200.0, checkpoint_every_steps=10),
                labels={"checkpoint_bytes": str(CHECKPOINT_BYTES), "checkpoint_changed_fraction": "0.1"},
            )
        )

        async def running_at(cluster: str, attempt: int) -> dict[str, Any] | None:
            job = await client.job(JOB)
            ok = job and job["state"] == "running" and job["cluster"] == cluster and job["attempt"] == attempt
            return job if ok else None

        await until(lambda: running_at(DEAD, 1), 20, "the job running on c-weu-a")
        await platform.start(f"agent-{ALIVE}")
        await _publish_links(client, dead_reachable=True)

        async def incremental_replica() -> list[asyncpg.Record] | None:
            rows = await db.fetch("SELECT * FROM checkpoint_replicas WHERE job_id = $1 ORDER BY step", JOB)
            ready_delta = [r for r in rows if r["state"] == "ready" and not r["full_copy"]]
            return rows if ready_delta else None

        rows = await until(incremental_replica, 20, "a ready incremental replica of the job")
        first = rows[0]
        assert first["full_copy"] and first["cluster"] == ALIVE and first["source_cluster"] == DEAD
        assert first["transfer_bytes"] == CHECKPOINT_BYTES == first["stored_bytes"]
        delta = next(r for r in rows if not r["full_copy"])
        # One interval's 10 % of the checkpoint per interval since the replica it builds on.
        intervals = (delta["step"] - delta["base_step"]) / 10
        assert delta["transfer_bytes"] == round(CHECKPOINT_BYTES * 0.1 * intervals)
        assert delta["cluster"] == ALIVE and delta["base_step"] < delta["step"]
        assert 0.15 < delta["transfer_s"] < first["transfer_s"]  # 150 ms RTT + the bytes at 10 Gbps

        # The failure: c-weu-a's heartbeats end and its region's probes go stale.
        await platform.stop(f"agent-{DEAD}")
        await _publish_links(client, dead_reachable=False)
        moved = await until(lambda: running_at(ALIVE, 2), 30, "the job re-placed on c-sea1-a")

        requeued = [e["event"] for e in moved["events"] if e["kind"] == "requeued"]
        assert len(requeued) == 1 and requeued[0]["cause"] == "cluster_lost"
        found = re.search(r"resumes from replica in c-sea1-a at step (\d+)", requeued[0]["reason"])
        assert found, requeued[0]["reason"]
        step = int(found.group(1))
        ready = await db.fetch(
            """SELECT step FROM checkpoint_replicas WHERE job_id = $1 AND attempt = 1
               AND state IN ('ready', 'superseded')""",
            JOB,
        )
        assert step >= 20 and step == max(r["step"] for r in ready)
        assert (
            f"step {step}" in requeued[0]["reason"] and "cluster c-weu-a unreachable" in requeued[0]["reason"]
        )
        # The original of that step lay on the failed cluster.
        assert (
            await db.fetchval(
                "SELECT cluster FROM checkpoints WHERE job_id = $1 AND attempt = 1 AND step = $2", JOB, step
            )
            == DEAD
        )
        assert await db.fetchval("SELECT resume_step FROM jobs WHERE job_id = $1", JOB) == step
        # `loom job` shows the replicas with the job.
        assert any(r["cluster"] == ALIVE and r["step"] == step for r in moved["replicas"])
    finally:
        await db.close()
        await client.close()
