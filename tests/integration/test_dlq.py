"""Dead letters you can act on, on a real JetStream and PostgreSQL: list, show, replay, purge.

A message is dead-lettered by a real :class:`ConsumerRunner` whose handler claims the message id
in the inbox (as Loom's services do) and refuses while "broken"; then it is listed, shown,
replayed to the fixed handler (handled once), replayed again (the inbox skips it) and purged.
Each test publishes to a stream of its own with a one-second duplicate window, so replays are
not held back by the two minutes of Loom's streams.
"""

import asyncio
import json
import subprocess
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest
from cli_helpers import loom_cli
from nats.aio.client import Client
from nats.js.api import StreamConfig
from waiting import until

from loom.bus import ConsumerRunner, ConsumerSpec, Delivery, Publisher, connect, ensure_streams
from loom.bus.dlq import MARKS_BUCKET, DeadLetter, DeadLetterError, DeadLetters, UnknownDeadLetterError
from loom.errors import InvalidInputError
from loom.store import inbox
from loom_proto import subjects

WAIT_S = 15.0


class InboxHandler:
    """Handles each message id once (inbox claim in the same transaction); refuses while broken."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool
        self.broken = True
        self.handled: list[bytes] = []
        self.skipped = 0

    async def __call__(self, d: Delivery[bytes]) -> None:
        assert d.msg_id is not None
        async with self.pool.acquire() as conn, conn.transaction():
            if not await inbox.claim(conn, "dlq-test", d.msg_id):
                self.skipped += 1
                return
            if self.broken:
                raise InvalidInputError(f"cannot take {d.message!r} yet")
            self.handled.append(d.message)


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[Client]:
    client = await connect(nats_url, "test-dlq")
    await ensure_streams(client.jetstream())
    yield client
    await client.close()


@pytest.fixture
async def subject(nc: Client) -> AsyncIterator[str]:
    """``dlqtest.<unique>.orders`` in a stream of its own with a one-second duplicate window."""
    name = f"DLQTEST_{uuid.uuid4().hex[:8]}"
    token = name.lower()
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name=name, subjects=[f"dlqtest.{token}.>"], duplicate_window=1.0))
    yield f"dlqtest.{token}.orders"
    await js.delete_stream(name)


@pytest.fixture
async def handler(fresh_database: Callable[..., Awaitable[str]]) -> AsyncIterator[InboxHandler]:
    pool = await asyncpg.create_pool(await fresh_database("dlq"), min_size=1, max_size=2)
    assert pool is not None
    yield InboxHandler(pool)
    await pool.close()


@pytest.fixture
async def runner(nc: Client, subject: str, handler: InboxHandler) -> AsyncIterator[ConsumerRunner[bytes]]:
    stream = (await nc.jetstream().find_stream_name_by_subject(subject)) or ""
    spec = ConsumerSpec(stream=stream, durable=f"dlqtest-{uuid.uuid4().hex[:8]}", filter_subjects=[subject])
    consumer: ConsumerRunner[bytes] = ConsumerRunner(
        nc, spec, bytes, handler=handler, idle_fetch_timeout_s=0.2
    )
    await consumer.start()
    yield consumer
    await consumer.stop()


async def _dead_lettered(dlq: DeadLetters, subject: str) -> DeadLetter:
    async def one() -> DeadLetter | None:
        letters = await dlq.entries(subject=subject)
        return letters[0] if letters else None

    letter: DeadLetter = await until(one, WAIT_S, f"a dead letter of {subject}")
    return letter


async def _replay_until_delivered(dlq: DeadLetters, seq: int, *, again: bool = False) -> None:
    """Replay until the stream takes it: inside its duplicate window the copy is dropped (and said so)."""

    async def replayed() -> bool:
        [result] = await dlq.replay([await dlq.get(seq)], again=again)
        assert result.outcome in ("replayed", "duplicate")
        return result.outcome == "replayed"

    await until(replayed, WAIT_S, f"dead letter #{seq} replayed", interval_s=0.2)


@pytest.mark.usefixtures("runner")
async def test_a_dead_letter_is_listed_replayed_once_to_a_fixed_handler_and_purged_only_with_a_reason(
    nc: Client, subject: str, handler: InboxHandler
) -> None:
    await Publisher(nc).publish_bytes(
        subject, b'{"order": 1}', msg_id="order-1", headers={"X-Origin": "test"}
    )
    dlq = DeadLetters(nc)
    letter = await _dead_lettered(dlq, subject)

    assert letter.original_subject == subject
    assert letter.subject == subjects.dead_letter(subject)
    assert letter.error_type == "InvalidInputError"
    assert letter.error is not None
    assert "cannot take" in letter.error
    assert letter.deliveries == 1
    assert letter.consumer is not None
    assert letter.consumer.startswith("dlqtest-")
    assert letter.original_msg_id == "order-1", "the consumer keeps the original id for replay"
    assert letter.headers["X-Origin"] == "test"
    assert letter.data == b'{"order": 1}'
    assert letter.replay is None
    assert letter.time is not None
    assert abs(datetime.now(UTC) - letter.time) < timedelta(minutes=1)
    assert await dlq.get(letter.seq) == letter
    assert [
        x.seq for x in await dlq.entries(subject=subject, since=datetime.now(UTC) + timedelta(minutes=1))
    ] == []

    handler.broken = False
    await _replay_until_delivered(dlq, letter.seq)
    await until(lambda: _true(handler.handled == [b'{"order": 1}']), WAIT_S, "the replay handled")
    marked = await dlq.get(letter.seq)
    assert marked.replay is not None
    assert marked.replay.times == 1
    [listed] = await dlq.entries(subject=subject)
    assert listed.replay == marked.replay

    [skipped] = await dlq.replay([marked])
    assert skipped.outcome == "skipped", "a replayed entry is not replayed again unless asked"
    await _replay_until_delivered(dlq, letter.seq, again=True)
    await until(lambda: _true(handler.skipped == 1), WAIT_S, "the second replay seen by the handler")
    assert handler.handled == [b'{"order": 1}'], "the inbox kept the second replay from being handled twice"
    again = await dlq.get(letter.seq)
    assert again.replay is not None
    assert again.replay.times == 2

    with pytest.raises(DeadLetterError, match="reason"):
        await dlq.purge([letter.seq], reason="  ")
    assert await dlq.get(letter.seq) == again, "a refused purge deletes nothing"
    result = await dlq.purge([letter.seq], reason="order 1 replayed and handled")
    assert result.deleted == 1
    with pytest.raises(UnknownDeadLetterError):
        await dlq.get(letter.seq)
    assert await dlq.entries(subject=subject) == []
    kv = await nc.jetstream().key_value(MARKS_BUCKET)
    records = [json.loads((await kv.get(k)).value or b"") for k in await kv.keys() if k.startswith("purges.")]
    assert {"reason": "order 1 replayed and handled", "seqs": [letter.seq]}.items() <= next(
        r for r in records if r["seqs"] == [letter.seq]
    ).items()


async def test_a_replay_inside_the_duplicate_window_of_loom_streams_is_reported_and_not_marked(
    nc: Client,
) -> None:
    """Loom's streams remember ids for two minutes: a replay that soon is dropped, and says so."""
    subject = subjects.job_submitted(f"dlq-{uuid.uuid4().hex[:8]}")
    msg_id = f"job-{uuid.uuid4().hex[:8]}"
    publisher = Publisher(nc)
    await publisher.publish_bytes(subject, b"{}", msg_id=msg_id)
    # Dead-letter it as a consumer would, with the original id kept.
    await publisher.publish_bytes(
        subjects.dead_letter(subject),
        b"{}",
        msg_id=f"dlq-test-{msg_id}",
        headers={"Loom-Original-Subject": subject, "Loom-Original-Msg-Id": msg_id, "Loom-Error": "x"},
    )
    dlq = DeadLetters(nc)
    [letter] = await dlq.entries(subject=subject)
    [result] = await dlq.replay([letter])
    assert result.outcome == "duplicate"
    assert (await dlq.get(letter.seq)).replay is None
    await dlq.purge(subject=subject, reason="test clean-up")
    assert await dlq.entries(subject=subject) == []


