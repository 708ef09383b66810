"""Public GPU-cluster job traces, read as they are published, replayed as a :class:`Trace`.

A new user holds real traces, not Loom's generic format. ``loom bench policies --workload FILE``
(and the grid's ``--grid-workloads FILE``) recognise these by their content
(:func:`sniff_format`), whatever the file is called:

- ``openb``: the Alibaba GPU cluster trace 2023 (``openb_pod_list_*.csv`` of alibaba/clusterdata
  ``cluster-trace-gpu-v2023``), read by :func:`loom.sim.workloads.load_alibaba`.
- ``philly``: Microsoft's Philly trace (``cluster_job_log`` of msr-fiddle/philly-traces; Jeon et
  al., ATC 2019): a JSON array of jobs with ``jobid``, ``vc``, ``user``, ``status``,
  ``submitted_time`` and ``attempts`` (each with ``start_time``, ``end_time`` and ``detail``: the
  servers and the GPUs it ran on).
- ``pai``: Alibaba PAI's task table (``pai_task_table.csv`` of alibaba/clusterdata
  ``cluster-trace-gpu-v2020``; Weng et al., NSDI 2022), published without a header (one is
  accepted): each task with GPUs is a job on the GPU type the trace names (:func:`_read_pai`).
- ``helios``: a Slurm-style job log with a header: SenseTime's Helios traces (``cluster_log.csv``
  of S-Lab-System-Group/HeliosData; Hu et al., SC 2021: ``job_id, user, vc, gpu_num, cpu_num,
  node_num, state, submit_time, start_time, end_time, duration, queue``) and Shanghai AI Lab's
  Acme traces (``trace_seren.csv``, ``trace_kalos.csv`` of InternLM/AcmeTrace; Hu et al., NSDI
  2024), which add ``type`` and ``gpu_time`` and leave out ``vc``. Required: ``gpu_num``,
  ``submit_time`` and either ``duration`` or ``start_time`` and ``end_time``.

**How a job becomes a simulated job** (the same rules for ``philly`` and ``helios``; every count of
what was skipped or assumed goes to ``Trace.source``):

- **Which jobs.** Jobs without GPUs are skipped, and so are jobs that never ran (no attempt, no
  start or end time, a duration not above 0) and, in Philly, jobs still running when the trace was
  taken (no end time on the last attempt): the trace does not say how much work they were. Every
  end state is kept (completed, failed, killed, cancelled): the job held its GPUs that long.
  ``limit`` keeps the first ``limit`` jobs by submission that remain; ``start_s`` skips jobs
  submitted earlier than that many seconds after the first of them (the first GPU job that ran).
- **Arrival**: the submission time, from the first kept job's.
- **Shape.** Philly: one worker per server of the job's last attempt with servers, each with the
  server's GPUs (a job on 2 servers with 8 GPUs each is 2 workers x 8 GPUs); servers with unequal
  GPU counts share the job's GPUs evenly, rounded up (counted as ``reshaped``).
  Helios / Acme: ``node_num`` workers of ``gpu_num / node_num`` GPUs; when that does not divide,
  or a one-node job asks for more than :data:`MAX_GPUS_PER_WORKER`, the GPUs are cut into workers of
  at most that many (rounded up: counted as ``reshaped``); never more workers than GPUs.
- **Model.** No trace says which model a job trained: each job draws one (seeded) uniformly from
  ``families`` (default: the Philly-like families, all known to the truth tables), labelled
  ``family``; its V100 step time is Gavel's, or Transformer's scaled by parameters, as in
  :func:`loom.sim.workloads.philly_like`.
- **Work.** The trace measured how long the job ran on *its* GPUs; the rule is that work in
  reference-GPU seconds is ``duration x the truth's speed of the job's family on trace_gpu`` with
  a worker's GPUs in one node, as the trace ran it (so
  on ``trace_gpu`` the simulator, timed by the same truth, computes it exactly as long as the trace
  says; a gang's all-reduce over the links it gets comes on top, as the trace's duration already
  held its own: a gang replays somewhat longer than recorded). Philly: the sum of its attempts
  (each attempt held its GPUs; a retry redoes work).
  ``trace_gpu`` defaults per format (:data:`TRACE_GPUS`: Philly's servers were P100 and P40, of
  which the tables hold P100; Helios ran V100; Acme's clusters are A100) and can be set.
- **Communication**: a gang of several workers all-reduces ``parameters x 2`` bytes a step, two
  rounds (``net_training``); a single worker is ``training``.
- **Tenant**: the trace's virtual cluster (``vc``), else its user, as ``vc-<id>`` / ``u-<id>``;
  **home region** drawn (seeded) uniformly from the topology's regions.
"""

