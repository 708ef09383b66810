"""The transactional outbox: decide in a transaction, publish after commit, never lose a message.

A handler adds the messages its decision implies with :func:`add` inside its transaction. After
the commit the service calls :meth:`OutboxRelay.flush`, which publishes pending rows in order with
their deterministic ids and marks them published. If the process dies in between, the next flush
(at start-up, or after the next commit) publishes them; JetStream's duplicate window absorbs a
message published twice because the mark did not commit.

A producer's rows go out in commit order (``outbox.id``) as far as a failure is known in time: a
consumer should not see a job's later event before its ``placed``. Once a fast-path publish fails,
the fast path stands aside and the relay publishes every row in order until it finds none pending
(:attr:`OutboxRelay.behind`), bar rows that are stuck: refused :data:`STUCK_ROUNDS` times in a row
while other rows of the same sends went through, over at least ``stuck_after_s`` (a subject no
stream takes, say; an outage or a stream's leader election fails every row, so it never makes one
stuck). Stuck rows no longer hold the others back; they are still retried, at growing intervals
(:data:`STUCK_RETRY_S`, doubling at each refusal, up to :data:`STUCK_RETRY_MAX_S`: before, every
relay round sent each again and logged its failure). A row that fails in a
relay round is sent again at the next round, after the rows behind it that went through (a chunk
of failing rows must not keep the rest from the bus); rows of one stream fail together in an
outage, so their order holds. Not covered: the fast path sends a
commit's batch while the previous batch's acks are still awaited, so a batch whose acks fail only
after the next was sent (a reconnect, a stream leader's election) can still land after it (a
review reproduced it); consumers of events from several producers tolerate such order anyway.
"""

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import asyncpg
import msgspec
import structlog
from opentelemetry import propagate
from opentelemetry.context import Context

from loom.bus import Publisher
from loom.bus.publisher import Outgoing, SentBatch, too_large
from loom_proto.codec import encode

log = structlog.get_logger("loom.store")

STUCK_ROUNDS = 3
"""Sends in a row a row must fail while others of the same send go through to be stuck."""
STUCK_AFTER_S = 60.0
"""Seconds a row must have been failing to be stuck: longer than a stream leader's election (the
publisher waits up to 20 s for one)."""
STUCK_RETRY_S = 1.0
"""Seconds before a stuck row is sent again after its first refusal as stuck; doubled each time."""
STUCK_RETRY_MAX_S = 300.0
"""The longest a stuck row waits between sends."""
_FAILURES_KEPT = 10_000
"""Rows whose failures are counted at most (the oldest forgotten first)."""


@dataclass(frozen=True)
class OutboxMessage:
    """A message to publish after commit."""

    msg_id: str
    subject: str
    payload: bytes
    headers: Mapping[str, str]


def message(
    subject: str,
    event: msgspec.Struct,
    msg_id: str,
    *,
    headers: Mapping[str, str] | None = None,
    context: Context | None = None,
) -> OutboxMessage:
    """An outbox message carrying a trace context (default: the current one), so publishing later
    continues that trace."""
    carrier = dict(headers or {})
    propagate.inject(carrier, context=context)
    return OutboxMessage(msg_id=msg_id, subject=subject, payload=encode(event), headers=carrier)


async def add(conn: asyncpg.Connection, producer: str, messages: Sequence[OutboxMessage]) -> None:
    """Record messages to publish; a message id already recorded is kept as it was."""
    if not messages:
        return
    await conn.execute(
        """INSERT INTO outbox (producer, msg_id, subject, payload, headers)
           SELECT $1, m, s, p, h::jsonb
           FROM unnest($2::text[], $3::text[], $4::bytea[], $5::text[]) AS u(m, s, p, h)
           ON CONFLICT (msg_id) DO NOTHING""",
        producer,
        [m.msg_id for m in messages],
        [m.subject for m in messages],
        [m.payload for m in messages],
        [json.dumps(dict(m.headers)) for m in messages],
    )


