"""Read-only queries of the web console over placement's tables (the writes stay placement's).

Each takes an optional tenant: a tenant's console sees its own jobs and counts only.
"""

import time
from typing import Any

import asyncpg
import msgspec

from loom_proto.alerts import IncidentChange


async def counts_of(conn: asyncpg.Connection | asyncpg.Pool, tenant: str | None) -> dict[str, int]:
    """How many jobs are in each state, of one tenant or of all."""
    rows = await conn.fetch(
        "SELECT state, count(*) AS n FROM jobs WHERE ($1::text IS NULL OR tenant = $1) GROUP BY state", tenant
    )
    return {r["state"]: int(r["n"]) for r in rows}


async def waiting(
    conn: asyncpg.Connection | asyncpg.Pool, tenant: str | None, *, limit: int = 500
) -> list[dict[str, Any]]:
    """Queued jobs in the order placement's queue sorts them (higher priority first, then oldest),
    with the GPUs each asks for."""
    rows = await conn.fetch(
        """SELECT job_id, tenant, priority, submitted_at, spec->'resources'->>'gpus' AS gpus FROM jobs
           WHERE state = 'queued' AND ($1::text IS NULL OR tenant = $1)
           ORDER BY priority DESC, submitted_at, job_id LIMIT $2""",
        tenant,
        limit,
    )
    now = time.time()
    return [
        {
            "job_id": r["job_id"],
            "tenant": r["tenant"],
            "priority": r["priority"],
            "gpus": int(r["gpus"]) if r["gpus"] is not None else 0,
            "submitted_at": r["submitted_at"].timestamp(),
            "waiting_s": max(now - r["submitted_at"].timestamp(), 0.0),
        }
        for r in rows
    ]


async def incidents_of(
    conn: asyncpg.Connection | asyncpg.Pool, tenant: str | None, *, open_only: bool = False, limit: int = 200
) -> list[IncidentChange]:
    """Incidents newest first: every one, or those whose affected tenants include ``tenant``."""
    rows = await conn.fetch(
        """SELECT record FROM incidents
           WHERE ($1::text IS NULL OR record->'tenants' ? $1) AND (NOT $2 OR state <> 'resolved')
           ORDER BY opened_at DESC, incident_id LIMIT $3""",
        tenant,
        open_only,
        limit,
    )
    out = []
    for row in rows:
        try:
            out.append(msgspec.json.decode(row["record"], type=IncidentChange))
        except msgspec.ValidationError:  # written by another version: `loom incidents` skips it too
            continue
    return out
