"""Failover on real NATS and PostgreSQL: a cluster whose heartbeats stop and whose region the
probes cannot reach is failed; its runs are re-placed elsewhere (next attempt, from their last
checkpoint), their GPUs released; when it returns its old runs are stopped and never counted.

Metrics, placement and two agents run in this process (tests/platform_helpers.py). The agents
heartbeat at most every second, so metrics marks a silent cluster stale within about 4 s.
Network perception is not run: the test publishes the link states it would (every link of the
dead cluster's region stale, the others live).
"""

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import asyncpg
import pytest
from nats.errors import NoRespondersError
from platform_helpers import Platform
from waiting import until

from loom.client import LoomClient
from loom_proto import subjects
from loom_proto.codec import encode
from loom_proto.jobs import JobSpec, Resources, Work
from loom_proto.net import LinkState
from loom_services.cluster_agent.agent import Agent

DEAD, ALIVE = "c-weu-a", "c-sea1-a"
DEAD_REGION, ALIVE_REGION, OTHER_REGION = "azure-westeurope", "gcp-asia-southeast1", "aws-us-east-2"
JOBS = [f"fo-{i}" for i in range(3)]


@pytest.fixture
def nats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # One per test: a fresh database's metrics numbers its view deltas from 1 again, and the
    # stream would drop them as duplicates of the previous test's.
    from loom.runtime.servers import NatsServer

    with NatsServer(tmp_path_factory.mktemp("failover-nats")) as server:
        yield server.url


@pytest.fixture
async def platform(
    nats_url: str, fresh_database: Callable[..., Awaitable[str]], tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Platform]:
    p = Platform(nats_url, await fresh_database("failover"), tmp_path_factory.mktemp("agents"))
    p.placement = {"failover_ttl_s": 4.0, "failover_period_s": 0.2}
    yield p
    for name in list(p.tasks):
        await p.stop(name)


def _link(src: str, dst: str, *, stale: bool) -> LinkState:
    return LinkState(
        src=src,
        dst=dst,
        rtt_ms_p50=100.0,
        rtt_ms_p95=110.0,
        rtt_ms_p99=120.0,
        jitter_ms=1.0,
        loss_rate=0.0,
        cost=100.0,
        stale=stale,
        updated_at=time.time(),
    )


async def _publish_links(client: LoomClient, *, dead_reachable: bool) -> None:
    """What network perception would publish: the dead region's links (un)reachable, others live."""
    regions = [DEAD_REGION, ALIVE_REGION, OTHER_REGION]
    for src in regions:
        for dst in regions:
            if src == dst:
                continue
            stale = DEAD_REGION in (src, dst) and not dead_reachable
            await client.nc.publish(subjects.link_state(src, dst), encode(_link(src, dst, stale=stale)))
    await client.nc.flush()


async def _placement_stats(client: LoomClient) -> dict[str, Any]:
    reply = await client.nc.request("loom.health.placement", b"", timeout=2)
    stats: dict[str, Any] = json.loads(reply.data)
    return stats


