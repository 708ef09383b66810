"""Cancelling jobs on real NATS and PostgreSQL: a queued job leaves the queue and is never placed;
a running one is stopped on its cluster (its attempt fenced), gives its GPUs back and is not
placed again; a finished one stays as it ended.

Before, a ``cancelled`` event was only recorded: the agent kept running the job while the view
showed its GPUs free, and a queued job could still be placed.
"""

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import asyncpg
import pytest
from platform_helpers import Platform
from waiting import until

from loom.client import LoomClient, QueryError
from loom_proto import subjects
from loom_proto.jobs import JobCancelled, JobSpec, Resources, Work
from loom_services.cluster_agent.agent import Agent

CLUSTER = "c-weu-a"


@pytest.fixture(scope="module")
def nats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from loom.runtime.servers import NatsServer

    with NatsServer(tmp_path_factory.mktemp("cancel-nats")) as server:
        yield server.url


@pytest.fixture
async def platform(
    nats_url: str, fresh_database: Callable[..., Awaitable[str]], tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Platform]:
    p = Platform(nats_url, await fresh_database("cancel"), tmp_path_factory.mktemp("agents"))
    yield p
    for name in list(p.tasks):
        await p.stop(name)


def _spec(job_id: str, gpus: int) -> JobSpec:
    # 100 steps of 200 s each at the agents' 2000x time scale: about 10 s of running.
    return JobSpec(
        job_id=job_id,
        tenant="t1",
        resources=Resources(gpus=gpus, gpu_models=["T4"]),
        work=Work(steps=100, step_time_s=200.0, checkpoint_every_steps=10),
    )


async def test_cancel_stops_a_running_job_frees_its_gpus_and_drops_a_queued_one(platform: Platform) -> None:
    await platform.start("metrics")
    await platform.start("placement")
    client = await LoomClient.connect(platform.nats_url)
    db = await asyncpg.connect(platform.database_url)
    try:
        # No cluster yet: the first job waits in the queue.
        await client.submit(_spec("cx-queued", 1))
        await until(lambda: _state(client, "cx-queued", "queued"), 10, "cx-queued queued")
        assert await client.cancel("cx-queued", reason="not needed") == "cancelled"

        agent: Agent = await platform.start(f"agent-{CLUSTER}")
        await client.submit(_spec("cx-run", 2))

        async def running() -> dict[str, Any] | None:
            job = await client.job("cx-run")
            return job if job and job["state"] == "running" else None

        await until(running, 30, "cx-run running")
        assert await client.cancel_outcome("cx-run", reason="wrong data") == ("cancelled", False)

        async def stopped() -> bool:
            return "cx-run:1" in agent.finished and "cx-run:1" not in agent.running

        await until(stopped, 10, "the agent to stop cx-run")
        reserved = await db.fetchval("SELECT COALESCE(sum(gpus_reserved), 0) FROM node_allocations")
        assert reserved == 0
        # Neither is placed (again) afterwards, though the cluster has room for both.
        await asyncio.sleep(2.0)
        run_job, queued_job = await client.job("cx-run"), await client.job("cx-queued")
        assert run_job is not None and queued_job is not None
        assert (run_job["state"], run_job["attempt"]) == ("cancelled", 1)
        assert queued_job["state"] == "cancelled" and queued_job["cluster"] is None
        assert [e["kind"] for e in run_job["events"]].count("placed") == 1
        assert "placed" not in [e["kind"] for e in queued_job["events"]]
        assert not agent.running
        # A cancelled job stays cancelled; an unknown one is an error.
        assert await client.cancel("cx-run") == "cancelled"
        assert await client.cancel_outcome("cx-run") == ("cancelled", True)  # `loom cancel`: "already"
        with pytest.raises(QueryError, match="no job"):
            await client.cancel("cx-nowhere")
        # A raw client's cancellation of a job that had ended: acknowledged, not written into its
        # history (a "cancelled" row after the end read as though it took effect).
        before = [e["kind"] for e in (await client.job("cx-run") or {})["events"]]
        requests = subjects.job_event("cancelled", "t1")
        dead = await client.nc.subscribe(subjects.dead_letter(requests))
        for job_id, msg_id in (("cx-run", "cx-run-late"), ("cx-nowhere", "cx-nowhere-1")):
            event = JobCancelled(job_id=job_id, tenant="t1", reason="too late", at=time.time())
            await client.publisher.publish(requests, event, msg_id=msg_id)
        # The second, of no job, is dead-lettered after the first was handled (one consumer, in order).
        letter = await dead.next_msg(timeout=15)
        assert (letter.headers or {}).get("Nats-Msg-Id", "").startswith(
            "dlq-"
        ) and b"cx-nowhere" in letter.data
        after = [e["kind"] for e in (await client.job("cx-run") or {})["events"]]
        assert after == before and (await client.job("cx-run") or {})["state"] == "cancelled"
    finally:
        await db.close()
        await client.close()


