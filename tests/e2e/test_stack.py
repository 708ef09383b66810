"""The whole stack as a user runs it: `loom up` processes, real NATS and PostgreSQL, OTLP export.

One stack serves the module (small topology: three clusters, 71 GPUs, simulated time 2000x),
started with ``--traces``: every service exports its spans over OTLP/HTTP to the stack's own trace
store (:mod:`loom.telemetry.spanstore`), which the tests read back from its files and through the
Jaeger query API it answers, as `loom trace` does.
"""

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import nats
import pytest
from nats.aio.client import Client
from waiting import until

from loom.bus.connection import auth_options, credentials_path
from loom.client import LoomClient, QueryError
from loom.runtime import stack
from loom.security.http_token import bearer_header, otlp_headers
from loom.telemetry.spanstore import ReceivedSpan, SpanFile
from loom_proto import subjects
from loom_proto.jobs import JobSpec, Resources, Work

pytestmark = pytest.mark.slow

PLACEMENT_INSTANCES = ("placement", "placement-standby")
"""The two placement processes of the stack; either may hold the lease."""


class StoredSpans:
    """The stack's trace store as the tests read it: its span files, polled."""

    def __init__(self, home: Path, url: str) -> None:
        self.file = SpanFile(home / "traces")
        self.url = url

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        return self.file.trace(trace_id)

    def wait_for(
        self, trace_id: str, predicate: Callable[[list[ReceivedSpan]], bool], timeout_s: float
    ) -> list[ReceivedSpan]:
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.trace(trace_id)
            if predicate(spans):
                return spans
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"no match within {timeout_s} s: {[(s['service_name'], s['name']) for s in spans]}"
                )
            time.sleep(0.1)


@pytest.fixture(scope="module")
def store(state: dict[str, Any], home: Path) -> StoredSpans:
    assert state.get("traces_url"), "the stack was started with --traces"
    return StoredSpans(home, state["traces_url"])


@pytest.fixture(scope="module")
def home() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="loom-e2e-", dir="/tmp"))
    path.chmod(0o755)  # PostgreSQL runs as an unprivileged user when tests run as root
    saved = {
        k: os.environ.get(k)
        for k in (
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "OTEL_BSP_SCHEDULE_DELAY",
            "LOOM_NATS_URL",
            "LOOM_DATABASE_URL",
        )
    }
    os.environ.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)  # the stack's own store (--traces)
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "100"
    os.environ.pop("LOOM_NATS_URL", None)
    os.environ.pop("LOOM_DATABASE_URL", None)
    try:
        stack.up(
            path,
            stack.StackOptions(
                topology="small",
                time_scale=2000.0,
                heartbeat_s=0.5,
                max_heartbeat_s=2.0,
                durable=False,
                traces=True,
            ),
        )
        yield path
    finally:
        stack.down(path)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="module")
def state(home: Path) -> dict[str, Any]:
    loaded = stack.read_state(home)
    assert loaded is not None
    return loaded


@pytest.fixture
async def client(state: dict[str, Any]) -> AsyncIterator[LoomClient]:
    c = await LoomClient.connect(state["nats_url"], name="e2e")
    await _wait(lambda: _clusters_known(c), timeout_s=30, what="three clusters in the view")
    yield c
    await c.close()


async def _clusters_known(c: LoomClient) -> bool:
    view = await c.view()
    return sum(len(z["clusters"]) for r in view["regions"].values() for z in r["zones"].values()) == 3


async def _wait(check: Callable[[], Any], *, timeout_s: float, what: str) -> Any:
    """Wait for a condition; a service restarting (no answer for a moment) counts as "not yet"."""
    return await until(check, timeout_s, what, interval_s=0.1, retry_on=(QueryError,))


async def _state_of(c: LoomClient, job_id: str) -> str | None:
    job = await c.job(job_id)
    return job["state"] if job else None


def _job(job_id: str, *, gpus: int = 1, steps: int = 100, step_time_s: float = 10.0) -> JobSpec:
    return JobSpec(
        job_id=job_id,
        tenant="e2e",
        resources=Resources(gpus=gpus),
        work=Work(steps=steps, step_time_s=step_time_s),
    )


