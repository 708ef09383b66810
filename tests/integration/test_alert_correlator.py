"""The alert correlator on a real JetStream and PostgreSQL: webhook in, incidents out.

Placements are real rows (jobs placed, GPUs reserved on the capacity book of the small topology):
a gang across aws-us-east-2 and azure-westeurope, a two-stage pipeline across the same pair, a job
on one cluster, and a gang across gcp-asia-southeast1 and aws-us-east-2. The service runs as a
task with an HTTP receiver on a free port; what it publishes is read from ``loom.incidents.*``.
"""

import asyncio
import json
import shutil
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from waiting import until

from loom.alerts import CorrelatorConfig
from loom.bus import Publisher, connect
from loom.bus.dlq import DeadLetters
from loom.model.capacity import NodeCapacity
from loom.model.topology import load_topology
from loom.runtime.service import close_context, open_context
from loom.store import incidents as store
from loom.store import jobs as job_store
from loom.store.pool import create_pool, transaction
from loom_proto import subjects
from loom_proto.alerts import Alert, IncidentChange
from loom_proto.jobs import JobFailed
from loom_proto.net import LinkDegraded, LinkRecovered
from loom_services.alert_correlator.receiver import Answer, Receiver
from loom_services.alert_correlator.service import AlertCorrelator

WAIT_S = 15.0
TOPOLOGY = load_topology("small")
NODES = {c.id: [n.id for n in c.nodes] for c in TOPOLOGY.clusters}
USE, WEU, SEA = "aws-us-east-2", "azure-westeurope", "gcp-asia-southeast1"
PLACED = {
    # job -> [(cluster, node index)]
    "gang-1": [("c-use2-a", 0), ("c-weu-a", 0)],
    "pipe-1": [("c-use2-a", 1), ("c-weu-a", 1)],
    "local-1": [("c-use2-a", 2)],
    "gang-2": [("c-sea1-a", 0), ("c-use2-a", 3)],
}
TENANT = {"gang-1": "acme", "pipe-1": "acme", "local-1": "beta", "gang-2": "beta"}


async def _place(database_url: str) -> None:
    pool = await create_pool(database_url)
    try:
        async with transaction(pool) as conn:
            await job_store.upsert_nodes(
                conn,
                1,
                [
                    NodeCapacity(n.id, c.id, c.region, c.zone, n.gpu_model, max(n.gpus, 1))
                    for c in TOPOLOGY.clusters
                    for n in c.nodes
                ],
            )
            await job_store.insert_jobs(
                conn,
                [
                    job_store.NewJob(
                        job_id, TENANT[job_id], b"{}", 0.0, {}, parent="dag-1" if job_id == "pipe-1" else None
                    )
                    for job_id in PLACED
                ],
            )
            for job_id, parts in PLACED.items():
                for cluster, i in parts:
                    await job_store.reserve(conn, [(job_id, 1, cluster, [(NODES[cluster][i], 1)])])
                await job_store.mark_placed(conn, [(job_id, parts[0][0], 1, 1.0)])
    finally:
        await pool.close()


@pytest.fixture(scope="module")
async def database_url(fresh_database: Callable[..., Awaitable[str]]) -> str:
    """A database of the module's own, with the placements above."""
    url = await fresh_database("alerts")
    await _place(url)
    return url


WEBHOOK_BODIES: list[dict[str, Any]] = []
"""What the incident webhook (a receiver of the test's own) was sent."""


@pytest.fixture(scope="module")
async def webhook() -> AsyncIterator[str]:
    """An HTTP endpoint collecting the correlator's incident webhooks."""

    async def on_post(body: bytes) -> Answer:
        WEBHOOK_BODIES.append(json.loads(body))
        return Answer(200, {})

    receiver = Receiver(on_post, max_body_bytes=1 << 20)
    port = await receiver.start("127.0.0.1", 0)
    yield f"http://127.0.0.1:{port}/"
    await receiver.close()


@pytest.fixture(scope="module")
async def correlator(nats_url: str, database_url: str, webhook: str) -> AsyncIterator[AlertCorrelator]:
    ctx = await open_context("alert-correlator", nats_url=nats_url, database_url=database_url)
    service = AlertCorrelator(
        ctx,
        TOPOLOGY,
        config=CorrelatorConfig(group_wait_s=0.2, min_update_interval_s=0.5),
        http_port=0,
        refresh_s=0.2,
        webhooks=[webhook],
    )
    task = asyncio.create_task(service.run())

    async def ready() -> bool:
        return service.receiver.port is not None and len(service.core.placements.jobs) == len(PLACED)

    await until(ready, WAIT_S, "the correlator listening with every placement loaded")
    yield service
    ctx.stopping.set()
    await asyncio.wait_for(task, timeout=15)
    await close_context(ctx)


