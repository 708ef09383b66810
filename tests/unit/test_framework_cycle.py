"""One cycle over a queue (``Framework.schedule_many``) reuses work from job to job (plugins'
``score_key``, ``CycleState.shared``); it must decide exactly as deciding every job from scratch.

Random platforms (partly filled, some nodes unschedulable, running jobs to preempt, shrink, keep
near or apart from) and random queues (gangs, multi-GPU workers, task types, tenants, priorities,
regions and GPU models required, spanning gangs, elastic minimums, datasets, pipelines) go through
the cycle with its caches and through the same framework with ``cycle_caches`` off; every outcome,
every decision record and the snapshot left behind must be the same.
"""

from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from loom.model.capacity import NodeCapacity
from loom.sched.framework import Framework, Outcome, QueueItem
from loom.sched.plugins.cost import default_economics
from loom.sched.profile import DEFAULT_PLUGINS, build_framework
from loom.sched.quota import QuotaBook, TenantConfig, TenantQuota
from loom.sched.snapshot import ClusterInfo, NetMatrix, RunningJob, Snapshot
from loom_proto.jobs import Affinity, Communication, DataSpec, JobSpec, Layer, Pipeline, Resources, Work

MODELS = ("A100", "T4", "V100M16", "H100")
TASKS = ("training_compute", "training_memory", "training_comm", "inference")
REGIONS = tuple(sorted(default_economics().price_per_gpu_hour))


