"""Metrics, comparisons, the must-show checks and the report, on hand-made simulation results.

Every result here is built by hand, so each expected figure can be worked out on paper: the
percentiles, the time-weighted utilisation, the per-class grouping, and that rejected or unfinished
jobs never enter a JCT. The claim checks are exercised both ways (a result that passes and one
that fails), and the report must write every plot and a page that links them.
"""

import argparse
import json
from pathlib import Path

import numpy as np
import pytest

from loom.sim import metrics
from loom.sim.model import JobClass, JobRecord, Sample, SimResult
from loom.sim.report import PLOTS, REPORT_NAME, SUMMARY_NAME, fmt_bytes, fmt_duration, write_report


def rec(
    job_id: str,
    job_class: JobClass = "batch",
    *,
    arrival_s: float = 0.0,
    start_s: float | None = None,
    end_s: float | None = None,
    gpus: int = 1,
    cost: float = 0.0,
    scu_hours: float = 0.0,
    cross_region_bytes: float = 0.0,
    rejected: str | None = None,
) -> JobRecord:
    return JobRecord(
        job_id=job_id,
        job_class=job_class,
        tenant="t",
        arrival_s=arrival_s,
        start_s=start_s,
        end_s=end_s,
        gpus=gpus,
        cost=cost,
        scu_hours=scu_hours,
        cross_region_bytes=cross_region_bytes,
        rejected=rejected,
    )


def finished(
    job_id: str, job_class: JobClass, jct_s: float, *, queue_s: float = 0.0, cost: float = 1.0
) -> JobRecord:
    return rec(job_id, job_class, arrival_s=0.0, start_s=queue_s, end_s=jct_s, cost=cost)


def result(policy: str, records: list[JobRecord], timeline: list[Sample] | None = None) -> SimResult:
    return SimResult(policy=policy, records=records, timeline=timeline or [])


# ---- summarize --------------------------------------------------------------------------------


def test_jct_percentiles_interpolate_linearly_over_finished_jobs() -> None:
    records = [finished(f"j{i}", "batch", float(v)) for i, v in enumerate([10, 20, 30, 40, 100])]
    s = metrics.summarize(result("p", records))["overall"]
    assert s["jct_mean_s"] == pytest.approx(40.0)
    assert s["jct_p50_s"] == pytest.approx(30.0)
    # p99 of [10, 20, 30, 40, 100]: rank 0.99 * 4 = 3.96 -> 40 + 0.96 * 60
    assert s["jct_p99_s"] == pytest.approx(97.6)
    assert s["jct_p99_s"] == pytest.approx(float(np.percentile([10, 20, 30, 40, 100], 99)))


def test_rejected_and_unfinished_jobs_are_counted_but_never_enter_jct_or_queueing() -> None:
    records = [
        rec("done", arrival_s=0.0, start_s=5.0, end_s=15.0),
        rec("rejected", arrival_s=0.0, rejected="no GPU model allowed exists"),
        # A rejected job with times set by mistake must still not count.
        rec("rejected-late", arrival_s=0.0, start_s=1.0, end_s=10_000.0, rejected="quota"),
        rec("running", arrival_s=2.0, start_s=4.0),
        rec("queued", arrival_s=3.0),
    ]
    s = metrics.summarize(result("p", records))["overall"]
    assert (s["jobs"], s["finished"], s["rejected"], s["unfinished"]) == (5, 1, 2, 2)
    assert s["jct_mean_s"] == pytest.approx(15.0)
    assert s["jct_p99_s"] == pytest.approx(15.0)
    # Queueing: "done" waited 5 s, "running" 2 s; rejected and never-started jobs have none.
    assert s["queue_mean_s"] == pytest.approx(3.5)
    assert s["makespan_s"] == pytest.approx(15.0)


