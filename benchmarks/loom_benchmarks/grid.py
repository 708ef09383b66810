"""``loom bench policies --grid``: every policy over platforms x loads x spanning x workloads x seeds.

A **cell** is one (platform, load, spanning, workload); it is run once per seed and each policy of
:data:`GRID_POLICIES` replays the same trace on the same platform, every job timed by the truth
(:mod:`loom.sim.truth`; the packaged tables unless a truth file is given).

- **Platforms** (:func:`grid_platform`), from the default topology (``libs/loom/topologies/default.json``):
  ``small`` keeps the clusters of three regions (Frankfurt, Ohio, West Europe: V100s, the
  undisclosed G2/G3, A10, T4, P100) and about 64 of their GPUs; ``medium`` keeps every cluster of the
  six regions and about 500 GPUs; ``default`` is the whole topology (6,105 GPUs). A smaller platform
  takes a seeded sample of each kept cluster's nodes in proportion to its GPUs, so the model mix
  holds; its regions, links, prices are the topology's (only the kept regions).
- **Load** (:func:`loom.sim.workloads.at_load`): the trace's arrivals are spread so that it offers
  ``load x capacity`` reference-GPU-hours per hour, from its own work, where the capacity is the
  platform's GPUs each weighted by its model's median true speed (:func:`reference_capacity`): the
  A100-class G2/G3 that dominate these platforms run 3.4-4.4x a V100 by the truth tables, so a load
  counted in plain GPUs would leave the platforms mostly idle.
- **Spanning** (:func:`loom.sim.workloads.with_spanning`): every gang of several workers may span
  clusters, or none may. Traces of single workers only (the Alibaba sample) are the same either way:
  their spanning cells copy the runs with spanning forbidden rather than repeat them.
- **Workloads**: ``alibaba`` (the packaged sample, :func:`~loom.sim.workloads.load_alibaba`), ``mix``
  (:func:`~loom.sim.workloads.training_mix`) and ``philly`` (:func:`~loom.sim.workloads.philly_like`),
  :data:`CELL_JOBS` jobs each (``--jobs`` overrides), home regions over the platform's regions.
  A workload may also be a **file**: a public trace as published (the Alibaba 2023 pod lists,
  Philly's ``cluster_job_log``, Helios / Acme job logs, PAI's task table:
  :mod:`loom.sim.public_traces`) or the generic format, read by
  :func:`loom.sim.workloads.load_workload` (its first :data:`FILE_JOBS` jobs by arrival, of a
  public trace or a generic file alike, unless ``--jobs`` says otherwise; the seed draws home
  regions and the models a public trace does not name); its cells are named by the file's stem.

Per cell and policy the figures are averaged over seeds: mean / p50 / p99 JCT (the seeds' own
figures averaged), mean queueing, time-weighted utilisation over the run and, in brackets on the
line, while jobs arrive (``gpu_utilisation_arrivals``: a finite trace of heavy-tailed jobs drains
for days after its last arrival, so the run's figure understates the load the cell reached),
GPU-hours, cross-region bytes, cost, finished / rejected / unfinished counts, and the belief
error (:func:`loom.sim.metrics.belief_error`: median over the jobs that ran of
``|believed step / true step - 1|``). **Loom's margin** is
``(best baseline - loom) / best baseline`` on mean JCT, the best baseline being the lowest mean
JCT among the baselines (``oracle`` is a bound, not a baseline): positive when Loom is faster. It
is computed per seed and from the seed-averaged means, and only over baselines that finished at
least as many jobs as Loom (:func:`margin`). Each seed's figures are in the JSON too, with Loom's
JCT per job, from which :func:`spanning_penalty` pairs the same jobs with spanning allowed and
forbidden. Where the workload has network-sensitive training (the ``mix``), the line also gives
Loom's margin over compute-only greedy on that class alone (:func:`class_margin`: pooled over the
seeds on the class's jobs both finished); the issue asks >= 25 % in contended cells (load >= 1.0).

:func:`run_grid` is pure apart from the work it does (no I/O): tests call it on a tiny grid.
"""

import dataclasses
import math
import multiprocessing
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from loom.model.topology import Topology
    from loom.sim.model import Platform, SimResult, Trace
    from loom.sim.truth import Truth

