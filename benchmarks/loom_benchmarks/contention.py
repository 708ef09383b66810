"""``loom bench contention``: decisions under contention, on two small platforms, every policy.

Two reproductions of an outside evaluation (issue 12, part 4), kept small so that one cell (one
platform, workload, load, seed and spanning rule, every policy) simulates in seconds:

- ``small3``: the packaged ``small`` topology, 71 GPUs in 3 regions (G2 and V100 in Ohio, V100 and
  T4 in Singapore, P100 and T4 in the Netherlands); gangs kept in one cluster.
- ``wide6``: the default topology sampled to 16 nodes (:func:`loom.sim.engine.platform_from_topology`
  with ``nodes=16``): 82 GPUs in 8 clusters over 6 regions; run with spanning allowed and
  forbidden (every gang's ``allow_multi_cluster``).
- ``sia3`` (only when named, ``--platforms sia3``): Sia's simulated cluster, 64 GPUs (24 T4, 16
  A100 40 GB, 24 RTX 2080 Ti), one GPU model per cluster in the small topology's three regions
  (:data:`SIA_NODES`); gangs kept in one cluster. With ``--truth`` from ``tools/adaptdl_truth.py``
  every GPU is timed by what Sia's authors measured on it.

Workloads (:func:`contention_trace`) come from the training mix
(:func:`loom.sim.workloads.training_mix`): ``mix`` is the default mix, ``net`` its
network-sensitive training alone. Every data-parallel gang (a job with ``comm`` and more than one
worker: ``net_training`` and the DAGs' training stage) is redrawn to 4, 8 or 16 workers of one GPU
each, and may span clusters only in the spanning runs. Work and dataset sizes are scaled by
``duration_scale`` (1/8: jobs of minutes to an hour) so that a run takes seconds.

**Load** is offered work over capacity: each job's work in reference-GPU seconds (``steps x
step_time_s x`` its GPUs; a pipeline's steps times its whole model's compute) summed, over the
arrival span times the platform's capacity in reference GPUs (every GPU's SCU for
``training_compute``). The mix's arrivals are stretched or packed so that this ratio is the load
asked for (0.5, 0.8, 1.0, 1.2 by default).

Per policy and cell: mean, p50 and p99 JCT, mean queueing, time-weighted GPU utilisation,
GPU-hours, cross-region bytes, gangs placed over more than one cluster (and more than one
region), finished/unfinished counts, the network-sensitive class's mean JCT and the belief error
(:func:`loom.sim.metrics.belief_error`, as ``loom bench policies`` reports it: per job that ran,
``|predicted step / true step - 1|``, median and p90; 0 when timed by belief); per cell, Loom's
margin over the best baseline (``(best - loom) / best``: positive means Loom is better) and over
compute-only greedy on ``net_training``; with spanning allowed, Loom against itself with
spanning forbidden.

Jobs are timed by the simulator's truth (the packaged measured tables, :mod:`loom.sim.truth`)
unless ``--truth`` names another file or ``belief`` (the scheduler's own model).
"""

import argparse
import dataclasses
import itertools
import json
import math
import random
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Final

import msgspec

if TYPE_CHECKING:
    from loom.model.topology import Topology
    from loom.sim.model import Platform, SimResult, Trace

