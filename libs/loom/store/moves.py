"""Checkpoints, drained clusters and migrations in PostgreSQL (migrations 008 and 011).

Placement records checkpoints (in its lifecycle transaction) and reads drains; the migration
service writes drains and migrations and reads the rest.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeAlias

import asyncpg

from loom.migrate.checkpoints import Checkpoint

Conn: TypeAlias = asyncpg.Connection | asyncpg.Pool


# ---- checkpoints -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CheckpointRow:
    """A checkpoint report to record."""

    job_id: str
    attempt: int
    step: int
    cluster: str
    uri: str
    checkpoint_bytes: int
    checksum: str
    at: float


async def record_checkpoints(conn: asyncpg.Connection, rows: Sequence[CheckpointRow]) -> None:
    """Record checkpoint reports; one already recorded (same run and step) is kept as it was."""
    if not rows:
        return
    await conn.executemany(
        """INSERT INTO checkpoints (job_id, attempt, step, cluster, uri, bytes, checksum, at)
           VALUES ($1, $2, $3, $4, $5, $6, $7, to_timestamp($8))
           ON CONFLICT (job_id, attempt, step) DO NOTHING""",
        [(r.job_id, r.attempt, r.step, r.cluster, r.uri, r.checkpoint_bytes, r.checksum, r.at) for r in rows],
    )


async def checkpoints_of(conn: Conn, job_ids: Sequence[str]) -> dict[str, list[Checkpoint]]:
    """Every recorded checkpoint of these jobs (any attempt), by job."""
    if not job_ids:
        return {}
    rows = await conn.fetch(
        """SELECT job_id, attempt, step, cluster, uri, checksum, corrupt FROM checkpoints
           WHERE job_id = ANY($1::text[]) ORDER BY job_id, step DESC""",
        list(job_ids),
    )
    out: dict[str, list[Checkpoint]] = {}
    for r in rows:
        out.setdefault(r["job_id"], []).append(
            Checkpoint(
                job_id=r["job_id"],
                attempt=r["attempt"],
                step=r["step"],
                cluster=r["cluster"],
                uri=r["uri"],
                checksum=r["checksum"],
                corrupt=r["corrupt"],
            )
        )
    return out


async def checkpoint_since(conn: Conn, job_id: str, attempt: int, since: float) -> int | None:
    """The highest step of the run's checkpoints written at or after ``since`` (wall s), if any."""
    step: int | None = await conn.fetchval(
        """SELECT max(step) FROM checkpoints
           WHERE job_id = $1 AND attempt = $2 AND at >= to_timestamp($3) AND NOT corrupt""",
        job_id,
        attempt,
        since,
    )
    return step


async def job_states(
    conn: Conn, job_ids: Sequence[str], *, held_on: str | None = None
) -> dict[str, tuple[str, int]]:
    """Job -> (state, attempt) as the store has it; with ``held_on``, only the jobs some attempt
    of which held GPUs on that cluster (what its agent may ask about: its own runs)."""
    if not job_ids:
        return {}
    rows = await conn.fetch(
        """SELECT job_id, state, attempt FROM jobs j WHERE job_id = ANY($1::text[])
             AND ($2::text IS NULL OR EXISTS (
                 SELECT 1 FROM reservations r WHERE r.job_id = j.job_id AND r.cluster = $2))""",
        list(job_ids),
        held_on,
    )
    return {r["job_id"]: (r["state"], r["attempt"]) for r in rows}


# ---- drains ------------------------------------------------------------------------------------


async def drained_clusters(conn: Conn) -> set[str]:
    """Clusters closed to new placements."""
    rows = await conn.fetch("SELECT cluster FROM cluster_drains")
    return {r["cluster"] for r in rows}


async def drains(conn: Conn) -> list[dict[str, Any]]:
    """Every drain, oldest first."""
    rows = await conn.fetch("SELECT * FROM cluster_drains ORDER BY started_at, cluster")
    return [_plain(r) for r in rows]