def test_rejection_reasons_are_counted_most_frequent_first_and_truth_rules_per_job() -> None:
    records = [
        rec("a", rejected="no GPU model allowed exists"),
        rec("b", rejected="quota"),
        rec("c", rejected="no GPU model allowed exists"),
        *(rec(f"r{i}", rejected=f"reason {i}") for i in range(6)),
        rec("done", start_s=0.0, end_s=10.0),
    ]
    s = metrics.summarize(result("p", records))["overall"]
    reasons = s["rejected_reasons"]
    assert list(reasons.items())[:2] == [("no GPU model allowed exists", 2), ("quota", 1)]
    assert len(reasons) == metrics.REASONS_KEPT  # the most frequent only
    timed = [
        JobRecord(
            job_id=f"t{i}",
            job_class="batch",
            tenant="t",
            arrival_s=0.0,
            start_s=0.0,
            end_s=1.0,
            step_s=1.0,
            belief_step_s=1.0,
            truth_rule=rule,
        )
        for i, rule in enumerate(["measured", "peer-ratio", "measured", "derived-reference"])
    ]
    rules = metrics.belief_error(timed)["truth_rules"]
    assert rules == {"measured": 2, "derived-reference": 1, "peer-ratio": 1}


def test_no_finished_job_gives_none_not_zero() -> None:
    s = metrics.summarize(result("p", [rec("q"), rec("r", rejected="x")]))["overall"]
    assert s["jct_mean_s"] is None
    assert s["jct_p99_s"] is None
    assert s["queue_mean_s"] is None
    assert s["makespan_s"] is None


def test_figures_are_grouped_per_class_in_a_stable_order() -> None:
    records = [
        rec("b1", "batch", arrival_s=0.0, start_s=0.0, end_s=100.0, cost=2.0, scu_hours=1.0),
        rec("n1", "net_training", arrival_s=10.0, start_s=20.0, end_s=50.0, cost=5.0, cross_region_bytes=1e9),
        rec("n2", "net_training", arrival_s=10.0, start_s=10.0, end_s=70.0, cost=3.0, cross_region_bytes=2e9),
        rec("i1", "inference", arrival_s=0.0, rejected="too big"),
    ]
    s = metrics.summarize(result("p", records))
    assert list(s["by_class"]) == ["net_training", "inference", "batch"]
    net = s["by_class"]["net_training"]
    assert (net["jobs"], net["finished"]) == (2, 2)
    assert net["jct_mean_s"] == pytest.approx(50.0)  # 40 and 60
    assert net["queue_mean_s"] == pytest.approx(5.0)  # 10 and 0
    assert net["makespan_s"] == pytest.approx(60.0)  # arrival 10 -> end 70
    assert net["cost"] == pytest.approx(8.0)
    assert net["cross_region_bytes"] == pytest.approx(3e9)
    assert s["by_class"]["inference"]["rejected"] == 1
    assert s["by_class"]["batch"]["scu_hours"] == pytest.approx(1.0)
    assert s["overall"]["cost"] == pytest.approx(10.0)
    assert s["overall"]["jobs"] == sum(c["jobs"] for c in s["by_class"].values())


def test_utilisation_is_time_weighted_with_each_sample_holding_until_the_next() -> None:
    timeline = [
        Sample(t_s=0.0, gpus_used=10, gpus_total=10, cross_region_bytes=0.0),
        # 1 s at 100 %, then 9 s at 0 %: an unweighted mean of samples would say 50 %.
        Sample(t_s=1.0, gpus_used=0, gpus_total=10, cross_region_bytes=0.0),
        Sample(t_s=10.0, gpus_used=0, gpus_total=10, cross_region_bytes=0.0),
    ]
    assert metrics.mean_utilisation(timeline) == pytest.approx(0.1)
    # Order of the samples does not matter.
    assert metrics.mean_utilisation(list(reversed(timeline))) == pytest.approx(0.1)


def test_utilisation_weighs_by_the_gpus_that_existed_while_a_cluster_was_down() -> None:
    timeline = [
        Sample(t_s=0.0, gpus_used=5, gpus_total=10, cross_region_bytes=0.0),
        Sample(t_s=10.0, gpus_used=5, gpus_total=5, cross_region_bytes=0.0),
        Sample(t_s=20.0, gpus_used=0, gpus_total=10, cross_region_bytes=0.0),
    ]
    # (5*10 + 5*10) GPU-s used of (10*10 + 5*10) GPU-s that existed.
    assert metrics.mean_utilisation(timeline) == pytest.approx(100 / 150)


