"""``loom bench console``: how fast the web console's pages answer with a full store.

Starts a private stack (`loom up` processes: every service of the topology, the console among
them), stores ``--jobs`` finished jobs of ``--tenants`` tenants with their event histories
straight into PostgreSQL (as placement would have left them), a metered usage row per job (as
metering would have), ``--incidents`` incidents over those jobs and one drained cluster, submits
a few real jobs through the bus so the job page has real decision records, then requests each
page ``--requests`` times over one keep-alive connection, as the operator (and the jobs,
incidents and usage pages as a tenant too), and reports p50/p95/p99/max per page. It measures;
it asserts nothing.
"""

import argparse
import asyncio
import http.client
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import asyncpg
import numpy as np

from loom.client import LoomClient
from loom.model.topology import load_topology
from loom.runtime import stack
from loom.runtime.tokens import load_tokens
from loom.store import jobs as repo
from loom.store import moves
from loom.store.incidents import save_incidents
from loom_benchmarks.secured import stack_security
from loom_proto.alerts import AffectedJob, IncidentChange, TimelineEntry
from loom_proto.jobs import JobSpec, Resources, Work

TARGET_P95_MS = 200.0
_WARMUP = 10
_REAL_JOBS = 20
_BATCH = 2000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``loom bench console``."""
    parser.add_argument("--jobs", type=int, default=10_000, help="finished jobs stored before measuring")
    parser.add_argument("--tenants", type=int, default=20)
    parser.add_argument("--incidents", type=int, default=200, help="incidents stored before measuring")
    parser.add_argument("--requests", type=int, default=200, help="requests per page")
    parser.add_argument("--topology", default="default")
    parser.add_argument("--json", action="store_true", help="print only the JSON result on stdout")


async def _fill(
    database_url: str, jobs: int, tenants: int, clusters: list[str], where: dict[str, tuple[str, str]]
) -> None:
    """Store finished jobs with their submitted/placed/started/completed events and a usage row
    each (``where``: cluster -> region, GPU model)."""
    conn = await asyncpg.connect(database_url)
    now = time.time()
    try:
        for start in range(0, jobs, _BATCH):
            batch = range(start, min(start + _BATCH, jobs))
            new = []
            events = []
            for i in batch:
                job_id = f"bench-{i:06d}"
                tenant = f"tenant-{i % tenants:02d}"
                at = now - (jobs - i) * 6.0
                spec = JobSpec(
                    job_id=job_id, tenant=tenant, resources=Resources(gpus=1 + i % 4), work=Work(steps=100)
                )
                new.append(repo.NewJob(job_id, tenant, _encode(spec), at, {}))
                cluster = clusters[i % len(clusters)]
                for k, kind in enumerate(("placed", "started", "completed")):
                    body = {
                        "kind": kind,
                        "job_id": job_id,
                        "tenant": tenant,
                        "cluster": cluster,
                        "attempt": 1,
                    }
                    events.append(
                        repo.JobEventRow(
                            job_id, kind, f"{job_id}:{kind}", json.dumps(body).encode(), at + k + 1
                        )
                    )
            usage = []
            for i in batch:
                cluster = clusters[i % len(clusters)]
                region, model = where[cluster]
                start_ms = round((now - (jobs - i) * 6.0 + 2) * 1000)
                usage.append(
                    (
                        f"bench-{i:06d}",
                        1,
                        0,
                        f"tenant-{i % tenants:02d}",
                        json.dumps({"team": f"team-{i % 7}"}),
                        cluster,
                        region,
                        model,
                        start_ms,
                        start_ms + 60_000 * (1 + i % 120),
                        1 + i % 4,
                        1.0,
                        2.5,
                        "failed" if i % 100 == 7 else "completed",
                    )
                )
            async with conn.transaction():
                await repo.insert_jobs(conn, new, submitted_events=True)
                await conn.executemany(
                    """INSERT INTO usage_rows (job_id, attempt, seq, tenant, labels, cluster, region,
                           gpu_model, start_ms, end_ms, gpus, scu_per_gpu, price_per_scu_hour, outcome)
                       VALUES ($1, $2, $3, $4, $5::jsonb, $6, $7, $8, $9, $10, $11, $12, $13, $14)""",
                    usage,
                )
                await repo.append_events(conn, events)
                await conn.execute(
                    """UPDATE jobs SET
                              state = CASE WHEN right(job_id, 2) = '07' THEN 'failed' ELSE 'completed' END,
                              cluster = ($2::text[])[1 + substr(job_id, 7)::int % cardinality($2::text[])],
                              attempt = 1,
                              progress = 1, placed_at = submitted_at + interval '1 second',
                              finished_at = submitted_at + interval '3 seconds'
                       WHERE job_id = ANY($1::text[])""",
                    [j.job_id for j in new],
                    clusters,
                )
        await conn.execute("ANALYZE jobs; ANALYZE job_events; ANALYZE usage_rows")
    finally:
        await conn.close()


async def _incidents(database_url: str, count: int, jobs: int, tenants: int, drained: str) -> str:
    """Store ``count`` incidents, each over 50 of the stored jobs, and drain one cluster; the
    newest incident's id."""
    now = time.time()
    records = []
    for n in range(count):
        hit = [(n * 37 + k * 11) % max(jobs, 1) for k in range(50)]
        affected = [AffectedJob(job_id=f"bench-{i:06d}", tenant=f"tenant-{i % tenants:02d}") for i in hit]
        records.append(
            IncidentChange(
                incident_id=f"inc-{n:05d}",
                change="resolved" if n < count - 5 else "opened",
                reason="bench",
                state="resolved" if n < count - 5 else "open",
                root_kind="cluster",
                root=drained,
                root_reason="every alert names it",
                severity="warning",
                summary=f"{drained} unhealthy",
                jobs=affected,
                jobs_total=len(affected),
                tenants=sorted({j.tenant for j in affected if j.tenant}),
                alerts=3,
                distinct_alerts=2,
                opened_at=now - (count - n) * 300.0,
                updated_at=now - (count - n) * 300.0 + 60,
                resolved_at=now - (count - n) * 300.0 + 120 if n < count - 5 else None,
                timeline=[TimelineEntry(at=now - (count - n) * 300.0, what=f"opened: {drained} unhealthy")],
            )
        )
    conn = await asyncpg.connect(database_url)
    try:
        await save_incidents(conn, records)
        await moves.start_drain(conn, drained, concurrency=2, deadline_s=0.0, forced=True)
    finally:
        await conn.close()
    return records[-1].incident_id if records else "inc-none"


