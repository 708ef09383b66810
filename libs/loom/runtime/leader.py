"""Run a body only while this instance leads its shard: lease, fence claim, body, and back.

:func:`lead` is the loop a sharded service (placement) wraps its work in. As standby it waits for
the lease; as leader it claims the fence with the lease's token and runs ``body(token)``; when
the lease is lost it cancels the body and becomes a standby again. Every write the body makes
must pass :func:`loom.store.fence.check` with that token, so a body that has not yet noticed the
loss cannot commit anything once the next leader has claimed.
"""

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import asyncpg
import structlog
from nats.js import JetStreamContext

from loom.bus.lease import LeaderLease
from loom.store import fence
from loom.store.pool import StoreError

T = TypeVar("T")

log = structlog.get_logger("loom.leader")


@dataclass
class Leadership:
    """This instance's standing for one shard, kept current by :func:`lead`.

    msgspec encodes dataclasses, so ``ctx.stats["leadership"] = leadership`` puts the live values
    into every health answer.
    """

    shard: str
    holder: str
    is_leader: bool = False
    token: int | None = None
    terms: int = 0
    """How many times this instance became leader."""


async def lead(
    js: JetStreamContext,
    pool: asyncpg.Pool,
    *,
    shard: str,
    holder: str,
    body: Callable[[int], Awaitable[None]],
    stopping: asyncio.Event,
    leadership: Leadership | None = None,
    ttl_s: float = 2.0,
    renew_s: float = 0.5,
    poll_s: float = 0.2,
    grace_s: float = 0.0,
) -> None:
    """Lead ``shard`` whenever possible until ``stopping`` is set; run ``body(token)`` meanwhile.

    ``body`` runs until cancelled (the lease was lost, or we are stopping). If it returns, this
    instance steps down and :func:`lead` returns; if it raises, it steps down and the error
    propagates. On every way out the lease is released, so a standby takes over at once.
    """
    status = leadership if leadership is not None else Leadership(shard=shard, holder=holder)

    async def still_newest() -> bool:
        """After the lease key was re-created (a leaderless bucket, ``grace_s``): whether our
        token is still the newest fence claimed, i.e. nobody led in between."""
        token = lease.token
        return token is not None and await fence.claim(pool, shard, token, holder)

    lease = LeaderLease(
        js, shard, holder, ttl_s=ttl_s, renew_s=renew_s, poll_s=poll_s, grace_s=grace_s, confirm=still_newest
    )
    try:
        while not stopping.is_set():
            log.info("standby", shard=shard, holder=holder)
            token = await _unless_stopping(lease.acquire(), stopping)
            if token is None or stopping.is_set():
                return
            try:
                claimed = await fence.claim(pool, shard, token, holder)
            except StoreError as exc:
                if exc.non_retryable:
                    raise
                # Leading without a fence cannot write anything; let another instance try.
                log.warning("fence claim failed; stepping down", shard=shard, token=token, error=str(exc))
                claimed = False
            if not claimed:
                # Normally a newer token means a later acquisition, so our lease is gone already.
                # (If not, the bucket was recreated and its revisions restarted below the fence;
                # backing off a TTL keeps that visible in the logs instead of a busy loop.)
                log.error("fence claim refused; stepping down", shard=shard, holder=holder, token=token)
                await lease.release()
                await _unless_stopping(asyncio.sleep(ttl_s), stopping)
                continue
            status.is_leader, status.token, status.terms = True, token, status.terms + 1
            log.info("leading", shard=shard, holder=holder, token=token)
            outcome = await _run_body(body(token), lease.lost, stopping)
            status.is_leader, status.token = False, None
            if outcome == "lost":
                log.warning("leadership lost; back to standby", shard=shard, holder=holder, token=token)
            elif outcome == "returned":
                return
    finally:
        status.is_leader, status.token = False, None
        await lease.release()


async def _run_body(body: Awaitable[None], lost: asyncio.Event, stopping: asyncio.Event) -> str:
    """Run the body until it returns ("returned"), the lease is lost ("lost") or we stop ("stopping").

    An error from the body propagates; the body is cancelled on every other way out.
    """
    body_task = asyncio.ensure_future(body)
    lost_wait = asyncio.ensure_future(lost.wait())
    stop_wait = asyncio.ensure_future(stopping.wait())
    try:
        await asyncio.wait({body_task, lost_wait, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
        if body_task.done():
            body_task.result()
            return "returned"
        return "stopping" if stopping.is_set() else "lost"
    finally:
        lost_wait.cancel()
        stop_wait.cancel()
        if not body_task.done():
            body_task.cancel()
            try:
                await body_task
            except asyncio.CancelledError:
                pass
            except Exception:
                # Leadership is over either way; the error must not keep a standby from taking over.
                log.exception("leader body failed while being cancelled")


async def _unless_stopping(work: Awaitable[T], stopping: asyncio.Event) -> T | None:
    """``await work``, or None as soon as ``stopping`` is set (``work`` is then cancelled)."""
    task = asyncio.ensure_future(work)
    stop_wait = asyncio.ensure_future(stopping.wait())
    try:
        await asyncio.wait({task, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop_wait.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        return None
    return task.result()
