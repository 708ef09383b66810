"""Migration's batched handling of ``started`` events against real PostgreSQL: one statement per
round of starts ends the same migrations, with the same destinations, as one statement per event."""

from collections.abc import Awaitable, Callable

import pytest

from loom.store import moves
from loom.store.pool import create_pool, transaction


async def test_a_batch_of_starts_ends_each_migration_at_the_first_start_that_follows_it(
    fresh_database: Callable[..., Awaitable[str]],
) -> None:
    pool = await create_pool(await fresh_database("migration-batch"), max_size=1)
    try:
        async with transaction(pool) as conn:
            for job, attempt in (("a", 1), ("a", 2), ("b", 1), ("c", 3)):
                await moves.plan(
                    conn,
                    migration_id=f"{job}:{attempt}",
                    job_id=job,
                    tenant="acme",
                    cause="failover",
                    state="started",
                    from_cluster="lost",
                    from_attempt=attempt,
                    steps=10,
                    why="cluster lost",
                    trace_context={},
                )
            with pytest.raises(ValueError, match="one start per job"):
                await moves.complete_many(conn, [("a", 2, "x"), ("a", 3, "y")])
            # a's attempt 2 starts on x (ends a:1), b's attempt 2 on z, c's attempt 3 (ends nothing).
            first = await moves.complete_many(conn, [("a", 2, "x"), ("b", 2, "z"), ("c", 3, "w")])
            # Next round: a's attempt 3 starts on y (ends a:2, not a:1 again).
            second = await moves.complete_many(conn, [("a", 3, "y")])
            rows = await conn.fetch("SELECT migration_id, state, to_cluster FROM migrations ORDER BY 1")
    finally:
        await pool.close()
    assert [r["migration_id"] for r in first] == ["a:1", "b:1"]  # in the order of the starts
    assert [r["migration_id"] for r in second] == ["a:2"]
    assert [(r["migration_id"], r["state"], r["to_cluster"]) for r in rows] == [
        ("a:1", "completed", "x"),
        ("a:2", "completed", "y"),
        ("b:1", "completed", "z"),
        ("c:3", "started", None),
    ]
