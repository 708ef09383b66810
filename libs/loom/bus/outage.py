"""Telling a dependency outage from a bad message, and waiting the outage out.

A handler fails; was it the message, or a server underneath (PostgreSQL, NATS)? Each dependency a
process stands on is registered here with a *recogniser* (does this error point at me?) and a
*probe* (do I answer now?). A failure is an outage only when both agree: its error (or one in its
``__cause__`` / ``__context__`` chain) is recognised, or is a bare socket error or timeout, and the
probe of that dependency fails. Then the consumer does not count the delivery toward dead-lettering,
stops fetching, and waits here until the probe answers again, for as long as that takes; health
replies say ``degraded: <dependency> unavailable`` meanwhile. A recognised error whose dependency
answers the probe is an ordinary failure (retried with backoff, dead-lettered after
``max_deliver``), so a misclassified error can never hold a message forever.

One :class:`Dependencies` per connection: :func:`of_connection` returns the one a service context
registered for its NATS client (with PostgreSQL when it has a pool), or a NATS-only one.
"""

import asyncio
import time
import weakref
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass

import structlog
from nats.aio.client import Client
from nats.errors import (
    ConnectionClosedError,
    ConnectionReconnectingError,
    NoRespondersError,
    NoServersError,
    OutboundBufferLimitError,
    StaleConnectionError,
)
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.errors import NoStreamResponseError, ServiceUnavailableError

from loom.bus.connection import BusError
from loom.errors import LoomError, UnavailableError
from loom.tasks import cancel_and_wait

log = structlog.get_logger("loom.bus")

CLOSE_GRACE_S = 0.5
"""How long :meth:`Dependencies.close` waits for a cancelled probe loop before cancelling it again."""

Probe = Callable[[], Awaitable[None]]
"""Returns when the dependency answers; raises (or times out) when it does not."""

Recogniser = Callable[[BaseException], bool]
"""Whether an error points at the dependency."""

_BUS_ERRORS = (
    ConnectionClosedError,
    ConnectionReconnectingError,
    NoRespondersError,
    NoServersError,
    OutboundBufferLimitError,
    StaleConnectionError,
    NatsTimeoutError,
    NoStreamResponseError,
    ServiceUnavailableError,
)


@dataclass(frozen=True)
class Dependency:
    """A server a process stands on."""

    name: str
    probe: Probe
    recognises: Recogniser


def is_bus_outage(exc: BaseException) -> bool:
    """Whether ``exc`` says NATS is out of reach (a publish that gave up, a lost connection)."""
    if isinstance(exc, BusError):
        return not exc.non_retryable
    return isinstance(exc, _BUS_ERRORS)


def nats_dependency(nc: Client, *, timeout_s: float = 2.0) -> Dependency:
    """NATS, probed by a round trip to the server (a PING answered)."""

    async def probe() -> None:
        if not nc.is_connected:
            raise BusError("not connected to NATS")
        await nc.flush(timeout=timeout_s)  # type: ignore[arg-type]  # annotated int, used as a float

    return Dependency("nats", probe, is_bus_outage)


