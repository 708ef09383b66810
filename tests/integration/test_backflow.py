"""Backflow after a whole failed cluster returns, on real NATS and PostgreSQL (issue 15 items 2, 4).

c-use2-a (G2s, ten times a T4) runs three jobs; it fails (its agent stopped, its region's probes
lost: the link states network perception would publish), and they are re-placed on c-weu-a's T4s.
Then it returns: its agent comes back with its journal and stops its orphaned runs (never two live
runs of one job), the migration service sees it back from no schedulable GPUs (``cluster_joined``)
and the benefit rule decides, job by job, who flows back: the two long jobs (hours left on a T4,
a 1 GB checkpoint) move, one at a time (one migration per cluster in flight), the heavy one with a
50 TB checkpoint stays, with its numbers in ``loom explain``.

Metrics, placement, the migration service and two agents of the "small" topology run in this
process (tests/platform_helpers.py). The failover is judged as in test_failover.py (4 s TTL); the
migration rule's cool-down is shortened to 5 s (30 min by default): the cluster returns inside it,
so the jobs that just failed over first stay, held by their cool-down, and the review is done again
when it ends (before, a review's stays were final: with the default cool-down, nothing that had
failed over ever flowed back to a cluster that returned within 30 min).
"""

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import asyncpg
import pytest
from platform_helpers import Platform
from waiting import until

from loom.client import LoomClient
from loom.migrate import benefit
from loom_proto import subjects
from loom_proto.codec import encode
from loom_proto.jobs import JobSpec, Resources, Work
from loom_proto.net import LinkState
from loom_services.cluster_agent.agent import Agent

pytestmark = pytest.mark.slow

FAST, SLOW = "c-use2-a", "c-weu-a"
FAST_REGION, SLOW_REGION, OTHER_REGION = "aws-us-east-2", "azure-westeurope", "gcp-asia-southeast1"
LONG, HEAVY = ["back-long-0", "back-long-1"], "back-heavy"
JOBS = [*LONG, HEAVY]
COOLDOWN_S = 5.0
"""The migration rule's cool-down here (30 min by default): the cluster returns inside it."""


@pytest.fixture
def nats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from loom.runtime.servers import NatsServer

    with NatsServer(tmp_path_factory.mktemp("backflow-nats")) as server:
        yield server.url


@pytest.fixture
async def platform(
    nats_url: str, fresh_database: Callable[..., Awaitable[str]], tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Platform]:
    p = Platform(nats_url, await fresh_database("backflow"), tmp_path_factory.mktemp("agents"))
    p.time_scale = 50.0
    p.progress_every = 0.002  # a progress report every 80 steps: a move checkpoints where the run is
    p.placement = {"failover_ttl_s": 4.0, "failover_period_s": 0.2}
    p.migration = {
        "rule": benefit.MigrationSettings(cooldown_s=COOLDOWN_S),
        "clusters_every_s": 0.5,
        "per_cluster": 1,  # one backflow move in flight per cluster: the work flows back gradually
    }
    yield p
    await asyncio.gather(*(p.stop(name) for name in list(p.tasks)))


def _job(job_id: str, *, steps: int, every: int, checkpoint_gb: int) -> JobSpec:
    # 1 s of reference compute a step (7.8 s predicted on a T4 at a new cluster's trust, a tenth
    # of that on a G2).
    return JobSpec(
        job_id=job_id,
        tenant="t1",
        labels={"checkpoint_bytes": str(checkpoint_gb * 10**9)},
        resources=Resources(gpus=2, gpu_models=["T4", "G2"]),
        work=Work(steps=steps, step_time_s=1.0, checkpoint_every_steps=every),
    )


