"""A message that kills the process handling it is dead-lettered after a bounded number of lives;
one held back by outages never is. On real NATS.

A "process life" here is a fresh connection and a fresh ConsumerRunner (nothing carried over in
memory); it "dies" mid-handler: its loop is cancelled and its connection closed without settling
the message, which JetStream redelivers after the ack wait, as after a SIGKILL.
"""

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from waiting import until

from loom.bus import ConsumerRunner, ConsumerSpec, Delivery, Publisher, connect, ensure_streams
from loom.bus.attempts import AttemptLog, Attempts
from loom.bus.outage import Dependencies, Dependency
from loom.errors import TransientError, UnavailableError
from loom.tasks import cancel_and_wait
from loom_proto import subjects as s

ACK_WAIT_S = 0.6


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="module")
async def nc(nats_url: str) -> AsyncIterator[Client]:
    client = await connect(nats_url, "test-crash-loop")
    await ensure_streams(client.jetstream())
    yield client
    await client.close()


def spec_for(subject: str, **kwargs: Any) -> ConsumerSpec:
    kwargs.setdefault("first_nak_delay_s", 0.05)
    kwargs.setdefault("max_nak_delay_s", 0.2)
    return ConsumerSpec(
        stream="CLUSTERS", durable=unique("crash"), filter_subjects=[subject], ack_wait_s=ACK_WAIT_S, **kwargs
    )


async def dead_letters(nc: Client, subject: str) -> "asyncio.Queue[Msg]":
    queue: asyncio.Queue[Msg] = asyncio.Queue()

    async def on_msg(msg: Msg) -> None:
        queue.put_nowait(msg)

    await nc.subscribe(s.dead_letter(subject), cb=on_msg)
    await nc.flush()
    return queue


async def test_a_message_that_kills_its_process_every_time_is_dead_lettered_after_max_crashes(
    nc: Client, nats_url: str
) -> None:
    subject = s.cluster_command(unique("c"), "stop")
    spec = spec_for(subject, suspect_after=1, max_crashes=2)
    dead = await dead_letters(nc, subject)
    await Publisher(nc).publish_bytes(subject, b'{"kind":"stop","job_id":"j"}', msg_id=unique("m"))
    deliveries: list[int] = []
    lives = 0
    try:
        # Delivery 1 (not suspect) and 2, 3 (suspects, attempts recorded) kill their process; the
        # 4th finds 2 attempts that never came back and dead-letters the message unhandled.
        while dead.empty() and lives < 8:
            lives += 1
            client = await connect(nats_url, f"test-crash-life-{lives}")
            entered = asyncio.Event()

            async def crash(d: Delivery[bytes], entered: asyncio.Event = entered) -> None:
                deliveries.append(d.num_delivered)
                entered.set()
                await asyncio.Event().wait()  # the process "hangs" here until it is killed

            runner: ConsumerRunner[bytes] = ConsumerRunner(
                client, spec, bytes, handler=crash, idle_fetch_timeout_s=0.2
            )
            await runner.start()
            dead_wait = asyncio.ensure_future(dead.get())
            entered_wait = asyncio.ensure_future(entered.wait())
            done, _ = await asyncio.wait(
                {dead_wait, entered_wait}, timeout=10.0, return_when=asyncio.FIRST_COMPLETED
            )
            entered_wait.cancel()
            if dead_wait in done:
                dead.put_nowait(dead_wait.result())
                for _ in range(100):  # the dead letter is out; the term follows it
                    if runner.counts["dead_lettered"]:
                        break
                    await asyncio.sleep(0.05)
            else:
                dead_wait.cancel()
            assert done, f"life {lives}: neither handled nor dead-lettered within 10 s"
            # Killed: the loop is cancelled mid-handler, the connection dropped, nothing settled.
            # Cancelled again while it runs on: on Python 3.11 ``asyncio.wait_for`` (in the NATS
            # client's requests) drops a cancellation that arrives as the awaited reply does, and
            # one cancel left the loop fetching and the test hung for its whole timeout (once, in
            # ``make test``).
            assert runner._task is not None
            await cancel_and_wait([runner._task])
            await client.close()
        assert not dead.empty(), f"still redelivered after {lives} process lives (deliveries {deliveries})"
        letter = dead.get_nowait()
        headers = letter.headers or {}
        assert headers["Loom-Error-Type"] == "CrashLoopError"
        assert "ended 2 times" in headers["Loom-Error"]
        assert headers["Loom-Deliveries"] == "4"
        assert deliveries == [1, 2, 3], "the handler must not run again once the crashes are counted"
        assert lives == 4
        info = await nc.jetstream().consumer_info(spec.stream, spec.durable)
        assert info.num_ack_pending == 0 and info.num_pending == 0, "the message is settled (terminated)"
    finally:
        await nc.jetstream().delete_consumer(spec.stream, spec.durable)


