"""Checkpoints as records: which one a resume uses, and which reports are refused (pure)."""

from loom.migrate.checkpoints import Checkpoint, checksum_of, choose, late_report, report_refusal


def _ck(step: int, attempt: int = 1, *, good: bool = True, corrupt: bool = False) -> Checkpoint:
    uri = f"sim://c/j/{attempt}/{step}"
    checksum = checksum_of("j", attempt, step, uri) if good else "sha256:0000"
    return Checkpoint("j", attempt, step, "c", uri, checksum=checksum, corrupt=corrupt)


def test_the_checksum_depends_on_the_run_the_step_and_the_location() -> None:
    base = checksum_of("j", 1, 10, "sim://a")
    assert base == checksum_of("j", 1, 10, "sim://a")
    assert (
        len(
            {
                base,
                checksum_of("j", 2, 10, "sim://a"),
                checksum_of("j", 1, 20, "sim://a"),
                checksum_of("j", 1, 10, "sim://b"),
            }
        )
        == 4
    )


def test_a_resume_takes_the_latest_checkpoint_that_verifies() -> None:
    chosen = choose([_ck(10), _ck(30), _ck(20)])
    assert chosen is not None and chosen.step == 30
    assert chosen.why == "resumes from its checkpoint at step 30 (recorded)"


def test_a_corrupt_latest_checkpoint_falls_back_to_the_previous_and_says_so() -> None:
    chosen = choose([_ck(10), _ck(20), _ck(30, good=False)])
    assert chosen is not None and chosen.step == 20
    assert "previous checkpoint at step 20" in chosen.why and "step 30 (checksum mismatch)" in chosen.why
    marked = choose([_ck(10), _ck(20, corrupt=True)])
    assert marked is not None and marked.step == 10 and "marked corrupt" in marked.why


def test_when_no_checkpoint_verifies_the_resume_is_step_0_with_the_reasons() -> None:
    chosen = choose([_ck(10, good=False), _ck(20, good=False)])
    assert chosen is not None and chosen.step == 0 and chosen.checkpoint is None
    assert "step 20 (checksum mismatch)" in chosen.why and "step 10 (checksum mismatch)" in chosen.why


def test_without_any_checkpoint_the_caller_decides_and_a_resume_never_starts_at_the_end() -> None:
    assert choose([]) is None
    assert choose([_ck(0)]) is None
    last = choose([_ck(100)], last_step=99)
    assert last is not None and last.step == 99


def test_an_agent_without_checksums_is_trusted() -> None:
    chosen = choose([Checkpoint("j", 1, 40, "c", "sim://x")])
    assert chosen is not None and chosen.step == 40


def test_reports_of_unknown_fenced_or_finished_runs_are_refused_with_the_reason() -> None:
    assert report_refusal(job_state=None, current_attempt=None, attempt=1) == "checkpoint of an unknown job"
    assert "unknown attempt 3" in (report_refusal(job_state="running", current_attempt=2, attempt=3) or "")
    assert "fenced attempt 1" in (report_refusal(job_state="running", current_attempt=2, attempt=1) or "")
    assert "finished run" in (report_refusal(job_state="completed", current_attempt=2, attempt=2) or "")
    assert "given up" in (report_refusal(job_state="queued", current_attempt=2, attempt=2) or "")
    assert report_refusal(job_state="running", current_attempt=2, attempt=2) is None
    assert report_refusal(job_state="placed", current_attempt=1, attempt=1) is None


def test_only_a_report_of_the_live_attempt_of_an_ended_job_is_late_rather_than_poison() -> None:
    assert late_report(job_state="cancelled", current_attempt=2, attempt=2)
    assert late_report(job_state="completed", current_attempt=1, attempt=1)
    assert not late_report(job_state="cancelled", current_attempt=2, attempt=1)  # fenced
    assert not late_report(job_state="queued", current_attempt=2, attempt=2)  # given up
    assert not late_report(job_state=None, current_attempt=None, attempt=1)  # unknown job