async def start_drain(conn: Conn, cluster: str, *, concurrency: int, deadline_s: float, forced: bool) -> bool:
    """Close a cluster (a repeated drain updates its settings and drains again); True when new."""
    existed = await conn.fetchval("SELECT 1 FROM cluster_drains WHERE cluster = $1", cluster)
    await conn.execute(
        """INSERT INTO cluster_drains (cluster, concurrency, deadline_s, forced, state)
           VALUES ($1, $2, $3, $4, 'draining')
           ON CONFLICT (cluster) DO UPDATE SET concurrency = $2, deadline_s = $3, forced = $4,
                 state = 'draining', updated_at = now()""",
        cluster,
        concurrency,
        deadline_s,
        forced,
    )
    return existed is None


async def end_drain(conn: Conn, cluster: str) -> bool:
    """Open a drained cluster again; False when it was not drained."""
    status: str = await conn.execute("DELETE FROM cluster_drains WHERE cluster = $1", cluster)
    return status.endswith(" 1")


async def hold_drain(conn: Conn, cluster: str) -> bool:
    """Whether ``cluster`` is still drained, holding its drain row (``FOR SHARE``) until ``conn``'s
    transaction ends: an undrain's :func:`end_drain` waits for a move planned under it, and then
    fails it with the drain's other planned moves; a move planned after an undrain sees none."""
    return (
        await conn.fetchval("SELECT 1 FROM cluster_drains WHERE cluster = $1 FOR SHARE", cluster) is not None
    )


async def mark_drained(conn: Conn, cluster: str) -> None:
    """The drain emptied the cluster (it stays closed until undrained)."""
    await conn.execute(
        """UPDATE cluster_drains SET state = 'drained', updated_at = now()
           WHERE cluster = $1 AND state = 'draining'""",
        cluster,
    )


async def known_clusters(conn: Conn) -> dict[str, dict[str, int]]:
    """Every cluster the capacity book knows: cluster -> GPU model -> total GPUs (schedulable nodes)."""
    rows = await conn.fetch(
        """SELECT cluster, coalesce(gpu_model, '') AS model, sum(gpus_total)::int AS gpus
           FROM node_allocations WHERE schedulable GROUP BY cluster, gpu_model"""
    )
    out: dict[str, dict[str, int]] = {}
    for r in rows:
        out.setdefault(r["cluster"], {})[r["model"]] = r["gpus"]
    listed = await conn.fetch("SELECT DISTINCT cluster FROM node_allocations")
    for r in listed:
        out.setdefault(r["cluster"], {})
    return out


async def runs_on(conn: Conn, cluster: str) -> list[asyncpg.Record]:
    """Running jobs with a live reservation on ``cluster``: job row fields, the lead cluster and
    the GPUs the attempt holds in all (``gpus_held``)."""
    rows: list[asyncpg.Record] = await conn.fetch(
        """SELECT j.job_id, j.tenant, j.spec, j.attempt, j.progress, j.cluster AS lead, j.state,
                  j.trace_context,
                  (SELECT COALESCE(sum(h.gpus), 0) FROM reservations h WHERE h.job_id = j.job_id
                     AND h.attempt = j.attempt AND h.state <> 'released') AS gpus_held
           FROM jobs j
           WHERE j.state IN ('placed', 'running')
             AND EXISTS (SELECT 1 FROM reservations r WHERE r.job_id = j.job_id AND r.attempt = j.attempt
                         AND r.cluster = $1 AND r.state <> 'released')
           ORDER BY j.job_id""",
        cluster,
    )
    return rows


# ---- migrations --------------------------------------------------------------------------------


OPEN_STATES = ("planned", "started")


async def plan(
    conn: asyncpg.Connection,
    *,
    migration_id: str,
    job_id: str,
    tenant: str,
    cause: str,
    state: str,
    from_cluster: str,
    from_attempt: int,
    steps: int,
    why: str,
    trace_context: Mapping[str, str],
    resume_step: int = 0,
    lost_steps: int = 0,
) -> bool:
    """Record a migration; False when it was recorded already (nothing changes then)."""
    status: str = await conn.execute(
        """INSERT INTO migrations (migration_id, job_id, tenant, cause, state, from_cluster, from_attempt,
                                   steps, why, trace_context, resume_step, lost_steps, started_at)
           VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10::jsonb, $11, $12,
                   CASE WHEN $5 = 'started' THEN now() END)
           ON CONFLICT (migration_id) DO NOTHING""",
        migration_id,
        job_id,
        tenant,
        cause,
        state,
        from_cluster,
        from_attempt,
        steps,
        why[:2048],
        json.dumps(dict(trace_context)),
        resume_step,
        lost_steps,
    )
    return status.endswith(" 1")


