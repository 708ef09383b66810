"""Dead letters you can act on: list, show, replay and purge the messages in the ``DLQ`` stream.

A consumer that gives up on a message (see :mod:`loom.bus.consumer`) publishes it to
``loom.dlq.<original subject>`` with its payload, its headers and the error in ``Loom-*``
headers; its original ``Nats-Msg-Id`` travels as ``Loom-Original-Msg-Id``. Here:

* :meth:`DeadLetters.entries` / :meth:`DeadLetters.get` read them back as :class:`DeadLetter`;
* :meth:`DeadLetters.replay` republishes the original payload and headers to the original subject
  *with the original message id*, so replay is idempotent twice over: the stream drops a repeat
  inside its duplicate window, and a handler's inbox (keyed by that id) skips a message it
  already handled. A replayed entry is marked (in the ``LOOM_DLQ`` key-value bucket), and a
  marked entry is not replayed again unless asked;
* :meth:`DeadLetters.purge` deletes entries, only with a reason, which is logged and kept in the
  same bucket.

The pure parts (reading headers, ``--since``) are plain functions, tested without a server.
"""

import dataclasses
import json
import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Literal

import structlog
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import RawStreamMsg
from nats.js.errors import BadRequestError, KeyNotFoundError, NoKeysError, NotFoundError
from nats.js.kv import KeyValue
from opentelemetry import propagate

from loom.bus.connection import BusError
from loom.bus.publisher import Publisher
from loom.errors import InvalidInputError, LoomError
from loom_proto.subjects import DEAD_LETTERS, PREFIX, dead_letter

__all__ = [
    "DLQ_STREAM",
    "MARKS_BUCKET",
    "DeadLetter",
    "DeadLetterError",
    "DeadLetters",
    "PurgeResult",
    "Replay",
    "ReplayResult",
    "UnknownDeadLetterError",
    "parse_since",
    "replay_headers",
]

log = structlog.get_logger("loom.bus")

DLQ_STREAM = "DLQ"
MARKS_BUCKET = "LOOM_DLQ"
"""Key-value bucket of replay marks (``replayed.<seq>``) and purge records (``purges.<ns>``)."""

DLQ_SUBJECTS = DEAD_LETTERS

NOT_REPLAYABLE_HEADER = "Loom-Not-Replayable"
"""Set on a dead letter that was never a bus message (an HTTP payload refused at the door): why
replaying it cannot work, and what to do instead. :meth:`DeadLetters.replay` refuses it."""

# Headers the consumer adds when it dead-letters; a replay leaves them (and the DLQ's own id) out.
_DEAD_LETTER_HEADERS = frozenset(
    {
        "Loom-Error",
        "Loom-Error-Type",
        "Loom-Original-Subject",
        "Loom-Original-Msg-Id",
        "Loom-Stream",
        "Loom-Stream-Seq",
        "Loom-Deliveries",
        "Loom-Consumer",
        "Loom-Failures",
        NOT_REPLAYABLE_HEADER,
        "Nats-Msg-Id",
    }
)
REPLAYED_FROM_HEADER = "Loom-Replayed-From"
"""Set on a replayed message: the DLQ sequence it came from."""

_STREAM_NOT_FOUND = 10059
"""JetStream's error code for "stream not found" (a missing message is 10037)."""
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")
_UNIT_S = {"s": 1, "m": 60, "h": 3_600, "d": 86_400, "w": 604_800}


class DeadLetterError(LoomError):
    """A dead-letter operation that cannot be done as asked."""

    non_retryable = True


class UnknownDeadLetterError(DeadLetterError):
    """No dead letter has this sequence number (never had, or purged)."""


@dataclass(frozen=True)
class Replay:
    """The mark of a replayed dead letter."""

    at: datetime
    times: int
    stream_seq: int
    """Where the last replay landed in the original stream."""


