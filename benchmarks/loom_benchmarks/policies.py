"""``loom bench policies``: Loom's placement against the baselines, in the discrete-event simulator.

A platform is built from a topology (:func:`loom.sim.engine.platform_from_topology`: its regions,
measured links and prices, clusters of Alibaba openb nodes, replicated or sampled to ``--nodes``),
a trace from ``--workload``, and the same trace is replayed once per policy of
:data:`loom.sim.policies.POLICIES` (:func:`loom.sim.engine.simulate`, simulated time, seeded).

Workloads:

- ``mix``: the distributed-training mix (:func:`loom.sim.workloads.training_mix`): network-sensitive
  data-parallel training, other training, pipeline models, inference services and DAG pipelines;
- ``alibaba``: the Alibaba GPU trace (:func:`loom.sim.workloads.load_alibaba`): arrivals, sizes and
  GPU model constraints of the openb pods;
- ``philly``: the Philly-like synthetic trace the grid runs (:func:`loom.sim.workloads.philly_like`:
  gangs of 1-16 GPUs, heavy-tailed durations; :data:`PHILLY_JOBS` jobs by default);
- ``scenario``: the seeds' multi-stage scenario (seed 001 §4: preprocessing, training and
  validation across a cheap, high-latency region and a fast, expensive one;
  :mod:`loom.sim.scenarios`);
- a path to a file in the generic workload format, ``.jsonl`` or ``.csv``
  (:func:`loom.sim.workloads.load_workload`; its home and data regions must be the topology's).

Figures (:mod:`loom.sim.metrics`): per policy, overall and per job class, JCT (mean, p50, p99),
queueing delay, makespan, time-weighted GPU utilisation, SCU-hours, cost and cross-region bytes;
Loom's improvement over every other policy; and the issue's must-shows with their numbers and
pass/fail: on a mix, ``net_training`` mean JCT >= 25 % below compute-only greedy with no other class
more than 5 % worse; on the scenario, total time and cost better than the seeds' 23 % and 18 % over
the fixed home region. The report (:func:`loom.sim.report.write_report`: PNG plots and a Markdown
page) goes to ``--out`` (``./loom-report/``), checked before anything is simulated.

On the scenario, "total time" is the makespan of all its pipelines (first arrival to last end),
the seeds' 总耗时, and cost the sum over its jobs. ``--jobs`` counts jobs on every workload (the
mix's DAG units are three jobs each, so it is turned into units; the scenario rounds up to whole
pipelines; a trace file keeps its first N jobs by arrival). The timeline is sampled every
``--sample-every`` simulated seconds (default: the arrival span over 400).

**Truth.** Every job is timed by a truth the scheduler cannot see (:mod:`loom.sim.truth`): by
default the packaged measured tables (Gavel + Lambda); ``--truth FILE`` replays with an operator's
own truth file (the format is documented in :mod:`loom.sim.truth`); ``--truth belief`` times jobs
by the scheduler's own belief, as the simulator did before (kept for comparison). The belief error
(predicted against true step time: median, p90, per GPU model) is reported next to the outcomes.

``--grid``: the evaluation grid (:mod:`loom_benchmarks.grid`): every policy over platforms, loads,
spanning allowed or not, workloads and seeds, timed by truth; one line per cell on stderr, the JSON
on stdout. ``--grid-platforms``, ``--grid-loads``, ``--grid-seeds``, ``--grid-workloads`` and
``--grid-spanning`` run a subset; ``--policies`` and ``--jobs`` (per cell) apply too.

``--scale``: Loom alone on 100,000 nodes and 100,000 jobs of the mix (unless ``--nodes``/``--jobs``
say otherwise), reporting the wall time of building and simulating and the peak RSS against the
issue's target (10 minutes on 2 cores; ``cpu_count`` and ``affinity`` say what this run had). The
target is judged on the total (build and simulate); no report is written unless ``--out`` is given.
"""

import argparse
import importlib.metadata
import json
import os
import platform
import resource
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import numpy as np

if TYPE_CHECKING:
    from loom.model.topology import Topology
    from loom.sim.model import Platform, SimResult, Trace
    from loom_benchmarks.grid import GridSpec

WORKLOADS: Final = ("mix", "alibaba", "philly", "scenario")
PHILLY_JOBS: Final = 200
"""``--workload philly``'s jobs unless ``--jobs`` says otherwise (as many as a grid cell's)."""
TARGET: Final = "loom"
DEFAULT_OUT: Final = Path("loom-report")
SCALE_NODES: Final = 100_000
SCALE_JOBS: Final = 100_000
TARGET_SCALE_S: Final = 600.0
"""The issue's target: 100,000 nodes and 100,000 jobs simulated in at most 10 minutes on 2 cores."""
BELIEF_NAME: Final = "belief"
"""``--truth belief``: time jobs by the scheduler's own belief."""
SAMPLES: Final = 400
"""Timeline samples aimed at over the trace's arrival span (when ``--sample-every`` is not given)."""


class OptionError(ValueError):
    """An option of ``loom bench policies`` that cannot be used."""


@dataclass(frozen=True)
class Options:
    """``loom bench policies``' options, checked and with defaults filled in."""

    workload: str
    topology: str
    jobs: int | None
    """Jobs (workload units for ``mix``, pipelines' jobs for ``scenario``); None: the workload's default."""
    nodes: int | None
    policies: list[str]
    seed: int
    out: Path | None
    scale: bool
    sample_every_s: float | None
    rate_per_h: float | None = None
    """``--rate``: the mix's arrivals per hour; None: the mix's default."""
    truth: str | None = None
    """``--truth``: a truth file, ``belief``, or None for the packaged tables."""
    load: float | None = None
    """``--load``: arrivals spread to offer this share of the platform's reference capacity (None:
    the workload's own arrivals)."""
    trace_gpu: str | None = None
    """``--trace-gpu``: the GPU a public trace's durations were measured on (None: the format's)."""
    trace_start_s: float = 0.0
    """``--trace-start``: a public trace's jobs submitted in its first this many seconds are skipped."""


