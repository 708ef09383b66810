"""Network, data, cost and affinity plugins: each decides as the measured network and the job say."""

import dataclasses
import math
from collections.abc import Iterable, Sequence
from functools import cache

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loom.model.capacity import NodeCapacity
from loom.sched.framework import Candidates, Code, CycleState, Framework, Outcome
from loom.sched.plugins.affinity import Affinity as AffinityPlugin
from loom.sched.plugins.cost import (
    ANNUAL_CARBON_G_PER_KWH,
    CostEnergy,
    default_economics,
    solar_dip_profile,
)
from loom.sched.plugins.data import READ_SLOWDOWN, data_delay_s
from loom.sched.plugins.network import (
    DEFAULT_ALPHA,
    INTRA_CLUSTER_GBPS,
    AlphaLearner,
    Jct,
    Joint,
    network_factors,
    predict_step_s,
)
from loom.sched.profile import DEFAULT_PLUGINS, DEFAULT_WEIGHTS, build_framework, default_registry
from loom.sched.snapshot import ClusterInfo, Economics, NetMatrix, RunningJob, Snapshot
from loom_proto.jobs import Affinity, Communication, DataSpec, JobSpec, Resources, TaskType, Work

Site = tuple[str, str, str, int]
"""(cluster, region, gpu model, GPUs on its one node)."""


def snapshot(
    sites: Sequence[Site],
    links: Iterable[tuple[str, str, float, float]] = (),
    *,
    regions: Sequence[str] = (),
    running: Sequence[RunningJob] = (),
    speed: dict[tuple[str, str], float] | None = None,
    economics: Economics | None = None,
    now: float = 0.0,
    trust: dict[str, float] | None = None,
) -> Snapshot:
    """One node per cluster; links (a, b, rtt_ms, gbps) are set both ways."""
    names = sorted({r for _, r, _, _ in sites} | set(regions))
    net = NetMatrix(names)
    for a, b, rtt_ms, gbps in links:
        net.set_link(a, b, rtt_ms=rtt_ms, bandwidth_gbps=gbps)
        net.set_link(b, a, rtt_ms=rtt_ms, bandwidth_gbps=gbps)
    nodes = [
        NodeCapacity(node=f"{c}-n0", cluster=c, region=r, zone=f"{r}-a", gpu_model=m, gpus_total=g)
        for c, r, m, g in sites
    ]
    clusters = {
        c: ClusterInfo(id=c, region=r, zone=f"{r}-a", trust=(trust or {}).get(c, 1.0)) for c, r, _, _ in sites
    }
    return Snapshot(
        nodes, clusters=clusters, net=net, running=running, speed=speed, economics=economics, now=now
    )


def job(
    job_id: str = "j",
    *,
    workers: int = 1,
    gpus: int = 1,
    task_type: TaskType = "training_compute",
    steps: int = 1000,
    step_time_s: float = 1.0,
    **extra: object,
) -> JobSpec:
    return JobSpec(
        job_id=job_id,
        tenant="acme",
        task_type=task_type,
        workers=workers,
        resources=Resources(gpus=gpus),
        work=Work(steps=steps, step_time_s=step_time_s),
        **extra,  # type: ignore[arg-type]
    )


def running(job_id: str, cluster: str, **labels: str) -> RunningJob:
    return RunningJob(
        job_id=job_id,
        tenant="acme",
        priority=100,
        cluster=cluster,
        gpu_model="V100M16",
        allocations=((f"{cluster}-n0", 1),),
        labels=labels,
    )


def candidates_of(fw: Framework, spec: JobSpec, snap: Snapshot) -> tuple[CycleState, Candidates]:
    state = fw.new_state(spec, snap)
    assert fw.run_pre_filters(state).ok
    return state, fw.find_candidates(state)


def score_of(plugin: Joint | Jct, state: CycleState, cands: Candidates) -> dict[str, float]:
    raw = plugin.score(state, cands)
    norm = plugin.normalize(state, raw)
    return {state.snapshot.clusters[int(c)].id: float(v) for c, v in zip(cands.cluster, norm, strict=True)}


def placed(outcome: Outcome) -> list[str]:
    assert outcome.status.ok, outcome.status
    assert outcome.decision is not None
    return [p.cluster for p in outcome.decision.parts]


# ---- joint and JCT ---------------------------------------------------------------------------


