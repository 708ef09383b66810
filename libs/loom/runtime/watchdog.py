"""Long-lived tasks under supervision: none of them dies silently.

A service's loops (consumer loops, heartbeats, outbox flushers, probe loops, an agent's job runs)
run as asyncio tasks. A task nobody awaits that raises is gone without a word, and the service
keeps answering health checks as if nothing happened. :class:`Watchdog` runs each such task in a
supervisor that:

* logs a death (the task raised, or returned although it must run until cancelled) with its
  error and traceback;
* starts it again after an exponential backoff (reset once a run has lasted ``healthy_after_s``),
  for as long as the service lives: a loop that keeps dying is visible, never abandoned;
* reports it in :meth:`Watchdog.health` (``tasks``: state, restarts, last error; ``problems``:
  why the service is degraded) until it has run ``healthy_after_s`` again.

Cancelling a supervised task (the service stopping, a leader stepping down) ends it quietly and
forgets it. Other conditions a service wants in its health answer (a dependency unreachable, work
waiting for it) are registered with :meth:`Watchdog.condition`: a probe that returns a problem,
or None when all is well, evaluated at each health request.

A :class:`~loom.bus.consumer.ConsumerRunner` keeps its loop in a task of its own;
:meth:`Watchdog.watch_consumer` supervises it from outside, through ``wait`` (which raises what
killed the loop) and ``restart``.
"""

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import structlog

from loom.tasks import cancel_and_wait

log = structlog.get_logger("loom.watchdog")

TaskState = Literal["running", "recovering", "restarting"]
"""``running``: up (and healthy); ``recovering``: restarted less than ``healthy_after_s`` ago;
``restarting``: dead, waiting out its backoff."""

ProblemProbe = Callable[[], str | None]
"""Returns why the service is degraded, or None when this condition is fine."""

# Errors that end the process or the task on purpose: never caught as a task's death.
_NOT_A_DEATH = (asyncio.CancelledError, KeyboardInterrupt, SystemExit, GeneratorExit)


class RestartableLoop(Protocol):
    """What :meth:`Watchdog.watch_consumer` needs of a consumer runner."""

    async def wait(self) -> None:
        """Return when the loop was stopped; raise what killed it."""

    async def restart(self) -> None:
        """Start the loop again after it died."""


@dataclass
class _Record:
    """What the watchdog knows of one supervised task."""

    name: str
    listed: bool
    state: TaskState = "running"
    restarts: int = 0
    last_error: str | None = None
    up_since: float = field(default_factory=time.monotonic)


def _retrieve(task: "asyncio.Future[None]") -> None:
    """Mark a future's outcome as seen (asyncio warns about an exception nobody retrieved)."""
    if not task.cancelled():
        task.exception()


class TaskDied(RuntimeError):
    """A task that must run until cancelled returned."""


