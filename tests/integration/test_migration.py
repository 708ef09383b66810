"""The migration service on real NATS and PostgreSQL: drains move jobs at checkpoint boundaries with
bounded concurrency and reopen on undrain; a returning agent stops its orphaned runs itself; a
checkpoint report of a fenced attempt is dead-lettered with its reason.

Metrics, placement, the migration service and two agents of the small topology run in this
process (tests/platform_helpers.py). Only c-weu-a and c-sea1-a have T4 GPUs (8 and 4).
"""

import asyncio
import json
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import asyncpg
import msgspec
import nats.errors
import pytest
from cli_helpers import loom_cli
from platform_helpers import Platform
from waiting import until

from loom.bus.connection import connect
from loom.client import LoomClient
from loom_proto import subjects
from loom_proto.codec import encode
from loom_proto.jobs import Affinity, JobCheckpointed, JobSpec, Resources, Work
from loom_services.cluster_agent.agent import Agent

pytestmark = pytest.mark.slow

DRAINED, OTHER = "c-weu-a", "c-sea1-a"


@pytest.fixture
def nats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # One server per test: a stream that kept the other test's heartbeats would show its clusters.
    from loom.runtime.servers import NatsServer

    with NatsServer(tmp_path_factory.mktemp("migration-nats")) as server:
        yield server.url


@pytest.fixture
async def platform(
    nats_url: str, fresh_database: Callable[..., Awaitable[str]], tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Platform]:
    p = Platform(nats_url, await fresh_database("migration"), tmp_path_factory.mktemp("agents"))
    p.placement = {"failover_ttl_s": 30.0}
    yield p
    await asyncio.gather(*(p.stop(name) for name in list(p.tasks)))  # together: the test's budget


def _job(job_id: str, step_time_s: float = 600.0) -> JobSpec:
    # 100 steps of 600 s at 2000x: 30 s of wall time, a checkpoint every 10 steps (3 s).
    return JobSpec(
        job_id=job_id,
        tenant="t1",
        resources=Resources(gpus=1, gpu_models=["T4"]),
        work=Work(steps=100, step_time_s=step_time_s, checkpoint_every_steps=10),
    )


async def _ask(client: LoomClient, subject: str, request: dict[str, Any]) -> dict[str, Any]:
    reply = await client.nc.request(subject, json.dumps(request).encode(), timeout=5)
    answer: dict[str, Any] = json.loads(reply.data)
    return answer


async def _health(client: LoomClient, name: str, key: str) -> dict[str, Any] | None:
    stats: dict[str, Any] = json.loads((await client.nc.request(f"loom.health.{name}", b"", timeout=2)).data)
    return stats if stats.get(key) else None


async def _running_at(
    client: LoomClient, jobs: list[str], cluster: str, attempt: int
) -> list[dict[str, Any]] | None:
    found = [await client.job(j) for j in jobs]
    ok = all(
        j and j["state"] == "running" and j["cluster"] == cluster and j["attempt"] == attempt for j in found
    )
    return found if ok else None  # type: ignore[return-value]


async def _progressed(client: LoomClient, jobs: list[str], fraction: float) -> bool:
    found = [await client.job(j) for j in jobs]
    return all(j and j["progress"] >= fraction for j in found)


async def _drained(db: asyncpg.Connection) -> None:
    """Wait for the drain of ``DRAINED`` to end."""
    state = await until(
        lambda: db.fetchval(
            "SELECT state FROM cluster_drains WHERE cluster = $1 AND state = 'drained'", DRAINED
        ),
        10,
        "the drain to end",
    )
    assert state == "drained"


async def _after_a_pass(migration: Any, check: Callable[[], Awaitable[Any]]) -> Any:
    """One drain pass of the migration service (a test that drives them), then ``check()``."""
    await migration.drain_pass()
    return await check()


async def _driven_drain_setup(
    platform: Platform, jobs: list[str], progressed_within_s: float = 20.0
) -> tuple[Any, LoomClient, asyncpg.Connection]:
    """The driven-drain tests' start: a migration service whose loop never runs by itself (the
    test drives its passes), ``jobs`` running on c-weu-a, then c-sea1-a known, and a checkpoint
    passed on c-weu-a. Returns (migration service, client, database connection)."""
    platform.migration = {"poll_s": 3600.0}
    await platform.start("metrics")
    await platform.start("placement")
    migration = await platform.start("migration")
    await platform.start(f"agent-{DRAINED}")
    client = await LoomClient.connect(platform.nats_url)
    db = await asyncpg.connect(platform.database_url)
    for job_id in jobs:
        await client.submit(_job(job_id))
    await until(lambda: _running_at(client, jobs, DRAINED, 1), 10, "the jobs on c-weu-a")
    await platform.start(f"agent-{OTHER}")
    await until(
        lambda: db.fetchval("SELECT count(*) FROM node_allocations WHERE cluster = $1", OTHER),
        10,
        "c-sea1-a known",
    )
    await until(lambda: _progressed(client, jobs, 0.1), progressed_within_s, "a checkpoint passed on c-weu-a")
    return migration, client, db


