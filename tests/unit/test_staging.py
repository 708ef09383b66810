"""Staging a queued job's dataset (loom.sched.staging) and the simulator copying it while the job
waits (``simulate(..., stage_data=True)``)."""

from typing import Any

import pytest

from loom.model.capacity import NodeCapacity
from loom.sched.framework import Framework
from loom.sched.plugins.data import DataLocality
from loom.sched.plugins.resources import ResourceFit
from loom.sched.snapshot import Economics, NetMatrix, Snapshot
from loom.sched.staging import staging_plan
from loom.sim.engine import simulate
from loom.sim.model import Platform, SimJob, Trace
from loom.sim.policies import FrameworkPolicy
from loom.sim.truth import BELIEF
from loom_proto.jobs import Affinity, Communication, DataSpec, JobSpec, Resources, Work

FAST, SLOW = "A100", "T4"
SPEED = {(FAST, "training_compute"): 4.0, (SLOW, "training_compute"): 1.0}


def node(name: str, cluster: str, region: str, model: str, gpus: int = 8) -> NodeCapacity:
    return NodeCapacity(
        node=name, cluster=cluster, region=region, zone=f"{region}-a", gpu_model=model, gpus_total=gpus
    )


def net() -> NetMatrix:
    """r-data holds the datasets; r-fast is 10 s of copying away per 10 GB (8 Gbps), r-slow 2x."""
    m = NetMatrix(["r-data", "r-fast", "r-slow"])
    for a, b, gbps in (("r-data", "r-fast", 8.0), ("r-data", "r-slow", 16.0), ("r-fast", "r-slow", 8.0)):
        m.set_link(a, b, rtt_ms=0.0, bandwidth_gbps=gbps)
        m.set_link(b, a, rtt_ms=0.0, bandwidth_gbps=gbps)
    return m


NODES = [
    node("f0", "c-fast", "r-fast", FAST),
    node("f1", "c-fast", "r-fast", FAST),
    node("s0", "c-slow", "r-slow", SLOW),
    node("d0", "c-data", "r-data", SLOW, gpus=2),
]


def snapshot(nodes: list[NodeCapacity] = NODES) -> Snapshot:
    return Snapshot(nodes, net=net(), speed=SPEED, now=0.0)


def job(
    job_id: str = "j",
    workers: int = 4,
    *,
    region: str = "r-data",
    size_gb: float = 100.0,
    affinity: Affinity | None = None,
    steps: int = 400,
) -> JobSpec:
    return JobSpec(
        job_id=job_id,
        tenant="t",
        workers=workers,
        resources=Resources(gpus=1),
        work=Work(steps=steps, step_time_s=1.0),
        comm=Communication(bytes_per_step=10**6),
        data=DataSpec(dataset=f"ds-{job_id}", region=region, size_gb=size_gb),
        affinity=affinity or Affinity(),
    )


def test_the_dataset_goes_to_the_fastest_pool_that_could_ever_hold_the_gang() -> None:
    plan = staging_plan(job(workers=4), snapshot())
    assert plan is not None
    assert (plan.src, plan.dst, plan.dataset) == ("r-data", "r-fast", "ds-j")
    assert plan.sync_s == pytest.approx(100.0 * 8 / 8.0)  # 100 GB over 8 Gbps
    # 16 workers fit the fast pool (2 nodes x 8) whole; 17 fit no pool, so nothing is staged.
    assert staging_plan(job(workers=16), snapshot()) is not None
    assert staging_plan(job(workers=17), snapshot()) is None


def test_no_plan_where_the_data_already_is_or_was_copied() -> None:
    snap = snapshot()
    assert staging_plan(job(region="r-fast"), snap) is None  # the dataset lives there
    assert staging_plan(job(), snap, copied=frozenset({"r-fast"})) is None  # copied for it before
    no_data = JobSpec(job_id="n", tenant="t", workers=4, resources=Resources(gpus=1), work=Work(steps=1))
    assert staging_plan(no_data, snap) is None


def test_affinity_limits_where_it_is_staged() -> None:
    snap = snapshot()
    plan = staging_plan(job(affinity=Affinity(regions=["r-slow", "r-data"])), snap)
    assert plan is not None and plan.dst == "r-slow"  # the fastest pool it may use
    plan = staging_plan(job(affinity=Affinity(avoid_clusters=["c-fast"])), snap)
    assert plan is not None and plan.dst == "r-slow"
    # Only the data's own region allowed: nothing to copy.
    assert staging_plan(job(workers=2, affinity=Affinity(regions=["r-data"])), snap) is None


