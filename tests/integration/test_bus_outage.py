"""NATS down for longer than a publish's whole retry budget, on the real services in this process.

Before journalled reports, an agent's run task published each report itself; after its publisher
gave up (8 attempts: with the default 5 s timeout and the backoffs between them, about 47 s) the
task died without a word and the job stayed ``running`` with its GPUs held until the agent was
killed. Here the agent's publisher waits 0.5 s per attempt, so it gives up after about 11 s (8 x
0.5 s plus 7.15 s of backoff), and NATS stays down 20 s: the same fault, in a test's time.
"""

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from nats.js.api import ConsumerConfig, DeliverPolicy
from platform_helpers import Platform
from waiting import until

from loom.bus import Publisher
from loom.client import LoomClient, QueryError
from loom.runtime.servers import NatsServer
from loom_proto import subjects
from loom_proto.jobs import JobSpec, Resources, Work

P100 = "openb-node-0123"  # c-weu-a's only P100 node: 2 GPUs
OUTAGE_S = 20.0
"""Longer than the agent's publish give-up here (about 11 s), by far."""


@pytest.fixture
def nats(tmp_path: Path) -> Iterator[NatsServer]:
    """A NATS of this test's own: the test stops and restarts it."""
    with NatsServer(tmp_path / "nats") as server:
        yield server


@pytest.fixture
async def platform(
    nats: NatsServer, fresh_database: Callable[..., Awaitable[str]], tmp_path: Path
) -> AsyncIterator[Platform]:
    (tmp_path / "agents").mkdir()
    p = Platform(nats.url, await fresh_database("outage"), tmp_path / "agents")
    await p.start("metrics")
    yield p
    nats.start()  # a no-op unless the test failed during the outage
    for name in list(p.tasks):
        await p.stop(name)


async def _job(client: LoomClient, job_id: str, state: str) -> dict[str, Any] | None:
    try:
        job = await client.job(job_id, timeout_s=1.0)
    except QueryError:
        return None  # placement is not answering yet (it lost its lease while NATS was down)
    return job if job and job["state"] == state else None


async def test_a_job_that_finishes_while_nats_is_down_is_reported_completed_once_and_frees_its_gpus(
    nats: NatsServer, platform: Platform
) -> None:
    placement = await platform.start("placement")
    agent = await platform.start("agent-c-weu-a")
    agent.ctx.publisher = Publisher(agent.ctx.nc, timeout_s=0.5)  # gives up after ~11 s, not ~47 s
    client = await LoomClient.connect(nats.url)
    job_id = "outage-job"
    try:
        # 100 steps of 160 s at 2000x: 8 s of wall time, a progress report every 0.8 s.
        await client.submit(
            JobSpec(
                job_id=job_id,
                tenant="t1",
                resources=Resources(gpus=2, gpu_models=["P100"]),
                work=Work(steps=100, step_time_s=160.0),
            )
        )
        await until(lambda: _job(client, job_id, "running"), 15, "the job running")
        down_at = time.monotonic()
        nats.stop()
        assert f"{job_id}:1" in agent.running, "the run is still going when NATS goes down"

        # The run goes on without the bus, ends, and frees its GPUs here at once.
        await until(
            lambda: _true(agent.backend.nodes[P100].gpus_used == 0), 15, "the run to end during the outage"
        )
        assert f"{job_id}:1" not in agent.running
        health = agent.ctx.watchdog.health()
        assert health["status"] == "degraded"
        assert any(
            p.startswith("nats unavailable, ") and "reports journalled" in p for p in health["problems"]
        )
        assert agent.ctx.stats["reports_pending"] >= 1
        assert health["tasks"]["reports"]["state"] == "running", "waiting out the bus is not a death"

        await asyncio.sleep(max(OUTAGE_S - (time.monotonic() - down_at), 0.0))  # the fault's length
        nats.start()

        job = await until(lambda: _job(client, job_id, "completed"), 30, "the job reported completed")
        kinds = [e["kind"] for e in job["events"]]
        assert kinds.count("started") == 1 and kinds.count("completed") == 1
        assert job_id not in placement.book.runs, "placement released the run's GPUs"
        # Each report once, in the order the run made them (resends were dropped as duplicates).
        reports = await _reports_in_stream(client, job_id)
        assert reports == [
            ("started", None),
            *(("progress", s) for s in range(10, 100, 10)),
            ("completed", None),
        ]

        # The GPUs are really free: a job that needs all of them runs there next.
        await client.submit(
            JobSpec(
                job_id="after-outage",
                tenant="t1",
                resources=Resources(gpus=2, gpu_models=["P100"]),
                work=Work(steps=10, step_time_s=80.0),
            )
        )
        await until(lambda: _job(client, "after-outage", "completed"), 20, "the next P100 job completed")

        async def healthy() -> dict[str, Any] | None:
            reply = await client.nc.request(subjects.service_health("agent-c-weu-a"), b"", timeout=1.0)
            answer: dict[str, Any] = msgspec.json.decode(reply.data)
            return answer if answer["status"] == "ok" else None

        answer = await until(healthy, 10, "the agent's health back to ok")
        assert answer["reports_pending"] == 0 and answer["problems"] == []
    finally:
        await client.close()


async def _reports_in_stream(client: LoomClient, job_id: str) -> list[tuple[str, int | None]]:
    """What the JOBS stream holds of ``job_id``'s run, in stream order: (kind, step) of each
    started, progress, checkpointed and completed message (a duplicate dropped by the stream's
    dedup is not there)."""
    js = client.nc.jetstream()
    sub = await js.pull_subscribe(
        # Agents' reports carry their cluster as a fifth token (loom.jobs.<kind>.<tenant>.<cluster>).
        f"{subjects.PREFIX}.jobs.>",
        config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL),
        stream="JOBS",
    )
    found: list[tuple[str, int | None]] = []
    try:
        while True:
            try:
                msgs = await sub.fetch(100, timeout=1.0)
            except TimeoutError:
                break
            for m in msgs:
                kind, event = m.subject.split(".")[2], msgspec.json.decode(m.data)
                if event.get("job_id") == job_id and kind in (
                    "started",
                    "progress",
                    "checkpointed",
                    "completed",
                ):
                    found.append((kind, event.get("step")))
    finally:
        await sub.unsubscribe()
    return found


async def _true(value: bool) -> bool:
    return value
