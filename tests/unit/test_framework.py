"""The scheduling framework: extension points, statuses, pruning, scoring, and its invariants.

The property tests drive the default profile (the one the placement service runs) over random
platforms and job streams and check what must always hold: no node ever gives more GPUs than it
has, no job is placed twice, a gang gets all its workers or nothing, and no tenant exceeds its quota.
"""

import itertools
from collections.abc import Sequence

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loom.model.capacity import NodeCapacity
from loom.model.topology import load_topology
from loom.sched import pipeline
from loom.sched.explain import render
from loom.sched.framework import (
    SUCCESS,
    Candidates,
    Code,
    CycleState,
    DecisionRecord,
    Framework,
    QueueItem,
    Registry,
    RegistryError,
    Status,
    extension_points,
)
from loom.sched.plugins.compute import ScuFit, WaterLevel
from loom.sched.plugins.quota import Preempt, Quota
from loom.sched.plugins.resources import ResourceFit
from loom.sched.profile import build_framework
from loom.sched.quota import QuotaBook, TenantConfig, TenantQuota
from loom.sched.snapshot import ClusterInfo, FloatArray, NetMatrix, RunningJob, Snapshot
from loom_proto.jobs import JobSpec, Layer, Pipeline, Resources, Work


def node(
    name: str, cluster: str, region: str, *, model: str = "A100", gpus: int = 8, reserved: int = 0
) -> NodeCapacity:
    return NodeCapacity(
        node=name,
        cluster=cluster,
        region=region,
        zone=f"{region}-a",
        gpu_model=model,
        gpus_total=gpus,
        gpus_reserved=reserved,
        cpu_milli=64_000,
        memory_mib=512 * 1024,
    )


def job(job_id: str, *, gpus: int = 1, workers: int = 1, tenant: str = "t", **kw: object) -> JobSpec:
    return JobSpec(
        job_id=job_id,
        tenant=tenant,
        workers=workers,
        resources=Resources(gpus=gpus, **kw.pop("resources", {})),  # type: ignore[arg-type]
        work=Work(steps=100, step_time_s=1.0),
        **kw,  # type: ignore[arg-type]
    )


def two_clusters() -> Snapshot:
    nodes = [node(f"a{i}", "ca", "r1") for i in range(2)] + [
        node(f"b{i}", "cb", "r2", model="T4", gpus=4) for i in range(3)
    ]
    speed = {("A100", t): 3.0 for t in ("training_compute", "training_memory", "training_comm", "inference")}
    speed |= {("T4", t): 0.5 for t in ("training_compute", "training_memory", "training_comm", "inference")}
    return Snapshot(nodes, net=NetMatrix(["r1", "r2"]), speed=speed, now=1_700_000_000.0)


class Always:
    """A score plugin that prefers one cluster: for checking weights and normalisation."""

    name = "always"

    def __init__(self, favourite: str) -> None:
        self.favourite = favourite

    def score(self, state: CycleState, candidates: Candidates) -> FloatArray:
        ids = [state.snapshot.clusters[int(c)].id for c in candidates.cluster]
        return np.array([1.0 if c == self.favourite else 0.0 for c in ids])

    def normalize(self, state: CycleState, raw: FloatArray) -> FloatArray:
        return raw * 100.0


class Broken:
    name = "broken"

    def score(self, state: CycleState, candidates: Candidates) -> FloatArray:
        return np.zeros(len(candidates))

    def normalize(self, state: CycleState, raw: FloatArray) -> FloatArray:
        return raw + 500.0


def test_each_plugin_satisfies_the_protocols_it_claims() -> None:
    assert extension_points(ResourceFit()) == ["pre_filter", "filter"]
    assert extension_points(ScuFit()) == ["score"]
    assert set(extension_points(Quota())) == {"pre_filter", "reserve"}
    assert extension_points(Preempt()) == ["post_filter"]
    framework = build_framework()
    for plugin in framework.plugins:
        assert extension_points(plugin), plugin


def test_the_registry_refuses_duplicates_and_unknown_names() -> None:
    registry = Registry()
    registry.register("x", lambda _c: ScuFit())
    with pytest.raises(RegistryError, match="already registered"):
        registry.register("x", lambda _c: ScuFit())
    with pytest.raises(RegistryError, match="unknown plugin 'y'"):
        registry.build("y")
    with pytest.raises(RegistryError, match="duplicate"):
        Framework([ScuFit(), ScuFit()])
    with pytest.raises(RegistryError, match="weight"):
        Framework([ScuFit()], {"scu_fit": -1.0})


def test_weights_decide_between_plugins_that_disagree() -> None:
    plugins = [ResourceFit(), ScuFit(), Always("cb")]
    by_compute = Framework(plugins, {"scu_fit": 10.0, "always": 1.0}).schedule(job("j"), two_clusters())
    by_favourite = Framework(plugins, {"scu_fit": 1.0, "always": 10.0}).schedule(job("j"), two_clusters())
    assert by_compute.decision and by_compute.decision.lead.cluster == "ca"
    assert by_favourite.decision and by_favourite.decision.lead.cluster == "cb"


def test_a_score_outside_0_to_100_is_refused() -> None:
    with pytest.raises(ValueError, match="outside 0-100"):
        Framework([Broken()]).schedule(job("j"), two_clusters())


class NotANumber:
    name = "nan"

    def score(self, state: CycleState, candidates: Candidates) -> FloatArray:
        return np.zeros(len(candidates))

    def normalize(self, state: CycleState, raw: FloatArray) -> FloatArray:
        return raw * np.nan


def test_the_range_check_names_the_first_plugin_out_of_range() -> None:
    # The scores are checked at once after every plugin scored: a plugin in range before it does
    # not hide a broken one, and of two broken ones the first in order is named.
    with pytest.raises(ValueError, match="plugin broken produced"):
        Framework([ScuFit(), Broken()]).schedule(job("j"), two_clusters())
    with pytest.raises(ValueError, match="plugin nan produced"):
        Framework([NotANumber(), Broken()]).schedule(job("j"), two_clusters())
    with pytest.raises(ValueError, match="plugin broken produced"):
        Framework([Broken(), NotANumber()]).schedule(job("j"), two_clusters())
    assert Framework([ScuFit(), Always("ca")]).schedule(job("j"), two_clusters()).decision is not None


def test_hierarchical_pruning_records_why_each_cluster_was_ruled_out() -> None:
    outcome = Framework([ResourceFit(), ScuFit()]).schedule(job("big", gpus=8, workers=2), two_clusters())
    assert outcome.decision is not None and outcome.decision.lead.cluster == "ca"
    assert "cb" in outcome.record.pruned
    assert outcome.record.pruned["cb"] == "region r2 has 12 free GPUs; the job needs 16"


def test_a_gang_that_can_never_fit_is_unresolvable_with_an_actionable_reason() -> None:
    outcome = Framework([ResourceFit()]).schedule(job("huge", gpus=8, workers=3), two_clusters())
    assert outcome.status.code == Code.UNRESOLVABLE
    assert "allow_multi_cluster" in outcome.status.reason
    too_wide = Framework([ResourceFit()]).schedule(job("wide", gpus=16), two_clusters())
    assert too_wide.status.code == Code.UNRESOLVABLE and "at most 8 per worker" in too_wide.status.reason


def test_a_spanning_gang_counts_one_gpu_model_per_cluster_when_judging_if_it_can_ever_fit() -> None:
    # A spread takes one GPU model per cluster: clusters of 1 A100 node and 1 T4 node hold two
    # 8-GPU workers for a spanning gang, not four. Counting every model of them left a gang of
    # three workers waiting for ever ("would fit but the GPUs are taken").
    nodes = [node(f"{c}a", c, "r1") for c in ("ca", "cb")] + [
        node(f"{c}t", c, "r1", model="T4") for c in ("ca", "cb")
    ]
    snap = Snapshot(nodes, net=NetMatrix(["r1"]))
    framework = Framework([ResourceFit()])
    outcome = framework.schedule(job("stuck", gpus=8, workers=3, allow_multi_cluster=True), snap)
    assert outcome.status.code == Code.UNRESOLVABLE
    assert "2 such worker(s)" in outcome.status.reason
    fits = framework.schedule(job("fits", gpus=8, workers=2, allow_multi_cluster=True), snap)
    assert fits.decision is not None and len(fits.decision.parts) == 2


