"""`loom up` gives every service a /metrics port, the state file keeps it and `loom status` lists it."""

import json
import os
import urllib.request
from pathlib import Path

import pytest

from loom.runtime.stack import metrics_ports, process_table
from loom.telemetry.metrics import ENV_METRICS_PORT, serve_metrics


def test_a_base_port_gives_consecutive_ports_in_start_order() -> None:
    assert metrics_ports(["placement", "metrics", "agent-a"], 9500) == {
        "placement": 9500,
        "metrics": 9501,
        "agent-a": 9502,
    }


def test_without_a_base_every_service_gets_a_free_port_of_its_own() -> None:
    ports = metrics_ports([f"s{i}" for i in range(5)], 0)
    assert len(set(ports.values())) == 5
    assert all(1024 <= p <= 65535 for p in ports.values())


def test_status_lists_each_services_metrics_url(tmp_path: Path) -> None:
    state = {
        "status": "ready",
        "supervisor_pid": os.getpid(),
        "services": {
            "metrics": {"pid": os.getpid(), "restarts": 0, "last_exit": None, "metrics_port": 9501},
            "old": {"pid": os.getpid(), "restarts": 0, "last_exit": None},
        },
    }
    (tmp_path / "stack.json").write_text(json.dumps(state))
    rows = {r["name"]: r for r in process_table(tmp_path)}
    assert rows["metrics"]["metrics_url"] == "http://127.0.0.1:9501/metrics"
    assert rows["old"]["metrics_url"] is None


def test_a_service_serves_metrics_on_the_port_its_environment_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_METRICS_PORT, raising=False)
    assert serve_metrics("quiet") is None
    (port,) = metrics_ports(["probe"], 0).values()
    monkeypatch.setenv(ENV_METRICS_PORT, str(port))
    assert serve_metrics("loud") == port
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert 'loom_service_info{service="loud"} 1.0' in body
    assert "# TYPE loom_decision_latency_seconds histogram" in body
