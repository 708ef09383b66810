"""Metering's tables: run records (``usage_runs``) and the usage rows metered from them (``usage_rows``).

Written only by the metrics service's metering consumer (``services/metrics/metering.py``), read by
``loom usage``. See migration ``009_metering.sql``.
"""

import json
from collections.abc import Sequence
from typing import Any

import asyncpg
import msgspec

from loom.metering.run import RunRecord, not_before_placement
from loom.metering.usage import UsageRow
from loom.store.roles import tenant_scope

__all__ = [
    "job_spec",
    "job_specs",
    "load_run",
    "load_runs",
    "open_runs",
    "read_rows",
    "read_tenant_rows",
    "recorded_runs",
    "replace_rows",
    "save_run",
    "save_runs",
    "usage_totals",
]


async def load_run(conn: asyncpg.Connection, job_id: str, attempt: int) -> RunRecord | None:
    """The run record of one attempt, locked until the transaction ends; None when none yet."""
    row = await conn.fetchrow(
        "SELECT record FROM usage_runs WHERE job_id = $1 AND attempt = $2 FOR UPDATE", job_id, attempt
    )
    return None if row is None else msgspec.json.decode(row["record"], type=RunRecord)


async def load_runs(
    conn: asyncpg.Connection, keys: Sequence[tuple[str, int]]
) -> dict[tuple[str, int], RunRecord]:
    """:func:`load_run` of many attempts in one statement (locked, in key order so two writers
    never lock in opposite orders); attempts without a record are left out."""
    if not keys:
        return {}
    ordered = sorted(set(keys))
    rows = await conn.fetch(
        """SELECT r.job_id, r.attempt, r.record FROM usage_runs r
           JOIN unnest($1::text[], $2::int[]) AS k(job_id, attempt)
             ON r.job_id = k.job_id AND r.attempt = k.attempt
           ORDER BY r.job_id, r.attempt FOR UPDATE OF r""",
        [k[0] for k in ordered],
        [k[1] for k in ordered],
    )
    return {(r["job_id"], r["attempt"]): msgspec.json.decode(r["record"], type=RunRecord) for r in rows}


async def open_runs(conn: asyncpg.Connection, job_id: str) -> list[RunRecord]:
    """Every run record of a job that has not ended (locked): what a cancellation ends."""
    rows = await conn.fetch(
        "SELECT record FROM usage_runs WHERE job_id = $1 AND (record->>'ended_ms') IS NULL "
        "ORDER BY attempt FOR UPDATE",
        job_id,
    )
    return [msgspec.json.decode(r["record"], type=RunRecord) for r in rows]


async def save_run(conn: asyncpg.Connection, record: RunRecord) -> None:
    """Insert or replace one run record."""
    await conn.execute(
        """INSERT INTO usage_runs (job_id, attempt, record) VALUES ($1, $2, $3::jsonb)
           ON CONFLICT (job_id, attempt) DO UPDATE SET record = EXCLUDED.record, updated_at = now()""",
        record.job_id,
        record.attempt,
        msgspec.json.encode(record).decode(),
    )


async def save_runs(conn: asyncpg.Connection, records: Sequence[RunRecord]) -> None:
    """:func:`save_run` of many records in one statement (one record per attempt)."""
    if not records:
        return
    await conn.execute(
        """INSERT INTO usage_runs (job_id, attempt, record)
           SELECT * FROM unnest($1::text[], $2::int[], $3::jsonb[])
           ON CONFLICT (job_id, attempt) DO UPDATE SET record = EXCLUDED.record, updated_at = now()""",
        [r.job_id for r in records],
        [r.attempt for r in records],
        [msgspec.json.encode(r).decode() for r in records],
    )