class OutboxRelay:
    """Publishes one producer's pending outbox rows; one flush at a time."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        publisher: Publisher,
        producer: str,
        *,
        batch: int = 500,
        stuck_after_s: float = STUCK_AFTER_S,
    ) -> None:
        self._pool = pool
        self._stuck_after_s = stuck_after_s
        self._publisher = publisher
        self._producer = producer
        self._batch = batch
        self._lock = asyncio.Lock()
        self._kick = asyncio.Event()
        self._sending: set[str] = set()
        """Ids publish_now has sent and not yet marked (flush leaves them to it)."""
        self.behind = True
        """Rows older than the next commit's may be pending: the fast path (:meth:`publish_now`)
        leaves its rows to the relay, which sends them after the older ones. Set when a send
        fails; cleared by a flush of every age that finds nothing pending but stuck rows, under
        the lock the fast path sends under, so no commit slips between that look and the fast
        path's next send.
        True at first: the rows a dead process left are not known until the first such flush (the
        services run one at start-up)."""
        self._failures: dict[str, tuple[int, float]] = {}
        """Per failing row (memory only): its failed sends in a row while others of the same send
        went through, and when it first failed (``time.monotonic()``)."""
        self._retry_at: dict[str, tuple[float, float]] = {}
        """Stuck rows -> (when a flush sends them again, ``time.monotonic()``; the wait before
        that): before it, no flush sends the row; each refusal after it doubles the wait."""
        self.published = 0
        self.set_aside = 0
        """Rows the bus refused for good, set aside (``outbox.refused`` says why)."""

    def kick(self) -> None:
        """Ask the background loop (:meth:`run`) to flush soon; returns at once."""
        self._kick.set()

    async def run(self, stopping: asyncio.Event, *, idle_s: float = 1.0, min_age_s: float = 1.0) -> None:
        """Flush when kicked (and every ``idle_s`` regardless) until ``stopping``, then once more.

        Publishing off the handler's path lets the next batch's transaction overlap this batch's
        publishes; the outbox row, not the handler, is what guarantees the message goes out.
        These rounds take only rows at least ``min_age_s`` old: younger ones are the fast path's
        (:meth:`publish_now`), which a flush would only publish twice, acks and all. While the
        relay is :attr:`behind` they take every row: the fast path has left its rows to them.
        """
        while not stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._kick.wait(), timeout=idle_s)
            self._kick.clear()
            try:
                await self.flush(min_age_s=0.0 if self.behind else min_age_s)
            except Exception as exc:  # rows stay pending; the next round retries them
                log.warning("outbox flush failed", producer=self._producer, error=repr(exc))
                await asyncio.sleep(0.5)
        with contextlib.suppress(Exception):
            await self.flush()

    async def publish_now(
        self, messages: Sequence[OutboxMessage], *, on_sent: Callable[[], None] | None = None
    ) -> int:
        """Publish messages just committed to the outbox, without reading them back, and mark them.

        The fast path after a commit; whatever fails here stays pending for :meth:`flush`, and so
        do later commits' messages until the relay has caught up (:attr:`behind`): sent now, they
        would overtake the ones that failed. ``on_sent`` is called once they are handed to NATS,
        before their acks are awaited (not when they are left to the relay).
        """
        if not messages:
            return 0
        # Sent in commit order, one batch after the other; the acks are awaited outside the lock,
        # so the next commit's messages go out while this batch's are being stored.
        async with self._lock:
            if self.behind:
                self.kick()  # committed, so the relay's next round sends them after the older ones
                return 0
            try:
                sent = await self._claim_and_send(messages)
            except BaseException:
                self.behind = True
                self.kick()
                raise
        if on_sent is not None:
            on_sent()
        done, settled = await self._settle(messages, sent)
        if settled < len(messages):
            self.behind = True
            self.kick()
        return len(done)

    async def flush(self, *, min_age_s: float = 0.0) -> int:
        """Publish everything pending (at least ``min_age_s`` old); returns how many were published.

        A chunk at a time: the lock is held while a chunk is read and sent, not while its acks
        come back. A round for old rows only (``min_age_s`` above 0, the background rounds) first
        looks without the lock whether there is any: the usual round finds none, and holding the
        lock over that query held up the fast path (:meth:`publish_now` sends under it) after
        every commit that fell in it.

        A flush of every age that finds nothing pending but stuck rows lets the fast path go again
        (:attr:`behind`); one that leaves other rows pending (failed, or still in the fast path's
        hand) holds it back. A row that fails is left out of the flush's later chunks, so the rows
        behind it still go."""
        total = 0
        if min_age_s > 0 and not await self._pool.fetchval(
            """SELECT EXISTS (SELECT 1 FROM outbox
                 WHERE producer = $1 AND published_at IS NULL
                   AND created_at <= now() - make_interval(secs => $2))""",
            self._producer,
            min_age_s,
        ):
            return 0
        now = time.monotonic()
        tried = [msg_id for msg_id, (at, _) in self._retry_at.items() if at > now]
        """Rows this flush sent and saw fail (left out of its later chunks: sent once a flush), and
        stuck rows not due again yet."""
        held = False
        """Whether a row failed this flush that may go through soon (not stuck)."""
        while True:
            async with self._lock:
                rows = await self._pool.fetch(
                    """SELECT msg_id, subject, payload, headers FROM outbox
                       WHERE producer = $1 AND published_at IS NULL
                         AND created_at <= now() - make_interval(secs => $3)
                         AND NOT (msg_id = ANY($4::text[]))
                       ORDER BY id LIMIT $2""",
                    self._producer,
                    self._batch,
                    min_age_s,
                    tried,
                )
                in_hand = any(r["msg_id"] in self._sending for r in rows)  # publish_now's
                if (
                    min_age_s <= 0
                    and not held
                    and len(rows) < self._batch  # every pending row is in sight
                    and not in_hand
                    and all(self._stuck(r["msg_id"]) for r in rows)
                ):
                    # Caught up, under the lock the fast path sends under: the next commit is the
                    # oldest pending, bar rows that keep failing.
                    self.behind = False
                pending = [
                    OutboxMessage(r["msg_id"], r["subject"], bytes(r["payload"]), json.loads(r["headers"]))
                    for r in rows
                    if r["msg_id"] not in self._sending
                ]
                if not pending:
                    return total
                try:
                    sent = await self._claim_and_send(pending)
                except BaseException:
                    self.behind = True
                    raise
            done, settled = await self._settle(pending, sent)
            total += len(done)
            if settled < len(pending):
                failed = [m.msg_id for m in pending if m.msg_id in self._failures]
                if any(not self._stuck(msg_id) for msg_id in failed):
                    self.behind = held = True  # a row that may go through soon: the fast path waits
                # The rows after the failed ones still go (a full chunk of failing rows must not
                # keep the rows behind it from the bus), the failed ones again at the next flush.
                tried.extend(failed)
            elif in_hand:
                return total  # the fast path settles its own

    async def _claim_and_send(self, messages: Sequence[OutboxMessage]) -> SentBatch:
        """Send (under the caller's lock), the messages marked in hand so no other path sends them
        meanwhile; on failure they are in nobody's hand again."""
        ids = [m.msg_id for m in messages]
        self._sending.update(ids)
        try:
            return await self._send(messages)
        except BaseException:
            self._sending.difference_update(ids)
            raise

    async def _settle(self, messages: Sequence[OutboxMessage], sent: SentBatch) -> tuple[list[str], int]:
        """Await the acks, mark what made it published (and set aside what the bus refused for
        good), and let go of the messages; returns the ids published, and how many were settled
        either way."""
        try:
            done, set_aside = self._acked(messages, await sent.acks())
            if done:
                await self._pool.execute(
                    """UPDATE outbox SET published_at = now()
                       WHERE msg_id = ANY($1::text[]) AND published_at IS NULL""",
                    done,
                )
            if set_aside:
                await self._pool.execute(
                    """UPDATE outbox SET published_at = now(), refused = u.why
                       FROM unnest($1::text[], $2::text[]) AS u(id, why)
                       WHERE msg_id = u.id AND published_at IS NULL""",
                    list(set_aside),
                    list(set_aside.values()),
                )
        finally:
            self._sending.difference_update(m.msg_id for m in messages)
        self._count_failures(messages, done, set_aside)
        self.published += len(done)
        self.set_aside += len(set_aside)
        return done, len(done) + len(set_aside)

    def _stuck(self, msg_id: str) -> bool:
        """Whether a pending row is stuck: refused :data:`STUCK_ROUNDS` sends in a row while others
        went through, failing for ``stuck_after_s`` at least."""
        count, since = self._failures.get(msg_id, (0, 0.0))
        return count >= STUCK_ROUNDS and time.monotonic() - since >= self._stuck_after_s

    def _count_failures(
        self, messages: Sequence[OutboxMessage], done: Sequence[str], set_aside: Mapping[str, str]
    ) -> None:
        """Count a failed send of each message neither published nor set aside, as a refusal of
        that row only when another of the same send went through (else the bus was down: it says
        nothing of the row); forget the rest."""
        gone = {*done, *set_aside}
        specific = bool(done)
        now = time.monotonic()
        for m in messages:
            if m.msg_id in gone:
                self._failures.pop(m.msg_id, None)
                self._retry_at.pop(m.msg_id, None)
            else:
                count, since = self._failures.pop(m.msg_id, (0, now))
                count += specific
                self._failures[m.msg_id] = (count, since)
                if self._stuck(m.msg_id):
                    _, waited = self._retry_at.get(m.msg_id, (0.0, 0.0))
                    wait = min(2.0 * waited, STUCK_RETRY_MAX_S) if waited else STUCK_RETRY_S
                    self._retry_at[m.msg_id] = (now + wait, wait)
        while len(self._failures) > _FAILURES_KEPT:
            oldest = next(iter(self._failures))
            del self._failures[oldest]
            self._retry_at.pop(oldest, None)

    async def _send(self, messages: Sequence[OutboxMessage]) -> SentBatch:
        """Send at once, each continuing its stored trace (see :meth:`Publisher.send_batch`)."""
        contexts: dict[tuple[str, str], Context] = {}  # the messages of one job share a trace
        batch = []
        for m in messages:
            key = (m.headers.get("traceparent", ""), m.headers.get("tracestate", ""))
            parent = contexts.get(key)
            if parent is None:
                parent = contexts[key] = propagate.extract(m.headers)
            batch.append(
                Outgoing(
                    m.subject,
                    m.payload,
                    m.msg_id,
                    {k: v for k, v in m.headers.items() if k not in ("traceparent", "tracestate")},
                    parent,
                )
            )
        return await self._publisher.send_batch(batch)

    def _acked(
        self, messages: Sequence[OutboxMessage], outcomes: Sequence[BaseException | None]
    ) -> tuple[list[str], dict[str, str]]:
        """The ids published, and those too large for any resend (:func:`loom.bus.publisher.too_large`)
        with why; the others are retried."""
        done: list[str] = []
        set_aside: dict[str, str] = {}
        for m, error in zip(messages, outcomes, strict=True):
            if error is None:
                done.append(m.msg_id)
            elif too_large(error):
                set_aside[m.msg_id] = (repr(error) or type(error).__name__)[:1024]
                log.error(
                    "outbox message refused by the bus for good; set aside (outbox.refused)",
                    producer=self._producer,
                    msg_id=m.msg_id,
                    subject=m.subject,
                    bytes=len(m.payload),
                    error=repr(error),
                )
            else:
                log.warning("outbox publish failed; will retry", msg_id=m.msg_id, error=repr(error))
        return done, set_aside
