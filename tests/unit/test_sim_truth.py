"""The simulator's truth: the file format, measured and derived speeds, scaling, noise, and a
simulation timed by a truth that disagrees with the scheduler's belief."""

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any

import msgspec
import pytest

from loom.model.capacity import NodeCapacity
from loom.model.topology import load_topology
from loom.sched.plugins.cost import default_economics
from loom.sched.snapshot import ClusterInfo, NetMatrix
from loom.sim.engine import simulate
from loom.sim.metrics import belief_error, summarize
from loom.sim.model import Platform, SimJob, Trace
from loom.sim.policies import POLICIES, FrameworkPolicy
from loom.sim.truth import (
    BELIEF,
    PACKAGED_TRUTH,
    Truth,
    TruthError,
    dump_truth,
    job_batch,
    load_truth,
    parse_truth,
    perturbed,
)
from loom_proto.jobs import JobSpec, Layer, Pipeline, Resources, Work

EU = "aws-eu-central-1"
DATA = Path(__file__).resolve().parents[2] / "libs" / "loom" / "sim" / "data" / PACKAGED_TRUTH


def packaged_document() -> dict[str, Any]:
    document: dict[str, Any] = json.loads(DATA.read_text())
    return document


def cell(document: dict[str, Any], **match: object) -> float:
    (found,) = [c for c in document["cells"] if all(c[k] == v for k, v in match.items())]
    return float(found["throughput"])


def tiny(cells: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"format": "loom-truth", "version": 1, "cells": cells, **extra}


def c(
    family: str, gpu: str, value: float, *, n: int = 1, series: str = "s", precision: str = "fp32"
) -> dict[str, Any]:
    return {
        "family": family,
        "gpu_model": gpu,
        "precision": precision,
        "gpus_per_node": n,
        "throughput": value,
        "series": series,
    }


# ---- the file -------------------------------------------------------------------------------------


def test_the_packaged_file_round_trips_through_dump_and_parse(tmp_path: Path) -> None:
    truth = load_truth()
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(dump_truth(truth)))
    again = load_truth(path)
    assert len(again.cells) == len(truth.cells) > 500
    for family, gpu, n in (
        ("bert-base", "A100", 1),
        ("lm", "H100", 4),
        ("resnet50", "T4", 2),
        ("x", "G3", 8),
    ):
        a = truth.speed(family, gpu, gpus_per_node=n, job_id="j")
        b = again.speed(family, gpu, gpus_per_node=n, job_id="j")
        assert (a.speed, a.rule) == (b.speed, b.rule)
    assert again.noise_cv == truth.noise_cv > 0


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ([], "top level must be an object"),
        ({"format": "other", "version": 1, "cells": []}, "'format' must be 'loom-truth'"),
        ({"format": "loom-truth", "version": 2, "cells": []}, "'version' 2 is not supported"),
        (tiny([]), "'cells' must be a non-empty list"),
        (tiny([{**c("f", "V100M16", 1.0), "throughput": -1}]), r"cells\[0\].throughput must be a positive"),
        (tiny([{**c("f", "V100M16", 1.0), "precision": "fp8"}]), r"cells\[0\].precision must be one of"),
        (
            tiny([c("f", "V100M16", 1.0), {**c("f", "A100", 2.0), "gpus_per_node": 0}]),
            r"cells\[1\].gpus_per_node",
        ),
        (tiny([{**c("f", "V100M16", 1.0), "series": ""}]), r"cells\[0\].series must be a non-empty string"),
        (tiny([c("f", "A100", 1.0)]), "no cell of the reference GPU V100M16"),
        (tiny([c("f", "V100M16", 1.0)], noise={"cv": 2}), r"noise.cv must be a number in \[0, 1\)"),
    ],
)
def test_a_bad_truth_file_is_refused_saying_what_is_wrong(
    document: Any, message: str, tmp_path: Path
) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(document))
    with pytest.raises(TruthError, match=message) as caught:
        load_truth(path)
    assert str(path) in str(caught.value)


def test_a_truth_file_that_is_not_json_or_missing_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text("{ not json")
    with pytest.raises(TruthError, match="is not JSON"):
        load_truth(path)
    with pytest.raises(TruthError, match="cannot be read"):
        load_truth(tmp_path / "absent.json")


# ---- measured and derived -------------------------------------------------------------------------


def test_measured_cells_are_returned_exactly_relative_to_the_reference_gpu() -> None:
    document = packaged_document()
    truth = load_truth()
    got = truth.speed("bert-base", "A100")
    expected = cell(document, family="bert-base", gpu_model="A100", precision="fp32", gpus_per_node=1) / cell(
        document, family="bert-base", gpu_model="V100M16", precision="fp32", gpus_per_node=1
    )
    assert got.speed == pytest.approx(expected, rel=1e-12)
    assert (got.derived, got.rule, got.scaling) == (False, "measured", 1.0)
    # Gavel's ResNet-50 at batch 64 on a K80: its own series, chosen by the batch.
    k80 = truth.speed("ResNet-50", "K80", batch=64)
    assert k80.speed == pytest.approx(
        cell(document, family="resnet-50", gpu_model="K80", series="gavel/bs64")
        / cell(document, family="resnet-50", gpu_model="V100M16", series="gavel/bs64"),
        rel=1e-12,
    )
    assert not k80.derived
    half = truth.speed("bert-base@fp16", "H100")
    assert half.precision == "fp16"
    assert half.speed == pytest.approx(
        cell(document, family="bert-base", gpu_model="H100", precision="fp16", gpus_per_node=1)
        / cell(document, family="bert-base", gpu_model="V100M16", precision="fp16", gpus_per_node=1)
    )
    assert truth.speed("bert-base", "V100M16").speed == 1.0


