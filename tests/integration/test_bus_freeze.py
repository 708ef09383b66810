"""A nats-server frozen for a moment (SIGSTOP) must not leave Loom's connections deaf afterwards.

nats-py 2.16.0 ends a connection's read loop when the late PONG of a timed-out ``flush`` arrives
(``loom.bus.connection._process_pong`` works around it); ``loom bench chaos`` found metrics,
migration and the placement standby answering nothing for minutes after a 2 s freeze.
"""

import asyncio
import os
import signal
from pathlib import Path

import nats.errors
import pytest
from nats.aio.msg import Msg

from loom.bus import connect
from loom.runtime.servers import NatsServer


async def test_a_flush_that_timed_out_while_nats_was_frozen_leaves_the_connection_working(
    tmp_path: Path,
) -> None:
    with NatsServer(tmp_path / "nats") as server:
        assert server.pid is not None
        nc = await connect(server.url, "freeze-test")
        try:

            async def echo(msg: Msg) -> None:
                await msg.respond(b"pong:" + msg.data)

            await nc.subscribe("freeze.echo", cb=echo)
            await nc.flush(timeout=2)
            os.kill(server.pid, signal.SIGSTOP)
            await _stopped(server.pid)  # a thread running on another core stops at its next switch
            try:
                with pytest.raises(nats.errors.TimeoutError):  # FlushTimeoutError is one
                    await nc.flush(timeout=0.5)
            finally:
                os.kill(server.pid, signal.SIGCONT)
            # The late PONG arrives now; the connection must go on reading.
            for n in range(3):
                reply = await nc.request("freeze.echo", str(n).encode(), timeout=5)
                assert reply.data == f"pong:{n}".encode()
            assert nc.is_connected
        finally:
            await nc.close()


def _thread_states(pid: int) -> set[str]:
    return {
        (task / "stat").read_text().rsplit(")", 1)[-1].split()[0]
        for task in Path(f"/proc/{pid}/task").iterdir()
    }


async def _stopped(pid: int) -> None:
    """Wait until the kernel shows every thread of ``pid`` stopped (state ``T``)."""
    states: set[str] = set()
    for _ in range(200):
        states = _thread_states(pid)
        if states == {"T"}:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"nats-server {pid} not stopped: {states}")
