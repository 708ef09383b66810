"""A job's life through the real services running in this process, on real NATS and PostgreSQL.

All services share one in-memory span exporter here, so the trace of a job can be read back
directly; the OTLP path across OS processes is covered in tests/e2e.
"""

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from platform_helpers import Platform
from waiting import until

from loom.bus.publisher import Outgoing
from loom.client import LoomClient, QueryError
from loom.model.profiles import relative_speed
from loom.model.scu import TrustTracker
from loom.runtime.servers import NatsServer
from loom.telemetry import current_trace_id, reset_for_tests, setup_telemetry
from loom_proto import subjects
from loom_proto.clusters import StartJobs
from loom_proto.codec import decode, encode
from loom_proto.jobs import Affinity, JobSpec, JobSubmitted, Resources, Work


@pytest.fixture(scope="module")
def nats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A NATS of this module's own: the services' durable consumers start from a clean stream."""
    with NatsServer(tmp_path_factory.mktemp("flow-nats")) as server:
        yield server.url


@pytest.fixture(scope="module")
def exporter() -> Iterator[InMemorySpanExporter]:
    spans = InMemorySpanExporter()
    setup_telemetry("flow", exporter=spans, log_level=None)
    yield spans
    reset_for_tests()


@pytest.fixture(scope="module")
async def platform(
    nats_url: str,
    fresh_database: Callable[..., Awaitable[str]],
    exporter: InMemorySpanExporter,
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[Platform]:
    p = Platform(nats_url, await fresh_database("flow"), tmp_path_factory.mktemp("agents"))
    for name in ("metrics", "placement", "agent-c-use2-a", "agent-c-weu-a", "agent-c-sea1-a"):
        await p.start(name)
    yield p
    for name in list(p.tasks):
        await p.stop(name)


@pytest.fixture
async def client(platform: Platform) -> AsyncIterator[LoomClient]:
    c = await LoomClient.connect(platform.nats_url)
    yield c
    await c.close()


def job_state(client: LoomClient, job_id: str, wanted: str) -> Callable[[], Awaitable[Any]]:
    async def check() -> Any:
        job = await client.job(job_id)
        return job if job and job["state"] == wanted else None

    return check


async def test_a_job_is_one_trace_from_submission_to_completion(
    client: LoomClient, exporter: InMemorySpanExporter
) -> None:
    with trace.get_tracer("test").start_as_current_span("client submits"):
        trace_id = current_trace_id()
        await client.submit(
            JobSpec(
                job_id="flow-traced",
                tenant="t1",
                resources=Resources(gpus=2),
                work=Work(steps=40, step_time_s=10.0),
            )
        )
    job = await until(job_state(client, "flow-traced", "completed"), 30, "flow-traced completed")

    def names() -> set[str]:
        return {
            s.name for s in exporter.get_finished_spans() if format(s.context.trace_id, "032x") == trace_id
        }

    await until(lambda: _true("process loom.jobs.completed" in names()), 10, "the completion to be recorded")
    cluster = job["cluster"]
    assert {
        "publish loom.jobs.submitted",
        "process loom.jobs.submitted",
        "publish loom.jobs.placed",
        f"publish loom.clusters.{cluster}",
        f"process loom.clusters.{cluster}",
        "publish loom.jobs.started",
        "publish loom.jobs.progress",
        "publish loom.jobs.completed",
        "process loom.jobs.completed",
    } <= names()
    # Heartbeats are not part of any job's trace.
    assert not any("heartbeat" in n for n in names())


async def test_an_unreadable_submission_is_an_error_in_its_trace(
    client: LoomClient, exporter: InMemorySpanExporter
) -> None:
    # Before, placement's span for a submission it rejected as invalid ended "unset", like one
    # it handled: the submitter's trace did not show the refusal.
    with trace.get_tracer("test").start_as_current_span("client submits garbage"):
        trace_id = current_trace_id()
        await client.publisher.publish_bytes(
            subjects.job_submitted("t1"), b'{"job_id": "flow-bad", "tenant": "t1"}', msg_id="flow-bad"
        )

    def processed() -> list[Any]:
        return [
            s
            for s in exporter.get_finished_spans()
            if format(s.context.trace_id, "032x") == trace_id and s.name == "process loom.jobs.submitted"
        ]

    await until(lambda: _true(bool(processed())), 10, "placement's span of the rejected submission")
    (span,) = processed()
    assert span.status.status_code == StatusCode.ERROR
    assert "rejected (invalid)" in (span.status.description or "")


async def _true(value: bool) -> bool:
    return value


async def test_jobs_started_together_on_one_cluster_are_one_command_and_each_stays_one_trace(
    client: LoomClient, exporter: InMemorySpanExporter
) -> None:
    batches: list[int] = []

    async def on_batch(msg: Any) -> None:
        batches.append(len(decode(msg.data, StartJobs).starts))

    sub = await client.nc.subscribe("loom.clusters.*.cmd.starts", cb=on_batch)
    tracer = trace.get_tracer("test")
    ids = [f"flow-batched-{i}" for i in range(8)]
    trace_ids: dict[str, str] = {}
    messages = []
    for job_id in ids:
        spec = JobSpec(
            job_id=job_id,
            tenant="t1",
            resources=Resources(gpus=1),
            work=Work(steps=5, step_time_s=10.0),
            affinity=Affinity(regions=["aws-us-east-2"]),  # all on c-use2-a
        )
        fields = {f: getattr(spec, f) for f in JobSpec.__struct_fields__}
        with tracer.start_as_current_span(f"client submits {job_id}") as span:
            trace_ids[job_id] = format(span.get_span_context().trace_id, "032x")
            messages.append(
                Outgoing(
                    subjects.job_submitted("t1"),
                    encode(JobSubmitted(**fields, submitted_at=time.time())),
                    job_id,
                    {},
                    otel_context.get_current(),
                )
            )
    # At once: the first is placed alone, the ones that arrive meanwhile in the next cycle.
    assert await client.publisher.publish_batch(messages) == [None] * len(ids)
    for job_id in ids:
        await until(job_state(client, job_id, "completed"), 30, f"{job_id} completed")
    await sub.unsubscribe()
    assert sum(batches) >= 2, "several starts went as one command"

    def names(job_id: str) -> set[str]:
        return {
            s.name
            for s in exporter.get_finished_spans()
            if format(s.context.trace_id, "032x") == trace_ids[job_id]
        }

    needed = {
        "publish loom.jobs.submitted",
        "process loom.jobs.submitted",
        "publish loom.jobs.placed",
        "publish loom.clusters.c-use2-a",
        "process loom.clusters.c-use2-a",
        "publish loom.jobs.started",
        "publish loom.jobs.completed",
    }
    for job_id in ids:
        await until(lambda j=job_id: _true(needed <= names(j)), 10, f"{job_id}'s trace whole")


async def test_a_restarted_metrics_service_rebuilds_the_same_view(
    platform: Platform, client: LoomClient
) -> None:
    await until(lambda: _clusters(client, 3), 15, "three clusters in the view")
    before = await client.view()
    await platform.stop("metrics")
    await platform.start("metrics")
    after = await until(
        lambda: _view_or_none(client), 10, "the new metrics to answer"
    )  # rebuilt from PostgreSQL
    strip = _without_times
    assert strip(after) == strip(before)


async def _view_or_none(client: LoomClient) -> dict[str, Any] | None:
    try:
        return await client.view(timeout_s=0.5)
    except QueryError:
        return None


async def _clusters(client: LoomClient, n: int) -> bool:
    view = await client.view()
    return sum(len(z["clusters"]) for r in view["regions"].values() for z in r["zones"].values()) == n


# What agents change from one heartbeat to the next (jobs keep running while metrics restarts).
_DYNAMIC = {
    "last_heartbeat_at",
    "age_s",
    "ttl_s",
    "heartbeat_interval_s",
    "gpus_used",
    "gpus_free",
    "gpus_reserved",
    # Learning from a run that completes between the two snapshots moves these legitimately.
    "trust",
    "scu_per_gpu",
}


def _without_times(view: dict[str, Any]) -> Any:
    if isinstance(view, dict):
        return {k: _without_times(v) for k, v in view.items() if k not in _DYNAMIC}
    if isinstance(view, list):
        return [_without_times(v) for v in view]
    return view


async def test_a_restarted_agent_resumes_its_running_job_and_finishes_it_once(
    platform: Platform, client: LoomClient
) -> None:
    # Only c-weu-a has P100s, so the job lands there.
    await client.submit(
        JobSpec(
            job_id="flow-resume",
            tenant="t1",
            resources=Resources(gpus=2, gpu_models=["P100"]),
            work=Work(steps=100, step_time_s=200.0),
        )
    )  # 10 s at 2000x
    await until(job_state(client, "flow-resume", "running"), 15, "flow-resume running")
    await platform.stop("agent-c-weu-a")
    stopped_at = (await client.job("flow-resume"))["progress"]  # type: ignore[index]
    assert stopped_at < 1.0
    await platform.start("agent-c-weu-a")
    job = await until(job_state(client, "flow-resume", "completed"), 40, "flow-resume completed")
    kinds = [e["kind"] for e in job["events"]]
    assert kinds.count("started") == 1 and kinds.count("completed") == 1
    steps = [e["event"]["step"] for e in job["events"] if e["kind"] == "progress"]
    assert steps == sorted(steps), "progress never goes back after the restart"


async def test_queued_jobs_wait_for_capacity_and_are_placed_when_it_frees(client: LoomClient) -> None:
    # c-sea1-a holds all 9 V100M16 GPUs, on nodes of at most 4: two 4-GPU jobs fit, the third waits.
    ids = [f"flow-wait-{i}" for i in range(3)]
    for job_id in ids:
        await client.submit(
            JobSpec(
                job_id=job_id,
                tenant="t2",
                resources=Resources(gpus=4, gpu_models=["V100M16"]),
                work=Work(steps=10, step_time_s=200.0),
            )
        )
    first = await until(lambda: _some_queued(client, ids), 15, "one job queued while the others run")
    assert first["state"] == "queued"
    for job_id in ids:
        await until(job_state(client, job_id, "completed"), 40, f"{job_id} completed")


async def _some_queued(client: LoomClient, ids: list[str]) -> Any:
    for job_id in ids:
        job = await client.job(job_id)
        if job and job["state"] == "queued":
            return job
    return None


async def test_a_silent_cluster_turns_stale_within_its_ttl_and_its_capacity_is_not_offered(
    platform: Platform, client: LoomClient
) -> None:
    await until(lambda: _clusters(client, 3), 15, "three clusters in the view")
    await platform.stop("agent-c-weu-a")  # the only cluster with P100s goes silent
    stopped = time.monotonic()

    async def weu_stale() -> dict[str, Any] | None:
        view = await client.view(region="azure-westeurope")
        cluster = view["regions"]["azure-westeurope"]["zones"]["azure-westeurope-a"]["clusters"]["c-weu-a"]
        return cluster if cluster["stale"] else None

    cluster = await until(weu_stale, 15, "c-weu-a to turn stale")
    # Metrics checks once a second; the declared interval is at most 1 s here, so at most 4 s TTL.
    assert time.monotonic() - stopped <= cluster["ttl_s"] + 2.0
    assert cluster["gpus_free"] == 0
    fresh = await client.view(fresh_only=True)
    assert "azure-westeurope" not in fresh["regions"]

    async def placement_knows() -> bool:
        # Placement follows the view asynchronously: wait until it has closed the silent cluster.
        reply = await client.nc.request("loom.health.placement", b"", timeout=2)
        closed = json.loads(reply.data).get("unschedulable_nodes", {})
        return int(closed.get("c-weu-a", 0)) > 0

    await until(placement_knows, 15, "placement to close c-weu-a")

    await client.submit(
        JobSpec(
            job_id="flow-p100-while-stale",
            tenant="t3",
            resources=Resources(gpus=1, gpu_models=["P100"]),
            work=Work(steps=5),
        )
    )
    await until(job_state(client, "flow-p100-while-stale", "queued"), 10, "the P100 job to wait")
    # Observed over two seconds (several requeue cycles): it stays queued while the cluster is stale.
    watch_until = time.monotonic() + 2.0
    while time.monotonic() < watch_until:
        job = await client.job("flow-p100-while-stale")
        assert job is not None and job["state"] == "queued"
        await asyncio.sleep(0.2)
    await platform.start("agent-c-weu-a")
    await until(
        job_state(client, "flow-p100-while-stale", "completed"), 20, "the job after the cluster returns"
    )


async def _trust_of(client: LoomClient, region: str, cluster: str) -> float:
    view = await client.view(region=region, nodes=False)
    (zone,) = view["regions"][region]["zones"].values()
    return float(zone["clusters"][cluster]["trust"])


async def test_trust_rises_as_a_cluster_delivers_its_claimed_compute_and_falls_when_it_does_not(
    platform: Platform, client: LoomClient
) -> None:
    # c-use2-a is the only cluster with V100M32; it delivers exactly what its profile claims.
    ids = [f"flow-trust-{i}" for i in range(3)]
    before = await _trust_of(client, "aws-us-east-2", "c-use2-a")  # earlier tests' runs count too
    for job_id in ids:
        await client.submit(
            JobSpec(
                job_id=job_id,
                tenant="t4",
                resources=Resources(gpus=1, gpu_models=["V100M32"]),
                work=Work(steps=10, step_time_s=20.0),
            )
        )
    for job_id in ids:
        await until(job_state(client, job_id, "completed"), 20, f"{job_id} completed")

    # Three runs that confirm the claim, each learned once (metering may fold them in one batch or
    # in three): the trust read below is the one after all three, not a reading on the way.
    expected = TrustTracker(trust=before)
    for _ in ids:
        expected = expected.observe(1.0, 1.0)

    async def trust_risen() -> float | None:
        trust = await _trust_of(client, "aws-us-east-2", "c-use2-a")
        return trust if trust == pytest.approx(expected.trust, abs=1e-3) else None

    confirmed = await until(
        trust_risen, 10, f"c-use2-a's trust to rise from {before} to {expected.trust:.4f}"
    )
    assert confirmed > 0.5
    # The same cluster restarted delivering half its claim: the next run is a mismatch.
    await platform.stop("agent-c-use2-a")
    await platform.start("agent-c-use2-a", efficiency=0.5)
    await client.submit(
        JobSpec(
            job_id="flow-trust-slow",
            tenant="t4",
            resources=Resources(gpus=1, gpu_models=["V100M32"]),
            work=Work(steps=10, step_time_s=20.0),
        )
    )
    await until(job_state(client, "flow-trust-slow", "completed"), 20, "the slow run to complete")

    async def trust_fallen() -> float | None:
        trust = await _trust_of(client, "aws-us-east-2", "c-use2-a")
        return trust if trust < confirmed else None

    fallen = await until(trust_fallen, 10, "c-use2-a's trust to fall")
    assert fallen == pytest.approx(confirmed * 0.5, rel=0.01)


async def test_agents_publish_their_accelerator_profiles_and_the_view_carries_their_scu(
    client: LoomClient, platform: Platform
) -> None:
    async def scu_known() -> dict[str, Any] | None:
        try:
            view = await client.view(region="azure-westeurope", nodes=False, timeout_s=1.0)
        except QueryError:
            return None
        (zone,) = view["regions"]["azure-westeurope"]["zones"].values()
        table = zone["clusters"]["c-weu-a"]["scu_per_gpu"]
        return table if set(table) == {"P100", "T4"} else None

    table = await until(scu_known, 10, "c-weu-a's accelerator SCU in the view")
    # The same SCU model placement believes: V100M16 is the reference, the older parts are slower.
    assert table["P100"]["training_compute"] == pytest.approx(
        relative_speed("P100", "training_compute"), rel=1e-3
    )
    assert all(0 < v < 1 for per_task in table.values() for v in per_task.values())
    await platform.stop("metrics")
    await platform.start("metrics")
    rebuilt = await until(scu_known, 10, "the SCU table after a metrics restart")
    assert rebuilt == table