def test_utilisation_of_an_empty_or_single_sample_timeline() -> None:
    assert metrics.mean_utilisation([]) is None
    assert metrics.mean_utilisation([Sample(5.0, 3, 4, 0.0)]) == pytest.approx(0.75)
    assert metrics.summarize(result("p", []))["overall"]["gpu_utilisation_mean"] is None


# ---- compare ----------------------------------------------------------------------------------


def test_compare_gives_improvements_of_the_target_over_every_other_policy_per_class() -> None:
    loom = result("loom", [finished("a", "net_training", 60.0, cost=8.0), finished("b", "batch", 100.0)])
    greedy = result(
        "greedy_compute", [finished("a", "net_training", 100.0, cost=10.0), finished("b", "batch", 100.0)]
    )
    rnd = result("random", [finished("a", "net_training", 50.0), finished("b", "batch", 200.0)])
    out = metrics.compare([loom, greedy, rnd], baseline="greedy_compute")
    assert out["target"] == "loom"
    assert set(out["vs"]) == {"greedy_compute", "random"}
    assert out["headline"] is out["vs"]["greedy_compute"]
    net = out["vs"]["greedy_compute"]["by_class"]["net_training"]
    assert net["jct_mean_s"] == pytest.approx(0.4)
    assert net["jct_mean_paired"] == pytest.approx(0.4)
    assert net["cost"] == pytest.approx(0.2)
    # Worse than random on net_training: a negative improvement.
    assert out["vs"]["random"]["by_class"]["net_training"]["jct_mean_s"] == pytest.approx(-0.2)
    assert out["vs"]["random"]["by_class"]["batch"]["jct_mean_s"] == pytest.approx(0.5)


def test_compare_pairs_jobs_so_leaving_slow_jobs_unfinished_does_not_help() -> None:
    # The target finishes only the quick job; its unpaired mean looks 10x better, the paired one is equal.
    loom = result("loom", [finished("quick", "batch", 10.0), rec("slow", arrival_s=0.0, start_s=0.0)])
    other = result("first_fit", [finished("quick", "batch", 10.0), finished("slow", "batch", 190.0)])
    overall = metrics.compare([loom, other], baseline="first_fit")["headline"]["overall"]
    assert overall["jct_mean_s"] == pytest.approx(0.9)
    assert overall["jct_mean_paired"] == pytest.approx(0.0)
    assert overall["paired_jobs"] == 1
    assert overall["finished"] == {"target": 1, "other": 2}


def test_compare_without_zero_division_when_the_other_never_queued() -> None:
    loom = result("loom", [finished("a", "batch", 10.0, queue_s=1.0)])
    other = result("random", [finished("a", "batch", 10.0, queue_s=0.0)])
    assert metrics.compare([loom, other], baseline="random")["headline"]["overall"]["queue_mean_s"] is None


def test_compare_refuses_missing_target_or_baseline_or_the_target_as_baseline() -> None:
    with pytest.raises(ValueError, match="another policy"):
        metrics.compare([result("loom", [])], baseline="loom")
    with pytest.raises(KeyError, match="target"):
        metrics.compare([result("random", [])], baseline="random")
    with pytest.raises(KeyError, match="baseline"):
        metrics.compare([result("loom", [])], baseline="greedy_compute")


# ---- claims -----------------------------------------------------------------------------------


def _mix(net_loom: float, batch_loom: float) -> list[SimResult]:
    loom = result(
        "loom",
        [
            finished("n1", "net_training", net_loom),
            finished("n2", "net_training", net_loom),
            finished("b1", "batch", batch_loom),
            finished("i1", "inference", 50.0),
        ],
    )
    greedy = result(
        "greedy_compute",
        [
            finished("n1", "net_training", 100.0),
            finished("n2", "net_training", 100.0),
            finished("b1", "batch", 100.0),
            finished("i1", "inference", 50.0),
        ],
    )
    return [loom, greedy]


