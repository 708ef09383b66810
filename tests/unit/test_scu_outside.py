"""``loom bench scu --outside``: AdaptDL / Pollux / Sia profiles read, ratios taken, errors scored."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from loom.model.profiles import profile_for_model
from loom.model.scu import speed_ratio
from loom.sim.truth import load_truth, parse_truth
from loom_benchmarks.scu_outside import (
    OutsideDataError,
    evaluate,
    largest_common_batch,
    outside_cells,
    read_node_steps,
    read_single_gpu_steps,
    read_tree,
    truth_document,
    workload_jobs,
)

HEADER = "local_bsz,step_time,sync_time,placement\n"


def profile(rows: list[tuple[int, float, str]], sync: float = 0.0) -> str:
    return HEADER + "".join(f"{b},{s},{sync},{p}\n" for b, s, p in rows)


def _tool(name: str) -> Any:
    """``tools/<name>.py`` as a module (the tools are scripts, not a package)."""
    tool = Path(__file__).resolve().parents[2] / "tools" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, tool)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write(folder: Path, model: str, name: str, text: str) -> Path:
    path = folder / model / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_only_one_gpu_rows_are_read_and_a_repeated_batch_keeps_its_median(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "bert",
        "placements-azure.csv",
        profile(
            [(8, 0.2, "1"), (8, 0.4, "1"), (8, 0.3, "1"), (16, 0.5, "1"), (16, 0.1, "2"), (32, 0.9, "11")],
            sync=0.001,
        ),
    )
    # step_time is the whole iteration: sync_time is part of it, never added.
    assert read_single_gpu_steps(path) == {8: pytest.approx(0.3), 16: pytest.approx(0.5)}
    assert read_node_steps(path) == {
        (1, 8): pytest.approx(0.3),
        (1, 16): pytest.approx(0.5),
        (2, 16): pytest.approx(0.1),
    }


def test_odd_placements_are_skipped_and_an_unreadable_csv_is_a_clear_error(tmp_path: Path) -> None:
    path = write(
        tmp_path, "bert", "placements-azure.csv", HEADER + "8,0.2,0,\u00b2\n8,0.3,0,1.0\n8,0.4,0,1\n"
    )
    assert read_node_steps(path) == {(1, 8): pytest.approx(0.4)}
    huge = write(tmp_path, "bert", "placements-rtx.csv", HEADER + '8,0.2,0,"' + "x" * 200_000 + '"\n')
    with pytest.raises(OutsideDataError, match="not a CSV file"):
        read_node_steps(huge)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("local_bsz,step_time\n8,0.2\n", "missing column(s) placement"),
        (profile([(8, -0.2, "1")]), "line 2"),
        (HEADER + "8,nan,0.0,1\n", "line 2"),
        (HEADER + "eight,0.2,0.0,1\n", "line 2"),
        (HEADER + "0,0.2,0.0,1\n", "line 2"),
    ],
)
def test_a_bad_profile_is_refused_naming_the_file_and_line(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, "bert", "placements-azure.csv", text)
    with pytest.raises(OutsideDataError, match=r"placements-azure\.csv") as info:
        read_single_gpu_steps(path)
    assert message in str(info.value)


def test_ratios_are_to_the_v100_at_common_batches_and_the_headline_takes_the_largest(tmp_path: Path) -> None:
    # The V100 (azure) runs batch 8 in 0.4 s and 16 in 0.8 s; the A100 (dgx) 0.2 s and 0.2 s.
    write(
        tmp_path, "cifar10", "placements-azure.csv", profile([(8, 0.4, "1"), (16, 0.8, "1"), (64, 1.0, "1")])
    )
    write(tmp_path, "cifar10", "placements-dgx.csv", profile([(8, 0.2, "1"), (16, 0.2, "1"), (32, 0.3, "1")]))
    profiles, skipped = read_tree([tmp_path])
    assert skipped == []
    cells, no_reference = outside_cells(profiles)
    assert no_reference == []
    assert [(c.gpu, c.batch, c.measured_ratio) for c in cells] == [
        ("A100-40G", 8, 2.0),
        ("A100-40G", 16, 4.0),
    ]
    (headline,) = largest_common_batch(cells)
    assert headline.batch == 16
    assert (headline.task_type, headline.precision) == ("training_memory", "fp32")


def test_the_extended_dgx_profile_wins_and_pollux_files_are_the_t4s(tmp_path: Path) -> None:
    write(tmp_path, "bert", "placements-azure.csv", profile([(4, 0.3, "1"), (8, 0.6, "1")]))
    write(tmp_path, "bert", "placements-dgx.csv", profile([(4, 0.3, "1")]))
    write(tmp_path, "bert", "placements-dgx-ext.csv", profile([(4, 0.15, "1"), (8, 0.2, "1")]))
    write(tmp_path, "bert", "placements.csv", profile([(4, 0.9, "1")]))  # Pollux: AWS g4dn, T4
    write(tmp_path, "gpt_pmp", "placements-rtx.csv", profile([(4, 0.9, "1")]))
    write(tmp_path, "bert", "placements-tpu.csv", profile([(4, 0.9, "1")]))
    profiles, skipped = read_tree([tmp_path])
    assert sorted(profiles) == [("bert", "aws"), ("bert", "azure"), ("bert", "dgx"), ("bert", "dgx-ext")]
    assert any("gpt_pmp" in s for s in skipped) and any("'tpu'" in s for s in skipped)
    write(tmp_path, "bert", "placements-aws.csv", profile([(4, 0.8, "1")]))
    _, skipped = read_tree([tmp_path])
    assert any("bert/aws already read" in s for s in skipped)
    cells, _ = outside_cells(profiles)
    by_gpu = {(c.gpu, c.batch): c.measured_ratio for c in cells}
    assert by_gpu == {
        ("A100-40G", 4): 2.0,
        ("A100-40G", 8): pytest.approx(3.0),
        ("T4", 4): pytest.approx(1 / 3),
    }


def test_the_evaluation_scores_the_packaged_weights_and_hands_each_miss_to_the_learner(
    tmp_path: Path,
) -> None:
    write(tmp_path, "bert", "placements-azure.csv", profile([(8, 0.9, "1")]))
    write(tmp_path, "bert", "placements-rtx.csv", profile([(8, 0.1, "1")]))  # 9x the V100: a host effect
    write(tmp_path, "deepspeech2", "placements-rtx.csv", profile([(8, 0.1, "1")]))  # no V100 to compare
    result = evaluate([tmp_path])
    predicted = speed_ratio(profile_for_model("RTX2080TI"), profile_for_model("V100M32"), "training_compute")
    (row,) = result["rows"]
    assert row["predicted"] == pytest.approx(predicted, abs=1e-4)
    assert row["measured"] == pytest.approx(9.0)
    assert result["largest_common_batch"]["median_error"] == pytest.approx(
        abs(predicted - 9.0) / 9.0, abs=1e-4
    )
    assert result["models_without_reference"] == ["deepspeech2"]
    # A profile ~14x off is learned within 15 % after two runs (the learner's confirmation rule).
    assert 9.0 / predicted == pytest.approx(11.8, rel=0.1)
    assert row["learned_runs_to_15pct"]["max"] == 2


def test_no_ratio_at_all_is_a_clear_error(tmp_path: Path) -> None:
    write(tmp_path, "bert", "placements-rtx.csv", profile([(8, 0.1, "1")]))
    with pytest.raises(OutsideDataError, match="no ratio to V100M32"):
        evaluate([tmp_path])
    with pytest.raises(OutsideDataError, match="not a folder"):
        evaluate([tmp_path / "missing"])


def test_the_cli_reports_the_outside_figures_and_refuses_a_bad_folder(tmp_path: Path) -> None:
    write(tmp_path, "imagenet", "placements-azure.csv", profile([(32, 0.5, "1")]))
    write(tmp_path, "imagenet", "placements-quad.csv", profile([(32, 0.6, "1")]))
    loom = [sys.executable, "-m", "loom.cli.main"]
    done = subprocess.run(
        [*loom, "bench", "scu", "--json", "--outside", str(tmp_path)],
        check=False,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    outside = json.loads(done.stdout)["outside"]
    assert outside["rows"][0]["precision"] == "fp16"
    assert outside["rows"][0]["measured"] == pytest.approx(0.5 / 0.6, abs=1e-4)
    bad = subprocess.run(
        [*loom, "bench", "scu", "--outside", str(tmp_path / "nope")],
        check=False,
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2
    assert "not a folder" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_a_truth_file_from_the_profiles_times_jobs_by_them_with_intra_node_scaling(tmp_path: Path) -> None:
    # V100 (azure): batch 8 in 0.4 s on one GPU; 2 GPUs of one node: 0.5 s a step (per GPU 80 %).
    write(tmp_path, "bert", "placements-azure.csv", profile([(8, 0.4, "1"), (8, 0.5, "2"), (8, 0.9, "11")]))
    write(tmp_path, "bert", "placements-rtx.csv", profile([(8, 0.8, "1")]))
    write(tmp_path, "yolov3", "placements-azure.csv", profile([(4, 0.2, "1")]))
    write(tmp_path, "yolov3", "placements-dgx.csv", profile([(4, 0.25, "1")]))
    truth = parse_truth(truth_document([tmp_path]), "sia")
    assert truth.speed("bert", "V100M16").speed == pytest.approx(1.0)
    assert truth.speed("bert", "RTX2080TI").speed == pytest.approx(0.5)
    assert truth.speed("bert", "RTX2080TI").rule == "measured"
    assert truth.speed("bert", "V100M16", gpus_per_node=2).speed == pytest.approx(0.8)
    # Measured slower on the A100 than on the V100: the truth says so, whatever the profile says.
    assert truth.speed("yolov3", "A100-40G").speed == pytest.approx(0.8)
    assert truth.speed("yolov3", "G2").speed == pytest.approx(0.8)  # Loom's G2 is an A100 here too
    assert truth.speed("bert", "V100M32").speed == pytest.approx(1.0)
    assert truth.speed("yolov3", "G3").rule == "profile-ratio"  # an A100 80 GB: not the card measured


def test_the_truth_keeps_a_models_larger_batches_where_the_gpus_are_busy(tmp_path: Path) -> None:
    # At batch 4 the V100's host holds it back (the RTX looks 2x faster); at 16 and 32 it is 0.5x.
    write(
        tmp_path,
        "ncf",
        "placements-azure.csv",
        profile([(4, 0.4, "1"), (8, 0.4, "1"), (16, 0.2, "1"), (32, 0.4, "1")], sync=0.05),
    )
    write(
        tmp_path,
        "ncf",
        "placements-rtx.csv",
        profile([(4, 0.2, "1"), (8, 0.4, "1"), (16, 0.4, "1"), (32, 0.8, "1")]),
    )
    document = truth_document([tmp_path])
    assert sorted({c["batch"] for c in document["cells"]}) == [8, 16, 32]
    truth = parse_truth(document, "sia")
    assert truth.speed("ncf", "RTX2080TI").speed == pytest.approx((1.0 * 0.5 * 0.5) ** (1 / 3))


def test_the_truth_tool_writes_a_file_the_simulator_loads_and_refuses_nonsense(tmp_path: Path) -> None:
    module = _tool("adaptdl_truth")
    data = tmp_path / "traces"
    write(data, "cifar10", "placements-azure.csv", profile([(32, 0.1, "1")]))
    write(data, "cifar10", "placements-quad.csv", profile([(32, 0.125, "1")]))
    out = tmp_path / "truth.json"
    assert module.main([str(data), "-o", str(out)]) == 0
    assert load_truth(out).speed("resnet-18", "QRTX6000").speed == pytest.approx(0.8)
    assert module.main([str(data), "-o", str(out)]) == 2  # never overwrites
    empty = tmp_path / "empty"
    empty.mkdir()
    assert module.main([str(empty), "-o", str(tmp_path / "other.json")]) == 2
    assert not (tmp_path / "other.json").exists()


def test_the_sia3_platform_is_sias_cluster_one_gpu_model_per_cluster_and_opt_in() -> None:
    from loom_benchmarks.contention import PLATFORMS, cells, platform_and_topology

    platform, topology = platform_and_topology("sia3")
    by_cluster: dict[str, dict[str, int]] = {}
    for node in platform.nodes:
        models = by_cluster.setdefault(node.cluster, {})
        models[str(node.gpu_model)] = models.get(str(node.gpu_model), 0) + node.gpus_total
    assert by_cluster == {"c-sea1-a": {"T4": 24}, "c-use2-a": {"A100-40G": 16}, "c-weu-a": {"RTX2080TI": 24}}
    assert len({c.region for c in topology.clusters}) == 3
    assert "sia3" not in PLATFORMS  # the default run is unchanged
    assert {c.span for c in cells(["sia3"], ["mix"], [1.0], [1])} == {False}


def _validation(folder: Path, model: str, batch: int, iterations: list[int]) -> None:
    path = folder / model / f"validation-{batch}.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = "".join(f"{i},{i},0.5,1.0,1.0\n" for i in iterations)
    path.write_text("progress,iteration,metric,grad_sqr,grad_var\n" + rows)


def test_a_sia_workload_becomes_gangs_whose_work_follows_pollux_rule(tmp_path: Path) -> None:
    traces = tmp_path / "traces"
    # BERT trains 2 epochs: 1,000 iterations at global batch 12, 200 at 96 (after epoch 2).
    _validation(traces, "bert", 12, [500, 1000, 1500])
    _validation(traces, "bert", 96, [100, 200, 300])
    write(traces, "bert", "placements-azure.csv", profile([(4, 0.2, "1"), (8, 0.3, "1")]))
    workload = tmp_path / "workload-1.csv"
    workload.write_text(
        "name,time,application,num_replicas,batch_size\nbert-0,10,bert,6,48\nbert-1,20.5,bert,1,4\n"
    )
    first, second = workload_jobs(workload, [traces])
    # batch 48: between 12 (1,000) and 96 (200): 1000 + (48 - 12) / 84 x (200 - 1000)
    assert first["steps"] == round(1000 + 36 / 84 * (200 - 1000))
    assert first["workers"] == 6 and first["gpus"] == 1
    assert first["step_time_s"] == pytest.approx(0.3)  # local batch 8 on the V100
    assert first["labels"] == {"family": "bert-base", "batch": "8", "precision": "fp32"}
    assert first["class"] == "net_training" and first["bytes_per_step"] == 440_000_000
    assert second["steps"] == 1000 and second["class"] == "training" and "bytes_per_step" not in second
    assert second["arrival_s"] == 20.5


def test_the_workload_tool_writes_jobs_loom_reads_and_refuses_what_it_cannot_time(tmp_path: Path) -> None:
    from loom.sim.workloads import load_workload

    module = _tool("adaptdl_workload")
    traces = tmp_path / "traces"
    _validation(traces, "cifar10", 256, list(range(10, 1010, 10)))
    write(traces, "cifar10", "placements-azure.csv", profile([(32, 0.1, "1"), (64, 0.15, "1")]))
    workload = tmp_path / "w.csv"
    workload.write_text("name,time,application,num_replicas,batch_size\ncifar10-0,0,cifar10,4,256\n")
    out, topo = tmp_path / "w.jsonl", tmp_path / "sia3.json"
    assert module.main([str(workload), str(traces), "-o", str(out), "--topology-out", str(topo)]) == 0
    trace = load_workload(out)
    (job,) = trace.jobs
    assert (job.spec.workers, job.spec.work.steps) == (4, 1000)
    assert job.spec.work.step_time_s == pytest.approx(0.15)
    assert load_topology_file(topo) == 64
    unknown = tmp_path / "u.csv"
    unknown.write_text("name,time,application,num_replicas,batch_size\nx,0,gpt_pmp,4,256\n")
    assert module.main([str(unknown), str(traces), "-o", str(tmp_path / "u.jsonl")]) == 2
    no_curves = tmp_path / "n.csv"
    no_curves.write_text("name,time,application,num_replicas,batch_size\nb,0,bert,4,256\n")
    assert module.main([str(no_curves), str(traces), "-o", str(tmp_path / "n.jsonl")]) == 2
    assert not (tmp_path / "u.jsonl").exists() and not (tmp_path / "n.jsonl").exists()


def load_topology_file(path: Path) -> int:
    from loom.model.topology import load_topology

    return sum(c.total_gpus for c in load_topology(path).clusters)


def test_a_gpu_whose_memory_stops_below_the_floor_keeps_its_largest_batch_measured(tmp_path: Path) -> None:
    # The V100 runs batches 4..64; the RTX 2080 Ti stops at 8 (memory), below the floor (16).
    write(
        tmp_path,
        "yolov3",
        "placements-azure.csv",
        profile([(4, 0.1, "1"), (8, 0.2, "1"), (16, 0.4, "1"), (32, 0.8, "1")]),
    )
    write(tmp_path, "yolov3", "placements-rtx.csv", profile([(4, 0.2, "1"), (8, 0.5, "1")]))
    write(
        tmp_path,
        "yolov3",
        "placements-dgx.csv",
        profile([(8, 0.1, "1"), (16, 0.4, "1"), (32, 0.8, "1"), (64, 1.6, "1")]),
    )
    document = truth_document([tmp_path])
    kept = {(c["gpu_model"], c["batch"]) for c in document["cells"]}
    assert ("RTX2080TI", 8) in kept and ("V100M16", 8) in kept and ("RTX2080TI", 4) not in kept
    assert ("A100-40G", 8) not in kept  # the small batch is kept only to compare the RTX with
    truth = parse_truth(document, "sia")
    assert truth.speed("yolov3", "RTX2080TI").speed == pytest.approx(0.4)
    assert truth.speed("yolov3", "RTX2080TI").rule == "measured"
    assert truth.speed("yolov3", "A100-40G").speed == pytest.approx(1.0)