def _encode(spec: JobSpec) -> bytes:
    import msgspec

    return msgspec.json.encode(spec)


async def _submit_real(nats_url: str, count: int) -> list[str]:
    """Jobs placed by the real placement service (so they have decision records)."""
    client = await LoomClient.connect(nats_url, name="bench-console")
    ids = []
    try:
        for i in range(count):
            spec = JobSpec(
                job_id=f"real-{i:03d}",
                tenant="tenant-00",
                resources=Resources(gpus=1),
                work=Work(steps=100, step_time_s=1.0),
            )
            admission = await client.submit_checked(spec, wait_s=10.0)
            if admission.outcome == "accepted":
                ids.append(spec.job_id)
    finally:
        await client.close()
    return ids


def _measure(url: str, token: str, path: str, requests: int) -> dict[str, Any]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=30)
    headers = {"Authorization": f"Bearer {token}"}
    samples: list[float] = []
    statuses: set[int] = set()
    size = 0
    try:
        for i in range(_WARMUP + requests):
            t0 = time.perf_counter()
            conn.request("GET", path, headers=headers)
            response = conn.getresponse()
            body = response.read()
            elapsed_ms = (time.perf_counter() - t0) * 1000
            statuses.add(response.status)
            size = len(body)
            if i >= _WARMUP:
                samples.append(elapsed_ms)
    finally:
        conn.close()
    values = np.array(samples)
    return {
        "p50_ms": round(float(np.percentile(values, 50)), 2),
        "p95_ms": round(float(np.percentile(values, 95)), 2),
        "p99_ms": round(float(np.percentile(values, 99)), 2),
        "max_ms": round(float(values.max()), 2),
        "bytes": size,
        "statuses": sorted(statuses),
    }