def test_net_training_claim_passes_at_25_percent_with_others_within_5_percent() -> None:
    check = metrics.check_claims(mix=_mix(net_loom=75.0, batch_loom=105.0))
    net = check["checks"]["net_training_vs_greedy"]
    assert net["passed"] is True
    assert net["net_training_improvement"] == pytest.approx(0.25)
    assert net["classes"]["batch"]["improvement"] == pytest.approx(-0.05)
    assert net["worst_other_class"] == {"class": "batch", "improvement": pytest.approx(-0.05)}
    assert check["passed"] is True
    assert check["checks"]["multi_stage_vs_home_region"]["passed"] is None


def test_net_training_claim_fails_when_the_gain_is_short_of_25_percent() -> None:
    net = metrics.check_claims(mix=_mix(net_loom=76.0, batch_loom=100.0))["checks"]["net_training_vs_greedy"]
    assert net["passed"] is False
    assert net["classes"]["net_training"]["passed"] is False
    assert net["net_training_improvement"] == pytest.approx(0.24)


def test_net_training_claim_fails_when_another_class_gets_more_than_5_percent_worse() -> None:
    check = metrics.check_claims(mix=_mix(net_loom=50.0, batch_loom=106.0))
    net = check["checks"]["net_training_vs_greedy"]
    assert net["classes"]["net_training"]["passed"] is True
    assert net["classes"]["batch"]["passed"] is False
    assert net["passed"] is False
    assert check["passed"] is False


def test_net_training_claim_fails_when_the_target_leaves_jobs_of_a_class_unfinished() -> None:
    loom, greedy = _mix(net_loom=50.0, batch_loom=100.0)
    # The batch job never finishes under Loom: pairing drops it, so its mean alone would pass.
    loom.records[2] = rec("b1", "batch", arrival_s=0.0, start_s=0.0)
    net = metrics.check_net_training([loom, greedy])
    assert net["classes"]["batch"]["finished"] == {"target": 0, "baseline": 1}
    assert net["classes"]["batch"]["passed"] is False
    assert net["passed"] is False


def test_net_training_claim_is_not_run_without_the_baseline_or_the_class() -> None:
    only_loom = metrics.check_claims(mix=[_mix(75.0, 100.0)[0]])["checks"]["net_training_vs_greedy"]
    assert only_loom["passed"] is None
    assert "greedy_compute" in only_loom["reason"]
    no_class = metrics.check_claims(
        mix=[
            result("loom", [finished("b", "batch", 1.0)]),
            result("greedy_compute", [finished("b", "batch", 1.0)]),
        ]
    )
    assert no_class["checks"]["net_training_vs_greedy"]["passed"] is None
    assert no_class["passed"] is None


def _scenario(loom_end_s: float, loom_cost: float, *, loom_finishes_all: bool = True) -> list[SimResult]:
    stages = [("pre", 0.0, 1.0), ("train", 1.0, 2.0), ("val", 2.0, 1.0)]
    home = result(
        "home_region",
        [
            rec(n, "dag", arrival_s=0.0, start_s=0.0, end_s=100.0 * (i + 1), cost=c)
            for i, (n, _, c) in enumerate(stages)
        ],
    )
    loom_records = [
        rec(n, "dag", arrival_s=0.0, start_s=0.0, end_s=loom_end_s, cost=loom_cost / 3) for n, _, _ in stages
    ]
    if not loom_finishes_all:
        loom_records[-1] = rec("val", "dag", arrival_s=0.0)
    return [result("loom", loom_records), home]


def test_multi_stage_claim_passes_when_time_and_cost_beat_23_and_18_percent() -> None:
    check = metrics.check_claims(scenario=_scenario(loom_end_s=200.0, loom_cost=3.2))
    stage = check["checks"]["multi_stage_vs_home_region"]
    assert stage["passed"] is True
    assert stage["total_time_s"] == {"target": 200.0, "baseline": 300.0}
    assert stage["time_improvement"] == pytest.approx(1 / 3)
    assert stage["cost_improvement"] == pytest.approx(0.2)
    assert check["passed"] is True


