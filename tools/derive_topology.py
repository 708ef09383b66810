"""Derive the packaged topologies from the reference measurements (developers only, never at run time).

Reads the Skyplane inter-region RTT and throughput measurements and the Alibaba GPU node list
from the shared reference data and writes ``libs/loom/topologies/default.json`` and
``small.json``. The output is deterministic: re-running on the same data gives identical bytes.

    .venv/bin/python tools/derive_topology.py            # write the files
    .venv/bin/python tools/derive_topology.py --check    # exit 1 if they are out of date

How the data become a topology (also recorded in each file's ``source``):

- Regions are chosen by hand (``DEFAULT_REGIONS``) to span continents and all three providers;
  each has RTT and throughput measured in both directions to every other chosen one.
- The data have no zones. Each region gets two invented zones, ``<region>-a`` and ``<region>-b``.
  GCP measurements name a zone (``gcp:asia-southeast1-a``); that region's id drops the zone
  letter and its ``-a`` zone is the measured one.
- The RTT file holds several ping runs for many pairs, sometimes far apart (different routes on
  different days). A link's ``rtt_ms`` is the mean of the runs' means, min/max the extremes over
  all runs, and ``rtt_mdev_ms`` the pooled deviation sqrt(mean(run mdev^2) + variance of the run
  means), so unstable paths show a large deviation. Pings from GCP carry no mdev; for those the
  within-run part comes from the reverse direction's runs (the same round trip measured from
  the other end), or is left out when neither direction has one.
- Throughput is iperf3 with 64 parallel TCP connections; a missing direction takes the reverse
  direction's figure, and a pair measured in neither direction has ``bandwidth_gbps`` None.
- Alibaba GPU nodes (CPU-only nodes skipped) are dealt to clusters per GPU model with a smooth
  weighted round-robin over the nodes sorted by name (``DEFAULT_SHARES``), so each cluster gets
  its own model mix and a spread of the node shapes of each model. ``small.json`` takes an
  evenly spaced handful of nodes per model (``SMALL_PICKS``).
"""

import argparse
import csv
import json
import math
import sys
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from rich.console import Console
from rich.table import Table

from loom.model.topology import Cluster, Link, Node, Region, Topology, load_topology, validate_topology

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data"
OUT = REPO / "libs" / "loom" / "topologies"

SKYPLANE = (
    "skyplane-project/skyplane, profiles/latency.csv and profiles/throughput_mini.csv at commit "
    "2e3b2c01735054a8053d6a939d69fe43a652d2d0 (Apache-2.0)"
)
ALIBABA = (
    "alibaba/clusterdata, cluster-trace-gpu-v2023/csv/openb_node_list_all_node.csv at commit "
    "7a6c496e4f4b6ce6150be8f881cb051bf2abff42 (Weng et al., 'Beware of Fragmentation', USENIX ATC 2023)"
)

# Five continents, three providers, two regions each; every directed pair is in both CSVs.
# Includes a near pair (Frankfurt - Amsterdam, ~7 ms) and far ones (Singapore - Sao Paulo, ~320 ms).
DEFAULT_REGIONS = [
    "aws:us-east-2",  # Ohio
    "aws:eu-central-1",  # Frankfurt
    "azure:westeurope",  # Netherlands
    "azure:australiaeast",  # New South Wales
    "gcp:asia-southeast1-a",  # Singapore
    "gcp:southamerica-east1-a",  # Sao Paulo
]
SMALL_REGIONS = ["aws:us-east-2", "azure:westeurope", "gcp:asia-southeast1-a"]


@dataclass(frozen=True)
class ClusterPlace:
    """Where a cluster sits: region source name and zone letter."""

    region: str
    zone_letter: str