GRID_POLICIES: Final = (
    "loom",
    "random",
    "round_robin",
    "first_fit",
    "greedy_compute",
    "home_region",
    "gavel_like",
    "oracle",
)
TARGET: Final = "loom"
BOUNDS: Final = frozenset({"oracle"})
"""Policies that are bounds, not baselines: never Loom's best baseline."""
PLATFORMS: Final = ("small", "medium", "default")
LOADS: Final = (0.5, 0.8, 1.0, 1.2)
WORKLOADS: Final = ("alibaba", "mix", "philly")
SEEDS: Final = (0, 1, 2, 3, 4)
WITHOUT_GANGS: Final = frozenset({"alibaba"})
"""Workloads of single workers (every Alibaba task is one node): spanning changes nothing, so a
cell with spanning allowed copies the run with it forbidden (``copied_from`` in the JSON)."""
SPANNING: Final = (False, True)
CELL_JOBS: Final[Mapping[str, int]] = {"alibaba": 200, "mix": 150, "philly": 200}
"""Jobs per cell and workload (the mix's DAG units are three jobs: 150 jobs is about 115 units)."""
FILE_JOBS: Final = 200
"""Jobs per cell of a file, public trace or generic (the first, by arrival), unless ``--jobs`` says
otherwise."""


def workload_label(workload: str) -> str:
    """A workload's name in cell keys: a named workload as is, a file by its stem (no ``/``)."""
    if workload in WORKLOADS:
        return workload
    stem = (Path(workload).stem or "file").replace("/", "_")
    return f"file-{stem}" if stem in WORKLOADS else stem  # never the label of a named workload


CLASS: Final = "net_training"
"""The class whose margin over compute-only greedy the grid reports (issue 12: >= 25 % in contended
cells): network-sensitive training, present in the ``mix`` workload."""
CLASS_BASELINE: Final = "greedy_compute"
CONTENDED_LOAD: Final = 1.0
CONTENDED_QUEUE_SHARE: Final = 0.01
"""A cell is *contended* at a load of :data:`CONTENDED_LOAD` or above where jobs do wait: the
class's baseline (compute-only greedy) spends at least this share of its mean JCT queueing. On the
default platform (6,212 GPUs) the mix's 150 jobs never queue at any load (utilisation ~11 %):
those cells are not contended whatever their nominal load."""
SMALL_REGIONS: Final = ("aws-eu-central-1", "aws-us-east-2", "azure-westeurope")
PLATFORM_GPUS: Final[Mapping[str, int | None]] = {"small": 64, "medium": 500, "default": None}
FIGURES: Final = (
    "jct_mean_s",
    "jct_p50_s",
    "jct_p99_s",
    "queue_mean_s",
    "gpu_utilisation_mean",
    "gpu_hours",
    "cross_region_bytes",
    "cost",
    "finished",
    "rejected",
    "unfinished",
    "belief_error_median",
    "gpu_utilisation_arrivals",
    "plugin_errors",
)
_OWN_FIGURES: Final = frozenset({"belief_error_median", "gpu_utilisation_arrivals", "plugin_errors"})
"""Figures computed here rather than read from :func:`loom.sim.metrics.summarize`."""


@dataclass(frozen=True)
class GridSpec:
    """What a grid runs (defaults: the full grid)."""

    platforms: tuple[str, ...] = PLATFORMS
    loads: tuple[float, ...] = LOADS
    spanning: tuple[bool, ...] = SPANNING
    workloads: tuple[str, ...] = WORKLOADS
    seeds: tuple[int, ...] = SEEDS
    policies: tuple[str, ...] = GRID_POLICIES
    jobs: Mapping[str, int] = field(default_factory=lambda: dict(CELL_JOBS))
    truth_path: str | None = None
    trace_start_s: float = 0.0
    """A public trace file's tasks submitted in its first this many seconds are skipped (the Alibaba
    pod lists open with services created months before the rest); named workloads take none."""

    def cells(self) -> list[tuple[str, float, bool, str]]:
        """(platform, load, spanning, workload), in the order lines are printed."""
        return [
            (p, load, span, w)
            for p in self.platforms
            for load in self.loads
            for span in self.spanning
            for w in self.workloads
        ]


# ---- platforms and traces -----------------------------------------------------------------------


def sub_topology(
    topology: "Topology", regions: Iterable[str] | None, gpus: int | None, seed: int
) -> "Topology":
    """The topology's clusters in ``regions`` (all when None), each keeping a seeded sample of its
    nodes with about ``gpus x`` its share of the kept GPUs (every node when None); the regions and
    links among the kept regions."""
    import msgspec
    import numpy as np

    keep = set(regions) if regions is not None else {r.id for r in topology.regions}
    clusters = [c for c in topology.clusters if c.region in keep]
    if gpus is not None:
        rng = np.random.default_rng(seed)
        total = sum(c.total_gpus for c in clusters)
        trimmed = []
        for cluster in clusters:
            target = gpus * cluster.total_gpus / max(total, 1)
            order = rng.permutation(len(cluster.nodes))
            chosen: list[int] = []
            held = 0
            for i in order.tolist():
                node_gpus = cluster.nodes[i].gpus if cluster.nodes[i].gpu_model is not None else 0
                if node_gpus == 0 or held + node_gpus > target + node_gpus / 2:
                    continue
                chosen.append(i)
                held += node_gpus
            trimmed.append(msgspec.structs.replace(cluster, nodes=[cluster.nodes[i] for i in sorted(chosen)]))
        clusters = [c for c in trimmed if c.nodes]
    kept = {c.region for c in clusters}
    return msgspec.structs.replace(
        topology,
        name=f"{topology.name}-{len(kept)}r" + (f"-{gpus}g" if gpus is not None else ""),
        regions=[r for r in topology.regions if r.id in kept],
        links=[link for link in topology.links if link.src in kept and link.dst in kept],
        clusters=clusters,
    )