def test_comm_heavy_gang_that_must_span_clusters_takes_the_pair_with_the_best_link() -> None:
    snap = snapshot(
        [("a", "A", "V100M16", 4), ("b", "B", "V100M16", 4), ("c", "C", "V100M16", 4)],
        [("A", "B", 150.0, 1.0), ("A", "C", 150.0, 1.0), ("B", "C", 2.0, 10.0)],
    )
    spec = job(
        workers=6,
        task_type="training_comm",
        allow_multi_cluster=True,
        comm=Communication(bytes_per_step=10**9),
    )
    # No cluster holds 6 workers; the best spread (b and c, 10 Gbit/s) holds 2.2x the GPU-hours of
    # the gang in one cluster (2.602 s a step against 1.16 s), beyond the span guard's bound, and
    # no cluster will ever hold it: rejected with the figure, however long it waited.
    for waited in (0.0, 10**7):
        refused = build_framework().schedule(spec, snap, submitted_at=snap.now - waited)
        assert refused.decision is None and refused.status.plugin == "span_guard"
        assert refused.status.code == Code.UNRESOLVABLE and refused.status.reject == "span_inflation"
        assert f"at least {2.602 / 1.16:.1f}x the GPU-hours" in refused.status.reason
    # Under a looser bound the spread goes ahead at once, over the pair with the best link.
    loose = {"config": {"span_guard": {"gpu_hours_bound": 3.0}}}
    outcome = build_framework(loose).schedule(spec, snap, submitted_at=snap.now)
    assert sorted(placed(outcome)) == ["b", "c"]
    decision = outcome.decision
    assert decision is not None
    expected = 1.0 + 2 * 1e9 * 8 / 10e9 + 2.0 / 1000
    assert decision.predicted_step_s == pytest.approx(expected)
    assert decision.slowdown == pytest.approx(expected / 1.0)


def test_step_time_is_compute_on_the_slowest_part_plus_allreduce_over_the_slowest_link() -> None:
    net = NetMatrix(["A", "B", "C"])
    net.set_link("A", "B", rtt_ms=10.0, bandwidth_gbps=8.0)
    net.set_link("B", "A", rtt_ms=10.0, bandwidth_gbps=8.0)
    net.set_link("B", "C", rtt_ms=40.0, bandwidth_gbps=2.0)
    net.set_link("C", "B", rtt_ms=40.0, bandwidth_gbps=2.0)
    net.set_link("A", "C", rtt_ms=30.0, bandwidth_gbps=4.0)
    net.set_link("C", "A", rtt_ms=30.0, bandwidth_gbps=4.0)
    spec = job(workers=3, step_time_s=2.0, comm=Communication(bytes_per_step=10**9, rounds_per_step=3))
    estimate = predict_step_s(spec, speeds=[2.0, 1.0, 4.0], regions=["A", "B", "C"], net=net)
    assert estimate.compute_s == pytest.approx(2.0)
    assert estimate.comm_s == pytest.approx(2 * 1e9 * 8 / 2e9 + 3 * 40.0 / 1000)
    assert estimate.slowdown == pytest.approx(estimate.step_s / 2.0)
    alone = predict_step_s(spec, speeds=[2.0], regions=["A"], net=net)
    assert alone.comm_s == pytest.approx(2 * 1e9 * 8 / (INTRA_CLUSTER_GBPS * 1e9) + 3 * 0.1 / 1000)
    single_worker = predict_step_s(spec, speeds=[1.0], regions=["A", "B"], net=net, workers=1)
    assert single_worker.comm_s == 0.0
    assert single_worker.slowdown == 1.0


def test_single_cluster_job_binds_compute_time_and_trust_slows_it() -> None:
    snap = snapshot(
        [("a", "A", "V100M16", 4)], trust={"a": 0.5}, speed={("V100M16", "training_compute"): 2.0}
    )
    outcome = build_framework().schedule(job(step_time_s=3.0), snap)
    assert placed(outcome) == ["a"]
    assert outcome.decision is not None
    assert outcome.decision.predicted_step_s == pytest.approx(3.0 / (2.0 * 0.5))
    assert outcome.decision.slowdown == 1.0


