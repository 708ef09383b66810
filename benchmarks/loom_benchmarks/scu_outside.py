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
from collections.abc import Iterable, Mapping, Sequence
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
    batch: int
    task_type: TaskType
    precision: Precision
    measured_ratio: float


def read_node_steps(path: Path) -> dict[tuple[int, int], float]:
    """``{(GPUs, local batch): seconds per step}`` of a profile's rows on one node.

    A ``placement`` of one digit ``n`` (1-9) is ``n`` GPUs of one node (``11`` or ``22``, more than
    one node, are skipped: Loom's truth models one node's scaling, the network the rest). Seconds
    are ``step_time``, the whole iteration: it already holds ``sync_time`` (Pollux's and Sia's
    ``applications.py`` take a step as ``step_time`` and the compute alone as ``step_time -
    sync_time``). Repeated rows keep their median. Raises :class:`OutsideDataError` for a missing
    column, a row that cannot be parsed, a batch that is not a positive integer, or a time that is
    not a finite number (step > 0, sync >= 0).
    """
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise OutsideDataError(f"{path}: cannot read: {exc}") from exc
    try:
        return _node_steps(path, csv.DictReader(text.splitlines()))
    except csv.Error as exc:
        raise OutsideDataError(f"{path}: not a CSV file as expected: {exc}") from exc


def _node_steps(path: Path, reader: "csv.DictReader[str]") -> dict[tuple[int, int], float]:
    needed = {"local_bsz", "step_time", "sync_time", "placement"}
    missing = needed - set(reader.fieldnames or ())
    if missing:
        raise OutsideDataError(f"{path}: missing column(s) {', '.join(sorted(missing))}")
    steps: dict[tuple[int, int], list[float]] = defaultdict(list)
    for line, row in enumerate(reader, start=2):
        placement = (row.get("placement") or "").strip()
        if len(placement) != 1 or placement not in "123456789":
            continue
        try:
            batch = int((row["local_bsz"] or "").strip())
            step = float((row["step_time"] or "").strip())
            sync = float((row["sync_time"] or "").strip())
        except ValueError as exc:
            raise OutsideDataError(f"{path} line {line}: {exc}") from exc
        if batch <= 0 or not (math.isfinite(step) and step > 0 and math.isfinite(sync) and sync >= 0):
            raise OutsideDataError(
                f"{path} line {line}: local_bsz must be a positive integer, step_time a positive "
                f"and sync_time a non-negative finite number, got {row['local_bsz']!r}, "
                f"{row['step_time']!r}, {row['sync_time']!r}"
            )
        steps[(int(placement), batch)].append(step)
    return {k: statistics.median(v) for k, v in sorted(steps.items())}


def one_gpu(steps: Mapping[tuple[int, int], float]) -> dict[int, float]:
    """``{local batch: seconds per step}`` of the one-GPU entries of :func:`read_node_steps`' map."""
    return {batch: t for (gpus, batch), t in steps.items() if gpus == 1}


def read_single_gpu_steps(path: Path) -> dict[int, float]:
    """``{local batch: seconds per step}`` of a profile's one-GPU rows (:func:`read_node_steps`)."""
    return one_gpu(read_node_steps(path))


def read_tree(
    folders: Sequence[Path],
) -> tuple[dict[tuple[str, str], dict[tuple[int, int], float]], list[str]]:
    """``{(model, cluster): {(GPUs, batch): seconds}}`` from every folder; a (model, cluster) once.

    The first folder that has a (model, cluster) wins (the artifacts keep copies in two places).
    Returns the profiles and the files skipped, each with why.
    """
    profiles: dict[tuple[str, str], dict[tuple[int, int], float]] = {}
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
                skipped.append(f"{path}: {model}/{cluster} already read from another file")
                continue
            steps = read_node_steps(path)
            if not any(gpus == 1 for gpus, _ in steps):
                skipped.append(f"{path}: no one-GPU row")
                continue
            profiles[(model, cluster)] = steps
    return profiles, skipped


def by_gpu_model(
    profiles: Mapping[tuple[str, str], Mapping[tuple[int, int], float]],
) -> dict[str, dict[str, Mapping[tuple[int, int], float]]]:
    """``{model: {library GPU: profile}}``; of two clusters with the same GPUs (``dgx`` and
    ``dgx-ext``) the one with more rows (the extended profile)."""
    by_model: dict[str, dict[str, Mapping[tuple[int, int], float]]] = defaultdict(dict)
    for (model, cluster), steps in sorted(profiles.items()):
        gpu = OUTSIDE_CLUSTERS[cluster]
        if gpu in by_model[model] and len(by_model[model][gpu]) >= len(steps):
            continue
        by_model[model][gpu] = steps
    return dict(by_model)


