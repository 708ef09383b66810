"""loom.bus against a real JetStream: streams, deduplicated publish, ack / retry / dead-letter, traces.

Every test uses Loom's real streams (so dead letters land in DLQ) with subjects of a tenant of its
own and a durable consumer of its own, so tests never see each other's messages.
"""

import asyncio
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import suppress
from typing import Any

import msgspec
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, DeliverPolicy, DiscardPolicy, RetentionPolicy, StorageType
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from waiting import until

from loom.bus import BusError, ConsumerRunner, ConsumerSpec, Delivery, Publisher, connect, ensure_streams
from loom.bus.connection import stream_config
from loom.bus.outage import Dependencies, Dependency
from loom.bus.publisher import Outgoing
from loom.errors import InvalidInputError, LoomError, NotLeaderError, TransientError, UnavailableError
from loom.telemetry import reset_for_tests, setup_telemetry
from loom_proto import JobSubmitted, Work
from loom_proto import subjects as s

WAIT_S = 10.0
"""Upper bound for anything the bus should do; a test waits this long only when it is failing."""

StartConsumer = Callable[..., Awaitable[ConsumerRunner[Any]]]


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def submitted(tenant: str, n: int = 1, name: str = "") -> JobSubmitted:
    return JobSubmitted(job_id=f"job-{n}", tenant=tenant, name=name, work=Work(steps=1))


def consumer_spec(subjects: Sequence[str], **overrides: Any) -> ConsumerSpec:
    """A test consumer on the stream holding ``subjects``: submissions are in REQUESTS (most tests
    here use them), runs' events in JOBS."""
    stream = "REQUESTS" if all(".submitted." in x or ".cancelled." in x for x in subjects) else "JOBS"
    return ConsumerSpec(stream=stream, durable=unique("test"), filter_subjects=list(subjects), **overrides)


async def next_item(queue: "asyncio.Queue[Any]") -> Any:
    return await asyncio.wait_for(queue.get(), WAIT_S)


async def _settled_on_server(nc: Client, durable: str) -> tuple[int, int]:
    """(ack pending, pending) of ``durable`` on ``REQUESTS`` once the acks sent are applied: an ack is a
    plain publish the server applies on its own time, so read until none is pending, at most 5 s
    (a stop no longer waits out its pull request, which gave the server that time before)."""
    deadline = asyncio.get_running_loop().time() + 5.0
    while True:
        info = await nc.jetstream().consumer_info("REQUESTS", durable)
        if info.num_ack_pending == 0 or asyncio.get_running_loop().time() > deadline:
            return info.num_ack_pending, info.num_pending
        await asyncio.sleep(0.05)


async def subject_count(nc: Client, stream: str, subject: str) -> int:
    info = await nc.jetstream().stream_info(stream, subjects_filter=subject)
    return (info.state.subjects or {}).get(subject, 0)


@pytest.fixture(scope="module")
async def nc(nats_url: str) -> AsyncIterator[Client]:
    client = await connect(nats_url, "test-bus")
    await ensure_streams(client.jetstream())
    yield client
    await client.close()


@pytest.fixture
async def start_consumer(nc: Client) -> AsyncIterator[StartConsumer]:
    """Starts runners with a short idle fetch (so stop() is quick); stops and deletes them after."""
    runners: list[ConsumerRunner[Any]] = []

    async def start(spec: ConsumerSpec, message_type: Any, **kwargs: Any) -> ConsumerRunner[Any]:
        kwargs.setdefault("idle_fetch_timeout_s", 0.2)
        runner: ConsumerRunner[Any] = ConsumerRunner(nc, spec, message_type, **kwargs)
        await runner.start()
        runners.append(runner)
        return runner

    yield start
    for runner in runners:
        await runner.stop()
        with suppress(Exception):
            await nc.jetstream().delete_consumer(runner.spec.stream, runner.spec.durable)


@pytest.fixture
async def watch(nc: Client) -> AsyncIterator[Callable[[str], Awaitable["asyncio.Queue[Msg]"]]]:
    """Core-NATS subscriptions (to see dead letters as they are published), removed after."""
    subs = []

    async def subscribe(subject: str) -> "asyncio.Queue[Msg]":
        queue: asyncio.Queue[Msg] = asyncio.Queue()

        async def on_msg(msg: Msg) -> None:
            queue.put_nowait(msg)

        subs.append(await nc.subscribe(subject, cb=on_msg))
        await nc.flush()
        return queue

    yield subscribe
    for sub in subs:
        await sub.unsubscribe()


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    setup_telemetry("test-bus", exporter=exporter, log_level=None)
    yield exporter
    reset_for_tests()


# -- streams -----------------------------------------------------------------------------------------


def test_stream_config_follows_the_spec() -> None:
    spec = next(sp for sp in s.STREAMS if sp.name == "JOBS")
    config = stream_config(spec)
    assert config.name == "JOBS"
    assert config.subjects == spec.subjects
    assert config.storage == StorageType.FILE
    assert config.retention == RetentionPolicy.LIMITS
    assert config.discard == DiscardPolicy.OLD
    assert config.duplicate_window == spec.duplicate_window_s
    assert config.max_age == spec.max_age_s
    assert config.max_msg_size == spec.max_msg_bytes


async def test_ensure_streams_is_idempotent_and_sets_file_storage_and_dedup_window(nc: Client) -> None:
    js = nc.jetstream()
    subject = s.job_submitted(unique("t"))
    await Publisher(nc).publish(subject, submitted("t"), msg_id=unique("m"))

    await ensure_streams(js)
    await ensure_streams(js)

    for spec in s.STREAMS:
        info = await js.stream_info(spec.name)
        assert info.config.storage == StorageType.FILE
        assert info.config.duplicate_window == pytest.approx(spec.duplicate_window_s)
        assert info.config.max_age == pytest.approx(spec.max_age_s)
        assert info.config.max_msg_size == spec.max_msg_bytes
        assert sorted(info.config.subjects or []) == sorted(spec.subjects)
    assert await subject_count(nc, "REQUESTS", subject) == 1, "updating a stream keeps its messages"


# -- publish -----------------------------------------------------------------------------------------


async def test_publishing_one_msg_id_twice_stores_the_message_once(nc: Client) -> None:
    publisher = Publisher(nc)
    subject = s.job_submitted(unique("t"))
    message = submitted("t")

    first = await publisher.publish(subject, message, msg_id="job-1")
    again = await publisher.publish(subject, message, msg_id="job-1")

    assert not first.duplicate
    assert again.duplicate
    assert again.seq == first.seq
    assert first.stream == "REQUESTS"
    assert await subject_count(nc, "REQUESTS", subject) == 1
    await publisher.publish(subject, message, msg_id="job-1-resubmitted")
    assert await subject_count(nc, "REQUESTS", subject) == 2, "another id is another message"