def platform(seed: int) -> Snapshot:
    """A random platform: clusters in the default economics' regions, pools of several models,
    nodes partly used or unschedulable, running jobs on them, measured links, trust, speeds."""
    rng = np.random.default_rng(seed)
    regions = list(REGIONS[: int(rng.integers(2, len(REGIONS) + 1))])
    nodes: list[NodeCapacity] = []
    clusters: dict[str, ClusterInfo] = {}
    running: list[RunningJob] = []
    for c in range(int(rng.integers(3, 10))):
        region = regions[int(rng.integers(len(regions)))]
        cid = f"c{c:02d}"
        zone = f"{region}-{'ab'[int(rng.integers(2))]}"
        clusters[cid] = ClusterInfo(cid, region, zone, trust=float(rng.choice([1.0, 1.0, 0.6])))
        for model in rng.choice(MODELS, size=int(rng.integers(1, 3)), replace=False).tolist():
            gpus = int(rng.choice([4, 8]))
            for n in range(int(rng.integers(1, 6))):
                reserved = int(rng.choice([0, 0, 0, 1, 2, gpus // 2, gpus]))
                name = f"{cid}-{model}-{n}"
                nodes.append(
                    NodeCapacity(
                        node=name,
                        cluster=cid,
                        region=region,
                        zone=zone,
                        gpu_model=model,
                        gpus_total=gpus,
                        gpus_reserved=reserved,
                        schedulable=bool(rng.random() > 0.1),
                        cpu_milli=int(rng.choice([0, 64_000])),
                        memory_mib=int(rng.choice([0, 256 * 1024])),
                    )
                )
                if reserved and rng.random() < 0.5:
                    workers = 1 + int(rng.random() < 0.3)
                    running.append(
                        RunningJob(
                            job_id=f"run-{name}",
                            tenant=f"t{int(rng.integers(3))}",
                            priority=int(rng.choice([10, 100, 500])),
                            cluster=cid,
                            gpu_model=model,
                            allocations=((name, reserved),),
                            progress=float(rng.random()),
                            preemptible=bool(rng.random() < 0.8),
                            labels={"app": str(rng.choice(["web", "db"]))},
                            workers=workers,
                            min_workers=1,
                            max_workers=workers,
                            gpus_per_worker=max(reserved // workers, 1),
                            expected_end_s=1e6 + float(rng.integers(0, 7200)) if rng.random() < 0.7 else None,
                        )
                    )
    net = NetMatrix(REGIONS)
    for a in REGIONS:
        for b in REGIONS:
            if a != b:
                net.set_link(
                    a,
                    b,
                    rtt_ms=float(rng.uniform(5, 250)),
                    bandwidth_gbps=float(rng.uniform(0.5, 20)),
                    loss=float(rng.choice([0.0, 0.0, 0.01])),
                    degraded=bool(rng.random() < 0.1),
                )
    speed = {(m, t): float(rng.uniform(0.3, 4.0)) for m in MODELS for t in TASKS}
    learned = {("llama", m): float(rng.uniform(0.7, 1.3)) for m in MODELS if rng.random() < 0.5}
    return Snapshot(
        nodes,
        clusters=clusters,
        running=running,
        net=net,
        economics=default_economics(),
        speed=speed,
        gpu_memory_gib={"A100": 80.0, "T4": 16.0, "V100M16": 16.0, "H100": 80.0},
        learned=learned,
        now=1e6,
    )


def queue(seed: int, snap: Snapshot) -> list[QueueItem]:  # noqa: PLR0912 - one draw per job feature
    """A random queue; runs of equal jobs (what the caches are for) among odd ones."""
    rng = np.random.default_rng(seed + 1)
    cluster_ids = [c.id for c in snap.clusters]
    items: list[QueueItem] = []
    template: dict[str, Any] = {}
    for i in range(int(rng.integers(10, 60))):
        if not template or rng.random() < 0.3:
            kw: dict[str, Any] = {
                "tenant": f"t{int(rng.integers(3))}",
                "task_type": str(rng.choice(TASKS)),
                "priority": int(rng.choice([10, 100, 100, 500])),
                "workers": int(rng.choice([1, 1, 1, 2, 4, 8])),
                "labels": {"family": "llama"} if rng.random() < 0.3 else {},
                "allow_multi_cluster": bool(rng.random() < 0.25),
            }
            gpus = int(rng.choice([1, 1, 2, 4, 8]))
            res: dict[str, Any] = {"gpus": gpus}
            if rng.random() < 0.2:
                res["gpu_models"] = rng.choice(MODELS, size=2, replace=False).tolist()
            if rng.random() < 0.2:
                res["cpu_milli"] = 4000
                res["memory_mib"] = 16 * 1024
            kw["resources"] = Resources(**res)
            kw["work"] = Work(steps=int(rng.integers(10, 5000)), step_time_s=float(rng.uniform(0.1, 5)))
            if kw["workers"] > 1 and rng.random() < 0.3:
                kw["min_workers"] = 1
            if rng.random() < 0.4:
                kw["comm"] = Communication(bytes_per_step=int(rng.integers(1, 10**9)), rounds_per_step=2)
            if rng.random() < 0.2:
                kw["data"] = DataSpec(
                    dataset="ds",
                    region=str(rng.choice(REGIONS)),
                    size_gb=float(rng.uniform(1, 500)),
                    start=str(rng.choice(["after_sync", "while_syncing"])),  # type: ignore[arg-type]
                )
            aff: dict[str, Any] = {}
            roll = rng.random()
            if roll < 0.1:
                aff["regions"] = [str(rng.choice(REGIONS))]
            elif roll < 0.2:
                aff["prefer_regions"] = [str(rng.choice(REGIONS))]
            elif roll < 0.25:
                aff["near_jobs"] = {"app": "web"}
            elif roll < 0.3:
                aff["apart_from_jobs"] = {"app": "db"}
            elif roll < 0.35:
                aff["avoid_clusters"] = [str(rng.choice(cluster_ids))]
            if aff:
                kw["affinity"] = Affinity(**aff)
            if rng.random() < 0.04:
                kw["pipeline"] = Pipeline(
                    layers=[Layer(compute_s=0.05, memory_gib=float(rng.uniform(5, 60))) for _ in range(6)]
                )
                kw["allow_multi_cluster"] = True
            template = kw
        spec = JobSpec(job_id=f"j{i:03d}", **template)
        items.append(
            QueueItem(
                job=spec,
                submitted_at=1e6 - float(rng.integers(0, 3600)),
                fair_share=float(rng.random()),
                attempts=int(rng.integers(0, 3)),
            )
        )
    return items


def framework(caches: bool) -> Framework:
    fw = build_framework({"plugins": [*DEFAULT_PLUGINS, "backfill"]})
    fw.cycle_caches = caches
    return fw


def quota_book() -> QuotaBook:
    return QuotaBook(
        TenantConfig(
            tenants={
                "t0": TenantQuota(name="t0", cohort="all", gpus=24, borrowing_limit=16),
                "t1": TenantQuota(name="t1", cohort="all", gpus=16),
                "t2": TenantQuota(name="t2", cohort=None, gpus=8),
            },
            open=False,
        ),
        {"t1": 4},
    )


def summary(outcome: Outcome) -> dict[str, Any]:
    d = outcome.decision
    return {
        "status": (outcome.status.code, outcome.status.reason, outcome.status.plugin, outcome.status.wait_s),
        "decision": None
        if d is None
        else (
            d.job_id,
            d.parts,
            d.allocations,
            d.workers,
            d.score,
            d.predicted_step_s,
            d.slowdown,
            d.start_after_s,
            d.sync,
            d.victims,
            d.shrunk,
        ),
        "record": outcome.record.to_dict(),
        "raw": [(c.cluster, c.gpu_model, c.raw, c.scores, c.total) for c in outcome.record.candidates],
    }


def run(seed: int, caches: bool, quota: bool, cycles: int) -> list[Any]:
    snap = platform(seed)
    if quota:
        snap.quota = quota_book()
    fw = framework(caches)
    items = queue(seed, snap)
    avoid = {items[0].job.job_id: [snap.clusters[0].id]}
    seen: list[Any] = []
    for cycle in range(cycles):
        snap.now = 1e6 + 600.0 * cycle
        out = fw.schedule_many(items, snap, avoid=avoid)
        seen.append([(item.job.job_id, summary(o)) for item, o in out])
        placed = {item.job.job_id for item, o in out if o.decision is not None}
        items = [i for i in items if i.job.job_id not in placed]
    seen.append(
        (snap.free.tolist(), snap.cpu_free.tolist(), snap.free_sum.tolist(), snap.pool_version.tolist())
    )
    seen.append(sorted((r.job_id, r.workers, r.allocations) for r in snap.running))
    seen.append(dict(snap.quota.usage) if snap.quota is not None else None)
    return seen


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), quota=st.booleans())
def test_a_cycle_decides_exactly_as_every_job_from_scratch(seed: int, quota: bool) -> None:
    fast = run(seed, caches=True, quota=quota, cycles=2)
    reference = run(seed, caches=False, quota=quota, cycles=2)
    assert fast == reference


def test_a_queue_of_equal_jobs_reuses_scores_and_still_decides_the_same() -> None:
    """The case the caches are for: many equal jobs. Some plugins' scores come from the cache
    (they are not recomputed), and the decisions and records are those of deciding from scratch."""
    snap = platform(7)
    items = [
        QueueItem(
            job=JobSpec(
                job_id=f"e{i:03d}",
                tenant="t0",
                task_type="inference",
                resources=Resources(gpus=1),
                work=Work(steps=1, step_time_s=600.0),
            ),
            submitted_at=1e6,
        )
        for i in range(40)
    ]
    calls = {"fast": 0, "reference": 0}
    results = {}
    for name, caches in (("fast", True), ("reference", False)):
        fw = framework(caches)
        jct = next(p for p in fw.scorers if p.name == "jct")
        score = jct.score

        def counted(state: Any, candidates: Any, name: str = name, score: Any = score) -> Any:
            calls[name] += 1
            return score(state, candidates)

        jct.score = counted  # type: ignore[method-assign]
        s = platform(7)
        results[name] = [(i.job.job_id, summary(o)) for i, o in fw.schedule_many(items, s)]
    assert results["fast"] == results["reference"]
    assert sum(o["decision"] is not None for _, o in results["fast"]) > 0
    assert calls["reference"] == 40
    assert calls["fast"] < calls["reference"]
    assert snap.free.sum() > 0


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_keyed_score_plugins_read_nothing_their_key_and_the_candidates_do_not_cover(seed: int) -> None:
    """The ``score_key`` contract, plugin by plugin: another job with an equal key, on the same
    candidates, after free GPUs and running jobs changed, gets the same raw scores (and the same
    normalised ones when ``normalize_key`` is equal too)."""
    snap = platform(seed)
    fw = framework(caches=True)
    rng = np.random.default_rng(seed + 2)
    for item in queue(seed, snap)[:8]:
        state = fw.new_state(item.job, snap)
        if not fw.run_pre_filters(state).ok or item.job.pipeline is not None:
            continue
        state.policy_mask = state.cluster_mask.copy()
        candidates = fw.find_candidates(state, min_capacity=1)
        if len(candidates) == 0:
            continue
        keyed = [p for p in fw.scorers if getattr(p, "score_key", None) is not None]
        before = {}
        for p in keyed:
            key = p.score_key(state)  # type: ignore[attr-defined]
            if key is not None and p.name not in state.skipped:
                raw = np.asarray(p.score(state, candidates), dtype=np.float64)
                before[p.name] = (key, raw, p.normalize_key(state), p.normalize(state, raw))  # type: ignore[attr-defined]
        # change what keyed plugins must not read: free GPUs, running jobs, another job id and tenant
        nodes = rng.choice(len(snap.node_ids), size=min(5, len(snap.node_ids)), replace=False)
        snap.take([(snap.node_ids[int(n)], 1) for n in nodes])
        snap.running = snap.running[: len(snap.running) // 2]
        other = JobSpec(
            **{
                **{f: getattr(item.job, f) for f in item.job.__struct_fields__},
                "job_id": "other",
                "tenant": "t9",
            }
        )
        again = fw.new_state(other, snap)
        fw.run_pre_filters(again)
        for p in keyed:
            if p.name not in before:
                continue
            key, raw, norm_key, norm = before[p.name]
            if p.score_key(again) != key:  # type: ignore[attr-defined]
                continue
            raw2 = np.asarray(p.score(again, candidates), dtype=np.float64)
            assert raw2.tobytes() == raw.tobytes(), p.name
            if norm_key is not None and p.normalize_key(again) == norm_key:  # type: ignore[attr-defined]
                assert np.asarray(p.normalize(again, raw2)).tobytes() == np.asarray(norm).tobytes(), p.name
