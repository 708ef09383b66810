"""The static topology: regions, the measured links between them, and the GPU clusters in each.

A topology is what the scheduler, the simulator and the local stack agree the world looks like
before any live measurement arrives. The packaged ones (``topologies/default.json`` and
``topologies/small.json``) are derived from real measurements by ``tools/derive_topology.py``;
see ``libs/loom/topologies/README.md`` for their sources.

Every id that can end up in a NATS subject (region, zone, cluster and node ids) is an
:data:`loom_proto.ids.Id`, so decoding rejects an id that is not a safe subject token.
"""

import functools
import importlib.resources
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Annotated

import msgspec
from msgspec import Meta

from loom.errors import InvalidInputError
from loom_proto.ids import ID_PATTERN, Id
from loom_proto.jobs import GpuModel

__all__ = [
    "Cluster",
    "Link",
    "Node",
    "Region",
    "Topology",
    "TopologyError",
    "load_topology",
    "packaged_topology_names",
    "validate_topology",
]

_PACKAGE = "loom"
_PACKAGED_DIR = "topologies"
_DEFAULT_NAME = "default"
_ID_RE = re.compile(ID_PATTERN)

# Bounds match loom_proto.clusters.NodeState, so every topology node can be reported by an agent.
Gpus = Annotated[int, Meta(ge=0, le=64)]
CpuMilli = Annotated[int, Meta(ge=0, le=1_024_000)]
MemoryMib = Annotated[int, Meta(ge=0, le=16 * 1024 * 1024)]
Milliseconds = Annotated[float, Meta(ge=0, le=60_000)]
Gbps = Annotated[float, Meta(ge=0, le=10_000)]
Text = Annotated[str, Meta(min_length=1, max_length=8192)]


class TopologyError(InvalidInputError):
    """A topology that cannot be used: unreadable, malformed, inconsistent, or an unknown id asked of it."""