def test_a_spanning_gang_that_fits_is_spread_even_when_the_best_scored_pool_of_a_cluster_is_small() -> None:
    # Cluster ca: one fast A100 node and two slow T4 nodes; cb: one A100 node. By score the spread
    # took ca's A100 pool (one 8-GPU worker) and cb's (one) and stopped at two of three workers,
    # though ca's T4 pool holds two: the gang "would fit" and waited for ever.
    nodes = [
        node("ca-a", "ca", "r1"),
        node("ca-t0", "ca", "r1", model="T4"),
        node("ca-t1", "ca", "r1", model="T4"),
    ]
    nodes.append(node("cb-a", "cb", "r1"))
    speed = {("A100", t): 3.0 for t in ("training_compute", "training_memory", "training_comm", "inference")}
    speed |= {("T4", t): 0.5 for t in ("training_compute", "training_memory", "training_comm", "inference")}
    snap = Snapshot(nodes, net=NetMatrix(["r1"]), speed=speed)
    outcome = Framework([ResourceFit(), ScuFit()]).schedule(
        job("g", gpus=8, workers=3, allow_multi_cluster=True), snap
    )
    assert outcome.decision is not None, outcome.record.reason
    assert sorted((p.cluster, p.gpu_model) for p in outcome.decision.parts) == [("ca", "T4"), ("cb", "A100")]
    assert outcome.decision.workers == 3


def test_a_job_that_fits_but_finds_the_gpus_taken_waits() -> None:
    snap = two_clusters()
    framework = Framework([ResourceFit(), ScuFit()])
    first = framework.schedule(job("first", gpus=8, workers=2), snap)
    assert first.decision is not None
    second = framework.schedule(job("second", gpus=8, workers=2), snap)
    assert second.status.code == Code.UNSCHEDULABLE
    assert "taken" in second.status.reason


def test_an_unknown_gpu_model_is_rejected_at_once() -> None:
    outcome = Framework([ResourceFit(["A100", "T4", "H100"])]).schedule(
        job("j", resources={"gpu_models": ["Z9000"]}), two_clusters()
    )
    assert outcome.status.code == Code.UNRESOLVABLE and "Z9000" in outcome.status.reason


def test_a_multi_cluster_gang_spreads_over_the_best_clusters() -> None:
    snap = two_clusters()
    outcome = Framework([ResourceFit(), ScuFit()]).schedule(
        job("spread", gpus=4, workers=6, allow_multi_cluster=True), snap
    )
    assert outcome.decision is not None
    assert [p.cluster for p in outcome.decision.parts] == ["ca", "cb"]
    assert sum(g for _, g in outcome.decision.allocations) == 24


def test_small_jobs_fill_partly_used_nodes_and_leave_empty_ones_whole_for_gangs() -> None:
    # Four 8-GPU nodes. Most room first put each small job on an empty node, so three 1-GPU jobs
    # broke three nodes and a gang of 2 x 8 GPUs no longer fit the cluster.
    snap = Snapshot([node(f"n{i}", "ca", "r1") for i in range(4)], net=NetMatrix(["r1"]))
    framework = Framework([ResourceFit(), ScuFit()])
    used: set[str] = set()
    for i in range(3):
        outcome = framework.schedule(job(f"small{i}", gpus=1), snap)
        assert outcome.decision is not None
        used |= {n for n, _ in outcome.decision.allocations}
    assert len(used) == 1
    gang = framework.schedule(job("gang", gpus=8, workers=2), snap)
    assert gang.decision is not None and gang.decision.parts[0].cluster == "ca"
    # A gang still takes as few nodes as it can: the two emptiest whole nodes, not the partial one.
    assert sorted(g for _, g in gang.decision.allocations) == [8, 8]
    # The part of a gang that does not fill a node goes to the tightest node that holds it.
    tail = framework.schedule(job("tail", gpus=1, workers=9), snap)
    assert tail.decision is not None
    assert sorted(g for _, g in tail.decision.allocations) == [1, 8]


def test_elastic_jobs_start_with_what_fits_but_never_below_their_minimum() -> None:
    snap = two_clusters()
    framework = Framework([ResourceFit(), ScuFit()])
    outcome = framework.schedule(job("el", gpus=8, workers=4, min_workers=2), snap)
    assert outcome.decision is not None and outcome.decision.workers == 2
    again = framework.schedule(
        job("el2", gpus=4, workers=4, min_workers=4, resources={"gpu_models": ["A100"]}), snap
    )
    assert again.decision is None


def test_preemption_stops_the_lowest_priority_least_progressed_job() -> None:
    nodes = [node("a0", "ca", "r1", reserved=8)]
    running = [
        RunningJob(
            job_id="old",
            tenant="t",
            priority=10,
            cluster="ca",
            gpu_model="A100",
            allocations=(("a0", 4),),
            progress=0.9,
        ),
        RunningJob(
            job_id="new",
            tenant="t",
            priority=10,
            cluster="ca",
            gpu_model="A100",
            allocations=(("a0", 4),),
            progress=0.1,
        ),
    ]
    snap = Snapshot(nodes, running=running, net=NetMatrix(["r1"]))
    framework = Framework([ResourceFit(), ScuFit(), Preempt()])
    outcome = framework.schedule(job("vip", gpus=4, priority=500), snap)
    assert outcome.decision is not None and outcome.decision.victims == ("new",)
    assert outcome.record.victims == ["new"]
    equal = framework.schedule(
        job("peer", gpus=4, priority=10), Snapshot(nodes, running=running, net=NetMatrix(["r1"]))
    )
    assert equal.decision is None  # equal priority never preempts
    # The record is the preempting job's tenant's to read: another tenant's victim is counted,
    # not named (its id told one tenant what another runs).
    other = Framework([ResourceFit(), ScuFit(), Preempt()]).schedule(
        job("vip2", gpus=4, priority=500, tenant="u"), Snapshot(nodes, running=running, net=NetMatrix(["r1"]))
    )
    assert other.decision is not None and other.decision.victims == ("new",)  # still stopped
    assert other.record.victims == ["1 job(s) of other tenants"]
    assert not any("new" in note for note in other.record.notes), other.record.notes


def test_quota_makes_a_tenant_wait_or_rejects_what_could_never_fit() -> None:
    config = TenantConfig(tenants={"acme": TenantQuota(name="acme", cohort=None, gpus=8)}, open=False)
    framework = Framework([ResourceFit(), Quota(), ScuFit()])
    snap = two_clusters()
    snap.quota = QuotaBook(config, {"acme": 4})
    assert framework.schedule(job("fits", gpus=4, tenant="acme"), snap).decision is not None
    waits = framework.schedule(job("waits", gpus=4, tenant="acme"), snap)
    assert waits.status.code == Code.UNSCHEDULABLE and waits.status.plugin == "quota"
    never = framework.schedule(job("never", gpus=8, workers=2, tenant="acme"), snap)
    assert never.status.code == Code.UNRESOLVABLE
    stranger = framework.schedule(job("who", tenant="nobody"), snap)
    assert stranger.status.code == Code.UNRESOLVABLE and "no quota" in stranger.status.reason
    assert (never.status.reject, stranger.status.reject) == ("quota", "unknown_tenant")
    assert snap.quota is not None and snap.quota.held("acme") == 8  # the placement counts at once


def test_a_refused_permit_gives_the_reservation_back() -> None:
    class Deny:
        name = "deny"

        def permit(self, state: CycleState, decision: object) -> Status:
            return Status(Code.UNSCHEDULABLE, "not today")

    config = TenantConfig(tenants={"acme": TenantQuota(name="acme", cohort=None, gpus=8)}, open=False)
    book = QuotaBook(config, {})
    snap = two_clusters()
    snap.quota = book
    outcome = Framework([ResourceFit(), Quota(), Deny()]).schedule(job("j", gpus=4, tenant="acme"), snap)
    assert outcome.decision is None and outcome.status.plugin == "deny"
    assert book.held("acme") == 0


def test_the_record_round_trips_and_renders_why_here_and_why_not_there() -> None:
    outcome = build_framework().schedule(job("j", gpus=2), two_clusters())
    record = DecisionRecord.from_dict(outcome.record.to_dict())
    assert record == outcome.record
    lines = render(record)
    assert lines[0].startswith("Job j: placed")
    assert any(line.startswith(("Why ca", "Why cb")) for line in lines)
    assert any(line.startswith("Why not") for line in lines)


