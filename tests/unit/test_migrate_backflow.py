"""Clusters joining, returning and growing (pure): the triggers, the jobs concerned, moves only toward it."""

from dataclasses import replace

import pytest

from loom.migrate.backflow import cluster_triggers, held_until, not_on, placed_elsewhere, toward
from loom.migrate.benefit import Candidate, MigrationSettings, PathState, RunningJobState, decide

PATH = PathState(rtt_ms=100.0, bandwidth_gbps=8.0)


def test_a_new_cluster_or_one_back_from_nothing_joined_and_a_grown_one_improved() -> None:
    before = {"a": 16, "b": 0, "c": 8, "d": 8}
    after = {"a": 16, "b": 8, "c": 9, "d": 12, "e": 4, "f": 0}
    assert cluster_triggers(before, after) == {
        "b": "cluster_joined",
        "d": "cluster_improved",
        "e": "cluster_joined",
    }
    # Shrinking, or vanishing, is no trigger here (failures have their own).
    assert cluster_triggers(after, before) == {}


def test_the_improvement_share_is_a_setting_and_one_gpu_at_least() -> None:
    assert cluster_triggers({"a": 2}, {"a": 3}, improve_share=0.0) == {"a": "cluster_improved"}
    assert cluster_triggers({"a": 2}, {"a": 2}, improve_share=0.0) == {}
    with pytest.raises(ValueError, match="improve_share"):
        cluster_triggers({}, {}, improve_share=-1)


def test_a_change_concerns_the_jobs_with_no_part_on_that_cluster() -> None:
    assert not_on({"x": ["a"], "y": ["b", "a"], "z": ["c"]}, "a") == ["z"]


def _running(step_s: float) -> RunningJobState:
    return RunningJobState(
        job_id="j",
        job_class="training",
        cluster="a",
        region="r-a",
        steps=10_000,
        steps_done=100.0,
        step_s=step_s,
        checkpoint_every_steps=100,
        checkpoint_bytes=1e9,
    )


def test_a_move_elsewhere_than_the_joined_cluster_becomes_a_stay_with_its_numbers() -> None:
    verdict = decide(_running(2.0), Candidate("c", "r-c", 1.0), PATH, now_s=0.0, trigger="cluster_joined")
    assert verdict.move
    kept = toward(verdict, "b")
    assert not kept.move and kept.gain_s == verdict.gain_s and kept.threshold_s == verdict.threshold_s
    assert kept.reason.startswith("stays: the framework's choice now is c, not b; gain")
    assert toward(verdict, "c") is verdict
    # A returning cluster's review is done again while it settles only for such stays.
    assert placed_elsewhere(kept, "b") and not placed_elsewhere(verdict, "c")
    cooled = decide(
        replace(_running(2.0), moves=1, last_moved_s=-10.0),
        Candidate("b", "r-b", 1.0),
        PATH,
        now_s=0.0,
        trigger="cluster_joined",
    )
    assert not placed_elsewhere(toward(cooled, "b"), "b")  # held there by its cool-down
    # The framework's choice is where the job runs now (the cluster not open to it yet).
    assert placed_elsewhere(toward(replace(cooled, target="a"), "b"), "b")


def test_backflow_moves_only_when_the_gain_beats_cost_and_margin() -> None:
    gains = decide(_running(2.0), Candidate("b", "r-b", 1.0), PATH, now_s=0.0, trigger="cluster_joined")
    small = decide(_running(1.01), Candidate("b", "r-b", 1.0), PATH, now_s=0.0, trigger="cluster_joined")
    assert gains.move and gains.gain_s > gains.threshold_s
    assert not small.move and small.gain_s < small.threshold_s
    # Inside the cool-down a job that just failed over (or drained off) does not flow back yet.
    cooled = replace(_running(2.0), moves=1, last_moved_s=-10.0)
    moved = decide(cooled, Candidate("b", "r-b", 1.0), PATH, now_s=0.0, trigger="cluster_joined")
    assert not moved.move and "cool-down" in moved.reason


def test_a_stay_held_only_by_the_cool_down_says_when_to_look_again() -> None:
    settings = MigrationSettings(cooldown_s=1800.0)
    back = Candidate("b", "r-b", 1.0)
    # Failed over 10 s ago; flowing back would pay: held until its cool-down ends.
    held = decide(
        replace(_running(2.0), moves=1, last_moved_s=-10.0), back, PATH, now_s=0.0, trigger="cluster_joined"
    )
    assert not held.move and held.held_until_s == pytest.approx(-10.0 + settings.cooldown_s)
    # Moved 20 s ago and would not pay anyway: nothing to come back for.
    never = decide(
        replace(_running(1.01), moves=1, last_moved_s=-20.0), back, PATH, now_s=0.0, trigger="cluster_joined"
    )
    assert not never.move and "cool-down" in never.reason and never.held_until_s is None
    # A move that pays, and a stay for another reason, carry no such time either.
    assert decide(_running(2.0), back, PATH, now_s=0.0, trigger="cluster_joined").held_until_s is None
    other = replace(held, target="c", held_until_s=held.held_until_s)
    earlier = replace(held, job_id="k", held_until_s=held.held_until_s - 5.0)  # type: ignore[operator]
    assert held_until([held, never], "b") == held.held_until_s
    assert held_until([held, earlier, never], "b") == earlier.held_until_s  # the earliest
    assert held_until([other, never], "b") is None  # held back from another cluster: not this review
    assert held_until([], "b") is None


def test_a_cluster_just_back_is_rechecked_while_it_settles_only_if_the_framework_chose_elsewhere() -> None:
    from loom.migrate.backflow import settling_recheck

    verdict = decide(_running(2.0), Candidate("c", "r-c", 1.0), PATH, now_s=0.0, trigger="cluster_joined")
    elsewhere = [toward(verdict, "b")]
    kw = {"now": 105.0, "settle_s": 12.0, "recheck_s": 3.0}
    assert settling_recheck(elsewhere, "b", joined_at=100.0, **kw) == 108.0
    assert settling_recheck(elsewhere, "b", joined_at=90.0, **kw) is None  # settled: done
    assert settling_recheck(elsewhere, "b", joined_at=None, **kw) is None  # not a join
    moved_there = decide(_running(2.0), Candidate("b", "r-b", 1.0), PATH, now_s=0.0, trigger="cluster_joined")
    assert settling_recheck([moved_there], "b", joined_at=100.0, **kw) is None


def test_a_settling_clusters_rechecks_record_only_verdicts_that_changed() -> None:
    # A joined cluster is reviewed again every few seconds while it settles: every review wrote a
    # stay for every running job (about 20 near-identical rows a job in `--verdicts`).
    from loom.store.moves import VerdictRow
    from loom_services.migration.service import Said, _news, _remember

    def row(job: str, decision: str, target: str | None, gain: float) -> VerdictRow:
        return VerdictRow(job, 1, "cluster_joined", decision, "c-a", target, "why", gain, 1.0, 2.0, 0.5, "")

    said: Said = {}
    first = [row("j1", "stay", None, 10.0), row("j2", "stay", "c-b", 5.0)]
    assert _news(first, said, "c-new") == first  # nothing said yet: all recorded
    _remember(first, said, "c-new")
    again = [row("j1", "stay", None, 11.0), row("j2", "move", "c-new", 9.0), row("j3", "stay", None, 1.0)]
    assert [r.job_id for r in _news(again, said, "c-new")] == ["j2", "j3"]  # j1 said the same before
    assert _news(again, said, None) == again  # no key: every verdict
    assert [r.job_id for r in _news(again, said, "c-other")] == ["j1", "j2", "j3"]  # another cluster's
