"""Checkpoint replicas in PostgreSQL (migration 013): the migration service records and advances
each copy; placement reads the ready ones when a run is lost; ``loom job`` shows them.

A replica row goes ``copying`` -> ``ready`` (the copy arrived) or ``failed``; a ready one becomes
``superseded`` when the job's next replica is ready, or ``evicted`` to make room in its cluster's
byte budget. Only ``copying`` and ``ready`` rows take budget; only ``ready`` ones are resumed from.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeAlias

import asyncpg

from loom.migrate.replicas import CopyPlan, Held, Replica, Site
from loom_proto.jobs import TERMINAL_STATES

Conn: TypeAlias = asyncpg.Connection | asyncpg.Pool


@dataclass(frozen=True, slots=True)
class Latest:
    """A running job's latest recorded checkpoint (what the replica loop copies)."""

    job_id: str
    tenant: str
    attempt: int
    step: int
    cluster: str
    uri: str
    checkpoint_bytes: int
    checksum: str
    spec: dict[str, Any]
    at_s: float = 0.0
    """When it was reported (wall clock)."""
    previous_step: int | None = None
    """The step of the checkpoint before it in this attempt (None: it is the first)."""
    previous_at_s: float | None = None


async def latest_checkpoints(conn: Conn) -> list[Latest]:
    """Each running job's newest checkpoint of its live attempt (not marked corrupt, past step 0)."""
    rows = await conn.fetch(
        """SELECT DISTINCT ON (c.job_id) c.job_id, j.tenant, c.attempt, c.step, c.cluster, c.uri, c.bytes,
                  c.checksum, j.spec, extract(epoch FROM c.at) AS at_s,
                  lag(c.step) OVER w AS previous_step, extract(epoch FROM lag(c.at) OVER w) AS previous_at_s
           FROM checkpoints c JOIN jobs j ON j.job_id = c.job_id AND j.attempt = c.attempt
           WHERE j.state = 'running' AND NOT c.corrupt AND c.step > 0
           WINDOW w AS (PARTITION BY c.job_id, c.attempt ORDER BY c.step)
           ORDER BY c.job_id, c.step DESC"""
    )
    return [
        Latest(
            job_id=r["job_id"],
            tenant=r["tenant"],
            attempt=r["attempt"],
            step=r["step"],
            cluster=r["cluster"],
            uri=r["uri"],
            checkpoint_bytes=int(r["bytes"]),
            checksum=r["checksum"],
            spec=json.loads(r["spec"]),
            at_s=float(r["at_s"]),
            previous_step=r["previous_step"],
            previous_at_s=None if r["previous_at_s"] is None else float(r["previous_at_s"]),
        )
        for r in rows
    ]


async def live_sites(conn: Conn) -> list[Site]:
    """Clusters a replica may go to: every cluster the ledger heard from and does not hold stale."""
    rows = await conn.fetch("SELECT cluster, region FROM ledger_clusters WHERE NOT stale ORDER BY cluster")
    return [Site(r["cluster"], r["region"]) for r in rows]


async def cluster_regions(conn: Conn) -> dict[str, str]:
    """Every cluster the ledger knows, with its region (a checkpoint's source included)."""
    rows = await conn.fetch("SELECT cluster, region FROM ledger_clusters")
    return {r["cluster"]: r["region"] for r in rows}


async def held(conn: Conn) -> list[Held]:
    """Every replica that takes budget (copying or ready), with whether its job is finished."""
    rows = await conn.fetch(
        """SELECT r.job_id, r.attempt, r.step, r.cluster, r.stored_bytes, r.state,
                  extract(epoch FROM coalesce(r.ready_at, r.requested_at)) AS at, j.state AS job_state
           FROM checkpoint_replicas r LEFT JOIN jobs j ON j.job_id = r.job_id
           WHERE r.state IN ('copying', 'ready')"""
    )
    return [
        Held(
            job_id=r["job_id"],
            attempt=r["attempt"],
            step=r["step"],
            cluster=r["cluster"],
            stored_bytes=float(r["stored_bytes"]),
            at_s=float(r["at"]),
            finished=r["job_state"] is None or r["job_state"] in TERMINAL_STATES,
            ready=r["state"] == "ready",
        )
        for r in rows
    ]


async def copying(conn: Conn) -> list[asyncpg.Record]:
    """Copies recorded as in flight (a restarted service times them again)."""
    rows: list[asyncpg.Record] = await conn.fetch(
        "SELECT * FROM checkpoint_replicas WHERE state = 'copying' ORDER BY requested_at"
    )
    return rows