DEFAULT_CLUSTERS = {
    "c-use2-a": ClusterPlace("aws:us-east-2", "a"),
    "c-use2-b": ClusterPlace("aws:us-east-2", "b"),
    "c-euc1-a": ClusterPlace("aws:eu-central-1", "a"),
    "c-weu-a": ClusterPlace("azure:westeurope", "a"),
    "c-weu-b": ClusterPlace("azure:westeurope", "b"),
    "c-aue-a": ClusterPlace("azure:australiaeast", "a"),
    "c-sea1-a": ClusterPlace("gcp:asia-southeast1-a", "a"),
    "c-sae1-a": ClusterPlace("gcp:southamerica-east1-a", "a"),
}

# Per GPU model: which clusters get its nodes, in what integer proportion. Every model in the
# node list must appear here, so no GPU node is silently dropped.
DEFAULT_SHARES: dict[str, dict[str, int]] = {
    "G2": {"c-use2-a": 4, "c-weu-b": 3, "c-sea1-a": 2, "c-euc1-a": 1},
    "G3": {"c-use2-a": 1, "c-weu-b": 1},
    "T4": {"c-use2-b": 5, "c-weu-a": 2, "c-aue-a": 2, "c-sae1-a": 1},
    "P100": {"c-weu-a": 1, "c-aue-a": 2, "c-sae1-a": 2},
    "V100M16": {"c-euc1-a": 3, "c-sea1-a": 2},
    "V100M32": {"c-euc1-a": 2, "c-use2-a": 1},
    "A10": {"c-use2-b": 1},
}

SMALL_CLUSTERS = {
    "c-use2-a": ClusterPlace("aws:us-east-2", "a"),
    "c-weu-a": ClusterPlace("azure:westeurope", "a"),
    "c-sea1-a": ClusterPlace("gcp:asia-southeast1-a", "a"),
}
SMALL_PICKS: dict[str, dict[str, int]] = {
    "c-use2-a": {"G2": 4, "V100M32": 2},
    "c-weu-a": {"T4": 4, "P100": 2},
    "c-sea1-a": {"V100M16": 3, "T4": 2},
}


MDEV_FROM_REVERSE = "no ping mdev from the source (GCP), within-run part from the reverse direction"
MDEV_BETWEEN_RUNS_ONLY = "no ping mdev in either direction, spread between runs only"
BANDWIDTH_FROM_REVERSE = "throughput not measured, taken from the reverse direction"
BANDWIDTH_MISSING = "throughput not measured in either direction"
NOTES = [MDEV_FROM_REVERSE, MDEV_BETWEEN_RUNS_ONLY, BANDWIDTH_FROM_REVERSE, BANDWIDTH_MISSING]


@dataclass(frozen=True)
class RttRun:
    """One ping run between two regions, as one CSV row."""

    min_ms: float
    avg_ms: float
    max_ms: float
    mdev_ms: float | None


@dataclass(frozen=True)
class NodeRow:
    """One Alibaba node with GPUs."""

    sn: str
    cpu_milli: int
    memory_mib: int
    gpus: int
    model: str


def read_rtt(path: Path) -> dict[tuple[str, str], list[RttRun]]:
    """All ping runs per directed pair, in file order."""
    runs: dict[tuple[str, str], list[RttRun]] = defaultdict(list)
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            mdev = row["mdev_rtt_ms"]
            runs[(row["src_region"], row["dst_region"])].append(
                RttRun(
                    min_ms=float(row["min_rtt_ms"]),
                    avg_ms=float(row["avg_rtt_ms"]),
                    max_ms=float(row["max_rtt_ms"]),
                    mdev_ms=float(mdev) if mdev else None,
                )
            )
    return dict(runs)


def read_throughput(path: Path) -> dict[tuple[str, str], float]:
    """Throughput in Gbit/s per directed pair; refuses a pair measured twice."""
    measured: dict[tuple[str, str], float] = {}
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            pair = (row["src_region"], row["dst_region"])
            if pair in measured:
                raise SystemExit(f"throughput measured twice for {pair}")
            measured[pair] = float(row["throughput_gbps"])
    return measured


