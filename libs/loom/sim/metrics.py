"""The figures of a simulation: per-policy summaries, Loom against the baselines, the issue's claims.

Everything here is a pure function of :class:`~loom.sim.model.SimResult` s.

- **JCT** (job completion time) is arrival to end, over the jobs that finished; a rejected job has
  none and is counted apart (``rejected``), as is a job still running or queued when the run ended
  (``unfinished``).
- **Queueing delay** is arrival to first start, over the jobs that started (not rejected).
- Percentiles interpolate linearly between order statistics (``numpy.percentile``'s default), as
  the other benchmarks do.
- **Makespan** is the first arrival to the last end of the jobs considered.
- **GPU utilisation** is time-weighted over the timeline, each sample holding until the next:
  ``sum(used_i * dt_i) / sum(total_i * dt_i)``, so a period where a cluster is down (fewer GPUs in
  total) weighs by the GPUs that existed. The timeline is not split by class, so per class only
  ``gpu_hours`` (GPUs held from start to end) is given.
- **Speed probes** a policy ran (``SimResult.probes``, :mod:`loom.sched.probe`) are not jobs of the
  trace: they are left out of every job figure, their GPU-hours, SCU-hours and cost are added to the
  overall totals (what the platform spent), and ``overall["probes"]`` counts them.
- An **improvement** of the target over another policy is ``(other - target) / other``: 0.25 means
  25 % lower (better) than the other; negative means worse. Mean JCT is also compared *paired*:
  over the jobs that finished under both policies, so a policy cannot look fast by leaving its
  slowest jobs unfinished.
- **Belief error** (:func:`belief_error`): per job that ran, ``|belief_step_s / step_s - 1|``: how
  far the step time the scheduler expected (its profiles and what it had learned) was from the step
  the simulator's truth gave (:mod:`loom.sim.truth`), where the job last ran. Median and p90 over
  the jobs, and per GPU model of the job's lead part; ``bias`` is the geometric mean of
  ``belief / true`` (below 1: the scheduler expected faster steps than it got). Timed by belief
  (``truth=BELIEF``) every error is 0.
"""

import itertools
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

import numpy as np

from loom.sim.model import JobRecord, Sample, SimResult

CLASS_ORDER: Final = ("net_training", "training", "pipeline", "inference", "dag", "batch")
"""The order classes are listed in (classes not seen in a run are left out)."""

COMPARED: Final = (
    "jct_mean_s",
    "jct_p50_s",
    "jct_p99_s",
    "queue_mean_s",
    "queue_p99_s",
    "makespan_s",
    "cost",
    "scu_hours",
    "cross_region_bytes",
)
"""Summary figures on which policies are compared (lower is better for all of them)."""

NET_JCT_REQUIRED: Final = 0.25
"""Must-show (a): network-sensitive training's mean JCT at least 25 % lower than compute-only greedy."""
OTHER_CLASS_WORSE_MAX: Final = 0.05
"""Must-show (a): while no other class's mean JCT is more than 5 % worse."""
SCENARIO_TIME_REQUIRED: Final = 0.23
SCENARIO_COST_REQUIRED: Final = 0.18
"""Must-show (b): the seeds' multi-stage scenario (seed 001 §4) reports total time 23 % shorter and
cost 18 % lower than fixed-region placement; Loom must do better than both."""


# ---- one policy -------------------------------------------------------------------------------


def _stats(values: Sequence[float], prefix: str) -> dict[str, float | None]:
    if not values:
        return {f"{prefix}_mean_s": None, f"{prefix}_p50_s": None, f"{prefix}_p99_s": None}
    arr = np.asarray(values, dtype=np.float64)
    return {
        f"{prefix}_mean_s": float(arr.mean()),
        f"{prefix}_p50_s": float(np.percentile(arr, 50)),
        f"{prefix}_p99_s": float(np.percentile(arr, 99)),
    }


def jcts(records: Iterable[JobRecord]) -> list[float]:
    """Completion times of the jobs that finished (rejected and unfinished jobs have none)."""
    return [j for r in records if r.rejected is None and (j := r.jct_s) is not None]


