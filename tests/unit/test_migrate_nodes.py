"""Node scope (pure): the runs a failed node takes down, slow runs over a window, suspect nodes."""

import pytest

from loom.migrate.nodes import Pace, PaceSettings, SuspectNodes, runs_on_nodes


def test_every_run_with_a_part_on_a_failed_node_is_lost_once_and_others_are_not() -> None:
    nodes_of = {"gang": ["n1", "n2", "n9"], "solo": ["n3"], "far": ["m1"]}
    assert runs_on_nodes(nodes_of, ["n9", "n2", "n3"]) == {"gang": "n2", "solo": "n3"}
    assert runs_on_nodes(nodes_of, []) == {}


def _pace(**kw: float) -> Pace:
    return Pace(PaceSettings(window_s=10.0, min_reports=3, **kw))  # type: ignore[arg-type]


def test_a_run_delivering_under_half_its_predicted_rate_over_a_covered_window_is_slow() -> None:
    pace = _pace()
    for at in range(0, 12, 2):
        pace.record("j", 1, float(at), observed_step_s=2.5)
    slow = pace.slow("j", 1, predicted_step_s=1.0, now_s=11.0)
    assert slow is not None
    assert slow.delivered == pytest.approx(0.4)
    assert "40%" in slow.reason and "predicted 1 s" in slow.reason


def test_a_run_at_half_its_rate_or_better_is_not_slow() -> None:
    pace = _pace()
    for at in range(0, 12, 2):
        pace.record("j", 1, float(at), observed_step_s=2.0)
    assert pace.slow("j", 1, predicted_step_s=1.0, now_s=11.0) is None


def test_too_few_reports_or_a_window_not_yet_covered_judges_nothing() -> None:
    pace = _pace()
    pace.record("j", 1, 0.0, 10.0)
    pace.record("j", 1, 1.0, 10.0)
    assert pace.slow("j", 1, 1.0, now_s=11.0) is None  # two reports only
    pace.record("j", 1, 2.0, 10.0)
    assert pace.slow("j", 1, 1.0, now_s=5.0) is None  # first report 5 s ago: window not covered
    assert pace.slow("j", 1, None, now_s=11.0) is None  # nothing predicted to compare with


def test_a_new_attempt_drops_the_old_ones_reports_and_late_old_reports_are_ignored() -> None:
    pace = _pace()
    for at in range(0, 12, 2):
        pace.record("j", 1, float(at), 5.0)
    pace.record("j", 2, 12.0, 1.0)
    assert pace.slow("j", 1, 1.0, now_s=12.0) is None
    pace.record("j", 1, 13.0, 5.0)  # a late report of the given-up run
    for at in range(14, 26, 2):
        pace.record("j", 2, float(at), 1.0)
    assert pace.slow("j", 2, 1.0, now_s=25.0) is None
    pace.forget("j")
    assert pace.slow("j", 2, 1.0, now_s=25.0) is None


def test_a_resized_run_is_judged_on_reports_at_its_new_size_only() -> None:
    # An elastic job grown from 2 to 8 workers: 0.965 s a step before (its prediction at 2
    # workers), a report straddling the resize, then exactly the 8-worker prediction. Judged on
    # the mean of all three against the new prediction it "delivered 41 %", and its nodes (a whole
    # pool) were closed to new work (a newcomer's walk).
    pace = _pace()
    for at in range(0, 12, 2):
        pace.record("j", 1, float(at), observed_step_s=0.965)
    pace.resized("j", 11.0)
    pace.record("j", 1, 10.5, observed_step_s=0.965)  # measured before it: dropped
    pace.record("j", 1, 12.0, observed_step_s=0.572)  # the first after it: straddles, passed over
    assert pace.slow("j", 1, predicted_step_s=0.2415, now_s=12.0) is None
    for at in range(13, 25, 2):
        pace.record("j", 1, float(at), observed_step_s=0.2415)
    assert pace.slow("j", 1, predicted_step_s=0.2415, now_s=24.0) is None
    # Still judged: slow at the new size is slow.
    for at in range(25, 37, 2):
        pace.record("j", 1, float(at), observed_step_s=0.7)
    assert pace.slow("j", 1, predicted_step_s=0.2415, now_s=36.0) is not None


def test_suspect_nodes_expire_and_marking_again_extends_never_shortens() -> None:
    suspect = SuspectNodes()
    assert suspect.mark(["n1", "n2"], until_s=100.0, why="slow") == ["n1", "n2"]
    assert suspect.mark(["n1"], until_s=50.0, why="slow again") == []
    assert suspect.active(99.0) == {"n1", "n2"}
    assert suspect.active(100.0) == frozenset()


def test_the_judgement_covers_the_window_only_and_a_repeated_report_counts_once() -> None:
    pace = _pace()
    for at in range(0, 30, 2):
        pace.record("j", 1, float(at), 1.0)  # on pace for a long time ...
    for at in range(30, 42, 2):
        pace.record("j", 1, float(at), 4.0)  # ... then a quarter of it for the last 12 s
    slow = pace.slow("j", 1, predicted_step_s=1.0, now_s=41.0)
    assert slow is not None and slow.observed_step_s == pytest.approx(4.0) and slow.reports == 6
    fresh = _pace()
    for _ in range(3):
        fresh.record("j", 1, 0.0, 3.0)  # one report delivered three times
    fresh.record("j", 1, 10.0, 3.0)
    assert fresh.slow("j", 1, 1.0, now_s=11.0) is None  # two distinct reports: too few
