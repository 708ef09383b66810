"""Placement's tables: jobs, their append-only events, the capacity book and reservations.

Functions take a connection so callers compose them inside one transaction.
"""

import contextlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

import asyncpg
import msgspec

from loom.model.capacity import NodeCapacity
from loom.store.moves import list_migrations, list_verdicts
from loom.store.pool import ConflictError
from loom.store.replicas import list_replicas
from loom.telemetry.jaeger import trace_id_of
from loom_proto.jobs import TERMINAL_STATES


def ts(unix_s: float) -> datetime:
    """A timezone-aware timestamp for a Unix time."""
    return datetime.fromtimestamp(unix_s, tz=UTC)


@dataclass(frozen=True)
class NewJob:
    """A job row to insert."""

    job_id: str
    tenant: str
    spec_json: bytes
    submitted_at: float
    trace_context: Mapping[str, str]
    state: str = "queued"
    parent: str | None = None
    priority: int = 100


@dataclass(frozen=True)
class JobEventRow:
    """One event to append to a job's history."""

    job_id: str
    kind: str
    msg_id: str
    event_json: bytes
    at: float


async def insert_jobs(
    conn: asyncpg.Connection, jobs: Sequence[NewJob], *, submitted_events: bool = False
) -> set[str]:
    """Insert queued jobs; returns the ids inserted (an id that exists already is left alone).

    ``submitted_events``: each job inserted also gets its ``submitted`` event (message id
    ``<job_id>:submitted``, the spec as the event, at its submission time), in the same statement.
    """
    if not jobs:
        return set()
    rows = await conn.fetch(
        """WITH ins AS (
               INSERT INTO jobs (job_id, tenant, state, spec, submitted_at, trace_context, parent, priority)
               SELECT j, t, st, s::jsonb, a, c::jsonb, p, pr
               FROM unnest($1::text[], $2::text[], $3::text[], $4::timestamptz[], $5::text[], $6::text[],
                           $7::text[], $8::int[]) AS u(j, t, s, a, c, st, p, pr)
               ON CONFLICT (job_id) DO NOTHING RETURNING job_id, spec, submitted_at
           ), events AS (
               INSERT INTO job_events (job_id, kind, msg_id, event, at)
               SELECT job_id, 'submitted', job_id || ':submitted', spec, submitted_at FROM ins WHERE $9
               ON CONFLICT (msg_id) DO NOTHING
           )
           SELECT job_id FROM ins""",
        [j.job_id for j in jobs],
        [j.tenant for j in jobs],
        [j.spec_json.decode() for j in jobs],
        [ts(j.submitted_at) for j in jobs],
        [json.dumps(dict(j.trace_context)) for j in jobs],
        [j.state for j in jobs],
        [j.parent for j in jobs],
        [j.priority for j in jobs],
        submitted_events,
    )
    return {r["job_id"] for r in rows}


async def append_events(conn: asyncpg.Connection, events: Sequence[JobEventRow]) -> set[str]:
    """Append events of known jobs; returns the message ids that were new.

    An event whose message id was recorded before is a redelivery and is skipped; an event of a
    job that has no row is skipped too (placement never accepted that job).
    """
    if not events:
        return set()
    rows = await conn.fetch(
        _APPEND_EVENTS.format(*_params(1, 5)) + " RETURNING msg_id",
        [e.job_id for e in events],
        [e.kind for e in events],
        [e.msg_id for e in events],
        [e.event_json.decode() for e in events],
        [ts(e.at) for e in events],
    )
    return {r["msg_id"] for r in rows}


async def mark_placed(
    conn: asyncpg.Connection, placed: Sequence[tuple[str, str, int, float] | tuple[str, str, int, float, int]]
) -> None:
    """(job_id, cluster, attempt, placed_at[, workers]) for jobs that were queued."""
    if not placed:
        return
    await conn.execute(
        _MARK_PLACED.format(*_params(1, 5)),
        [p[0] for p in placed],
        [p[1] for p in placed],
        [p[2] for p in placed],
        [ts(p[3]) for p in placed],
        [p[4] if len(p) > 4 else None for p in placed],
    )


