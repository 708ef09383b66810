"""Migration's batched handling of ``started`` events against real PostgreSQL: one statement per
round of starts ends the same migrations, with the same destinations, as one statement per event."""

from collections.abc import Awaitable, Callable

import pytest

from loom.model.capacity import NodeCapacity
from loom.store import jobs, moves
from loom.store.pool import create_pool, transaction


async def _placed(conn: object, *runs: tuple[str, int, str], version: int = 2) -> None:
    """Reservations for each (job, attempt, cluster): where those attempts were placed (a start
    ends a move only there; an agent's forged start of another cluster's job ended it)."""
    clusters = sorted({c for _, _, c in runs})
    await jobs.upsert_nodes(conn, version, [NodeCapacity(f"n-{c}", c, "r", "z", "T4", 64) for c in clusters])  # type: ignore[arg-type]
    await jobs.insert_jobs(
        conn, [jobs.NewJob(j, "acme", b"{}", 0.0, {}) for j in sorted({j for j, _, _ in runs})]
    )  # type: ignore[arg-type]
    for job, attempt, cluster in runs:
        await jobs.reserve(conn, [(job, attempt, cluster, [(f"n-{cluster}", 1)])])  # type: ignore[arg-type]


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
            await _placed(conn, ("a", 2, "x"), ("b", 2, "z"), ("c", 3, "w"), ("a", 3, "y"))
            # A start where its attempt was not placed (an agent's forgery) ends nothing.
            assert await moves.complete_many(conn, [("a", 2, "forger")]) == []
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


async def test_a_completed_move_names_every_cluster_its_new_attempt_holds(
    fresh_database: Callable[..., Awaitable[str]],
) -> None:
    # A pipeline drained off its second stage's cluster: its new attempt keeps the first stage on
    # c-a and puts the second on c-c. The lead's start (c-a) ends the move; the move went to c-a
    # and c-c, not "c-b -> c-a" (before: only the reporting cluster was named).
    pool = await create_pool(await fresh_database("migration-to-all"), max_size=1)
    try:
        async with transaction(pool) as conn:
            await moves.plan(
                conn,
                migration_id="p:1",
                job_id="p",
                tenant="acme",
                cause="drain",
                state="started",
                from_cluster="c-b",
                from_attempt=1,
                steps=10,
                why="drain of c-b",
                trace_context={},
            )
            await _placed(conn, ("p", 2, "c-c"), ("p", 2, "c-a"))
            done = await moves.complete_many(conn, [("p", 2, "c-a")])
    finally:
        await pool.close()
    assert [(r["migration_id"], r["state"], r["to_cluster"]) for r in done] == [
        ("p:1", "completed", "c-a,c-c")
    ]