import csv
import hashlib
import json
import math
import random
import re
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final, Literal

from loom.model.topology import Topology, load_topology
from loom.sim.model import SimJob, Trace
from loom.sim.truth import Truth, load_truth
from loom.sim.workloads import PHILLY_FAMILIES, WorkloadError, family_step_s, load_alibaba
from loom_proto.ids import InvalidIdError, validate_id
from loom_proto.jobs import Communication, JobSpec, Resources, Work

__all__ = [
    "FORMATS",
    "MAX_GPUS_PER_WORKER",
    "PAI_COLUMNS",
    "PAI_GPUS",
    "TRACE_GPUS",
    "PublicFormat",
    "load_public",
    "sniff_format",
]

PublicFormat = Literal["openb", "philly", "helios", "pai"]
FORMATS: Final[tuple[PublicFormat, ...]] = ("openb", "philly", "helios", "pai")

PAI_COLUMNS: Final = (
    "job_name",
    "task_name",
    "inst_num",
    "status",
    "start_time",
    "end_time",
    "plan_cpu",
    "plan_mem",
    "plan_gpu",
    "gpu_type",
)
"""``pai_task_table.csv``'s columns (published without a header; ``pai_task_table.header``)."""
PAI_STATES: Final = frozenset({"Terminated", "Failed", "Running", "Waiting"})
PAI_GPUS: Final[Mapping[str, str]] = {
    "V100": "V100M16",
    "V100M32": "V100M32",
    "P100": "P100",
    "T4": "T4",
    "MISC": "K80",
}
"""PAI's ``gpu_type`` -> the model the truth tables time it as (``MISC``: "older generations, e.g.
K40m, K80, M60", taken as K80)."""

TRACE_GPUS: Final[Mapping[str, str]] = {"philly": "P100", "helios": "V100M16", "acme": "A100"}
"""The GPU each format's durations were measured on, unless ``trace_gpu`` says otherwise (Acme is
the ``helios`` format with a ``type`` column)."""

MAX_GPUS_PER_WORKER: Final = 8
"""The most GPUs one worker (one node) takes when a trace's job must be cut into workers."""

MAX_RECORDED_S: Final = 365 * 86_400.0
"""The longest run a trace's job may be recorded with: one over a year is left out (counted)."""

_SNIFF_BYTES: Final = 65_536
_ABSENT: Final = frozenset({"", "none", "null", "nan", "nat"})
_SECONDS: Final = re.compile(r"\d+(\.\d*)?")
_OPENB_COLUMNS: Final = frozenset({"name", "num_gpu", "gpu_milli"})
_HELIOS_COLUMNS: Final = frozenset({"gpu_num", "submit_time"})


