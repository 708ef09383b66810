"""``loom bench migration``: failure, link degradation and drain, with migration on / never / always.

Every run is Loom's placement policy on the same trace, timed by the simulator's truth
(:mod:`loom.sim.truth`); only the migration mode differs (:mod:`loom.sim.migration`):

- ``on``: the benefit rule (:mod:`loom.migrate.benefit`), with its margins, cool-down and budget;
- ``never``: only the forced re-placement of a failed cluster's jobs; nothing moves proactively;
- ``always``: every affected job with a candidate placement moves at every trigger.

**Platforms**: the default topology sampled to 16 nodes (``wide16``: 82 GPUs, 8 clusters in 6
regions) and to 32 nodes (``wide32``). **Workload**: the contention benchmark's trace
(:func:`loom_benchmarks.contention.contention_trace`: the training mix with gangs of 4-16 one-GPU
workers that may span clusters, work x 1/8, arrivals set for the offered load), every job
checkpointing every ``CHECKPOINT_REFERENCE_S`` of reference-GPU work. **Loads** 0.5 and 0.8.

**Scenarios**, times as shares of the arrival span ``S`` (first to last arrival):

- ``failure``: the cluster with the most reference capacity (GPUs x SCU) fails at 0.25 S and
  returns at 0.55 S;
- ``degradation``: every link of the region whose links carry the most cross-region running jobs
  at 0.25 S (:func:`degradation_point`: spanning gangs, inference away from its users; found by
  a run without events or migration stopped there, the same for every mode) gets RTT x 5 and
  bandwidth x 0.2 from 0.25 S for ``--degradation-s`` (default 1 h). When no running job crosses
  a region boundary at 0.25 S, the degradation comes at the first job start after it (up to the
  last arrival) at which one does: a degraded link no job uses tests nothing (before, it then fell
  back to the busiest region's links, which no job used);
- ``drain``: that cluster is drained at 0.25 S and opened again at 0.75 S.

Per run: mean JCT (of the jobs every mode finished), finished jobs, GPU-hours, GPU-hours lost,
bytes moved, migrations, forced restarts and the belief error
(:func:`loom.sim.metrics.belief_error`, as ``loom bench policies`` reports it: per job that ran,
``|predicted step / true step - 1|``, median and p90). Per cell and scenario: each mode's mean
over seeds (the belief error's too; the table shows ``on``'s), and ``on``'s margin against
``never`` and ``always`` (positive: ``on`` is faster), and the paired split of each margin
(:func:`paired_difference`: the jobs either mode moved vs the knock-on rest).
Failed clusters' jobs resume from checkpoint replicas (:mod:`loom.sim.replicas`;
``--ideal-replicas``: from their latest checkpoint, the model before). The JSON
(stdout) holds every run; the table (stderr) every cell. Wins and losses are both listed.
"""

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final

import msgspec

if TYPE_CHECKING:
    from loom.sim.model import Platform, SimEvent, Trace

PLATFORMS: Final = {"wide16": 16, "wide32": 32}
"""Platform name -> nodes the default topology is sampled to."""
SCENARIOS: Final = ("failure", "degradation", "drain")
MODES: Final = ("on", "never", "always")
LOADS: Final = (0.5, 0.8)
SEEDS: Final = (1, 2, 3, 4)
UNITS: Final = 50
"""Workload units of the mix per run."""
DEGRADATION_S: Final = 3600.0
"""How long the degraded links stay degraded."""
CHECKPOINT_REFERENCE_S: Final = 300.0
"""Jobs checkpoint every this many seconds of reference-GPU work (steps x step time)."""


def platform(name: str) -> tuple["Platform", Any]:
    """The named platform and its topology."""
    from loom.model.topology import load_topology
    from loom.sim.engine import platform_from_topology

    if name not in PLATFORMS:
        raise ValueError(f"unknown platform {name!r}; known: {', '.join(PLATFORMS)}")
    topology = load_topology()
    return platform_from_topology(topology, nodes=PLATFORMS[name], seed=0, name=name), topology