async def mark_rejected(conn: asyncpg.Connection, rejected: Sequence[tuple[str, str]]) -> None:
    """(job_id, reason) for queued jobs that can never run."""
    if not rejected:
        return
    await conn.execute(
        _MARK_REJECTED.format(*_params(1, 2)),
        [r[0] for r in rejected],
        [r[1] for r in rejected],
    )


async def reserve(
    conn: asyncpg.Connection,
    job_allocations: Sequence[tuple[str, int, str, Sequence[tuple[str, int]]]],
    confirm_by: Sequence[float] | None = None,
) -> None:
    """Reserve GPUs: (job_id, attempt, cluster, [(node, gpus)]) for each job.

    The capacity book is updated by one conditional statement per batch; if any node lacks the
    GPUs (someone else's decision got there first) nothing is reserved and :class:`ConflictError`
    is raised, so the caller recomputes from fresh state.
    """
    per_node, res_rows = _reservation_rows(job_allocations, confirm_by)
    if not per_node:
        return
    updated = await conn.fetch(
        _RESERVE_NODES.format(nodes="$1", gpus="$2"), list(per_node), list(per_node.values())
    )
    if len(updated) != len(per_node):
        raise ConflictError("capacity changed under the decision; recomputing")
    await conn.execute(_INSERT_RESERVATIONS.format(*_params(1, 6)), *_columns(res_rows, 6))


_RESERVE_NODES = """UPDATE node_allocations n SET gpus_reserved = n.gpus_reserved + u.g
    FROM unnest({nodes}::text[], {gpus}::int[]) AS u(node, g)
    WHERE n.node = u.node AND n.schedulable AND n.gpus_total - n.gpus_reserved >= u.g
    RETURNING n.node"""
_INSERT_RESERVATIONS = """INSERT INTO reservations (job_id, attempt, node, cluster, gpus, state, confirm_by)
    SELECT j, a, n, c, g, 'reserved', d
    FROM unnest({}::text[], {}::int[], {}::text[], {}::text[], {}::int[], {}::timestamptz[])
        AS u(j, a, n, c, g, d)
    ON CONFLICT (job_id, attempt, node) DO UPDATE SET
        gpus = CASE WHEN reservations.state = 'released' THEN EXCLUDED.gpus
                    ELSE reservations.gpus + EXCLUDED.gpus END,
        state = CASE WHEN reservations.state = 'released' THEN 'confirmed' ELSE reservations.state END,
        released_at = NULL"""
_MARK_PLACED = """UPDATE jobs SET state = 'placed', cluster = u.c, attempt = u.a, placed_at = u.p,
           updated_at = now(), workers = u.w
    FROM unnest({}::text[], {}::text[], {}::int[], {}::timestamptz[], {}::int[]) AS u(j, c, a, p, w)
    WHERE jobs.job_id = u.j AND jobs.state = 'queued'"""
_MARK_REJECTED = """UPDATE jobs SET state = 'rejected', reason = u.r, finished_at = now(), updated_at = now()
    FROM unnest({}::text[], {}::text[]) AS u(j, r)
    WHERE jobs.job_id = u.j AND jobs.state = 'queued'"""
_RECORD_DECISIONS = """INSERT INTO decisions (job_id, attempt, outcome, record)
    SELECT j, a, o, r FROM unnest({}::text[], {}::int[], {}::text[], {}::text[]) AS u(j, a, o, r)
    ON CONFLICT (job_id, attempt) DO UPDATE SET outcome = EXCLUDED.outcome, record = EXCLUDED.record,
        at = now()"""
_APPEND_EVENTS = """INSERT INTO job_events (job_id, kind, msg_id, event, at)
    SELECT u.j, u.k, u.m, u.e::jsonb, u.a
    FROM unnest({}::text[], {}::text[], {}::text[], {}::text[], {}::timestamptz[]) AS u(j, k, m, e, a)
    WHERE EXISTS (SELECT 1 FROM jobs WHERE jobs.job_id = u.j)
    ON CONFLICT (msg_id) DO NOTHING"""


def _params(first: int, count: int) -> list[str]:
    """``$first`` .. ``$(first + count - 1)``."""
    return [f"${i}" for i in range(first, first + count)]


def _columns(rows: Sequence[Sequence[Any]], width: int) -> list[list[Any]]:
    """Rows as ``width`` column lists (empty lists for no rows)."""
    return [list(column) for column in zip(*rows, strict=True)] if rows else [[] for _ in range(width)]


