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
for it (one get and two puts); a message delivered once or twice never touches the bucket.
"""

import dataclasses
import os

import msgspec
import nats.errors
import structlog
from nats.js import JetStreamContext
from nats.js.errors import BadRequestError, KeyNotFoundError, NotFoundError
from nats.js.kv import KeyValue

ATTEMPTS_BUCKET = "LOOM_ATTEMPTS"
_KEEP_S = 7 * 24 * 3600.0

log = structlog.get_logger("loom.bus")

TRANSIENT = (nats.errors.Error, TimeoutError, OSError)
"""What the bucket raises when NATS does not answer this time."""


class Attempts(msgspec.Struct, frozen=True):
    """What is known of the earlier attempts at one message."""

    open: int = 0
    failures: int = 0
    error: str = ""


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
        """The record of a message; an empty one when there is none. A read that fails drops the
        bucket's handle, so the next opens it afresh: nats-py decides when it opens a bucket
        whether to read by direct get, and an agent that opened it before a service updated it to
        serve them read by the message-get API, which its permissions no longer allow."""
        kv = await self._bucket()
        try:
            entry = await kv.get(self.key(stream_seq))
        except KeyNotFoundError:
            return Attempts()
        except Exception:
            self._kv = None
            raise
        if not entry.value:
            return Attempts()
        try:
            return msgspec.json.decode(entry.value, type=Attempts)
        except msgspec.DecodeError:
            log.warning("unreadable attempt record, starting afresh", key=self.key(stream_seq))
            return Attempts()

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
