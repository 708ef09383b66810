"""Bad input to the simulator's benchmarks is refused up front: a one-line message and rc 2, before
anything is simulated, never a traceback, a hang or a result lost at the end."""

import argparse
import math
from pathlib import Path

import pytest

from loom.sim.model import EventError, SimEvent
from loom.sim.report import ReportFolderError, check_report_folder


def _bench(*argv: str) -> argparse.Namespace:
    from loom_benchmarks import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def _no_simulation(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if anything is simulated: the options must be refused before."""

    def refuse(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("simulated despite a bad option")

    monkeypatch.setattr("loom.sim.engine.simulate", refuse)


def _one_line_refusal(capsys: pytest.CaptureFixture[str], rc: int, message: str) -> None:
    err = capsys.readouterr().err
    assert rc == 2
    assert message in err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err


# ---- events ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("at_s", [math.nan, math.inf, -math.inf, -5.0])
def test_an_event_at_a_time_that_is_not_finite_and_non_negative_is_refused(at_s: float) -> None:
    with pytest.raises(EventError, match="at_s must be a finite time >= 0"):
        SimEvent(at_s=at_s, kind="link_restore", region="r")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("rtt_factor", 0.0),
        ("rtt_factor", math.nan),
        ("bandwidth_factor", -1.0),
        ("bandwidth_factor", 0.0),
        ("factor", math.inf),
    ],
)
def test_an_event_with_a_factor_out_of_range_is_refused(field: str, value: float) -> None:
    with pytest.raises(EventError, match=field):
        SimEvent(at_s=1.0, kind="link_degrade", region="r", **{field: value})


# ---- bench migration ------------------------------------------------------------------------------

MIGRATION = ("migration", "--platforms", "wide16", "--loads", "0.8", "--seeds", "1", "--json")


@pytest.mark.parametrize("value", ["nan", "inf", "-5", "0"])
def test_migration_refuses_a_degradation_time_that_is_not_finite_and_positive(
    value: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from loom_benchmarks.migration import main

    _no_simulation(monkeypatch)
    args = _bench(*MIGRATION, "--units", "5", "--scenarios", "degradation", f"--degradation-s={value}")
    _one_line_refusal(capsys, main(args), "--degradation-s must be a finite number of seconds > 0")


@pytest.mark.parametrize("units", ["1", "0", "-2"])
def test_migration_refuses_too_few_units_for_a_scenario(
    units: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from loom_benchmarks.migration import main

    _no_simulation(monkeypatch)
    args = _bench(*MIGRATION, "--scenarios", "failure", f"--units={units}")
    _one_line_refusal(capsys, main(args), "--units must be at least 2 (the scenarios' times are shares")


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--scenarios", "", "name at least one scenario"),
        ("--platforms", ",", "name at least one platform"),
        ("--seeds", "1,x", "--seeds are integers"),
        ("--loads", "nan", "--loads must be finite numbers > 0"),
        ("--loads", "", "--loads needs at least one value"),
    ],
)
def test_migration_refuses_empty_or_bad_lists(
    option: str,
    value: str,
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from loom_benchmarks.migration import main

    _no_simulation(monkeypatch)
    _one_line_refusal(capsys, main(_bench(*MIGRATION, f"{option}={value}")), message)


def test_migration_runs_a_seed_or_load_named_twice_once() -> None:
    from loom_benchmarks.migration import check_options

    args = _bench("migration", "--seeds", "1,1,2", "--loads", "0.5,0.50", "--scenarios", "drain,drain")
    assert check_options(args) == (["wide16", "wide32"], ["drain"], [0.5], [1, 2])


# ---- bench contention -----------------------------------------------------------------------------

CONTENTION = ("contention", "--platforms", "small3", "--loads", "0.8", "--seeds", "1", "--policies", "loom")


def test_contention_refuses_a_bad_truth_file_as_policies_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from loom_benchmarks.contention import main

    _no_simulation(monkeypatch)
    bad = tmp_path / "truth.json"
    bad.write_text(
        '{"format": "loom-truth", "version": 1, "cells": [{"family": "f", "gpu_model": "V100M16",'
        ' "precision": "fp32", "gpus_per_node": 1, "throughput": -5, "series": "s"}]}'
    )
    _one_line_refusal(capsys, main(_bench(*CONTENTION, "--truth", str(bad))), "throughput must be a positive")
    missing = str(tmp_path / "none.json")
    _one_line_refusal(capsys, main(_bench(*CONTENTION, "--truth", missing)), "No such file or directory")


@pytest.mark.parametrize("units", ["0", "-2"])
def test_contention_refuses_units_below_one(
    units: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from loom_benchmarks.contention import main

    _no_simulation(monkeypatch)
    _one_line_refusal(capsys, main(_bench(*CONTENTION, f"--units={units}")), "--units must be at least 1")


def test_contention_parses_seeds_and_loads_once_each() -> None:
    from loom_benchmarks.contention import parse_loads, parse_seeds

    assert parse_seeds("1, 1,2") == [1, 2]
    assert parse_loads("0.8,0.80,1") == [0.8, 1.0]


# ---- bench policies -------------------------------------------------------------------------------


def _workload(tmp_path: Path) -> str:
    path = tmp_path / "w.jsonl"
    path.write_text('{"arrival_s": 0, "job_id": "a", "steps": 1, "step_time_s": 1}\n')
    return str(path)


def test_policies_refuses_an_out_path_that_is_a_file_before_simulating(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from loom_benchmarks.policies import main

    _no_simulation(monkeypatch)
    taken = tmp_path / "taken"
    taken.write_text("mine")
    args = _bench("policies", "--workload", _workload(tmp_path), "--policies", "loom", "--out", str(taken))
    _one_line_refusal(capsys, main(args), "exists and is not a folder")
    assert taken.read_text() == "mine"


def test_a_report_folder_is_checked_without_leaving_anything_behind(tmp_path: Path) -> None:
    check_report_folder(tmp_path / "new" / "report")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "file").write_text("")
    with pytest.raises(ReportFolderError, match=r"file is not a folder"):
        check_report_folder(tmp_path / "file" / "report")


def test_policies_says_a_missing_workload_file_does_not_exist(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from loom_benchmarks.policies import main

    rc = main(_bench("policies", "--workload", "cluster_job_log"))
    _one_line_refusal(capsys, rc, "--workload 'cluster_job_log': no such file; a workload is one of mix")
    missing = str(tmp_path / "w.jsonl")
    _one_line_refusal(capsys, main(_bench("policies", "--workload", missing)), "No such file or directory")


def test_policies_runs_the_grids_philly_like_trace_on_its_own(tmp_path: Path) -> None:
    """``--workload philly``: the grid's Philly-like trace (gangs, heavy tails) as a single run, on a
    platform scaled by ``--nodes``; options meant for trace files are refused for it."""
    from loom.model.topology import load_topology
    from loom_benchmarks.policies import OptionError, build_workload, resolve

    argv = ("--workload", "philly", "--jobs", "60", "--nodes", "30", "--seed", "3")
    options = resolve(_bench("policies", *argv))
    workload = build_workload(options, load_topology())
    jobs = workload.trace.jobs
    assert len(jobs) == 60
    assert len(workload.platform.nodes) == 30
    assert {j.job_class for j in jobs} <= {"net_training", "training"}
    assert any(j.spec.workers > 1 for j in jobs)  # its gangs
    again = build_workload(options, load_topology()).trace.jobs
    assert [(j.spec.job_id, j.arrival_s) for j in again] == [(j.spec.job_id, j.arrival_s) for j in jobs]
    with pytest.raises(OptionError, match="--trace-gpu applies to a public trace file"):
        resolve(_bench("policies", "--workload", "philly", "--trace-gpu", "V100"))


def test_a_workload_that_shrank_is_said_on_stderr_even_with_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A job no cluster of the platform can hold is rejected by every policy: the figures are over
    fewer jobs than the file has, so `--json` says so once (it said nothing: an outside walk)."""
    from loom_benchmarks import policies

    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"arrival_s": 0, "job_id": "huge", "steps": 10, "step_time_s": 1, "workers": 50, "gpus": 8}\n'
        '{"arrival_s": 0, "job_id": "fine", "steps": 10, "step_time_s": 1}\n'
    )
    args = _bench(
        "policies", "--workload", str(trace), "--topology", "small", "--policies", "loom,first_fit", "--json"
    )
    assert policies.main(args) == 0
    out, err = capsys.readouterr()
    assert '"rejected": 1' in out
    (line,) = err.strip().splitlines()
    assert line.startswith("every policy: 1 rejected:") and "can never fit" in line