def sniff_format(path: str | Path) -> PublicFormat | None:
    """Which public trace format ``path`` holds, told from its first bytes (None: none of them)."""
    try:
        with Path(path).open(encoding="utf-8-sig", errors="replace") as handle:
            head = handle.read(_SNIFF_BYTES)
    except OSError as exc:
        raise WorkloadError(f"cannot read: {exc}", path=str(path)) from exc
    text = head.lstrip()
    if text.startswith("["):
        # Philly's cluster_job_log: a JSON array of job objects, with attempts and a submission.
        # Keys as published: jobid, then attempts (which may run long), then submitted_time.
        if '"jobid"' in text and '"attempts"' in text:
            return "philly"
        return None
    first = next((line for line in text.splitlines() if line.strip() and not line.startswith("#")), "")
    if first.lstrip().startswith("{"):
        return None
    cells = [c.strip() for c in next(csv.reader([first]), [])]
    header = set(cells)
    if header >= _OPENB_COLUMNS:
        return "openb"
    if cells == list(PAI_COLUMNS) or _pai_row(cells):
        return "pai"
    if header >= _HELIOS_COLUMNS:
        # Its reader says what is missing (a duration, or start and end times); taken for the
        # generic format, such a file was told its columns were unknown.
        return "helios"
    return None


@dataclass(frozen=True, slots=True)
class _Job:
    """One job of a public trace as read: where it is, what it asked for, how long it ran."""

    line: int
    job_id: str
    tenant: str
    submit_s: float
    workers: int
    gpus: int
    duration_s: float
    state: str
    gpu_model: str | None = None
    """The GPU the trace says the job ran on (PAI's ``gpu_type``); None: the format's ``trace_gpu``."""


@dataclass(frozen=True, slots=True)
class _Read:
    """A public trace file as read: its jobs, what was skipped or reshaped, and how to cite it."""

    jobs: list[_Job]
    counts: Counter[str]
    fmt: str
    default_gpu: str
    """The GPU its durations were measured on, unless ``trace_gpu`` says otherwise."""
    citation: str
    position: str
    """What orders the jobs in the file: ``line`` or (Philly) ``job`` in the array."""
    own_gpus: bool = False
    """Each job names its own GPU (PAI's ``gpu_type``), used unless ``trace_gpu`` is given."""


def load_public(
    path: str | Path,
    fmt: PublicFormat | None = None,
    *,
    topology: Topology | None = None,
    limit: int | None = None,
    seed: int = 0,
    start_s: float = 0.0,
    trace_gpu: str | None = None,
    families: Sequence[str] | None = None,
    truth: Truth | None = None,
    models: Collection[str] | None = None,
) -> Trace:
    """A public trace (``fmt``, or sniffed) as a :class:`Trace`; :class:`WorkloadError` when the file
    holds none of :data:`FORMATS`. ``trace_gpu``, ``families`` and ``truth`` do not apply to
    ``openb`` (its own rule: :func:`loom.sim.workloads.load_alibaba`); ``models`` (the platform's
    GPU models, default the topology's) applies to it alone."""
    fmt = fmt or sniff_format(path)
    if fmt == "openb":
        return load_alibaba(path, topology=topology, limit=limit, seed=seed, start_s=start_s, models=models)
    reader = {"philly": _read_philly, "pai": _read_pai, "helios": _read_helios}.get(fmt or "")
    if reader is not None:
        return _trace(
            reader(path),
            path,
            topology=topology,
            limit=limit,
            seed=seed,
            start_s=start_s,
            trace_gpu=trace_gpu,
            families=families,
            truth=truth,
        )
    raise WorkloadError(f"not a known public trace (known: {', '.join(FORMATS)})", path=str(path))


def _time(value: Any, what: str, where: str, line: int | None) -> float | None:
    """Seconds since the epoch of a trace's time (``2017-10-07 01:12:09``, with or without a UTC
    offset; a time without one is read as UTC), None when absent."""
    text = _present(value)
    if not text:
        return None
    if _SECONDS.fullmatch(text):
        return float(text)  # seconds already (a plain number is never read as a date)
    try:
        stamp = datetime.fromisoformat(text)
    except ValueError:
        raise WorkloadError(f"{what} is not a time: {text!r}", path=where, line=line) from None
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=UTC)
    return stamp.timestamp()


