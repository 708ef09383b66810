"""Waiting for a condition in tests: poll until it holds, fail clearly when it never does."""

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest


async def until(
    check: Callable[[], Awaitable[Any]],
    timeout_s: float,
    what: str,
    *,
    interval_s: float = 0.05,
    retry_on: tuple[type[BaseException], ...] = (),
) -> Any:
    """Return ``check()``'s first truthy result; fail after ``timeout_s`` naming ``what``.

    ``retry_on`` lists errors that mean "not yet" (a service restarting does not answer).
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            result = await check()
        except retry_on:
            result = None
        if result:
            return result
        await asyncio.sleep(interval_s)  # polling interval, bounded by the deadline
    pytest.fail(f"timed out after {timeout_s}s waiting for {what}")