def test_derived_cells_are_flagged_with_their_rule() -> None:
    truth = load_truth()
    t4 = truth.speed("bert-base", "T4")
    assert t4.derived and t4.rule == "profile-ratio"
    assert 0.0 < t4.speed < 1.0
    lm = truth.speed("lm", "A100")
    assert lm.derived and lm.rule == "peer-ratio"
    g3 = truth.speed("bert-base", "G3")
    assert g3.derived and g3.rule == "gpu-alias" and g3.gpu_model == "A100"
    assert g3.speed == truth.speed("bert-base", "A100").speed
    assert truth.speed("resnet50", "A100").family == "resnet-50"  # an alias: not derived
    assert not truth.speed("resnet50", "A100").derived
    unknown = truth.speed("bert-base", "NO-SUCH-GPU")
    assert (unknown.speed, unknown.rule) == (1.0, "unknown-gpu")
    fallback = truth.speed("lm@fp16", "V100M16")
    assert fallback.derived and "precision-fallback" in fallback.rule


def test_an_unknown_family_gets_a_table_family_by_a_seeded_hash_of_the_job_id() -> None:
    truth = load_truth()
    picks = {
        truth.speed("training_compute", "A100", task_type="training_compute", job_id=f"j{i}").family
        for i in range(60)
    }
    assert len(picks) >= 4
    assert all(truth.task_types[f] == "training_compute" for f in picks)
    one = truth.speed("training_compute", "A100", task_type="training_compute", job_id="j7")
    assert one == truth.speed("training_compute", "A100", task_type="training_compute", job_id="j7")
    assert one.derived and one.rule.startswith("family-by-hash")
    other_seed = {
        truth.speed("training_compute", "A100", task_type="training_compute", job_id=f"j{i}", seed=1).family
        for i in range(60)
    }
    assert other_seed == picks or len(other_seed) >= 4


def test_intra_node_scaling_is_the_per_gpu_throughput_at_n_against_one_gpu() -> None:
    document = packaged_document()
    truth = load_truth()
    one = cell(document, family="bert-base", gpu_model="V100M16", precision="fp32", gpus_per_node=1)
    two = cell(document, family="bert-base", gpu_model="V100M16", precision="fp32", gpus_per_node=2)
    four = cell(document, family="bert-base", gpu_model="V100M16", precision="fp32", gpus_per_node=4)
    eff2, eff4 = min(two / (2 * one), 1.0), min(four / (4 * one), 1.0)
    assert eff2 < 1.0  # the V100's measured BERT scaling is sublinear
    got = truth.speed("bert-base", "V100M16", gpus_per_node=2)
    assert got.scaling == pytest.approx(eff2) and got.speed == pytest.approx(eff2) and not got.derived
    three = truth.speed("bert-base", "V100M16", gpus_per_node=3).scaling
    t = math.log2(3) - 1
    assert three == pytest.approx(eff2 + t * (eff4 - eff2))
    a10 = truth.speed("bert-base", "A10", gpus_per_node=4)  # Lambda ran the A10 alone only
    assert a10.derived and a10.rule == "scaling-peer" and a10.scaling <= 1.0
    gavel = truth.speed("lm", "V100M16", gpus_per_node=8)  # Gavel measured one GPU only
    assert gavel.rule == "scaling-table" and 0 < gavel.scaling <= 1.0


def test_job_batch_reads_labels_then_the_name() -> None:
    spec = JobSpec(job_id="a", tenant="t", work=Work(steps=1, step_time_s=1.0), labels={"batch": "32"})
    assert job_batch(spec) == 32
    plain = JobSpec(job_id="b", tenant="t", work=Work(steps=1, step_time_s=1.0))
    assert job_batch(plain, "ResNet-50 (batch size 128)") == 128
    assert job_batch(plain, "resnet") is None


# ---- noise ----------------------------------------------------------------------------------------


def test_noise_is_deterministic_per_job_attempt_and_seed_with_the_files_spread() -> None:
    truth = load_truth()
    assert truth.noise_factor("job", 1) == truth.noise_factor("job", 1)
    assert truth.noise_factor("job", 1) != truth.noise_factor("job", 2)
    assert truth.noise_factor("job", 1, seed=3) != truth.noise_factor("job", 1)
    draws = [truth.noise_factor(f"j{i}", 1) for i in range(20_000)]
    assert statistics.fmean(draws) == pytest.approx(1.0, abs=0.002)
    assert statistics.stdev(draws) == pytest.approx(truth.noise_cv, rel=0.05)
    wide = [truth.noise_factor(f"j{i}", 1, family="tacotron2") for i in range(20_000)]
    assert statistics.stdev(wide) == pytest.approx(truth.noise_by_family["tacotron2"], rel=0.05)
    quiet = parse_truth(tiny([c("f", "V100M16", 1.0)]))
    assert quiet.noise_factor("job", 1) == 1.0


# ---- the simulator --------------------------------------------------------------------------------


def one_gpu_platform(model: str, believed_speed: float) -> Platform:
    nodes = [NodeCapacity(node="n0", cluster="c", region=EU, zone=f"{EU}-a", gpu_model=model, gpus_total=8)]
    return Platform(
        name="truth-test",
        nodes=nodes,
        clusters={"c": ClusterInfo(id="c", region=EU, zone=f"{EU}-a")},
        net=NetMatrix.from_topology(load_topology()),
        economics=default_economics(),
        speed={(model, t): believed_speed for t in ("training_compute", "inference", "training_memory")},
        gpu_memory_gib={model: 80.0},
    )


def truth_where_a100_is_the_reference() -> Truth:
    """A noise-free truth: family ``fam`` runs on an A100 exactly as on the reference V100."""
    return parse_truth(
        tiny(
            [c("fam", "V100M16", 10.0), c("fam", "A100", 10.0), c("fam", "A100", 80.0, n=8)],
            families={"fam": {"task_type": "training_compute"}},
        )
    )


def fam_job(job_id: str = "j", *, steps: int = 1000, step_time_s: float = 0.6) -> JobSpec:
    return JobSpec(
        job_id=job_id,
        tenant="t",
        resources=Resources(gpus=1),
        work=Work(steps=steps, step_time_s=step_time_s),
        labels={"model": "fam"},
    )


