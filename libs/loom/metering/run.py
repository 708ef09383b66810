"""Run records: one attempt of one job, folded from its lifecycle events in any order.

The record is what metering charges for: the parts placement gave the attempt (cluster, region,
GPU model, GPUs), the resizes of an elastic run, when it started and when and how it ended. Folding
is order-free and idempotent: the start is the agent's ``started_at``; the end is the *earliest*
end event (``completed``, ``failed``, ``cancelled``, or the ``requeued`` that gave the attempt
up), so a run both failed and requeued ends, and is marked, at whichever happened first. Ties go
to the first outcome of :data:`END_OUTCOMES`.
"""

from typing import Literal, TypeVar

import msgspec

from loom_proto.jobs import (
    JobCancelled,
    JobCompleted,
    JobFailed,
    JobPlaced,
    JobRequeued,
    JobResized,
    JobStarted,
)

__all__ = [
    "CLOCK_SKEW_S",
    "END_OUTCOMES",
    "MeteredEvent",
    "Outcome",
    "Part",
    "Resize",
    "RunRecord",
    "bounded",
    "fold",
    "not_before_placement",
    "to_ms",
]

Outcome = Literal["failed", "preempted", "requeued", "cancelled", "completed"]
END_OUTCOMES: tuple[Outcome, ...] = ("failed", "preempted", "requeued", "cancelled", "completed")
"""How a run can end; on equal times the earlier one in this tuple is the mark."""

MeteredEvent = JobPlaced | JobStarted | JobCompleted | JobFailed | JobCancelled | JobRequeued | JobResized
"""The lifecycle events a run record is folded from."""


CLOCK_SKEW_S = 300.0
"""How far an agent's clock may be from the servers': a run's start is counted from no earlier than
this before its placement (an agent's credentials could otherwise bill a run from a year before it
existed), and metering counts an agent's report's times no later than this after the server stored
the report (:func:`bounded`)."""


def to_ms(unix_s: float) -> int:
    """Seconds since the epoch as whole milliseconds: the unit every duration is counted in."""
    return round(unix_s * 1000)


class Part(msgspec.Struct, frozen=True):
    """GPUs of one model on one cluster given to the attempt (a job on several clusters has several)."""

    cluster: str
    region: str
    gpu_model: str
    gpus: int


class Resize(msgspec.Struct, frozen=True):
    """From ``at_ms`` on, the part on ``cluster`` holds ``gpus`` GPUs (an elastic grow or shrink)."""

    at_ms: int
    cluster: str
    gpus: int


class RunRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One attempt of one job as its events tell it (see the module docstring)."""

    job_id: str
    attempt: int
    tenant: str = ""
    labels: dict[str, str] = {}
    task_type: str = "training_compute"
    parts: tuple[Part, ...] = ()
    resizes: tuple[Resize, ...] = ()
    started_ms: int | None = None
    ended_ms: int | None = None
    placed_ms: int | None = None
    """When placement placed the attempt (None in records written before it was kept)."""
    outcome: Outcome | None = None
    reason: str = ""

    @property
    def complete(self) -> bool:
        """Placed, started and ended: ready to be metered."""
        return bool(self.parts) and self.started_ms is not None and self.ended_ms is not None

    @property
    def key(self) -> str:
        """``job:attempt``."""
        return f"{self.job_id}:{self.attempt}"


def _ended(record: RunRecord, at_s: float, outcome: Outcome, reason: str) -> RunRecord:
    at_ms = to_ms(at_s)
    current = record.ended_ms
    if current is not None and record.outcome is not None:
        if at_ms > current:
            return record
        if at_ms == current and END_OUTCOMES.index(record.outcome) <= END_OUTCOMES.index(outcome):
            return record
    return msgspec.structs.replace(record, ended_ms=at_ms, outcome=outcome, reason=reason[:256])


def not_before_placement(started_ms: int | None, placed_ms: int | None) -> int | None:
    """A start counted from no earlier than :data:`CLOCK_SKEW_S` before the placement (metering's
    fold and `loom usage reconcile` alike)."""
    if started_ms is None or placed_ms is None:
        return started_ms
    return max(started_ms, placed_ms - to_ms(CLOCK_SKEW_S))


_Event = TypeVar("_Event")


def bounded(event: _Event, stored_at_s: float) -> _Event:
    """An agent's report with its times no later than :data:`CLOCK_SKEW_S` after ``stored_at_s``,
    when the server stored it (a far-future end would bill at once for time that never passed);
    placement records the reports so bounded too, so that `loom usage reconcile`, which folds
    placement's history, agrees with metering. Other events as they are."""
    latest = stored_at_s + CLOCK_SKEW_S
    if isinstance(event, JobStarted) and event.started_at > latest:
        return msgspec.structs.replace(event, started_at=latest)
    if isinstance(event, JobCompleted | JobFailed) and event.at > latest:
        return msgspec.structs.replace(event, at=latest)
    return event


def _gpus(allocations: list[object]) -> int:
    return sum(int(getattr(a, "gpus", 0)) for a in allocations)


def fold(record: RunRecord, event: MeteredEvent) -> RunRecord:
    """The record after ``event``; the caller routes a ``requeued`` to attempt ``event.attempt - 1``
    and a ``cancelled`` (which names no attempt) to the job's runs that had not ended."""
    if isinstance(event, JobPlaced):
        parts = tuple(
            Part(p.cluster, p.region, p.gpu_model, _gpus(list(p.allocations))) for p in event.parts
        ) or (Part(event.cluster, event.region, event.gpu_model, _gpus(list(event.allocations))),)
        placed_ms = to_ms(event.placed_at)
        return msgspec.structs.replace(
            record,
            tenant=record.tenant or event.tenant,
            parts=parts,
            placed_ms=placed_ms,
            started_ms=not_before_placement(record.started_ms, placed_ms),
        )
    if isinstance(event, JobStarted):
        return msgspec.structs.replace(
            record,
            tenant=record.tenant or event.tenant,
            started_ms=not_before_placement(to_ms(event.started_at), record.placed_ms),
        )
    if isinstance(event, JobResized):
        resize = Resize(to_ms(event.at), event.cluster, _gpus(list(event.allocations)))
        if resize in record.resizes:
            return record
        resizes = tuple(sorted((*record.resizes, resize), key=lambda r: (r.at_ms, r.cluster, r.gpus)))
        return msgspec.structs.replace(record, resizes=resizes)
    if isinstance(event, JobCompleted):
        return _ended(record, event.at, "completed", "")
    if isinstance(event, JobFailed):
        return _ended(record, event.at, "failed", event.reason)
    if isinstance(event, JobCancelled):
        return _ended(record, event.at, "cancelled", event.reason)
    outcome: Outcome = "preempted" if event.cause == "preempted" else "requeued"
    return _ended(
        record, event.at, outcome, f"{event.cause}: {event.reason}" if event.reason else event.cause
    )