def _reservation_rows(
    job_allocations: Sequence[tuple[str, int, str, Sequence[tuple[str, int]]]],
    confirm_by: Sequence[float] | None,
) -> tuple[dict[str, int], list[tuple[str, int, str, str, int, datetime | None]]]:
    """GPUs to take per node, and one reservation row per (job, node)."""
    per_node: dict[str, int] = {}
    res_rows: list[tuple[str, int, str, str, int, datetime | None]] = []
    for i, (job_id, attempt, cluster, allocations) in enumerate(job_allocations):
        deadline = ts(confirm_by[i]) if confirm_by is not None else None
        for node, gpus in allocations:
            per_node[node] = per_node.get(node, 0) + gpus
            res_rows.append((job_id, attempt, node, cluster, gpus, deadline))
    return per_node, res_rows


async def apply_cycle(
    conn: asyncpg.Connection,
    *,
    reservations: Sequence[tuple[str, int, str, Sequence[tuple[str, int]]]],
    confirm_by: Sequence[float],
    placed: Sequence[tuple[str, str, int, float, int]],
    rejected: Sequence[tuple[str, str]],
    decisions: Sequence[tuple[str, int, str, Mapping[str, Any]]],
    events: Sequence[JobEventRow],
    outbox_rows: tuple[str, Sequence[tuple[str, str, bytes, Mapping[str, str]]]],
) -> None:
    """A cycle's writes in one statement (one round trip): :func:`reserve`, :func:`mark_placed`,
    :func:`mark_rejected`, :func:`record_decisions`, :func:`append_events` and the outbox rows
    (``(producer, [(msg_id, subject, payload, headers)])``, as ``outbox.add`` writes them).

    Raises :class:`ConflictError` when a node lacks the GPUs; the caller's transaction must then
    roll back (the other rows were written by the same statement).
    """
    per_node, res_rows = _reservation_rows(reservations, confirm_by)
    producer, messages = outbox_rows
    statements = {
        "res": _INSERT_RESERVATIONS.format(*_params(3, 6)),
        "placed": _MARK_PLACED.format(*_params(9, 5)),
        "rejected": _MARK_REJECTED.format(*_params(14, 2)),
        "decided": _RECORD_DECISIONS.format(*_params(16, 4)),
        "events": _APPEND_EVENTS.format(*_params(20, 5)),
        "outbox": """INSERT INTO outbox (producer, msg_id, subject, payload, headers)
            SELECT $25, m, s, p, h::jsonb FROM unnest($26::text[], $27::text[], $28::bytea[], $29::text[])
                AS u(m, s, p, h)
            ON CONFLICT (msg_id) DO NOTHING""",
    }
    ctes = ",\n".join(f"{name} AS ({sql})" for name, sql in statements.items())
    updated = await conn.fetchval(
        f"WITH upd AS ({_RESERVE_NODES.format(nodes='$1', gpus='$2')}),\n{ctes}\nSELECT count(*) FROM upd",
        list(per_node),
        list(per_node.values()),
        *_columns(res_rows, 6),
        *_columns([(j, c, a, ts(p), w) for j, c, a, p, w in placed], 5),
        *_columns(rejected, 2),
        *_columns([(j, a, o, msgspec.json.encode(r).decode()) for j, a, o, r in decisions], 4),
        *_columns([(e.job_id, e.kind, e.msg_id, e.event_json.decode(), ts(e.at)) for e in events], 5),
        producer,
        *_columns([(m, sub, pay, json.dumps(dict(h))) for m, sub, pay, h in messages], 4),
    )
    if updated != len(per_node):
        raise ConflictError("capacity changed under the decision; recomputing")


async def confirm(conn: asyncpg.Connection, runs: Sequence[tuple[str, int]]) -> None:
    """Agents started these (job_id, attempt) runs: reservations become confirmed, jobs running."""
    if not runs:
        return
    jobs_, attempts = [r[0] for r in runs], [r[1] for r in runs]
    # Both updates in one statement (one round trip); they touch different tables.
    await conn.execute(
        """WITH confirmed AS (
               UPDATE reservations r SET state = 'confirmed'
               FROM unnest($1::text[], $2::int[]) AS u(j, a)
               WHERE r.job_id = u.j AND r.attempt = u.a AND r.state = 'reserved')
           UPDATE jobs SET state = 'running', updated_at = now()
           FROM unnest($1::text[], $2::int[]) AS u(j, a)
           WHERE jobs.job_id = u.j AND jobs.attempt = u.a AND jobs.state = 'placed'""",
        jobs_,
        attempts,
    )


