"""The topology model, its validation, and the packaged topologies derived from real measurements."""

import itertools
import re
from pathlib import Path

import msgspec
import pytest

from loom.errors import InvalidInputError
from loom.model.topology import (
    Cluster,
    Link,
    Node,
    Region,
    Topology,
    TopologyError,
    load_topology,
    packaged_topology_names,
    validate_topology,
)
from loom_proto.ids import ID_PATTERN

ID_RE = re.compile(ID_PATTERN)


def _subject_ids(topology: Topology) -> list[str]:
    ids = [topology.name]
    for region in topology.regions:
        ids += [region.id, region.provider, *region.zones]
    for cluster in topology.clusters:
        ids += [cluster.id, cluster.region, cluster.zone, *(node.id for node in cluster.nodes)]
    for link in topology.links:
        ids += [link.src, link.dst]
    return ids


def _tiny(**changes: object) -> Topology:
    """A valid two-region topology; ``changes`` replace its top-level fields."""
    base = Topology(
        name="tiny",
        source="made up for a test",
        regions=[
            Region(id="r1", source_name="aws:r1", provider="aws", zones=["r1-a", "r1-b"]),
            Region(id="r2", source_name="gcp:r2-a", provider="gcp", zones=["r2-a"]),
        ],
        links=[
            Link(src="r1", dst="r2", rtt_ms=10.0, rtt_min_ms=9.0, rtt_max_ms=12.0, rtt_mdev_ms=0.5),
            Link(
                src="r2",
                dst="r1",
                rtt_ms=10.5,
                rtt_min_ms=9.5,
                rtt_max_ms=11.0,
                rtt_mdev_ms=0.4,
                bandwidth_gbps=2.5,
            ),
        ],
        clusters=[
            Cluster(
                id="c1",
                region="r1",
                zone="r1-a",
                nodes=[Node(id="n1", gpu_model="T4", gpus=2, cpu_milli=8000, memory_mib=1024)],
            ),
            Cluster(
                id="c2",
                region="r2",
                zone="r2-a",
                nodes=[
                    Node(id="n2", gpu_model="V100M32", gpus=8, cpu_milli=96000, memory_mib=4096),
                    Node(id="n3", gpus=0, cpu_milli=4000, memory_mib=512),
                ],
            ),
        ],
    )
    return msgspec.structs.replace(base, **changes)


def _node(node_id: str = "n9", **changes: object) -> Node:
    return msgspec.structs.replace(
        Node(id=node_id, gpu_model="T4", gpus=1, cpu_milli=1000, memory_mib=1024), **changes
    )


# --- the packaged topologies -------------------------------------------------------------------


@pytest.mark.parametrize("name", [None, "default", "small"])
def test_packaged_topology_loads_and_validates(name: str | None) -> None:
    topology = load_topology(name)
    validate_topology(topology)
    assert topology.name == (name or "default")
    assert topology.clusters


def test_packaged_names_include_default_and_small() -> None:
    assert {"default", "small"} <= set(packaged_topology_names())


@pytest.mark.parametrize("name", ["default", "small"])
def test_every_subject_id_in_packaged_topology_is_a_valid_token(name: str) -> None:
    bad = [i for i in _subject_ids(load_topology(name)) if ID_RE.fullmatch(i) is None]
    assert bad == []


@pytest.mark.parametrize("name", ["default", "small"])
def test_packaged_topology_cites_its_sources(name: str) -> None:
    source = load_topology(name).source
    assert "skyplane" in source and "2e3b2c01735054a8053d6a939d69fe43a652d2d0" in source
    assert "alibaba/clusterdata" in source and "7a6c496e4f4b6ce6150be8f881cb051bf2abff42" in source


@pytest.mark.parametrize("name", ["default", "small"])
def test_every_region_pair_has_measured_links_both_ways(name: str) -> None:
    topology = load_topology(name)
    ids = [r.id for r in topology.regions]
    for src, dst in itertools.permutations(ids, 2):
        link = topology.link(src, dst)
        assert link is not None, f"no link {src} -> {dst}"
        assert 0 < link.rtt_min_ms <= link.rtt_ms <= link.rtt_max_ms
        assert link.bandwidth_gbps is not None and link.bandwidth_gbps > 0
    assert len(topology.links) == len(ids) * (len(ids) - 1)


