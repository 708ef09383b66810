"""A running job's end re-predicted from its measured pace: the pure rule, and placement's book
applying it to a run's progress reports (the simulator's side: ``test_sim_truth``)."""

import math

import pytest

from loom.sched.cycle import progress_end_s
from loom_proto.jobs import JobSubmitted, Work
from loom_services.placement.book import Book, QueuedJob, Run

NOW = 1_700_000_000.0


def test_the_pace_over_the_last_stretch_times_the_rest() -> None:
    # From 0 to a tenth of the steps in 60 s: nine tenths left, 540 s.
    assert progress_end_s(now_s=NOW, done=0.1, elapsed_s=60.0, done_before=0.0) == pytest.approx(NOW + 540.0)
    # From 40 % to 50 % in 100 s: half left, 500 s.
    assert progress_end_s(now_s=NOW, done=0.5, elapsed_s=100.0, done_before=0.4) == pytest.approx(NOW + 500.0)
    assert progress_end_s(now_s=NOW, done=1.0, elapsed_s=60.0, done_before=0.9) == pytest.approx(NOW)


@pytest.mark.parametrize(
    ("done", "elapsed_s", "done_before"),
    [
        (0.0, 60.0, 0.0),  # nothing done yet
        (0.4, 60.0, 0.4),  # nothing done in that time
        (0.3, 60.0, 0.4),  # going backwards
        (0.4, 0.0, 0.1),  # no time passed
        (0.4, -5.0, 0.1),  # a clock going backwards
        (0.4, math.inf, 0.1),
        (0.4, math.nan, 0.1),
    ],
)
def test_a_report_that_cannot_tell_re_predicts_nothing(
    done: float, elapsed_s: float, done_before: float
) -> None:
    assert progress_end_s(now_s=NOW, done=done, elapsed_s=elapsed_s, done_before=done_before) is None


def booked(steps: int = 1000, step_s: float = 0.5, resumed: float = 0.0) -> tuple[Book, Run]:
    job = JobSubmitted(job_id="j", tenant="t", work=Work(steps=steps, step_time_s=1.0))
    run = Run(
        queued=QueuedJob(job=job, carrier={}),
        attempt=2,
        parts=[("ca", "A100", (("a0", 1),))],
        workers=1,
        progress=resumed,
        started_at=NOW,
        predicted_step_s=step_s,
        progress_at_start=resumed,
    )
    book = Book()
    book.add_run(run)
    return book, run


def running_end(book: Book) -> float | None:
    snap = book.snapshot(NOW)
    (r,) = [r for r in snap.running if r.job_id == "j"]
    return r.expected_end_s


def test_the_books_run_takes_the_end_its_progress_shows() -> None:
    book, run = booked()
    assert running_end(book) == pytest.approx(NOW + 500.0)  # believed: 1,000 steps x 0.5 s
    # The agent started it at 10 (its clock) and reports a tenth done at 110: 100 s a tenth.
    book.set_began("j", 2, 10.0)
    book.set_progress("j", 0.1, attempt=2, now=NOW + 100.0, at=110.0)
    assert run.expected_end_s == pytest.approx(NOW + 100.0 + 900.0)
    assert running_end(book) == pytest.approx(NOW + 1000.0)
    # The next report: from a tenth to 40 % in 150 s (faster now), 60 % left at that pace.
    book.set_progress("j", 0.4, attempt=2, now=NOW + 250.0, at=260.0)
    assert running_end(book) == pytest.approx(NOW + 250.0 + 300.0)
    assert book.snapshot(NOW).running[0].progress == pytest.approx(0.4)
    # A resize changes its pace: the next report only marks where it is, the one after re-predicts.
    book.resize_run("j", [("ca", "A100", (("a0", 1),))], 1, now=NOW + 300.0)
    book.set_progress("j", 0.5, attempt=2, now=NOW + 400.0, at=410.0)
    assert running_end(book) == pytest.approx(NOW + 550.0)
    book.set_progress("j", 0.6, attempt=2, now=NOW + 500.0, at=510.0)
    assert running_end(book) == pytest.approx(NOW + 500.0 + 400.0)


def test_a_report_of_another_attempt_or_without_the_clock_keeps_the_prediction() -> None:
    book, run = booked()
    book.set_began("j", 1, 10.0)  # an earlier attempt's start
    assert run.paced is None
    book.set_progress("j", 0.1, attempt=1, now=NOW + 100.0, at=110.0)
    assert running_end(book) == pytest.approx(NOW + 500.0) and run.progress == 0.0
    book.set_progress("j", 0.1)  # progress alone (no clock): preemption's figure only
    assert run.progress == pytest.approx(0.1) and running_end(book) == pytest.approx(NOW + 500.0)
    # No start known: the first timed report marks where the run is, the next one re-predicts.
    book.set_progress("j", 0.2, attempt=2, now=NOW + 100.0, at=110.0)
    assert running_end(book) == pytest.approx(NOW + 500.0)
    book.set_progress("j", 0.3, attempt=2, now=NOW + 200.0, at=160.0)
    assert running_end(book) == pytest.approx(NOW + 200.0 + 350.0)


def test_a_run_resumed_from_a_checkpoint_is_paced_from_where_it_resumed() -> None:
    # Resumed at half its steps (what placement gives a run placed again from a checkpoint): its
    # predicted end counts the steps left, and its first report's pace counts only what it did.
    book, run = booked(resumed=0.5)
    assert running_end(book) == pytest.approx(NOW + 250.0)  # 500 steps left x 0.5 s
    book.set_began("j", 2, 10.0)
    assert run.paced == (10.0, 0.5)
    # From half to 60 % in 100 s: 40 % left, 400 s (not the 67 s that counting the checkpointed
    # half as done in those 100 s would give).
    book.set_progress("j", 0.6, attempt=2, now=NOW + 100.0, at=110.0)
    assert running_end(book) == pytest.approx(NOW + 100.0 + 400.0)