async def test_publish_sends_the_msg_id_and_the_callers_headers(nc: Client) -> None:
    subject = s.job_submitted(unique("t"))
    await Publisher(nc).publish(subject, submitted("t"), msg_id="id-7", headers={"X-Loom-Test": "yes"})
    stored = await nc.jetstream().get_last_msg("REQUESTS", subject)
    assert stored.headers is not None
    assert stored.headers["Nats-Msg-Id"] == "id-7"
    assert stored.headers["X-Loom-Test"] == "yes"
    assert msgspec.json.decode(stored.data or b"")["kind"] == "submitted"


async def test_publish_to_a_subject_no_stream_holds_raises_bus_error(nc: Client) -> None:
    publisher = Publisher(nc, attempts=2, first_backoff_s=0.01, timeout_s=0.5)
    with pytest.raises(BusError):
        await publisher.publish_bytes(f"nowhere.{unique('x')}", b"{}", msg_id="m")


async def test_publish_batch_stores_each_message_once_and_reports_each_failure(nc: Client) -> None:
    publisher = Publisher(nc, timeout_s=2.0)
    subject = s.job_submitted(unique("t"))
    payload = msgspec.json.encode(submitted("t"))
    batch = [Outgoing(subject, payload, f"b-{i}", {"X-Loom-Test": str(i)}) for i in range(3)]
    nowhere = Outgoing(f"nowhere.{unique('x')}", b"{}", "lost", {})

    outcomes = await publisher.publish_batch([*batch, nowhere, batch[0]])

    assert outcomes[:3] == [None, None, None]
    assert outcomes[3] is not None, "no stream holds that subject: reported, not raised"
    assert outcomes[4] is None, "a repeated id is acknowledged (as a duplicate)"
    assert await subject_count(nc, "REQUESTS", subject) == 3
    stored = await nc.jetstream().get_last_msg("REQUESTS", subject)
    assert stored.headers is not None
    assert stored.headers["Nats-Msg-Id"] == "b-2"
    assert stored.headers["X-Loom-Test"] == "2"


async def test_send_batch_puts_a_whole_batch_on_the_wire_without_yielding_between_messages(
    nc: Client,
) -> None:
    """With room for the batch, no other task runs while it is sent (so nats.py's flusher writes
    it in one go, not one system call per message); every message is still stored."""
    publisher = Publisher(nc, timeout_s=2.0)
    await publisher.publish_batch([])  # nothing to send, nothing awaited
    subject = s.job_submitted(unique("t"))
    payload = msgspec.json.encode(submitted("t"))
    await publisher.publish_batch([Outgoing(subject, payload, unique("warm"), {})])  # reply inbox set up
    ticks = 0
    stop = asyncio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    before = ticks
    sent = await publisher.send_batch([Outgoing(subject, payload, unique("m"), {}) for _ in range(50)])
    during = ticks - before
    outcomes = await sent.acks()
    stop.set()
    await task

    assert during == 0, f"another task ran {during} times while the batch was being sent"
    assert outcomes == [None] * 50
    assert await subject_count(nc, "REQUESTS", subject) == 51


async def test_send_batch_beyond_the_pending_limit_stalls_and_reports_the_rest(nc: Client) -> None:
    """A batch larger than the room for unacknowledged publishes waits (up to the timeout) for
    room: what fits is stored, the rest is reported failed, none is lost silently."""
    publisher = Publisher(nc, timeout_s=0.5)
    publisher._js = nc.jetstream(timeout=0.5, publish_async_max_pending=3)
    subject = s.job_submitted(unique("t"))
    payload = msgspec.json.encode(submitted("t"))

    outcomes = await publisher.publish_batch([Outgoing(subject, payload, unique("m"), {}) for _ in range(5)])

    assert outcomes[:3] == [None, None, None]
    assert sum(o is None for o in outcomes) == await subject_count(nc, "REQUESTS", subject)


# -- consumer spec -----------------------------------------------------------------------------------


def test_consumer_spec_config_leaves_counting_failures_to_the_loop() -> None:
    one = ConsumerSpec(stream="JOBS", durable="d", filter_subjects=["a.b"], max_deliver=4).config()
    assert one.max_deliver == -1, "outage redeliveries must never exhaust a server-side budget"
    assert one.ack_policy == AckPolicy.EXPLICIT
    assert one.deliver_policy == DeliverPolicy.ALL
    assert (one.filter_subject, one.filter_subjects) == ("a.b", None)
    two = ConsumerSpec(
        stream="JOBS", durable="d", filter_subjects=["a.b", "a.c"], deliver_new_only=True
    ).config()
    assert (two.filter_subject, two.filter_subjects) == (None, ["a.b", "a.c"])
    assert two.deliver_policy == DeliverPolicy.NEW


def test_nak_delay_grows_exponentially_up_to_the_cap() -> None:
    spec = ConsumerSpec(
        stream="S", durable="d", filter_subjects=["x"], first_nak_delay_s=0.5, max_nak_delay_s=3.0
    )
    assert [spec.nak_delay_s(n) for n in (1, 2, 3, 4, 5)] == [0.5, 1.0, 2.0, 3.0, 3.0]


async def test_a_runner_needs_exactly_one_kind_of_handler(nc: Client) -> None:
    spec = consumer_spec(["loom.jobs.submitted.x"])

    async def handler(_: Delivery[Any]) -> None:
        return None

    async def batch(ds: list[Delivery[Any]]) -> list[BaseException | None]:
        return [None] * len(ds)

    with pytest.raises(ValueError, match="exactly one"):
        ConsumerRunner(nc, spec, JobSubmitted)
    with pytest.raises(ValueError, match="exactly one"):
        ConsumerRunner(nc, spec, JobSubmitted, handler=handler, batch_handler=batch)


# -- consuming ---------------------------------------------------------------------------------------


async def test_consumer_decodes_handles_and_acks_good_messages(
    nc: Client, start_consumer: StartConsumer
) -> None:
    tenant = unique("t")
    subject = s.job_submitted(tenant)
    publisher = Publisher(nc)
    for n in (1, 2, 3):
        await publisher.publish(subject, submitted(tenant, n), msg_id=f"{tenant}-{n}")
    seen: asyncio.Queue[Delivery[JobSubmitted]] = asyncio.Queue()

    async def handler(delivery: Delivery[JobSubmitted]) -> None:
        seen.put_nowait(delivery)

    runner = await start_consumer(consumer_spec([subject]), JobSubmitted, handler=handler)
    for n in (4, 5):
        await publisher.publish(subject, submitted(tenant, n), msg_id=f"{tenant}-{n}")
    deliveries = [await next_item(seen) for _ in range(5)]
    await runner.stop()

    assert [d.message.job_id for d in deliveries] == [f"job-{n}" for n in (1, 2, 3, 4, 5)]
    first = deliveries[0]
    assert isinstance(first.message, JobSubmitted)
    assert (first.subject, first.msg_id, first.num_delivered) == (subject, f"{tenant}-1", 1)
    assert first.headers["Nats-Msg-Id"] == f"{tenant}-1"
    assert runner.counts == {"acked": 5, "nacked": 0, "dead_lettered": 0}
    assert await _settled_on_server(nc, runner.spec.durable) == (0, 0)


