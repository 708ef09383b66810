"""A durable pull-consumer loop: fetch in batches, decode strictly, handle, then ack / nak / dead-letter.

What happens to a message is decided here, from the handler's outcome, never from message text:

* the handler returns normally: ack;
* decoding fails (each message is decoded on its own, with size, depth and repeated-key limits),
  or the handler raises a ``LoomError`` with ``non_retryable``, an ``InvalidIdError``, a
  ``DecodeError`` or a ``RecursionError``: dead-letter that message at once;
* a dependency outage (:mod:`loom.bus.outage`: the error points at PostgreSQL or NATS and its
  probe confirms it is down): nak without counting the delivery, stop fetching, and resume when
  the probe answers again, however long that takes; health says ``degraded`` meanwhile;
* any other exception: nak with an exponential delay, and dead-letter once it failed
  ``max_deliver`` times.

Failures are counted by this loop, per stream sequence, in memory; the server's own
``max_deliver`` is unlimited, so redeliveries caused by outages (or by restarts, or ack waits
running out while NATS was away) can never exhaust a budget the server enforces by dropping the
message. In-memory counts start afresh in a new process, so a message delivered more than
``suspect_after`` times is handled alone and its attempt written down first
(:mod:`loom.bus.attempts`): an attempt that never came back means the process handling it died,
and ``max_crashes`` of those dead-letter it (``Loom-Error-Type: CrashLoop``) once every dependency
answers; its ordinary failures are counted across process lives there too. So a message that
kills its process, or keeps failing across restarts, is dead-lettered by delivery
``suspect_after + max_crashes + max_deliver`` at the latest, while one held by outages
never is (an outage ends the attempt as any outcome does).

When a batch handler raises, or returns one error object for several messages, and that error is
no outage and would dead-letter them, those messages are handled again one by one, so the message
that broke the batch fails by itself and its neighbours go through.

A dead letter goes to ``loom.dlq.<original subject>`` with the original payload and headers plus
``Loom-Error``, ``Loom-Error-Type``, ``Loom-Original-Subject``, ``Loom-Stream``,
``Loom-Stream-Seq``, ``Loom-Deliveries`` and ``Loom-Failures``; its message id is derived from the
stream sequence so a redelivered poison message is dead-lettered once.
"""

import asyncio
import contextlib
import functools
import json
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import ConnectionReconnectingError, NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import APIError, NoStreamResponseError
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from loom.bus.attempts import TRANSIENT as ATTEMPTS_TRANSIENT
from loom.bus.attempts import AttemptLog, Attempts
from loom.bus.attempts import closed as attempt_closed
from loom.bus.attempts import opened as attempt_opened
from loom.bus.connection import BusError, announces_reconnects, on_reconnected
from loom.bus.outage import Dependencies, of_connection
from loom.bus.publisher import Publisher
from loom.errors import LoomError, NotLeaderError, UnavailableError
from loom.security.message_ids import logical
from loom.tasks import cancel_and_wait
from loom.telemetry import message_context, span_name
from loom.telemetry.metrics import CONSUMER_LAG, CONSUMER_MESSAGES, CONSUMER_REDELIVERIES, DEAD_LETTERS
from loom_proto.codec import DecodeError, decode
from loom_proto.ids import InvalidIdError
from loom_proto.subjects import dead_letter

log = structlog.get_logger("loom.bus")

_RECONNECT_LOOK_S = 0.25
"""How often a callback pull waiting for messages looks whether its connection was replaced, on a
client whose reconnects no listener hears (not made by :func:`loom.bus.connection.connect`)."""
_LEADERLESS_FIRST_S = 0.02
_LEADERLESS_MAX_S = 0.25
"""Backoff between pull requests answered "no responders" (the consumer's leader is being elected)."""
_tracer = trace.get_tracer("loom.bus")

T = TypeVar("T")

_MAX_TRACKED = 100_000
"""Failure counts kept per consumer at most (each is a few dozen bytes)."""


_ATTEMPTS_TIMEOUT_S = 2.0
"""Longest wait on the attempt-record bucket per operation."""
_ATTEMPTS_OFF_S = 30.0
"""After the bucket failed, suspects are handled without records this long."""

_NOT_OURS_DELAY_S = 0.5
"""Redelivery delay of a message given back because this instance no longer leads."""


_CREATE_TRY_TIMEOUT_S = 2.0
"""One consumer create / info request's timeout while starting (its reply may be lost with a
connection to a node that died)."""
_CREATE_RETRY_S = 0.1
"""Pause between tries of a consumer create that failed transiently."""


def _transient_api_error(error: BaseException) -> bool:
    """Whether a JetStream API request failed for the moment only: no reply, no responders, or a
    5xx answer (no meta leader; a cluster electing one), or the connection went meanwhile."""
    if isinstance(error, APIError):
        return error.code is not None and error.code >= 500
    return isinstance(
        error,
        NatsTimeoutError
        | TimeoutError
        | NoRespondersError
        | NoStreamResponseError
        | ConnectionReconnectingError,
    )