def test_explain_after_a_preemption_or_a_spread_says_nothing_it_contradicts() -> None:
    from loom.sched.framework import CandidateRecord

    def cand(cluster: str, total: float, **scores: float) -> CandidateRecord:
        return CandidateRecord(cluster, "r1", "V100", 4, scores, {}, total)

    weights = {"scu_fit": 4.0, "water_level": 1.0}
    preempted = DecisionRecord(
        "high-1",
        0.0,
        "placed",
        "placed 1 worker(s) x 1 GPU(s) on c-sea1-a with score 90.0",
        weights,
        [
            cand("c-sea1-a", 90.0, scu_fit=100.0, water_level=50.0),
            cand("c-x", 60.0, scu_fit=100.0, water_level=10.0),
        ],
        {"c-sea1-a": "region r1 has 1 free V100 GPUs"},
        ["c-sea1-a"],
        victims=["1 job(s) of other tenants"],
    )
    lines = render(preempted)
    # It said "Why not c-sea1-a: ruled out" under "placed on c-sea1-a" (the pruning from before).
    assert not any(line.startswith("Why not c-sea1-a") for line in lines), lines
    assert "c-sea1-a had no room at first (region r1 has 1 free V100 GPUs); stopping them made it." in lines
    # scu_fit scored both alike (100): not a reason; water_level set it apart.
    (why,) = [line for line in lines if line.startswith("Why c-sea1-a")]
    assert "load balance 50/100" in why and "100/100" not in why, why
    spread = DecisionRecord(
        "span-yes",
        0.0,
        "placed",
        "placed 7 worker(s) across c-sea1-a, c-weu-a with score 80.9",
        weights,
        [cand("c-sea1-a", 86.9, scu_fit=100.0, water_level=60.0), cand("c-weu-a", 70.0, scu_fit=90.0)],
        {},
        ["c-sea1-a", "c-weu-a"],
    )
    # "score 80.9" then "Why c-sea1-a: total 86.9" read as a contradiction: the lead cluster's own.
    assert any(
        line.startswith("Its lead part, c-sea1-a (V100), scored total 86.9 as a cluster of its own")
        for line in render(spread)
    )


def test_the_stored_record_without_raw_values_explains_the_same_and_is_smaller() -> None:
    outcome = build_framework().schedule(job("j", gpus=2), two_clusters())
    full, stored = outcome.record.to_dict(), outcome.record.to_dict(raw=False)
    assert "raw" in full["candidates"] and "raw" not in stored["candidates"]
    assert len(msgspec.json.encode(stored)) < len(msgspec.json.encode(full))
    record = DecisionRecord.from_dict(stored)
    assert record.candidates and all(c.raw == {} for c in record.candidates)
    assert [c.scores for c in record.candidates] == [c.scores for c in outcome.record.candidates]
    assert render(record) == render(outcome.record)


# ---- properties over the default profile -------------------------------------------------------


@st.composite
def platforms(draw: st.DrawFn) -> list[NodeCapacity]:
    clusters = draw(st.integers(1, 4))
    nodes = []
    for c in range(clusters):
        for n in range(draw(st.integers(1, 5))):
            gpus = draw(st.sampled_from([1, 2, 4, 8]))
            nodes.append(
                node(
                    f"c{c}n{n}",
                    f"c{c}",
                    f"r{c % 2}",
                    model=draw(st.sampled_from(["A100", "T4"])),
                    gpus=gpus,
                    reserved=draw(st.integers(0, gpus)),
                )
            )
    return nodes


@st.composite
def workloads(draw: st.DrawFn) -> list[JobSpec]:
    jobs = []
    for i in range(draw(st.integers(1, 25))):
        jobs.append(
            job(
                f"j{i}",
                gpus=draw(st.sampled_from([1, 2, 4, 8])),
                workers=draw(st.integers(1, 4)),
                tenant=draw(st.sampled_from(["t1", "t2"])),
                priority=draw(st.integers(0, 3)) * 100,
                allow_multi_cluster=draw(st.booleans()),
            )
        )
    return jobs


def check_invariants(
    nodes: Sequence[NodeCapacity], jobs: Sequence[JobSpec], framework: Framework, snap: Snapshot
) -> dict[str, int]:
    free0 = {n.node: n.gpus_free for n in nodes}
    placed: dict[str, int] = {}
    taken: dict[str, int] = {}
    items = [QueueItem(job=spec, submitted_at=float(i)) for i, spec in enumerate(jobs)]
    for item, outcome in framework.schedule_many(items, snap):
        spec = item.job
        assert (outcome.decision is None) == (outcome.status != SUCCESS)
        if outcome.decision is None:
            continue
        assert spec.job_id not in placed, "a job placed twice"
        d = outcome.decision
        gpus = sum(g for _, g in d.allocations)
        placed[spec.job_id] = gpus
        # All or nothing: exactly the workers decided, each with its GPUs on one node.
        assert d.workers == spec.workers  # no elastic jobs here
        assert gpus == spec.workers * spec.resources.gpus
        assert all(g % spec.resources.gpus == 0 for _, g in d.allocations)
        if not spec.allow_multi_cluster:
            assert len(d.parts) == 1
        for n, g in d.allocations:
            taken[n] = taken.get(n, 0) + g
    for n, g in taken.items():
        assert g <= free0[n], f"node {n} gave {g} GPUs with {free0[n]} free"
        assert snap.free[snap.node_index[n]] == free0[n] - g
    assert (snap.free >= 0).all()
    return placed


@settings(max_examples=60, deadline=None)
@given(platforms(), workloads())
def test_capacity_is_never_negative_nor_a_job_placed_twice_and_gangs_are_whole(
    nodes: list[NodeCapacity], jobs: list[JobSpec]
) -> None:
    snap = Snapshot(nodes, net=NetMatrix.from_topology(load_topology("small")))
    placed = check_invariants(nodes, jobs + jobs, build_framework(), snap)
    # A second cycle over the same queue: jobs already holding GPUs are never placed again.
    snap.running = [
        RunningJob(job_id=j, tenant="t", priority=0, cluster="c0", gpu_model="A100", allocations=())
        for j in placed
    ]
    again = build_framework().schedule_many([QueueItem(job=s, submitted_at=0.0) for s in jobs], snap)
    assert not {item.job.job_id for item, _ in again} & set(placed)


@settings(max_examples=60, deadline=None)
@given(platforms(), workloads(), st.integers(0, 16), st.integers(0, 16))
def test_quotas_are_never_exceeded(nodes: list[NodeCapacity], jobs: list[JobSpec], q1: int, q2: int) -> None:
    config = TenantConfig(
        tenants={
            "t1": TenantQuota(name="t1", cohort="lab", gpus=q1, borrowing_limit=4),
            "t2": TenantQuota(name="t2", cohort="lab", gpus=q2),
        },
        open=False,
    )
    book = QuotaBook(config, {})
    framework = Framework([ResourceFit(), Quota(), ScuFit(), WaterLevel()])
    snap = Snapshot(nodes, net=NetMatrix(["r0", "r1"]))
    snap.quota = book
    placed = check_invariants(nodes, jobs, framework, snap)
    held = {"t1": 0, "t2": 0}
    for spec in jobs:
        held[spec.tenant] += placed.get(spec.job_id, 0)
    assert held == {t: book.held(t) for t in held}
    assert held["t1"] <= q1 + 4
    assert held["t1"] + held["t2"] <= q1 + q2


def test_a_model_too_big_for_any_cluster_is_cut_into_pipeline_stages() -> None:
    from loom_proto.jobs import Layer, Pipeline

    nodes = [node(f"a{i}", "ca", "r1") for i in range(2)] + [node(f"b{i}", "cb", "r2") for i in range(2)]
    snap = Snapshot(nodes, net=NetMatrix(["r1", "r2"]), gpu_memory_gib={"A100": 80.0}, now=0.0)
    snap.net.set_link("r1", "r2", rtt_ms=20.0, bandwidth_gbps=10.0)
    snap.net.set_link("r2", "r1", rtt_ms=20.0, bandwidth_gbps=10.0)
    # 8 layers x 150 GiB = 1200 GiB: one cluster's 16 A100s hold 16 x 72 = 1152 GiB usable.
    layers = [Layer(compute_s=1.0, memory_gib=150.0, activation_mb=10.0) for _ in range(8)]
    spec = job("llm", pipeline=Pipeline(layers=layers, max_stages=4))
    outcome = build_framework().schedule(spec, snap)
    assert outcome.decision is not None, outcome.status
    parts = outcome.decision.parts
    assert [p.cluster for p in sorted(parts, key=lambda p: p.layers or (0, 0))] in (
        ["ca", "cb"],
        ["cb", "ca"],
    )
    covered = sorted(p.layers for p in parts if p.layers is not None)
    assert covered[0][0] == 0 and covered[-1][1] == 7
    assert all(a[1] + 1 == b[0] for a, b in itertools.pairwise(covered))
    assert outcome.decision.predicted_step_s and outcome.decision.predicted_step_s > 0
    assert any("pipeline of 2 stage(s)" in n for n in outcome.record.notes)
    # Every GPU taken is within what the nodes had.
    assert (snap.free >= 0).all()
    # Twice the model can never fit the platform at all: rejected at once, with the reason.
    huge = job("huge", pipeline=Pipeline(layers=layers * 2, max_stages=4))
    never = build_framework().schedule(
        huge, Snapshot(nodes, net=NetMatrix(["r1", "r2"]), gpu_memory_gib={"A100": 80.0})
    )
    assert never.status.code == Code.UNRESOLVABLE and never.status.plugin == "pipeline"
    # Judged on every GPU, busy or not: the reason does not call them free.
    assert "the largest total is" in never.status.reason and "free" not in never.status.reason