def _number(value: Any, what: str, where: str, line: int | None) -> float | None:
    text = _present(value)
    if not text:
        return None
    try:
        number = float(text)
    except ValueError:
        raise WorkloadError(f"{what} is not a number: {text!r}", path=where, line=line) from None
    if not math.isfinite(number) or number < 0:
        raise WorkloadError(f"{what} must be a finite number >= 0, got {text!r}", path=where, line=line)
    return number


def _present(value: Any) -> str:
    """A cell's text, or '' when it stands for nothing (empty, ``None``, ``null``, ``NaN``)."""
    text = "" if value is None else str(value).strip()
    return "" if text.lower() in _ABSENT else text


def _safe_id(text: str) -> str:
    """``text`` as an id (letters, digits, ``_``, ``-``; others become ``_``), at most 64 characters
    (a longer one keeps its first 55 and a digest of the whole, so distinct ids stay distinct)."""
    raw = "".join(c if c.isascii() and (c.isalnum() or c in "_-") else "_" for c in text)
    if len(raw) <= 64:
        return raw
    return f"{raw[:55]}-{hashlib.sha256(text.encode()).hexdigest()[:8]}"


def _tenant(prefix: str, value: Any) -> str:
    """``<prefix>-<id>`` of a trace's hashed vc or user (as an id)."""
    return _safe_id(f"{prefix}-{_present(value) or 'unknown'}")


def _owner(vc: Any, user: Any) -> str:
    """The tenant of a job: its virtual cluster, else its user."""
    return _tenant("vc", vc) if _present(vc) else _tenant("u", user)


def _shape(gpus: int, nodes: int) -> tuple[int, int, bool]:
    """(workers, GPUs per worker, reshaped) for ``gpus`` GPUs over ``nodes`` nodes (never more
    workers than GPUs: a job of 1 GPU on 4 nodes is 1 worker of 1 GPU)."""
    nodes = max(min(nodes, gpus), 1)  # a node without a GPU of the job is not a worker of it
    if gpus % nodes == 0 and gpus // nodes <= MAX_GPUS_PER_WORKER:
        return nodes, gpus // nodes, False
    workers = max(nodes, math.ceil(gpus / MAX_GPUS_PER_WORKER))
    return workers, math.ceil(gpus / workers), True


def _read_philly(path: str | Path) -> _Read:
    """Philly's ``cluster_job_log`` (JSON): its jobs as read (the rules: the module docstring)."""
    where = str(path)
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8-sig"))
    except (OSError, UnicodeDecodeError) as exc:
        raise WorkloadError(f"cannot read: {exc}", path=where) from exc
    except json.JSONDecodeError as exc:
        raise WorkloadError(f"malformed JSON: {exc}", path=where, line=exc.lineno) from None
    if not isinstance(data, list):
        raise WorkloadError("a Philly job log is a JSON array of jobs", path=where)
    counts: Counter[str] = Counter()
    jobs: list[_Job] = []
    for index, entry in enumerate(data):
        position = index + 1  # the job's position in the array (its line in the file is not known)
        try:
            if not isinstance(entry, dict):
                raise WorkloadError("not a JSON object")
            job = _philly_job(entry, position, "", counts)
        except WorkloadError as exc:
            raise WorkloadError(f"job {position} of the array: {exc}", path=where) from None
        if job is not None:
            jobs.append(job)
    citation = "msr-fiddle/philly-traces cluster_job_log (Jeon et al., ATC 2019)"
    return _Read(jobs, counts, "philly", TRACE_GPUS["philly"], citation, "job")


