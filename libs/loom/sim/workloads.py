"""Workloads the simulator replays: the Alibaba GPU trace, a generic file format, a training mix.

Three sources, one result: a :class:`~loom.sim.model.Trace`.

- :func:`load_alibaba` reads the Alibaba GPU cluster trace (``openb_pod_list_*.csv``); a packaged
  sample of its first 2,000 GPU tasks (:data:`ALIBABA_SAMPLE`) lets tests and the default bench
  run without the shared data. How a measured duration becomes work is stated in its docstring.
- :func:`load_jsonl` / :func:`write_jsonl` and :func:`load_csv` / :func:`write_csv` are the generic
  workload format (one job per line; documented field by field in ``libs/loom/sim/README.md`` and
  in :class:`WorkloadRow`). Bad input raises :class:`WorkloadError` naming the file and line.
- :func:`training_mix` generates a seeded mix of data-parallel gangs, single-node training,
  inference services, pipeline-parallel models and DAG pipelines.

**Work is in reference-GPU seconds.** A job's :class:`~loom_proto.jobs.Work` is ``steps`` of
``step_time_s`` seconds each on one reference GPU (V100M16, 1 SCU); the simulator divides by the
SCU of the GPU a job gets, as placement does. Never a measured step time per GPU model: the step
times below are the reference GPU's only.

**Step times** come from Gavel's measured throughputs on a V100 (``step_time_s = 1 / "null"
throughput``; packaged as ``data/gavel_v100_step_times.json``, see ``data/README.md``). Models that
Gavel did not measure are scaled from its Transformer in proportion to parameters: a training step
costs about ``6 x parameters x tokens`` FLOPs (Kaplan et al., "Scaling Laws for Neural Language
Models", 2020), so at the same batch the time per step grows with the parameter count. That is an
estimate, marked as such in :data:`NET_MODELS`.
"""

import csv
import dataclasses
import functools
import importlib.resources
import itertools
import json
import math
import random
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Final, Literal, TypeVar, get_args

import msgspec
from msgspec import Meta

from loom.errors import InvalidInputError
from loom.model.family import PRECISIONS
from loom.model.profiles import DEFAULT_REFERENCE_MODEL, UnknownGpuModelError, library_models, relative_speed
from loom.model.topology import Topology, load_topology
from loom.sched.pipeline import DEFAULT_USABLE_FRACTION
from loom.sim.model import DRAIN_CONCURRENCY, EventError, EventKind, JobClass, SimEvent, SimJob, Trace
from loom.sim.truth import Truth, load_truth
from loom_proto.ids import InvalidIdError, plain_words, validate_id
from loom_proto.jobs import (
    Affinity,
    Communication,
    DataSpec,
    JobSpec,
    Layer,
    Pipeline,
    Resources,
    TaskType,
    Work,
)
from loom_proto.migrations import MAX_DRAIN_CONCURRENCY

__all__ = [
    "ALIBABA_SAMPLE",
    "COLUMNS",
    "DEFAULT_ARRIVAL_RATE_PER_H",
    "DEFAULT_MIX",
    "MIX_CLASSES",
    "NET_MODELS",
    "PHILLY_FAMILIES",
    "PHILLY_GANG_SIZES",
    "TRAINING_MODELS",
    "EventRow",
    "ModelSpec",
    "WorkloadError",
    "WorkloadRow",
    "alibaba_sample_path",
    "apportion",
    "at_load",
    "check_events",
    "check_regions",
    "family_step_s",
    "first_jobs",
    "gpu_seconds",
    "job_to_row",
    "load_alibaba",
    "load_csv",
    "load_jsonl",
    "load_workload",
    "net_model",
    "philly_like",
    "pipeline_layers",
    "reference_step_times",
    "row_to_job",
    "training_mix",
    "with_spanning",
    "write_csv",
    "write_jsonl",
]

_PACKAGE = "loom.sim"
_DATA_DIR = "data"

ALIBABA_SAMPLE: Final = "openb_gpu_tasks_2000.csv"
"""The packaged sample: the first 2,000 GPU tasks of ``openb_pod_list_default.csv`` (see data/README.md)."""
ALIBABA_CITATION: Final = (
    "alibaba/clusterdata cluster-trace-gpu-v2023 at commit 7a6c496e4f4b6ce6150be8f881cb051bf2abff42 "
    "(Weng et al., 'Beware of Fragmentation', USENIX ATC 2023)"
)
ALIBABA_STEP_S: Final = 10.0
"""Nominal length of one step of an Alibaba task on the reference GPU: the trace has no steps, so
a duration is cut into steps of about this long (only checkpoint and progress granularity depend
on it; ``steps x step_time_s`` is the work exactly)."""
ALIBABA_TENANT: Final = "alibaba"
ALIBABA_DEFAULT_FILE: Final = "openb_pod_list_default.csv"
_ALIBABA_REQUIRED = ("name", "num_gpu", "gpu_milli")
_ALIBABA_TIMES = ("creation_time", "deletion_time", "scheduled_time")

DEFAULT_TENANT: Final = "default"
DEFAULT_STEP_S: Final = 10.0
"""Step length used to cut ``gpu_seconds`` into steps when a row gives no ``steps``."""

BYTES_PER_PARAM_FP16: Final = 2
"""Gradient bytes per parameter in mixed precision (fp16/bf16 gradients)."""
ALLREDUCE_ROUNDS: Final = 2
"""Latency-bound rounds of an all-reduce per step: reduce-scatter and all-gather, each at least one
round trip across clusters."""
TRAINING_STATE_BYTES_PER_PARAM: Final = 16
"""Mixed-precision Adam keeps 16 bytes per parameter: fp16 weights and gradients (2 + 2), fp32
master weights, momentum and variance (4 + 4 + 4) (Rajbhandari et al., "ZeRO", SC 2020, §3.1)."""
ACTIVATION_BYTES_PER_TOKEN_HIDDEN: Final = 34
"""Activation memory of one transformer layer per token per hidden unit, without the attention
term (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", 2022)."""
FORWARD_SHARE: Final = 1.0 / 3.0
"""An inference step (forward only) costs about a third of a training step (the backward pass
costs about twice the forward one; Kaplan et al. 2020, §2.1)."""


class WorkloadError(InvalidInputError):
    """A workload that cannot be used. ``path`` and ``line`` (1-based) say where, when a file is at fault."""

    def __init__(self, message: str, *, path: str = "", line: int | None = None) -> None:
        where = path
        if line is not None:
            where = f"{where}:{line}" if where else f"line {line}"
        super().__init__(f"{where}: {message}" if where else message)
        self.path = path
        self.line = line


# ---- reference step times and model catalogue ----------------------------------------------------


@functools.cache
def reference_step_times() -> Mapping[str, float]:
    """Seconds per step of each Gavel job type alone on one V100 (the reference GPU), by job type."""
    raw = importlib.resources.files(_PACKAGE).joinpath(_DATA_DIR, "gavel_v100_step_times.json").read_bytes()
    document = msgspec.json.decode(raw, type=dict[str, Any])
    return {str(k): float(v) for k, v in document["step_time_s"].items()}


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A model the training mix draws: size, one reference-GPU step, and what bounds its speed."""

    name: str
    params: float
    """Parameters (for gradient bytes and memory)."""
    step_time_s: float
    """Seconds per training step on one reference GPU."""
    task_type: TaskType
    source: str


def _gavel(job_type: str) -> float:
    return reference_step_times()[job_type]


_TRANSFORMER_JOB = "Transformer (batch size 128)"
_TRANSFORMER_PARAMS = 65e6
"""Transformer base (Vaswani et al., "Attention Is All You Need", 2017, Table 3: 65M)."""


def _scaled(name: str, params: float, paper: str) -> ModelSpec:
    step = _gavel(_TRANSFORMER_JOB) * params / _TRANSFORMER_PARAMS
    return ModelSpec(
        name,
        params,
        step,
        "training_compute",
        f"{paper}; ESTIMATED step: Gavel '{_TRANSFORMER_JOB}' on V100 x params / 65M",
    )


@functools.cache
def _net_models() -> tuple[ModelSpec, ...]:
    return (
        ModelSpec(
            "resnet50",
            25.6e6,
            _gavel("ResNet-50 (batch size 64)"),
            "training_compute",
            "25.6M params (He et al. 2016); step: Gavel 'ResNet-50 (batch size 64)' on V100",
        ),
        ModelSpec(
            "transformer-base",
            _TRANSFORMER_PARAMS,
            _gavel(_TRANSFORMER_JOB),
            "training_compute",
            f"65M params (Vaswani et al. 2017); step: Gavel '{_TRANSFORMER_JOB}' on V100",
        ),
        _scaled("bert-base", 110e6, "110M params (Devlin et al. 2019)"),
        _scaled("bert-large", 340e6, "340M params (Devlin et al. 2019)"),
        _scaled("gpt2-large", 774e6, "774M params (Radford et al. 2019)"),
        _scaled("gpt2-xl", 1558e6, "1.5B params (Radford et al. 2019)"),
    )


NET_MODELS: Final[tuple[str, ...]] = (
    "resnet50",
    "transformer-base",
    "bert-base",
    "bert-large",
    "gpt2-large",
    "gpt2-xl",
)
"""Data-parallel models of the mix (25M-1.5B parameters); :func:`net_model` gives each one's spec."""

TRAINING_MODELS: Final[Mapping[str, TaskType]] = {
    "ResNet-18 (batch size 64)": "training_compute",
    "ResNet-18 (batch size 128)": "training_compute",
    "ResNet-50 (batch size 32)": "training_compute",
    "ResNet-50 (batch size 64)": "training_compute",
    "ResNet-50 (batch size 128)": "training_compute",
    "Transformer (batch size 64)": "training_compute",
    "Transformer (batch size 128)": "training_compute",
    "CycleGAN": "training_compute",
    "LM (batch size 20)": "training_memory",
    "LM (batch size 80)": "training_memory",
    "Recommendation (batch size 2048)": "training_comm",
    "Recommendation (batch size 8192)": "training_comm",
    "A3C": "training_comm",
}
"""Single-node training jobs: Gavel job types with their measured V100 step time, and the task type
their family maps to (the mapping :mod:`loom.model.scu` was fitted with)."""


def net_model(name: str) -> ModelSpec:
    """The spec of one of :data:`NET_MODELS`."""
    for model in _net_models():
        if model.name == name:
            return model
    raise WorkloadError(f"unknown model {name!r}; known: {', '.join(NET_MODELS)}")


# ---- reading files -------------------------------------------------------------------------------


def alibaba_sample_path() -> Path:
    """Where the packaged Alibaba sample is (a plain file inside the installed package)."""
    return Path(str(importlib.resources.files(_PACKAGE).joinpath(_DATA_DIR, ALIBABA_SAMPLE)))


