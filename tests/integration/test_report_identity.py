"""An agent's credentials cannot report another cluster's job (issue 18), on a secured nats-server
with placement, metrics and the agent that runs the job, each connected as its own identity (so
their narrowed permissions, JetStream API included, are enough to place and run a job).

nats-server lets an agent publish its reports only on subjects naming its own cluster
(``loom.jobs.<kind>.<tenant>.<cluster>``); placement records a report only when that cluster
holds a part of the attempt's run. Before, a completion on ``loom.jobs.completed.<tenant>``
from any agent's credentials was recorded: the job finished and its GPUs were released while
its own agent kept running it.
"""

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import msgspec
import nats
import pytest
from nats.aio.client import Client
from platform_helpers import Platform
from waiting import until

from loom.bus.connection import remember_credentials
from loom.client import LoomClient
from loom.runtime.servers import NatsServer
from loom.security import ENV_CREDS, CredentialStore, Identity, admin_identity, read, tenant_identity
from loom_proto import subjects
from loom_proto.jobs import JobCompleted, JobSpec, Resources, Work

pytestmark = pytest.mark.security

RUNS_ON = "c-weu-a"  # the only cluster with T4s in the small topology
FORGER = "c-sea1-a"
TENANT = "t1"
JOB_ID = "ri-long"
SERVICES = {
    "metrics": Identity("metrics"),
    "placement": Identity("placement"),
    f"agent-{RUNS_ON}": Identity("agent", RUNS_ON),
}
IDENTITIES = [admin_identity(), *SERVICES.values(), Identity("agent", FORGER), tenant_identity(TENANT)]


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[NatsServer, CredentialStore]]:
    home = tmp_path_factory.mktemp("report-identity")
    store = CredentialStore(home)
    store.ensure_all(IDENTITIES)
    with NatsServer(home / "nats", authorization=store.auth_path) as server:
        # The test itself (its client) connects as the operator; each service as its own role.
        remember_credentials(server.url, store.path(admin_identity()))
        yield server, store


@pytest.fixture
async def platform(
    secured: tuple[NatsServer, CredentialStore],
    fresh_database: Callable[..., Awaitable[str]],
    tmp_path: Path,
) -> AsyncIterator[Platform]:
    server, store = secured
    (tmp_path / "agents").mkdir()
    p = Platform(server.url, await fresh_database("report_identity"), tmp_path / "agents")
    p.creds = {name: store.path(identity) for name, identity in SERVICES.items()}
    yield p
    for name in list(p.tasks):
        await p.stop(name)


async def _connect_as(
    server: NatsServer, store: CredentialStore, identity: Identity
) -> tuple[Client, list[str]]:
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    credential = read(store.path(identity))
    nc = await nats.connect(
        server.url,
        nkeys_seed_str=credential.seed,
        inbox_prefix=f"_INBOX.{credential.identity}",
        error_cb=on_error,
        allow_reconnect=False,
    )
    return nc, errors


async def test_another_clusters_agent_cannot_report_a_job(
    secured: tuple[NatsServer, CredentialStore], platform: Platform, monkeypatch: pytest.MonkeyPatch
) -> None:
    server, store = secured
    await platform.start("metrics")
    await platform.start("placement")
    await platform.start(f"agent-{RUNS_ON}")
    client = await LoomClient.connect(server.url)
    with monkeypatch.context() as patch:
        patch.setenv(ENV_CREDS, str(store.path(tenant_identity(TENANT))))
        tenant = await LoomClient.connect(server.url, name="tenant")
    # The tenant watches its own events: the agent's reports (the cluster as a fifth token) too.
    seen: list[str] = []

    async def watch() -> None:
        async for subject, event in tenant.watch(TENANT):
            if event.job_id == JOB_ID:
                seen.append(subject)

    watcher = asyncio.create_task(watch())
    forger, errors = await _connect_as(server, store, Identity("agent", FORGER))
    db = await asyncpg.connect(platform.database_url)
    try:
        job_id = JOB_ID
        # 1000 steps of 200 s at the agents' 2000x time scale: about 100 s, longer than the test.
        await client.submit(
            JobSpec(
                job_id=job_id,
                tenant=TENANT,
                resources=Resources(gpus=2, gpu_models=["T4"]),
                work=Work(steps=1000, step_time_s=200.0, checkpoint_every_steps=100),
            )
        )

        async def running() -> dict[str, Any] | None:
            job = await client.job(job_id)
            return job if job and job["state"] == "running" else None

        job = await until(running, 30, f"{job_id} running")
        assert job["cluster"] == RUNS_ON
        started = subjects.job_report("started", TENANT, RUNS_ON)

        async def reported() -> bool:
            return started in seen

        await until(reported, 10, "the tenant's watch to see its job's started report")
        assert subjects.job_placed(TENANT) in seen
        dead = await client.nc.subscribe(
            subjects.dead_letter(subjects.job_report("completed", TENANT, FORGER))
        )

        # nats-server: neither the job's own cluster's subject nor the cluster-less one.
        for forged_subject in (
            subjects.job_report("completed", TENANT, RUNS_ON),
            subjects.job_event("completed", TENANT),
        ):
            errors.clear()
            await forger.publish(forged_subject, b"{}")
            await until(lambda: _violation(errors), 5, f"a permissions violation for {forged_subject}")

        # The consumer: on its own subject, about the job running on another cluster.
        for named in (FORGER, RUNS_ON):
            reason = await _report_refused(forger, dead, named)
            assert FORGER in reason and (named == RUNS_ON or "no part" in reason), reason

        # State unchanged: still running on its cluster, its GPUs still held, nothing recorded.
        job = await client.job(job_id)
        assert job is not None and job["state"] == "running" and job["cluster"] == RUNS_ON
        held = await db.fetchval(
            "SELECT count(*) FROM reservations WHERE job_id = $1 AND state <> 'released'", job_id
        )
        assert held > 0
        recorded = await db.fetchval(
            "SELECT count(*) FROM job_events WHERE job_id = $1 AND kind = 'completed'", job_id
        )
        assert recorded == 0
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        await db.close()
        await forger.close()
        await tenant.close()
        await client.close()


async def _report_refused(forger: Client, dead: Any, named: str) -> str:
    """Publish, as the forger's agent on its own report subject, a completion of the job naming
    ``named`` as its cluster; return the reason of the dead letter placement made of it."""
    forged = JobCompleted(job_id=JOB_ID, tenant=TENANT, cluster=named, attempt=1, gpu_seconds=1.0, at=1.0)
    ack = await forger.jetstream().publish(
        subjects.job_report("completed", TENANT, FORGER),
        msgspec.json.encode(forged),
        headers={"Nats-Msg-Id": f"forged-{named}"},
    )
    assert ack.stream == "JOBS", "the agent may publish on its own report subject"
    letter = await dead.next_msg(timeout=15)
    assert letter.headers is not None
    assert "InvalidInputError" in letter.headers.get("Loom-Error-Type", "")
    return str(letter.headers.get("Loom-Error", ""))


async def _violation(errors: list[str]) -> bool:
    await asyncio.sleep(0)
    return any("permissions violation" in e.lower() for e in errors)
