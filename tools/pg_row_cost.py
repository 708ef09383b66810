"""What inserting a text row costs PostgreSQL by its size (issue 13: the decision records).

Starts a durable embedded PostgreSQL (as ``loom up`` does), then for each size inserts 2,000 rows
of that much text in batches of 200 through one ``unnest`` statement a transaction, as placement
writes its decision records, twice per size, and prints the wall time per row. Rows past ~2 KB go
through TOAST (compressed or moved out of line), which is where the cost jumps::

    .venv/bin/python tools/pg_row_cost.py --sizes 40,1500,1900,2100,2450,3000
"""

import argparse
import asyncio
import json
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

import asyncpg

from loom.runtime.servers import PostgresServer


async def _measure(url: str, sizes: list[int], batches: int, rows: int) -> list[dict[str, float]]:
    conn = await asyncpg.connect(url)
    out: list[dict[str, float]] = []
    try:
        await conn.execute(
            "CREATE TABLE row_cost (job_id text, attempt int, outcome text, record text,"
            " at timestamptz DEFAULT now(), PRIMARY KEY (job_id, attempt))"
        )
        rng = random.Random(7)
        text = json.dumps({"x": [round(rng.random() * 100, 2) for _ in range(2000)]})
        for size in sizes:
            for rep in range(2):
                await conn.execute("TRUNCATE row_cost")
                spent = 0.0
                for b in range(batches):
                    ids = [f"j{size}-{rep}-{b}-{i}" for i in range(rows)]
                    t0 = time.perf_counter()
                    async with conn.transaction():
                        await conn.execute(
                            "INSERT INTO row_cost (job_id, attempt, outcome, record)"
                            " SELECT j, 1, 'placed', r FROM unnest($1::text[], $2::text[]) AS u(j, r)",
                            ids,
                            [text[:size]] * rows,
                        )
                    spent += time.perf_counter() - t0
                per_row_us = round(spent / (batches * rows) * 1e6, 1)
                out.append({"bytes": size, "run": rep, "us_per_row": per_row_us})
    finally:
        await conn.close()
    return out


def main() -> None:
    """Start a server, measure, stop it; JSON lines on stdout."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="40,1500,1900,2100,2450,3000")
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--rows", type=int, default=200)
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="loom-rowcost-", dir="/tmp"))
    os.chmod(home, 0o755)
    server = PostgresServer(home / "pg", durable=True)
    try:
        server.start()
        sizes = [int(s) for s in args.sizes.split(",") if s]
        for line in asyncio.run(_measure(server.url, sizes, args.batches, args.rows)):
            print(json.dumps(line))
    finally:
        server.stop()
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