def _read_lines(path: str | Path) -> list[tuple[int, str]]:
    """(1-based line number, text) of every line that is neither blank nor a ``#`` comment."""
    try:
        text = Path(path).read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise WorkloadError(f"cannot read: {exc}", path=str(path)) from exc
    return [
        (n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip() and not line.startswith("#")
    ]


def _source_comment(path: str | Path, *, preamble_only: bool = False) -> str:
    """The text of the file's first ``# source:`` comment, or ''. ``preamble_only`` (CSV): look only
    at the comments before the first record (the header): after it, a line starting ``# source:``
    may be a line of a quoted multi-line cell."""
    with Path(path).open(encoding="utf-8-sig") as handle:
        for line in handle:
            if line.lower().startswith("# source:"):
                return line.split(":", 1)[1].strip()
            if preamble_only and line.strip() and not line.startswith("#"):
                break
    return ""


def _csv_records(path: str | Path) -> tuple[list[str], list[tuple[int, dict[str, str]]], int]:
    """The header, each record as (line, column -> cell), and the header's line number.

    Blank lines and lines starting with ``#`` before the header are skipped (comments); after the
    header every line belongs to a record, parsed by :mod:`csv` over the rest of the file, so a
    quoted cell may hold newlines and a first cell may start with ``#`` (a data row never vanishes
    as a comment). Blank lines between records are skipped. A record's line is the line it starts on.
    """
    where = str(path)
    try:
        with Path(path).open(encoding="utf-8-sig", newline="") as handle:
            header_line = 0
            for text in handle:
                header_line += 1
                if text.strip() and not text.startswith("#"):
                    break
            else:
                raise WorkloadError("no header row", path=where)
            reader = csv.reader(itertools.chain([text], handle), strict=True)
            rows: list[tuple[int, list[str]]] = []
            end = 0  # lines the reader has consumed (the header's is the first)
            try:
                for cells in reader:
                    rows.append((header_line + end, cells))
                    end = reader.line_num
            except csv.Error as exc:
                raise WorkloadError(f"malformed CSV: {exc}", path=where, line=header_line + end) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise WorkloadError(f"cannot read: {exc}", path=where) from exc
    header = rows[0][1]
    records: list[tuple[int, dict[str, str]]] = []
    for line, cells in rows[1:]:
        if len(cells) <= 1 and not "".join(cells).strip():
            continue  # a blank line
        if len(cells) != len(header):
            raise WorkloadError(f"{len(cells)} cells for {len(header)} columns", path=where, line=line)
        records.append((line, dict(zip(header, cells, strict=True))))
    return header, records, header_line


# ---- the Alibaba trace ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Task:
    line: int
    name: str
    cpu_milli: int
    memory_mib: int
    num_gpu: int
    gpu_milli: int
    gpu_models: tuple[str, ...]
    qos: str
    phase: str
    creation_s: float | None
    deletion_s: float | None
    scheduled_s: float | None


def _int_cell(cells: Mapping[str, str], column: str, where: str, line: int) -> int:
    text = cells.get(column, "").strip()
    if not text:
        return 0
    try:
        value = int(float(text))
    except ValueError:
        raise WorkloadError(f"{column} is not a number: {text!r}", path=where, line=line) from None
    if value < 0:
        raise WorkloadError(f"{column} must not be negative, got {value}", path=where, line=line)
    return value


def _time_cell(cells: Mapping[str, str], column: str, where: str, line: int) -> float | None:
    text = cells.get(column, "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        raise WorkloadError(f"{column} is not a number: {text!r}", path=where, line=line) from None
    if not math.isfinite(value) or value < 0:
        raise WorkloadError(f"{column} must be a finite time >= 0, got {text!r}", path=where, line=line)
    return value


def _read_tasks(path: str | Path) -> tuple[list[_Task], bool]:
    """Every row of an Alibaba pod list, and whether the file has time columns."""
    where = str(path)
    header, records, header_line = _csv_records(path)
    missing = [c for c in _ALIBABA_REQUIRED if c not in header]
    if missing:
        raise WorkloadError(
            f"not an Alibaba pod list: no column {', '.join(missing)}", path=where, line=header_line
        )
    timed = "creation_time" in header
    tasks = []
    for line, cells in records:
        spec = cells.get("gpu_spec", "").strip()
        tasks.append(
            _Task(
                line=line,
                name=cells["name"].strip(),
                cpu_milli=_int_cell(cells, "cpu_milli", where, line),
                memory_mib=_int_cell(cells, "memory_mib", where, line),
                num_gpu=_int_cell(cells, "num_gpu", where, line),
                gpu_milli=_int_cell(cells, "gpu_milli", where, line),
                gpu_models=tuple(m.strip() for m in spec.split("|") if m.strip()),
                qos=cells.get("qos", "").strip(),
                phase=cells.get("pod_phase", "").strip(),
                creation_s=_time_cell(cells, "creation_time", where, line),
                deletion_s=_time_cell(cells, "deletion_time", where, line),
                scheduled_s=_time_cell(cells, "scheduled_time", where, line),
            )
        )
    return tasks, timed


def _join_times(
    tasks: list[_Task], times_path: str | Path | None, path: str | Path, rng: random.Random
) -> tuple[list[_Task], int]:
    """Give a pod list without time columns the times of the same tasks in ``times_path``.

    Tasks not found there get an arrival and a duration drawn (seeded) from the joined ones: the
    arrival from all of them, the duration from those with the same GPU count (or all). Returns the
    tasks and how many were drawn.
    """
    source = Path(times_path) if times_path is not None else Path(path).with_name(ALIBABA_DEFAULT_FILE)
    if not source.is_file():
        raise WorkloadError(
            f"the file has no creation/deletion/scheduled times, and no times file {str(source)!r} "
            f"to take them from: put Alibaba's {ALIBABA_DEFAULT_FILE} beside it",
            path=str(path),
        )
    timed, has_times = _read_tasks(source)
    if not has_times:
        raise WorkloadError("the times file has no creation_time column", path=str(source))
    by_name = {t.name: t for t in timed}
    joined: list[_Task] = []
    orphans: list[_Task] = []
    for task in tasks:
        match = by_name.get(task.name)
        if match is None:
            orphans.append(task)
            continue
        joined.append(
            _replace_times(task, match.creation_s, match.deletion_s, match.scheduled_s),
        )
    pool = [t for t in joined if _duration(t) is not None]
    if orphans and not pool:
        raise WorkloadError("no task with valid times to draw missing times from", path=str(path))
    arrivals = sorted(t.creation_s for t in pool if t.creation_s is not None)
    durations: dict[int, list[float]] = {}
    for t in pool:
        durations.setdefault(t.num_gpu, []).append(_duration(t) or 0.0)
    everything = [d for ds in durations.values() for d in ds]
    for task in orphans:
        arrival = rng.choice(arrivals)
        duration = rng.choice(durations.get(task.num_gpu, everything))
        joined.append(_replace_times(task, arrival, arrival + duration, arrival))
    joined.sort(key=lambda t: t.line)
    return joined, len(orphans)


def _replace_times(
    task: _Task, creation: float | None, deletion: float | None, scheduled: float | None
) -> _Task:
    return _Task(
        line=task.line,
        name=task.name,
        cpu_milli=task.cpu_milli,
        memory_mib=task.memory_mib,
        num_gpu=task.num_gpu,
        gpu_milli=task.gpu_milli,
        gpu_models=task.gpu_models,
        qos=task.qos,
        phase=task.phase,
        creation_s=creation,
        deletion_s=deletion,
        scheduled_s=scheduled,
    )


def _duration(task: _Task) -> float | None:
    """Seconds the task ran: deletion - scheduled; None when it never ran or the times make no sense."""
    if task.scheduled_s is None or task.deletion_s is None:
        return None
    duration = task.deletion_s - task.scheduled_s
    return duration if duration > 0 else None


def _slowest_speed(models: Sequence[str], task_type: TaskType) -> float:
    """SCU of the slowest allowed model the library knows (1.0, the reference, when none is known)."""
    speeds = []
    for model in models:
        try:
            speeds.append(relative_speed(model, task_type))
        except UnknownGpuModelError:
            continue
    return min(speeds) if speeds else relative_speed(DEFAULT_REFERENCE_MODEL, task_type)


def _usable_tasks(
    tasks: Iterable[_Task],
    start_s: float,
    counts: Counter[str],
    absent: Counter[str],
    platform: frozenset[str],
) -> list[tuple[_Task, float]]:
    """The GPU tasks that ran and were created from ``start_s`` on, with their durations; ``counts``
    takes one count per skipped task, under its reason, and ``absent`` one per ``gpu_spec`` of a
    task skipped because it names only profiled models that ``platform`` (upper-case) lacks."""
    usable: list[tuple[_Task, float]] = []
    known = {m.upper() for m in library_models()}
    for task in tasks:
        wanted = [m.upper() for m in task.gpu_models]
        if task.num_gpu == 0 and task.gpu_milli == 0:
            counts["cpu_only"] += 1
        elif task.scheduled_s is None:
            counts["never_scheduled"] += 1
        elif (duration := _duration(task)) is None or task.creation_s is None:
            counts["no_duration"] += 1
        elif task.creation_s < start_s:
            counts["before_start"] += 1
        elif wanted and platform.isdisjoint(wanted) and known.issuperset(wanted):
            # A published trace run on a platform other than its own (the 63-GPU grid platform has
            # no G3): the task could never run there. A name no profile knows is left to
            # check_trace, which refuses it as a typo.
            counts["models_absent"] += 1
            absent["|".join(sorted({m.upper() for m in task.gpu_models}))] += 1
        else:
            usable.append((task, duration))
    return usable


def _platform_models(topology: Topology, models: Collection[str] | None) -> frozenset[str]:
    """The platform's GPU models, upper-case: ``models`` when given, else the topology's."""
    if models is None:
        models = {n.gpu_model for c in topology.clusters for n in c.nodes if n.gpu_model}
    return frozenset(m.upper() for m in models)


def load_alibaba(
    path: str | Path | None = None,
    *,
    topology: Topology | None = None,
    limit: int | None = None,
    seed: int = 0,
    time_scale: float = 1.0,
    arrival_scale: float = 1.0,
    times_path: str | Path | None = None,
    inference_qos: Iterable[str] = ("LS",),
    start_s: float = 0.0,
    models: Collection[str] | None = None,
) -> Trace:
    """The Alibaba GPU trace as a :class:`Trace` of ``batch`` jobs, in arrival order.

    ``path`` is an ``openb_pod_list_*.csv`` of alibaba/clusterdata ``cluster-trace-gpu-v2023``
    (``None``: the packaged sample of its first 2,000 GPU tasks). Lines starting with ``#`` are
    comments. How a row becomes a job:

    - **Which rows.** CPU-only tasks (``num_gpu == 0`` and ``gpu_milli == 0``) are skipped. A task
      that was never scheduled (no ``scheduled_time``: it was deleted while pending) is skipped: it
      never ran, so the trace does not say how much work it was. So is one whose ``deletion_time``
      is missing or not after its ``scheduled_time``. So is one whose ``gpu_spec`` names only
      profiled models the platform has none of (``models``, default ``topology``'s: a ``gpuspec``
      file run on a platform without its ``G3``; such a task could never run there; a name no
      profile knows is refused later, by :func:`check_trace`, as a typo). ``limit`` keeps the
      first ``limit`` GPU tasks (by arrival) that remain; ``start_s`` (trace seconds) skips tasks
      created before it (the trace's first tasks are long-running services created months before
      the rest). Every count is reported in ``Trace.source``.
    - **Arrival** = ``creation_time`` minus the first kept task's, times ``time_scale`` and
      ``arrival_scale`` (``arrival_scale`` < 1 packs arrivals closer: more load).
    - **GPUs.** ``num_gpu`` GPUs on one node (one worker). A task with ``num_gpu == 0`` but
      ``gpu_milli > 0``, or ``num_gpu == 1`` and ``gpu_milli < 1000``, shares a GPU in the trace;
      GPU sharing is not modelled, so it gets one whole GPU (counted as fractional in the source)
      and keeps its duration. ``gpu_spec`` (``|``-separated) gives the allowed models; empty: any.
      CPU and memory are the trace's.
    - **Work.** The trace measured a duration (``deletion_time - scheduled_time``) on whatever GPU
      the task got, and does not say which. The rule: it ran on the **slowest allowed model**
      (conservative: no task is given more work than the trace supports), so its work in
      reference-GPU seconds is ``duration x time_scale x SCU(that model, task type)``; an
      unconstrained task is assumed to have run on the reference V100M16 (SCU 1: work = duration).
      The simulator then divides by the SCU of the GPU it gets. Tasks still running when the trace
      was taken (``pod_phase`` Running) have their duration cut at the snapshot: a lower bound.
    - **Task type.** ``qos`` in ``inference_qos`` (default LS, "latency-sensitive", which the trace's
      paper describes as serving tasks) is ``inference``; others ``training_compute``. ``qos``,
      ``pod_phase`` and ``gpu_milli`` are kept as labels. Priority is 100 for all.
    - **Tenant** ``alibaba``; **home region** drawn (seeded) uniformly from the topology's regions.

    A pod list without time columns (``openb_pod_list_multigpu50.csv``) takes each task's times
    by name from ``times_path`` (default: ``openb_pod_list_default.csv`` beside it); tasks not
    found there get an arrival and duration drawn (seeded) from the found ones, counted in the
    source as resampled.
    """
    if not (time_scale > 0 and math.isfinite(time_scale)):
        raise WorkloadError(f"time_scale must be a positive number, got {time_scale}")
    if not (arrival_scale > 0 and math.isfinite(arrival_scale)):
        raise WorkloadError(f"arrival_scale must be a positive number, got {arrival_scale}")
    if limit is not None and limit < 0:
        raise WorkloadError(f"limit must not be negative, got {limit}")
    path = alibaba_sample_path() if path is None else Path(path)
    topology = topology if topology is not None else load_topology()
    regions = sorted(r.id for r in topology.regions)
    inference = frozenset(inference_qos)
    rng = random.Random(seed)

    tasks, timed = _read_tasks(path)
    resampled = 0
    if not timed:
        tasks, resampled = _join_times(tasks, times_path, path, rng)
    counts: Counter[str] = Counter()
    absent: Counter[str] = Counter()
    usable = _usable_tasks(tasks, start_s, counts, absent, _platform_models(topology, models))
    usable.sort(key=lambda td: (td[0].creation_s or 0.0, td[0].line))
    if limit is not None:
        counts["beyond_limit"] = max(len(usable) - limit, 0)
        usable = usable[:limit]

    jobs: list[SimJob] = []
    first = usable[0][0].creation_s or 0.0 if usable else 0.0
    first_line: dict[str, int] = {}
    for task, duration in usable:
        try:
            validate_id(task.name, "task name")
        except InvalidIdError as exc:
            raise WorkloadError(str(exc), path=str(path), line=task.line) from None
        if task.name in first_line:
            # Read on, the second was only rejected while the run went on; the generic format
            # refuses the same: each job needs its own id.
            raise WorkloadError(
                f"pod name {task.name!r} is given twice (first on line {first_line[task.name]})",
                path=str(path),
                line=task.line,
            )
        first_line[task.name] = task.line
        fractional = task.num_gpu == 0 or (task.num_gpu == 1 and 0 < task.gpu_milli < 1000)
        counts["fractional"] += fractional
        task_type: TaskType = "inference" if task.qos in inference else "training_compute"
        if not duration * time_scale <= MAX_JOB_S:
            counts["over_a_year"] += 1  # a broken row, not a measurement (1e300 s overflowed)
            continue
        work_s = duration * time_scale * _slowest_speed(task.gpu_models, task_type)
        steps = max(1, round(work_s / ALIBABA_STEP_S))
        labels = {"qos": task.qos, "phase": task.phase, "gpu_milli": str(task.gpu_milli)}
        try:
            spec = _pod_spec(task, task_type, steps, work_s, labels)
        except msgspec.ValidationError as exc:
            raise WorkloadError(_pod_words(str(exc)), path=str(path), line=task.line) from None
        arrival = ((task.creation_s or 0.0) - first) * time_scale * arrival_scale
        jobs.append(SimJob(spec, arrival, "batch", rng.choice(regions)))

    source = (
        f"{path.name}: {ALIBABA_CITATION}; {len(tasks)} rows, {len(jobs)} GPU tasks kept; skipped "
        f"{counts['cpu_only']} CPU-only, {counts['never_scheduled']} never scheduled, "
        f"{counts['no_duration']} without a valid duration, {counts['over_a_year']} running over a year, "
        f"{counts['models_absent']} needing GPU models the platform lacks"
        f"{' (' + ', '.join(f'{k}: {v}' for k, v in sorted(absent.items())) + ')' if absent else ''}, "
        f"{counts['before_start']} created before "
        f"start_s={start_s}, {counts['beyond_limit']} beyond the limit; "
        f"{counts['fractional']} fractional-GPU tasks given a whole GPU; {resampled} tasks' times "
        "resampled; work = duration x SCU of the slowest allowed model (V100M16 when unconstrained); "
        f"time_scale={time_scale}, arrival_scale={arrival_scale}, seed={seed}"
    )
    return Trace(jobs, source=source)


_POD_FIELDS: Final = {
    "$.resources.gpus": "num_gpu",
    "$.resources.cpu_milli": "cpu_milli",
    "$.resources.memory_mib": "memory_mib",
    "$.resources.gpu_models": "gpu_spec",
    "$.work.steps": "the run (deletion_time - scheduled_time)",
}


def _pod_words(error: str) -> str:
    """A pod's validation error in the pod list's own column names (it named ``$.resources.gpus``)."""
    for internal, column in _POD_FIELDS.items():
        error = error.replace(f"`{internal}`", column).replace(internal, column)
    return plain_words(error)


def _pod_spec(task: _Task, task_type: TaskType, steps: int, work_s: float, labels: dict[str, str]) -> JobSpec:
    return msgspec.convert(
        {
            "job_id": task.name,
            "tenant": ALIBABA_TENANT,
            "task_type": task_type,
            "resources": {
                "gpus": max(task.num_gpu, 1),
                "gpu_models": list(task.gpu_models),
                "cpu_milli": task.cpu_milli,
                "memory_mib": task.memory_mib,
            },
            "work": {"steps": steps, "step_time_s": work_s / steps},
            "labels": {k: v for k, v in labels.items() if v},
        },
        JobSpec,
    )


# ---- the generic format --------------------------------------------------------------------------

NonNegInt = Annotated[int, Meta(ge=0)]
PosInt = Annotated[int, Meta(ge=1)]
NonNegFloat = Annotated[float, Meta(ge=0)]
PosFloat = Annotated[float, Meta(gt=0)]
DataStart = Literal["after_sync", "while_syncing"]


class WorkloadRow(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    """One job of the generic workload format (a JSON-lines object or a CSV row).

    Only ``job_id``, ``arrival_s`` and the work are required. Work is either ``steps`` and
    ``step_time_s`` (seconds per step on one reference GPU), or ``gpu_seconds`` (reference-GPU
    seconds of the whole job over all its GPUs; cut into steps of :data:`DEFAULT_STEP_S` unless
    ``steps`` is given), or, for a pipeline, ``steps`` and ``layers`` (a step is then the layers'
    summed ``compute_s``). The README documents every field.
    """

    arrival_s: Annotated[float, Meta(ge=0, le=1e10)]
    job_id: str
    tenant: str = DEFAULT_TENANT
    name: str = ""
    job_class: JobClass = msgspec.field(default="batch", name="class")
    task_type: TaskType = "training_compute"
    priority: NonNegInt = 100
    preemptible: bool = True
    workers: PosInt = 1
    min_workers: PosInt | None = None
    gpus: PosInt = 1
    """GPUs per worker (on one node)."""
    gpu_models: list[str] = []
    gpu_memory_gib: NonNegFloat = 0.0
    cpu_milli: NonNegInt = 0
    memory_mib: NonNegInt = 0
    steps: PosInt | None = None
    step_time_s: PosFloat | None = None
    gpu_seconds: PosFloat | None = None
    checkpoint_every_steps: NonNegInt = 0
    bytes_per_step: NonNegInt | None = None
    rounds_per_step: NonNegInt | None = None
    dataset: str | None = None
    data_region: str | None = None
    data_size_gb: NonNegFloat | None = None
    data_start: DataStart = "after_sync"
    data_change_gb_per_hour: NonNegFloat = 0.0
    data_replicas: list[str] = []
    layers: list[Layer] = []
    max_stages: PosInt = 8
    affinity: Affinity | None = None
    labels: dict[str, str] = {}
    parents: list[str] = []
    home_region: str | None = None
    allow_multi_cluster: bool = False


class EventRow(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    """A scripted event in a JSON-lines workload: a line with an ``event`` field (its kind)."""

    event: EventKind
    at_s: Annotated[float, Meta(ge=0, le=1e10)]
    src: str = ""
    dst: str = ""
    cluster: str = ""
    region: str = ""
    rtt_factor: PosFloat = 1.0
    bandwidth_factor: PosFloat = 1.0
    factor: NonNegFloat = 1.0
    concurrency: Annotated[int, Meta(ge=1, le=MAX_DRAIN_CONCURRENCY)] = DRAIN_CONCURRENCY
    deadline_s: Annotated[float, Meta(ge=0, le=1e10)] = 0.0


_S = TypeVar("_S", bound=msgspec.Struct)
_LIST_COLUMNS = frozenset({"gpu_models", "parents", "data_replicas"})
_JSON_COLUMNS = frozenset({"layers", "affinity", "labels"})
COLUMNS: Final[tuple[str, ...]] = tuple(f.encode_name for f in msgspec.structs.fields(WorkloadRow))
"""The fields (and CSV columns) of the generic format, in order."""


def _work(row: WorkloadRow) -> tuple[int, float]:
    """(steps, seconds a step); a job over :data:`MAX_JOB_S` at the reference speed is refused
    here, in the row's own terms (an infinite ``gpu_seconds`` failed with an OverflowError, a huge
    one was told of ``$.work.steps``, a field the row did not give)."""
    if row.gpu_seconds is not None:
        if row.step_time_s is not None:
            raise ValueError("give either step_time_s (with steps) or gpu_seconds, not both")
        if not math.isfinite(row.gpu_seconds):
            raise ValueError(f"gpu_seconds must be a finite number of seconds, got {row.gpu_seconds}")
        wall_s = row.gpu_seconds / (row.gpus * row.workers)
        if not wall_s <= MAX_JOB_S:
            raise ValueError(
                _years(
                    row.job_id,
                    wall_s,
                    f"gpu_seconds {row.gpu_seconds:g} over {row.gpus * row.workers} GPU(s)",
                )
            )
        steps = row.steps or max(1, round(wall_s / DEFAULT_STEP_S))
        return steps, wall_s / steps
    if row.step_time_s is not None:
        if row.steps is None:
            raise ValueError("missing field `steps` (step_time_s is per step)")
        if not row.steps * row.step_time_s <= MAX_JOB_S:
            raise ValueError(
                _years(row.job_id, row.steps * row.step_time_s, f"{row.steps} steps of {row.step_time_s:g} s")
            )
        return row.steps, row.step_time_s
    if row.layers and row.steps is not None:
        return row.steps, sum(layer.compute_s for layer in row.layers)
    raise ValueError("missing work: give `steps` and `step_time_s`, or `gpu_seconds`")


def _years(job_id: str, seconds: float, work: str) -> str:
    """Why a job of ``seconds`` at the reference speed is refused (:data:`MAX_JOB_S`)."""
    return (
        f"job {job_id!r} runs {seconds / 86_400:,.0f} days at the reference speed ({work});"
        f" at most {MAX_JOB_S / 86_400:.0f}: a unit mistake (ms as s)?"
    )


def row_to_job(row: WorkloadRow) -> SimJob:
    """The job a row describes; ``ValueError`` (or ``msgspec.ValidationError``) says what is wrong."""
    steps, step_time_s = _work(row)
    data: dict[str, Any] | None = None
    if row.data_region is not None:
        if row.data_size_gb is None:
            raise ValueError("data_region needs data_size_gb")
        data = {
            "dataset": row.dataset if row.dataset is not None else row.job_id,
            "region": row.data_region,
            "size_gb": row.data_size_gb,
            "change_gb_per_hour": row.data_change_gb_per_hour,
            "start": row.data_start,
            "replicas": row.data_replicas,
        }
    elif row.data_size_gb is not None or row.dataset is not None or row.data_replicas:
        raise ValueError("dataset fields need data_region")
    comm = None
    if row.bytes_per_step is not None or row.rounds_per_step is not None:
        comm = {
            "bytes_per_step": row.bytes_per_step or 0,
            "rounds_per_step": 1 if row.rounds_per_step is None else row.rounds_per_step,
        }
    spec: dict[str, Any] = {
        "job_id": row.job_id,
        "tenant": row.tenant,
        "name": row.name,
        "task_type": row.task_type,
        "priority": row.priority,
        "workers": row.workers,
        "resources": {
            "gpus": row.gpus,
            "gpu_models": row.gpu_models,
            "cpu_milli": row.cpu_milli,
            "memory_mib": row.memory_mib,
            "gpu_memory_gib": row.gpu_memory_gib,
        },
        "work": {
            "steps": steps,
            "step_time_s": step_time_s,
            "checkpoint_every_steps": row.checkpoint_every_steps,
        },
        "labels": row.labels,
        "min_workers": row.min_workers,
        "preemptible": row.preemptible,
        "allow_multi_cluster": row.allow_multi_cluster,
        "comm": comm,
        "data": data,
        "affinity": msgspec.to_builtins(row.affinity or Affinity()),
        "pipeline": (
            {"layers": msgspec.to_builtins(row.layers), "max_stages": row.max_stages} if row.layers else None
        ),
    }
    job_spec = msgspec.convert(spec, JobSpec)
    if row.home_region is not None:
        validate_id(row.home_region, "home_region")
    for parent in row.parents:
        validate_id(parent, "parent")
    return SimJob(job_spec, row.arrival_s, row.job_class, row.home_region, tuple(row.parents))


def job_to_row(job: SimJob) -> WorkloadRow:
    """The row that reads back as ``job``; :class:`WorkloadError` if the format cannot hold it."""
    spec = job.spec
    if spec.stages:
        raise WorkloadError(
            f"job {spec.job_id!r} declares stages inside one spec, which the format does not hold; "
            "write each stage as a job with `parents`"
        )
    data = spec.data
    row = WorkloadRow(
        arrival_s=job.arrival_s,
        job_id=spec.job_id,
        tenant=spec.tenant,
        name=spec.name,
        job_class=job.job_class,
        task_type=spec.task_type,
        priority=spec.priority,
        preemptible=spec.preemptible,
        workers=spec.workers,
        min_workers=spec.min_workers,
        gpus=spec.resources.gpus,
        gpu_models=list(spec.resources.gpu_models),
        gpu_memory_gib=spec.resources.gpu_memory_gib,
        cpu_milli=spec.resources.cpu_milli,
        memory_mib=spec.resources.memory_mib,
        steps=spec.work.steps,
        step_time_s=spec.work.step_time_s,
        checkpoint_every_steps=spec.work.checkpoint_every_steps,
        bytes_per_step=spec.comm.bytes_per_step if spec.comm is not None else None,
        rounds_per_step=spec.comm.rounds_per_step if spec.comm is not None else None,
        dataset=data.dataset if data is not None else None,
        data_region=data.region if data is not None else None,
        data_size_gb=data.size_gb if data is not None else None,
        data_start=data.start if data is not None else "after_sync",
        data_change_gb_per_hour=data.change_gb_per_hour if data is not None else 0.0,
        data_replicas=list(data.replicas) if data is not None else [],
        layers=list(spec.pipeline.layers) if spec.pipeline is not None else [],
        max_stages=spec.pipeline.max_stages if spec.pipeline is not None else 8,
        affinity=spec.affinity if spec.affinity != Affinity() else None,
        labels=dict(spec.labels),
        parents=list(job.parents),
        home_region=job.home_region,
        allow_multi_cluster=spec.allow_multi_cluster,
    )
    return _with_defaults(row)


def _with_defaults(row: _S) -> _S:
    """``row`` with every value equal to its field's default replaced by the default itself, so
    ``omit_defaults`` leaves it out (it compares floats by identity: an equal 0.0 built elsewhere
    would still be written)."""
    same: dict[str, Any] = {}
    for f in msgspec.structs.fields(row):
        if f.default is not msgspec.NODEFAULT:
            default = f.default
        elif f.default_factory is not msgspec.NODEFAULT:
            default = f.default_factory()
        else:
            continue
        value = getattr(row, f.name)
        if value is not default and value == default:
            same[f.name] = default
    return msgspec.structs.replace(row, **same) if same else row


def _event_row(event: SimEvent) -> EventRow:
    row = EventRow(
        event=event.kind,
        at_s=event.at_s,
        src=event.src,
        dst=event.dst,
        cluster=event.cluster,
        region=event.region,
        rtt_factor=event.rtt_factor,
        bandwidth_factor=event.bandwidth_factor,
        factor=event.factor,
        concurrency=event.concurrency,
        deadline_s=event.deadline_s,
    )
    return _with_defaults(row)


def _event(row: EventRow) -> SimEvent:
    return SimEvent(
        at_s=row.at_s,
        kind=row.event,
        src=row.src,
        dst=row.dst,
        cluster=row.cluster,
        region=row.region,
        rtt_factor=row.rtt_factor,
        bandwidth_factor=row.bandwidth_factor,
        factor=row.factor,
        concurrency=row.concurrency,
        deadline_s=row.deadline_s,
    )


_LINK_EVENTS: Final = frozenset({"link_degrade", "link_restore"})
_CLUSTER_EVENTS: Final = frozenset({"cluster_down", "cluster_up", "cluster_drain", "cluster_undrain"})


def _event_problem(
    event: SimEvent, regions: Collection[str] | None, clusters: Collection[str] | None
) -> str | None:
    """What makes ``event`` a no-op the simulator would pass over silently, or None: a cluster
    event without a cluster, a link event naming no link or region, or (when they are known) a
    cluster or region that is not the platform's."""
    what = f"event {event.kind} at {event.at_s:g} s"
    if event.kind in _CLUSTER_EVENTS:
        if not event.cluster:
            return f"{what} names no cluster"
        if clusters is not None and event.cluster not in clusters:
            return f"{what}: unknown cluster {event.cluster!r}; known: {', '.join(sorted(clusters))}"
    if event.kind != "cluster_drain" and (event.concurrency != DRAIN_CONCURRENCY or event.deadline_s):
        return f"{what}: concurrency and deadline_s are a cluster_drain's"
    if event.kind in _LINK_EVENTS and not (event.region or event.src or event.dst):
        return f"{what} names no link (src and dst) or region"
    if regions is not None:
        for field_name in ("src", "dst", "region"):
            region = getattr(event, field_name)
            if region and region not in regions:
                return f"{what}: unknown {field_name} {region!r}; known: {', '.join(sorted(regions))}"
    return None


def check_events(
    trace: Trace, *, regions: Collection[str] | None = None, clusters: Collection[str] | None = None
) -> None:
    """:class:`WorkloadError` naming the first event of ``trace`` that would change nothing: a
    cluster event without a cluster, a link event without a link or region, or a cluster or region
    not among ``clusters`` / ``regions`` (a platform's; None: not checked). The JSON-lines loader
    checks its events so, naming the line."""
    for event in trace.events:
        problem = _event_problem(event, regions, clusters)
        if problem is not None:
            raise WorkloadError(problem)


MAX_JOB_S: Final = 365 * 86_400.0
"""The longest job a workload may hold (at its reference speed): one of years is a unit mistake
(milliseconds read as seconds), and the simulator would play it out for ever."""


def _parse(decode: Callable[[], WorkloadRow], where: str, line: int) -> SimJob:
    try:
        job = row_to_job(decode())
        _admissible(job)
        _not_years(job)
        _known_precision(job)
    except (msgspec.ValidationError, ValueError, InvalidInputError) as exc:
        raise WorkloadError(str(exc), path=where, line=line) from None
    return job


def _admissible(job: SimJob) -> None:
    """What placement refuses at admission (:func:`loom.sched.cycle.admission_check`: elastic
    bounds, a pipeline with workers, a reserved label, a bad DAG) raises
    :class:`InvalidInputError`: the simulator would otherwise run jobs the service rejects."""
    from loom.sched.cycle import admission_check  # noqa: PLC0415 - the scheduling core, on use

    admission_check(job.spec)


def _known_precision(job: SimJob) -> None:
    """A generic-format job whose ``labels.precision`` names no precision the speed tables know
    raises :class:`InvalidInputError`: ``int4`` or a typo was timed as fp32 without a word (an
    outside evaluator)."""
    value = job.spec.labels.get("precision")
    if value is not None and value.casefold() not in PRECISIONS:
        known = ", ".join(sorted(PRECISIONS))
        raise InvalidInputError(
            f"job {job.spec.job_id}: labels.precision {value!r} is none the speed tables know ({known})"
        )


def _not_years(job: SimJob) -> None:
    """A generic-format job longer than :data:`MAX_JOB_S` raises :class:`InvalidInputError` (a unit
    mistake, and the simulator would play it out for ever). Not applied to a public trace: its
    durations are measured, and one long job must not refuse the whole trace."""
    work = job.spec.work
    if work.steps * work.step_time_s > MAX_JOB_S:
        raise InvalidInputError(
            _years(
                job.spec.job_id,
                work.steps * work.step_time_s,
                f"{work.steps} steps of {work.step_time_s:g} s",
            )
        )


def _check_graph(jobs: Sequence[tuple[int, SimJob]], where: str) -> None:
    """Job ids are unique, every parent is a job of the file, and parents form no cycle."""
    line_of: dict[str, int] = {}
    for line, job in jobs:
        first = line_of.setdefault(job.spec.job_id, line)
        if first != line:
            raise WorkloadError(
                f"duplicate job_id {job.spec.job_id!r} (first on line {first})", path=where, line=line
            )
    parents = {job.spec.job_id: job.parents for _, job in jobs}
    for line, job in jobs:
        for parent in job.parents:
            if parent not in parents:
                raise WorkloadError(
                    f"parent {parent!r} of job {job.spec.job_id!r} never appears in the workload",
                    path=where,
                    line=line,
                )
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for root, root_parents in parents.items():
        if root in state:
            continue
        path = [root]
        iters: list[Iterator[str]] = [iter(root_parents)]
        state[root] = 1
        while iters:
            child = next(iters[-1], None)
            if child is None:
                state[path.pop()] = 2
                iters.pop()
                continue
            if state.get(child) == 1:
                cycle = [*path[path.index(child) :], child]
                raise WorkloadError(
                    f"parents form a cycle: {' -> '.join(cycle)} (each needs the next to finish first)",
                    path=where,
                    line=line_of[child],
                )
            if child not in state:
                state[child] = 1
                path.append(child)
                iters.append(iter(parents[child]))


def _unknown_region(job: SimJob, known: Collection[str]) -> str | None:
    """What is wrong with the regions ``job`` names (home, dataset, replicas), or None."""
    named = [("home_region", job.home_region)]
    if job.spec.data is not None:
        named.append(("data_region", job.spec.data.region))
        named += [("data_replicas", r) for r in job.spec.data.replicas]
    for field_name, region in named:
        if region is not None and region not in known:
            return (
                f"job {job.spec.job_id!r}: unknown {field_name} {region!r}; known: {', '.join(sorted(known))}"
            )
    return None


def _check_regions(jobs: Sequence[tuple[int, SimJob]], regions: Collection[str] | None, where: str) -> None:
    if regions is None:
        return
    known = frozenset(regions)
    for line, job in jobs:
        problem = _unknown_region(job, known)
        if problem is not None:
            raise WorkloadError(problem, path=where, line=line)


def check_regions(trace: Trace, regions: Collection[str]) -> None:
    """:class:`WorkloadError` naming the first job of ``trace`` whose home region, dataset region or
    replica is not one of ``regions`` (a platform's), and the regions that are known.

    The loaders check this when given the regions; a trace built in code, or read without them, is
    checked where it meets the platform (:func:`loom.sim.engine.simulate`)."""
    known = frozenset(regions)
    for job in trace.jobs:
        problem = _unknown_region(job, known)
        if problem is not None:
            raise WorkloadError(problem)


def check_trace(
    trace: Trace,
    *,
    where: str,
    regions: Collection[str] | None = None,
    clusters: Collection[str] | None = None,
    models: Collection[str] | None = None,
) -> None:
    """:class:`WorkloadError` for a workload that would simulate nothing or something other than
    what was meant: no job at all (an empty file, a header or comments only, events only, a public
    trace none of whose jobs can be replayed); a job the service would refuse at admission
    (:func:`_admissible`); a ``gpu_models`` name (in any case, as placement matches them) that
    neither the profile library nor the platform knows (``models``: the platform's), or that
    names only models the platform lacks (it could never run there), or an
    affinity naming a region or cluster the platform does not have (``regions`` / ``clusters``).
    Before, such a job was only counted rejected, so a typo quietly shrank the workload."""
    if not trace.jobs:
        events = f" ({len(trace.events)} event(s) only)" if trace.events else ""
        raise WorkloadError(f"no jobs to simulate{events}", path=where)
    known_models = {m.upper() for m in (*library_models(), *(models or ()))}  # matched as placement does
    for job in trace.jobs:
        try:
            _admissible(job)
            _known_precision(job)
        except InvalidInputError as exc:
            raise WorkloadError(str(exc), path=where) from None
        spec, name = job.spec, repr(job.spec.job_id)
        unknown = [m for m in spec.resources.gpu_models if m.upper() not in known_models]
        if unknown:
            raise WorkloadError(
                f"job {name}: unknown GPU model(s) {', '.join(map(repr, unknown))} in gpu_models;"
                f" known: {', '.join(sorted(known_models))}",
                path=where,
            )
        on_platform = {m.upper() for m in models} if models is not None else None
        wanted = spec.resources.gpu_models
        if on_platform is not None and wanted and not any(m.upper() in on_platform for m in wanted):
            # Placement waits for a cluster of those GPUs to join; the simulated platform never
            # changes, so the job stayed "unfinished" without a word (a newcomer's "A100", where
            # the packaged topologies name their A100s G2 and G3).
            raise WorkloadError(
                f"job {name}: no cluster of the platform has GPU model(s) {', '.join(map(repr, wanted))}"
                f" in gpu_models, so it could never run; the platform's: {', '.join(sorted(models or ()))}",
                path=where,
            )
        affinity = spec.affinity
        for field_name, named, known in (
            ("regions", affinity.regions, regions),
            ("avoid_regions", affinity.avoid_regions, regions),
            ("prefer_regions", affinity.prefer_regions, regions),
            ("clusters", affinity.clusters, clusters),
            ("avoid_clusters", affinity.avoid_clusters, clusters),
        ):
            missing = [n for n in named if known is not None and n not in known]
            if missing:
                raise WorkloadError(
                    f"job {name}: affinity {field_name} names {', '.join(map(repr, missing))}, not on"
                    f" the platform; known: {', '.join(sorted(known or ()))}",
                    path=where,
                )


_JSONL_SUFFIXES: Final = frozenset({".jsonl", ".ndjson", ".json"})


def _first_record(path: str | Path) -> tuple[int, str] | None:
    """The first line that is neither blank nor a comment, with its number."""
    try:
        with Path(path).open(encoding="utf-8-sig") as handle:
            for n, line in enumerate(handle, 1):
                if line.strip() and not line.startswith("#"):
                    return n, line
    except (OSError, UnicodeDecodeError) as exc:
        raise WorkloadError(f"cannot read: {exc}", path=str(path)) from exc
    return None


def load_workload(
    path: str | Path,
    *,
    regions: Collection[str] | None = None,
    topology: Topology | None = None,
    limit: int | None = None,
    seed: int = 0,
    trace_gpu: str | None = None,
    truth: Truth | None = None,
    start_s: float = 0.0,
    clusters: Collection[str] | None = None,
) -> Trace:
    """A workload file: a public trace as published, or the generic format.

    A public trace is told by its content, whatever its name
    (:func:`loom.sim.public_traces.sniff_format`: the Alibaba 2023 pod lists, Philly's
    ``cluster_job_log``, Helios / Acme job logs, PAI's task table) and read by
    :func:`loom.sim.public_traces.load_public` on ``topology`` (its regions draw home regions),
    keeping the first ``limit`` jobs from ``start_s`` on, with ``seed``, ``trace_gpu`` and ``truth`` (a
    :class:`~loom.sim.truth.Truth`: the GPU speeds turning measured durations into work).

    Otherwise the generic format, read by its name: ``.csv`` with :func:`load_csv`,
    ``.jsonl`` / ``.ndjson`` / ``.json`` with :func:`load_jsonl`, keeping its first ``limit`` jobs
    in arrival order (:func:`first_jobs`; ``seed``, ``start_s`` and ``trace_gpu`` do not apply).
    Any other name is read as JSON lines only when its first record is a JSON object; otherwise the
    format cannot be told (a CSV header is not recognisable for sure) and :class:`WorkloadError`
    asks for a ``.jsonl`` or ``.csv`` name. A ``.csv`` whose first record is a JSON object is
    refused too (a JSON-lines file misnamed). ``regions`` and ``clusters`` as for
    :func:`load_jsonl` (``clusters`` None: the clusters of ``topology`` when given).
    """
    from loom.sim import public_traces  # noqa: PLC0415 - it imports this module

    fmt = public_traces.sniff_format(path)
    if fmt is not None:
        return public_traces.load_public(
            path,
            fmt,
            topology=topology,
            limit=limit,
            seed=seed,
            start_s=start_s,
            trace_gpu=trace_gpu,
            truth=truth,
        )
    suffix = Path(path).suffix.lower()
    first = _first_record(path)
    looks_json = first is not None and first[1].lstrip().startswith("{")
    if suffix == ".csv":
        if looks_json and first is not None:
            raise WorkloadError(
                "named .csv but the line is a JSON object; name a JSON-lines workload .jsonl",
                path=str(path),
                line=first[0],
            )
        return first_jobs(load_csv(path, regions=regions), limit)
    if suffix in _JSONL_SUFFIXES or looks_json:
        if clusters is None and topology is not None:
            clusters = {c.id for c in topology.clusters}
        return first_jobs(load_jsonl(path, regions=regions, clusters=clusters), limit)
    raise WorkloadError(
        f"cannot tell the format of a {suffix or 'nameless'} file (JSON lines or CSV):"
        " name it .jsonl or .csv",
        path=str(path),
    )


def first_jobs(trace: Trace, limit: int | None) -> Trace:
    """``trace`` cut to its first ``limit`` jobs in arrival order (None: all), as ``--jobs`` cuts a
    public trace. A kept job whose parent was cut goes too (it would never be submitted), and so
    do its own children; events are kept. ``Trace.source`` says what was kept.
    :class:`WorkloadError` for a ``limit`` below 1."""
    if limit is not None and limit < 1:
        raise WorkloadError(f"limit must be at least 1 job, got {limit}")
    if limit is None or limit >= len(trace.jobs):
        return trace
    kept = trace.jobs[:limit]
    while True:  # dropping a job may orphan its children in turn (a parent may arrive after a child)
        ids = {job.spec.job_id for job in kept}
        keep = [job for job in kept if all(p in ids for p in job.parents)]
        if len(keep) == len(kept):
            break
        kept = keep
    orphans = limit - len(kept)
    note = f"; first {limit} of {len(trace.jobs)} jobs by arrival kept (limit)"
    if orphans:
        note += f", {orphans} of them dropped: a parent was cut"
    return Trace(kept, list(trace.events), trace.source + note)


def load_jsonl(
    path: str | Path, *, regions: Collection[str] | None = None, clusters: Collection[str] | None = None
) -> Trace:
    """Read a JSON-lines workload: one job (or, with an ``event`` field, one event) per line.

    Blank lines and lines starting with ``#`` are skipped; the first ``# source: ...`` comment
    becomes ``Trace.source``. Raises :class:`WorkloadError` naming the line for malformed JSON, an
    unknown or missing field, a value out of range (negative numbers), a duplicate job id, a
    parent that never appears, parents that form a cycle, or an event that would change nothing
    (a cluster event without a cluster, a link event without a link or region). With ``regions``
    (the platform's topology), also for a ``home_region``, ``data_region`` or ``data_replicas``, or
    an event's ``src``, ``dst`` or ``region``, not among them; with ``clusters`` (the platform's),
    for an event's ``cluster`` not among them.
    """
    where = str(path)
    jobs: list[tuple[int, SimJob]] = []
    events: list[SimEvent] = []
    for line, text in _read_lines(path):
        try:
            obj = msgspec.json.decode(text)
        except msgspec.DecodeError as exc:
            raise WorkloadError(f"malformed JSON: {exc}", path=where, line=line) from None
        if not isinstance(obj, dict):
            raise WorkloadError("expected a JSON object", path=where, line=line)
        if "event" in obj:
            try:
                event = _event(msgspec.convert(obj, EventRow))
            except (msgspec.ValidationError, EventError) as exc:
                raise WorkloadError(str(exc), path=where, line=line) from None
            problem = _event_problem(event, regions, clusters)
            if problem is not None:
                raise WorkloadError(problem, path=where, line=line)
            events.append(event)
            continue
        jobs.append((line, _parse(functools.partial(msgspec.convert, obj, WorkloadRow), where, line)))
    _check_graph(jobs, where)
    _check_regions(jobs, regions, where)
    return Trace([job for _, job in jobs], events, _source_comment(path) or f"jsonl: {Path(path).name}")


def load_csv(path: str | Path, *, regions: Collection[str] | None = None) -> Trace:
    """Read a CSV workload: a header of :data:`COLUMNS` (any subset, any order), one job per row.

    An empty cell is an absent field. ``gpu_models``, ``parents`` and ``data_replicas`` are
    ``|``-separated; ``layers``, ``affinity`` and ``labels`` are JSON. Errors and checks
    (``regions`` included) as :func:`load_jsonl` (events are JSON-lines only). Comments (lines
    starting with ``#``, the first ``# source: ...`` one becoming ``Trace.source``) come only
    before the header: after it every line is part of a row, parsed by :mod:`csv` over the whole
    file (a quoted cell may span lines; a row whose first cell starts with ``#`` is a row).
    """
    where = str(path)
    header, records, header_line = _csv_records(path)
    unknown = [c for c in header if c not in COLUMNS]
    if unknown:
        raise WorkloadError(f"unknown column {', '.join(map(repr, unknown))}", path=where, line=header_line)
    jobs: list[tuple[int, SimJob]] = []
    for line, cells in records:
        obj: dict[str, Any] = {}
        for column, cell in cells.items():
            if cell == "":
                continue
            if column in _LIST_COLUMNS:
                obj[column] = [part for part in cell.split("|") if part]
            elif column in _JSON_COLUMNS:
                try:
                    obj[column] = json.loads(cell)
                except json.JSONDecodeError as exc:
                    raise WorkloadError(f"{column} is not JSON: {exc}", path=where, line=line) from None
            else:
                obj[column] = cell
        decode = functools.partial(msgspec.convert, obj, WorkloadRow, strict=False)
        jobs.append((line, _parse(decode, where, line)))
    _check_graph(jobs, where)
    _check_regions(jobs, regions, where)
    source = _source_comment(path, preamble_only=True) or f"csv: {Path(path).name}"
    return Trace([job for _, job in jobs], [], source)


def _source_line(trace: Trace) -> str:
    return f"# source: {' '.join(trace.source.split())}\n" if trace.source else ""


def write_jsonl(trace: Trace, path: str | Path) -> None:
    """Write ``trace`` so that :func:`load_jsonl` reads back an equal one (jobs, events, source)."""
    encoder = msgspec.json.Encoder()
    with Path(path).open("w", encoding="utf-8") as handle:
        handle.write(_source_line(trace))
        for job in trace.jobs:
            handle.write(encoder.encode(job_to_row(job)).decode() + "\n")
        for event in trace.events:
            handle.write(encoder.encode(_event_row(event)).decode() + "\n")


def write_csv(trace: Trace, path: str | Path) -> None:
    """Write the jobs of ``trace`` as CSV with every column (events need JSON lines: refused)."""
    if trace.events:
        raise WorkloadError("CSV holds jobs only; write a trace with events as JSON lines")
    with Path(path).open("w", encoding="utf-8", newline="") as handle:
        handle.write(_source_line(trace))
        writer = csv.writer(handle, lineterminator="\n")
        writer.writerow(COLUMNS)
        for job in trace.jobs:
            row = msgspec.to_builtins(job_to_row(job))
            writer.writerow(_cell(column, row.get(column)) for column in COLUMNS)


def _cell(column: str, value: Any) -> str:
    if value is None:
        return ""
    if column in _LIST_COLUMNS:
        return "|".join(value)
    if column in _JSON_COLUMNS:
        return json.dumps(value, separators=(",", ":"), sort_keys=True)
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


# ---- the training mix ----------------------------------------------------------------------------

MixClass = Literal["net_training", "training", "inference", "pipeline", "dag"]
MIX_CLASSES: Final[tuple[MixClass, ...]] = get_args(MixClass)

DEFAULT_MIX: Final[Mapping[MixClass, float]] = {
    "net_training": 0.35,
    "training": 0.25,
    "inference": 0.15,
    "pipeline": 0.10,
    "dag": 0.15,
}
"""Share of workload units per class. Network-sensitive distributed training is the largest share
because it is what the network model is about; the rest keep every other class present so that
"no other class gets worse" is measured on real numbers of jobs. A ``dag`` unit is three jobs."""

DEFAULT_TENANTS: Final = ("team-a", "team-b", "team-c", "team-d")

DEFAULT_ARRIVAL_RATE_PER_H: Final = 300.0
"""Workload units arriving per hour by default. On the default platform (6,212 GPUs) this keeps it
busy while jobs arrive: gangs queue now and then, and a policy that ignores the network has to
spread some of them over regions. At 60 or 150 per hour nothing waits and no gang needs more than
one cluster, so the network is hardly at stake (the load sweep is in the simulator's README).
``loom bench policies --rate`` replays other loads."""


@dataclass(frozen=True, slots=True)
class _Context:
    rng: random.Random
    regions: tuple[str, ...]
    data_fraction: float
    data_home_share: float
    multi_cluster_min_gpus: int


def _log_uniform(rng: random.Random, low: float, high: float) -> float:
    return math.exp(rng.uniform(math.log(low), math.log(high)))


def _steps(duration_s: float, step_time_s: float) -> int:
    return max(1, round(duration_s / step_time_s))


def _dataset(ctx: _Context, dataset: str, home: str, low_gb: float, high_gb: float) -> DataSpec:
    region = home if ctx.rng.random() < ctx.data_home_share else ctx.rng.choice(ctx.regions)
    return DataSpec(dataset=dataset, region=region, size_gb=round(_log_uniform(ctx.rng, low_gb, high_gb), 1))


def _gpu_memory_gib(params: float) -> float:
    """Device memory of one data-parallel replica: training state plus a quarter for activations."""
    return float(math.ceil(params * TRAINING_STATE_BYTES_PER_PARAM * 1.25 / 2**30))


def _net_spec(
    ctx: _Context, job_id: str, *, tenant: str, model: ModelSpec, workers: int, gpus: int, duration_s: float
) -> JobSpec:
    return JobSpec(
        job_id=job_id,
        tenant=tenant,
        name=model.name,
        task_type=model.task_type,
        workers=workers,
        resources=_resources(gpus, _gpu_memory_gib(model.params)),
        work=_work_of(duration_s, model.step_time_s),
        comm=Communication(
            bytes_per_step=int(model.params * BYTES_PER_PARAM_FP16), rounds_per_step=ALLREDUCE_ROUNDS
        ),
        allow_multi_cluster=workers * gpus >= ctx.multi_cluster_min_gpus,
        # Mixed precision, as the fp16 gradients above say: its speed is the SCU's fp16 one.
        labels={"model": model.name, "precision": "fp16"},
    )


def _resources(gpus: int, gpu_memory_gib: float = 0.0) -> Resources:
    return Resources(gpus=gpus, gpu_memory_gib=gpu_memory_gib)


def _work_of(duration_s: float, step_time_s: float) -> Work:
    return Work(steps=_steps(duration_s, step_time_s), step_time_s=step_time_s)


def _net_training(ctx: _Context, uid: str, arrival: float, home: str, tenant: str) -> list[SimJob]:
    rng = ctx.rng
    model = net_model(rng.choice(NET_MODELS))
    workers, gpus = rng.choice((2, 4, 8, 16)), rng.choice((1, 2, 4, 8))
    spec = _net_spec(
        ctx,
        uid,
        tenant=tenant,
        model=model,
        workers=workers,
        gpus=gpus,
        duration_s=_log_uniform(rng, 1800, 8 * 3600),
    )
    if rng.random() < ctx.data_fraction:
        spec = msgspec.structs.replace(spec, data=_dataset(ctx, f"{uid}-data", home, 10, 2000))
    return [SimJob(spec, arrival, "net_training", home)]


def _training(ctx: _Context, uid: str, arrival: float, home: str, tenant: str) -> list[SimJob]:
    rng = ctx.rng
    job_type = rng.choice(sorted(TRAINING_MODELS))
    step = _gavel(job_type)
    spec = JobSpec(
        job_id=uid,
        tenant=tenant,
        name=job_type,
        task_type=TRAINING_MODELS[job_type],
        resources=_resources(rng.choice((1, 1, 1, 2, 4, 8))),
        work=_work_of(_log_uniform(rng, 900, 8 * 3600), step),
        labels={"model": job_type.split(" (")[0]},
    )
    if rng.random() < ctx.data_fraction:
        spec = msgspec.structs.replace(spec, data=_dataset(ctx, f"{uid}-data", home, 10, 2000))
    return [SimJob(spec, arrival, "training", home)]


_INFERENCE_MODELS = ("resnet50", "transformer-base", "bert-base", "bert-large")


def _inference_spec(
    uid: str, *, tenant: str, model: ModelSpec, workers: int, duration_s: float, home: str
) -> JobSpec:
    step = model.step_time_s * FORWARD_SHARE
    return JobSpec(
        job_id=uid,
        tenant=tenant,
        name=f"{model.name}-serving",
        task_type="inference",
        workers=workers,
        resources=_resources(1),
        work=_work_of(duration_s, step),
        affinity=Affinity(prefer_regions=[home]),
        labels={"model": model.name},
    )


def _inference(ctx: _Context, uid: str, arrival: float, home: str, tenant: str) -> list[SimJob]:
    rng = ctx.rng
    model = net_model(rng.choice(_INFERENCE_MODELS))
    spec = _inference_spec(
        uid,
        tenant=tenant,
        model=model,
        workers=rng.choice((1, 1, 2, 4)),
        duration_s=_log_uniform(rng, 1800, 6 * 3600),
        home=home,
    )
    return [SimJob(spec, arrival, "inference", home)]


PIPELINE_TOKENS_PER_STEP: Final = 4096
"""Tokens per pipeline step (e.g. 8 sequences of 512)."""


def pipeline_layers(layers: int, hidden: int) -> list[Layer]:
    """Transformer layers of width ``hidden``: compute, memory and activations per layer.

    A layer holds ``12 x hidden^2`` parameters; its step on one reference GPU is Gavel's measured
    Transformer step scaled by that over the Transformer base's 65M; its memory is the training
    state (:data:`TRAINING_STATE_BYTES_PER_PARAM`) plus activations
    (:data:`ACTIVATION_BYTES_PER_TOKEN_HIDDEN` per token and hidden unit); it sends its output
    forward and the gradient back, fp16: ``2 x tokens x hidden x 2`` bytes.
    """
    params = 12 * hidden * hidden
    compute_s = _gavel(_TRANSFORMER_JOB) * params / _TRANSFORMER_PARAMS
    memory_gib = (
        params * TRAINING_STATE_BYTES_PER_PARAM
        + PIPELINE_TOKENS_PER_STEP * hidden * ACTIVATION_BYTES_PER_TOKEN_HIDDEN
    ) / 2**30
    activation_mb = 2 * PIPELINE_TOKENS_PER_STEP * hidden * 2 / 1e6
    return [
        Layer(
            name=f"layer{i}",
            compute_s=compute_s,
            memory_gib=round(memory_gib, 3),
            activation_mb=activation_mb,
        )
        for i in range(layers)
    ]


def _pipeline(ctx: _Context, uid: str, arrival: float, home: str, tenant: str) -> list[SimJob]:
    rng = ctx.rng
    hidden = rng.choice((2048, 4096, 5120))
    layers = pipeline_layers(rng.randint(24, 96), hidden)
    step_s = sum(layer.compute_s for layer in layers)
    memory = sum(layer.memory_gib for layer in layers)
    reference_gpus = math.ceil(memory / (16.0 * DEFAULT_USABLE_FRACTION))
    duration_s = _log_uniform(rng, 3600, 12 * 3600)
    spec = JobSpec(
        job_id=uid,
        tenant=tenant,
        name=f"transformer-{len(layers)}x{hidden}",
        work=Work(steps=max(1, round(duration_s * reference_gpus / step_s)), step_time_s=step_s),
        pipeline=Pipeline(layers=layers),
        allow_multi_cluster=True,
        labels={"model": f"transformer-h{hidden}"},
    )
    return [SimJob(spec, arrival, "pipeline", home)]


def _dag(ctx: _Context, uid: str, arrival: float, home: str, tenant: str) -> list[SimJob]:
    """Preprocess -> train -> validate, one job each, linked by ``parents``; all arrive with the DAG
    (a stage is submitted when its parent completes, so the last stage's JCT is the DAG's)."""
    rng = ctx.rng
    labels = {"dag": uid}
    prep = JobSpec(
        job_id=f"{uid}-prep",
        tenant=tenant,
        name="preprocess",
        task_type="training_memory",
        resources=_resources(rng.choice((1, 2))),
        work=Work(steps=_steps(_log_uniform(rng, 900, 2 * 3600), 1.0), step_time_s=1.0),
        data=_dataset(ctx, f"{uid}-raw", home, 50, 1000),
        labels={**labels, "stage": "prep"},
    )
    model = net_model(rng.choice(NET_MODELS[:3]))
    train = _net_spec(
        ctx,
        f"{uid}-train",
        tenant=tenant,
        model=model,
        workers=rng.choice((2, 4, 8)),
        gpus=rng.choice((1, 2, 4)),
        duration_s=_log_uniform(rng, 1800, 4 * 3600),
    )
    train = msgspec.structs.replace(train, labels={**labels, "stage": "train", "model": model.name})
    val = _inference_spec(
        f"{uid}-val",
        tenant=tenant,
        model=model,
        workers=1,
        duration_s=_log_uniform(rng, 300, 1800),
        home=home,
    )
    val = msgspec.structs.replace(
        val, name="validate", labels={**labels, "stage": "val", "model": model.name}
    )
    return [
        SimJob(prep, arrival, "dag", home),
        SimJob(train, arrival, "dag", home, (prep.job_id,)),
        SimJob(val, arrival, "dag", home, (train.job_id,)),
    ]


_GENERATORS: Final[Mapping[MixClass, Callable[[_Context, str, float, str, str], list[SimJob]]]] = {
    "net_training": _net_training,
    "training": _training,
    "inference": _inference,
    "pipeline": _pipeline,
    "dag": _dag,
}
_PREFIX: Final[Mapping[MixClass, str]] = {
    "net_training": "net",
    "training": "train",
    "inference": "inf",
    "pipeline": "pipe",
    "dag": "dag",
}


def apportion(total: int, shares: Mapping[MixClass, float]) -> dict[MixClass, int]:
    """Whole counts summing to ``total`` in proportion to ``shares`` (largest remainder; ties in
    :data:`MIX_CLASSES` order)."""
    weight = sum(shares.values())
    quotas = {c: total * shares.get(c, 0.0) / weight for c in MIX_CLASSES}
    counts = {c: math.floor(q) for c, q in quotas.items()}
    left = total - sum(counts.values())
    for c in sorted(MIX_CLASSES, key=lambda c: (-(quotas[c] - counts[c]), MIX_CLASSES.index(c)))[:left]:
        counts[c] += 1
    return counts


def training_mix(
    *,
    topology: Topology | None = None,
    jobs: int = 1000,
    seed: int = 0,
    arrival_rate_per_h: float = DEFAULT_ARRIVAL_RATE_PER_H,
    mix: Mapping[str, float] | None = None,
    data_fraction: float = 0.5,
    data_home_share: float = 0.5,
    multi_cluster_min_gpus: int = 32,
    tenants: Sequence[str] = DEFAULT_TENANTS,
) -> Trace:
    """A seeded mix of ``jobs`` workload units (a DAG unit is three jobs), Poisson arrivals.

    Classes (proportions ``mix``, default :data:`DEFAULT_MIX`; counts are exact by largest
    remainder, their order shuffled):

    - ``net_training``: data-parallel gangs of 2-16 workers x 1-8 GPUs training one of
      :data:`NET_MODELS` (25M-1.5B parameters), 0.5-8 h of reference compute. Each step all-reduces
      the gradients: ``bytes_per_step = parameters x 2`` (fp16); the ring all-reduce's factor of 2
      (each worker sends and receives about twice the gradient) is applied by the network model
      (:func:`loom.sched.plugins.network.allreduce_s`), not here. ``rounds_per_step = 2``. Gangs of
      at least ``multi_cluster_min_gpus`` GPUs may span clusters. A replica needs the training
      state plus a quarter in device memory (``gpu_memory_gib``).
    - ``training``: one node, 1-8 GPUs, a Gavel job type with its measured V100 step time and task
      type, 0.25-8 h.
    - ``inference``: a service of 1-4 replicas x 1 GPU, forward-only steps (a third of the model's
      training step), 0.5-6 h, preferring its home region (its users): the network model adds the
      users' round trip to every step.
    - ``pipeline``: a transformer of 24-96 layers, hidden 2048/4096/5120 (:func:`pipeline_layers`),
      too big for one 16 GiB GPU, that placement may cut into stages across clusters; 1-12 h on
      as many reference GPUs as its memory needs.
    - ``dag``: preprocess (memory-bound, 1-2 GPUs, reads a 50-1000 GB raw dataset) -> train (a
      data-parallel gang of a small model) -> validate (one inference GPU near home), three jobs
      linked by ``parents``, labelled ``dag=<id>``.

    Durations are log-uniform in the ranges given. ``data_fraction`` of ``net_training`` and
    ``training`` jobs read a dataset (10-2000 GB), placed in the job's home region with
    probability ``data_home_share``, else in a random region. Home regions are uniform over the
    topology's regions, tenants uniform over ``tenants``.
    """
    shares = dict(DEFAULT_MIX) if mix is None else _check_mix(mix)
    if jobs < 0:
        raise WorkloadError(f"jobs must not be negative, got {jobs}")
    if not (arrival_rate_per_h > 0 and math.isfinite(arrival_rate_per_h)):
        raise WorkloadError(f"arrival_rate_per_h must be a positive number, got {arrival_rate_per_h}")
    for name, share in (("data_fraction", data_fraction), ("data_home_share", data_home_share)):
        if not 0 <= share <= 1:
            raise WorkloadError(f"{name} must be within [0, 1], got {share}")
    if not tenants:
        raise WorkloadError("tenants must not be empty")
    topology = topology if topology is not None else load_topology()
    rng = random.Random(seed)
    ctx = _Context(
        rng,
        tuple(sorted(r.id for r in topology.regions)),
        data_fraction,
        data_home_share,
        multi_cluster_min_gpus,
    )
    counts = apportion(jobs, shares)
    order = [c for c in MIX_CLASSES for _ in range(counts[c])]
    rng.shuffle(order)
    width = max(5, len(str(max(jobs - 1, 0))))
    out: list[SimJob] = []
    arrival = 0.0
    for i, job_class in enumerate(order):
        home = rng.choice(ctx.regions)
        tenant = rng.choice(tuple(tenants))
        out.extend(_GENERATORS[job_class](ctx, f"{_PREFIX[job_class]}-{i:0{width}d}", arrival, home, tenant))
        arrival += rng.expovariate(arrival_rate_per_h / 3600.0)
    mix_text = ", ".join(f"{c} {shares.get(c, 0.0):g}" for c in MIX_CLASSES)
    source = (
        f"training_mix(jobs={jobs}, seed={seed}, arrival_rate_per_h={arrival_rate_per_h}, mix: {mix_text}; "
        f"data_fraction={data_fraction}, data_home_share={data_home_share}, "
        f"multi_cluster_min_gpus={multi_cluster_min_gpus}); reference step times from Gavel's V100 "
        "throughputs (stanford-futuredata/gavel @ c4fa4009), larger models scaled by parameters"
    )
    return Trace(out, source=source)


def _check_mix(mix: Mapping[str, float]) -> dict[MixClass, float]:
    shares: dict[MixClass, float] = {}
    for name, share in mix.items():
        known = next((c for c in MIX_CLASSES if c == name), None)
        if known is None:
            raise WorkloadError(f"unknown class {name!r} in mix; known: {', '.join(MIX_CLASSES)}")
        if not (share >= 0 and math.isfinite(share)):
            raise WorkloadError(f"share of {name!r} must be a number >= 0, got {share}")
        shares[known] = float(share)
    if sum(shares.values()) <= 0:
        raise WorkloadError("mix shares sum to 0")
    return shares


# ---- a Philly-like trace, and shaping a trace for the evaluation grid -------------------------------

PHILLY_GANG_SIZES: Final[Mapping[int, float]] = {1: 0.70, 2: 0.10, 4: 0.10, 8: 0.07, 16: 0.03}
"""Share of jobs per GPU count in :func:`philly_like`: most jobs take one GPU, a tail 8-16. Read
from Jeon et al., "Analysis of Large-Scale Multi-Tenant GPU Clusters for DNN Training Workloads"
(USENIX ATC 2019), which groups Philly's jobs as 1, 2-4, 5-8 and more than 8 GPUs with single-GPU
jobs the large majority; the shares within groups are our choice (powers of two)."""

PHILLY_MEDIAN_S: Final = 3600.0
PHILLY_SIGMA: Final = 1.8
PHILLY_MIN_S: Final = 60.0
PHILLY_MAX_S: Final = 7 * 86_400.0
"""Durations of :func:`philly_like` on reference GPUs: log-normal, median 1 h, sigma 1.8 (mean
about 5 h; the top 1 % over 2 days), cut to 1 min - 7 days. Jeon et al. report run times from
minutes to weeks, heavy-tailed, with larger jobs running longer; these figures approximate their
distributions, they are not fitted to the raw trace (which is not in ``shared/data``)."""

PHILLY_LARGER_RUN_LONGER: Final = 0.25
"""Log-duration added per doubling of the GPU count (Jeon et al.: larger jobs run longer)."""

PHILLY_FAMILIES: Final[Mapping[str, tuple[float, str | None]]] = {
    # family (as the truth tables name it): (parameters, Gavel job type timing it on a V100 or None)
    "resnet-18": (11.7e6, "ResNet-18 (batch size 64)"),
    "resnet-50": (25.6e6, "ResNet-50 (batch size 64)"),
    "transformer": (_TRANSFORMER_PARAMS, _TRANSFORMER_JOB),
    "bert-base": (110e6, None),
    "bert-large": (340e6, None),
    "transformer-xl-base": (151e6, None),
    "lm": (66e6, "LM (batch size 20)"),
    "recommendation": (31e6, "Recommendation (batch size 2048)"),
    "cyclegan": (28e6, "CycleGAN"),
    "a3c": (4e6, "A3C"),
}
"""Model families of :func:`philly_like`, all known to the packaged truth tables. Parameter counts
are approximate (papers' figures) and only set the bytes a multi-node gang all-reduces; a step
without a Gavel measurement is Transformer's x parameters / 65M (an estimate)."""


def family_step_s(family: str) -> tuple[float, float]:
    """(parameters, V100 step time in s) of one of :data:`PHILLY_FAMILIES`: Gavel's measured step,
    or Transformer's scaled by parameters where Gavel did not measure the family."""
    try:
        params, gavel_job = PHILLY_FAMILIES[family]
    except KeyError:
        raise WorkloadError(
            f"unknown family {family!r}; known: {', '.join(sorted(PHILLY_FAMILIES))}"
        ) from None
    return params, (
        _gavel(gavel_job) if gavel_job else _gavel(_TRANSFORMER_JOB) * params / _TRANSFORMER_PARAMS
    )


def philly_like(
    jobs: int,
    seed: int = 0,
    *,
    topology: Topology | None = None,
    arrival_rate_per_h: float = 60.0,
    gang_sizes: Mapping[int, float] | None = None,
    tenants: Sequence[str] = DEFAULT_TENANTS,
) -> Trace:
    """A seeded synthetic trace shaped like Microsoft's Philly cluster (Jeon et al., ATC 2019).

    - **GPUs**: drawn from ``gang_sizes`` (default :data:`PHILLY_GANG_SIZES`: 1 GPU for most jobs,
      a tail of 8-16). 1-8 GPUs are one worker on one node; 8 GPUs are 2 workers x 4 one time in
      three; 16 GPUs are 2 x 8 or 4 x 4 (Philly ran jobs over 8 GPUs on several servers).
    - **Durations** on reference GPUs: log-normal (:data:`PHILLY_MEDIAN_S`, :data:`PHILLY_SIGMA`),
      plus :data:`PHILLY_LARGER_RUN_LONGER` per doubling of GPUs, cut to 1 min - 7 days.
    - **Models**: a family of :data:`PHILLY_FAMILIES` (labels ``family``), uniformly; its task type is
      the truth table's. Steps of its V100 step time (Gavel's, or estimated).
    - **Communication**: gangs of several workers all-reduce ``parameters x 2`` bytes per step
      (fp16 gradients), two rounds; they are ``net_training``, single workers ``training``.
      ``allow_multi_cluster`` is False (the grid sets it: :func:`with_spanning`).
    - **Arrivals**: Poisson at ``arrival_rate_per_h`` (re-spaced for a load by :func:`at_load`).
      Home regions uniform over the topology's, tenants uniform over ``tenants``.
    """
    if jobs < 0:
        raise WorkloadError(f"jobs must not be negative, got {jobs}")
    if not (arrival_rate_per_h > 0 and math.isfinite(arrival_rate_per_h)):
        raise WorkloadError(f"arrival_rate_per_h must be a positive number, got {arrival_rate_per_h}")
    sizes = dict(PHILLY_GANG_SIZES if gang_sizes is None else gang_sizes)
    if not sizes or any(g < 1 or w < 0 for g, w in sizes.items()) or sum(sizes.values()) <= 0:
        raise WorkloadError(f"gang_sizes must map GPU counts >= 1 to non-negative weights, got {sizes}")
    task_types = load_truth().task_types
    topology = topology if topology is not None else load_topology()
    regions = sorted(r.id for r in topology.regions)
    rng = random.Random(seed)
    families = sorted(PHILLY_FAMILIES)
    counts, weights = list(sizes), list(sizes.values())
    width = max(5, len(str(max(jobs - 1, 0))))
    out: list[SimJob] = []
    arrival = 0.0
    for i in range(jobs):
        arrival += rng.expovariate(arrival_rate_per_h / 3600.0)
        total = rng.choices(counts, weights)[0]
        workers, gpus = 1, total
        if total > 8 or (total == 8 and rng.random() < 1 / 3):
            workers = total // 8 if total > 8 and rng.random() < 0.5 else total // 4
            gpus = total // workers
        log_s = rng.gauss(math.log(PHILLY_MEDIAN_S), PHILLY_SIGMA) + PHILLY_LARGER_RUN_LONGER * math.log2(
            total
        )
        duration_s = min(max(math.exp(log_s), PHILLY_MIN_S), PHILLY_MAX_S)
        family = rng.choice(families)
        params, step_s = family_step_s(family)
        task_type = task_types.get(family) or "training_compute"
        comm = Communication(bytes_per_step=int(params * 2), rounds_per_step=2) if workers > 1 else None
        spec = JobSpec(
            job_id=f"philly-{i:0{width}d}",
            tenant=rng.choice(list(tenants)),
            name=family,
            task_type=task_type,  # type: ignore[arg-type]
            workers=workers,
            resources=_resources(gpus),
            work=_work_of(duration_s, step_s),
            labels={"family": family},
            comm=comm,
        )
        out.append(SimJob(spec, arrival, "net_training" if workers > 1 else "training", rng.choice(regions)))
    source = f"philly-like: {jobs} jobs, seed {seed}, {arrival_rate_per_h:g}/h; after Jeon et al., ATC 2019"
    return Trace(out, [], source)


def gpu_seconds(job: SimJob) -> float:
    """The reference-GPU seconds of a job's work: steps x step time x its GPUs (a pipeline's step is
    the whole model's compute on one GPU, however it is cut)."""
    spec = job.spec
    gpus = 1 if spec.pipeline is not None else spec.workers * spec.resources.gpus
    return spec.work.steps * spec.work.step_time_s * gpus


def at_load(trace: Trace, load: float, capacity_gpus: float) -> Trace:
    """``trace`` with its arrivals spread or packed so that it offers ``load x capacity_gpus``
    reference-GPU-hours per hour: the arrival span becomes ``sum(gpu_seconds) / (load x
    capacity_gpus)`` (the trace's own work; the arrival pattern is kept, times are scaled from the
    first arrival; an event before it comes at 0). A trace whose jobs all arrive at one instant has
    no span to scale: refused.

    ``capacity_gpus`` is the platform in reference (V100) GPUs: its GPU count for a nominal load,
    or each GPU weighted by its speed for a load of its compute (the grid uses the truth's median
    speed per model). A DAG stage submitted when its parents finish is counted at its trace arrival.
    """
    if not (load > 0 and math.isfinite(load)) or not capacity_gpus > 0:
        raise WorkloadError(f"load and capacity_gpus must be positive, got {load} and {capacity_gpus}")
    if len(trace.jobs) < 2:
        return trace
    first = trace.jobs[0].arrival_s
    span = trace.jobs[-1].arrival_s - first
    if not span > 0:
        raise WorkloadError(
            f"all {len(trace.jobs)} jobs arrive at {first:g} s: there is no arrival span for a load to"
            " scale (give the jobs their arrival times, or run without a load)"
        )
    target = math.fsum(gpu_seconds(j) for j in trace.jobs) / (load * capacity_gpus)
    scale = target / span
    jobs = [
        SimJob(j.spec, (j.arrival_s - first) * scale, j.job_class, j.home_region, j.parents)
        for j in trace.jobs
    ]
    # An event before the first arrival happens at the start (in its order), not before time 0.
    events = [dataclasses.replace(e, at_s=max((e.at_s - first) * scale, 0.0)) for e in trace.events]
    return Trace(jobs, events, f"{trace.source}; at load {load:g} of {capacity_gpus:,.0f} reference GPUs")


def with_spanning(trace: Trace, allowed: bool) -> Trace:
    """``trace`` with every gang of several workers allowed (or not) to span clusters; single
    workers and pipelines (which the planner may always cut into stages) are unchanged."""
    jobs = [
        SimJob(
            msgspec.structs.replace(j.spec, allow_multi_cluster=allowed),
            j.arrival_s,
            j.job_class,
            j.home_region,
            j.parents,
        )
        if j.spec.workers > 1 and j.spec.pipeline is None
        else j
        for j in trace.jobs
    ]
    return Trace(
        jobs, list(trace.events), f"{trace.source}; spanning {'allowed' if allowed else 'forbidden'}"
    )
