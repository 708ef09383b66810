"""The migration decision: cost components, class margins, hysteresis, cool-down, budget, ranking."""

import math

import pytest

from loom.migrate.benefit import (
    Candidate,
    MigrationBudget,
    MigrationSettings,
    PathState,
    QueuedOption,
    RunningJobState,
    checkpoint_bytes_of,
    decide,
    displacement_s,
    job_class_of,
    link_trigger,
    migration_cost,
    plan_migrations,
)
from loom_proto.jobs import Communication, JobSpec, Resources, Work
from loom_proto.net import LinkState

SETTINGS = MigrationSettings()
PATH = PathState(rtt_ms=100.0, bandwidth_gbps=8.0, loss_rate=0.0)
"""8 Gbit/s: one GB a second, plus 0.1 s."""


def job(**kw: object) -> RunningJobState:
    base: dict[str, object] = {
        "job_id": "j",
        "job_class": "training",
        "cluster": "c-a",
        "region": "r-a",
        "steps": 10_000,
        "steps_done": 1_050.0,
        "step_s": 1.0,
        "checkpoint_every_steps": 100,
        "checkpoint_bytes": 10e9,
    }
    base.update(kw)
    return RunningJobState(**base)  # type: ignore[arg-type]


def target(step_s: float = 0.5, **kw: object) -> Candidate:
    return Candidate(cluster="c-b", region="r-b", step_s=step_s, **kw)  # type: ignore[arg-type]


def test_a_voluntary_move_saves_a_checkpoint_copies_it_and_restarts_losing_nothing() -> None:
    cost = migration_cost(job(), target(), PATH, SETTINGS)
    assert cost.save_s == pytest.approx(10e9 * 8 / 4e9)  # 4 Gbit/s local write
    assert cost.transfer_s == pytest.approx(0.1 + 10.0)
    assert cost.restart_s == SETTINGS.restart_s
    assert cost.lost_steps == 0.0
    assert cost.lost_s == 0.0
    assert cost.total_s == pytest.approx(20.0 + 10.1 + 60.0)
    assert cost.transfer_bytes == 10e9


def test_a_lost_run_resumes_from_its_last_checkpoint_and_redoes_the_rest_at_the_targets_pace() -> None:
    cost = migration_cost(job(), target(step_s=0.5), PATH, SETTINGS, run_lost=True)
    assert cost.save_s == 0.0
    assert cost.lost_steps == pytest.approx(50.0)  # 1,050 done, checkpoint at 1,000
    assert cost.lost_s == pytest.approx(25.0)
    assert cost.transfer_s == pytest.approx(10.1)


def test_without_on_demand_saves_a_move_loses_the_steps_since_the_last_checkpoint() -> None:
    settings = MigrationSettings(save_on_demand=False)
    cost = migration_cost(job(), target(step_s=2.0), PATH, settings)
    assert cost.save_s == 0.0
    assert cost.lost_s == pytest.approx(100.0)


def test_a_job_without_checkpoints_loses_everything_and_sends_no_bytes() -> None:
    cost = migration_cost(job(checkpoint_every_steps=0), target(step_s=1.0), PATH, SETTINGS)
    assert cost.transfer_bytes == 0.0
    assert cost.transfer_s == 0.0
    assert cost.lost_steps == pytest.approx(1_050.0)


def test_loss_slows_the_transfer_and_a_blackholed_path_never_delivers() -> None:
    lossy = PathState(rtt_ms=100.0, bandwidth_gbps=8.0, loss_rate=0.5)
    assert lossy.transfer_s(10e9) == pytest.approx(0.1 + 20.0)
    assert math.isinf(PathState(rtt_ms=1.0, bandwidth_gbps=8.0, loss_rate=1.0).transfer_s(1.0))
    verdict = decide(
        job(),
        target(step_s=0.1),
        PathState(rtt_ms=1.0, bandwidth_gbps=8.0, loss_rate=1.0),
        now_s=0.0,
        trigger="link_degraded",
    )
    assert not verdict.move
    assert "delivers nothing" in verdict.reason