def read_gpu_nodes(path: Path) -> list[NodeRow]:
    """GPU nodes sorted by name; CPU-only nodes (gpu 0, empty model) are skipped."""
    nodes = []
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            gpus = int(row["gpu"])
            if gpus == 0:
                continue
            if not row["model"]:
                raise SystemExit(f"node {row['sn']} has {gpus} GPUs but no model")
            nodes.append(
                NodeRow(
                    sn=row["sn"],
                    cpu_milli=int(row["cpu_milli"]),
                    memory_mib=int(row["memory_mib"]),
                    gpus=gpus,
                    model=row["model"],
                )
            )
    return sorted(nodes, key=lambda n: n.sn)


def region_id(source_name: str) -> str:
    """``aws:us-east-1`` -> ``aws-us-east-1``; ``gcp:asia-southeast1-a`` -> ``gcp-asia-southeast1``."""
    provider, name = source_name.split(":", 1)
    if provider == "gcp":
        name = name.rsplit("-", 1)[0]
    return f"{provider}-{name}"


def make_region(source_name: str) -> Region:
    """A region with its two zones, ``-a`` and ``-b``."""
    rid = region_id(source_name)
    return Region(
        id=rid,
        source_name=source_name,
        provider=source_name.split(":", 1)[0],
        zones=[f"{rid}-a", f"{rid}-b"],
    )


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def make_link(
    src: str,
    dst: str,
    rtt: Mapping[tuple[str, str], list[RttRun]],
    throughput: Mapping[tuple[str, str], float],
    notes: Mapping[str, list[str]],
) -> Link:
    """The directed link ``src`` -> ``dst`` (source names), combining all ping runs (module docstring)."""
    runs = rtt.get((src, dst))
    if not runs:
        raise SystemExit(f"no RTT measured from {src} to {dst}; choose other regions")
    mean_ms = _mean([r.avg_ms for r in runs])
    between_var = _mean([(r.avg_ms - mean_ms) ** 2 for r in runs])
    own = [r.mdev_ms for r in runs if r.mdev_ms is not None]
    reverse = [r.mdev_ms for r in rtt.get((dst, src), []) if r.mdev_ms is not None]
    within = own or reverse
    name = f"{region_id(src)}->{region_id(dst)}"
    if not own:
        notes[MDEV_FROM_REVERSE if reverse else MDEV_BETWEEN_RUNS_ONLY].append(name)
    mdev_ms = math.sqrt((_mean([m**2 for m in within]) if within else 0.0) + between_var)

    bandwidth = throughput.get((src, dst))
    if bandwidth is None:
        bandwidth = throughput.get((dst, src))
        notes[BANDWIDTH_FROM_REVERSE if bandwidth is not None else BANDWIDTH_MISSING].append(name)
    return Link(
        src=region_id(src),
        dst=region_id(dst),
        rtt_ms=round(mean_ms, 3),
        rtt_min_ms=round(min(r.min_ms for r in runs), 3),
        rtt_max_ms=round(max(r.max_ms for r in runs), 3),
        rtt_mdev_ms=round(mdev_ms, 3),
        bandwidth_gbps=None if bandwidth is None else round(bandwidth, 3),
    )


def deal(items: Sequence[NodeRow], weights: Mapping[str, int]) -> dict[str, list[NodeRow]]:
    """Deal ``items`` to the keys of ``weights`` by smooth weighted round-robin (deterministic)."""
    total = sum(weights.values())
    current = dict.fromkeys(weights, 0)
    dealt: dict[str, list[NodeRow]] = {key: [] for key in weights}
    for item in items:
        for key, weight in weights.items():
            current[key] += weight
        chosen = max(weights, key=lambda k: (current[k], -list(weights).index(k)))
        current[chosen] -= total
        dealt[chosen].append(item)
    return dealt


