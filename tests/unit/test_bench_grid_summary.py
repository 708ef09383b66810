"""``loom bench grid-summary``: cells from several grid JSONs judged against the 3 % bound."""

import argparse
import json
from pathlib import Path

import pytest

from loom_benchmarks import grid_summary


def _line(
    cell: str, margin: float | None, per_seed: list[float | None], **extra: object
) -> dict[str, object]:
    return {
        "cell": cell,
        "seeds": list(range(len(per_seed))),
        "policies": {"loom": {"jct_mean_s": 1000.0}},
        "margin": margin,
        "best_baseline": None if margin is None else "gavel_like",
        "margin_per_seed": per_seed,
        "loom_finished_fewer": [],
        "common_margin": 0.1,
        "common_best_baseline": "first_fit",
        **extra,
    }


def _result(
    lines: list[dict[str, object]], penalties: list[dict[str, object]] | None = None
) -> dict[str, object]:
    return {"mode": "grid", "lines": lines, "spanning_penalty": penalties or []}


def test_cells_from_several_runs_are_judged_and_ordered_by_platform_workload_load() -> None:
    small = _result(
        [
            _line("small/1.2/span/mix", 0.05, [0.1, 0.0]),
            _line("small/1.2/nospan/mix", -0.031, [-0.2, 0.1]),
            _line("small/0.5/nospan/mix", -0.03, [-0.03]),
        ],
        [{"cells": "small/1.2/mix", "penalty": 0.04}],
    )
    default = _result([_line("default/0.8/nospan/philly", None, [None], loom_finished_fewer=["first_fit"])])
    verdicts = grid_summary.summarize([default, small])
    assert [v.cell for v in verdicts] == [
        "small/0.5/nospan/mix",
        "small/1.2/nospan/mix",
        "small/1.2/span/mix",
        "default/0.8/nospan/philly",
    ]
    by = {v.cell: v for v in verdicts}
    assert by["small/0.5/nospan/mix"].flags == ()  # exactly 3 % worse is within the bound
    assert by["small/1.2/nospan/mix"].flags == ("loom 3.1% worse than gavel_like",)
    assert (by["small/1.2/nospan/mix"].margin_min, by["small/1.2/nospan/mix"].margin_max) == (-0.2, 0.1)
    assert by["small/1.2/nospan/mix"].spanning_penalty is None  # the penalty belongs to the span cell
    assert by["small/1.2/span/mix"].spanning_penalty == pytest.approx(0.04)
    assert by["small/1.2/span/mix"].flags == ("spanning penalty +4.0%",)
    assert by["default/0.8/nospan/philly"].flags == ("loom finished fewer than first_fit",)
    table = grid_summary.markdown(verdicts)
    assert sum(row.startswith("| ") for row in table.splitlines()) == 5  # header and four cells
    assert "4 cells, 3 flagged (threshold 3%)" in table
    assert "| small/0.5/nospan/mix | 1 | 1,000 s | -3.0% | gavel_like | -3.0% .. -3.0% |" in table


def test_a_later_run_of_the_same_cell_replaces_the_earlier_one() -> None:
    before = _result([_line("small/1/nospan/philly", -0.10, [-0.10])])
    after = _result([_line("small/1/nospan/philly", 0.02, [0.02])])
    (verdict,) = grid_summary.summarize([before, after])
    assert verdict.margin == pytest.approx(0.02) and verdict.flags == ()
    (verdict,) = grid_summary.summarize([after, before])
    assert verdict.flags == ("loom 10.0% worse than gavel_like",)


