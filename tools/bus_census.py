"""Messages on the bus per placed job, by connection and by subject, through the real stack.

Starts the same private stack as ``loom bench e2e`` (time scale 1, heartbeats every 2 s, durable,
network services on), places one warm-up job, then submits ``--jobs`` long jobs at once and waits
until they all run (placement's view) and the stack has been quiet for ``--settle-s``. Between two
readings of the NATS server's ``/connz`` it reports each connection's messages in and out per job,
and a ``>`` subscriber (its own connection, not counted) counts the messages per subject family
(the job-specific tokens folded). JSON on stdout.

    .venv/bin/python tools/bus_census.py --jobs 1000
"""

import argparse
import asyncio
import json
import os
import re
import shutil
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

from loom.client import LoomClient
from loom.runtime import stack
from loom_benchmarks.e2e import _job, _Run
from loom_proto import subjects

_VOLATILE = re.compile(r"(_INBOX\.[^.]+|\b[0-9a-f]{8,}\b|\d+)")


def _family(subject: str) -> str:
    """A subject with its per-message tokens (inboxes, ids, numbers) folded."""
    if subject.startswith("$JS.ACK."):
        return "$JS.ACK." + subject.split(".")[2] + "." + subject.split(".")[3]
    if subject.startswith("_INBOX."):
        return "_INBOX"
    return _VOLATILE.sub("*", subject)


def _connz(monitor: str) -> dict[str, dict[str, int]]:
    with urllib.request.urlopen(f"{monitor}/connz?limit=4096", timeout=5) as reply:
        data = json.load(reply)
    out: dict[str, dict[str, int]] = {}
    for conn in data.get("connections", []):
        name = conn.get("name") or f"cid-{conn['cid']}"
        entry = out.setdefault(name, {"in_msgs": 0, "out_msgs": 0, "in_bytes": 0, "out_bytes": 0})
        for key in entry:
            entry[key] += int(conn.get(key, 0))
    return out


def _monitor_url(home: Path) -> str:
    for conf in home.rglob("nats.conf"):
        match = re.search(r'^http:\s*"?([^"\n]+)"?', conf.read_text(), re.MULTILINE)
        if match:
            host_port = match.group(1)
            return "http://" + host_port.replace("0.0.0.0", "127.0.0.1")
    raise SystemExit("no nats.conf with a monitoring port")


async def _census(
    nats_url: str, monitor: str, jobs: int, settle_s: float, rate: float = 0.0
) -> dict[str, Any]:
    client = await LoomClient.connect(nats_url, name="census-client")
    spy = await LoomClient.connect(nats_url, name="census-spy")
    run = _Run(client)
    families: Counter[str] = Counter()
    counting = False

    async def count(msg: Any) -> None:
        if counting:
            families[_family(msg.subject)] += 1

    await client.nc.subscribe(subjects.JOBS_PLACED_ALL, cb=run.on_placed)
    await spy.nc.subscribe(">", cb=count)
    warm = run.expect("warm", 1)
    await run.submit_loom(_job("warm", 0))
    await asyncio.wait_for(warm.wait(), timeout=60)
    await asyncio.sleep(3.0)
    before = await asyncio.to_thread(_connz, monitor)
    counting = True
    t0 = time.perf_counter()
    if rate > 0:
        # One by one at ``rate`` a second, each ack awaited (the bench's paced phase).
        await run.paced("tp", jobs, rate, run.submit_loom)
    else:
        done = run.expect("tp", jobs)
        for first in range(0, jobs, 256):
            await run.submit_batch([_job("tp", i) for i in range(first, min(first + 256, jobs))])
        await asyncio.wait_for(done.wait(), timeout=600)
    t_placed = time.perf_counter() - t0
    while (await client.counts()).get("running", 0) < jobs + 1:  # noqa: ASYNC110 - polls a query
        await asyncio.sleep(0.25)
    await asyncio.sleep(settle_s)
    counting = False
    after = await asyncio.to_thread(_connz, monitor)
    health = {}
    for name in ("migration", "placement", "placement-standby", "metrics"):
        try:
            reply = await client.nc.request(subjects.service_health(name), b"", timeout=2.0)
            health[name] = json.loads(reply.data)
        except Exception as exc:
            health[name] = {"error": repr(exc)}
    elapsed = time.perf_counter() - t0
    per_conn = {}
    for name, now in after.items():
        if name.startswith("census-spy"):
            continue
        then = before.get(name, {})
        diff = {k: round((v - then.get(k, 0)) / jobs, 2) for k, v in now.items() if k.endswith("msgs")}
        if any(diff.values()):
            per_conn[name] = diff
    await spy.close()
    await client.close()
    return {
        "jobs": jobs,
        "placed_s": round(t_placed, 2),
        "window_s": round(elapsed, 2),
        "msgs_per_job_by_connection": dict(sorted(per_conn.items(), key=lambda kv: -kv[1]["in_msgs"])),
        "msgs_per_job_total_in": round(sum(v["in_msgs"] for v in per_conn.values()), 2),
        "health": health,
        "msgs_per_job_by_subject": {
            k: round(v / jobs, 3) for k, v in families.most_common() if v / jobs >= 0.01
        },
    }


def main() -> None:
    """Start a private stack, count, stop it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--settle-s", type=float, default=5.0)
    parser.add_argument("--rate", type=float, default=0.0, help="jobs a second, one by one (0: all at once)")
    parser.add_argument("--topology", default="default")
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="loom-census-", dir="/tmp"))
    os.chmod(home, 0o755)
    for key in ("LOOM_NATS_URL", "LOOM_DATABASE_URL"):
        os.environ.pop(key, None)
    try:
        options = stack.StackOptions(topology=args.topology, time_scale=1.0, heartbeat_s=2.0, durable=True)
        state = stack.up(home, options)
        result = asyncio.run(
            _census(state["nats_url"], _monitor_url(home), args.jobs, args.settle_s, args.rate)
        )
        print(json.dumps(result, indent=1))
    finally:
        stack.down(home)
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