async def _publish_links(client: LoomClient, *, fast_reachable: bool) -> None:
    """What network perception would publish: the fast region's links (un)reachable, others live."""
    regions = [FAST_REGION, SLOW_REGION, OTHER_REGION]
    for src in regions:
        for dst in regions:
            if src == dst:
                continue
            state = LinkState(
                src=src,
                dst=dst,
                rtt_ms_p50=80.0,
                rtt_ms_p95=90.0,
                rtt_ms_p99=100.0,
                jitter_ms=1.0,
                loss_rate=0.0,
                cost=80.0,
                stale=FAST_REGION in (src, dst) and not fast_reachable,
                updated_at=time.time(),
            )
            await client.nc.publish(subjects.link_state(src, dst), encode(state))
    await client.nc.flush()


async def _all_running(client: LoomClient, cluster: str, attempt: int) -> list[dict[str, Any]] | None:
    jobs = [await client.job(j) for j in JOBS]
    ok = all(
        j and j["state"] == "running" and j["cluster"] == cluster and j["attempt"] == attempt for j in jobs
    )
    return jobs if ok else None  # type: ignore[return-value]


def _live(*agents: Agent) -> dict[str, list[str]]:
    """job -> its live runs (``cluster:attempt``) on the agents."""
    out: dict[str, list[str]] = {}
    for agent in agents:
        for key in agent.running:
            job_id, _, attempt = key.rpartition(":")
            out.setdefault(job_id, []).append(f"{agent.cluster}:{attempt}")
    return out


async def test_a_failed_cluster_that_returns_stops_its_orphans_and_draws_back_only_the_jobs_worth_moving(
    platform: Platform,
) -> None:
    await platform.start("metrics")
    await platform.start("placement")
    await platform.start("migration")
    await platform.start(f"agent-{FAST}")
    client = await LoomClient.connect(platform.nats_url)
    db = await asyncpg.connect(platform.database_url)
    try:
        await _publish_links(client, fast_reachable=True)
        # 40 000 steps: minutes of wall time on G2s, days of its clock left on T4s. The long jobs
        # checkpoint 1 GB; the heavy one 50 TB: saving it and sending it over the WAN takes longer
        # than the G2s would save it.
        for job_id in LONG:
            await client.submit(_job(job_id, steps=40_000, every=100, checkpoint_gb=1))
        await client.submit(_job(HEAVY, steps=40_000, every=100, checkpoint_gb=50_000))
        await until(lambda: _all_running(client, FAST, 1), 20, "the jobs running on the fast cluster")
        slow_agent: Agent = await platform.start(f"agent-{SLOW}")

        # -- the fast cluster fails: its agent gone, its region unreachable ----------------------
        await platform.stop(f"agent-{FAST}")
        failed_at = time.time()
        await _publish_links(client, fast_reachable=False)
        moved = await until(lambda: _all_running(client, SLOW, 2), 30, "the jobs failed over to c-weu-a")
        for job in moved:
            requeued = [e["event"] for e in job["events"] if e["kind"] == "requeued"]
            assert [r["cause"] for r in requeued] == ["cluster_lost"], requeued
        print(f"\nbackflow: all failed over {time.time() - failed_at:.2f} s after the agent stopped", end="")

        # -- it returns: orphans stopped, then only the jobs worth moving flow back --------------
        await _publish_links(client, fast_reachable=True)
        returned_at = time.time()
        fast_agent: Agent = await platform.start(f"agent-{FAST}")

        async def orphans_stopped() -> bool:
            old = [f"{j}:1" for j in JOBS]
            return all(k in fast_agent.finished and k not in fast_agent.running for k in old)

        await until(orphans_stopped, 15, "the returned agent's attempt-1 runs stopped")

        resurrected: list[dict[str, list[str]]] = []

        async def flowed_back() -> list[dict[str, Any]] | None:
            live = _live(fast_agent, slow_agent)
            if any(run.endswith(":1") for runs in live.values() for run in runs):
                resurrected.append(live)  # an orphan running again: a job doubled
            jobs = [await client.job(j) for j in LONG]
            back = all(
                j and j["state"] == "running" and j["cluster"] == FAST and j["attempt"] == 3 for j in jobs
            )
            return jobs if back else None  # type: ignore[return-value]

        await until(flowed_back, 60, "the long jobs back on the returned cluster", interval_s=0.02)
        print(f", both long jobs back {time.time() - returned_at:.2f} s after it returned")
        assert resurrected == [], "an orphaned attempt-1 run was live again"

        await _flowed_back_gradually_and_only_where_it_pays(client, db, returned_at)
        # One live run per job, where the store says it runs (the moved runs' stops may be in flight).
        expected = {**{j: [f"{FAST}:3"] for j in LONG}, HEAVY: [f"{SLOW}:2"]}

        async def one_run_each() -> bool:
            return _live(fast_agent, slow_agent) == expected

        await until(one_run_each, 10, "one live run per job")
    finally:
        await db.close()
        await client.close()