def evenly_spaced(items: Sequence[NodeRow], count: int) -> list[NodeRow]:
    """``count`` items spread evenly over ``items`` (first one included)."""
    if count > len(items):
        raise SystemExit(f"asked for {count} nodes of {len(items)}")
    return [items[i * len(items) // count] for i in range(count)]


def to_node(row: NodeRow) -> Node:
    """A topology node from an Alibaba node row."""
    return Node(
        id=row.sn, gpu_model=row.model, gpus=row.gpus, cpu_milli=row.cpu_milli, memory_mib=row.memory_mib
    )


def make_cluster(cluster_id: str, place: ClusterPlace, rows: Iterable[NodeRow]) -> Cluster:
    """A cluster at ``place`` holding ``rows``, nodes sorted by id."""
    rid = region_id(place.region)
    nodes = sorted((to_node(r) for r in rows), key=lambda n: n.id)
    return Cluster(id=cluster_id, region=rid, zone=f"{rid}-{place.zone_letter}", nodes=nodes)


def by_model(nodes: Iterable[NodeRow]) -> dict[str, list[NodeRow]]:
    """Nodes grouped per GPU model, keeping their order."""
    grouped: dict[str, list[NodeRow]] = defaultdict(list)
    for node in nodes:
        grouped[node.model].append(node)
    return dict(grouped)


def build(
    name: str,
    *,
    sources: Sequence[str],
    clusters: Sequence[Cluster],
    rtt: Mapping[tuple[str, str], list[RttRun]],
    throughput: Mapping[tuple[str, str], float],
    how_nodes: str,
) -> Topology:
    """Assemble and validate one topology, with its citation and derivation notes as ``source``."""
    notes: dict[str, list[str]] = {note: [] for note in NOTES}
    links = [make_link(src, dst, rtt, throughput, notes) for src in sources for dst in sources if src != dst]
    said = [f"{note}: {', '.join(names)}" for note, names in notes.items() if names]
    source = (
        f"Links: {SKYPLANE}. rtt_ms is the mean of all ping runs of the pair, min/max the extremes "
        "over runs, mdev the pooled deviation sqrt(mean(run mdev^2) + variance of run means); "
        "bandwidth_gbps is iperf3 with 64 parallel TCP connections. "
        f"Notes: {'; '.join(said) if said else 'every direction measured'}. "
        f"Nodes: {ALIBABA}; GPU nodes only, {how_nodes}. "
        "Zones are invented: the data have none; each region gets <region>-a and <region>-b "
        "(for GCP regions the -a zone is the one measured). Derived by tools/derive_topology.py."
    )
    topology = Topology(
        name=name,
        source=source,
        regions=sorted((make_region(s) for s in sources), key=lambda r: r.id),
        links=sorted(links, key=lambda link: (link.src, link.dst)),
        clusters=sorted(clusters, key=lambda c: c.id),
    )
    validate_topology(topology)
    return topology


def derive(data: Path) -> tuple[Topology, Topology, list[NodeRow]]:
    """The default and small topologies, and the GPU node rows they were made from."""
    rtt = read_rtt(data / "wan" / "region_rtt_ms.csv")
    throughput = read_throughput(data / "wan" / "region_throughput_gbps.csv")
    gpu_nodes = read_gpu_nodes(data / "gpu-cluster" / "openb_node_list_all_node.csv")
    per_model = by_model(gpu_nodes)

    unplanned = set(per_model) - set(DEFAULT_SHARES)
    if unplanned:
        raise SystemExit(f"GPU models without a share in DEFAULT_SHARES: {sorted(unplanned)}")
    rows_per_cluster: dict[str, list[NodeRow]] = defaultdict(list)
    for model, weights in DEFAULT_SHARES.items():
        for cluster_id, rows in deal(per_model.get(model, []), weights).items():
            rows_per_cluster[cluster_id].extend(rows)
    default = build(
        "default",
        sources=DEFAULT_REGIONS,
        clusters=[make_cluster(cid, place, rows_per_cluster[cid]) for cid, place in DEFAULT_CLUSTERS.items()],
        rtt=rtt,
        throughput=throughput,
        how_nodes=(
            "all of them, dealt per GPU model to clusters by smooth weighted round-robin over node names"
        ),
    )

    # Pick each model's nodes once, evenly spaced, then hand them out in cluster order, so two
    # clusters asking for the same model never share a node.
    picks_per_model: dict[str, int] = defaultdict(int)
    for picks in SMALL_PICKS.values():
        for model, count in picks.items():
            picks_per_model[model] += count
    pools = {model: iter(evenly_spaced(per_model[model], count)) for model, count in picks_per_model.items()}
    small_clusters = []
    for cid, place in SMALL_CLUSTERS.items():
        rows = [next(pools[model]) for model, count in SMALL_PICKS[cid].items() for _ in range(count)]
        small_clusters.append(make_cluster(cid, place, rows))
    small = build(
        "small",
        sources=SMALL_REGIONS,
        clusters=small_clusters,
        rtt=rtt,
        throughput=throughput,
        how_nodes="an evenly spaced handful per GPU model (by node name) for each cluster",
    )
    return default, small, gpu_nodes


def _is_flat(value: Any) -> bool:
    scalars = (str, int, float, bool, type(None))
    if isinstance(value, dict):
        return all(isinstance(v, scalars) for v in value.values())
    if isinstance(value, list):
        return all(isinstance(v, scalars) for v in value)
    return True


def render(value: Any, depth: int = 0) -> str:
    """JSON indented by two spaces, with objects and lists of plain values on one line each."""
    if _is_flat(value):
        return json.dumps(value, ensure_ascii=False, separators=(", ", ": "))
    pad, inner = "  " * depth, "  " * (depth + 1)
    if isinstance(value, dict):
        body = ",\n".join(f"{inner}{json.dumps(k)}: {render(v, depth + 1)}" for k, v in value.items())
        return "{\n" + body + "\n" + pad + "}"
    body = ",\n".join(inner + render(v, depth + 1) for v in value)
    return "[\n" + body + "\n" + pad + "]"


def encode(topology: Topology) -> str:
    """The file text of a topology; fields in declaration order, lists already sorted."""
    return render(msgspec.to_builtins(topology)) + "\n"


def summarise(console: Console, topology: Topology) -> None:
    """Print a table of a topology's clusters."""
    table = Table(title=f"{topology.name}: {len(topology.regions)} regions, {len(topology.links)} links")
    for column in ("cluster", "region", "zone", "nodes", "GPUs", "GPUs by model"):
        table.add_column(column)
    for c in topology.clusters:
        mix = ", ".join(f"{m} {n}" for m, n in c.gpus_by_model().items())
        table.add_row(c.id, c.region, c.zone, str(len(c.nodes)), str(c.total_gpus), mix)
    nodes = sum(len(c.nodes) for c in topology.clusters)
    mix = ", ".join(f"{m} {n}" for m, n in topology.gpus_by_model().items())
    table.add_row("total", "", "", str(nodes), str(topology.total_gpus), mix)
    console.print(table)


def main(argv: Sequence[str] | None = None) -> int:
    """Write (or with --check, compare) the packaged topologies."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DATA, help="the shared reference data folder")
    parser.add_argument("--out", type=Path, default=OUT, help="where the topology files go")
    parser.add_argument("--check", action="store_true", help="exit 1 if the files differ from a fresh run")
    args = parser.parse_args(argv)

    console = Console()
    default, small, gpu_nodes = derive(args.data)
    expected_gpus = sum(n.gpus for n in gpu_nodes)
    if default.total_gpus != expected_gpus or sum(len(c.nodes) for c in default.clusters) != len(gpu_nodes):
        raise SystemExit("the default topology lost or duplicated GPU nodes")
    console.print(f"source GPU nodes: {len(gpu_nodes)}, GPUs: {expected_gpus}")

    stale = []
    for topology in (default, small):
        path = args.out / f"{topology.name}.json"
        text = encode(topology)
        summarise(console, topology)
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(path)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        if load_topology(path) != topology:
            raise SystemExit(f"{path} does not read back as written")
        console.print(f"wrote {path} ({path.stat().st_size:,} bytes)")
    if stale:
        console.print(f"out of date: {', '.join(str(p) for p in stale)}; run tools/derive_topology.py")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