def _philly_job(entry: Mapping[str, Any], line: int, where: str, counts: Counter[str]) -> _Job | None:
    job_id = str(entry.get("jobid") or "").strip()
    if not job_id:
        raise WorkloadError("a job without a jobid", path=where)
    submitted = _time(entry.get("submitted_time"), "submitted_time", where, None)
    attempts = entry.get("attempts") or []
    if not isinstance(attempts, list):
        raise WorkloadError(f"job {job_id}: attempts is not a list", path=where)
    if submitted is None or not attempts:
        counts["never_ran"] += 1
        return None
    total = 0.0
    servers: list[Any] = []
    for attempt in attempts:
        if not isinstance(attempt, dict):
            raise WorkloadError(f"job {job_id}: an attempt is not a JSON object", path=where)
        start = _time(attempt.get("start_time"), "start_time", where, None)
        end = _time(attempt.get("end_time"), "end_time", where, None)
        if start is not None and end is not None and end > start:
            total += end - start
        if attempt.get("detail"):
            servers = _servers(attempt["detail"], job_id, where)
    last_end = attempts[-1].get("end_time") if isinstance(attempts[-1], dict) else None
    if _time(last_end, "end_time", where, None) is None and attempts[-1].get("start_time"):
        counts["still_running"] += 1
        return None
    # A server listed without GPUs of the job is not one of its workers.
    per_server = [n for s in servers if isinstance(s, dict) and (n := len(s.get("gpus") or [])) > 0]
    gpus = sum(per_server)
    if gpus == 0:
        counts["no_gpus"] += 1
        return None
    if total <= 0:
        counts["never_ran"] += 1
        return None
    workers, per_worker = len(per_server), max(per_server)
    if per_worker > MAX_GPUS_PER_WORKER or any(g != per_worker for g in per_server):
        # Servers with unequal GPU counts: the job's GPUs evenly over its servers (rounded up).
        workers, per_worker, _ = _shape(gpus, workers)
        counts["reshaped"] += 1
    tenant = _owner(entry.get("vc"), entry.get("user"))
    return _Job(line, job_id, tenant, submitted, workers, per_worker, total, str(entry.get("status") or ""))


def _recorded_sanely(jobs: list[_Job], counts: Counter[str]) -> list[_Job]:
    """A job recorded as running over a year is a broken row (or a unit mistake), not a measurement:
    left out and counted (one row must not refuse the whole trace; played out, a duration of
    1e300 s ran for minutes, and 1.7e308 s overflowed)."""
    sane = [j for j in jobs if j.duration_s <= MAX_RECORDED_S]
    counts["over_a_year"] = len(jobs) - len(sane)
    return sane


def _servers(detail: Any, job_id: str, where: str) -> list[Any]:
    """An attempt's ``detail``: its servers, each a list of GPU names (a string's length counted
    its characters as GPUs, "gpu0,gpu1" as 9; a number failed with a TypeError)."""
    if not isinstance(detail, list):
        raise WorkloadError(f"job {job_id}: an attempt's detail is not a list of servers", path=where)
    for server in detail:
        if isinstance(server, dict) and not isinstance(server.get("gpus") or [], list):
            raise WorkloadError(f"job {job_id}: a server's gpus is not a list of GPU names", path=where)
    return detail


def _read_helios(path: str | Path) -> _Read:
    """A Helios ``cluster_log.csv`` or an Acme ``trace_*.csv``: its jobs as read (the rules: the
    module docstring). Lines starting with ``#`` are comments."""
    where = str(path)
    rows = _csv_rows(path)
    if not rows:
        raise WorkloadError("no header row", path=where)
    header = rows[0][1]
    missing = sorted(_HELIOS_COLUMNS - set(header))
    if missing or not ("duration" in header or {"start_time", "end_time"} <= set(header)):
        raise WorkloadError(
            "not a Helios / Acme job log: it needs gpu_num, submit_time and duration (or start_time"
            f" and end_time); missing {', '.join(missing) or 'duration'}",
            path=where,
            line=rows[0][0],
        )
    acme = "type" in header
    counts: Counter[str] = Counter()
    jobs: list[_Job] = []
    for line, cells in rows[1:]:
        if len(cells) != len(header):
            raise WorkloadError(f"{len(cells)} cells for {len(header)} columns", path=where, line=line)
        row = dict(zip(header, cells, strict=True))
        job = _helios_job(row, line, where, counts)
        if job is not None:
            jobs.append(job)
    if acme:
        return _Read(
            jobs, counts, "helios", TRACE_GPUS["acme"], "InternLM/AcmeTrace (Hu et al., NSDI 2024)", "line"
        )
    citation = "S-Lab-System-Group/HeliosData (Hu et al., SC 2021)"
    return _Read(jobs, counts, "helios", TRACE_GPUS["helios"], citation, "line")