def test_a_pipeline_stage_takes_no_more_gpus_of_a_node_than_its_cpu_allows() -> None:
    # Each node has 64 cores; each stage GPU asks 30: at most 2 GPUs of a node. Before, the planner
    # counted GPUs only and put more on a node than its CPU held; the snapshot clamped the take at
    # 0 and gave the whole request back at the end (a node with more cores free than it has).
    nodes = [node(f"a{i}", "ca", "r1") for i in range(4)]
    snap = Snapshot(nodes, net=NetMatrix(["r1"]), gpu_memory_gib={"A100": 80.0}, now=0.0)
    layers = [Layer(compute_s=1.0, memory_gib=100.0, activation_mb=10.0) for _ in range(4)]  # 6 GPUs
    spec = job("llm", pipeline=Pipeline(layers=layers, max_stages=4), resources={"cpu_milli": 30_000})
    outcome = build_framework().schedule(spec, snap)
    assert outcome.decision is not None, outcome.status
    per_node: dict[str, int] = {}
    for part in outcome.decision.parts:
        for name, gpus in part.allocations:
            per_node[name] = per_node.get(name, 0) + gpus
    assert per_node and max(per_node.values()) <= 2, per_node
    assert (snap.cpu_free >= 0).all() and (snap.cpu_free <= snap.cpu_cap).all()


def test_a_pipeline_goes_to_the_pool_whose_nodes_have_the_cpu_it_asks() -> None:
    # The A100 nodes have 16 cores, the T4 nodes 256; each stage GPU asks 32. The cluster's pool
    # was chosen by GPUs alone (A100), its nodes then offered nothing, and the job was rejected
    # ("none of the 1 site(s) offered has GPUs...") though the T4s hold it (a review).
    def cap(name: str, model: str, gpus: int, cpu: int) -> NodeCapacity:
        return NodeCapacity(
            node=name,
            cluster="ca",
            region="r1",
            zone="r1-a",
            gpu_model=model,
            gpus_total=gpus,
            cpu_milli=cpu,
            memory_mib=512 * 1024,
        )

    nodes = [cap(f"a{i}", "A100", 8, 16_000) for i in range(2)] + [
        cap(f"t{i}", "T4", 4, 256_000) for i in range(2)
    ]
    speed = {
        (model, t): v for model, v in (("A100", 3.0), ("T4", 0.5)) for t in ("training_compute", "inference")
    }
    snap = Snapshot(
        nodes, net=NetMatrix(["r1"]), speed=speed, gpu_memory_gib={"A100": 80.0, "T4": 16.0}, now=0.0
    )
    layers = [Layer(compute_s=1.0, memory_gib=4.0, activation_mb=10.0) for _ in range(2)]
    spec = job("p", pipeline=Pipeline(layers=layers, max_stages=2), resources={"cpu_milli": 32_000})
    outcome = build_framework().schedule(spec, snap)
    assert outcome.decision is not None, outcome.status
    assert {p.gpu_model for p in outcome.decision.parts} == {"T4"}


def test_cpu_given_back_never_exceeds_what_a_node_has() -> None:
    snap = Snapshot([node("a0", "ca", "r1")], net=NetMatrix(["r1"]), now=0.0)
    snap.take((("a0", 3),), 1, cpu_milli=30_000)  # 90 cores asked of 64: clamped at 0
    assert snap.cpu_free[0] == 0
    snap.give_back((("a0", 3),), 1, cpu_milli=30_000)
    assert snap.cpu_free[0] == 64_000 and snap.free[0] == 8


def test_a_running_pipeline_is_timed_now_as_its_candidates_are_on_its_own_gpus() -> None:
    # Placement's what-if timed a running pipeline as one data-parallel gang over its parts (a
    # 131 ms step judged 7.8 s here, 60x too slow), so every move of a pipeline looked a gain.
    from loom_proto.jobs import Layer, Pipeline

    nodes = [node(f"a{i}", "ca", "r1") for i in range(2)] + [node(f"b{i}", "cb", "r2") for i in range(2)]
    snap = Snapshot(nodes, net=NetMatrix(["r1", "r2"]), gpu_memory_gib={"A100": 80.0}, now=0.0)
    for a, b in (("r1", "r2"), ("r2", "r1")):
        snap.net.set_link(a, b, rtt_ms=20.0, bandwidth_gbps=10.0)
    layers = [Layer(compute_s=1.0, memory_gib=150.0, activation_mb=10.0) for _ in range(8)]
    spec = job("llm", pipeline=Pipeline(layers=layers, max_stages=4))
    decision = build_framework().schedule(spec, snap).decision
    assert decision is not None and decision.predicted_step_s is not None
    parts = [(p.cluster, p.gpu_model, list(p.allocations)) for p in decision.parts]
    # Its own GPUs, taken now in the snapshot: timed as placed, whatever else is free.
    now = Framework.pipeline_step_now(spec, parts, snap)
    assert now == pytest.approx(decision.predicted_step_s)
    # The link between its stages slows: its step now is the slower hop's.
    for a, b in (("r1", "r2"), ("r2", "r1")):
        snap.net.set_link(a, b, rtt_ms=2_000.0, bandwidth_gbps=0.001)
    slowed = Framework.pipeline_step_now(spec, parts, snap)
    assert slowed is not None and slowed > 10 * decision.predicted_step_s
    assert slowed == pytest.approx(pipeline.transfer_s(10.0, 2_000.0, 0.001), rel=0.01)
    assert Framework.pipeline_step_now(spec, [("nowhere", "A100", [("x", 1)])], snap) is None


def full_of_elastic_and_rigid() -> Snapshot:
    """Two full 8-GPU A100 nodes: an elastic job of priority 100 on 12 GPUs (it may shrink to 4) and
    a rigid job of priority 10 on 4."""
    nodes = [node("a0", "ca", "r1", reserved=8), node("a1", "ca", "r1", reserved=8)]
    running = [
        RunningJob(
            job_id="elastic",
            tenant="t",
            priority=100,
            cluster="ca",
            gpu_model="A100",
            allocations=(("a0", 8), ("a1", 4)),
            workers=12,
            min_workers=4,
            max_workers=12,
            gpus_per_worker=1,
        ),
        RunningJob(
            job_id="rigid", tenant="t", priority=10, cluster="ca", gpu_model="A100", allocations=(("a1", 4),)
        ),
    ]
    return Snapshot(nodes, running=running, net=NetMatrix(["r1"]))


def test_under_pressure_elastic_jobs_shrink_before_anyone_is_preempted() -> None:
    snap = full_of_elastic_and_rigid()
    outcome = build_framework().schedule(job("newcomer", gpus=4, priority=100), snap)
    assert outcome.decision is not None
    assert outcome.decision.victims == ()  # nobody stopped: the elastic job gave workers back
    ((job_id, workers, allocations),) = outcome.decision.shrunk
    assert job_id == "elastic" and 4 <= workers <= 8
    assert sum(g for _, g in allocations) == workers
    assert sum(g for _, g in outcome.decision.allocations) == 4
    assert (snap.free >= 0).all()
    # A job of higher priority than the elastic job, with no elastic room left, preempts instead.
    assert any("shrinking elastic" in n for n in outcome.record.notes)


def test_a_preemption_refused_later_in_the_cycle_leaves_the_victims_running() -> None:
    nodes = [node("a0", "ca", "r1", reserved=8)]
    running = [
        RunningJob(
            job_id="low", tenant="t", priority=1, cluster="ca", gpu_model="A100", allocations=(("a0", 8),)
        )
    ]
    snap = Snapshot(nodes, running=running, net=NetMatrix(["r1"]))

    class Deny:
        name = "deny"

        def permit(self, state: CycleState, decision: object) -> Status:
            return Status(Code.UNSCHEDULABLE, "not now")

    # The preemptor is refused at permit, after the post-filter gave the victim's GPUs back.
    framework = Framework([ResourceFit(), ScuFit(), Preempt(), Deny()])
    outcome = framework.schedule(job("vip-job", gpus=4, priority=900), snap)
    assert outcome.decision is None
    assert [r.job_id for r in snap.running] == ["low"]
    assert int(snap.free[snap.node_index["a0"]]) == 0  # the victim's GPUs are still its own