async def test_a_drain_is_refused_for_a_job_whose_affinity_allows_no_other_open_cluster(
    platform: Platform,
) -> None:
    for name in ("metrics", "placement", "migration", f"agent-{DRAINED}"):
        await platform.start(name)
    client = await LoomClient.connect(platform.nats_url)
    db = await asyncpg.connect(platform.database_url)
    try:
        # A job pinned to a cluster placement does not know yet is refused: wait for its view.
        await until(
            lambda: db.fetchval("SELECT count(*) FROM node_allocations WHERE cluster = $1", DRAINED),
            20,
            "c-weu-a known",
        )
        await client.submit(msgspec.structs.replace(_job("pinned"), affinity=Affinity(clusters=[DRAINED])))
        await client.submit(_job("free"))
        await until(lambda: _running_at(client, ["pinned", "free"], DRAINED, 1), 20, "both on c-weu-a")
        await platform.start(f"agent-{OTHER}")
        await until(
            lambda: db.fetchval("SELECT count(*) FROM node_allocations WHERE cluster = $1", OTHER),
            10,
            "c-sea1-a known",
        )
        # c-sea1-a has T4s, but the pinned job may not run there (before, its T4s were counted).
        refused = await _ask(client, subjects.MIGRATE_DRAIN, {"cluster": DRAINED})
        assert refused["ok"] is False and refused["code"] == "refused", refused
        assert "pinned (1 x T4: 0 on other open clusters it may use)" in refused["error"]
        assert "1 job(s)" in refused["error"] and "free" not in refused["error"]
        assert await db.fetchval("SELECT count(*) FROM cluster_drains") == 0  # nothing changed
        forced = await _ask(client, subjects.MIGRATE_DRAIN, {"cluster": DRAINED, "force": True})
        assert forced["ok"] is True and forced["jobs"] == 2, forced
    finally:
        await client.close()
        await db.close()


async def test_a_drain_moves_every_job_from_its_checkpoint_two_at_a_time_and_undrain_reopens(
    platform: Platform,
) -> None:
    jobs = [f"dr-{i}" for i in range(4)]
    await platform.start("metrics")
    await platform.start("placement")
    await platform.start("migration")
    await platform.start(f"agent-{DRAINED}")
    client = await LoomClient.connect(platform.nats_url)
    db = await asyncpg.connect(platform.database_url)
    try:
        for job_id in jobs:
            await client.submit(_job(job_id))
        await until(lambda: _running_at(client, jobs, DRAINED, 1), 20, "the jobs running on c-weu-a")

        unknown = await _ask(client, subjects.MIGRATE_DRAIN, {"cluster": "c-nowhere"})
        assert unknown["ok"] is False and unknown["code"] == "unknown_cluster"
        # c-sea1-a is not up yet: c-weu-a holds the jobs' only T4 GPUs.
        refused = await _ask(client, subjects.MIGRATE_DRAIN, {"cluster": DRAINED, "concurrency": 2})
        assert refused["ok"] is False and refused["code"] == "refused"
        assert "without feasible GPUs elsewhere" in refused["error"] and "dr-0" in refused["error"]

        await platform.start(f"agent-{OTHER}")
        await until(
            lambda: db.fetchval("SELECT count(*) FROM node_allocations WHERE cluster = $1", OTHER),
            10,
            "c-sea1-a known",
        )
        await until(lambda: _progressed(client, jobs, 0.15), 20, "a checkpoint passed on c-weu-a")
        accepted = await _ask(client, subjects.MIGRATE_DRAIN, {"cluster": DRAINED, "concurrency": 2})
        assert accepted["ok"] is True and accepted["jobs"] == 4, accepted
        # Answered once placement had closed it: nothing submitted from here on lands there.
        assert accepted["placement_confirmed"] is True and accepted["shards"]["confirmed"] == ["global"]
        # Killed mid-drain, the migration service goes on from its records: nothing lost or doubled.
        await until(
            lambda: db.fetchval("SELECT count(*) FROM migrations WHERE state <> 'completed'"),
            10,
            "a move in flight",
        )
        await platform.stop("migration")
        await platform.start("migration")

        moved = await until(lambda: _running_at(client, jobs, OTHER, 2), 30, "every job moved to c-sea1-a")
        await _drained(db)
        rows = await db.fetch("SELECT * FROM migrations ORDER BY planned_at")
        assert [r["state"] for r in rows] == ["completed"] * 4
        assert all(r["cause"] == "drain" and r["to_cluster"] == OTHER for r in rows)
        # At most two in flight: no instant is inside more than two [planned, finished] intervals.
        for r in rows:
            inside = sum(1 for o in rows if o["planned_at"] <= r["planned_at"] < o["finished_at"])
            assert inside <= 2, [(o["job_id"], o["planned_at"], o["finished_at"]) for o in rows]
        # None restarted from step 0: each resumed from the checkpoint asked for, past its progress.
        for job in moved:
            row = next(r for r in rows if r["job_id"] == job["job_id"])
            assert row["resume_step"] >= 10
            requeued = [e["event"] for e in job["events"] if e["kind"] == "requeued"]
            assert len(requeued) == 1 and requeued[0]["cause"] == "migrated"
            assert requeued[0]["from_cluster"] == DRAINED
            steps = [
                e["event"]["step"]
                for e in job["events"]
                if e["kind"] == "progress" and e["event"]["attempt"] == 2
            ]
            assert not steps or min(steps) > row["resume_step"]
            assert [m["migration_id"] for m in job["migrations"]] == [f"{job['job_id']}:1"]

        # Closed: a new T4 job waits (c-sea1-a is full) rather than land on c-weu-a ...
        await client.submit(_job("dr-late"))
        await asyncio.sleep(1.5)
        late = await client.job("dr-late")
        assert late is not None and late["state"] == "queued"
        # ... until the drain ends.
        undrained = await _ask(client, subjects.MIGRATE_DRAIN, {"op": "undrain", "cluster": DRAINED})
        assert [undrained[k] for k in ("ok", "was_drained", "placement_confirmed", "shards")] == [
            *[True] * 3,
            {
                "confirmed": ["global"],
                "unconfirmed": [],
                "leaderless": [],
                "by": {"global": "placement (global)"},
                "known": True,
            },
        ]
        await until(
            lambda: _running_at(client, ["dr-late"], DRAINED, 1), 15, "the late job placed on c-weu-a"
        )
    finally:
        await db.close()
        await client.close()