async def replace_rows(conn: asyncpg.Connection, job_id: str, attempt: int, rows: Sequence[UsageRow]) -> None:
    """Make ``rows`` the usage of one attempt (a record that changed is metered afresh)."""
    await conn.execute("DELETE FROM usage_rows WHERE job_id = $1 AND attempt = $2", job_id, attempt)
    if not rows:
        return
    await conn.executemany(
        """INSERT INTO usage_rows (job_id, attempt, seq, tenant, labels, cluster, region, gpu_model,
               start_ms, end_ms, gpus, scu_per_gpu, price_per_scu_hour, outcome)
           VALUES ($1, $2, $3, $4, $5::jsonb, $6, $7, $8, $9, $10, $11, $12, $13, $14)""",
        [
            (
                r.job_id,
                r.attempt,
                r.seq,
                r.tenant,
                json.dumps(r.labels),
                r.cluster,
                r.region,
                r.gpu_model,
                r.start_ms,
                r.end_ms,
                r.gpus,
                r.scu_per_gpu,
                r.price_per_scu_hour,
                r.outcome,
            )
            for r in rows
        ],
    )


async def job_spec(conn: asyncpg.Connection, job_id: str) -> tuple[dict[str, str], str] | None:
    """A job's labels and task type from its record in ``jobs`` (stage jobs of a DAG have no
    submission event of their own, so this is where every job's labels are); None when unknown."""
    row = await conn.fetchrow("SELECT spec FROM jobs WHERE job_id = $1", job_id)
    return None if row is None else _spec_fields(row["spec"])


def _spec_fields(raw: Any) -> tuple[dict[str, str], str]:
    spec = json.loads(raw) if isinstance(raw, str) else dict(raw)
    labels = {str(k): str(v) for k, v in (spec.get("labels") or {}).items()}
    return labels, str(spec.get("task_type") or "training_compute")


async def job_specs(
    conn: asyncpg.Connection, job_ids: Sequence[str]
) -> dict[str, tuple[dict[str, str], str] | None]:
    """:func:`job_spec` of many jobs in one statement: every id asked for is a key (None when unknown)."""
    out: dict[str, tuple[dict[str, str], str] | None] = dict.fromkeys(job_ids)
    if not out:
        return out
    for row in await conn.fetch("SELECT job_id, spec FROM jobs WHERE job_id = ANY($1::text[])", list(out)):
        out[row["job_id"]] = _spec_fields(row["spec"])
    return out


async def read_tenant_rows(
    conn: asyncpg.Connection | asyncpg.Pool,
    tenant: str,
    *,
    since_ms: int | None = None,
    until_ms: int | None = None,
) -> list[UsageRow]:
    """:func:`read_rows` of one tenant inside :func:`loom.store.roles.tenant_scope`: row-level
    security, not only the ``WHERE``, keeps every other tenant's rows out."""
    async with tenant_scope(conn, tenant) as scoped:
        return await read_rows(scoped, tenant=tenant, since_ms=since_ms, until_ms=until_ms)


async def read_rows(
    conn: asyncpg.Connection | asyncpg.Pool,
    *,
    tenant: str | None = None,
    since_ms: int | None = None,
    until_ms: int | None = None,
) -> list[UsageRow]:
    """Usage rows of ``tenant`` (or all) that overlap ``[since_ms, until_ms)``, in time order."""
    rows = await conn.fetch(
        """SELECT job_id, attempt, seq, tenant, labels, cluster, region, gpu_model, start_ms, end_ms,
                  gpus, scu_per_gpu, price_per_scu_hour, outcome
           FROM usage_rows
           WHERE ($1::text IS NULL OR tenant = $1)
             AND ($2::bigint IS NULL OR end_ms > $2)
             AND ($3::bigint IS NULL OR start_ms < $3)
           ORDER BY start_ms, job_id, attempt, seq""",
        tenant,
        since_ms,
        until_ms,
    )
    out = []
    for r in rows:
        record = dict(r)
        labels = record["labels"]
        record["labels"] = json.loads(labels) if isinstance(labels, str) else dict(labels)
        out.append(UsageRow(**record))
    return out


