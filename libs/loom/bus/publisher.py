"""Publishing to JetStream with a deterministic message id, trace headers and retry.

The id goes in ``Nats-Msg-Id`` so the stream drops a repeat inside its duplicate window: a retry
after a timeout (when the first attempt may have landed) never doubles the message. A service's
or an agent's id goes there tagged with a key of its own identity, so that nobody else can take it
first (:mod:`loom.security.message_ids`); spans and consumers see the plain id.

On a NATS cluster two failures of a node are waited out rather than counted as failed attempts:
a stream whose leader died answers "no responders", or nothing at all (its followers, and the old
leader once restarted, take its subjects but drop what arrives), until its replicas elect another
(nats-server waits 4-9 s, a constant of its Raft code, before a follower campaigns): sends are
repeated meanwhile with short ack timeouts (see ``Publisher._attempt_timeout_s``), not counted and
without a growing backoff, so the first one after the election is acked at once. A publish in
flight on a connection to the dead node gets no ack at all; it is sent again, under the same id,
as soon as the client has reconnected to another node instead of after the full timeout.
"""

import asyncio
import contextlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgspec
from nats.aio.client import Client
from nats.errors import ConnectionClosedError, MaxPayloadError, NoRespondersError, OutboundBufferLimitError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.api import PubAck
from nats.js.errors import APIError, NoStreamResponseError, ServiceUnavailableError
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind

from loom.bus.connection import BusError, publish_denied
from loom.security.message_ids import keyed
from loom.telemetry import span_name
from loom_proto.codec import encode

_tracer = trace.get_tracer("loom.bus")

_RETRYABLE = (
    NoRespondersError,
    NatsTimeoutError,
    asyncio.TimeoutError,
    ServiceUnavailableError,
    OutboundBufferLimitError,
    # No stream answered: during start-up the stream may not exist yet, or its server restarts.
    NoStreamResponseError,
)


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One message of :meth:`Publisher.publish_batch`: where, what, its id, its headers, and the
    trace context its PRODUCER span continues (None: the current one)."""

    subject: str
    payload: bytes
    msg_id: str
    headers: Mapping[str, str]
    parent: otel_context.Context | None = None


_AWAITING_LEADER = (NoStreamResponseError, ServiceUnavailableError)
"""What a stream answers while it has no leader (also what a subject no stream captures gets)."""
_AWAITING_LEADER_OR_SILENT = (*_AWAITING_LEADER, NatsTimeoutError, asyncio.TimeoutError)
"""On a cluster also no answer at all: a stream's followers take its subjects but drop what arrives
while no leader is elected (they do not answer "no responders"), so a publish then times out."""
_IN_PROCESS_WAIT_S = 0.1
"""Pause before resending a publish whose id the server still has in process."""
_RECONNECT_CHECK_S = 0.05
"""How often a publish waiting for its ack looks whether its connection was lost meanwhile."""


_MSG_ID_IN_PROCESS = 10158
"""nats-server's error code for a publish whose ``Nats-Msg-Id`` an earlier, not yet stored, publish
holds (``409 duplicate message id is in process``): a resend right after a reconnect or an election
meets the first send still being replicated."""


def _in_process(error: BaseException | None) -> bool:
    return isinstance(error, APIError) and error.err_code == _MSG_ID_IN_PROCESS


_TOO_LARGE = 10054
"""nats-server's error code for a message larger than the stream's ``max_msg_size``."""


def too_large(error: BaseException) -> bool:
    """An outcome no resend can change and that no change of load clears: the message is larger
    than the server (``max_payload``) or its stream takes. The outbox sets such rows aside
    (``outbox.refused``); an account's limits (10002) and other refusals clear, and are retried."""
    return isinstance(error, MaxPayloadError) or (
        isinstance(error, APIError) and error.err_code == _TOO_LARGE
    )


def refused(error: BaseException) -> bool:
    """An outcome of :meth:`Publisher.publish_batch` that no resend can change: the stream refused
    the message (no stream for the subject, too large), as :meth:`Publisher.publish_bytes` raises
    a non-retryable :class:`BusError` for, larger than the server takes); 5xx answers and "id in
    process" are transient."""
    if isinstance(error, BusError):
        return error.non_retryable
    if isinstance(error, MaxPayloadError):  # larger than the server takes: the same next time
        return True
    if isinstance(error, _RETRYABLE):
        return False
    return isinstance(error, APIError) and not (
        (error.code is not None and error.code >= 500) or _in_process(error)
    )