def with_checkpoints(trace: "Trace", every_reference_s: float = CHECKPOINT_REFERENCE_S) -> "Trace":
    """Every job checkpoints every ``every_reference_s`` of reference-GPU work (at least every step)."""
    from loom.sim.model import Trace

    jobs = []
    for sim in trace.jobs:
        work = sim.spec.work
        every = max(1, round(every_reference_s / work.step_time_s))
        spec = msgspec.structs.replace(
            sim.spec, work=msgspec.structs.replace(work, checkpoint_every_steps=every)
        )
        jobs.append(dataclasses.replace(sim, spec=spec))
    return Trace(
        jobs, events=list(trace.events), source=f"{trace.source}; checkpoints every {every_reference_s:g} s"
    )


def busiest(built: "Platform") -> tuple[str, str]:
    """(cluster, region) with the most reference capacity (GPUs x SCU for training_compute)."""
    by_cluster: dict[str, float] = {}
    for node in built.nodes:
        if node.gpu_model is None:
            continue
        speed = built.speed.get((node.gpu_model, "training_compute"), 1.0)
        by_cluster[node.cluster] = by_cluster.get(node.cluster, 0.0) + node.gpus_total * speed
    cluster = max(sorted(by_cluster), key=lambda c: by_cluster[c])
    by_region: dict[str, float] = {}
    for cid, cap in by_cluster.items():
        region = built.clusters[cid].region
        by_region[region] = by_region.get(region, 0.0) + cap
    region = max(sorted(by_region), key=lambda r: by_region[r])
    return cluster, region


def crossings(records: Sequence[Any], specs: dict[str, Any], at_s: float) -> dict[str, int]:
    """Per region: the jobs running at ``at_s`` (by ``records``: started at or before, not ended
    by then) whose steps cross its links: gangs spanning regions, and inference served away from
    its users: the jobs :class:`loom.sim.migration.Migrator` counts as affected by a link (not
    pipelines: the simulator keeps their planned step when a link changes, and they never move)."""
    count: dict[str, int] = {}
    for record in records:
        if record.start_s is None or record.start_s > at_s or not record.regions:
            continue
        if record.end_s is not None and record.end_s <= at_s:
            continue
        spec = specs.get(record.job_id)
        if spec is not None and spec.pipeline is not None:
            continue
        crossed = set(record.regions) if len(set(record.regions)) > 1 else set()
        if spec is not None and spec.task_type == "inference":
            users = set(spec.affinity.prefer_regions) - {record.regions[0]}
            if users:
                crossed |= users | {record.regions[0]}
        for region in crossed:
            count[region] = count.get(region, 0) + 1
    return count


def most_crossed_region(trace: "Trace", built: "Platform", at_s: float, seed: int) -> str | None:
    """The region whose links carry the most cross-region running jobs at ``at_s`` (a run of Loom
    without events stopped there): gangs spanning regions, and inference served away from its
    users. None: no job crosses a region boundary then."""
    point = degradation_point(trace, built, at_s, at_s, seed)
    return point[1] if point is not None else None


def degradation_point(
    trace: "Trace", built: "Platform", at_s: float, until_s: float, seed: int
) -> tuple[float, str, int] | None:
    """(when, region, jobs crossing its links) for the degradation scenario, from a run of Loom
    without events or migration (the same for every mode: it never looks at one): at ``at_s`` the
    region whose links carry the most cross-region running jobs (:func:`crossings`); when no job
    crosses a region boundary at ``at_s``, the first job start after it, up to ``until_s``, at
    which one does (a degraded link no job uses tests nothing). None: none does until then.

    The run is stopped at ``at_s`` first (as before this rule); only when nothing crosses then is
    it run on to ``until_s``. A job's placement there is its last one (the run has no events or
    migrations; a preempted job's earlier placement is not seen)."""
    from loom.sim.engine import simulate
    from loom.sim.policies import make_policy

    specs = {j.spec.job_id: j.spec for j in trace.jobs}

    def best(count: dict[str, int]) -> tuple[str, int] | None:
        if not count:
            return None
        region = max(sorted(count), key=lambda r: count[r])
        return region, count[region]

    result = simulate(trace, built, make_policy("loom", seed), seed=seed, horizon_s=at_s, sample_every_s=0)
    found = best(crossings(result.records, specs, at_s))
    if found is not None:
        return at_s, found[0], found[1]
    if until_s <= at_s:
        return None
    result = simulate(trace, built, make_policy("loom", seed), seed=seed, horizon_s=until_s, sample_every_s=0)
    starts = sorted(
        {r.start_s for r in result.records if r.start_s is not None and at_s < r.start_s <= until_s}
    )
    for t in starts:
        found = best(crossings(result.records, specs, t))
        if found is not None:
            return t, found[0], found[1]
    return None


