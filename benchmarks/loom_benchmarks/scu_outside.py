"""The SCU model on measurements it was never fitted on: AdaptDL / Pollux / Sia step-time profiles.

``loom bench scu --outside DIR`` reads the throughput profiles the Pollux (OSDI '21) and Sia
(SOSP '23) schedulers measured on their clusters, in the layout their artifacts publish::

    DIR/<model>/placements-<cluster>.csv   (Sia: siasosp23/artifacts, sia-simulator/traces/ and
                                            adaptdl/sched/traces/)
    DIR/<model>/placements.csv             (Pollux: petuum/adaptdl, simulator/traces/; measured on
                                            AWS g4dn.12xlarge, so its cluster is ``aws``)

Each file has the columns ``local_bsz, step_time, sync_time, placement``; a row whose ``placement``
is ``1`` is one GPU on one node running a local batch of ``local_bsz`` in ``step_time`` seconds.
Only those rows are read: a speed ratio of two devices is a single-GPU ratio, as in the fit. The
data stay where the user keeps them; nothing of them ships with Loom.

The clusters' GPUs (Sia's ``simulator_config.py``): ``aws`` 4x T4 (g4dn.12xlarge), ``azure`` 8x
V100 32 GB (ND40rs_v2), ``dgx`` / ``dgx-ext`` DGX-A100 40 GB, ``quad`` 4x Quadro RTX 6000,
``rtx`` 8x RTX 2080 Ti. Models and what Loom calls them (:data:`OUTSIDE_MODELS`), by the same rules
as the fit's mapping: ResNet-18 on CIFAR-10, YOLOv3 and NCF are ``training_memory``; BERT (SQuAD)
and DeepSpeech2 (recurrent layers, like GNMT and Tacotron 2 in the fit) are ``training_compute``;
the ImageNet ResNet-50 runs with apex AMP (``amp.initialize`` in its ``main.py``), so
``fp16``; the others in FP32 (no AMP in their job specs).

A cell is (model, GPU model, local batch): the job's throughput (``local_bsz / step_time``) over
the V100's at the same local batch. The headline takes, for each (model, GPU), the largest local
batch both devices ran (the device busiest, closest to what the benchmarks the fit used measure);
``all_batches`` counts every common batch. Predictions use the packaged weights, fitted on Gavel +
Lambda only, so every figure here is out of sample. For each headline cell the speed learner
(:mod:`loom.model.learn`) is then handed the miss as its truth: how many runs it needs to know it.
"""

import csv
import math
import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from loom.model.profiles import profile_for_model
from loom.model.scu import Precision, speed_ratio
from loom_benchmarks.learn import convergence
from loom_proto.jobs import TaskType

OUTSIDE_CLUSTERS: Final[Mapping[str, str]] = {
    "aws": "T4",
    "azure": "V100M32",
    "dgx": "A100-40G",
    "dgx-ext": "A100-40G",
    "quad": "QRTX6000",
    "rtx": "RTX2080TI",
}
"""Cluster names in the Pollux / Sia artifacts → library GPU model."""

OUTSIDE_REFERENCE: Final = "V100M32"
"""The GPU the measured ratios are taken to (Sia's ``azure`` V100s; every prediction uses the same)."""

OUTSIDE_MODELS: Final[Mapping[str, tuple[TaskType, Precision]]] = {
    "cifar10": ("training_memory", "fp32"),
    "imagenet": ("training_memory", "fp16"),
    "yolov3": ("training_memory", "fp32"),
    "ncf": ("training_memory", "fp32"),
    "bert": ("training_compute", "fp32"),
    "deepspeech2": ("training_compute", "fp32"),
}
"""Model folder → (task type, precision). Other folders (Sia's ``gpt_pmp``, pipelined) are skipped."""

POLLUX_CLUSTER: Final = "aws"
"""The cluster a plain ``placements.csv`` (Pollux's layout) was measured on."""


LEARN_NOISE_CV: Final = 0.05
LEARN_RUNS: Final = 10
LEARN_SEEDS: Final = 50
"""Each headline cell's miss is handed to the speed learner as ``loom bench learn`` does (the
measured over the predicted ratio as the true factor, run noise cv 5 %, 10 runs, 50 seeds):
``learned_runs_to_15pct`` says how many runs of that (family, GPU) placement needs to know it."""