def parse_policies(text: str | None, known: Sequence[str]) -> list[str]:
    """``"loom, random"`` -> ``["loom", "random"]`` (order kept, repeats dropped); None -> all known."""
    if text is None:
        return list(known)
    names = list(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    if not names:
        raise OptionError("--policies needs at least one policy")
    for name in names:
        if name not in known:
            raise OptionError(f"unknown policy {name!r}; known: {', '.join(known)}")
    return names


def _trace_start_s(args: argparse.Namespace) -> float:
    """``--trace-start`` in seconds (0 when not given); :class:`OptionError` unless >= 0 and finite."""
    seconds = float(getattr(args, "trace_start", None) or 0.0)
    if not (seconds >= 0 and np.isfinite(seconds)):
        raise OptionError(f"--trace-start must be seconds >= 0, got {seconds}")
    return seconds


def _trace_options(args: argparse.Namespace, workload: str) -> tuple[str | None, float]:
    """``--trace-gpu`` and ``--trace-start``, which apply to a trace file only."""
    trace_gpu = getattr(args, "trace_gpu", None)
    if trace_gpu is not None and workload in WORKLOADS:
        raise OptionError(f"--trace-gpu applies to a public trace file, not --workload {workload}")
    if getattr(args, "trace_start", None) and workload in WORKLOADS:
        raise OptionError(f"--trace-start applies to a public trace file, not --workload {workload}")
    return (None if trace_gpu is None else str(trace_gpu)), _trace_start_s(args)


def resolve(args: argparse.Namespace, known: Sequence[str] | None = None) -> Options:
    """Check the options and fill the defaults (``--scale`` changes them: see the module docstring)."""
    if known is None:
        from loom.sim.policies import POLICIES

        known = list(POLICIES)
    workload = str(args.workload)
    if (
        workload not in WORKLOADS
        and not workload.endswith((".jsonl", ".csv"))
        and not Path(workload).is_file()
    ):
        raise OptionError(
            f"--workload {workload!r}: no such file; a workload is one of {', '.join(WORKLOADS)} or a"
            " trace file: the generic format (.jsonl, .csv) or a public trace as published (Alibaba"
            " 2023 pod list, Philly cluster_job_log, Helios / Acme job log, PAI task table)"
        )
    scale = bool(args.scale)
    jobs = args.jobs if args.jobs is not None else (SCALE_JOBS if scale else None)
    nodes = args.nodes if args.nodes is not None else (SCALE_NODES if scale else None)
    if jobs is not None and jobs < 1:
        raise OptionError(f"--jobs must be at least 1, got {jobs}")
    if nodes is not None and nodes < 1:
        raise OptionError(f"--nodes must be at least 1, got {nodes}")
    if args.sample_every is not None and not args.sample_every > 0:
        raise OptionError(f"--sample-every must be positive, got {args.sample_every}")
    rate = getattr(args, "rate", None)
    if rate is not None:
        if workload != "mix":
            raise OptionError(f"--rate applies to --workload mix only, not {workload!r}")
        if not (rate > 0 and np.isfinite(rate)):
            raise OptionError(f"--rate must be a positive number of arrivals per hour, got {rate}")
    truth = getattr(args, "truth", None)
    if truth is not None and truth != BELIEF_NAME and not Path(truth).is_file():
        raise OptionError(f"--truth is a truth file or {BELIEF_NAME!r}, got {truth!r} (no such file)")
    load = getattr(args, "load", None)
    if load is not None and not (load > 0 and np.isfinite(load)):
        raise OptionError(f"--load must be a positive share of the platform's capacity, got {load}")
    if load is not None and workload == "scenario":
        raise OptionError("--load does not apply to --workload scenario (its own two-region platform)")
    trace_gpu, trace_start = _trace_options(args, workload)
    policies = [TARGET] if scale and args.policies is None else parse_policies(args.policies, known)
    out = Path(args.out) if args.out is not None else (None if scale else DEFAULT_OUT)
    return Options(
        workload=workload,
        topology=str(args.topology),
        jobs=None if jobs is None else int(jobs),
        nodes=None if nodes is None else int(nodes),
        policies=policies,
        seed=int(args.seed),
        out=out,
        scale=scale,
        sample_every_s=args.sample_every,
        rate_per_h=None if rate is None else float(rate),
        truth=None if truth is None else str(truth),
        load=None if load is None else float(load),
        trace_gpu=trace_gpu,
        trace_start_s=trace_start,
    )


def command_line(options: Options) -> str:
    """The ``loom bench policies`` command that repeats this run."""
    parts = [
        "loom bench policies",
        f"--workload {options.workload}",
        f"--topology {options.topology}",
        f"--policies {','.join(options.policies)}",
        f"--seed {options.seed}",
    ]
    if options.jobs is not None:
        parts.append(f"--jobs {options.jobs}")
    if options.nodes is not None:
        parts.append(f"--nodes {options.nodes}")
    if options.rate_per_h is not None:
        parts.append(f"--rate {options.rate_per_h:g}")
    if options.sample_every_s is not None:
        parts.append(f"--sample-every {options.sample_every_s:g}")
    if options.truth is not None:
        parts.append(f"--truth {options.truth}")
    if options.load is not None:
        parts.append(f"--load {options.load:g}")
    if options.trace_gpu is not None:
        parts.append(f"--trace-gpu {options.trace_gpu}")
    if options.trace_start_s:
        parts.append(f"--trace-start {options.trace_start_s:g}")
    if options.scale:
        parts.append("--scale")
    if options.out is not None:
        parts.append(f"--out {options.out}")
    return " ".join(parts)


# ---- building and running ---------------------------------------------------------------------


@dataclass
class Workload:
    """What a run replays: the platform, the trace, and what the workload adds about itself."""

    platform: "Platform"
    trace: "Trace"
    about: dict[str, Any]


def mix_units(jobs: int) -> int:
    """The fewest units of the default training mix that make at least ``jobs`` jobs (a DAG unit
    is three jobs, every other unit one)."""
    from loom.sim.workloads import DEFAULT_MIX, apportion

    def jobs_of(units: int) -> int:
        return units + 2 * apportion(units, DEFAULT_MIX)["dag"]

    units = max(1, int(jobs / (1 + 2 * DEFAULT_MIX["dag"] / sum(DEFAULT_MIX.values()))) - 2)
    while jobs_of(units) < jobs:
        units += 1
    while units > 1 and jobs_of(units - 1) >= jobs:
        units -= 1
    return units


def build_workload(options: Options, topology: "Topology") -> Workload:
    """The platform and the trace ``--workload`` names.

    ``mix``, ``alibaba`` and ``philly`` run on ``platform_from_topology(topology, nodes=--nodes)``;
    ``--jobs`` is the mix's job count (the fewest workload units giving at least that many jobs, a
    DAG unit being three: :func:`mix_units`), the number of Alibaba tasks kept (the packaged sample
    holds 2,000) or the Philly-like trace's jobs (:data:`PHILLY_JOBS` by default). ``scenario``
    brings its own two-region platform (``--nodes`` does not apply) and ``--jobs`` is its job count
    rounded up to whole three-stage pipelines. A trace file keeps its
    first ``--jobs`` jobs by arrival (:func:`loom.sim.workloads.first_jobs` for the generic format;
    its events must name the platform's clusters and the topology's regions).
    """
    from loom.sim.engine import platform_from_topology

    if options.workload == "scenario":
        from loom.sim.scenarios import multi_stage_scenario

        if options.jobs is None:
            scenario = multi_stage_scenario(topology=topology, seed=options.seed)
        else:
            pipelines = -(-options.jobs // 3)
            scenario = multi_stage_scenario(topology=topology, seed=options.seed, pipelines=pipelines)
        about = {
            "scenario": scenario.name,
            "description": scenario.description,
            "fixed_region": scenario.fixed_region,
            "region_roles": dict(scenario.region_roles),
            "seeds_reduction": {"time": scenario.seeds_time_reduction, "cost": scenario.seeds_cost_reduction},
        }
        if options.nodes is not None:
            about["nodes_ignored"] = "the scenario brings its own two-region platform"
        return Workload(scenario.platform, scenario.trace, about)
    built = _with_gpus(platform_from_topology(topology, nodes=options.nodes, seed=options.seed), options)
    if options.workload == "mix":
        from loom.sim.workloads import DEFAULT_ARRIVAL_RATE_PER_H, training_mix

        rate = options.rate_per_h if options.rate_per_h is not None else DEFAULT_ARRIVAL_RATE_PER_H
        mix_about: dict[str, Any] = {"arrival_rate_per_h": rate}
        if options.jobs is None:
            trace = training_mix(topology=topology, seed=options.seed, arrival_rate_per_h=rate)
            return Workload(built, trace, mix_about)
        units = mix_units(options.jobs)
        trace = training_mix(topology=topology, jobs=units, seed=options.seed, arrival_rate_per_h=rate)
        return Workload(built, trace, {**mix_about, "mix_units": units})
    if options.workload == "philly":
        from loom.sim.workloads import philly_like

        jobs = options.jobs if options.jobs is not None else PHILLY_JOBS
        return Workload(built, philly_like(jobs, options.seed, topology=topology), {})
    if options.workload == "alibaba":
        from loom.sim.workloads import load_alibaba

        return Workload(built, load_alibaba(topology=topology, limit=options.jobs, seed=options.seed), {})
    from loom.sim.public_traces import load_public, sniff_format
    from loom.sim.truth import load_truth
    from loom.sim.workloads import check_trace, load_workload

    regions = {r.id for r in topology.regions}
    fmt = sniff_format(options.workload)
    if options.trace_start_s and fmt is None:
        raise OptionError(
            f"--trace-start applies to a public trace, not to {options.workload} (the generic format)"
        )
    if options.trace_gpu is not None and fmt in (None, "openb"):
        raise OptionError(
            f"--trace-gpu applies to a Philly, Helios / Acme or PAI trace, not to {options.workload}"
            f" ({fmt or 'the generic format'})"
        )
    if fmt is None:
        trace = load_workload(
            Path(options.workload), regions=regions, clusters=set(built.clusters), limit=options.jobs
        )
    else:  # told once, here: read as that format
        trace = load_public(
            Path(options.workload),
            fmt,
            topology=topology,
            limit=options.jobs,
            seed=options.seed,
            start_s=options.trace_start_s,
            trace_gpu=options.trace_gpu,
            truth=None if options.truth in (None, BELIEF_NAME) else load_truth(options.truth),
            models={n.gpu_model for n in built.nodes if n.gpu_model},  # --nodes may sample some out
        )
    check_trace(
        trace,
        where=str(options.workload),
        regions=regions,
        clusters=set(built.clusters),
        models={n.gpu_model for n in built.nodes if n.gpu_model},
    )
    return Workload(built, trace, {"path": options.workload, "format": fmt or "generic"})


def _with_gpus(built: "Platform", options: Options) -> "Platform":
    """``built``, refused when it has no GPU (every job would end "unfinished", exit 0)."""
    if not any(n.gpu_model and n.gpus_total for n in built.nodes):
        raise OptionError(f"the topology {options.topology} has no GPUs: nothing could run on it")
    return built


def at_option_load(workload: Workload, options: Options, truth: object) -> Workload:
    """``workload`` with its arrivals spread to ``--load`` of the platform's reference capacity (the
    grid's rule: :func:`loom_benchmarks.grid.reference_capacity`, by ``truth``'s speeds unless it
    times by belief); unchanged without ``--load``."""
    if options.load is None:
        return workload
    from loom.sim.truth import Truth
    from loom.sim.workloads import at_load
    from loom_benchmarks.grid import reference_capacity

    capacity = reference_capacity(workload.platform, truth if isinstance(truth, Truth) else None)
    about = {**workload.about, "load": {"share": options.load, "reference_capacity_gpus": round(capacity, 1)}}
    return Workload(workload.platform, at_load(workload.trace, options.load, capacity), about)


def sample_every_s(trace: "Trace", options: Options) -> float:
    """``--sample-every``, or the trace's arrival span over :data:`SAMPLES` (at least 1 s)."""
    if options.sample_every_s is not None:
        return options.sample_every_s
    if not trace.jobs:
        return 60.0
    span = trace.jobs[-1].arrival_s - trace.jobs[0].arrival_s
    return max(1.0, span / SAMPLES)


def _peak_rss_mib() -> float:
    # ru_maxrss is in KiB on Linux, bytes on macOS.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / (1024 * 1024 if sys.platform == "darwin" else 1024), 1)


def _platform_figures(built: "Platform") -> dict[str, Any]:
    gpus = Counter[str]()
    for node in built.nodes:
        if node.gpu_model:
            gpus[node.gpu_model] += node.gpus_total
    return {
        "name": built.name,
        "nodes": len(built.nodes),
        "clusters": len(built.clusters),
        "regions": len({c.region for c in built.clusters.values()}),
        "gpus": sum(gpus.values()),
        "gpus_by_model": dict(sorted(gpus.items())),
    }


def _trace_figures(trace: "Trace") -> dict[str, Any]:
    classes = Counter(j.job_class for j in trace.jobs)
    return {
        "source": trace.source,
        "jobs": len(trace.jobs),
        "events": len(trace.events),
        "jobs_by_class": dict(sorted(classes.items())),
        "arrival_span_s": (trace.jobs[-1].arrival_s - trace.jobs[0].arrival_s) if trace.jobs else 0.0,
    }


def headline(summary: dict[str, Any]) -> dict[str, Any]:
    """A policy's few figures worth a glance."""
    o = summary["overall"]
    net = summary["by_class"].get("net_training", {})
    return {
        "finished": o["finished"],
        "jobs": o["jobs"],
        "jct_mean_s": o["jct_mean_s"],
        "jct_p99_s": o["jct_p99_s"],
        "net_training_jct_mean_s": net.get("jct_mean_s"),
        "queue_mean_s": o["queue_mean_s"],
        "makespan_s": o["makespan_s"],
        "gpu_utilisation_mean": o["gpu_utilisation_mean"],
        "cost": o["cost"],
        "cross_region_bytes": o["cross_region_bytes"],
        "belief_error_median": summary["belief_error"]["median"],
        "belief_error_p90": summary["belief_error"]["p90"],
    }


def comparison_baseline(options: Options) -> str | None:
    """Whom Loom is compared with first: the fixed home region on the scenario, compute-only greedy
    otherwise; the first other policy run when that one was not; None when Loom was not run."""
    if TARGET not in options.policies:
        return None
    preferred = "home_region" if options.workload == "scenario" else "greedy_compute"
    if preferred in options.policies:
        return preferred
    return next((p for p in options.policies if p != TARGET), None)


def environment(load_before: float) -> dict[str, Any]:
    """Where the figures were taken."""
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "numpy": np.__version__,
        # The installed version, without importing it (its import would count in the peak RSS).
        "matplotlib": importlib.metadata.version("matplotlib"),
        "cpu_count": os.cpu_count(),
        "affinity": affinity,
        "load_average_1m": {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2)},
        "machine": platform.machine(),
        "peak_rss_mib": _peak_rss_mib(),
    }