def queue_delays(records: Iterable[JobRecord]) -> list[float]:
    """Queueing delays of the jobs that started."""
    return [q for r in records if r.rejected is None and (q := r.queue_s) is not None]


def makespan_s(records: Sequence[JobRecord]) -> float | None:
    """First arrival to last end; None when nothing finished."""
    ends = [r.end_s for r in records if r.end_s is not None and r.rejected is None]
    if not ends:
        return None
    return max(ends) - min(r.arrival_s for r in records)


def gpu_hours(records: Iterable[JobRecord]) -> float:
    """GPUs held from (last) start to end, in hours, over the jobs that finished."""
    return (
        sum(r.gpus * (r.end_s - r.start_s) for r in records if r.start_s is not None and r.end_s is not None)
        / 3600.0
    )


def group_stats(records: Sequence[JobRecord]) -> dict[str, Any]:
    """Counts, JCT, queueing, makespan and totals of one group of jobs."""
    finished = sum(1 for r in records if r.end_s is not None and r.rejected is None)
    rejected = sum(1 for r in records if r.rejected is not None)
    return {
        "jobs": len(records),
        "finished": finished,
        "rejected": rejected,
        "unfinished": len(records) - finished - rejected,
        **_stats(jcts(records), "jct"),
        **_stats(queue_delays(records), "queue"),
        "makespan_s": makespan_s(records),
        "gpu_hours": gpu_hours(records),
        "scu_hours": sum(r.scu_hours for r in records),
        # What the platform's bill would say: GPU-hours at the regions' prices, plus the bytes moved
        # between regions at the clouds' transfer prices (loom.model.egress), each also apart.
        "cost": sum(r.cost + r.transfer_cost for r in records),
        "gpu_cost": sum(r.cost for r in records),
        "transfer_cost": sum(r.transfer_cost for r in records),
        "cross_region_bytes": sum(r.cross_region_bytes for r in records),
        "restarts": sum(r.restarts for r in records),
    }


def utilisation_series(timeline: Sequence[Sample]) -> tuple[list[float], list[float]]:
    """(times, used share of the GPUs) per sample, in time order; a sample with no GPUs is 0."""
    ordered = sorted(timeline, key=lambda s: s.t_s)
    return (
        [s.t_s for s in ordered],
        [s.gpus_used / s.gpus_total if s.gpus_total > 0 else 0.0 for s in ordered],
    )


def mean_utilisation(timeline: Sequence[Sample]) -> float | None:
    """Time-weighted share of the GPUs in use (each sample holds until the next); None without samples."""
    ordered = sorted(timeline, key=lambda s: s.t_s)
    if not ordered:
        return None
    if len(ordered) == 1 or ordered[-1].t_s <= ordered[0].t_s:
        used = sum(s.gpus_used for s in ordered)
        total = sum(s.gpus_total for s in ordered)
        return used / total if total > 0 else None
    used_gpu_s = 0.0
    total_gpu_s = 0.0
    for here, after in itertools.pairwise(ordered):
        dt = after.t_s - here.t_s
        used_gpu_s += here.gpus_used * dt
        total_gpu_s += here.gpus_total * dt
    return used_gpu_s / total_gpu_s if total_gpu_s > 0 else None


def _error_stats(pairs: Sequence[tuple[float, float]]) -> dict[str, Any]:
    if not pairs:
        return {"jobs": 0, "median": None, "p90": None, "bias": None}
    arr = np.asarray(pairs, dtype=np.float64)
    ratio = arr[:, 0] / arr[:, 1]
    error = np.abs(ratio - 1.0)
    return {
        "jobs": len(pairs),
        "median": float(np.percentile(error, 50)),
        "p90": float(np.percentile(error, 90)),
        "bias": float(np.exp(np.log(ratio).mean())),
    }


