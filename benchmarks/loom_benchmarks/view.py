"""``loom bench view``: the ledger at scale (pure core, the code the metrics service runs).

Builds a ledger of ``--nodes`` nodes (clusters of 1,000 nodes, 2 zones per region), then
measures: folding a heartbeat delta of 1,000 changed nodes (decode + apply), a filtered view
query (one region, one GPU model), an unfiltered summary query, region summaries, and the
ledger's memory per node (tracemalloc).
"""

import argparse
import statistics
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import msgspec

from loom.model.ledger import Ledger
from loom_proto.clusters import ClusterHeartbeat, NodeState

MODELS = ("A100", "V100M32", "T4", "G2", "P100")
NOW = 1_700_000_000.0


def _cluster_nodes(cluster: int, per_cluster: int, zone: str, used: int) -> list[NodeState]:
    return [
        NodeState(
            node=f"n{cluster:04d}-{i:04d}",
            zone=zone,
            gpu_model=MODELS[(cluster + i // 100) % len(MODELS)],
            gpus_total=8,
            gpus_used=used if i % 3 == 0 else 0,
            cpu_milli=64_000,
            memory_mib=512 * 1024,
        )
        for i in range(per_cluster)
    ]


def _heartbeat(cluster: int, seq: int, nodes: list[NodeState], *, full: bool) -> ClusterHeartbeat:
    return ClusterHeartbeat(
        cluster=f"c{cluster:04d}",
        region=f"r{cluster % 10:02d}",
        agent_epoch=1,
        seq=seq,
        sent_at=NOW + seq,
        full=full,
        nodes=nodes,
        interval_s=2.0,
    )


def _timed(fn: Callable[[], Any], repeats: int) -> dict[str, float]:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1000)
    ordered = sorted(samples)
    return {
        "p50_ms": round(statistics.median(ordered), 3),
        "p99_ms": round(ordered[min(int(len(ordered) * 0.99), len(ordered) - 1)], 3),
        "max_ms": round(ordered[-1], 3),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Build the ledger and measure."""
    per_cluster = 1_000
    clusters = max(args.nodes // per_cluster, 1)
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    ledger = Ledger(known_models=frozenset(MODELS))
    built = time.perf_counter()
    for c in range(clusters):
        zone = f"r{c % 10:02d}-{'ab'[c // 10 % 2]}"
        ledger.apply(_heartbeat(c, 1, _cluster_nodes(c, per_cluster, zone, 0), full=True), NOW)
    build_s = time.perf_counter() - built
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    ledger_bytes = sum(s.size_diff for s in after.compare_to(before, "filename"))
    nodes = len(ledger.nodes)

    encoder = msgspec.json.Encoder()
    decoder = msgspec.json.Decoder(ClusterHeartbeat)

    # Deltas in which a third of cluster 0's 1,000 nodes change, as JSON, the way the service gets them.
    payloads = [
        encoder.encode(_heartbeat(0, 2 + i, _cluster_nodes(0, per_cluster, "r00-a", 1 + i % 7), full=False))
        for i in range(args.repeats)
    ]
    pending = iter(enumerate(payloads))

    def apply_delta() -> None:
        i, payload = next(pending)
        applied = ledger.apply(decoder.decode(payload), NOW + 2 + i)
        assert applied.change is not None and len(applied.change.nodes) >= per_cluster // 3

    delta = _timed(apply_delta, args.repeats)
    filtered = _timed(lambda: ledger.query(now=NOW, region="r03", gpu_model="T4"), args.repeats)
    free_filter = _timed(
        lambda: ledger.query(now=NOW, min_free_gpus=8, with_nodes=False), max(args.repeats // 4, 3)
    )
    summaries = _timed(lambda: ledger.summaries(lambda _m: 1.0), max(args.repeats // 4, 3))
    one_region = _timed(lambda: ledger.summaries(lambda _m: 1.0, ["r03"]), args.repeats)
    return {
        "benchmark": "view",
        "nodes": nodes,
        "clusters": clusters,
        "build_s": round(build_s, 2),
        "delta_1000_nodes_ms": delta,
        "filtered_query_ms": filtered,
        "filtered_query": "region r03, model T4, with node lists",
        "free_capacity_query_ms": free_filter,
        "summaries_all_regions_ms": summaries,
        "summary_one_region_ms": one_region,
        "ledger_bytes_per_node": round(ledger_bytes / max(nodes, 1), 1),
    }
