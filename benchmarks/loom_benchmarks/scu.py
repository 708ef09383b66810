"""``loom bench scu``: the SCU model's predicted speed ratios to the V100 against measured ones.

Data (``data/README.md``), every value a single-GPU training throughput:

- Gavel's oracle throughputs (``data/gavel_oracle_throughputs.json``): 26 job types (7 models at
  several batch sizes) on K80, P100 and V100, FP32;
- Lambda's PyTorch benchmark (``data/lambda_1gpu_throughput.csv``, derived from Lambda's CSVs by
  :func:`derive_lambda_table`): 10 models on 15 GPU models from V100 to B200, FP32 (TF32 where
  the GPU has it, NVIDIA's containers' default) and FP16 (mixed precision); the median over the
  rows of one GPU model, 1-GPU rows only (multi-GPU rows measure intra-node scaling, not the
  device).

Every cell is a (job, precision, GPU model) whose throughput is divided by the V100 16 GB's for the
same job and precision *from the same source*: 314 ratios (52 Gavel, 262 Lambda). Each is
compared with the SCU model's prediction, :func:`loom.model.scu.speed_ratio` over the reference
library's profiles with weights fitted per (precision, task type) by
:func:`loom.model.scu.fit_weights`, and with the naive ratio of peak FP32 TFLOPS (datasheet
FP32 without tensor cores: what a scheduler that knows only the headline number would use).

Error is ``|predicted - measured| / measured`` per cell; figures are the median and the 90th
percentile (linear interpolation). Evaluations:

- ``in_sample``: weights fitted on every cell, predicting the same cells;
- ``leave_one_gpu_out`` (LOGO, the headline): for each GPU model, weights refitted without any of
  its cells, then its cells predicted: how well the model does on a GPU it has never seen;
- ``leave_one_model_out`` (LOMO): the same per model (ResNet-50 from Gavel and Lambda together):
  how well it does on a job it has never seen.

Models map to Loom task types by what bounds their single-GPU step (:data:`MODEL_TASK_TYPE`):

- ``training_compute``: dense GEMM-bound sequence models: BERT (base, large), Transformer,
  Transformer-XL (base, large), GNMT and Tacotron 2 (large-batch recurrent layers run as GEMMs)
  and WaveGlow (wide 1-D convolutions and invertible 1x1 convolutions, GEMMs again). Their
  speed-ups follow the matrix rate: an A100 is 4-6x a V100 in FP32 (TF32 vs plain FP32).
- ``training_memory``: models whose step follows memory bandwidth: convolutional nets with batch
  normalisation and activations between small convolutions (ResNet-18/50, SSD, CycleGAN), the
  small-batch LSTM LM (Gavel: batch 5-80, weights re-read every step), embedding-bound
  recommendation (NCF, Gavel's Recommendation) and A3C (small kernels). Their speed-ups follow
  bandwidth: an A100 is 2.4-2.9x a V100 in FP32.
- ``training_comm``: no single-GPU measurement says how communication-bound work speeds up, so no
  cell maps here and its weights are the prior.
- ``inference``: no measured job; its weights are the prior.

The grouping was chosen after looking at the data (the measured ratios fall in these two groups
on every GPU), so ``alternative_mapping`` reports the figures for the mapping the issue suggested
(SSD/ResNet/WaveGlow as compute, GNMT/Tacotron 2/LM/Transformer-XL as memory, NCF and
Recommendation as communication) too.
"""

import argparse
import csv
import importlib.resources
import io
import json
import math
import re
import statistics
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np

from loom.model.profiles import DEFAULT_REFERENCE_MODEL, profile_for_model, reference_profile
from loom.model.scu import (
    PRECISION_PRIORS,
    PRECISION_WEIGHTS,
    PRECISIONS,
    TASK_TYPES,
    DeviceProfile,
    Precision,
    RatioObservation,
    TaskWeights,
    fit_weights,
    speed_ratio,
)
from loom_proto.jobs import TaskType

