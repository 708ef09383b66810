"""The baselines' choices (Gavel-like places by the job's own throughput, ties by best fit) and the
oracle (Loom knowing the truth)."""

import pytest

from loom.model.capacity import NodeCapacity
from loom.model.profiles import relative_speed
from loom.sched.framework import QueueItem
from loom.sched.plugins.cost import default_economics
from loom.sched.snapshot import ClusterInfo, NetMatrix, Snapshot
from loom.sim.engine import simulate
from loom.sim.model import Platform, SimJob, Trace
from loom.sim.policies import make_policy, oracle_factors
from loom.sim.truth import BELIEF, Truth, TruthCell
from loom_proto.jobs import JobSpec, Resources, Work

TASKS = ("training_compute", "training_memory", "training_comm", "inference")


def snapshot(pools: dict[str, tuple[str, int, float]]) -> Snapshot:
    """``cluster -> (gpu_model, 8-GPU nodes, SCU)``, one region."""
    nodes = [
        NodeCapacity(node=f"{cid}-{i}", cluster=cid, region="r1", zone="r1-a", gpu_model=model, gpus_total=8)
        for cid, (model, count, _) in pools.items()
        for i in range(count)
    ]
    speed = {(model, t): scu for model, _, scu in pools.values() for t in TASKS}
    clusters = {cid: ClusterInfo(id=cid, region="r1", zone="r1-a") for cid in pools}
    return Snapshot(nodes, clusters=clusters, net=NetMatrix(["r1"]), speed=speed, gpu_memory_gib={})


def job(job_id: str, gpus: int) -> JobSpec:
    return JobSpec(
        job_id=job_id, tenant="t", resources=Resources(gpus=gpus), work=Work(steps=10, step_time_s=1.0)
    )


def chosen(policy_name: str, snap: Snapshot, spec: JobSpec) -> str:
    outcome = make_policy(policy_name).decide_one(QueueItem(job=spec, submitted_at=0.0), snap)
    assert outcome.decision is not None, outcome.record.reason
    return outcome.decision.lead.cluster


def test_gavel_like_takes_a_13_percent_faster_pool_with_fewer_free_gpus() -> None:
    snap = snapshot({"fast": ("FAST", 1, 1.13), "roomy": ("SLOW", 8, 1.0)})
    assert chosen("gavel_like", snap, job("j", 1)) == "fast"
    # Compute-only greedy takes the pool with most free compute: that is what gavel_like used to equal.
    assert chosen("greedy_compute", snap, job("j", 1)) == "roomy"


def test_gavel_like_breaks_near_ties_by_the_tightest_fit() -> None:
    # 1 % apart is within the tolerance: the pool the job fills best wins, not the roomiest.
    snap = snapshot({"roomy": ("A", 8, 1.01), "tight": ("B", 1, 1.0)})
    assert chosen("gavel_like", snap, job("j", 8)) == "tight"
    # 5 % apart is not a tie: the faster pool wins whatever its fit.
    snap = snapshot({"roomy": ("A", 8, 1.05), "tight": ("B", 1, 1.0)})
    assert chosen("gavel_like", snap, job("j", 8)) == "roomy"


def truth_platform() -> Platform:
    """One region, one 8-GPU node of V100M16 (cluster c-v100) and one of P100 (c-p100)."""
    pools = {"c-p100": "P100", "c-v100": "V100M16"}
    nodes = [
        NodeCapacity(node=f"{cid}-0", cluster=cid, region="r1", zone="r1-a", gpu_model=model, gpus_total=8)
        for cid, model in pools.items()
    ]
    return Platform(
        name="truth-test",
        nodes=nodes,
        clusters={cid: ClusterInfo(id=cid, region="r1", zone="r1-a") for cid in pools},
        net=NetMatrix(["r1"]),
        economics=default_economics(),
        speed={(m, t): relative_speed(m, t) for m in pools.values() for t in TASKS},
        gpu_memory_gib=dict.fromkeys(pools.values(), 16.0),
    )


def test_the_oracle_learns_the_truth_and_takes_the_gpu_the_profile_underrates() -> None:
    # The truth says a P100 runs this family 3x as fast as a V100; the profile says it is slower.
    cells = [
        TruthCell("resnet-50", "V100M16", "fp32", 1, 100.0, "s"),
        TruthCell("resnet-50", "P100", "fp32", 1, 300.0, "s"),
    ]
    truth = Truth(cells, families={"resnet-50": "training_compute"})
    plat = truth_platform()
    assert relative_speed("P100", "training_compute") < 1.0
    spec = JobSpec(
        job_id="r",
        tenant="t",
        labels={"family": "resnet-50"},
        resources=Resources(gpus=1),
        work=Work(steps=1000, step_time_s=1.0),
    )
    trace = Trace(jobs=[SimJob(spec=spec, arrival_s=0.0)])
    factors = oracle_factors(truth, [spec], plat.snapshot(), seed=0)
    assert factors[("resnet-50", "P100")] == pytest.approx(3.0 / relative_speed("P100", "training_compute"))
    assert factors[("resnet-50", "V100M16")] == pytest.approx(1.0)
    oracle = simulate(trace, plat, make_policy("oracle"), truth=truth).records[0]
    loom = simulate(trace, plat, make_policy("loom"), truth=truth).records[0]
    assert (oracle.gpu_model, loom.gpu_model) == ("P100", "V100M16")
    assert oracle.jct_s is not None and loom.jct_s is not None
    assert oracle.jct_s == pytest.approx(loom.jct_s / 3.0, rel=0.05)
    # Timed by belief there is nothing to know: the oracle is Loom.
    assert simulate(trace, plat, make_policy("oracle"), truth=BELIEF).records[0].gpu_model == "V100M16"