PLATFORMS: Final = ("small3", "wide6")
"""The platforms a run takes by default."""
KNOWN_PLATFORMS: Final = (*PLATFORMS, "sia3")
SIA_NODES: Final = (
    # (cluster of the small topology, GPU model, nodes, GPUs a node, CPU milli, memory MiB)
    ("c-sea1-a", "T4", 6, 4, 48_000, 196_608),
    ("c-use2-a", "A100-40G", 2, 8, 256_000, 1_048_576),
    ("c-weu-a", "RTX2080TI", 3, 8, 48_000, 393_216),
)
"""``sia3``: Sia's default simulated cluster (its ``simulator_config.py``: 6 AWS g4dn.12xlarge of 4
T4s, 2 DGX A100 40 GB, 3 nodes of 8 RTX 2080 Ti; 64 GPUs), one GPU model per cluster in the small
topology's three regions, for replaying with a truth built from Sia's own measurements
(``tools/adaptdl_truth.py``). Not in the default run."""
WORKLOADS: Final = ("mix", "net")
LOADS: Final = (0.5, 0.8, 1.0, 1.2)
SEEDS: Final = (1, 2, 3)
BASELINES: Final = ("random", "first_fit", "greedy_compute", "round_robin", "gavel_like")
TARGET: Final = "loom"
GANG_WORKERS: Final = (4, 8, 16)
"""Workers of a redrawn data-parallel gang (one GPU each)."""
DURATION_SCALE: Final = 1 / 8
"""Work and dataset sizes of the mix scaled by this (jobs of minutes to an hour)."""
DEFAULT_UNITS: Final = 100
"""Workload units of the mix per run (a DAG unit is three jobs)."""
STAGING_POLICIES: Final = (TARGET, "oracle")
"""The policies that stage data with ``--stage-data`` (Loom's rule; the baselines have none)."""
WIDE_NODES: Final = 16
"""Nodes the default topology is sampled to for ``wide6`` (82 GPUs)."""


@dataclasses.dataclass(frozen=True)
class Cell:
    """One grid cell: a platform, a workload, an offered load, a seed, and whether gangs may span."""

    platform: str
    workload: str
    load: float
    seed: int
    span: bool

    @property
    def label(self) -> str:
        """``small3/mix/load 0.8/seed 1/span`` in words."""
        return (
            f"{self.platform}/{self.workload}/load {self.load:g}/seed {self.seed}/"
            f"{'span' if self.span else 'one-cluster'}"
        )


def platform_and_topology(name: str) -> tuple["Platform", "Topology"]:
    """The named platform (see the module docstring) and the topology its regions come from."""
    from loom.model.topology import load_topology
    from loom.sim.engine import platform_from_topology

    if name == "small3":
        import importlib.resources

        path = importlib.resources.files("loom") / "topologies" / "small.json"
        topology = load_topology(str(path))
        return platform_from_topology(topology, name="small3"), topology
    if name == "sia3":
        import importlib.resources

        path = importlib.resources.files("loom") / "topologies" / "small.json"
        topology = sia_topology(load_topology(str(path)))
        return platform_from_topology(topology, name="sia3"), topology
    if name == "wide6":
        topology = load_topology()
        return platform_from_topology(topology, nodes=WIDE_NODES, seed=0, name="wide6"), topology
    raise ValueError(f"unknown platform {name!r}; known: {', '.join(KNOWN_PLATFORMS)}")


def sia_topology(small: "Topology") -> "Topology":
    """The small topology's regions and links with :data:`SIA_NODES` as its clusters' nodes."""
    from msgspec.structs import replace

    from loom.model.topology import Cluster, Node, validate_topology

    by_id = {c.id: c for c in small.clusters}
    clusters = [
        Cluster(
            id=cid,
            region=by_id[cid].region,
            zone=by_id[cid].zone,
            nodes=[
                Node(id=f"{cid}-n{i}", gpu_model=model, gpus=gpus, cpu_milli=cpu, memory_mib=mem)
                for i in range(nodes)
            ],
        )
        for cid, model, nodes, gpus, cpu, mem in SIA_NODES
    ]
    topology = replace(small, name="sia3", clusters=clusters)
    validate_topology(topology)
    return topology


def capacity_reference_gpus(platform: "Platform") -> float:
    """The platform's GPUs weighted by their SCU for ``training_compute`` (reference GPUs)."""
    return sum(
        node.gpus_total * platform.speed.get((node.gpu_model, "training_compute"), 1.0)
        for node in platform.nodes
        if node.gpu_model is not None
    )


def work_reference_gpu_s(spec: Any) -> float:
    """A job's work in reference-GPU seconds: steps x step time x its GPUs (a pipeline: steps x the
    whole model's compute on one GPU)."""
    work = spec.work.steps * spec.work.step_time_s
    if spec.pipeline is not None:
        return float(work)
    return float(work * spec.workers * spec.resources.gpus)


