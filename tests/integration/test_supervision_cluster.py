"""``loom up --nats-cluster 3``: three nats-server nodes, each watched and restarted on its own.

The real supervisor process with its servers and no services (``--servers-only``), as in
test_supervision.py. The stream leader is SIGKILLed while acknowledged publishes go on; the
supervisor restarts it on its port and data directory, it rejoins and catches up, and
``loom status`` shows the three nodes with the restart.
"""

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from nats.errors import TimeoutError as NatsTimeoutError
from waiting import until

from loom.bus import Publisher, connect
from loom.runtime import stack
from loom_proto import JobSubmitted, Work
from loom_proto import subjects as s
from loom_proto.subjects import STREAMS

pytestmark = pytest.mark.slow

NODES = {"nats-1", "nats-2", "nats-3"}


@pytest.fixture
def home() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="loom-cluster-", dir="/tmp"))
    path.chmod(0o755)  # PostgreSQL runs as an unprivileged user when tests run as root
    saved = {k: os.environ.pop(k, None) for k in ("LOOM_NATS_URL", "LOOM_DATABASE_URL")}
    try:
        stack.up(path, stack.StackOptions(services=False, nats_cluster=3), timeout_s=90)
        yield path
    finally:
        stack.down(path)
        for key, value in saved.items():
            if value is not None:
                os.environ[key] = value
        shutil.rmtree(path, ignore_errors=True)


def _state(home: Path) -> dict[str, Any]:
    state = stack.read_state(home)
    assert state is not None
    return state


def _status_rows(home: Path) -> dict[str, dict[str, Any]]:
    out = subprocess.run(
        [sys.executable, "-m", "loom.cli.main", "status", "--json"],
        env=dict(os.environ, LOOM_HOME=str(home)),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return {row["name"]: row for row in json.loads(out.stdout)["processes"]}


async def test_a_killed_cluster_node_is_restarted_by_the_supervisor_and_rejoins(home: Path) -> None:
    state = _state(home)
    assert set(state["servers"]) >= NODES
    ports = {name: state["servers"][name]["port"] for name in NODES}
    assert state["nats_url"].split(",") == [f"nats://127.0.0.1:{ports[n]}" for n in sorted(NODES)]
    rows = _status_rows(home)
    assert all(rows[name]["alive"] and rows[name]["server_status"] == "up" for name in NODES)

    nc = await connect(state["nats_url"], "test-cluster-stack")
    try:
        js = nc.jetstream()
        for spec in STREAMS:  # the supervisor created them with the replicas it set
            assert (await js.stream_info(spec.name)).config.num_replicas == 3, spec.name
        info = await js.stream_info("REQUESTS")  # where the submissions below go
        assert info.cluster is not None and info.cluster.leader in NODES
        victim = info.cluster.leader
        before = state["servers"][victim]

        tenant = f"t-{os.getpid()}"
        publisher = Publisher(nc)
        acked_at: list[float] = []
        for n in range(40):
            if n == 10:
                os.kill(int(before["pid"]), signal.SIGKILL)
            message = JobSubmitted(job_id=f"job-{n}", tenant=tenant, name="", work=Work(steps=1))
            await publisher.publish(s.job_submitted(tenant), message, msg_id=f"{tenant}-{n}")
            acked_at.append(time.monotonic())
        stall_s = max(b - a for a, b in itertools.pairwise(acked_at))
        print(f"\nstack node kill ({victim}, stream leader): publish stall {stall_s:.2f} s")
        assert stall_s < 30.0

        async def restarted() -> dict[str, Any] | None:
            server = _state(home)["servers"][victim]
            return dict(server) if server["restarts"] == 1 and server["status"] == "up" else None

        after = await until(restarted, 45, f"{victim} restarted by the supervisor")
        assert after["pid"] != before["pid"]
        assert after["port"] == before["port"]
        assert after["last_exit"] == "killed by SIGKILL"

        async def rejoined() -> bool:
            stream = await js.stream_info("REQUESTS")
            peers = stream.cluster.replicas if stream.cluster is not None else None
            return (
                bool(peers)
                and all(p.current and not p.offline for p in peers or [])
                and {
                    stream.cluster.leader if stream.cluster else None,
                    *(p.name for p in peers or []),
                }
                == NODES
            )

        await until(
            rejoined, 30, f"{victim} to rejoin REQUESTS as a current replica", retry_on=(NatsTimeoutError,)
        )
        stored = await js.stream_info("REQUESTS", subjects_filter=s.job_submitted(tenant))
        assert (stored.state.subjects or {}).get(s.job_submitted(tenant)) == 40
    finally:
        await nc.close()

    rows = _status_rows(home)
    assert rows[victim]["restarts"] == 1
    assert rows[victim]["last_exit"] == "killed by SIGKILL"
    assert all(rows[name]["alive"] for name in NODES)
    assert all(rows[name]["restarts"] == 0 for name in NODES - {victim})
