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


def test_an_agents_failure_report_of_another_clusters_run_raises_no_alert() -> None:
    # Placement refuses such a report; the correlator turned it into a "job failed" alert of the
    # job (its text the forger's, its alert key taken first: the real failure merged into it).
    from types import SimpleNamespace

    from loom.alerts.resources import JobPlacement, Part, Placements
    from loom.model.topology import load_topology
    from loom_proto.jobs import JobFailed

    svc = AlertCorrelator(SimpleNamespace(name="alert-correlator"), load_topology("small"), http_port=None)  # type: ignore[arg-type]
    svc.core.set_placements(
        Placements(svc.inventory, [JobPlacement("x", "acme", (Part("c-use2-a", ("n1",)),))])
    )
    ingested: list[object] = []

    async def ingest(alert: object, *, own: bool = False) -> None:
        ingested.append(alert)

    svc._ingest = ingest  # type: ignore[method-assign]

    def report(on: str, cluster: str) -> object:
        event = JobFailed(job_id="x", tenant="acme", cluster=cluster, attempt=1, reason="boom", at=1.0)
        return SimpleNamespace(subject=f"loom.jobs.failed.acme.{on}", message=event)

    async def scenario() -> None:
        await svc.on_job_event(report("c-sea1-a", "c-use2-a"))  # type: ignore[arg-type]
        await svc.on_job_event(report("c-sea1-a", "c-sea1-a"))  # type: ignore[arg-type]
        assert ingested == []
        await svc.on_job_event(report("c-use2-a", "c-use2-a"))  # type: ignore[arg-type]
        assert len(ingested) == 1

    asyncio.run(scenario())