@dataclass(frozen=True)
class DeadLetter:
    """One entry of the DLQ stream, its ``Loom-*`` headers read into fields."""

    seq: int
    time: datetime | None
    subject: str
    original_subject: str
    consumer: str | None
    error_type: str | None
    error: str | None
    deliveries: int | None
    stream: str | None
    stream_seq: int | None
    original_msg_id: str | None
    headers: dict[str, str]
    data: bytes
    replay: Replay | None = None

    @classmethod
    def from_message(
        cls, seq: int, subject: str, headers: Mapping[str, str], data: bytes, at: datetime | None
    ) -> "DeadLetter":
        """Read a DLQ message. The original subject is the DLQ subject minus its prefix, which
        nats-server let its publisher use: its ``Loom-*`` headers are whatever that publisher set.
        An entry whose ``Loom-Original-Subject`` names another subject is not replayable (an
        agent may dead-letter its own commands only: replayed as the operator, such an entry
        published a completion of another cluster's job, or a submission billed to another
        tenant)."""
        prefix = f"{PREFIX}.dlq."
        claimed = headers.get("Loom-Original-Subject")
        # A dead letter of a dead letter stays on its subject (subjects.dead_letter), and says so.
        original = claimed if claimed == subject else subject.removeprefix(prefix)
        kept = dict(headers)
        if claimed is not None and claimed != original:
            kept[NOT_REPLAYABLE_HEADER] = (
                f"its Loom-Original-Subject header names {claimed[:256]!r}, but it was dead-lettered on"
                f" {subject!r}: whoever published it set that header; not replayed"
            )
        return cls(
            seq=seq,
            time=at,
            subject=subject,
            original_subject=original,
            consumer=headers.get("Loom-Consumer"),
            error_type=headers.get("Loom-Error-Type"),
            error=headers.get("Loom-Error"),
            deliveries=_int_or_none(headers.get("Loom-Deliveries")),
            stream=headers.get("Loom-Stream"),
            stream_seq=_int_or_none(headers.get("Loom-Stream-Seq")),
            original_msg_id=headers.get("Loom-Original-Msg-Id") or None,
            headers=kept,
            data=data,
        )

    def summary(self) -> dict[str, object]:
        """The fields ``loom dlq list --json`` prints (no payload)."""
        return {
            "seq": self.seq,
            "time": self.time.isoformat() if self.time else None,
            "original_subject": self.original_subject,
            "consumer": self.consumer,
            "error_type": self.error_type,
            "error": self.error,
            "deliveries": self.deliveries,
            "original_msg_id": self.original_msg_id,
            "replayed": None
            if self.replay is None
            else {
                "at": self.replay.at.isoformat(),
                "times": self.replay.times,
                "stream_seq": self.replay.stream_seq,
            },
        }


ReplayOutcome = Literal["replayed", "duplicate", "skipped", "not_replayable"]


@dataclass(frozen=True)
class ReplayResult:
    """What one replay did.

    ``replayed``: published (``stream_seq`` is where); ``duplicate``: the stream still remembers
    the original message id (its duplicate window has not passed since the original was
    published) and dropped the copy, nothing was delivered; ``skipped``: replayed before, and
    ``again`` was not asked; ``not_replayable``: it was never a bus message (``why`` says what to
    do instead), nothing was published.
    """

    seq: int
    outcome: ReplayOutcome
    subject: str
    msg_id: str
    stream_seq: int | None = None
    why: str | None = None


@dataclass(frozen=True)
class PurgeResult:
    """What a purge deleted, and why."""

    reason: str
    deleted: int
    seqs: list[int] = field(default_factory=list)
    subject: str | None = None