MIN_PLATFORM_GPUS: Final = 16
"""The fewest GPUs a sized grid platform (``NAME:GPUS``) may ask for."""


def is_platform_file(name: str) -> bool:
    """Whether a grid platform's name is a topology file (a path ending in ``.json``) rather than
    one of the packaged platforms."""
    return name.endswith(".json")


def platform_label(name: str) -> str:
    """A platform's name in cell keys: a packaged platform as is, a topology file by its stem
    (``file-<stem>`` where the stem is a packaged platform's name; no ``:``, which sizes one)."""
    if not is_platform_file(name):
        return name
    stem = (Path(name).stem or "file").replace(":", "_")
    return f"file-{stem}" if stem in PLATFORMS else stem


def parse_platform(name: str) -> tuple[str, int | None]:
    """A grid platform's name: ``small``, ``medium``, ``default``, or one of them sized,
    ``NAME:GPUS`` (its regions, about ``GPUS`` GPUs sampled over their clusters as ``medium`` is:
    ``medium:120``, ``default:2000``), for sweeping platform size; or a topology file of one's own
    (``path/to/platform.json``, read by :func:`loom.model.topology.load_topology`): ``("file",
    None)``. :class:`ValueError` if not one."""
    if is_platform_file(name):
        return "file", None
    base, sep, size = name.partition(":")
    if base not in PLATFORMS:
        raise ValueError(f"unknown grid platform {name!r}; known: {', '.join(PLATFORMS)}, or NAME:GPUS")
    if not sep:
        return base, None
    try:
        gpus = int(size)
    except ValueError:
        raise ValueError(f"grid platform {name!r}: GPUS must be a whole number, got {size!r}") from None
    if gpus < MIN_PLATFORM_GPUS:
        raise ValueError(f"grid platform {name!r}: at least {MIN_PLATFORM_GPUS} GPUs, got {gpus}")
    return base, gpus


def grid_topology(name: str, base: "Topology | None" = None) -> "Topology":
    """The topology of a grid platform: ``small``, ``medium`` or ``default`` (see the module
    docstring), one of them sized, or a topology file (:func:`parse_platform`)."""
    from loom.model.topology import TopologyError, load_topology

    if is_platform_file(name):
        try:
            return load_topology(Path(name))
        except TopologyError as exc:
            raise ValueError(f"grid platform {name!r}: {exc}") from None
    topology = base if base is not None else load_topology()
    kind, gpus = parse_platform(name)
    if gpus is not None:
        regions = SMALL_REGIONS if kind == "small" else None
        whole = sub_topology(topology, regions, None, seed=0)
        have = sum(c.total_gpus for c in whole.clusters)
        if gpus > have:
            # It ran the whole platform under the asked-for size's name (medium:7000: 6,212 GPUs).
            raise ValueError(f"grid platform {name!r}: its regions hold {have:,} GPUs; ask for at most that")
        sized = sub_topology(topology, regions, gpus, seed=0)
        got = sum(c.total_gpus for c in sized.clusters)
        if got < MIN_PLATFORM_GPUS:
            raise ValueError(
                f"grid platform {name!r}: sampling its clusters' nodes keeps {got} GPUs, under the"
                f" {MIN_PLATFORM_GPUS} a platform needs; ask for more"
            )
        return sized
    if name == "default":
        return topology
    if name == "small":
        return sub_topology(topology, SMALL_REGIONS, PLATFORM_GPUS["small"], seed=0)
    if name == "medium":
        return sub_topology(topology, None, PLATFORM_GPUS["medium"], seed=0)
    raise ValueError(f"unknown grid platform {name!r}; known: {', '.join(PLATFORMS)}")


def grid_platform(name: str) -> tuple["Topology", "Platform"]:
    """(topology, platform) of a grid platform."""
    from loom.sim.engine import platform_from_topology

    topology = grid_topology(name)
    return topology, platform_from_topology(topology, name=platform_label(name))


def platform_gpus(platform: "Platform") -> int:
    """GPUs of a platform."""
    return sum(n.gpus_total for n in platform.nodes if n.gpu_model is not None)