def test_degraded_link_lowers_the_network_score_of_its_region() -> None:
    sites = [("a", "A", "V100M16", 4), ("b", "B", "V100M16", 4), ("c", "C", "V100M16", 4)]
    links = [("A", "B", 20.0, 5.0), ("A", "C", 20.0, 5.0), ("B", "C", 20.0, 5.0)]
    healthy = snapshot(sites, links)
    sick = snapshot(sites, links)
    sick.net.set_link("A", "C", rtt_ms=60.0, bandwidth_gbps=1.0, loss=0.03, degraded=True)
    fw = build_framework()
    joint = Joint()
    state, cands = candidates_of(fw, job(), healthy)
    before = score_of(joint, state, cands)
    assert before["a"] == pytest.approx(before["b"])
    state, cands = candidates_of(fw, job(), sick)
    after = score_of(joint, state, cands)
    assert after["a"] < after["b"] == pytest.approx(before["b"])
    assert after["c"] == pytest.approx(before["c"])
    assert placed(fw.schedule(job(), sick))[0] != "a"


def test_alpha_decides_between_fast_compute_and_a_good_network() -> None:
    snap = snapshot(
        [("a", "A", "H100", 4), ("b", "B", "V100M16", 4)],
        [("A", "B", 100.0, 1.0)],
        speed={("H100", "training_comm"): 3.0, ("V100M16", "training_comm"): 1.0},
    )
    spec = job(
        task_type="training_comm",
        data=DataSpec(dataset="d", region="B", size_gb=300.0),
        step_time_s=1.0,
        steps=600,
    )
    fw = build_framework()
    state, cands = candidates_of(fw, spec, snap)
    compute_minded = score_of(Joint(AlphaLearner({"training_comm": 0.95})), state, cands)
    network_minded = score_of(Joint(AlphaLearner({"training_comm": 0.1})), state, cands)
    assert compute_minded["a"] > compute_minded["b"]
    assert network_minded["b"] > network_minded["a"]


def test_inference_goes_near_the_users_in_prefer_regions() -> None:
    snap = snapshot(
        [("a", "A", "T4", 4), ("b", "B", "T4", 4)],
        [("A", "U", 200.0, 2.0), ("B", "U", 10.0, 2.0), ("A", "B", 190.0, 2.0)],
        regions=["U"],
    )
    spec = job(task_type="inference", affinity=Affinity(prefer_regions=["U"]))
    fw = build_framework()
    assert placed(fw.schedule(spec, snap)) == ["b"]
    state, cands = candidates_of(fw, spec, snap)
    factors = network_factors(state, cands, np.ones(len(cands)))
    by_cluster = dict(zip((snap.clusters[int(c)].id for c in cands.cluster), factors.users, strict=True))
    assert by_cluster["b"] > by_cluster["a"]
    training = job(affinity=Affinity(prefer_regions=["U"]))
    state, cands = candidates_of(fw, training, snap)
    assert np.all(network_factors(state, cands, np.ones(len(cands))).users == 1.0)


def test_jct_prefers_the_shorter_completion_and_scores_relative_to_the_best() -> None:
    snap = snapshot(
        [("a", "A", "V100M16", 4), ("b", "B", "A100", 4)],
        speed={("A100", "training_compute"): 2.0},
    )
    fw = build_framework()
    state, cands = candidates_of(fw, job(), snap)
    raw = dict(zip((snap.clusters[int(c)].id for c in cands.cluster), Jct().score(state, cands), strict=True))
    assert raw == {"a": pytest.approx(1000.0), "b": pytest.approx(500.0)}
    assert score_of(Jct(), state, cands) == {"a": pytest.approx(50.0), "b": pytest.approx(100.0)}


def test_alpha_learner_moves_toward_the_observed_compute_share_and_stays_clamped() -> None:
    learner = AlphaLearner()
    assert learner.alpha("training_compute") == DEFAULT_ALPHA["training_compute"]
    previous = learner.alpha("training_compute")
    for _ in range(40):
        now = learner.observe("training_compute", compute_s_predicted=1.0, observed_step_s=4.0)
        assert now <= previous
        previous = now
    assert previous == pytest.approx(0.25, abs=1e-3)
    for _ in range(60):
        learner.observe("training_compute", 1.0, 1000.0)
    assert learner.alpha("training_compute") == pytest.approx(0.1)
    for _ in range(60):
        learner.observe("inference", 5.0, 1.0)
    assert learner.alpha("inference") == pytest.approx(0.95)
    before = learner.as_dict()
    learner.observe("training_memory", 0.0, 1.0)
    learner.observe("training_memory", 1.0, math.nan)
    assert learner.as_dict() == before
    assert learner.alpha("no_such_type") == 0.5