class _ConnectionLost(Exception):
    """The connection a publish went out on was lost before its ack came back."""


class Publisher:
    """Publishes Structs or raw bytes to JetStream; one per service connection.

    ``leader_wait_s`` bounds how long "no leader" answers are retried (every ``leader_poll_s``,
    not counted in ``attempts``) when the client knows more than one server, i.e. on a cluster;
    on a single server such an answer means no stream captures the subject, and counts.
    """

    def __init__(
        self,
        nc: Client,
        *,
        timeout_s: float = 5.0,
        attempts: int = 8,
        first_backoff_s: float = 0.05,
        max_backoff_s: float = 2.0,
        leader_wait_s: float = 20.0,
        leader_poll_s: float = 0.025,
        cluster_timeout_s: float = 2.0,
        leaderless_timeout_s: float = 0.5,
        id_key: bytes | None = None,
    ) -> None:
        self._nc = nc
        self._id_key = id_key
        """The key this identity tags its message ids with on the wire (None: plain ids), so
        that no other identity can take an id first (:mod:`loom.security.message_ids`)."""
        # publish_batch sends whole batches before their acks come back: room for many of them.
        self._js: JetStreamContext = nc.jetstream(timeout=timeout_s, publish_async_max_pending=50_000)
        self._timeout_s = timeout_s
        self._attempts = attempts
        self._first_backoff_s = first_backoff_s
        self._max_backoff_s = max_backoff_s
        self._leader_wait_s = leader_wait_s
        self._leader_poll_s = leader_poll_s
        self._cluster_timeout_s = min(cluster_timeout_s, timeout_s)
        self._leaderless_timeout_s = min(leaderless_timeout_s, timeout_s)

    def _attempt_timeout_s(self, *, clustered: bool, awaiting_leader: bool) -> float:
        """How long one send waits for its ack. On a cluster a send can go unanswered because the
        stream is electing a leader (its followers, the restarted old leader among them, take its
        subjects but drop what arrives meanwhile, answering nothing): the first send waits
        ``cluster_timeout_s``, and once one went unanswered the next ones ``leaderless_timeout_s``
        each, so the first send after the election is acked at once. Resending is safe: the same
        ``Nats-Msg-Id`` is stored once."""
        if not clustered:
            return self._timeout_s
        return self._leaderless_timeout_s if awaiting_leader else self._cluster_timeout_s

    async def _publish_once(
        self, subject: str, payload: bytes, headers: dict[str, str], timeout_s: float | None = None
    ) -> PubAck:
        """One publish and its ack; :class:`_ConnectionLost` when the connection drops meanwhile.

        nats.py leaves a request pending across a reconnect although its reply, if any, went to the
        lost connection; waiting out the timeout would stall every publisher of a killed node.
        """
        reconnects = self._nc.stats["reconnects"]
        request = asyncio.ensure_future(
            self._js.publish(subject, payload, timeout=timeout_s or self._timeout_s, headers=headers)
        )
        try:
            while True:
                done, _ = await asyncio.wait({request}, timeout=_RECONNECT_CHECK_S)
                if done:
                    return request.result()
                if self._nc.stats["reconnects"] != reconnects:
                    raise _ConnectionLost
        finally:
            if not request.done():
                request.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await request

    async def publish(
        self,
        subject: str,
        message: msgspec.Struct,
        *,
        msg_id: str,
        headers: Mapping[str, str] | None = None,
        parent: otel_context.Context | None = None,
    ) -> PubAck:
        """Encode ``message`` and publish it; see :meth:`publish_bytes`."""
        return await self.publish_bytes(
            subject, encode(message), msg_id=msg_id, headers=headers, parent=parent
        )

    async def publish_bytes(
        self,
        subject: str,
        payload: bytes,
        *,
        msg_id: str,
        headers: Mapping[str, str] | None = None,
        parent: otel_context.Context | None = None,
    ) -> PubAck:
        """Publish under a PRODUCER span, retrying with the same id until the stream acknowledges.

        ``parent`` is the trace context to continue; by default the current one. Raises
        :class:`BusError` when every attempt failed.
        """
        with _tracer.start_as_current_span(
            span_name("publish", subject),
            context=parent,
            kind=SpanKind.PRODUCER,
            attributes={
                "messaging.system": "nats",
                "messaging.operation.type": "publish",
                "messaging.destination.name": subject,
                "messaging.message.id": msg_id,
                "messaging.message.body.size": len(payload),
            },
        ) as span:
            all_headers = dict(headers or {})
            all_headers["Nats-Msg-Id"] = keyed(msg_id, self._id_key)
            propagate.inject(all_headers)
            backoff_s = self._first_backoff_s
            last_error: Exception | None = None
            attempt = 0
            awaiting_leader_since: float | None = None
            clustered = len(self._nc.servers) > 1
            while attempt < self._attempts:
                sent_at = time.monotonic()
                try:
                    ack = await self._publish_once(
                        subject,
                        payload,
                        all_headers,
                        self._attempt_timeout_s(
                            clustered=clustered, awaiting_leader=awaiting_leader_since is not None
                        ),
                    )
                except _ConnectionLost as exc:
                    # The client is connected again (to another node): send again at once.
                    last_error = exc
                    attempt += 1
                    span.add_event("resend after reconnect", {"attempt": attempt})
                    continue
                except _RETRYABLE as exc:
                    last_error = exc
                    if publish_denied(self._nc, subject, since=sent_at):
                        # No ack came because the server refused the publish (an error on the
                        # connection, not a reply): this identity may not publish there.
                        span.record_exception(exc)
                        raise BusError(
                            f"publish to {subject} refused: this client's NATS permissions do not allow"
                            " it (a tenant's credentials publish only that tenant's subjects)",
                            non_retryable=True,
                        ) from exc
                except APIError as exc:
                    # 503 and similar are transient, and so is "duplicate message id is in process"
                    # (an earlier send of this id is being stored: the next one gets its ack as a
                    # duplicate); anything else (e.g. no stream) will not heal.
                    if (exc.code is not None and exc.code >= 500) or _in_process(exc):
                        last_error = exc
                    else:
                        span.record_exception(exc)
                        raise BusError(f"publish to {subject} refused: {exc}", non_retryable=True) from exc
                except ConnectionClosedError as exc:
                    raise BusError(f"publish to {subject}: connection closed") from exc
                else:
                    span.set_attribute("messaging.nats.duplicate", bool(ack.duplicate))
                    span.set_attribute("messaging.nats.stream_sequence", ack.seq)
                    return ack
                if _in_process(last_error) or (
                    clustered and isinstance(last_error, _AWAITING_LEADER_OR_SILENT)
                ):
                    now = time.monotonic()
                    awaiting_leader_since = awaiting_leader_since or now
                    if now - awaiting_leader_since < self._leader_wait_s:
                        # An id in process: the first send is being stored; give it a moment.
                        await asyncio.sleep(
                            _IN_PROCESS_WAIT_S if _in_process(last_error) else self._leader_poll_s
                        )
                        continue
                attempt += 1
                span.add_event("retry", {"attempt": attempt, "error": repr(last_error)})
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, self._max_backoff_s)
            assert last_error is not None
            span.record_exception(last_error)
            raise BusError(f"publish to {subject} failed after {self._attempts} attempts: {last_error!r}")

    async def publish_batch(self, messages: Sequence[Outgoing]) -> list[BaseException | None]:
        """Publish many messages at once, their acks awaited together (up to the timeout).

        Each goes under a PRODUCER span of its own with its id, as :meth:`publish_bytes` sends
        it, but without waiting for its ack before the next is sent. One attempt each: returns,
        per message, None when the stream acknowledged it, else the error; the caller keeps what
        failed for a later try (the outbox does).
        """
        return await (await self.send_batch(messages)).acks()

    async def send_batch(self, messages: Sequence[Outgoing]) -> "SentBatch":
        """The sending half of :meth:`publish_batch`: every message is on the connection, in
        order, when this returns; :meth:`SentBatch.acks` waits for the stream's answers."""
        spans: list[trace.Span] = []
        sent: list[asyncio.Future[PubAck] | BaseException] = []
        # nats.py's publish_async waits for room with ``asyncio.wait_for(..., timeout)``, which
        # yields to the event loop on every message even when room is free: the client's flusher
        # then writes each message with a system call of its own. With room for the whole batch
        # (nothing can take it in between: nothing here yields), no stall timeout is needed, so
        # the batch is written at once and goes out in one write.
        reconnects = self._nc.stats["reconnects"]
        room = getattr(self._js, "_publish_async_pending_semaphore", None)
        free = 0 if room is None or room.locked() else int(getattr(room, "_value", 0))
        for m in messages:
            # The sampler reads the subject only; the rest goes only into a span that records.
            span = _tracer.start_span(
                span_name("publish", m.subject),
                context=m.parent,
                kind=SpanKind.PRODUCER,
                attributes={"messaging.destination.name": m.subject},
            )
            if span.is_recording():
                span.set_attributes(
                    {
                        "messaging.system": "nats",
                        "messaging.operation.type": "publish",
                        "messaging.message.id": m.msg_id,
                        "messaging.message.body.size": len(m.payload),
                    }
                )
            spans.append(span)
            headers = dict(m.headers)
            headers["Nats-Msg-Id"] = keyed(m.msg_id, self._id_key)
            propagate.inject(headers, context=trace.set_span_in_context(span, m.parent))
            stall = None if free > 0 else self._timeout_s
            free -= 1
            try:
                sent.append(
                    await self._js.publish_async(m.subject, m.payload, headers=headers, wait_stall=stall)
                )
            except Exception as exc:  # stalled, or the connection is closed: this one failed
                sent.append(exc)
        clustered = len(self._nc.servers) > 1
        silent_s = self._cluster_timeout_s if clustered else None
        return SentBatch(spans, sent, self._timeout_s, self._nc, reconnects, silent_s=silent_s)

    async def publish_core(
        self, subject: str, payload: bytes, headers: Mapping[str, str] | None = None
    ) -> None:
        """Publish on core NATS (no stream, no ack): replies and best-effort notices."""
        await self._nc.publish(subject, payload, headers=dict(headers or {}) or None)


