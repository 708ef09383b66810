"""Clusters placement's leader classified failed, kept for the next leader (migration 015).

A new leader (a takeover, a restart) would otherwise know of a failure only once its own liveness
pings and the view say so again, seconds later, and meanwhile place the jobs the failover has just
queued back on the failed cluster, whose agent never starts them.
"""

from dataclasses import dataclass
from typing import TypeAlias

import asyncpg

__all__ = ["FailedCluster", "failed_clusters", "forget_failed", "record_failed"]

Conn: TypeAlias = asyncpg.Connection | asyncpg.Pool


@dataclass(frozen=True, slots=True)
class FailedCluster:
    """A cluster classified failed: why, and when (unix s)."""

    cluster: str
    reason: str
    failed_at: float


async def failed_clusters(conn: Conn) -> list[FailedCluster]:
    """Every cluster recorded failed, by name."""
    rows = await conn.fetch("SELECT cluster, reason, failed_at FROM failed_clusters ORDER BY cluster")
    return [FailedCluster(r["cluster"], r["reason"], float(r["failed_at"])) for r in rows]


async def record_failed(conn: Conn, clusters: list[FailedCluster]) -> None:
    """Record clusters classified failed (a repeat keeps the first classification)."""
    if not clusters:
        return
    await conn.executemany(
        """INSERT INTO failed_clusters (cluster, reason, failed_at) VALUES ($1, $2, $3)
           ON CONFLICT (cluster) DO NOTHING""",
        [(c.cluster, c.reason[:2048], c.failed_at) for c in clusters],
    )


async def forget_failed(conn: Conn, clusters: list[str]) -> None:
    """Clusters that returned: failed no more."""
    if clusters:
        await conn.execute("DELETE FROM failed_clusters WHERE cluster = ANY($1::text[])", clusters)
