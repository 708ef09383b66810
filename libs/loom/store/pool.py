"""The asyncpg pool, and mapping of database errors to Loom's retryable / non-retryable errors."""

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TypeVar

import asyncpg

from loom.errors import LoomError, UnavailableError

T = TypeVar("T")


class StoreError(LoomError):
    """The store could not do what was asked; ``non_retryable`` says whether trying again can help."""


class ConflictError(StoreError):
    """A write lost a race (serialization failure, fenced, capacity taken); retrying may succeed."""


class DatabaseUnavailableError(StoreError, UnavailableError):
    """PostgreSQL could not be reached, or dropped the connection (shut down, restarting, out of
    connection slots): an outage, not a property of what was asked."""

    dependency = "postgres"


_UNAVAILABLE = (
    DatabaseUnavailableError,
    asyncpg.PostgresConnectionError,  # class 08, ConnectionDoesNotExistError among them
    asyncpg.InterfaceError,  # the connection or the pool is closed under us
    asyncpg.CannotConnectNowError,  # 57P03: starting up or shutting down
    asyncpg.AdminShutdownError,  # 57P01: terminated by a (fast) shutdown
    asyncpg.CrashShutdownError,  # 57P02
    asyncpg.TooManyConnectionsError,  # 53300
)


def is_unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` (an asyncpg error, or one mapped from it) says the database is out of reach
    rather than that the request was wrong. A bare socket error or timeout could come from any
    server: it is the database's only inside :func:`transaction` (see :func:`map_error`)."""
    return isinstance(exc, _UNAVAILABLE)


async def probe(pool: asyncpg.Pool, *, timeout_s: float = 2.0) -> None:
    """Return when the database answers ``SELECT 1`` through ``pool``; raise otherwise."""
    async with pool.acquire(timeout=timeout_s) as conn:
        await conn.fetchval("SELECT 1", timeout=timeout_s)


async def _keep_session(conn: asyncpg.Connection) -> None:
    """A released connection's reset: nothing beyond what asyncpg always does (roll back an open
    transaction, drop listeners). Loom sets no session state (no SET, LISTEN, cursors held across
    transactions; the migration lock is unlocked explicitly), so asyncpg's default reset query
    (``pg_advisory_unlock_all(); CLOSE ALL; UNLISTEN *; RESET ALL``) would only cost a round trip
    on every release."""


async def create_pool(url: str, *, min_size: int = 1, max_size: int = 10) -> asyncpg.Pool:
    """Open a pool; JSON columns are decoded by the callers, so no codecs are registered."""
    try:
        pool = await asyncpg.create_pool(
            url, min_size=min_size, max_size=max_size, command_timeout=30, reset=_keep_session
        )
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
    # Refused, reset or unreachable sockets, and timeouts of the pool's acquire or of a connect.
    if is_unavailable(exc) or isinstance(exc, OSError | TimeoutError):
        return DatabaseUnavailableError(f"database unavailable: {exc!r}")
    return StoreError(str(exc))


@asynccontextmanager
async def transaction(pool: asyncpg.Pool) -> AsyncIterator[asyncpg.Connection]:
    """A connection inside a transaction; database errors leave as :class:`StoreError`."""
    try:
        async with pool.acquire() as conn, conn.transaction():
            yield conn
    except StoreError:
        raise
    except (TimeoutError, asyncpg.PostgresError, OSError, asyncpg.InterfaceError) as exc:
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