async def test_a_failed_cluster_s_runs_are_placed_again_elsewhere_and_its_old_runs_fenced(
    platform: Platform,
) -> None:
    await platform.start("metrics")
    await platform.start("placement")
    await platform.start("migration")  # keeps the checkpoint replicas a failover resumes from
    await platform.start(f"agent-{DEAD}")
    client = await LoomClient.connect(platform.nats_url)
    db = await asyncpg.connect(platform.database_url)
    try:
        await _publish_links(client, dead_reachable=True)
        # Only c-weu-a is up: the T4 jobs land there. 100 steps of 0.1 s (200 s at 2000x) each,
        # a checkpoint every 10 steps.
        for job_id in JOBS:
            await client.submit(
                JobSpec(
                    job_id=job_id,
                    tenant="t1",
                    resources=Resources(gpus=1, gpu_models=["T4"]),
                    work=Work(steps=100, step_time_s=200.0, checkpoint_every_steps=10),
                )
            )

        async def all_running_at(cluster: str, attempt: int) -> list[dict[str, Any]] | None:
            jobs = [await client.job(j) for j in JOBS]
            ok = all(
                j and j["state"] == "running" and j["cluster"] == cluster and j["attempt"] == attempt
                for j in jobs
            )
            return jobs if ok else None  # type: ignore[return-value]

        await until(lambda: all_running_at(DEAD, 1), 20, "the jobs running on c-weu-a")
        await platform.start(f"agent-{ALIVE}")

        async def progressed() -> bool:
            jobs = [await client.job(j) for j in JOBS]
            return all(j and j["progress"] >= 0.15 for j in jobs)

        await until(progressed, 20, "some progress (a checkpoint passed) on c-weu-a")

        async def replicated() -> bool:
            held = await db.fetchval(
                """SELECT count(DISTINCT job_id) FROM checkpoint_replicas
                   WHERE job_id = ANY($1::text[]) AND cluster = $2 AND state = 'ready'""",
                JOBS,
                ALIVE,
            )
            return bool(held == len(JOBS))

        # A failed cluster's checkpoints go with it: the jobs resume from their replicas.
        await until(replicated, 20, "a checkpoint replica of every job on c-sea1-a")

        # The kill: c-weu-a's heartbeats end and its region's probes go stale.
        await platform.stop(f"agent-{DEAD}")
        killed = time.time()
        await _publish_links(client, dead_reachable=False)

        moved = await until(lambda: all_running_at(ALIVE, 2), 30, "the jobs re-placed on c-sea1-a")
        all_replaced_s = time.time() - killed
        stats = await _placement_stats(client)
        failed = stats["failover"]["failed"][DEAD]
        detected_s = failed["at"] - killed
        print(f"\nfailover: detection {detected_s:.2f} s, all {len(JOBS)} re-placed", end="")
        print(f" {all_replaced_s:.2f} s after the kill")
        assert "probes cannot reach region azure-westeurope" in failed["reason"]
        assert stats["failover"]["requeued"] == len(JOBS)

        # GPUs on the dead cluster released; each job holds exactly one live reservation set.
        reserved = await db.fetchval(
            "SELECT COALESCE(sum(gpus_reserved), 0) FROM node_allocations WHERE cluster = $1", DEAD
        )
        assert reserved == 0
        live = await db.fetch(
            """SELECT job_id, attempt, cluster FROM reservations
               WHERE job_id = ANY($1::text[]) AND state <> 'released'""",
            JOBS,
        )
        assert sorted((r["job_id"], r["attempt"], r["cluster"]) for r in live) == [
            (j, 2, ALIVE) for j in JOBS
        ]
        resumed = _requeued_once(moved)

        # A second detection pass does nothing more (the failed cluster stays failed meanwhile).
        await asyncio.sleep(1.0)
        assert (await _placement_stats(client))["failover"]["requeued"] == len(JOBS)

        await _placement_restarted(platform, client)

        # The old agent returns with its journal: it resumes its attempt-1 runs, then its durable
        # command consumer delivers the stops placement sent for them.
        returned: Agent = await platform.start(f"agent-{DEAD}")

        async def old_runs_stopped() -> bool:
            old = [f"{j}:1" for j in JOBS]
            return all(k in returned.finished and k not in returned.running for k in old)

        await until(old_runs_stopped, 15, "the returned agent's old runs stopped")
        assert not any(key.endswith(":2") for key in returned.running), "no new attempt runs there"

        await _completed_once(client, db, resumed)
    finally:
        await db.close()
        await client.close()


async def _completed_once(client: LoomClient, db: asyncpg.Connection, resumed: dict[str, int]) -> None:
    """Every job completes once, by attempt 2 on c-sea1-a, having resumed past its checkpoint."""

    async def completed() -> list[dict[str, Any]] | None:
        jobs = [await client.job(j) for j in JOBS]
        return jobs if all(j and j["state"] == "completed" for j in jobs) else None  # type: ignore[return-value]

    done = await until(completed, 30, "the jobs completed on c-sea1-a")
    for job in done:
        assert job["attempt"] == 2 and job["cluster"] == ALIVE
        kinds = [(e["kind"], e["event"].get("attempt")) for e in job["events"]]
        assert kinds.count(("completed", 2)) == 1
        assert ("completed", 1) not in kinds, "the old attempt never completes the job"
        # Attempt 2 ran from its checkpoint, not from step 0.
        steps = [
            e["event"]["step"]
            for e in job["events"]
            if e["kind"] == "progress" and e["event"]["attempt"] == 2
        ]
        assert steps and min(steps) > resumed[job["job_id"]]
    reserved = await db.fetchval("SELECT COALESCE(sum(gpus_reserved), 0) FROM node_allocations")
    assert reserved == 0


def _requeued_once(moved: list[dict[str, Any]]) -> dict[str, int]:
    """Each job was requeued once for its lost cluster, to resume from a checkpoint: job -> step."""
    resumed: dict[str, int] = {}
    for job in moved:
        requeued = [e["event"] for e in job["events"] if e["kind"] == "requeued"]
        assert len(requeued) == 1 and requeued[0]["cause"] == "cluster_lost"
        assert requeued[0]["attempt"] == 2
        # The agent reported checkpoints (every 10 steps; 15 % of 100 steps had passed); those on
        # the failed cluster are gone, their replicas on c-sea1-a are read.
        found = re.search(r"resumes from replica in c-sea1-a at step (\d+)", requeued[0]["reason"])
        assert found, requeued[0]["reason"]
        checkpoints = [
            e["event"]["step"]
            for e in job["events"]
            if e["kind"] == "checkpointed" and e["event"]["attempt"] == 1
        ]
        resumed[job["job_id"]] = int(found.group(1))
        # At most one checkpoint interval behind the latest checkpoint (a copy may be in flight).
        assert resumed[job["job_id"]] >= 10 and resumed[job["job_id"]] >= max(checkpoints) - 10
    return resumed