def _helios_job(row: Mapping[str, str], line: int, where: str, counts: Counter[str]) -> _Job | None:
    job_id = row.get("job_id", "").strip() or f"line{line}"
    gpus = _number(row.get("gpu_num"), "gpu_num", where, line) or 0.0
    if gpus <= 0:
        counts["cpu_only"] += 1
        return None
    submitted = _time(row.get("submit_time"), "submit_time", where, line)
    duration = _number(row.get("duration"), "duration", where, line)
    if duration is None:
        start = _time(row.get("start_time"), "start_time", where, line)
        end = _time(row.get("end_time"), "end_time", where, line)
        duration = end - start if start is not None and end is not None else None
    if submitted is None or duration is None or duration <= 0:
        counts["never_ran"] += 1
        return None
    nodes = int(_number(row.get("node_num"), "node_num", where, line) or 1)
    workers, per_worker, reshaped = _shape(math.ceil(gpus), nodes)
    counts["reshaped"] += reshaped
    tenant = _owner(row.get("vc"), row.get("user"))
    return _Job(line, job_id, tenant, submitted, workers, per_worker, duration, row.get("state", ""))


def _csv_rows(path: str | Path) -> list[tuple[int, list[str]]]:
    """Every CSV record of ``path`` that is neither blank nor a ``#`` comment: (the line it starts
    on, its cells stripped). A quoted cell may hold line ends; a malformed record raises
    :class:`WorkloadError` naming its line."""
    where = str(path)
    rows: list[tuple[int, list[str]]] = []
    try:
        with Path(path).open(encoding="utf-8-sig", newline="") as handle:
            # A comment line is blanked before the parser sees it (a quote in it must not open a
            # cell); blanked, it still counts as a line.
            reader = csv.reader(("\n" if text.startswith("#") else text for text in handle), strict=True)
            line = 1
            for cells in reader:
                if cells and any(c.strip() for c in cells):
                    rows.append((line, [c.strip() for c in cells]))
                line = reader.line_num + 1
    except (OSError, UnicodeDecodeError) as exc:
        raise WorkloadError(f"cannot read: {exc}", path=where) from exc
    except csv.Error as exc:
        raise WorkloadError(f"malformed CSV: {exc}", path=where, line=line) from None
    return rows


def _pai_row(cells: Sequence[str]) -> bool:
    """Whether ``cells`` look like a row of PAI's headerless task table."""
    if len(cells) != len(PAI_COLUMNS) or cells[3] not in PAI_STATES:
        return False
    try:
        for i in (2, 6, 8):
            float(cells[i] or 0)
    except ValueError:
        return False
    return True


def _read_pai(path: str | Path) -> _Read:
    """Alibaba PAI's ``pai_task_table.csv`` (cluster-trace-gpu-v2020; Weng et al., NSDI 2022), with
    or without its header row: its tasks as read. Each task that asked for GPUs (``plan_gpu`` > 0)
    is one job (``<job_name>-<task_name>``): ``inst_num`` workers of ``ceil(plan_gpu / 100)`` GPUs
    (a fractional GPU is a whole one: sharing is not modelled; counted), arriving at its launch
    (``start_time``: the task table holds no submission), running ``end_time - start_time`` on its
    ``gpu_type`` (:data:`PAI_GPUS`), unless ``trace_gpu`` sets one GPU for all. Tasks without an end
    (running, waiting) are skipped and counted. Tenant: ``pai``. Otherwise the module's rules."""
    where = str(path)
    counts: Counter[str] = Counter()
    jobs: list[_Job] = []
    for line, cells in _csv_rows(path):
        if cells == list(PAI_COLUMNS):
            continue  # the header, when the user put it back
        if len(cells) != len(PAI_COLUMNS):
            raise WorkloadError(
                f"{len(cells)} cells for the task table's {len(PAI_COLUMNS)} columns", path=where, line=line
            )
        job = _pai_job(dict(zip(PAI_COLUMNS, cells, strict=True)), line, where, counts)
        if job is not None:
            jobs.append(job)
    citation = "alibaba/clusterdata cluster-trace-gpu-v2020 pai_task_table (Weng et al., NSDI 2022)"
    return _Read(jobs, counts, "pai", PAI_GPUS["V100"], citation, "line", own_gpus=True)