def test_a_gpu_believed_three_times_faster_than_truth_times_the_job_by_truth() -> None:
    plat = one_gpu_platform("A100", believed_speed=3.0)
    trace = Trace(jobs=[SimJob(spec=fam_job(), arrival_s=0.0)])
    truth = truth_where_a100_is_the_reference()
    result = simulate(trace, plat, POLICIES["loom"](0), truth=truth)
    (r,) = result.records
    assert r.jct_s == pytest.approx(1000 * 0.6)  # the truth: the A100 runs it at reference speed
    assert r.step_s == pytest.approx(0.6) and r.compute_step_s == pytest.approx(0.6)
    assert r.belief_step_s == pytest.approx(0.2) and r.belief_compute_step_s == pytest.approx(0.2)
    assert r.truth_rule == "measured"
    error = belief_error(result.records)
    assert error["median"] == pytest.approx(2 / 3) and error["p90"] == pytest.approx(2 / 3)
    assert error["by_gpu_model"]["A100"]["median"] == pytest.approx(2 / 3)
    assert error["bias"] == pytest.approx(1 / 3)
    assert r.scu_hours == pytest.approx(1.0 * 600 / 3600)  # delivered: one reference GPU's worth
    assert summarize(result)["belief_error"]["median"] == pytest.approx(2 / 3)
    # Timed by belief, the same job takes what the scheduler expected, and the error is nil.
    (b,) = simulate(trace, plat, POLICIES["loom"](0), truth=BELIEF).records
    assert b.jct_s == pytest.approx(1000 * 0.2)
    assert belief_error([b])["median"] == 0.0 and b.truth_rule == ""


def test_a_multi_gpu_worker_is_timed_with_the_measured_intra_node_scaling() -> None:
    plat = one_gpu_platform("A100", believed_speed=1.0)
    spec = JobSpec(
        job_id="g8",
        tenant="t",
        resources=Resources(gpus=8),
        work=Work(steps=100, step_time_s=1.0),
        labels={"model": "fam"},
    )
    (r,) = simulate(
        Trace(jobs=[SimJob(spec=spec, arrival_s=0.0)]),
        plat,
        POLICIES["loom"](0),
        truth=truth_where_a100_is_the_reference(),
    ).records
    assert r.step_s == pytest.approx(1.0)  # 80 at 8 GPUs = 8 x 10: perfect scaling, measured
    slow = parse_truth(tiny([c("fam", "V100M16", 10.0), c("fam", "A100", 10.0), c("fam", "A100", 40.0, n=8)]))
    (h,) = simulate(
        Trace(jobs=[SimJob(spec=spec, arrival_s=0.0)]), plat, POLICIES["loom"](0), truth=slow
    ).records
    assert h.step_s == pytest.approx(2.0)  # half the per-GPU throughput at 8 GPUs: twice the step


def test_run_noise_changes_the_true_step_but_not_the_belief() -> None:
    plat = one_gpu_platform("A100", believed_speed=1.0)
    noisy = parse_truth(tiny([c("fam", "V100M16", 10.0), c("fam", "A100", 10.0)], noise={"cv": 0.1}))
    jobs = [SimJob(spec=fam_job(f"j{i}", steps=10, step_time_s=1.0), arrival_s=100.0 * i) for i in range(20)]
    # Not learning (the learner would move the belief toward the noisy truth run by run).
    records = simulate(Trace(jobs=jobs), plat, POLICIES["first_fit"](0), truth=noisy, seed=5).records
    again = simulate(Trace(jobs=list(jobs)), plat, POLICIES["first_fit"](0), truth=noisy, seed=5).records
    steps = [r.step_s for r in records]
    assert steps == [r.step_s for r in again]
    assert len(set(steps)) == len(steps)
    assert all(r.belief_step_s == pytest.approx(1.0) for r in records)
    assert steps == [pytest.approx(noisy.noise_factor(f"j{i}", 1, family="fam", seed=5)) for i in range(20)]


def test_a_pipeline_is_timed_by_its_bottleneck_under_the_truth() -> None:
    plat = one_gpu_platform("A100", believed_speed=3.0)
    layers = [Layer(name=f"l{i}", compute_s=0.1, memory_gib=1.0, activation_mb=1.0) for i in range(4)]
    spec = JobSpec(
        job_id="p",
        tenant="t",
        work=Work(steps=100, step_time_s=0.4),
        pipeline=Pipeline(layers=layers),
        labels={"model": "fam"},
    )
    (r,) = simulate(
        Trace(jobs=[SimJob(spec=spec, arrival_s=0.0)]),
        plat,
        POLICIES["loom"](0),
        truth=truth_where_a100_is_the_reference(),
    ).records
    assert r.end_s is not None
    assert r.step_s == pytest.approx(
        3 * r.belief_step_s
    )  # compute-bound on one site: 3x slower than believed


# ---- loom bench policies --truth ------------------------------------------------------------------


def _bench(*argv: str) -> argparse.Namespace:
    from loom_benchmarks import add_arguments

    parser = argparse.ArgumentParser(prog="loom bench")
    add_arguments(parser)
    return parser.parse_args(["policies", "--json", *argv])


def test_bench_policies_truth_option_takes_a_file_or_belief_and_refuses_a_missing_file(
    tmp_path: Path,
) -> None:
    from loom_benchmarks import policies

    with pytest.raises(policies.OptionError, match="--truth is a truth file or 'belief'"):
        policies.resolve(_bench("--truth", str(tmp_path / "absent.json")), known=["loom"])
    belief = policies.resolve(_bench("--truth", "belief"), known=["loom"])
    assert belief.truth == "belief"
    assert "--truth belief" in policies.command_line(belief)
    assert policies.resolve(_bench(), known=["loom"]).truth is None


