"""loom.store against a real Postgres (and NATS for the outbox): migrations, inbox, outbox, capacity book."""

import asyncio
import math
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict
from typing import Any

import asyncpg
import msgspec
import pytest
from nats.aio.client import Client
from nats.js.api import StreamConfig
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from waiting import until

from loom.bus import Publisher, connect, ensure_streams
from loom.model.capacity import NodeCapacity
from loom.model.ledger import LedgerCluster, LedgerNode
from loom.model.scu import DecayLearner, TrustTracker
from loom.net import LinkEvent
from loom.store import inbox, jobs, ledger, links, outbox
from loom.store.migrations import available, migrate, migrate_url
from loom.store.pool import ConflictError, StoreError, create_pool, map_error, redact, transaction, with_retry
from loom.telemetry import reset_for_tests, setup_telemetry
from loom_proto import JobStarted
from loom_proto import subjects as s
from loom_proto.clusters import AcceleratorProfile

FreshDatabase = Callable[..., Awaitable[str]]


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="module")
async def pool(fresh_database: FreshDatabase) -> AsyncIterator[asyncpg.Pool]:
    """A migrated database of this module's own; 25 connections so races really run in parallel."""
    db = await create_pool(await fresh_database("store"), min_size=1, max_size=25)
    yield db
    await db.close()


@pytest.fixture(scope="module")
async def nc(nats_url: str) -> AsyncIterator[Client]:
    client = await connect(nats_url, "test-store")
    await ensure_streams(client.jetstream())
    yield client
    await client.close()


# -- migrations --------------------------------------------------------------------------------------


def test_shipped_migrations_are_numbered_from_one_ascending_without_repeats() -> None:
    # Numbers are handed out per piece of work, so a branch may hold a later number before an
    # earlier one lands (loom.store.migrations.available allows the gap, never a repeat).
    versions = [m.version for m in available()]
    assert versions == sorted(set(versions))
    assert versions[0] == 1


async def test_migrating_twice_applies_each_migration_once(fresh_database: FreshDatabase) -> None:
    url = await fresh_database("migrate", migrate=False)
    conn = await asyncpg.connect(url)
    try:
        everything = [m.version for m in available()]
        assert await migrate(conn) == everything
        assert await migrate(conn) == []
        rows = await conn.fetch("SELECT version FROM schema_migrations ORDER BY version")
        assert [r["version"] for r in rows] == everything
    finally:
        await conn.close()


async def test_concurrent_migrations_from_three_connections_apply_once(fresh_database: FreshDatabase) -> None:
    url = await fresh_database("migrate_race", migrate=False)
    results = await asyncio.gather(*(migrate_url(url) for _ in range(3)))
    applied = sorted(v for result in results for v in result)
    assert applied == [m.version for m in available()], f"applied {results}"
    conn = await asyncpg.connect(url)
    try:
        assert await conn.fetchval("SELECT count(*) FROM schema_migrations") == len(available())
        assert await conn.fetchval("SELECT to_regclass('public.job_events') IS NOT NULL")
        held = await conn.fetchval(
            """SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'
               AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"""
        )
        assert held == 0, "the migration lock is released"
    finally:
        await conn.close()


# -- inbox -------------------------------------------------------------------------------------------


async def test_inbox_claims_a_message_once_per_consumer(pool: asyncpg.Pool) -> None:
    msg_id = unique("m")
    async with transaction(pool) as conn:
        assert await inbox.claim(conn, "placement", msg_id)
    async with transaction(pool) as conn:
        assert not await inbox.claim(conn, "placement", msg_id), "a redelivery finds the claim"
        assert await inbox.claim(conn, "metrics", msg_id), "another consumer handles it on its own"


async def test_an_inbox_claim_rolls_back_with_its_transaction(pool: asyncpg.Pool) -> None:
    msg_id = unique("m")
    with pytest.raises(RuntimeError):
        async with transaction(pool) as conn:
            assert await inbox.claim(conn, "placement", msg_id)
            raise RuntimeError("handler failed after claiming")
    async with transaction(pool) as conn:
        assert await inbox.claim(conn, "placement", msg_id), "the redelivery is handled afresh"


async def test_inbox_claim_many_returns_only_the_new_ids(pool: asyncpg.Pool) -> None:
    a, b, c = unique("a"), unique("b"), unique("c")
    async with transaction(pool) as conn:
        assert await inbox.claim_many(conn, "placement", [a, b]) == {a, b}
    async with transaction(pool) as conn:
        assert await inbox.claim_many(conn, "placement", [a, b, c]) == {c}
        assert await inbox.claim_many(conn, "placement", []) == set()


# -- outbox ------------------------------------------------------------------------------------------


def started(tenant: str, n: int) -> JobStarted:
    return JobStarted(job_id=f"job-{n}", tenant=tenant, cluster="c1", started_at=1_700_000_000.0 + n)


async def subject_count(nc: Client, subject: str) -> int:
    info = await nc.jetstream().stream_info("JOBS", subjects_filter=subject)
    return (info.state.subjects or {}).get(subject, 0)


async def add_messages(
    pool: asyncpg.Pool, producer: str, tenant: str, count: int
) -> list[outbox.OutboxMessage]:
    messages = [
        outbox.message(s.job_event("started", tenant), started(tenant, n), f"{tenant}:job-{n}:started")
        for n in range(count)
    ]
    async with transaction(pool) as conn:
        await outbox.add(conn, producer, messages)
    return messages