def platform() -> Platform:
    return Platform(
        name="staging",
        nodes=[node("f0", "c-fast", "r-fast", FAST)],
        clusters={},
        net=net(),
        economics=Economics(),
        speed=SPEED,
        gpu_memory_gib={FAST: 80.0, SLOW: 16.0},
    )


def run(stage: bool) -> dict[str, tuple[float, float]]:
    # "first" holds the only pool (8 fast GPUs) for 1000 s (4000 steps of 1 s at speed 4); "second"
    # arrives at 10 s, is queued, and reads 100 GB from r-data (100 s to copy, after_sync).
    first = job("first", workers=8, region="r-fast", steps=4000)
    second = job("second", workers=8, steps=400)
    policy = FrameworkPolicy("t", Framework([ResourceFit(), DataLocality()]))
    result = simulate(
        Trace([SimJob(first, 0.0), SimJob(second, 10.0)]), platform(), policy, truth=BELIEF, stage_data=stage
    )
    out = {}
    for r in result.records:
        assert r.start_s is not None and r.end_s is not None
        out[r.job_id] = (r.start_s, r.end_s)
    return out


def test_a_queued_jobs_copy_runs_while_it_waits_not_on_its_gpus() -> None:
    before, after = run(stage=False), run(stage=True)
    assert before["first"] == after["first"]
    start, end = before["second"]
    assert start == pytest.approx(before["first"][1])  # queued until the pool frees
    # Without staging it holds the GPUs 100 s for the copy, then runs 100 s.
    assert end - start == pytest.approx(200.0, rel=0.05)
    s_start, s_end = after["second"]
    assert s_start == pytest.approx(start)
    # Staged from 10 s, the copy was done long before: it runs at once.
    assert s_end - s_start == pytest.approx(100.0, rel=0.05)


def test_placement_waits_only_for_what_is_left_of_a_staged_copy() -> None:
    framework = Framework([ResourceFit(), DataLocality()])
    spec = job(workers=8)
    fast = NODES[:2]  # only the fast pool: the job goes there
    full = framework.schedule(spec, snapshot(fast)).decision
    assert full is not None and full.start_after_s == pytest.approx(100.0)  # the whole copy
    snap = snapshot(fast)
    snap.now = 50.0
    snap.staged[spec.job_id] = {"r-fast": 80.0}  # begun earlier, done at 80 s
    staged = framework.schedule(spec, snap).decision
    assert staged is not None and staged.start_after_s == pytest.approx(30.0)
    assert staged.sync is not None and staged.sync.dst == "r-fast"


def test_the_contention_bench_stages_for_loom_alone() -> None:
    from loom_benchmarks.contention import Cell, run_cell

    cell = Cell("small3", "net", 1.2, 1, False)
    plain = run_cell(cell, ("loom", "greedy_compute"), units=12)
    staged = run_cell(cell, ("loom", "greedy_compute"), units=12, stage_data=True)

    def figures(run: dict[str, Any], policy: str) -> dict[str, Any]:
        return {k: v for k, v in run["policies"][policy].items() if k != "wall_s"}

    assert figures(plain, "greedy_compute") == figures(staged, "greedy_compute")
    # Loom staged (its runs changed); whether a 12-job cell is faster is the benchmark's question.
    assert figures(plain, "loom")["jct_mean_s"] != figures(staged, "loom")["jct_mean_s"]
    assert staged["policies"]["loom"]["finished"] == plain["policies"]["loom"]["finished"] == 12


def test_a_dataset_in_a_region_loom_does_not_know_is_refused_as_unresolvable() -> None:
    # A typo ("mars-1") was placed with a copy priced over made-up links ("waits 800 s").
    from loom.sched.framework import Code
    from loom.sched.profile import build_framework

    framework = build_framework()
    outcome = framework.schedule(job("typo", 1, region="mars-1"), snapshot(), apply=False)
    assert outcome.decision is None and outcome.status.code == Code.UNRESOLVABLE
    assert "region mars-1, which Loom does not know" in outcome.status.reason
    assert "r-data" in outcome.status.reason
    replica = JobSpec(
        job_id="rep",
        tenant="t",
        work=Work(steps=1),
        data=DataSpec(dataset="ds", region="r-data", size_gb=1.0, replicas=["nowhere"]),
    )
    # A replica Loom does not know is only one place less to copy from: left out, not refused.
    assert framework.schedule(replica, snapshot(), apply=False).decision is not None
    assert framework.schedule(job("fine", 1), snapshot(), apply=False).decision is not None
