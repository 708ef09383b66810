"""The replica loop measures each job's checkpoint interval from its two latest checkpoints
(``loom.store.replicas.latest_checkpoints``, real PostgreSQL), which the replica target's
keeping-up test reads (``loom.migrate.replicas.checkpoint_interval_s``)."""

from collections.abc import Awaitable, Callable

import asyncpg
import pytest

from loom.migrate.replicas import checkpoint_interval_s
from loom.store import replicas as replica_store

T0 = 1_767_225_600.0


async def test_the_latest_checkpoint_comes_with_the_one_before_it_of_the_same_attempt(
    fresh_database: Callable[..., Awaitable[str]],
) -> None:
    conn = await asyncpg.connect(await fresh_database("replint"))
    try:
        for job_id in ("j-two", "j-one"):
            await conn.execute(
                """INSERT INTO jobs (job_id, tenant, state, spec, attempt, submitted_at)
                   VALUES ($1, 'acme', 'running', '{}', 2, to_timestamp($2))""",
                job_id,
                T0,
            )
        rows = [
            ("j-two", 1, 90, T0 - 100.0),  # an earlier attempt: not this one's interval
            ("j-two", 2, 100, T0 + 10.0),
            ("j-two", 2, 120, T0 + 70.0),  # 20 steps in 60 s
            ("j-one", 2, 50, T0 + 5.0),
        ]
        await conn.executemany(
            """INSERT INTO checkpoints (job_id, attempt, step, cluster, uri, at)
               VALUES ($1, $2, $3, 'c-a', 'sim://x', to_timestamp($4))""",
            rows,
        )
        latest = {c.job_id: c for c in await replica_store.latest_checkpoints(conn)}
    finally:
        await conn.close()
    two, one = latest["j-two"], latest["j-one"]
    assert (two.step, two.previous_step) == (120, 100)
    assert two.at_s == pytest.approx(T0 + 70.0) and two.previous_at_s == pytest.approx(T0 + 10.0)
    assert (one.step, one.previous_step, one.previous_at_s) == (50, None, None)
    # 3 s a step, 10 steps an interval, agents at 2 simulated seconds per wall second: 60 s.
    interval = checkpoint_interval_s(
        step=two.step,
        at_s=two.at_s,
        previous_step=two.previous_step,
        previous_at_s=two.previous_at_s,
        checkpoint_every_steps=10,
        time_scale=2.0,
    )
    assert interval == pytest.approx(60.0)