def contention_trace(
    topology: "Topology",
    platform: "Platform",
    *,
    workload: str,
    load: float,
    seed: int,
    span: bool,
    units: int = DEFAULT_UNITS,
    duration_scale: float = DURATION_SCALE,
) -> "Trace":
    """The cell's trace: the training mix with gangs of 4-16 one-GPU workers (see the module
    docstring), its arrivals set so the offered load is ``load`` of the platform's capacity."""
    from loom.sim.model import SimJob, Trace
    from loom.sim.workloads import training_mix

    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; known: {', '.join(WORKLOADS)}")
    if not load > 0:
        raise ValueError(f"load must be positive, got {load}")
    mix = None if workload == "mix" else {"net_training": 1.0}
    base = training_mix(topology=topology, jobs=units, seed=seed, mix=mix)
    rng = random.Random(seed * 7919 + 17)
    jobs: list[SimJob] = []
    for sim in base.jobs:
        spec = sim.spec
        work = msgspec.structs.replace(spec.work, steps=max(1, round(spec.work.steps * duration_scale)))
        changes: dict[str, Any] = {"work": work}
        if spec.data is not None:
            changes["data"] = msgspec.structs.replace(
                spec.data, size_gb=round(spec.data.size_gb * duration_scale, 1)
            )
        if spec.comm is not None and spec.workers > 1:
            changes["workers"] = rng.choice(GANG_WORKERS)
            changes["resources"] = msgspec.structs.replace(spec.resources, gpus=1)
            changes["allow_multi_cluster"] = span
        jobs.append(dataclasses.replace(sim, spec=msgspec.structs.replace(spec, **changes)))
    demand = sum(work_reference_gpu_s(j.spec) for j in jobs)
    first = min(j.arrival_s for j in jobs)
    last = max(j.arrival_s for j in jobs)
    span_s = demand / (load * capacity_reference_gpus(platform))
    stretch = span_s / (last - first) if last > first else 1.0
    jobs = [dataclasses.replace(j, arrival_s=(j.arrival_s - first) * stretch) for j in jobs]
    source = (
        f"contention: {base.source}; gangs redrawn to {GANG_WORKERS} x 1 GPU, "
        f"allow_multi_cluster={span}; work and data x {duration_scale:g}; "
        f"arrivals set for load {load:g}"
    )
    return Trace(jobs, source=source)


def _is_gang(record: Any, gangs: set[str]) -> bool:
    return bool(record.job_id in gangs)


def figures(result: "SimResult", gangs: set[str]) -> dict[str, Any]:
    """One policy's figures in one cell (see the module docstring)."""
    from loom.sim import metrics

    summary = metrics.summarize(result)
    overall = summary["overall"]
    net = summary["by_class"].get("net_training", {})
    placed = [r for r in result.records if r.start_s is not None and r.job_id in gangs]
    return {
        "jct_mean_s": overall["jct_mean_s"],
        "jct_p50_s": overall["jct_p50_s"],
        "jct_p99_s": overall["jct_p99_s"],
        "queue_mean_s": overall["queue_mean_s"],
        "utilisation": overall["gpu_utilisation_mean"],
        "gpu_hours": overall["gpu_hours"],
        "cross_region_bytes": overall["cross_region_bytes"],
        "gangs": len(gangs),
        "gangs_spanning_clusters": sum(1 for r in placed if len(r.clusters) > 1),
        "gangs_spanning_regions": sum(1 for r in placed if len(r.regions) > 1),
        "finished": overall["finished"],
        "unfinished": overall["unfinished"],
        "rejected": overall["rejected"],
        "jobs": overall["jobs"],
        "net_training_jct_mean_s": net.get("jct_mean_s"),
        "belief_error_median": summary["belief_error"]["median"],
        "belief_error_p90": summary["belief_error"]["p90"],
        "wall_s": round(result.wall_s, 3),
    }


def resolve_truth(name: str | None) -> Any:
    """``--truth``: None for the simulator's default (the packaged measured tables), ``belief`` to
    time jobs by the scheduler's own belief, or a truth file (:mod:`loom.sim.truth`)."""
    from loom.sim.truth import BELIEF, load_truth

    if name is None:
        return None
    return BELIEF if name == "belief" else load_truth(name)