def _int_or_none(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def parse_since(text: str, *, now: datetime | None = None) -> datetime:
    """``--since``: a duration back from ``now`` (``90s``, ``15m``, ``2h``, ``1d``, ``1h30m``) or an ISO time.

    A time without a zone is UTC. Raises :class:`~loom.errors.InvalidInputError` otherwise.
    """
    text = text.strip()
    now = now or datetime.now(UTC)
    if re.fullmatch(r"(\d+(?:\.\d+)?[smhdw])+", text):
        seconds = sum(float(n) * _UNIT_S[unit] for n, unit in _DURATION.findall(text))
        try:
            return now - timedelta(seconds=seconds)
        except OverflowError:  # further back than a date goes (800000d)
            raise InvalidInputError(f"cannot read the time {text!r}: further back than any date") from None
    try:
        at = datetime.fromisoformat(text)
    except ValueError:
        raise InvalidInputError(
            f"cannot read the time {text!r}: give a duration back like 30s, 15m, 2h, 1d or an ISO time"
            " like 2026-12-01T10:00"
        ) from None
    return at if at.tzinfo is not None else at.replace(tzinfo=UTC)


def replay_headers(letter: DeadLetter) -> dict[str, str]:
    """The headers a replay publishes: the original ones, without the dead-letter's, plus its origin."""
    headers = {k: v for k, v in letter.headers.items() if k not in _DEAD_LETTER_HEADERS}
    headers[REPLAYED_FROM_HEADER] = str(letter.seq)
    return headers


def replay_msg_id(letter: DeadLetter) -> str:
    """The original message id; an entry that had none gets one from its DLQ sequence."""
    return letter.original_msg_id or f"dlq-replay-{letter.seq}"


class DeadLetters:
    """The DLQ stream of one NATS connection."""

    def __init__(self, nc: Client, *, publisher: Publisher | None = None) -> None:
        self._nc = nc
        self._js: JetStreamContext = nc.jetstream()
        self._publisher = publisher or Publisher(nc, attempts=3)
        self._kv: KeyValue | None = None

    async def _marks(self) -> KeyValue:
        if self._kv is None:
            try:
                self._kv = await self._js.key_value(MARKS_BUCKET)
            except (NotFoundError, BadRequestError):
                self._kv = await self._js.create_key_value(
                    bucket=MARKS_BUCKET,
                    description="replay marks and purge records of the DLQ",
                    # As Loom's streams: 3 on a NATS cluster, 1 on the embedded server.
                    replicas=int(os.environ.get("LOOM_STREAM_REPLICAS", "1")),
                )
        return self._kv

    async def _replays(self) -> dict[int, Replay]:
        kv = await self._marks()
        try:
            keys = await kv.keys()
        except NoKeysError:
            return {}
        marks: dict[int, Replay] = {}
        for key in keys:
            if not key.startswith("replayed."):
                continue
            try:
                entry = await kv.get(key)
            except KeyNotFoundError:
                continue
            mark = json.loads(entry.value or b"{}")
            marks[int(key.removeprefix("replayed."))] = Replay(
                at=datetime.fromisoformat(mark["at"]),
                times=int(mark["times"]),
                stream_seq=int(mark["stream_seq"]),
            )
        return marks

    async def _replay_of(self, seq: int) -> Replay | None:
        kv = await self._marks()
        try:
            entry = await kv.get(f"replayed.{seq}")
        except KeyNotFoundError:
            return None
        mark = json.loads(entry.value or b"{}")
        return Replay(
            at=datetime.fromisoformat(mark["at"]),
            times=int(mark["times"]),
            stream_seq=int(mark["stream_seq"]),
        )

    async def _read(
        self, seq: int, *, subject: str | None = None, next_: bool = False
    ) -> RawStreamMsg | None:
        try:
            if next_:
                return await self._js.get_msg(DLQ_STREAM, seq, subject=subject or DLQ_SUBJECTS, next=True)
            return await self._js.get_msg(DLQ_STREAM, seq)
        except NotFoundError as exc:
            if exc.err_code == _STREAM_NOT_FOUND:
                raise BusError(f"no {DLQ_STREAM} stream on this server: is the Loom stack running?") from exc
            return None

    @staticmethod
    def _letter(raw: RawStreamMsg) -> DeadLetter:
        assert raw.seq is not None
        return DeadLetter.from_message(
            raw.seq, raw.subject or "", dict(raw.headers or {}), raw.data or b"", _msg_time(raw)
        )

    async def entries(self, *, subject: str | None = None, since: datetime | None = None) -> list[DeadLetter]:
        """Every dead letter, oldest first; of one original subject (wildcards allowed) or since a time."""
        filter_subject = dead_letter(subject) if subject else DLQ_SUBJECTS
        replays = await self._replays()
        letters: list[DeadLetter] = []
        seq = 1
        while (raw := await self._read(seq, subject=filter_subject, next_=True)) is not None:
            letter = self._letter(raw)
            seq = letter.seq + 1
            if since is not None and letter.time is not None and letter.time < since:
                continue
            letters.append(_with_replay(letter, replays.get(letter.seq)))
        return letters

    async def get(self, seq: int) -> DeadLetter:
        """One dead letter by its DLQ sequence; :class:`UnknownDeadLetterError` when there is none."""
        raw = await self._read(seq)
        if raw is None:
            raise UnknownDeadLetterError(f"no dead letter #{seq} (never dead-lettered, or purged)")
        return _with_replay(self._letter(raw), await self._replay_of(seq))

    async def select(
        self, seqs: Sequence[int] = (), *, subject: str | None = None, since: datetime | None = None
    ) -> list[DeadLetter]:
        """The entries named by sequence, or else those matching ``subject`` and ``since``."""
        if seqs:
            return [await self.get(seq) for seq in seqs]
        return await self.entries(subject=subject, since=since)

    async def replay(self, letters: Sequence[DeadLetter], *, again: bool = False) -> list[ReplayResult]:
        """Republish each entry's payload to its original subject, with its original message id."""
        kv = await self._marks()
        results: list[ReplayResult] = []
        for letter in letters:
            msg_id = replay_msg_id(letter)
            if refusal := letter.headers.get(NOT_REPLAYABLE_HEADER):
                results.append(
                    ReplayResult(letter.seq, "not_replayable", letter.original_subject, msg_id, why=refusal)
                )
                continue
            if letter.replay is not None and not again:
                results.append(ReplayResult(letter.seq, "skipped", letter.original_subject, msg_id))
                continue
            ack = await self._publisher.publish_bytes(
                letter.original_subject,
                letter.data,
                msg_id=msg_id,
                headers=replay_headers(letter),
                parent=propagate.extract(letter.headers),
            )
            if ack.duplicate:
                results.append(
                    ReplayResult(letter.seq, "duplicate", letter.original_subject, msg_id, ack.seq)
                )
                continue
            times = (letter.replay.times if letter.replay else 0) + 1
            mark = {"at": datetime.now(UTC).isoformat(), "times": times, "stream_seq": ack.seq}
            await kv.put(f"replayed.{letter.seq}", json.dumps(mark).encode())
            log.info(
                "dead letter replayed",
                seq=letter.seq,
                subject=letter.original_subject,
                msg_id=msg_id,
                stream_seq=ack.seq,
            )
            results.append(ReplayResult(letter.seq, "replayed", letter.original_subject, msg_id, ack.seq))
        return results

    async def purge(
        self,
        seqs: Sequence[int] = (),
        *,
        subject: str | None = None,
        everything: bool = False,
        reason: str,
    ) -> PurgeResult:
        """Delete entries by sequence, of one original subject, or all; refused without a reason."""
        reason = reason.strip()
        if not reason:
            raise DeadLetterError("purging dead letters needs a reason (--reason TEXT)")
        if sum((bool(seqs), subject is not None, everything)) != 1:
            raise DeadLetterError("purge takes sequence numbers, --subject or --all (exactly one)")
        if seqs:
            for seq in seqs:
                await self.get(seq)  # every one must exist before any is deleted
            for seq in seqs:
                await self._js.delete_msg(DLQ_STREAM, seq)
            result = PurgeResult(reason=reason, deleted=len(seqs), seqs=list(seqs))
        else:
            filter_subject = dead_letter(subject) if subject else None
            before = (await self._js.stream_info(DLQ_STREAM)).state.messages
            await self._js.purge_stream(DLQ_STREAM, subject=filter_subject)
            after = (await self._js.stream_info(DLQ_STREAM)).state.messages
            result = PurgeResult(reason=reason, deleted=before - after, subject=subject)
        record = {
            "at": datetime.now(UTC).isoformat(),
            "reason": reason,
            "deleted": result.deleted,
            "seqs": result.seqs,
            "subject": subject,
            "all": everything,
        }
        await (await self._marks()).put(f"purges.{time.time_ns()}", json.dumps(record).encode())
        log.info("dead letters purged", **record)  # the record is kept in the bucket; the CLI says it
        return result


def _msg_time(raw: RawStreamMsg) -> datetime | None:
    if raw.time is None:
        return None
    return raw.time if raw.time.tzinfo else raw.time.replace(tzinfo=UTC)


def _with_replay(letter: DeadLetter, replay: Replay | None) -> DeadLetter:
    if replay is None:
        return letter
    return dataclasses.replace(letter, replay=replay)
