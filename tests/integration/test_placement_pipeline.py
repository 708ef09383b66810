"""The placement pipeline on real NATS and PostgreSQL: the next batch decides while this one writes.

Two submission batches are handed to a leading :class:`PlacementService` at once, as its
submissions consumer does (``pipeline=3``); the first batch's write is held until the second
has decided (on top of the first's placements), so the overlap is certain. When the first
batch's write then fails, both batches must be rolled back and answered with a retryable error
(the consumer naks them): nothing stored, nothing left in memory, and the same messages
delivered again are each placed exactly once. When nothing fails, the pipelined batches decide
exactly what the same batches decide one after the other. Batches claim and insert before they
wait for the lock, in the order they were handed over, and take the lock in that order too.
"""

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import asyncpg
import pytest
from opentelemetry import trace
from opentelemetry.context import Context

from loom.bus import Delivery
from loom.errors import LoomError
from loom.model.topology import load_topology
from loom.runtime.service import ServiceContext, close_context, open_context
from loom.sim.engine import platform_from_topology
from loom.store import fence
from loom.store import jobs as repo
from loom.store.pool import transaction
from loom_proto import subjects
from loom_proto.codec import encode
from loom_proto.jobs import JobSubmitted, Resources, Work
from loom_services.placement.service import PlacementService

TOPOLOGY = load_topology("small")
PLATFORM = platform_from_topology(TOPOLOGY)
BATCH = 20


async def leading_service(ctx: ServiceContext) -> PlacementService:
    """A placement service leading the global shard of a fresh database with the small platform."""
    async with transaction(ctx.db) as conn:
        await repo.upsert_nodes(conn, 1, PLATFORM.nodes)
    assert await fence.claim(ctx.db, "global", 1, "pipeline-test")
    svc = PlacementService(ctx, topology=TOPOLOGY, economics=PLATFORM.economics, settle_s=0.0)
    svc.token = 1
    svc.held = {"global": 1}
    await svc.load()
    svc.settled_at = float("-inf")
    return svc


@pytest.fixture
async def services(
    nats_url: str, fresh_database: Callable[..., Awaitable[str]]
) -> AsyncIterator[Callable[[], Awaitable[PlacementService]]]:
    """Makes leading placement services, each on a database of its own."""
    made: list[ServiceContext] = []

    async def make() -> PlacementService:
        ctx = await open_context(
            "placement-pipeline", nats_url=nats_url, database_url=await fresh_database("pipeline")
        )
        made.append(ctx)
        return await leading_service(ctx)

    yield make
    for ctx in made:
        await close_context(ctx)


def batch(prefix: str, first: int) -> list[Delivery[bytes]]:
    """A batch of one-GPU submissions as the consumer hands them over."""
    out = []
    for i in range(first, first + BATCH):
        job = JobSubmitted(
            job_id=f"{prefix}-{i}",
            tenant="t1",
            task_type=("training_compute", "inference", "training_memory")[i % 3],
            resources=Resources(gpus=1),
            work=Work(steps=100, step_time_s=3600.0),
            submitted_at=1.0 + i,
        )
        out.append(submission(job, i + 1))
    return out


def submission(job: JobSubmitted, seq: int) -> Delivery[bytes]:
    """``job``'s submission as the consumer hands it over (stream sequence ``seq``)."""
    return Delivery(
        msg=None,  # type: ignore[arg-type]  # the handler never touches the raw message
        subject=subjects.job_submitted(job.tenant),
        message=encode(job),
        headers={},
        msg_id=f"{job.job_id}:submit",
        num_delivered=1,
        stream_seq=seq,
        span=trace.INVALID_SPAN,
        context=Context(),
    )