class SentBatch:
    """Messages :meth:`Publisher.send_batch` sent, their acks still to come."""

    def __init__(
        self,
        spans: list[trace.Span],
        sent: list[asyncio.Future[PubAck] | BaseException],
        timeout_s: float,
        nc: Client | None = None,
        reconnects: int = 0,
        *,
        silent_s: float | None = None,
    ) -> None:
        self._spans = spans
        self._sent = sent
        self._timeout_s = timeout_s
        self._nc = nc
        self._reconnects = reconnects
        self._silent_s = silent_s
        """On a cluster: when not one ack came back this long, the stream is taken to be electing
        a leader (its replicas drop what they get meanwhile) and the rest count as failed now."""

    async def acks(self) -> list[BaseException | None]:
        """Per message, None once the stream acknowledged it, else the error (no ack within the
        timeout counts as one; so does the connection being replaced meanwhile: the acks still
        missing then went to the lost one, and the caller sends those again at once instead of
        after the timeout; on a cluster, so does no ack at all within ``silent_s``); every span
        ends here."""
        waiting: set[asyncio.Future[PubAck]] = {f for f in self._sent if not isinstance(f, BaseException)}
        sent_n = len(waiting)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout_s
        silent_until = loop.time() + self._silent_s if self._silent_s is not None else float("inf")
        while waiting:
            left = deadline - loop.time()
            if left <= 0 or (len(waiting) == sent_n and loop.time() >= silent_until):
                break
            _, waiting = await asyncio.wait(waiting, timeout=min(left, _RECONNECT_CHECK_S))
            if self._nc is not None and self._nc.stats["reconnects"] != self._reconnects:
                for lost in waiting:
                    if not lost.done():
                        lost.set_exception(_ConnectionLost())
                break
        outcomes: list[BaseException | None] = []
        for span, f in zip(self._spans, self._sent, strict=True):
            error: BaseException | None
            if isinstance(f, BaseException):
                error = f
            elif not f.done():
                f.cancel()  # no ack in time (its pending slot is given back)
                error = NatsTimeoutError()
            else:
                error = f.exception()
                if error is None:
                    ack = f.result()
                    span.set_attribute("messaging.nats.duplicate", bool(ack.duplicate))
                    span.set_attribute("messaging.nats.stream_sequence", ack.seq)
            if error is not None:
                span.record_exception(error)
            span.end()
            outcomes.append(error)
        return outcomes
