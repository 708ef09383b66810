"""Poison on every consumed subject of the real services, in this process on real NATS and
PostgreSQL: placement (submissions, lifecycle), metrics (heartbeats, reservations), an agent
(commands) and network perception (probe samples).

A deeply nested JSON of 100 KB once failed whole batches (placement dead-lettered valid jobs next to
it; network perception lost real samples) and killed an agent's command consumer for good. Here
each bad message fails alone (a rejection, a dead letter with error headers, or a refusal counted)
and every consumer is alive and settled afterwards. Hypothesis mixes hostile payloads with valid
ones on every subject (bounded: a few batches each).
"""

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nats.aio.msg import Msg
from platform_helpers import Platform
from waiting import until

from loom.client import LoomClient
from loom.model.topology import load_topology
from loom.runtime.servers import NatsServer
from loom.runtime.service import open_context
from loom_proto import subjects
from loom_proto.jobs import JobSpec, Resources, Work
from loom_services.network_perception.service import NetworkPerception

NESTED = b"[" * 50_000 + b"]" * 50_000  # 100 KB, no message id: placement's worst case
NESTED_UNDER_KEY = b'{"kind":"probe","src":"a","dst":"b","x":' + b"[" * 20_000 + b"]" * 20_000 + b"}"
CLUSTER = "c-weu-a"
USE2, WEU = "aws-us-east-2", "azure-westeurope"