class Watchdog:
    """Supervises a service's long-lived tasks and tells its health.

    ``first_backoff_s`` doubles at each death in a row up to ``max_backoff_s``; a run that lasted
    ``healthy_after_s`` resets it, and is what turns a restarted task healthy again.
    """

    def __init__(
        self,
        owner: str,
        *,
        first_backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        healthy_after_s: float = 10.0,
    ) -> None:
        self.owner = owner
        self.first_backoff_s = first_backoff_s
        self.max_backoff_s = max(max_backoff_s, first_backoff_s)
        self.healthy_after_s = healthy_after_s
        self._records: dict[str, _Record] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._conditions: dict[str, ProblemProbe] = {}

    # ---- supervising ----------------------------------------------------------------------------

    def supervise(
        self,
        name: str,
        work: Callable[[], Awaitable[None]],
        *,
        finishes: bool = False,
        listed: bool = True,
    ) -> asyncio.Task[None]:
        """Run ``work()`` in a supervised task named ``name`` (unique while it runs) and return it.

        ``work`` is called afresh for each run. Unless ``finishes``, it must run until cancelled:
        returning is a death too. With ``finishes`` (a job's run, a consumer loop that returns
        when stopped) a normal return ends the supervision. ``listed=False`` keeps the task out
        of :meth:`health`'s ``tasks`` while it is healthy (one per running job would drown the
        service's own loops); a dying one is listed all the same.
        """
        if name in self._tasks and not self._tasks[name].done():
            raise ValueError(f"a task named {name!r} is already supervised by {self.owner}")
        record = _Record(name=name, listed=listed)
        self._records[name] = record
        task = asyncio.create_task(self._supervise(record, work, finishes), name=f"watchdog:{name}")
        self._tasks[name] = task
        return task

    def watch_consumer(self, name: str, runner: RestartableLoop) -> asyncio.Task[None]:
        """Supervise a started consumer runner's loop: a loop that dies is restarted through
        ``runner.restart()``; one stopped with ``runner.stop()`` ends the supervision."""
        first = True

        async def loop() -> None:
            nonlocal first
            if not first:
                await runner.restart()
            first = False
            # Shielded: cancelling the supervision must not cancel the loop itself (the runner's
            # own stop() finishes the batch in hand). The waiter retrieves the loop's end even
            # when the supervision is gone by then.
            waiter = asyncio.ensure_future(runner.wait())
            waiter.add_done_callback(_retrieve)
            await asyncio.shield(waiter)

        return self.supervise(name, loop, finishes=True)

    async def _supervise(self, record: _Record, work: Callable[[], Awaitable[None]], finishes: bool) -> None:
        backoff_s = self.first_backoff_s
        loop = asyncio.get_running_loop()
        try:
            while True:
                began = loop.time()
                record.up_since = time.monotonic()
                try:
                    await work()
                except _NOT_A_DEATH:
                    raise
                except BaseException as exc:  # whatever kills a task is a death to report
                    error: BaseException = exc
                else:
                    if finishes:
                        return
                    error = TaskDied(f"task {record.name} returned but must run until cancelled")
                if loop.time() - began >= self.healthy_after_s:
                    backoff_s = self.first_backoff_s
                record.state, record.restarts = "restarting", record.restarts + 1
                record.last_error = f"{type(error).__name__}: {error}"[:512]
                log.error(
                    "task died; restarting",
                    service=self.owner,
                    task=record.name,
                    error=record.last_error,
                    restarts=record.restarts,
                    retry_in_s=round(backoff_s, 3),
                    exc_info=error,
                )
                await asyncio.sleep(backoff_s)  # the backoff before the next run
                backoff_s = min(backoff_s * 2, self.max_backoff_s)
                record.state = "recovering"
                log.info("task restarted", service=self.owner, task=record.name, restarts=record.restarts)
        finally:
            if self._records.get(record.name) is record:
                del self._records[record.name]
                self._tasks.pop(record.name, None)

    async def stop(self) -> None:
        """Cancel every supervised task and wait for them to end."""
        await cancel_and_wait(list(self._tasks.values()))

    # ---- health ---------------------------------------------------------------------------------

    def condition(self, name: str, probe: ProblemProbe) -> None:
        """Include ``probe()``'s problem (when not None) in every health answer; replaces an
        earlier probe of the same name."""
        self._conditions[name] = probe

    def drop_condition(self, name: str) -> None:
        """Stop asking ``name``'s probe."""
        self._conditions.pop(name, None)

    def task_states(self) -> dict[str, dict[str, Any]]:
        """Each listed (or unhealthy) task: its state, restarts and last error."""
        now = time.monotonic()
        out: dict[str, dict[str, Any]] = {}
        for name, r in sorted(self._records.items()):
            state = r.state
            if state == "recovering" and now - r.up_since >= self.healthy_after_s:
                state = r.state = "running"
            if r.listed or state != "running":
                out[name] = {"state": state, "restarts": r.restarts, "last_error": r.last_error}
        return out

    def problems(self) -> list[str]:
        """Why the service is degraded now (empty when it is not)."""
        found: list[str] = []
        for name, t in self.task_states().items():
            if t["state"] != "running":
                found.append(f"task {name} {t['state']} ({t['restarts']} restarts): {t['last_error']}")
        for name, probe in sorted(self._conditions.items()):
            try:
                problem = probe()
            except Exception as exc:  # a broken probe is itself a problem to show
                problem = f"health probe {name} failed: {exc!r}"
            if problem:
                found.append(problem)
        return found

    def health(self) -> dict[str, Any]:
        """The part of a health answer this watchdog knows: ``status`` (``ok`` or ``degraded``),
        ``problems`` and ``tasks``."""
        problems = self.problems()
        return {
            "status": "degraded" if problems else "ok",
            "problems": problems,
            "tasks": self.task_states(),
        }