def test_the_verdict_moves_when_the_gain_beats_cost_plus_margin_and_carries_its_numbers() -> None:
    verdict = decide(job(), target(step_s=0.5), PATH, now_s=0.0, trigger="link_degraded")
    here = 8_950.0
    there = 8_950.0 * 0.5
    cost = 20.0 + 10.1 + 60.0
    margin = SETTINGS.margin_s["training"] + SETTINGS.margin_fraction["training"] * cost
    assert verdict.move
    assert verdict.remaining_here_s == pytest.approx(here)
    assert verdict.remaining_there_s == pytest.approx(there)
    assert verdict.gain_s == pytest.approx(here - there)
    assert verdict.threshold_s == pytest.approx(cost + margin)
    assert verdict.margin_s == pytest.approx(here - there - cost - margin)
    assert verdict.net_s == pytest.approx(here - there - cost)
    assert verdict.reason.startswith("moves: gain")


def test_a_start_wait_at_the_target_counts_against_the_gain() -> None:
    now = decide(job(), target(step_s=0.5), PATH, now_s=0.0, trigger="link_degraded")
    later = decide(job(), target(step_s=0.5, start_after_s=4_400.0), PATH, now_s=0.0, trigger="link_degraded")
    assert later.gain_s == pytest.approx(now.gain_s - 4_400.0)
    assert not later.move


def _gain_needed(job_class: str) -> float:
    """Steps left such that the gain (half the remaining time) sits between the network-training
    and inference thresholds."""
    cost = 20.0 + 10.1 + 60.0
    return cost + SETTINGS.margin_s[job_class] + SETTINGS.margin_fraction[job_class] * cost  # type: ignore[index]


def test_network_sensitive_training_moves_on_a_gain_that_steady_inference_does_not_move_on() -> None:
    low, high = _gain_needed("network_training"), _gain_needed("inference")
    assert low < _gain_needed("training") < high
    gain = (low + high) / 2  # a 1.0 s -> 0.5 s step halves the time: gain = remaining / 2
    steps_done = 10_000 - 2 * gain
    net = decide(
        job(job_class="network_training", steps_done=steps_done),
        target(),
        PATH,
        now_s=0.0,
        trigger="link_degraded",
    )
    inf = decide(
        job(job_class="inference", steps_done=steps_done), target(), PATH, now_s=0.0, trigger="link_degraded"
    )
    assert net.gain_s == pytest.approx(gain)
    assert net.move
    assert not inf.move
    assert inf.threshold_s > net.threshold_s


def test_a_job_that_moved_before_needs_a_bigger_gain_to_move_again() -> None:
    threshold = _gain_needed("training")
    margin = threshold - (20.0 + 10.1 + 60.0)
    gain = threshold + margin / 2  # enough with margin x1, short of margin x2
    steps_done = 10_000 - 2 * gain
    first = decide(job(steps_done=steps_done), target(), PATH, now_s=10_000.0, trigger="link_improved")
    again = decide(
        job(steps_done=steps_done, moves=1, last_moved_s=0.0),
        target(),
        PATH,
        now_s=10_000.0,
        trigger="link_improved",
    )
    assert first.move
    assert not again.move
    assert again.threshold_s - first.threshold_s == pytest.approx(margin)
    assert "x2 after 1 move" in again.reason


def test_inside_the_cool_down_a_job_stays_whatever_the_gain_but_a_failure_still_moves_it() -> None:
    recent = job(moves=1, last_moved_s=1_000.0)
    stays = decide(recent, target(step_s=0.01), PATH, now_s=1_500.0, trigger="link_degraded")
    assert not stays.move
    assert "cool-down" in stays.reason
    after = decide(
        recent, target(step_s=0.01), PATH, now_s=1_000.0 + SETTINGS.cooldown_s + 1, trigger="link_degraded"
    )
    assert after.move
    forced = decide(recent, target(step_s=0.01), PATH, now_s=1_500.0, trigger="cluster_failed")
    assert forced.move
    assert forced.forced


def test_forced_triggers_move_even_at_a_loss_and_nothing_moves_without_a_target() -> None:
    slower = target(step_s=3.0)
    drained = decide(job(), slower, PATH, now_s=0.0, trigger="drain")
    assert drained.move
    assert drained.gain_s < 0
    assert "drained" in drained.reason
    failed = decide(job(step_s=math.inf), slower, PATH, now_s=0.0, trigger="cluster_failed")
    assert failed.move
    assert math.isinf(failed.remaining_here_s)
    voluntary = decide(job(), slower, PATH, now_s=0.0, trigger="cluster_joined")
    assert not voluntary.move
    nowhere = decide(job(), None, PATH, now_s=0.0, trigger="drain")
    assert not nowhere.move
    assert nowhere.target is None