async def _report_checkpoint(
    client: LoomClient, job_id: str, cluster: str, *, attempt: int, step: int
) -> None:
    """An agent's checkpoint report of tenant t1's ``job_id``, published by hand under its usual id."""
    await client.nc.publish(
        subjects.job_event("checkpointed", "t1"),
        encode(
            JobCheckpointed(
                job_id=job_id,
                tenant="t1",
                cluster=cluster,
                attempt=attempt,
                step=step,
                checkpoint_uri=f"sim://{job_id}/{step}",
                at=time.time(),
            )
        ),
        headers={"Nats-Msg-Id": f"{job_id}:checkpointed:{attempt}:{step}"},
    )


async def _a_cancelled_runs_late_checkpoint_is_acknowledged_only(
    client: LoomClient, dlq: Any, job_id: str
) -> None:
    """A cancelled job's live run may still report a checkpoint while it stops: acknowledged,
    counted, neither recorded nor dead-lettered (a dead letter is for poison, not for a race)."""
    assert await client.cancel(job_id) == "cancelled"
    await _report_checkpoint(client, job_id, OTHER, attempt=2, step=77)
    await until(lambda: _health(client, "placement", "late_checkpoints"), 10, "the late checkpoint seen")
    with pytest.raises(nats.errors.TimeoutError):
        await dlq.next_msg(timeout=1.0)
    job = await client.job(job_id)
    assert job is not None and job["state"] == "cancelled"
    assert not [e for e in job["events"] if e["kind"] == "checkpointed" and e["event"].get("step") == 77]