def reference_capacity(platform: "Platform", truth: "Truth | None") -> float:
    """A platform's compute in reference (V100) GPUs: each GPU weighted by its model's median true
    speed over the truth's families (one GPU per node); by its believed SCU for ``training_compute``
    when timing by belief (``truth`` None)."""
    speed: dict[str, float] = {}
    total = 0.0
    for node in platform.nodes:
        model = node.gpu_model
        if model is None:
            continue
        if model not in speed:
            if truth is None:
                speed[model] = platform.speed.get((model, "training_compute"), 1.0)
            else:
                speed[model] = statistics.median(truth.speed(f, model).speed for f in truth.families)
        total += node.gpus_total * speed[model]
    return total


_FILE_TRACES: dict[tuple[Any, ...], "Trace"] = {}
"""Trace files read in this process (:func:`grid_trace`), by path, version and what drew from them."""


def grid_trace(
    workload: str,
    jobs: int,
    seed: int,
    topology: "Topology",
    truth: "Truth | None" = None,
    *,
    start_s: float = 0.0,
) -> "Trace":
    """A workload's trace for the grid (before load and spanning are applied): a named workload, or
    a file (:func:`loom.sim.workloads.load_workload`; ``truth`` turns a public trace's measured
    durations into work, ``start_s`` skips its tasks submitted before then)."""
    from loom.sim import workloads

    if start_s and workload in WORKLOADS:
        raise ValueError(f"a trace start applies to a trace file, not to the named workload {workload!r}")
    if workload == "alibaba":
        return workloads.load_alibaba(topology=topology, limit=jobs, seed=seed)
    if workload == "mix":
        from loom_benchmarks.policies import mix_units

        return workloads.training_mix(topology=topology, jobs=mix_units(jobs), seed=seed)
    if workload == "philly":
        return workloads.philly_like(jobs, seed, topology=topology)
    if Path(workload).is_file():
        # Read once per worker process and (seed, jobs, platform, truth), not once per cell: a
        # published trace may be tens of megabytes, and only load and spanning differ per cell.
        stat = Path(workload).stat()
        key = (
            str(Path(workload).resolve()),
            stat.st_mtime_ns,
            stat.st_size,
            jobs,
            seed,
            topology.name,
            None if truth is None else truth.source,
            start_s,
        )
        trace = _FILE_TRACES.get(key)
        if trace is None:
            trace = workloads.load_workload(
                workload,
                regions={r.id for r in topology.regions},
                topology=topology,
                limit=jobs,
                seed=seed,
                truth=truth,
                start_s=start_s,
            )
            # As `loom bench policies` checks a file: nothing to run, or names the platform lacks,
            # refuse it rather than quietly shrink every cell.
            workloads.check_trace(
                trace,
                where=str(workload),
                regions={r.id for r in topology.regions},
                clusters={c.id for c in topology.clusters},
                models={n.gpu_model for c in topology.clusters for n in c.nodes if n.gpu_model},
            )
            _FILE_TRACES[key] = trace  # only a trace that passed
        return trace
    raise ValueError(f"unknown grid workload {workload!r}; known: {', '.join(WORKLOADS)}")


# ---- one cell, one seed -------------------------------------------------------------------------


def figures(result: "SimResult", arrivals: tuple[float, float] | None = None) -> dict[str, Any]:
    """The grid's figures of one run; ``arrivals`` (first, last arrival) bounds the window of
    ``gpu_utilisation_arrivals``."""
    from loom.sim import metrics

    overall = metrics.summarize(result)["overall"]
    out = {k: overall.get(k) for k in FIGURES if k not in _OWN_FIGURES}
    out["belief_error_median"] = metrics.belief_error(result.records)["median"]
    window = [s for s in result.timeline if arrivals is None or arrivals[0] <= s.t_s <= arrivals[1]]
    out["gpu_utilisation_arrivals"] = metrics.mean_utilisation(window)
    out["plugin_errors"] = result.plugin_errors
    return out


