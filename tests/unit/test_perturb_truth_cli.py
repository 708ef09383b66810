"""``tools/perturb_truth.py``: a perturbed truth file, or a one-line usage error (exit 2), never a
traceback or a broken file."""

import importlib.util
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from loom.sim.truth import load_truth

TOOL = Path(__file__).resolve().parents[2] / "tools" / "perturb_truth.py"


def _main() -> Callable[[list[str]], int]:
    spec = importlib.util.spec_from_file_location("perturb_truth", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    main: Callable[[list[str]], int] = module.main
    return main


def _tiny(*gpus: str) -> dict[str, Any]:
    cells = [
        {
            "family": "f",
            "gpu_model": g,
            "precision": "fp32",
            "gpus_per_node": 1,
            "throughput": 10.0,
            "series": "s",
        }
        for g in gpus
    ]
    return {"format": "loom-truth", "version": 1, "cells": cells}


def test_it_writes_a_perturbed_truth_file_that_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "t.json"
    assert _main()(["--sigma", "0.3", "--seed", "1", "-o", str(out)]) == 0
    assert len(load_truth(out).cells) == len(load_truth().cells)
    assert "pairs perturbed, factors 0.41 .. 2.14" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--base", "{tmp}/absent.json"], "absent.json: cannot be read"),
        (["--base", "{tmp}/bad.json"], "bad.json: is not JSON"),
        (["--base", "{tmp}/ref-only.json"], "every cell is on the reference GPU V100M16"),
        (["--sigma", "inf"], "argument --sigma: must be a finite number >= 0, got 'inf'"),
        (["--sigma", "nan"], "argument --sigma: must be a finite number >= 0"),
        (["--sigma", "-1"], "argument --sigma: must be a finite number >= 0"),
        (["--sigma", "x"], "argument --sigma: not a number"),
        (["--sigma", "40"], "sigma 40 is too large"),
        (["-o", "/nonexistent-dir/x.json"], "-o /nonexistent-dir/x.json: cannot be written"),
    ],
)
def test_bad_arguments_give_a_one_line_usage_error_and_no_file(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "bad.json").write_text("{ not json")
    (tmp_path / "ref-only.json").write_text(json.dumps(_tiny("V100M16")))
    args = [a.format(tmp=tmp_path) for a in argv]
    if "-o" not in args:
        args += ["-o", str(tmp_path / "out.json")]
    with pytest.raises(SystemExit) as exited:
        _main()(args)
    assert exited.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert ": error: " in error and message in error
    assert not (tmp_path / "out.json").exists()
