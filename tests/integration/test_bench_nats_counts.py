"""loom bench e2e's NATS message counts (``nats_msgs_per_job``), read from a real server's ``/varz``."""

import asyncio

import nats
from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig, StreamConfig

from loom.runtime.servers import NatsServer, find_free_port
from loom_benchmarks.e2e import _nats_figures, _nats_settled, consumers_pending, msgs_per_job, nats_counts


async def test_the_counts_follow_what_was_published_and_delivered(nats_server: NatsServer) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        got: list[bytes] = []

        async def on(msg: Msg) -> None:
            got.append(msg.data)

        await nc.subscribe("bench.count.test", cb=on)
        await nc.flush()
        before = await asyncio.to_thread(nats_counts, nats_server.monitor_url)
        for i in range(50):
            await nc.publish("bench.count.test", str(i).encode())
        await nc.flush()
        for _ in range(100):
            if len(got) == 50:
                break
            await asyncio.sleep(0.02)
        assert len(got) == 50
        after = await asyncio.to_thread(nats_counts, nats_server.monitor_url)
    finally:
        await nc.close()
    # Each message in once and out once to the one subscriber; other tests of the session may
    # publish meanwhile, never fewer.
    assert after["in"] - before["in"] >= 50
    assert after["out"] - before["out"] >= 50
    per_job = msgs_per_job(before, {"in": before["in"] + 50, "out": before["out"] + 100}, 25)
    assert per_job == {"in": 2.0, "out": 4.0}
    assert msgs_per_job(before, before, 0) == {"in": 0.0, "out": 0.0}


async def test_the_counts_are_read_once_the_traffic_is_quiet(nats_server: NatsServer) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        before = await asyncio.to_thread(nats_counts, nats_server.monitor_url)
        for i in range(30):
            await nc.publish("bench.count.quiet", str(i).encode())
        await nc.flush()
        # A stream nobody else in the session uses: nothing pending there.
        figures = await _nats_figures(nats_server.monitor_url, before, 10, streams=("BENCHNONE",))
    finally:
        await nc.close()
    per_job = figures["nats_msgs_per_job"]
    assert per_job["settled"] is True
    assert per_job["in"] >= 3.0


async def test_a_monitor_that_does_not_answer_leaves_the_figure_out() -> None:
    # A port nothing listens on: the run goes on without the figure.
    assert await _nats_figures(f"http://127.0.0.1:{find_free_port()}", {"in": 0, "out": 0}, 10) == {}


async def test_a_consumer_left_behind_is_said_to_be_unsettled(nats_server: NatsServer) -> None:
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    try:
        await js.add_stream(StreamConfig(name="BENCHCOUNT", subjects=["bench.settle.>"]))
        await js.add_consumer("BENCHCOUNT", ConsumerConfig(durable_name="behind"))
        assert await asyncio.to_thread(consumers_pending, nats_server.monitor_url, ("BENCHCOUNT",)) == 0
        _, settled = await _nats_settled(
            nats_server.monitor_url, quiet_s=0.1, limit_s=1.0, streams=("BENCHCOUNT",)
        )
        assert settled is True
        for i in range(3):
            await js.publish("bench.settle.x", str(i).encode())
        # Nobody pulls "behind": 3 pending, never caught up.
        assert await asyncio.to_thread(consumers_pending, nats_server.monitor_url, ("BENCHCOUNT",)) == 3
        _, settled = await _nats_settled(
            nats_server.monitor_url, quiet_s=0.1, limit_s=1.0, streams=("BENCHCOUNT",)
        )
        assert settled is False
    finally:
        await js.delete_stream("BENCHCOUNT")
        await nc.close()