GAVEL_FILE: Final = "gavel_oracle_throughputs.json"
LAMBDA_FILE: Final = "lambda_1gpu_throughput.csv"
GAVEL_SOURCE: Final = (
    "stanford-futuredata/gavel, scheduler/notebooks/figures/motivation/oracle_throughputs.json at commit "
    "c4fa40097339e9608ab71fd64c8bdea96a5e4a4c (MIT); isolated ('null') steps/s"
)
LAMBDA_SOURCE: Final = (
    "lambdal/deeplearning-benchmark, pytorch/pytorch-train-throughput-{fp32,fp16}.csv, "
    "pytorch/pytorch-train-throughput-v2-{fp32,fp16}.csv and pytorch/csv_v1_v2/*-{fp32,fp16}.csv at "
    "commit aa5addb6a53675a649a80036dad548f1c27cbcc4; 1-GPU rows, median per GPU model"
)
GAVEL_TO_LIBRARY: Final[Mapping[str, str]] = {"k80": "K80", "p100": "P100", "v100": "V100M16"}
LAMBDA_TO_LIBRARY: Final[tuple[tuple[str, str], ...]] = (
    # (pattern in Lambda's system name, library model); the first match wins, so variants first.
    (r"A100[ _]40GB[ _]PCIe", "A100-40G-PCIE"),
    (r"A100[ _]80GB[ _]PCIe", "A100-80G-PCIE"),
    (r"A100[ _]80GB[ _]SXM4", "A100"),
    (r"H100[ _]80GB[ _]PCIe", "H100-PCIE"),
    (r"H100[ _]80GB[ _]SXM5", "H100"),
    (r"GH200", "GH200"),
    (r"H200", "H200"),
    (r"B200", "B200"),
    (r"V100 16GB", "V100M16"),
    (r"Quadro RTX 8000", "QRTX8000"),
    (r"RTX 6000 Ada", "RTX6000ADA"),
    (r"RTX A6000", "RTXA6000"),
    (r"RTX 3090", "RTX3090"),
    (r"RTX 4090", "RTX4090"),
    (r"\bA10\b", "A10"),
)
"""Lambda system names to library models (vendor prefixes such as ``Dell`` or ``LambdaCloud`` and
host suffixes are ignored: every row of one GPU model counts toward its median)."""

MODEL_OF_GAVEL_FAMILY: Final[Mapping[str, str]] = {
    "ResNet-18": "resnet18",
    "ResNet-50": "resnet50",
    "CycleGAN": "cyclegan",
    "Transformer": "transformer",
    "LM": "lm",
    "Recommendation": "recommendation",
    "A3C": "a3c",
}
"""Gavel job families by the model name the cells use (Lambda's ``resnet50`` is the same model)."""

MODEL_TASK_TYPE: Final[Mapping[str, TaskType]] = {
    "bert_base_squad": "training_compute",
    "bert_large_squad": "training_compute",
    "transformer": "training_compute",
    "transformerxlbase": "training_compute",
    "transformerxllarge": "training_compute",
    "gnmt": "training_compute",
    "tacotron2": "training_compute",
    "waveglow": "training_compute",
    "resnet18": "training_memory",
    "resnet50": "training_memory",
    "ssd": "training_memory",
    "cyclegan": "training_memory",
    "lm": "training_memory",
    "ncf": "training_memory",
    "recommendation": "training_memory",
    "a3c": "training_memory",
}
"""Every measured model's task type (the reasoning is in the module's docstring)."""

ALTERNATIVE_MODEL_TASK_TYPE: Final[Mapping[str, TaskType]] = {
    **dict.fromkeys(
        (
            "ssd",
            "resnet18",
            "resnet50",
            "cyclegan",
            "waveglow",
            "transformer",
            "bert_base_squad",
            "bert_large_squad",
        ),
        "training_compute",
    ),
    **dict.fromkeys(
        ("gnmt", "tacotron2", "lm", "transformerxlbase", "transformerxllarge"), "training_memory"
    ),
    **dict.fromkeys(("ncf", "recommendation", "a3c"), "training_comm"),
}
"""The issue's suggestion, for comparison."""

