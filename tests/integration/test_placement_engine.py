"""The placement engine through the real services on real NATS and PostgreSQL.

DAG stages in dependency order, gangs across clusters, preemption, start-confirmation expiry,
decision records for `loom explain`, and a standby taking over from the leader.
"""

import asyncio
import itertools
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import asyncpg
import pytest
from platform_helpers import Platform
from waiting import until

from loom.client import LoomClient
from loom.runtime.servers import NatsServer
from loom.sched.explain import render
from loom.sched.framework import DecisionRecord
from loom_proto.jobs import Affinity, JobSpec, Layer, Pipeline, Resources, Stage, Work


@pytest.fixture(scope="module")
def nats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with NatsServer(tmp_path_factory.mktemp("engine-nats")) as server:
        yield server.url


@pytest.fixture(scope="module")
async def platform(
    nats_url: str,
    fresh_database: Callable[..., Awaitable[str]],
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[Platform]:
    p = Platform(
        nats_url,
        await fresh_database("engine"),
        tmp_path_factory.mktemp("engine-agents"),
        placement={"confirm_timeout_s": 3.0, "lease_ttl_s": 1.0},
    )
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


@pytest.fixture
async def db(platform: Platform) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(platform.database_url)
    yield conn
    await conn.close()


def in_state(client: LoomClient, job_id: str, *wanted: str) -> Callable[[], Awaitable[Any]]:
    async def check() -> Any:
        job = await client.job(job_id)
        return job if job and job["state"] in wanted else None

    return check


def events_of(job: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [e["event"] for e in job["events"] if e["kind"] == kind]


async def test_dag_stages_run_in_dependency_order(client: LoomClient) -> None:
    short = Work(steps=20, step_time_s=20.0)
    await client.submit(
        JobSpec(
            job_id="dag1",
            tenant="t1",
            work=Work(steps=1),
            stages=[
                Stage(name="evaluate", depends_on=["train"], work=short, task_type="inference"),
                Stage(name="prep", work=short, resources=Resources(gpus=1, gpu_models=["T4"])),
                Stage(
                    name="train",
                    depends_on=["prep"],
                    work=short,
                    resources=Resources(gpus=4, gpu_models=["V100M32"]),
                ),
            ],
        )
    )
    parent = await until(in_state(client, "dag1", "completed"), 60, "dag1 completed")
    assert parent["state"] == "completed"
    prep = await client.job("dag1--prep")
    train = await client.job("dag1--train")
    evaluate = await client.job("dag1--evaluate")
    assert prep and train and evaluate
    assert {prep["state"], train["state"], evaluate["state"]} == {"completed"}
    # Each stage was placed only after the stage it depends on had completed.
    assert events_of(train, "placed")[0]["placed_at"] >= events_of(prep, "completed")[0]["at"]
    assert events_of(evaluate, "placed")[0]["placed_at"] >= events_of(train, "completed")[0]["at"]
    assert events_of(train, "placed")[0]["gpu_model"] == "V100M32"


async def test_a_cyclic_dag_is_rejected_at_once_and_stores_nothing(
    platform: Platform, client: LoomClient
) -> None:
    rejected: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    async def collect(msg: Any) -> None:
        rejected.put_nowait(json.loads(msg.data))

    sub = await client.nc.subscribe("loom.jobs.rejected.t1", cb=collect)
    try:
        await client.submit(
            JobSpec(
                job_id="cyc1",
                tenant="t1",
                work=Work(steps=1),
                stages=[
                    Stage(name="a", depends_on=["b"], work=Work(steps=1)),
                    Stage(name="b", depends_on=["a"], work=Work(steps=1)),
                ],
            )
        )
        event = await asyncio.wait_for(rejected.get(), 15)
    finally:
        await sub.unsubscribe()
    assert event["job_id"] == "cyc1"
    assert event["code"] == "cyclic"
    assert "cycle" in event["reason"]
    assert await client.job("cyc1") is None
    assert await client.job("cyc1--a") is None


async def test_loom_jobs_says_why_a_queued_job_waits(client: LoomClient) -> None:
    # The reason column was empty for queued jobs; only `loom explain` said why.
    await client.submit(
        JobSpec(
            job_id="waits-h100",
            tenant="t1",
            resources=Resources(gpus=1, gpu_models=["H100"]),
            work=Work(steps=1),
        )
    )

    async def listed() -> dict[str, Any] | None:
        rows = [j for j in await client.jobs(tenant="t1", limit=500) if j["job_id"] == "waits-h100"]
        return rows[0] if rows and rows[0]["reason"] else None

    row = await until(listed, 15, "waits-h100 listed with a reason")
    assert row["state"] == "queued" and "H100" in row["reason"], row
    assert (await client.job("waits-h100") or {})["reason"] == row["reason"]
    await client.cancel("waits-h100")


async def test_a_dag_with_a_stage_no_cluster_could_ever_hold_is_rejected_before_any_stage_runs(
    client: LoomClient,
) -> None:
    # Its first stage ran to completion, then the second was rejected and the DAG failed (a
    # newcomer's walk): what could be known at once is said at once, nothing run for it.
    await client.submit(
        JobSpec(
            job_id="dag-never",
            tenant="t1",
            work=Work(steps=1),
            stages=[
                Stage(name="a", work=Work(steps=20, step_time_s=20.0), resources=Resources(gpus=1)),
                Stage(name="b", depends_on=["a"], work=Work(steps=10), resources=Resources(gpus=32)),
            ],
        )
    )
    job = await until(in_state(client, "dag-never", "rejected"), 15, "dag-never rejected")
    (rejected,) = events_of(job, "rejected")
    assert rejected["code"] == "impossible", rejected
    assert rejected["reason"].startswith("stage b: ") and "can never fit" in rejected["reason"]
    assert "ask for at most" in rejected["hint"], rejected  # what to change, as for any job
    assert await client.job("dag-never--a") is None, "no stage was created, none ran"


async def test_a_gang_too_big_for_one_cluster_spans_two_and_frees_every_part(
    client: LoomClient, db: asyncpg.Connection
) -> None:
    # 5 workers x 4 V100s: c-use2-a holds 3 such workers (V100M32), c-sea1-a 2 (V100M16).
    await client.submit(
        JobSpec(
            job_id="gang-wide",
            tenant="t1",
            workers=5,
            allow_multi_cluster=True,
            resources=Resources(gpus=4, gpu_models=["V100M16", "V100M32"]),
            work=Work(steps=30, step_time_s=20.0),
        )
    )
    job = await until(in_state(client, "gang-wide", "completed"), 60, "gang-wide completed")
    placed = events_of(job, "placed")[0]
    assert {p["cluster"] for p in placed["parts"]} == {"c-use2-a", "c-sea1-a"}
    assert sum(a["gpus"] for p in placed["parts"] for a in p["allocations"]) == 20
    assert placed["workers"] == 5

    async def all_free() -> bool:
        rows = await db.fetch(
            "SELECT gpus_reserved FROM node_allocations WHERE cluster IN ('c-use2-a', 'c-sea1-a')"
        )
        held = await db.fetchval(
            "SELECT count(*) FROM reservations WHERE job_id = 'gang-wide' AND state <> 'released'"
        )
        return all(r["gpus_reserved"] == 0 for r in rows) and held == 0

    await until(all_free, 20, "every part's GPUs given back")

    async def member_stopped() -> bool:
        view = await client.view(region="gcp-asia-southeast1", nodes=True)
        nodes = [
            n
            for r in view["regions"].values()
            for z in r["zones"].values()
            for c in z["clusters"].values()
            for n in (c["nodes"].values() if isinstance(c["nodes"], dict) else c["nodes"])
        ]
        return bool(nodes) and all(n["gpus_used"] == 0 for n in nodes)

    await until(member_stopped, 20, "the member part on c-sea1-a stopped")


async def test_every_decision_is_explained(client: LoomClient) -> None:
    await client.submit(
        JobSpec(
            job_id="explained", tenant="t1", resources=Resources(gpus=2), work=Work(steps=5, step_time_s=5.0)
        )
    )
    await until(in_state(client, "explained", "running", "completed"), 30, "explained placed")
    answer = await client.explain("explained")
    decisions = answer["decisions"]
    assert [d["outcome"] for d in decisions] == ["placed"]
    record = DecisionRecord.from_dict(decisions[0]["record"])
    assert record.chosen and record.chosen[0] == answer["job"]["cluster"]
    assert len(record.candidates) >= 2
    plugins = set(record.candidates[0].scores)
    assert {"scu_fit", "water_level"} <= plugins
    for cand in record.candidates:
        assert all(0.0 <= s <= 100.0 for s in cand.scores.values())
    lines = render(record)
    assert lines[0].startswith("Job explained: placed")
    assert any(line.startswith("Why not ") for line in lines)


async def test_a_start_nobody_confirms_expires_and_the_job_goes_elsewhere(
    platform: Platform, client: LoomClient
) -> None:
    await platform.stop("agent-c-weu-a")
    try:
        await client.submit(
            JobSpec(
                job_id="orphan",
                tenant="t1",
                resources=Resources(gpus=1, gpu_models=["T4"]),
                affinity=Affinity(clusters=["c-weu-a", "c-sea1-a"], prefer_regions=["azure-westeurope"]),
                work=Work(steps=10, step_time_s=5.0),
            )
        )
        job = await until(in_state(client, "orphan", "completed"), 60, "orphan completed")
    finally:
        await platform.start("agent-c-weu-a")
    placed = events_of(job, "placed")
    assert placed[-1]["cluster"] == "c-sea1-a"
    if placed[0]["cluster"] == "c-weu-a":
        # The first placement went to the silent cluster: it expired and was requeued, avoiding it.
        requeued = events_of(job, "requeued")
        assert requeued and requeued[0]["cause"] == "start_timeout"
        assert "c-weu-a" in requeued[0]["avoid_clusters"]
        assert placed[-1]["attempt"] == 2
    assert job["attempt"] == len(placed)


async def test_an_elastic_job_grows_into_freed_gpus_and_shrinks_under_pressure(client: LoomClient) -> None:
    weu_t4 = {"gpu_models": ["T4"]}
    here = Affinity(clusters=["c-weu-a"])
    await client.submit(
        JobSpec(
            job_id="blocker",
            tenant="t1",
            workers=2,
            resources=Resources(gpus=2, **weu_t4),
            affinity=here,
            work=Work(steps=300, step_time_s=20.0),
        )
    )
    await until(in_state(client, "blocker", "running"), 30, "blocker running")
    await client.submit(
        JobSpec(
            job_id="elastic",
            tenant="t1",
            workers=10,
            min_workers=2,
            resources=Resources(gpus=1, **weu_t4),
            affinity=here,
            work=Work(steps=1500, step_time_s=20.0),
        )
    )
    job = await until(in_state(client, "elastic", "running"), 30, "elastic running")
    assert events_of(job, "placed")[0]["workers"] == 6  # 10 T4s on c-weu-a, 4 held by the blocker

    async def grown() -> Any:
        j = await client.job("elastic")
        return j if j and any(e["workers"] == 10 for e in events_of(j, "resized")) else None

    job = await until(grown, 40, "elastic grown to 10 workers once the blocker finished")
    assert (await client.job("blocker") or {})["state"] == "completed"
    await client.submit(
        JobSpec(
            job_id="pressing",
            tenant="t1",
            resources=Resources(gpus=2, **weu_t4),
            affinity=here,
            work=Work(steps=10, step_time_s=5.0),
        )
    )
    await until(in_state(client, "pressing", "running", "completed"), 30, "pressing placed")
    job = await client.job("elastic")
    assert job is not None and job["state"] in ("running", "completed")
    resized = events_of(job, "resized")
    shrinks = [i for i, e in enumerate(resized) if e["workers"] == 8 and "pressing" in e["reason"]]
    assert shrinks, resized
    # "pressing" runs for seconds in the stack's time: the job may already have grown back once it
    # ended; any resize after the shrink is that growth, never a further shrink.
    after = resized[shrinks[-1] + 1 :]
    assert all(e["workers"] > 8 for e in after), resized
    if after:
        assert (await client.job("pressing") or {})["state"] == "completed"
    assert not events_of(job, "requeued")  # shrunk, never stopped


async def test_a_model_no_cluster_can_hold_runs_as_a_pipeline_over_two(client: LoomClient) -> None:
    # 12 layers x 100 GiB: c-use2-a's 32 G2 (40 GiB each, 36 usable) hold 1,152 GiB, not 1,200.
    layers = [Layer(compute_s=0.5, memory_gib=100.0, activation_mb=20.0) for _ in range(12)]
    await client.submit(
        JobSpec(
            job_id="llm-pipe",
            tenant="t1",
            pipeline=Pipeline(layers=layers, max_stages=3),
            work=Work(steps=20, step_time_s=6.0),
        )
    )
    job = await until(in_state(client, "llm-pipe", "completed"), 60, "llm-pipe completed")
    placed = events_of(job, "placed")[0]
    parts = placed["parts"]
    assert len(parts) >= 2
    spans = sorted(tuple(p["layers"]) for p in parts)
    assert spans[0][0] == 0 and spans[-1][1] == 11
    assert all(a[1] + 1 == b[0] for a, b in itertools.pairwise(spans))
    assert placed["predicted_step_s"] > 0
    explained = await client.explain("llm-pipe")
    notes = DecisionRecord.from_dict(explained["decisions"][0]["record"]).notes
    assert any("the model fits no single cluster" in n for n in notes)


async def test_a_higher_priority_job_preempts_the_cheapest_victim(client: LoomClient) -> None:
    g2 = Resources(gpus=8, gpu_models=["G2"])
    long = Work(steps=1_000_000, step_time_s=10.0, checkpoint_every_steps=100)
    for i, prio in enumerate((10, 20, 30, 40)):
        await client.submit(JobSpec(job_id=f"low-{i}", tenant="t2", priority=prio, resources=g2, work=long))
    for i in range(4):
        await until(in_state(client, f"low-{i}", "running"), 30, f"low-{i} running")

    async def checkpointed() -> int | None:
        job = await client.job("low-0")
        steps = [e["step"] for e in events_of(job, "checkpointed")] if job else []
        return max(steps) if steps else None

    saved = await until(checkpointed, 30, "low-0 to record a checkpoint")
    await client.submit(
        JobSpec(
            job_id="urgent", tenant="t1", priority=900, resources=g2, work=Work(steps=10, step_time_s=5.0)
        )
    )
    urgent = await until(in_state(client, "urgent", "running", "completed"), 30, "urgent placed")
    victim = await until(in_state(client, "low-0", "queued", "placed", "running"), 10, "victim known")
    history = await client.job("low-0")
    assert history is not None
    requeued = events_of(history, "requeued")
    # Another tenant's job: named as such, not by id (its id told t2 what t1 runs).
    assert requeued and requeued[0]["cause"] == "preempted"
    reason = requeued[0]["reason"]
    assert reason.startswith("preempted by a job of another tenant; resumes from its checkpoint at step ")
    # From its newest checkpoint (it restarted from step 0): at or after the one seen before.
    resumed = int(reason.split("at step ")[1].split()[0])
    assert resumed >= saved > 0
    assert victim is not None
    for i in (1, 2, 3):
        # Only preemption is in question: this module's 3 s start-confirmation timeout can requeue a
        # start a loaded host confirms late ("start_timeout"), which says nothing of the victim.
        other = await client.job(f"low-{i}")
        preempted = [e for e in events_of(other, "requeued") if e["cause"] == "preempted"] if other else []
        assert other and not preempted, f"low-{i} should not have been preempted: {preempted}"
    assert events_of(urgent, "placed")[0]["cluster"] == "c-use2-a"
    explained = await client.explain("urgent")
    assert DecisionRecord.from_dict(explained["decisions"][-1]["record"]).victims == [
        "1 job(s) of other tenants"
    ]


async def test_a_standby_takes_over_when_the_leader_stops(platform: Platform, client: LoomClient) -> None:
    await platform.start("placement-b")
    await platform.stop("placement")
    await client.submit(
        JobSpec(job_id="after-handover", tenant="t1", resources=Resources(gpus=1), work=Work(steps=5))
    )
    job = await until(in_state(client, "after-handover", "completed"), 30, "placed by the new leader")
    assert len(events_of(job, "placed")) == 1


async def test_a_new_leader_counts_running_jobs_once(platform: Platform, client: LoomClient) -> None:
    # c-sea1-a has V100M16 nodes of 4, 4 and 1 GPUs. Long jobs hold 4 and 2 of them; after a
    # change of leader (the new one rebuilds its book from PostgreSQL) a 2-GPU job must still
    # fit beside the second one. Counting the running jobs twice would leave no node with 2 free.
    here = Affinity(clusters=["c-sea1-a"])
    long = Work(steps=10**6, step_time_s=10.0)
    for job_id, gpus in (("holder-4", 4), ("holder-2", 2)):
        await client.submit(
            JobSpec(
                job_id=job_id,
                tenant="t1",
                resources=Resources(gpus=gpus, gpu_models=["V100M16"]),
                affinity=here,
                work=long,
            )
        )
        await until(in_state(client, job_id, "running"), 30, f"{job_id} running")
    await platform.start("placement-c")
    await platform.stop("placement-b")
    await client.submit(
        JobSpec(
            job_id="second",
            tenant="t1",
            resources=Resources(gpus=2, gpu_models=["V100M16"]),
            affinity=here,
            work=Work(steps=5, step_time_s=5.0),
        )
    )
    job = await until(
        in_state(client, "second", "running", "completed"), 30, "second placed beside the holders"
    )
    assert events_of(job, "placed")[0]["cluster"] == "c-sea1-a"


async def test_a_dag_whose_waiting_stage_is_cancelled_ends_with_it(client: LoomClient) -> None:
    # Before, cancelling a queued stage left its DAG "running" for ever (only a run's end, or a
    # parent's completion, settled a DAG). B200s are known to Loom but on no cluster: it waits.
    await client.submit(
        JobSpec(
            job_id="dagq",
            tenant="t1",
            work=Work(steps=1),
            stages=[
                Stage(name="only", work=Work(steps=5), resources=Resources(gpus=1, gpu_models=["B200"])),
                Stage(name="after", depends_on=["only"], work=Work(steps=5)),
            ],
        )
    )
    await until(in_state(client, "dagq--only", "queued", "waiting"), 30, "the stage queued")
    assert await client.cancel("dagq--only") == "cancelled"
    parent = await until(in_state(client, "dagq", "failed", "cancelled"), 15, "the DAG ended")
    after = await client.job("dagq--after")
    assert after is None or after["state"] in ("cancelled", "failed"), after
    assert parent["state"] in ("failed", "cancelled")