async def stored_msg_ids(nc: Client, subject: str, count: int) -> list[str]:
    js = nc.jetstream()
    info = await js.stream_info("JOBS", subjects_filter=subject)
    assert (info.state.subjects or {}).get(subject, 0) == count
    ids = []
    seq = 0
    for _ in range(count):
        msg = await js.get_msg("JOBS", seq + 1, subject=subject, next=True)
        seq = msg.seq
        ids.append((msg.headers or {})["Nats-Msg-Id"])
    return ids


async def test_outbox_flush_publishes_each_message_once_with_its_id(pool: asyncpg.Pool, nc: Client) -> None:
    producer, tenant = unique("producer"), unique("t")
    messages = await add_messages(pool, producer, tenant, 5)
    relay = outbox.OutboxRelay(pool, Publisher(nc), producer)

    assert await relay.flush() == 5
    assert await relay.flush() == 0, "a second flush finds nothing pending"

    subject = s.job_event("started", tenant)
    assert sorted(await stored_msg_ids(nc, subject, 5)) == sorted(m.msg_id for m in messages)
    pending = await pool.fetchval(
        "SELECT count(*) FROM outbox WHERE producer = $1 AND published_at IS NULL", producer
    )
    assert pending == 0
    assert relay.published == 5


async def test_outbox_publishes_after_a_crash_between_commit_and_flush(
    pool: asyncpg.Pool, nc: Client
) -> None:
    producer, tenant = unique("producer"), unique("t")
    # The process that committed these rows died before flushing: its relay never ran.
    await add_messages(pool, producer, tenant, 3)

    restarted = outbox.OutboxRelay(pool, Publisher(nc), producer)
    assert await restarted.flush() == 3
    assert await restarted.flush() == 0
    assert await subject_count(nc, s.job_event("started", tenant)) == 3


async def test_a_background_flush_leaves_rows_younger_than_its_age_to_the_fast_path(
    pool: asyncpg.Pool, nc: Client
) -> None:
    producer, tenant = unique("producer"), unique("t")
    await add_messages(pool, producer, tenant, 2)
    relay = outbox.OutboxRelay(pool, Publisher(nc), producer)
    assert await relay.flush(min_age_s=60.0) == 0, "just committed: publish_now's to send"
    await pool.execute(
        "UPDATE outbox SET created_at = now() - interval '2 minutes' WHERE producer = $1", producer
    )
    assert await relay.flush(min_age_s=60.0) == 2, "left over: the flush sends them"
    assert await subject_count(nc, s.job_event("started", tenant)) == 2


async def test_a_background_round_with_nothing_old_does_not_wait_for_the_fast_paths_lock(
    pool: asyncpg.Pool, nc: Client
) -> None:
    producer, tenant = unique("producer"), unique("t")
    await add_messages(pool, producer, tenant, 2)
    relay = outbox.OutboxRelay(pool, Publisher(nc), producer)
    async with relay._lock:  # the fast path (publish_now) is sending a committed batch
        # Only young rows (publish_now's): the round finds nothing without taking the lock.
        assert await asyncio.wait_for(relay.flush(min_age_s=60.0), timeout=10) == 0
        await pool.execute(
            "UPDATE outbox SET created_at = now() - interval '2 minutes' WHERE producer = $1", producer
        )
        # Rows left over: this round reads and sends them under the lock, so it waits for it.
        round_ = asyncio.create_task(relay.flush(min_age_s=60.0))
        done, _ = await asyncio.wait([round_], timeout=0.5)
        assert not done
    assert await asyncio.wait_for(round_, timeout=10) == 2
    assert await subject_count(nc, s.job_event("started", tenant)) == 2


async def test_outbox_republish_after_a_lost_mark_is_absorbed_by_dedup(
    pool: asyncpg.Pool, nc: Client
) -> None:
    producer, tenant = unique("producer"), unique("t")
    await add_messages(pool, producer, tenant, 3)
    relay = outbox.OutboxRelay(pool, Publisher(nc), producer)
    assert await relay.flush() == 3
    # Published, but the process died before the mark committed.
    await pool.execute("UPDATE outbox SET published_at = NULL WHERE producer = $1", producer)

    assert await outbox.OutboxRelay(pool, Publisher(nc), producer).flush() == 3
    assert await subject_count(nc, s.job_event("started", tenant)) == 3, "the stream stores each id once"


async def test_outbox_keeps_the_first_message_of_an_id_and_flushes_only_its_producer(
    pool: asyncpg.Pool, nc: Client
) -> None:
    mine, theirs, tenant = unique("producer"), unique("producer"), unique("t")
    subject = s.job_event("started", tenant)
    first = outbox.message(subject, started(tenant, 1), f"{tenant}:same")
    second = outbox.message(subject, started(tenant, 2), f"{tenant}:same")
    async with transaction(pool) as conn:
        await outbox.add(conn, mine, [first])
        await outbox.add(conn, mine, [second])
        await outbox.add(conn, theirs, [outbox.message(subject, started(tenant, 3), f"{tenant}:theirs")])

    assert await outbox.OutboxRelay(pool, Publisher(nc), mine).flush() == 1
    stored = await nc.jetstream().get_last_msg("JOBS", subject)
    assert stored.data == first.payload
    assert await subject_count(nc, subject) == 1, "the other producer's row waits for its own relay"