def test_an_elastic_job_gets_only_as_many_workers_as_its_quota_allows() -> None:
    config = TenantConfig(tenants={"acme": TenantQuota(name="acme", cohort=None, gpus=8)}, open=False)
    framework = Framework([ResourceFit(), Quota(), ScuFit()])
    snap = two_clusters()
    snap.quota = QuotaBook(config, {})
    outcome = framework.schedule(job("el", gpus=1, workers=16, min_workers=2, tenant="acme"), snap)
    assert outcome.decision is not None and outcome.decision.workers == 8


def test_a_job_whose_only_cluster_failed_to_start_it_waits_and_is_not_rejected() -> None:
    snap = two_clusters()
    framework = Framework([ResourceFit(), ScuFit()])
    spec = job("picky", gpus=8, workers=2, resources={"gpu_models": ["A100"]})
    outcome = framework.schedule(spec, snap, avoid_clusters=["ca"])
    # "ca" is the only cluster with A100s: avoiding it is a preference, so the job is placed there.
    assert outcome.decision is not None and outcome.decision.lead.cluster == "ca"


def test_a_cluster_an_earlier_attempt_left_is_ruled_out_with_every_cause_that_leaves_one() -> None:
    from loom.sched.framework import AVOIDED_REASON

    snap = two_clusters()
    outcome = Framework([ResourceFit(), ScuFit()]).schedule(job("moved", gpus=1), snap, avoid_clusters=["ca"])
    assert outcome.decision is not None and outcome.decision.lead.cluster == "cb"
    # A drain or a migration leaves a cluster as a failed start does: the reason names them all.
    assert outcome.record.pruned["ca"] == AVOIDED_REASON
    assert all(word in AVOIDED_REASON for word in ("failed", "drain", "migration"))


def test_a_comm_heavy_gang_waits_for_one_cluster_rather_than_span_a_slow_link() -> None:
    from loom.sched.plugins.network import SpanGuard
    from loom_proto.jobs import Communication

    # Two 16-GPU clusters an ocean apart (100 ms, 1 Gbit/s); ca has 8 GPUs busy.
    nodes = [
        node("a0", "ca", "r1", reserved=8),
        node("a1", "ca", "r1"),
        node("b0", "cb", "r2"),
        node("b1", "cb", "r2", reserved=8),
    ]
    snap = Snapshot(nodes, net=NetMatrix(["r1", "r2"]))
    snap.net.set_link("r1", "r2", rtt_ms=100.0, bandwidth_gbps=1.0)
    snap.net.set_link("r2", "r1", rtt_ms=100.0, bandwidth_gbps=1.0)
    heavy = job(
        "heavy", gpus=8, workers=2, allow_multi_cluster=True, comm=Communication(bytes_per_step=10**9)
    )
    framework = Framework([ResourceFit(), ScuFit(), SpanGuard()])
    outcome = framework.schedule(heavy, snap)
    assert outcome.decision is None and outcome.status.code == Code.UNSCHEDULABLE
    assert outcome.status.plugin == "span_guard" and "waiting for one cluster" in outcome.status.reason
    # ca's busy GPUs have no predicted end: the wait is not known, so no wake-up time is set, but
    # the spread holds more than 1.25x the GPU-hours of the gang in one cluster: it is refused.
    assert "GPU-hours" in outcome.status.reason and outcome.status.wait_s == 0.0
    assert int(snap.free.sum()) == 16  # nothing taken
    # A gang no single cluster could ever hold, whose every spread crosses the ocean beyond the
    # GPU-hours bound: waiting cannot help it, so it is rejected, however long it waited and
    # whether the GPUs are free now or not (the verdict is read from the idle platform).
    huge = job("huge", gpus=8, workers=3, allow_multi_cluster=True, comm=Communication(bytes_per_step=10**9))
    nodes = [node("a0", "ca", "r1"), node("a1", "ca", "r1"), node("b0", "cb", "r2")]
    busy = [node("a0", "ca", "r1", reserved=8), node("a1", "ca", "r1"), node("b0", "cb", "r2", reserved=8)]
    for waited, where in ((0.0, nodes), (10**7, nodes), (0.0, busy)):
        platform = Snapshot(where, net=snap.net)
        refused = framework.schedule(huge, platform, submitted_at=platform.now - waited)
        assert refused.decision is None and refused.status.code == Code.UNRESOLVABLE
        assert refused.status.plugin == "span_guard" and refused.status.reject == "span_inflation"
        # One step: compute 1 s / A100's speed; over the ocean 2 x 8 Gbit / 1 Gbit/s + one 100 ms
        # round, in one cluster 2 x 8 Gbit / 100 Gbit/s + 0.1 ms.
        compute = 1.0 / float(platform.job_speeds(huge)[platform.models.index("A100")])
        inflation = (compute + 16.0 + 0.1) / (compute + 0.16 + 0.0001)
        assert f"would cost at least {inflation:.1f}x the GPU-hours of one cluster" in refused.status.reason
        assert f"{inflation:.1f}x the GPU-hours" in refused.status.hint
        assert "fewer or smaller workers" in refused.status.hint
    # Without communication the spread costs nothing: permitted.
    light = job("light", gpus=8, workers=2, allow_multi_cluster=True)
    assert framework.schedule(light, snap).decision is not None


def test_each_clusters_nodes_of_one_model_are_one_slice_of_the_snapshot() -> None:
    nodes = [
        node("a0", "ca", "r1", model="T4"),
        node("a1", "ca", "r1"),
        node("a2", "ca", "r1", model="T4"),
        node("b0", "cb", "r2"),
    ]
    snap = Snapshot(nodes)
    for c, cluster in enumerate(snap.clusters):
        start, stop = snap.slices[c]
        for m, model in enumerate(snap.models):
            expected = sorted(n.node for n in nodes if n.cluster == cluster.id and n.gpu_model == model)
            pool = snap.pool(c, m)
            assert snap.node_ids[pool] == expected
            assert start <= pool.start <= pool.stop <= stop
            assert [snap.node_ids[i] for i in snap.node_slice(c, m)[0]] == expected