async def usage_totals(conn: asyncpg.Connection | asyncpg.Pool) -> list[asyncpg.Record]:
    """GPU-ms and cost per tenant, team, region and GPU model: what the usage gauges export."""
    return list(
        await conn.fetch(
            """SELECT tenant, coalesce(labels->>'team', '(none)') AS team, region, gpu_model,
                      sum(gpu_ms)::bigint AS gpu_ms,
                      sum(gpu_ms * scu_per_gpu * price_per_scu_hour / 3600000.0) AS cost
               FROM usage_rows GROUP BY 1, 2, 3, 4"""
        )
    )


async def recorded_runs(conn: asyncpg.Connection | asyncpg.Pool) -> dict[tuple[str, int], tuple[str, int]]:
    """``(job, attempt) -> (tenant, GPU-ms)`` of every attempt that ran, computed from placement's
    own job history (``job_events``), not from metering's records: what ``loom usage reconcile``
    holds the usage rows against.

    Same rule, derived independently: GPUs of each part as placed (changed by ``resized`` from its
    time on) times (earliest end - start), in whole milliseconds.
    """
    runs: dict[tuple[str, int], dict[str, Any]] = {}
    cancels: dict[str, int] = {}

    def run(job_id: str, attempt: int) -> dict[str, Any]:
        return runs.setdefault(
            (job_id, attempt),
            {"tenant": "", "parts": {}, "lead": "", "start": None, "end": None, "resizes": []},
        )

    rows = await conn.fetch(
        "SELECT job_id, kind, event FROM job_events WHERE kind IN "
        "('placed', 'started', 'resized', 'completed', 'failed', 'cancelled', 'requeued') ORDER BY id"
    )
    for row in rows:
        event = json.loads(row["event"]) if isinstance(row["event"], str) else dict(row["event"])
        kind, job_id = row["kind"], row["job_id"]
        if kind == "cancelled":
            cancels[job_id] = min(cancels.get(job_id, 1 << 62), round(event["at"] * 1000))
            continue
        attempt = int(event.get("attempt", 1)) - (1 if kind == "requeued" else 0)
        r = run(job_id, attempt)
        if kind == "placed":
            parts = event.get("parts") or [event]
            r["tenant"] = event["tenant"]
            r["lead"] = parts[0]["cluster"]
            r["parts"] = {p["cluster"]: sum(a["gpus"] for a in p["allocations"]) for p in parts}
            if "placed_at" in event:
                r["placed"] = round(event["placed_at"] * 1000)
        elif kind == "started":
            r["start"] = round(event["started_at"] * 1000)
        elif kind == "resized":
            gpus = sum(a["gpus"] for a in event["allocations"])
            r["resizes"].append((round(event["at"] * 1000), event["cluster"], gpus))
        else:
            at = round(event["at"] * 1000)
            r["end"] = at if r["end"] is None else min(r["end"], at)
    out: dict[tuple[str, int], tuple[str, int]] = {}
    for (job_id, attempt), r in runs.items():
        end = r["end"]
        if job_id in cancels and r["start"] is not None:
            end = cancels[job_id] if end is None else min(end, cancels[job_id])
        if r["start"] is None or end is None or not r["parts"]:
            continue
        start = not_before_placement(r["start"], r.get("placed"))  # as metering counts it
        assert start is not None
        end = max(end, start)
        gpu_ms = 0
        for cluster, gpus in r["parts"].items():
            resized = sorted(
                (at, g)
                for at, c, g in set(r["resizes"])
                if c == cluster or (cluster == r["lead"] and c not in r["parts"])
            )
            steps = [(start, gpus), *resized]
            for k, (t_from, g) in enumerate(steps):
                t_to = steps[k + 1][0] if k + 1 < len(steps) else end
                gpu_ms += g * max(min(t_to, end) - max(t_from, start), 0)
        out[(job_id, attempt)] = (r["tenant"], gpu_ms)
    return out