async def test_a_raw_json_job_from_any_nats_client_is_placed_and_completes(
    client: LoomClient, state: dict[str, Any]
) -> None:
    nc = await nats.connect(
        state["nats_url"], **auth_options(credentials_path(state["nats_url"]))
    )  # no Loom code but the credentials
    js = nc.jetstream()
    payload = json.dumps(
        {
            "job_id": "raw-json-1",
            "tenant": "rawtenant",
            "resources": {"gpus": 2, "gpu_models": ["V100M32"]},
            "work": {"steps": 50, "step_time_s": 20},
        }
    ).encode()
    ack = await js.publish("loom.jobs.submitted.rawtenant", payload, headers={"Nats-Msg-Id": "raw-json-1"})
    assert ack.stream == "REQUESTS"
    await nc.close()

    await _wait(lambda: _is(client, "raw-json-1", "completed"), timeout_s=30, what="raw-json-1 completed")
    job = await client.job("raw-json-1")
    assert job is not None
    kinds = [e["kind"] for e in job["events"]]
    assert kinds[:3] == ["submitted", "placed", "started"] and kinds[-1] == "completed"
    placed = next(e["event"] for e in job["events"] if e["kind"] == "placed")
    assert placed["gpu_model"] == "V100M32" and placed["cluster"] == "c-use2-a"
    assert sum(a["gpus"] for a in placed["allocations"]) == 2


async def _is(c: LoomClient, job_id: str, wanted: str) -> bool:
    return await _state_of(c, job_id) == wanted


async def test_every_job_is_one_trace_from_client_publish_to_completion(
    client: LoomClient, store: StoredSpans, monkeypatch: pytest.MonkeyPatch
) -> None:
    from opentelemetry import trace

    from loom.telemetry import current_trace_id, reset_for_tests, setup_telemetry

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", store.url)
    token = stack.local_http_token(store.file.directory.parent)
    assert token  # the store of a secured stack asks for it
    for key, value in otlp_headers(token).items():
        monkeypatch.setenv(key, value)
    provider = setup_telemetry("e2e-client", log_level=None)  # exports to the store, like the services
    try:
        with trace.get_tracer("e2e").start_as_current_span("submit traced-1"):
            trace_id = current_trace_id()
            await client.submit(_job("traced-1", steps=20))
        provider.force_flush()
    finally:
        reset_for_tests()
    assert trace_id is not None
    await _wait(lambda: _is(client, "traced-1", "completed"), timeout_s=30, what="traced-1 completed")

    job = await client.job("traced-1")
    assert job is not None
    agent = f"agent-{job['cluster']}"

    def service(span: dict[str, Any]) -> str:
        # Whichever placement instance leads handles the job; both are "placement" here.
        return "placement" if span["service_name"] in PLACEMENT_INSTANCES else str(span["service_name"])

    def services_of(spans: list[Any]) -> set[tuple[str, str]]:
        return {(service(s), s["name"]) for s in spans}

    needed = {
        ("e2e-client", "publish loom.jobs.submitted"),
        ("placement", "process loom.jobs.submitted"),
        ("placement", "publish loom.jobs.placed"),
        ("placement", f"publish loom.clusters.{job['cluster']}"),
        (agent, f"process loom.clusters.{job['cluster']}"),
        (agent, "publish loom.jobs.started"),
        (agent, "publish loom.jobs.completed"),
        ("placement", "process loom.jobs.completed"),
    }
    mine = await asyncio.to_thread(store.wait_for, trace_id, lambda s: needed <= services_of(s), 20)
    assert {s["trace_id"] for s in mine} == {trace_id}
    by_id = {s["span_id"]: s for s in mine}
    consumer = next(s for s in mine if s["name"] == "process loom.jobs.submitted")
    producer = by_id[consumer["parent_span_id"]]
    assert producer["service_name"] == "e2e-client" and producer["kind"] == "PRODUCER"
    assert consumer["kind"] == "CONSUMER"