@settings(max_examples=60, deadline=None)
@given(platforms(), workloads(), st.sampled_from([0, 16_000, 48_000]))
def test_candidates_are_what_counting_node_by_node_finds(
    nodes: list[NodeCapacity], jobs: list[JobSpec], cpu_milli: int
) -> None:
    framework = Framework([ResourceFit(), ScuFit()])
    snap = Snapshot(nodes, net=NetMatrix(["r0", "r1"]))
    for drawn in jobs:
        spec = job(
            drawn.job_id, gpus=drawn.resources.gpus, workers=drawn.workers, resources={"cpu_milli": cpu_milli}
        )
        state = framework.new_state(spec, snap)
        assert framework.run_pre_filters(state).ok
        framework.prune_hierarchically(state)
        g = spec.resources.gpus
        rooms: dict[tuple[int, int], list[tuple[str, int]]] = {}
        for i, node_id in sorted(enumerate(snap.node_ids), key=lambda p: p[1]):
            c, m = int(snap.cluster_of[i]), int(snap.model_of[i])
            room = int(snap.free[i]) // g
            if cpu_milli:
                room = min(room, int(snap.cpu_free[i]) // cpu_milli)
            if state.cluster_mask[c] and snap.schedulable[i] and room > 0:
                rooms.setdefault((c, m), []).append((node_id, room))
        expected = {
            pair: (sum(r for _, r in held), held)
            for pair, held in sorted(rooms.items())
            if sum(r for _, r in held) >= state.min_workers
        }
        found = framework.find_candidates(state)
        got = {}
        for k in range(len(found)):
            passing, room = found.nodes_of(k)
            held = [(snap.node_ids[i], int(r)) for i, r in zip(passing.tolist(), room.tolist(), strict=True)]
            got[(int(found.cluster[k]), int(found.model[k]))] = (int(found.capacity[k]), held)
        assert list(got.items()) == list(expected.items())
        framework.schedule(spec, snap)


def test_pipeline_sites_list_the_free_gpus_of_each_clusters_best_pool_as_they_change() -> None:
    nodes = [
        node("a0", "ca", "r1"),
        node("a1", "ca", "r1", model="T4", gpus=4),
        node("a2", "ca", "r1", reserved=8),
        node("b0", "cb", "r2", model="T4", gpus=4),
    ]
    speed = {("A100", "training_compute"): 3.0, ("T4", "training_compute"): 0.5}
    snap = Snapshot(nodes, net=NetMatrix(["r1", "r2"]), speed=speed)
    framework = build_framework()
    spec = job("p", task_type="training_compute")

    def sites(*, idle: bool = False) -> list[tuple[str, str, tuple[tuple[str, int], ...]]]:
        found = framework.pipeline_sites(framework.new_state(spec, snap), idle=idle)
        return [(s.cluster, s.gpu_model, s.free_gpus) for s in found]

    first = framework.pipeline_sites(framework.new_state(spec, snap))
    assert sites() == [("ca", "A100", (("a0", 8),)), ("cb", "T4", (("b0", 4),))]
    assert framework.pipeline_sites(framework.new_state(spec, snap))[1] is first[1]  # nothing changed
    assert sites(idle=True)[0] == ("ca", "A100", (("a0", 8), ("a2", 8)))
    snap.take([("a0", 6)])  # 2 A100s (x 3.0) still beat 4 T4s (x 0.5)
    assert sites()[0] == ("ca", "A100", (("a0", 2),))
    snap.take([("a0", 2)])
    assert sites()[0] == ("ca", "T4", (("a1", 4),))
    snap.give_back([("a0", 8)])
    assert sites()[0] == ("ca", "A100", (("a0", 8),))


class Everywhere:
    """A filter that says nothing of its inputs (no ``filter_key``): it refuses nodes named ``*x``."""

    name = "no_x"

    def filter(self, state: CycleState, nodes: np.ndarray) -> np.ndarray:
        return np.array([not state.snapshot.node_ids[i].endswith("x") for i in nodes.tolist()], dtype=bool)

    def describe(self, state: CycleState) -> str:
        return "not an x node"


def counted(framework: Framework, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many nodes each of the framework's per-node counts looked at."""
    sizes: list[int] = []
    original = Framework._node_workers

    def counting(self: Framework, state: CycleState, nodes: "np.ndarray | slice") -> np.ndarray:
        out = original(self, state, nodes)
        sizes.append(int(out.size))
        return out

    monkeypatch.setattr(Framework, "_node_workers", counting)
    return sizes


def capacities(framework: Framework, spec: JobSpec, snap: Snapshot) -> dict[str, int]:
    found = framework.find_candidates(framework.new_state(spec, snap))
    return {
        f"{snap.clusters[int(c)].id}/{snap.models[int(m)]}": int(cap)
        for c, m, cap in zip(found.cluster, found.model, found.capacity, strict=True)
    }


def test_workers_per_pool_are_recounted_only_for_pools_whose_nodes_changed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    nodes = [
        node(f"{c}{i}", c, "r1", model=m)
        for c in ("ca", "cb", "cc")
        for i, m in enumerate(("A100", "T4") * 2)
    ]
    snap = Snapshot(nodes)
    framework = Framework([ResourceFit(), ScuFit()])
    sizes = counted(framework, monkeypatch)
    spec = job("j", gpus=2)
    full = {f"{c}/{m}": 8 for c in ("ca", "cb", "cc") for m in ("A100", "T4")}
    assert capacities(framework, spec, snap) == full
    assert sizes == [12]  # the first count looks at every node
    assert capacities(framework, spec, snap) == full
    assert sizes == [12]  # nothing changed: nothing recounted
    snap.take([("ca0", 6)])  # ca's A100 pool changes (ca0 and ca2)
    assert capacities(framework, spec, snap) == {**full, "ca/A100": 5}
    assert sizes == [12, 2]
    snap.set_schedulable(snap.cluster_index["cb"], False)  # both of cb's pools go
    assert capacities(framework, spec, snap) == {
        k: v for k, v in {**full, "ca/A100": 5}.items() if "cb" not in k
    }
    assert sizes == [12, 2, 4]
    assert snap.free_sum[snap.cluster_index["cb"]].tolist() == [0, 0]
    snap.set_schedulable(snap.cluster_index["cb"], True)
    snap.give_back([("ca0", 6)])
    assert capacities(framework, spec, snap) == full
    assert sizes == [12, 2, 4, 6]
    # another shape (CPU per worker) is counted on its own
    heavy = job("h", gpus=2, resources={"cpu_milli": 32_000})
    assert capacities(framework, heavy, snap) == dict.fromkeys(full, 4)
    assert sizes[-1] == 12


def test_without_filter_keys_every_pool_is_counted_each_time(monkeypatch: pytest.MonkeyPatch) -> None:
    nodes = [node("a0", "ca", "r1"), node("a1x", "ca", "r1"), node("b0", "cb", "r1")]
    snap = Snapshot(nodes)
    framework = Framework([ResourceFit(), Everywhere(), ScuFit()])
    sizes = counted(framework, monkeypatch)
    spec = job("j", gpus=8)
    assert capacities(framework, spec, snap) == {"ca/A100": 1, "cb/A100": 1}
    assert capacities(framework, spec, snap) == {"ca/A100": 1, "cb/A100": 1}
    assert sizes == [3, 3]
    decision = framework.schedule(spec, snap).decision
    assert decision is not None and decision.parts[0].allocations == (("a0", 8),)  # never the x node


def test_set_schedulable_keeps_the_pool_figures_true() -> None:
    snap = Snapshot([node("a0", "ca", "r1"), node("a1", "ca", "r1", model="T4", gpus=4, reserved=1)])
    c = snap.cluster_index["ca"]
    before = snap.pool_version.copy()
    snap.set_schedulable(c, np.array([True, False]))
    assert snap.free_sum[c].tolist() == [8, 0] and snap.max_free[c].tolist() == [8, 0]
    assert (snap.pool_version > before).all()
    snap.set_schedulable(c, True)
    assert snap.free_sum[c].tolist() == [8, 3] and snap.max_free[c].tolist() == [8, 3]


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["A100", "T4", "V100"]),
            st.sampled_from([1, 2, 4, 8]),
            st.integers(0, 8),
            st.sampled_from(["r1", "r2", "r3"]),
        ),
        min_size=1,
        max_size=24,
    ),
    st.sampled_from([4.0, 30.0, 90.0, 400.0]),
    st.integers(1, 4),
)
def test_a_decision_builds_only_the_sites_the_planner_would_consider(
    drawn: list[tuple[str, int, int, str]], layer_gib: float, top: int
) -> None:
    nodes = [
        node(f"n{i}", f"c{i % 14:02d}", region, model=model, gpus=gpus, reserved=min(reserved, gpus))
        for i, (model, gpus, reserved, region) in enumerate(drawn)
    ]
    speed = {(m, "training_compute"): v for m, v in (("A100", 3.0), ("V100", 2.0), ("T4", 0.5))}
    memory = {"A100": 80.0, "V100": 32.0, "T4": 16.0}
    net = NetMatrix(["r1", "r2", "r3"])
    for a, b in itertools.permutations(["r1", "r2", "r3"], 2):
        net.set_link(a, b, rtt_ms=30.0, bandwidth_gbps=5.0)
    snap = Snapshot(nodes, net=net, speed=speed, gpu_memory_gib=memory)
    layers = [Layer(compute_s=1.0, memory_gib=layer_gib, activation_mb=50.0) for _ in range(4)]
    spec = job("p", task_type="training_compute", pipeline=Pipeline(layers=layers, max_stages=4))
    framework = build_framework()
    for idle in (False, True):
        state = framework.new_state(spec, snap)
        every = framework.pipeline_sites(state, idle=idle)
        some = framework.pipeline_sites(state, idle=idle, top=top)
        assert len(some) <= min(top + 1, len(every))
        assert {s.key for s in some} <= {s.key for s in every}
        assert pipeline.plan(layers, some, net.link, max_sites=top) == pipeline.plan(
            layers, every, net.link, max_sites=top
        )
        assert pipeline.best_single(layers, some) == pipeline.best_single(layers, every)


def test_the_fastest_site_that_holds_the_whole_model_is_built_even_when_others_rank_higher() -> None:
    # 120 GiB: 5 V100s (32 GiB) or 9 T4s (16 GiB). Four free V100s (useful 2.0 x 4) outrank sixteen
    # T4s (0.5 x 9) but cannot hold the model alone; the T4s can.
    nodes = [node("v0", "cv", "r1", model="V100", reserved=4), node("t0", "ct", "r1", model="T4")]
    nodes.append(node("t1", "ct", "r1", model="T4"))
    speed = {("V100", "training_compute"): 2.0, ("T4", "training_compute"): 0.5}
    snap = Snapshot(nodes, net=NetMatrix(["r1"]), speed=speed, gpu_memory_gib={"V100": 32.0, "T4": 16.0})
    layers = [Layer(compute_s=1.0, memory_gib=30.0, activation_mb=50.0) for _ in range(4)]
    spec = job("p", task_type="training_compute", pipeline=Pipeline(layers=layers, max_stages=4))
    framework = build_framework()
    some = framework.pipeline_sites(framework.new_state(spec, snap), top=1)
    assert [s.cluster for s in some] == ["ct", "cv"]
    single = pipeline.best_single(layers, some)
    assert single is not None and single.stages[0].site.cluster == "ct" and single.stages[0].gpus == 9