def test_the_profile_shares_the_alpha_learner_from_the_context() -> None:
    learner = AlphaLearner({"training_compute": 0.2})
    fw = build_framework(context={"alpha_learner": learner})
    joint = next(p for p in fw.plugins if isinstance(p, Joint))
    assert joint.learner is learner
    with pytest.raises(TypeError):
        build_framework(context={"alpha_learner": "not a learner"})


# ---- data locality ---------------------------------------------------------------------------


DATA_SITES: list[Site] = [("x", "X", "V100M16", 4), ("y", "Y", "V100M16", 4)]
DATA_LINKS = [("X", "Y", 50.0, 4.0)]


def test_job_with_a_large_dataset_lands_in_its_region_when_compute_is_equal() -> None:
    spec = job(data=DataSpec(dataset="corpus", region="Y", size_gb=5000.0))
    outcome = build_framework().schedule(spec, snapshot(DATA_SITES, DATA_LINKS))
    assert placed(outcome) == ["y"]
    assert outcome.decision is not None
    assert outcome.decision.sync is None
    assert outcome.decision.start_after_s == 0.0


def test_job_forced_away_from_its_data_gets_a_sync_plan_and_waits_for_the_first_copy() -> None:
    spec = job(
        data=DataSpec(dataset="corpus", region="Y", size_gb=5000.0, change_gb_per_hour=2.0),
        affinity=Affinity(regions=["X"]),
    )
    snap = snapshot(DATA_SITES, DATA_LINKS)
    outcome = build_framework().schedule(spec, snap)
    assert placed(outcome) == ["x"]
    decision = outcome.decision
    assert decision is not None and decision.sync is not None
    copy_s = 0.05 + 5000.0 * 8 / 4.0
    assert decision.sync.src == "Y" and decision.sync.dst == "X"
    assert decision.sync.initial_gb == 5000.0
    assert decision.sync.initial_s == pytest.approx(copy_s)
    assert decision.sync.incremental_gb_per_hour == 2.0
    assert decision.start_after_s == pytest.approx(copy_s)
    assert any(n.startswith("data_locality: start waits") for n in outcome.record.notes)


def test_while_syncing_job_starts_at_once_with_its_sync_plan() -> None:
    spec = job(
        data=DataSpec(dataset="corpus", region="Y", size_gb=100.0, start="while_syncing"),
        affinity=Affinity(regions=["X"]),
    )
    outcome = build_framework().schedule(spec, snapshot(DATA_SITES, DATA_LINKS))
    assert outcome.decision is not None and outcome.decision.sync is not None
    assert outcome.decision.sync.start == "while_syncing"
    assert outcome.decision.start_after_s == 0.0


def test_the_first_copy_comes_from_the_replica_that_delivers_it_soonest() -> None:
    snap = snapshot(
        [("x", "X", "V100M16", 4)], [("X", "Y", 200.0, 0.5), ("X", "Z", 5.0, 10.0)], regions=["Y", "Z"]
    )
    spec = job(data=DataSpec(dataset="corpus", region="Y", replicas=["Z"], size_gb=100.0))
    outcome = build_framework().schedule(spec, snap)
    assert outcome.decision is not None and outcome.decision.sync is not None
    assert outcome.decision.sync.src == "Z"
    assert outcome.decision.sync.initial_s == pytest.approx(0.005 + 100.0 * 8 / 10.0)


def test_data_delay_waits_for_the_copy_or_reads_slower_while_it_runs() -> None:
    sync = np.array([0.0, 100.0, 10_000.0])
    assert data_delay_s(1000.0, sync, "after_sync").tolist() == [0.0, 100.0, 10_000.0]
    f = READ_SLOWDOWN
    assert data_delay_s(1000.0, sync, "while_syncing").tolist() == pytest.approx(
        [0.0, 100.0 * (1 - 1 / f), 1000.0 * (f - 1)]
    )


def test_jobs_without_data_or_affinity_are_not_scored_by_those_plugins() -> None:
    outcome = build_framework().schedule(job(), snapshot(DATA_SITES, DATA_LINKS))
    scored = set(outcome.record.candidates[0].scores)
    assert "data_locality" not in scored and "affinity" not in scored
    assert {"joint", "jct", "cost_energy"} <= scored