def belief_error(records: Iterable[JobRecord]) -> dict[str, Any]:
    """How far the scheduler's expected step time was from the true one (see the module docstring):
    overall, per GPU model of the lead part, and the share of jobs whose true speed was derived
    rather than measured (:attr:`~loom.sim.model.JobRecord.truth_rule` other than ``measured``)."""
    ran = [
        r
        for r in records
        if r.rejected is None and r.start_s is not None and r.step_s > 0 and r.belief_step_s > 0
    ]
    pairs = [(r.belief_step_s, r.step_s) for r in ran]
    by_model: dict[str, list[tuple[float, float]]] = {}
    for r in ran:
        by_model.setdefault(r.gpu_model, []).append((r.belief_step_s, r.step_s))
    timed = [r for r in ran if r.truth_rule]
    rules = Counter(r.truth_rule for r in timed)
    return {
        **_error_stats(pairs),
        "timed_by": "truth" if timed else ("belief" if ran else None),
        "derived_share": (sum(1 for r in timed if r.truth_rule != "measured") / len(timed))
        if timed
        else None,
        "truth_rules": dict(sorted(rules.items(), key=lambda kv: (-kv[1], kv[0]))),
        "by_gpu_model": {m: _error_stats(by_model[m]) for m in sorted(by_model)},
    }


REASONS_KEPT = 5
"""Rejection reasons listed per policy (the most frequent)."""


def rejected_reasons(records: Iterable[JobRecord], keep: int = REASONS_KEPT) -> dict[str, int]:
    """The most frequent reasons jobs were rejected for, with how many each (most first)."""
    counts = Counter(r.rejected for r in records if r.rejected is not None)
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:keep])


def by_class(records: Iterable[JobRecord]) -> dict[str, list[JobRecord]]:
    """Records grouped by job class, classes in :data:`CLASS_ORDER` (unknown ones after, sorted)."""
    groups: dict[str, list[JobRecord]] = {}
    for r in records:
        groups.setdefault(r.job_class, []).append(r)
    order = {c: i for i, c in enumerate(CLASS_ORDER)}
    return {c: groups[c] for c in sorted(groups, key=lambda c: (order.get(c, len(order)), c))}


def summarize(result: SimResult) -> dict[str, Any]:
    """One policy's figures, overall and per job class (see the module docstring for definitions)."""
    overall = group_stats(result.records)
    if result.probes:
        # Speed probes are the policy's own runs: out of the jobs' figures, in what the platform spent.
        spent = group_stats(result.probes)
        for key in ("gpu_hours", "scu_hours", "cost", "gpu_cost", "transfer_cost"):
            overall[key] += spent[key]
    overall["probes"] = {
        "runs": len(result.probes),
        "gpu_hours": gpu_hours(result.probes),
        "cost": sum(r.cost + r.transfer_cost for r in result.probes),
    }
    overall["gpu_utilisation_mean"] = mean_utilisation(result.timeline)
    overall["rejected_reasons"] = rejected_reasons(result.records)
    return {
        "policy": result.policy,
        "overall": overall,
        "by_class": {c: group_stats(rs) for c, rs in by_class(result.records).items()},
        "belief_error": belief_error(result.records),
        "wall_s": result.wall_s,
        "decisions": result.decisions,
        "peak_rss_mib": result.peak_rss_mib,
        "notes": list(result.notes),
    }


# ---- policies against each other --------------------------------------------------------------


def improvement(target: float | None, other: float | None) -> float | None:
    """``(other - target) / other``: the share by which ``target`` is lower; None when undefined."""
    if target is None or other is None or other <= 0:
        return None
    return (other - target) / other


def paired_mean_jct(
    target: Sequence[JobRecord], other: Sequence[JobRecord]
) -> tuple[float | None, float | None, int]:
    """Mean JCT of each side over the jobs that finished under both, and how many those are."""
    theirs = {r.job_id: j for r in other if r.rejected is None and (j := r.jct_s) is not None}
    pairs = [
        (j, theirs[r.job_id])
        for r in target
        if r.rejected is None and (j := r.jct_s) is not None and r.job_id in theirs
    ]
    if not pairs:
        return None, None, 0
    arr = np.asarray(pairs, dtype=np.float64)
    return float(arr[:, 0].mean()), float(arr[:, 1].mean()), len(pairs)


