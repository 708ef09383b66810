"""The baselines' choices: Gavel-like places by the job's own throughput, ties by best fit."""

from loom.sched.firstfit import NodeCapacity
from loom.sched.framework import QueueItem
from loom.sched.snapshot import ClusterInfo, NetMatrix, Snapshot
from loom.sim.policies import make_policy
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