async def moves_of_run(conn: Conn, job_id: str, attempt: int) -> dict[str, str]:
    """The migrations recorded from the job's run ``attempt``: migration id -> state."""
    rows = await conn.fetch(
        "SELECT migration_id, state FROM migrations WHERE job_id = $1 AND from_attempt = $2",
        job_id,
        attempt,
    )
    return {r["migration_id"]: r["state"] for r in rows}


async def mark_started(
    conn: asyncpg.Connection, migration_id: str, *, resume_step: int, lost_steps: int, why: str
) -> asyncpg.Record | None:
    """planned -> started; None when it was not planned any more."""
    row: asyncpg.Record | None = await conn.fetchrow(
        """UPDATE migrations SET state = 'started', started_at = now(), resume_step = $2, lost_steps = $3,
                  why = $4
           WHERE migration_id = $1 AND state = 'planned' RETURNING *""",
        migration_id,
        resume_step,
        lost_steps,
        why[:2048],
    )
    return row


async def complete_many(
    conn: asyncpg.Connection, starts: Sequence[tuple[str, int, str]]
) -> list[asyncpg.Record]:
    """:func:`complete` of several ``(job, attempt, cluster)`` starts, of distinct jobs, in one
    statement; the rows in the order of ``starts``. A drain move whose job starts on the drained
    cluster again (it was undrained meanwhile) is failed instead, with why."""
    if len({job_id for job_id, _, _ in starts}) != len(starts):
        raise ValueError("complete_many takes one start per job")
    if not starts:
        return []
    rows: list[asyncpg.Record] = await conn.fetch(
        """WITH s AS (
               SELECT * FROM unnest($1::text[], $2::int[], $3::text[]) WITH ORDINALITY
                 AS s(job_id, attempt, cluster, pos)
           ), ending AS (
               -- Each open move the start ends; ``back``: a drain move whose job's new attempt has
               -- a part on the drained cluster again (undrained meanwhile), whichever of its
               -- clusters' start reports came first.
               SELECT m.migration_id, s.job_id, s.attempt, s.pos,
                      m.cause = 'drain' AND (m.from_cluster = s.cluster OR EXISTS (
                          SELECT 1 FROM reservations r WHERE r.job_id = s.job_id AND r.attempt = s.attempt
                            AND r.cluster = m.from_cluster)) AS back
               FROM migrations m JOIN s ON m.job_id = s.job_id
               WHERE m.from_attempt < s.attempt AND m.state IN ('planned', 'started')
                 -- Only a start where that attempt was placed (its reservations stay, released
                 -- or not): an agent's forged start of another cluster's job ended its move.
                 AND EXISTS (SELECT 1 FROM reservations r WHERE r.job_id = s.job_id
                             AND r.attempt = s.attempt AND r.cluster = s.cluster)
           ), done AS (
               -- A drain move that did not happen: failed, not "completed c-x -> c-x".
               UPDATE migrations m
               SET state = CASE WHEN e.back THEN 'failed' ELSE 'completed' END,
                   why = CASE WHEN e.back
                              THEN left('the drain of ' || m.from_cluster || ' ended before the job moved:'
                                        || ' it runs there again; ' || m.why, 2048)
                              ELSE m.why END,
                   -- Every cluster the new attempt holds GPUs on (a pipeline's or a spanning
                   -- gang's too, not only the one whose start report came first), sorted.
                   to_cluster = CASE WHEN e.back THEN m.to_cluster ELSE (
                       SELECT string_agg(DISTINCT r.cluster, ',' ORDER BY r.cluster) FROM reservations r
                       WHERE r.job_id = e.job_id AND r.attempt = e.attempt) END,
                   finished_at = now()
               FROM ending e
               WHERE m.migration_id = e.migration_id
               RETURNING m.*, e.pos
           )
           SELECT * FROM done ORDER BY pos, migration_id""",
        [j for j, _, _ in starts],
        [a for _, a, _ in starts],
        [c for _, _, c in starts],
    )
    return rows