async def test_a_drain_move_whose_job_starts_on_the_drained_cluster_again_is_failed_not_completed(
    fresh_database: Callable[..., Awaitable[str]],
) -> None:
    # Undrained before the job moved, it started on the same cluster: the move did not happen
    # (before: "completed c-sea1-a -> c-sea1-a"). A failover's restart in place still completes.
    pool = await create_pool(await fresh_database("migration-back"), max_size=1)
    try:
        async with transaction(pool) as conn:
            for job, cause in (("d", "drain"), ("f", "failover")):
                await moves.plan(
                    conn,
                    migration_id=f"{job}:1",
                    job_id=job,
                    tenant="acme",
                    cause=cause,
                    state="started",
                    from_cluster="c-sea1-a",
                    from_attempt=1,
                    steps=10,
                    why="drain of c-sea1-a past its deadline",
                    trace_context={},
                )
            # A gang ("g") drained off its member cluster c-weu-a whose new attempt starts with a part
            # there again, its lead's start report (c-sea1-a) first: the move did not happen either.
            await moves.plan(
                conn,
                migration_id="g:1",
                job_id="g",
                tenant="acme",
                cause="drain",
                state="started",
                from_cluster="c-weu-a",
                from_attempt=1,
                steps=10,
                why="drain of c-weu-a",
                trace_context={},
            )
            await jobs.upsert_nodes(conn, 1, [NodeCapacity("n-w", "c-weu-a", "r", "z", "T4", 4)])
            await jobs.insert_jobs(conn, [jobs.NewJob("g", "acme", b"{}", 0.0, {})])
            await jobs.reserve(conn, [("g", 2, "c-weu-a", [("n-w", 2)])])
            await _placed(conn, ("d", 2, "c-sea1-a"), ("f", 2, "c-sea1-a"), ("g", 2, "c-sea1-a"))
            done = await moves.complete_many(
                conn, [("d", 2, "c-sea1-a"), ("f", 2, "c-sea1-a"), ("g", 2, "c-sea1-a")]
            )
    finally:
        await pool.close()
    by_id = {r["migration_id"]: r for r in done}
    assert (by_id["d:1"]["state"], by_id["d:1"]["to_cluster"]) == ("failed", None)
    assert by_id["d:1"]["why"].startswith("the drain of c-sea1-a ended before the job moved")
    assert (by_id["f:1"]["state"], by_id["f:1"]["to_cluster"]) == ("completed", "c-sea1-a")
    assert by_id["g:1"]["state"] == "failed" and by_id["g:1"]["why"].startswith("the drain of c-weu-a ended")


async def test_first_attempt_starts_cost_migration_no_statement_and_a_later_start_still_ends_its_move(
    fresh_database: Callable[..., Awaitable[str]],
) -> None:
    """A first attempt's start can end no migration (``from_attempt >= 1``): a batch of them is
    acknowledged without touching PostgreSQL; a second attempt's start in a batch still ends the
    migration of the first."""
    from types import SimpleNamespace
    from typing import Any

    from opentelemetry import trace

    from loom.bus import Delivery
    from loom_proto.codec import encode
    from loom_proto.jobs import JobStarted
    from loom_services.migration.service import MigrationService

    def delivery(seq: int, event: JobStarted) -> Delivery[bytes]:
        return Delivery(
            msg=None,
            subject="loom.jobs.started.acme",
            message=encode(event),
            headers={},
            msg_id=f"{event.job_id}:started:{event.attempt}",
            num_delivered=1,
            stream_seq=seq,
            span=trace.get_tracer("test").start_span("x"),
        )  # type: ignore[arg-type]

    def started(job: str, attempt: int) -> JobStarted:
        return JobStarted(job_id=job, tenant="acme", cluster="c2", attempt=attempt, started_at=1.0)

    pool = await create_pool(await fresh_database("migration-first-starts"), max_size=1)
    statements: list[str] = []
    try:
        async with transaction(pool) as conn:
            await moves.plan(
                conn,
                migration_id="m:1",
                job_id="m",
                tenant="acme",
                cause="drain",
                state="started",
                from_cluster="c1",
                from_attempt=1,
                steps=10,
                why="drained",
                trace_context={},
            )
            await _placed(conn, ("m", 2, "c2"))
        service = MigrationService(SimpleNamespace(db=pool, publisher=None, stats={}))  # type: ignore[arg-type]

        def logged(q: Any) -> None:
            statements.append(q.query)

        async with pool.acquire() as conn:  # the pool's one connection
            conn.add_query_logger(logged)
        first = await service.on_job_events([delivery(i, started(f"f{i}", 1)) for i in range(50)])
        statements_for_first = len(statements)
        second = await service.on_job_events([delivery(60, started("f0", 1)), delivery(61, started("m", 2))])
        async with pool.acquire() as conn:
            conn.remove_query_logger(logged)
        row = await pool.fetchrow("SELECT state, to_cluster FROM migrations WHERE migration_id = 'm:1'")
    finally:
        await pool.close()
    assert first == [None] * 50 and second == [None, None]
    assert statements_for_first == 0
    assert row is not None and (row["state"], row["to_cluster"]) == ("completed", "c2")
