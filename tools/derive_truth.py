"""Derive the simulator's packaged truth tables from the reference data (developers only).

Reads Gavel's and Lambda's measured training throughputs under ``../shared/data/gpu-throughput/``
and writes ``libs/loom/sim/data/truth_throughput.json`` in the truth file format of
:mod:`loom.sim.truth` (documented there and in ``libs/loom/sim/data/README.md``):

- **Gavel** (``gavel_oracle_throughputs.json``): every job type's ``"null"`` throughput (steps per
  second alone on one GPU) on ``k80``, ``p100`` and ``v100``, fp32, one GPU. One series per job type
  and batch size (``gavel/bs64``...), since only cells of one batch compare. ``Transformer (batch
  size 256)`` is left out: its ``v100`` value equals its ``p100`` value (a known artifact of the
  source), so its reference cell is not a measurement.
- **Lambda** (``lambda/``), series ``lambda``: ``v1v2-pytorch-train-throughput-{fp32,fp16}.csv``
  (seven models, V100 through B200, 1/2/4/8 GPUs), plus the H200 systems of
  ``pytorch-train-throughput-v2-*.csv`` (the v1v2 file's H100/GH200/B200 rows are rows of that
  same v2 run, value for value, so its H200 rows compare with them directly; the median over the
  H200 hosts of one GPU count is kept).
- **Lambda**, series ``lambda-v1``: the three models the v1v2 files lack (``ncf``,
  ``transformerxlbase``, ``transformerxllarge``) from ``pytorch-train-throughput-{fp32,fp16}.csv``.
  Rows of the vendors' duplicate H100 systems (``Dell``, ``DellTexas``, ``SMC``, ``1CC``,
  ``RAIDZ1``) are left out (they have no Transformer-XL figure and broken ``ncf`` figures, up to
  10^10 samples/s); zero cells are not measurements; a multi-GPU cell whose per-GPU throughput is
  above twice the same system's one-GPU figure is dropped as broken; duplicates of one (GPU, GPU
  count) keep their median.
- **Noise**: the coefficient of variation of throughput across identical systems: Lambda's v2 run
  has 20-odd hosts each of one and eight H100 SXM5 (``LambdaOD_*``), and its v1 files five vendors'
  H100 SXM5 systems at 1/2/4/8 GPUs. Per model, the median over those groups (three or more
  hosts) of ``std / mean``; the table's figure is the median over models. Gavel measured each job
  once per GPU (its pair entries are two *different* jobs sharing a GPU, not repeats), so it gives
  no noise figure.

Batch sizes: Lambda's cells come with the per-GPU batch of ``pytorch-train-bs-{fp32,fp16}.csv``
(the v1 file's, for the systems it has; absent where it has none). Gavel's from the job type's name.

The output is deterministic: re-running on the same data gives identical bytes.

    .venv/bin/python tools/derive_truth.py            # write the file
    .venv/bin/python tools/derive_truth.py --check    # exit 1 if it is out of date
"""

import argparse
import csv
import json
import re
import statistics
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data"
OUT = REPO / "libs" / "loom" / "sim" / "data"
NAME = "truth_throughput.json"

GAVEL = (
    "stanford-futuredata/gavel, scheduler/notebooks/figures/motivation/oracle_throughputs.json at "
    "commit c4fa40097339e9608ab71fd64c8bdea96a5e4a4c (MIT; Narayanan et al., OSDI 2020): 'null' "
    "throughput, steps/s of the job alone on one GPU"
)
LAMBDA = (
    "lambdal/deeplearning-benchmark, pytorch/csv_v1_v2/*.csv and pytorch/*-v2-*.csv at commit "
    "aa5addb6a53675a649a80036dad548f1c27cbcc4 (NVIDIA's PyTorch reference models in NGC containers): "
    "training throughput in each model's own unit per second (images, sequences, tokens, samples)"
)
LAMBDA_V1 = (
    "lambdal/deeplearning-benchmark, pytorch/pytorch-train-throughput-*.csv (v1) at commit "
    "aa5addb6a53675a649a80036dad548f1c27cbcc4: models the v1v2 files lack"
)

