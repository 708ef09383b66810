"""The SDK's queries on real NATS: a query is asked again once when its first ask goes unanswered,
so a queue group member that hangs (a stopped placement standby) does not fail every other
`loom job` / `loom jobs` (an outside walk: about half did, with one of two instances frozen)."""

import asyncio
import json
from collections.abc import Iterator

import nats
import pytest
from nats.aio.msg import Msg

from loom.client import LoomClient, QueryError
from loom.runtime.servers import NatsServer

# A server and a loop of this module's own: in full runs the first test saw 1 ask of 2 in 2 of 4
# runs (never alone, nor with every core busy); a subscriber other tests left on the session's
# server was ruled out (it failed on a server of its own), tasks other tests left on the worker's
# session loop were not. The cause is not known: its failure message says when each ask came.
pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]


@pytest.fixture(scope="module")
def nats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A NATS server of this file's own: these tests count the asks on ``loom.jobs.query`` in queue
    group ``placement``, which no other test's subscriber may share."""
    with NatsServer(tmp_path_factory.mktemp("sdk-retry-nats")) as server:
        yield server.url


async def test_a_query_whose_first_ask_is_lost_is_answered_by_the_second(nats_url: str) -> None:
    responder = await nats.connect(nats_url)
    asks: list[bytes] = []

    async def first_lost(msg: Msg) -> None:
        asks.append(msg.data)
        if len(asks) > 1:  # the first ask went to a member that hangs: no answer
            await msg.respond(json.dumps({"ok": True, "result": {"job_id": "j-1"}}).encode())

    sub = await responder.subscribe("loom.jobs.query", queue="placement", cb=first_lost)
    await responder.flush()
    client = await LoomClient.connect(nats_url)
    try:
        assert await client.job("j-1", timeout_s=2.0) == {"job_id": "j-1"}
        assert len(asks) == 2 and asks[0] == asks[1]  # the same question, asked again
        # Nobody answers at all: one error after the whole budget, as before.
        asks.clear()
        await sub.unsubscribe()

        loop = asyncio.get_running_loop()
        at: list[float] = []

        async def hangs(msg: Msg) -> None:
            asks.append(msg.data)
            at.append(loop.time())

        await responder.subscribe("loom.jobs.query", queue="placement", cb=hangs)
        await responder.flush()  # the server has the unsubscription and the new one
        began = loop.time()
        with pytest.raises(QueryError, match=r"no answer on loom\.jobs\.query within 2 s") as raised:
            await client.job("j-1", timeout_s=2.0)
        ended = loop.time()
        # The second ask, sent at half the budget, has reached the server: its callback may still
        # be queued on the responder's side.
        await responder.flush()
        for _ in range(20):
            if len(asks) >= 2:
                break
            await asyncio.sleep(0.05)
        seen = [round(t - began, 3) for t in at]
        assert len(asks) == 2, f"asks at {seen} s, gave up at {ended - began:.3f} s: {raised.value}"
    finally:
        await client.close()
        await responder.close()


async def test_a_slow_answer_to_the_first_ask_is_still_taken(nats_url: str) -> None:
    # A review: asked again at half the budget with the first ask dropped, a service answering in
    # 1.2 s of a 2 s budget failed every time; the first ask now waits on beside the second.

    responder = await nats.connect(nats_url)
    asks: list[float] = []

    async def slow(msg: Msg) -> None:
        asks.append(asyncio.get_running_loop().time())
        if len(asks) == 1:
            await asyncio.sleep(1.2)
            await msg.respond(json.dumps({"ok": True, "result": {"job_id": "slow"}}).encode())

    await responder.subscribe("loom.jobs.query", queue="placement", cb=slow)
    await responder.flush()
    client = await LoomClient.connect(nats_url)
    try:
        assert await client.job("slow", timeout_s=2.0) == {"job_id": "slow"}
    finally:
        await client.close()
        await responder.close()