def outside_cells(
    profiles: Mapping[tuple[str, str], Mapping[tuple[int, int], float]],
) -> tuple[list[OutsideCell], list[str]]:
    """Every (model, GPU, common batch) one-GPU ratio to the reference GPU; models without it listed."""
    cells: list[OutsideCell] = []
    no_reference: list[str] = []
    for model, gpus in sorted(by_gpu_model(profiles).items()):
        one = {g: one_gpu(steps) for g, steps in gpus.items()}
        reference = one.get(OUTSIDE_REFERENCE)
        if reference is None:
            no_reference.append(model)
            continue
        task_type, precision = OUTSIDE_MODELS[model]
        for gpu in sorted(g for g in one if g != OUTSIDE_REFERENCE):
            steps = one[gpu]
            for batch in sorted(set(steps) & set(reference)):
                # throughput ratio = (batch / step) / (batch / reference step)
                cells.append(
                    OutsideCell(model, gpu, batch, task_type, precision, reference[batch] / steps[batch])
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


# ---- a truth file from the same profiles --------------------------------------------------------------

TRUTH_FAMILIES: Final[Mapping[str, tuple[str, str]]] = {
    "cifar10": ("resnet-18", "ResNet-18 on CIFAR-10 (AdaptDL benchmark)"),
    "imagenet": ("resnet-50", "ResNet-50 on ImageNet, apex AMP (AdaptDL benchmark)"),
    "yolov3": ("yolov3", "YOLOv3 on PASCAL VOC (AdaptDL benchmark)"),
    "ncf": ("ncf", "NCF on MovieLens (AdaptDL benchmark)"),
    "bert": ("bert-base", "BERT base fine-tuning on SQuAD (AdaptDL benchmark)"),
    "deepspeech2": ("deepspeech2", "DeepSpeech2 (GRU) on CMU ARCTIC / VoxForge (AdaptDL benchmark)"),
}
"""Model folder → (truth family, what it is). Names shared with the packaged tables where the
model is the same, so a workload's families reach them the same way."""

TRUTH_GPU: Final[Mapping[str, str]] = {**OUTSIDE_CLUSTERS, "azure": "V100M16"}
"""Cluster → GPU model in the truth file. Sia's V100s are 32 GB SXM2 (ND40rs_v2); the truth's
reference must be the scheduler's ``V100M16``, so they stand for it (the same GV100 at the same
clocks; at these batch sizes memory size does not bind)."""

TRUTH_GPU_ALIASES: Final[Mapping[str, Mapping[str, str]]] = {
    "V100M32": {"gpu": "V100M16", "why": "measured on V100 32 GB, which stands for the 16 GB"},
    "G2": {
        "gpu": "A100-40G",
        "why": "undisclosed Alibaba model assumed an A100 40 GB (as the packaged truth)",
    },
}
"""Only what was measured stands for another GPU. Loom's ``G3`` (assumed an A100 80 GB) and the A100
80 GB are not the 40 GB card measured here: the truth derives them (``profile-ratio``: the A100 40 GB
times the profiles' ratio, 1.14-1.21x), flagged. Aliasing them to the 40 GB card instead (a first
run, 2026-12-03) made every A100 alike in truth while Loom believes the 80 GB ones faster."""


def large_batch_floor(profiles: Iterable[Mapping[tuple[int, int], float]]) -> int:
    """The median of the distinct one-GPU local batches over a model's profiles (the smaller of the
    two middle ones): the truth keeps the batches at or above it."""
    batches = sorted({b for steps in profiles for b in one_gpu(steps)})
    return batches[(len(batches) - 1) // 2] if batches else 0


def truth_document(folders: Sequence[Path]) -> dict[str, Any]:
    """A ``loom-truth`` file (:mod:`loom.sim.truth`) from AdaptDL / Pollux / Sia profiles.

    One series per (model, local batch): its cells are every GPU model's throughput at that local
    batch on 1 to 8 GPUs of one node (``GPUs x batch / step_time`` samples a second), so speeds
    and intra-node scaling come from the same measurements. Only a model's **larger batches** are
    kept: those at or above the median of the distinct one-GPU local batches it was measured at
    (a GPU that never reached it keeps its largest, with the reference GPU's cell at that batch).
    At small batches every GPU idles on its host (CIFAR-10 at batch 32 runs 2.2x faster on a T4
    than on the Azure V100, 0.34x at batch 725), and a job without a batch label is timed by the
    geometric mean over every kept batch both GPUs ran (:class:`loom.sim.truth.Truth`'s rule).
    GPUs the profiles lack (the P100, H100, ...) are derived by the truth's documented rules,
    flagged.
    """
    profiles, skipped = read_tree(folders)
    if not profiles:
        raise OutsideDataError(f"no profile of {', '.join(OUTSIDE_MODELS)} in {', '.join(map(str, folders))}")
    cells: list[dict[str, Any]] = []
    families: dict[str, dict[str, str]] = {}
    for model, gpus in sorted(by_gpu_model(profiles).items()):
        family, about = TRUTH_FAMILIES[model]
        task_type, precision = OUTSIDE_MODELS[model]
        families[family] = {"task_type": task_type, "about": about}
        least = large_batch_floor(gpus.values())
        # A GPU whose memory stops below the floor (YOLOv3 on the 11 GB RTX 2080 Ti: local batch 8
        # at most) keeps its largest batch, with the reference GPU's cell at that batch to compare
        # with: a derived cell would guess where it was measured.
        extra: dict[int, set[str]] = defaultdict(set)
        for gpu, steps in gpus.items():
            largest = max(one_gpu(steps), default=0)
            if 0 < largest < least:
                extra[largest].update((gpu, OUTSIDE_REFERENCE))
        for gpu, steps in sorted(gpus.items()):
            truth_gpu = TRUTH_GPU["azure"] if gpu == OUTSIDE_REFERENCE else gpu
            for (n, batch), seconds in sorted(steps.items()):
                if batch < least and gpu not in extra.get(batch, ()):
                    continue
                cells.append(
                    {
                        "family": family,
                        "gpu_model": truth_gpu,
                        "precision": precision,
                        "batch": batch,
                        "gpus_per_node": n,
                        "throughput": round(n * batch / seconds, 6),
                        "series": f"{model}-b{batch}",
                        "source": f"{model}/{gpu}",
                    }
                )
    return {
        "format": "loom-truth",
        "version": 1,
        "reference_gpu": "V100M16",
        "description": "Training throughput measured by the Pollux / Sia schedulers' authors (AdaptDL "
        "profiles), converted by loom_benchmarks.scu_outside.truth_document; never used to fit Loom.",
        "sources": [str(f) for f in folders],
        "units": "samples/s (local batch x GPUs / step_time), local batches at or above each model's "
        "median measured one",
        "gpus": dict(TRUTH_GPU),
        "families": families,
        "aliases": {"bert": "bert-base", "resnet50": "resnet-50", "resnet18": "resnet-18"},
        "gpu_aliases": {k: dict(v) for k, v in TRUTH_GPU_ALIASES.items()},
        "skipped": skipped,
        "cells": cells,
    }


# ---- a workload from Pollux / Sia workload files -------------------------------------------------------

POLLUX_EPOCHS: Final[Mapping[str, int]] = {
    "bert": 2,
    "cifar10": 100,
    "ncf": 10,
    "imagenet": 90,
    "deepspeech2": 80,
    "yolov3": 50,
}
"""Epochs each application trains for (Pollux's and Sia's ``applications.py``: ``max_epochs``, no
target metric, so a job completes after the last one)."""

GRADIENT_BYTES: Final[Mapping[str, int]] = {
    "cifar10": 11_700_000 * 4,  # ResNet-18: 11.7 M parameters, FP32 gradients
    "imagenet": 25_600_000 * 4,  # ResNet-50: 25.6 M (apex AMP keeps FP32 master gradients)
    "bert": 110_000_000 * 4,  # BERT base: 110 M
    "yolov3": 61_900_000 * 4,  # YOLOv3 (Darknet-53): 61.9 M
}
"""Bytes each worker all-reduces a step, from the models' published parameter counts. DeepSpeech2
and NCF are left out (their sizes in the AdaptDL benchmarks are not stated): their jobs carry no
network term and count as ``training``, not network-sensitive."""


def read_validation(folder: Path, model: str) -> dict[int, list[int]]:
    """``{global batch: [iterations after each epoch]}`` from ``folder/<model>/validation-<batch>.csv``."""
    curves: dict[int, list[int]] = {}
    for path in sorted((folder / model).glob("validation-*.csv")):
        try:
            batch = int(path.stem.removeprefix("validation-"))
            rows = list(csv.DictReader(path.read_text(encoding="utf-8-sig").splitlines()))
            iterations = [int(float(r["iteration"])) for r in rows]
        except (OSError, UnicodeDecodeError, ValueError, KeyError, csv.Error) as exc:
            raise OutsideDataError(f"{path}: cannot read an iteration per epoch: {exc!r}") from exc
        if batch <= 0 or not iterations or any(i <= 0 for i in iterations):
            raise OutsideDataError(f"{path}: need a positive batch and positive iterations")
        curves[batch] = iterations
    return curves


def _between(points: Mapping[int, float], x: float) -> float:
    """``points`` interpolated linearly at ``x`` inside their range (callers clamp outside it)."""
    sizes = sorted(points)
    upper = next(s for s in sizes if s >= x)
    lower = max(s for s in sizes if s <= x)
    if upper == lower:
        return float(points[lower])
    return points[lower] + (x - lower) * (points[upper] - points[lower]) / (upper - lower)


def iterations_to_complete(curves: Mapping[int, Sequence[int]], epochs: int, batch: float) -> float:
    """Iterations a job of global ``batch`` runs to finish ``epochs`` epochs, interpolated linearly
    between the validated batch sizes (clamped to the nearest outside them), as Pollux does."""
    last = min(epochs, *(len(v) for v in curves.values())) - 1
    at_last = {size: float(curve[last]) for size, curve in curves.items()}
    return _between(at_last, min(max(batch, min(at_last)), max(at_last)))


def step_at(steps: Mapping[int, float], local: float) -> float:
    """Seconds a step takes at local batch ``local`` (interpolated linearly between measured batches;
    below the smallest, the smallest's; above the largest, proportionally more, as gradient
    accumulation would)."""
    smallest, largest = min(steps), max(steps)
    if local >= largest:
        return steps[largest] * local / largest
    return _between(steps, max(local, smallest))


def workload_jobs(workload: Path, folders: Sequence[Path]) -> list[dict[str, Any]]:
    """Loom's generic workload records (JSON lines, ``libs/loom/sim/README.md``) for a Pollux / Sia
    workload file (``name,time,application,num_replicas,batch_size``).

    Each job is a gang of ``num_replicas`` one-GPU workers (kept in one cluster) arriving at
    ``time``; it trains ``batch_size`` a step over all workers for its application's epochs:
    ``steps`` are the iterations that takes (the validation curves in ``folders``), ``step_time_s``
    the reference V100's step at the local batch ``batch_size / num_replicas`` (its one-GPU
    profile). Its ``labels`` name the truth's family and that local batch, so a truth from
    :func:`truth_document` times it where it runs. Durations follow Pollux's rule for a fixed
    batch size and allocation (``iterations x step time``); Pollux and Sia themselves adapt both
    while a job runs, which Loom does not."""
    profiles, _ = read_tree(folders)
    by_model = by_gpu_model(profiles)
    try:
        rows = list(csv.DictReader(workload.read_text(encoding="utf-8-sig").splitlines()))
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise OutsideDataError(f"{workload}: cannot read: {exc}") from exc
    needed = {"name", "time", "application", "num_replicas", "batch_size"}
    if not rows or needed - set(rows[0]):
        raise OutsideDataError(f"{workload}: need the columns {', '.join(sorted(needed))}")
    curves: dict[str, dict[int, list[int]]] = {}
    jobs: list[dict[str, Any]] = []
    for line, row in enumerate(rows, start=2):
        app = (row["application"] or "").strip()
        if app not in OUTSIDE_MODELS:
            raise OutsideDataError(
                f"{workload} line {line}: application {app!r} is not one of {', '.join(OUTSIDE_MODELS)}"
            )
        try:
            arrival = float(row["time"])
            replicas = int(row["num_replicas"])
            batch = float(row["batch_size"])
        except (TypeError, ValueError) as exc:
            raise OutsideDataError(f"{workload} line {line}: {exc}") from exc
        if not (
            math.isfinite(arrival) and arrival >= 0 and replicas >= 1 and math.isfinite(batch) and batch > 0
        ):
            raise OutsideDataError(f"{workload} line {line}: time >= 0, num_replicas >= 1, batch_size > 0")
        if app not in curves:
            curves[app] = {}
            for folder in folders:
                curves[app] = curves[app] or read_validation(folder, app)
            if not curves[app]:
                raise OutsideDataError(
                    f"no validation-<batch>.csv for {app} in {', '.join(map(str, folders))}"
                )
        reference = one_gpu(by_model.get(app, {}).get(OUTSIDE_REFERENCE, {}))
        if not reference:
            raise OutsideDataError(f"no one-GPU profile of {app} on the V100 (placements-azure.csv)")
        local = batch / replicas
        task_type, precision = OUTSIDE_MODELS[app]
        job: dict[str, Any] = {
            "arrival_s": arrival,
            "job_id": (row["name"] or f"job-{line}").strip().replace(".", "-"),
            "class": "net_training" if app in GRADIENT_BYTES and replicas > 1 else "training",
            "task_type": task_type,
            "workers": replicas,
            "gpus": 1,
            "steps": max(1, round(iterations_to_complete(curves[app], POLLUX_EPOCHS[app], batch))),
            "step_time_s": round(step_at(reference, local), 6),
            "labels": {"family": TRUTH_FAMILIES[app][0], "batch": str(round(local)), "precision": precision},
        }
        if app in GRADIENT_BYTES and replicas > 1:
            job["bytes_per_step"] = GRADIENT_BYTES[app]
        jobs.append(job)
    return jobs