# ---- affinity ----------------------------------------------------------------------------------


AFF_SITES: list[Site] = [("a", "A", "V100M16", 4), ("b", "A", "V100M16", 4), ("c", "C", "V100M16", 4)]
AFF_LINKS = [("A", "C", 80.0, 4.0)]


def test_anti_affinity_keeps_the_job_off_clusters_running_labelled_jobs() -> None:
    snap = snapshot(
        AFF_SITES, AFF_LINKS, running=[running("db", "a", team="x"), running("web", "b", team="y")]
    )
    spec = job(affinity=Affinity(apart_from_jobs={"team": "x"}))
    outcome = build_framework().schedule(spec, snap)
    assert placed(outcome)[0] != "a"
    assert "team=x" in outcome.record.pruned["a"]
    everywhere = snapshot(AFF_SITES, AFF_LINKS, running=[running(f"db{c}", c, team="x") for c in "abc"])
    blocked = build_framework().schedule(spec, everywhere)
    assert blocked.status.code == Code.UNSCHEDULABLE
    assert "apart_from_jobs" in blocked.status.reason


def test_a_gang_kept_apart_from_the_job_on_the_only_cluster_it_fits_waits_rather_than_is_rejected() -> None:
    # Only "big" has 8-GPU nodes; the team=x job running there bars it for as long as it runs.
    # Before, the gang was rejected as "can never fit: the largest node has 4 GPUs".
    sites: list[Site] = [("small", "A", "V100M16", 4), ("big", "C", "V100M16", 8)]
    snap = snapshot(sites, AFF_LINKS, running=[running("db", "big", team="x")])
    spec = job(gpus=8, affinity=Affinity(apart_from_jobs={"team": "x"}))
    outcome = build_framework().schedule(spec, snap)
    assert outcome.decision is None
    assert outcome.status.code == Code.UNSCHEDULABLE, outcome.status.reason
    assert "team=x" in outcome.record.pruned["big"]
    assert build_framework().never_fits(spec, snap) is None
    # Without the job running there, it is placed on "big".
    free = snapshot(sites, AFF_LINKS)
    assert placed(build_framework().schedule(spec, free))[0] == "big"


def test_job_selectors_match_the_tenants_own_jobs_and_never_name_another_tenants() -> None:
    # Matched against every tenant's jobs, beta's `apart_from_jobs: {team: red}` was explained as
    # "runs acme-secret-run labelled team=red", and `near_jobs` put it beside acme's job on purpose.
    other = dataclasses.replace(running("acme-secret-run", "a", team="red"), tenant="beta")

    def snap() -> Snapshot:
        return snapshot(AFF_SITES, AFF_LINKS, running=[other, running("own-db", "b", app="db")])

    fw = build_framework()
    apart = fw.schedule(job(affinity=Affinity(clusters=["a"], apart_from_jobs={"team": "red"})), snap())
    assert placed(apart) == ["a"] and "acme-secret-run" not in repr(apart.record.to_dict())
    state = fw.new_state(job(affinity=Affinity(near_jobs={"team": "red"})), snap())
    assert fw.run_pre_filters(state).ok and "affinity" in state.skipped  # nothing of its own to be near
    assert placed(fw.schedule(job(affinity=Affinity(near_jobs={"app": "db"})), snap())) == ["b"]


def test_unknown_required_region_is_unresolvable_but_one_known_name_is_enough() -> None:
    snap = snapshot(AFF_SITES, AFF_LINKS)
    outcome = build_framework().schedule(job(affinity=Affinity(regions=["mars-1"])), snap)
    assert outcome.impossible
    assert outcome.status.plugin == "affinity" and "mars-1" in outcome.status.reason
    assert placed(build_framework().schedule(job(affinity=Affinity(regions=["mars-1", "C"])), snap)) == ["c"]
    unknown_cluster = build_framework().schedule(job(affinity=Affinity(clusters=["zz"])), snap)
    assert unknown_cluster.impossible and "zz" in unknown_cluster.status.reason


def test_required_region_that_no_cluster_has_joined_yet_waits() -> None:
    snap = snapshot(AFF_SITES, AFF_LINKS, regions=["E"])
    outcome = build_framework().schedule(job(affinity=Affinity(regions=["E"])), snap)
    assert outcome.status.code == Code.UNSCHEDULABLE
    assert "E" in outcome.status.reason


