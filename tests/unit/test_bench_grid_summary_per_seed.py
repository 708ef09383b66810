"""``loom bench grid-summary``: the per-seed column compares each seed with that seed's own best
baseline, the margin with the best baseline overall (so the margin may lie outside the per-seed
range); the table says so, and gives the standard error of the per-seed margins, as does the JSON."""

import argparse
import json
import math
import statistics
from pathlib import Path

import pytest

from loom_benchmarks import grid_summary


def _grid(margin: float, per_seed: list[float | None]) -> dict[str, object]:
    line = {
        "cell": "small/0.8/nospan/mix",
        "seeds": list(range(len(per_seed))),
        "policies": {"loom": {"jct_mean_s": 1000.0}},
        "margin": margin,
        "best_baseline": "gavel_like",
        "margin_per_seed": per_seed,
        "loom_finished_fewer": [],
    }
    return {"mode": "grid", "lines": [line], "spanning_penalty": []}


def test_the_standard_error_of_the_per_seed_margins_is_judged_over_the_seeds_that_have_one() -> None:
    # Overall +5 % (against gavel_like on the seed means) lies outside the per-seed range (-2 .. +4 %):
    # each seed there is against its own best baseline.
    (verdict,) = grid_summary.summarize([_grid(0.05, [0.04, -0.02, 0.01, None])])
    expected = statistics.stdev([0.04, -0.02, 0.01]) / math.sqrt(3)
    assert verdict.margin_per_seed_se == pytest.approx(expected)
    (one,) = grid_summary.summarize([_grid(0.05, [0.04])])
    assert one.margin_per_seed_se is None  # one seed has no standard error


def test_the_table_says_what_each_margin_column_compares_and_shows_the_standard_error() -> None:
    table = grid_summary.markdown(grid_summary.summarize([_grid(0.05, [0.04, -0.02, 0.01])]))
    header = table.splitlines()[0]
    assert "margin vs best baseline (overall)" in header
    assert "per seed (vs that seed's best)" in header
    assert "per-seed SE" in header
    se = statistics.stdev([0.04, -0.02, 0.01]) / math.sqrt(3)
    assert f"| +5.0% | gavel_like | -2.0% .. +4.0% | ±{se:.1%} |" in table
    assert grid_summary.LEGEND in table
    assert "that seed's own best baseline" in grid_summary.LEGEND
    assert "can lie outside this range" in grid_summary.LEGEND
    # Every row has as many columns as the header.
    assert len({r.count("|") for r in table.splitlines() if r.startswith("|")}) == 1


def test_the_json_carries_the_standard_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "grid.json"
    path.write_text(json.dumps(_grid(0.05, [0.04, -0.02])))
    args = argparse.Namespace(files=[str(path)], threshold=3.0, class_target=25.0, json=True)
    assert grid_summary.main(args) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["margin_per_seed_se"] == pytest.approx(statistics.stdev([0.04, -0.02]) / math.sqrt(2))
    assert (row["margin_min"], row["margin_max"]) == (-0.02, 0.04)
