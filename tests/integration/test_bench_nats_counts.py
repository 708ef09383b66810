"""loom bench e2e's NATS message counts (``nats_msgs_per_job``), read from a real server's ``/varz``."""

import asyncio

import nats

from loom.runtime.servers import NatsServer
from loom_benchmarks.e2e import msgs_per_job, nats_counts


async def test_the_counts_follow_what_was_published_and_delivered(nats_server: NatsServer) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        got: list[bytes] = []

        async def on(msg: object) -> None:
            got.append(msg.data)  # type: ignore[attr-defined]

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