def test_bench_policies_replays_with_an_operators_truth_file_and_reports_the_belief_error(
    tmp_path: Path,
) -> None:
    from loom_benchmarks import policies

    mine = tmp_path / "truth.json"
    mine.write_text(json.dumps(dump_truth(load_truth())))
    common = ("--jobs", "12", "--nodes", "200", "--policies", "loom,greedy_compute")
    timed = policies.run(_bench(*common, "--truth", str(mine), "--out", str(tmp_path / "r")))
    assert str(mine) in timed["method"]["truth"]
    for summary in timed["summaries"]:
        error = summary["belief_error"]
        assert error["timed_by"] == "truth" and error["jobs"] > 0
        assert error["median"] is not None and error["median"] > 0
        assert timed["headline"][summary["policy"]]["belief_error_median"] == error["median"]
    page = (tmp_path / "r" / "report.md").read_text()
    assert "## Belief error (predicted vs true step time)" in page
    summary_json = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert (
        summary_json["summaries"][0]["belief_error"]["median"]
        == timed["summaries"][0]["belief_error"]["median"]
    )
    believed = policies.run(_bench(*common, "--truth", "belief", "--out", str(tmp_path / "b")))
    assert believed["method"]["truth"].startswith("belief")
    assert all(s["belief_error"]["median"] == 0.0 for s in believed["summaries"])


# ---- learning the truth in the simulator --------------------------------------------------------


def two_pool_platform(a100_nodes: int = 1, h100_speed: float = 2.0) -> Platform:
    """One cluster with A100 nodes the profile believes 3x the reference and an H100 node believed 2x."""
    nodes = [
        NodeCapacity(
            node=f"a{i}" if i else "a", cluster="c", region=EU, zone=f"{EU}-a", gpu_model="A100", gpus_total=1
        )
        for i in range(a100_nodes)
    ]
    nodes.append(
        NodeCapacity(node="h", cluster="c", region=EU, zone=f"{EU}-a", gpu_model="H100", gpus_total=1)
    )
    speeds = {"A100": 3.0, "H100": h100_speed}
    return Platform(
        name="learn-test",
        nodes=nodes,
        clusters={"c": ClusterInfo(id="c", region=EU, zone=f"{EU}-a")},
        net=NetMatrix.from_topology(load_topology()),
        economics=default_economics(),
        speed={
            (m, t): s for m, s in speeds.items() for t in ("training_compute", "inference", "training_memory")
        },
        gpu_memory_gib={"A100": 80.0, "H100": 80.0},
    )


def test_a_three_times_wrong_profile_is_learned_within_15_percent_in_ten_runs_and_changes_decisions() -> None:
    """The must-show in the simulator: the truth runs ``fam`` on the A100 at the reference speed (the
    profile says 3x) and on the H100 at 2x (as believed), with 5 % run noise. The learner, taught by
    completed runs timed by that truth, knows the A100 within 15 % of 1/3 of its profile after at
    most ten runs, and Loom then sends the family to the H100, which really is faster."""
    from loom.model.learn import SpeedLearner

    truth = parse_truth(
        tiny(
            [c("fam", "V100M16", 10.0), c("fam", "A100", 10.0), c("fam", "H100", 20.0)],
            families={"fam": {"task_type": "training_compute"}},
            noise={"cv": 0.05},
        )
    )
    jobs = [
        SimJob(spec=fam_job(f"j{i:02d}", steps=100, step_time_s=1.0), arrival_s=1000.0 * i) for i in range(12)
    ]
    learner = SpeedLearner()
    result = simulate(
        Trace(jobs=jobs), two_pool_platform(), POLICIES["loom"](0), truth=truth, learner=learner, seed=3
    )
    # The loom policy learns by itself too (its own learner), as placement does.
    own = simulate(Trace(jobs=list(jobs)), two_pool_platform(), POLICIES["loom"](0), truth=truth, seed=3)
    assert [r.gpu_model for r in own.records] == [r.gpu_model for r in result.records]
    records = sorted(result.records, key=lambda r: r.arrival_s)
    a100_runs = [r for r in records if r.gpu_model == "A100"]
    assert records[0].gpu_model == "A100"  # believed 3x: the first job goes there
    assert 1 <= len(a100_runs) <= 10
    estimate = learner.estimate("fam", "A100")
    assert estimate.factor == pytest.approx(1 / 3, rel=0.15)
    # Once learned, the family goes to the H100 (truly 2x) and runs twice as fast as on the A100.
    assert [r.gpu_model for r in records[-2:]] == ["H100", "H100"]
    assert records[-1].jct_s < 0.6 * records[0].jct_s
    # Without learning the scheduler keeps its wrong belief and keeps choosing the A100.
    blind_policy = POLICIES["loom"](0)
    assert isinstance(blind_policy, FrameworkPolicy)
    blind_policy.speed_learner = None
    blind = simulate(Trace(jobs=list(jobs)), two_pool_platform(), blind_policy, truth=truth, seed=3)
    assert all(r.gpu_model == "A100" for r in blind.records)


def test_a_running_job_teaches_its_speed_at_its_first_progress_report_once() -> None:
    """The agent reports progress every tenth of a run's steps with the compute step it measured,
    and placement learns from the first such report: a job arriving while the first A100 run is
    under way (past its first tenth) already knows the A100 runs the family at 2x, not the profile's
    3x, and takes the H100 (2.5x), though an A100 is free. The run teaches once: its completion
    adds nothing. A run more than twice as slow as predicted (what the slow-node rule flags: a slow
    node looks the same mid-run) teaches only when it completes."""
    from loom.model.learn import SpeedLearner

    def scenario(a100: float, second_at: float) -> tuple[dict[str, str], SpeedLearner]:
        truth = parse_truth(
            tiny(
                [c("fam", "V100M16", 10.0), c("fam", "A100", 10.0 * a100), c("fam", "H100", 25.0)],
                families={"fam": {"task_type": "training_compute"}},
            )
        )
        jobs = [
            SimJob(spec=fam_job("first", steps=1000, step_time_s=1.0), arrival_s=0.0),
            SimJob(spec=fam_job("second", steps=100, step_time_s=1.0), arrival_s=second_at),
        ]
        learner = SpeedLearner()
        platform = two_pool_platform(a100_nodes=2, h100_speed=2.5)
        result = simulate(
            Trace(jobs=jobs), platform, POLICIES["loom"](0), truth=truth, learner=learner, seed=3
        )
        by_id = {r.job_id: r for r in result.records}
        first = by_id["first"]
        assert first.gpu_model == "A100" and first.end_s is not None and first.end_s > second_at
        return {r.job_id: r.gpu_model for r in result.records}, learner

    # Truly 2x (1.5x slower than believed): 500 s, its first tenth ends at 50 s.
    placed, learner = scenario(a100=2.0, second_at=150.0)
    assert placed["second"] == "H100"
    assert learner.runs() == {("fam", "A100"): 1, ("fam", "H100"): 1}
    assert learner.estimate("fam", "A100").factor == pytest.approx(2 / 3, rel=0.15)
    # Arriving before that first tenth, it is decided with the profile alone: the free A100.
    early, _ = scenario(a100=2.0, second_at=20.0)
    assert early["second"] == "A100"
    # Truly 1x (3x slower than believed): nothing is learned mid-run, the free A100 is taken.
    slow, learner = scenario(a100=1.0, second_at=150.0)
    assert slow["second"] == "A100"
    assert learner.estimate("fam", "A100").factor == pytest.approx(1 / 3, rel=0.15)  # at completion