async def stream_msg_ids(nc: Client, stream: str) -> list[str]:
    """The ids of a stream's messages, in the order it stored them."""
    js = nc.jetstream()
    count = (await js.stream_info(stream)).state.messages
    return [((await js.get_msg(stream, seq)).headers or {})["Nats-Msg-Id"] for seq in range(1, count + 1)]


async def commit(
    pool: asyncpg.Pool, producer: str, message: outbox.OutboxMessage
) -> list[outbox.OutboxMessage]:
    async with transaction(pool) as conn:
        await outbox.add(conn, producer, [message])
    return [message]


def _order_case() -> tuple[str, str, str, str]:
    """A producer of its own, a token, the stream its rows go to (made by :func:`_order_stream`,
    when the test says) and one job's subject in it."""
    token = uuid.uuid4().hex[:10]
    return unique("producer"), token, f"ORDER_{token}", f"ordertest.{token}.job-1"


async def _order_stream(nc: Client, token: str) -> None:
    await nc.jetstream().add_stream(StreamConfig(name=f"ORDER_{token}", subjects=[f"ordertest.{token}.>"]))


async def test_after_a_failed_fast_path_later_commits_wait_for_the_relay_to_send_it_first(
    pool: asyncpg.Pool, nc: Client
) -> None:
    # A job's placed event failed on its fast path (no stream took it: a leader election, say);
    # the job's next event, committed after, went out on its own fast path before the relay sent
    # the placed one, so consumers saw the job's events out of order (a review).
    producer, token, stream, subject = _order_case()
    relay = outbox.OutboxRelay(pool, Publisher(nc, timeout_s=2.0), producer)
    assert await relay.flush() == 0  # start-up: nothing left over, the fast path may go
    placed = outbox.message(subject, started(token, 1), f"{token}:placed")
    assert await relay.publish_now(await commit(pool, producer, placed)) == 0, "no stream yet"
    await _order_stream(nc, token)
    try:
        finished = outbox.message(subject, started(token, 2), f"{token}:finished")
        await relay.publish_now(await commit(pool, producer, finished))
        await relay.flush()  # the relay's round
        assert await stream_msg_ids(nc, stream) == [placed.msg_id, finished.msg_id]
        # Caught up: the fast path sends the next commit itself again.
        later = outbox.message(subject, started(token, 3), f"{token}:later")
        assert await relay.publish_now(await commit(pool, producer, later)) == 1
        assert await stream_msg_ids(nc, stream) == [placed.msg_id, finished.msg_id, later.msg_id]
    finally:
        await nc.jetstream().delete_stream(stream)


async def test_a_row_that_keeps_failing_holds_the_fast_path_back_only_for_a_few_rounds(
    pool: asyncpg.Pool, nc: Client
) -> None:
    # A row no stream takes failed at every round; the relay's "caught up" needed none pending at
    # all, so the fast path stood aside for good and every later commit waited for a relay round
    # (a review). Refused STUCK_ROUNDS times while other rows went through (and for stuck_after_s,
    # 0 here) it no longer counts; it is still retried.
    producer, token, stream, subject = _order_case()
    await _order_stream(nc, token)
    relay = outbox.OutboxRelay(pool, Publisher(nc, timeout_s=2.0), producer, stuck_after_s=0.0)
    try:
        assert await relay.flush() == 0
        poison = outbox.message(f"nostream.{token}", started(token, 0), f"{token}:poison")
        assert await relay.publish_now(await commit(pool, producer, poison)) == 0
        sent_fast, good = [], []
        for n in range(1, 7):
            m = outbox.message(subject, started(token, n), f"{token}:{n}")
            good.append(m.msg_id)
            sent_fast.append(await relay.publish_now(await commit(pool, producer, m)))
            await relay.flush()
        assert sent_fast[:2] == [0, 0]  # behind the failed row, through the relay, in order
        assert sent_fast[-2:] == [1, 1]  # the failing row stuck: the fast path goes again
        assert await stream_msg_ids(nc, stream) == good
        pending = await pool.fetchval(
            "SELECT count(*) FROM outbox WHERE producer = $1 AND published_at IS NULL", producer
        )
        assert pending == 1  # the failing row is kept, not dropped
    finally:
        await nc.jetstream().delete_stream(stream)