def scenario_events(
    scenario: str,
    trace: "Trace",
    built: "Platform",
    *,
    first_s: float,
    span_s: float,
    seed: int,
    degradation_s: float = DEGRADATION_S,
) -> list["SimEvent"]:
    """The scripted events of a scenario (see the module docstring)."""
    from loom.sim.model import SimEvent
    from loom.sim.scenarios import cluster_failure_events, drain_events

    cluster, region = busiest(built)
    at = first_s + 0.25 * span_s
    if scenario == "failure":
        return cluster_failure_events(cluster, at_s=at, duration_s=0.30 * span_s)
    if scenario == "degradation":
        point = degradation_point(trace, built, at, first_s + span_s, seed)
        if point is not None:
            at, region, _ = point
        return [
            SimEvent(at_s=at, kind="link_degrade", region=region, rtt_factor=5.0, bandwidth_factor=0.2),
            SimEvent(at_s=at + degradation_s, kind="link_restore", region=region),
        ]
    if scenario == "drain":
        return drain_events(cluster, at_s=at, duration_s=0.5 * span_s)
    raise ValueError(f"unknown scenario {scenario!r}; known: {', '.join(SCENARIOS)}")


def run_cell(
    platform_name: str,
    load: float,
    seed: int,
    scenario: str,
    *,
    modes: Sequence[str] = MODES,
    units: int = UNITS,
    degradation_s: float = DEGRADATION_S,
    ideal_replicas: bool = False,
) -> dict[str, Any]:
    """Every mode over one (platform, load, seed, scenario): per mode its figures. ``ideal_replicas``:
    a failed cluster's jobs resume from their latest checkpoint (no replica copies modelled)."""
    from loom.migrate.replicas import ReplicaSettings
    from loom.sim.engine import simulate
    from loom.sim.migration import MigrationPolicy
    from loom.sim.model import Trace
    from loom.sim.policies import make_policy
    from loom_benchmarks.contention import contention_trace

    built, topology = platform(platform_name)
    base = contention_trace(topology, built, workload="mix", load=load, seed=seed, span=True, units=units)
    trace = with_checkpoints(base)
    arrivals = [j.arrival_s for j in trace.jobs]
    first, span = min(arrivals), max(arrivals) - min(arrivals)
    events = scenario_events(
        scenario, trace, built, first_s=first, span_s=span, seed=seed, degradation_s=degradation_s
    )
    trace = Trace(trace.jobs, events=events, source=trace.source)
    results = {}
    for mode in modes:
        started = time.perf_counter()
        result = simulate(
            trace,
            built,
            make_policy("loom", seed),
            seed=seed,
            sample_every_s=max(span / 100.0, 60.0),
            migration=MigrationPolicy(
                mode,  # type: ignore[arg-type]
                replicas=None if ideal_replicas else ReplicaSettings(),
            ),
        )
        results[mode] = (result, time.perf_counter() - started)
    finished_by_all = set.intersection(
        *(
            {r.job_id for r in res.records if r.end_s is not None and r.rejected is None}
            for res, _ in results.values()
        )
    )
    touched = set().union(*((res.migration or {}).get("touched_jobs", []) for res, _ in results.values()))
    jct_of = {
        mode: {r.job_id: r.jct_s for r in res.records if r.job_id in finished_by_all and r.jct_s is not None}
        for mode, (res, _) in results.items()
    }
    moved_effect: dict[str, Any] = {}
    for mode, (res, _) in results.items():
        moved = [j for j in (res.migration or {}).get("moved_jobs", []) if j in finished_by_all]
        if moved and "never" in jct_of:
            moved_effect[mode] = {
                "jobs": len(moved),
                "jct_mean_s": round(statistics.fmean(jct_of[mode][j] for j in moved), 1),
                "jct_mean_never_s": round(statistics.fmean(jct_of["never"][j] for j in moved), 1),
            }
    out: dict[str, Any] = {}
    moved_by = {mode: set((res.migration or {}).get("moved_jobs", [])) for mode, (res, _) in results.items()}
    paired = {
        other: paired_difference(jct_of["on"], jct_of[other], moved_by["on"] | moved_by[other])
        for other in ("never", "always")
        if "on" in jct_of and other in jct_of
    }
    for mode, (result, wall_s) in results.items():
        jcts = {
            r.job_id: r.jct_s for r in result.records if r.job_id in finished_by_all and r.jct_s is not None
        }
        mig = dict(result.migration or {})
        verdicts = mig.pop("verdicts", [])
        mig.pop("touched_jobs", None)
        mig.pop("moved_jobs", None)
        near = [jct for job_id, jct in jcts.items() if job_id in touched]
        out[mode] = {
            "jct_mean_s": round(statistics.fmean(jcts.values()), 1) if jcts else None,
            "jct_mean_touched_s": round(statistics.fmean(near), 1) if near else None,
            "finished": sum(1 for r in result.records if r.end_s is not None),
            "jobs": len(result.records),
            "gpu_hours": _gpu_hours(result),
            **_belief_error(result),
            **mig,
            # A drain's purpose: how long after it began the cluster held no job (None: not while drained).
            "drain_emptied_after_s": (mig.get("drains") or [{}])[0].get("emptied_after_s"),
            "verdicts_moved": sum(1 for v in verdicts if v["decision"] == "move"),
            "verdicts_stayed": sum(1 for v in verdicts if v["decision"] == "stay"),
            "example_verdicts": verdicts[:3],
            "wall_s": round(wall_s, 2),
        }
    return {
        "platform": platform_name,
        "load": load,
        "seed": seed,
        "scenario": scenario,
        "jobs": len(trace.jobs),
        "compared_jobs": len(finished_by_all),
        "touched_jobs": len(touched & finished_by_all),
        "moved_jobs_effect": moved_effect,
        "paired": paired,
        "arrival_span_h": round(span / 3600.0, 2),
        "scripted": [
            {"at_s": round(e.at_s, 1), "kind": e.kind, "where": e.cluster or e.region or f"{e.src}-{e.dst}"}
            for e in events
        ],
        "modes": out,
    }


