"""``loom bench placement`` at a tiny size: the JSON's shape, and that its decisions are sound.

No timing is asserted: the figures depend on the machine. What must hold anywhere is that the
counts add up, the percentiles are ordered, every placed worker sits on a node of the snapshot,
and the snapshot's books balance (no node below zero free GPUs, every GPU taken accounted for).
"""

import argparse
import json
from collections import Counter
from typing import Any

import numpy as np
import pytest

from loom.model.topology import load_topology
from loom.sched.profile import build_framework
from loom_benchmarks import placement

SEED = 11


def _args(**overrides: object) -> argparse.Namespace:
    values: dict[str, object] = {"nodes": "300", "decisions": 50, "fill": 0.6, "seed": SEED, "json": True}
    values.update(overrides)
    return argparse.Namespace(**values)


@pytest.fixture(scope="module")
def result() -> dict[str, Any]:
    return placement.run(_args())


@pytest.fixture(scope="module")
def size_run() -> placement.SizeRun:
    """Nearly full, so some jobs wait and the post-filters (preemption) run too."""
    return placement.run_size(300, 50, SEED, fill=0.9)


def test_result_is_json_with_one_size_and_its_figures(result: dict[str, Any]) -> None:
    decoded = json.loads(json.dumps(result))
    assert decoded["benchmark"] == "placement"
    (size,) = decoded["sizes"]
    assert size["nodes"] == 300
    assert size["decisions"] == 50
    assert set(size["latency_ms"]) == set(size["cpu_ms"]) == {"p50", "p90", "p99", "max", "mean"}
    assert size["snapshot_build_ms"] >= 0
    assert size["decisions_per_s"] > 0
    assert size["peak_rss_mib"] > 0
    assert decoded["headline"]["300"]["p99_ms"] == size["latency_ms"]["p99"]
    assert decoded["environment"]["cpu_count"] >= 1
    assert decoded["environment"]["python"].count(".") == 2


def test_sizes_without_a_target_say_so_and_targets_are_stated(result: dict[str, Any]) -> None:
    (size,) = result["sizes"]
    assert size["target_p99_ms"] is None
    assert size["meets_target"] is None
    assert result["targets"]["p99_ms_by_nodes"] == {"10000": 5.0, "100000": 50.0}


def test_outcome_counts_add_up_to_the_decisions(result: dict[str, Any]) -> None:
    (size,) = result["sizes"]
    assert set(size["outcomes"]) == {"placed", "waiting", "rejected"}
    assert sum(size["outcomes"].values()) == size["decisions"]
    assert sum(k["jobs"] for k in size["latency_ms_by_kind"].values()) == size["decisions"]
    for name, latency in size["latency_ms_by_outcome"].items():
        assert size["outcomes"][name] > 0
        assert latency["p50"] <= latency["p99"] <= latency["max"]


def test_percentiles_are_ordered(result: dict[str, Any]) -> None:
    (size,) = result["sizes"]
    lat = size["latency_ms"]
    assert 0 < lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["max"]
    assert lat["mean"] <= lat["max"]


def test_the_profile_reported_is_the_default_one(result: dict[str, Any]) -> None:
    expected = [getattr(p, "name", type(p).__name__) for p in build_framework().plugins]
    assert result["profile"]["plugins"] == expected


def test_placed_decisions_use_nodes_of_the_snapshot_in_their_cluster(size_run: placement.SizeRun) -> None:
    snap = size_run.snapshot
    assert len(size_run.outcomes) == len(size_run.decisions) == 50
    assert {"placed", "waiting"} <= set(size_run.outcomes)
    for outcome, decision in zip(size_run.outcomes, size_run.decisions, strict=True):
        assert outcome in placement.OUTCOMES
        assert (decision is not None) == (outcome == "placed")
        if decision is None:
            continue
        for part in decision.parts:
            for node, gpus in part.allocations:
                i = snap.node_index[node]
                assert gpus > 0
                assert snap.clusters[int(snap.cluster_of[i])].id == part.cluster
                assert snap.models[int(snap.model_of[i])] == part.gpu_model


def test_every_gpu_taken_or_freed_is_accounted_for_and_none_goes_negative(
    size_run: placement.SizeRun,
) -> None:
    snap = size_run.snapshot
    moved: Counter[str] = Counter()
    holders = {r.job_id: r for r in size_run.running_before}
    for decision in size_run.decisions:
        if decision is None:
            continue
        for victim in decision.victims:  # preemption gave the victim's GPUs back first
            for node, gpus in holders.pop(victim).allocations:
                moved[node] -= gpus
        for node, gpus in decision.allocations:
            moved[node] += gpus
    expected = size_run.free_before.copy()
    for node, gpus in moved.items():
        expected[snap.node_index[node]] -= gpus
    assert (expected >= 0).all()
    assert np.array_equal(snap.free, expected)
    assert (snap.free <= snap.total).all()
    assert size_run.figures["gpus_placed"] == sum(
        g for d in size_run.decisions if d for _, g in d.allocations
    )