async def test_a_returning_agent_stops_its_orphaned_runs_and_a_fenced_checkpoint_is_dead_lettered(
    platform: Platform,
) -> None:
    jobs = [f"or-{i}" for i in range(2)]
    await platform.start("metrics")
    await platform.start("placement")
    await platform.start(f"agent-{DRAINED}")
    client = await LoomClient.connect(platform.nats_url)
    dlq = await client.nc.subscribe(subjects.dead_letter(subjects.job_event("checkpointed", "t1")))
    try:
        for job_id in jobs:
            await client.submit(_job(job_id, step_time_s=300.0))
        await until(lambda: _running_at(client, jobs, DRAINED, 1), 20, "the jobs running on c-weu-a")
        await until(lambda: _progressed(client, jobs, 0.15), 20, "a checkpoint passed on c-weu-a")
        # The agent goes away with its journal; placement gives its runs up meanwhile (the
        # failover's and a drain's path) and the jobs run elsewhere at attempt 2.
        await platform.stop(f"agent-{DRAINED}")
        # Closed to new work as a drain closes it (placement offers none of its nodes).
        db = await asyncpg.connect(platform.database_url)
        try:
            await db.execute(
                "INSERT INTO cluster_drains (cluster, concurrency, state) VALUES ($1, 1, 'drained')", DRAINED
            )
        finally:
            await db.close()
        await client.nc.publish(subjects.MIGRATE_DRAINS_CHANGED, b"")
        stats = await until(
            lambda: _health(client, "placement", "drained"), 5, "placement to know c-weu-a is closed"
        )
        assert stats["drained"] == [DRAINED]
        for job_id in jobs:
            answer = await _ask(
                client,
                subjects.PLACEMENT_MIGRATE,
                {
                    "job_id": job_id,
                    "attempt": 1,
                    "resume_step": 10,
                    "avoid": [DRAINED],
                    "from_cluster": DRAINED,
                },
            )
            assert answer == {"ok": True, "requeued": True}
        # The stops placement sent the old runs are lost: only the agent's own attempt check fences them.
        js = client.nc.jetstream()
        await js.purge_stream("CLUSTERS", subject=subjects.cluster_command(DRAINED, "stop"))
        await platform.start(f"agent-{OTHER}")
        await until(lambda: _running_at(client, jobs, OTHER, 2), 20, "the jobs running on c-sea1-a")

        returned: Agent = await platform.start(f"agent-{DRAINED}")
        back_at = time.time()

        async def orphans_stopped() -> bool:
            return bool(returned.ctx.stats.get("orphans_stopped") == 2)

        await until(orphans_stopped, 10, "the orphans stopped")
        assert not returned.running and {f"{j}:1" for j in jobs} <= returned.finished

        # A checkpoint report of the fenced attempt: dead-lettered with the reason, not recorded.
        await _report_checkpoint(client, jobs[0], DRAINED, attempt=1, step=95)
        letter = await dlq.next_msg(timeout=10)
        assert "fenced attempt 1" in (letter.headers or {}).get("Loom-Error", "")
        await asyncio.sleep(1.0)
        for job_id in jobs:
            job = await client.job(job_id)
            assert job is not None and job["attempt"] == 2
            late_old = [e for e in job["events"] if e["event"].get("attempt") == 1 and e["at"] >= back_at]
            assert late_old == [], "the orphaned run reported nothing after the agent returned"

        await _a_cancelled_runs_late_checkpoint_is_acknowledged_only(client, dlq, jobs[1])
    finally:
        await dlq.unsubscribe()
        await client.close()


async def _stuck_on_drained(platform: Platform, job_id: str) -> tuple[LoomClient, asyncpg.Connection]:
    """Metrics, placement and migration; c-sea1-a's 4 T4 GPUs taken by long blockers ``blk-0..3``;
    ``job_id`` running on c-weu-a past a checkpoint: it has feasible GPUs elsewhere (a drain of
    c-weu-a is not refused) but no room there now. The caller closes the client and connection."""
    await platform.start("metrics")
    await platform.start("placement")
    await platform.start("migration")
    await platform.start(f"agent-{OTHER}")
    client = await LoomClient.connect(platform.nats_url)
    db = await asyncpg.connect(platform.database_url)
    blockers = [f"blk-{i}" for i in range(4)]
    for blocker in blockers:
        await client.submit(_job(blocker, step_time_s=2400.0))
    await until(lambda: _running_at(client, blockers, OTHER, 1), 10, "c-sea1-a full")
    await platform.start(f"agent-{DRAINED}")
    await client.submit(_job(job_id))
    await until(lambda: _running_at(client, [job_id], DRAINED, 1), 10, "the job on c-weu-a")
    await until(lambda: _progressed(client, [job_id], 0.1), 15, "a checkpoint passed")
    return client, db


async def test_a_drain_job_with_no_room_elsewhere_keeps_running_says_so_and_moves_when_room_appears(
    platform: Platform,
) -> None:
    # c-sea1-a's 4 T4 GPUs are taken: c-weu-a's job has feasible GPUs elsewhere (the drain is not
    # refused) but no room there now. It must keep running, say it waits for capacity and what it
    # needs, and move once a blocker ends (before: its run was given up and it sat queued).
    client, db = await _stuck_on_drained(platform, "stuck")
    try:
        accepted = await _ask(client, subjects.MIGRATE_DRAIN, {"cluster": DRAINED, "concurrency": 2})
        assert accepted["ok"] is True and accepted["jobs"] == 1, accepted

        async def waiting() -> list[dict[str, Any]] | None:
            drains = await _ask(client, subjects.MIGRATE_QUERY, {"op": "drains"})
            mine = [d for d in drains["result"] if d["cluster"] == DRAINED]
            return mine[0]["waiting"] or None if mine else None

        listed = await until(waiting, 5, "the drain to say the job waits for capacity")
        assert [(w["job_id"], w["needs"]) for w in listed] == [("stuck", "1 x T4")]
        assert "waits for capacity" in listed[0]["why"] and f"{OTHER} 4" in listed[0]["why"]
        # `loom drains` lists the drain, still draining, with the job waiting to move and why.
        shown = await asyncio.to_thread(_loom, "drains", platform=platform)
        assert shown.returncode == 0, shown.stderr
        assert DRAINED in shown.stdout and "draining" in shown.stdout
        assert f"drain of {DRAINED}: stuck not moved, waits for capacity" in shown.stdout
        as_json = await asyncio.to_thread(_loom, "drains", "--json", platform=platform)
        assert [(d["cluster"], d["state"], len(d["waiting"])) for d in json.loads(as_json.stdout)] == [
            (DRAINED, "draining", 1)
        ]
        await asyncio.sleep(1.0)  # a few drain passes: it stays put, nothing given up
        assert await _running_at(client, ["stuck"], DRAINED, 1)
        assert await db.fetchval("SELECT count(*) FROM migrations") == 0
        verdict = await db.fetchrow(
            "SELECT * FROM migration_verdicts WHERE job_id = 'stuck' AND trigger = 'drain'"
        )
        assert verdict["decision"] == "stay" and verdict["target"] is None
        assert verdict["reason"].startswith("waits for capacity: needs 1 x T4")

        await client.cancel("blk-0")  # room appears: the drain asks again and moves it there
        await until(lambda: _running_at(client, ["stuck"], OTHER, 2), 15, "the job moved to c-sea1-a")
        await _drained(db)
        row = await db.fetchrow("SELECT * FROM migrations WHERE job_id = 'stuck'")
        assert row["state"] == "completed" and row["to_cluster"] == OTHER and row["resume_step"] >= 10
        assert await waiting() is None
        shown = await asyncio.to_thread(_loom, "drains", platform=platform)
        assert shown.returncode == 0 and "drained" in shown.stdout and "not moved" not in shown.stdout
    finally:
        await db.close()
        await client.close()


