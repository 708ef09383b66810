"""Network perception's tables: each link's learned record (restored on start) and its events.

``net_link_records`` holds one :class:`~loom.net.LinkRecord` per directed link, so a restarted
service keeps its learned baselines; ``net_link_events`` is the append-only history of links that
became degraded or recovered.
"""

import math
from collections.abc import Sequence

import asyncpg
import msgspec
import structlog

from loom.net import LinkEvent, LinkRecord
from loom.store.jobs import ts

log = structlog.get_logger("loom.store")


async def load_link_records(conn: asyncpg.Connection | asyncpg.Pool) -> list[LinkRecord]:
    """Every stored link record, by (src, dst); one an older version wrote (not decodable) is skipped."""
    rows = await conn.fetch("SELECT record FROM net_link_records ORDER BY src, dst")
    records = []
    for row in rows:
        try:
            records.append(msgspec.json.decode(row["record"], type=LinkRecord))
        except msgspec.ValidationError as exc:  # written by an older version: relearn that link
            log.warning("link record skipped", error=str(exc))
    return records


async def save_link_records(conn: asyncpg.Connection, records: Sequence[LinkRecord]) -> None:
    """Insert or replace the record of each link."""
    await conn.executemany(
        """INSERT INTO net_link_records (src, dst, record, saved_at) VALUES ($1, $2, $3::jsonb, $4)
           ON CONFLICT (src, dst) DO UPDATE
           SET record = EXCLUDED.record, saved_at = EXCLUDED.saved_at""",
        [(r.src, r.dst, msgspec.json.encode(r).decode(), ts(r.saved_at)) for r in records],
    )


async def append_link_events(conn: asyncpg.Connection, events: Sequence[LinkEvent]) -> None:
    """Append degraded / recovered events to the history."""
    await conn.executemany(
        """INSERT INTO net_link_events
               (src, dst, kind, at, reason, rtt_ms, baseline_rtt_ms, loss_rate)
           VALUES ($1, $2, $3, $4, $5, $6, $7, $8)""",
        [
            # A lost link's RTT is infinite: stored as NULL (the column cannot hold infinity).
            (
                e.src,
                e.dst,
                e.kind,
                ts(e.at),
                e.reason,
                e.rtt_ms if math.isfinite(e.rtt_ms) else None,
                e.baseline_rtt_ms,
                e.loss_rate,
            )
            for e in events
        ],
    )
