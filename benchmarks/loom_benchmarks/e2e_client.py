"""``python -m loom_benchmarks.e2e_client``: the CPU the ``loom bench e2e`` client spends per
submission, one by one (256 publishes in flight, each awaiting its ack) against batched
(:meth:`loom_benchmarks.e2e._Run.submit_batch`: ``BURST_BATCH`` at once, acks awaited together).

A private JetStream-enabled ``nats-server`` (no other service: nothing consumes the submissions);
the figure is this process's ``time.process_time`` per job, so the machine's load matters less
than it does to rates. The client's CPU counts in ``loom bench e2e``'s CPU per placed job over
every process, in the Loom run and the baseline alike.
"""

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from loom.bus.connection import connect, ensure_streams
from loom.client import LoomClient
from loom.runtime.servers import NatsServer
from loom_benchmarks.e2e import BURST_BATCH, _job, _Run


async def _measure(url: str, jobs: int, rounds: int) -> dict[str, Any]:
    nc = await connect(url, "loom-bench-setup")
    await ensure_streams(nc.jetstream())
    await nc.close()
    client = await LoomClient.connect(url, name="loom-bench")
    run = _Run(client)
    one_by_one: list[float] = []
    batched: list[float] = []
    in_flight = asyncio.Semaphore(256)
    batches = asyncio.Semaphore(2)

    async def one(i: int, prefix: str) -> None:
        async with in_flight:
            await run.submit_loom(_job(prefix, i))

    async def batch(first: int, prefix: str) -> None:
        async with batches:
            last = min(first + BURST_BATCH, jobs)
            await run.submit_batch([_job(prefix, i) for i in range(first, last)])

    try:
        for r in range(rounds):
            t = time.process_time()
            await asyncio.gather(*(one(i, f"one{r}") for i in range(jobs)))
            one_by_one.append((time.process_time() - t) * 1000 / jobs)
            t = time.process_time()
            await asyncio.gather(*(batch(k, f"batch{r}") for k in range(0, jobs, BURST_BATCH)))
            batched.append((time.process_time() - t) * 1000 / jobs)
    finally:
        await client.close()
    return {
        "benchmark": "e2e_client",
        "jobs": jobs,
        "rounds": rounds,
        "one_by_one_ms_per_job": round(statistics.median(one_by_one), 4),
        "batched_ms_per_job": round(statistics.median(batched), 4),
        "one_by_one_all": [round(v, 4) for v in one_by_one],
        "batched_all": [round(v, 4) for v in batched],
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m loom_benchmarks.e2e_client [--jobs N] [--rounds R] [--json]``."""
    parser = argparse.ArgumentParser(prog="python -m loom_benchmarks.e2e_client", description=__doc__)
    parser.add_argument("--jobs", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3, help="alternated rounds of each (median)")
    parser.add_argument("--json", action="store_true", help="print the JSON result on one line")
    args = parser.parse_args(argv)
    with NatsServer(Path(tempfile.mkdtemp(prefix="loom-bench-client-"))) as server:
        result = asyncio.run(_measure(server.url, args.jobs, args.rounds))
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