async def test_consumer_with_several_filter_subjects_gets_them_all(
    nc: Client, start_consumer: StartConsumer
) -> None:
    tenant = unique("t")
    subjects = [s.job_event("started", tenant), s.job_event("completed", tenant)]
    seen: asyncio.Queue[str] = asyncio.Queue()

    async def handler(delivery: Delivery[bytes]) -> None:
        seen.put_nowait(delivery.subject)

    await start_consumer(consumer_spec(subjects), bytes, handler=handler)
    for subject in subjects:
        await Publisher(nc).publish_bytes(subject, b"{}", msg_id=unique("m"))
    assert {await next_item(seen), await next_item(seen)} == set(subjects)


async def test_a_message_two_consumers_refuse_leaves_a_dead_letter_for_each(
    nc: Client, start_consumer: StartConsumer, watch: Callable[[str], Awaitable["asyncio.Queue[Msg]"]]
) -> None:
    # Before, both dead letters had one message id, so the DLQ stream kept the first and dropped
    # the second as a duplicate: the second consumer's error was lost.
    tenant = unique("t")
    subject = s.job_submitted(tenant)
    dead = await watch(s.dead_letter(subject))
    await Publisher(nc).publish_bytes(subject, b"not json", msg_id=f"{tenant}-bad")

    async def handler(delivery: Delivery[JobSubmitted]) -> None:
        raise AssertionError("never called for an undecodable message")

    first = await start_consumer(consumer_spec([subject]), JobSubmitted, handler=handler)
    second = await start_consumer(consumer_spec([subject]), JobSubmitted, handler=handler)
    letters = [await next_item(dead), await next_item(dead)]
    assert sorted((m.headers or {})["Loom-Consumer"] for m in letters) == sorted(
        [first.spec.durable, second.spec.durable]
    )

    # A plain subscriber can see a letter before the DLQ stream has stored it: wait for the stream.
    async def stored() -> int:
        info = await nc.jetstream().stream_info("DLQ", subjects_filter=s.dead_letter(subject))
        return (info.state.subjects or {}).get(s.dead_letter(subject), 0)

    async def both() -> bool:
        return await stored() >= 2

    await until(both, 5.0, "both dead letters stored")
    await asyncio.sleep(0.2)  # a third (a doubled letter) would show within this
    assert await stored() == 2


@pytest.mark.parametrize(
    "payload",
    [
        b"not json",
        msgspec.json.encode(
            {"kind": "submitted", "job_id": "j", "tenant": "t", "work": {"steps": 1}, "colour": "blue"}
        ),
    ],
    ids=["not json", "unknown field"],
)
async def test_an_undecodable_message_is_dead_lettered_and_the_consumer_goes_on(
    nc: Client,
    start_consumer: StartConsumer,
    watch: Callable[[str], Awaitable["asyncio.Queue[Msg]"]],
    payload: bytes,
) -> None:
    tenant = unique("t")
    subject = s.job_submitted(tenant)
    dead = await watch(s.dead_letter(subject))
    publisher = Publisher(nc)
    # A publisher's own JetStream header (checked by the stream it reaches) would have the DLQ
    # stream refuse the dead letter, and the message go round for ever: it travels renamed.
    bad_ack = await publisher.publish_bytes(
        subject,
        payload,
        msg_id=f"{tenant}-bad",
        headers={"X-Origin": "test", "Nats-Expected-Stream": "REQUESTS"},
    )
    await publisher.publish(subject, submitted(tenant, 2), msg_id=f"{tenant}-good")
    handled: asyncio.Queue[Delivery[JobSubmitted]] = asyncio.Queue()

    async def handler(delivery: Delivery[JobSubmitted]) -> None:
        handled.put_nowait(delivery)

    runner = await start_consumer(consumer_spec([subject]), JobSubmitted, handler=handler)
    letter = await next_item(dead)
    good = await next_item(handled)
    await runner.stop()

    assert good.message.job_id == "job-2"
    assert handled.empty(), "the handler never sees the undecodable message"
    assert letter.data == payload
    headers = letter.headers or {}
    assert headers["Loom-Error-Type"] == "DecodeError"
    assert headers["Loom-Error"]
    assert headers["Loom-Original-Subject"] == subject
    assert headers["Loom-Stream"] == "REQUESTS"
    assert headers["Loom-Stream-Seq"] == str(bad_ack.seq)
    assert headers["Loom-Deliveries"] == "1"
    assert headers["Loom-Consumer"] == runner.spec.durable
    assert headers["X-Origin"] == "test", "the original headers travel with the dead letter"
    assert headers["Loom-Original-Expected-Stream"] == "REQUESTS" and "Nats-Expected-Stream" not in headers
    assert headers["Nats-Msg-Id"] == f"dlq-REQUESTS-{bad_ack.seq}-{runner.spec.durable}"
    stored = await nc.jetstream().get_last_msg("DLQ", s.dead_letter(subject))
    assert stored.data == payload
    assert runner.counts == {"acked": 1, "nacked": 0, "dead_lettered": 1}
    settled = await _settled_on_server(nc, runner.spec.durable)
    assert settled == (0, 0), "the poison message is terminated, not pending"


@pytest.mark.parametrize(
    "error", [RuntimeError("boom"), TransientError("database restarting")], ids=lambda e: type(e).__name__
)
async def test_a_retryable_failure_is_redelivered_with_backoff_then_dead_lettered_after_max_deliver(
    nc: Client,
    start_consumer: StartConsumer,
    watch: Callable[[str], Awaitable["asyncio.Queue[Msg]"]],
    error: Exception,
) -> None:
    tenant = unique("t")
    subject = s.job_submitted(tenant)
    dead = await watch(s.dead_letter(subject))
    attempts: list[tuple[int, float]] = []

    async def handler(delivery: Delivery[JobSubmitted]) -> None:
        attempts.append((delivery.num_delivered, time.monotonic()))
        raise error

    spec = consumer_spec([subject], max_deliver=3, first_nak_delay_s=0.1, max_nak_delay_s=1.0)
    runner = await start_consumer(spec, JobSubmitted, handler=handler)
    await Publisher(nc).publish(subject, submitted(tenant), msg_id=f"{tenant}-1")
    letter = await next_item(dead)
    await runner.stop()

    assert [n for n, _ in attempts] == [1, 2, 3]
    gaps = [later - earlier for (_, earlier), (_, later) in itertools.pairwise(attempts)]
    assert gaps[0] >= 0.1 * 0.9, f"redelivered after {gaps[0]:.3f}s, before its nak delay"
    assert gaps[1] >= 0.2 * 0.9, f"second redelivery after {gaps[1]:.3f}s: the delay did not grow"
    headers = letter.headers or {}
    assert headers["Loom-Deliveries"] == "3"
    assert headers["Loom-Error-Type"] == type(error).__name__
    assert headers["Loom-Error"] == str(error)
    assert runner.counts == {"acked": 0, "nacked": 2, "dead_lettered": 1}