async def release(conn: asyncpg.Connection, job_id: str, attempt: int) -> list[tuple[str, int]]:
    """Release a run's reservations; returns (node, gpus) released. Releasing twice releases nothing."""
    rows = await conn.fetch(
        """UPDATE reservations SET state = 'released', released_at = now()
           WHERE job_id = $1 AND attempt = $2 AND state <> 'released' RETURNING node, gpus""",
        job_id,
        attempt,
    )
    released = [(r["node"], r["gpus"]) for r in rows]
    if released:
        await conn.execute(
            """UPDATE node_allocations n SET gpus_reserved = n.gpus_reserved - u.g
               FROM unnest($1::text[], $2::int[]) AS u(node, g) WHERE n.node = u.node""",
            [r[0] for r in released],
            [r[1] for r in released],
        )
    return released


async def finish(conn: asyncpg.Connection, job_id: str, attempt: int, state: str, reason: str | None) -> bool:
    """Record a terminal state of the job's current attempt.

    A completion also counts when the attempt was just given up and the job waits to be placed
    again (queued at that attempt): the work is done, so it is not run twice.
    """
    done = await conn.fetchval(
        """UPDATE jobs SET state = $3, reason = COALESCE($4, reason), finished_at = now(), updated_at = now(),
                  progress = CASE WHEN $3 = 'completed' THEN 1 ELSE progress END
           WHERE job_id = $1 AND attempt = $2
             AND (state IN ('placed', 'running') OR ($3 = 'completed' AND state = 'queued'))
           RETURNING true""",
        job_id,
        attempt,
        state,
        reason,
    )
    return bool(done)


async def set_progress(conn: asyncpg.Connection, updates: Sequence[tuple[str, int, float]]) -> None:
    """(job_id, attempt, fraction done); progress only moves forward."""
    if not updates:
        return
    await conn.execute(
        """UPDATE jobs SET progress = GREATEST(jobs.progress, u.p), updated_at = now()
           FROM (SELECT j, a, max(p) AS p FROM unnest($1::text[], $2::int[], $3::real[]) AS x(j, a, p)
                 GROUP BY j, a) AS u
           WHERE jobs.job_id = u.j AND jobs.attempt = u.a AND jobs.state IN ('placed', 'running')""",
        [u[0] for u in updates],
        [u[1] for u in updates],
        [min(max(u[2], 0.0), 1.0) for u in updates],
    )


async def load_nodes(conn: asyncpg.Connection | asyncpg.Pool) -> dict[str, NodeCapacity]:
    """The capacity book as placement holds it in memory."""
    rows = await conn.fetch(
        """SELECT node, cluster, region, zone, gpu_model, gpus_total, gpus_reserved, schedulable,
                  cpu_milli, memory_mib
           FROM node_allocations"""
    )
    return {
        r["node"]: NodeCapacity(
            node=r["node"],
            cluster=r["cluster"],
            region=r["region"],
            zone=r["zone"],
            gpu_model=r["gpu_model"],
            gpus_total=r["gpus_total"],
            gpus_reserved=r["gpus_reserved"],
            schedulable=r["schedulable"],
            cpu_milli=r["cpu_milli"],
            memory_mib=r["memory_mib"],
        )
        for r in rows
    }


async def upsert_nodes(conn: asyncpg.Connection, version: int, nodes: Iterable[NodeCapacity]) -> None:
    """Follow the view: totals, model and schedulability change; reservations never do here."""
    items = list(nodes)
    if not items:
        return
    await conn.execute(
        """INSERT INTO node_allocations AS n
               (node, cluster, region, zone, gpu_model, gpus_total, schedulable, view_version, cpu_milli,
                memory_mib)
           SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::int[],
                                $7::bool[],
                                $8::bigint[], $9::int[], $10::bigint[])
           ON CONFLICT (node) DO UPDATE SET cluster = EXCLUDED.cluster, region = EXCLUDED.region,
               zone = EXCLUDED.zone, gpu_model = EXCLUDED.gpu_model, gpus_total = EXCLUDED.gpus_total,
               schedulable = EXCLUDED.schedulable, view_version = EXCLUDED.view_version,
               cpu_milli = EXCLUDED.cpu_milli, memory_mib = EXCLUDED.memory_mib
           WHERE n.view_version <= EXCLUDED.view_version""",
        [c.node for c in items],
        [c.cluster for c in items],
        [c.region for c in items],
        [c.zone for c in items],
        [c.gpu_model for c in items],
        [c.gpus_total for c in items],
        [c.schedulable for c in items],
        [version] * len(items),
        [c.cpu_milli for c in items],
        [c.memory_mib for c in items],
    )