def paired_difference(on: dict[str, float], other: dict[str, float], moved: set[str]) -> dict[str, Any]:
    """``on`` against another mode, job by job (both dicts: job -> JCT over the same jobs): the
    jobs either mode moved proactively (where the two decided differently, or alike), and the
    rest, whose JCT differs only by knock-on placement. Each part as seconds of the overall mean
    JCT difference (other − on: positive when ``on`` is faster), and the moved jobs' own mean."""
    jobs = sorted(set(on) & set(other))
    if not jobs:
        return {"moved": 0, "moved_s": 0.0, "knock_on_s": 0.0, "moved_own_s": None, "changed": 0}
    mine = [j for j in jobs if j in moved]
    diff = {j: other[j] - on[j] for j in jobs}
    n = len(jobs)
    return {
        "moved": len(mine),
        "moved_s": round(sum(diff[j] for j in mine) / n, 1),
        "knock_on_s": round(sum(diff[j] for j in jobs if j not in moved) / n, 1),
        "moved_own_s": round(statistics.fmean(diff[j] for j in mine), 1) if mine else None,
        "changed": sum(1 for j in jobs if j not in moved and abs(diff[j]) > 1.0),
    }


def _gpu_hours(result: Any) -> float:
    from loom.sim import metrics

    return round(metrics.gpu_hours(result.records), 2)


def _belief_error(result: Any) -> dict[str, float | None]:
    """How far the scheduler's predicted step times were from the true ones, median and p90."""
    from loom.sim import metrics

    error = metrics.belief_error(result.records)
    return {"belief_error_median": error["median"], "belief_error_p90": error["p90"]}


def _margin(on: float | None, other: float | None) -> float | None:
    """(other - on) / other: positive when ``on`` is faster."""
    if on is None or other is None or other <= 0:
        return None
    return round((other - on) / other, 4)