@pytest.mark.parametrize(
    "error",
    [InvalidInputError("tenant over quota forever"), LoomError("cannot ever work", non_retryable=True)],
    ids=lambda e: type(e).__name__,
)
async def test_a_non_retryable_error_is_dead_lettered_at_first_delivery(
    nc: Client,
    start_consumer: StartConsumer,
    watch: Callable[[str], Awaitable["asyncio.Queue[Msg]"]],
    error: LoomError,
) -> None:
    tenant = unique("t")
    subject = s.job_submitted(tenant)
    dead = await watch(s.dead_letter(subject))
    calls: list[int] = []

    async def handler(delivery: Delivery[JobSubmitted]) -> None:
        calls.append(delivery.num_delivered)
        raise error

    runner = await start_consumer(consumer_spec([subject], max_deliver=5), JobSubmitted, handler=handler)
    await Publisher(nc).publish(subject, submitted(tenant), msg_id=f"{tenant}-1")
    letter = await next_item(dead)
    await runner.stop()

    assert calls == [1]
    assert (letter.headers or {})["Loom-Deliveries"] == "1"
    assert (letter.headers or {})["Loom-Error-Type"] == type(error).__name__
    assert runner.counts == {"acked": 0, "nacked": 0, "dead_lettered": 1}


@pytest.mark.parametrize("callback_pull", [False, True])
async def test_a_batch_handler_settles_each_message_by_its_own_outcome(
    nc: Client,
    start_consumer: StartConsumer,
    watch: Callable[[str], Awaitable["asyncio.Queue[Msg]"]],
    callback_pull: bool,
) -> None:
    tenant = unique("t")
    subject = s.job_submitted(tenant)
    dead = await watch(s.dead_letter(subject))
    publisher = Publisher(nc)
    names = ["ok-1", "bad", "ok-2", "retry"]
    for n, name in enumerate(names):
        await publisher.publish(subject, submitted(tenant, n, name), msg_id=f"{tenant}-{name}")
    batches: list[list[tuple[str, int]]] = []

    async def batch_handler(deliveries: list[Delivery[JobSubmitted]]) -> list[BaseException | None]:
        batches.append([(d.message.name, d.num_delivered) for d in deliveries])
        outcomes: dict[str, BaseException | None] = {
            "bad": InvalidInputError("bad job"),
            "retry": RuntimeError("try again"),
        }
        return [outcomes.get(d.message.name) for d in deliveries]

    spec = consumer_spec([subject], max_deliver=2, first_nak_delay_s=0.05)
    runner = await start_consumer(
        spec, JobSubmitted, batch_handler=batch_handler, linger_s=0.2, callback_pull=callback_pull
    )
    letters = [await next_item(dead), await next_item(dead)]
    await runner.stop()

    by_name = {msgspec.json.decode(m.data)["name"]: m.headers or {} for m in letters}
    assert by_name["bad"]["Loom-Deliveries"] == "1"
    assert by_name["retry"]["Loom-Deliveries"] == "2"
    seen = [item for batch in batches for item in batch]
    assert sorted(seen) == sorted([("ok-1", 1), ("bad", 1), ("ok-2", 1), ("retry", 1), ("retry", 2)])
    assert max(len(b) for b in batches) > 1, "messages waiting together are handled as one batch"
    assert runner.counts == {"acked": 2, "nacked": 1, "dead_lettered": 2}


async def test_a_lingering_consumer_gathers_sparse_messages_into_one_batch(
    nc: Client, start_consumer: StartConsumer
) -> None:
    tenant = unique("t")
    subject = s.job_submitted(tenant)
    publisher = Publisher(nc)
    batches: list[list[str]] = []
    handled = asyncio.Event()

    async def batch_handler(deliveries: list[Delivery[JobSubmitted]]) -> list[BaseException | None]:
        batches.append([d.message.job_id for d in deliveries])
        if sum(len(b) for b in batches) == 3:
            handled.set()
        return [None] * len(deliveries)

    runner = await start_consumer(
        consumer_spec([subject]),
        JobSubmitted,
        batch_handler=batch_handler,
        callback_pull=True,
        linger_s=2.0,
        idle_fetch_timeout_s=10.0,
    )
    await asyncio.sleep(0.3)  # the standing request is out
    for n in range(3):
        await publisher.publish(subject, submitted(tenant, n), msg_id=f"{tenant}-{n}")
        await asyncio.sleep(0.2)  # sparse: each alone would be a batch of its own without lingering
    await asyncio.wait_for(handled.wait(), WAIT_S)
    assert batches == [["job-0", "job-1", "job-2"]]
    assert runner.counts["acked"] == 3


async def test_a_lingering_consumer_stops_lingering_once_its_request_is_used_up(
    nc: Client, start_consumer: StartConsumer
) -> None:
    tenant = unique("t")
    subject = s.job_submitted(tenant)
    publisher = Publisher(nc)
    for n in range(3):
        await publisher.publish(subject, submitted(tenant, n), msg_id=f"{tenant}-{n}")
    handled = asyncio.Event()
    batches: list[int] = []

    async def batch_handler(deliveries: list[Delivery[JobSubmitted]]) -> list[BaseException | None]:
        batches.append(len(deliveries))
        handled.set()
        return [None] * len(deliveries)

    # A linger far past the wait below: all the request asked for is on hand at once, and nothing
    # more can come, so the batch goes without it.
    await start_consumer(
        consumer_spec([subject], batch=3),
        JobSubmitted,
        batch_handler=batch_handler,
        callback_pull=True,
        linger_s=120.0,
        idle_fetch_timeout_s=300.0,
    )
    await asyncio.wait_for(handled.wait(), WAIT_S)
    assert batches == [3]


async def test_a_stop_does_not_wait_out_the_standing_pull_request(
    nc: Client, start_consumer: StartConsumer
) -> None:
    async def handle(delivery: Delivery[JobSubmitted]) -> None:
        raise AssertionError(f"nothing was published, yet {delivery.msg_id} came")

    # A request that would stand for five minutes: a stop ends the wait for its messages at once.
    runner = await start_consumer(
        consumer_spec([s.job_submitted(unique("t"))]),
        JobSubmitted,
        handler=handle,
        callback_pull=True,
        idle_fetch_timeout_s=300.0,
    )
    await asyncio.sleep(0.3)  # the request is out and the loop waits for messages
    await asyncio.wait_for(runner.stop(), WAIT_S)


