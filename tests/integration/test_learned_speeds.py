"""Learned speeds through the real services on real NATS and PostgreSQL.

One cluster's T4s run jobs of the ``gru-speech`` family at a third of their profile (the sim
agent's ``true_speed`` knob); placement, which only knows the profile, must learn it from the
runs' reported step times, keep it across a restart, and show it in ``loom explain``.
"""

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import asyncpg
import msgspec
import pytest
from platform_helpers import Platform
from waiting import until

from loom.client import LoomClient, QueryError
from loom.model.learn import SpeedLearner
from loom.runtime.servers import NatsServer
from loom.sched.explain import render
from loom.sched.framework import DecisionRecord
from loom.sched.probe import PROBE_LABEL, probe_id
from loom.store import speeds
from loom_proto.jobs import JobSpec, Resources, Work

FAMILY = "gru-speech"
GPU = "T4"
TRUE_FACTOR = 1 / 3
RUNS = 10
SERVICES: dict[str, Any] = {}
"""The module's running services by name (the placement service's book is read by a test)."""


@pytest.fixture(scope="module")
def nats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with NatsServer(tmp_path_factory.mktemp("learn-nats")) as server:
        yield server.url


@pytest.fixture(scope="module")
async def platform(
    nats_url: str,
    fresh_database: Callable[..., Awaitable[str]],
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[Platform]:
    p = Platform(nats_url, await fresh_database("learn"), tmp_path_factory.mktemp("learn-agents"))
    await p.start("metrics")
    SERVICES["placement"] = await p.start("placement")
    SERVICES["agent"] = await p.start("agent-c-sea1-a", true_speed={(FAMILY, GPU): TRUE_FACTOR})
    yield p
    for name in list(p.tasks):
        await p.stop(name)


@pytest.fixture
async def client(platform: Platform) -> AsyncIterator[LoomClient]:
    c = await LoomClient.connect(platform.nats_url)
    yield c
    await c.close()


def completed(client: LoomClient, job_id: str) -> Callable[[], Awaitable[Any]]:
    async def check() -> Any:
        job = await client.job(job_id)
        return job if job and job["state"] == "completed" else None

    return check


def t4_job(job_id: str, labels: dict[str, str], *, steps: int, step_time_s: float) -> JobSpec:
    """A one-GPU ``training_memory`` job of tenant t1 that may run only on the T4s."""
    return JobSpec(
        job_id=job_id,
        tenant="t1",
        task_type="training_memory",
        labels=labels,
        resources=Resources(gpus=1, gpu_models=[GPU]),
        work=Work(steps=steps, step_time_s=step_time_s),
    )


async def learned(client: LoomClient) -> dict[str, Any] | None:
    rows = await client.learned_speeds()
    return next((r for r in rows if r["family"] == FAMILY and r["gpu_model"] == GPU), None)


async def test_a_gpu_three_times_slower_than_its_profile_is_learned_within_ten_runs_and_kept(
    platform: Platform, client: LoomClient
) -> None:
    factors: list[float] = []
    for n in range(RUNS):
        job_id = f"gru-{n}"
        await client.submit(t4_job(job_id, {"model": "GRU speech"}, steps=60, step_time_s=1.0))
        await until(completed(client, job_id), 60, f"{job_id} completed")

        async def taught(runs: int = n + 1) -> dict[str, Any] | None:
            row = await learned(client)
            return row if row is not None and row["runs"] == runs else None

        row = await until(taught, 15, f"run {n + 1} learned")
        factors.append(row["factor"])
    print("learned factor after each run:", [round(f, 4) for f in factors])
    assert abs(factors[-1] / TRUE_FACTOR - 1) <= 0.15
    first_within = next(i for i, f in enumerate(factors) if abs(f / TRUE_FACTOR - 1) <= 0.15) + 1
    assert first_within <= RUNS
    final = await learned(client)
    assert final is not None
    assert final["source"] == "own"
    assert final["log_sd"] < 0.05
    # Ten runs of one network on one GPU agree: comparative advantage may act on the cell.
    assert final["spread"] is not None and final["spread"] < 0.2 and final["steady"] is True

    # The last run was placed with what the first nine taught, and its explanation says so.
    answer = await client.explain(f"gru-{RUNS - 1}")
    record = DecisionRecord.from_dict(answer["decisions"][-1]["record"])
    note = next(line for line in render(record) if f"speed of family {FAMILY} on {GPU}" in line)
    assert f"{RUNS - 1} run(s), own" in note
    used = float(note.split(": x", 1)[1].split(" ", 1)[0])
    assert abs(used / TRUE_FACTOR - 1) <= 0.15

    # Every completion was taught once, however often it was delivered.
    conn = await asyncpg.connect(platform.database_url)
    try:
        stored = await conn.fetchval("SELECT count(*) FROM speed_observations")
        distinct = await conn.fetchval("SELECT count(DISTINCT job_id) FROM speed_observations")
    finally:
        await conn.close()
    assert stored == distinct == RUNS

    # A restarted placement knows exactly what the last one knew.
    await platform.stop("placement")
    service = SERVICES["placement"] = await platform.start("placement")

    async def reloaded() -> bool:
        return service.leadership.is_leader and dict(service.learner.runs()).get((FAMILY, GPU)) == RUNS

    await until(reloaded, 30, "restarted placement leads with its learned speeds", retry_on=(QueryError,))
    estimate = service.learner.estimate(FAMILY, GPU)
    assert estimate.factor == pytest.approx(final["factor"])
    assert estimate.runs == RUNS
    assert service.book.learned[(FAMILY, GPU)] == pytest.approx(final["factor"])
    # ... and which cells runs measured (what comparative advantage trusts a ratio on).
    assert (FAMILY, GPU) in service.book.measured


async def test_a_long_run_teaches_while_it_runs_and_its_completion_adds_nothing(
    platform: Platform, client: LoomClient
) -> None:
    """The agent's progress reports carry the compute step it measured; placement learns from the
    first one, so a long run's family is learned while the run is still under way (at its first
    tenth), and the run's completion is not counted a second time."""
    family = "gru-long"
    job_id = "gru-long-0"
    # Hours of job time: about 12 s here.
    await client.submit(t4_job(job_id, {"family": family}, steps=1_000, step_time_s=10.0))

    async def taught() -> dict[str, Any] | None:
        rows = await client.learned_speeds()
        return next((r for r in rows if r["family"] == family and r["gpu_model"] == GPU), None)

    row = await until(taught, 30, "the running job's family learned")
    assert row["runs"] == 1
    job = await client.job(job_id)
    assert job is not None and job["state"] == "running", job  # learned before it ended
    await until(completed(client, job_id), 120, f"{job_id} completed")
    conn = await asyncpg.connect(platform.database_url)
    try:
        keys = await conn.fetch("SELECT event_id FROM speed_observations WHERE job_id = $1", job_id)
    finally:
        await conn.close()
    assert [k["event_id"] for k in keys] == [speeds.run_event_id(job_id, 1)]
    final = await taught()
    assert final is not None and final["runs"] == 1


async def test_an_observation_delivered_twice_is_stored_and_taught_once(
    fresh_database: Callable[..., Awaitable[str]],
) -> None:
    conn = await asyncpg.connect(await fresh_database("learn-store"))
    try:
        first = speeds.SpeedObservation(
            event_id="j1:completed:1",
            job_id="j1",
            family=FAMILY,
            gpu_model=GPU,
            prior_speed=3.0,
            observed_speed=1.0,
        )
        second = speeds.SpeedObservation(
            event_id="j2:completed:1",
            job_id="j2",
            family=FAMILY,
            gpu_model=GPU,
            prior_speed=3.0,
            observed_speed=1.1,
        )
        async with conn.transaction():
            assert await speeds.record(conn, [first, second]) == [first, second]
        async with conn.transaction():
            assert await speeds.record(conn, [second, first]) == []
        learner = await speeds.load_learner(conn)
        assert learner.runs() == {(FAMILY, GPU): 2}
        # Replayed in the order stored: the same state as teaching them directly.
        direct = SpeedLearner()
        first.teach(direct)
        second.teach(direct)
        assert learner.to_bytes() == direct.to_bytes()
    finally:
        await conn.close()


async def test_a_running_jobs_end_follows_its_progress_reports_not_the_belief(
    platform: Platform, client: LoomClient
) -> None:
    """Placement times a run from its belief when it places it (1,000 steps of the job's clock, some
    thousands of seconds) and then from its progress reports (the agent's clock, which runs
    ``time_scale`` x faster here): the waits other jobs compute for its GPUs follow the run."""
    job_id = "gru-paced-0"
    await client.submit(t4_job(job_id, {"family": "gru-paced"}, steps=1_000, step_time_s=10.0))
    placement = SERVICES["placement"]

    async def re_predicted() -> float | None:
        run = placement.book.runs.get(job_id)
        if run is None or run.paced is None or run.end_s is None:
            return None
        return float(run.end_s)

    end = await until(re_predicted, 120, "the run's end re-predicted from its progress")
    run = placement.book.runs[job_id]
    believed = run.predicted_step_s * 1_000
    assert believed > 1_000  # the belief: job-clock seconds from its placement
    now = time.time()
    assert now - 5 < end < now + 120, (end - now, believed)  # its pace: seconds of wall clock
    snap = placement.book.snapshot(now)
    (core,) = [r for r in snap.running if r.job_id == job_id]
    assert core.expected_end_s == pytest.approx(end)
    await until(completed(client, job_id), 120, f"{job_id} completed")


async def test_a_family_new_to_the_gpus_is_probed_on_each_and_its_next_job_goes_where_it_is_fastest(
    platform: Platform, client: LoomClient
) -> None:
    """c-sea1-a has T4s and V100s. The profile believes a ``training_memory`` job 2.5x faster on a
    V100; jobs of family ``probe-fam`` truly run 5x their profile on the T4 (the agent's
    ``true_speed`` knob), so 2x faster than on a V100. The family's first job asks for a probe on
    each model (loom.sched.probe) and, not held (the default), goes where the profile says; its
    next job goes to a T4. A restarted placement remembers that both cells were probed."""
    family = "probe-fam"
    agent = SERVICES["agent"]
    agent.backend.true_speed[(family, GPU)] = 5.0

    def family_job(job_id: str) -> JobSpec:
        return JobSpec(
            job_id=job_id,
            tenant="t1",
            task_type="training_memory",
            labels={"family": family},
            work=Work(steps=2_000, step_time_s=10.0),  # 20,000 s believed on a V100: long enough
        )

    await client.submit(family_job("probe-fam-0"))
    probes = {model: probe_id(family, model) for model in (GPU, "V100M16")}
    for model, pid in probes.items():
        probe = await until(completed(client, pid), 60, f"the probe on {model} completed")
        assert probe["tenant"] == "t1"
        assert probe["spec"]["labels"][PROBE_LABEL] == "probe-fam-0"
        assert probe["spec"]["resources"]["gpu_models"] == [model]
    rows = {r["gpu_model"]: r for r in await client.learned_speeds() if r["family"] == family}
    assert rows[GPU]["runs"] >= 1 and abs(rows[GPU]["factor"] / 5.0 - 1) <= 0.15
    assert rows["V100M16"]["runs"] >= 1 and abs(rows["V100M16"]["factor"] - 1) <= 0.15

    await client.submit(family_job("probe-fam-1"))
    first = await until(completed(client, "probe-fam-0"), 120, "probe-fam-0 completed")
    second = await until(completed(client, "probe-fam-1"), 120, "probe-fam-1 completed")
    models = {
        job["job_id"]: [e["event"]["gpu_model"] for e in job["events"] if e["kind"] == "placed"]
        for job in (first, second)
    }
    assert models == {"probe-fam-0": ["V100M16"], "probe-fam-1": [GPU]}, models
    answer = await client.explain("probe-fam-1")
    note = next(n for n in DecisionRecord.from_dict(answer["decisions"][-1]["record"]).notes if GPU in n)
    assert f"speed of family {family} on {GPU}" in note and "own" in note, note

    await platform.stop("placement")
    service = SERVICES["placement"] = await platform.start("placement")

    async def reloaded() -> bool:
        return service.leadership.is_leader and {(family, GPU), (family, "V100M16")} <= service.learner.probed

    await until(reloaded, 30, "restarted placement remembers the probed cells", retry_on=(QueryError,))


async def test_a_model_slow_on_two_nodes_is_learned_while_its_runs_are_under_way(
    platform: Platform, client: LoomClient
) -> None:
    """Runs over twice as slow as predicted teach only at completion (a slow node looks the same
    mid-run), unless runs on two nodes of the model agree: then it is the model, learned at their
    first progress reports. Each 2-GPU job here takes a whole T4 node of c-sea1-a."""
    family = "gru-two-nodes"
    agent = SERVICES["agent"]
    agent.backend.true_speed[(family, GPU)] = 0.1  # ten times slower than the T4's profile
    jobs = [f"{family}-{i}" for i in range(2)]
    for job_id in jobs:
        spec = t4_job(job_id, {"family": family}, steps=1_000, step_time_s=10.0)  # ~50 s at 0.1
        await client.submit(msgspec.structs.replace(spec, resources=Resources(gpus=2, gpu_models=[GPU])))

    async def taught() -> dict[str, Any] | None:
        rows = await client.learned_speeds()
        return next((r for r in rows if r["family"] == family and r["gpu_model"] == GPU), None)

    row = await until(taught, 60, "the family learned from two nodes' progress reports")
    assert row["runs"] == 2 and row["factor"] == pytest.approx(0.1, rel=0.2)
    for job_id in jobs:  # both still under way: learned from their progress, not their end
        job = await client.job(job_id)
        assert job is not None and job["state"] == "running", job
    nodes = {SERVICES["placement"].book.runs[j].parts[0][2][0][0] for j in jobs}
    assert len(nodes) == 2
    for job_id in jobs:
        await client.cancel(job_id)