def run(args: argparse.Namespace, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Start a private stack, fill the store, measure every page, stop; the JSON result."""
    say = progress or (lambda _s: None)
    topology = load_topology(args.topology)
    clusters = sorted(c.id for c in topology.clusters)
    biggest = max(topology.clusters, key=lambda c: len(c.nodes))
    home = Path(tempfile.mkdtemp(prefix="loom-bench-console-", dir="/tmp"))
    os.chmod(home, 0o755)  # PostgreSQL runs as an unprivileged user when we are root
    env_backup = {k: os.environ.pop(k) for k in ("LOOM_NATS_URL", "LOOM_DATABASE_URL") if k in os.environ}
    try:
        say("starting the stack")
        state = stack.up(home, stack.StackOptions(topology=args.topology, time_scale=600.0), timeout_s=300.0)
        say(f"storing {args.jobs} jobs")
        where = {
            c.id: (c.region, next((n.gpu_model for n in c.nodes if n.gpu_model), "none"))
            for c in topology.clusters
        }
        asyncio.run(_fill(state["database_url"], args.jobs, args.tenants, clusters, where))
        say("submitting real jobs")
        real = asyncio.run(_submit_real(state["nats_url"], _REAL_JOBS))
        say(f"storing {args.incidents} incidents, draining {biggest.id}")
        incident = asyncio.run(
            _incidents(state["database_url"], args.incidents, args.jobs, args.tenants, biggest.id)
        )
        tokens = load_tokens(home)
        url = state["console_url"]
        job = real[0] if real else "bench-000000"
        pages = {
            "map": "/",
            "resources": "/resources",
            "cluster nodes": f"/resources/{biggest.region}/{biggest.zone}/{biggest.id}",
            "jobs": "/jobs",
            "jobs, failed": "/jobs?state=failed",
            "jobs, 1000 rows": "/jobs?limit=1000",
            "job": f"/jobs/{job}",
            "queue": "/queue",
            "cancel confirmation": f"/jobs/{job}/cancel",
            "drain confirmation": f"/clusters/{biggest.id}/undrain",
            "incidents": "/incidents",
            "incident": f"/incidents/{incident}",
            "usage": "/usage",
            "usage by model": "/usage?by=model",
            "usage CSV": "/usage.csv?by=label:team",
        }
        measured: dict[str, Any] = {}
        for name, path in pages.items():
            say(f"page {name}")
            measured[name] = {"path": path, **_measure(url, tokens.operator, path, args.requests)}
        for name, path in (("jobs", "/jobs"), ("incidents", "/incidents"), ("usage", "/usage")):
            say(f"page {name} (tenant)")
            measured[f"{name} (tenant)"] = {
                "path": path,
                **_measure(url, tokens.tenant_token("tenant-03"), path, args.requests),
            }
        services = len(state["services"])
        security = stack_security(home)
    finally:
        say("stopping the stack")
        stack.down(home)
        os.environ.update(env_backup)
        shutil.rmtree(home, ignore_errors=True)
    default_pages = {k: v for k, v in measured.items() if k != "jobs, 1000 rows"}
    worst = max(v["p95_ms"] for v in default_pages.values())
    return {
        "benchmark": "console",
        "security": security,
        "topology": args.topology,
        "services": services,
        "jobs_in_store": args.jobs + len(real),
        "usage_rows_in_store": args.jobs,
        "incidents_in_store": args.incidents,
        "tenants": args.tenants,
        "requests_per_page": args.requests,
        "cpus": os.cpu_count(),
        "pages": measured,
        "worst_p95_ms": worst,
        "target_p95_ms": TARGET_P95_MS,
        "meets_target": worst <= TARGET_P95_MS and all(v["statuses"] == [200] for v in measured.values()),
        "note": "worst_p95_ms leaves out 'jobs, 1000 rows' (ten times the default page size)",
    }


def main(args: argparse.Namespace) -> int:
    """``loom bench console``: JSON on stdout, a table on stderr unless ``--json``."""
    from rich.console import Console
    from rich.table import Table

    console = Console(stderr=True)
    with console.status("console benchmark…") as status:
        result = run(args, progress=lambda s: status.update(f"console benchmark: {s}"))
    print(json.dumps(result, indent=2))
    sys.stdout.flush()
    if not args.json:
        table = Table(title=f"console pages, {result['jobs_in_store']} jobs in the store")
        for column in ("page", "p50 ms", "p95 ms", "p99 ms", "max ms", "bytes"):
            table.add_column(column)
        for name, page in result["pages"].items():
            table.add_row(name, *(str(page[k]) for k in ("p50_ms", "p95_ms", "p99_ms", "max_ms", "bytes")))
        console.print(table)
    return 0