async def _flowed_back_gradually_and_only_where_it_pays(
    client: LoomClient, db: asyncpg.Connection, returned_at: float
) -> None:
    """The long jobs moved back one after the other (cause ``backflow``, from their checkpoints);
    the heavy one stayed; every ``cluster_joined`` verdict since the return says why."""

    async def completed() -> list[asyncpg.Record] | None:
        # A move completes when the migration service reads the next attempt's start (just after).
        rows = await db.fetch(
            "SELECT * FROM migrations WHERE cause = 'backflow' AND state = 'completed' ORDER BY planned_at"
        )
        return rows if len(rows) >= len(LONG) else None

    rows = await until(completed, 10, "both backflow moves completed")
    assert sorted(r["job_id"] for r in rows) == LONG
    assert all(r["from_cluster"] == SLOW and r["from_attempt"] == 2 for r in rows)
    # Resumed from the checkpoint each was asked for: nothing much redone, never step 0.
    shown = [{k: r[k] for k in ("job_id", "from_attempt", "resume_step", "lost_steps", "why")} for r in rows]
    assert all(r["resume_step"] > 0 and r["lost_steps"] <= 100 for r in rows), shown
    # Gradually: the second move was planned only once the first had ended.
    first, second = rows
    assert second["planned_at"] >= first["finished_at"], [dict(r) for r in rows]

    joined = await db.fetch(
        """SELECT * FROM migration_verdicts WHERE trigger = 'cluster_joined' AND target = $1
           AND at >= to_timestamp($2) ORDER BY id""",
        FAST,
        returned_at,
    )
    decided = {r["job_id"]: r for r in joined if r["decision"] in ("move", "stay")}  # each job's latest
    # Until its cool-down ended, a long job stayed, saying so; it moved once it had ended.
    failed_over = dict(
        await db.fetch(
            """SELECT job_id, extract(epoch FROM started_at) FROM migrations
               WHERE cause = 'failover' AND job_id = ANY($1::text[])""",
            LONG,
        )
    )
    held = 0
    for r in joined:
        if r["job_id"] in LONG and r["decision"] == "stay":
            assert "cool-down" in r["reason"], dict(r)
            held += 1
        if r["job_id"] in LONG and r["decision"] == "move":
            assert r["at"].timestamp() >= float(failed_over[r["job_id"]]) + COOLDOWN_S - 0.5, dict(r)
    numbers = {j: {k: round(decided[j][k]) for k in ("gain_s", "cost_s", "threshold_s")} for j in JOBS}
    print(f"backflow: {held} verdicts held by the cool-down before the moves; {numbers}")
    assert set(decided) == set(JOBS), [dict(r) for r in joined]
    for job_id in LONG:
        assert decided[job_id]["decision"] == "move"
        assert decided[job_id]["gain_s"] > decided[job_id]["threshold_s"]
    assert decided[HEAVY]["decision"] == "stay"
    assert decided[HEAVY]["gain_s"] < decided[HEAVY]["threshold_s"]
    # One of the long jobs waited its turn (the budget), said so, and moved at a later review.
    assert any(r["decision"] == "deferred" and "in flight" in r["reason"] for r in joined)

    heavy = await client.job(HEAVY)
    assert heavy is not None and heavy["attempt"] == 2 and heavy["cluster"] == SLOW
    shown = (await client.explain(HEAVY))["job"]["verdicts"]
    assert any(v["trigger"] == "cluster_joined" and v["decision"] == "stay" for v in shown)