async def test_messages_waiting_on_hand_behind_a_long_batch_are_kept_alive(
    nc: Client, start_consumer: StartConsumer
) -> None:
    """A standing pull request goes on delivering while a batch is handled: what waits on hand for
    the next batch is said to be in progress too, or the server delivers it again past its ack
    wait (a second copy in a later batch)."""
    tenant = unique("t")
    subject = s.job_submitted(tenant)
    publisher = Publisher(nc)
    first_in = asyncio.Event()
    release = asyncio.Event()
    seen: list[tuple[str, int]] = []

    async def batch_handler(deliveries: list[Delivery[JobSubmitted]]) -> list[BaseException | None]:
        seen.extend((d.message.job_id, d.num_delivered) for d in deliveries)
        if not first_in.is_set():
            first_in.set()
            await asyncio.wait_for(release.wait(), WAIT_S)  # a batch far longer than the ack wait
        return [None] * len(deliveries)

    runner = await start_consumer(
        consumer_spec([subject], ack_wait_s=1.0),
        JobSubmitted,
        batch_handler=batch_handler,
        callback_pull=True,
        linger_s=0.0,
        idle_fetch_timeout_s=10.0,
    )
    await publisher.publish(subject, submitted(tenant, 0), msg_id=f"{tenant}-0")
    await asyncio.wait_for(first_in.wait(), WAIT_S)
    await publisher.publish(subject, submitted(tenant, 1), msg_id=f"{tenant}-1")  # lands on hand
    await asyncio.sleep(3.0)  # three ack waits
    release.set()

    async def both_acked() -> bool:
        return runner.counts["acked"] >= 2

    await until(both_acked, WAIT_S, "both messages acked")
    await asyncio.sleep(0.5)  # a second copy, were one on its way, would be handled by now
    assert seen == [("job-0", 1), ("job-1", 1)]


async def test_what_arrives_on_hand_while_a_consumer_waits_out_an_outage_is_handled_once(
    nc: Client, start_consumer: StartConsumer
) -> None:
    """A pipelined callback pull has its next batch on hand when the batch in a slot meets an
    outage. Before, the loop waited the outage out with that batch on hand and nothing keeping it
    alive: past its ack wait the server redelivered it, and after the resume the stale copies went
    to a handler beside the redelivered ones (a review: m0 and m1 handled three times)."""
    tenant = unique("t")
    subject = s.job_submitted(tenant)
    state = {"down": False}

    async def probe() -> None:
        if state["down"]:
            raise OSError("the database refused the connection")

    dependencies = Dependencies(
        Dependency("db", probe, lambda exc: isinstance(exc, UnavailableError)), first_backoff_s=0.05
    )
    handled: list[tuple[str, int]] = []
    succeeded: list[str] = []

    async def batch_handler(deliveries: list[Delivery[JobSubmitted]]) -> list[BaseException | None]:
        handled.extend((d.message.job_id, d.num_delivered) for d in deliveries)
        if deliveries[0].message.job_id == "job-0" and deliveries[0].num_delivered == 1:
            await asyncio.sleep(0.3)  # the next batch lands on hand meanwhile
            state["down"] = True
            return [UnavailableError("database down", dependency="db")] * len(deliveries)
        await asyncio.sleep(0.5)
        succeeded.extend(d.message.job_id for d in deliveries)
        return [None] * len(deliveries)

    publisher = Publisher(nc)
    for n in range(4):
        await publisher.publish(subject, submitted(tenant, n), msg_id=f"{tenant}-{n}")
    runner = await start_consumer(
        consumer_spec([subject], ack_wait_s=1.0, batch=2, first_nak_delay_s=0.05),
        JobSubmitted,
        batch_handler=batch_handler,
        callback_pull=True,
        pipeline=2,
        linger_s=0.0,
        idle_fetch_timeout_s=0.5,
        dependencies=dependencies,
    )
    try:

        async def paused() -> bool:
            return runner.waiting_for == ["db"]

        await until(paused, WAIT_S, "the consumer paused for the outage")
        await asyncio.sleep(3.0)  # three ack waits
        state["down"] = False

        async def all_acked() -> bool:
            return runner.counts["acked"] >= 4

        await until(all_acked, WAIT_S, "every message acked")
        await asyncio.sleep(2.0)  # a stale copy, or a redelivery of an acked one, would be handled by now
    finally:
        await dependencies.close()
    assert sorted(succeeded) == ["job-0", "job-1", "job-2", "job-3"], handled


@pytest.mark.parametrize("callback_pull", [True, False])
async def test_suspects_waiting_their_turn_are_kept_alive_and_handled_once(
    nc: Client, start_consumer: StartConsumer, callback_pull: bool
) -> None:
    """Much-redelivered messages (suspects) are handled one by one after the rest of their batch;
    before, only the one being handled was said to be in progress, and the others, past their ack
    wait, were redelivered and handled a second time (a review)."""
    tenant = unique("t")
    subject = s.job_submitted(tenant)
    handled: list[tuple[str, int]] = []

    async def handler(d: Delivery[JobSubmitted]) -> None:
        handled.append((d.message.job_id, d.num_delivered))
        if d.num_delivered == 1:
            raise TransientError("fails once")  # comes back as a suspect (suspect_after=1)
        await asyncio.sleep(1.5)  # longer than the ack wait

    publisher = Publisher(nc)
    for n in range(3):
        await publisher.publish(subject, submitted(tenant, n), msg_id=f"{tenant}-{n}")
    runner = await start_consumer(
        consumer_spec(
            [subject], ack_wait_s=1.0, batch=10, first_nak_delay_s=0.3, max_nak_delay_s=0.3, suspect_after=1
        ),
        JobSubmitted,
        handler=handler,
        callback_pull=callback_pull,
        linger_s=0.2,
        idle_fetch_timeout_s=2.0,
    )

    async def all_acked() -> bool:
        return runner.counts["acked"] >= 3

    await until(all_acked, 3 * WAIT_S, "every message acked")
    await asyncio.sleep(3.0)  # a redelivered copy would be handled by now
    assert sorted(job for job, n in handled if n > 1) == ["job-0", "job-1", "job-2"], handled