async def queued_jobs(conn: asyncpg.Connection | asyncpg.Pool) -> list[asyncpg.Record]:
    """Jobs accepted but not yet placed, oldest first (with the attempt they last had)."""
    rows: list[asyncpg.Record] = await conn.fetch(
        """SELECT job_id, spec, trace_context, attempt, avoid_clusters, parent,
                  resume_step FROM jobs
           WHERE state = 'queued' ORDER BY submitted_at, job_id"""
    )
    return rows


async def recent_jobs(
    conn: asyncpg.Connection | asyncpg.Pool, limit: int, *, before: tuple[datetime, str] | None = None
) -> list[asyncpg.Record]:
    """Up to ``limit`` of the latest jobs submitted, newest first, before ``before``
    ((``submitted_at``, job id) of the last row of the page before): their spec, when they were
    submitted (``submitted_at``, and as epoch seconds ``at``), their state, DAG parent and whether
    they were ever placed (``never_placed``), for the caller to leave out what placement never
    decided (a filter on the spec here would keep the planner off the index). What a new placement
    leader notes as the shapes seen lately (``Snapshot.seen``), a page at a time."""
    rows: list[asyncpg.Record] = await conn.fetch(
        """SELECT job_id, spec, submitted_at, extract(epoch FROM submitted_at)::float8 AS at, state,
                  parent, placed_at IS NULL AS never_placed FROM jobs
           WHERE ($2::timestamptz IS NULL OR (submitted_at, job_id) < ($2::timestamptz, $3::text))
           ORDER BY submitted_at DESC, job_id DESC LIMIT $1""",
        max(int(limit), 0),
        None if before is None else before[0],
        None if before is None else before[1],
    )
    return rows


async def active_runs(conn: asyncpg.Connection | asyncpg.Pool) -> list[asyncpg.Record]:
    """Placed and running jobs with their live reservations: (job row, [(node, cluster, gpus)])."""
    rows: list[asyncpg.Record] = await conn.fetch(
        """SELECT j.job_id, j.tenant, j.spec, j.attempt, j.progress, j.workers, j.cluster,
                  j.trace_context, j.avoid_clusters, j.parent,
                  array_agg(r.node ORDER BY r.node) AS nodes,
                  array_agg(r.cluster ORDER BY r.node) AS clusters,
                  array_agg(r.gpus ORDER BY r.node) AS gpus
           FROM jobs j JOIN reservations r ON r.job_id = j.job_id AND r.attempt = j.attempt
           WHERE j.state IN ('placed', 'running') AND r.state <> 'released'
           GROUP BY j.job_id"""
    )
    return rows


async def requeue(
    conn: asyncpg.Connection,
    job_id: str,
    attempt: int,
    avoid: Sequence[str],
    *,
    unstarted_only: bool = False,
    resume_step: int = 0,
) -> list[tuple[str, int]] | None:
    """Give up a placed or running attempt: release its GPUs, queue the job again.

    Returns the (node, gpus) released, or None when the attempt had moved on (finished, or already
    given up) and nothing changed. ``unstarted_only``: only if the agent never confirmed the start.
    ``avoid``: every cluster the next attempt avoids (:func:`loom.sched.cycle.requeue_avoid`).
    ``resume_step``: the step the next run resumes from (0: from the start).
    """
    row = await conn.fetchrow(
        """UPDATE jobs SET state = 'queued', updated_at = now(), resume_step = $5,
                  avoid_clusters = $3::text[]
           WHERE job_id = $1 AND attempt = $2
             AND state = ANY(CASE WHEN $4 THEN ARRAY['placed'] ELSE ARRAY['placed', 'running'] END)
             AND NOT ($4 AND EXISTS (SELECT 1 FROM reservations r WHERE r.job_id = $1 AND r.attempt = $2
                                      AND r.state = 'confirmed'))
           RETURNING job_id""",
        job_id,
        attempt,
        list(avoid),
        unstarted_only,
        max(resume_step, 0),
    )
    if row is None:
        return None
    return await release(conn, job_id, attempt)


