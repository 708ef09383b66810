"""Read-only queries of the web console over placement's tables (the writes stay placement's).

Each takes an optional tenant: a tenant's console sees its own jobs and counts only.
"""

import time
from dataclasses import dataclass
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


@dataclass(frozen=True, slots=True)
class UsageTotal:
    """Usage summed over the rows that share a key (what :class:`loom.metering.usage.Group` sums,
    computed by PostgreSQL)."""

    key: str
    runs: int
    gpu_ms: int
    scu_seconds: float
    cost: float
    preempted_gpu_ms: int = 0
    failed_gpu_ms: int = 0


_USAGE_KEYS = {
    "tenant": "tenant",
    "region": "region",
    "model": "gpu_model",
    "cluster": "cluster",
    "label:team": "coalesce(labels->>'team', '(none)')",
    "label:project": "coalesce(labels->>'project', '(none)')",
}
USAGE_KEYS = tuple(_USAGE_KEYS)


async def usage_totals(
    conn: asyncpg.Connection | asyncpg.Pool,
    by: str,
    *,
    tenant: str | None,
    since_ms: int | None,
    until_ms: int | None,
) -> tuple[list[UsageTotal], UsageTotal]:
    """Usage rows of ``tenant`` (or all) clipped to ``[since_ms, until_ms)`` and summed by ``by``
    (one of :data:`USAGE_KEYS`), sorted by key: the sums of ``loom.metering.usage.aggregate``
    (exact GPU-ms), done in the database rather than over every row in Python. With them, the
    total (key ``total``): its runs are distinct runs, not the groups' sum (a run that spans two
    regions, or ran on two models, is in two groups but one run)."""
    key = _USAGE_KEYS[by]  # a fixed expression, never the caller's text
    rows = await conn.fetch(
        f"""WITH clipped AS (
                SELECT {key} AS key, job_id, attempt, outcome, gpus::bigint AS gpus, scu_per_gpu,
                       price_per_scu_hour,
                       greatest(start_ms, coalesce($2::bigint, start_ms)) AS s,
                       least(end_ms, coalesce($3::bigint, end_ms)) AS e
                FROM usage_rows
                WHERE ($1::text IS NULL OR tenant = $1)
                  AND ($2::bigint IS NULL OR end_ms > $2) AND ($3::bigint IS NULL OR start_ms < $3))
            SELECT key, GROUPING(key) = 1 AS whole, count(DISTINCT (job_id, attempt)) AS runs,
                   coalesce(sum(gpus * (e - s)), 0)::bigint AS gpu_ms,
                   coalesce(sum(gpus * (e - s) * scu_per_gpu / 1000.0), 0) AS scu_seconds,
                   coalesce(sum(gpus * (e - s) * scu_per_gpu * price_per_scu_hour / 3600000.0), 0) AS cost,
                   coalesce(sum(gpus * (e - s)) FILTER (WHERE outcome = 'preempted'), 0)::bigint AS preempted,
                   coalesce(sum(gpus * (e - s)) FILTER (WHERE outcome = 'failed'), 0)::bigint AS failed
            FROM clipped WHERE e > s GROUP BY GROUPING SETS ((key), ()) ORDER BY whole, key""",
        tenant,
        since_ms,
        until_ms,
    )
    totals = [
        UsageTotal(
            "total" if r["whole"] else str(r["key"]),
            int(r["runs"]),
            int(r["gpu_ms"]),
            float(r["scu_seconds"]),
            float(r["cost"]),
            int(r["preempted"]),
            int(r["failed"]),
        )
        for r in rows
    ]
    # The grand total's row comes last (and comes even when no row is in the window).
    return totals[:-1], totals[-1]


async def incident_briefs(
    conn: asyncpg.Connection | asyncpg.Pool, *, open_only: bool, limit: int
) -> list[IncidentChange]:
    """The operator's incident list: each incident without its job list and timeline (the list
    shows neither), so the page does not carry thousands of job ids through."""
    rows = await conn.fetch(
        """SELECT record - 'jobs' - 'timeline' - 'dags' AS record FROM incidents
           WHERE NOT $1 OR state <> 'resolved' ORDER BY opened_at DESC, incident_id LIMIT $2""",
        open_only,
        limit,
    )
    out = []
    for row in rows:
        try:
            out.append(msgspec.json.decode(row["record"], type=IncidentChange))
        except msgspec.ValidationError:
            continue
    return out