async def test_unknown_sequences_are_refused_before_anything_is_purged(nc: Client, subject: str) -> None:
    publisher = Publisher(nc)
    await publisher.publish_bytes(subjects.dead_letter(subject), b"{}", msg_id=f"dlq-{uuid.uuid4().hex}")
    dlq = DeadLetters(nc)
    [letter] = await dlq.entries(subject=subject)
    last = (await nc.jetstream().stream_info("DLQ")).state.last_seq
    with pytest.raises(UnknownDeadLetterError):
        await dlq.purge([letter.seq, last + 1000], reason="clean-up")
    assert [x.seq for x in await dlq.entries(subject=subject)] == [letter.seq]
    with pytest.raises(UnknownDeadLetterError):
        await dlq.get(last + 1000)


def _loom(*args: str, nats_url: str, database_url: str) -> subprocess.CompletedProcess[str]:
    return loom_cli(*args, nats_url=nats_url, database_url=database_url)


async def test_the_dlq_commands_list_show_and_refuse_a_purge_without_reason(
    nc: Client, subject: str, nats_url: str, database_url: str
) -> None:
    await Publisher(nc).publish_bytes(
        subjects.dead_letter(subject),
        b'{"order": 7}',
        msg_id=f"dlq-{uuid.uuid4().hex}",
        headers={"Loom-Original-Subject": subject, "Loom-Error-Type": "DecodeError", "Loom-Error": "bad"},
    )
    urls = {"nats_url": nats_url, "database_url": database_url}
    listed = await asyncio.to_thread(
        _loom, "dlq", "list", "--subject", subject, "--since", "5m", "--json", **urls
    )
    assert listed.returncode == 0, listed.stderr
    [row] = json.loads(listed.stdout)
    assert (row["original_subject"], row["error_type"], row["error"]) == (subject, "DecodeError", "bad")
    shown = await asyncio.to_thread(_loom, "dlq", "show", str(row["seq"]), "--json", **urls)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["payload"] == {"order": 7}
    refused = await asyncio.to_thread(_loom, "dlq", "purge", str(row["seq"]), **urls)
    assert refused.returncode == 2
    assert "--reason" in refused.stderr
    unknown = await asyncio.to_thread(_loom, "dlq", "show", str(row["seq"] + 10**9), **urls)
    assert unknown.returncode == 1
    assert "no dead letter" in unknown.stderr
    purged = await asyncio.to_thread(_loom, "dlq", "purge", "--subject", subject, "--reason", "test", **urls)
    assert purged.returncode == 0, purged.stderr
    assert "purged 1" in purged.stdout


async def _true(value: bool) -> bool:
    return value
