"""The alert correlator's incidents: the latest state of each, for `loom incidents` and restarts."""

from collections.abc import Mapping, Sequence

import asyncpg
import msgspec
import structlog

from loom.alerts.correlate import Held
from loom.store.jobs import ts
from loom_proto.alerts import IncidentChange

log = structlog.get_logger("loom.store")


async def save_incidents(
    conn: asyncpg.Connection,
    incidents: Sequence[IncidentChange],
    held: Mapping[str, Held] | None = None,
) -> None:
    """Insert or replace each incident with what it holds (:class:`~loom.alerts.correlate.Held`,
    by incident id; NULL where absent); a write older than the stored one (``updated_at``) is
    ignored."""
    kept = held or {}
    await conn.executemany(
        """INSERT INTO incidents (incident_id, state, root_kind, root, severity, summary, jobs_total,
                                  alerts, opened_at, updated_at, resolved_at, record, held)
           VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12::jsonb, $13::jsonb)
           ON CONFLICT (incident_id) DO UPDATE
           SET state = EXCLUDED.state, root_kind = EXCLUDED.root_kind, root = EXCLUDED.root,
               severity = EXCLUDED.severity, summary = EXCLUDED.summary,
               jobs_total = EXCLUDED.jobs_total, alerts = EXCLUDED.alerts,
               updated_at = EXCLUDED.updated_at, resolved_at = EXCLUDED.resolved_at,
               record = EXCLUDED.record, held = EXCLUDED.held
           WHERE incidents.updated_at <= EXCLUDED.updated_at""",
        [
            (
                i.incident_id,
                i.state,
                i.root_kind,
                i.root,
                i.severity,
                i.summary,
                i.jobs_total,
                i.alerts,
                ts(i.opened_at),
                ts(i.updated_at),
                ts(i.resolved_at) if i.resolved_at is not None else None,
                msgspec.json.encode(i).decode(),
                msgspec.json.encode(h).decode() if (h := kept.get(i.incident_id)) is not None else None,
            )
            for i in incidents
        ],
    )


def _decode(raw: str) -> IncidentChange | None:
    try:
        return msgspec.json.decode(raw, type=IncidentChange)
    except msgspec.ValidationError as exc:  # written by another version: shown nowhere, kept in the table
        log.warning("incident record skipped", error=str(exc))
        return None


async def list_incidents(
    conn: asyncpg.Connection | asyncpg.Pool, *, open_only: bool = False, limit: int = 100
) -> list[IncidentChange]:
    """Newest first; ``open_only``: open and acknowledged ones."""
    rows = await conn.fetch(
        """SELECT record FROM incidents WHERE NOT $1 OR state <> 'resolved'
           ORDER BY opened_at DESC, incident_id LIMIT $2""",
        open_only,
        limit,
    )
    return [i for i in (_decode(r["record"]) for r in rows) if i is not None]


async def get_incident(conn: asyncpg.Connection | asyncpg.Pool, incident_id: str) -> IncidentChange | None:
    """One incident's latest state."""
    row = await conn.fetchrow("SELECT record FROM incidents WHERE incident_id = $1", incident_id)
    return _decode(row["record"]) if row is not None else None


async def restorable(
    conn: asyncpg.Connection | asyncpg.Pool, *, resolved_since_s: float
) -> list[tuple[IncidentChange, Held | None]]:
    """Open incidents, with what each holds, and those resolved within ``resolved_since_s`` (so a
    relapse re-opens them)."""
    rows = await conn.fetch(
        """SELECT record, held FROM incidents
           WHERE state <> 'resolved' OR resolved_at > now() - make_interval(secs => $1)
           ORDER BY opened_at""",
        resolved_since_s,
    )
    out = []
    for r in rows:
        change = _decode(r["record"])
        if change is None:
            continue
        held = None
        if r["held"] is not None:
            try:
                held = msgspec.json.decode(r["held"], type=Held)
            except msgspec.ValidationError as exc:  # written by another version: nothing held
                log.warning("incident's held alerts skipped", error=str(exc))
        out.append((change, held))
    return out


async def placed_parts(conn: asyncpg.Connection | asyncpg.Pool) -> list[asyncpg.Record]:
    """Placed and running jobs, one row per (job, cluster) with its nodes: the correlator's snapshot."""
    rows: list[asyncpg.Record] = await conn.fetch(
        """SELECT j.job_id, j.tenant, j.parent, r.cluster, array_agg(r.node ORDER BY r.node) AS nodes
           FROM jobs j JOIN reservations r ON r.job_id = j.job_id AND r.attempt = j.attempt
           WHERE j.state IN ('placed', 'running') AND r.state <> 'released'
           GROUP BY j.job_id, j.tenant, j.parent, r.cluster"""
    )
    return rows