def test_default_topology_spans_providers_and_continents() -> None:
    topology = load_topology()
    assert len(topology.regions) >= 6
    assert {r.provider for r in topology.regions} == {"aws", "azure", "gcp"}
    assert 6 <= len(topology.clusters) <= 10
    assert all(len(region.zones) == 2 for region in topology.regions)
    # A near pair and a far pair, so that network awareness has something to choose between.
    rtts = [link.rtt_ms for link in topology.links]
    assert min(rtts) < 20
    assert max(rtts) > 250


def test_default_topology_is_heterogeneous() -> None:
    topology = load_topology()
    assert len(topology.gpus_by_model()) >= 4
    mixes = [
        tuple((model, round(gpus / c.total_gpus, 1)) for model, gpus in c.gpus_by_model().items())
        for c in topology.clusters
    ]
    assert len(set(mixes)) == len(mixes), f"two clusters share a GPU model mix: {mixes}"
    assert len({max(c.gpus_by_model().items(), key=lambda kv: kv[1])[0] for c in topology.clusters}) >= 3
    assert all(c.total_gpus > 0 for c in topology.clusters)


def test_default_topology_holds_only_gpu_nodes_with_unique_ids() -> None:
    topology = load_topology()
    nodes = [n for c in topology.clusters for n in c.nodes]
    assert len(nodes) > 1000
    assert len({n.id for n in nodes}) == len(nodes)
    assert all(n.gpus > 0 and n.gpu_model for n in nodes)
    assert topology.total_gpus == sum(topology.gpus_by_model().values()) == sum(n.gpus for n in nodes)


def test_small_topology_is_small_and_heterogeneous() -> None:
    topology = load_topology("small")
    assert len(topology.regions) == 3
    assert len(topology.clusters) == 3
    assert {c.region for c in topology.clusters} == {r.id for r in topology.regions}
    assert all(4 <= len(c.nodes) <= 8 for c in topology.clusters)
    assert len({frozenset(c.gpus_by_model()) for c in topology.clusters}) == 3


# --- lookups -----------------------------------------------------------------------------------


def test_lookups_find_clusters_regions_and_directed_links() -> None:
    topology = _tiny()
    assert topology.cluster("c2").zone == "r2-a"
    assert topology.region_of("c2").id == "r2"
    assert topology.region("r1").provider == "aws"
    forward, backward = topology.link("r1", "r2"), topology.link("r2", "r1")
    assert forward is not None and forward.bandwidth_gbps is None
    assert backward is not None and backward.bandwidth_gbps == 2.5
    assert topology.link("r1", "r1") is None


def test_unknown_cluster_or_region_raises_topology_error() -> None:
    topology = _tiny()
    with pytest.raises(TopologyError, match="no cluster 'nope'"):
        topology.cluster("nope")
    with pytest.raises(TopologyError, match="no cluster 'nope'"):
        topology.region_of("nope")
    with pytest.raises(TopologyError, match="no region 'nope'"):
        topology.region("nope")


def test_gpu_totals_count_by_model_and_skip_cpu_nodes() -> None:
    topology = _tiny()
    assert topology.gpus_by_model() == {"T4": 2, "V100M32": 8}
    assert topology.total_gpus == 10
    assert topology.cluster("c2").gpus_by_model() == {"V100M32": 8}


# --- validation --------------------------------------------------------------------------------


def test_valid_topology_passes_validation() -> None:
    validate_topology(_tiny())


def test_topology_error_is_non_retryable_invalid_input() -> None:
    assert issubclass(TopologyError, InvalidInputError)
    assert TopologyError("x").non_retryable