def run_seed(
    task: tuple[str, float, bool, str, int, tuple[str, ...], int, str | None, float],
) -> dict[str, Any]:
    """Every policy over one cell and seed: ``{"cell": ..., "seed": s, "policies": {name: figures}}``
    (a top-level function taking one tuple, for ``multiprocessing``)."""
    from loom.sim.engine import simulate
    from loom.sim.policies import make_policy
    from loom.sim.truth import BELIEF, Truth, load_truth
    from loom.sim.workloads import at_load, with_spanning

    platform_name, load, spanning, workload, seed, policies, jobs, truth_path, start_s = task
    started = time.perf_counter()
    topology, built = _platform_cached(platform_name)
    gpus = platform_gpus(built)
    truth = BELIEF if truth_path == "belief" else load_truth(truth_path)
    capacity = reference_capacity(built, truth if isinstance(truth, Truth) else None)
    start = start_s if workload not in WORKLOADS else 0.0
    base = grid_trace(
        workload, jobs, seed, topology, truth if isinstance(truth, Truth) else None, start_s=start
    )
    if workload in WITHOUT_GANGS and any(j.spec.workers > 1 for j in base.jobs):
        raise ValueError(f"{workload} was taken to have no gangs (its spanning cells are copies)")
    trace = with_spanning(at_load(base, load, capacity), spanning)
    span = (trace.jobs[-1].arrival_s - trace.jobs[0].arrival_s) if trace.jobs else 0.0
    every = max(60.0, span / 200.0)
    out: dict[str, dict[str, Any]] = {}
    jct_by_job: dict[str, float] | None = None
    jct_by_policy: dict[str, dict[str, float]] = {}
    for name in policies:
        result = simulate(trace, built, make_policy(name, seed), seed=seed, sample_every_s=every, truth=truth)
        window = (trace.jobs[0].arrival_s, trace.jobs[-1].arrival_s) if trace.jobs else None
        out[name] = figures(result, window)
        jct_by_policy[name] = {
            r.job_id: round(jct, 1)
            for r in result.records
            if r.rejected is None and (jct := r.jct_s) is not None
        }
        if name == TARGET:
            jct_by_job = jct_by_policy[name]
    class_jobs = sorted(j.spec.job_id for j in trace.jobs if j.job_class == CLASS)
    return {
        "cell": cell_key(platform_name, load, spanning, workload),
        "seed": seed,
        "jobs": len(trace.jobs),
        "platform_gpus": gpus,
        "reference_capacity_gpus": round(capacity, 1),
        "arrival_span_h": span / 3600.0,
        "wall_s": round(time.perf_counter() - started, 2),
        "policies": out,
        "jct_by_job": jct_by_job,
        "jct_by_policy": jct_by_policy,
        "class_jobs": {CLASS: class_jobs},
    }


_PLATFORMS: dict[str, tuple["Topology", "Platform"]] = {}


def _platform_cached(name: str) -> tuple["Topology", "Platform"]:
    found = _PLATFORMS.get(name)
    if found is None:
        found = _PLATFORMS[name] = grid_platform(name)
    return found


def cell_key(platform: str, load: float, spanning: bool, workload: str) -> str:
    """A cell's name: ``small/0.8/span/philly`` (``nospan`` when spanning is forbidden; a
    topology file's platform and a workload file by their stems)."""
    span = "span" if spanning else "nospan"
    return f"{platform_label(platform)}/{load:g}/{span}/{workload_label(workload)}"


# ---- aggregation --------------------------------------------------------------------------------


def _mean(values: Sequence[float | None]) -> float | None:
    kept = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    return math.fsum(kept) / len(kept) if kept else None


def margin(by_policy: Mapping[str, Mapping[str, Any]], target: str = TARGET) -> dict[str, Any]:
    """Loom's margin over its best baseline on mean JCT: ``(best - loom) / best`` (positive: Loom is
    faster), with the baseline's name; None when Loom or every baseline has no mean JCT, and None
    when a baseline finished more jobs than Loom (``loom_finished_fewer`` names them: Loom's mean
    would leave out jobs theirs includes, so the cell counts as a loss to explain, not a margin).

    Only baselines that finished at least as many jobs as Loom are compared (``not_comparable``
    names the others): a policy that rejects the jobs its rule cannot place (``home_region`` with a
    gang bigger than its home region) would otherwise win by leaving out the longest jobs."""
    mine = by_policy.get(target, {})
    done = mine.get("finished")
    baselines: dict[str, float] = {}
    fewer: list[str] = []
    more: list[str] = []
    for name, f in by_policy.items():
        if name == target or name in BOUNDS or f.get("jct_mean_s") is None:
            continue
        if done is not None and f.get("finished") is not None and f["finished"] < done:
            fewer.append(name)
            continue
        if done is not None and f.get("finished") is not None and f["finished"] > done:
            more.append(name)
        baselines[name] = float(f["jct_mean_s"])
    if mine.get("jct_mean_s") is None or not baselines:
        return {"best_baseline": None, "margin": None, "not_comparable": fewer, "loom_finished_fewer": more}
    if more:
        # Loom's mean would cover fewer (likely shorter) jobs than theirs: no margin, said so.
        return {"best_baseline": None, "margin": None, "not_comparable": fewer, "loom_finished_fewer": more}
    best = min(baselines, key=lambda n: (baselines[n], n))
    value = baselines[best]
    result = (value - float(mine["jct_mean_s"])) / value if value > 0 else None
    return {"best_baseline": best, "margin": result, "not_comparable": fewer, "loom_finished_fewer": more}


