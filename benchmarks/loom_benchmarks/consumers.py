"""``python -m loom_benchmarks.consumers``: CPU per job of the job-event consumers outside placement.

The handlers of metrics' metering consumer (``placed`` and ``started`` of every job) and of
migration's job-event consumer (``started``) are called directly, in this process, on batches of
``--batch`` events of ``--jobs`` jobs, against a private durable PostgreSQL (fsync on): what the
consumers cost per job in this process (``time.process_time``) and in PostgreSQL (its processes'
CPU from ``/proc``), independent of the machine's load in a way rates are not. No NATS: the
ConsumerRunner's own cost per message is not in these figures.
"""

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from opentelemetry import trace

from loom.bus import Delivery
from loom.runtime.servers import PostgresServer
from loom.store.migrations import migrate_url
from loom.store.pool import create_pool
from loom_proto import subjects
from loom_proto.codec import encode
from loom_proto.jobs import JobPlaced, JobStarted, NodeAllocation
from loom_services.metrics.metering import Metering
from loom_services.migration.service import MigrationService


def _postgres_cpu_ms(data_dir: Path) -> float:
    """CPU (user + system) of the processes of the PostgreSQL whose data is under ``data_dir``."""
    ticks = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if b"postgres" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                continue
            if str(data_dir) not in os.readlink(f"/proc/{pid}/cwd"):
                continue
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])
        except OSError:
            continue
    return ticks * 1000 / os.sysconf("SC_CLK_TCK")


def _deliveries(events: list[tuple[str, Any]], first_seq: int) -> list[Delivery[bytes]]:
    tracer = trace.get_tracer("loom.bench.consumers")
    return [
        Delivery(
            msg=None,  # type: ignore[arg-type]  # the handlers never touch the NATS message
            subject=subjects.job_event("started", "bench"),  # the handlers read the payload only
            message=encode(event),
            headers={},
            msg_id=msg_id,
            num_delivered=1,
            stream_seq=first_seq + i,
            span=tracer.start_span("bench"),
        )
        for i, (msg_id, event) in enumerate(events)
    ]


async def _run(jobs: int, batch: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as home, PostgresServer(Path(home) / "pg", durable=True) as server:
        await migrate_url(server.url)
        pool = await create_pool(server.url, max_size=2)
        try:
            await pool.executemany(
                "INSERT INTO jobs (job_id, tenant, state, spec, submitted_at) "
                "VALUES ($1, 'bench', 'running', $2::jsonb, now())",
                [
                    (f"j{i}", json.dumps({"labels": {"team": "t"}, "task_type": "inference"}))
                    for i in range(jobs)
                ],
            )
            t0 = 1_780_000_000.0
            placed = [
                (
                    f"j{i}:placed:1",
                    JobPlaced(
                        job_id=f"j{i}",
                        tenant="bench",
                        cluster="c1",
                        region="r1",
                        gpu_model="A100",
                        allocations=[NodeAllocation("n1", 1)],
                        placed_at=t0,
                    ),
                )
                for i in range(jobs)
            ]
            started = [
                (
                    f"j{i}:started:1",
                    JobStarted(job_id=f"j{i}", tenant="bench", cluster="c1", started_at=t0 + 1),
                )
                for i in range(jobs)
            ]
            ctx: Any = SimpleNamespace(db=pool, publisher=None, stats={})
            metering = Metering(ctx, lambda _region, _at: 2.0)
            migration = MigrationService(ctx)
            out: dict[str, Any] = {}
            for name, handler, events in (
                ("metering", metering.on_events, placed + started),
                ("migration", migration.on_job_events, started),
            ):
                batches = [_deliveries(events[k : k + batch], k) for k in range(0, len(events), batch)]
                pg_before, cpu_before = _postgres_cpu_ms(server.data_dir), time.process_time()
                for deliveries in batches:
                    outcomes = await handler(deliveries)
                    if any(o is not None for o in outcomes):
                        raise RuntimeError(f"{name}: a delivery failed: {outcomes}")
                cpu_after, pg_after = time.process_time(), _postgres_cpu_ms(server.data_dir)
                out[name] = {
                    "process_ms_per_job": round((cpu_after - cpu_before) * 1000 / jobs, 4),
                    "postgres_ms_per_job": round((pg_after - pg_before) / jobs, 4),
                }
        finally:
            await pool.close()
    return {"benchmark": "consumers", "jobs": jobs, "batch": batch, **out}


def main(argv: list[str] | None = None) -> int:
    """``python -m loom_benchmarks.consumers [--jobs N] [--batch B] [--json]``: not under ``loom
    bench``, because it calls the services' handlers in-process and the CLI (a library) may not
    import services (the import contract)."""
    parser = argparse.ArgumentParser(prog="python -m loom_benchmarks.consumers", description=__doc__)
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=50, help="events per handled batch")
    parser.add_argument("--json", action="store_true", help="print the JSON result on one line")
    args = parser.parse_args(argv)
    result = asyncio.run(_run(args.jobs, args.batch))
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