def test_multi_stage_claim_fails_at_exactly_the_seeds_figures_or_below() -> None:
    # "Better than the seeds' 23 % and 18 %": equal is not better.
    equal = metrics.check_multi_stage(_scenario(loom_end_s=231.0, loom_cost=3.2))
    assert equal["time_improvement"] == pytest.approx(0.23)
    assert equal["passed_parts"]["time"] is False
    assert equal["passed"] is False
    cheap_but_slow = metrics.check_multi_stage(_scenario(loom_end_s=290.0, loom_cost=1.0))
    assert cheap_but_slow["passed_parts"] == {"time": False, "cost": True, "finished_every_job": True}
    fast_but_dear = metrics.check_multi_stage(_scenario(loom_end_s=100.0, loom_cost=3.5))
    assert fast_but_dear["passed_parts"]["cost"] is False
    assert fast_but_dear["passed"] is False


def test_multi_stage_claim_fails_when_the_target_leaves_a_stage_unfinished() -> None:
    stage = metrics.check_multi_stage(_scenario(loom_end_s=100.0, loom_cost=1.0, loom_finishes_all=False))
    assert stage["passed_parts"]["finished_every_job"] is False
    assert stage["passed"] is False


# ---- report -----------------------------------------------------------------------------------


def _timeline(used: list[int], total: int = 16) -> list[Sample]:
    return [
        Sample(t_s=600.0 * i, gpus_used=u, gpus_total=total, cross_region_bytes=1e9 * i)
        for i, u in enumerate(used)
    ]


def _results() -> list[SimResult]:
    loom = result(
        "loom",
        [
            rec(
                "n1",
                "net_training",
                arrival_s=0.0,
                start_s=10.0,
                end_s=3600.0,
                cost=5.0,
                cross_region_bytes=1e9,
            ),
            rec("b1", "batch", arrival_s=60.0, start_s=60.0, end_s=900.0, cost=1.0),
            rec("i1", "inference", arrival_s=0.0, rejected="no model"),
        ],
        _timeline([4, 8, 16, 8, 0]),
    )
    greedy = result(
        "greedy_compute",
        [
            rec(
                "n1",
                "net_training",
                arrival_s=0.0,
                start_s=0.0,
                end_s=7200.0,
                cost=6.0,
                cross_region_bytes=4e9,
            ),
            rec("b1", "batch", arrival_s=60.0, start_s=120.0, end_s=1000.0, cost=1.0),
            rec("i1", "inference", arrival_s=0.0, start_s=0.0, end_s=30.0),
        ],
        _timeline([8, 16, 16, 16, 8, 0]),
    )
    return [loom, greedy]


def test_report_writes_every_plot_and_a_page_that_links_them(tmp_path: Path) -> None:
    results = _results()
    claims = metrics.check_claims(mix=results)
    comparison = metrics.compare(results, baseline="greedy_compute")
    page = write_report(
        results,
        tmp_path / "out",
        title="Policies on a tiny mix",
        context={"workload": "hand-made", "seed": 3},
        claims=claims,
        comparison=comparison,
    )
    assert page == tmp_path / "out" / REPORT_NAME
    for name in PLOTS.values():
        png = tmp_path / "out" / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    text = page.read_text()
    for name in PLOTS.values():
        assert f"]({name})" in text
    assert text.startswith("# Policies on a tiny mix")
    assert "- **seed**: 3" in text
    assert "| loom |" in text and "| greedy_compute |" in text
    assert "net_training_vs_greedy" in text
    assert "multi_stage_vs_home_region: not run" in text
    assert "Rejected by loom:\n- 1 x no model" in text  # why, next to the counts
    assert "| rejected | unfinished |" in text
    summary = json.loads((tmp_path / "out" / SUMMARY_NAME).read_text())
    assert [s["policy"] for s in summary["summaries"]] == ["loom", "greedy_compute"]
    assert (
        summary["claims"]["checks"]["net_training_vs_greedy"]["passed"]
        == claims["checks"]["net_training_vs_greedy"]["passed"]
    )


def test_report_is_the_same_bytes_for_the_same_results(tmp_path: Path) -> None:
    write_report(_results(), tmp_path / "a", title="t")
    write_report(_results(), tmp_path / "b", title="t")
    for name in [*PLOTS.values(), REPORT_NAME, SUMMARY_NAME]:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_report_copes_with_a_policy_that_finished_nothing_and_has_no_timeline(tmp_path: Path) -> None:
    page = write_report([result("loom", [rec("q")])], tmp_path, title="empty")
    assert all((tmp_path / name).stat().st_size > 0 for name in PLOTS.values())
    assert "| loom |" in page.read_text()