async def _state(client: LoomClient, job_id: str, wanted: str) -> bool:
    job = await client.job(job_id)
    return bool(job and job["state"] == wanted)


async def test_a_cancellation_of_another_tenants_job_changes_nothing_and_is_dead_lettered(
    platform: Platform,
) -> None:
    # A tenant publishes cancellations on its own subject (its credentials allow that one): one
    # naming another tenant's job, or another tenant than its subject, must stop nothing. Before,
    # placement cancelled any job a cancellation named.
    import time

    from loom.bus import Publisher
    from loom.bus.dlq import DeadLetters
    from loom_proto import subjects
    from loom_proto.jobs import JobCancelled

    await platform.start("metrics")
    await platform.start("placement")
    # Not CLUSTER: this module's tests share one NATS server and each has a fresh database, so
    # the view deltas of the cluster another test used (ids by ledger version) would be dropped
    # by JetStream as duplicates of that test's within its 2-minute window.
    await platform.start("agent-c-sea1-a")
    client = await LoomClient.connect(platform.nats_url)
    try:
        await client.submit(_spec("cx-t1", 1))
        await client.submit(_spec("cx-t1b", 1))
        await until(lambda: _state(client, "cx-t1", "running"), 30, "cx-t1 running")
        await until(lambda: _state(client, "cx-t1b", "running"), 30, "cx-t1b running")
        attempt = (await client.job("cx-t1") or {})["attempt"]
        publisher = Publisher(client.nc)
        forged = [
            ("t2", JobCancelled(job_id="cx-t1", tenant="t2", reason="not mine", at=time.time())),
            ("t2", JobCancelled(job_id="cx-t1", tenant="t1", reason="not my subject", at=time.time())),
            # A job nobody submitted yet: stored, it would land in the history of whoever does.
            ("t2", JobCancelled(job_id="cx-later", tenant="t2", reason="ahead of time", at=time.time())),
        ]
        for i, (subject_tenant, event) in enumerate(forged):
            await publisher.publish(
                subjects.job_event("cancelled", subject_tenant), event, msg_id=f"forged-{i}"
            )
        # The message id the SDK's cancellation of cx-t1 once had, taken first: JetStream's
        # duplicate window would drop the owner's real cancellation (before, ids were predictable).
        squat = JobCancelled(job_id="cx-t1", tenant="t2", reason="squatting", at=time.time())
        await publisher.publish(
            subjects.job_event("cancelled", "t2"), squat, msg_id=f"cx-t1:cancelled:{attempt}"
        )
        dlq = DeadLetters(client.nc)

        async def refused() -> list[str] | None:
            letters = await dlq.entries(subject=subjects.job_event("cancelled", "t2"))
            mine = [x.error or "" for x in letters if x.consumer == "placement-cancelled"]
            return mine if len(mine) == 4 else None

        errors = await until(refused, 15, "the forged cancellations dead-lettered by placement")
        assert any("may not cancel job cx-t1: it is another tenant's" in e for e in errors), errors
        assert any("names tenant 't1'" in e for e in errors), errors
        assert any("no job cx-later to cancel" in e for e in errors), errors
        job = await client.job("cx-t1")
        assert job is not None and job["state"] == "running"
        assert "cancelled" not in [e["kind"] for e in job["events"]]
        # The job's own tenant cancels it with the SDK, whatever ids were taken before.
        assert await client.cancel("cx-t1") == "cancelled"
        # A cancellation's time recorded is the server's, not the one claimed (an early `at` would
        # have ended the run, and its metering, back then).
        began = time.time()
        claimed = JobCancelled(job_id="cx-t1b", tenant="t1", reason="mine", at=began - 3600.0)
        await publisher.publish(subjects.job_event("cancelled", "t1"), claimed, msg_id="own-cancel")
        await until(lambda: _state(client, "cx-t1b", "cancelled"), 15, "cx-t1b cancelled")
        done = await client.job("cx-t1b")
        assert done is not None
        (cancelled,) = [e for e in done["events"] if e["kind"] == "cancelled"]
        assert cancelled["at"] >= began - 5.0 and cancelled["event"]["at"] >= began - 5.0
    finally:
        await client.close()