def test_contradictory_rules_are_unresolvable_and_avoid_rules_prune_with_a_reason() -> None:
    snap = snapshot(AFF_SITES, AFF_LINKS)
    fw = build_framework()
    both = fw.schedule(job(affinity=Affinity(regions=["C"], avoid_regions=["C"])), snap)
    assert both.impossible
    mismatch = fw.schedule(job(affinity=Affinity(clusters=["a"], regions=["C"])), snap)
    assert mismatch.impossible
    avoided = fw.schedule(job(affinity=Affinity(avoid_clusters=["a"], avoid_regions=["C"])), snap)
    assert placed(avoided) == ["b"]
    assert avoided.record.pruned["a"] == "the job avoids this cluster"
    assert avoided.record.pruned["c"] == "the job avoids region C"


def test_near_jobs_prefers_the_same_cluster_then_the_same_region_then_the_nearest() -> None:
    sites: list[Site] = [*AFF_SITES, ("d", "D", "V100M16", 4)]
    links = [("A", "C", 80.0, 4.0), ("A", "D", 5.0, 4.0), ("C", "D", 80.0, 4.0)]
    snap = snapshot(sites, links, running=[running("db", "b", app="db")])
    spec = job(affinity=Affinity(near_jobs={"app": "db"}))
    fw = build_framework()
    assert placed(fw.schedule(spec, snap)) == ["b"]
    state = fw.new_state(spec, snap)
    assert fw.run_pre_filters(state).ok
    cands = fw.find_candidates(state)
    plugin = AffinityPlugin()
    scores = dict(
        zip(
            (snap.clusters[int(c)].id for c in cands.cluster),
            plugin.normalize(state, plugin.score(state, cands)),
            strict=True,
        )
    )
    assert scores["b"] == 100.0
    assert scores["b"] > scores["a"] > scores["d"] > scores["c"]


# ---- cost and energy ---------------------------------------------------------------------------


def test_cost_prefers_the_cleaner_region_at_the_hour_its_grid_is_cleaner() -> None:
    solar = [500.0] * 24
    for hour in range(10, 15):
        solar[hour] = 100.0
    economics = Economics(
        price_per_gpu_hour={"A": 2.0, "B": 2.0}, carbon_g_per_kwh={"A": solar, "B": [300.0]}
    )
    sites: list[Site] = [("a", "A", "V100M16", 4), ("b", "B", "V100M16", 4)]
    plugin = CostEnergy(price_weight=0.0, carbon_weight=1.0)
    fw = build_framework()
    for hour, cleaner in ((12, "a"), (0, "b")):
        snap = snapshot(sites, economics=economics, now=hour * 3600.0 + 86_400.0 * 3)
        state, cands = candidates_of(fw, job(), snap)
        scores = plugin.normalize(state, plugin.score(state, cands))
        best = snap.clusters[int(cands.cluster[int(np.argmax(scores))])].id
        assert best == cleaner


def test_cost_prefers_the_cheaper_price_per_scu_hour() -> None:
    economics = Economics(price_per_gpu_hour={"A": 2.0, "B": 3.0})
    speed = {("A100", "training_compute"): 2.0}
    sites: list[Site] = [("a", "A", "V100M16", 4), ("b", "B", "A100", 4)]
    plugin = CostEnergy(price_weight=1.0, carbon_weight=0.0)
    state, cands = candidates_of(build_framework(), job(), snapshot(sites, speed=speed, economics=economics))
    price, _ = plugin.price_and_carbon(state, cands)
    assert sorted(price.tolist()) == [1.5, 2.0]
    scores = dict(zip(cands.cluster.tolist(), plugin.score(state, cands).tolist(), strict=True))
    assert scores[state.snapshot.cluster_index["b"]] == 100.0
    assert scores[state.snapshot.cluster_index["a"]] == 0.0