async def test_draining_the_cluster_of_a_spanning_gangs_member_part_waits_for_capacity_not_a_move_in_place(
    platform: Platform,
) -> None:
    # A gang of 6 x 2 T4 spans both clusters (it needs T4s of both). A what-if answered before
    # placement heard of the drain re-places it where it is, a part still on the drained cluster
    # (the race is made certain here: the service's what-if answers as if placement had not heard
    # of the drain). Before, a candidate led from the other cluster counted as room off the drained
    # one: a move "c-sea1-a -> c-sea1-a" was planned that could never start, held a slot of the
    # drain's concurrency, and the gang was not listed as waiting for capacity.
    await platform.start("metrics")
    await platform.start("placement")
    migration = await platform.start("migration")
    await platform.start(f"agent-{OTHER}")
    await platform.start(f"agent-{DRAINED}")
    client = await LoomClient.connect(platform.nats_url)
    db = await asyncpg.connect(platform.database_url)
    try:
        await until(
            lambda: db.fetchval("SELECT count(DISTINCT cluster) = 2 FROM node_allocations"),
            10,
            "both clusters",
        )
        gang = JobSpec(
            job_id="gang",
            tenant="t1",
            workers=6,
            allow_multi_cluster=True,
            resources=Resources(gpus=2, gpu_models=["T4"]),
            work=Work(steps=100, step_time_s=600.0, checkpoint_every_steps=10),
        )
        await client.submit(gang)

        async def running() -> dict[str, Any] | None:
            job = await client.job("gang")
            return job if job and job["state"] == "running" else None

        lead = (await until(running, 15, "the gang running"))["cluster"]
        member = OTHER if lead == DRAINED else DRAINED
        await until(lambda: _progressed(client, ["gang"], 0.1), 20, "a checkpoint passed")
        asked = migration._whatif

        async def before_the_drain_was_heard(job_id: str) -> dict[str, Any] | None:
            answer = await asked(job_id)
            if answer is None or job_id != "gang":
                return answer
            current = answer["current"]
            in_place = {
                "cluster": lead,
                "region": current["regions"][0],
                "clusters": current["clusters"],
                "step_s": current["step_s"],
            }
            return {**answer, "candidate": in_place}

        migration._whatif = before_the_drain_was_heard
        accepted = await _ask(
            client, subjects.MIGRATE_DRAIN, {"cluster": member, "concurrency": 2, "force": True}
        )
        assert accepted["ok"] is True and accepted["jobs"] == 1, accepted

        async def waiting() -> list[dict[str, Any]] | None:
            drains = await _ask(client, subjects.MIGRATE_QUERY, {"op": "drains"})
            mine = [d for d in drains["result"] if d["cluster"] == member]
            return mine[0]["waiting"] or None if mine else None

        listed = await until(waiting, 10, "the drain to say the gang waits for capacity")
        assert [(w["job_id"], w["needs"]) for w in listed] == [("gang", "12 x T4")]
        for _ in range(3):
            await migration.drain_pass()
        assert await db.fetchval("SELECT count(*) FROM migrations WHERE job_id = 'gang'") == 0
        job = await client.job("gang")
        assert job is not None and (job["state"], job["attempt"]) == ("running", 1)
    finally:
        await db.close()
        await client.close()


