"""A PostgreSQL outage far longer than a consumer's retry budget, on a real PostgreSQL stopped and
started again, with real NATS: nothing acknowledged is dead-lettered, the consumer waits and
resumes, and the service's health says it is degraded meanwhile.

The consumer's retry budget here is about 0.3 s (3 failures, 0.05 s then 0.1 s apart); the outage
lasts OUTAGE_S, so before outages were told from bad messages every message that arrived in it was
dead-lettered.
"""

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import msgspec
import pytest
from nats.aio.msg import Msg
from platform_helpers import Platform
from waiting import until

from loom.bus import ConsumerRunner, ConsumerSpec, Delivery
from loom.client import LoomClient
from loom.runtime.servers import NatsServer, PostgresServer
from loom.runtime.service import ServiceContext, close_context, open_context
from loom.store.migrations import migrate_url
from loom.store.pool import transaction
from loom_proto import JobSubmitted, Work
from loom_proto import subjects as s
from loom_proto.jobs import JobSpec, Resources

OUTAGE_S = 9.0
"""Thirty times the consumer's old retry budget, three times the default one."""


@pytest.fixture(scope="module")
def postgres(postgres_dir_factory: Callable[[str], Path]) -> Iterator[PostgresServer]:
    """A PostgreSQL of this module's own: the test stops and restarts it."""
    with PostgresServer(postgres_dir_factory("outage"), durable=False) as server:
        yield server


@pytest.fixture
async def ctx(nats_url: str, postgres: PostgresServer) -> AsyncIterator[ServiceContext]:
    conn = await asyncpg.connect(postgres.url)
    try:
        await conn.execute("CREATE TABLE IF NOT EXISTS received (job_id text PRIMARY KEY, n int NOT NULL)")
    finally:
        await conn.close()
    context = await open_context(
        f"outage-{uuid.uuid4().hex[:6]}", nats_url=nats_url, database_url=postgres.url
    )
    yield context
    await close_context(context)


async def test_a_postgres_outage_longer_than_the_retry_budget_dead_letters_nothing(
    ctx: ServiceContext, postgres: PostgresServer
) -> None:
    tenant = f"t{uuid.uuid4().hex[:8]}"
    subject = s.job_submitted(tenant)
    dead: list[Msg] = []

    async def on_dead(msg: Msg) -> None:
        dead.append(msg)

    dead_sub = await ctx.nc.subscribe(s.dead_letter(subject), cb=on_dead)

    async def handler(d: Delivery[JobSubmitted]) -> None:
        async with transaction(ctx.db) as conn:
            await conn.execute(
                "INSERT INTO received VALUES ($1, 1) ON CONFLICT (job_id) DO UPDATE SET n = received.n + 1",
                d.message.job_id,
            )

    spec = ConsumerSpec(
        stream="REQUESTS",
        durable=f"outage-{tenant}",
        filter_subjects=[subject],
        max_deliver=3,
        first_nak_delay_s=0.05,
        max_nak_delay_s=0.1,
    )
    runner: ConsumerRunner[JobSubmitted] = ConsumerRunner(
        ctx.nc, spec, JobSubmitted, handler=handler, publisher=ctx.publisher, idle_fetch_timeout_s=0.2
    )
    await runner.start()

    async def publish(n: int) -> None:
        job = JobSubmitted(job_id=f"job-{n}", tenant=tenant, work=Work(steps=1))
        await ctx.publisher.publish(subject, job, msg_id=f"{tenant}-{n}")

    async def received() -> dict[str, int]:
        async with transaction(ctx.db) as conn:
            rows = await conn.fetch("SELECT job_id, n FROM received WHERE job_id LIKE 'job-%'")
        return {r["job_id"]: r["n"] for r in rows}

    async def health() -> dict[str, Any]:
        reply = await ctx.nc.request(s.service_health(ctx.name), b"", timeout=2.0)
        return dict(msgspec.json.decode(reply.data))

    try:
        async with transaction(ctx.db) as conn:
            await conn.execute("DELETE FROM received")
        for n in range(5):
            await publish(n)
        await until(lambda: _has(received, 5), 10, "the first five handled")

        await asyncio.to_thread(postgres.stop)
        stopped_at = time.monotonic()
        for n in range(5, 15):  # acknowledged by JetStream while the database is down
            await publish(n)
        statuses = []
        while time.monotonic() - stopped_at < OUTAGE_S:
            statuses.append((await health()).get("status"))
            await asyncio.sleep(0.5)  # the outage's length, not synchronisation
        await asyncio.to_thread(postgres.start)

        async def settled() -> dict[str, int] | None:
            got = await _has(received, 15, retry=True)
            if got is None and dead:
                return {"(dead letters)": len(dead)}  # stop waiting: the assertion below says why
            return got

        got = await until(settled, 30, "all fifteen handled after the outage")
        assert dead == [], f"{len(dead)} dead-lettered during the outage: {[m.data for m in dead]}"
        assert runner.counts["dead_lettered"] == 0
        assert sorted(got) == sorted(f"job-{n}" for n in range(15))
        assert "degraded: postgres unavailable" in statuses, statuses
        assert runner.held_for_outage >= 1
        after = await until(
            lambda: _healthy(health), 10, "health back to ok once the database answers", retry_on=(Exception,)
        )
        assert after["outages"] == {"postgres": 1}
    finally:
        await runner.stop()
        await dead_sub.unsubscribe()
        if not postgres.running:
            await asyncio.to_thread(postgres.start)