def hold_first_write(svc: PlacementService, monkeypatch: pytest.MonkeyPatch, *, fail: bool) -> dict[str, int]:
    """Hold the first batch's write (reservations and all) until the second batch has decided,
    on top of the first one's placements, and waits for its turn to write; then fail that write
    (a statement timeout: a retryable database error) when ``fail``. Returns call counts.

    The second batch must not have written anything by then: its reservations, on the nodes the
    first one reserves too, would block the first batch's while it waits for the first to end."""
    second_waits = asyncio.Event()
    counts = {"writes": 0, "turns": 0}
    turn = svc._turn
    write = repo.apply_cycle

    async def turning(b: Any) -> None:
        counts["turns"] += 1
        if counts["turns"] == 2:
            second_waits.set()
        await turn(b)

    async def held(conn: asyncpg.Connection, **kwargs: Any) -> None:
        counts["writes"] += 1
        if counts["writes"] == 1:
            await asyncio.wait_for(second_waits.wait(), timeout=20)
            if fail:
                await conn.execute("SET LOCAL statement_timeout = 1")
                await conn.execute("SELECT pg_sleep(1)")
        await write(conn, **kwargs)

    monkeypatch.setattr(svc, "_turn", turning)
    monkeypatch.setattr(repo, "apply_cycle", held)
    return counts


async def both(
    svc: PlacementService, first: list[Delivery[bytes]], second: list[Delivery[bytes]]
) -> list[Any]:
    """Hand both batches over at once, the first one first (as the pipelined consumer does)."""
    one = asyncio.create_task(svc.on_submitted(first))
    await asyncio.sleep(0)  # the first handler takes the lock before the second asks for it
    two = asyncio.create_task(svc.on_submitted(second))
    return list(await asyncio.wait_for(asyncio.gather(one, two), timeout=30))


async def placements(pool: asyncpg.Pool) -> dict[str, tuple[str, tuple[tuple[str, int], ...]]]:
    rows = await pool.fetch(
        """SELECT j.job_id, j.cluster, array_agg(r.node ORDER BY r.node) AS nodes,
                  array_agg(r.gpus ORDER BY r.node) AS gpus
           FROM jobs j JOIN reservations r ON r.job_id = j.job_id AND r.attempt = j.attempt
           WHERE j.state = 'placed' GROUP BY j.job_id, j.cluster"""
    )
    return {r["job_id"]: (r["cluster"], tuple(zip(r["nodes"], r["gpus"], strict=True))) for r in rows}


async def test_a_write_failing_mid_pipeline_discards_both_batches_and_redelivery_places_each_job_once(
    services: Callable[[], Awaitable[PlacementService]], monkeypatch: pytest.MonkeyPatch
) -> None:
    svc = await services()
    pool = svc.pool
    prefix = f"p{uuid.uuid4().hex[:6]}"
    first, second = batch(prefix, 0), batch(prefix, BATCH)
    counts = hold_first_write(svc, monkeypatch, fail=True)

    outcomes = await both(svc, first, second)

    # Both batches were decided, the second on top of the first, and both answered with an error
    # the consumer naks (retryable), never acked or dead-lettered.
    assert counts["turns"] == 2
    assert svc.stats["pipeline"]["overlapped"] >= 1
    assert svc.stats["pipeline"]["discarded"] == 1
    for result in outcomes:
        assert len(result) == BATCH
        assert all(isinstance(o, LoomError) and not o.non_retryable for o in result), result
    # Nothing stored: no job, claim, reservation, decision or message; no GPU promised.
    assert await pool.fetchval("SELECT count(*) FROM jobs") == 0
    assert await pool.fetchval("SELECT count(*) FROM inbox") == 0
    assert await pool.fetchval("SELECT count(*) FROM reservations") == 0
    assert await pool.fetchval("SELECT count(*) FROM decisions") == 0
    assert await pool.fetchval("SELECT count(*) FROM outbox") == 0
    assert await pool.fetchval("SELECT coalesce(sum(gpus_reserved), 0) FROM node_allocations") == 0
    # Nothing kept in memory: no run, nothing pending, nothing queued, every GPU free again.
    assert svc.book.runs == {}
    assert svc.book.pending == {}
    assert svc.queue == {}
    assert sum(c.gpus_reserved for c in svc.book.nodes.values()) == 0
    assert svc.book.snapshot(0.0).running == []

    # The consumer delivers both batches again: each job is placed exactly once.
    monkeypatch.undo()
    again = await both(svc, first, second)
    assert again == [[None] * BATCH, [None] * BATCH]
    placed = await placements(pool)
    ids = {f"{prefix}-{i}" for i in range(2 * BATCH)}
    assert set(placed) == ids
    assert all(sum(g for _, g in nodes) == 1 for _, nodes in placed.values())
    for kind in ("submitted", "placed"):
        events = await pool.fetch(
            "SELECT job_id, count(*) AS n FROM job_events WHERE kind = $1 GROUP BY job_id", kind
        )
        assert {r["job_id"]: r["n"] for r in events} == dict.fromkeys(ids, 1), kind
    assert await pool.fetchval("SELECT count(*) FROM decisions") == 2 * BATCH
    # The store's book and the service's agree node by node, and no node is over-promised.
    rows = await pool.fetch("SELECT node, gpus_total, gpus_reserved FROM node_allocations")
    assert all(r["gpus_reserved"] <= r["gpus_total"] for r in rows)
    assert sum(r["gpus_reserved"] for r in rows) == 2 * BATCH
    assert {r["node"]: r["gpus_reserved"] for r in rows} == {
        n: c.gpus_reserved for n, c in svc.book.nodes.items()
    }
    assert set(svc.book.runs) == ids
    assert svc.book.pending == {}