@pytest.fixture
async def incidents(nats_url: str) -> AsyncIterator[list[IncidentChange]]:
    """Every incident change published while the test runs."""
    nc: Client = await connect(nats_url, "incident-watcher")
    seen: list[IncidentChange] = []

    async def on(msg: Msg) -> None:
        seen.append(msgspec.json.decode(msg.data, type=IncidentChange))

    for subject in subjects.INCIDENTS_ALL:
        await nc.subscribe(subject, cb=on)
    yield seen
    await nc.drain()


def _post(port: int, body: bytes) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/alertmanager", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


async def _curl(port: int, body: bytes) -> tuple[int, dict[str, Any]]:
    """POST as an operator would, with curl (urllib where curl is not installed)."""
    if shutil.which("curl") is None:
        return await asyncio.to_thread(_post, port, body)
    proc = await asyncio.create_subprocess_exec(
        "curl",
        "-sS",
        "-H",
        "Content-Type: application/json",
        "-H",
        "Expect: 100-continue",
        "--data-binary",
        "@-",
        "-w",
        "\n%{http_code}",
        f"http://127.0.0.1:{port}/alertmanager",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await asyncio.wait_for(proc.communicate(body), timeout=WAIT_S)
    text, _, code = out.decode().rpartition("\n")
    return int(code), json.loads(text)


def _opened(seen: list[IncidentChange], root: str) -> Callable[[], Awaitable[IncidentChange | None]]:
    async def check() -> IncidentChange | None:
        return next((i for i in seen if i.change == "opened" and i.root == root), None)

    return check


async def test_an_alertmanager_webhook_becomes_an_incident_attached_to_the_right_jobs(
    correlator: AlertCorrelator, incidents: list[IncidentChange]
) -> None:
    assert correlator.receiver.port is not None
    payload = {
        "version": "4",
        "groupKey": '{}:{alertname="ClusterDown"}',
        "truncatedAlerts": 0,
        "status": "firing",
        "receiver": "loom",
        "groupLabels": {"alertname": "ClusterDown"},
        "commonLabels": {"alertname": "ClusterDown", "cluster": "c-weu-a", "severity": "critical"},
        "commonAnnotations": {},
        "externalURL": "http://alertmanager:9093",
        "alerts": [
            {
                "status": "firing",
                "labels": {"alertname": "ClusterDown", "cluster": "c-weu-a", "severity": "critical"},
                "annotations": {"summary": "c-weu-a API unreachable"},
                "startsAt": "2026-12-01T10:00:00.000Z",
                "endsAt": "0001-01-01T00:00:00Z",
                "generatorURL": "http://prometheus:9090/graph",
                "fingerprint": "0f1e2d3c4b5a6978",
            }
        ],
    }
    status, body = await _curl(correlator.receiver.port, json.dumps(payload).encode())
    assert (status, body) == (200, {"accepted": 1})
    opened = await until(_opened(incidents, "c-weu-a"), WAIT_S, "the cluster incident opened")
    assert opened.root_kind == "cluster" and opened.severity == "critical"
    assert {j.job_id for j in opened.jobs} == {"gang-1", "pipe-1"}
    assert set(opened.tenants) == {"acme"} and opened.dags == ["dag-1"]

    # A job alert under it is attached, not a new incident; the record is in PostgreSQL.
    publisher = correlator.ctx.publisher
    failed = JobFailed(job_id="gang-1", tenant="acme", cluster="c-weu-a", reason="worker lost", at=1.0)
    await publisher.publish(subjects.job_event("failed", "acme"), failed, msg_id="gang-1-failed-test")

    async def attached() -> bool:
        return correlator.core.counts["attached"] >= 1

    await until(attached, WAIT_S, "the job alert attached to the cluster incident")

    async def stored() -> IncidentChange | None:
        return await store.get_incident(correlator.ctx.db, opened.incident_id)

    record = await until(stored, WAIT_S, "the incident persisted")
    assert record.root == "c-weu-a" and record.jobs_total == 2

    async def hooked() -> dict[str, Any] | None:
        return next((b for b in WEBHOOK_BODIES if b["incident_id"] == opened.incident_id), None)

    sent = await until(hooked, WAIT_S, "the incident sent to the configured webhook")
    assert sent["change"] == "opened" and sent["jobs_total"] == 2
    assert not any(i.change == "opened" and i.incident_id != opened.incident_id for i in incidents)


async def test_a_link_degradation_opens_one_link_incident_naming_the_jobs_whose_paths_use_it(
    correlator: AlertCorrelator, incidents: list[IncidentChange]
) -> None:
    publisher = Publisher(correlator.ctx.nc)
    for src, dst in ((USE, SEA), (SEA, USE)):  # both directions degrade: still one incident
        event = LinkDegraded(
            src=src, dst=dst, at=2.0, reason="rtt 3x baseline", rtt_ms=600, baseline_rtt_ms=200, loss_rate=0.0
        )
        await publisher.publish(subjects.net_event("degraded"), event, msg_id=f"test-degraded-{src}-{dst}")
    root = f"{SEA}~{USE}" if SEA < USE else f"{USE}~{SEA}"
    opened = await until(_opened(incidents, root), WAIT_S, "the link incident opened")
    assert opened.root_kind == "link"
    assert [j.job_id for j in opened.jobs] == ["gang-2"]  # not the jobs that stay within one region
    recovered = LinkRecovered(
        src=USE, dst=SEA, at=3.0, reason="back within thresholds", baseline_rtt_ms=200, loss_rate=0.0
    )
    await publisher.publish(subjects.net_event("recovered"), recovered, msg_id="test-recovered")

    async def resolved() -> IncidentChange | None:
        return next((i for i in incidents if i.change == "resolved" and i.root == root), None)

    done = await until(resolved, WAIT_S, "the link incident resolved on recovery")
    assert done.incident_id == opened.incident_id and done.state == "resolved"
    assert sum(1 for i in incidents if i.root == root and i.change == "opened") == 1


async def test_a_malformed_payload_is_answered_400_and_dead_lettered(correlator: AlertCorrelator) -> None:
    assert correlator.receiver.port is not None
    body = json.dumps(
        {"version": "4", "alerts": [{"status": "firing", "labels": {}, "startsAt": "yesterday"}]}
    )
    status, answer = await asyncio.to_thread(_post, correlator.receiver.port, body.encode())
    assert status == 400 and "RFC 3339" in answer["error"]
    status, _ = await asyncio.to_thread(_post, correlator.receiver.port, b"{not json")
    assert status == 400

    async def letters() -> list[Any]:
        found = await DeadLetters(correlator.ctx.nc).entries(subject=subjects.alert_raw("alertmanager"))
        return found if len(found) >= 2 else []

    found = await until(letters, WAIT_S, "both payloads in the dead-letter queue")
    # Raw alerts on the bus: not an Alert, or not of its subject's source -> dead-lettered too.
    publisher = correlator.ctx.publisher
    await publisher.publish_bytes(subjects.alert_raw("bench"), b'{"kind": "alert"}', msg_id="raw-bad-1")
    lying = Alert(alert_id="x1", source="other", severity="info", summary="s", at=1.0)
    await publisher.publish(subjects.alert_raw("bench"), lying, msg_id="raw-bad-2")

    async def raw_letters() -> list[Any]:
        got = await DeadLetters(correlator.ctx.nc).entries(subject=subjects.alert_raw("bench"))
        return got if len(got) >= 2 else []

    raw = await until(raw_letters, WAIT_S, "both raw alerts in the dead-letter queue")
    assert {letter.error_type for letter in raw} == {"DecodeError", "SubjectMismatchError"}
    assert {letter.consumer for letter in found} == {"alert-correlator-http"}
    assert any("RFC 3339" in (letter.error or "") for letter in found)
    assert any(letter.data == b"{not json" for letter in found)
    # Replaying one cannot work (the bus takes Loom's alerts, not Alertmanager's payload): refused,
    # nothing published. Before, it was "replayed" into a new dead letter of the raw consumer.
    [refused] = await DeadLetters(correlator.ctx.nc).replay(found[:1])
    assert refused.outcome == "not_replayable" and "POST it to the webhook again" in (refused.why or "")


async def test_the_cli_lists_shows_and_acknowledges_incidents(
    correlator: AlertCorrelator,
    nats_url: str,
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from loom.cli.main import build_parser

    monkeypatch.setenv("LOOM_NATS_URL", nats_url)
    monkeypatch.setenv("LOOM_DATABASE_URL", database_url)

    def cli(*argv: str) -> int:
        args = build_parser().parse_args(list(argv))
        return int(args.fn(args))

    assert await asyncio.to_thread(cli, "incidents", "--open", "--json") == 0
    listed = json.loads(capsys.readouterr().out)
    cluster = next(i for i in listed if i["root"] == "c-weu-a")
    assert cluster["state"] == "open" and cluster["jobs_total"] == 2

    assert await asyncio.to_thread(cli, "ack", cluster["incident_id"], "--by", "oncall") == 0
    assert "acknowledged" in capsys.readouterr().out

    async def acked() -> IncidentChange | None:
        i = await store.get_incident(correlator.ctx.db, cluster["incident_id"])
        return i if i is not None and i.state == "acknowledged" else None

    await until(acked, WAIT_S, "the acknowledgement persisted")
    assert await asyncio.to_thread(cli, "incident", cluster["incident_id"]) == 0
    shown = capsys.readouterr().out
    assert "root cause: cluster c-weu-a" in shown and "gang-1" in shown and "acknowledged by oncall" in shown
    assert await asyncio.to_thread(cli, "ack", "inc-nope") == 1


async def test_a_service_that_stops_answering_health_opens_an_incident_resolved_when_it_answers(
    nats_url: str, correlator: AlertCorrelator, incidents: list[IncidentChange]
) -> None:
    from loom.alerts.sources import HealthWatch

    answering = True
    nc: Client = await connect(nats_url, "fake-service")

    async def on_health(msg: Msg) -> None:
        if answering:
            await msg.respond(json.dumps({"status": "ok"}).encode())

    await nc.subscribe(subjects.service_health("fake-svc"), cb=on_health)
    await nc.flush()
    correlator.watch_health = ["fake-svc"]
    correlator.health = HealthWatch(misses=2)
    correlator.health_timeout_s = 0.3

    async def asked_and_answered() -> bool:
        # A loaded machine may answer later than 0.3 s; ask again until one answer counted, so
        # the misses below are misses of a service seen alive (not a start-up grace).
        await correlator.check_health()
        return "fake-svc" in correlator.health.seen and correlator.health.missed_in_row["fake-svc"] == 0

    try:
        await until(asked_and_answered, WAIT_S, "the service's first health answer")
        assert correlator.health.firing == {}
        answering = False
        await correlator.check_health()
        assert not any(i.root == "fake-svc" for i in incidents)  # one miss is not an outage
        await correlator.check_health()
        opened = await until(_opened(incidents, "fake-svc"), WAIT_S, "the service incident opened")
        assert opened.root_kind == "service" and opened.severity == "critical"
        answering = True

        async def resolved() -> IncidentChange | None:
            if "fake-svc" in correlator.health.firing:
                await correlator.check_health()  # asked again until an answer arrives in time
            return next((i for i in incidents if i.change == "resolved" and i.root == "fake-svc"), None)

        done = await until(resolved, WAIT_S, "the service incident resolved once it answers")
        assert done.incident_id == opened.incident_id
    finally:
        correlator.watch_health = []
        await nc.drain()


async def test_placements_cluster_classification_and_a_slow_run_reach_the_correlator(
    nats_url: str, correlator: AlertCorrelator, incidents: list[IncidentChange]
) -> None:
    from loom_proto.clusters import ClusterHealthChanged, SlowRun

    nc: Client = await connect(nats_url, "fake-placement")
    try:
        failed = ClusterHealthChanged(
            cluster="c-sea1-a", state="failed", reason="no heartbeat, probes lost", region=SEA, at=10.0
        )
        await nc.publish(subjects.PLACEMENT_CLUSTER_HEALTH, msgspec.json.encode(failed))
        await nc.publish(subjects.PLACEMENT_CLUSTER_HEALTH, b'{"cluster": 3}')  # bad: logged, ignored
        opened = await until(_opened(incidents, "c-sea1-a"), WAIT_S, "the failed cluster's incident")
        assert opened.severity == "critical" and [j.job_id for j in opened.jobs] == ["gang-2"]
        slow = SlowRun(
            job_id="local-1",
            attempt=1,
            observed_step_s=5.0,
            predicted_step_s=1.0,
            nodes=[NODES["c-use2-a"][2]],
        )
        before = correlator.core.counts["received"]
        await nc.publish(subjects.PLACEMENT_SLOW, msgspec.json.encode(slow))

        async def slow_seen() -> bool:
            return correlator.core.counts["received"] == before + 1

        await until(slow_seen, WAIT_S, "the slow run received as one job alert")
        healthy = ClusterHealthChanged(cluster="c-sea1-a", state="healthy", region=SEA, at=11.0)
        await nc.publish(subjects.PLACEMENT_CLUSTER_HEALTH, msgspec.json.encode(healthy))

        async def resolved() -> IncidentChange | None:
            return next((i for i in incidents if i.change == "resolved" and i.root == "c-sea1-a"), None)

        assert (await until(resolved, WAIT_S, "resolved when healthy")).incident_id == opened.incident_id
    finally:
        await nc.drain()