def run_cell(
    cell: Cell,
    policies: Sequence[str] = (TARGET, *BASELINES),
    *,
    units: int = DEFAULT_UNITS,
    truth: Any = None,
    stage_data: bool = False,
) -> dict[str, Any]:
    """Every policy over the cell's trace: per policy :func:`figures`, and Loom's margins.

    ``stage_data``: Loom (and the oracle, Loom knowing the truth) copy a queued job's dataset while
    it waits (:mod:`loom.sched.staging`; the simulator's ``stage_data``); the baselines never do.

    ``truth``: what times the jobs (:func:`resolve_truth`; None: the simulator's default, the
    packaged measured tables)."""
    from loom.sim.engine import simulate
    from loom.sim.policies import make_policy

    platform, topology = platform_and_topology(cell.platform)
    trace = contention_trace(
        topology,
        platform,
        workload=cell.workload,
        load=cell.load,
        seed=cell.seed,
        span=cell.span,
        units=units,
    )
    gangs = {j.spec.job_id for j in trace.jobs if j.spec.comm is not None and j.spec.workers > 1}
    arrivals = [j.arrival_s for j in trace.jobs]
    span_s = max(arrivals) - min(arrivals)
    out: dict[str, Any] = {}
    for name in policies:
        result = simulate(
            trace,
            platform,
            make_policy(name, cell.seed),
            seed=cell.seed,
            sample_every_s=max(span_s / 200.0, 30.0),
            truth=truth,
            stage_data=stage_data and name in STAGING_POLICIES,
        )
        out[name] = figures(result, gangs)
    return {"cell": dataclasses.asdict(cell), "label": cell.label, "policies": out, **margins(out)}


def margin(target: float | None, other: float | None) -> float | None:
    """``(other - target) / other``: positive when the target is lower (better)."""
    if target is None or other is None or other <= 0:
        return None
    return (other - target) / other