def test_report_refuses_no_results(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least one"):
        write_report([], tmp_path, title="nothing")


def test_durations_and_bytes_read_in_a_fitting_unit() -> None:
    assert fmt_duration(5400.0) == "1.5 h"
    assert fmt_duration(90.0) == "1.5 min"
    assert fmt_duration(45.0) == "45 s"
    assert fmt_duration(3 * 86_400.0) == "3 d"
    assert fmt_duration(None) == ""
    assert fmt_bytes(2.5e12) == "2.5 TB"
    assert fmt_bytes(0.0) == "0 B"


# ---- the benchmark's options ------------------------------------------------------------------


def _parse(*argv: str) -> argparse.Namespace:
    from loom_benchmarks import add_arguments

    parser = argparse.ArgumentParser(prog="loom bench")
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_bench_policies_defaults() -> None:
    from loom_benchmarks import policies

    args = _parse("policies")
    assert args.bench == "policies"
    options = policies.resolve(args, known=["loom", "random", "greedy_compute"])
    assert options.workload == "mix"
    assert options.topology == "default"
    assert options.policies == ["loom", "random", "greedy_compute"]
    assert options.out == Path("loom-report")
    assert not options.scale


def test_bench_policies_parses_every_option() -> None:
    from loom_benchmarks import policies

    args = _parse(
        "policies",
        "--workload",
        "traces/x.jsonl",
        "--topology",
        "small",
        "--jobs",
        "300",
        "--nodes",
        "500",
        "--policies",
        "greedy_compute, loom",
        "--seed",
        "9",
        "--out",
        "r",
        "--json",
    )
    options = policies.resolve(args, known=["loom", "greedy_compute", "random"])
    assert options.rate_per_h is None
    assert options.workload == "traces/x.jsonl"
    assert (options.topology, options.jobs, options.nodes, options.seed) == ("small", 300, 500, 9)
    assert options.policies == ["greedy_compute", "loom"]
    assert options.out == Path("r")
    assert args.json is True


def test_bench_policies_scale_mode_runs_loom_alone_at_100k_and_writes_no_report_unless_asked() -> None:
    from loom_benchmarks import policies

    options = policies.resolve(_parse("policies", "--scale"), known=["loom", "random"])
    assert options.scale
    assert (options.nodes, options.jobs) == (100_000, 100_000)
    assert options.policies == ["loom"]
    assert options.out is None
    smaller = policies.resolve(_parse("policies", "--scale", "--nodes", "2000", "--out", "o"), known=["loom"])
    assert (smaller.nodes, smaller.jobs, smaller.out) == (2000, 100_000, Path("o"))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--policies", "loom,nope"), "unknown policy 'nope'"),
        (("--policies", ","), "at least one policy"),
        (("--jobs", "0"), "--jobs"),
        (("--nodes", "-5"), "--nodes"),
        (("--workload", "cats"), "--workload"),
        (("--rate", "0"), "--rate must be a positive"),
        (("--rate", "nan"), "--rate must be a positive"),
        (("--workload", "alibaba", "--rate", "100"), "--rate applies to --workload mix only"),
    ],
)
def test_bench_policies_refuses_bad_options(argv: tuple[str, ...], message: str) -> None:
    from loom_benchmarks import policies

    with pytest.raises(policies.OptionError, match=message):
        policies.resolve(_parse("policies", *argv), known=["loom", "random"])