async def existing_jobs(conn: asyncpg.Connection, job_ids: Sequence[str]) -> set[str]:
    """Which of these job ids exist already."""
    rows = await conn.fetch("SELECT job_id FROM jobs WHERE job_id = ANY($1::text[])", list(job_ids))
    return {r["job_id"] for r in rows}


async def lock_queued(conn: asyncpg.Connection, job_ids: Sequence[str]) -> set[str]:
    """Lock the rows of jobs that are still queued (for this transaction); returns their ids."""
    if not job_ids:
        return set()
    rows = await conn.fetch(
        "SELECT job_id FROM jobs WHERE job_id = ANY($1::text[]) AND state = 'queued'"
        " ORDER BY job_id FOR UPDATE",  # in one order: another transaction locking jobs waits, not deadlocks
        list(job_ids),
    )
    return {r["job_id"] for r in rows}


async def lock_active(conn: asyncpg.Connection, job_id: str, attempt: int) -> bool:
    """Lock a job's row if that attempt is still placed or running (resizes check this first)."""
    row = await conn.fetchrow(
        """SELECT 1 FROM jobs WHERE job_id = $1 AND attempt = $2 AND state IN ('placed', 'running')
           FOR UPDATE""",
        job_id,
        attempt,
    )
    return row is not None


async def expired_reservations(
    conn: asyncpg.Connection | asyncpg.Pool, limit: int = 500
) -> list[asyncpg.Record]:
    """Runs whose agent did not confirm the start in time: (job_id, attempt, clusters)."""
    rows: list[asyncpg.Record] = await conn.fetch(
        """SELECT r.job_id, r.attempt, array_agg(DISTINCT r.cluster) AS clusters
           FROM reservations r JOIN jobs j ON j.job_id = r.job_id AND j.attempt = r.attempt
           WHERE r.state = 'reserved' AND r.confirm_by < now() AND j.state = 'placed'
           GROUP BY r.job_id, r.attempt LIMIT $1""",
        limit,
    )
    return rows


async def grow(
    conn: asyncpg.Connection, job_id: str, attempt: int, cluster: str, allocations: Sequence[tuple[str, int]]
) -> None:
    """Add GPUs to a running job's reservation (an elastic job grows); ConflictError if they are gone.

    The caller has locked the job's row with :func:`lock_active`, so the run cannot finish meanwhile.
    Only the rows of the nodes grown onto are marked confirmed (a run not yet started stays
    unconfirmed, so its start can still expire).
    """
    await reserve(conn, [(job_id, attempt, cluster, allocations)])
    await conn.execute(
        """UPDATE reservations SET state = 'confirmed'
           WHERE job_id = $1 AND attempt = $2 AND state = 'reserved' AND node = ANY($3::text[])
             AND EXISTS (SELECT 1 FROM reservations c WHERE c.job_id = $1 AND c.attempt = $2
                         AND c.state = 'confirmed')""",
        job_id,
        attempt,
        [n for n, _ in allocations],
    )


async def shrink(
    conn: asyncpg.Connection, job_id: str, attempt: int, freed: Sequence[tuple[str, int]]
) -> None:
    """Give back some of a running job's GPUs (an elastic job shrinks); a node left with none is released."""
    if not freed:
        return
    nodes, gpus = [n for n, _ in freed], [g for _, g in freed]
    rows = await conn.fetch(
        """UPDATE reservations r SET
               gpus = CASE WHEN r.gpus - u.g <= 0 THEN r.gpus ELSE r.gpus - u.g END,
               state = CASE WHEN r.gpus - u.g <= 0 THEN 'released' ELSE r.state END,
               released_at = CASE WHEN r.gpus - u.g <= 0 THEN now() ELSE r.released_at END
           FROM unnest($3::text[], $4::int[]) AS u(node, g)
           WHERE r.job_id = $1 AND r.attempt = $2 AND r.node = u.node AND r.state <> 'released'
           RETURNING r.node, LEAST(u.g, r.gpus) AS g""",
        job_id,
        attempt,
        nodes,
        gpus,
    )
    if len(rows) != len(freed):
        raise ConflictError(f"{job_id} attempt {attempt} no longer holds what it would give back")
    await conn.execute(
        """UPDATE node_allocations n SET gpus_reserved = GREATEST(n.gpus_reserved - u.g, 0)
           FROM unnest($1::text[], $2::int[]) AS u(node, g) WHERE n.node = u.node""",
        nodes,
        gpus,
    )