async def test_a_stuck_row_is_retried_at_growing_intervals_not_at_every_round(
    pool: asyncpg.Pool, nc: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before, every relay round (each second) sent a stuck row again and logged its failure.
    producer, token, stream, subject = _order_case()
    await _order_stream(nc, token)
    relay = outbox.OutboxRelay(pool, Publisher(nc, timeout_s=2.0), producer, stuck_after_s=0.0)
    clock = [1_000.0]
    monkeypatch.setattr(outbox.time, "monotonic", lambda: clock[0])
    try:
        poison = outbox.message(f"nostream.{token}", started(token, 0), f"{token}:poison")
        await relay.publish_now(await commit(pool, producer, poison))
        for n in range(1, 4):  # refused while the rows beside it go through: stuck after 3
            m = outbox.message(subject, started(token, n), f"{token}:{n}")
            await relay.publish_now(await commit(pool, producer, m))
            await relay.flush()
        assert relay._stuck(poison.msg_id)

        sent: list[str] = []
        send = relay._send

        async def counted(messages: Any) -> Any:
            sent.extend(m.msg_id for m in messages)
            return await send(messages)

        monkeypatch.setattr(relay, "_send", counted)
        await relay.flush()
        await relay.flush()
        assert poison.msg_id not in sent  # not due: left out of both flushes
        waits = []
        for n in range(1, 5):
            due, wait = relay._retry_at[poison.msg_id]
            assert due - clock[0] == wait
            waits.append(wait)
            clock[0] = due - 0.01
            await relay.flush()
            assert sent.count(poison.msg_id) == n - 1  # not yet
            clock[0] = due
            await relay.flush()
            assert sent.count(poison.msg_id) == n  # due: sent once more, refused again
        assert waits == [1.0, 2.0, 4.0, 8.0]
        m = outbox.message(subject, started(token, 9), f"{token}:after")
        assert await relay.publish_now(await commit(pool, producer, m)) == 1  # the fast path goes
        assert (
            await pool.fetchval(
                "SELECT count(*) FROM outbox WHERE producer = $1 AND published_at IS NULL", producer
            )
            == 1
        )  # kept, still retried
    finally:
        await nc.jetstream().delete_stream(stream)


async def test_an_outage_never_makes_a_row_stuck_so_later_commits_never_overtake_it(
    pool: asyncpg.Pool, nc: Client
) -> None:
    # A review: with "stuck" meaning three failed sends in a row, a few relay rounds of an outage
    # (no stream for the subject, as in a leader election) made the pending row stuck, the fast
    # path went again and the first commit after the recovery overtook it. A row refused while no
    # other row goes through says nothing of itself.
    producer, token, stream, subject = _order_case()
    relay = outbox.OutboxRelay(pool, Publisher(nc, timeout_s=2.0), producer, stuck_after_s=0.0)
    assert await relay.flush() == 0
    placed = outbox.message(subject, started(token, 1), f"{token}:placed")
    assert await relay.publish_now(await commit(pool, producer, placed)) == 0  # the outage
    for _ in range(4):
        await relay.flush()
    assert relay.behind
    await _order_stream(nc, token)
    try:
        finished = outbox.message(subject, started(token, 2), f"{token}:finished")
        assert await relay.publish_now(await commit(pool, producer, finished)) == 0  # left to the relay
        await relay.flush()
        assert await stream_msg_ids(nc, stream) == [placed.msg_id, finished.msg_id]
    finally:
        await nc.jetstream().delete_stream(stream)


async def test_a_chunk_of_failing_rows_does_not_keep_the_rows_behind_it_from_the_bus(
    pool: asyncpg.Pool, nc: Client
) -> None:
    # A review: a flush read the oldest `batch` rows only; with that many failing rows at the head
    # the rows behind them were never sent, yet the fast path was let go again.
    producer, token, stream, subject = _order_case()
    relay = outbox.OutboxRelay(pool, Publisher(nc, timeout_s=2.0), producer, batch=2, stuck_after_s=0.0)
    await _order_stream(nc, token)
    try:
        assert await relay.flush() == 0
        for n in range(2):
            poison = outbox.message(f"nostream.{token}", started(token, n), f"{token}:poison{n}")
            await relay.publish_now(await commit(pool, producer, poison))
        for _ in range(3):
            await relay.flush()
        good = []
        for n in range(10, 13):
            m = outbox.message(subject, started(token, n), f"{token}:{n}")
            good.append(m.msg_id)
            await relay.publish_now(await commit(pool, producer, m))
            await relay.flush()
        assert await stream_msg_ids(nc, stream) == good
    finally:
        await nc.jetstream().delete_stream(stream)


async def test_the_background_relay_sends_what_the_fast_path_left_it_without_waiting_for_its_age(
    pool: asyncpg.Pool, nc: Client
) -> None:
    producer, token, stream, subject = _order_case()
    relay = outbox.OutboxRelay(pool, Publisher(nc, timeout_s=2.0), producer)
    assert await relay.flush() == 0
    placed = outbox.message(subject, started(token, 1), f"{token}:placed")
    assert await relay.publish_now(await commit(pool, producer, placed)) == 0, "no stream yet"
    await _order_stream(nc, token)
    stopping = asyncio.Event()
    # Rounds of old rows only (a minute): what the fast path left must not wait that long.
    background = asyncio.create_task(relay.run(stopping, idle_s=0.2, min_age_s=60.0))
    try:
        finished = outbox.message(subject, started(token, 2), f"{token}:finished")
        await relay.publish_now(await commit(pool, producer, finished))

        async def both() -> bool:
            return bool((await nc.jetstream().stream_info(stream)).state.messages >= 2)

        await until(both, 10, "the relay to send both rows")
        assert await stream_msg_ids(nc, stream) == [placed.msg_id, finished.msg_id]
    finally:
        stopping.set()
        relay.kick()
        await asyncio.wait_for(background, timeout=10)
        await nc.jetstream().delete_stream(stream)


async def test_outbox_rows_the_bus_refuses_for_good_are_set_aside_and_hold_back_nothing(
    pool: asyncpg.Pool, nc: Client
) -> None:
    # Two rows no resend can publish (over the server's 1 MiB limit) ahead of a good one, in chunks
    # of two: before, each flush read the same head chunk, failed it, and stopped (a review).
    producer, tenant = unique("producer"), unique("t")
    subject = s.job_event("started", tenant)
    big = [outbox.OutboxMessage(f"{tenant}:big-{n}", subject, b"x" * (2 << 20), {}) for n in range(2)]
    good = outbox.message(subject, started(tenant, 1), f"{tenant}:good")
    async with transaction(pool) as conn:
        await outbox.add(conn, producer, big)
        await outbox.add(conn, producer, [good])
    relay = outbox.OutboxRelay(pool, Publisher(nc, timeout_s=1.0), producer, batch=2)
    assert await relay.flush() == 1
    assert relay.set_aside == 2 and relay.published == 1
    assert await subject_count(nc, subject) == 1
    rows = await pool.fetch(
        """SELECT msg_id, published_at IS NOT NULL AS settled, refused FROM outbox
           WHERE producer = $1 ORDER BY id""",
        producer,
    )
    assert [(r["msg_id"], r["settled"]) for r in rows] == [
        (f"{tenant}:big-0", True),
        (f"{tenant}:big-1", True),
        (f"{tenant}:good", True),
    ]
    assert [bool(r["refused"]) for r in rows] == [True, True, False]
    assert "MaxPayload" in rows[0]["refused"]
    assert await relay.flush() == 0  # nothing is pending any more


async def test_an_outbox_message_continues_the_trace_it_was_added_in(pool: asyncpg.Pool, nc: Client) -> None:
    exporter = InMemorySpanExporter()
    setup_telemetry("test-store", exporter=exporter, log_level=None)
    try:
        producer, tenant = unique("producer"), unique("t")
        subject = s.job_event("started", tenant)
        with trace.get_tracer("test").start_as_current_span("decide") as decision:
            message = outbox.message(subject, started(tenant, 1), f"{tenant}:1")
        async with transaction(pool) as conn:
            await outbox.add(conn, producer, [message])
        assert await outbox.OutboxRelay(pool, Publisher(nc), producer).flush() == 1
        stored = await nc.jetstream().get_last_msg("JOBS", subject)
        traceparent = (stored.headers or {})["traceparent"]
        assert traceparent.split("-")[1] == f"{decision.get_span_context().trace_id:032x}"
    finally:
        reset_for_tests()


# -- capacity book -----------------------------------------------------------------------------------


async def add_node(pool: asyncpg.Pool, total: int, *, schedulable: bool = True, version: int = 1) -> str:
    name = unique("node")
    cap = NodeCapacity(
        node=name,
        cluster="c1",
        region="r1",
        zone="z1",
        gpu_model="A100",
        gpus_total=total,
        schedulable=schedulable,
    )
    async with transaction(pool) as conn:
        await jobs.upsert_nodes(conn, version, [cap])
    return name


async def gpus_reserved(pool: asyncpg.Pool, node: str) -> int:
    value = await pool.fetchval("SELECT gpus_reserved FROM node_allocations WHERE node = $1", node)
    assert isinstance(value, int)
    return value


async def try_reserve(pool: asyncpg.Pool, job_id: str, allocations: list[tuple[str, int]]) -> bool:
    try:
        async with transaction(pool) as conn:
            await jobs.reserve(conn, [(job_id, 1, "c1", allocations)])
    except ConflictError:
        return False
    return True


async def test_reserve_never_exceeds_the_total_under_twenty_racing_transactions(pool: asyncpg.Pool) -> None:
    node, total, per_job = await add_node(pool, 16), 16, 2
    gate = asyncio.Event()

    async def contender(i: int) -> bool:
        await gate.wait()
        return await try_reserve(pool, f"race-{node}-{i}", [(node, per_job * 2 if i % 5 == 0 else per_job)])

    tasks = [asyncio.create_task(contender(i)) for i in range(20)]
    gate.set()
    outcomes = await asyncio.gather(*tasks)

    granted = [per_job * 2 if i % 5 == 0 else per_job for i, ok in enumerate(outcomes) if ok]
    assert sum(granted) <= total
    assert total - sum(granted) < per_job, "every refusal was for lack of capacity"
    assert await gpus_reserved(pool, node) == sum(granted)
    rows = await pool.fetchval("SELECT coalesce(sum(gpus), 0) FROM reservations WHERE node = $1", node)
    assert rows == sum(granted), "reservations rows match the book"


async def test_reserve_of_equal_requests_grants_exactly_capacity_over_request(pool: asyncpg.Pool) -> None:
    node = await add_node(pool, 8)
    outcomes = await asyncio.gather(*(try_reserve(pool, f"eq-{node}-{i}", [(node, 2)]) for i in range(20)))
    assert outcomes.count(True) == 8 // 2
    assert await gpus_reserved(pool, node) == 8


async def test_reserve_is_all_or_nothing_across_nodes(pool: asyncpg.Pool) -> None:
    roomy, small = await add_node(pool, 8), await add_node(pool, 2)
    assert not await try_reserve(pool, unique("job"), [(roomy, 4), (small, 4)])
    assert await gpus_reserved(pool, roomy) == 0, "the node that had room gave nothing"
    assert await pool.fetchval("SELECT count(*) FROM reservations WHERE node = $1", roomy) == 0


async def apply_one_placement(pool: asyncpg.Pool, job_id: str, node: str, gpus: int) -> None:
    """A queued job placed on ``node`` with everything a cycle writes, in one statement."""
    async with transaction(pool) as conn:
        await jobs.insert_jobs(conn, [jobs.NewJob(job_id, "acme", b"{}", 1_700_000_000.0, {})])
        await jobs.apply_cycle(
            conn,
            reservations=[(job_id, 1, "c1", [(node, gpus)])],
            confirm_by=[1_700_000_100.0],
            placed=[(job_id, "c1", 1, 1_700_000_001.0, 1)],
            rejected=[],
            decisions=[(job_id, 1, "placed", {"reason": "fits"})],
            events=[jobs.JobEventRow(job_id, "placed", f"{job_id}:placed:1", b'{"kind": "placed"}', 1.0)],
            outbox_rows=("apply-test", [(f"{job_id}:placed:1", "loom.jobs.placed.c1", b"{}", {"a": "b"})]),
        )


async def test_apply_cycle_writes_a_cycle_in_one_statement_or_refuses_it_whole(pool: asyncpg.Pool) -> None:
    node = await add_node(pool, 4)
    job_id = unique("job")
    await apply_one_placement(pool, job_id, node, 3)
    row = await pool.fetchrow("SELECT state, cluster, attempt, workers FROM jobs WHERE job_id = $1", job_id)
    assert tuple(row) == ("placed", "c1", 1, 1)
    assert await gpus_reserved(pool, node) == 3
    assert await pool.fetchval("SELECT gpus FROM reservations WHERE job_id = $1", job_id) == 3
    assert await pool.fetchval("SELECT outcome FROM decisions WHERE job_id = $1", job_id) == "placed"
    assert await pool.fetchval("SELECT count(*) FROM job_events WHERE job_id = $1", job_id) == 1
    assert (
        await pool.fetchval("SELECT headers FROM outbox WHERE msg_id = $1", f"{job_id}:placed:1")
        == '{"a": "b"}'
    )

    late = unique("job")
    with pytest.raises(ConflictError):
        await apply_one_placement(pool, late, node, 2)
    assert await gpus_reserved(pool, node) == 3, "only one GPU is left: nothing taken"
    assert await pool.fetchval("SELECT count(*) FROM jobs WHERE job_id = $1", late) == 0
    assert await pool.fetchval("SELECT count(*) FROM reservations WHERE job_id = $1", late) == 0
    assert await pool.fetchval("SELECT count(*) FROM outbox WHERE msg_id = $1", f"{late}:placed:1") == 0


async def test_reserve_refuses_unschedulable_and_unknown_nodes(pool: asyncpg.Pool) -> None:
    drained = await add_node(pool, 8, schedulable=False)
    assert not await try_reserve(pool, unique("job"), [(drained, 1)])
    assert not await try_reserve(pool, unique("job"), [(unique("ghost"), 1)])


async def test_release_twice_releases_once(pool: asyncpg.Pool) -> None:
    a, b = await add_node(pool, 8), await add_node(pool, 8)
    job_id = unique("job")
    assert await try_reserve(pool, job_id, [(a, 4), (b, 2)])
    async with transaction(pool) as conn:
        released = await jobs.release(conn, job_id, 1)
    assert sorted(released) == sorted([(a, 4), (b, 2)])
    async with transaction(pool) as conn:
        assert await jobs.release(conn, job_id, 1) == []
    assert (await gpus_reserved(pool, a), await gpus_reserved(pool, b)) == (0, 0)


async def test_upsert_nodes_follows_newer_views_and_never_touches_reservations(pool: asyncpg.Pool) -> None:
    node = await add_node(pool, 8, version=5)
    assert await try_reserve(pool, unique("job"), [(node, 3)])
    newer = NodeCapacity(
        node=node,
        cluster="c1",
        region="r1",
        zone="z1",
        gpu_model="A100",
        gpus_total=6,
        gpus_reserved=0,
        schedulable=False,
    )
    older = NodeCapacity(node=node, cluster="c1", region="r1", zone="z1", gpu_model="A100", gpus_total=1)
    async with transaction(pool) as conn:
        await jobs.upsert_nodes(conn, 6, [newer])
        await jobs.upsert_nodes(conn, 4, [older])
    book = await jobs.load_nodes(pool)
    assert (book[node].gpus_total, book[node].gpus_reserved, book[node].schedulable) == (6, 3, False)


# -- jobs and their history ----------------------------------------------------------------------------


async def test_job_events_are_append_only(pool: asyncpg.Pool) -> None:
    job_id = unique("job")
    async with transaction(pool) as conn:
        assert await jobs.insert_jobs(conn, [jobs.NewJob(job_id, "acme", b"{}", 1_700_000_000.0, {})]) == {
            job_id
        }
        assert (
            await jobs.insert_jobs(conn, [jobs.NewJob(job_id, "acme", b"{}", 1_700_000_000.0, {})]) == set()
        )
        event = jobs.JobEventRow(job_id, "submitted", f"{job_id}:submitted", b'{"kind": "submitted"}', 1.7e9)
        assert await jobs.append_events(conn, [event]) == {event.msg_id}
        assert await jobs.append_events(conn, [event]) == set(), "a redelivered event is skipped"
        orphan = jobs.JobEventRow(unique("nojob"), "started", unique("m"), b"{}", 1.7e9)
        assert await jobs.append_events(conn, [orphan]) == set(), "events of unknown jobs are skipped"

    with pytest.raises(StoreError, match="append-only"):
        async with transaction(pool) as conn:
            await conn.execute("UPDATE job_events SET kind = 'forged' WHERE job_id = $1", job_id)
    with pytest.raises(StoreError, match="append-only"):
        async with transaction(pool) as conn:
            await conn.execute("DELETE FROM job_events WHERE job_id = $1", job_id)
    job = await jobs.get_job(pool, job_id)
    assert job is not None
    assert [e["kind"] for e in job["events"]] == ["submitted"]
    # A report stored late (sent after an outage) still reads in the order things happened.
    async with transaction(pool) as conn:
        late = jobs.JobEventRow(job_id, "completed", unique("m"), b"{}", 1.7e9 + 20)
        early = jobs.JobEventRow(job_id, "started", unique("m"), b"{}", 1.7e9 + 10)
        assert len(await jobs.append_events(conn, [late, early])) == 2
    job = await jobs.get_job(pool, job_id)
    assert job is not None
    assert [e["kind"] for e in job["events"]] == ["submitted", "started", "completed"]


# -- error mapping -----------------------------------------------------------------------------------


# -- metrics' ledger and network perception's tables -------------------------------------------------


async def test_the_ledger_round_trips_and_an_older_cluster_version_never_overwrites_a_newer(
    fresh_database: FreshDatabase,
) -> None:
    db = await create_pool(await fresh_database("ledger"))
    try:
        newer = LedgerCluster(cluster="c1", region="r1", version=5, last_heartbeat_at=1_700_000_000.0)
        node = LedgerNode(
            node="n1",
            cluster="c1",
            region="r1",
            zone="z1",
            gpu_model="A100",
            gpus_total=8,
            gpus_used=2,
            cpu_milli=64_000,
            memory_mib=512_000,
            healthy=True,
            updated_at=1_700_000_000.0,
        )
        gone = LedgerNode(**{**asdict(node), "node": "n2"})
        async with transaction(db) as conn:
            await ledger.write_cluster(conn, newer)
            await ledger.write_cluster(conn, LedgerCluster(cluster="c1", region="r1", version=4))
            await ledger.write_nodes(conn, [node, gone])
            await ledger.delete_nodes(conn, ["n2"])
        [cluster] = await ledger.load_clusters(db)
        assert (cluster.cluster, cluster.version, cluster.last_heartbeat_at) == ("c1", 5, 1_700_000_000.0)
        assert await ledger.load_nodes(db) == [node]
        # One statement for many nodes; a node listed twice is written as its last entry.
        busier = LedgerNode(**{**asdict(node), "gpus_used": 6})
        many = [LedgerNode(**{**asdict(node), "node": f"m{i}", "gpus_used": i % 8}) for i in range(300)]
        async with transaction(db) as conn:
            await ledger.write_nodes(conn, [node, *many, busier])
            await ledger.write_nodes(conn, [])
        stored = {n.node: n for n in await ledger.load_nodes(db)}
        assert stored["n1"] == busier and len(stored) == 301
        assert [stored[f"m{i}"].gpus_used for i in range(300)] == [i % 8 for i in range(300)]
        await db.execute("DELETE FROM ledger_nodes WHERE node LIKE 'm%'")
        async with transaction(db) as conn:
            await ledger.write_nodes(conn, [node])

        async with transaction(db) as conn:
            await ledger.save_learning(
                conn,
                "c1",
                TrustTracker(trust=0.5, confirmations=2),
                ("A100", "training"),
                DecayLearner(0.875, 3),
            )
        assert await ledger.load_trust(db) == {"c1": TrustTracker(trust=0.5, confirmations=2, mismatches=0)}
        assert await ledger.load_decay(db) == {
            ("A100", "training"): DecayLearner(factor=0.875, observations=3)
        }
        [cluster] = await ledger.load_clusters(db)
        assert cluster.trust == 0.5
    finally:
        await db.close()


async def test_profiles_replace_per_model_and_reservations_read_back_by_run(
    fresh_database: FreshDatabase,
) -> None:
    db = await create_pool(await fresh_database("profiles"))
    try:
        profile = AcceleratorProfile(
            gpu_model="A100",
            compute_fp32_tflops=19.5,
            compute_fp16_tflops=312.0,
            memory_bandwidth_gbps=15_552.0,
            memory_gib=80.0,
            interconnect_gbps=4_800.0,
            network_gbps=200.0,
        )
        faster = msgspec.structs.replace(profile, compute_fp32_tflops=20.0)
        async with transaction(db) as conn:
            await ledger.save_profiles(conn, "c1", "library", 1_700_000_000.0, [profile])
            await ledger.save_profiles(conn, "c1", "calibrated", 1_700_000_100.0, [faster])
        assert await ledger.load_profiles(db) == {"c1": [faster]}

        async with transaction(db) as conn:
            await jobs.upsert_nodes(
                conn,
                1,
                [
                    NodeCapacity(
                        node="n1", cluster="c1", region="r1", zone="z1", gpu_model="A100", gpus_total=8
                    )
                ],
            )
            await jobs.reserve(conn, [("j1", 1, "c1", [("n1", 4)])])
        assert await ledger.unconfirmed_reservations(db) == {"j1:1": [("n1", 4)]}
        async with transaction(db) as conn:
            await jobs.insert_jobs(conn, [jobs.NewJob("j1", "t", b"{}", 1_700_000_000.0, {})])
            await jobs.mark_placed(conn, [("j1", "c1", 1, 1_700_000_001.0)])
            await jobs.confirm(conn, [("j1", 2)])  # another attempt: nothing moves
        assert await ledger.unconfirmed_reservations(db) == {"j1:1": [("n1", 4)]}
        assert await db.fetchval("SELECT state FROM jobs WHERE job_id = 'j1'") == "placed"
        async with transaction(db) as conn:
            await jobs.confirm(conn, [("j1", 1)])
        assert await ledger.unconfirmed_reservations(db) == {}
        assert await db.fetchval("SELECT state FROM jobs WHERE job_id = 'j1'") == "running"
    finally:
        await db.close()


async def test_link_events_store_a_lost_links_infinite_rtt_as_null(fresh_database: FreshDatabase) -> None:
    db = await create_pool(await fresh_database("links"))
    try:
        lost = LinkEvent("degraded", "r1", "r2", 1_700_000_000.0, "loss", math.inf, 20.0, 1.0)
        slow = LinkEvent("degraded", "r2", "r1", 1_700_000_001.0, "rtt", 90.0, 20.0, 0.0)
        async with transaction(db) as conn:
            await links.append_link_events(conn, [lost, slow])
        rows = await db.fetch("SELECT src, rtt_ms FROM net_link_events ORDER BY id")
        assert [(r["src"], r["rtt_ms"]) for r in rows] == [("r1", None), ("r2", 90.0)]
        assert await links.load_link_records(db) == []
    finally:
        await db.close()


def test_map_error_says_whether_a_retry_can_help() -> None:
    conflict = map_error(asyncpg.SerializationError("could not serialize"))
    assert isinstance(conflict, ConflictError)
    assert not conflict.non_retryable
    assert isinstance(map_error(asyncpg.DeadlockDetectedError("deadlock")), ConflictError)
    assert map_error(asyncpg.UniqueViolationError("duplicate key")).non_retryable
    assert map_error(asyncpg.CheckViolationError("check")).non_retryable
    unavailable = map_error(OSError("connection refused"))
    assert not unavailable.non_retryable
    assert "unavailable" in str(unavailable)


async def test_a_constraint_violation_in_a_transaction_is_a_non_retryable_store_error(
    pool: asyncpg.Pool,
) -> None:
    with pytest.raises(StoreError) as caught:
        async with transaction(pool) as conn:
            await conn.execute("UPDATE node_allocations SET gpus_reserved = -1")
    assert caught.value.non_retryable


async def test_with_retry_repeats_only_lost_races() -> None:
    calls = 0

    async def loses_twice() -> str:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise ConflictError("lost a race")
        return "won"

    assert await with_retry(loses_twice) == "won"
    assert calls == 3

    async def always_loses() -> None:
        raise ConflictError("lost again")

    with pytest.raises(ConflictError):
        await with_retry(always_loses, attempts=2)

    failures = 0

    async def broken() -> None:
        nonlocal failures
        failures += 1
        raise StoreError("bad input", non_retryable=True)

    with pytest.raises(StoreError):
        await with_retry(broken)
    assert failures == 1


def test_redact_hides_the_password() -> None:
    assert redact("postgresql://loom:s3cret@db:5432/loom") == "postgresql://loom@db:5432/loom"
    assert redact("postgresql://db/loom") == "postgresql://db/loom"


async def test_a_requeue_stores_the_next_attempts_avoids_as_given(pool: asyncpg.Pool) -> None:
    """The store writes what the next attempt avoids (loom.sched.cycle.requeue_avoid decides it)."""
    node = await add_node(pool, 8)
    job_id = unique("job")
    await apply_one_placement(pool, job_id, node, 1)
    async with transaction(pool) as conn:
        assert await jobs.requeue(conn, job_id, 1, ["c-b", "c-a"]) is not None
    row = await pool.fetchrow("SELECT state, avoid_clusters FROM jobs WHERE job_id = $1", job_id)
    assert (row["state"], sorted(row["avoid_clusters"])) == ("queued", ["c-a", "c-b"])
    # Queued again, it runs nowhere: `loom jobs` and `loom job` show no cluster, and where it ran.
    shown = await jobs.get_job(pool, job_id)
    assert shown is not None and (shown["cluster"], shown["last_cluster"]) == (None, "c1")


async def test_a_move_of_a_job_that_ended_meanwhile_is_failed_as_moot(pool: asyncpg.Pool) -> None:
    # A failed-over run's late completion finished the job before its next attempt started:
    # before, the failover migration stayed "started" for good.
    from loom.store import moves

    done, running = unique("ended"), unique("running")
    async with transaction(pool) as conn:
        await jobs.insert_jobs(
            conn, [jobs.NewJob(j, "acme", b"{}", 1_700_000_000.0, {}) for j in (done, running)]
        )
        for job_id in (done, running):
            assert await moves.plan(
                conn,
                migration_id=f"m-{job_id}",
                job_id=job_id,
                tenant="acme",
                cause="failover",
                state="started",
                from_cluster="c1",
                from_attempt=1,
                steps=100,
                why="cluster c1 lost",
                trace_context={},
            )
        await jobs.set_state(conn, [done], "completed", ["queued"])
        ended = [r for r in await moves.end_moot(conn) if r["job_id"] in (done, running)]
    assert [(r["job_id"], r["state"]) for r in ended] == [(done, "failed")]
    assert ended[0]["why"].startswith("the job completed (attempt 0) before the move: cluster c1 lost")
    states = {r["job_id"]: r["state"] for r in await pool.fetch("SELECT job_id, state FROM migrations")}
    assert states[running] == "started"
    async with transaction(pool) as conn:
        assert await moves.end_moot(conn) == []  # once
        await jobs.set_state(conn, [running], "cancelled", ["queued"])
        swept = await moves.end_moot(conn)
    assert [(r["job_id"], r["state"]) for r in swept] == [(running, "failed")]