def _compare_groups(
    target_stats: Mapping[str, Any],
    other_stats: Mapping[str, Any],
    target_records: Sequence[JobRecord],
    other_records: Sequence[JobRecord],
) -> dict[str, Any]:
    out: dict[str, Any] = {m: improvement(target_stats.get(m), other_stats.get(m)) for m in COMPARED}
    mine, theirs, jobs = paired_mean_jct(target_records, other_records)
    out["jct_mean_paired"] = improvement(mine, theirs)
    out["paired_jobs"] = jobs
    out["finished"] = {"target": target_stats["finished"], "other": other_stats["finished"]}
    return out


def compare(results: Sequence[SimResult], baseline: str, target: str = "loom") -> dict[str, Any]:
    """Improvements of ``target`` over every other policy, overall and per class (lower is better
    for every figure in :data:`COMPARED`); ``headline`` is the comparison with ``baseline``."""
    by_policy = {r.policy: r for r in results}
    if baseline == target:
        raise ValueError(f"the baseline must be another policy than the target {target!r}")
    if target not in by_policy:
        raise KeyError(f"no result for the target policy {target!r}; have {sorted(by_policy)}")
    if baseline not in by_policy:
        raise KeyError(f"no result for the baseline policy {baseline!r}; have {sorted(by_policy)}")
    mine = by_policy[target]
    my_summary = summarize(mine)
    my_classes = by_class(mine.records)
    vs: dict[str, Any] = {}
    for name, other in by_policy.items():
        if name == target:
            continue
        summary = summarize(other)
        their_classes = by_class(other.records)
        vs[name] = {
            "overall": _compare_groups(
                my_summary["overall"], summary["overall"], mine.records, other.records
            ),
            "by_class": {
                c: _compare_groups(
                    my_summary["by_class"][c], summary["by_class"][c], my_classes[c], their_classes[c]
                )
                for c in my_classes
                if c in their_classes
            },
        }
    return {
        "target": target,
        "baseline": baseline,
        "metrics": [*COMPARED, "jct_mean_paired"],
        "meaning": "(other - target) / other: positive means the target is lower (better) by that share",
        "headline": vs[baseline],
        "vs": vs,
    }


# ---- the must-shows -------------------------------------------------------------------


def _find(results: Sequence[SimResult], name: str) -> SimResult | None:
    return next((r for r in results if r.policy == name), None)


def _not_run(claim: str, why: str) -> dict[str, Any]:
    return {"claim": claim, "passed": None, "reason": why}


def check_net_training(
    results: Sequence[SimResult], *, target: str = "loom", baseline: str = "greedy_compute"
) -> dict[str, Any]:
    """Must-show (a): ``net_training`` mean JCT at least 25 % below ``baseline``'s, and no other
    class's mean JCT more than 5 % above it. Mean JCT is paired (jobs finished under both); a
    class in which the target finishes fewer jobs than the baseline fails whatever its mean."""
    claim = (
        f"net_training mean JCT >= {NET_JCT_REQUIRED:.0%} lower under {target} than {baseline}, "
        f"no other class > {OTHER_CLASS_WORSE_MAX:.0%} worse"
    )
    mine, theirs = _find(results, target), _find(results, baseline)
    if mine is None or theirs is None:
        return _not_run(claim, f"needs results of both {target} and {baseline}")
    my_classes, their_classes = by_class(mine.records), by_class(theirs.records)
    if "net_training" not in my_classes or "net_training" not in their_classes:
        return _not_run(claim, "the workload has no net_training jobs")
    classes: dict[str, Any] = {}
    for c, records in my_classes.items():
        if c not in their_classes:
            continue
        a, b, jobs = paired_mean_jct(records, their_classes[c])
        gain = improvement(a, b)
        finished = {"target": len(jcts(records)), "baseline": len(jcts(their_classes[c]))}
        # A job the target leaves unfinished (or rejects) that the baseline completes is worse
        # than any JCT, and pairing alone would drop it: the class fails outright.
        not_fewer = finished["target"] >= finished["baseline"]
        required = NET_JCT_REQUIRED if c == "net_training" else -OTHER_CLASS_WORSE_MAX
        if c == "net_training":
            gain_ok = gain is not None and gain >= required
        else:
            # No job of the class finished under either policy: nothing got worse.
            gain_ok = gain >= required if gain is not None else finished["baseline"] == 0
        classes[c] = {
            "target_jct_mean_s": a,
            "baseline_jct_mean_s": b,
            "paired_jobs": jobs,
            "finished": finished,
            "improvement": gain,
            "required": required,
            "passed": gain_ok and not_fewer,
        }
    net = classes["net_training"]
    return {
        "claim": claim,
        "passed": all(v["passed"] for v in classes.values()),
        "target": target,
        "baseline": baseline,
        "net_training_improvement": net["improvement"],
        "worst_other_class": _worst_other(classes),
        "classes": classes,
    }