async def test_bad_submissions_are_rejected_with_reasons_and_store_nothing(
    client: LoomClient, state: dict[str, Any]
) -> None:
    nc = await nats.connect(state["nats_url"], **auth_options(credentials_path(state["nats_url"])))
    rejected: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    async def on_rejected(msg: Any) -> None:
        await rejected.put(json.loads(msg.data))

    await nc.subscribe("loom.jobs.rejected.badtenant", cb=on_rejected)
    js = nc.jetstream()
    bad = {
        "bad-json": b"{not json",
        "bad-field": json.dumps(
            {"job_id": "bad-field", "tenant": "badtenant", "work": {"steps": 1}, "gpus": 3}
        ),
        "bad-type": json.dumps({"job_id": "bad-type", "tenant": "badtenant", "work": {"steps": "many"}}),
        "bad-negative": json.dumps(
            {"job_id": "bad-negative", "tenant": "badtenant", "work": {"steps": 1}, "resources": {"gpus": -2}}
        ),
        "bad-absurd": json.dumps(
            {"job_id": "bad-absurd", "tenant": "badtenant", "work": {"steps": 1}, "workers": 10**9}
        ),
        "bad-tenant": json.dumps({"job_id": "bad-tenant", "tenant": "bad.tenant", "work": {"steps": 1}}),
        "bad-id": json.dumps({"job_id": "bad*id", "tenant": "badtenant", "work": {"steps": 1}}),
        "bad-size": json.dumps(
            {"job_id": "bad-size", "tenant": "badtenant", "work": {"steps": 1}, "name": "x" * 300_000}
        ),
    }
    for msg_id, body in bad.items():
        data = body if isinstance(body, bytes) else body.encode()
        await js.publish("loom.jobs.submitted.badtenant", data, headers={"Nats-Msg-Id": msg_id})
    reasons: dict[str, str] = {}
    for _ in bad:
        event = await asyncio.wait_for(rejected.get(), timeout=15)
        assert event["code"] == "invalid"
        reasons[event["job_id"]] = event["reason"]
    await nc.close()
    assert set(reasons) == set(bad)
    assert "steps" in reasons["bad-type"] and "gpus" in reasons["bad-field"]
    assert ">= 1" in reasons["bad-negative"] and "workers" in reasons["bad-absurd"]
    assert "tenant" in reasons["bad-tenant"] and "job_id" in reasons["bad-id"]
    assert "exceeds" in reasons["bad-size"]

    conn = await asyncpg.connect(state["database_url"])
    try:
        assert await conn.fetchval("SELECT count(*) FROM jobs WHERE tenant = 'badtenant'") == 0
    finally:
        await conn.close()
    # The service is still there and still places jobs.
    await client.submit(_job("after-bad-input", steps=5))
    await _wait(lambda: _is(client, "after-bad-input", "completed"), timeout_s=30, what="job after bad input")


async def test_an_impossible_job_is_rejected_at_once_with_an_actionable_reason(client: LoomClient) -> None:
    await client.submit(
        JobSpec(
            job_id="too-big-1",
            tenant="e2e",
            workers=40,
            resources=Resources(gpus=8, gpu_models=["G2"]),
            work=Work(steps=1),
        )
    )
    job = await _wait(lambda: _rejected(client, "too-big-1"), timeout_s=15, what="too-big-1 rejected")
    assert "can never fit" in job["reason"] and "fewer workers" in job["reason"]


async def _rejected(c: LoomClient, job_id: str) -> dict[str, Any] | None:
    job = await c.job(job_id)
    return job if job and job["state"] == "rejected" else None


async def _health(nc: Client, name: str) -> dict[str, Any] | None:
    """A service instance's health answer, or None while it does not answer (dead, restarting)."""
    try:
        reply = await nc.request(subjects.service_health(name), b"", timeout=1.0)
    except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
        return None
    answer: dict[str, Any] = json.loads(reply.data)
    return answer


async def _leading(nc: Client, name: str) -> dict[str, Any] | None:
    """The health answer of ``name`` if it says it leads placement, else None."""
    answer = await _health(nc, name)
    return answer if answer is not None and answer["leadership"]["is_leader"] else None