def test_the_command_reads_grid_json_files_and_refuses_others(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = tmp_path / "grid.json"
    good.write_text(json.dumps(_result([_line("medium/0.8/nospan/mix", -0.05, [-0.05])])))
    args = argparse.Namespace(files=[str(good)], threshold=3.0, class_target=25.0, json=True)
    assert grid_summary.main(args) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["cell"] == "medium/0.8/nospan/mix" and row["flags"] == ["loom 5.0% worse than gavel_like"]
    assert (
        grid_summary.main(argparse.Namespace(files=[str(good)], threshold=6.0, class_target=25.0, json=True))
        == 0
    )
    assert json.loads(capsys.readouterr().out)[0]["flags"] == []
    # A cell in two files: the later file's run is used, and said (it was silent: the order of the
    # files decided a flag).
    again = tmp_path / "rerun.json"
    again.write_text(json.dumps(_result([_line("medium/0.8/nospan/mix", 0.05, [0.05])])))
    args = argparse.Namespace(files=[str(good), str(again)], threshold=3.0, class_target=25.0, json=True)
    assert grid_summary.main(args) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)[0]["flags"] == []
    assert f"medium/0.8/nospan/mix is in both {good} and {again}: {again}'s run is used" in captured.err
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"benchmark": "scu"}))
    assert (
        grid_summary.main(
            argparse.Namespace(files=[str(other)], threshold=3.0, class_target=25.0, json=False)
        )
        == 2
    )
    assert "not the JSON of" in capsys.readouterr().err


def test_the_spanning_penalty_pairs_seeds_across_files() -> None:
    # Loom's jobs with spanning allowed (one file) took 10 % longer than forbidden (another file).
    def run(span: str, jct: dict[str, float]) -> dict[str, object]:
        return {"cell": f"small/1/{span}/philly", "seed": 0, "jct_by_job": jct, "policies": {"loom": {}}}

    allowed = _result([_line("small/1/span/philly", 0.1, [0.1])])
    allowed["seeds"] = [run("span", {"a": 110.0, "b": 220.0})]
    forbidden = _result([_line("small/1/nospan/philly", 0.1, [0.1])])
    forbidden["seeds"] = [run("nospan", {"a": 100.0, "b": 200.0})]
    by = {v.cell: v for v in grid_summary.summarize([allowed, forbidden])}
    assert by["small/1/span/philly"].spanning_penalty == pytest.approx(0.10)
    assert by["small/1/span/philly"].flags == ("spanning penalty +10.0%",)
    assert grid_summary.summarize([allowed])[0].spanning_penalty is None  # no twin: no penalty


def test_a_contended_cell_is_flagged_when_the_class_beats_greedy_by_less_than_the_target() -> None:
    result = _result(
        [
            _line("small/1.2/nospan/mix", 0.1, [0.1], class_margin=0.20, class_margin_per_seed=[0.1, 0.3]),
            _line("small/1/nospan/mix", 0.1, [0.1], class_margin=0.26, class_margin_per_seed=[0.26]),
            # Below the target but not contended (load 0.8): not flagged for it.
            _line("small/0.8/nospan/mix", 0.1, [0.1], class_margin=0.05, class_margin_per_seed=[0.05]),
        ]
    )
    by = {v.cell: v for v in grid_summary.summarize([result])}
    assert by["small/1.2/nospan/mix"].flags == ("net-training +20.0% vs greedy (< 25%)",)
    assert (by["small/1.2/nospan/mix"].class_margin_min, by["small/1.2/nospan/mix"].class_margin_max) == (
        0.1,
        0.3,
    )
    assert by["small/1/nospan/mix"].flags == ()
    assert by["small/0.8/nospan/mix"].flags == ()
    assert grid_summary.summarize([result], class_target=0.15)[2].flags == ()  # 1.2 sorts last
    assert "+20.0% (+10.0% .. +30.0%)" in grid_summary.markdown(list(by.values()))


def test_a_cell_where_nothing_queues_under_greedy_is_not_contended_whatever_its_load() -> None:
    def policies(queue_s: float) -> dict[str, object]:
        return {
            "loom": {"jct_mean_s": 900.0},
            "greedy_compute": {"jct_mean_s": 1000.0, "queue_mean_s": queue_s},
        }

    result = _result(
        [
            _line("default/1.2/nospan/mix", 0.1, [0.1], class_margin=0.06, policies=policies(0.0)),
            _line("medium/1.2/nospan/mix", 0.1, [0.1], class_margin=0.06, policies=policies(150.0)),
        ]
    )
    by = {v.cell: v for v in grid_summary.summarize([result])}
    assert by["default/1.2/nospan/mix"].flags == () and not by["default/1.2/nospan/mix"].contended
    assert by["medium/1.2/nospan/mix"].flags == ("net-training +6.0% vs greedy (< 25%)",)
    assert by["medium/1.2/nospan/mix"].contended