def test_the_budget_bounds_migrations_per_cluster_and_per_link_and_frees_on_release() -> None:
    budget = MigrationBudget(per_cluster=2, per_link=1)
    assert budget.acquire("c-a", "c-b", "r-a", "r-b")
    refusal = budget.refusal("c-c", "c-d", "r-b", "r-a")  # the same link, the other way
    assert refusal is not None
    assert "r-a-r-b" in refusal
    assert budget.acquire("c-a", "c-a2", "r-a", "r-a")  # inside a region: no link used
    assert not budget.acquire("c-a", "c-e", "r-a", "r-e")  # c-a has 2 in flight
    assert "cluster c-a" in (budget.refusal("c-a", "c-e", "r-a", "r-e") or "")
    assert budget.in_flight == 4
    budget.release("c-a", "c-b", "r-a", "r-b")
    assert budget.acquire("c-a", "c-e", "r-a", "r-e")
    budget.release("c-x", "c-y", "r-x", "r-y")  # nothing in flight there: no negative counts
    assert budget.clusters["c-x"] == 0
    with pytest.raises(ValueError, match="at least one"):
        MigrationBudget(per_cluster=0)


def test_plans_start_the_largest_net_benefit_first_and_defer_what_the_budget_refuses() -> None:
    small = decide(job(job_id="small", steps_done=8_000), target(), PATH, now_s=0.0, trigger="link_degraded")
    big = decide(job(job_id="big", steps_done=0), target(), PATH, now_s=0.0, trigger="link_degraded")
    mid = decide(job(job_id="mid", steps_done=4_000), target(), PATH, now_s=0.0, trigger="link_degraded")
    stay = decide(job(job_id="stay"), target(step_s=2.0), PATH, now_s=0.0, trigger="link_degraded")
    assert big.net_s > mid.net_s > small.net_s > 0
    budget = MigrationBudget(per_cluster=2, per_link=10)
    plan = plan_migrations([small, stay, mid, big], {"c-a": "r-a", "c-b": "r-b"}, budget)
    assert [v.job_id for v in plan.start] == ["big", "mid"]
    assert [(v.job_id, "c-a" in why) for v, why in plan.deferred] == [("small", True)]
    assert [v.job_id for v in plan.stay] == ["stay"]
    assert budget.clusters["c-a"] == 2


def test_a_path_of_link_states_adds_rtts_takes_the_narrowest_bandwidth_and_compounds_loss() -> None:
    hops = [
        LinkState(
            src="a", dst="b", rtt_ms_p50=10, rtt_ms_p95=12, rtt_ms_p99=13, jitter_ms=1,
            loss_rate=0.1, bandwidth_gbps=10, cost=10, updated_at=0,
        ),
        LinkState(
            src="b", dst="c", rtt_ms_p50=30, rtt_ms_p95=32, rtt_ms_p99=33, jitter_ms=1,
            loss_rate=0.1, bandwidth_gbps=2, cost=30, updated_at=0,
        ),
    ]  # fmt: skip
    path = PathState.of(hops)
    assert path.rtt_ms == 40
    assert path.bandwidth_gbps == 2
    assert path.loss_rate == pytest.approx(1 - 0.9 * 0.9)
    assert PathState.of([]).bandwidth_gbps > 10


def test_link_triggers_follow_the_rtt_doubling_and_one_percent_loss_rules() -> None:
    base = PathState(rtt_ms=100.0, bandwidth_gbps=4.0)
    assert link_trigger(base, PathState(rtt_ms=200.0, bandwidth_gbps=4.0)) == "link_degraded"
    assert link_trigger(base, PathState(rtt_ms=110.0, bandwidth_gbps=4.0, loss_rate=0.02)) == "link_degraded"
    assert link_trigger(base, PathState(rtt_ms=150.0, bandwidth_gbps=4.0, loss_rate=0.005)) is None
    assert link_trigger(base, PathState(rtt_ms=60.0, bandwidth_gbps=4.0)) == "link_improved"
    assert link_trigger(base, PathState(rtt_ms=100.0, bandwidth_gbps=8.0)) == "link_improved"