# PLR0915: one end-to-end scenario, its steps in order.
async def test_sigkill_of_placement_with_queued_jobs_places_every_job_exactly_once(  # noqa: PLR0915
    client: LoomClient, state: dict[str, Any], home: Path, store: StoredSpans
) -> None:
    async def sole_leader() -> tuple[str, dict[str, Any]] | None:
        """The one instance that leads, once both answer (None while that is not so)."""
        answers = {name: await _health(client.nc, name) for name in PLACEMENT_INSTANCES}
        if any(answer is None for answer in answers.values()):
            return None
        leaders = [(name, a) for name, a in answers.items() if a is not None and a["leadership"]["is_leader"]]
        return leaders[0] if len(leaders) == 1 else None

    # 40 jobs x 4 GPUs = 160 GPUs on a 71-GPU platform: most of them queue.
    ids = [f"chaos-{i}" for i in range(40)]
    for job_id in ids[:20]:
        await client.submit(_job(job_id, gpus=4, steps=100, step_time_s=20.0))
    killed, answer = await _wait(sole_leader, timeout_s=30, what="one placement instance to lead")
    old_pid = answer["pid"]
    assert old_pid == stack.read_state(home)["services"][killed]["pid"]  # type: ignore[index]
    os.kill(old_pid, signal.SIGKILL)
    for job_id in ids[20:]:  # submitted while the leader is dead: they wait in JetStream
        await client.submit(_job(job_id, gpus=4, steps=100, step_time_s=20.0))

    # Another process takes the lease once the dead leader's key expires (lease TTL 2 s): usually
    # the standby, but the supervisor restarts the killed instance within about a TTL, and the
    # fresh process contends for the expiring lease as well.
    async def new_leader() -> tuple[str, dict[str, Any]] | None:
        for name in PLACEMENT_INSTANCES:
            now = await _leading(client.nc, name)
            if now is not None and now["pid"] != old_pid:
                return name, now
        return None

    _, took_over = await _wait(new_leader, timeout_s=30, what="another placement process to take over")
    assert took_over["leadership"]["token"] > answer["leadership"]["token"]

    async def restarted() -> bool:
        now = stack.read_state(home)
        return bool(now) and now["services"][killed]["pid"] != old_pid  # type: ignore[index]

    await _wait(restarted, timeout_s=20, what=f"the supervisor to restart {killed}")
    # Both instances are back and exactly one of them leads.
    await _wait(sole_leader, timeout_s=30, what="both placement instances up, one leading")

    async def all_completed() -> bool:
        states = [await _state_of(client, j) for j in ids]
        return all(s == "completed" for s in states)

    await _wait(all_completed, timeout_s=90, what="every chaos job to complete")

    conn = await asyncpg.connect(state["database_url"])
    try:
        placed = await conn.fetch(
            "SELECT job_id, count(*) AS n FROM job_events WHERE kind = 'placed' AND job_id LIKE 'chaos-%' "
            "GROUP BY job_id"
        )
        assert {r["job_id"]: r["n"] for r in placed} == dict.fromkeys(ids, 1)
        over = await conn.fetchval("SELECT count(*) FROM node_allocations WHERE gpus_reserved > gpus_total")
        assert over == 0
        held = await conn.fetchval(
            "SELECT count(*) FROM reservations WHERE job_id LIKE 'chaos-%' AND state <> 'released'"
        )
        assert held == 0
    finally:
        await conn.close()
    # Exactly one JobPlaced per job on the bus, too (the stream is the other half of "exactly once").
    nc = await nats.connect(state["nats_url"], **auth_options(credentials_path(state["nats_url"])))
    try:
        js = nc.jetstream()
        sub = await js.subscribe("loom.jobs.placed.*", ordered_consumer=True)
        seen: dict[str, int] = {}
        info = await js.stream_info("JOBS")
        while True:
            try:
                msg = await sub.next_msg(timeout=2)
            except nats.errors.TimeoutError:
                break
            body = json.loads(msg.data)
            if body["job_id"].startswith("chaos-"):
                seen[body["job_id"]] = seen.get(body["job_id"], 0) + 1
            if msg.metadata.sequence.stream >= info.state.last_seq:
                break
        assert seen == dict.fromkeys(ids, 1)
    finally:
        await nc.close()
    # Each job is one trace across the leader change, though this client sends no trace context:
    # a redelivery to the new leader used to start a second trace for the same job.
    traces: dict[str, set[str]] = {job_id: set() for job_id in ids}
    for span in store.file.spans():
        msg_id = str(span["attributes"].get("messaging.message.id", ""))
        job_id = msg_id.split(":", 1)[0]
        if job_id in traces:
            traces[job_id].add(span["trace_id"])
    assert {job_id: len(t) for job_id, t in traces.items()} == dict.fromkeys(ids, 1)