def test_default_economics_covers_the_default_topology_with_a_solar_dip_at_local_noon() -> None:
    from loom.model.topology import load_topology

    economics = default_economics()
    regions = {r.id for r in load_topology().regions}
    assert regions == set(economics.price_per_gpu_hour) == set(economics.carbon_g_per_kwh)
    for region, mean in ANNUAL_CARBON_G_PER_KWH.items():
        profile = economics.carbon_g_per_kwh[region]
        assert len(profile) == 24
        assert sum(profile) / 24 == pytest.approx(mean, rel=1e-3)
    frankfurt = economics.carbon_g_per_kwh["aws-eu-central-1"]
    assert min(range(24), key=lambda h: frankfurt[h]) == 11  # 12:00 CET is 11:00 UTC
    assert frankfurt[11] < frankfurt[23]
    assert solar_dip_profile(100.0, 0.0, 0) == (100.0,) * 24


# ---- the profile and the 0-100 contract -------------------------------------------------------


def test_default_profile_registers_every_plugin_with_its_weight() -> None:
    names = set(default_registry().names())
    assert {"joint", "jct", "data_locality", "cost_energy", "affinity"} <= names
    assert set(DEFAULT_PLUGINS) <= names
    assert DEFAULT_WEIGHTS["joint"] == 3.0 and DEFAULT_WEIGHTS["jct"] == 2.0
    fw = build_framework(context={"economics": default_economics()})
    assert {p.name for p in fw.plugins} == set(DEFAULT_PLUGINS)  # type: ignore[attr-defined]


@cache
def default_snapshot() -> Snapshot:
    from loom.model.profiles import relative_speed
    from loom.model.scu import TASK_TYPES
    from loom.model.topology import load_topology

    topo = load_topology()
    nodes = [
        NodeCapacity(
            node=n.id,
            cluster=c.id,
            region=c.region,
            zone=c.zone,
            gpu_model=n.gpu_model,
            gpus_total=n.gpus,
            cpu_milli=n.cpu_milli,
            memory_mib=n.memory_mib,
        )
        for c in topo.clusters
        for n in c.nodes
    ]
    models = {n.gpu_model for n in nodes if n.gpu_model}
    speed = {(m, t): relative_speed(m, t) for m in models for t in TASK_TYPES}
    snap = Snapshot(
        nodes,
        net=NetMatrix.from_topology(topo),
        speed=speed,
        economics=default_economics(),
        now=1_700_000_000.0,
        running=[running("db", "c-weu-a", app="db")],
    )
    snap.net.set_link(
        "gcp-asia-southeast1", "aws-eu-central-1", rtt_ms=400.0, bandwidth_gbps=0.2, loss=0.05, degraded=True
    )
    return snap


REGIONS = [
    "aws-eu-central-1",
    "aws-us-east-2",
    "azure-westeurope",
    "azure-australiaeast",
    "gcp-asia-southeast1",
    "gcp-southamerica-east1",
]


@st.composite
def any_job(draw: st.DrawFn) -> JobSpec:
    """Jobs of every kind the plugins treat differently, against the default topology."""
    data = draw(
        st.one_of(st.none(), st.tuples(st.sampled_from(REGIONS), st.floats(0, 50_000), st.booleans()))
    )
    return job(
        task_type=draw(
            st.sampled_from(["training_compute", "training_memory", "training_comm", "inference"])
        ),
        workers=draw(st.integers(1, 600)),
        gpus=draw(st.sampled_from([1, 2, 4, 8])),
        allow_multi_cluster=draw(st.booleans()),
        comm=Communication(bytes_per_step=draw(st.integers(0, 10**10))),
        data=None
        if data is None
        else DataSpec(
            dataset="d", region=data[0], size_gb=data[1], start="after_sync" if data[2] else "while_syncing"
        ),
        affinity=Affinity(
            prefer_regions=draw(st.lists(st.sampled_from(REGIONS), max_size=2)),
            near_jobs={"app": "db"} if draw(st.booleans()) else {},
        ),
    )


@settings(max_examples=40, deadline=None)
@given(spec=any_job())
def test_every_score_stays_within_0_100_on_the_default_topology(spec: JobSpec) -> None:
    # The framework raises when a plugin's normalised score leaves 0-100.
    outcome = build_framework().schedule(spec, default_snapshot(), apply=False)
    assert outcome.status.code in (Code.SUCCESS, Code.UNSCHEDULABLE, Code.UNRESOLVABLE), outcome.status
    for cand in outcome.record.candidates:
        assert all(0.0 <= s <= 100.0 for s in cand.scores.values())
    if outcome.decision is not None and outcome.decision.predicted_step_s is not None:
        assert outcome.decision.slowdown >= 1.0