GAVEL_GPUS = {"k80": "K80", "p100": "P100", "v100": "V100M16"}
GAVEL_LEFT_OUT = {"Transformer (batch size 256)"}

# Lambda's product names -> Loom GPU model names (the longest match wins; see the README).
LAMBDA_GPUS: tuple[tuple[str, str], ...] = (
    ("Quadro RTX 8000", "QRTX8000"),
    ("RTX 6000 Ada", "RTX6000ADA"),
    ("RTX A6000", "RTXA6000"),
    ("RTX 3090", "RTX3090"),
    ("RTX 4090", "RTX4090"),
    ("A100 40GB PCIe", "A100-40G-PCIE"),
    ("A100 80GB PCIe", "A100-80G-PCIE"),
    ("A100 80GB SXM4", "A100"),
    ("H100 80GB PCIe", "H100-PCIE"),
    ("H100 80GB SXM5", "H100"),
    ("GH200", "GH200"),
    ("H200", "H200"),
    ("B200", "B200"),
    ("V100 16GB", "V100M16"),
    ("A10", "A10"),
)
LAMBDA_PRODUCTS = {
    "V100M16": "Tesla V100 SXM2 16 GB (Lambda Cloud)",
    "A10": "A10 24 GB PCIe (Lambda Cloud)",
    "A100-40G-PCIE": "A100 40 GB PCIe (Lambda Cloud)",
    "A100-80G-PCIE": "A100 80 GB PCIe",
    "A100": "A100 80 GB SXM4",
    "RTX3090": "GeForce RTX 3090 24 GB",
    "RTX4090": "GeForce RTX 4090 24 GB",
    "RTXA6000": "RTX A6000 48 GB",
    "RTX6000ADA": "RTX 6000 Ada Generation 48 GB",
    "QRTX8000": "Quadro RTX 8000 48 GB",
    "H100-PCIE": "H100 80 GB PCIe Gen5",
    "H100": "H100 80 GB SXM5",
    "GH200": "GH200 Grace Hopper 96 GB",
    "H200": "H200 141 GB SXM",
    "B200": "B200 192 GB SXM",
    "K80": "Tesla K80 (one GK210 of the board; Gavel)",
    "P100": "Tesla P100 (Gavel)",
}
VENDOR_DUPLICATES = ("Dell", "DellTexas", "SMC", "1CC", "RAIDZ1")

# Lambda's model columns -> (family, task type, unit).
LAMBDA_MODELS = {
    "ssd": ("ssd", "training_compute", "images/s"),
    "bert_base_squad": ("bert-base", "training_compute", "sequences/s"),
    "bert_large_squad": ("bert-large", "training_compute", "sequences/s"),
    "gnmt": ("gnmt", "training_memory", "tokens/s"),
    "ncf": ("ncf", "training_comm", "samples/s"),
    "resnet50": ("resnet-50", "training_compute", "images/s"),
    "tacotron2": ("tacotron2", "training_memory", "samples/s"),
    "transformerxlbase": ("transformer-xl-base", "training_compute", "tokens/s"),
    "transformerxllarge": ("transformer-xl-large", "training_compute", "tokens/s"),
    "waveglow": ("waveglow", "training_compute", "samples/s"),
}
V1_ONLY = ("ncf", "transformerxlbase", "transformerxllarge")