async def test_a_suspect_handled_alone_is_kept_alive_until_it_is_settled(
    nc: Client, start_consumer: StartConsumer
) -> None:
    """A suspect is handled alone; before, it was said to be in progress only while its handler
    ran, and a settling that outlasted the ack wait (here: the probe of a slow database its
    failure pointed at) had the server redeliver it: the copy was handled after the message had
    been dead-lettered (a review)."""
    tenant = unique("t")
    subject = s.job_submitted(tenant)

    async def probe() -> None:
        await asyncio.sleep(1.5)  # slow, but it answers: no outage; longer than the ack wait

    dependencies = Dependencies(Dependency("db", probe, lambda exc: isinstance(exc, UnavailableError)))
    handled: list[int] = []

    async def handler(d: Delivery[JobSubmitted]) -> None:
        handled.append(d.num_delivered)
        if d.num_delivered == 1:
            raise TransientError("fails once")  # comes back as a suspect (suspect_after=1)
        if d.num_delivered == 2:
            raise UnavailableError("database slow", dependency="db")  # its second failure: dead-lettered

    await Publisher(nc).publish(subject, submitted(tenant, 0), msg_id=f"{tenant}-0")
    spec = consumer_spec(
        [subject], ack_wait_s=1.0, first_nak_delay_s=0.3, max_nak_delay_s=0.3, suspect_after=1, max_deliver=2
    )
    runner = await start_consumer(
        spec,
        JobSubmitted,
        handler=handler,
        callback_pull=True,
        linger_s=0.0,
        idle_fetch_timeout_s=2.0,
        dependencies=dependencies,
    )
    try:

        async def dead_lettered() -> bool:
            return runner.counts["dead_lettered"] >= 1

        await until(dead_lettered, 3 * WAIT_S, "the message dead-lettered")
        await asyncio.sleep(3.0)  # a redelivered copy would be handled by now
    finally:
        await dependencies.close()
    assert handled == [1, 2], "handled again after its dead letter"
    assert runner.counts["acked"] == 0


async def test_a_pipelined_consumer_fetches_the_next_batch_while_one_is_handled_and_settles_each(
    nc: Client, start_consumer: StartConsumer
) -> None:
    tenant = unique("t")
    subject = s.job_submitted(tenant)
    publisher = Publisher(nc)
    release = asyncio.Event()
    second_started = asyncio.Event()
    batches: list[list[str]] = []

    async def batch_handler(deliveries: list[Delivery[JobSubmitted]]) -> list[BaseException | None]:
        batches.append([d.message.job_id for d in deliveries])
        if len(batches) == 1:
            await asyncio.wait_for(release.wait(), WAIT_S)  # still handling when the next arrives
        else:
            second_started.set()
        return [None] * len(deliveries)

    spec = consumer_spec([subject], batch=1)
    runner = await start_consumer(spec, JobSubmitted, batch_handler=batch_handler, pipeline=2)
    for n in range(2):
        await publisher.publish(subject, submitted(tenant, n), msg_id=f"{tenant}-{n}")
    await asyncio.wait_for(second_started.wait(), WAIT_S)
    assert runner.counts["acked"] <= 1, "the first batch is not acked before its handler returns"
    release.set()

    async def both_acked() -> bool:
        return runner.counts["acked"] == 2

    await until(both_acked, WAIT_S, "both batches acked")
    await runner.stop()
    assert batches == [["job-0"], ["job-1"]]
    assert runner.counts == {"acked": 2, "nacked": 0, "dead_lettered": 0}


async def test_a_pipelined_callback_pull_has_its_next_batch_on_hand_while_every_slot_is_busy(
    nc: Client, start_consumer: StartConsumer
) -> None:
    """A used-up pull request is renewed as its messages go to a handler, not at the next fetch: a
    pipelined consumer whose every slot is busy then finds the next batch already on hand when a
    slot frees (before, nothing was asked for until then, and a burst waited a round trip and a
    batch's delivery each time the request ran out)."""
    tenant = unique("t")
    subject = s.job_submitted(tenant)
    publisher = Publisher(nc)
    for n in range(9):
        await publisher.publish(subject, submitted(tenant, n, f"m{n}"), msg_id=f"{tenant}-{n}")
    release = asyncio.Event()
    batches: list[list[str]] = []

    async def batch_handler(deliveries: list[Delivery[JobSubmitted]]) -> list[BaseException | None]:
        batches.append([d.message.name for d in deliveries])
        await asyncio.wait_for(release.wait(), WAIT_S)
        return [None] * len(deliveries)

    spec = consumer_spec([subject], batch=3)
    runner = await start_consumer(
        spec, JobSubmitted, batch_handler=batch_handler, callback_pull=True, linger_s=0.0, pipeline=2
    )

    async def next_batch_on_hand() -> bool:
        return len(batches) == 2 and runner.buffered == 3

    await until(next_batch_on_hand, WAIT_S, "two batches handled and the third on hand")
    assert sum(len(b) for b in batches) == 6
    release.set()

    async def all_acked() -> bool:
        return runner.counts["acked"] == 9

    await until(all_acked, WAIT_S, "every message acked")
    await runner.stop()
    assert sorted(name for b in batches for name in b) == [f"m{n}" for n in range(9)]
    assert runner.counts == {"acked": 9, "nacked": 0, "dead_lettered": 0}


@pytest.mark.parametrize("pipeline", [1, 3])
async def test_a_callback_pull_hands_over_one_batch_at_a_time_and_keeps_what_waits_alive(
    nc: Client, start_consumer: StartConsumer, pipeline: int
) -> None:
    """Handlers slower than the request's renewal (0.2 s idle fetch) and than the ack wait (1 s):
    a renewal never counts the messages already on hand against the new request (that asked for a
    second batch, and handed over two at once), and what waits on hand for a free slot is kept alive
    (else the server redelivers it and it is handled twice)."""
    tenant = unique("t")
    subject = s.job_submitted(tenant)
    publisher = Publisher(nc)
    for n in range(30):
        await publisher.publish(subject, submitted(tenant, n, f"m{n}"), msg_id=f"{tenant}-{n}")
    sizes: list[int] = []
    names: list[str] = []

    async def batch_handler(deliveries: list[Delivery[JobSubmitted]]) -> list[BaseException | None]:
        sizes.append(len(deliveries))
        names.extend(d.message.name for d in deliveries)
        await asyncio.sleep(1.5)
        return [None] * len(deliveries)

    spec = consumer_spec([subject], batch=5, ack_wait_s=1.0)
    runner = await start_consumer(
        spec,
        JobSubmitted,
        batch_handler=batch_handler,
        callback_pull=True,
        linger_s=0.0,
        pipeline=pipeline,
        idle_fetch_timeout_s=0.2,
    )

    async def all_acked() -> bool:
        return runner.counts["acked"] >= 30

    await until(all_acked, 60.0, "every message acked")
    await runner.stop()
    assert max(sizes) <= 5
    assert sorted(names) == sorted(f"m{n}" for n in range(30)), "each message handled once"