def test_job_classes_and_checkpoint_sizes_come_from_the_spec() -> None:
    def spec(**kw: object) -> JobSpec:
        return JobSpec(job_id="x", tenant="t", work=Work(steps=10), **kw)  # type: ignore[arg-type]

    talks = Communication(bytes_per_step=1_000_000, rounds_per_step=2)
    assert job_class_of(spec(workers=4, comm=talks)) == "network_training"
    assert job_class_of(spec(workers=1, comm=talks)) == "training"
    assert job_class_of(spec(task_type="inference")) == "inference"
    assert checkpoint_bytes_of(spec(workers=4, comm=talks)) == 8_000_000
    assert checkpoint_bytes_of(spec(labels={"checkpoint_bytes": "123"})) == 123
    assert checkpoint_bytes_of(spec(workers=2, resources=Resources(gpus=4))) == 8 * 2e9


def test_settings_refuse_nonsense() -> None:
    with pytest.raises(ValueError, match="hysteresis"):
        MigrationSettings(hysteresis_factor=0.5)
    with pytest.raises(ValueError, match="save_gbps"):
        MigrationSettings(save_gbps=0)


def test_the_queues_loss_is_the_expected_loss_of_the_waiting_job_that_would_have_had_the_gpus() -> None:
    faster_there = QueuedOption("q1", steps_left=1_000, step_target_s=0.5, step_elsewhere_s=1.5)  # 1,000 s
    as_fast_elsewhere = QueuedOption("q2", steps_left=1_000, step_target_s=0.5, step_elsewhere_s=0.5)  # 0
    only_there = QueuedOption("q3", steps_left=10, step_target_s=0.5, step_elsewhere_s=math.inf)  # waits
    assert displacement_s([], 5_000.0) == 0.0  # nobody waits: the GPUs taken were idle
    assert displacement_s([faster_there], 5_000.0) == pytest.approx(1_000.0)
    assert displacement_s([faster_there], 300.0) == pytest.approx(300.0)  # waiting out the move costs less
    assert displacement_s([as_fast_elsewhere], 5_000.0) == 0.0
    assert displacement_s([only_there], 5_000.0) == pytest.approx(5_000.0)
    assert displacement_s([faster_there, as_fast_elsewhere, only_there], 2_000.0) == pytest.approx(
        (1_000.0 + 0.0 + 2_000.0) / 3
    )
    # Room on the target expected after the move ends anyway: the move delays nobody.
    late = QueuedOption("q4", 1_000, 0.5, 1.5, wait_free_s=6_000.0, wait_taken_s=9_000.0)
    assert displacement_s([late], 5_000.0) == 0.0
    # Room expected at 1,000 s, at 1,500 s once the move took its GPUs: 500 s later.
    delayed = QueuedOption("q5", 1_000, 0.5, 1.5, wait_free_s=1_000.0, wait_taken_s=1_500.0)
    assert displacement_s([delayed], 5_000.0) == pytest.approx(500.0)
    # ... and never later than the move's end, when its GPUs come back.
    never_room = QueuedOption("q6", 1_000, 0.5, 9.5, wait_free_s=1_000.0, wait_taken_s=math.inf)
    assert displacement_s([never_room], 5_000.0) == pytest.approx(4_000.0)


def test_a_voluntary_move_pays_the_queues_loss_too_a_forced_one_does_not() -> None:
    free = decide(job(), target(step_s=0.5), PATH, now_s=0.0, trigger="link_degraded")
    assert free.move and free.queue_s == 0.0
    # A waiting job that runs 4,000 steps 1.5 s slower elsewhere, longer than the move holds the
    # target (its cost + its 4,475 s there): it would wait, losing that hold.
    waiting = [QueuedOption("q", steps_left=4_000, step_target_s=0.5, step_elsewhere_s=2.0)]
    held = free.cost.total_s + free.remaining_there_s if free.cost is not None else 0.0
    queued = decide(job(), target(step_s=0.5), PATH, now_s=0.0, trigger="link_degraded", queued=waiting)
    assert queued.queue_s == pytest.approx(min(held, 4_000 * 1.5))
    assert queued.threshold_s == pytest.approx(free.threshold_s + queued.queue_s)
    assert not queued.move  # gain 4,475 s < cost + margin + 4,565 s
    assert "the queue's loss" in queued.reason
    forced = decide(job(), target(step_s=0.5), PATH, now_s=0.0, trigger="cluster_failed", queued=waiting)
    assert forced.move and forced.queue_s == 0.0