REFERENCE: Final = DEFAULT_REFERENCE_MODEL
PRIOR_STRENGTH: Final = 0.01
"""The fit's pull toward the prior (:func:`loom.model.scu.fit_weights`'s ``prior_strength``): weak,
so that the data choose and the prior breaks near-ties. Chosen by held-out error (0, 0.002, 0.005,
0.01 and 0.02 were tried: 0.01 had the lowest leave-one-model-out error at the same LOGO error)."""
TARGET_MEDIAN_ERROR: Final = 0.15


@dataclass(frozen=True)
class Cell:
    """One measured ratio: a job's throughput on ``gpu`` over the V100's, at one precision."""

    source: str
    """``gavel`` or ``lambda``."""
    job: str
    """The measured job (Gavel: ``ResNet-50 (batch size 64)``; Lambda: ``resnet50``)."""
    model: str
    """The model it trains (``resnet50``), what leave-one-model-out holds out."""
    task_type: TaskType
    precision: Precision
    gpu: str
    """Library model name."""
    measured_ratio: float


# ---- data ---------------------------------------------------------------------------------------------


def _lambda_model(name: str) -> str | None:
    for pattern, model in LAMBDA_TO_LIBRARY:
        if re.search(pattern, name):
            return model
    return None


def _gpus_in_row(name: str, num_gpu: str | None) -> int:
    if num_gpu:
        return round(float(num_gpu))
    found = re.search(r"_(\d+)x(?=[A-Z])", name)  # v2 files: ..._1xH100_80GB_SXM5_...
    return int(found.group(1)) if found else 0


def derive_lambda_table(folder: Path) -> list[dict[str, str]]:
    """The packaged ``lambda_1gpu_throughput.csv`` from Lambda's CSVs in ``folder``.

    Reads ``pytorch-train-throughput{,-v2}-{fp32,fp16}.csv`` and ``v1v2-pytorch-train-throughput-*``
    (the copies in ``../shared/data/gpu-throughput/lambda``), keeps rows of one GPU of a model the
    library knows, drops zero cells (not measured), and takes the median per (GPU model,
    precision, model). Rows: gpu, precision, model, throughput, rows.
    """
    values: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    for precision in PRECISIONS:
        names = (
            f"pytorch-train-throughput-{precision}.csv",
            f"pytorch-train-throughput-v2-{precision}.csv",
            f"v1v2-pytorch-train-throughput-{precision}.csv",
        )
        for file_name in names:
            with (folder / file_name).open(newline="") as handle:
                for row in csv.DictReader(handle):
                    name = row.get("name_gpu") or row.get("") or ""
                    gpu = _lambda_model(name)
                    if gpu is None or _gpus_in_row(name, row.get("num_gpu")) != 1:
                        continue
                    for column, text in row.items():
                        if column in ("", "name_gpu", "num_gpu", "watt", "price") or not text:
                            continue
                        value = float(text)
                        if value > 0:
                            values[(gpu, precision, column)].append(value)
    return [
        {
            "gpu": gpu,
            "precision": precision,
            "model": model,
            "throughput": f"{statistics.median(vs):.6g}",
            "rows": str(len(vs)),
        }
        for (gpu, precision, model), vs in sorted(values.items())
    ]


def write_lambda_table(folder: Path, out: Path) -> None:
    """Write :func:`derive_lambda_table`'s rows as CSV (how the packaged file was made)."""
    rows = derive_lambda_table(folder)
    with out.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["gpu", "precision", "model", "throughput", "rows"])
        writer.writeheader()
        writer.writerows(rows)


def _data_text(name: str) -> str:
    return importlib.resources.files("loom_benchmarks").joinpath("data", name).read_text()


def _precision(text: str) -> Precision:
    for p in PRECISIONS:
        if p == text:
            return p
    raise ValueError(f"unknown precision {text!r}")