async def test_a_stopped_pipelined_consumer_gives_back_what_it_had_on_hand(
    nc: Client, start_consumer: StartConsumer
) -> None:
    """The next batch a pipelined consumer asked for ahead, on hand when it stops, is naked at once:
    the consumer that takes over (a new placement leader) gets it now, not after the ack wait."""
    tenant = unique("t")
    subject = s.job_submitted(tenant)
    publisher = Publisher(nc)
    for n in range(40):
        await publisher.publish(subject, submitted(tenant, n, f"m{n}"), msg_id=f"{tenant}-{n}")
    handled: set[str] = set()

    async def batch_handler(deliveries: list[Delivery[JobSubmitted]]) -> list[BaseException | None]:
        handled.update(d.message.name for d in deliveries)
        await asyncio.sleep(0.3)
        return [None] * len(deliveries)

    spec = consumer_spec([subject], batch=5, ack_wait_s=30.0)
    first = await start_consumer(
        spec, JobSubmitted, batch_handler=batch_handler, callback_pull=True, linger_s=0.0, pipeline=3
    )

    async def one_ahead() -> bool:
        return len(handled) == 15 and first.buffered == 5

    await until(one_ahead, WAIT_S, "three batches in hand and the next on hand")
    await first.stop()
    assert first.buffered == 0
    second = await start_consumer(
        spec, JobSubmitted, batch_handler=batch_handler, callback_pull=True, linger_s=0.0, pipeline=3
    )

    async def all_handled() -> bool:
        return len(handled) == 40

    await until(all_handled, 10.0, "every message handled well within the 30 s ack wait")
    await second.stop()


async def test_a_callback_pull_consumer_renews_its_pull_request_and_keeps_receiving(
    nc: Client, start_consumer: StartConsumer
) -> None:
    tenant = unique("t")
    subject = s.job_submitted(tenant)
    publisher = Publisher(nc)
    got: asyncio.Queue[list[str]] = asyncio.Queue()

    async def batch_handler(deliveries: list[Delivery[JobSubmitted]]) -> list[BaseException | None]:
        got.put_nowait([d.message.name for d in deliveries])
        return [None] * len(deliveries)

    spec = consumer_spec([subject], batch=3)
    runner = await start_consumer(
        spec, JobSubmitted, batch_handler=batch_handler, callback_pull=True, idle_fetch_timeout_s=0.3
    )
    await asyncio.sleep(1.0)  # several pull requests expire meanwhile
    for n in range(7):  # more than one request's batch
        await publisher.publish(subject, submitted(tenant, n, f"m{n}"), msg_id=f"{tenant}-{n}")
    seen: list[str] = []
    while len(seen) < 7:
        seen += await next_item(got)
    await runner.stop()
    assert sorted(seen) == [f"m{n}" for n in range(7)]
    assert runner.counts == {"acked": 7, "nacked": 0, "dead_lettered": 0}
    assert await _settled_on_server(nc, spec.durable) == (0, 0)


async def test_an_idle_callback_pull_asks_again_only_as_its_own_request_runs_out(
    nc: Client, start_consumer: StartConsumer
) -> None:
    """A standing pull request is renewed a little before it expires; the request it replaced still
    ends with its own "408 expired" a moment later. That status belongs to the old request, so it
    must not make the runner ask again (it did, every time: twice the requests while idle)."""
    spec = consumer_spec([s.job_submitted(unique("t"))])

    async def handle(delivery: Delivery[JobSubmitted]) -> None:
        raise AssertionError(f"nothing was published, yet {delivery.msg_id} came")

    runner = await start_consumer(
        spec, JobSubmitted, handler=handle, callback_pull=True, idle_fetch_timeout_s=0.3
    )
    pulls_before = runner.pulls
    idle_s = 3.0
    await asyncio.sleep(idle_s)  # the idle period measured: its pull requests and their expiries
    pulls = runner.pulls - pulls_before
    assert pulls >= 3, "the request was renewed while idle"
    # One request per renewal (at 0.9 of the 0.3 s expiry, or later on a slow loop), never one more
    # per expired request: that would be about twice as many.
    assert pulls <= idle_s / (0.9 * 0.3) + 2
    assert runner.counts == {"acked": 0, "nacked": 0, "dead_lettered": 0}


async def test_a_batch_handler_that_raises_fails_every_message_of_the_batch(
    nc: Client, start_consumer: StartConsumer
) -> None:
    tenant = unique("t")
    subject = s.job_submitted(tenant)
    for n in (1, 2):
        await Publisher(nc).publish(subject, submitted(tenant, n), msg_id=f"{tenant}-{n}")
    done: asyncio.Queue[tuple[str, int]] = asyncio.Queue()
    calls = 0

    async def batch_handler(deliveries: list[Delivery[JobSubmitted]]) -> list[BaseException | None]:
        nonlocal calls
        calls += 1
        if any(d.num_delivered == 1 for d in deliveries):
            raise RuntimeError("whole batch failed")
        for d in deliveries:
            done.put_nowait((d.message.job_id, d.num_delivered))
        return [None] * len(deliveries)

    spec = consumer_spec([subject], max_deliver=3, first_nak_delay_s=0.05)
    runner = await start_consumer(spec, JobSubmitted, batch_handler=batch_handler, linger_s=0.2)
    results = sorted([await next_item(done), await next_item(done)])
    await runner.stop()

    assert results == [("job-1", 2), ("job-2", 2)]
    assert runner.counts["nacked"] == 2
    assert runner.counts["acked"] == 2


async def test_message_type_bytes_passes_the_raw_payload(nc: Client, start_consumer: StartConsumer) -> None:
    subject = s.job_submitted(unique("t"))
    payload = b"\x00\xffnot json at all"
    await Publisher(nc).publish_bytes(subject, payload, msg_id=unique("m"))
    seen: asyncio.Queue[Delivery[bytes]] = asyncio.Queue()

    async def handler(delivery: Delivery[bytes]) -> None:
        seen.put_nowait(delivery)

    runner = await start_consumer(consumer_spec([subject]), bytes, handler=handler)
    delivery = await next_item(seen)
    await runner.stop()

    assert delivery.message == payload
    assert runner.counts == {"acked": 1, "nacked": 0, "dead_lettered": 0}


async def test_a_concurrent_handler_handles_the_messages_of_one_fetch_at_once(
    nc: Client, start_consumer: StartConsumer, spans: InMemorySpanExporter
) -> None:
    tenant = unique("t")
    subject = s.job_submitted(tenant)
    for n in (1, 2, 3):
        await Publisher(nc).publish(subject, submitted(tenant, n), msg_id=f"{tenant}-{n}")
    inside: set[str] = set()
    all_inside = asyncio.Event()
    span_ids: asyncio.Queue[int] = asyncio.Queue()

    async def handler(delivery: Delivery[JobSubmitted]) -> None:
        # Returns only once every message is inside a handler: handled one by one, none would.
        inside.add(delivery.message.job_id)
        if len(inside) == 3:
            all_inside.set()
        await asyncio.wait_for(all_inside.wait(), WAIT_S)
        span_ids.put_nowait(trace.get_current_span().get_span_context().span_id)

    runner = await start_consumer(
        consumer_spec([subject]), JobSubmitted, handler=handler, concurrent=True, linger_s=0.2
    )
    ids = {await next_item(span_ids) for _ in range(3)}
    await runner.stop()

    consumer_spans = {sp.context.span_id for sp in spans.get_finished_spans() if sp.kind == SpanKind.CONSUMER}
    assert ids == consumer_spans, "each handler runs under its own consumer span"
    assert len(ids) == 3
    assert runner.counts == {"acked": 3, "nacked": 0, "dead_lettered": 0}


