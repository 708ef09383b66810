"""The alert correlator's webhook receiver when another process holds its port."""

import asyncio
import socket

import pytest

from loom_services.alert_correlator import service as correlator_module
from loom_services.alert_correlator.receiver import Answer, Receiver
from loom_services.alert_correlator.service import AlertCorrelator


async def _ok(body: bytes) -> Answer:
    return Answer(200, {})


def test_a_taken_port_is_a_health_problem_and_the_receiver_listens_once_it_is_free(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(correlator_module, "LISTEN_RETRY_S", 0.05)
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    svc = object.__new__(AlertCorrelator)  # only the receiver's part of the service
    svc.receiver = Receiver(_ok, max_body_bytes=1024)
    svc.http_host, svc.http_port, svc.http_error = "127.0.0.1", port, None

    async def scenario() -> None:
        await svc._listen(retry=False)  # at start: said, not waited for
        assert svc.http_error is not None and str(port) in svc.http_error
        retrying = asyncio.create_task(svc._listen())
        await asyncio.sleep(0.3)
        assert not retrying.done() and svc.http_error is not None  # still taken: still trying
        holder.close()
        await asyncio.wait_for(retrying, 5)
        assert svc.http_error is None and svc.receiver.port == port
        _reader, writer = await asyncio.open_connection("127.0.0.1", port)  # listening now
        writer.close()
        await svc.receiver.close()

    try:
        asyncio.run(scenario())
    finally:
        holder.close()
