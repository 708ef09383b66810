"""Fencing: a leader's writes commit only while its lease token is the newest one claimed.

A lease (:mod:`loom.bus.lease`) says who *should* lead; it cannot stop a leader that was paused,
partitioned or slow to notice its loss from writing afterwards. The fence makes that harmless:

1. A new leader first :func:`claim`\\ s its shard with its token. The claim is an upsert that
   raises the stored token only when the new one is larger, and it takes the row's exclusive
   lock (``UPDATE``) to do so.
2. Every write of a leader runs in a transaction that first calls :func:`check`, which reads the
   row ``FOR SHARE`` and refuses (:class:`FencedError`) unless the token is still the stored one.

Why that is enough: the share lock is held until the leader's transaction ends and conflicts with
the claim's update. So a claim waits for every leader transaction that already passed its check,
and those commit *before* the new leader starts, as if the old leader had finished in time. A
check that comes while a claim is in progress waits for it, and then sees the claim's new token
(READ COMMITTED re-reads the updated row; REPEATABLE READ and SERIALIZABLE raise a serialization
failure instead, whose retry sees the new token). Any check after the claim commits reads the new
token. Hence, once a new leader's claim has committed, no transaction of an older leader commits:
its writes are rolled back with its check. Tokens grow with every acquisition, so "larger" is
"newer".
"""

import asyncpg

from loom.store.pool import StoreError, transaction


class FencedError(StoreError):
    """A newer leader has claimed the shard; this leader's write was refused. Not retryable."""

    non_retryable = True


async def claim(pool: asyncpg.Pool, shard: str, token: int, holder: str) -> bool:
    """Record ``token`` as the shard's newest; False if a newer token has already been claimed.

    Claiming the same token again for the same holder succeeds (a retry after a lost reply).
    """
    async with transaction(pool) as conn:
        claimed = await conn.fetchval(
            """INSERT INTO fences (shard, token, holder, claimed_at) VALUES ($1, $2, $3, now())
               ON CONFLICT (shard) DO UPDATE
                   SET token = EXCLUDED.token, holder = EXCLUDED.holder, claimed_at = EXCLUDED.claimed_at
                   WHERE fences.token < EXCLUDED.token
                      OR (fences.token = EXCLUDED.token AND fences.holder = EXCLUDED.holder)
               RETURNING token""",
            shard,
            token,
            holder,
        )
    return claimed is not None


async def check(conn: asyncpg.Connection, shard: str, token: int) -> None:
    """Inside the caller's transaction: raise :class:`FencedError` unless ``token`` is current.

    Call it in the same transaction as the writes it guards (before them, to waste no work); the
    share lock it takes lasts until that transaction ends, which is what makes the fence hold.
    """
    if not conn.is_in_transaction():
        raise StoreError("fence.check must run inside the transaction it guards", non_retryable=True)
    current = await conn.fetchval("SELECT token FROM fences WHERE shard = $1 FOR SHARE", shard)
    if current is None:
        raise FencedError(f"shard {shard} has no claimed leader; token {token} is not current")
    if current != token:
        raise FencedError(f"shard {shard} is led by token {current}; token {token} is fenced off")


async def tokens(pool: asyncpg.Pool) -> dict[str, int]:
    """Every shard (territory) a leader ever claimed -> its newest token: the shards that exist,
    whether they lead now or not (their leases say that, :func:`loom.bus.lease.lease_holders`)."""
    rows = await pool.fetch("SELECT shard, token FROM fences")
    return {str(r["shard"]): int(r["token"]) for r in rows}