async def start_copy(conn: asyncpg.Connection, plan: CopyPlan, latest: Latest, uri: str) -> bool:
    """Record a copy in flight and the evictions it needs; False when it was recorded already."""
    status: str = await conn.execute(
        """INSERT INTO checkpoint_replicas (job_id, tenant, attempt, step, source_cluster, source_uri,
                                            cluster, uri, checksum, full_copy, base_step,
                                            transfer_bytes, stored_bytes, transfer_s, state, why)
           VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, 'copying', $15)
           ON CONFLICT (job_id, attempt, step, cluster) DO NOTHING""",
        plan.job_id,
        latest.tenant,
        plan.attempt,
        plan.step,
        plan.source,
        latest.uri,
        plan.target,
        uri,
        latest.checksum,
        plan.full,
        plan.base_step,
        round(plan.transfer_bytes),
        round(plan.stored_bytes),
        plan.transfer_s,
        plan.why[:2048],
    )
    if not status.endswith(" 1"):
        return False
    for h in plan.evict:
        await conn.execute(
            """UPDATE checkpoint_replicas SET state = 'evicted', why = why || $5
               WHERE job_id = $1 AND attempt = $2 AND step = $3 AND cluster = $4 AND state = 'ready'""",
            h.job_id,
            h.attempt,
            h.step,
            h.cluster,
            f"; evicted for {plan.job_id} step {plan.step}",
        )
    return True


async def finish_copy(
    conn: asyncpg.Connection, job_id: str, attempt: int, step: int, cluster: str, *, ok: bool, why: str = ""
) -> bool:
    """A copy arrived (ready: the job's older replicas are superseded) or failed (and why)."""
    if not ok:
        status: str = await conn.execute(
            """UPDATE checkpoint_replicas SET state = 'failed', why = why || $5
               WHERE job_id = $1 AND attempt = $2 AND step = $3 AND cluster = $4 AND state = 'copying'""",
            job_id,
            attempt,
            step,
            cluster,
            f"; failed: {why}",
        )
        return status.endswith(" 1")
    status = await conn.execute(
        """UPDATE checkpoint_replicas SET state = 'ready', ready_at = now()
           WHERE job_id = $1 AND attempt = $2 AND step = $3 AND cluster = $4 AND state = 'copying'""",
        job_id,
        attempt,
        step,
        cluster,
    )
    if not status.endswith(" 1"):
        return False
    await conn.execute(
        """UPDATE checkpoint_replicas SET state = 'superseded'
           WHERE job_id = $1 AND state = 'ready' AND (step, attempt) < ($2, $3)""",
        job_id,
        step,
        attempt,
    )
    return True


async def ready_replicas(conn: Conn, job_ids: Sequence[str]) -> dict[str, list[Replica]]:
    """The ready replicas of these jobs, by job (what a resume may read)."""
    if not job_ids:
        return {}
    rows = await conn.fetch(
        """SELECT job_id, attempt, step, cluster, source_cluster, source_uri, checksum, corrupt
           FROM checkpoint_replicas WHERE job_id = ANY($1::text[]) AND state = 'ready'
           ORDER BY job_id, step DESC""",
        list(job_ids),
    )
    out: dict[str, list[Replica]] = {}
    for r in rows:
        out.setdefault(r["job_id"], []).append(
            Replica(
                job_id=r["job_id"],
                attempt=r["attempt"],
                step=r["step"],
                cluster=r["cluster"],
                source_cluster=r["source_cluster"],
                source_uri=r["source_uri"],
                checksum=r["checksum"],
                corrupt=r["corrupt"],
            )
        )
    return out


async def list_replicas(
    conn: Conn, *, job_id: str | None = None, cluster: str | None = None, limit: int = 200
) -> list[dict[str, Any]]:
    """Replicas, newest first (of one job, or held in one cluster), every state."""
    rows = await conn.fetch(
        """SELECT * FROM checkpoint_replicas WHERE ($1::text IS NULL OR job_id = $1)
             AND ($2::text IS NULL OR cluster = $2)
           ORDER BY requested_at DESC, job_id, step DESC LIMIT $3""",
        job_id,
        cluster,
        limit,
    )
    out: list[dict[str, Any]] = []
    for row in rows:
        item: dict[str, Any] = {}
        for key, value in row.items():
            item[key] = (
                value.replace(tzinfo=value.tzinfo or UTC).timestamp()
                if isinstance(value, datetime)
                else value
            )
        out.append(item)
    return out