async def fail(conn: asyncpg.Connection, migration_id: str, why: str) -> asyncpg.Record | None:
    """An open migration did not happen, and why."""
    row: asyncpg.Record | None = await conn.fetchrow(
        """UPDATE migrations SET state = 'failed', why = $2, finished_at = now()
           WHERE migration_id = $1 AND state IN ('planned', 'started') RETURNING *""",
        migration_id,
        why[:2048],
    )
    return row


async def end_moot(conn: asyncpg.Connection) -> list[asyncpg.Record]:
    """Open migrations of jobs that have ended meanwhile (a failed-over run's late completion
    finished the job before its next attempt started, say): failed, with why. Before, such a
    failover stayed "started" for good."""
    rows: list[asyncpg.Record] = await conn.fetch(
        """UPDATE migrations m SET state = 'failed', finished_at = now(),
                  why = left('the job ' || j.state || ' (attempt ' || j.attempt || ') before the move: '
                             || m.why, 2048)
           FROM jobs j
           WHERE m.state IN ('planned', 'started')
             AND j.job_id = m.job_id AND j.state IN ('completed', 'failed', 'cancelled', 'rejected')
           RETURNING m.*"""
    )
    return rows


async def open_migrations(conn: Conn, cluster: str | None = None) -> list[asyncpg.Record]:
    """Migrations planned or started (of one source cluster)."""
    rows: list[asyncpg.Record] = await conn.fetch(
        """SELECT * FROM migrations WHERE state IN ('planned', 'started')
             AND ($1::text IS NULL OR from_cluster = $1) ORDER BY planned_at""",
        cluster,
    )
    return rows


async def list_migrations(
    conn: Conn, *, job_id: str | None = None, cluster: str | None = None, limit: int = 200
) -> list[dict[str, Any]]:
    """Migrations, newest first (of one job, or from one cluster)."""
    rows = await conn.fetch(
        """SELECT * FROM migrations WHERE ($1::text IS NULL OR job_id = $1)
             AND ($2::text IS NULL OR from_cluster = $2)
           ORDER BY planned_at DESC, migration_id LIMIT $3""",
        job_id,
        cluster,
        limit,
    )
    return [_plain(r) for r in rows]


def _plain(row: asyncpg.Record) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in row.items():
        if isinstance(value, datetime):
            out[key] = value.replace(tzinfo=value.tzinfo or UTC).timestamp()
        elif key == "trace_context":
            continue
        else:
            out[key] = value
    return out


# ---- network-driven moves (migration 012) ------------------------------------------------------


async def running_spans(conn: Conn, job_ids: Sequence[str] | None = None) -> list[asyncpg.Record]:
    """Every running job (of ``job_ids``, None: all) with the clusters and regions its live
    reservations hold (lead first in ``lead``), for the network review: which jobs a link's change
    concerns."""
    rows: list[asyncpg.Record] = await conn.fetch(
        """SELECT j.job_id, j.tenant, j.spec, j.attempt, j.progress, j.cluster AS lead, j.trace_context,
                  array_agg(DISTINCT r.cluster) AS clusters, array_agg(DISTINCT n.region) AS regions
           FROM jobs j
           JOIN reservations r ON r.job_id = j.job_id AND r.attempt = j.attempt AND r.state <> 'released'
           JOIN node_allocations n ON n.node = r.node
           WHERE j.state = 'running' AND ($1::text[] IS NULL OR j.job_id = ANY($1::text[]))
           GROUP BY j.job_id ORDER BY j.job_id""",
        None if job_ids is None else list(job_ids),
    )
    return rows