async def _has(received: Callable[[], Any], count: int, *, retry: bool = False) -> dict[str, int] | None:
    try:
        got: dict[str, int] = await received()
    except Exception:
        if not retry:
            raise
        return None
    return got if len(got) >= count else None


async def _healthy(health: Callable[[], Any]) -> dict[str, Any] | None:
    reply: dict[str, Any] = await health()
    return reply if reply.get("status") == "ok" else None


# -- the services: acknowledged submissions and completions through a PostgreSQL outage ---------------


@pytest.fixture
async def platform(
    postgres: PostgresServer, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Platform]:
    with NatsServer(tmp_path_factory.mktemp("outage-nats")) as nats:
        name = f"outage_{uuid.uuid4().hex[:8]}"
        conn = await asyncpg.connect(postgres.url)
        try:
            await conn.execute(f'CREATE DATABASE "{name}"')
        finally:
            await conn.close()
        url = postgres.url.rsplit("/", 1)[0] + f"/{name}"
        await migrate_url(url)
        p = Platform(nats.url, url, tmp_path_factory.mktemp("outage-agents"))
        for service in ("metrics", "placement", "agent-c-weu-a"):
            await p.start(service)
        try:
            yield p
        finally:
            if not postgres.running:
                await asyncio.to_thread(postgres.start)
            for service in list(p.tasks):
                await p.stop(service)


async def test_submissions_and_completions_acknowledged_during_a_postgres_outage_are_all_placed_and_recorded(
    platform: Platform, postgres: PostgresServer
) -> None:
    client = await LoomClient.connect(platform.nats_url)
    tenant = f"t{uuid.uuid4().hex[:6]}"
    dead: list[Msg] = []

    async def on_dead(msg: Msg) -> None:
        dead.append(msg)

    await client.nc.subscribe("loom.dlq.>", cb=on_dead)
    try:
        await until(lambda: _cluster_seen(client), 15, "the agent's cluster in the view")
        running = JobSpec(
            job_id="during-run",
            tenant=tenant,
            task_type="inference",
            resources=Resources(gpus=1),
            work=Work(steps=400),
        )
        # Runs about 8 s: completes while the database is down (at least 9 s). Not shorter: under
        # load the look below can come seconds after the start, and at 4 s the job was once over.
        await client.submit(running)
        await until(lambda: _state(client, "during-run", "running"), 20, "a job running before the outage")
        assert await _state(client, "during-run", "running")

        await asyncio.to_thread(postgres.stop)
        stopped_at = time.monotonic()
        for n in range(8):  # acknowledged by JetStream while the database is down
            await client.submit(
                JobSpec(
                    job_id=f"sub-{n}",
                    tenant=tenant,
                    task_type="inference",
                    resources=Resources(gpus=1),
                    work=Work(steps=2),
                )
            )
        statuses: set[str] = set()

        async def ask(service: str) -> None:
            try:
                reply = await client.nc.request(s.service_health(service), b"", timeout=3.0)
                statuses.add(f"{service}: {msgspec.json.decode(reply.data).get('status')}")
            except Exception:  # a busy service may not answer in time; the next round will
                return

        # The outage lasts OUTAGE_S, longer only while placement has not yet answered a health
        # request during it (a loaded machine can delay its answers); 40 s at most.
        while True:
            elapsed = time.monotonic() - stopped_at
            seen = "placement: degraded: postgres unavailable" in statuses
            if elapsed >= 40.0 or (elapsed >= OUTAGE_S and seen):
                break
            await asyncio.gather(ask("placement"), ask("metrics"))
            await asyncio.sleep(0.5)  # the outage's length, not synchronisation
        await asyncio.to_thread(postgres.start)

        jobs = ["during-run", *(f"sub-{n}" for n in range(8))]

        async def done() -> bool:
            if dead:
                return True
            for job_id in jobs:
                try:
                    j = await client.job(job_id, timeout_s=2.0)
                except Exception:
                    return False
                if not j or j["state"] != "completed":
                    return False
            return True

        await until(done, 60, "every job completed after the outage", interval_s=0.5)
        assert dead == [], (
            f"dead-lettered: {[(m.subject, (m.headers or {}).get('Loom-Error')) for m in dead]}"
        )
        assert "placement: degraded: postgres unavailable" in statuses, statuses
    finally:
        await client.close()


async def _cluster_seen(client: LoomClient) -> bool:
    try:
        view = await client.view()
    except Exception:
        return False
    return any(z["clusters"] for r in view["regions"].values() for z in r["zones"].values())


async def _state(client: LoomClient, job_id: str, wanted: str) -> bool:
    j = await client.job(job_id)
    return bool(j and j["state"] == wanted)
