"""Does the migration service's what-if load starve placement? (issue 15, backflow / drain reviews)

``python -m loom_benchmarks.whatif_load [--json]``: a private stack (``loom up``'s services, no
probe collectors) runs ``--running`` one-GPU jobs; then ``--probes`` short jobs are submitted
one every ``--every`` seconds and each one's placement latency (``placed_at - submitted_at`` in
the store) is measured twice: on a quiet placement service, and while a review of every running
job is under way — ``loom.placement.whatif`` requests for the running jobs, one after the other
(``--reviewers`` of them in parallel), as the migration service sends them in a drain, backflow
or link review. Reported: placement latency p50 / p99 / max in both phases, the what-ifs
answered and their answer time.
"""

import argparse
import asyncio
import json
import os
import sys
import time
from typing import Any

import asyncpg

from loom.client import LoomClient
from loom_benchmarks.private_stack import measure_on_private_stack
from loom_proto import subjects
from loom_proto.jobs import JobSpec, Resources, Work


def _quantiles(values: list[float]) -> dict[str, float | int | None]:
    if not values:
        return {"n": 0, "p50": None, "p99": None, "max": None, "mean": None}
    ordered = sorted(values)

    def q(p: float) -> float:
        return round(ordered[min(int(p * len(ordered)), len(ordered) - 1)], 4)

    return {
        "n": len(values),
        "p50": q(0.5),
        "p99": q(0.99),
        "max": round(ordered[-1], 4),
        "mean": round(sum(values) / len(values), 4),
    }


async def _placement_latencies(
    client: LoomClient, db: asyncpg.Connection, prefix: str, probes: int, every: float
) -> list[float]:
    work = Work(steps=2, step_time_s=1.0, checkpoint_every_steps=0)
    ids = []
    for i in range(probes):
        spec = JobSpec(job_id=f"{prefix}-{i}", tenant="bench", resources=Resources(gpus=1), work=work)
        await client.submit(spec)
        ids.append(spec.job_id)
        await asyncio.sleep(every)
    deadline = time.monotonic() + 60
    rows: list[asyncpg.Record] = []
    while time.monotonic() < deadline:
        rows = await db.fetch(
            "SELECT job_id, submitted_at, placed_at FROM jobs WHERE job_id = ANY($1::text[])", ids
        )
        if len(rows) == len(ids) and all(r["placed_at"] is not None for r in rows):
            break
        await asyncio.sleep(0.5)
    return [(r["placed_at"] - r["submitted_at"]).total_seconds() for r in rows if r["placed_at"] is not None]


async def _review(client: LoomClient, job_ids: list[str], stop: asyncio.Event, answers: list[float]) -> None:
    """What-ifs for the running jobs one after the other, round after round, until ``stop``."""
    while not stop.is_set():
        for job_id in job_ids:
            if stop.is_set():
                return
            t = time.perf_counter()
            try:
                reply = await client.nc.request(
                    subjects.PLACEMENT_WHATIF, json.dumps({"job_id": job_id}).encode(), timeout=5
                )
                if json.loads(reply.data).get("ok"):
                    answers.append(time.perf_counter() - t)
            except Exception:
                await asyncio.sleep(0.01)


async def _measure(state: dict[str, Any], args: argparse.Namespace, say: Any) -> dict[str, Any]:
    client = await LoomClient.connect(state["nats_url"])
    db = await asyncpg.connect(state["database_url"])
    try:
        work = Work(steps=100_000, step_time_s=1.0, checkpoint_every_steps=100)
        running = [
            JobSpec(job_id=f"wl-run-{i}", tenant="bench", resources=Resources(gpus=1), work=work)
            for i in range(args.running)
        ]
        for spec in running:
            await client.submit(spec)
        ids = [s.job_id for s in running]
        say(f"{len(ids)} jobs submitted; waiting for them to run")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            n = await db.fetchval(
                "SELECT count(*) FROM jobs WHERE job_id = ANY($1::text[]) AND state = 'running'", ids
            )
            if n == len(ids):
                break
            await asyncio.sleep(0.5)
        say("quiet phase")
        quiet = await _placement_latencies(client, db, "wl-quiet", args.probes, args.every)
        say("review phase")
        stop = asyncio.Event()
        answers: list[float] = []
        reviewers = [asyncio.create_task(_review(client, ids, stop, answers)) for _ in range(args.reviewers)]
        await asyncio.sleep(1.0)
        t0 = time.perf_counter()
        loaded = await _placement_latencies(client, db, "wl-review", args.probes, args.every)
        review_s = time.perf_counter() - t0
        stop.set()
        await asyncio.gather(*reviewers)
        return {
            "running_jobs": len(ids),
            "probes": args.probes,
            "every_s": args.every,
            "reviewers": args.reviewers,
            "placement_latency_quiet_s": _quantiles(quiet),
            "placement_latency_under_review_s": _quantiles(loaded),
            "whatifs_answered": len(answers),
            "whatifs_per_s": round(len(answers) / max(review_s + 1.0, 1e-9), 1),
            "whatif_answer_s": _quantiles(answers),
        }
    finally:
        await db.close()
        await client.close()


def run(args: argparse.Namespace, progress: Any = None) -> dict[str, Any]:
    """Start a private stack, measure, stop it; the JSON result."""
    say = progress or (lambda _s: None)
    t0 = time.perf_counter()
    measured = measure_on_private_stack("whatif", args, _measure, say)
    load = os.getloadavg()
    return {
        "benchmark": "whatif_load",
        **measured,
        "wall_s": round(time.perf_counter() - t0, 1),
        "machine": {
            "cpus": os.cpu_count(),
            "python": sys.version.split()[0],
            "loadavg": [round(x, 1) for x in load],
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", default="default")
    parser.add_argument("--running", type=int, default=60, help="running jobs the review looks at")
    parser.add_argument(
        "--probes", type=int, default=40, help="jobs whose placement latency is measured per phase"
    )
    parser.add_argument("--every", type=float, default=0.25, help="seconds between two of them")
    parser.add_argument(
        "--reviewers", type=int, default=1, help="reviews at once (one what-if in flight each)"
    )
    parser.add_argument("--time-scale", type=float, default=60.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = run(args, progress=None if args.json else lambda s: print(s, file=sys.stderr))
    print(json.dumps(result, indent=None if args.json else 2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