async def set_workers(conn: asyncpg.Connection, job_id: str, attempt: int, workers: int) -> int:
    """Record an elastic job's current number of workers; returns its resize count (for message ids)."""
    count: int = await conn.fetchval(
        """UPDATE jobs SET workers = $3, resizes = resizes + 1, updated_at = now()
           WHERE job_id = $1 AND attempt = $2 RETURNING resizes""",
        job_id,
        attempt,
        workers,
    )
    return count


async def record_decisions(
    conn: asyncpg.Connection, records: Sequence[tuple[str, int, str, Mapping[str, Any]]]
) -> None:
    """(job_id, attempt, outcome, record) audit rows; a later record of the same attempt replaces it."""
    if not records:
        return
    await conn.execute(
        _RECORD_DECISIONS.format(*_params(1, 4)),
        [r[0] for r in records],
        [r[1] for r in records],
        [r[2] for r in records],
        [msgspec.json.encode(r[3]).decode() for r in records],
    )


async def decisions_of(conn: asyncpg.Connection | asyncpg.Pool, job_id: str) -> list[dict[str, Any]]:
    """Every attempt's decision record of a job, oldest first."""
    rows = await conn.fetch(
        "SELECT attempt, outcome, at, record FROM decisions WHERE job_id = $1 ORDER BY attempt", job_id
    )
    return [
        {
            "attempt": r["attempt"],
            "outcome": r["outcome"],
            "at": r["at"].timestamp(),
            "record": json.loads(r["record"]),
        }
        for r in rows
    ]


async def children(conn: asyncpg.Connection, parent: str) -> list[asyncpg.Record]:
    """A DAG job's stage jobs with their states (locks them for the caller's transaction)."""
    rows: list[asyncpg.Record] = await conn.fetch(
        """SELECT job_id, state, spec, trace_context, cluster FROM jobs WHERE parent = $1
           ORDER BY job_id FOR UPDATE""",
        parent,
    )
    return rows


async def set_state(
    conn: asyncpg.Connection,
    job_ids: Sequence[str],
    state: str,
    from_states: Sequence[str],
    reason: str | None = None,
) -> list[str]:
    """Move jobs in one of ``from_states`` to ``state``; returns the ids moved."""
    if not job_ids:
        return []
    terminal = state in TERMINAL_STATES
    rows = await conn.fetch(
        """UPDATE jobs SET state = $2, reason = COALESCE($4, reason), updated_at = now(),
                  finished_at = CASE WHEN $5 THEN now() ELSE finished_at END,
                  progress = CASE WHEN $2 = 'completed' THEN 1 ELSE progress END
           WHERE job_id = ANY($1::text[]) AND state = ANY($3::text[]) RETURNING job_id""",
        list(job_ids),
        state,
        list(from_states),
        reason,
        terminal,
    )
    return [r["job_id"] for r in rows]


async def tenants_of(
    conn: asyncpg.Connection | asyncpg.Pool, job_ids: Sequence[str], *, lock: bool = False
) -> dict[str, str]:
    """Job id -> its tenant, for those of ``job_ids`` that exist (``lock``: their rows locked for
    update until the transaction ends)."""
    rows = await conn.fetch(
        "SELECT job_id, tenant FROM jobs WHERE job_id = ANY($1::text[]) ORDER BY job_id"
        + (" FOR UPDATE" if lock else ""),
        list(job_ids),
    )
    return {r["job_id"]: r["tenant"] for r in rows}


async def job_row(conn: asyncpg.Connection | asyncpg.Pool, job_id: str) -> asyncpg.Record | None:
    """One job's row."""
    row: asyncpg.Record | None = await conn.fetchrow("SELECT * FROM jobs WHERE job_id = $1", job_id)
    return row


