"""Placement decides a burst of submissions in slices only when a whole batch would hold the event
loop (and so the lease renewals) longer than its budget."""

from typing import Any

import pytest

from loom_services.placement.service import MIN_DECIDE_SLICE, decide_slice


@pytest.mark.parametrize(
    ("jobs", "per_job_ms", "budget_ms", "expected"),
    [
        (200, None, 250.0, 200),  # nothing measured yet: all at once
        (200, 0.5, 250.0, 200),  # a quiet machine: 100 ms for the batch, within the budget
        (200, 10.0, 250.0, 25),  # loaded 20x: 2 s for the batch, the lease TTL; 25 at a time
        (200, 100.0, 250.0, MIN_DECIDE_SLICE),  # never fewer than the minimum
        (5, 100.0, 250.0, 5),  # a small batch is never split
        (0, 1.0, 250.0, 1),
    ],
)
def test_a_batch_is_sliced_only_when_deciding_it_would_hold_the_loop_past_its_budget(
    jobs: int, per_job_ms: float | None, budget_ms: float, expected: int
) -> None:
    assert decide_slice(jobs, per_job_ms, budget_ms) == expected


def test_every_slice_holds_the_loop_within_the_budget_when_the_minimum_allows() -> None:
    for per_job_ms in (1.0, 2.5, 7.0, 12.0, 30.0):
        size = decide_slice(500, per_job_ms, 250.0)
        assert size * per_job_ms <= 250.0 or size == MIN_DECIDE_SLICE
        assert (size + 1) * per_job_ms > 250.0 or size == 500


def test_a_batch_that_rejected_a_dag_stage_is_not_pipelined() -> None:
    """Settling a DAG writes its other stages' rows, which the next batch may lock as due queued
    jobs while it waits for this batch to end: such a batch keeps the lock until it commits."""
    from loom.sched.cycle import CycleResult, Rejected
    from loom_proto.jobs import JobSubmitted, Resources, Work
    from loom_services.placement.book import QueuedJob
    from loom_services.placement.service import Applied

    def rejected(parent: str | None) -> Rejected[QueuedJob]:
        job = JobSubmitted(
            job_id="s1", tenant="t", resources=Resources(gpus=1), work=Work(steps=1, step_time_s=1.0)
        )
        record: Any = None  # pipelinable reads no record
        return Rejected(QueuedJob(job, {}, parent=parent), "impossible", "no", "", record)

    assert Applied(cycle=CycleResult(rejected=[rejected(None)])).pipelinable
    assert not Applied(cycle=CycleResult(rejected=[rejected("dag-1")])).pipelinable