def test_bench_policies_rate_sets_the_mix_arrivals_and_is_in_the_command_line() -> None:
    from loom.model.topology import load_topology
    from loom.sim.workloads import DEFAULT_ARRIVAL_RATE_PER_H
    from loom_benchmarks import policies

    topology = load_topology()
    argv = ("--rate", "1200", "--jobs", "40", "--nodes", "100")
    options = policies.resolve(_parse("policies", *argv), known=["loom"])
    assert options.rate_per_h == 1200.0
    assert "--rate 1200" in policies.command_line(options)
    fast = policies.build_workload(options, topology)
    default = policies.build_workload(
        policies.resolve(_parse("policies", "--jobs", "40", "--nodes", "100"), known=["loom"]), topology
    )
    assert fast.about["arrival_rate_per_h"] == 1200.0
    assert default.about["arrival_rate_per_h"] == DEFAULT_ARRIVAL_RATE_PER_H
    fast_span, default_span = (
        w.trace.jobs[-1].arrival_s - w.trace.jobs[0].arrival_s for w in (fast, default)
    )
    # The same seeded draws, scaled: a higher rate, a proportionally shorter arrival span.
    assert default_span > 0
    assert fast_span == pytest.approx(default_span * DEFAULT_ARRIVAL_RATE_PER_H / 1200.0)


def _bench_args(*argv: str) -> argparse.Namespace:
    return _parse("policies", "--json", *argv)


def test_bench_policies_runs_a_tiny_mix_and_writes_the_report(tmp_path: Path) -> None:
    from loom_benchmarks import policies

    out = tmp_path / "report"
    result = policies.run(
        _bench_args("--jobs", "12", "--nodes", "200", "--policies", "loom,greedy_compute", "--out", str(out))
    )
    decoded = json.loads(json.dumps(result))
    assert decoded["benchmark"] == "policies"
    assert decoded["mode"] == "compare"
    assert [s["policy"] for s in decoded["summaries"]] == ["loom", "greedy_compute"]
    assert set(decoded["headline"]) == {"loom", "greedy_compute"}
    assert decoded["platform"]["nodes"] == 200
    assert decoded["workload"]["jobs"] == decoded["summaries"][0]["overall"]["jobs"] >= 12
    assert decoded["comparison"]["baseline"] == "greedy_compute"
    assert decoded["claims"]["checks"]["net_training_vs_greedy"]["passed"] in (True, False, None)
    assert decoded["claims"]["checks"]["multi_stage_vs_home_region"]["passed"] is None
    assert "scale" not in decoded
    assert decoded["report"] == str(out / REPORT_NAME)
    assert all((out / name).is_file() for name in PLOTS.values())
    assert "loom bench policies --workload mix" in (out / REPORT_NAME).read_text()


def test_bench_policies_checks_the_scenario_claim_on_the_scenario(tmp_path: Path) -> None:
    from loom_benchmarks import policies

    result = policies.run(
        _bench_args(
            "--workload", "scenario", "--jobs", "3", "--policies", "loom,home_region", "--out", str(tmp_path)
        )
    )
    assert result["workload"]["jobs"] == 3
    assert result["workload"]["fixed_region"]
    assert result["comparison"]["baseline"] == "home_region"
    stage = result["claims"]["checks"]["multi_stage_vs_home_region"]
    assert stage["passed"] in (True, False)
    assert stage["finished"]["jobs"] == 3
    assert result["claims"]["checks"]["net_training_vs_greedy"]["passed"] is None


def test_bench_policies_scale_mode_reports_time_memory_and_the_target() -> None:
    from loom_benchmarks import policies

    result = policies.run(_bench_args("--scale", "--nodes", "150", "--jobs", "4"))
    scale = result["scale"]
    assert result["mode"] == "scale"
    assert [s["policy"] for s in result["summaries"]] == ["loom"]
    assert scale["nodes"] == 150
    assert scale["jobs"] == result["workload"]["jobs"] >= 4
    assert scale["target_s"] == 600.0
    assert scale["meets_target"] is (scale["total_s"] <= 600.0)
    assert scale["peak_rss_mib"] > 0
    assert result["report"] is None
    assert result["comparison"] is None


@pytest.mark.parametrize("jobs", [1, 2, 3, 12, 100, 1_000, 100_000])
def test_mix_units_are_the_fewest_that_make_at_least_the_jobs_asked(jobs: int) -> None:
    from loom.sim.workloads import DEFAULT_MIX, apportion
    from loom_benchmarks import policies

    def jobs_of(units: int) -> int:
        return units + 2 * apportion(units, DEFAULT_MIX)["dag"]

    units = policies.mix_units(jobs)
    assert jobs_of(units) >= jobs
    assert units == 1 or jobs_of(units - 1) < jobs