def _worst_other(classes: Mapping[str, Mapping[str, Any]]) -> dict[str, Any] | None:
    others = [
        (v["improvement"], c)
        for c, v in classes.items()
        if c != "net_training" and v["improvement"] is not None
    ]
    if not others:
        return None
    gain, name = min(others)
    return {"class": name, "improvement": gain}


def check_multi_stage(
    results: Sequence[SimResult], *, target: str = "loom", baseline: str = "home_region"
) -> dict[str, Any]:
    """Must-show (b): on the seeds' multi-stage scenario, total time (makespan: first arrival to last
    end) and total cost both improved over ``baseline`` by more than 23 % and 18 %; the target must
    also finish every job the baseline finishes, or its time and cost would not be comparable."""
    claim = (
        f"multi-stage scenario: total time > {SCENARIO_TIME_REQUIRED:.0%} and cost > "
        f"{SCENARIO_COST_REQUIRED:.0%} lower under {target} than {baseline}"
    )
    mine, theirs = _find(results, target), _find(results, baseline)
    if mine is None or theirs is None:
        return _not_run(claim, f"needs results of both {target} and {baseline}")
    a, b = group_stats(mine.records), group_stats(theirs.records)
    time_gain = improvement(a["makespan_s"], b["makespan_s"])
    cost_gain = improvement(a["cost"], b["cost"])
    finished_ok = a["finished"] >= b["finished"]
    time_ok = time_gain is not None and time_gain > SCENARIO_TIME_REQUIRED
    cost_ok = cost_gain is not None and cost_gain > SCENARIO_COST_REQUIRED
    return {
        "claim": claim,
        "passed": time_ok and cost_ok and finished_ok,
        "target": target,
        "baseline": baseline,
        "total_time_s": {"target": a["makespan_s"], "baseline": b["makespan_s"]},
        "cost": {"target": a["cost"], "baseline": b["cost"]},
        "finished": {"target": a["finished"], "baseline": b["finished"], "jobs": a["jobs"]},
        "time_improvement": time_gain,
        "cost_improvement": cost_gain,
        "required": {"time": SCENARIO_TIME_REQUIRED, "cost": SCENARIO_COST_REQUIRED},
        "passed_parts": {"time": time_ok, "cost": cost_ok, "finished_every_job": finished_ok},
    }


def check_claims(
    mix: Sequence[SimResult] | None = None,
    scenario: Sequence[SimResult] | None = None,
    *,
    target: str = "loom",
) -> dict[str, Any]:
    """The issue's must-shows with their numbers: (a) on a training mix, against compute-only
    greedy; (b) on the multi-stage scenario, against the fixed home region. A check whose results
    were not given has ``passed: None``; ``passed`` overall is None when no check ran."""
    checks: dict[str, dict[str, Any]] = {
        "net_training_vs_greedy": (
            check_net_training(mix, target=target)
            if mix is not None
            else _not_run("net_training vs greedy_compute", "no training-mix run")
        ),
        "multi_stage_vs_home_region": (
            check_multi_stage(scenario, target=target)
            if scenario is not None
            else _not_run("multi-stage scenario vs home_region", "no scenario run")
        ),
    }
    verdicts = [c["passed"] for c in checks.values() if c["passed"] is not None]
    return {"passed": all(verdicts) if verdicts else None, "checks": checks}