def margins(by_policy: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Loom's margin over the best baseline's mean JCT, and over greedy on ``net_training``."""
    loom = by_policy.get(TARGET)
    if loom is None:
        return {}
    others = {p: f["jct_mean_s"] for p, f in by_policy.items() if p != TARGET and f["jct_mean_s"]}
    best = min(others, key=lambda p: others[p]) if others else None
    greedy = by_policy.get("greedy_compute", {})
    return {
        "best_baseline": best,
        "margin_vs_best": margin(loom["jct_mean_s"], others[best]) if best else None,
        "net_margin_vs_greedy": margin(
            loom["net_training_jct_mean_s"], greedy.get("net_training_jct_mean_s")
        ),
    }


def cells(
    platforms: Iterable[str], workloads: Iterable[str], loads: Iterable[float], seeds: Iterable[int]
) -> list[Cell]:
    """The grid: ``small3`` with gangs in one cluster, ``wide6`` with spanning allowed and forbidden."""
    out: list[Cell] = []
    for platform, workload, load, seed in itertools.product(platforms, workloads, loads, seeds):
        spans = (True, False) if platform == "wide6" else (False,)
        out.extend(Cell(platform, workload, load, seed, span) for span in spans)
    return out


def aggregate(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (platform, workload, load, span): every policy's figures averaged over the seeds, and
    Loom's margins from those means (and, spanning allowed, against itself spanning forbidden)."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in results:
        c = r["cell"]
        groups.setdefault((c["platform"], c["workload"], c["load"], c["span"]), []).append(r)
    rows: list[dict[str, Any]] = []
    for (platform, workload, load, span), members in sorted(groups.items()):
        names = list(members[0]["policies"])
        means: dict[str, dict[str, Any]] = {}
        for name in names:
            means[name] = {
                key: _mean([m["policies"][name][key] for m in members])
                for key in members[0]["policies"][name]
            }
        rows.append(
            {
                "platform": platform,
                "workload": workload,
                "load": load,
                "span": span,
                "seeds": [m["cell"]["seed"] for m in members],
                "policies": means,
                **margins(means),
            }
        )
    by_key = {(r["platform"], r["workload"], r["load"], r["span"]): r for r in rows}
    for row in rows:
        if row["span"]:
            forbidden = by_key.get((row["platform"], row["workload"], row["load"], False))
            if forbidden is not None and TARGET in row["policies"]:
                row["loom_vs_itself_forbidden"] = margin(
                    row["policies"][TARGET]["jct_mean_s"], forbidden["policies"][TARGET]["jct_mean_s"]
                )
    return rows


def _mean(values: Sequence[Any]) -> Any:
    numbers = [float(v) for v in values if isinstance(v, int | float)]
    return sum(numbers) / len(numbers) if numbers else None


def run(args: argparse.Namespace, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Every cell of the grid the options name; per-cell results and the seed-averaged rows."""
    say = progress or (lambda _s: None)
    platforms = (
        list(PLATFORMS)
        if args.platforms is None
        else parse_names(args.platforms, KNOWN_PLATFORMS, "platform")
    )
    workloads = parse_names(args.workloads, WORKLOADS, "workload")
    loads = parse_loads(args.loads)
    seeds = parse_seeds(args.seeds)
    check_units(args.units)
    from loom.sim.policies import POLICIES

    policies = parse_names(args.policies, tuple(POLICIES), "policy")
    grid = cells(platforms, workloads, loads, seeds)
    truth = resolve_truth(args.truth)
    from loom_benchmarks.policies import dangling_aliases, unknown_truth_gpus

    built = [platform_and_topology(name)[0] for name in platforms]
    # Said before the cells run, as `loom bench policies` says it (the grid too).
    unknown_gpus = unknown_truth_gpus(truth, *built, warn=True)
    started = time.perf_counter()
    results = []
    for i, cell in enumerate(grid):
        say(f"cell {i + 1} of {len(grid)}: {cell.label}")
        results.append(
            run_cell(cell, policies, units=args.units, truth=truth, stage_data=bool(args.stage_data))
        )
    return {
        "benchmark": "contention",
        "method": {
            "platforms": platforms,
            "workloads": workloads,
            "loads": loads,
            "seeds": seeds,
            "policies": policies,
            "units": args.units,
            "duration_scale": DURATION_SCALE,
            "timed_by": args.truth or "truth (packaged Gavel + Lambda tables)",
            "truth_unknown_gpus": unknown_gpus,
            "truth_dangling_gpu_aliases": dangling_aliases(truth, *built),
            "gang_workers": GANG_WORKERS,
            "stage_data": bool(args.stage_data),
            "margin": "(best baseline - loom) / best baseline on mean JCT: positive, Loom is better",
        },
        "rows": aggregate(results),
        "cells": results,
        "wall_s": round(time.perf_counter() - started, 1),
    }


def parse_names(text: str | None, known: Sequence[str], what: str) -> list[str]:
    """A comma-separated list of ``known`` names (None: all of them), repeats dropped; ValueError
    for an unknown name or an empty list."""
    if text is None:
        return list(known)
    names = _items(text, f"name at least one {what}; known: {', '.join(known)}")
    for name in names:
        if name not in known:
            raise ValueError(f"unknown {what} {name!r}; known: {', '.join(known)}")
    return names


def _items(text: str, empty: str) -> list[str]:
    """The comma-separated items of ``text``, stripped, repeats dropped; ValueError(``empty``) for none."""
    items = list(dict.fromkeys(p.strip() for p in str(text).split(",") if p.strip()))
    if not items:
        raise ValueError(empty)
    return items


def parse_loads(text: str) -> list[float]:
    """``--loads``: comma-separated shares of capacity, each a finite number > 0 (repeats dropped);
    ValueError naming the option otherwise."""
    items = _items(text, f"--loads needs at least one value, got {text!r}")
    try:
        loads = [float(item) for item in items]
    except ValueError:
        raise ValueError(f"--loads are numbers, got {text!r}") from None
    if not all(math.isfinite(load) and load > 0 for load in loads):
        raise ValueError(f"--loads must be finite numbers > 0, got {text!r}")
    return list(dict.fromkeys(loads))


def parse_seeds(text: str) -> list[int]:
    """``--seeds``: comma-separated integers, each run once (repeats dropped); ValueError naming the
    option otherwise."""
    items = _items(text, f"--seeds needs at least one value, got {text!r}")
    try:
        seeds = [int(item) for item in items]
    except ValueError:
        raise ValueError(f"--seeds are integers, got {text!r}") from None
    return list(dict.fromkeys(seeds))


def check_units(units: int, least: int = 1, why: str = "") -> None:
    """``--units``: workload units of the mix per run, at least ``least`` (``why``: the reason,
    when more than one is needed); ValueError otherwise."""
    if units < least:
        raise ValueError(f"--units must be at least {least}{why}, got {units}")


def _h(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds / 3600:.2f}h"


def _pct(share: float | None) -> str:
    return "-" if share is None else f"{share * 100:+.1f}%"


def _share(share: float | None) -> str:
    return "-" if share is None else f"{share:.1%}"


def print_table(result: dict[str, Any]) -> None:
    """One line per seed-averaged cell, on stderr."""
    for row in result["rows"]:
        pol = row["policies"]
        loom = pol.get(TARGET, {})
        base = " ".join(f"{p}={_h(f['jct_mean_s'])}" for p, f in pol.items() if p != TARGET)
        extra = f" vs-forbidden={_pct(row.get('loom_vs_itself_forbidden'))}" if row["span"] else ""
        print(
            f"{row['platform']:6} {row['workload']:3} load {row['load']:<4g}"
            f" {'span' if row['span'] else 'one ':4} loom={_h(loom.get('jct_mean_s'))}"
            f" q={_h(loom.get('queue_mean_s'))} util={loom.get('utilisation') or 0:.2f}"
            f" spans={loom.get('gangs_spanning_clusters')}/{loom.get('gangs')}"
            f" xr={(loom.get('cross_region_bytes') or 0) / 1e12:.2f}TB"
            f" belief-err={_share(loom.get('belief_error_median'))}"
            f" | best {row.get('best_baseline')} margin {_pct(row.get('margin_vs_best'))}"
            f" net-vs-greedy {_pct(row.get('net_margin_vs_greedy'))}{extra} | {base}",
            file=sys.stderr,
        )


def add_loads_and_seeds(
    parser: argparse.ArgumentParser, loads: Sequence[float], seeds: Sequence[int]
) -> None:
    """``--loads`` and ``--seeds`` (seed numbers, not a count), as ``contention`` and ``migration``
    take them, with their defaults."""
    parser.add_argument(
        "--loads",
        default=",".join(f"{x:g}" for x in loads),
        help="offered loads, comma-separated: work offered over the platform's capacity, each a number"
        f" > 0 (1: as much as it can do; default {','.join(f'{x:g}' for x in loads)})",
    )
    parser.add_argument(
        "--seeds",
        default=",".join(str(s) for s in seeds),
        help="which seeds to run, comma-separated seed numbers, not a count (5 runs seed 5 alone;"
        f" default {','.join(str(s) for s in seeds)})",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``loom bench contention``."""
    parser.add_argument(
        "--platforms",
        default=None,
        help=f"comma-separated, of {', '.join(KNOWN_PLATFORMS)} (default {','.join(PLATFORMS)})",
    )
    parser.add_argument("--workloads", default=None, help=f"comma-separated, of {', '.join(WORKLOADS)}")
    add_loads_and_seeds(parser, LOADS, SEEDS)
    parser.add_argument(
        "--policies",
        default=None,
        help="comma-separated policy names (default loom and its five baselines: random, first_fit, "
        "greedy_compute, round_robin, gavel_like; oracle and home_region on request)",
    )
    parser.add_argument("--units", type=int, default=DEFAULT_UNITS, help="workload units of the mix per run")
    parser.add_argument(
        "--truth",
        default=None,
        help="truth file timing the jobs (default the packaged tables); 'belief': the scheduler's belief",
    )
    parser.add_argument(
        "--stage-data",
        action="store_true",
        help="Loom and oracle copy a queued job's dataset while it waits (loom.sched.staging)",
    )
    parser.add_argument("--json", action="store_true", help="print only the JSON result on stdout")


def main(args: argparse.Namespace) -> int:
    """``loom bench contention``: JSON on stdout, one line per cell on stderr unless ``--json``."""
    if args.policies is None:
        args.policies = ",".join((TARGET, *BASELINES))
    from loom.errors import InvalidInputError

    try:
        result = run(args, progress=lambda s: print(s, file=sys.stderr) if not args.json else None)
    except (ValueError, InvalidInputError) as exc:  # a bad option or input file: one line, rc 2
        print(str(exc), file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2))
    if not args.json:
        print_table(result)
    return 0