def common_jobs_margin(seeds: Sequence[Mapping[str, Any]], target: str = TARGET) -> dict[str, Any]:
    """Loom's margin over each baseline on the jobs both finished (pooled over ``seeds``, from their
    ``jct_by_policy``): ``(sum baseline JCT - sum Loom JCT) / sum baseline JCT``. The mean-JCT
    margin (:func:`margin`) has none when a baseline finished more jobs than Loom (e.g. gangs no
    cluster holds, which Loom rejects when no spread keeps within its GPU-hours bound and the
    baselines spread at any cost); this one compares like with like, and ``common_jobs`` /
    ``baseline_only`` say how many jobs it covers and how many finished only under the baseline.
    ``common_margin`` is the smallest (Loom's worst) over the baselines, ``common_best_baseline``
    which."""
    sums: dict[str, list[float]] = {}
    for run in seeds:
        by = run.get("jct_by_policy") or {}
        mine = by.get(target)
        if mine is None:
            continue
        for name, theirs in by.items():
            if name == target or name in BOUNDS:
                continue
            common = mine.keys() & theirs.keys()
            acc = sums.setdefault(name, [0.0, 0.0, 0.0, 0.0])
            acc[0] += math.fsum(theirs[j] for j in common)
            acc[1] += math.fsum(mine[j] for j in common)
            acc[2] += len(common)
            acc[3] += len(theirs.keys() - mine.keys())
    per = {n: (a[0] - a[1]) / a[0] for n, a in sums.items() if a[0] > 0}
    if not per:
        return {"common_margin": None, "common_best_baseline": None, "common_jobs": 0, "baseline_only": 0}
    worst = min(per, key=lambda n: (per[n], n))
    return {
        "common_margin": per[worst],
        "common_best_baseline": worst,
        "common_jobs": int(sums[worst][2]),
        "baseline_only": int(sums[worst][3]),
    }


def class_margin(
    seeds: Sequence[Mapping[str, Any]],
    job_class: str = CLASS,
    baseline: str = CLASS_BASELINE,
    target: str = TARGET,
) -> dict[str, Any]:
    """Loom's margin over ``baseline`` on one class's jobs (:data:`CLASS`: network-sensitive
    training, against compute-only greedy), pooled over ``seeds`` on the class's jobs both
    finished: ``(sum baseline JCT - sum Loom JCT) / sum baseline JCT`` (positive: Loom faster),
    with the per-seed margins and how many jobs it covers. None where a seed has no such class (a
    workload without it, or a run from before ``class_jobs`` was recorded)."""
    totals = [0.0, 0.0]
    jobs = 0
    per_seed: list[float | None] = []
    for run in seeds:
        members = (run.get("class_jobs") or {}).get(job_class)
        by = run.get("jct_by_policy") or {}
        mine, theirs = by.get(target), by.get(baseline)
        if not members or mine is None or theirs is None:
            continue
        common = [j for j in members if j in mine and j in theirs]
        b, t = math.fsum(theirs[j] for j in common), math.fsum(mine[j] for j in common)
        per_seed.append((b - t) / b if b > 0 else None)
        totals[0] += b
        totals[1] += t
        jobs += len(common)
    if totals[0] <= 0:
        return {"class_margin": None, "class_jobs": 0, "class_margin_per_seed": []}
    return {
        "class_margin": (totals[0] - totals[1]) / totals[0],
        "class": job_class,
        "class_baseline": baseline,
        "class_jobs": jobs,
        "class_margin_per_seed": per_seed,
    }


def contended(cell: str, policies: Mapping[str, Mapping[str, Any]]) -> bool | None:
    """Whether a cell is contended: its load is :data:`CONTENDED_LOAD` or above and jobs wait under
    compute-only greedy (its mean queueing at least :data:`CONTENDED_QUEUE_SHARE` of its mean
    JCT); None without greedy's figures (then only the load can tell)."""
    baseline = policies.get(CLASS_BASELINE) or {}
    jct, queue = baseline.get("jct_mean_s"), baseline.get("queue_mean_s")
    if not jct or queue is None:
        return None
    return float(cell.split("/")[1]) >= CONTENDED_LOAD and queue >= CONTENDED_QUEUE_SHARE * jct


