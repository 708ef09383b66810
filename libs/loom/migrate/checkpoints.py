"""Checkpoints as records: their checksums, whether a report may be recorded, which one a resume uses.

Agents report every checkpoint they write (job, attempt, step, cluster, where, size, checksum).
Placement records each in the store (``checkpoints``) in the transaction that records the event,
after :func:`report_refusal` accepted it; a report it refuses (unknown job, an attempt that is not
the live one, a run given up) goes to the dead letters with that reason, except a late one
(:func:`late_report`: the live attempt of a job that has ended), which is acknowledged unrecorded. A resume
(:func:`choose`) takes the latest checkpoint whose checksum verifies and whose cluster can be read
(not failed), else its replica in another cluster (:mod:`loom.migrate.replicas`), else the
previous one, else step 0, and says which and why (the job's history shows it).
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from loom_proto.jobs import TERMINAL_STATES

if TYPE_CHECKING:
    from loom.migrate.replicas import Replica

CHECKSUM_PREFIX = "sha256:"


def checksum_of(job_id: str, attempt: int, step: int, uri: str) -> str:
    """The digest of a simulated checkpoint's content (its identity: the run, the step, where it lies)."""
    digest = hashlib.sha256(f"{job_id}\x00{attempt}\x00{step}\x00{uri}".encode()).hexdigest()
    return CHECKSUM_PREFIX + digest[:32]


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """One recorded checkpoint."""

    job_id: str
    attempt: int
    step: int
    cluster: str
    uri: str
    checksum: str = ""
    corrupt: bool = False
    """Marked unreadable (a failed read or copy): never resumed from."""

    def problem(self) -> str | None:
        """Why this checkpoint cannot be resumed from, or None when it verifies."""
        if self.corrupt:
            return "marked corrupt"
        if not self.checksum:
            return None  # an agent that reports no checksum: nothing to verify, trusted as written
        if self.checksum != checksum_of(self.job_id, self.attempt, self.step, self.uri):
            return "checksum mismatch"
        return None


@dataclass(frozen=True, slots=True)
class Choice:
    """The checkpoint a resume uses (None: step 0) and why, for the job's history."""

    step: int
    checkpoint: Checkpoint | None
    why: str
    replica: Replica | None = None
    """The replica resumed from (the original could not be read), if any."""


def choose(
    checkpoints: Iterable[Checkpoint],
    *,
    last_step: int | None = None,
    replicas: Iterable[Replica] = (),
    unreachable: Collection[str] = (),
) -> Choice | None:
    """The newest checkpoint that verifies and can be read, falling back to its replica, then to
    older ones, then to step 0.

    Every copy (the originals and their ``replicas`` in other clusters) is tried newest step first,
    the original before its replica at the same step. A copy is passed over when it is marked
    corrupt, its checksum fails, or it lies in a cluster of ``unreachable`` (failed: its storage
    went with it). None when no checkpoint was recorded at all (the caller may then estimate from
    progress, :func:`loom.migrate.resume.resume_point`). ``last_step``: a resume never starts at or
    past the job's end (clamped to it).
    """
    copies: list[tuple[int, int, int, Checkpoint | Replica]] = [
        (c.step, c.attempt, 1, c) for c in checkpoints if c.step > 0
    ]
    copies += [(r.step, r.attempt, 0, r) for r in replicas if r.step > 0]
    if not copies:
        return None
    copies.sort(key=lambda item: item[:3], reverse=True)
    rejected: list[str] = []
    for *_, c in copies:
        problem = c.problem()
        if problem is None and c.cluster in unreachable:
            problem = f"cluster {c.cluster} unreachable"
        name = f"step {c.step}" if isinstance(c, Checkpoint) else f"replica in {c.cluster} at step {c.step}"
        if problem is not None:
            rejected.append(f"{name} ({problem})")
            continue
        step = c.step if last_step is None else min(c.step, last_step)
        but = f"; rejected: {', '.join(rejected)}" if rejected else ""
        if not isinstance(c, Checkpoint):
            return Choice(step, None, f"resumes from replica in {c.cluster} at step {step}{but}", replica=c)
        if not rejected:
            return Choice(step, c, f"resumes from its checkpoint at step {step} (recorded)")
        return Choice(step, c, f"resumes from the previous checkpoint at step {step} (recorded){but}")
    return Choice(0, None, f"restarts from step 0: no checkpoint verifies (rejected: {', '.join(rejected)})")


def report_refusal(*, job_state: str | None, current_attempt: int | None, attempt: int) -> str | None:
    """Why a checkpoint report must not be recorded, or None (refused: the dead letters, unless
    :func:`late_report`).

    ``job_state`` / ``current_attempt``: the job's row as the store has it (None: no such job).
    """
    if job_state is None or current_attempt is None:
        return "checkpoint of an unknown job"
    if attempt > current_attempt:
        return f"checkpoint of unknown attempt {attempt} (the job is at attempt {current_attempt})"
    if attempt < current_attempt:
        return f"checkpoint of fenced attempt {attempt} (the job moved on to attempt {current_attempt})"
    if job_state in TERMINAL_STATES:
        return f"checkpoint of a finished run (attempt {attempt}, job {job_state})"
    if job_state == "queued":
        return f"checkpoint of attempt {attempt}, which was given up (the job is queued again)"
    return None


def late_report(*, job_state: str | None, current_attempt: int | None, attempt: int) -> bool:
    """Whether a refused checkpoint report is merely late: one of the live attempt of a job that has
    ended (a run stopped by a cancel reports while it stops). A race, not poison: acknowledged and
    not recorded rather than dead-lettered."""
    return job_state in TERMINAL_STATES and current_attempt == attempt
