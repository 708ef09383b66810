"""One poison message never takes others with it, on real NATS.

The consumer loop decodes each message on its own (size, depth and repeated-key limits) before any
handler sees it; a RecursionError a handler raises is final for that message alone; a batch handler
that raises is run again message by message so only the culprit fails. Hypothesis mixes arbitrary,
garbled, deeply nested and oversized payloads with valid ones: valid ones are handled, bad ones
dead-lettered with error headers, and the loop is alive afterwards.

The services' own consumers get the same treatment in test_poison_services.py.
"""

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nats.aio.client import Client
from nats.aio.msg import Msg

from loom.bus import ConsumerRunner, ConsumerSpec, Delivery, Publisher, connect, ensure_streams
from loom_proto import subjects as s
from loom_proto.clusters import ClusterCommand, StopJob
from loom_proto.codec import MAX_PAYLOAD_BYTES, encode
from loom_proto.jobs import JobSubmitted, Work

WAIT_S = 10.0
NESTED = b"[" * 50_000 + b"]" * 50_000  # 100 KB
NESTED_UNDER_TAG = b'{"kind":"stop","x":' + b"[" * 30_000 + b"]" * 30_000 + b"}"
Watch = Callable[[str], Awaitable["asyncio.Queue[Msg]"]]


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="module")
async def nc(nats_url: str) -> AsyncIterator[Client]:
    client = await connect(nats_url, "test-poison")
    await ensure_streams(client.jetstream())
    yield client
    await client.close()


@pytest.fixture
async def runners(nc: Client) -> AsyncIterator[list[ConsumerRunner[Any]]]:
    started: list[ConsumerRunner[Any]] = []
    yield started
    for runner in started:
        await runner.stop()
        await nc.jetstream().delete_consumer(runner.spec.stream, runner.spec.durable)


async def start(
    nc: Client, runners: list[ConsumerRunner[Any]], subject: str, message_type: Any, **kwargs: Any
) -> ConsumerRunner[Any]:
    stream = "CLUSTERS" if subject.startswith("loom.clusters") else "REQUESTS"  # commands, submissions
    spec = ConsumerSpec(
        stream=stream,
        durable=unique("poison"),
        filter_subjects=[subject],
        max_deliver=kwargs.pop("max_deliver", 5),
        first_nak_delay_s=0.05,
        max_nak_delay_s=0.2,
    )
    runner: ConsumerRunner[Any] = ConsumerRunner(nc, spec, message_type, idle_fetch_timeout_s=0.2, **kwargs)
    await runner.start()
    runners.append(runner)
    return runner


async def dead_letters(nc: Client, subject: str) -> "asyncio.Queue[Msg]":
    queue: asyncio.Queue[Msg] = asyncio.Queue()

    async def on_msg(msg: Msg) -> None:
        queue.put_nowait(msg)

    await nc.subscribe(s.dead_letter(subject), cb=on_msg)
    await nc.flush()
    return queue


async def drain(queue: "asyncio.Queue[Any]", count: int) -> list[Any]:
    return [await asyncio.wait_for(queue.get(), WAIT_S) for _ in range(count)]


