"""Moving clients' requests out of the JOBS stream: what an upgraded deployment left there.

Until the REQUESTS stream existed, JOBS held submissions and cancellations next to the lifecycle
log, and JetStream's duplicate window is per stream: a message id a tenant chose could drop a
service's event with the same deterministic id (``<job>:completed:1`` of another tenant's job).
:data:`loom_proto.subjects.STREAMS` now narrows JOBS and creates REQUESTS beside it (in that
order), so whatever a client publishes from then on lands in REQUESTS. What the old layout
stored in JOBS and placement had not yet acknowledged would be stranded there: placement's new
consumers read REQUESTS. :func:`replay_left_requests` republishes it, once, before they start.

It is idempotent: each message keeps its message id (one without gets the id placement claimed
it under, ``JOBS-<seq>``), so JetStream's window and placement's and metering's inboxes drop
what was handled before, or what a second replay sends again. The old submissions consumer is
deleted last; while it exists the move is not done, and its absence says there is nothing to do
(a deployment that never had it, or one already moved).
"""

from dataclasses import dataclass

import nats.js.errors
import structlog
from nats.js import JetStreamContext

from loom_proto import subjects

log = structlog.get_logger("bus.requests_move")

OLD_STREAM = "JOBS"
NEW_STREAM = "REQUESTS"


@dataclass(frozen=True)
class Replayed:
    """What :func:`replay_left_requests` republished (messages a subject) and from where."""

    submitted: int = 0
    cancelled: int = 0
    from_seq: dict[str, int] | None = None


class MoveError(RuntimeError):
    """A republished request did not land in REQUESTS (the streams are still in the old layout)."""


OTHER_READERS: tuple[str, ...] = ("metrics-metering",)
"""Durables of other services that read cancellations in JOBS in the old layout (metering's): a
cancellation one of them had not read yet is replayed too (REQUESTS' consumers of it start empty)."""


async def replay_left_requests(
    js: JetStreamContext,
    *,
    submitted_durable: str,
    lifecycle_durable: str,
    other_readers: tuple[str, ...] = OTHER_READERS,
) -> Replayed:
    """Republish the submissions and cancellations the old layout left in JOBS after the
    acknowledgement floor of the consumers that read them there (placement's ``submitted_durable``
    and ``lifecycle_durable``, which also read cancellations), then delete ``submitted_durable``
    from JOBS. Nothing to do, and nothing asked of the server beyond one look-up, when that
    consumer is not there."""
    try:
        submitted_info = await js.consumer_info(OLD_STREAM, submitted_durable)
    except nats.js.errors.NotFoundError:
        return Replayed()
    starts = {subjects.JOBS_SUBMITTED_ALL: _after_floor(submitted_info)}
    try:
        lifecycle_info = await js.consumer_info(OLD_STREAM, lifecycle_durable)
    except nats.js.errors.NotFoundError:
        lifecycle_info = None
    if lifecycle_info is None:
        starts[subjects.JOBS_CANCELLED_ALL] = 1  # never read there: every cancellation is waiting
    elif subjects.JOBS_CANCELLED_ALL in _filters(lifecycle_info):
        starts[subjects.JOBS_CANCELLED_ALL] = _after_floor(lifecycle_info)
    # else: that consumer was moved already (cancellations read from REQUESTS) by an instance cut
    # short before it deleted the submissions consumer; the first one replayed the cancellations.
    if subjects.JOBS_CANCELLED_ALL in starts:
        for durable in other_readers:  # one behind placement: from its floor (the inboxes dedupe)
            try:
                info = await js.consumer_info(OLD_STREAM, durable)
            except nats.js.errors.NotFoundError:
                continue
            if subjects.JOBS_CANCELLED_ALL in _filters(info):
                starts[subjects.JOBS_CANCELLED_ALL] = min(
                    starts[subjects.JOBS_CANCELLED_ALL], _after_floor(info)
                )
    counts: dict[str, int] = {}
    for pattern, start in starts.items():
        counts[pattern] = await _republish(js, pattern, start)
    await js.delete_consumer(OLD_STREAM, submitted_durable)
    replayed = Replayed(
        submitted=counts.get(subjects.JOBS_SUBMITTED_ALL, 0),
        cancelled=counts.get(subjects.JOBS_CANCELLED_ALL, 0),
        from_seq=dict(starts),
    )
    log.info(
        "requests left in JOBS replayed into REQUESTS",
        submitted=replayed.submitted,
        cancelled=replayed.cancelled,
        deleted=submitted_durable,
    )
    return replayed


def _after_floor(info: object) -> int:
    floor = getattr(getattr(info, "ack_floor", None), "stream_seq", None) or 0
    return int(floor) + 1


def _filters(info: object) -> set[str]:
    config = getattr(info, "config", None)
    found = set(getattr(config, "filter_subjects", None) or [])
    single = getattr(config, "filter_subject", None)
    if single:
        found.add(single)
    return found


async def _republish(js: JetStreamContext, pattern: str, start: int) -> int:
    """Each message of JOBS on ``pattern`` from sequence ``start`` on, published again (it lands
    in REQUESTS), oldest first; how many."""
    seq, sent = start, 0
    while True:
        try:
            msg = await js.get_msg(OLD_STREAM, seq=seq, subject=pattern, next=True)
        except nats.js.errors.NotFoundError:
            return sent
        assert msg.seq is not None and msg.subject is not None
        headers = dict(msg.headers or {})
        headers.setdefault("Nats-Msg-Id", f"JOBS-{msg.seq}")  # the id placement claimed it under
        ack = await js.publish(msg.subject, msg.data or b"", headers=headers)
        if ack.stream != NEW_STREAM:
            raise MoveError(f"{msg.subject} landed in {ack.stream}, not {NEW_STREAM}: streams not moved yet")
        sent += 1
        seq = msg.seq + 1
