"""A durable record of the attempts at one message that never came back: crash-loop detection.

The consumer loop counts a message's failures in memory, so a message whose handling *kills the
process* (a segfault in a library, the OOM killer, an ``os._exit`` deep in a dependency) is
redelivered to the next process with a fresh count, forever. JetStream's own ``max_deliver``
cannot tell those deliveries from the ones an outage caused (which must never dead-letter), so
the loop keeps it unlimited and, for a message delivered more than ``suspect_after`` times, writes
down what it is about to do before doing it:

* ``open``: attempts started and never finished, i.e. the process handling it ended first. It is
  raised (and the write acknowledged by the stream) *before* the handler runs and lowered again
  when the handler returns or raises, whatever the outcome, outages included. Only a process that
  died mid-attempt leaves it raised.
* ``failures``: the ordinary (non-outage) failures of the message over every process life, so a
  handler that keeps raising is dead-lettered after ``max_deliver`` failures even when the process
  restarts between them.
* ``error``: the last error seen, for the dead letter.

Records live in the KV bucket ``LOOM_ATTEMPTS`` (key ``<stream>.<durable>.<stream seq>``, removed
once the message is settled for good, expired after 7 days otherwise). Only suspect deliveries pay
for it (two gets and two writes); a message delivered once or twice never touches the bucket.

Two attempts at one message can overlap (two consumers of a durable, a redelivery while the first
copy is still handled), so a record is changed only at the revision it was read at, and read
again when another attempt wrote it meanwhile (:meth:`AttemptLog.change`): a plain put of what
one attempt read lost the other's change (its attempt left open, or closed for it).
"""

import dataclasses
import os
from collections.abc import Callable

import msgspec
import nats.errors
import structlog
from nats.js import JetStreamContext
from nats.js.errors import BadRequestError, KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue

ATTEMPTS_BUCKET = "LOOM_ATTEMPTS"
_KEEP_S = 7 * 24 * 3600.0

log = structlog.get_logger("loom.bus")

TRANSIENT = (nats.errors.Error, TimeoutError, OSError)
"""What the bucket raises when NATS does not answer this time."""

_CHANGE_TRIES = 16
"""Tries of one change that other attempts keep writing first (each a read and a write)."""


class AttemptConflictError(nats.errors.Error):
    """Other attempts wrote the record before every try of a change (one of :data:`TRANSIENT`)."""


class Attempts(msgspec.Struct, frozen=True):
    """What is known of the earlier attempts at one message."""

    open: int = 0
    failures: int = 0
    error: str = ""


def opened(record: Attempts, max_crashes: int) -> Attempts | None:
    """The record with one more attempt open; None when ``max_crashes`` attempts never came back
    (a crash loop: the message is dead-lettered, not tried again)."""
    if record.open >= max_crashes:
        return None
    return msgspec.structs.replace(record, open=record.open + 1)


def closed(record: Attempts, before: Attempts, failures: int, error: str) -> Attempts:
    """The record with one attempt closed, as it is now (``record``): the attempt opened on
    ``before`` and knows ``failures`` in all; the failures it added beyond ``before`` are added
    to what other attempts wrote meanwhile."""
    return Attempts(
        open=max(record.open - 1, 0),
        failures=record.failures + max(failures - before.failures, 0),
        error=error,
    )