def _pai_job(row: Mapping[str, str], line: int, where: str, counts: Counter[str]) -> _Job | None:
    plan = _number(row["plan_gpu"], "plan_gpu", where, line) or 0.0
    if plan <= 0:
        counts["cpu_only"] += 1
        return None
    start = _number(row["start_time"], "start_time", where, line)
    end = _number(row["end_time"], "end_time", where, line)
    if start is None or end is None or end <= start:
        counts["still_running" if start is not None and row["status"] == "Running" else "never_ran"] += 1
        return None
    gpu_type = row["gpu_type"]
    if gpu_type and gpu_type not in PAI_GPUS:
        raise WorkloadError(
            f"unknown gpu_type {gpu_type!r}; known: {', '.join(PAI_GPUS)}", path=where, line=line
        )
    counts["fractional"] += plan % 100 != 0
    instances = max(int(_number(row["inst_num"], "inst_num", where, line) or 1), 1)
    workers, gpus, reshaped = _shape(instances * math.ceil(plan / 100), instances)
    counts["reshaped"] += reshaped
    job_id = f"{row['job_name'][:40]}-{row['task_name'][:23]}"
    model = PAI_GPUS.get(gpu_type) if gpu_type else None
    return _Job(line, job_id, "pai", start, workers, gpus, end - start, row["status"], model)


def _unique_ids(jobs: Sequence[_Job], where: str) -> list[str]:
    """Each job's id as an id, distinct: an id seen before is named by its line (or array
    position) too. :class:`WorkloadError` for a tenant that is no id (it never is after
    :func:`_tenant`; kept as a check)."""
    seen: set[str] = set()
    ids: list[str] = []
    for job in jobs:
        job_id = _safe_id(job.job_id)
        n = 0
        while job_id in seen:
            n += 1
            job_id = _safe_id(f"{job.job_id}-{job.line}" + (f"-{n}" if n > 1 else ""))
        try:
            validate_id(job_id, "job id")
            validate_id(job.tenant, "tenant")
        except InvalidIdError as exc:
            raise WorkloadError(str(exc), path=where, line=job.line) from None
        seen.add(job_id)
        ids.append(job_id)
    return ids


