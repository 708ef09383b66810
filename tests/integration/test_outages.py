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
from waiting import until

from loom.bus import ConsumerRunner, ConsumerSpec, Delivery
from loom.runtime.servers import PostgresServer
from loom.runtime.service import ServiceContext, close_context, open_context
from loom.store.pool import transaction
from loom_proto import JobSubmitted, Work
from loom_proto import subjects as s

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
        stream="JOBS",
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
            return await _has(received, 15, retry=True) or ({} if dead else None)

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
