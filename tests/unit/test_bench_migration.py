"""``loom bench migration``: its margins and summary, and the checkpoints it gives every job."""

from typing import Any

import pytest

from loom.sim.model import SimJob, Trace
from loom_benchmarks.migration import aggregate, paired_difference, summary, with_checkpoints
from loom_proto.jobs import JobSpec, Work


def run(seed: int, scenario: str, jct: dict[str, float]) -> dict[str, Any]:
    return {
        "platform": "wide16",
        "load": 0.5,
        "seed": seed,
        "scenario": scenario,
        "modes": {m: {"jct_mean_s": v, "migrations": 1} for m, v in jct.items()},
        "moved_jobs_effect": {"on": {"jobs": 2, "jct_mean_s": 50.0, "jct_mean_never_s": 100.0}},
    }


def test_margins_are_pooled_over_seeds_and_losses_are_listed() -> None:
    runs = [
        run(1, "failure", {"on": 90.0, "never": 100.0, "always": 120.0}),
        run(2, "failure", {"on": 110.0, "never": 100.0, "always": 80.0}),
        run(1, "degradation", {"on": 100.0, "never": 90.0, "always": 110.0}),
    ]
    cells = {c["scenario"]: c for c in aggregate(runs)}
    failure = cells["failure"]
    assert failure["modes"]["on"]["jct_mean_s"] == pytest.approx(100.0)
    assert failure["on_vs_never"] == pytest.approx(0.0)
    assert failure["on_vs_always"] == pytest.approx(0.0)
    assert failure["on_vs_never_per_seed"] == [pytest.approx(0.1), pytest.approx(-0.1)]
    assert failure["moved_jobs"]["on"] == {
        "jobs": 4,
        "jct_mean_s": 50.0,
        "jct_mean_never_s": 100.0,
        "vs_never": pytest.approx(0.5),
    }
    out = summary(list(cells.values()))
    assert out["failure"]["on_beats_both"] == 0
    assert out["degradation"]["on_loses_to_never"] == ["wide16/0.5: -11.1%"]
    assert out["degradation"]["on_loses_to_always"] == []


def test_every_job_checkpoints_every_300_reference_seconds_at_least_every_step() -> None:
    jobs = [
        SimJob(spec=JobSpec(job_id="a", tenant="t", work=Work(steps=1000, step_time_s=0.5)), arrival_s=0.0),
        SimJob(spec=JobSpec(job_id="b", tenant="t", work=Work(steps=10, step_time_s=900.0)), arrival_s=1.0),
    ]
    out = with_checkpoints(Trace(jobs=jobs))
    assert [j.spec.work.checkpoint_every_steps for j in out.jobs] == [600, 1]
    assert "checkpoints every 300 s" in out.source


def test_the_paired_difference_splits_moved_jobs_from_knock_on() -> None:
    on = {"a": 100.0, "b": 200.0, "c": 300.0, "d": 400.0}
    never = {"a": 160.0, "b": 200.0, "c": 340.0, "d": 300.0}
    out = paired_difference(on, never, {"a", "x"})  # "x" did not finish in both: not compared
    assert out == {
        "moved": 1,
        "moved_s": pytest.approx(60.0 / 4),
        "knock_on_s": pytest.approx((40.0 - 100.0) / 4),
        "moved_own_s": pytest.approx(60.0),
        "changed": 2,
    }
    # The parts add up to the difference of the two means.
    total = sum(never.values()) / 4 - sum(on.values()) / 4
    assert out["moved_s"] + out["knock_on_s"] == pytest.approx(total)
    assert paired_difference(on, never, set())["moved_own_s"] is None


def test_crossings_count_spanning_gangs_and_inference_away_from_users_not_pipelines_or_ended() -> None:
    from loom.sim.model import JobRecord
    from loom_benchmarks.migration import crossings
    from loom_proto.jobs import Affinity, Layer, Pipeline

    specs = {
        "gang": JobSpec(job_id="gang", tenant="t", work=Work(steps=1)),
        "inf": JobSpec(
            job_id="inf",
            tenant="t",
            work=Work(steps=1),
            task_type="inference",
            affinity=Affinity(prefer_regions=["c"]),
        ),
        "home": JobSpec(
            job_id="home",
            tenant="t",
            work=Work(steps=1),
            task_type="inference",
            affinity=Affinity(prefer_regions=["a"]),
        ),
        "pipe": JobSpec(
            job_id="pipe",
            tenant="t",
            work=Work(steps=1),
            pipeline=Pipeline(layers=[Layer(name="l0", compute_s=1.0)]),
        ),
        "done": JobSpec(job_id="done", tenant="t", work=Work(steps=1)),
    }

    def rec(job_id: str, regions: tuple[str, ...], start: float, end: float | None = None) -> JobRecord:
        return JobRecord(
            job_id=job_id,
            job_class="batch",
            tenant="t",
            arrival_s=0.0,
            start_s=start,
            end_s=end,
            regions=regions,
        )

    records = [
        rec("gang", ("a", "b"), 10.0),
        rec("inf", ("a",), 10.0),  # served in a, its users in c
        rec("home", ("a",), 10.0),  # served where its users are
        rec("pipe", ("a", "b", "d"), 10.0),  # the simulator keeps a pipeline's step on a link change
        rec("done", ("a", "b"), 10.0, end=50.0),
    ]
    assert crossings(records, specs, 100.0) == {"a": 2, "b": 1, "c": 1}
    assert crossings(records, specs, 5.0) == {}  # nothing started yet
    assert crossings(records, specs, 20.0)["b"] == 2  # "done" still runs


def test_a_loss_is_called_beyond_noise_only_past_two_standard_errors_of_its_seeds() -> None:
    """Paired per-seed margins give each cell's noise: a loss of 1 % whose seeds swing ±10 % is
    within it; the same loss on seeds that agree is not. The scenario's mean per mode is given too."""
    noisy = [
        run(1, "failure", {"on": 90.0, "never": 100.0, "always": 80.0}),
        run(2, "failure", {"on": 112.0, "never": 100.0, "always": 120.0}),
    ]
    steady = [
        run(1, "degradation", {"on": 101.0, "never": 100.0, "always": 110.0}),
        run(2, "degradation", {"on": 101.5, "never": 100.0, "always": 110.0}),
        run(3, "degradation", {"on": 101.2, "never": 100.0, "always": 110.0}),
    ]
    cells = {c["scenario"]: c for c in aggregate(noisy + steady)}
    assert cells["failure"]["on_vs_never"] == pytest.approx(-0.01)
    assert cells["failure"]["on_vs_never_se"] == pytest.approx(0.11, abs=1e-4)
    out = summary(list(cells.values()))
    assert out["failure"]["on_loses_to_never"] == ["wide16/0.5: -1.0%"]
    assert out["failure"]["on_loses_beyond_noise"] == []
    assert out["degradation"]["on_loses_beyond_noise"] == ["wide16/0.5 vs never: -1.2% (± 0.1%)"]
    assert out["degradation"]["scenario_mean_jct_s"] == {"on": 101.2, "never": 100.0, "always": 110.0}