class OutsideDataError(ValueError):
    """An outside profile that cannot be read; the message names the file and the row."""


@dataclass(frozen=True)
class OutsideCell:
    """One measured ratio: ``model`` at local batch ``batch`` on ``gpu`` over the reference's."""

    model: str
    gpu: str
    cluster: str
    batch: int
    task_type: TaskType
    precision: Precision
    measured_ratio: float


def read_single_gpu_steps(path: Path) -> dict[int, float]:
    """``{local batch: step seconds}`` of a profile's one-GPU rows (``placement`` ``1``).

    Repeated batches keep their median. Raises :class:`OutsideDataError` for a missing column, a
    batch that is not a positive integer or a step time that is not a positive finite number.
    """
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise OutsideDataError(f"{path}: cannot read: {exc}") from exc
    reader = csv.DictReader(text.splitlines())
    needed = {"local_bsz", "step_time", "placement"}
    missing = needed - set(reader.fieldnames or ())
    if missing:
        raise OutsideDataError(f"{path}: missing column(s) {', '.join(sorted(missing))}")
    steps: dict[int, list[float]] = defaultdict(list)
    for line, row in enumerate(reader, start=2):
        if (row.get("placement") or "").strip() != "1":
            continue
        try:
            batch = int((row["local_bsz"] or "").strip())
            step = float((row["step_time"] or "").strip())
        except ValueError as exc:
            raise OutsideDataError(f"{path} line {line}: {exc}") from exc
        if batch <= 0 or not (math.isfinite(step) and step > 0):
            raise OutsideDataError(
                f"{path} line {line}: local_bsz must be a positive integer and step_time a "
                f"positive finite number, got {row['local_bsz']!r}, {row['step_time']!r}"
            )
        steps[batch].append(step)
    return {b: statistics.median(v) for b, v in sorted(steps.items())}


def read_tree(folders: Sequence[Path]) -> tuple[dict[tuple[str, str], dict[int, float]], list[str]]:
    """``{(model, cluster): {batch: step}}`` from every folder; a (model, cluster) read once.

    The first folder that has a (model, cluster) wins (the artifacts keep copies in two places).
    Returns the profiles and the files skipped, each with why.
    """
    profiles: dict[tuple[str, str], dict[int, float]] = {}
    skipped: list[str] = []
    for folder in folders:
        if not folder.is_dir():
            raise OutsideDataError(f"{folder}: not a folder")
        for path in sorted(folder.glob("*/placements*.csv")):
            model = path.parent.name
            stem = path.stem
            cluster = POLLUX_CLUSTER if stem == "placements" else stem.removeprefix("placements-")
            if model not in OUTSIDE_MODELS:
                skipped.append(f"{path}: model {model!r} has no task type here")
                continue
            if cluster not in OUTSIDE_CLUSTERS:
                skipped.append(f"{path}: cluster {cluster!r} is not one of {', '.join(OUTSIDE_CLUSTERS)}")
                continue
            if (model, cluster) in profiles:
                continue
            steps = read_single_gpu_steps(path)
            if not steps:
                skipped.append(f"{path}: no one-GPU row")
                continue
            profiles[(model, cluster)] = steps
    return profiles, skipped


def outside_cells(
    profiles: Mapping[tuple[str, str], Mapping[int, float]],
) -> tuple[list[OutsideCell], list[str]]:
    """Every (model, GPU, common batch) ratio to the reference GPU; models without it are listed."""
    cells: list[OutsideCell] = []
    no_reference: list[str] = []
    by_model: dict[str, dict[str, Mapping[int, float]]] = defaultdict(dict)
    for (model, cluster), steps in profiles.items():
        gpu = OUTSIDE_CLUSTERS[cluster]
        # dgx and dgx-ext are the same GPUs; the extended profile (more batches) is preferred.
        if gpu in by_model[model] and len(by_model[model][gpu]) >= len(steps):
            continue
        by_model[model][gpu] = steps
    for model in sorted(by_model):
        gpus = by_model[model]
        reference = gpus.get(OUTSIDE_REFERENCE)
        if reference is None:
            no_reference.append(model)
            continue
        task_type, precision = OUTSIDE_MODELS[model]
        for gpu in sorted(g for g in gpus if g != OUTSIDE_REFERENCE):
            steps = gpus[gpu]
            for batch in sorted(set(steps) & set(reference)):
                # throughput ratio = (batch / step) / (batch / reference step)
                cells.append(
                    OutsideCell(model, gpu, gpu, batch, task_type, precision, reference[batch] / steps[batch])
                )
    return cells, no_reference