# Gavel's job families -> task type (the mapping loom.model.scu was fitted with).
GAVEL_FAMILIES = {
    "resnet-18": "training_compute",
    "resnet-50": "training_compute",
    "cyclegan": "training_compute",
    "transformer": "training_compute",
    "lm": "training_memory",
    "recommendation": "training_comm",
    "a3c": "training_comm",
}
ABOUT = {
    "resnet-50": "ResNet-50 image classification (Gavel: ImageNet, batch 16-128; Lambda: NVIDIA's "
    "reference, ImageNet)",
    "resnet-18": "ResNet-18 on CIFAR-10 (Gavel)",
    "cyclegan": "CycleGAN image translation (Gavel)",
    "transformer": "Transformer translation model, WMT16 en-de (Gavel)",
    "lm": "LSTM language model, Wikitext-2 (Gavel)",
    "recommendation": "autoencoder recommendation, ML-20M (Gavel)",
    "a3c": "A3C reinforcement learning, Atari Pong (Gavel)",
    "ssd": "SSD300 object detection, COCO (Lambda)",
    "bert-base": "BERT base fine-tuning on SQuAD (Lambda)",
    "bert-large": "BERT large fine-tuning on SQuAD (Lambda)",
    "gnmt": "GNMT v2 LSTM translation, WMT16 (Lambda)",
    "ncf": "Neural Collaborative Filtering, ML-20M (Lambda)",
    "tacotron2": "Tacotron 2 speech synthesis, LJSpeech (Lambda)",
    "transformer-xl-base": "Transformer-XL base language model, WikiText-103 (Lambda)",
    "transformer-xl-large": "Transformer-XL large language model, WikiText-103 (Lambda)",
    "waveglow": "WaveGlow speech synthesis, LJSpeech (Lambda)",
}
# Model labels of Loom's workloads (folded, loom.model.family) -> table family.
ALIASES = {
    "resnet50": "resnet-50",
    "transformer-base": "transformer",
    "gpt2-large": "transformer-xl-large",
    "gpt2-xl": "transformer-xl-large",
    "transformer-h2048": "transformer-xl-large",
    "transformer-h4096": "transformer-xl-large",
    "transformer-h5120": "transformer-xl-large",
    "bert": "bert-base",
    "transformer-xl": "transformer-xl-base",
}
GPU_ALIASES = {
    "V100M32": {"gpu": "V100M16", "why": "the same V100 SXM2 chip with 32 GB; no separate measurement"},
    "V100": {"gpu": "V100M16", "why": "Loom's name for a V100 is V100M16"},
    "A100M80": {"gpu": "A100", "why": "Loom's alias of the A100 SXM4 80 GB"},
    "A100-40G": {
        "gpu": "A100-40G-PCIE",
        "why": "an A100 40 GB; only the PCIe card (250 W) was measured, it stands for the SXM4 (400 W)",
    },
    "G2": {
        "gpu": "A100-40G-PCIE",
        "why": "undisclosed Alibaba model assumed an A100 40 GB (loom.model.profiles); its closest "
        "measured product",
    },
    "G3": {
        "gpu": "A100",
        "why": "undisclosed Alibaba model assumed an A100 SXM4 80 GB (loom.model.profiles)",
    },
    "RTX-4090": {"gpu": "RTX4090", "why": "spelling"},
}


def _gpu_of(name: str) -> str | None:
    best: tuple[int, str] | None = None
    for product, model in LAMBDA_GPUS:
        if product in name and (best is None or len(product) > best[0]):
            best = (len(product), model)
    if best is None and re.search(r"H200", name):
        return "H200"
    return best[1] if best else None


