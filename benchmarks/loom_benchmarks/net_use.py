"""What probing the links in use costs a probe collector: CPU at rest, and with links in use.

``python -m loom_benchmarks.net_use [--seconds 30] [--links 1 2] [--json]``: a NATS server of its
own, the probe responders of the "small" topology's clusters and the westeurope collector (its
emulated relays in its own event loop, as in the stack), in this process. The collector's CPU is
the event loop thread's (``time.thread_time``: probes, relays, samples; the responders' echo
threads are counted apart, as ``echo_threads_pct``). It is measured for ``--seconds`` with no link
in use (the platform at rest), then for each ``--links`` count with that many of the collector's
links announced in use on ``loom.net.use`` (as the migration service announces the links running
jobs span), each getting its extra probes (:mod:`loom.net.intensity`); ``--direct`` probes the
responders without the emulated relays (a real WAN: the relays' work is then not the collector's,
nor is their bandwidth cap on a tick's probes). CPU is in % of one core;
a shared host adds noise, so compare runs taken together.
"""

import argparse
import asyncio
import contextlib
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from loom.model.topology import load_topology
from loom.runtime.servers import NatsServer
from loom.runtime.service import close_context, open_context
from loom_proto import subjects
from loom_proto.codec import encode
from loom_proto.net import LinkInUse, LinksInUse
from loom_services.cluster_agent.probes import ProbeResponder
from loom_services.probe_collector.collector import CollectorConfig, ProbeCollector

REGION = "azure-westeurope"


async def _measure(seconds: float) -> dict[str, float]:
    wall, loop_cpu, all_cpu = time.monotonic(), time.thread_time(), time.process_time()
    await asyncio.sleep(seconds)  # the measurement window
    wall = time.monotonic() - wall
    loop_pct = 100.0 * (time.thread_time() - loop_cpu) / wall
    all_pct = 100.0 * (time.process_time() - all_cpu) / wall
    return {"collector_loop_pct": round(loop_pct, 2), "echo_threads_pct": round(all_pct - loop_pct, 2)}


async def run(seconds: float, links: list[int], *, emulate: bool = True) -> dict[str, Any]:
    """The collector's CPU at rest, then with each count of links in use; its probe counts."""
    topology = load_topology("small")
    with tempfile.TemporaryDirectory() as tmp, NatsServer(Path(tmp)) as server:
        agents = await open_context("agents", nats_url=server.url, database_url=None)
        responders = [
            await ProbeResponder(agents, cluster=c.id, region=c.region).start() for c in topology.clusters
        ]
        ctx = await open_context(f"probe-{REGION}", nats_url=server.url, database_url=None)
        collector = ProbeCollector(
            ctx, topology, REGION, CollectorConfig(bandwidth_every_s=0.0, emulate=emulate)
        )
        task = asyncio.create_task(collector.run())
        peers = sorted(collector.links)
        try:
            for _ in range(300):  # the peers' discovery: at most 30 s
                if len(collector.probing) == len(peers):
                    break
                await asyncio.sleep(0.1)  # polling the collector's state, bounded
            await asyncio.sleep(3.0)  # settle: a few periods of steady probing
            out: dict[str, Any] = {
                "seconds": seconds,
                "emulate": emulate,
                "peers": peers,
                "at_rest": await _measure(seconds),
            }
            for count in links:
                used = peers[:count]
                announce = LinksInUse(
                    links=[LinkInUse(src=REGION, dst=dst) for dst in used], ttl_s=3600.0, at=time.time()
                )
                await agents.nc.publish(subjects.NET_USE, encode(announce))
                await asyncio.sleep(2.0)  # the next period plans the extra probes
                before = dict(collector.counts)
                measured = await _measure(seconds)
                sent = collector.counts["dense_probes_sent"] - before["dense_probes_sent"]
                lost = collector.counts["dense_probes_lost"] - before["dense_probes_lost"]
                out[f"links_in_use_{count}"] = {
                    **measured,
                    "links": used,
                    "extra_probes_per_s": round(sent / seconds, 1),
                    "extra_probes_lost": lost,
                }
            empty = LinksInUse(links=[], ttl_s=3600.0, at=time.time())
            await agents.nc.publish(subjects.NET_USE, encode(empty))
            await asyncio.sleep(2.0)
            out["at_rest_after"] = await _measure(seconds)
            return out
        finally:
            ctx.stopping.set()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, timeout=15)
            await close_context(ctx)
            for responder in responders:
                await responder.close()
            await close_context(agents)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--links", type=int, nargs="*", default=[1, 2])
    parser.add_argument(
        "--direct", action="store_true", help="probe the responders directly (no emulated relays)"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = asyncio.run(run(args.seconds, args.links, emulate=not args.direct))
    print(json.dumps(result, indent=None if args.json else 2))
    return result


if __name__ == "__main__":
    main()