def gavel_job_model(job_type: str) -> str:
    """``ResNet-50 (batch size 64)`` → ``resnet50``."""
    return MODEL_OF_GAVEL_FAMILY[job_type.split(" (", 1)[0]]


def load_cells(mapping: Mapping[str, TaskType] = MODEL_TASK_TYPE) -> list[Cell]:
    """Every measured ratio to the V100, Gavel's then Lambda's, in a stable order."""
    cells: list[Cell] = []
    gavel: dict[str, dict[str, dict[str, Any]]] = json.loads(_data_text(GAVEL_FILE))
    reference_gpu = next(g for g, m in GAVEL_TO_LIBRARY.items() if m == REFERENCE)
    for job in sorted(set.intersection(*(set(gavel[g]) for g in GAVEL_TO_LIBRARY))):
        model = gavel_job_model(job)
        base = float(gavel[reference_gpu][job]["null"])
        for gpu, library in GAVEL_TO_LIBRARY.items():
            if library == REFERENCE:
                continue
            ratio = float(gavel[gpu][job]["null"]) / base
            cells.append(Cell("gavel", job, model, mapping[model], "fp32", library, ratio))
    table = {
        (r["gpu"], r["precision"], r["model"]): float(r["throughput"])
        for r in csv.DictReader(io.StringIO(_data_text(LAMBDA_FILE)))
    }
    for (gpu, precision, model), value in sorted(table.items()):
        base_value = table.get((REFERENCE, precision, model))
        if gpu == REFERENCE or base_value is None:
            continue
        cells.append(
            Cell("lambda", model, model, mapping[model], _precision(precision), gpu, value / base_value)
        )
    return cells


# ---- fitting and predicting ---------------------------------------------------------------------------

Weights = dict[Precision, dict[TaskType, TaskWeights]]


def _profile(model: str) -> DeviceProfile:
    return profile_for_model(model)


def fitted_weights(cells: Iterable[Cell]) -> Weights:
    """Weights per (precision, task type) fitted on ``cells``; the prior where no cell has that key.

    What :data:`loom.model.scu.PRECISION_WEIGHTS` holds when ``cells`` are all of :func:`load_cells`.
    """
    by_key: dict[tuple[Precision, TaskType], list[RatioObservation]] = defaultdict(list)
    reference = _profile(REFERENCE)
    for cell in cells:
        by_key[(cell.precision, cell.task_type)].append(
            RatioObservation(_profile(cell.gpu), reference, cell.measured_ratio)
        )
    return {
        p: {
            t: fit_weights(by_key.get((p, t), []), PRECISION_PRIORS[p][t], prior_strength=PRIOR_STRENGTH)
            for t in TASK_TYPES
        }
        for p in PRECISIONS
    }


def predict(cell: Cell, weights: Weights) -> float:
    """The SCU model's predicted ratio to the V100 for one cell."""
    return speed_ratio(
        _profile(cell.gpu),
        _profile(REFERENCE),
        cell.task_type,
        weights=weights[cell.precision],
        precision=cell.precision,
    )


def _error(predicted: float, measured: float) -> float:
    return abs(predicted - measured) / measured


def _held_out(cells: Sequence[Cell], group: Callable[[Cell], str]) -> list[tuple[Cell, float]]:
    """(cell, predicted) with weights refitted without the cell's group, for every cell."""
    out: list[tuple[Cell, float]] = []
    for name in sorted({group(c) for c in cells}):
        weights = fitted_weights(c for c in cells if group(c) != name)
        out.extend((c, predict(c, weights)) for c in cells if group(c) == name)
    return out


def leave_one_gpu_out(cells: Sequence[Cell]) -> list[tuple[Cell, float]]:
    """Every cell predicted with weights fitted on the other GPU models' cells."""
    return _held_out(cells, lambda c: c.gpu)