def aggregate(cell: str, seeds: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One cell's line: per policy every figure averaged over ``seeds`` (the runs of :func:`run_seed`),
    Loom's margin from those means and per seed."""
    policies = list(dict.fromkeys(p for s in seeds for p in s["policies"]))
    means = {
        p: {k: _mean([s["policies"][p].get(k) for s in seeds if p in s["policies"]]) for k in FIGURES}
        for p in policies
    }
    per_seed = [margin(s["policies"]) for s in seeds]
    line = {
        "cell": cell,
        "seeds": [s["seed"] for s in seeds],
        "jobs": _mean([s["jobs"] for s in seeds]),
        "platform_gpus": seeds[0]["platform_gpus"] if seeds else None,
        "reference_capacity_gpus": seeds[0].get("reference_capacity_gpus") if seeds else None,
        "policies": means,
        **margin(means),
        **common_jobs_margin(seeds),
        **class_margin(seeds),
        "margin_per_seed": [m["margin"] for m in per_seed],
        "best_baseline_per_seed": [m["best_baseline"] for m in per_seed],
    }
    line["contended"] = contended(cell, means)
    mine = means.get(TARGET, {}).get("jct_mean_s")
    bound = means.get("oracle", {}).get("jct_mean_s")
    if mine is not None and bound:
        line["oracle_gap"] = mine / bound - 1.0
    return line


def spanning_penalty(seeds: Sequence[Mapping[str, Any]], policy: str = TARGET) -> list[dict[str, Any]]:
    """Per (platform, load, workload) run both ways: how much slower ``policy`` (Loom) was with
    spanning allowed than forbidden, over the jobs that finished both ways in the same seed (the
    same trace but for the flag): ``sum(JCT allowed) / sum(JCT forbidden) - 1`` (positive: spanning
    made it slower). ``only_when_allowed`` counts jobs that finished only when they could span (a
    gang bigger than any cluster), ``only_when_forbidden`` the reverse, ``rejected_allowed`` /
    ``rejected_forbidden`` the jobs ``policy`` rejected each way (a gang no cluster holds is rejected
    with spanning forbidden, and also allowed when no spread keeps within the span guard's GPU-hours
    bound), summed over seeds; ``unpaired`` is the ratio of the plain mean JCTs (all jobs that
    finished each way, so different job sets) minus 1."""
    runs = {(s["cell"], s["seed"]): s for s in seeds if s.get("jct_by_job") is not None}
    pooled: dict[str, list[float]] = {}
    for (cell, seed), run in runs.items():
        platform, load, span, workload = cell.split("/")
        other = runs.get((f"{platform}/{load}/nospan/{workload}", seed))
        if span != "span" or other is None:
            continue
        allowed, forbidden = run["jct_by_job"], other["jct_by_job"]
        common = allowed.keys() & forbidden.keys()
        acc = pooled.setdefault(f"{platform}/{load}/{workload}", [0.0] * 9)
        acc[0] += math.fsum(allowed[j] for j in common)
        acc[1] += math.fsum(forbidden[j] for j in common)
        acc[2] += len(common)
        acc[3] += len(allowed.keys() - forbidden.keys())
        acc[4] += math.fsum(allowed.values()) / max(len(allowed), 1)
        acc[5] += math.fsum(forbidden.values()) / max(len(forbidden), 1)
        acc[6] += len(forbidden.keys() - allowed.keys())
        acc[7] += float(run.get("policies", {}).get(policy, {}).get("rejected") or 0)
        acc[8] += float(other.get("policies", {}).get(policy, {}).get("rejected") or 0)
    return [
        {
            "cells": key,
            "policy": policy,
            "penalty": acc[0] / acc[1] - 1.0 if acc[1] > 0 else None,
            "paired_jobs": int(acc[2]),
            "only_when_allowed": int(acc[3]),
            "only_when_forbidden": int(acc[6]),
            "rejected_allowed": int(acc[7]),
            "rejected_forbidden": int(acc[8]),
            "unpaired": acc[4] / acc[5] - 1.0 if acc[5] > 0 else None,
        }
        for key, acc in pooled.items()
    ]


def run_grid(
    spec: GridSpec,
    *,
    processes: int = 1,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run every cell and seed of ``spec`` (over ``processes`` worker processes when above 1) and
    aggregate: ``{"lines": [...], "seeds": [...], "spanning_penalty": [...], ...}``."""
    say = progress or (lambda _s: None)
    truth_notes = _truth_notes(spec)
    cells = set(spec.cells())
    tasks = [
        (
            p,
            load,
            span,
            w,
            seed,
            tuple(spec.policies),
            int(spec.jobs.get(w, FILE_JOBS)),
            spec.truth_path,
            spec.trace_start_s,
        )
        for p, load, span, w in spec.cells()
        for seed in spec.seeds
        # A trace without gangs is the same with spanning allowed: its run is copied, not repeated.
        if not (span and w in WITHOUT_GANGS and (p, load, False, w) in cells)
    ]
    started = time.perf_counter()
    results: list[dict[str, Any]] = []
    if processes > 1 and len(tasks) > 1:
        with multiprocessing.get_context("spawn").Pool(processes) as pool:
            for i, done in enumerate(pool.imap_unordered(run_seed, tasks), 1):
                results.append(done)
                say(f"{i}/{len(tasks)} {done['cell']} seed {done['seed']} ({done['wall_s']:.0f} s)")
    else:
        for i, task in enumerate(tasks, 1):
            done = run_seed(task)
            results.append(done)
            say(f"{i}/{len(tasks)} {done['cell']} seed {done['seed']} ({done['wall_s']:.0f} s)")
    for p, load, span, w in spec.cells():
        if span and w in WITHOUT_GANGS and (p, load, False, w) in cells:
            twin = cell_key(p, load, False, w)
            results += [
                {**r, "cell": cell_key(p, load, True, w), "copied_from": twin}
                for r in results
                if r["cell"] == twin
            ]
    order = {cell_key(*c): i for i, c in enumerate(spec.cells())}
    results.sort(key=lambda r: (order[r["cell"]], r["seed"]))
    lines = []
    for cell in sorted(order, key=order.__getitem__):
        seeds = [r for r in results if r["cell"] == cell]
        if seeds:
            lines.append(aggregate(cell, seeds))
    return {
        "benchmark": "policies",
        "mode": "grid",
        "grid": {**dataclasses.asdict(spec), "jobs": dict(spec.jobs)},
        "lines": lines,
        "spanning_penalty": spanning_penalty(results),
        "seeds": results,
        "timing": {"total_s": round(time.perf_counter() - started, 1), "processes": processes},
        "method": {
            "timed_by": "truth: " + (spec.truth_path or "the packaged tables (loom.sim.truth)")
            if spec.truth_path != "belief"
            else "belief (--truth belief)",
            "aggregate": "per policy, each figure averaged over seeds (p50/p99: the seeds' own, averaged)",
            "margin": "(best baseline mean JCT - loom mean JCT) / best baseline;"
            " oracle is a bound, not a baseline",
            "load": "offered reference-GPU-hours per hour / the platform's reference capacity (GPUs x the"
            " model's median true speed), from the trace's own work",
            **truth_notes,
        },
    }


def _truth_notes(spec: GridSpec) -> dict[str, Any]:
    """What of a ``--truth`` file times nothing on the grid's platforms, warned on stderr before the
    cells run (as a single ``loom bench policies`` run warns): cells of GPU models no platform or
    profile has, and the platforms' GPU models aliased to a GPU no cell measures."""
    if spec.truth_path in (None, "belief"):
        return {}
    from loom.sim.truth import load_truth
    from loom_benchmarks.policies import dangling_aliases, unknown_truth_gpus

    truth = load_truth(spec.truth_path)
    built = [_platform_cached(name)[1] for name in dict.fromkeys(spec.platforms)]
    return {
        "truth_unknown_gpus": unknown_truth_gpus(truth, *built, warn=True),
        "truth_dangling_gpu_aliases": dangling_aliases(truth, *built),
    }


# ---- output -------------------------------------------------------------------------------------


def format_line(line: Mapping[str, Any]) -> str:
    """One cell as one text line: each policy's mean/p50/p99 JCT, queue, util, GPU-h, x-region, cost,
    rejected / unfinished jobs, belief error (``be``: median |predicted / true step - 1|); Loom's margin."""
    from loom.sim.report import fmt_bytes, fmt_duration

    parts = [f"{line['cell']:<34}"]
    for name, f in line["policies"].items():
        util = f["gpu_utilisation_mean"]
        jct = "/".join(fmt_duration(f[k]) for k in ("jct_mean_s", "jct_p50_s", "jct_p99_s"))
        busy = f.get("gpu_utilisation_arrivals")
        parts.append(
            f"{name}: {jct} q {fmt_duration(f['queue_mean_s'])} u {'' if util is None else f'{util:.0%}'}"
            f" ({'' if busy is None else f'{busy:.0%}'})"
            f" {f['gpu_hours'] or 0.0:,.0f}GPUh {fmt_bytes(f['cross_region_bytes'] or 0.0)}"
            f" ${f['cost'] or 0.0:,.0f}"
            + (f" rej {f['rejected']:.0f}" if f.get("rejected") else "")
            + (f" unf {f['unfinished']:.0f}" if f.get("unfinished") else "")
            + (f" be {be:.0%}" if (be := f.get("belief_error_median")) is not None else "")
            + (f" PLUGIN ERRORS {f['plugin_errors']:.0f}" if f.get("plugin_errors") else "")
        )
    m = line.get("margin")
    parts.append(
        "loom margin "
        + ("n/a" if m is None else f"{m:+.1%} vs {line['best_baseline']}")
        + (f"; oracle gap {line['oracle_gap']:+.1%}" if line.get("oracle_gap") is not None else "")
        + (
            f"; not comparable (finished fewer): {', '.join(line['not_comparable'])}"
            if line.get("not_comparable")
            else ""
        )
        + (
            f"; LOOM FINISHED FEWER than {', '.join(line['loom_finished_fewer'])}: no margin"
            if line.get("loom_finished_fewer")
            else ""
        )
        + (
            f"; on jobs both finished {line['common_margin']:+.1%} vs {line['common_best_baseline']}"
            f" ({line['common_jobs']} jobs; {line['baseline_only']} finished only under it)"
            if line.get("common_margin") is not None
            else ""
        )
        + (
            f"; {line['class']} {line['class_margin']:+.1%} vs {line['class_baseline']}"
            f" ({line['class_jobs']} jobs)"
            if line.get("class_margin") is not None
            else ""
        )
    )
    return " | ".join(parts)
