"""``loom bench e2e``: placements per second and submit -> placed latency through the real stack.

A private stack (its own NATS, PostgreSQL and service processes, in a temporary home) is
started; jobs are published as raw events exactly as any client would, and the ``JobPlaced``
events are observed on the bus. Latency is measured from the client's publish to the arrival
of the placed event at the same client (one clock). Jobs are long, so the clusters' only work
during the measurement is starting them.

``--shards N`` starts N placement shards (the topology's regions split by GPUs,
:func:`loom.runtime.stack.placement_groups`) and gives every job a one-region affinity, regions
taken in proportion to their GPUs (:func:`_regions`), so the jobs spread over the shards; give
``--shards 1`` for the single-shard figure with the same jobs.
"""

import argparse
import asyncio
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from loom.client import LoomClient
from loom.model.topology import load_topology
from loom.runtime import stack
from loom_proto import subjects
from loom_proto.codec import decode
from loom_proto.jobs import Affinity, JobPlaced, JobSpec, Resources, Work


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(round(q / 100 * (len(ordered) - 1)), len(ordered) - 1)
    return ordered[index]


def _job(prefix: str, i: int, regions: list[str] | None = None) -> JobSpec:
    return JobSpec(
        job_id=f"{prefix}-{i}",
        tenant="bench",
        task_type="inference",
        resources=Resources(gpus=1),
        work=Work(steps=1, step_time_s=86_400.0),
        affinity=Affinity(regions=[regions[i % len(regions)]]) if regions else Affinity(),
    )


def _regions(topology: str) -> list[str]:
    """Regions in proportion to their GPUs (one entry per 50 GPUs, at least one), interleaved:
    job ``i`` is allowed in entry ``i % len``."""
    gpus: dict[str, int] = {}
    for cluster in load_topology(topology).clusters:
        gpus[cluster.region] = gpus.get(cluster.region, 0) + sum(n.gpus for n in cluster.nodes)
    slots = sorted(
        ((k + 0.5) / max(round(g / 50), 1), region)
        for region, g in gpus.items()
        for k in range(max(round(g / 50), 1))
    )
    return [region for _, region in slots]


# PLR0915: warm-up, throughput and paced phases share clocks and subscription.
async def _measure(  # noqa: PLR0915
    nats_url: str, jobs: int, rate: float, paced_jobs: int, regions: list[str] | None = None
) -> dict[str, Any]:
    client = await LoomClient.connect(nats_url, name="loom-bench")
    sent: dict[str, float] = {}
    placed: dict[str, float] = {}
    waiter: dict[str, asyncio.Event] = {}
    warm = sorted(set(regions)) if regions else [""]  # every shard warmed up
    expected: dict[str, int] = {"warm": len(warm), "tp": jobs, "paced": paced_jobs}
    seen: dict[str, int] = {}

    async def on_placed(msg: Any) -> None:
        now = time.perf_counter()
        event = decode(msg.data, JobPlaced)
        if event.job_id in placed:
            return
        placed[event.job_id] = now
        prefix = event.job_id.split("-", 1)[0]
        seen[prefix] = seen.get(prefix, 0) + 1
        if seen[prefix] == expected.get(prefix) and prefix in waiter:
            waiter[prefix].set()

    waiter.update({prefix: asyncio.Event() for prefix in expected})
    sub = await client.nc.subscribe(subjects.JOBS_PLACED_ALL, cb=on_placed)
    try:
        # Warm up: the first placement needs the capacity view; wait until one job goes through.
        for i in range(len(warm)):
            sent[f"warm-{i}"] = time.perf_counter()
            await client.submit(_job("warm", i, warm if regions else None))
        await asyncio.wait_for(waiter["warm"].wait(), timeout=60)

        # Throughput: everything at once, 256 publishes in flight.
        sem = asyncio.Semaphore(256)

        async def submit(prefix: str, i: int) -> None:
            async with sem:
                spec = _job(prefix, i, regions)
                sent[spec.job_id] = time.perf_counter()
                await client.submit(spec)

        t0 = time.perf_counter()
        await asyncio.gather(*(submit("tp", i) for i in range(jobs)))
        t_published = time.perf_counter()
        await asyncio.wait_for(waiter["tp"].wait(), timeout=max(120.0, jobs / 20))
        t_done = max(placed[f"tp-{i}"] for i in range(jobs))
        tp_lat = [(placed[f"tp-{i}"] - sent[f"tp-{i}"]) * 1000 for i in range(jobs)]
        result: dict[str, Any] = {
            "jobs": jobs,
            "placements_per_s": round(jobs / (t_done - t0), 1),
            "publish_per_s": round(jobs / (t_published - t0), 1),
            "burst_latency_ms_p50": round(_percentile(tp_lat, 50), 2),
            "burst_latency_ms_p99": round(_percentile(tp_lat, 99), 2),
        }

        if paced_jobs:
            # Steady state first: the burst's jobs are all started (their agents and the lifecycle
            # consumers have caught up), so the paced phase measures 50 jobs/s, not the backlog.
            settle_start = time.perf_counter()
            while time.perf_counter() - settle_start < 120:
                counts = await client.counts()
                if counts.get("running", 0) >= jobs + len(warm):
                    break
                await asyncio.sleep(0.25)
            result["settle_s"] = round(time.perf_counter() - settle_start, 2)
            await asyncio.sleep(1.0)
            interval = 1.0 / rate
            start = time.perf_counter()
            for i in range(paced_jobs):
                delay = start + i * interval - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                spec = _job("paced", i, regions)
                sent[spec.job_id] = time.perf_counter()
                await client.submit(spec)
            await asyncio.wait_for(waiter["paced"].wait(), timeout=60)
            lat = [(placed[f"paced-{i}"] - sent[f"paced-{i}"]) * 1000 for i in range(paced_jobs)]
            result.update(
                {
                    "paced_rate_per_s": rate,
                    "paced_jobs": paced_jobs,
                    "paced_latency_ms_p50": round(_percentile(lat, 50), 2),
                    "paced_latency_ms_p99": round(_percentile(lat, 99), 2),
                    "paced_latency_ms_mean": round(statistics.fmean(lat), 2),
                }
            )
        return result
    finally:
        await sub.unsubscribe()
        await client.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start a private stack, measure, stop it."""
    home = Path(tempfile.mkdtemp(prefix="loom-bench-", dir="/tmp"))
    os.chmod(home, 0o755)  # PostgreSQL runs as an unprivileged user when we are root
    env_backup = {k: os.environ.pop(k) for k in ("LOOM_NATS_URL", "LOOM_DATABASE_URL") if k in os.environ}
    try:
        options = stack.StackOptions(
            topology=args.topology,
            time_scale=1.0,
            heartbeat_s=2.0,
            durable=True,
            network=not args.without_network,
            placement_shards=args.shards or 1,
        )
        state = stack.up(home, options)
        started = time.time()
        regions = _regions(args.topology) if args.shards else None
        result = asyncio.run(_measure(state["nats_url"], args.jobs, args.rate, args.paced_jobs, regions))
        result.update(
            {
                "benchmark": "e2e",
                "topology": args.topology,
                "services": len(state["services"]),
                "placement_shards": args.shards or 1,
                "placement_groups": stack.placement_groups(options),
                "network_services": not args.without_network,
                "cpu_cores": os.cpu_count(),
                "nats_sync": "always",
                "postgres_durable": True,
                "wall_s": round(time.time() - started, 1),
            }
        )
        return result
    finally:
        stack.down(home)
        os.environ.update(env_backup)
        shutil.rmtree(home, ignore_errors=True)