def leave_one_model_out(cells: Sequence[Cell]) -> list[tuple[Cell, float]]:
    """Every cell predicted with weights fitted on the other models' cells."""
    return _held_out(cells, lambda c: c.model)


def in_sample(cells: Sequence[Cell]) -> list[tuple[Cell, float]]:
    """Every cell predicted with weights fitted on all of them."""
    weights = fitted_weights(cells)
    return [(c, predict(c, weights)) for c in cells]


def peak_fp32(cells: Sequence[Cell]) -> list[tuple[Cell, float]]:
    """Every cell predicted by the ratio of datasheet FP32 TFLOPS (no tensor cores)."""
    ref = _profile(REFERENCE).compute_fp32_tflops
    return [(c, _profile(c.gpu).compute_fp32_tflops / ref) for c in cells]


def logo_median_error(cells: Sequence[Cell] | None = None) -> float:
    """The headline: median error of leave-one-GPU-out predictions over every cell."""
    rows = leave_one_gpu_out(cells if cells is not None else load_cells())
    return float(np.median([_error(p, c.measured_ratio) for c, p in rows]))


# ---- figures ------------------------------------------------------------------------------------------


def _stats(errors: Sequence[float]) -> dict[str, float]:
    values = np.asarray(errors, dtype=np.float64)
    if not len(values):
        return {"cells": 0}
    return {
        "median_error": round(float(np.median(values)), 4),
        "p90_error": round(float(np.percentile(values, 90)), 4),
        "mean_error": round(float(values.mean()), 4),
        "max_error": round(float(values.max()), 4),
        "cells": len(values),
    }


def summary(rows: Sequence[tuple[Cell, float]], evaluation: str) -> dict[str, Any]:
    """Error figures of predictions overall, by precision, by source, by GPU and by model."""
    errors = [(c, _error(p, c.measured_ratio)) for c, p in rows]

    def by(key: Callable[[Cell], str]) -> dict[str, float]:
        groups: dict[str, list[float]] = defaultdict(list)
        for c, e in errors:
            groups[key(c)].append(e)
        return {k: round(float(np.median(v)), 4) for k, v in sorted(groups.items())}

    return {
        "evaluation": evaluation,
        **_stats([e for _, e in errors]),
        "by_precision": {p: _stats([e for c, e in errors if c.precision == p]) for p in PRECISIONS},
        "by_source": {s: _stats([e for c, e in errors if c.source == s]) for s in ("gavel", "lambda")},
        "median_error_by_gpu": by(lambda c: c.gpu),
        "median_error_by_gpu_and_precision": by(lambda c: f"{c.gpu} {c.precision}"),
        "median_error_by_model": by(lambda c: c.model),
    }


def _weights_json(weights: TaskWeights) -> dict[str, float]:
    return {k: round(v, 4) for k, v in zip(TaskWeights.__struct_fields__, weights.vector(), strict=True) if v}