async def test_outages_never_count_as_crashes_nor_failures_of_a_much_redelivered_message(
    nc: Client,
) -> None:
    subject = s.cluster_command(unique("c"), "stop")
    # One unfinished attempt would already dead-letter it: every outage must close its attempt.
    spec = spec_for(subject, suspect_after=1, max_crashes=1, max_deliver=1)
    dead = await dead_letters(nc, subject)
    state = {"down": False, "outages_left": 5}

    async def probe() -> None:
        if state["down"]:
            state["down"] = False  # back at the next probe
            raise OSError("fake database refused the connection")

    dependencies = Dependencies(
        Dependency("fakedb", probe, lambda exc: isinstance(exc, UnavailableError)), first_backoff_s=0.05
    )
    handled: list[int] = []

    async def handler(d: Delivery[bytes]) -> None:
        handled.append(d.num_delivered)
        if state["outages_left"] > 0:
            state["outages_left"] -= 1
            state["down"] = True
            raise UnavailableError("fake database down", dependency="fakedb")

    runner: ConsumerRunner[bytes] = ConsumerRunner(
        nc, spec, bytes, handler=handler, idle_fetch_timeout_s=0.2, dependencies=dependencies
    )
    await runner.start()
    try:
        await Publisher(nc).publish_bytes(subject, b"{}", msg_id=unique("m"))
        deadline = asyncio.get_running_loop().time() + 15.0
        while runner.counts["acked"] < 1:
            assert asyncio.get_running_loop().time() < deadline, f"not acked; handled at deliveries {handled}"
            await asyncio.sleep(0.05)
        assert handled == [1, 2, 3, 4, 5, 6]
        assert runner.held_for_outage == 5
        assert runner.counts["dead_lettered"] == 0 and dead.empty()
    finally:
        await runner.stop()
        await nc.jetstream().delete_consumer(spec.stream, spec.durable)


async def test_a_handler_that_fails_once_per_process_life_is_dead_lettered_after_max_deliver_failures(
    nc: Client, nats_url: str
) -> None:
    """Each life fails the message once and then restarts (a supervisor restarting a service that
    exits after an error): in-memory counts alone would start afresh every time."""
    subject = s.cluster_command(unique("c"), "stop")
    # The redelivery after a failure comes 1 s later: in the next life.
    spec = spec_for(subject, suspect_after=1, max_deliver=2, first_nak_delay_s=1.0, max_nak_delay_s=1.0)
    dead = await dead_letters(nc, subject)
    await Publisher(nc).publish_bytes(subject, b"{}", msg_id=unique("m"))
    deliveries: list[int] = []
    lives = 0
    try:
        while dead.empty() and lives < 6:
            lives += 1
            client = await connect(nats_url, f"test-fail-life-{lives}")

            async def fail(d: Delivery[bytes]) -> None:
                deliveries.append(d.num_delivered)
                raise ValueError("this message always breaks the handler")

            runner: ConsumerRunner[bytes] = ConsumerRunner(
                client, spec, bytes, handler=fail, idle_fetch_timeout_s=0.2
            )
            await runner.start()
            for _ in range(200):  # until this life has settled the delivery one way or the other
                if runner.counts["nacked"] or runner.counts["dead_lettered"]:
                    break
                await asyncio.sleep(0.05)
            await runner.stop()
            await client.close()
        letter = await asyncio.wait_for(dead.get(), 5.0)
        headers = letter.headers or {}
        assert headers["Loom-Error-Type"] == "ValueError"
        assert headers["Loom-Failures"] == "2"
        assert deliveries == [1, 2, 3], "failed in lives 1 (not yet a suspect) and 2, dead-lettered in 3"
    finally:
        await nc.jetstream().delete_consumer(spec.stream, spec.durable)


