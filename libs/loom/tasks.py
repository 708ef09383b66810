"""Ending asyncio tasks for certain: one way, used by every stop and close.

A cancellation can be lost. Python 3.11's ``asyncio.wait_for`` returns the inner result when a
cancel lands just as the inner call completes (the NATS client's requests go through it), and a
supervised loop may catch a cancel and turn it into an error it restarts on. ``task.cancel()``
followed by ``await task`` then waits for that task's next round of work, or for ever. And the
common ``with suppress(CancelledError): await task`` also swallows the *caller's* cancellation.

:func:`cancel_and_wait` cancels, waits a grace period, and cancels again whatever is still running,
until every task has ended; the tasks' own ends (results, errors, cancellations) are retrieved and
dropped, and a cancellation of the caller propagates.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import structlog

log = structlog.get_logger(__name__)

#: How long a cancelled task has before it is cancelled again.
GRACE_S = 0.5


async def cancel_and_wait(tasks: Iterable[asyncio.Future[Any]], grace_s: float = GRACE_S) -> None:
    """Cancel ``tasks`` and return once every one has ended.

    A task still running ``grace_s`` after its cancellation lost it and is cancelled again (logged);
    none is waited on for more than one grace period per lost cancellation. Each task's own end is
    retrieved and dropped: a task's error is not the stopper's. If the caller is cancelled while it
    waits, :class:`asyncio.CancelledError` propagates (the tasks have all been cancelled by then).
    """
    every = list(tasks)
    pending = {task for task in every if not task.done()}
    for task in pending:
        task.cancel()
    while pending:
        _, pending = await asyncio.wait(pending, timeout=grace_s)
        for task in pending:
            log.warning("task still running after its cancellation; cancelled again", task=_name(task))
            task.cancel()
    for task in every:
        if not task.cancelled():
            task.exception()  # retrieved, so that asyncio does not report it as never retrieved


def _name(task: asyncio.Future[Any]) -> str:
    return task.get_name() if isinstance(task, asyncio.Task) else repr(task)