def test_the_site_best_single_picks_is_built_when_speeds_differ_by_rounding_only() -> None:
    # Trusts one float step apart: equal seconds for the whole model, so best_single takes the first
    # cluster, though the second has a hair more useful capacity; eight faster sites outrank both.
    low = 0.9
    while 1.0 / (2 * low) != 1.0 / (2 * float(np.nextafter(low, 2.0))):
        low = float(np.nextafter(low, 2.0))
    high = float(np.nextafter(low, 2.0))
    info = {"c00": ClusterInfo(id="c00", region="r1", zone="z", trust=low)}
    info["c01"] = ClusterInfo(id="c01", region="r1", zone="z", trust=high)
    nodes = [node("a", "c00", "r1", reserved=6), node("b", "c01", "r1", reserved=6)]
    for i in range(2, 10):
        info[f"c{i:02d}"] = ClusterInfo(id=f"c{i:02d}", region="r1", zone="z")
        nodes.append(node(f"h{i}", f"c{i:02d}", "r1", model="H100", reserved=7))
    speed = {("H100", "training_compute"): 3.0, ("A100", "training_compute"): 1.0}
    snap = Snapshot(
        nodes, clusters=info, net=NetMatrix(["r1"]), speed=speed, gpu_memory_gib={"A100": 80.0, "H100": 80.0}
    )
    layers = [Layer(compute_s=1.0, memory_gib=100.0, activation_mb=1.0)]
    spec = job("p", task_type="training_compute", pipeline=Pipeline(layers=layers, max_stages=1))
    framework = build_framework()
    state = framework.new_state(spec, snap)
    single = pipeline.best_single(layers, framework.pipeline_sites(state, top=8))
    assert single is not None and single.stages[0].site.cluster == "c00"
    assert single == pipeline.best_single(layers, framework.pipeline_sites(state))


def test_a_pipeline_no_site_can_run_is_told_how_many_sites_there_were() -> None:
    info = {f"c{i}": ClusterInfo(id=f"c{i}", region="r1", zone="z", trust=0.0) for i in range(3)}
    snap = Snapshot([node(f"n{i}", f"c{i}", "r1") for i in range(3)], clusters=info, net=NetMatrix(["r1"]))
    spec = job("p", pipeline=Pipeline(layers=[Layer(compute_s=1.0, memory_gib=10.0)], max_stages=1))
    outcome = build_framework().schedule(spec, snap)
    assert outcome.record.outcome == "rejected"
    assert "none of the 3 site(s) offered" in outcome.record.reason


def test_learned_speed_reaches_the_job_speed_tables_per_family() -> None:
    """A learned factor for (family, model) scales only that family's speeds, and set_learned rebuilds."""
    from loom.model.capacity import NodeCapacity
    from loom.sched.snapshot import Snapshot
    from loom_proto.jobs import JobSpec, Work

    nodes = [
        NodeCapacity(node=f"n{m}", cluster="c1", region="r", zone="z", gpu_model=m, gpus_total=8)
        for m in ("T4", "V100M16")
    ]
    snap = Snapshot(nodes, speed={("T4", "training_compute"): 0.5, ("V100M16", "training_compute"): 1.0})
    bert = JobSpec(job_id="a", tenant="t", work=Work(steps=1, step_time_s=1.0), labels={"model": "BERT"})
    resnet = JobSpec(job_id="b", tenant="t", work=Work(steps=1, step_time_s=1.0), labels={"model": "resnet"})
    assert list(snap.job_speeds(bert)) == [0.5, 1.0]
    snap.set_learned({("bert", "T4"): 0.2})
    assert list(snap.job_speeds(bert)) == pytest.approx([0.1, 1.0])
    assert list(snap.job_speeds(resnet)) == [0.5, 1.0]
    assert snap.job_gpu_speed(bert, "T4") == pytest.approx(0.1)
    snap.set_learned({})
    assert snap.job_gpu_speed(bert, "T4") == 0.5


def test_pruning_names_the_models_the_job_allows_and_explain_says_each_reason_once() -> None:
    from loom.sched.explain import render

    # Fifty free T4 nodes in one zone, every V100 taken in the other: the job needs V100s.
    nodes = [
        NodeCapacity(
            node=f"t{i}",
            cluster="ct",
            region="r1",
            zone="r1-a",
            gpu_model="T4",
            gpus_total=8,
            gpus_reserved=0,
        )
        for i in range(50)
    ] + [
        NodeCapacity(
            node=f"v{i}",
            cluster="cv",
            region="r1",
            zone="r1-b",
            gpu_model="V100",
            gpus_total=8,
            gpus_reserved=8,
        )
        for i in range(2)
    ]
    speed = {("T4", "training_compute"): 1.0, ("V100", "training_compute"): 2.0}
    snap = Snapshot(nodes, net=NetMatrix(["r1"]), speed=speed, now=1000.0)
    spec = JobSpec(
        job_id="v",
        tenant="t",
        workers=2,
        resources=Resources(gpus=8, gpu_models=["V100"]),
        work=Work(steps=1),
    )
    outcome = Framework([ResourceFit(), ScuFit()]).schedule(spec, snap)
    assert outcome.decision is None
    assert outcome.record.pruned["ct"] == "region r1 has 0 free V100 GPUs; the job needs 16"
    lines = render(outcome.record)
    assert sum("region r1 has 0 free V100 GPUs" in line for line in lines) == 2  # once per cluster
    assert "(ct:" not in lines[0]  # the headline does not repeat them


def test_a_region_without_any_of_the_models_is_said_to_have_none_not_none_free() -> None:
    nodes = [
        NodeCapacity(node="t0", cluster="ct", region="r1", zone="r1-a", gpu_model="T4", gpus_total=8),
        NodeCapacity(node="v0", cluster="cv", region="r2", zone="r2-a", gpu_model="V100", gpus_total=8),
    ]
    speed = {("T4", "training_compute"): 1.0, ("V100", "training_compute"): 2.0}
    snap = Snapshot(nodes, net=NetMatrix(["r1", "r2"]), speed=speed, now=1000.0)
    spec = JobSpec(
        job_id="v", tenant="t", resources=Resources(gpus=8, gpu_models=["V100"]), work=Work(steps=1)
    )
    outcome = Framework([ResourceFit(), ScuFit()]).schedule(spec, snap)
    assert outcome.decision is not None and outcome.decision.lead.cluster == "cv"
    assert outcome.record.pruned["ct"] == "region r1 has no V100 GPUs; the job needs 8"


def test_a_zone_or_cluster_without_any_of_the_models_is_said_to_have_none_not_none_free() -> None:
    # r1's V100s are all in zone r1-b: zone r1-a has none (it read "0 free V100 GPUs" there), and
    # a cluster of r1-b with no V100s says so too.
    nodes = [
        NodeCapacity(node="t0", cluster="ct", region="r1", zone="r1-a", gpu_model="T4", gpus_total=8),
        NodeCapacity(node="v0", cluster="cv", region="r1", zone="r1-b", gpu_model="V100", gpus_total=8),
        NodeCapacity(node="t1", cluster="cu", region="r1", zone="r1-b", gpu_model="T4", gpus_total=8),
    ]
    speed = {("T4", "training_compute"): 1.0, ("V100", "training_compute"): 2.0}
    snap = Snapshot(nodes, net=NetMatrix(["r1"]), speed=speed, now=1000.0)
    spec = JobSpec(
        job_id="v", tenant="t", resources=Resources(gpus=8, gpu_models=["V100"]), work=Work(steps=1)
    )
    outcome = Framework([ResourceFit(), ScuFit()]).schedule(spec, snap)
    assert outcome.decision is not None and outcome.decision.lead.cluster == "cv"
    assert outcome.record.pruned["ct"] == "zone r1-a has no V100 GPUs; the job needs 8"
    assert outcome.record.pruned["cu"] == "no V100 GPUs here; the job needs 8"


