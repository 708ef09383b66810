"""A service process started by hand: bad options refused before it connects, and stoppable while
NATS cannot be reached (a newcomer's walk: it ignored SIGTERM and Ctrl-C for 11 minutes)."""

import contextlib
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(tmp_path: Path) -> dict[str, str]:
    return dict(
        os.environ,
        LOOM_HOME=str(tmp_path),
        LOOM_NATS_URL=f"nats://127.0.0.1:{_closed_port()}",
        LOOM_DATABASE_URL=f"postgresql://127.0.0.1:{_closed_port()}/loom",
    )


AGENT = [sys.executable, "-m", "loom_services.cluster_agent"]


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--cluster", "nosuch"], "has no cluster 'nosuch'"),
        (["--cluster", "c-weu-a", "--topology", "/nonexistent.json"], "cannot read topology file"),
        (["--cluster", "c-weu-a", "--true-speed", "garbage"], "is not FAMILY:GPU=FACTOR"),
        (["--cluster", "c-weu-a", "--true-speed", "gru:T4=-1"], "must be positive"),
        (["--cluster", "c-weu-a", "--time-scale", "-5"], "--time-scale must be a positive number"),
        (["--cluster", "c-weu-a", "--heartbeat-s", "5", "--max-heartbeat-s", "1"], "at least --heartbeat-s"),
    ],
)
def test_the_agent_refuses_a_bad_option_before_it_connects(
    argv: list[str], said: str, tmp_path: Path
) -> None:
    out = subprocess.run(
        AGENT + argv, env=_env(tmp_path), capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert said in out.stderr and "Traceback" not in out.stderr


def test_a_service_waiting_for_nats_stops_on_sigterm(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [*AGENT, "--cluster", "c-weu-a"],
        env=_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout or ()], daemon=True).start()
    said: list[str] = []
    try:
        deadline = time.monotonic() + 30
        while not any("waiting for nats" in line for line in said):  # bounded: never a hang
            assert time.monotonic() < deadline, f"it never said it waits for NATS: {said}"
            with contextlib.suppress(queue.Empty):
                said.append(lines.get(timeout=1.0))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        time.sleep(0.2)  # the reader takes the last lines
        while not lines.empty():
            said.append(lines.get_nowait())
        assert any("service stopped before it connected" in line for line in said), said
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