WAITING_STATES = ("queued", "waiting")


_JOB_COLUMNS: Final = """j.*, CASE WHEN j.state IN ('queued', 'waiting') AND COALESCE(j.reason, '') = ''
    THEN (SELECT d.record FROM decisions d  -- a job never placed is at attempt 0, its decision at 1
          WHERE d.job_id = j.job_id AND d.attempt >= j.attempt AND d.outcome = 'waiting'
          ORDER BY d.attempt DESC LIMIT 1)
    END AS waiting_record"""
"""A job's row, and for one that waits without a reason of its own the decision record that says why."""


def _job_dict(row: asyncpg.Record) -> dict[str, Any]:
    """A job as the queries show it: a job waiting to be placed (again) runs nowhere, so its
    ``cluster`` is None and the cluster its last attempt ran on is ``last_cluster``."""
    waiting = row["state"] in WAITING_STATES
    reason = row["reason"]
    if waiting and not reason and "waiting_record" in row and row["waiting_record"]:
        # Why it waits, from its latest decision (`loom jobs` showed nothing for queued jobs).
        with contextlib.suppress(ValueError, AttributeError):
            reason = json.loads(row["waiting_record"]).get("reason") or reason
    return {
        "job_id": row["job_id"],
        "tenant": row["tenant"],
        "state": row["state"],
        "cluster": None if waiting else row["cluster"],
        "last_cluster": row["cluster"] if waiting else None,
        "attempt": row["attempt"],
        "progress": round(float(row["progress"]), 4),
        "reason": reason,
        "submitted_at": row["submitted_at"].timestamp(),
        "placed_at": row["placed_at"].timestamp() if row["placed_at"] else None,
        "finished_at": row["finished_at"].timestamp() if row["finished_at"] else None,
    }


async def get_job(conn: asyncpg.Connection | asyncpg.Pool, job_id: str) -> dict[str, Any] | None:
    """A job and its full event history, for `loom job ID`."""
    row = await conn.fetchrow(f"SELECT {_JOB_COLUMNS} FROM jobs j WHERE job_id = $1", job_id)
    if row is None:
        return None
    out = _job_dict(row)
    out["parent"] = row["parent"]  # the DAG a stage's job belongs to (None for any other job)
    out["spec"] = json.loads(row["spec"])
    out["trace_id"] = trace_id_of(json.loads(row["trace_context"] or "{}"))
    events = await conn.fetch(
        # In the order things happened: reports can be stored after later ones (a journalled report
        # sent when the bus returns), so the insertion order is only the tie-break.
        "SELECT kind, msg_id, event, at FROM job_events WHERE job_id = $1 ORDER BY at, id",
        job_id,
    )
    out["events"] = [
        {"kind": e["kind"], "msg_id": e["msg_id"], "at": e["at"].timestamp(), "event": json.loads(e["event"])}
        for e in events
    ]
    out["migrations"] = list(reversed(await list_migrations(conn, job_id=job_id)))
    out["replicas"] = await list_replicas(conn, job_id=job_id, limit=20)
    # Why it moved, or did not: every migration verdict of it, with the numbers (oldest first).
    out["verdicts"] = list(reversed(await list_verdicts(conn, job_id=job_id, limit=50)))
    return out


async def list_jobs(
    conn: asyncpg.Connection | asyncpg.Pool,
    *,
    tenant: str | None = None,
    state: str | None = None,
    limit: int = 100,
) -> list[dict[str, Any]]:
    """Newest jobs first, optionally of one tenant or state."""
    rows = await conn.fetch(
        f"""SELECT {_JOB_COLUMNS} FROM jobs j
           WHERE ($1::text IS NULL OR tenant = $1) AND ($2::text IS NULL OR state = $2)
           ORDER BY submitted_at DESC, job_id LIMIT $3""",
        tenant,
        state,
        limit,
    )
    return [_job_dict(r) for r in rows]


async def count_by_state(conn: asyncpg.Connection | asyncpg.Pool) -> dict[str, int]:
    """How many jobs are in each state."""
    rows = await conn.fetch("SELECT state, count(*) AS n FROM jobs GROUP BY state")
    return {r["state"]: int(r["n"]) for r in rows}