def test_a_half_precision_family_learns_against_its_half_precision_profile() -> None:
    """The learned factor multiplies the fp16 speed for an fp16 family, so it must be measured
    against the fp16 speed: the belief then converges to the truth (not to truth x fp16 / fp32)."""
    from loom.model.learn import SpeedLearner

    plat = two_pool_platform()
    plat.half_speed.update({("A100", t): 6.0 for t in ("training_compute", "inference", "training_memory")})
    plat.half_speed.update({("H100", t): 2.0 for t in ("training_compute", "inference", "training_memory")})
    truth = parse_truth(
        tiny(
            [
                c("fam", "V100M16", 10.0, precision="fp16"),
                c("fam", "A100", 20.0, precision="fp16"),
                c("fam", "H100", 30.0, precision="fp16"),
            ],
            families={"fam": {"task_type": "training_compute"}},
        )
    )
    spec = msgspec.structs.replace(
        fam_job("h0", steps=100, step_time_s=1.0), labels={"model": "fam", "precision": "fp16"}
    )
    jobs = [
        SimJob(spec=msgspec.structs.replace(spec, job_id=f"h{i}"), arrival_s=1000.0 * i) for i in range(4)
    ]
    learner = SpeedLearner()
    records = simulate(
        Trace(jobs=jobs), plat, POLICIES["loom"](0), truth=truth, learner=learner, seed=1
    ).records
    assert records[0].gpu_model == "A100" and records[0].belief_step_s == pytest.approx(1 / 6)
    estimate = learner.estimate("fam@fp16", "A100")
    assert estimate.factor == pytest.approx(2.0 / 6.0, rel=0.05)  # true 2x over the fp16 profile's 6x
    # Once learned, what the scheduler expects of the next runs is what they deliver.
    last = records[-1]
    assert last.gpu_model == "A100" and last.belief_compute_step_s == pytest.approx(
        last.compute_step_s, rel=0.05
    )


def test_the_oracle_keeps_the_truth_when_a_learner_is_passed() -> None:
    from loom.model.learn import SpeedLearner

    truth = parse_truth(
        tiny(
            [c("fam", "V100M16", 10.0), c("fam", "A100", 10.0), c("fam", "H100", 20.0)],
            families={"fam": {"task_type": "training_compute"}},
        )
    )
    jobs = [SimJob(spec=fam_job(f"o{i}", steps=100, step_time_s=1.0), arrival_s=1000.0 * i) for i in range(3)]
    learner = SpeedLearner()
    records = simulate(
        Trace(jobs=jobs), two_pool_platform(), POLICIES["oracle"](0), truth=truth, learner=learner, seed=1
    ).records
    assert [r.gpu_model for r in records] == ["H100"] * 3  # knows from the start: H100 is truly 2x
    assert learner.estimates() == []  # and learns nothing that could overwrite the truth


def test_a_perturbed_truth_scales_each_family_gpu_pair_by_one_factor_and_keeps_the_reference() -> None:
    from loom.sim.truth import load_truth, perturbed

    base = load_truth()
    truth, factors = perturbed(base, 0.5, seed=3)
    assert factors and all(gpu != base.reference_gpu for _family, gpu in factors)
    assert len(set(factors.values())) == len(factors)  # each pair its own draw
    assert perturbed(base, 0.5, seed=3)[1] == factors  # deterministic in the seed
    assert perturbed(base, 0.5, seed=4)[1] != factors
    for before, after in zip(base.cells, truth.cells, strict=True):
        factor = factors.get((before.family, before.gpu_model), 1.0)
        assert after.throughput == pytest.approx(before.throughput * factor)
    # One factor per pair: a family's 1-GPU speed on a GPU moves by it, its intra-node scaling not.
    gpu = "A100"
    family = next(
        c.family for c in base.cells if c.gpu_model == gpu and c.gpus_per_node == 8 and c.precision == "fp32"
    )
    was, now = (t.speed(family, gpu, precision="fp32") for t in (base, truth))
    assert now.rule == was.rule == "measured"
    assert now.single == pytest.approx(was.single * factors[(family, gpu)])
    eight = [t.speed(family, gpu, precision="fp32", gpus_per_node=8) for t in (base, truth)]
    assert eight[1].scaling == pytest.approx(eight[0].scaling) and eight[0].scaling < 1.0
    assert perturbed(base, 0.0, seed=1)[0].cells == base.cells
    with pytest.raises(ValueError, match="sigma"):
        perturbed(base, -0.1, seed=1)


# ---- what an operator's file may get wrong -----------------------------------------------------


def three_families(*extra: dict[str, Any]) -> dict[str, Any]:
    """Families ``a`` and ``b`` measured on the V100, A100 and H100 (3x and 6x the V100), plus ``extra``."""
    cells = [
        c(family, gpu, value, series=family)
        for family in ("a", "b")
        for gpu, value in (("V100M16", 10.0), ("A100", 30.0), ("H100", 60.0))
    ]
    return tiny([*cells, *extra], families={f: {"task_type": "training_compute"} for f in "abn"})