def _read(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def _num(text: str) -> float:
    return float(text) if text.strip() else 0.0


def _gpus_in_v2_name(name: str) -> int:
    found = re.search(r"_(\d+)x(?:H100|H200|GH200|B200)", name)
    return int(found.group(1)) if found else 1


def _batches(lam: Path, precision: str) -> dict[tuple[str, int, str], int]:
    out: dict[tuple[str, int, str], int] = {}
    for row in _read(lam / f"pytorch-train-bs-{precision}.csv"):
        gpu = _gpu_of(row["name_gpu"])
        if gpu is None or row["name_gpu"].split()[0] in VENDOR_DUPLICATES:
            continue
        n = int(float(row["num_gpu"]))
        for column in LAMBDA_MODELS:
            out.setdefault((gpu, n, column), int(float(row[column])) // n)
    return out


def _cell(  # noqa: PLR0917 - one positional per field of the cell, in the file's order
    family: str, gpu: str, precision: str, batch: int | None, n: int, value: float, series: str, source: str
) -> dict[str, Any]:
    return {
        "family": family,
        "gpu_model": gpu,
        "precision": precision,
        "batch": batch,
        "gpus_per_node": n,
        "throughput": round(value, 6),
        "series": series,
        "source": source,
    }


def gavel_cells(data: Path) -> list[dict[str, Any]]:
    """Gavel's one-GPU throughputs, one series per job type and batch."""
    raw = json.loads((data / "gpu-throughput" / "gavel_oracle_throughputs.json").read_text())
    cells = []
    for gavel_gpu, model in sorted(GAVEL_GPUS.items(), key=lambda kv: kv[1]):
        for job_type in sorted(raw[gavel_gpu]):
            if job_type in GAVEL_LEFT_OUT:
                continue
            base, _, rest = job_type.partition(" (")
            family = re.sub(r"[^a-z0-9]+", "-", base.casefold()).strip("-")
            found = re.search(r"batch size (\d+)", rest)
            batch = int(found.group(1)) if found else None
            series = f"gavel/bs{batch}" if batch else "gavel"
            value = float(raw[gavel_gpu][job_type]["null"])
            cells.append(_cell(family, model, "fp32", batch, 1, value, series, f"gavel {gavel_gpu}"))
    return cells


def lambda_cells(data: Path) -> list[dict[str, Any]]:
    """Lambda's series ``lambda`` (v1v2 + the v2 H200 hosts) and ``lambda-v1`` (three models)."""
    lam = data / "gpu-throughput" / "lambda"
    cells: list[dict[str, Any]] = []
    for precision in ("fp32", "fp16"):
        batches = _batches(lam, precision)
        for (column, gpu, n), found in sorted(_lambda_v1v2_values(lam, precision).items()):
            family = LAMBDA_MODELS[column][0]
            source = "lambda v1v2" if gpu != "H200" else f"lambda v2, median of {len(found)} hosts"
            cells.append(
                _cell(
                    family,
                    gpu,
                    precision,
                    batches.get((gpu, n, column)),
                    n,
                    statistics.median(found),
                    "lambda",
                    source,
                )
            )
        v1 = _lambda_v1_values(lam, precision)
        for (column, gpu, n), found in sorted(v1.items()):
            value = statistics.median(found)
            one = v1.get((column, gpu, 1))
            if n > 1 and one and value / n > 2.0 * statistics.median(one):
                continue
            family = LAMBDA_MODELS[column][0]
            cells.append(
                _cell(
                    family,
                    gpu,
                    precision,
                    batches.get((gpu, n, column)),
                    n,
                    value,
                    "lambda-v1",
                    "lambda v1",
                )
            )
    return cells


def _lambda_v1v2_values(lam: Path, precision: str) -> dict[tuple[str, str, int], list[float]]:
    """Throughputs by (model column, GPU, GPUs) of the v1v2 table and of the v2 table's H200 hosts."""
    values: dict[tuple[str, str, int], list[float]] = defaultdict(list)
    for row in _read(lam / f"v1v2-pytorch-train-throughput-{precision}.csv"):
        gpu = _gpu_of(row["name_gpu"])
        if gpu is None:
            continue
        n = int(float(row["num_gpu"]))
        for column in LAMBDA_MODELS:
            if column in row and _num(row[column]) > 0:
                values[(column, gpu, n)].append(_num(row[column]))
    for row in _read(lam / f"pytorch-train-throughput-v2-{precision}.csv"):
        name = row[""]
        if "H200" not in name:
            continue
        n = _gpus_in_v2_name(name)
        for column in LAMBDA_MODELS:
            if column in row and _num(row[column]) > 0:
                values[(column, "H200", n)].append(_num(row[column]))
    return values


def _lambda_v1_values(lam: Path, precision: str) -> dict[tuple[str, str, int], list[float]]:
    """Throughputs by (model column, GPU, GPUs) of the v1 table, for the models only it has."""
    v1: dict[tuple[str, str, int], list[float]] = defaultdict(list)
    for row in _read(lam / f"pytorch-train-throughput-{precision}.csv"):
        gpu = _gpu_of(row["name_gpu"])
        if gpu is None or row["name_gpu"].split()[0] in VENDOR_DUPLICATES:
            continue
        n = int(float(row["num_gpu"]))
        for column in V1_ONLY:
            if _num(row[column]) > 0:
                v1[(column, gpu, n)].append(_num(row[column]))
    return v1


def noise(data: Path) -> dict[str, Any]:
    """Run-to-run (host-to-host) variation of identical systems, per family and overall."""
    lam = data / "gpu-throughput" / "lambda"
    groups: dict[tuple[str, str, str, int], list[float]] = defaultdict(list)
    for precision in ("fp32", "fp16"):
        for row in _read(lam / f"pytorch-train-throughput-v2-{precision}.csv"):
            name = row[""]
            if not name.startswith("LambdaOD") or "H100_80GB_SXM5" not in name or name.endswith("_bk"):
                continue
            n = _gpus_in_v2_name(name)
            for column in LAMBDA_MODELS:
                if column in row and _num(row[column]) > 0:
                    groups[(column, precision, "v2", n)].append(_num(row[column]))
        for row in _read(lam / f"pytorch-train-throughput-{precision}.csv"):
            if row["name_gpu"].split()[0] not in VENDOR_DUPLICATES:
                continue
            n = int(float(row["num_gpu"]))
            for column in LAMBDA_MODELS:
                if column != "ncf" and _num(row[column]) > 0:
                    groups[(column, precision, "v1", n)].append(_num(row[column]))
    per_family: dict[str, list[float]] = defaultdict(list)
    for (column, _, _, _), found in sorted(groups.items()):
        if len(found) >= 3:
            per_family[LAMBDA_MODELS[column][0]].append(statistics.stdev(found) / statistics.fmean(found))
    by_family = {f: round(statistics.median(cvs), 4) for f, cvs in sorted(per_family.items())}
    return {
        "cv": round(statistics.median(by_family.values()), 4),
        "by_family": by_family,
        "source": (
            "coefficient of variation (std / mean) of throughput across identical systems: Lambda v2's "
            "LambdaOD H100 SXM5 hosts (1 and 8 GPUs, 20-odd hosts each) and Lambda v1's five vendors' "
            "H100 SXM5 systems (1/2/4/8 GPUs); per family the median over groups of 3+ hosts, overall "
            "the median over families. Gavel measured each job once per GPU: no figure from it."
        ),
    }


def derive(data: Path) -> str:
    """The packaged truth file as JSON text."""
    cells = gavel_cells(data) + lambda_cells(data)
    cells.sort(key=lambda c: (c["family"], c["precision"], c["series"], c["gpu_model"], c["gpus_per_node"]))
    families = {
        f: {
            "task_type": GAVEL_FAMILIES.get(f) or next(v[1] for v in LAMBDA_MODELS.values() if v[0] == f),
            "about": ABOUT[f],
        }
        for f in sorted({c["family"] for c in cells})
    }
    units = {"gavel": "steps/s"} | {f"lambda:{v[0]}": v[2] for v in LAMBDA_MODELS.values()}
    document = {
        "format": "loom-truth",
        "version": 1,
        "reference_gpu": "V100M16",
        "description": (
            "Measured training throughput per (family, GPU model, precision, batch, GPUs per node). "
            "Derived by tools/derive_truth.py; do not edit by hand."
        ),
        "sources": {"gavel": GAVEL, "lambda": LAMBDA, "lambda-v1": LAMBDA_V1},
        "units": dict(sorted(units.items())),
        "gpus": dict(sorted(LAMBDA_PRODUCTS.items())),
        "gpu_aliases": dict(sorted(GPU_ALIASES.items())),
        "families": families,
        "aliases": dict(sorted(ALIASES.items())),
        "noise": noise(data),
        "cells": cells,
    }
    # One cell per line keeps the file small and its diffs readable.
    head = json.dumps({k: v for k, v in document.items() if k != "cells"}, indent=1)
    rows = ",\n".join("  " + json.dumps(c, separators=(",", ":")) for c in cells)
    return head[:-2] + ',\n "cells": [\n' + rows + "\n ]\n}\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Write (or with --check, compare) the packaged truth file."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--data", type=Path, default=DATA, help="the shared reference data folder")
    parser.add_argument("--out", type=Path, default=OUT, help="where the file goes")
    parser.add_argument("--check", action="store_true", help="exit 1 if the file differs from a fresh run")
    args = parser.parse_args(argv)
    text = derive(args.data)
    path = args.out / NAME
    if args.check:
        if not path.is_file() or path.read_text() != text:
            print(f"out of date: {path}; run tools/derive_truth.py")
            return 1
        return 0
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote {path} ({path.stat().st_size:,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