async def test_two_overlapping_attempts_at_a_suspect_keep_each_others_open_attempt(
    nc: Client, nats_url: str
) -> None:
    """Two consumers of a durable work the same suspect at once (the first one's keep-alive too
    slow for the ack wait: here another instance shortened it). Before, each wrote the record it
    had read, changed: the first one's close wrote ``open`` back to what it had read, and the
    second one's attempt, still running, was no longer on record, so its process dying would not
    count as a crash (a review)."""
    subject = s.cluster_command(unique("c"), "stop")
    # Suspects from the first delivery on; the first instance's nak holds the message a while.
    quick = spec_for(subject, suspect_after=0, max_crashes=5, first_nak_delay_s=30.0, max_nak_delay_s=30.0)
    slow = dataclasses.replace(quick, ack_wait_s=30.0)  # kept alive every 10 s
    a_in, b_in, release = asyncio.Event(), asyncio.Event(), asyncio.Event()
    seqs: list[int] = []

    async def first(d: Delivery[bytes]) -> None:
        seqs.append(d.stream_seq)
        a_in.set()
        await asyncio.wait_for(b_in.wait(), 10.0)  # the second instance has it too
        raise TransientError("the first attempt fails")

    async def second(d: Delivery[bytes]) -> None:
        b_in.set()
        await asyncio.wait_for(release.wait(), 20.0)

    other = await connect(nats_url, "test-crash-overlap")
    a: ConsumerRunner[bytes] = ConsumerRunner(nc, slow, bytes, handler=first, idle_fetch_timeout_s=0.2)
    b: ConsumerRunner[bytes] = ConsumerRunner(other, quick, bytes, handler=second, idle_fetch_timeout_s=0.2)
    await a.start()
    try:
        await Publisher(nc).publish_bytes(subject, b"{}", msg_id=unique("m"))
        await asyncio.wait_for(a_in.wait(), 10.0)
        await b.start()  # the server's ack wait is now short: the message goes to b as well
        await asyncio.wait_for(b_in.wait(), 10.0)
        log = AttemptLog(nc.jetstream(), slow.stream, slow.durable)

        async def first_closed() -> Attempts | None:
            record = await log.get(seqs[0])
            return record if record.failures == 1 else None  # its failure is written as it closes

        record = await until(first_closed, 10.0, "the first attempt closed")
        assert record.open == 1, f"the second attempt, still running, is on record: {record}"
    finally:
        release.set()
        await b.stop()
        await a.stop()
        await other.close()
        await nc.jetstream().delete_consumer(slow.stream, slow.durable)


async def test_a_message_given_back_at_outages_in_a_row_is_not_made_a_suspect_by_them(
    nc: Client,
) -> None:
    """Each give-back at an outage is a delivery to JetStream; before, three outages in a row
    made the message a suspect (suspect_after=3), handled alone with its attempt written down."""
    subject = s.cluster_command(unique("c"), "stop")
    spec = spec_for(subject)  # suspect_after=3
    state = {"down": False, "outages_left": 3}

    async def probe() -> None:
        if state["down"]:
            state["down"] = False  # back at the next probe
            raise OSError("fake database refused the connection")

    dependencies = Dependencies(
        Dependency("fakedb", probe, lambda exc: isinstance(exc, UnavailableError)), first_backoff_s=0.05
    )
    log = AttemptLog(nc.jetstream(), spec.stream, spec.durable)
    recorded: list[tuple[int, int]] = []  # (delivery, attempts open on record as it is handled)

    async def handler(d: Delivery[bytes]) -> None:
        recorded.append((d.num_delivered, (await log.get(d.stream_seq)).open))
        if state["outages_left"] > 0:
            state["outages_left"] -= 1
            state["down"] = True
            raise UnavailableError("fake database down", dependency="fakedb")

    runner: ConsumerRunner[bytes] = ConsumerRunner(
        nc, spec, bytes, handler=handler, idle_fetch_timeout_s=0.2, dependencies=dependencies
    )
    await runner.start()
    try:
        await Publisher(nc).publish_bytes(subject, b"{}", msg_id=unique("m"))

        async def acked() -> bool:
            return runner.counts["acked"] >= 1

        await until(acked, 15.0, "the message acked")
        assert runner.held_for_outage == 3
        assert recorded == [(1, 0), (2, 0), (3, 0), (4, 0)], "its 4th delivery was handled as a suspect"
    finally:
        await runner.stop()
        await dependencies.close()
        await nc.jetstream().delete_consumer(spec.stream, spec.durable)