def _not_ours(error: BaseException) -> bool:
    """Whether ``error`` (or its cause) says another instance leads now: :class:`NotLeaderError`."""
    seen: BaseException | None = error
    for _ in range(8):
        if seen is None:
            return False
        if isinstance(seen, NotLeaderError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


class CrashLoopError(LoomError):
    """The processes handling a message kept dying before they settled it."""

    non_retryable = True


def _never_succeeds(error: BaseException) -> bool:
    """Whether a retry of the same message cannot help: it is the message, not the moment."""
    if isinstance(error, LoomError):
        return error.non_retryable
    # An id that cannot become a subject token will not become one on a retry either; a message
    # that recursed too deep will again.
    return isinstance(error, InvalidIdError | DecodeError | RecursionError)


@dataclass(frozen=True, kw_only=True)
class ConsumerSpec:
    """A durable pull consumer on one stream."""

    stream: str
    durable: str
    filter_subjects: Sequence[str]
    max_deliver: int = 5
    """Failures (outages not counted) after which a message is dead-lettered."""
    ack_wait_s: float = 30.0
    batch: int = 100
    first_nak_delay_s: float = 0.2
    max_nak_delay_s: float = 10.0
    max_ack_pending: int = 20_000
    suspect_after: int = 3
    """A delivery whose count (JetStream's ``num_delivered``) is above this is a suspect: it is
    handled alone, with its attempt recorded in ``LOOM_ATTEMPTS`` first (:mod:`loom.bus.attempts`)."""
    max_crashes: int = 3
    """Attempts at one message that never came back (the process died) after which it is
    dead-lettered, provided every dependency answers then."""
    deliver_new_only: bool = False
    """Start at messages published after the consumer is created (e.g. live views)."""

    def config(self) -> ConsumerConfig:
        """The JetStream consumer configuration."""
        subjects = list(self.filter_subjects)
        return ConsumerConfig(
            durable_name=self.durable,
            # Named too: the client then creates it on ``CONSUMER.CREATE.<stream>.<name>.<filter>``
            # (one filter), whose filter nats-server checks against the request's, so an agent's
            # permissions can allow its own commands' filter only (loom.security.permissions).
            name=self.durable,
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.NEW if self.deliver_new_only else DeliverPolicy.ALL,
            ack_wait=self.ack_wait_s,
            # Unlimited: the loop counts failures itself, outages excluded, and dead-letters; a
            # server-side limit would drop a message silently once outages had used it up.
            max_deliver=-1,
            max_ack_pending=self.max_ack_pending,
            filter_subject=subjects[0] if len(subjects) == 1 else None,
            filter_subjects=subjects if len(subjects) > 1 else None,
        )

    def nak_delay_s(self, failures: int) -> float:
        """Exponential backoff for the next redelivery after ``failures`` failures."""
        return float(min(self.first_nak_delay_s * (2 ** max(failures - 1, 0)), self.max_nak_delay_s))


@dataclass(kw_only=True)
class Delivery(Generic[T]):
    """One decoded message with its consumer span; ``context`` continues its trace."""

    msg: Msg
    subject: str
    message: T
    headers: dict[str, str]
    msg_id: str | None
    num_delivered: int
    stream_seq: int
    span: Span
    context: otel_context.Context = field(default_factory=otel_context.Context)
    received_at: float = 0.0
    """Wall-clock seconds when this client got the message (callback pull: when it landed, even
    while earlier batches were still being handled; else when its fetch returned)."""


MessageHandler = Callable[[Delivery[T]], Awaitable[None]]
BatchHandler = Callable[[list[Delivery[T]]], Awaitable[Sequence[BaseException | None]]]


def stored_at(d: "Delivery[Any]") -> float:
    """When the server stored the delivered message (wall seconds; JetStream's own clock, which no
    publisher sets): the time to trust over a time the payload claims. Now, when the message
    carries no stream metadata."""
    try:
        stamp = d.msg.metadata.timestamp
    except Exception:  # not a JetStream message (a test's), or metadata nats-py cannot read
        return time.time()
    return stamp.timestamp() if stamp is not None else time.time()


async def caught_up(js: JetStreamContext, stream: str, durable: str, *, within_s: float = 2.0) -> bool:
    """Wait (at most ``within_s``) until ``durable`` on ``stream`` has nothing pending nor
    unacknowledged: what was stored before now is handled. Whether it got there (False also when
    the consumer cannot be looked up: the caller goes on as it would without waiting). A handler of
    one stream waits so for another's before acting on a message the other's may precede (a
    cancellation on REQUESTS after a completion on JOBS)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            info = await js.consumer_info(stream, durable, timeout=1.0)
        except Exception:  # not known: as if caught up (nothing to wait for that can be seen)
            return False
        if not info.num_pending and not info.num_ack_pending:
            return True
        await asyncio.sleep(0.05)
    return False


async def _in_progress(msgs: Iterable[Msg]) -> None:
    """Tell the server these messages are being worked on (their ack wait starts again)."""
    for msg in msgs:
        with contextlib.suppress(Exception):
            await msg.in_progress()


class ConsumerRunner(Generic[T]):
    """Runs one durable pull consumer until :meth:`stop`.

    Give either ``handler`` (one message at a time, its span current while it runs; with
    ``concurrent`` the messages of one fetch are handled concurrently, started in order) or
    ``batch_handler`` (all decoded messages of a fetch at once; it returns one outcome per
    delivery, ``None`` for success or the exception that message hit). With ``pipeline`` above 1,
    up to that many fetched batches are handled at once (started in fetch order; each settled
    after its own handler returns): the handler orders its own effects.
    """

    # PLR0915: one statement per piece of the loop's state, each documented.
    def __init__(  # noqa: PLR0915
        self,
        nc: Client,
        spec: ConsumerSpec,
        message_type: Any,
        *,
        handler: MessageHandler[T] | None = None,
        batch_handler: BatchHandler[T] | None = None,
        publisher: Publisher | None = None,
        idle_fetch_timeout_s: float = 2.0,
        linger_s: float = 0.002,
        concurrent: bool = False,
        callback_pull: bool = False,
        pipeline: int = 1,
        dependencies: Dependencies | None = None,
        create_wait_s: float = 30.0,
    ) -> None:
        if (handler is None) == (batch_handler is None):
            raise ValueError("give exactly one of handler and batch_handler")
        self._nc = nc
        self._js: JetStreamContext = nc.jetstream()
        self.spec = spec
        self._type = message_type
        self._handler = handler
        self._batch_handler = batch_handler
        self._publisher = publisher or Publisher(nc)
        self._idle_fetch_timeout_s = idle_fetch_timeout_s
        self._linger_s = linger_s
        self._concurrent = concurrent
        self._callback_pull = callback_pull
        self._pipeline = max(pipeline, 1)
        self._create_wait_s = create_wait_s
        self.created_without_update = 0
        """Starts that found the consumer but could not update it (no JetStream meta leader)."""
        self._paused = False  # waiting out an outage: what the standing request delivers is given back
        self._arrived: list[Msg] = []
        self._arrived_at: list[float] = []
        """Wall-clock seconds each of ``_arrived`` landed (:attr:`Delivery.received_at`)."""
        self._arrival = asyncio.Event()
        self._pull_left = 0
        self._pull_expires_at = 0.0
        self._reply = ""
        """The reply subject of the current pull request (callback pull)."""
        self._reconnect_look_s: float | None = _RECONNECT_LOOK_S
        self._cb_sub: Subscription | None = None
        self._advisory_sub: Subscription | None = None
        self._stop_listening: Callable[[], None] | None = None
        self._leader_elected = asyncio.Event()
        self._pull_reconnects = 0
        self._leaderless_backoff_s = 0.0
        """While pulls are answered "no responders" (the consumer has no leader: a NATS cluster is
        electing one), how long to wait before the next; the election's advisory cuts it short."""
        self._stopping = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.dependencies = dependencies or of_connection(nc)
        self._attempts: AttemptLog | None = None
        self._attempts_off_until = float("-inf")
        self._failures: dict[int, int] = {}
        """Stream sequence -> failures so far (outages not counted), while the message is unsettled."""
        self._given_back: dict[int, int] = {}
        """Stream sequence -> deliveries this process gave back at an outage, while the message is
        unsettled. JetStream counts each, but they are no sign of a message that kills its process,
        so they do not make it a suspect (before, three outages in a row did). Memory only: a new
        process counts them, erring towards a suspect."""
        self.waiting_for: list[str] = []
        """The dependencies this consumer waits for (it fetches nothing meanwhile)."""
        self.counts: dict[str, int] = {"acked": 0, "nacked": 0, "dead_lettered": 0}
        self._acked_metric = CONSUMER_MESSAGES.labels(spec.durable, "acked")
        """The acked counter's child, looked up once rather than per message."""
        self.held_for_outage = 0
        """Deliveries nakked, uncounted, because a dependency was down."""
        self.pulls = 0
        """Pull requests sent (callback pull)."""

    async def start(self) -> None:
        """Create or update the durable consumer and start the loop in a task."""
        await self._create()
        if self._callback_pull:
            # Each pull request has its own reply subject under one inbox: a request renewed before
            # it expired still gets its "408 expired" later, and only the current request's status
            # ends the current request (an old one's made the runner ask again at once, every time).
            self._inbox = self._nc.new_inbox()
            self._reply = f"{self._inbox}.0"
            self._cb_sub = await self._nc.subscribe(f"{self._inbox}.*", cb=self._on_pulled)
            self._next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{self.spec.stream}.{self.spec.durable}"
            # Reconnects of a client made by ``connect`` reach _on_reconnected at once; any other
            # client is looked at every _RECONNECT_LOOK_S while the loop waits.
            self._reconnect_look_s = None if announces_reconnects(self._nc) else _RECONNECT_LOOK_S
            # On a cluster the standing pull request lives on the consumer's leader: when that node
            # dies the request dies with it, and a new one is needed the moment another is elected.
            self._advisory_sub = await self._nc.subscribe(
                f"$JS.EVENT.ADVISORY.CONSUMER.LEADER_ELECTED.{self.spec.stream}.{self.spec.durable}",
                cb=self._on_leader_elected,
            )
            self._stop_listening = on_reconnected(self._nc, self._on_reconnected)
        else:
            self._sub = await self._js.pull_subscribe_bind(durable=self.spec.durable, stream=self.spec.stream)
        self._task = asyncio.create_task(self._run(), name=f"consumer-{self.spec.durable}")

    async def _create(self) -> None:
        """Create or update the durable consumer, riding out a JetStream meta-leader election.

        On a cluster the request is answered by the meta leader; after its node died nobody answers
        until the survivors elect another (nats-server waits 4-9 s before a follower campaigns), and
        a request sent on a connection to the dead node gets no reply at all. Each try has a short
        timeout and a transient failure is tried again, up to ``create_wait_s``. When the consumer
        exists already (a durable one survives its node: the consumer's own Raft group answers its
        info and its pulls), the loop starts on it at once and the update waits for the next start.
        Anything else (no such stream, a config the server refuses) raises :class:`BusError`.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._create_wait_s
        while True:
            try:
                await self._js.add_consumer(
                    self.spec.stream, config=self.spec.config(), timeout=_CREATE_TRY_TIMEOUT_S
                )
                return
            except Exception as exc:
                if not _transient_api_error(exc) or loop.time() >= deadline:
                    raise BusError(
                        f"cannot create consumer {self.spec.durable} on {self.spec.stream}: {exc!r}"
                    ) from exc
                error = exc
            with contextlib.suppress(Exception):
                await self._js.consumer_info(
                    self.spec.stream, self.spec.durable, timeout=_CREATE_TRY_TIMEOUT_S
                )
                log.warning(
                    "consumer exists; started without updating it (no JetStream meta leader answered)",
                    consumer=self.spec.durable,
                    error=repr(error),
                )
                self.created_without_update += 1
                return
            await asyncio.sleep(_CREATE_RETRY_S)

    async def stop(self) -> None:
        """Finish the batch in hand, then stop fetching; unacked messages are redelivered later."""
        self._stopping.set()
        self._arrival.set()  # a callback pull waiting for messages, or lingering, stops waiting
        # A loop that died already was reported by whoever waited on it (a watchdog). A caller
        # cancelled while the batch finishes (a stop under a timeout: a handler hung on the bus)
        # ends the loop there and then, and stays cancelled; the loop's own cancellation is no
        # error of the stop.
        task = self._task
        try:
            if task is not None and not task.done():
                try:
                    await asyncio.wait([task])
                except asyncio.CancelledError:
                    await cancel_and_wait([task])
                    raise
                if not task.cancelled():
                    task.result()
        finally:
            await self._unsubscribe()

    async def _unsubscribe(self) -> None:
        with contextlib.suppress(Exception):
            if self._cb_sub is not None:
                await self._cb_sub.unsubscribe()
            else:
                await self._sub.unsubscribe()
        # Messages on hand no handler will see (callback pull): given back now, not after their
        # ack wait (on a placement handover the new leader would wait that long for them).
        await self._give_back()
        with contextlib.suppress(Exception):
            if self._advisory_sub is not None:
                await self._advisory_sub.unsubscribe()
        self._advisory_sub = None
        if self._stop_listening is not None:
            self._stop_listening()
            self._stop_listening = None

    async def wait(self) -> None:
        """Return when the loop ends (it ends only on stop or a fatal error, which is raised)."""
        if self._task is not None:
            await self._task

    async def restart(self) -> None:
        """Start the loop again after it died (a watchdog restarts it); a no-op while it runs or
        once stopped.

        The old subscription goes first; raises what :meth:`start` raises.
        """
        if self._stopping.is_set() or (self._task is not None and not self._task.done()):
            return
        self._task = None
        await self._unsubscribe()
        self._cb_sub = None
        self._arrived, self._arrived_at, self._pull_left = [], [], 0
        await self.start()

    async def _on_pulled(self, msg: Msg) -> None:
        if self._paused:
            # The standing request goes on delivering while the loop waits out an outage: nothing
            # would handle this or keep it alive, and a copy kept past its ack wait would be
            # handled beside the server's redelivery (a review). Given back until the request is
            # over, so it does not come straight back to it.
            if not JetStreamContext.is_status_msg(msg):
                with contextlib.suppress(Exception):
                    await msg.nak(delay=self._paused_nak_delay_s)
            return
        self._arrived.append(msg)
        self._arrived_at.append(time.time())
        self._arrival.set()

    def _on_reconnected(self) -> None:
        self._pull_left = 0  # the request's replies may have gone to the lost connection
        self._arrival.set()

    async def _on_leader_elected(self, msg: Msg) -> None:
        self._pull_left = 0  # the request held by the old leader is gone: ask the new one now
        self._leader_elected.set()
        self._arrival.set()

    async def _callback_fetch(self) -> tuple[list[Msg], list[float]]:
        # One standing pull request of ``batch`` messages, renewed when it is used up or expires;
        # messages land in a plain callback. nats-py's ``fetch`` spends two tasks and a timer on
        # every message it hands over (and a chain of event-loop rounds): a low-rate consumer whose
        # work is cheap pays mostly for that. After the first arrival, linger so a batch gathers
        # (:meth:`_linger`).
        loop = asyncio.get_running_loop()
        if not self._arrived and self._renewal_due(loop):
            # Only with nothing on hand: what is on hand belongs to the request before, and counted
            # against a new one it would make that one look used up (a second request would be
            # asked for, and two batches delivered at once).
            if self._leaderless_backoff_s > 0:
                self._leader_elected.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._leader_elected.wait(), timeout=self._leaderless_backoff_s)
            await self._request(loop)
        if not self._arrived:
            # Until the request is due for renewal (in slices on a client whose reconnects are not
            # announced, so a reconnect, the request lost with the connection, is noticed soon).
            wait_s = max(self._pull_expires_at - loop.time(), 0.01)
            if self._reconnect_look_s is not None:
                wait_s = min(wait_s, self._reconnect_look_s)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrival.wait(), timeout=wait_s)
        if self._arrived and self._linger_s > 0:
            await self._linger(loop)
        self._arrival.clear()
        arrived, self._arrived = self._arrived, []
        arrived_at, self._arrived_at = self._arrived_at, []
        msgs: list[Msg] = []
        received: list[float] = []
        for msg, at in zip(arrived, arrived_at, strict=True):
            if JetStreamContext.is_status_msg(msg):
                if msg.subject != self._reply:
                    continue  # the end of a request already renewed: the current one stands
                # 408 (expired), 409 (limits), 404, or 503 (no responders: no consumer leader, a
                # cluster electing one): the request is over; ask again next round, after a short
                # backoff while nobody answers, so an election of several seconds is no hot loop.
                self._pull_left = 0
                no_leader = (msg.headers or {}).get("Status") == "503"
                self._leaderless_backoff_s = (
                    min(max(self._leaderless_backoff_s * 2, _LEADERLESS_FIRST_S), _LEADERLESS_MAX_S)
                    if no_leader
                    else 0.0
                )
                continue
            self._leaderless_backoff_s = 0.0
            msgs.append(msg)
            received.append(at)
        self._pull_left -= len(msgs)
        if (
            msgs
            and self._pipeline > 1
            and self._pull_left <= 0
            and self._leaderless_backoff_s == 0
            and not self._stopping.is_set()
        ):
            # A pipelined consumer whose request these messages used up asks for the next batch
            # now, so that it flows in while they are handled: it fetches only when a slot frees,
            # and asked then, with every slot busy it had nothing on the way and waited a round
            # trip and a batch's delivery each time (what is on hand meanwhile is kept alive:
            # _wait_for_slot). The messages in hand go to their handler whatever happens: a
            # request that could not be sent is asked again at the next fetch.
            try:
                await self._request(loop)
            except Exception as exc:
                self._pull_left = 0
                log.debug("pull request failed", consumer=self.spec.durable, error=repr(exc))
        return msgs, received

    async def _linger(self, loop: asyncio.AbstractEventLoop) -> None:
        """After a first arrival, up to ``linger_s`` for more to gather into the batch: not past
        the moment the standing request is used up (all it asked for is on hand) or ended (a pull
        status arrived), as nothing more can come then, nor past a stop. A consumer off the
        latency path (metering, say) lingers long at a low rate and so handles a few messages a
        transaction, not one."""
        deadline = loop.time() + self._linger_s
        while (
            len(self._arrived) < self._pull_left
            and not self._request_ended(self._arrived[-1])
            and not self._stopping.is_set()
        ):
            left = deadline - loop.time()
            if left <= 0:
                return
            self._arrival.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrival.wait(), timeout=left)
            if not self._arrived:  # taken by a stop or a reconnect meanwhile
                return

    def _request_ended(self, msg: Msg) -> bool:
        """A pull status that ends the current request (a late one of a request already renewed
        does not)."""
        return bool(JetStreamContext.is_status_msg(msg)) and msg.subject == self._reply

    def _renewal_due(self, loop: asyncio.AbstractEventLoop) -> bool:
        """The standing request is used up, about to expire, or lost with a connection."""
        return (
            self._pull_left <= 0
            or loop.time() >= self._pull_expires_at
            or self._nc.stats["reconnects"] != self._pull_reconnects
        )

    async def _wait_for_slot(self, in_flight: set[asyncio.Task[None]]) -> None:
        """Until fewer than ``pipeline`` batches are in hand (finished ones leave ``in_flight``);
        meanwhile what is on hand, waiting for a slot, is kept alive."""
        while len(in_flight) >= self._pipeline:
            done, _ = await asyncio.wait(
                in_flight, timeout=self._keep_alive_period_s, return_when=asyncio.FIRST_COMPLETED
            )
            in_flight -= done
            if not done:  # every slot still busy: what is on hand must not expire meanwhile
                await _in_progress(self._on_hand())

    async def _give_back(self, delay_s: float | None = None) -> None:
        """Nak what is on hand (callback pull), uncounted, and forget it; the standing request
        counts as used up (the next fetch asks anew)."""
        on_hand = self._on_hand()
        self._arrived, self._arrived_at = [], []
        self._pull_left = 0
        for msg in on_hand:
            with contextlib.suppress(Exception):
                self._gave_back(msg.metadata.sequence.stream)
            with contextlib.suppress(Exception):
                await msg.nak(delay=delay_s)

    @property
    def _paused_nak_delay_s(self) -> float:
        """Redelivery delay of what arrives while paused: past the standing request's expiry."""
        return self._idle_fetch_timeout_s + self.spec.first_nak_delay_s

    def _on_hand(self) -> list[Msg]:
        """The messages on hand (callback pull), pull statuses left out."""
        return [m for m in self._arrived if not JetStreamContext.is_status_msg(m)]

    @property
    def buffered(self) -> int:
        """Messages (and pull statuses) on hand, not yet given to a handler (callback pull)."""
        return len(self._arrived)

    async def _request(self, loop: asyncio.AbstractEventLoop) -> None:
        """A new standing pull request of ``batch`` messages (callback pull); the one before it is
        used up, expired or lost with its connection."""
        expires_s = self._idle_fetch_timeout_s
        request = {"batch": self.spec.batch, "expires": int(expires_s * 1e9)}
        # A client that reconnected asks again at once: the reply to a request made on the
        # lost connection may be lost with it.
        self._pull_reconnects = self._nc.stats["reconnects"]
        self.pulls += 1
        self._reply = f"{self._inbox}.{self.pulls}"
        await self._nc.publish(self._next_subject, json.dumps(request).encode(), reply=self._reply)
        self._pull_left = self.spec.batch
        # Renew a little before the server's expiry, so there is never a gap without a request.
        self._pull_expires_at = loop.time() + expires_s * 0.9

    async def _fetch(self) -> tuple[list[Msg], list[float]]:
        if self._callback_pull:
            return await self._callback_fetch()
        # A lone lingering pull returns the moment one message arrives; then take whatever else is
        # already waiting with a short pull, so a burst is handled as one batch without adding
        # latency when traffic is sparse.
        try:
            msgs: list[Msg] = await self._sub.fetch(1, timeout=self._idle_fetch_timeout_s)
        except (TimeoutError, NatsTimeoutError):
            return [], []
        if self.spec.batch > 1:
            with contextlib.suppress(NatsTimeoutError, asyncio.TimeoutError):
                msgs.extend(await self._sub.fetch(self.spec.batch - 1, timeout=self._linger_s))
        return msgs, [time.time()] * len(msgs)

    async def _run(self) -> None:
        in_flight: set[asyncio.Task[None]] = set()
        try:
            while not self._stopping.is_set():
                if self.waiting_for:
                    if in_flight:  # the batches in hand settle (nak) first
                        await asyncio.gather(*in_flight, return_exceptions=True)
                        in_flight.clear()
                    log.warning("consumer paused", consumer=self.spec.durable, waiting_for=self.waiting_for)
                    # What is on hand (and arrives meanwhile) goes back: nothing keeps it alive
                    # through the wait, and past its ack wait a copy handled after the resume
                    # would be the server's redelivery's twin.
                    self._paused = True
                    await self._give_back(self._paused_nak_delay_s)
                    try:
                        if not await self.dependencies.wait_until_up(self.waiting_for, self._stopping):
                            break
                    finally:
                        self._paused = False
                    log.info("consumer resumed", consumer=self.spec.durable, waited_for=self.waiting_for)
                    self.waiting_for = []
                try:
                    msgs, received = await self._fetch()
                except Exception as exc:  # connection trouble: the client reconnects, we retry
                    if self._stopping.is_set():
                        break
                    log.warning("fetch failed", consumer=self.spec.durable, error=repr(exc))
                    suspects = self.dependencies.suspects(exc)
                    self.waiting_for = await self.dependencies.confirm(suspects) if suspects else []
                    if not self.waiting_for:
                        await asyncio.sleep(0.5)
                    continue
                if not msgs:
                    continue
                if self._pipeline == 1:
                    await self._process_guarded(msgs, received)
                    continue
                # Pipelined: the next batch is fetched and its handler started (in fetch order)
                # while earlier ones are still handled; each batch is settled after its handler.
                task = asyncio.create_task(self._process_guarded(msgs, received))
                in_flight.add(task)
                await self._wait_for_slot(in_flight)
        finally:
            if in_flight:
                await asyncio.gather(*in_flight, return_exceptions=True)

    async def _process_guarded(self, msgs: list[Msg], received: list[float]) -> None:
        try:
            await self._process(msgs, received)
        except Exception as exc:
            # Never let one batch end the loop: what was not settled is redelivered after the
            # ack wait.
            log.exception("consumer batch failed", consumer=self.spec.durable, error=repr(exc))
            await asyncio.sleep(0.5)

    async def _process(self, msgs: list[Msg], received: list[float]) -> None:
        deliveries: list[Delivery[T]] = []
        durable = self.spec.durable
        CONSUMER_LAG.labels(durable).set(msgs[-1].metadata.num_pending or 0)
        for msg, received_at in zip(msgs, received, strict=True):
            headers = dict(msg.headers or {})
            meta = msg.metadata
            # The id without its publisher's tag: what was claimed and recorded before it had one
            # (loom.security.message_ids).
            msg_id = logical(sent) if (sent := headers.get("Nats-Msg-Id")) else None
            parent = message_context(headers, msg.subject, msg_id or f"{meta.stream}:{meta.sequence.stream}")
            if meta.num_delivered > 1:
                CONSUMER_REDELIVERIES.labels(durable).inc()
            # Only what the sampler reads goes in at the start; the rest only into a span that
            # records (with nowhere to export, none does, and building them cost every delivery).
            span = _tracer.start_span(
                span_name("process", msg.subject),
                context=parent,
                kind=SpanKind.CONSUMER,
                attributes={"messaging.destination.name": msg.subject},
            )
            if span.is_recording():
                span.set_attributes(
                    {
                        "messaging.system": "nats",
                        "messaging.operation.type": "process",
                        "messaging.consumer.group.name": self.spec.durable,
                        "messaging.message.id": msg_id or "",
                        "messaging.nats.stream_sequence": meta.sequence.stream,
                        "messaging.nats.delivery_count": meta.num_delivered,
                    }
                )
            try:
                # ``bytes`` hands the payload over untouched, for handlers that answer bad input
                # themselves (placement tells a submitter why a job was refused).
                message: T = msg.data if self._type is bytes else decode(msg.data, self._type)  # type: ignore[assignment]
            except Exception as exc:  # DecodeError; anything else a decoder raises is as final
                await self._dead_letter(msg, exc, span)
                continue
            deliveries.append(
                Delivery(
                    msg=msg,
                    subject=msg.subject,
                    message=message,
                    headers=headers,
                    msg_id=msg_id,
                    num_delivered=meta.num_delivered,
                    stream_seq=meta.sequence.stream,
                    span=span,
                    context=trace.set_span_in_context(span, parent),
                    received_at=received_at,
                )
            )
        # Delivered many times: maybe a message that kills its process. Each is handled alone,
        # after the others, with its attempt written down first.
        suspects: list[Delivery[T]] = []
        ordinary: list[Delivery[T]] = []
        for d in deliveries:
            (suspects if self._suspect(d) else ordinary).append(d)
        if not suspects:
            if ordinary:
                await self._process_decoded(ordinary)
            return
        deliveries = ordinary
        # The suspects wait their turn (the rest of the batch, then each other): kept alive
        # meanwhile, or past their ack wait the server would redeliver them to be handled twice
        # (a review). Each leaves the list as its turn comes (an in-progress would hold back the
        # redelivery of one given back).
        turn = {id(d.msg): d.msg for d in suspects}
        waiting = asyncio.create_task(self._keep_alive(turn.values()))
        try:
            if deliveries:
                await self._process_decoded(deliveries)
            for d in suspects:
                del turn[id(d.msg)]
                await self._process_suspect(d)
        finally:
            waiting.cancel()

    def _suspect(self, delivery: Delivery[T]) -> bool:
        """Delivered more than ``suspect_after`` times, those given back at an outage not counted."""
        given_back = self._given_back.get(delivery.stream_seq, 0) if self._given_back else 0
        return delivery.num_delivered - given_back > self.spec.suspect_after

    def _gave_back(self, stream_seq: int) -> None:
        """Remember a delivery given back at an outage (see ``_given_back``)."""
        self._given_back[stream_seq] = self._given_back.pop(stream_seq, 0) + 1
        if len(self._given_back) > _MAX_TRACKED:  # forget the oldest (settled elsewhere, most likely)
            del self._given_back[next(iter(self._given_back))]

    def _settled_for_good(self, stream_seq: int) -> None:
        """Forget what was counted of a message acked or dead-lettered."""
        if self._failures:
            self._failures.pop(stream_seq, None)
        if self._given_back:
            self._given_back.pop(stream_seq, None)

    async def _process_decoded(self, deliveries: list[Delivery[T]]) -> None:
        # While the handler works, tell the server the batch is in progress, so a short ack wait
        # (quick redelivery after a crash) never redelivers a batch that is merely slow.
        # Kept alive through the settling too: probing an outage, or a dead letter's publish,
        # may outlast the ack wait (an in-progress after the ack is ignored).
        alive = {id(d.msg): d.msg for d in deliveries}
        keepalive = asyncio.create_task(self._keep_alive(alive.values()))
        try:
            outcomes = await self._handle(deliveries)
            down = await self._outages(outcomes)
            # An ack is a publish without a reply (it never waits on the server): acknowledge in
            # line, and give only failures (a dead letter waits for its stream's ack) a task each.
            failed = []
            acked = 0
            for d, o in zip(deliveries, outcomes, strict=True):
                if o is None:
                    del alive[id(d.msg)]  # settled (an in-progress would hold back a redelivery)
                    await self._ack(d)
                    acked += 1
                elif (suspects := self._outage_of(o, down)) is not None:
                    failed.append(self._then_forget(alive, d, self._hold(d, o, suspects)))
                else:
                    failed.append(self._then_forget(alive, d, self._settle(d, o)))
            if acked:
                self.counts["acked"] += acked
                self._acked_metric.inc(acked)
            if failed:
                await asyncio.gather(*failed)
        finally:
            keepalive.cancel()
        if down:
            self.waiting_for = down

    @staticmethod
    async def _then_forget(alive: dict[int, Msg], delivery: Delivery[T], settling: Awaitable[None]) -> None:
        """Settle a failed delivery (a nak, or a dead letter's publish, which may outlast the ack
        wait: a review), kept alive until it is settled, then out of the keep-alive."""
        try:
            await settling
        finally:
            alive.pop(id(delivery.msg), None)

    async def _process_suspect(self, delivery: Delivery[T]) -> None:
        """Handle a much-redelivered message alone, its attempt recorded before and closed after.

        Without the record (NATS does not answer the bucket) it is handled as any other message.
        Kept alive from its turn until it is settled: the record's reads and writes, the handler,
        probing an outage its failure points at and a dead letter's publish may each outlast the
        ack wait, and past it the server redelivers it, to be handled beside (or after) this
        settling; before, only the handler was covered (a review). Out of the keep-alive once
        settled (an in-progress would hold back the redelivery of one given back).
        """
        alive = {id(delivery.msg): delivery.msg}
        keepalive = asyncio.create_task(self._keep_alive(alive.values()))
        try:
            await self._attempt_suspect(delivery, alive)
        finally:
            keepalive.cancel()

    async def _attempt_suspect(self, delivery: Delivery[T], alive: dict[int, Msg]) -> None:
        """The body of :meth:`_process_suspect`; empties ``alive`` as the delivery is settled (or
        handed to :meth:`_process_decoded`, which keeps it alive itself)."""
        seq = delivery.stream_seq
        if self.waiting_for:  # an earlier message of the batch met an outage: give this one back
            alive.clear()
            await self._hold(delivery, UnavailableError(",".join(self.waiting_for)), self.waiting_for)
            return
        if self._attempts is None:
            self._attempts = AttemptLog(self._js, self.spec.stream, self.spec.durable)
        loop = asyncio.get_running_loop()
        if loop.time() < self._attempts_off_until:
            alive.clear()
            await self._process_decoded([delivery])
            return
        try:
            # Opened at the revision read, read again when another attempt wrote it meanwhile.
            async with asyncio.timeout(_ATTEMPTS_TIMEOUT_S):
                before, now = await self._attempts.change(
                    seq, functools.partial(attempt_opened, max_crashes=self.spec.max_crashes)
                )
            if now is None:
                # Only when every dependency answers: a process killed while it waited on one
                # that was down did not die of the message.
                down = await self.dependencies.confirm(self.dependencies.names)
                if down:
                    self.waiting_for = down
                    alive.clear()
                    await self._hold(delivery, UnavailableError(",".join(down)), down)
                    return
                crash = CrashLoopError(
                    f"the process handling it ended {before.open} times before settling it "
                    f"(delivery {delivery.num_delivered})"
                    + (f"; last error: {before.error}" if before.error else "")
                )
                await self._dead_letter(delivery.msg, crash, delivery.span, failures=before.failures)
                alive.clear()
                await self._forget(seq)
                return
        except ATTEMPTS_TRANSIENT as exc:
            # Not per message: a bucket that does not answer (or that permissions keep from us)
            # would cost every suspect its timeout.
            self._attempts_off_until = loop.time() + _ATTEMPTS_OFF_S
            log.warning(
                "attempt records unavailable; handling suspects without them for a while",
                consumer=self.spec.durable,
                error=repr(exc),
                off_s=_ATTEMPTS_OFF_S,
            )
            alive.clear()
            await self._process_decoded([delivery])
            return
        if before.failures > self._failures.get(seq, 0):
            self._failures[seq] = before.failures
        outcome = (await self._handle([delivery]))[0]
        down = await self._outages([outcome])
        if outcome is not None and (suspects := self._outage_of(outcome, down)) is not None:
            alive.clear()  # a nak: no in-progress after it
            await self._hold(delivery, outcome, suspects)
            self.waiting_for = down
            settled = False
        else:
            await self._settle(delivery, outcome)
            alive.clear()
            settled = (
                outcome is None
                or _never_succeeds(outcome)
                or (not _not_ours(outcome) and seq not in self._failures)
            )
        await self._close_attempt(seq, before, outcome, settled=settled)

    async def _close_attempt(
        self, seq: int, before: Attempts, outcome: BaseException | None, *, settled: bool
    ) -> None:
        """The attempt came back: close it (the record goes once the message is settled for good)."""
        assert self._attempts is not None
        if settled:
            await self._forget(seq)
            return
        failures = self._failures.get(seq, before.failures)
        last = repr(outcome)[:512] if outcome is not None else before.error
        with contextlib.suppress(*ATTEMPTS_TRANSIENT):
            async with asyncio.timeout(_ATTEMPTS_TIMEOUT_S):
                # Closed on the record as it is now: another attempt may be open meanwhile.
                await self._attempts.change(seq, lambda now: attempt_closed(now, before, failures, last))

    async def _forget(self, seq: int) -> None:
        assert self._attempts is not None
        try:
            async with asyncio.timeout(_ATTEMPTS_TIMEOUT_S):
                await self._attempts.forget(seq)
        except ATTEMPTS_TRANSIENT as exc:  # it expires on its own; a stale one only costs a look
            log.debug("attempt record not removed", consumer=self.spec.durable, error=repr(exc))

    async def _outages(self, outcomes: Sequence[BaseException | None]) -> list[str]:
        """The dependencies that the failures point at and that are down now (probed)."""
        suspects: set[str] = set()
        for o in outcomes:
            if o is not None and not _never_succeeds(o):
                suspects.update(self.dependencies.suspects(o))
        return await self.dependencies.confirm(sorted(suspects)) if suspects else []

    def _outage_of(self, outcome: BaseException, down: list[str]) -> list[str] | None:
        if not down or _never_succeeds(outcome):
            return None
        hit = [name for name in self.dependencies.suspects(outcome) if name in down]
        return hit or None

    async def _hold(self, delivery: Delivery[T], outcome: BaseException, down: list[str]) -> None:
        """Give a delivery back, uncounted, while a dependency it needs is down."""
        self.held_for_outage += 1
        self._gave_back(delivery.stream_seq)
        delivery.span.set_attribute("loom.outage", ",".join(down))
        delivery.span.record_exception(outcome)
        try:
            # The loop fetches nothing until the dependency answers, so the delay only spaces out
            # redeliveries to another consumer of the same durable.
            await delivery.msg.nak(delay=self.spec.first_nak_delay_s)
            self.counts["nacked"] += 1
            CONSUMER_MESSAGES.labels(self.spec.durable, "nacked").inc()
        except Exception as exc:  # NATS may be the one that is down: the ack wait redelivers it
            log.debug("nak failed", consumer=self.spec.durable, error=repr(exc))
        finally:
            delivery.span.end()

    @property
    def _keep_alive_period_s(self) -> float:
        """How often messages held past the ack wait are said to be in progress."""
        return max(self.spec.ack_wait_s / 3, 0.05)

    async def _keep_alive(self, msgs: Iterable[Msg]) -> None:
        """Every third of the ack wait, say ``msgs`` are in progress (read afresh each time: a live
        view leaves out what was settled meanwhile), and what waits on hand."""
        while True:
            await asyncio.sleep(self._keep_alive_period_s)
            # With a callback pull the standing request goes on delivering while a batch is
            # handled: what waits on hand for the next batch must not outlive its ack wait either
            # (a redelivery would bring a second copy into a later batch).
            await _in_progress([*msgs, *self._on_hand()] if self._callback_pull else list(msgs))

    async def _handle(self, deliveries: list[Delivery[T]]) -> Sequence[BaseException | None]:
        if self._batch_handler is not None:
            try:
                outcomes = list(await self._handle_batch(deliveries))
            except Exception as exc:
                outcomes = [exc] * len(deliveries)
            # One error shared by several messages, and about to dead-letter them, is most likely
            # one message breaking the batch: handle those alone, so only the culprit fails.
            shared = self._shared_fatal(deliveries, outcomes)
            if shared:
                log.warning(
                    "batch failed as a whole; handling its messages one by one",
                    consumer=self.spec.durable,
                    error=repr(outcomes[shared[0]]),
                    messages=len(shared),
                )
                for i in shared:
                    try:
                        outcomes[i] = (await self._handle_batch([deliveries[i]]))[0]
                    except Exception as alone:
                        outcomes[i] = alone
            return outcomes
        handler = self._handler
        assert handler is not None

        async def one(delivery: Delivery[T]) -> BaseException | None:
            token = otel_context.attach(delivery.context)
            try:
                await handler(delivery)
            except Exception as exc:
                return exc
            finally:
                otel_context.detach(token)
            return None

        if self._concurrent:
            # Each handler runs in its own task (its own trace context); handlers start in order.
            return await asyncio.gather(*(one(d) for d in deliveries))
        return [await one(d) for d in deliveries]

    def _shared_fatal(self, deliveries: list[Delivery[T]], outcomes: list[BaseException | None]) -> list[int]:
        """Indices of the messages failed by one error object shared with another message, that is
        no outage, and that would dead-letter at least one of them now."""
        by_error: dict[int, list[int]] = {}
        for i, o in enumerate(outcomes):
            if o is not None:
                by_error.setdefault(id(o), []).append(i)
        shared: list[int] = []
        for indices in by_error.values():
            error = outcomes[indices[0]]
            assert error is not None
            if len(indices) < 2 or self.dependencies.suspects(error):
                continue
            fatal = _never_succeeds(error) or any(
                self._failures.get(deliveries[i].stream_seq, 0) + 1 >= self.spec.max_deliver for i in indices
            )
            if fatal:
                shared += indices
        return sorted(shared)

    async def _handle_batch(self, deliveries: list[Delivery[T]]) -> Sequence[BaseException | None]:
        assert self._batch_handler is not None
        outcomes = await self._batch_handler(deliveries)
        if len(outcomes) != len(deliveries):
            error = RuntimeError("batch handler returned the wrong number of outcomes")
            return [error] * len(deliveries)
        return outcomes

    async def _ack(self, delivery: Delivery[T]) -> None:
        """Acknowledge a delivery its handler succeeded with (the caller counts it)."""
        self._settled_for_good(delivery.stream_seq)
        try:
            await delivery.msg.ack()
        finally:
            delivery.span.end()

    async def _settle(self, delivery: Delivery[T], outcome: BaseException | None) -> None:
        msg, span = delivery.msg, delivery.span
        if outcome is None:
            await self._ack(delivery)
            self.counts["acked"] += 1
            self._acked_metric.inc()
            return
        if _never_succeeds(outcome):
            self._failures.pop(delivery.stream_seq, None)
            await self._dead_letter(msg, outcome, span, failures=1)
            return
        if _not_ours(outcome):
            # Another instance leads now (this one was fenced): give it back, uncounted.
            self.counts["not_ours"] = self.counts.get("not_ours", 0) + 1
            span.record_exception(outcome)
            try:
                await msg.nak(delay=_NOT_OURS_DELAY_S)
                self.counts["nacked"] += 1
                CONSUMER_MESSAGES.labels(self.spec.durable, "nacked").inc()
            finally:
                span.end()
            return
        failures = self._failures.pop(delivery.stream_seq, 0) + 1
        if failures >= self.spec.max_deliver:
            await self._dead_letter(msg, outcome, span, failures=failures)
            return
        self._failures[delivery.stream_seq] = failures
        if len(self._failures) > _MAX_TRACKED:  # forget the oldest (redelivered elsewhere, most likely)
            del self._failures[next(iter(self._failures))]
        delay_s = self.spec.nak_delay_s(failures)
        log.warning(
            "handler failed, will retry",
            consumer=self.spec.durable,
            subject=msg.subject,
            error=repr(outcome),
            delivery=delivery.num_delivered,
            failures=failures,
            retry_in_s=delay_s,
        )
        span.record_exception(outcome)
        span.set_status(Status(StatusCode.ERROR, repr(outcome)))
        try:
            await msg.nak(delay=delay_s)
            self.counts["nacked"] += 1
            CONSUMER_MESSAGES.labels(self.spec.durable, "nacked").inc()
        finally:
            span.end()

    async def _dead_letter(self, msg: Msg, error: BaseException, span: Span, *, failures: int = 1) -> None:
        meta = msg.metadata
        # JetStream's own headers travel renamed (``Nats-Msg-Id`` as ``Loom-Original-Msg-Id``): the
        # DLQ stream would act on them (a ``Nats-Expected-Stream`` of the original's stream has
        # the dead letter refused, and the message went round for ever).
        headers = {
            (f"Loom-Original-{k[5:]}" if k.startswith("Nats-") else k): v
            for k, v in (msg.headers or {}).items()
        }
        headers.update(
            {
                "Loom-Error": str(error)[:1024] or type(error).__name__,
                "Loom-Error-Type": type(error).__name__,
                "Loom-Original-Subject": msg.subject,
                "Loom-Stream": meta.stream,
                "Loom-Stream-Seq": str(meta.sequence.stream),
                "Loom-Deliveries": str(meta.num_delivered),
                "Loom-Failures": str(failures),
                "Loom-Consumer": self.spec.durable,
            }
        )
        span.record_exception(error)
        span.set_status(Status(StatusCode.ERROR, f"dead-lettered: {error}"))
        log.error(
            "message dead-lettered",
            consumer=self.spec.durable,
            subject=msg.subject,
            error=str(error),
            error_type=type(error).__name__,
            stream_seq=meta.sequence.stream,
        )
        try:
            await self._publisher.publish_bytes(
                dead_letter(msg.subject),
                msg.data,
                # One per consumer: two consumers refusing one message leave two dead letters.
                msg_id=f"dlq-{meta.stream}-{meta.sequence.stream}-{self.spec.durable}",
                headers=headers,
                parent=trace.set_span_in_context(span),
            )
        except BusError as exc:
            # Could not park it: leave it to be redelivered rather than lose it.
            log.error("dead-letter publish failed", error=str(exc), subject=msg.subject)
            with contextlib.suppress(Exception):  # NATS away: the ack wait redelivers it
                await msg.nak(delay=self.spec.max_nak_delay_s)
            span.end()
            return
        self._settled_for_good(meta.sequence.stream)
        try:
            await msg.term()
            self.counts["dead_lettered"] += 1
            CONSUMER_MESSAGES.labels(self.spec.durable, "dead_lettered").inc()
            DEAD_LETTERS.labels(self.spec.durable, meta.stream).inc()
        finally:
            span.end()


async def stop_runners(runners: Iterable[ConsumerRunner[Any]]) -> None:
    """Stop ``runners`` together (each finishes its batch in hand). A cancellation of the caller
    does not cut the stops short: they go on, shielded, and the cancellation propagates. The first
    error a stop raised (a loop that died while stopping) is raised once all have stopped."""
    stops = asyncio.gather(*(runner.stop() for runner in runners), return_exceptions=True)
    outcomes = await asyncio.shield(stops)
    for outcome in outcomes:
        if isinstance(outcome, Exception):
            raise outcome