def test_loom_status_reports_every_process_healthy(home: Path) -> None:
    env = dict(os.environ, LOOM_HOME=str(home))
    out = subprocess.run(
        [sys.executable, "-m", "loom.cli.main", "status", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout)
    names = {p["name"] for p in report["processes"]}
    assert {"supervisor", "nats", "postgres", "placement", "metrics", "agent-c-use2-a"} <= names
    assert all(p["alive"] for p in report["processes"])
    assert all(
        p["health"]["pid"] == p["pid"]
        for p in report["processes"]
        if p["name"] not in ("supervisor", "nats", "postgres")
    )


def test_every_service_serves_prometheus_metrics_at_the_url_status_lists(home: Path) -> None:
    from urllib.error import HTTPError
    from urllib.request import Request, urlopen

    from prometheus_client.parser import text_string_to_metric_families

    services = [p for p in stack.process_table(home) if p["name"] not in ("supervisor", "nats", "postgres")]
    assert services
    # A secured stack's endpoints answer only its bearer token (`loom status` names its file).
    token = stack.local_http_token(home)
    assert token
    for process in services:
        url = process["metrics_url"]
        assert url, f"{process['name']} has no /metrics URL"
        with pytest.raises(HTTPError) as refused:
            urlopen(url, timeout=10)
        assert refused.value.code == 401, process["name"]
        with urlopen(Request(url, headers=bearer_header(token)), timeout=10) as answer:
            families = {f.name: f for f in text_string_to_metric_families(answer.read().decode())}
        (info,) = families["loom_service_info"].samples
        assert info.labels["service"] == process["name"]
        assert "process_cpu_seconds" in families
        if process["name"] == "metrics":
            assert families["loom_cluster_free_gpus"].samples
        if process["name"] == "placement":
            assert families["loom_queue_depth"].samples
    # `loom credentials rotate` writes a new token: every endpoint asks for it from its next
    # request, with no restart, and refuses the old one.
    from loom.security.http_token import rotate_http_token

    assert rotate_http_token(home) is not None
    new = stack.local_http_token(home)
    assert new and new != token
    for process in services:
        url = process["metrics_url"]
        with pytest.raises(HTTPError) as refused:
            urlopen(Request(url, headers=bearer_header(token)), timeout=10)
        assert refused.value.code == 401, process["name"]
        with urlopen(Request(url, headers=bearer_header(new)), timeout=10) as answer:
            assert answer.status == 200, process["name"]


async def test_the_services_spans_reach_the_store_after_its_token_is_rotated(
    client: LoomClient, store: StoredSpans, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The services' exporters read the token file at each export: after a rotation the store
    # refuses the old token, and the spans still arrive (before, the token was fixed in their
    # environment at start: every span after a rotation was refused until a restart).
    from opentelemetry import trace

    from loom.security.http_token import rotate_http_token
    from loom.telemetry import current_trace_id, reset_for_tests, setup_telemetry

    home = store.file.directory.parent
    assert rotate_http_token(home) is not None
    token = stack.local_http_token(home)
    assert token
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", store.url)
    for key, value in otlp_headers(token).items():
        monkeypatch.setenv(key, value)
    provider = setup_telemetry("e2e-client", log_level=None)
    try:
        with trace.get_tracer("e2e").start_as_current_span("submit rotated-1"):
            trace_id = current_trace_id()
            await client.submit(_job("rotated-1", steps=5))
        provider.force_flush()
    finally:
        reset_for_tests()
    assert trace_id is not None

    def placed(spans: list[Any]) -> bool:
        return any(
            s["service_name"] in PLACEMENT_INSTANCES and s["name"] == "process loom.jobs.submitted"
            for s in spans
        )

    await asyncio.to_thread(store.wait_for, trace_id, placed, 20)


def _loom(home: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "loom.cli.main", *argv],
        env=dict(os.environ, LOOM_HOME=str(home), COLUMNS="200"),  # wide enough for whole tables
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_loom_view_says_when_nothing_matches_and_keeps_json_small(home: Path) -> None:
    # A filter that matches nothing used to print an empty tree with exit 0.
    mars = _loom(home, "view", "--region", "mars")
    assert mars.returncode == 1 and "no cluster matches --region mars" in mars.stderr
    # A negative --min-free used to be accepted.
    negative = _loom(home, "view", "--min-free", "-3")
    assert negative.returncode == 2 and "must be 0 or more" in negative.stderr
    # --json without --nodes used to dump every node.
    brief = json.loads(_loom(home, "view", "--json").stdout)
    full = json.loads(_loom(home, "view", "--json", "--nodes").stdout)
    clusters = [
        c for r in brief["regions"].values() for z in r["zones"].values() for c in z["clusters"].values()
    ]
    assert clusters and all(
        "nodes" not in c and sum(c["gpus_by_model"].values()) == c["gpus_total"] for c in clusters
    )
    assert any(
        c["nodes"]
        for r in full["regions"].values()
        for z in r["zones"].values()
        for c in z["clusters"].values()
    )
    # Each cluster says whether it is drained (the migration service answers: none is here).
    assert all(c["drain"] is None for c in clusters)
    # A GPU model written otherwise than the platform's names the models there.
    lower = _loom(home, "view", "--model", "t4")
    assert lower.returncode == 1 and "no cluster matches --model t4" in lower.stderr
    assert "GPU models on the platform (names as written):" in lower.stderr and "T4" in lower.stderr
    # The text view shows each cluster's trust.
    assert "trust 1.00" in _loom(home, "view").stdout or "trust 0." in _loom(home, "view").stdout
    # A reader that goes away early (`| head`) ends the command quietly.
    piped = subprocess.run(
        f"{sys.executable} -m loom.cli.main view --json --nodes | head -c 100 > /dev/null",
        shell=True,
        env=dict(os.environ, LOOM_HOME=str(home)),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert "Traceback" not in piped.stderr and "BrokenPipeError" not in piped.stderr


def test_loom_net_degrade_names_an_unknown_link_and_shows_gbps_like_net_links(home: Path) -> None:
    # An unknown link used to answer "is the service running?".
    nowhere = _loom(home, "net", "degrade", "nowhere", "elsewhere", "--rtt-factor", "2")
    assert nowhere.returncode == 2 and "no emulated link nowhere -> elsewhere" in nowhere.stderr
    known = nowhere.stderr.split("known: ", 1)[1].replace("\n", " ")
    src, dst = (part.strip() for part in known.split(",")[0].split("->"))
    # The emulated bandwidth used to be printed in loopback Mbps while `net links` says Gbps.
    degraded = _loom(home, "net", "degrade", src, dst, "--gbps", "0.5")
    try:
        assert degraded.returncode == 0, degraded.stderr
        assert "Gbps" in degraded.stdout and "0.50" in degraded.stdout and "Mbps" not in degraded.stdout
    finally:
        assert _loom(home, "net", "restore", src, dst).returncode == 0
    # Restoring an unknown link names it, as degrading one does (it said "is the service running?").
    unknown = _loom(home, "net", "restore", "nowhere", "elsewhere")
    assert unknown.returncode == 2 and "no emulated link nowhere -> elsewhere" in unknown.stderr


def test_loom_net_links_and_path_show_percentiles_forecast_and_bottleneck(home: Path) -> None:
    links = _loom(home, "net", "links")
    assert links.returncode == 0, links.stderr
    assert all(word in links.stdout for word in ("p95", "p99", "forecast"))
    pairs = json.loads(_loom(home, "net", "links", "--json").stdout)
    assert pairs and all("windows" in link and "rtt_ms_forecast" in link for link in pairs)
    src, dst = pairs[0]["src"], pairs[0]["dst"]
    path = _loom(home, "net", "path", src, dst)
    assert path.returncode == 0, path.stderr
    assert "bottleneck" in path.stdout
    # A region Loom does not know is bad input, as in `net degrade` (they exited 1, as an outage).
    for argv in (("path", src, "nowhere"), ("links", "--region", "nowhere")):
        unknown = _loom(home, "net", *argv)
        assert unknown.returncode == 2 and "unknown region 'nowhere'" in unknown.stderr, unknown.stderr


def test_loom_submit_says_what_became_of_each_job(home: Path, tmp_path: Path) -> None:
    job_id = f"cli-{uuid.uuid4().hex[:8]}"
    spec = {
        "job_id": job_id,
        "tenant": "acme",
        "resources": {"gpus": 1},
        "work": {"steps": 5, "step_time_s": 1.0},
    }
    path = tmp_path / "job.json"
    path.write_text(json.dumps(spec))
    first = _loom(home, "submit", str(path))
    assert first.returncode == 0 and "accepted" in first.stdout, first.stdout + first.stderr
    # The same file again (the README invites it) used to be dropped silently.
    again = _loom(home, "submit", str(path))
    assert again.returncode == 0 and "already submitted" in again.stdout, again.stdout + again.stderr
    # A different spec under the same id used to be dropped silently too.
    path.write_text(json.dumps({**spec, "work": {"steps": 50, "step_time_s": 1.0}}))
    taken = _loom(home, "submit", str(path))
    assert taken.returncode == 1 and "taken by a different spec" in taken.stderr, taken.stdout + taken.stderr
    # A cyclic DAG used to print "submitted" with exit 0; the reason was only in placement's log.
    stage = {"resources": {"gpus": 1}, "work": {"steps": 1, "step_time_s": 1.0}}
    cyclic = {
        "job_id": f"dag-{uuid.uuid4().hex[:8]}",
        "tenant": "acme",
        "work": {"steps": 1},
        "stages": [{**stage, "name": "a", "depends_on": ["b"]}, {**stage, "name": "b", "depends_on": ["a"]}],
    }
    path.write_text(json.dumps(cyclic))
    refused = _loom(home, "submit", str(path), "--wait", "--timeout", "30")
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "rejected" in refused.stderr and "cycle" in refused.stderr
    # `loom jobs` used to cut reasons at 80 characters, mid-word. A job that can never fit is
    # rejected by placement with a long, actionable reason.
    big = {**spec, "job_id": f"big-{uuid.uuid4().hex[:8]}", "workers": 40}
    big["resources"] = {"gpus": 8, "gpu_models": ["G2"]}
    path.write_text(json.dumps(big))
    _loom(home, "submit", str(path))
    reason = ""
    for _ in range(30):
        listed = _loom(home, "jobs", "--state", "rejected", "--limit", "500", "--json")
        reason = next((r["reason"] for r in json.loads(listed.stdout) if r["job_id"] == big["job_id"]), "")
        if reason:
            break
        time.sleep(0.5)
    last = reason.split()[-1] if reason else ""
    assert len(reason) > 80 and last not in reason[:80], reason  # the old cut lost its last word
    table = _loom(home, "jobs", "--state", "rejected", "--limit", "500").stdout
    assert last in table, table
    # Submitted again: still a rejection (it exited 0 as "already submitted").
    again = _loom(home, "submit", str(path))
    assert again.returncode == 1 and "already submitted (rejected)" in again.stdout, (
        again.stdout + again.stderr
    )


def test_loom_submit_wait_shows_progress_while_the_job_runs(home: Path, tmp_path: Path) -> None:
    # About 12 s of running at the stack's time scale: the wait used to print nothing between
    # "running" and "completed".
    spec = {
        "job_id": f"slow-{uuid.uuid4().hex[:8]}",
        "tenant": "acme",
        "resources": {"gpus": 1},
        "work": {"steps": 24_000, "step_time_s": 1.0, "checkpoint_every_steps": 2_000},
    }
    path = tmp_path / "slow.json"
    path.write_text(json.dumps(spec))
    done = _loom(home, "submit", str(path), "--wait", "--timeout", "50")
    assert done.returncode == 0, done.stdout + done.stderr
    progress = [line for line in done.stdout.splitlines() if "% done" in line]
    assert progress, done.stdout
    assert "completed" in done.stdout.splitlines()[-1]


def test_loom_job_and_explain_of_a_dag_point_to_its_stage_jobs(
    home: Path, tmp_path: Path, store: StoredSpans
) -> None:
    dag_id = f"dag-{uuid.uuid4().hex[:8]}"
    stage = {"resources": {"gpus": 1}, "work": {"steps": 5, "step_time_s": 1.0}}
    spec = {
        "job_id": dag_id,
        "tenant": "acme",
        "work": {"steps": 1},
        "stages": [{**stage, "name": "prep"}, {**stage, "name": "train", "depends_on": ["prep"]}],
    }
    path = tmp_path / "dag.json"
    path.write_text(json.dumps(spec))
    assert _loom(home, "submit", str(path), "--wait", "--timeout", "40").returncode == 0
    # A DAG whose stage's job id is taken is accepted, then rejected at once: a refusal all the
    # same (it exited 0, "accepted, rejected").
    clash = tmp_path / "clash.json"
    clash.write_text(json.dumps({**spec, "job_id": f"c{dag_id}"}))
    taken = tmp_path / "taken.json"
    taken.write_text(json.dumps({**stage, "job_id": f"c{dag_id}--prep", "tenant": "acme"}))
    assert _loom(home, "submit", str(taken)).returncode == 0
    refused = _loom(home, "submit", str(clash))
    assert refused.returncode == 1, refused.stdout + refused.stderr
    # (whichever placement's answer the CLI sees first: the rejected event, or the job's record)
    assert "already exist" in refused.stderr, refused.stderr
    # The rejected DAG used to list that other job, completed on its cluster, as its stage.
    rejected = json.loads(_loom(home, "job", f"c{dag_id}", "--json").stdout)
    assert [(s["job_id"], s["state"]) for s in rejected["stage_jobs"]] == [
        (f"c{dag_id}--prep", "not created (the id is another job's)"),
        # It said "not yet created", as though it would be.
        (f"c{dag_id}--train", "not created (the DAG is rejected)"),
    ]
    # The DAG's own record used to be empty, with no pointer to its stage jobs.
    shown = _loom(home, "job", dag_id)
    assert shown.returncode == 0, shown.stderr
    assert f"{dag_id}--prep" in shown.stdout and f"{dag_id}--train" in shown.stdout
    as_json = json.loads(_loom(home, "job", dag_id, "--json").stdout)
    assert [s["state"] for s in as_json["stage_jobs"]] == ["completed", "completed"]
    # `loom explain` used to say "no decision recorded yet".
    explained = _loom(home, "explain", dag_id)
    assert f"loom explain {dag_id}--train" in explained.stdout, explained.stdout
    # One trace from `loom submit` to the DAG's own completion: the DAG's `completed` used to
    # start a new root trace, and `loom submit` emitted no span at all.
    traced = _loom(home, "trace", dag_id, "--jaeger", "http://127.0.0.1:9")  # nothing listens there
    assert traced.returncode == 1 and "Jaeger at http://127.0.0.1:9 cannot be reached" in traced.stderr
    trace_id = traced.stdout.split()[1]
    assert f"/trace/{trace_id}" in traced.stdout
    assert f"trace: {trace_id}" in shown.stdout

    def done_and_whole(mine: list[Any]) -> bool:
        ids = {s["span_id"] for s in mine}
        completed = any(
            s["name"] == "publish loom.jobs.completed"
            and s["attributes"].get("messaging.message.id") == f"{dag_id}:completed:1"
            for s in mine
        )
        # Every span hangs from one root (none orphaned), once the parents are exported too.
        return completed and sum(1 for s in mine if s["parent_span_id"] not in ids) == 1

    mine = store.wait_for(trace_id, done_and_whole, timeout_s=15)
    roots = [s for s in mine if s["parent_span_id"] is None]
    assert [(r["service_name"], r["name"]) for r in roots] == [("loom-cli", "loom submit")], roots
    stage_cluster = as_json["stage_jobs"][0]["cluster"]
    assert {s["service_name"] for s in mine} >= {"loom-cli", f"agent-{stage_cluster}"}
    # With no Jaeger given, `loom trace` prints the tree from the stack's store (its Jaeger API).
    tree = _loom(home, "trace", dag_id)
    assert tree.returncode == 0, tree.stderr
    lines = tree.stdout.splitlines()
    assert lines[1] == f"trace store {store.url} (loom up --traces)"
    assert "loom-cli: loom submit" in lines[2] and lines[2].split("loom-cli")[0].strip().startswith("0.000s")
    assert any("placement" in line and "publish loom.jobs.completed" in line for line in lines[3:])
    assert len(lines) - 2 >= len(mine)  # every span received is in the tree
