"""The console's read queries on a real PostgreSQL: a tenant's counts and queue, the queue's order."""

import time
from collections.abc import Awaitable, Callable

import asyncpg

from loom.store import console as store
from loom.store import jobs as repo


async def test_the_queue_is_in_placements_order_and_a_tenant_sees_only_its_own(
    fresh_database: Callable[..., Awaitable[str]],
) -> None:
    conn = await asyncpg.connect(await fresh_database("console"))
    try:
        now = time.time()
        spec = b'{"resources": {"gpus": 3}}'
        await repo.insert_jobs(
            conn,
            [
                repo.NewJob("old-low", "alpha", spec, now - 30, {}, priority=100),
                repo.NewJob("new-high", "beta", spec, now - 10, {}, priority=300),
                repo.NewJob("mid-low", "alpha", spec, now - 20, {}, priority=100),
                repo.NewJob("done", "alpha", spec, now - 40, {}),
            ],
        )
        await conn.execute("UPDATE jobs SET state = 'completed' WHERE job_id = 'done'")

        queued = await store.waiting(conn, None)
        assert [j["job_id"] for j in queued] == ["new-high", "old-low", "mid-low"]
        assert queued[0]["gpus"] == 3 and queued[0]["priority"] == 300
        assert 29 <= queued[1]["waiting_s"] <= 60
        assert [j["job_id"] for j in await store.waiting(conn, "alpha")] == ["old-low", "mid-low"]

        assert await store.counts_of(conn, None) == {"queued": 3, "completed": 1}
        assert await store.counts_of(conn, "beta") == {"queued": 1}
    finally:
        await conn.close()