async def test_a_submission_id_another_tenant_took_first_does_not_drop_the_owners_job(
    platform: Platform,
) -> None:
    # JetStream drops a message whose id it saw within two minutes, whoever sent it. The SDK used
    # the job id as the message id, so another tenant publishing its own submission under that id
    # first made the owner's `loom submit` answer "already submitted" while no job existed (a
    # newcomer's walk); beyond the window, placement's inbox (ids claimed across tenants) dropped it
    # for good. Now the SDK's id has a random part and placement claims ids within their tenant.
    from loom.bus import Publisher
    from loom_proto import subjects
    from loom_proto.jobs import JobSubmitted

    await platform.start("placement")
    client = await LoomClient.connect(platform.nats_url)
    try:
        publisher = Publisher(client.nc)
        squat = JobSubmitted(job_id="sq-other", tenant="t2", work=Work(steps=1))
        ack = await publisher.publish(subjects.job_submitted("t2"), squat, msg_id="sq-victim")
        assert not ack.duplicate
        await until(lambda: _state(client, "sq-other", "queued"), 15, "t2's own job queued")
        admission = await client.submit_checked(_spec("sq-victim", 1), wait_s=10.0)
        assert admission.outcome == "accepted", admission
        job = await client.job("sq-victim")
        assert job is not None and job["tenant"] == "t1"
        # The same spec submitted twice at once (two `loom submit` of one file): each message has
        # its own id, so placement admits one and refuses the other as a duplicate; the refused
        # one's submitter is told the job exists ("already submitted"), not "rejected".
        both = await asyncio.gather(
            client.submit_checked(_spec("sq-twice", 1), wait_s=10.0),
            client.submit_checked(_spec("sq-twice", 1), wait_s=10.0),
        )
        assert {a.outcome for a in both} <= {"accepted", "duplicate"}, both
        # Past JetStream's window, placement's own memory of message ids (its inbox) is what drops
        # a message again: it keeps a tenant's ids within its tenant, so t2's "sq-victim" is
        # t2's alone and cannot stand for t1's message under the same id (it was kept bare).
        db = await asyncpg.connect(platform.database_url)
        try:
            claimed = await db.fetchval("SELECT count(*) FROM inbox WHERE msg_id = 'sq-victim@t2'")
            bare = await db.fetchval("SELECT count(*) FROM inbox WHERE msg_id = 'sq-victim'")
        finally:
            await db.close()
        assert (claimed, bare) == (1, 0)
        # A submission it cannot decode is refused naming the job id in its payload (the SDK's
        # message id is not the job id, and the submitter waits for its job id's rejection).
        rejected = await client.nc.subscribe(subjects.job_event("rejected", "t1"))
        body = b'{"job_id": "sq-bad", "tenant": "t1", "work": {"steps": "many"}}'
        await client.nc.jetstream().publish(
            subjects.job_submitted("t1"), body, headers={"Nats-Msg-Id": "sq-bad:0123abcd"}
        )
        msg = await rejected.next_msg(timeout=10)
        event = json.loads(msg.data)
        assert (event["job_id"], event["code"]) == ("sq-bad", "invalid"), event
        # A NUL character decodes, but no text column can store it: the insert failed, the batch
        # went one by one, the message was dead-lettered and the submitter never answered.
        body = b'{"job_id": "sq-nul", "tenant": "t1", "work": {"steps": 1}, "name": "a\\u0000b"}'
        await client.nc.jetstream().publish(
            subjects.job_submitted("t1"), body, headers={"Nats-Msg-Id": "sq-nul"}
        )
        event = json.loads((await rejected.next_msg(timeout=10)).data)
        assert (event["job_id"], event["code"]) == ("sq-nul", "invalid"), event
        assert "$.name holds a NUL character" in event["reason"]
        assert await client.job("sq-nul") is None
    finally:
        await client.close()


async def test_a_submission_claimed_under_its_bare_id_before_the_scoping_is_not_handled_again(
    platform: Platform,
) -> None:
    # Claims were bare message ids before they were kept within their tenant: a message claimed so
    # and delivered again after the upgrade has a new scoped id, but was done (a review's finding).
    from loom_proto import subjects

    await platform.start("placement")
    client = await LoomClient.connect(platform.nats_url)
    try:
        # A message claimed before ids were scoped (a bare row) and delivered again after the
        # upgrade is not handled twice: its scoped id is new, its bare one was done.
        db = await asyncpg.connect(platform.database_url)
        try:
            await db.execute("INSERT INTO inbox (consumer, msg_id) VALUES ('placement', 'sq-legacy')")
        finally:
            await db.close()
        js = client.nc.jetstream()
        for job_id, msg_id in (("sq-legacy-job", "sq-legacy"), ("sq-after-legacy", "sq-after")):
            body = f'{{"job_id": "{job_id}", "tenant": "t1", "work": {{"steps": 1}}}}'.encode()
            await js.publish(subjects.job_submitted("t1"), body, headers={"Nats-Msg-Id": msg_id})
        await until(lambda: _state(client, "sq-after-legacy", "queued"), 15, "the job sent after it")
        assert await client.job("sq-legacy-job") is None
    finally:
        await client.close()