def test_a_job_that_only_a_closed_cluster_could_hold_is_said_to_wait_for_it_not_for_gpus_taken() -> None:
    # ca (drained) is the only cluster with an 8-GPU node; cb's nodes hold 4. Before, the job
    # waited "would fit but the GPUs are taken now" though no GPU was taken anywhere.
    nodes = [
        NodeCapacity(
            node="a0",
            cluster="ca",
            region="r1",
            zone="r1-a",
            gpu_model="A100",
            gpus_total=8,
            schedulable=False,
        ),
        NodeCapacity(node="b0", cluster="cb", region="r1", zone="r1-a", gpu_model="A100", gpus_total=4),
    ]
    snap = Snapshot(nodes, net=NetMatrix(["r1"]))
    snap.closed = {"ca": "drained"}
    framework = Framework([ResourceFit()])
    outcome = framework.schedule(job("big", gpus=8), snap)
    assert outcome.status.code == Code.UNSCHEDULABLE
    assert "only with nodes that take no new work now (ca drained)" in outcome.status.reason
    assert outcome.record.pruned["ca"] == "drained: it takes no new work now"
    # Without a known why, the nodes are still named as what the job waits for.
    snap = Snapshot(nodes, net=NetMatrix(["r1"]))
    outcome = framework.schedule(job("big", gpus=8), snap)
    assert "(ca nodes unschedulable: `loom status` says which and why)" in outcome.status.reason
    # A job the open cluster holds when its GPUs free waits for GPUs taken, as before.
    busy = [node("b0", "cb", "r1", gpus=4, reserved=4), nodes[0]]
    outcome = framework.schedule(job("small", gpus=4), Snapshot(busy, net=NetMatrix(["r1"])))
    assert outcome.status.code == Code.UNSCHEDULABLE
    assert "GPUs are taken now" in outcome.status.reason


def test_a_big_job_weighs_the_gpu_models_its_family_never_ran_on_at_the_risk_factor() -> None:
    """Once a family has steady runs on one model, a job of at least ``risk_gpu_hours`` (reference
    GPU-hours) counts every other model at ``risk_factor`` of its estimate; a small job, a family
    with no steady cell, and a snapshot without the rule keep the estimates as they are."""
    from loom.model.capacity import NodeCapacity
    from loom.sched.snapshot import Snapshot
    from loom_proto.jobs import JobSpec, Work

    nodes = [
        NodeCapacity(node=f"n{m}", cluster="c1", region="r", zone="z", gpu_model=m, gpus_total=8)
        for m in ("K80", "T4", "V100M16")
    ]
    speeds = {
        ("K80", "training_compute"): 0.3,
        ("T4", "training_compute"): 0.5,
        ("V100M16", "training_compute"): 1.0,
    }
    snap = Snapshot(nodes, speed=speeds)

    def job(job_id: str, hours: float, model: str = "BERT") -> JobSpec:
        return JobSpec(
            job_id=job_id, tenant="t", work=Work(steps=3600, step_time_s=hours), labels={"model": model}
        )

    big, small, other = job("big", 16.0), job("small", 15.9), job("other", 40.0, "resnet")
    snap.set_learned({("bert", "V100M16"): 0.9, ("bert", "K80"): 2.0}, [("bert", "V100M16")])
    assert list(snap.job_speeds(big)) == pytest.approx([0.6, 0.5, 0.9])  # no rule yet
    snap.set_risk(16.0, 0.8)
    assert list(snap.job_speeds(big)) == pytest.approx([0.48, 0.4, 0.9])  # K80 and T4 at 0.8
    assert list(snap.job_speeds(small)) == pytest.approx([0.6, 0.5, 0.9])
    assert list(snap.job_speeds(other)) == [0.3, 0.5, 1.0]  # resnet has no steady cell
    assert snap.at_risk(big, "bert") and not snap.at_risk(small, "bert")
    snap.set_learned({("bert", "V100M16"): 0.9, ("bert", "K80"): 2.0}, [("bert", "V100M16"), ("bert", "K80")])
    assert list(snap.job_speeds(big)) == pytest.approx([0.6, 0.4, 0.9])  # K80 now steady
    snap.set_risk(0.0, 0.8)  # off
    assert list(snap.job_speeds(big)) == pytest.approx([0.6, 0.5, 0.9])


def test_the_big_job_handicap_steers_the_choice_and_never_a_prediction() -> None:
    """``job_speeds`` (what a choice weighs) carries the handicap; ``believed_speeds`` and
    ``job_gpu_speed`` (a predicted step, a running job's move, a speed probe) do not; a pipeline,
    whose plan is timed with the speeds it is chosen by, is never at risk; and the cells the book
    assigns straight to ``measured`` are read again."""
    nodes = [node("a0", "ca", "r1", model="A100"), node("v0", "cv", "r1", model="V100M16")]
    speed = {("A100", "training_compute"): 2.0, ("V100M16", "training_compute"): 1.0}
    snap = Snapshot(nodes, net=NetMatrix(["r1"]), speed=speed, now=1_700_000_000.0)
    snap.set_learned({("bert", "V100M16"): 1.0}, [("bert", "V100M16")])
    snap.set_risk(16.0, 0.4)  # the A100, untried by bert, counts at 0.8 for a big job: below the V100

    def bert(job_id: str, step_s: float, pipeline: Pipeline | None = None) -> JobSpec:
        work = Work(steps=3600, step_time_s=step_s)
        return JobSpec(job_id=job_id, tenant="t", work=work, labels={"model": "BERT"}, pipeline=pipeline)

    big, small = bert("big", 20.0), bert("small", 1.0)
    assert list(snap.job_speeds(big)) == pytest.approx([0.8, 1.0])
    assert list(snap.believed_speeds(big)) == pytest.approx([2.0, 1.0])
    assert snap.job_gpu_speed(big, "A100") == pytest.approx(2.0)
    framework = build_framework()
    chosen = framework.schedule(big, snap, apply=False).decision
    assert chosen is not None and chosen.lead.gpu_model == "V100M16"  # no bet on the untried A100
    assert chosen.predicted_step_s == pytest.approx(20.0)
    quick = framework.schedule(small, snap, apply=False).decision
    assert quick is not None and quick.lead.gpu_model == "A100"  # a small job goes and finds out
    # With only the A100 free, the big job runs there, predicted at the A100's believed speed.
    v100 = snap.node_index["v0"]
    snap.take([("v0", 8)])
    assert snap.free[v100] == 0
    there = framework.schedule(big, snap, apply=False).decision
    assert there is not None and there.lead.gpu_model == "A100"
    assert there.predicted_step_s == pytest.approx(10.0)
    # A pipeline is never at risk; the book's straight assignment of measured cells is read again.
    layers = [Layer(compute_s=5.0, activation_mb=1.0) for _ in range(4)]
    assert not snap.at_risk(bert("pipe", 20.0, Pipeline(layers=layers)), "bert")
    snap.measured = frozenset({("bert", "A100"), ("bert", "V100M16")})
    assert snap.at_risk(big, "bert")  # still a steady family
    assert list(snap.job_speeds(big)) == pytest.approx([2.0, 1.0])  # the A100 now steady: no handicap
    snap.measured = frozenset()
    assert not snap.at_risk(big, "bert")


def test_loom_weighs_a_big_jobs_untried_gpus_in_the_simulator_and_gavel_like_does_not() -> None:
    from loom.model.learn import LearnSettings
    from loom.sim.policies import POLICIES

    assert LearnSettings().risk_gpu_hours == 16.0 and LearnSettings().risk_factor == 0.8
    loom, gavel = POLICIES["loom"](0), POLICIES["gavel_like"](0)
    assert loom.speed_learner is not None and loom.speed_learner.settings.risk_gpu_hours == 16.0
    assert gavel.speed_learner is not None and gavel.speed_learner.settings.risk_gpu_hours == 0.0


def test_the_big_job_handicap_never_makes_a_spread_look_more_wasteful_than_believed() -> None:
    """The span guard's GPU-hours bound is a prediction, read at the believed speeds: a gang that
    only a spread over a measured V100 and an untried T4 can run (believed 1.11x the GPU-hours of
    one cluster) is placed, not refused for good as the handicapped 0.72 T4 (1.39x) would have it."""
    nodes = [node("v0", "cv", "r1", model="V100M16"), node("t0", "ct", "r1", model="T4")]
    speed = {("V100M16", "training_compute"): 1.0, ("T4", "training_compute"): 0.9}
    snap = Snapshot(nodes, net=NetMatrix(["r1"]), speed=speed, now=1_700_000_000.0)
    snap.set_learned({("bert", "V100M16"): 1.0}, [("bert", "V100M16")])
    snap.set_risk(16.0, 0.8)
    gang = JobSpec(
        job_id="gang",
        tenant="t",
        workers=2,
        resources=Resources(gpus=8),
        work=Work(steps=3600, step_time_s=20.0),
        labels={"model": "BERT"},
        allow_multi_cluster=True,
    )
    assert snap.at_risk(gang, "bert") and snap.job_speeds(gang)[snap.model_index["T4"]] == pytest.approx(0.72)
    outcome = build_framework().schedule(gang, snap, apply=False)
    assert outcome.decision is not None, outcome.status.reason
    assert sorted(p.gpu_model for p in outcome.decision.parts) == ["T4", "V100M16"]