def test_a_family_without_a_reference_cell_gets_a_derived_reference_and_flagged_speeds() -> None:
    truth = parse_truth(three_families(c("n", "A100", 90.0, series="n"), c("n", "H100", 180.0, series="n")))
    # Its reference throughput: 90 / 3 (the others' A100 speed) and 180 / 6 (H100), so 30.
    for gpu, expected in (("A100", 3.0), ("H100", 6.0), ("V100M16", 1.0)):
        got = truth.speed("n", gpu)
        assert got.speed == pytest.approx(expected)
        assert got.derived and got.rule == "derived-reference"
    assert truth.derived_reference == {("n", "fp32")}
    assert truth.speed("a", "A100").rule == "measured"


def test_the_packaged_file_without_a_familys_reference_cells_derives_its_speeds_near_the_measured() -> None:
    document = packaged_document()
    measured = load_truth().speed("bert-large", "A100").speed
    document["cells"] = [
        x for x in document["cells"] if not (x["family"] == "bert-large" and x["gpu_model"] == "V100M16")
    ]
    got = parse_truth(document).speed("bert-large", "A100")
    assert got.rule == "derived-reference" and got.speed != 1.0
    assert measured / 2 < got.speed < measured * 2


def test_a_family_with_no_reference_cell_and_no_bridge_to_it_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps(three_families(c("n", "K80", 5.0, series="n"))))
    with pytest.raises(
        TruthError, match=r"family 'n' has no fp32 cell on the reference GPU V100M16"
    ) as caught:
        load_truth(path)
    assert str(path) in str(caught.value) and "K80" in str(caught.value)


def test_a_file_with_half_precision_cells_only_times_fp32_jobs_by_them_flagged() -> None:
    truth = parse_truth(
        tiny([c("f", "V100M16", 10.0, precision="fp16"), c("f", "A100", 20.0, precision="fp16")])
    )
    got = truth.speed("f", "A100")
    assert got.speed == pytest.approx(2.0)
    assert (got.derived, got.rule, got.precision) == (True, "precision-fallback", "fp16")
    assert truth.speed("f@fp16", "A100").rule == "measured"


@pytest.mark.parametrize("reference", ["A100", "h100", 123])
def test_a_reference_gpu_other_than_the_schedulers_is_refused_saying_why(reference: object) -> None:
    document = tiny([c("f", "V100M16", 10.0), c("f", "A100", 20.0)], reference_gpu=reference)
    with pytest.raises(TruthError, match="reference_gpu") as caught:
        parse_truth(document, "mine.json")
    assert "mine.json" in str(caught.value)
    if isinstance(reference, str):
        assert "V100M16" in str(caught.value) and "step times" in str(caught.value)


def test_gpu_names_are_case_insensitive_in_cells_and_the_reference() -> None:
    truth = parse_truth(
        tiny(
            [c("f", "v100m16", 10.0), c("f", "a100", 20.0)],
            reference_gpu="v100m16",
            gpu_aliases={"g3": "a100"},
        )
    )
    assert truth.reference_gpu == "V100M16"
    assert {x.gpu_model for x in truth.cells} == {"V100M16", "A100"}
    got = truth.speed("f", "A100")
    assert (got.speed, got.rule) == (2.0, "measured")
    assert truth.speed("f", "G3").speed == 2.0


@pytest.mark.parametrize(
    ("cells", "where"),
    [
        ([c("f", "V100M16", 1e-320), c("f", "A100", 10.0)], r"cells\[0\].throughput 1e-320 and cells\[1\]"),
        ([c("f", "V100M16", 1e-300), c("f", "A100", 1e300)], r"cells\[0\].throughput 1e-300 and cells\[1\]"),
    ],
)
def test_throughputs_whose_ratios_leave_the_floats_are_refused(
    cells: list[dict[str, Any]], where: str
) -> None:
    with pytest.raises(TruthError, match=where + r".*too far apart"):
        parse_truth(tiny(cells))


def test_a_derived_speed_that_overflows_raises_instead_of_timing_a_job_by_infinity() -> None:
    truth = parse_truth(
        tiny(
            [
                c("f", "V100M16", 1.0, series="f"),
                c("f", "A100", 1e200, series="f"),
                c("p", "V100M16", 1.0, series="p"),
                c("p", "A100", 1e-200, series="p"),
                c("p", "H100", 1e100, series="p"),
            ],
            families={"f": {"task_type": "training_compute"}, "p": {"task_type": "training_compute"}},
        ),
        "wide.json",
    )
    with pytest.raises(TruthError, match=r"wide.json: the speed of f \(fp32\) on H100 .* inf"):
        truth.speed("f", "H100")


@pytest.mark.parametrize("gpu", ["A100", "a100"])
def test_a_duplicate_measurement_is_refused_naming_both_cells(gpu: str) -> None:
    document = tiny(
        [c("f", "V100M16", 10.0), c("f", "A100", 20.0), c("f", "V100M16", 5.0, n=2), c("f", gpu, 30.0)]
    )
    with pytest.raises(TruthError, match=r"cells\[1\] and cells\[3\] are the same measurement"):
        parse_truth(document)
    document["cells"][3]["series"] = "other"  # another series: another measurement
    parse_truth(document)


def test_a_truth_file_with_a_byte_order_mark_is_read_and_one_not_utf8_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "bom.json"
    path.write_text("\ufeff" + json.dumps(tiny([c("f", "V100M16", 10.0), c("f", "A100", 20.0)])), "utf-8")
    assert load_truth(path).speed("f", "A100").speed == 2.0
    path.write_bytes(b'{"format": "loom-truth\xff"}')
    with pytest.raises(TruthError, match="is not UTF-8 text"):
        load_truth(path)


def test_perturbing_keeps_the_reference_cells_whatever_their_spelling() -> None:
    document = tiny(
        [c("f", "v100m16", 10.0), c("f", "A100", 20.0), c("g", "V100m16", 5.0), c("g", "A100", 5.0)],
        reference_gpu="v100m16",
    )
    base = parse_truth(document)
    truth, factors = perturbed(base, 0.5, seed=1)
    assert set(factors) == {("f", "A100"), ("g", "A100")}
    assert [x.throughput for x in truth.cells if x.gpu_model == "V100M16"] == [10.0, 5.0]