async def test_a_drain_past_its_deadline_is_drained_once_the_cluster_is_empty_though_its_job_still_waits(
    platform: Platform,
) -> None:
    # c-sea1-a is full: past the deadline the job is given up and waits in the queue for room,
    # nothing left on c-weu-a. Before, its started move kept the drain "draining" (and
    # `loom drain --wait` waiting) until the job found room somewhere, which might be never.
    client, db = await _stuck_on_drained(platform, "late")
    try:
        accepted = await _ask(
            client, subjects.MIGRATE_DRAIN, {"cluster": DRAINED, "concurrency": 2, "deadline_s": 1.0}
        )
        assert accepted["ok"] is True, accepted
        await _drained(db)
        job = await client.job("late")
        assert job is not None and job["state"] == "queued" and job["attempt"] == 1
        row = await db.fetchrow("SELECT state, to_cluster FROM migrations WHERE job_id = 'late'")
        assert row["state"] == "started"  # completed when the job starts elsewhere
        await client.cancel("blk-0")  # room: the job starts on c-sea1-a, its move completes
        await until(lambda: _running_at(client, ["late"], OTHER, 2), 15, "the job running on c-sea1-a")

        async def completed() -> bool:
            return await db.fetchval("SELECT state FROM migrations WHERE job_id = 'late'") == "completed"

        await until(completed, 10, "the move completed")
    finally:
        await db.close()
        await client.close()


def _loom(*args: str, platform: Platform) -> subprocess.CompletedProcess[str]:
    """The ``loom`` CLI as a user runs it, against this test's stack."""
    return loom_cli(*args, nats_url=platform.nats_url, database_url=platform.database_url)


async def test_a_drain_job_whose_room_was_taken_while_it_waited_for_its_turn_stays_and_waits_for_capacity(
    platform: Platform,
) -> None:
    # Two jobs on c-weu-a, drained one at a time. Both find room on c-sea1-a (4 T4) when the drain
    # starts; while the second waits for its turn, other work takes that room. When its turn comes
    # it must not move on the verdict it had (its run given up, the job queued without GPUs): the
    # drain asks placement again, finds no room, and it keeps running and waits for capacity.
    # The test drives the drain's passes itself (the loop's own period is an hour), so the room is
    # taken between two passes, not raced against one.
    jobs = ["first", "second"]
    migration, client, db = await _driven_drain_setup(platform, jobs)
    try:
        accepted = await _ask(client, subjects.MIGRATE_DRAIN, {"cluster": DRAINED, "concurrency": 1})
        assert accepted["ok"] is True and accepted["jobs"] == 2, accepted

        await migration.drain_pass()  # both judged with room on c-sea1-a; one planned
        planned = await db.fetch("SELECT job_id FROM migrations")
        assert len(planned) == 1, planned
        mover = planned[0]["job_id"]
        waiter = next(j for j in jobs if j != mover)

        started = "SELECT state IN ('started', 'completed') FROM migrations WHERE job_id = $1"
        await until(
            lambda: _after_a_pass(migration, lambda: db.fetchval(started, mover)),
            15,
            "the first move started",
        )
        # No pass from here until the room is taken: the slot frees when the move completes.
        await until(lambda: _running_at(client, [mover], OTHER, 2), 15, "the first job moved to c-sea1-a")
        await until(
            lambda: db.fetchval("SELECT state = 'completed' FROM migrations WHERE job_id = $1", mover),
            10,
            "the first move completed",
        )
        blockers = [f"blk-{i}" for i in range(3)]
        for job_id in blockers:
            await client.submit(_job(job_id, step_time_s=2400.0))
        await until(lambda: _running_at(client, blockers, OTHER, 1), 10, "c-sea1-a full")

        asked_before = migration.stats.get("drain_asked_again", 0)
        await migration.drain_pass()  # its turn: asked again, no room now
        assert await db.fetchval("SELECT count(*) FROM migrations WHERE job_id = $1", waiter) == 0
        assert migration.stats.get("drain_asked_again", 0) > asked_before
        assert await _running_at(client, [waiter], DRAINED, 1)
        drains = await _ask(client, subjects.MIGRATE_QUERY, {"op": "drains"})
        waiting = next(d for d in drains["result"] if d["cluster"] == DRAINED)["waiting"]
        assert [(w["job_id"], w["needs"]) for w in waiting] == [(waiter, "1 x T4")]
        assert "waits for capacity" in waiting[0]["why"]
        verdicts = await db.fetch(
            "SELECT decision, target FROM migration_verdicts WHERE job_id = $1 AND trigger = 'drain'", waiter
        )
        assert [(v["decision"], v["target"]) for v in verdicts] == [("stay", None)]

        await client.cancel("blk-0")  # room appears: a later pass finds it and moves the job there

        await until(
            lambda: _after_a_pass(migration, lambda: _running_at(client, [waiter], OTHER, 2)),
            20,
            "the waiting job moved to c-sea1-a once room appeared",
        )
        drained = "SELECT state = 'drained' FROM cluster_drains WHERE cluster = $1"
        await until(
            lambda: _after_a_pass(migration, lambda: db.fetchval(drained, DRAINED)), 10, "the drain ended"
        )
        rows = await db.fetch("SELECT job_id, state, to_cluster FROM migrations ORDER BY planned_at")
        assert [(r["job_id"], r["state"], r["to_cluster"]) for r in rows] == [
            (mover, "completed", OTHER),
            (waiter, "completed", OTHER),
        ]
    finally:
        await db.close()
        await client.close()