class Node(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """One machine; ``gpu_model`` is None exactly when the node has no GPU."""

    id: Id
    gpu_model: GpuModel | None = None
    gpus: Gpus = 0
    cpu_milli: CpuMilli
    memory_mib: MemoryMib


class Cluster(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """A set of nodes in one zone of one region, run by one cluster agent."""

    id: Id
    region: Id
    zone: Id
    nodes: list[Node]

    @property
    def total_gpus(self) -> int:
        """The number of GPUs over all nodes of the cluster."""
        return sum(node.gpus for node in self.nodes)

    def gpus_by_model(self) -> dict[str, int]:
        """GPU count per model in this cluster, models sorted by name."""
        return _gpus_by_model(self.nodes)


class Region(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """A cloud region; ``source_name`` is the region's name in the measurements (``aws:us-east-1``)."""

    id: Id
    source_name: Text
    provider: Id
    zones: list[Id]


class Link(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """The measured network path from region ``src`` to region ``dst`` (directed).

    ``rtt_ms`` is the mean round-trip time; min/max/mdev describe its spread. ``bandwidth_gbps``
    is None where no throughput was measured.
    """

    src: Id
    dst: Id
    rtt_ms: Milliseconds
    rtt_min_ms: Milliseconds
    rtt_max_ms: Milliseconds
    rtt_mdev_ms: Milliseconds
    bandwidth_gbps: Gbps | None = None


class Topology(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True, dict=True):
    """Regions, directed links between them and clusters, with the citation of where they come from.

    Lookups are indexed on first use; call :func:`validate_topology` first, since the indexes
    assume ids are unique.
    """

    name: Id
    source: Text
    """Where the numbers come from and how they were derived (citation text)."""
    regions: list[Region]
    links: list[Link]
    clusters: list[Cluster]

    @functools.cached_property
    def _regions_by_id(self) -> dict[str, Region]:
        return {region.id: region for region in self.regions}

    @functools.cached_property
    def _clusters_by_id(self) -> dict[str, Cluster]:
        return {cluster.id: cluster for cluster in self.clusters}

    @functools.cached_property
    def _links_by_pair(self) -> dict[tuple[str, str], Link]:
        return {(link.src, link.dst): link for link in self.links}

    def region(self, region_id: str) -> Region:
        """The region with this id; :class:`TopologyError` if there is none."""
        try:
            return self._regions_by_id[region_id]
        except KeyError:
            raise TopologyError(f"topology {self.name!r} has no region {region_id!r}") from None

    def cluster(self, cluster_id: str) -> Cluster:
        """The cluster with this id; :class:`TopologyError` if there is none."""
        try:
            return self._clusters_by_id[cluster_id]
        except KeyError:
            raise TopologyError(f"topology {self.name!r} has no cluster {cluster_id!r}") from None

    def region_of(self, cluster_id: str) -> Region:
        """The region that holds the cluster; :class:`TopologyError` if the cluster is unknown."""
        return self.region(self.cluster(cluster_id).region)

    def link(self, src: str, dst: str) -> Link | None:
        """The directed link from region ``src`` to region ``dst``, or None if none is known."""
        return self._links_by_pair.get((src, dst))

    def gpus_by_model(self) -> dict[str, int]:
        """Total GPU count per model over all clusters, models sorted by name."""
        return _gpus_by_model(node for cluster in self.clusters for node in cluster.nodes)

    @property
    def total_gpus(self) -> int:
        """The number of GPUs over all clusters."""
        return sum(cluster.total_gpus for cluster in self.clusters)


def _gpus_by_model(nodes: Iterable[Node]) -> dict[str, int]:
    counts: Counter[str] = Counter()
    for node in nodes:
        if node.gpu_model is not None and node.gpus > 0:
            counts[node.gpu_model] += node.gpus
    return dict(sorted(counts.items()))


def validate_topology(topology: Topology) -> None:
    """Raise :class:`TopologyError` naming the first inconsistency found; return None if there is none.

    Checks what decoding cannot: ids are valid subject tokens (also for Structs built in code,
    which msgspec does not validate), ids are unique (zone and node ids across the whole
    topology), links join two distinct declared regions at most once per direction, clusters sit
    in a declared region and one of its zones, numbers are not negative and RTT statistics are
    ordered (min <= mean <= max), and a node has a GPU model exactly when it has GPUs.
    """
    _check_id(topology.name, "topology name")
    zones_by_region = _check_regions(topology.regions)
    _check_links(topology.links, zones_by_region)
    _check_clusters(topology.clusters, zones_by_region)


def _check_regions(regions: Sequence[Region]) -> dict[str, set[str]]:
    """Region and zone ids valid and unique, every region with a zone; returns the zones by region."""
    zones_by_region: dict[str, set[str]] = {}
    seen_zones: dict[str, str] = {}
    for region in regions:
        _check_id(region.id, "region id")
        _check_id(region.provider, "provider", f" of region {region.id!r}")
        if region.id in zones_by_region:
            raise TopologyError(f"duplicate region id {region.id!r}")
        if not region.zones:
            raise TopologyError(f"region {region.id!r} declares no zones")
        for zone in region.zones:
            _check_id(zone, "zone id", f" in region {region.id!r}")
            if zone in seen_zones:
                raise TopologyError(
                    f"duplicate zone id {zone!r} (in regions {seen_zones[zone]!r} and {region.id!r})"
                )
            seen_zones[zone] = region.id
        zones_by_region[region.id] = set(region.zones)
    return zones_by_region


def _check_links(links: Sequence[Link], zones_by_region: Mapping[str, set[str]]) -> None:
    """Links join two distinct declared regions once per direction, with ordered, non-negative figures."""
    seen_links: set[tuple[str, str]] = set()
    for link in links:
        name = f"link {link.src!r} -> {link.dst!r}"
        for end in (link.src, link.dst):
            if end not in zones_by_region:
                raise TopologyError(f"{name}: endpoint {end!r} is not a declared region")
        if link.src == link.dst:
            raise TopologyError(f"{name}: a link must join two different regions")
        if (link.src, link.dst) in seen_links:
            raise TopologyError(f"duplicate {name}")
        seen_links.add((link.src, link.dst))
        for field, value in (
            ("rtt_ms", link.rtt_ms),
            ("rtt_min_ms", link.rtt_min_ms),
            ("rtt_max_ms", link.rtt_max_ms),
            ("rtt_mdev_ms", link.rtt_mdev_ms),
            ("bandwidth_gbps", link.bandwidth_gbps),
        ):
            _check_non_negative(value, f"{name}: {field}")
        if not link.rtt_min_ms <= link.rtt_ms <= link.rtt_max_ms:
            raise TopologyError(
                f"{name}: need rtt_min_ms <= rtt_ms <= rtt_max_ms, got "
                f"{link.rtt_min_ms} <= {link.rtt_ms} <= {link.rtt_max_ms}"
            )


def _check_clusters(clusters: Sequence[Cluster], zones_by_region: Mapping[str, set[str]]) -> None:
    """Cluster and node ids valid and unique; clusters in a declared zone; nodes' figures consistent."""
    seen_clusters: set[str] = set()
    seen_nodes: dict[str, str] = {}
    for cluster in clusters:
        _check_id(cluster.id, "cluster id")
        if cluster.id in seen_clusters:
            raise TopologyError(f"duplicate cluster id {cluster.id!r}")
        seen_clusters.add(cluster.id)
        if cluster.region not in zones_by_region:
            raise TopologyError(f"cluster {cluster.id!r}: region {cluster.region!r} is not declared")
        if cluster.zone not in zones_by_region[cluster.region]:
            raise TopologyError(
                f"cluster {cluster.id!r}: zone {cluster.zone!r} is not declared in region {cluster.region!r}"
            )
        for node in cluster.nodes:
            _check_id(node.id, "node id", f" in cluster {cluster.id!r}")
            if node.id in seen_nodes:
                raise TopologyError(
                    f"duplicate node id {node.id!r} (in clusters {seen_nodes[node.id]!r} and {cluster.id!r})"
                )
            seen_nodes[node.id] = cluster.id
            where = f"node {node.id!r} in cluster {cluster.id!r}"
            for field, amount in (
                ("gpus", node.gpus),
                ("cpu_milli", node.cpu_milli),
                ("memory_mib", node.memory_mib),
            ):
                _check_non_negative(amount, f"{where}: {field}")
            if (node.gpu_model is None) != (node.gpus == 0):
                raise TopologyError(
                    f"{where}: gpu_model {node.gpu_model!r} with {node.gpus} GPUs; "
                    "a node has a GPU model exactly when it has GPUs"
                )


def _check_id(value: str, what: str, where: str = "") -> None:
    if not isinstance(value, str) or _ID_RE.fullmatch(value) is None:
        raise TopologyError(
            f"invalid {what} {value!r}{where}: must be 1-64 characters of letters, digits, '_' or '-'"
        )


def _check_non_negative(value: float | None, what: str) -> None:
    if value is not None and not value >= 0:  # `not >=` also catches NaN
        raise TopologyError(f"{what} must not be negative, got {value}")


def packaged_topology_names() -> list[str]:
    """Names of the topologies shipped inside the ``loom`` package, sorted."""
    folder = importlib.resources.files(_PACKAGE).joinpath(_PACKAGED_DIR)
    return sorted(
        entry.name.removesuffix(".json") for entry in folder.iterdir() if entry.name.endswith(".json")
    )


def load_topology(path: str | Path | None = None) -> Topology:
    """Read, decode and validate a topology.

    ``None`` loads the packaged default; a bare name (a ``str`` that is a valid id, such as
    ``"small"``) loads the packaged ``topologies/<name>.json``; anything else is a path to a
    JSON file. Raises :class:`TopologyError` when the file is missing, malformed or inconsistent.
    """
    if path is None:
        path = _DEFAULT_NAME
    if isinstance(path, str) and _ID_RE.fullmatch(path) is not None:
        resource = importlib.resources.files(_PACKAGE).joinpath(_PACKAGED_DIR, f"{path}.json")
        if not resource.is_file():
            raise TopologyError(
                f"no packaged topology named {path!r}; available: {', '.join(packaged_topology_names())}"
            )
        where = f"packaged topology {path!r}"
        data = resource.read_bytes()
    else:
        where = f"topology file {str(path)!r}"
        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            raise TopologyError(f"cannot read {where}: {exc.strerror or exc}") from exc
    try:
        topology = msgspec.json.decode(data, type=Topology)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise TopologyError(f"{where} is malformed: {exc}") from exc
    try:
        validate_topology(topology)
    except TopologyError as exc:
        raise TopologyError(f"{where} is inconsistent: {exc}") from exc
    return topology