async def links_left(conn: Conn, job_ids: Sequence[str]) -> dict[str, str]:
    """Job -> the link (``src->dst``) of its latest move off a degraded link (its newest ``move``
    verdict on ``link_degraded``): which jobs a link's recovery concerns."""
    if not job_ids:
        return {}
    rows = await conn.fetch(
        """SELECT DISTINCT ON (job_id) job_id, link FROM migration_verdicts
           WHERE job_id = ANY($1::text[]) AND decision = 'move' AND trigger = 'link_degraded'
           ORDER BY job_id, id DESC""",
        list(job_ids),
    )
    return {r["job_id"]: r["link"] for r in rows}


async def move_verdict(conn: Conn, job_id: str, attempt: int) -> asyncpg.Record | None:
    """The latest ``move`` verdict of a job's run (its trigger, target and link): what a planned
    voluntary move was decided on."""
    row: asyncpg.Record | None = await conn.fetchrow(
        """SELECT trigger, target, link FROM migration_verdicts
           WHERE job_id = $1 AND attempt = $2 AND decision = 'move' ORDER BY id DESC LIMIT 1""",
        job_id,
        attempt,
    )
    return row


async def spanned_regions(conn: Conn) -> list[list[str]]:
    """The regions of each running job whose live reservations span more than one (the links in
    use, :mod:`loom.net.intensity`): one short array a cross-region job, nothing for the others."""
    rows = await conn.fetch(
        """SELECT array_agg(DISTINCT n.region) AS regions
           FROM jobs j
           JOIN reservations r ON r.job_id = j.job_id AND r.attempt = j.attempt AND r.state <> 'released'
           JOIN node_allocations n ON n.node = r.node
           WHERE j.state = 'running'
           GROUP BY j.job_id HAVING count(DISTINCT n.region) > 1 ORDER BY j.job_id"""
    )
    return [list(r["regions"]) for r in rows]


async def move_history(conn: Conn, job_ids: Sequence[str]) -> dict[str, tuple[int, float | None, str]]:
    """job -> (moves started or completed, when the last one started (unix s), its cause)."""
    if not job_ids:
        return {}
    rows = await conn.fetch(
        """SELECT job_id, count(*) AS n,
                  max(extract(epoch FROM coalesce(started_at, planned_at))) AS last,
                  (array_agg(cause ORDER BY planned_at DESC))[1] AS cause
           FROM migrations WHERE job_id = ANY($1::text[]) AND state IN ('started', 'completed')
           GROUP BY job_id""",
        list(job_ids),
    )
    return {
        r["job_id"]: (int(r["n"]), float(r["last"]) if r["last"] is not None else None, r["cause"])
        for r in rows
    }


@dataclass(frozen=True, slots=True)
class VerdictRow:
    """One job's migration verdict, moved or not, with its numbers."""

    job_id: str
    attempt: int
    trigger: str
    decision: str
    source: str
    target: str | None
    reason: str
    gain_s: float | None
    cost_s: float | None
    threshold_s: float | None
    margin_s: float | None
    link: str


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


async def record_verdicts(conn: Conn, rows: Sequence[VerdictRow]) -> None:
    """Keep the verdicts (``loom migrations --verdicts``, ``loom explain``)."""
    if not rows:
        return
    await conn.executemany(
        """INSERT INTO migration_verdicts (job_id, attempt, trigger, decision, source, target, reason,
                                           gain_s, cost_s, threshold_s, margin_s, link)
           VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)""",
        [
            (
                r.job_id,
                r.attempt,
                r.trigger,
                r.decision,
                r.source,
                r.target,
                r.reason[:2048],
                _finite(r.gain_s),
                _finite(r.cost_s),
                _finite(r.threshold_s),
                _finite(r.margin_s),
                r.link,
            )
            for r in rows
        ],
    )


async def list_verdicts(conn: Conn, *, job_id: str | None = None, limit: int = 200) -> list[dict[str, Any]]:
    """Migration verdicts, newest first (of one job)."""
    rows = await conn.fetch(
        """SELECT * FROM migration_verdicts WHERE ($1::text IS NULL OR job_id = $1)
           ORDER BY at DESC, id DESC LIMIT $2""",
        job_id,
        limit,
    )
    return [_plain(r) for r in rows]