@pytest.mark.parametrize("sigma", [math.inf, math.nan, -0.1, 40.0])
def test_perturbing_refuses_a_sigma_that_cannot_give_finite_positive_factors(sigma: float) -> None:
    with pytest.raises(ValueError, match="sigma"):
        perturbed(load_truth(), sigma, seed=1)


def believed_fast_platform() -> Platform:
    """An A100 node believed 4x the reference and a V100 node (the reference), in two clusters."""
    nodes = [
        NodeCapacity(node="a0", cluster="ca", region=EU, zone=f"{EU}-a", gpu_model="A100", gpus_total=8),
        NodeCapacity(node="v0", cluster="cv", region=EU, zone=f"{EU}-b", gpu_model="V100M16", gpus_total=8),
    ]
    speed = {
        (m, t): s
        for m, s in (("A100", 4.0), ("V100M16", 1.0))
        for t in ("training_compute", "training_memory")
    }
    return Platform(
        name="two-pools",
        nodes=nodes,
        clusters={
            "ca": ClusterInfo(id="ca", region=EU, zone=f"{EU}-a"),
            "cv": ClusterInfo(id="cv", region=EU, zone=f"{EU}-b"),
        },
        net=NetMatrix.from_topology(load_topology()),
        economics=default_economics(),
        speed=speed,
        gpu_memory_gib={"A100": 80.0, "V100M16": 16.0},
    )


def eight_gpu_job(job_id: str) -> JobSpec:
    return JobSpec(
        job_id=job_id,
        tenant="t",
        resources=Resources(gpus=8),
        work=Work(steps=1000, step_time_s=0.6),
        labels={"model": "fam"},
    )


@pytest.mark.parametrize(("arrival_s", "waits"), [(30.0, True), (100.0, False)])
def test_a_job_waits_for_gpus_held_by_a_slow_run_only_until_its_progress_shows_how_slow(
    arrival_s: float, waits: bool
) -> None:
    # "first" takes the A100 believed 4x the V100: predicted to end at 150 s, it truly runs at the
    # reference speed (600 s). "second" prefers to wait for that A100 while the prediction stands
    # (150 s, then 150 s of run, against 600 s on the V100 now); from first's progress report at a
    # tenth of its run (60 s), its end is re-predicted from its pace, and waiting no longer pays.
    flat = parse_truth(
        tiny(
            [
                c("fam", "V100M16", 10.0),
                c("fam", "A100", 10.0),
                c("fam", "V100M16", 80.0, n=8),
                c("fam", "A100", 80.0, n=8),
            ],
            families={"fam": {"task_type": "training_compute"}},
        )
    )
    policy = POLICIES["loom"](0)
    assert isinstance(policy, FrameworkPolicy)
    policy.speed_learner = None  # the re-predicted end alone: no lesson about the A100 either
    trace = Trace(jobs=[SimJob(eight_gpu_job("first"), 0.0), SimJob(eight_gpu_job("second"), arrival_s)])
    records = {r.job_id: r for r in simulate(trace, believed_fast_platform(), policy, truth=flat).records}
    first, second = records["first"], records["second"]
    assert first.gpu_model == "A100" and first.end_s == pytest.approx(600.0)
    assert second.gpu_model == "V100M16"
    assert second.start_s is not None
    if waits:
        # Held back until its wait for the A100 (predicted free at 150 s) ran out, by which time
        # first's report had shown it ends at 600 s: started on the V100 then.
        assert second.start_s == pytest.approx(150.0)
    else:
        assert second.start_s == pytest.approx(arrival_s)


def test_a_gpu_measured_only_on_several_gpus_a_node_is_timed_from_that_cell_not_by_its_profile(
    tmp_path: Path,
) -> None:
    # The A100 measured only at 2 GPUs a node, 6x slower than the reference there. Before, that
    # cell was dropped without a word and the A100 was timed by its profile (4.7x faster).
    document = tiny(
        [
            c("resnet-50", "V100M16", 400.0),
            c("resnet-50", "V100M16", 760.0, n=2),
            c("resnet-50", "A100", 133.0, n=2),
        ],
        families={"resnet-50": {"task_type": "training_compute"}},
    )
    truth = parse_truth(document)
    speed = truth.speed("resnet-50", "A100")
    # s1 = 133 / (2 x eff(2)) / 400 with the reference's own eff(2) = 760 / (2 x 400) = 0.95.
    assert speed.rule == "from-multi-gpu" and speed.derived
    assert speed.speed == pytest.approx(133.0 / (2 * 0.95) / 400.0)
    assert truth.speed("resnet-50", "A100", gpus_per_node=2).speed == pytest.approx(133.0 / 2 / 400.0)


@pytest.mark.parametrize(
    ("document", "message"),
    [
        (
            tiny([{**c("resnet-50", "V100M16", 400.0), "extra": 1}]),
            r"cells\[0\] has unknown field\(s\) 'extra'",
        ),
        (
            tiny(
                [c("resnet-50", "V100M16", 400.0)], families={"resnet-50": {"task_type": "training_computee"}}
            ),
            r"families\['resnet-50'\]\.task_type must be one of training_compute, .*got 'training_computee'",
        ),
        (
            # A field's name misspelt: the family went without its task type, silently.
            tiny(
                [c("resnet-50", "V100M16", 400.0)], families={"resnet-50": {"tasktype": "training_compute"}}
            ),
            r"families\['resnet-50'\] must be an object of about, task_type; it has 'tasktype'",
        ),
    ],
)
def test_a_truth_file_with_an_unknown_cell_field_or_task_type_is_refused(document: Any, message: str) -> None:
    # Both were accepted and ignored before: a typo changed the timings without a word.
    with pytest.raises(TruthError, match=message):
        parse_truth(document)


def test_truth_cells_of_a_gpu_no_one_has_are_named_and_the_report_warns(tmp_path: Path) -> None:
    from loom_benchmarks import policies

    truth = parse_truth(tiny([c("resnet-50", "V100M16", 400.0), c("resnet-50", "H900", 100.0)]))
    platform = one_gpu_platform("A100", 4.0)
    assert policies.unknown_truth_gpus(truth, platform) == ["H900"]
    assert policies.unknown_truth_gpus(load_truth(), platform) == []  # the packaged tables: all known


