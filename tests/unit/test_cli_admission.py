"""What `loom submit` says of each submission, and whether it exits 1."""

import pytest

from loom.cli.main import _print_admission
from loom.client.sdk import Admission
from loom_proto.jobs import JobSpec, Work

SPEC = JobSpec(job_id="dag-1", tenant="acme", work=Work(steps=1))


@pytest.mark.parametrize(
    ("admission", "refused"),
    [
        (Admission("dag-1", "accepted", state="queued"), False),
        (Admission("dag-1", "accepted", state="running"), False),
        # Accepted, then refused or failed before the CLI's first look: it exited 0 before.
        (
            Admission("dag-1", "accepted", state="rejected", reason="stage job id(s) dag-1--a already exist"),
            True,
        ),
        (Admission("dag-1", "accepted", state="failed", reason="stage a failed"), True),
        (Admission("dag-1", "rejected", code="invalid", reason="bad"), True),
        (Admission("dag-1", "conflict", reason="taken"), True),
        (Admission("dag-1", "duplicate", state="rejected"), True),
        (Admission("dag-1", "duplicate", state="completed"), False),
    ],
)
def test_a_submission_refused_or_failed_in_any_way_counts_as_refused(
    admission: Admission, refused: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _print_admission(SPEC, admission) is refused
    if admission.outcome == "accepted" and refused:
        said = " ".join(capsys.readouterr().err.split())  # as one line, however the console wrapped it
        assert f"accepted, then {admission.state}: {admission.reason}" in said
