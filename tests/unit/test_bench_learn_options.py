"""``loom bench learn``: a value out of range is bad usage, refused at argument parsing (exit 2, a
message naming the option), never a traceback, an empty result or a figure of the noise."""

import argparse
import json

import pytest

from loom.cli.argtypes import non_negative_float_below


def _parser() -> argparse.ArgumentParser:
    from loom_benchmarks import add_arguments

    parser = argparse.ArgumentParser(prog="loom bench")
    add_arguments(parser)
    return parser


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--seeds", "0", "argument --seeds: must be 1 or more, got 0"),
        ("--seeds", "-3", "argument --seeds: must be 1 or more, got -3"),
        ("--seeds", "2.5", "argument --seeds: not a whole number: '2.5'"),
        ("--runs", "0", "argument --runs: must be 1 or more, got 0"),
        ("--noise-cv", "-1", "argument --noise-cv: must be 0 or more and below 1, got -1"),
        ("--noise-cv", "5", "argument --noise-cv: must be 0 or more and below 1, got 5"),
        ("--noise-cv", "1", "argument --noise-cv: must be 0 or more and below 1, got 1"),
        ("--noise-cv", "nan", "argument --noise-cv: not a finite number: 'nan'"),
        ("--truth", "0", "argument --truth: must be more than 0, got 0"),
        ("--truth", "-1", "argument --truth: must be more than 0, got -1"),
        ("--truth", "inf", "argument --truth: not a finite number: 'inf'"),
        ("--truth", "1e-300", "argument --truth: must be within 0.0001-10000, got 1e-300"),  # was taken
        ("--truth", "1e5", "argument --truth: must be within 0.0001-10000, got 100000"),
        ("--first-seed", "-1", "argument --first-seed"),
    ],
)
def test_learn_refuses_an_option_out_of_range_at_parsing_naming_it(
    option: str, value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        _parser().parse_args(["learn", f"{option}={value}"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert message in err
    assert "Traceback" not in err


def test_learn_runs_at_the_edges_of_its_ranges(capsys: pytest.CaptureFixture[str]) -> None:
    from loom_benchmarks import run_benchmark

    args = _parser().parse_args(
        ["learn", "--seeds", "1", "--runs", "1", "--noise-cv", "0", "--truth", "0.5", "--json"]
    )
    assert run_benchmark(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["seeds"] == 1 and result["noise_cv"] == 0.0 and result["truth"] == 0.5
    assert [row["runs"] for row in result["convergence"]["per_run"]] == [1]


def test_learn_runs_seeds_from_the_first_seed_asked(capsys: pytest.CaptureFixture[str]) -> None:
    # `--seeds N` always meant seeds 0..N-1, which the README's 200-seed run covers: no held-out check.
    from loom_benchmarks import run_benchmark

    def errors(*extra: str) -> list[float]:
        args = _parser().parse_args(
            ["learn", "--seeds", "3", "--runs", "1", "--noise-cv", "0.2", "--json", *extra]
        )
        assert run_benchmark(args) == 0
        result = json.loads(capsys.readouterr().out)
        return [result["first_seed"], *(row["median_error"] for row in result["convergence"]["per_run"])]

    assert errors()[0] == 0 and errors("--first-seed", "500")[0] == 500
    assert errors()[1:] != errors("--first-seed", "500")[1:]  # other seeds, other runs


def test_learn_keeps_its_defaults() -> None:
    args = _parser().parse_args(["learn"])
    assert (args.truth, args.noise_cv, args.runs, args.seeds) == (pytest.approx(1 / 3), 0.05, 10, 200)


def test_a_number_below_a_limit_takes_zero_and_refuses_the_limit_itself() -> None:
    below_one = non_negative_float_below(1.0)
    assert below_one("0") == 0.0
    assert below_one("0.999") == pytest.approx(0.999)
    for bad in ("1", "-0.001", "x", "inf"):
        with pytest.raises(argparse.ArgumentTypeError):
            below_one(bad)


def test_learn_predicts_measured_cells_it_never_saw_better_than_the_profile_alone() -> None:
    from loom_benchmarks.learn import held_out_cells, measured_deviations

    deviations = measured_deviations()
    assert len(deviations) > 200  # Gavel + Lambda: (model@precision, GPU) cells
    result = held_out_cells(0.05, seeds=12)
    assert set(result["shares"]) == {"0.05", "0.15", "0.3"}
    for name, share in result["shares"].items():
        assert share["predicted"] > 0
        learner, profile_alone = share["learner"], share["profile_alone_mean_abs_log_error"]
        loose = share["loose_priors"]["mean_abs_log_error"]
        # the learner's estimates of cells it never ran are nearer the measured truth than the
        # profile alone, and nearer than with the main effects' loose priors of before
        assert learner["mean_abs_log_error"] < profile_alone, name
        assert learner["mean_abs_log_error"] < loose, name
        # the estimate's own sd is not overconfident on real deviations (a normal error is within
        # 1 sd 68 % of the time; it is wider than that, so probes ask more than they must)
        assert learner["share_within_1_sd"] >= 0.68, name