async def test_pipelined_batches_decide_what_the_same_batches_decide_one_after_the_other(
    services: Callable[[], Awaitable[PlacementService]], monkeypatch: pytest.MonkeyPatch
) -> None:
    prefix = f"q{uuid.uuid4().hex[:6]}"
    first, second = batch(prefix, 0), batch(prefix, BATCH)

    serial = await services()
    assert await serial.on_submitted(first) == [None] * BATCH
    assert await serial.on_submitted(second) == [None] * BATCH
    assert serial.stats["pipeline"]["overlapped"] == 0

    pipelined = await services()
    hold_first_write(pipelined, monkeypatch, fail=False)
    assert await both(pipelined, first, second) == [[None] * BATCH, [None] * BATCH]
    assert pipelined.stats["pipeline"]["overlapped"] == 1

    expected = await placements(serial.pool)
    assert len(expected) == 2 * BATCH
    assert await placements(pipelined.pool) == expected
    assert pipelined.book.pending == {}


def slow_first_claim(svc: PlacementService, monkeypatch: pytest.MonkeyPatch, delay_s: float) -> list[int]:
    """Slow the claim of batch 0 (of batches made by :func:`batch` from 0, ``BATCH`` apart) by
    ``delay_s``; returns the batch numbers in the order their claims and inserts ended."""
    inserted: list[int] = []
    insert = svc._insert_batch

    async def slow(conn: asyncpg.Connection, accepted: Any, now: float) -> Any:
        which = int(accepted[0][1].job_id.rsplit("-", 1)[1]) // BATCH
        if which == 0:
            await asyncio.sleep(delay_s)
        out = await insert(conn, accepted, now)
        inserted.append(which)
        return out

    monkeypatch.setattr(svc, "_insert_batch", slow)
    return inserted