class Dependencies:
    """The dependencies of one process: which are down now, and waiting for one to return.

    Probing while a dependency is down backs off from ``first_backoff_s`` to ``max_backoff_s``;
    one probing task per dependency serves every consumer waiting on it.
    """

    def __init__(
        self,
        *dependencies: Dependency,
        probe_timeout_s: float = 2.0,
        first_backoff_s: float = 0.2,
        max_backoff_s: float = 2.0,
    ) -> None:
        self._deps: dict[str, Dependency] = {d.name: d for d in dependencies}
        self.probe_timeout_s = probe_timeout_s
        self.first_backoff_s = first_backoff_s
        self.max_backoff_s = max_backoff_s
        self.down_since: dict[str, float] = {}
        """Dependency -> when it was found down (wall clock), while it is."""
        self.outages: dict[str, int] = {}
        """Dependency -> outages seen since start (health shows them)."""
        self._up: dict[str, asyncio.Event] = {}
        self._probing: dict[str, asyncio.Task[None]] = {}
        self._checked_at = float("-inf")
        self._checker: asyncio.Task[list[str]] | None = None
        self._closed = False

    def add(self, dependency: Dependency) -> None:
        """Register (or replace) a dependency."""
        self._deps[dependency.name] = dependency

    @property
    def names(self) -> list[str]:
        """The registered dependencies."""
        return sorted(self._deps)

    @property
    def unavailable(self) -> list[str]:
        """The dependencies down now."""
        return sorted(self.down_since)

    def status(self) -> str:
        """``ok``, or ``degraded: postgres unavailable`` (each dependency that is down)."""
        if not self.down_since:
            return "ok"
        return "degraded: " + ", ".join(f"{name} unavailable" for name in self.unavailable)

    def suspects(self, error: BaseException) -> list[str]:
        """The dependencies ``error`` may point at: those recognising an error of its chain; else,
        for a bare socket error or timeout, every dependency; else none."""
        found: set[str] = set()
        vague = False
        for exc in _chain(error):
            if isinstance(exc, LoomError) and exc.non_retryable:
                continue
            if isinstance(exc, UnavailableError) and exc.dependency in self._deps:
                found.add(exc.dependency)
            for dep in self._deps.values():
                if dep.recognises(exc):
                    found.add(dep.name)
            vague = vague or isinstance(exc, OSError | TimeoutError)
        if not found and vague:
            found = set(self._deps)
        return sorted(found)

    async def confirm(self, names: list[str]) -> list[str]:
        """Probe ``names`` (those already known down are not probed again); the ones down."""
        down = [n for n in names if n in self.down_since]
        unknown = [n for n in names if n in self._deps and n not in self.down_since]
        answers = await asyncio.gather(*(self._probe(n) for n in unknown))
        for name, error in zip(unknown, answers, strict=True):
            if error is not None:
                self.mark_down(name, error)
                down.append(name)
        return sorted(down)

    async def check(self, *, timeout_s: float | None = None, min_interval_s: float = 1.0) -> list[str]:
        """Probe every dependency not known down (at most once per ``min_interval_s``, each within
        ``timeout_s``, by default the probe timeout consumers use) and mark the silent ones down;
        the dependencies down now.

        So that an idle process, whose consumers meet no error, still reports an outage (health
        requests start it: :meth:`check_soon`).
        """
        now = time.monotonic()
        if now - self._checked_at >= min_interval_s:
            self._checked_at = now
            names = [n for n in self._deps if n not in self.down_since]
            answers = await asyncio.gather(*(self._probe(n, timeout_s) for n in names))
            for name, error in zip(names, answers, strict=True):
                if error is not None:
                    self.mark_down(name, error)
        return self.unavailable

    def check_soon(self, *, min_interval_s: float = 1.0) -> None:
        """Start :meth:`check` in the background unless one runs (or ran within
        ``min_interval_s``): a health answer is not delayed by the probes; the next one shows them."""
        if self._checker is not None and not self._checker.done():
            return
        if time.monotonic() - self._checked_at < min_interval_s:
            return
        self._checker = asyncio.create_task(
            self.check(min_interval_s=min_interval_s), name="dependency-check"
        )

    def mark_down(self, name: str, error: BaseException | str) -> None:
        """Record ``name`` as down (once per outage) and start probing it until it answers."""
        if name in self.down_since or name not in self._deps:
            return
        self.down_since[name] = time.time()
        self.outages[name] = self.outages.get(name, 0) + 1
        self._up[name] = asyncio.Event()
        log.warning("dependency unavailable", dependency=name, error=str(error)[:300])
        self._probing[name] = asyncio.create_task(self._probe_until_up(name), name=f"probe-{name}")

    async def wait_until_up(self, names: list[str], stopping: asyncio.Event | None = None) -> bool:
        """Return True when every one of ``names`` answers again, False if ``stopping`` is set first."""
        for name in names:
            event = self._up.get(name)
            if name not in self.down_since or event is None:
                continue
            waiters = [asyncio.ensure_future(event.wait())]
            if stopping is not None:
                waiters.append(asyncio.ensure_future(stopping.wait()))
            try:
                await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waiters:
                    w.cancel()
            if not event.is_set():
                return False
        return True

    async def close(self) -> None:
        """Stop probing (the process is ending). A probe loop that lost its cancellation (Python
        3.11's ``wait_for`` returns the inner result when a cancel lands just as it completes) ends
        at its next round all the same (``_closed``), and is cancelled again meanwhile."""
        self._closed = True
        tasks = list(self._probing.values()) + ([self._checker] if self._checker is not None else [])
        await cancel_and_wait(tasks, CLOSE_GRACE_S)  # a probe's end is no error of the close
        self._probing.clear()

    async def _probe(self, name: str, timeout_s: float | None = None) -> BaseException | None:
        task = asyncio.current_task()
        cancels = task.cancelling() if task is not None else 0
        try:
            await asyncio.wait_for(self._deps[name].probe(), timeout=timeout_s or self.probe_timeout_s)
        except Exception as exc:  # any failure to answer is "down"
            outcome: BaseException | None = exc
        else:
            outcome = None
        # Python 3.11's wait_for hands back the probe's end when a cancel lands just as the probe
        # completes; the cancel is honoured here. Otherwise a probe loop cancelled once (an event
        # loop's close cancels every task once, then waits for all) went on probing a server that
        # was gone, for ever: a test worker's teardown hung until pytest-timeout failed it (CI).
        if task is not None and task.cancelling() > cancels:  # a cancel since it began (as asyncio.timeout)
            raise asyncio.CancelledError
        return outcome

    async def _probe_until_up(self, name: str) -> None:
        backoff_s = self.first_backoff_s
        while True:
            await asyncio.sleep(backoff_s)
            if self._closed:
                return
            if await self._probe(name) is None:
                break
            backoff_s = min(backoff_s * 2, self.max_backoff_s)
        since = self.down_since.pop(name, time.time())
        self._probing.pop(name, None)
        log.info("dependency available again", dependency=name, down_s=round(time.time() - since, 3))
        self._up[name].set()


def _chain(error: BaseException, limit: int = 16) -> Iterator[BaseException]:
    """``error``, its causes and contexts, and the members of exception groups (bounded)."""
    todo = [error]
    seen: set[int] = set()
    while todo and len(seen) < limit:
        exc = todo.pop()
        if id(exc) in seen:
            continue
        seen.add(id(exc))
        yield exc
        if isinstance(exc, BaseExceptionGroup):
            todo.extend(exc.exceptions)
        for nxt in (exc.__cause__, exc.__context__):
            if nxt is not None:
                todo.append(nxt)


_BY_CONNECTION: "weakref.WeakKeyDictionary[Client, Dependencies]" = weakref.WeakKeyDictionary()


def of_connection(nc: Client) -> Dependencies:
    """The dependencies registered for ``nc``'s process (NATS at least, registered on first use)."""
    deps = _BY_CONNECTION.get(nc)
    if deps is None:
        deps = Dependencies(nats_dependency(nc))
        _BY_CONNECTION[nc] = deps
    return deps