@pytest.fixture(scope="module")
def nats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A NATS of this module's own: the services' durable consumers start from a clean stream."""
    with NatsServer(tmp_path_factory.mktemp("poison-nats")) as server:
        yield server.url


@pytest.fixture(scope="module")
async def platform(
    nats_url: str, fresh_database: Callable[..., Awaitable[str]], tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Platform]:
    p = Platform(nats_url, await fresh_database("poison"), tmp_path_factory.mktemp("poison-agents"))
    for name in ("metrics", "placement", f"agent-{CLUSTER}"):
        await p.start(name)
    ctx = await open_context("network-perception", nats_url=nats_url, database_url=p.database_url)
    perception = NetworkPerception(ctx, load_topology("small"), period_s=0.2, persist_every_s=1.0)
    p.tasks["network-perception"] = (asyncio.create_task(perception.run()), ctx)
    yield p
    for name in list(p.tasks):
        await p.stop(name)


@pytest.fixture
async def client(platform: Platform) -> AsyncIterator[LoomClient]:
    c = await LoomClient.connect(platform.nats_url)
    yield c
    await c.close()


def job(job_id: str, tenant: str) -> JobSpec:
    return JobSpec(
        job_id=job_id, tenant=tenant, task_type="inference", resources=Resources(gpus=1), work=Work(steps=2)
    )


async def collect(client: LoomClient, subject: str) -> list[Msg]:
    got: list[Msg] = []

    async def on_msg(msg: Msg) -> None:
        got.append(msg)

    await client.nc.subscribe(subject, cb=on_msg)
    await client.nc.flush()
    return got


async def health(client: LoomClient, name: str) -> dict[str, Any]:
    reply = await client.nc.request(subjects.service_health(name), b"", timeout=2.0)
    return dict(msgspec.json.decode(reply.data))


async def placed(client: LoomClient, job_ids: list[str]) -> bool:
    for job_id in job_ids:
        j = await client.job(job_id)
        if not j or j["state"] not in ("placed", "running", "completed"):
            return False
    return True


async def all_settled(client: LoomClient) -> bool:
    """Every durable consumer of the services has nothing pending nor unacknowledged."""
    js = client.nc.jetstream()
    for stream in ("JOBS", "REQUESTS", "CLUSTERS", "NET"):
        for info in await js.consumers_info(stream):
            if info.name.startswith(("placement", "metrics", "agent", "network-perception")) and (
                info.num_pending or info.num_ack_pending
            ):
                return False
    return True


async def test_nested_json_next_to_valid_submissions_fails_only_itself(client: LoomClient) -> None:
    tenant = f"t{uuid.uuid4().hex[:6]}"
    rejected = await collect(client, subjects.job_event("rejected", tenant))
    dead = await collect(client, subjects.dead_letter(subjects.job_submitted(tenant)))
    await until(lambda: _clusters(client), 15, "the agent's cluster in the view")

    await client.submit(job("before", tenant))
    await client.nc.jetstream().publish(subjects.job_submitted(tenant), NESTED)  # no message id
    await client.submit(job("after", tenant))

    await until(lambda: placed(client, ["before", "after"]), 20, "the valid neighbours placed")
    await until(lambda: _true(len(rejected) == 1), 10, "the nested submission rejected")
    reason = msgspec.json.decode(rejected[0].data)["reason"]
    assert "nested" in reason, reason
    assert dead == []
    await until(lambda: all_settled(client), 10, "every consumer settled")


async def test_nested_json_to_an_agent_is_dead_lettered_and_its_consumer_lives_on(client: LoomClient) -> None:
    subject = subjects.cluster_commands(CLUSTER)
    dead = await collect(client, subjects.dead_letter(subject))
    tenant = f"t{uuid.uuid4().hex[:6]}"
    # The tag last: to find which command it is, the decoder must first skip the nested value.
    await client.nc.jetstream().publish(subject, b'{"x":' + NESTED + b',"kind":"stop"}')
    await until(lambda: _true(len(dead) == 1), 10, "the nested command dead-lettered")
    assert (dead[0].headers or {})["Loom-Error-Type"] == "DecodeError"
    await until(lambda: all_settled(client), 10, "every consumer settled")
    await client.submit(job("later", tenant))  # runs only if the agent still takes commands
    await until(lambda: _state(client, "later", "completed"), 20, "a later job run by the agent")


async def test_nested_samples_never_cost_network_perception_the_valid_ones(client: LoomClient) -> None:
    before = await health(client, "network-perception")
    dead = await collect(client, subjects.dead_letter(subjects.probe_sample(USE2, WEU)))
    js = client.nc.jetstream()
    now = time.time()
    for seq in range(3):
        sample = {"kind": "probe", "src": USE2, "dst": WEU, "probe": "udp_echo", "seq": seq, "sent_at": now}
        await js.publish(subjects.probe_sample(USE2, WEU), json.dumps({**sample, "rtt_ms": 80.0}).encode())
        if seq == 1:
            await js.publish(subjects.probe_sample(USE2, WEU), NESTED_UNDER_KEY)

    async def counted() -> dict[str, Any] | None:
        stats = await health(client, "network-perception")
        return stats if stats["accepted"] >= before["accepted"] + 3 else None

    after = await until(counted, 10, "the three valid samples accepted")
    assert after["refused"].get("undecodable", 0) == before["refused"].get("undecodable", 0) + 1
    assert dead == []


# -- fuzzing every consumed subject ------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=10),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3)
    ),
    max_leaves=20,
)
hostile = st.one_of(
    st.binary(min_size=1, max_size=200),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.integers(40, 30_000).map(
        lambda depth: b'{"kind":"completed","x":' + b"[" * depth + b"]" * depth + b"}"
    ),
    st.integers(40, 30_000).map(lambda depth: b"{" * depth),
    st.integers(40, 30_000).map(lambda depth: b'{"x":' + b"[" * depth + b"]" * depth + b',"kind":"stop"}'),
    st.just(b'{"kind":"stop","job_id":"a","job_id":"b"}'),
    st.just(b'{"kind":"submitted","job_id":"' + b"x" * 300_000 + b'"}'),
)


def hostile_payloads(count: int) -> list[bytes]:
    """Hostile payloads drawn by Hypothesis (bounded); the test publishes them."""
    drawn: list[bytes] = []

    @settings(
        max_examples=count,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(hostile)
    def draw(payload: bytes) -> None:
        drawn.append(payload)

    draw()
    return drawn


async def test_fuzzed_payloads_on_every_consumed_subject_leave_every_consumer_alive(
    client: LoomClient,
) -> None:
    tenant = f"t{uuid.uuid4().hex[:6]}"
    targets = [
        subjects.job_submitted(tenant),
        subjects.job_event("completed", tenant),
        subjects.job_event("started", tenant),
        subjects.cluster_heartbeat(CLUSTER),
        subjects.cluster_commands(CLUSTER),
        subjects.probe_sample(USE2, WEU),
    ]
    js = client.nc.jetstream()
    payloads = hostile_payloads(12)
    sent = 0
    for i, payload in enumerate(payloads):
        await client.submit(job(f"fuzz-{i}", tenant))  # a valid neighbour each time
        for subject in targets:
            try:
                await js.publish(subject, payload, headers={"Nats-Msg-Id": f"fuzz-{tenant}-{i}-{subject}"})
                sent += 1
            except Exception:  # a stream may refuse the oversized one outright: nothing to consume
                continue
    assert sent >= len(payloads) * len(targets) // 2
    jobs = [f"fuzz-{i}" for i in range(len(payloads))]
    # Polled gently: the services share this process's event loop with the test.
    await until(lambda: placed(client, jobs), 30, "every valid neighbour placed", interval_s=0.5)
    await until(lambda: all_settled(client), 20, "every consumer settled after the fuzzing")
    for name in ("metrics", "placement", f"agent-{CLUSTER}", "network-perception"):
        assert (await health(client, name))["status"] == "ok"
    await client.submit(job("canary", tenant))
    await until(lambda: _state(client, "canary", "completed"), 20, "a job run end to end after the fuzzing")


async def _clusters(client: LoomClient) -> bool:
    view = await client.view()
    return any(z["clusters"] for r in view["regions"].values() for z in r["zones"].values())


async def _state(client: LoomClient, job_id: str, wanted: str) -> bool:
    j = await client.job(job_id)
    return bool(j and j["state"] == wanted)


async def _true(value: bool) -> bool:
    return value