async def test_batches_are_admitted_while_the_lock_is_held_in_the_order_handed_over(
    services: Callable[[], Awaitable[PlacementService]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch claims and inserts before it waits for the lock (so it admits while another
    decides), after the batch handed over before it has, however slow that one's claim; at most
    ``ADMITTING`` batches hold a connection waiting; the lock is taken in the order handed over."""
    from loom_services.placement import service as placement

    svc = await services()
    prefix = f"o{uuid.uuid4().hex[:6]}"
    batches = [batch(prefix, k * BATCH) for k in range(3)]
    inserted = slow_first_claim(svc, monkeypatch, 0.3)
    await svc.lock.acquire()  # another cycle decides meanwhile
    tasks = []
    for b in batches:
        tasks.append(asyncio.create_task(svc.on_submitted(b)))
        await asyncio.sleep(0)
    for _ in range(100):
        if len(inserted) == placement.ADMITTING:
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.2)
    assert inserted == [0, 1], "two batches admitted, in order, while the lock was held; the third waits"
    svc.lock.release()
    assert await asyncio.wait_for(asyncio.gather(*tasks), timeout=30) == [[None] * BATCH] * 3
    assert inserted == [0, 1, 2]

    await asyncio.gather(*svc._sending)
    timings = svc.job_timings_of(prefix)
    assert len(timings) == 3 * BATCH
    cycle = {
        k: {timings[f"{prefix}-{i}"]["cycle"] for i in range(k * BATCH, (k + 1) * BATCH)} for k in range(3)
    }
    assert all(len(c) == 1 for c in cycle.values()), "one lock taken per batch"
    assert min(cycle[0]) < min(cycle[1]) < min(cycle[2]), "the lock taken in the order handed over"
    assert len(await placements(svc.pool)) == 3 * BATCH


async def test_a_batch_that_gives_up_before_its_claim_lets_the_next_one_claim_only_after_the_one_before(
    services: Callable[[], Awaitable[PlacementService]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The middle of three batches is cancelled while it waits for its turn to claim: the third
    still claims and takes the lock after the first (the chain skips the middle one, nobody
    overtakes), and nothing of the middle one is stored."""
    svc = await services()
    prefix = f"m{uuid.uuid4().hex[:6]}"
    batches = [batch(prefix, k * BATCH) for k in range(3)]
    inserted = slow_first_claim(svc, monkeypatch, 0.5)
    tasks = []
    for b in batches:
        tasks.append(asyncio.create_task(svc.on_submitted(b)))
        await asyncio.sleep(0)
    await asyncio.sleep(0.1)
    tasks[1].cancel()
    outcomes = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=30)
    assert isinstance(outcomes[1], asyncio.CancelledError)
    assert outcomes[0] == outcomes[2] == [None] * BATCH
    assert inserted == [0, 2], "the third batch claimed after the first, the middle one never"
    await asyncio.gather(*svc._sending)
    timings = svc.job_timings_of(prefix)
    assert timings[f"{prefix}-0"]["cycle"] < timings[f"{prefix}-{2 * BATCH}"]["cycle"]
    placed = await placements(svc.pool)
    assert len(placed) == 2 * BATCH and not any(f"{prefix}-{i}" in placed for i in range(BATCH, 2 * BATCH))


async def test_one_submission_admitted_by_two_batches_at_once_is_placed_once_without_a_stall(
    services: Callable[[], Awaitable[PlacementService]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same messages in two batches handed over together (the global shard and a territory it
    holds both admit a submission): the second claims after the first has, waits in the database
    for the first to commit, and finds them handled. Were the second to claim first, the first
    would wait in the database for the second, which waits for the first to take the lock: a stall
    until the statement timeout (30 s)."""
    svc = await services()
    prefix = f"d{uuid.uuid4().hex[:6]}"
    same = batch(prefix, 0)
    insert = svc._insert_batch
    calls = 0

    async def slow_first(conn: asyncpg.Connection, accepted: Any, now: float) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            await asyncio.sleep(0.3)  # the first batch's claim comes late
        return await insert(conn, accepted, now)

    monkeypatch.setattr(svc, "_insert_batch", slow_first)
    one = asyncio.create_task(svc.on_submitted(same))
    await asyncio.sleep(0)
    two = asyncio.create_task(svc.on_submitted(same))
    assert await asyncio.wait_for(asyncio.gather(one, two), timeout=10) == [[None] * BATCH] * 2
    assert len(await placements(svc.pool)) == BATCH
    events = await svc.pool.fetchval(
        "SELECT count(*) FROM job_events WHERE job_id LIKE $1 AND kind = 'placed'", f"{prefix}-%"
    )
    assert events == BATCH, "each job placed once"


async def test_a_health_request_naming_job_timings_gets_each_admitted_jobs_path_in_order(
    services: Callable[[], Awaitable[PlacementService]],
) -> None:
    svc = await services()
    prefix = f"t{uuid.uuid4().hex[:6]}"
    assert await svc.on_submitted(batch(prefix, 0)) == [None] * BATCH
    await asyncio.gather(*svc._sending)  # the placed events handed to NATS
    health = subjects.service_health(svc.ctx.name)

    plain = json.loads((await svc.ctx.nc.request(health, b"", timeout=10)).data)
    assert "job_timings" not in plain, "only a request that names the section gets it"
    reply = await svc.ctx.nc.request(health, f"job_timings:{prefix}".encode(), timeout=10)
    timings = json.loads(reply.data)["job_timings"]

    assert set(timings) == {f"{prefix}-{i}" for i in range(BATCH)}
    for stamps in timings.values():
        # Handed over, claimed and inserted, the lock taken, decided, committed, sent: in that order.
        path = [stamps[k] for k in ("handled", "admitted", "cycle", "decided", "committed", "sent")]
        assert path == sorted(path)
        assert path[0] > 0
    other = await svc.ctx.nc.request(health, b"job_timings:nobody-", timeout=10)
    assert json.loads(other.data)["job_timings"] == {}


async def test_one_job_id_twice_in_a_batch_is_admitted_once_and_the_other_rejected_as_a_duplicate(
    services: Callable[[], Awaitable[PlacementService]],
) -> None:
    """Two messages of one batch (distinct message ids) carry the same job id: the first is the
    job, placed once; the second is answered as a duplicate, never a second admission."""
    svc = await services()
    prefix = f"d{uuid.uuid4().hex[:6]}"
    deliveries = batch(prefix, 0)[:3]
    again = deliveries[0]
    deliveries.append(
        Delivery(
            msg=None,  # type: ignore[arg-type]
            subject=again.subject,
            message=again.message,
            headers={},
            msg_id=f"{prefix}-0:submit-again",
            num_delivered=1,
            stream_seq=99,
            span=trace.INVALID_SPAN,
            context=Context(),
        )
    )

    assert await svc.on_submitted(deliveries) == [None] * 4
    await asyncio.gather(*svc._sending)

    pool = svc.pool
    assert await pool.fetchval("SELECT count(*) FROM jobs") == 3
    assert await pool.fetchval("SELECT count(*) FROM inbox") == 4, (
        "both messages claimed: neither redelivered"
    )
    assert await pool.fetchval("SELECT count(*) FROM reservations WHERE job_id = $1", f"{prefix}-0") == 1
    assert set(svc.book.runs) | set(svc.book.pending) == {f"{prefix}-{i}" for i in range(3)}
    rejected = await pool.fetch(
        "SELECT subject FROM outbox WHERE msg_id LIKE $1",
        f"{prefix}-0:rejected:duplicate:%",
    )
    assert len(rejected) == 1


async def test_the_same_message_twice_in_a_batch_is_admitted_once_and_answered_once(
    services: Callable[[], Awaitable[PlacementService]],
) -> None:
    """A redelivery inside one batch (the same message id twice) is no duplicate submission: the
    job is placed once and no rejection is sent for its own message."""
    svc = await services()
    prefix = f"r{uuid.uuid4().hex[:6]}"
    deliveries = batch(prefix, 0)[:2]
    deliveries.append(deliveries[0])

    assert await svc.on_submitted(deliveries) == [None] * 3
    await asyncio.gather(*svc._sending)

    pool = svc.pool
    assert await pool.fetchval("SELECT count(*) FROM jobs") == 2
    assert await pool.fetchval("SELECT count(*) FROM reservations WHERE job_id = $1", f"{prefix}-0") == 1
    assert await pool.fetchval("SELECT count(*) FROM outbox WHERE msg_id LIKE '%:rejected:%'") == 0