def packaged_equal_fitted(fitted: Weights) -> bool:
    """True when :data:`loom.model.scu.PRECISION_WEIGHTS` are exactly the fit."""
    return all(
        math.isclose(a, b, abs_tol=1e-6)
        for p in PRECISIONS
        for t in TASK_TYPES
        for a, b in zip(PRECISION_WEIGHTS[p][t].normalised().vector(), fitted[p][t].vector(), strict=True)
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Compute every figure; the JSON result."""
    cells = load_cells()
    fitted = fitted_weights(cells)
    evaluations = {
        "in_sample": (in_sample(cells), "weights fitted on every cell, predicting the same cells"),
        "leave_one_gpu_out": (
            leave_one_gpu_out(cells),
            "for each GPU model, weights refitted without its cells, then its cells predicted",
        ),
        "leave_one_model_out": (
            leave_one_model_out(cells),
            "for each model (Gavel's and Lambda's ResNet-50 together), weights refitted without its "
            "cells; a (precision, task type) left with no cell falls back to the prior",
        ),
        "peak_fp32_baseline": (peak_fp32(cells), "ratio of datasheet FP32 TFLOPS (no tensor cores)"),
    }
    models = {name: summary(rows, text) for name, (rows, text) in evaluations.items()}
    logo, lomo, base = (
        models["leave_one_gpu_out"],
        models["leave_one_model_out"],
        models["peak_fp32_baseline"],
    )
    alternative = load_cells(ALTERNATIVE_MODEL_TASK_TYPE)
    result: dict[str, Any] = {
        "benchmark": "scu",
        "headline": {
            "logo_median_error": logo["median_error"],
            "logo_p90_error": logo["p90_error"],
            "logo_median_error_fp32": logo["by_precision"]["fp32"]["median_error"],
            "logo_median_error_fp16": logo["by_precision"]["fp16"]["median_error"],
            "lomo_median_error": lomo["median_error"],
            "lomo_p90_error": lomo["p90_error"],
            "lomo_median_error_fp32": lomo["by_precision"]["fp32"]["median_error"],
            "lomo_median_error_fp16": lomo["by_precision"]["fp16"]["median_error"],
            "in_sample_median_error": models["in_sample"]["median_error"],
            "peak_fp32_median_error": base["median_error"],
            "peak_fp32_p90_error": base["p90_error"],
            "peak_fp32_median_error_fp32": base["by_precision"]["fp32"]["median_error"],
            "peak_fp32_median_error_fp16": base["by_precision"]["fp16"]["median_error"],
            "target_logo_median_error": TARGET_MEDIAN_ERROR,
            "logo_meets_target": logo["median_error"] <= TARGET_MEDIAN_ERROR,
            "logo_beats_peak_fp32": logo["median_error"] < base["median_error"]
            and logo["p90_error"] < base["p90_error"],
            "packaged_equal_fitted": packaged_equal_fitted(fitted),
        },
        "error_definition": "|predicted_ratio - measured_ratio| / measured_ratio per cell (a job's "
        "throughput on a GPU model over the V100 16 GB's, same source and precision); p90 by linear "
        "interpolation",
        "data": {
            "sources": {"gavel": GAVEL_SOURCE, "lambda": LAMBDA_SOURCE},
            "reference": REFERENCE,
            "cells": len(cells),
            "cells_by_source_and_precision": {
                f"{s} {p}": sum(1 for c in cells if c.source == s and c.precision == p)
                for s in ("gavel", "lambda")
                for p in PRECISIONS
            },
            "gpus": sorted({c.gpu for c in cells}),
            "models": sorted({c.model for c in cells}),
        },
        "model_task_type": dict(MODEL_TASK_TYPE),
        "models": models,
        "weights": {
            "fitted": {p: {t: _weights_json(w) for t, w in ws.items()} for p, ws in fitted.items()},
            "prior": {
                p: {t: _weights_json(w.normalised()) for t, w in ws.items()}
                for p, ws in PRECISION_PRIORS.items()
            },
            "prior_strength": PRIOR_STRENGTH,
            "packaged_equal_fitted": packaged_equal_fitted(fitted),
            "note": "no cell maps to training_comm or inference: their weights are the priors",
        },
        "library_profiles": {
            model: {"product": reference_profile(model).product, **_profile_json(_profile(model))}
            for model in sorted({c.gpu for c in cells} | {REFERENCE})
        },
        "alternative_mapping": {
            "model_task_type": dict(ALTERNATIVE_MODEL_TASK_TYPE),
            **{
                name: {k: v for k, v in summary(rows, name).items() if k in ("median_error", "p90_error")}
                for name, rows in (
                    ("in_sample", in_sample(alternative)),
                    ("leave_one_gpu_out", leave_one_gpu_out(alternative)),
                    ("leave_one_model_out", leave_one_model_out(alternative)),
                )
            },
        },
    }
    if getattr(args, "outside", None):
        from loom_benchmarks.scu_outside import evaluate

        result["outside"] = evaluate(args.outside)
    if args.rows:
        result["rows"] = [
            {
                "source": c.source,
                "job": c.job,
                "gpu": c.gpu,
                "precision": c.precision,
                "task_type": c.task_type,
                "measured": round(c.measured_ratio, 4),
                **{name: round(p, 4) for name, (rows, _) in evaluations.items() for cc, p in rows if cc is c},
            }
            for c in cells
        ]
    return result


def _profile_json(profile: DeviceProfile) -> dict[str, Any]:
    return {k: getattr(profile, k) for k in profile.__struct_fields__ if k != "model"}


def print_table(result: Mapping[str, Any]) -> None:
    """The figures as a readable table on stderr."""
    from rich.console import Console
    from rich.table import Table

    data = result["data"]
    table = Table(title=f"predicted vs measured speed ratios to {data['reference']} ({data['cells']} cells)")
    table.add_column("evaluation", no_wrap=True)
    for col in ("median err", "p90 err", "fp32 median", "fp16 median", "gavel median", "lambda median"):
        table.add_column(col, justify="right")
    for name, m in result["models"].items():
        table.add_row(
            name,
            f"{m['median_error']:.1%}",
            f"{m['p90_error']:.1%}",
            *(f"{m['by_precision'][p]['median_error']:.1%}" for p in PRECISIONS),
            *(f"{m['by_source'][s]['median_error']:.1%}" for s in ("gavel", "lambda")),
        )
    console = Console(stderr=True)
    console.print(table)
    gpus = Table(title="median error by GPU model")
    gpus.add_column("GPU", no_wrap=True)
    for col in ("in sample", "leave GPU out", "peak FP32"):
        gpus.add_column(col, justify="right")
    models = result["models"]
    for gpu in data["gpus"]:
        gpus.add_row(
            gpu,
            *(
                f"{models[m]['median_error_by_gpu'][gpu]:.1%}"
                for m in ("in_sample", "leave_one_gpu_out", "peak_fp32_baseline")
            ),
        )
    console.print(gpus)
    h = result["headline"]
    console.print(
        f"leave one GPU out: median {h['logo_median_error']:.1%} (fp32 {h['logo_median_error_fp32']:.1%}, "
        f"fp16 {h['logo_median_error_fp16']:.1%}), p90 {h['logo_p90_error']:.1%}; leave one model out: "
        f"median {h['lomo_median_error']:.1%}; peak FP32 ratio: {h['peak_fp32_median_error']:.1%}; "
        f"target {h['target_logo_median_error']:.0%}: {'met' if h['logo_meets_target'] else 'NOT met'}; "
        f"packaged weights {'equal' if h['packaged_equal_fitted'] else 'DIFFER FROM'} the fit"
    )
    outside = result.get("outside")
    if outside:
        o, b = outside["largest_common_batch"], outside["all_batches"]
        console.print(
            f"outside (never fitted on; {', '.join(outside['folders'])}): largest common batch, "
            f"{o['cells']} cells: median {o['median_error']:.1%} "
            f"(peak FP32 {o['peak_fp32_median_error']:.1%}); "
            f"every common batch, {b['cells']} cells: median {b['median_error']:.1%} "
            f"(peak FP32 {b['peak_fp32_median_error']:.1%})"
        )
        for row in outside["rows"]:
            learned = row["learned_runs_to_15pct"]
            console.print(
                f"  {row['model']:12s} {row['gpu']:10s} batch {row['local_batch']:>6d}: measured "
                f"{row['measured']:.2f}x, predicted {row['predicted']:.2f}x, "
                f"peak FP32 {row['peak_fp32']:.2f}x; "
                f"learned within 15 % after {learned['median']} runs (worst {learned['max']})"
            )


def main(args: argparse.Namespace) -> int:
    """``loom bench scu``: JSON on stdout, the table on stderr unless ``--json``."""
    from loom_benchmarks.scu_outside import OutsideDataError

    try:
        result = run(args)
    except OutsideDataError as exc:
        print(exc, file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2))
    if not args.json:
        print_table(result)
    sys.stdout.flush()
    return 0
