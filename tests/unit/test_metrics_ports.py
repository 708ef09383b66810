"""`loom up` gives every service a /metrics port, the state file keeps it and `loom status` lists it."""

import json
import os
import socket
import sys
import urllib.request
from pathlib import Path

import pytest

from loom.runtime.servers import find_free_port
from loom.runtime.stack import (
    ServiceProcess,
    StackOptions,
    Supervisor,
    metrics_ports,
    process_table,
)
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


_PRINT_PORT = f"import os; print(os.environ[{ENV_METRICS_PORT!r}])"


def _spawn_and_read_port(tmp_path: Path, options: StackOptions, port: int) -> tuple[int, str]:
    """Spawn a process that prints its metrics port, as the supervisor spawns a service."""
    supervisor = Supervisor(tmp_path, options)
    log = tmp_path / f"svc-{port}.log"
    svc = ServiceProcess("svc", [sys.executable, "-c", _PRINT_PORT], str(log), metrics_port=port)
    supervisor.spawn(svc, dict(os.environ))
    assert supervisor.procs["svc"].wait(timeout=30) == 0
    assert svc.metrics_port is not None
    return svc.metrics_port, log.read_text().strip()


def test_a_picked_port_another_listener_took_is_picked_again_at_spawn(tmp_path: Path) -> None:
    """A free port picked for a service and taken before it bound it: restarting on it would die
    on "address already in use" for ever (an e2e stack crash-looped so until its start timeout)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        got, seen = _spawn_and_read_port(tmp_path, StackOptions(), port)
        assert got != port
        assert seen == str(got)
    free = find_free_port()
    assert _spawn_and_read_port(tmp_path, StackOptions(), free) == (free, str(free))


def test_a_port_its_own_answered_scrapes_left_in_time_wait_is_kept(tmp_path: Path) -> None:
    """The service's server closes each scrape's connection first, leaving it in TIME_WAIT on the
    port for a minute; the server binds with SO_REUSEADDR, so a restart there works: no move."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("0.0.0.0", 0))
    listener.listen()
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    answered, _ = listener.accept()
    answered.close()  # the server closes first: its side of the connection goes to TIME_WAIT
    client.close()
    listener.close()
    # The state the test needs: a plain bind (no SO_REUSEADDR) is refused now.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as plain, pytest.raises(OSError):
        plain.bind(("0.0.0.0", port))
    assert _spawn_and_read_port(tmp_path, StackOptions(), port) == (port, str(port))


def test_a_configured_base_port_is_kept_even_when_taken(tmp_path: Path) -> None:
    """An operator's --metrics-port-base is what Prometheus scrapes: never moved behind its back."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        options = StackOptions(metrics_port_base=port)
        assert _spawn_and_read_port(tmp_path, options, port) == (port, str(port))


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


def test_the_consoles_picked_port_another_listener_took_is_picked_again_at_spawn(tmp_path: Path) -> None:
    # A parallel test run's server took the port picked for the console before it bound it: the
    # console crash-looped on "address already in use" and the stack never started.
    _print_argv = "import sys; print(sys.argv[sys.argv.index('--port') + 1])"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        supervisor = Supervisor(tmp_path, StackOptions(console_port=port))
        supervisor._console_port_chosen = True  # as the stack's start picked it
        log = tmp_path / "console.log"
        svc = ServiceProcess("console", [sys.executable, "-c", _print_argv, "--port", str(port)], str(log))
        supervisor.spawn(svc, dict(os.environ))
        assert supervisor.procs["console"].wait(timeout=30) == 0
        moved = supervisor.options.console_port
        assert moved != port and log.read_text().strip() == str(moved)
        assert supervisor.state["console_url"] == f"http://127.0.0.1:{moved}"
        # A port the operator asked for (--console-port) stays, taken or not.
        fixed = Supervisor(tmp_path, StackOptions(console_port=port))
        kept = ServiceProcess("console", [sys.executable, "-c", _print_argv, "--port", str(port)], str(log))
        fixed.spawn(kept, dict(os.environ))
        assert fixed.procs["console"].wait(timeout=30) == 0
        assert fixed.options.console_port == port and kept.argv[-1] == str(port)