def _predicted(cell: OutsideCell) -> float:
    return speed_ratio(
        profile_for_model(cell.gpu),
        profile_for_model(OUTSIDE_REFERENCE),
        cell.task_type,
        precision=cell.precision,
    )


def _peak_fp32(cell: OutsideCell) -> float:
    return (
        profile_for_model(cell.gpu).compute_fp32_tflops
        / profile_for_model(OUTSIDE_REFERENCE).compute_fp32_tflops
    )


def _error(predicted: float, measured: float) -> float:
    return abs(predicted - measured) / measured


def _median(values: Sequence[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


def largest_common_batch(cells: Sequence[OutsideCell]) -> list[OutsideCell]:
    """One cell per (model, GPU): the one at the largest batch both devices ran."""
    best: dict[tuple[str, str], OutsideCell] = {}
    for cell in cells:
        key = (cell.model, cell.gpu)
        if key not in best or cell.batch > best[key].batch:
            best[key] = cell
    return [best[k] for k in sorted(best)]


def _figures(cells: Sequence[OutsideCell]) -> dict[str, Any]:
    loom = [_error(_predicted(c), c.measured_ratio) for c in cells]
    peak = [_error(_peak_fp32(c), c.measured_ratio) for c in cells]
    signed = [_predicted(c) / c.measured_ratio - 1 for c in cells]

    def by(key: str) -> dict[str, float | None]:
        groups: dict[str, list[float]] = defaultdict(list)
        for c, e in zip(cells, loom, strict=True):
            groups[getattr(c, key)].append(e)
        return {k: _median(v) for k, v in sorted(groups.items())}

    return {
        "cells": len(cells),
        "median_error": _median(loom),
        "mean_signed_error": round(statistics.fmean(signed), 4) if signed else None,
        "peak_fp32_median_error": _median(peak),
        "median_error_by_gpu": by("gpu"),
        "median_error_by_model": by("model"),
    }


def evaluate(folders: Sequence[Path]) -> dict[str, Any]:
    """The outside evaluation's JSON: headline at the largest common batch, every batch, every row."""
    profiles, skipped = read_tree(folders)
    cells, no_reference = outside_cells(profiles)
    if not cells:
        raise OutsideDataError(
            f"no ratio to {OUTSIDE_REFERENCE} in {', '.join(map(str, folders))}: need "
            f"<model>/placements-azure.csv and another cluster's file for at least one model of "
            f"{', '.join(OUTSIDE_MODELS)}"
        )
    headline = largest_common_batch(cells)
    return {
        "folders": [str(f) for f in folders],
        "reference": OUTSIDE_REFERENCE,
        "clusters": dict(OUTSIDE_CLUSTERS),
        "models": {m: {"task_type": t, "precision": p} for m, (t, p) in OUTSIDE_MODELS.items()},
        "weights": "packaged (fitted on Gavel + Lambda only): every figure is out of sample",
        "largest_common_batch": _figures(headline),
        "all_batches": _figures(cells),
        "rows": [
            {
                "model": c.model,
                "gpu": c.gpu,
                "local_batch": c.batch,
                "task_type": c.task_type,
                "precision": c.precision,
                "measured": round(c.measured_ratio, 4),
                "predicted": round(_predicted(c), 4),
                "peak_fp32": round(_peak_fp32(c), 4),
                "learned_runs_to_15pct": convergence(
                    c.measured_ratio / _predicted(c), LEARN_NOISE_CV, LEARN_RUNS, LEARN_SEEDS
                )["runs_to_15pct"],
            }
            for c in headline
        ],
        "profiles_read": sorted(f"{m}/{c}" for m, c in profiles),
        "models_without_reference": no_reference,
        "skipped": skipped,
    }