# -- tracing -----------------------------------------------------------------------------------------


def _span(spans: Sequence[ReadableSpan], kind: SpanKind, subject: str) -> ReadableSpan:
    matching = [
        sp
        for sp in spans
        if sp.kind == kind and (sp.attributes or {}).get("messaging.destination.name") == subject
    ]
    assert len(matching) == 1, f"{len(matching)} {kind.name} spans for {subject}"
    return matching[0]


async def test_the_consumer_span_continues_the_publishers_trace(
    nc: Client, start_consumer: StartConsumer, spans: InMemorySpanExporter
) -> None:
    subject = s.job_submitted(unique("t"))
    current: asyncio.Queue[trace.SpanContext] = asyncio.Queue()

    async def handler(delivery: Delivery[JobSubmitted]) -> None:
        current.put_nowait(trace.get_current_span().get_span_context())

    runner = await start_consumer(consumer_spec([subject]), JobSubmitted, handler=handler)
    await Publisher(nc).publish(subject, submitted("t"), msg_id=unique("m"))
    in_handler = await next_item(current)
    await runner.stop()

    finished = spans.get_finished_spans()
    producer = _span(finished, SpanKind.PRODUCER, subject)
    consumer = _span(finished, SpanKind.CONSUMER, subject)
    assert producer.context is not None and consumer.context is not None
    assert consumer.context.trace_id == producer.context.trace_id
    assert consumer.parent is not None
    assert consumer.parent.span_id == producer.context.span_id
    assert in_handler.trace_id == producer.context.trace_id
    assert in_handler.span_id == consumer.context.span_id, "the handler runs under the consumer span"


async def test_recorded_batch_publish_and_consumer_spans_carry_their_messaging_attributes(
    nc: Client, start_consumer: StartConsumer, spans: InMemorySpanExporter
) -> None:
    subject = s.job_submitted(unique("t"))
    msg_id = unique("m")
    handled: asyncio.Queue[int] = asyncio.Queue()

    async def handler(delivery: Delivery[JobSubmitted]) -> None:
        handled.put_nowait(delivery.stream_seq)

    runner = await start_consumer(consumer_spec([subject]), JobSubmitted, handler=handler)
    payload = msgspec.json.encode(submitted("t"))
    assert await Publisher(nc).publish_batch([Outgoing(subject, payload, msg_id, {})]) == [None]
    seq = await next_item(handled)
    await runner.stop()

    finished = spans.get_finished_spans()
    producer = _span(finished, SpanKind.PRODUCER, subject).attributes or {}
    consumer = _span(finished, SpanKind.CONSUMER, subject).attributes or {}
    assert (producer["messaging.message.id"], producer["messaging.message.body.size"]) == (
        msg_id,
        len(payload),
    )
    assert producer["messaging.operation.type"] == "publish"
    assert (consumer["messaging.message.id"], consumer["messaging.nats.stream_sequence"]) == (msg_id, seq)
    assert consumer["messaging.nats.delivery_count"] == 1
    assert consumer["messaging.operation.type"] == "process"


async def test_a_dead_letter_continues_the_trace_of_the_poison_message(
    nc: Client,
    start_consumer: StartConsumer,
    spans: InMemorySpanExporter,
    watch: Callable[[str], Awaitable["asyncio.Queue[Msg]"]],
) -> None:
    subject = s.job_submitted(unique("t"))
    dead = await watch(s.dead_letter(subject))

    async def handler(delivery: Delivery[JobSubmitted]) -> None:
        return None

    runner = await start_consumer(consumer_spec([subject]), JobSubmitted, handler=handler)
    await Publisher(nc).publish_bytes(subject, b"garbage", msg_id=unique("m"))
    await next_item(dead)
    await runner.stop()

    finished = spans.get_finished_spans()
    original = _span(finished, SpanKind.PRODUCER, subject)
    parked = _span(finished, SpanKind.PRODUCER, s.dead_letter(subject))
    assert original.context is not None and parked.context is not None
    assert parked.context.trace_id == original.context.trace_id
    consumer = _span(finished, SpanKind.CONSUMER, subject)
    assert not consumer.status.is_ok


async def test_a_message_given_back_by_a_fenced_instance_is_not_counted_toward_dead_lettering(
    nc: Client,
    start_consumer: StartConsumer,
    watch: Callable[[str], Awaitable["asyncio.Queue[Msg]"]],
) -> None:
    """A placement instance that lost its fence raises NotLeaderError for whatever it still
    fetches; those deliveries must not use up the message's budget (max_deliver 2 here), or a
    leadership change would dead-letter acknowledged submissions."""
    tenant = unique("t")
    subject = s.job_submitted(tenant)
    dead = await watch(s.dead_letter(subject))
    handled: asyncio.Queue[int] = asyncio.Queue()
    attempts: list[int] = []

    async def handler(delivery: Delivery[JobSubmitted]) -> None:
        attempts.append(delivery.num_delivered)
        if len(attempts) <= 4:
            raise NotLeaderError("fenced: a newer leader holds token 7") from RuntimeError("fence")
        await handled.put(delivery.num_delivered)

    spec = consumer_spec([subject], max_deliver=2, first_nak_delay_s=0.05)
    runner = await start_consumer(spec, JobSubmitted, handler=handler)
    await Publisher(nc).publish(subject, submitted(tenant), msg_id=f"{tenant}-1")
    assert await next_item(handled) == 5
    await runner.stop()
    assert dead.empty()
    assert runner.counts["not_ours"] == 4 and runner.counts["dead_lettered"] == 0


async def test_caught_up_waits_for_a_consumer_to_have_nothing_pending(nc: Client) -> None:
    from nats.js.api import AckPolicy, ConsumerConfig

    from loom.bus.consumer import caught_up

    js = nc.jetstream()
    subject = s.job_event("started", unique("t"))
    durable = unique("behind")
    await js.add_consumer(
        "JOBS", ConsumerConfig(durable_name=durable, filter_subject=subject, ack_policy=AckPolicy.EXPLICIT)
    )
    await Publisher(nc).publish_bytes(subject, b"{}", msg_id=unique("m"))

    async def pending() -> bool:  # as the server counts it (under CI load, a moment after the ack)
        return (await js.consumer_info("JOBS", durable)).num_pending == 1

    await until(pending, 10, "the message pending")
    assert not await caught_up(js, "JOBS", durable, within_s=0.3)  # one message not handled yet
    sub = await js.pull_subscribe_bind(durable, "JOBS")
    (msg,) = await sub.fetch(1, timeout=2)
    assert not await caught_up(js, "JOBS", durable, within_s=0.3)  # delivered, not acknowledged
    await msg.ack_sync()
    assert await caught_up(js, "JOBS", durable, within_s=2.0)
    assert not await caught_up(js, "JOBS", unique("nobody"), within_s=0.3)  # unknown: no waiting