async def settled(nc: Client, runner: ConsumerRunner[Any]) -> None:
    """Wait until the consumer has nothing pending nor unacknowledged (its loop is alive)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while True:
        info = await nc.jetstream().consumer_info(runner.spec.stream, runner.spec.durable)
        if info.num_pending == 0 and info.num_ack_pending == 0:
            return
        if loop.time() > deadline:
            pytest.fail(f"consumer stuck: {info.num_pending} pending, {info.num_ack_pending} unacknowledged")
        await asyncio.sleep(0.05)


async def test_a_deeply_nested_command_is_dead_lettered_alone_and_the_consumer_lives_on(
    nc: Client, runners: list[ConsumerRunner[Any]]
) -> None:
    cluster = unique("c")
    subject = s.cluster_commands(cluster)
    dead = await dead_letters(nc, subject)
    handled: asyncio.Queue[str] = asyncio.Queue()

    async def on_command(d: Delivery[ClusterCommand]) -> None:
        assert isinstance(d.message, StopJob)
        handled.put_nowait(d.message.job_id)

    runner = await start(nc, runners, subject, ClusterCommand, handler=on_command, concurrent=True)
    publisher = Publisher(nc)
    await publisher.publish(subject, StopJob(job_id="before"), msg_id=unique("m"))
    await publisher.publish_bytes(subject, NESTED_UNDER_TAG, msg_id=unique("m"))
    await publisher.publish_bytes(subject, NESTED, msg_id=unique("m"))
    await publisher.publish(subject, StopJob(job_id="after"), msg_id=unique("m"))

    letters = await drain(dead, 2)
    assert sorted(await drain(handled, 2)) == ["after", "before"]
    assert {(m.headers or {})["Loom-Error-Type"] for m in letters} == {"DecodeError"}
    assert all("nested" in (m.headers or {})["Loom-Error"] for m in letters)
    await publisher.publish(subject, StopJob(job_id="later"), msg_id=unique("m"))
    assert await drain(handled, 1) == ["later"], "the loop survived the poison"
    await settled(nc, runner)


async def test_a_recursion_error_in_a_handler_dead_letters_that_message_at_its_first_delivery(
    nc: Client, runners: list[ConsumerRunner[Any]]
) -> None:
    tenant = unique("t")
    subject = s.job_submitted(tenant)
    dead = await dead_letters(nc, subject)
    calls: list[tuple[str, int]] = []

    async def handler(d: Delivery[JobSubmitted]) -> None:
        calls.append((d.message.job_id, d.num_delivered))
        if d.message.job_id == "deep":
            raise RecursionError("maximum recursion depth exceeded")

    runner = await start(nc, runners, subject, JobSubmitted, handler=handler, max_deliver=5)
    publisher = Publisher(nc)
    for job_id in ("a", "deep", "b"):
        await publisher.publish(
            subject, JobSubmitted(job_id=job_id, tenant=tenant, work=Work(steps=1)), msg_id=unique("m")
        )
    [letter] = await drain(dead, 1)
    await settled(nc, runner)

    assert (letter.headers or {})["Loom-Error-Type"] == "RecursionError"
    assert (letter.headers or {})["Loom-Deliveries"] == "1", "not retried as if it were transient"
    assert sorted(calls) == [("a", 1), ("b", 1), ("deep", 1)]
    assert runner.counts == {"acked": 2, "nacked": 0, "dead_lettered": 1}


@pytest.mark.parametrize("how", ["raises", "returns one error for all"])
async def test_a_batch_that_fails_as_a_whole_because_of_one_message_fails_that_message_only(
    nc: Client, runners: list[ConsumerRunner[Any]], how: str
) -> None:
    tenant = unique("t")
    subject = s.job_submitted(tenant)
    dead = await dead_letters(nc, subject)
    done: list[str] = []

    async def batch(ds: list[Delivery[JobSubmitted]]) -> list[BaseException | None]:
        if any(d.message.job_id == "deep" for d in ds):
            error = RecursionError("maximum recursion depth exceeded")  # e.g. from a json.loads
            if how == "raises":
                raise error
            return [error] * len(ds)  # as a handler does when its one transaction failed
        done.extend(d.message.job_id for d in ds)
        return [None] * len(ds)

    publisher = Publisher(nc)
    for job_id in ("a", "deep", "b", "c"):
        await publisher.publish(
            subject, JobSubmitted(job_id=job_id, tenant=tenant, work=Work(steps=1)), msg_id=unique("m")
        )
    runner = await start(nc, runners, subject, JobSubmitted, batch_handler=batch, linger_s=0.2)
    [letter] = await drain(dead, 1)
    await settled(nc, runner)

    assert json.loads(letter.data)["job_id"] == "deep"
    assert sorted(done) == ["a", "b", "c"]
    assert runner.counts == {"acked": 3, "nacked": 0, "dead_lettered": 1}


async def test_a_repeated_key_is_refused_not_last_one_wins(
    nc: Client, runners: list[ConsumerRunner[Any]]
) -> None:
    cluster = unique("c")
    subject = s.cluster_commands(cluster)
    dead = await dead_letters(nc, subject)
    handled: asyncio.Queue[str] = asyncio.Queue()

    async def on_command(d: Delivery[ClusterCommand]) -> None:
        assert isinstance(d.message, StopJob)
        handled.put_nowait(d.message.job_id)

    runner = await start(nc, runners, subject, ClusterCommand, handler=on_command)
    publisher = Publisher(nc)
    await publisher.publish_bytes(
        subject, b'{"kind":"stop","job_id":"mine","job_id":"yours"}', msg_id=unique("m")
    )
    await publisher.publish(subject, StopJob(job_id="plain"), msg_id=unique("m"))

    assert await drain(handled, 1) == ["plain"]
    [letter] = await drain(dead, 1)
    assert (letter.headers or {})["Loom-Error-Type"] == "DecodeError"
    assert "'job_id' appears more than once" in (letter.headers or {})["Loom-Error"]
    await settled(nc, runner)


# -- fuzzing ---------------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=10),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3)
    ),
    max_leaves=20,
)
VALID_STOP = encode(StopJob(job_id="x"))
hostile = st.one_of(
    st.binary(min_size=1, max_size=200),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.integers(40, 40_000).map(lambda depth: b'{"kind":"stop","x":' + b"[" * depth + b"]" * depth + b"}"),
    st.integers(40, 40_000).map(lambda depth: b"[" * depth),
    st.integers(40, 40_000).map(lambda depth: b'{"x":' + b"[" * depth + b"]" * depth + b',"kind":"stop"}'),
    st.just(VALID_STOP[:-1] + b',"job_id":"again"}'),
    st.just(b'{"kind":"stop","job_id":"' + b"x" * (MAX_PAYLOAD_BYTES + 1) + b'"}'),
    st.integers(1, len(VALID_STOP) - 1).map(lambda cut: VALID_STOP[:cut]),
)


def hostile_batches(count: int) -> list[list[tuple[bool, bytes]]]:
    """Batches of (valid, payload): Hypothesis draws them (bounded), the test publishes them."""
    drawn: list[list[tuple[bool, bytes]]] = []

    @settings(
        max_examples=count,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(st.lists(st.tuples(st.booleans(), hostile), min_size=1, max_size=6))
    def collect(batch: list[tuple[bool, bytes]]) -> None:
        drawn.append([(valid, VALID_STOP if valid else payload) for valid, payload in batch])

    collect()
    return drawn


@pytest.mark.parametrize("shape", ["handler", "concurrent", "batch"])
async def test_fuzzed_commands_next_to_valid_ones_only_the_bad_are_dead_lettered(
    nc: Client, runners: list[ConsumerRunner[Any]], shape: str
) -> None:
    cluster = unique("c")
    subject = s.cluster_commands(cluster)
    dead = await dead_letters(nc, subject)
    handled: asyncio.Queue[str] = asyncio.Queue()

    async def one(d: Delivery[ClusterCommand]) -> None:
        handled.put_nowait(d.headers["Nats-Msg-Id"])

    async def batch(ds: list[Delivery[ClusterCommand]]) -> list[BaseException | None]:
        for d in ds:
            await one(d)
        return [None] * len(ds)

    kwargs: dict[str, Any] = {"batch_handler": batch} if shape == "batch" else {"handler": one}
    runner = await start(nc, runners, subject, ClusterCommand, concurrent=shape == "concurrent", **kwargs)
    publisher = Publisher(nc)
    valid_ids: list[str] = []
    bad = 0
    for batch_payloads in hostile_batches(8):
        for valid, payload in batch_payloads:
            msg_id = unique("m")
            await publisher.publish_bytes(subject, payload, msg_id=msg_id)
            if valid:
                valid_ids.append(msg_id)
            else:
                bad += 1
    assert sorted(await drain(handled, len(valid_ids))) == sorted(valid_ids)
    letters = await drain(dead, bad)
    for letter in letters:
        headers = letter.headers or {}
        assert headers["Loom-Error-Type"] == "DecodeError"
        assert headers["Loom-Error"] and headers["Loom-Original-Subject"] == subject
    await settled(nc, runner)
    await publisher.publish(subject, StopJob(job_id="canary"), msg_id="canary-" + cluster)
    assert await drain(handled, 1) == ["canary-" + cluster], "the loop is alive after the fuzzing"