def aggregate(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (platform, load, scenario): each mode's mean over seeds, and ``on``'s margins."""
    cells: dict[tuple[str, float, str], list[dict[str, Any]]] = {}
    for run in runs:
        cells.setdefault((run["platform"], run["load"], run["scenario"]), []).append(run)
    lines = []
    for (plat, load, scenario), group in cells.items():
        modes: dict[str, dict[str, Any]] = {}
        for mode in group[0]["modes"]:

            def mean(key: str, mode: str = mode, group: list[dict[str, Any]] = group) -> float | None:
                values = [g["modes"][mode].get(key) for g in group]
                kept = [v for v in values if v is not None]
                return round(statistics.fmean(kept), 3) if kept else None

            modes[mode] = {
                k: mean(k)
                for k in (
                    "jct_mean_s",
                    "jct_mean_touched_s",
                    "gpu_hours_lost",
                    "bytes_moved",
                    "migrations",
                    "forced_restarts",
                    "deferred_by_budget",
                    "held_by_queue",
                    "belief_error_median",
                    "belief_error_p90",
                    "drain_emptied_after_s",
                )
            }
            if scenario == "drain":
                modes[mode]["drains_emptied"] = sum(
                    1 for g in group if g["modes"][mode].get("drain_emptied_after_s") is not None
                )
        on = modes.get("on", {}).get("jct_mean_s")
        per_seed = {
            other: [_margin(g["modes"]["on"]["jct_mean_s"], g["modes"][other]["jct_mean_s"]) for g in group]
            for other in ("never", "always")
            if other in modes and "on" in modes
        }
        moved: dict[str, Any] = {}
        for mode in ("on", "always"):
            effects = [g["moved_jobs_effect"][mode] for g in group if mode in g.get("moved_jobs_effect", {})]
            n = sum(e["jobs"] for e in effects)
            if n:
                mine = sum(e["jobs"] * e["jct_mean_s"] for e in effects) / n
                never = sum(e["jobs"] * e["jct_mean_never_s"] for e in effects) / n
                moved[mode] = {
                    "jobs": n,
                    "jct_mean_s": round(mine, 1),
                    "jct_mean_never_s": round(never, 1),
                    "vs_never": _margin(mine, never),
                }
        paired: dict[str, Any] = {}
        for other in ("never", "always"):
            parts = [g["paired"][other] for g in group if other in g.get("paired", {})]
            if parts:
                paired[other] = {
                    "moved": sum(p["moved"] for p in parts),
                    "moved_s": round(statistics.fmean(p["moved_s"] for p in parts), 1),
                    "knock_on_s": round(statistics.fmean(p["knock_on_s"] for p in parts), 1),
                    "seeds_moved_jobs_win": sum(1 for p in parts if p["moved"] and p["moved_s"] > 0),
                    "seeds_moved_jobs_lose": sum(1 for p in parts if p["moved"] and p["moved_s"] < 0),
                    "seeds_alike": sum(1 for p in parts if not p["moved"]),
                }
        lines.append(
            {
                "platform": plat,
                "moved_jobs": moved,
                "paired": paired,
                "load": load,
                "scenario": scenario,
                "seeds": [g["seed"] for g in group],
                "modes": modes,
                "on_vs_never": _margin(on, modes.get("never", {}).get("jct_mean_s")),
                "on_vs_never_touched": _margin(
                    modes.get("on", {}).get("jct_mean_touched_s"),
                    modes.get("never", {}).get("jct_mean_touched_s"),
                ),
                "on_vs_always_touched": _margin(
                    modes.get("on", {}).get("jct_mean_touched_s"),
                    modes.get("always", {}).get("jct_mean_touched_s"),
                ),
                "on_vs_always": _margin(on, modes.get("always", {}).get("jct_mean_s")),
                "on_vs_never_per_seed": per_seed.get("never"),
                "on_vs_always_per_seed": per_seed.get("always"),
                "on_vs_never_se": _standard_error(per_seed.get("never")),
                "on_vs_always_se": _standard_error(per_seed.get("always")),
            }
        )
    return lines


def _standard_error(margins: Sequence[float | None] | None) -> float | None:
    """The standard error of the mean of per-seed margins (paired: each seed's ``on`` against the
    other mode on the same jobs and events); None with fewer than two seeds."""
    kept = [m for m in margins or () if m is not None]
    if len(kept) < 2:
        return None
    return round(statistics.stdev(kept) / math.sqrt(len(kept)), 4)


def run(args: argparse.Namespace, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The whole benchmark (see the module docstring)."""
    platforms, scenarios, loads, seeds = check_options(args)
    started = time.perf_counter()
    runs = []
    for plat in platforms:
        for load in loads:
            for scenario in scenarios:
                for seed in seeds:
                    one = run_cell(
                        plat,
                        load,
                        seed,
                        scenario,
                        units=args.units,
                        degradation_s=args.degradation_s,
                        ideal_replicas=getattr(args, "ideal_replicas", False),
                    )
                    runs.append(one)
                    if progress is not None:
                        jct = {m: f["jct_mean_s"] for m, f in one["modes"].items()}
                        progress(f"{plat}/{load:g}/{scenario}/seed {seed}: mean JCT s {jct}")
    lines = aggregate(runs)
    return {
        "benchmark": "migration",
        "timed_by": "truth (the packaged measured tables)",
        "policy": "loom",
        "platforms": {p: PLATFORMS[p] for p in platforms},
        "loads": loads,
        "seeds": seeds,
        "units": args.units,
        "checkpoint_reference_s": CHECKPOINT_REFERENCE_S,
        "degradation_s": args.degradation_s,
        "replicas": "ideal" if getattr(args, "ideal_replicas", False) else "modelled (loom.sim.replicas)",
        "cells": lines,
        "summary": summary(lines),
        "runs": runs,
        "wall_s": round(time.perf_counter() - started, 1),
    }


def summary(lines: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per scenario: cells where ``on`` beats both other modes on mean JCT, and where it loses."""
    out: dict[str, Any] = {}
    for scenario in SCENARIOS:
        mine = [line for line in lines if line["scenario"] == scenario]
        if not mine:
            continue
        beats = [line for line in mine if (line["on_vs_never"] or 0) > 0 and (line["on_vs_always"] or 0) > 0]
        out[scenario] = {
            "cells": len(mine),
            "on_beats_both": len(beats),
            "paired_on_beats_both": sum(
                1
                for line in mine
                if all(line.get("paired", {}).get(o, {}).get("moved_s", 0) > 0 for o in ("never", "always"))
            ),
            "paired_on_not_worse_than_either": sum(
                1
                for line in mine
                if all(line.get("paired", {}).get(o, {}).get("moved_s", 0) >= 0 for o in ("never", "always"))
            ),
            "on_loses_to_never": [
                f"{line['platform']}/{line['load']:g}: {line['on_vs_never']:+.1%}"
                for line in mine
                if line["on_vs_never"] is not None and line["on_vs_never"] < 0
            ],
            "on_loses_to_always": [
                f"{line['platform']}/{line['load']:g}: {line['on_vs_always']:+.1%}"
                for line in mine
                if line["on_vs_always"] is not None and line["on_vs_always"] < 0
            ],
            # A loss beyond two standard errors of its per-seed margins: not the seeds' noise.
            "on_loses_beyond_noise": [
                f"{line['platform']}/{line['load']:g} vs {other}: {line[f'on_vs_{other}']:+.1%}"
                f" (± {line[f'on_vs_{other}_se']:.1%})"
                for line in mine
                for other in ("never", "always")
                if line.get(f"on_vs_{other}") is not None
                and line.get(f"on_vs_{other}_se") is not None
                and line[f"on_vs_{other}"] < -2 * line[f"on_vs_{other}_se"]
            ],
            "scenario_mean_jct_s": {
                mode: round(statistics.fmean(line["modes"][mode]["jct_mean_s"] for line in mine), 1)
                for mode in ("on", "never", "always")
                if all(
                    mode in line["modes"] and line["modes"][mode]["jct_mean_s"] is not None for line in mine
                )
            },
        }
    return out


MIN_UNITS: Final = 2
"""The fewest ``--units``: the scenarios' times are shares of the arrival span, which one unit
(its jobs arriving at once) does not have."""


def check_options(args: argparse.Namespace) -> tuple[list[str], list[str], list[float], list[int]]:
    """The platforms, scenarios, loads and seeds the options name, every option checked before
    anything runs; ValueError with a one-line message naming the option otherwise."""
    from loom_benchmarks.contention import check_units, parse_loads, parse_names, parse_seeds

    platforms = parse_names(args.platforms, tuple(PLATFORMS), "platform")
    scenarios = parse_names(args.scenarios, SCENARIOS, "scenario")
    loads = parse_loads(args.loads)
    seeds = parse_seeds(args.seeds)
    check_units(args.units, MIN_UNITS, " (the scenarios' times are shares of the arrival span)")
    degradation_s = args.degradation_s
    if not (math.isfinite(degradation_s) and degradation_s > 0):
        raise ValueError(f"--degradation-s must be a finite number of seconds > 0, got {degradation_s}")
    return platforms, scenarios, loads, seeds


def print_table(result: dict[str, Any]) -> None:
    """One line per cell and scenario on stderr."""
    print(
        f"{'platform':<8} {'load':>4} {'scenario':<12} "
        + f"{'moved by on: n, vs never':>25} "
        + " ".join(f"{m + ' JCT s':>12}" for m in MODES)
        + f" {'on vs never':>12} {'on vs always':>12} {'touched: vs never/always':>25}"
        + f" {'moves on/always':>16}"
        + f" {'GPU-h lost on/never/always':>28}"
        + f" {'paired vs never/always: moved s, knock-on s':>44}"
        + f" {'belief err on':>13}"
        + f" {'drain emptied after s (seeds) on/never/always':>48}",
        file=sys.stderr,
    )
    for line in result["cells"]:
        modes = line["modes"]

        def pct(x: float | None) -> str:
            return "-" if x is None else f"{x:+.1%}"

        jct = " ".join(f"{(modes.get(m, {}).get('jct_mean_s') or 0):>12.0f}" for m in MODES)
        moves = f"{modes.get('on', {}).get('migrations')}/{modes.get('always', {}).get('migrations')}"
        lost = "/".join(f"{modes.get(m, {}).get('gpu_hours_lost') or 0:.2f}" for m in MODES)
        own = line.get("moved_jobs", {}).get("on")
        mine = f"{own['jobs']}, {pct(own['vs_never'])}" if own else "-"
        belief = _share(modes.get("on", {}).get("belief_error_median"))
        emptied = " / ".join(_emptied(modes.get(m, {}), len(line["seeds"])) for m in MODES)
        print(
            f"{line['platform']:<8} {line['load']:>4g} {line['scenario']:<12} {mine:>25} {jct} "
            f"{pct(line['on_vs_never']):>12} {pct(line['on_vs_always']):>12} "
            f"{pct(line['on_vs_never_touched']) + ' / ' + pct(line['on_vs_always_touched']):>25} "
            f"{moves:>16} {lost:>28} {_paired(line):>44} {belief:>13} {emptied:>48}",
            file=sys.stderr,
        )


def _emptied(mode: dict[str, Any], seeds: int) -> str:
    """A drain's mean time to empty over the seeds it emptied in, and how many (``-``: no drain)."""
    if "drains_emptied" not in mode:
        return "-"
    after = mode.get("drain_emptied_after_s")
    return f"{'-' if after is None else f'{after:.0f}'} ({mode['drains_emptied']}/{seeds})"


def _share(share: float | None) -> str:
    return "-" if share is None else f"{share:.1%}"


def _paired(line: dict[str, Any]) -> str:
    parts = []
    for other in ("never", "always"):
        p = line.get("paired", {}).get(other)
        parts.append("-" if p is None else f"{p['moved_s']:+.0f}, {p['knock_on_s']:+.0f}")
    return " / ".join(parts)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``loom bench migration``."""
    parser.add_argument("--platforms", default=None, help=f"comma-separated, of {', '.join(PLATFORMS)}")
    parser.add_argument("--scenarios", default=None, help=f"comma-separated, of {', '.join(SCENARIOS)}")
    from loom_benchmarks.contention import add_loads_and_seeds

    add_loads_and_seeds(parser, LOADS, SEEDS)
    parser.add_argument(
        "--units", type=int, default=UNITS, help=f"workload units of the mix per run (at least {MIN_UNITS})"
    )
    parser.add_argument(
        "--degradation-s",
        type=float,
        default=DEGRADATION_S,
        help="how long the degraded links stay degraded (seconds > 0)",
    )
    parser.add_argument(
        "--ideal-replicas",
        action="store_true",
        help="a failed cluster's jobs resume from their latest checkpoint (no replica copies modelled)",
    )
    parser.add_argument("--json", action="store_true", help="print only the JSON result on stdout")


def main(args: argparse.Namespace) -> int:
    """``loom bench migration``: JSON on stdout, a table on stderr unless ``--json``."""
    from loom.errors import InvalidInputError

    try:
        result = run(args, progress=lambda s: print(s, file=sys.stderr) if not args.json else None)
    except (ValueError, InvalidInputError) as exc:  # a bad option or input: one line, rc 2
        print(str(exc), file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2))
    if not args.json:
        print_table(result)
    return 0