async def _placement_restarted(platform: Platform, client: LoomClient) -> None:
    """A restarted placement knows the cluster failed (from the ledger) and re-queues nothing more."""
    await platform.stop("placement")
    await platform.start("placement")
    await _publish_links(client, dead_reachable=False)

    async def failed_again() -> dict[str, Any] | None:
        stats = await _placement_stats(client)
        return stats if DEAD in stats.get("failover", {}).get("failed", {}) else None

    # Right after the start its health subscription may not have reached the server yet.
    restarted = await until(
        failed_again, 15, "the restarted placement to know c-weu-a failed", retry_on=(NoRespondersError,)
    )
    await asyncio.sleep(1.0)
    assert (await _placement_stats(client))["failover"]["requeued"] == 0
    for job_id in JOBS:
        job = await client.job(job_id)
        assert job and [e["kind"] for e in job["events"]].count("requeued") == 1
        assert job["attempt"] == 2 and job["state"] == "running"
    # Failed by both signals, or by heartbeat loss past 2 x TTL if it classified before the links came.
    reason = restarted["failover"]["failed"][DEAD]["reason"]
    assert "probes cannot reach" in reason or "2 x TTL" in reason, reason


async def test_a_new_leader_keeps_a_cluster_its_predecessor_failed_closed_until_it_returns(
    platform: Platform,
) -> None:
    """A takeover or restart right after a failover: the new leader has not seen the failure
    itself (its pings need a few periods, and here neither the view nor the probes will tell it:
    metrics is stopped, the probes get through again), yet places nothing there."""
    await platform.start("metrics")
    await platform.start("placement")
    await platform.start(f"agent-{DEAD}")
    await platform.start(f"agent-{ALIVE}")
    client = await LoomClient.connect(platform.nats_url)
    db = await asyncpg.connect(platform.database_url)
    try:
        await _publish_links(client, dead_reachable=True)

        async def both_known() -> bool:
            n = await db.fetchval(
                """SELECT count(DISTINCT cluster) FROM node_allocations
                   WHERE schedulable AND cluster = ANY($1::text[])""",
                [DEAD, ALIVE],
            )
            return bool(n == 2)

        await until(both_known, 20, "both clusters' nodes known")
        await platform.stop("metrics")  # the view will not say the dead cluster is stale
        await platform.stop(f"agent-{DEAD}")
        await _publish_links(client, dead_reachable=False)

        async def classified() -> bool:
            return DEAD in (await _placement_stats(client))["failover"]["failed"]

        await until(classified, 15, "the leader to classify c-weu-a failed (agent gone, probes lost)")
        recorded = await until(
            lambda: db.fetchrow("SELECT * FROM failed_clusters WHERE cluster = $1", DEAD), 5, "its record"
        )
        assert "probes cannot reach region azure-westeurope" in recorded["reason"]

        # The probes get through again (the link states are kept on the bus: a new leader reads
        # them), so the new leader alone would find the cluster only suspect, never failed.
        await _publish_links(client, dead_reachable=True)
        await platform.stop("placement")
        await platform.start("placement")
        # A job only the dead cluster's GPUs fit (P100s): only the record keeps it from going there.
        await client.submit(
            JobSpec(
                job_id="after-takeover",
                tenant="t1",
                resources=Resources(gpus=1, gpu_models=["P100"]),
                work=Work(steps=100, step_time_s=200.0, checkpoint_every_steps=10),
            )
        )
        decided = await until(
            lambda: db.fetchrow("SELECT outcome FROM decisions WHERE job_id = 'after-takeover'"),
            20,
            "the new leader's decision",
        )
        assert decided["outcome"] == "waiting"
        job = await client.job("after-takeover")
        assert job is not None and job["state"] == "queued"
        stats = await _placement_stats(client)
        assert "classified by the previous leader" in stats["failover"]["failed"][DEAD]["reason"]
        assert stats["failover"]["failed"][DEAD]["at"] == pytest.approx(recorded["failed_at"])

        # It returns: its agent answers the new leader's pings; the record goes, the job runs there.
        await platform.start(f"agent-{DEAD}")

        async def running() -> dict[str, Any] | None:
            job = await client.job("after-takeover")
            return job if job and job["state"] == "running" else None

        job = await until(running, 20, "the job running on the returned cluster")
        assert job["cluster"] == DEAD and job["attempt"] == 1

        async def forgotten() -> bool:
            return not await db.fetchval("SELECT count(*) FROM failed_clusters")

        await until(forgotten, 5, "the record of the failure gone")
    finally:
        await db.close()
        await client.close()
