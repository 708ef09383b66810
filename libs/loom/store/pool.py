"""The asyncpg pool, and mapping of database errors to Loom's retryable / non-retryable errors."""

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TypeVar

import asyncpg

from loom.errors import LoomError

T = TypeVar("T")


class StoreError(LoomError):
    """The store could not do what was asked; ``non_retryable`` says whether trying again can help."""


class ConflictError(StoreError):
    """A write lost a race (serialization failure, fenced, capacity taken); retrying may succeed."""


async def create_pool(url: str, *, min_size: int = 1, max_size: int = 10) -> asyncpg.Pool:
    """Open a pool; JSON columns are decoded by the callers, so no codecs are registered."""
    try:
        pool = await asyncpg.create_pool(url, min_size=min_size, max_size=max_size, command_timeout=30)
    except (OSError, asyncpg.PostgresError) as exc:
        raise StoreError(f"cannot connect to PostgreSQL at {redact(url)}: {exc}") from exc
    assert pool is not None
    return pool


def redact(url: str) -> str:
    """The URL without its password, for messages and logs."""
    if "@" not in url or "://" not in url:
        return url
    scheme, rest = url.split("://", 1)
    creds, host = rest.rsplit("@", 1)
    user = creds.split(":", 1)[0]
    return f"{scheme}://{user}@{host}"


def map_error(exc: BaseException) -> StoreError:
    """Translate an asyncpg error into a StoreError whose ``non_retryable`` a consumer can trust."""
    if isinstance(exc, asyncpg.SerializationError | asyncpg.DeadlockDetectedError):
        return ConflictError(str(exc))
    if isinstance(exc, asyncpg.IntegrityConstraintViolationError | asyncpg.DataError):
        return StoreError(str(exc), non_retryable=True)
    if isinstance(exc, asyncpg.PostgresConnectionError | OSError | asyncpg.InterfaceError):
        return StoreError(f"database unavailable: {exc}")
    return StoreError(str(exc))


@asynccontextmanager
async def transaction(pool: asyncpg.Pool) -> AsyncIterator[asyncpg.Connection]:
    """A connection inside a transaction; database errors leave as :class:`StoreError`."""
    try:
        async with pool.acquire() as conn, conn.transaction():
            yield conn
    except StoreError:
        raise
    except (asyncpg.PostgresError, OSError, asyncpg.InterfaceError) as exc:
        raise map_error(exc) from exc


async def with_retry(fn: Callable[[], Awaitable[T]], *, attempts: int = 5) -> T:
    """Run ``fn`` again when it lost a race (ConflictError), up to ``attempts`` times."""
    for attempt in range(1, attempts + 1):
        try:
            return await fn()
        except ConflictError:
            if attempt == attempts:
                raise
    raise AssertionError("unreachable")
