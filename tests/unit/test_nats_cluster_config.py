"""The replicated bus's plumbing without a running cluster: URLs, node configs, the process table."""

import json
import subprocess
from pathlib import Path

import pytest

from loom.bus import BusError, server_urls
from loom.runtime import stack
from loom.runtime.servers import NatsCluster, NatsServer, _nats_binary


def test_a_nats_url_may_list_every_node_of_a_cluster() -> None:
    assert server_urls("nats://a:4222") == ["nats://a:4222"]
    assert server_urls("nats://a:4222, nats://b:4222,,nats://c:4222 ") == [
        "nats://a:4222",
        "nats://b:4222",
        "nats://c:4222",
    ]
    with pytest.raises(BusError):
        server_urls(" , ")


def test_cluster_nodes_get_unique_names_own_stores_and_routes_to_every_node(tmp_path: Path) -> None:
    cluster = NatsCluster(tmp_path, 3)
    names = [node.server_name for node in cluster.nodes]
    assert names == ["nats-1", "nats-2", "nats-3"]
    assert len({node.data_dir for node in cluster.nodes}) == 3
    ports = [p for node in cluster.nodes for p in (node.port, node.monitor_port, node.cluster_port)]
    assert len(set(ports)) == 9
    route_ports = {node.cluster_port for node in cluster.nodes}
    assert all(set(node.route_ports) == route_ports for node in cluster.nodes)
    assert cluster.url == ",".join(f"nats://127.0.0.1:{node.port}" for node in cluster.nodes)


def test_the_real_nats_server_accepts_a_cluster_node_config(tmp_path: Path) -> None:
    node = NatsCluster(tmp_path, 3).nodes[1]
    node.data_dir.mkdir(parents=True)
    node._prepare(0.0)
    config = node.config_path.read_text()
    assert 'server_name: "nats-2"' in config
    assert f'listen: "127.0.0.1:{node.cluster_port}"' in config
    result = subprocess.run(
        [str(_nats_binary()), "-c", str(node.config_path), "-t"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_cluster_node_needs_a_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="server_name"):
        NatsServer(tmp_path, cluster_port=6222, route_ports=[6222])


def test_the_process_table_lists_every_nats_node(tmp_path: Path) -> None:
    up = {"pid": None, "port": 1, "status": "up", "restarts": 0, "last_exit": None, "crash_loop": False}
    state = {
        "status": "ready",
        "supervisor_pid": None,
        "servers": {
            "nats-1": up,
            "nats-2": {**up, "restarts": 1, "last_exit": "killed by SIGKILL"},
            "nats-3": up,
            "postgres": up,
        },
        "services": {},
    }
    (tmp_path / "stack.json").write_text(json.dumps(state))
    rows = stack.process_table(tmp_path)
    assert [row["name"] for row in rows] == ["supervisor", "nats-1", "nats-2", "nats-3", "postgres"]
    assert rows[2]["restarts"] == 1
    assert all(stack.is_server(row["name"]) for row in rows[1:])
    assert not stack.is_server("placement")


def test_the_deployment_template_matches_the_embedded_cluster(tmp_path: Path) -> None:
    """deploy/nats/cluster-3.conf and NatsCluster describe the same cluster (name, nodes, fsync)."""
    template = (Path(__file__).parents[2] / "deploy" / "nats" / "cluster-3.conf").read_text()
    node = NatsCluster(tmp_path, 3).nodes[0]
    node.data_dir.mkdir(parents=True)
    node._prepare(0.0)
    generated = node.config_path.read_text()
    assert "name: loom" in template
    assert 'name: "loom"' in generated
    for setting in ("sync_interval: always", "max_payload: 1MB"):
        assert setting in template
        assert setting in generated
    assert all(f"nats-route://nats-{i}:6222" in template for i in (1, 2, 3))
    assert "LOOM_STREAM_REPLICAS=3" in template
