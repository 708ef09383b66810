"""Idempotent handling: a message id is claimed in the same transaction as the state change.

If the transaction commits, the claim commits with it and a redelivery finds it; if it rolls back,
the claim goes too and the redelivery is handled afresh.
"""

from collections.abc import Sequence

import asyncpg


async def claim(conn: asyncpg.Connection, consumer: str, msg_id: str) -> bool:
    """True when ``msg_id`` was not yet processed by ``consumer`` (and is now claimed)."""
    row = await conn.fetchrow(
        "INSERT INTO inbox (consumer, msg_id) VALUES ($1, $2) ON CONFLICT DO NOTHING RETURNING 1",
        consumer,
        msg_id,
    )
    return row is not None


async def claim_many(conn: asyncpg.Connection, consumer: str, msg_ids: Sequence[str]) -> set[str]:
    """Claim a batch at once; returns the ids that were new (the others were done before)."""
    rows = await conn.fetch(
        """INSERT INTO inbox (consumer, msg_id)
           SELECT $1, unnest($2::text[])
           ON CONFLICT DO NOTHING RETURNING msg_id""",
        consumer,
        list(msg_ids),
    )
    return {r["msg_id"] for r in rows}


async def claim_scoped(
    conn: asyncpg.Connection, consumer: str, scoped: Sequence[str], legacy: Sequence[str]
) -> set[str]:
    """:func:`claim_many` of ``scoped`` ids (a tenant's message ids within its tenant), less those
    whose ``legacy`` id (the bare message id, pair by pair) was claimed before ids were scoped: a
    message in flight across that upgrade is not handled twice. One statement, as the claim alone
    (a second look-up was a round trip more on every submission batch)."""
    rows = await conn.fetch(
        """INSERT INTO inbox (consumer, msg_id)
           SELECT $1, t.scoped FROM unnest($2::text[], $3::text[]) AS t(scoped, legacy)
           WHERE t.legacy = t.scoped
              OR NOT EXISTS (SELECT 1 FROM inbox i WHERE i.consumer = $1 AND i.msg_id = t.legacy)
           ON CONFLICT DO NOTHING RETURNING msg_id""",
        consumer,
        list(scoped),
        list(legacy),
    )
    return {r["msg_id"] for r in rows}