class AttemptLog:
    """The attempt records of one consumer (created lazily, shared by every consumer of a process)."""

    def __init__(self, js: JetStreamContext, stream: str, durable: str) -> None:
        self._js = js
        self._prefix = f"{stream}.{durable}"
        self._kv: KeyValue | None = None

    def key(self, stream_seq: int) -> str:
        """The record's key for a message of this consumer."""
        return f"{self._prefix}.{stream_seq}"

    async def get(self, stream_seq: int) -> Attempts:
        """The record of a message; an empty one when there is none."""
        return (await self.read(stream_seq))[0]

    async def read(self, stream_seq: int) -> tuple[Attempts, int]:
        """The record of a message (an empty one when there is none) and the revision to change it
        at (:meth:`write`). A read that fails drops the bucket's handle, so the next opens it
        afresh: nats-py decides when it opens a bucket whether to read by direct get, and an agent
        that opened it before a service updated it to serve them read by the message-get API,
        which its permissions no longer allow."""
        kv = await self._bucket()
        try:
            entry = await kv.get(self.key(stream_seq))
        except KeyNotFoundError as exc:
            # Removed (the purge marker's revision is the one to write at) or never written (0).
            marker = getattr(exc, "entry", None)
            return Attempts(), int(getattr(marker, "revision", 0) or 0)
        except Exception:
            self._kv = None
            raise
        revision = int(entry.revision or 0)
        if not entry.value:
            return Attempts(), revision
        try:
            return msgspec.json.decode(entry.value, type=Attempts), revision
        except msgspec.DecodeError:
            log.warning("unreadable attempt record, starting afresh", key=self.key(stream_seq))
            return Attempts(), revision

    async def write(self, stream_seq: int, attempts: Attempts, revision: int) -> bool:
        """Write the record if it is still at ``revision`` (0: there is none); False when another
        attempt wrote it since. Returns once the stream has stored it."""
        kv = await self._bucket()
        try:
            await kv.update(self.key(stream_seq), msgspec.json.encode(attempts), last=revision)
        except KeyWrongLastSequenceError:
            return False
        return True

    async def change(
        self, stream_seq: int, change: Callable[[Attempts], Attempts | None]
    ) -> tuple[Attempts, Attempts | None]:
        """Apply ``change`` to the record as it is now (None: leave it), again on what another
        attempt wrote meanwhile; the record it was applied to, and the one written."""
        for _ in range(_CHANGE_TRIES):
            before, revision = await self.read(stream_seq)
            after = change(before)
            if after is None or await self.write(stream_seq, after, revision):
                return before, after
        raise AttemptConflictError(f"attempt record {self.key(stream_seq)} changed under every try")

    async def put(self, stream_seq: int, attempts: Attempts) -> None:
        """Write the record; returns once the stream has stored it."""
        kv = await self._bucket()
        await kv.put(self.key(stream_seq), msgspec.json.encode(attempts))

    async def forget(self, stream_seq: int) -> None:
        """Remove the record of a message settled for good."""
        kv = await self._bucket()
        await kv.purge(self.key(stream_seq))

    async def _bucket(self) -> KeyValue:
        if self._kv is None:
            try:
                self._kv = await self._js.key_value(ATTEMPTS_BUCKET)
            except (NotFoundError, BadRequestError):
                self._kv = await ensure_bucket(self._js)
        return self._kv


async def ensure_bucket(js: JetStreamContext) -> KeyValue:
    """Create ``LOOM_ATTEMPTS`` if absent (with :func:`loom.bus.ensure_streams`, by whoever may
    manage streams, so an agent, which may not, finds it there).

    Its records are read by direct get, whose request subject names the key: an agent's
    permissions then allow reads of its own consumer's records only (``loom.security.permissions``),
    where the stream's message-get API takes the key in the request and would read anyone's. A
    bucket made before (no direct get) is updated to serve it."""
    try:
        return await js.create_key_value(
            bucket=ATTEMPTS_BUCKET,
            description="unfinished attempts and failures of redelivered messages (crash loops)",
            history=1,
            ttl=_KEEP_S,
            replicas=int(os.environ.get("LOOM_STREAM_REPLICAS", "1")),
            direct=True,
        )
    except BadRequestError as exc:  # there already, with another configuration
        info = await js.stream_info(f"KV_{ATTEMPTS_BUCKET}")
        if not info.config.allow_direct:
            await js.update_stream(dataclasses.replace(info.config, allow_direct=True))
            log.info("attempts bucket now serves direct gets", bucket=ATTEMPTS_BUCKET)
        else:  # it differs otherwise (its replicas, say): kept as it is, and said
            log.warning("attempts bucket kept with its own configuration", error=repr(exc))
        return await js.key_value(ATTEMPTS_BUCKET)