async def test_a_drain_move_whose_room_went_before_its_checkpoint_waits_and_starts_once_room_returns(
    platform: Platform,
) -> None:
    # One job on c-weu-a finds room on c-sea1-a and its move is planned (a checkpoint asked for).
    # Before the move starts, other work takes c-sea1-a's 4 T4s. With its checkpoint recorded the
    # move would give the run up now: it must not (the job would sit queued without GPUs); it
    # keeps running and the move starts once a blocker ends. Passes driven by the test.
    migration, client, db = await _driven_drain_setup(platform, ["solo"], progressed_within_s=15.0)
    try:
        accepted = await _ask(client, subjects.MIGRATE_DRAIN, {"cluster": DRAINED, "concurrency": 1})
        assert accepted["ok"] is True and accepted["jobs"] == 1, accepted
        await migration.drain_pass()  # room on c-sea1-a: planned, a checkpoint asked for
        planned = await db.fetchrow("SELECT * FROM migrations WHERE job_id = 'solo'")
        assert planned["state"] == "planned"

        blockers = [f"blk-{i}" for i in range(4)]
        for job_id in blockers:
            await client.submit(_job(job_id, step_time_s=2400.0))
        await until(lambda: _running_at(client, blockers, OTHER, 1), 10, "c-sea1-a full")
        await until(
            lambda: db.fetchval(
                "SELECT count(*) FROM checkpoints WHERE job_id = 'solo' AND attempt = 1 AND step >= $1",
                max(int(planned["resume_step"]), 1),
            ),
            10,
            "the checkpoint the move asked for",
        )
        await migration.drain_pass()  # the move could start now: placement is asked, no room
        assert await db.fetchval("SELECT state FROM migrations WHERE job_id = 'solo'") == "planned"
        assert await _running_at(client, ["solo"], DRAINED, 1)
        assert migration.stats.get("drain_start_held", 0) >= 1

        await client.cancel("blk-0")
        await until(
            lambda: _after_a_pass(migration, lambda: _running_at(client, ["solo"], OTHER, 2)),
            20,
            "the move started once room returned",
        )
        row = await db.fetchrow("SELECT * FROM migrations WHERE job_id = 'solo'")
        assert row["state"] in ("started", "completed") and row["resume_step"] >= 10
    finally:
        await db.close()
        await client.close()


async def test_a_cluster_drained_again_after_an_undrain_failed_its_planned_moves_moves_every_job_once(
    platform: Platform,
) -> None:
    # Two jobs on c-weu-a; a drain plans both moves, then `loom undrain` fails them before their
    # checkpoints start them. Draining c-weu-a again must plan both jobs again (under new ids: the
    # failed moves keep theirs) and move each exactly once; a repeated drain request and repeated
    # passes plan nothing twice. Passes driven by the test.
    jobs = ["again-a", "again-b"]
    migration, client, db = await _driven_drain_setup(platform, jobs)
    try:
        drain = {"cluster": DRAINED, "concurrency": 2}
        assert (await _ask(client, subjects.MIGRATE_DRAIN, drain))["ok"] is True
        await migration.drain_pass()  # both planned, their checkpoints asked for
        first = await db.fetch("SELECT migration_id, state FROM migrations ORDER BY migration_id")
        assert [(r["migration_id"], r["state"]) for r in first] == [
            ("again-a:1", "planned"),
            ("again-b:1", "planned"),
        ]
        migration._start_held_at["again-a:1"] = time.monotonic()  # as if its start had been held

        undrained = await _ask(client, subjects.MIGRATE_DRAIN, {"op": "undrain", "cluster": DRAINED})
        assert undrained["ok"] is True and undrained["was_drained"] is True
        failed = await db.fetch("SELECT migration_id, state FROM migrations ORDER BY migration_id")
        assert [(r["migration_id"], r["state"]) for r in failed] == [
            ("again-a:1", "failed"),
            ("again-b:1", "failed"),
        ]
        # Published as moves that no longer mattered (the operator ended their drain): no alert.
        cancelled = await db.fetch(
            "SELECT payload FROM outbox WHERE subject LIKE 'loom.migrations.failed.%' ORDER BY msg_id"
        )
        events = [json.loads(bytes(r["payload"])) for r in cancelled]
        assert [(e["migration_id"], e["moot"]) for e in events] == [("again-a:1", True), ("again-b:1", True)]
        assert "again-a:1" not in migration._start_held_at  # the undrain leaves no hold behind
        assert not [k for k in migration._drain_judged_at if k[0] == DRAINED]  # nor a verdict's age

        assert (await _ask(client, subjects.MIGRATE_DRAIN, drain))["ok"] is True
        await migration.drain_pass()
        assert (await _ask(client, subjects.MIGRATE_DRAIN, drain))["ok"] is True  # repeated: same drain
        await migration.drain_pass()
        replanned = await db.fetch(
            "SELECT migration_id FROM migrations WHERE state <> 'failed' ORDER BY migration_id"
        )
        assert [r["migration_id"] for r in replanned] == ["again-a:1:2", "again-b:1:2"]

        await until(
            lambda: _after_a_pass(migration, lambda: _running_at(client, jobs, OTHER, 2)),
            25,
            "both jobs moved to c-sea1-a",
        )
        drained = "SELECT state = 'drained' FROM cluster_drains WHERE cluster = $1"
        await until(
            lambda: _after_a_pass(migration, lambda: db.fetchval(drained, DRAINED)), 10, "the drain ended"
        )
        rows = await db.fetch("SELECT migration_id, state, to_cluster FROM migrations ORDER BY migration_id")
        assert [(r["migration_id"], r["state"], r["to_cluster"]) for r in rows] == [
            ("again-a:1", "failed", None),
            ("again-a:1:2", "completed", OTHER),
            ("again-b:1", "failed", None),
            ("again-b:1:2", "completed", OTHER),
        ]
        planned_events = await db.fetchval(
            "SELECT count(*) FROM outbox WHERE subject LIKE 'loom.migrations.planned.%'"
        )
        assert planned_events == 4  # two per job: the failed move's and the one that moved it
    finally:
        await db.close()
        await client.close()