def run(args: argparse.Namespace, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Build, simulate every policy, summarise, check the claims, write the report; the JSON result."""
    from loom.model.topology import load_topology
    from loom.sim import metrics
    from loom.sim.engine import simulate
    from loom.sim.policies import POLICIES
    from loom.sim.truth import BELIEF, load_truth

    say = progress or (lambda _s: None)
    options = resolve(args, list(POLICIES))
    if options.out is not None:
        from loom.sim.report import check_report_folder

        check_report_folder(options.out)  # before simulating, not after: a bad --out loses nothing
    truth = BELIEF if options.truth == BELIEF_NAME else load_truth(options.truth)
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    say(f"building the platform and the {options.workload} workload")
    topology = load_topology(options.topology)
    workload = at_option_load(build_workload(options, topology), options, truth)
    built, trace = workload.platform, workload.trace
    build_s = time.perf_counter() - started
    every_s = sample_every_s(trace, options)
    unused = _warn_of_unknowns(truth, built, trace, options.workload)
    results: list[SimResult] = []
    runs: list[dict[str, Any]] = []
    for i, name in enumerate(options.policies):
        say(f"simulating {name} ({i + 1} of {len(options.policies)}) over {len(trace.jobs):,} jobs")
        t0 = time.perf_counter()
        result = simulate(
            trace, built, POLICIES[name](options.seed), seed=options.seed, sample_every_s=every_s, truth=truth
        )
        wall_s = time.perf_counter() - t0
        results.append(result)
        runs.append(
            {
                "policy": name,
                "wall_s": round(wall_s, 3),
                "engine_wall_s": round(result.wall_s, 3),
                "decisions": result.decisions,
                "peak_rss_mib": result.peak_rss_mib,
                "plugin_errors": result.plugin_errors,
                "notes": list(result.notes),
            }
        )
    total_s = time.perf_counter() - started
    say("summarising")
    summaries = _with_arrival_utilisation([metrics.summarize(r) for r in results], results, trace)
    baseline = comparison_baseline(options)
    comparison = metrics.compare(results, baseline=baseline, target=TARGET) if baseline else None
    if TARGET not in options.policies:
        claims = None
    elif options.workload == "scenario":
        claims = metrics.check_claims(scenario=results, target=TARGET)
    elif options.workload == "mix":  # the claim is about the training mix, not any workload's classes
        claims = metrics.check_claims(mix=results, target=TARGET)
    else:
        claims = metrics.check_claims(target=TARGET)
    out: dict[str, Any] = {
        "benchmark": "policies",
        "mode": "scale" if options.scale else "compare",
        "headline": {s["policy"]: headline(s) for s in summaries},
        "targets": {
            "net_training_jct_improvement_vs_greedy_compute": metrics.NET_JCT_REQUIRED,
            "other_class_jct_worse_at_most": metrics.OTHER_CLASS_WORSE_MAX,
            "scenario_time_improvement_vs_home_region_above": metrics.SCENARIO_TIME_REQUIRED,
            "scenario_cost_improvement_vs_home_region_above": metrics.SCENARIO_COST_REQUIRED,
            "scale_wall_s": TARGET_SCALE_S,
            "source": "issue 6, must show; the scenario's figures from seed 001 §4",
        },
        "claims": claims,
        "comparison": comparison,
        "summaries": summaries,
        "runs": runs,
        "platform": _platform_figures(built),
        "workload": {"name": options.workload, **_trace_figures(trace), **workload.about},
        "method": {
            "simulated": "loom.sim.engine.simulate: discrete events in simulated time, one run per policy "
            "over the same trace and platform, seeded",
            "policies": options.policies,
            "seed": options.seed,
            "topology": options.topology,
            "nodes_asked": options.nodes,
            "jobs_asked": options.jobs,
            "sample_every_s": every_s,
            "truth_unknown_gpus": unused,
            "truth_dangling_gpu_aliases": dangling_aliases(truth, built),
            "truth": (
                "belief: jobs timed by the scheduler's own belief (profiles x what it learned)"
                if options.truth == BELIEF_NAME
                else f"truth file {options.truth or '(packaged) Gavel + Lambda tables'}: jobs timed by "
                "measured throughput the scheduler cannot see (loom.sim.truth)"
            ),
            "jct": "arrival to end, finished jobs only; rejected and unfinished counted apart",
            "improvement": "(other - loom) / other; mean JCT also paired over jobs finished under both",
        },
        "timing": {
            "build_s": round(build_s, 3),
            "total_s": round(total_s, 3),
        },
        "report": None,
        "environment": environment(load_before),
    }
    if options.scale:
        out["scale"] = {
            "nodes": len(built.nodes),
            "jobs": len(trace.jobs),
            "total_s": round(total_s, 3),
            "simulate_s": round(sum(r["wall_s"] for r in runs), 3),
            "peak_rss_mib": _peak_rss_mib(),
            "target_s": TARGET_SCALE_S,
            "meets_target": total_s <= TARGET_SCALE_S,
            "cores": out["environment"]["affinity"] or out["environment"]["cpu_count"],
            "target_cores": 2,
        }
    if options.out is not None:
        from loom.sim.report import write_report

        say(f"writing the report to {options.out}")
        page = write_report(
            results,
            options.out,
            title=f"Loom against the baselines: {options.workload} on {options.topology}",
            context={
                "workload": f"{options.workload} ({len(trace.jobs):,} jobs; {trace.source})",
                "platform": f"{built.name}: {len(built.nodes):,} nodes, {len(built.clusters):,} clusters, "
                f"{out['platform']['gpus']:,} GPUs in {out['platform']['regions']} regions",
                "policies": ", ".join(options.policies),
                "seed": options.seed,
                "timed by": options.truth or "truth (packaged Gavel + Lambda tables)",
                "command": command_line(options),
            },
            claims=claims,
            comparison=comparison,
        )
        out["report"] = str(page)
    return out


def _with_arrival_utilisation(
    summaries: list[dict[str, Any]], results: "list[SimResult]", trace: "Trace"
) -> list[dict[str, Any]]:
    """``summaries`` with utilisation while jobs arrive too (the grid's figure): over the whole run
    a finite trace of long jobs drains for hours after its last arrival, so "load 1.0" read 7 %."""
    from loom.sim import metrics

    first = min((j.arrival_s for j in trace.jobs), default=0.0)
    last = max((j.arrival_s for j in trace.jobs), default=0.0)
    for summary, r in zip(summaries, results, strict=True):
        window = [x for x in r.timeline if first <= x.t_s <= last]
        # Jobs that all arrive at once have no arrival window: the run's figure stands for it.
        busy = metrics.mean_utilisation(window) if last > first else None
        summary["overall"]["gpu_utilisation_arrivals"] = (
            busy if busy is not None else summary["overall"].get("gpu_utilisation_mean")
        )
    return summaries


def unknown_truth_gpus(truth: object, *platforms: "Platform", warn: bool = False) -> list[str]:
    """GPU models the truth file measured that neither the platforms nor the profile library has
    (so no job is ever timed by them): a misspelt name, whose cells would otherwise be dropped
    without a word. With ``warn``, also said on stderr whatever the output format, with the
    platforms' GPU models the file aliases to a GPU no cell measures (:func:`dangling_aliases`)."""
    from loom.model.profiles import library_models
    from loom.sim.truth import Truth

    if not isinstance(truth, Truth):
        return []
    on_platforms = {n.gpu_model.upper() for built in platforms for n in built.nodes if n.gpu_model}
    known = {m.upper() for m in library_models()} | on_platforms | {k.upper() for k in truth.gpu_aliases}
    unused = sorted({c.gpu_model for c in truth.cells} - known)
    if unused and warn:
        print(
            f"warning: the truth file's cells for GPU model(s) {', '.join(unused)} match no GPU of the"
            " platform or of the profile library: they time nothing (a typo?)",
            file=sys.stderr,
        )
    dangling = dangling_aliases(truth, *platforms)
    if dangling and warn:
        named = ", ".join(f"{k} -> {v}" for k, v in dangling.items())
        print(
            f"warning: the truth file aliases the platform's GPU model(s) {named}, which no cell"
            " measures: those GPUs are timed by the derivation rules as unknown ones (a typo?)",
            file=sys.stderr,
        )
    return unused


def _warn_of_unknowns(truth: object, built: "Platform", trace: "Trace", workload: str) -> list[str]:
    """Warn on stderr of the truth file's GPU models nothing has (returned) and, for a trace file,
    of its jobs' model labels the truth does not know."""
    unused = unknown_truth_gpus(truth, built, warn=True)
    if workload not in WORKLOADS:
        unknown_model_labels(truth, trace, warn=True)
    return unused


def unknown_model_labels(truth: object, trace: "Trace", warn: bool = False) -> dict[str, int]:
    """The ``labels.family`` / ``labels.model`` values of a trace's jobs that the truth file does not
    know (nor alias), with how many jobs name each: such a job is timed as one of the file's
    families chosen by a seeded hash (rule ``family-by-hash``), so a misspelt model ("resnet-5O")
    gets some other model's speeds. With ``warn``, said on stderr whatever the output format
    (before, only the JSON's ``truth_rules`` counted them; an outside evaluator's typo went
    unnoticed)."""
    from loom.model.family import job_family
    from loom.sim.truth import Truth

    if not isinstance(truth, Truth):
        return {}
    named: dict[str, int] = {}
    for job in trace.jobs:
        spec = job.spec
        name = spec.labels.get("family") or spec.labels.get("model") or ""
        # As the simulator resolves it (an alias counts only when it names a family of the table).
        if name and "family-by-hash" in truth.resolve_family(job_family(spec), task_type=spec.task_type)[2]:
            named[name] = named.get(name, 0) + 1
    if named and warn:
        listed = ", ".join(
            f"{name!r} ({count} job{'s' if count > 1 else ''})" for name, count in sorted(named.items())
        )
        print(
            f"warning: the trace names model(s) the truth file does not know: {listed}; each such job is"
            " timed as one of its families chosen by hash (truth rule family-by-hash): a typo?",
            file=sys.stderr,
        )
    return named


def dangling_aliases(truth: object, *platforms: "Platform") -> dict[str, str]:
    """The platforms' GPU models the truth file's ``gpu_aliases`` send to a GPU no cell measures
    (alias -> target): a typo there ("A1000") timed every job on them at the reference speed."""
    from loom.sim.truth import Truth

    if not isinstance(truth, Truth):
        return {}
    on_platforms = {n.gpu_model.upper() for built in platforms for n in built.nodes if n.gpu_model}
    return {k: v for k, v in truth.dangling_gpu_aliases().items() if k.upper() in on_platforms}


# ---- output -----------------------------------------------------------------------------------


def _rules_and_rejections(summaries: list[dict[str, Any]]) -> list[str]:
    """Per policy: how the truth timed its jobs (when not all measured), and why jobs were rejected."""
    lines = []
    for s in summaries:
        rules = s["belief_error"].get("truth_rules") or {}
        if rules and set(rules) != {"measured"}:
            lines.append(f"{s['policy']}: jobs timed by " + ", ".join(f"{k} {v:,}" for k, v in rules.items()))
        lines.extend(
            f"{s['policy']}: {n:,} rejected: {why}"
            for why, n in (s["overall"].get("rejected_reasons") or {}).items()
        )
    return lines


def _rejections_by_reason(summaries: list[dict[str, Any]]) -> list[str]:
    """Each rejection reason once, with the policies that rejected for it (one line for a job every
    policy rejected, rather than one per policy)."""
    by_reason: dict[tuple[str, int], list[str]] = {}
    for s in summaries:
        for why, n in (s["overall"].get("rejected_reasons") or {}).items():
            by_reason.setdefault((why, n), []).append(s["policy"])
    every = len(summaries)
    return [
        f"{'every policy' if len(names) == every else ', '.join(names)}: {n:,} rejected: {why}"
        for (why, n), names in by_reason.items()
    ]


def print_table(result: dict[str, Any]) -> None:
    """The summary table, the claims and (with ``--scale``) the scale figures, on stderr."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    from loom.sim.report import fmt_bytes, fmt_duration, fmt_share, summary_rows

    console = Console(stderr=True)
    if not console.is_terminal:
        # Redirected to a file: rich would assume 80 columns and cut the figures.
        console = Console(stderr=True, width=120)
    workload = result["workload"]
    table = Table(
        title=f"policies on {workload['name']} ({workload['jobs']:,} jobs), "
        f"{result['platform']['nodes']:,} nodes, seed {result['method']['seed']}",
        caption="JCT: arrival to end (finished jobs); queue: arrival to start; util: time-weighted over"
        " the run, util arr.: while jobs arrive; all figures in the report",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    columns = (
        ("done", "finished", lambda v: f"{v:,}"),
        ("rejected", "rejected", lambda v: f"{v:,}"),
        ("unfinished", "unfinished", lambda v: f"{v:,}"),
        ("mean JCT", "jct_mean_s", fmt_duration),
        ("p99 JCT", "jct_p99_s", fmt_duration),
        ("queue", "queue_mean_s", fmt_duration),
        ("util", "gpu_utilisation_mean", fmt_share),
        ("util arr.", "gpu_utilisation_arrivals", fmt_share),
        ("cost $", "cost", lambda v: f"{v:,.0f}"),
        ("x-region", "cross_region_bytes", fmt_bytes),
    )
    table.add_column("policy", no_wrap=True)
    for header, _, _ in columns:
        table.add_column(header, justify="right", no_wrap=True)
    for row in summary_rows(result["summaries"], columns):
        table.add_row(*row)
    console.print(table)
    classes = list(dict.fromkeys(c for s in result["summaries"] for c in s["by_class"]))
    if len(classes) > 1:
        by_class = Table(title="mean JCT by job class", box=box.SIMPLE_HEAD, pad_edge=False)
        by_class.add_column("policy", no_wrap=True)
        for c in classes:
            by_class.add_column(c, justify="right", no_wrap=True)
        for s in result["summaries"]:
            by_class.add_row(
                s["policy"], *(fmt_duration(s["by_class"].get(c, {}).get("jct_mean_s")) for c in classes)
            )
        console.print(by_class)
    timed_by = result["method"]["truth"].split(":")[0]
    errors = Table(
        title=f"belief error: |predicted / true - 1| of step time ({timed_by})",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    for header in ("policy", "jobs", "median", "p90", "bias", "worst GPU model (median)"):
        errors.add_column(header, justify="left" if header == "policy" else "right", no_wrap=True)
    for s in result["summaries"]:
        e = s["belief_error"]
        models = [(g["median"], m) for m, g in e["by_gpu_model"].items() if g["median"] is not None]
        worst = max(models, default=None)
        errors.add_row(
            s["policy"],
            f"{e['jobs']:,}",
            fmt_share(e["median"]),
            fmt_share(e["p90"]),
            "-" if e["bias"] is None else f"{e['bias']:.3f}",
            "-" if worst is None else f"{worst[1]} {fmt_share(worst[0])}",
        )
    console.print(errors)
    for line in _rules_and_rejections(result["summaries"]):
        console.print(line)
    claims = result.get("claims")
    if claims:
        for name, check in claims["checks"].items():
            console.print(_claim_line(name, check))
    scale = result.get("scale")
    if scale:
        met = "[green]met[/green]" if scale["meets_target"] else "[red]missed[/red]"
        console.print(
            f"scale: {scale['nodes']:,} nodes, {scale['jobs']:,} jobs in {scale['total_s']:,.1f} s "
            f"(simulate {scale['simulate_s']:,.1f} s) on {scale['cores']} cores; target "
            f"{scale['target_s']:.0f} s on {scale['target_cores']}: {met}; "
            f"peak RSS {scale['peak_rss_mib']:,.0f} MiB"
        )
    env = result["environment"]
    console.print(
        f"Python {env['python']}, {env['cpu_count']} CPUs (load {env['load_average_1m']['before']:g} -> "
        f"{env['load_average_1m']['after']:g}), peak RSS {env['peak_rss_mib']:,.0f} MiB"
        + (f"; report: {result['report']}" if result["report"] else "")
    )


def _claim_line(name: str, check: dict[str, Any]) -> str:
    """One claim check as a line: its verdict, the claim, and the figures it was judged on."""
    from loom.sim.report import fmt_share

    verdict = check["passed"]
    mark = "not run" if verdict is None else ("[green]pass[/green]" if verdict else "[red]FAIL[/red]")
    detail = check.get("reason", "")
    if "net_training_improvement" in check:
        worst = check["worst_other_class"]
        # Improvements: + is a lower mean JCT under Loom (faster), - a higher one.
        detail = f"net_training {fmt_share(check['net_training_improvement'], signed=True)} faster" + (
            f", worst other class {worst['class']} {fmt_share(worst['improvement'], signed=True)} faster"
            if worst
            else ""
        )
        failed = [c for c, v in check["classes"].items() if not v["passed"]]
        if failed:
            detail += f"; failed by {', '.join(failed)}"
    elif "time_improvement" in check:
        detail = (
            f"time {fmt_share(check['time_improvement'], signed=True)}, "
            f"cost {fmt_share(check['cost_improvement'], signed=True)}"
        )
    return f"{name}: {mark} ({check['claim']}): {detail}"


def _seed_list(seeds: Sequence[int]) -> str:
    """The seeds as the grid's header names them: a run of consecutive seeds as ``first-last``
    (``--grid-seeds 60`` is sixty seeds, 0-59, not seed 60: the header says so)."""
    if len(seeds) > 2 and list(seeds) == list(range(seeds[0], seeds[0] + len(seeds))):
        return f"seeds {seeds[0]}-{seeds[-1]}"
    return "seeds " + ", ".join(str(s) for s in seeds)


def _csv_list(text: str | None, option: str) -> list[str] | None:
    if text is None:
        return None
    items = [part.strip() for part in text.split(",") if part.strip()]
    if not items:
        raise OptionError(f"{option} needs at least one value")
    return list(dict.fromkeys(items))


def _grid_platforms(text: str | None) -> tuple[str, ...] | None:
    """``--grid-platforms``: grid platforms, sized or not (:func:`loom_benchmarks.grid.parse_platform`);
    None when not given."""
    from loom_benchmarks import grid

    platforms = _csv_list(text, "--grid-platforms")
    if platforms is None:
        return None
    for name in platforms:
        try:
            grid.parse_platform(name)
        except ValueError as exc:
            raise OptionError(f"--grid-platforms: {exc}") from None
        if ":" in name or grid.is_platform_file(name):
            try:
                # A size its regions cannot give, or a file that is not a topology: before any cell runs.
                grid.grid_topology(name)
            except ValueError as exc:
                raise OptionError(f"--grid-platforms: {exc}") from None
    labels = [grid.platform_label(name) for name in platforms]
    if len(set(labels)) < len(labels):
        raise OptionError(f"--grid-platforms: two platforms would share a cell name: {', '.join(platforms)}")
    return tuple(platforms)


def _grid_loads(text: str | None) -> tuple[float, ...] | None:
    """``--grid-loads``: positive numbers; None when not given."""
    loads = _csv_list(text, "--grid-loads")
    if loads is None:
        return None
    try:
        values = tuple(float(v) for v in loads)
    except ValueError:
        raise OptionError(f"--grid-loads are numbers, got {text!r}") from None
    if not all(v > 0 and np.isfinite(v) for v in values):
        raise OptionError(f"--grid-loads must be positive, got {text!r}")
    return values


def _grid_seeds(text: str | None) -> tuple[int, ...] | None:
    """``--grid-seeds``: a count (``5``: seeds 0-4) or a list of seeds (``0,1``); None when not given."""
    seeds = _csv_list(text, "--grid-seeds")
    if seeds is None or text is None:
        return None
    try:
        numbers = [int(v) for v in seeds]
    except ValueError:
        raise OptionError(f"--grid-seeds are integers, got {text!r}") from None
    one_count = len(numbers) == 1 and "," not in text
    if one_count and numbers[0] < 1:
        raise OptionError(f"--grid-seeds must be a positive count or a list of seeds, got {numbers[0]}")
    return tuple(range(numbers[0])) if one_count else tuple(numbers)


def _grid_workloads(text: str | None) -> tuple[str, ...] | None:
    """``--grid-workloads``: named workloads or trace files (told apart in cells by their stems)."""
    from loom_benchmarks import grid

    workloads = _csv_list(text, "--grid-workloads")
    if workloads is None:
        return None
    unknown = [w for w in workloads if w not in grid.WORKLOADS and not Path(w).is_file()]
    if unknown:
        raise OptionError(
            f"unknown --grid-workloads {unknown}; known: {', '.join(grid.WORKLOADS)}, or a trace file"
        )
    labels = [grid.workload_label(w) for w in workloads]
    if len(set(labels)) != len(labels):
        raise OptionError(f"--grid-workloads names two workloads alike: {labels}")
    return tuple(workloads)


def _grid_inputs(args: argparse.Namespace, workloads: Sequence[str]) -> dict[str, Any]:
    """The grid's ``truth_path`` (``--truth``) and ``trace_start_s`` (``--trace-start``: seconds
    >= 0, and some workload must be a trace file), where given."""
    from loom_benchmarks import grid

    fields: dict[str, Any] = {}
    truth = getattr(args, "truth", None)
    if truth is not None:
        fields["truth_path"] = str(truth)
    seconds = _trace_start_s(args)
    if seconds:
        if all(w in grid.WORKLOADS for w in workloads):
            raise OptionError("--trace-start applies to a trace file in --grid-workloads, and none is given")
        fields["trace_start_s"] = seconds
    return fields


def grid_spec(args: argparse.Namespace, known: Sequence[str] | None = None) -> "GridSpec":
    """The grid ``--grid-*`` (and ``--policies``, ``--jobs``) ask for; :class:`OptionError` if not valid."""
    from loom_benchmarks import grid

    known = list(known) if known is not None else list(grid.GRID_POLICIES)
    # The single run's options: the grid takes its own (--grid-*). They were ignored in silence
    # (`--grid --topology mine.json` ran the packaged platforms; an outside walk).
    # Given on the command line (`loom` notes what it said: `--seed 7` too), or differing from
    # the default where that is not known (a parser of its own, as the tests build).
    given = set(getattr(args, "given", None) or ())
    ignored = [
        flag
        for flag, value, default in (
            ("--workload", getattr(args, "workload", "mix"), "mix"),
            ("--topology", getattr(args, "topology", "default"), "default"),
            ("--nodes", getattr(args, "nodes", None), None),
            ("--seed", getattr(args, "seed", 7), 7),
            ("--rate", getattr(args, "rate", None), None),
            ("--load", getattr(args, "load", None), None),
            ("--trace-gpu", getattr(args, "trace_gpu", None), None),
            ("--scale", getattr(args, "scale", False), False),
            ("--out", getattr(args, "out", None), None),
            ("--sample-every", getattr(args, "sample_every", None), None),
        )
        if flag in given or value != default
    ]
    if ignored:
        raise OptionError(
            f"--grid does not take {', '.join(ignored)}: it runs --grid-platforms (NAME or NAME:GPUS)"
            " x --grid-loads x --grid-seeds x --grid-workloads (names or trace files)"
        )
    fields: dict[str, Any] = {}
    platforms = _grid_platforms(args.grid_platforms)
    if platforms is not None:
        fields["platforms"] = platforms
    loads = _grid_loads(args.grid_loads)
    if loads is not None:
        fields["loads"] = loads
    seeds = _grid_seeds(args.grid_seeds)
    if seeds is not None:
        fields["seeds"] = seeds
    workloads = _grid_workloads(args.grid_workloads)
    if workloads is not None:
        fields["workloads"] = workloads
        # a trace file's jobs per cell, shown with the named workloads' (--jobs overrides both)
        files = [w for w in workloads if w not in grid.WORKLOADS]
        fields["jobs"] = {**grid.CELL_JOBS, **dict.fromkeys(files, grid.FILE_JOBS)}
    spanning = _csv_list(getattr(args, "grid_spanning", None), "--grid-spanning")
    if spanning is not None:
        ways = {"allowed": True, "forbidden": False}
        unknown = [w for w in spanning if w not in ways]
        if unknown:
            raise OptionError(f"unknown --grid-spanning {unknown}; known: allowed, forbidden")
        fields["spanning"] = tuple(ways[w] for w in spanning)
    if args.policies is not None:
        fields["policies"] = tuple(parse_policies(args.policies, known))
    if args.jobs is not None:
        if args.jobs < 1:
            raise OptionError(f"--jobs must be at least 1, got {args.jobs}")
        fields["jobs"] = dict.fromkeys((*grid.WORKLOADS, *fields.get("workloads", ())), int(args.jobs))
    fields.update(_grid_inputs(args, fields.get("workloads", grid.WORKLOADS)))
    if getattr(args, "grid_processes", 2) < 1:
        raise OptionError("--grid-processes must be at least 1")
    return grid.GridSpec(**fields)


def run_grid_command(args: argparse.Namespace) -> int:
    """``loom bench policies --grid``: progress and one line per cell on stderr, the JSON on stdout."""
    from rich.console import Console

    from loom.errors import InvalidInputError
    from loom_benchmarks import grid

    console = Console(stderr=True, width=400)
    try:
        spec = grid_spec(args)
        cells = spec.cells()
        console.print(
            f"grid: {len(cells)} cells x {len(spec.seeds)} seeds ({_seed_list(spec.seeds)})"
            f" x {len(spec.policies)} policies,"
            f" jobs per cell {dict(spec.jobs)} (a file: its first that many, or all it has),"
            f" {args.grid_processes} processes"
        )
        result = grid.run_grid(spec, processes=args.grid_processes, progress=console.print)
    except (OptionError, InvalidInputError) as exc:
        console.print(str(exc), style="red", markup=False, highlight=False, soft_wrap=True)
        return 2
    print(json.dumps(result, indent=2))
    sys.stdout.flush()
    for line in result["lines"]:
        console.print(grid.format_line(line), markup=False, highlight=False, soft_wrap=True)
    for item in result["spanning_penalty"]:
        paired, unpaired = item["penalty"], item["unpaired"]
        console.print(
            f"loom, spanning allowed vs forbidden, {item['cells']}: "
            + ("n/a" if paired is None else f"{paired:+.1%}")
            + f" over {item['paired_jobs']} jobs finished both ways; {item['only_when_allowed']} finished"
            f" only when allowed, {item.get('only_when_forbidden', 0)} only when forbidden; rejected"
            f" {item.get('rejected_allowed', 0)} allowed / {item.get('rejected_forbidden', 0)} forbidden;"
            " plain means over all finished jobs " + ("n/a" if unpaired is None else f"{unpaired:+.1%}"),
            markup=False,
            highlight=False,
        )
    console.print(f"grid took {result['timing']['total_s']:,.0f} s on {args.grid_processes} processes")
    return 0


def main(args: argparse.Namespace) -> int:
    """``loom bench policies``: JSON on stdout, the table on stderr unless ``--json``; progress on stderr."""
    from rich.console import Console

    from loom.errors import InvalidInputError

    if getattr(args, "grid", False):
        return run_grid_command(args)
    console = Console(stderr=True)
    try:
        with console.status("policies benchmark…") as status:
            result = run(args, progress=lambda s: status.update(f"policies benchmark: {s}"))
    except (OptionError, InvalidInputError) as exc:
        console.print(str(exc), style="red", markup=False, highlight=False, soft_wrap=True)
        return 2
    print(json.dumps(result, indent=2))
    if not args.json:
        print_table(result)
    else:
        # Quiet otherwise, but a workload that shrank (jobs no cluster of the platform can hold,
        # rejected by every policy) is said: the figures are over fewer jobs than the file has.
        for line in _rejections_by_reason(result["summaries"]):
            console.print(line, markup=False, highlight=False, soft_wrap=True)
    sys.stdout.flush()
    return 0