def test_a_platform_gpu_aliased_to_a_gpu_no_cell_measures_is_named_and_warned_of(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # "G2" -> "A1000" (a typo): every G2 job was timed at the reference speed, with no warning.
    from loom_benchmarks import policies

    doc = tiny([c("resnet-50", "V100M16", 400.0), c("resnet-50", "A100", 1200.0)])
    platform = one_gpu_platform("G2", 3.0)
    typo = parse_truth({**doc, "gpu_aliases": {"G2": {"gpu": "A1000"}}})
    assert typo.dangling_gpu_aliases() == {"G2": "A1000"}
    assert policies.dangling_aliases(typo, platform) == {"G2": "A1000"}
    assert policies.unknown_truth_gpus(typo, platform, warn=True) == []
    assert (
        "aliases the platform's GPU model(s) G2 -> A1000, which no cell measures" in capsys.readouterr().err
    )
    right = parse_truth({**doc, "gpu_aliases": {"G2": {"gpu": "A100"}}})
    assert right.dangling_gpu_aliases() == {} and policies.dangling_aliases(right, platform) == {}
    assert right.speed("resnet-50", "G2").speed == pytest.approx(3.0)


def test_a_trace_naming_a_model_the_truth_does_not_know_is_warned_of(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A misspelt ``labels.model`` ("resnet-5O") was timed as some other family chosen by hash,
    with nothing on stderr (an outside evaluator's file); a known name or alias is not named."""
    from loom.sim.model import SimJob, Trace
    from loom_benchmarks import policies
    from loom_proto.jobs import JobSpec, Resources, Work

    def job(job_id: str, labels: dict[str, str]) -> SimJob:
        spec = JobSpec(
            job_id=job_id,
            tenant="t",
            resources=Resources(gpus=1),
            work=Work(steps=1, step_time_s=1.0),
            labels=labels,
        )
        return SimJob(spec, 0.0, "training", "r1")

    trace = Trace(
        [
            job("a", {"model": "resnet-50"}),
            job("b", {"model": "resnet-5O"}),
            job("c", {"model": "resnet-5O"}),
            job("d", {}),
        ]
    )
    assert policies.unknown_model_labels(load_truth(), trace, warn=True) == {"resnet-5O": 2}
    assert "'resnet-5O' (2 jobs)" in capsys.readouterr().err
    assert (
        policies.unknown_model_labels(load_truth(), Trace([job("a", {"model": "resnet-50"})]), warn=True)
        == {}
    )
    assert capsys.readouterr().err == ""
    # An alias whose target is no family of the table is followed by nothing: named too (a review).
    dangling = load_truth()
    dangling.aliases["my-net"] = "no-such-family"
    assert policies.unknown_model_labels(dangling, Trace([job("e", {"model": "my-net"})])) == {"my-net": 1}


def test_bench_policies_checks_the_mix_claim_on_the_mix_only_and_refuses_a_platform_without_gpus(
    tmp_path: Path,
) -> None:
    # Before, a user's own workload was graded against the training mix's claim (FAIL on a
    # three-job file), and a topology without clusters ran every job "unfinished" with exit 0.
    from loom_benchmarks import policies

    path = tmp_path / "w.jsonl"
    path.write_text(
        "".join(
            json.dumps(
                {"job_id": f"j{i}", "arrival_s": i, "steps": 10, "step_time_s": 1, "class": "net_training"}
            )
            + "\n"
            for i in range(3)
        )
    )
    common = ("--workload", str(path), "--policies", "loom,greedy_compute", "--out", str(tmp_path / "r"))
    result = policies.run(_bench(*common))
    net = result["claims"]["checks"]["net_training_vs_greedy"]
    assert net["passed"] is None and "no training-mix run" in net["reason"]
    # Utilisation while the jobs arrive is reported beside the whole run's.
    for summary in result["summaries"]:
        overall = summary["overall"]
        assert 0 < overall["gpu_utilisation_arrivals"] <= 1 and 0 < overall["gpu_utilisation_mean"] <= 1
    empty = tmp_path / "topo.json"
    empty.write_text(
        json.dumps(
            {
                "name": "empty",
                "source": "test",
                "regions": [{"id": "r1", "source_name": "t:r1", "provider": "aws", "zones": ["r1-a"]}],
                "links": [],
                "clusters": [],
            }
        )
    )
    with pytest.raises(policies.OptionError, match="has no GPUs: nothing could run on it"):
        policies.run(_bench(*common, "--topology", str(empty)))


def test_a_model_slow_on_two_nodes_is_learned_mid_run_and_one_slow_node_is_not() -> None:
    # The A100 truly delivers a tenth of the reference (believed 3x): 30x slower than believed,
    # beyond the slow-node rule's 2x, so one run's mid-run report teaches nothing (it could be its
    # node). Before, two A100 nodes reporting the same waited for a completion (10,000 s) too.
    from loom.model.learn import SpeedLearner

    truth = parse_truth(
        tiny(
            [c("fam", "V100M16", 10.0), c("fam", "A100", 1.0), c("fam", "H100", 20.0)],
            families={"fam": {"task_type": "training_compute"}},
        )
    )

    def learned_by(a100_nodes: int, jobs: int) -> SpeedLearner:
        learner = SpeedLearner()
        trace = Trace(
            jobs=[
                SimJob(spec=fam_job(f"j{i}", steps=1000, step_time_s=1.0), arrival_s=float(i))
                for i in range(jobs)
            ]
        )
        simulate(
            trace,
            two_pool_platform(a100_nodes),
            POLICIES["loom"](0),
            truth=truth,
            learner=learner,
            horizon_s=2_000,
        )
        return learner

    two = learned_by(2, 2).estimate("fam", "A100")  # both reported by t ~ 1,000 s
    assert two.runs == 2 and two.factor == pytest.approx(0.1 / 3, rel=0.1)
    one = learned_by(1, 1).estimate("fam", "A100")  # one node: its completion will teach
    assert one.runs == 0 and one.factor == pytest.approx(1.0)