def _cluster(cluster_id: str, region: str, zone: str, *nodes: Node) -> Cluster:
    return Cluster(id=cluster_id, region=region, zone=zone, nodes=list(nodes))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"regions": [*_tiny().regions, Region(id="r1", source_name="x", provider="aws", zones=["r9-a"])]},
            "duplicate region id 'r1'",
        ),
        (
            {"regions": [*_tiny().regions, Region(id="r3", source_name="x", provider="aws", zones=["r1-a"])]},
            "duplicate zone id 'r1-a'",
        ),
        (
            {"clusters": [*_tiny().clusters, _cluster("c1", "r1", "r1-b", _node())]},
            "duplicate cluster id 'c1'",
        ),
        (
            {"clusters": [*_tiny().clusters, _cluster("c3", "r1", "r1-b", _node("n2"))]},
            "duplicate node id 'n2' (in clusters 'c2' and 'c3')",
        ),
        (
            {
                "links": [
                    *_tiny().links,
                    Link(src="r1", dst="mars", rtt_ms=1, rtt_min_ms=1, rtt_max_ms=1, rtt_mdev_ms=0),
                ]
            },
            "endpoint 'mars' is not a declared region",
        ),
        (
            {"links": [*_tiny().links, _tiny().links[0]]},
            "duplicate link 'r1' -> 'r2'",
        ),
        (
            {"links": [Link(src="r1", dst="r1", rtt_ms=1, rtt_min_ms=1, rtt_max_ms=1, rtt_mdev_ms=0)]},
            "two different regions",
        ),
        (
            {"links": [Link(src="r1", dst="r2", rtt_ms=5, rtt_min_ms=6, rtt_max_ms=7, rtt_mdev_ms=0)]},
            "rtt_min_ms <= rtt_ms <= rtt_max_ms",
        ),
        (
            {
                "links": [
                    Link(
                        src="r1",
                        dst="r2",
                        rtt_ms=5,
                        rtt_min_ms=4,
                        rtt_max_ms=7,
                        rtt_mdev_ms=0,
                        bandwidth_gbps=-1.0,
                    )
                ]
            },
            "bandwidth_gbps must not be negative",
        ),
        (
            {"clusters": [_cluster("c3", "r9", "r1-a", _node())]},
            "cluster 'c3': region 'r9' is not declared",
        ),
        (
            {"clusters": [_cluster("c3", "r1", "r2-a", _node())]},
            "zone 'r2-a' is not declared in region 'r1'",
        ),
        (
            {"clusters": [_cluster("c3", "r1", "r1-a", _node(cpu_milli=-1))]},
            "cpu_milli must not be negative",
        ),
        (
            {"clusters": [_cluster("c3", "r1", "r1-a", _node(gpus=0))]},
            "a node has a GPU model exactly when it has GPUs",
        ),
        (
            {"clusters": [_cluster("c.3", "r1", "r1-a", _node())]},
            "invalid cluster id 'c.3'",
        ),
        (
            {"clusters": [_cluster("c3", "r1", "r1-a", _node("node 1"))]},
            "invalid node id 'node 1' in cluster 'c3'",
        ),
        (
            {
                "regions": [Region(id="aws:us-east-1", source_name="x", provider="aws", zones=["z"])],
                "links": [],
                "clusters": [],
            },
            "invalid region id 'aws:us-east-1'",
        ),
    ],
)
def test_validation_names_the_inconsistency(changes: dict[str, object], message: str) -> None:
    with pytest.raises(TopologyError) as caught:
        validate_topology(_tiny(**changes))
    assert message in str(caught.value)


# --- loading -----------------------------------------------------------------------------------


def test_load_from_path_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "tiny.json"
    path.write_bytes(msgspec.json.encode(_tiny()))
    assert load_topology(path) == _tiny()
    assert load_topology(str(path)) == _tiny()


def test_load_rejects_bad_id_while_decoding(tmp_path: Path) -> None:
    raw = msgspec.to_builtins(_tiny())
    raw["clusters"][0]["id"] = "tenant.a.>"
    path = tmp_path / "bad.json"
    path.write_bytes(msgspec.json.encode(raw))
    with pytest.raises(TopologyError, match=r"malformed.*clusters\[0\]\.id"):
        load_topology(path)


def test_load_rejects_unknown_fields(tmp_path: Path) -> None:
    raw = msgspec.to_builtins(_tiny())
    raw["regions"][0]["continent"] = "europe"
    path = tmp_path / "extra.json"
    path.write_bytes(msgspec.json.encode(raw))
    with pytest.raises(TopologyError, match="unknown field `continent`"):
        load_topology(path)


def test_load_reports_inconsistent_file(tmp_path: Path) -> None:
    path = tmp_path / "dup.json"
    path.write_bytes(msgspec.json.encode(_tiny(clusters=[*_tiny().clusters, *_tiny().clusters])))
    with pytest.raises(TopologyError, match="inconsistent: duplicate cluster id 'c1'"):
        load_topology(path)


def test_load_unknown_packaged_name_lists_the_available_ones() -> None:
    with pytest.raises(TopologyError, match=r"no packaged topology named 'nope'; available: .*small"):
        load_topology("nope")


def test_load_missing_file_raises_topology_error(tmp_path: Path) -> None:
    with pytest.raises(TopologyError, match="cannot read topology file"):
        load_topology(tmp_path / "missing.json")