def _trace(
    read: _Read,
    path: str | Path,
    *,
    topology: Topology | None,
    limit: int | None,
    seed: int,
    start_s: float,
    trace_gpu: str | None,
    families: Sequence[str] | None,
    truth: Truth | None,
) -> Trace:
    """The kept jobs as simulated jobs, in submission order, with what was skipped in the source;
    ``trace_gpu`` (None: the format's) sets the GPU every duration was measured on."""
    where = str(path)
    jobs, counts, fmt, citation, position = read.jobs, read.counts, read.fmt, read.citation, read.position
    forced_gpu = trace_gpu is not None or not read.own_gpus
    trace_gpu = trace_gpu or read.default_gpu
    if limit is not None and limit < 0:
        raise WorkloadError(f"limit must not be negative, got {limit}")
    if not (math.isfinite(start_s) and start_s >= 0):
        raise WorkloadError(f"start_s must be a finite number >= 0, got {start_s}")
    truth = truth if truth is not None else load_truth()
    chosen = sorted(families) if families is not None else sorted(PHILLY_FAMILIES)
    unknown = [f for f in chosen if f not in PHILLY_FAMILIES]
    if not chosen or unknown:
        raise WorkloadError(
            f"families must be among {', '.join(sorted(PHILLY_FAMILIES))}; got {', '.join(unknown) or 'none'}"
        )
    if truth.speed(chosen[0], trace_gpu).rule == "unknown-gpu":
        raise WorkloadError(f"trace GPU {trace_gpu!r} is not known to the truth tables", path=where)
    topology = topology if topology is not None else load_topology()
    regions = sorted(r.id for r in topology.regions)
    rng = random.Random(seed)
    jobs = sorted(_recorded_sanely(jobs, counts), key=lambda j: (j.submit_s, j.line))
    first = jobs[0].submit_s if jobs else 0.0
    kept = [j for j in jobs if j.submit_s - first >= start_s]
    counts["before_start"] = len(jobs) - len(kept)
    if limit is not None:
        counts["beyond_limit"] = max(len(kept) - limit, 0)
        kept = kept[:limit]
    origin = kept[0].submit_s if kept else 0.0
    out: list[SimJob] = []
    ids = _unique_ids(kept, where)
    counts["renamed"] = sum(job_id != job.job_id for job_id, job in zip(ids, kept, strict=True))
    states: Counter[str] = Counter()
    for job_id, job in zip(ids, kept, strict=True):
        states[job.state or "unknown"] += 1
        family = rng.choice(chosen)
        params, step_s = family_step_s(family)
        ran_on = trace_gpu if forced_gpu or job.gpu_model is None else job.gpu_model
        # Per GPU, with the worker's GPUs in one node as the trace ran it (and as the simulator
        # times it): at one GPU's speed an 8-GPU job replayed 2.3x longer than recorded, on the
        # very GPU it was measured on (a newcomer's walk).
        true = truth.speed(family, ran_on, gpus_per_node=max(job.gpus, 1))
        if true.rule == "unknown-gpu":
            raise WorkloadError(f"GPU {ran_on!r} is not known to the truth tables", path=where, line=job.line)
        speed = true.speed
        work_s = job.duration_s * speed
        steps = max(1, round(work_s / step_s))
        gang = job.workers > 1
        spec = JobSpec(
            job_id=job_id,
            tenant=job.tenant,
            name=family,
            task_type=truth.task_types.get(family) or "training_compute",  # type: ignore[arg-type]
            workers=job.workers,
            resources=Resources(gpus=job.gpus),
            work=Work(steps=steps, step_time_s=work_s / steps),
            labels={"family": family, "trace_state": job.state[:64]} if job.state else {"family": family},
            comm=Communication(bytes_per_step=int(params * 2), rounds_per_step=2) if gang else None,
        )
        out.append(
            SimJob(spec, job.submit_s - origin, "net_training" if gang else "training", rng.choice(regions))
        )
    gpu_rule = truth.speed(chosen[0], trace_gpu)
    ran_on_text = (
        f"on {trace_gpu} ({gpu_rule.rule}{', derived' if gpu_rule.derived else ''})"
        if forced_gpu
        else f"on each job's GPU type ({', '.join(f'{k} as {v}' for k, v in PAI_GPUS.items())})"
    )
    noted = ("reshaped", "fractional", "renamed")
    skipped = ", ".join(f"{counts[k]} {k.replace('_', ' ')}" for k in sorted(counts) if k not in noted)
    source = (
        f"{Path(path).name} ({fmt}): {citation}; {len(out)} jobs kept (by {position} order of submission);"
        f" skipped {skipped or 'none'}; {counts['reshaped']} reshaped into workers of <= "
        f"{MAX_GPUS_PER_WORKER} GPUs; {counts['fractional']} fractional-GPU tasks given whole GPUs;"
        f" {counts['renamed']} job ids renamed (repeated, or not letters, digits, _ and -);"
        f" end states {dict(sorted(states.items()))}; family drawn per job from "
        f"{', '.join(chosen)}; work = duration x truth speed {ran_on_text}"
        f" (per GPU, a worker's GPUs in one node); seed={seed}"
    )
    return Trace(out, [], source)