def test_platform_replicates_clusters_to_the_exact_node_count() -> None:
    topology = load_topology()
    base = {c.id: c for c in topology.clusters}
    nodes = placement.replicate(topology, 3_000, SEED)
    assert len(nodes) == 3_000
    assert len({n.node for n in nodes}) == 3_000
    for n in nodes:
        original = base[n.cluster.split("-r")[0]] if n.cluster not in base else base[n.cluster]
        assert (n.region, n.zone) == (original.region, original.zone)
    assert any(n.cluster.endswith("-r2") for n in nodes)
    assert {n.gpu_model for n in nodes} == {n.gpu_model for c in topology.clusters for n in c.nodes}


def test_a_platform_smaller_than_the_topology_samples_every_cluster() -> None:
    topology = load_topology()
    nodes = placement.replicate(topology, 300, SEED)
    assert len(nodes) == 300
    assert {n.cluster for n in nodes} == {c.id for c in topology.clusters}


def test_prefill_reserves_about_the_requested_share() -> None:
    assert placement.prefill_shares(0.6) == pytest.approx((0.3, 0.5))
    assert placement.prefill_shares(0.0) == pytest.approx((1.0, 0.0))
    assert placement.prefill_shares(1.0) == pytest.approx((0.0, 1.0))
    built = placement.build_platform(load_topology(), 2_000, 0.6, SEED)
    total = sum(n.gpus_total for n in built.nodes)
    reserved = sum(n.gpus_reserved for n in built.nodes)
    assert reserved / total == pytest.approx(0.6, abs=0.05)
    assert sum(j.gpus for j in built.running) == reserved


def test_workload_is_seeded_and_mixes_every_kind() -> None:
    regions, models = ["r1", "r2"], ["T4", "G2"]
    jobs = placement.workload(400, SEED, regions, models)
    assert jobs == placement.workload(400, SEED, regions, models)
    assert jobs != placement.workload(400, SEED + 1, regions, models)
    kinds = Counter(placement.job_kind(j) for j in jobs)
    assert set(kinds) == {"single_gpu", "multi_gpu", "gang"}
    assert kinds["single_gpu"] > kinds["multi_gpu"] > kinds["gang"]
    assert any(j.data is not None for j in jobs)
    assert any(j.resources.gpu_models for j in jobs)


def test_the_cli_prints_the_json_result(capsys: pytest.CaptureFixture[str]) -> None:
    from loom.cli.main import build_parser

    args = build_parser().parse_args(["bench", "placement", "--nodes", "200", "--decisions", "10", "--json"])
    assert args.fn(args) == 0
    printed = json.loads(capsys.readouterr().out)
    assert [s["nodes"] for s in printed["sizes"]] == [200]


@pytest.mark.parametrize("overrides", [{"nodes": "1000,x"}, {"nodes": "0"}, {"fill": 1.5}, {"decisions": 0}])
def test_unusable_options_are_refused(overrides: dict[str, Any]) -> None:
    with pytest.raises(placement.OptionError):
        placement.run(_args(**overrides))


def test_cycles_decide_the_same_with_the_caches_on_and_off_and_count_every_job() -> None:
    """``--cycle``: the jobs in cycles of a batch, caches on and off: the same decisions."""
    result = placement.run(_args(decisions=30, cycle=12, fill=0.9))
    (size,) = result["sizes"]
    cycle = size["cycle"]
    assert cycle["batch"] == 12
    for name in ("mixed", "identical_1gpu_inference"):
        figures = cycle[name]
        assert figures["same_decisions"] is True
        for mode in ("cycle_caches", "no_cycle_caches"):
            assert sum(figures[mode]["outcomes"].values()) == 30
            assert figures[mode]["cpu_ms_per_job"] > 0
        assert figures["cycle_caches"]["outcomes"] == figures["no_cycle_caches"]["outcomes"]
    assert cycle["identical_1gpu_inference"]["cycle_caches"]["outcomes"]["placed"] > 0


def test_a_negative_cycle_is_refused() -> None:
    with pytest.raises(placement.OptionError, match="--cycle"):
        placement.run(_args(cycle=-1))