async def test_a_drain_asked_while_the_bus_connection_is_closed_is_committed_and_answered_unconfirmed(
    platform: Platform,
) -> None:
    """The drain row is committed before placement is asked: with the migration service's NATS
    connection closed (or draining) the ask fails, and the answer says the drain was not confirmed
    rather than failing the whole request."""
    platform.migration = {"poll_s": 3600.0}  # no loop of its own uses the connection meanwhile
    await platform.start("metrics")
    await platform.start("placement")  # it records the clusters' nodes (node_allocations)
    migration = await platform.start("migration")
    await platform.start(f"agent-{DRAINED}")
    db = await asyncpg.connect(platform.database_url)
    closed = await connect(platform.nats_url, "migration-closed-test")
    await closed.close()
    live = migration.ctx.nc
    try:
        await until(
            lambda: db.fetchval("SELECT count(*) FROM node_allocations WHERE cluster = $1", DRAINED),
            10,
            "c-weu-a known",
        )
        migration.ctx.nc = closed
        try:
            for bad in ({"concurrency": 65}, {"concurrency": 99_999_999_999}, {"deadline_s": float("inf")}):
                refused = await migration._drain_request({"op": "drain", "cluster": DRAINED, **bad})
                assert refused["code"] == "bad_request" and "must be" in refused["error"], refused
            answer = await migration._drain_request({"op": "drain", "cluster": DRAINED})
        finally:
            migration.ctx.nc = live
        assert answer["ok"] is True, answer
        assert answer["placement_confirmed"] is False
        state = await db.fetchval("SELECT state FROM cluster_drains WHERE cluster = $1", DRAINED)
        assert state == "draining"
    finally:
        migration.ctx.nc = live
        await db.close()


async def test_a_checkpoint_moves_the_jobs_progress_forward(platform: Platform) -> None:
    # The agent reports progress every tenth of a run; checkpoints every 2 % here came between,
    # and `loom jobs` showed 0 % while checkpoints at steps 20, 40, ... were already recorded.
    await platform.start("metrics")
    await platform.start("placement")
    await platform.start(f"agent-{DRAINED}")
    client = await LoomClient.connect(platform.nats_url)
    db = await asyncpg.connect(platform.database_url)
    try:
        spec = JobSpec(
            job_id="often",
            tenant="t1",
            resources=Resources(gpus=1, gpu_models=["T4"]),
            work=Work(steps=1000, step_time_s=600.0, checkpoint_every_steps=20),
        )
        await client.submit(spec)

        async def early_checkpoint() -> int | None:
            step = await db.fetchval("SELECT max(step) FROM checkpoints WHERE job_id = 'often'")
            return int(step) if step is not None and 0 < step < 100 else None

        step = await until(early_checkpoint, 30, "a checkpoint before the first progress report")
        progress = await db.fetchval("SELECT progress FROM jobs WHERE job_id = 'often'")
        assert progress >= step / 1000 - 1e-6, (progress, step)
    finally:
        await db.close()
        await client.close()
