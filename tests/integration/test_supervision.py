"""The supervisor owns its servers: a SIGKILLed nats-server, PostgreSQL, or local Slurm daemon
(slurmctld, slurmd, munged of ``--slurm``) comes back by itself.

``loom up --servers-only --slurm`` runs the real supervisor process with its two servers, one
local Slurm cluster and no services (the services would only slow the start on a small machine;
the server watching is the same).
"""

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import nats
import pytest
from waiting import until

from loom.bus.connection import auth_options, credentials_path
from loom.runtime import stack

pytestmark = pytest.mark.slow


SLURM_CLUSTER = "c-weu-a"
"""The cluster ``--slurm`` backs with a local Slurm here (its daemons are watched too)."""


@pytest.fixture(scope="module")
def home() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="loom-supervision-", dir="/tmp"))
    path.chmod(0o755)  # PostgreSQL runs as an unprivileged user when tests run as root
    saved = {k: os.environ.pop(k, None) for k in ("LOOM_NATS_URL", "LOOM_DATABASE_URL")}
    try:
        options = stack.StackOptions(services=False, topology="small", slurm_clusters=[SLURM_CLUSTER])
        stack.up(path, options, timeout_s=90)
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


def _zombie_children(parent: int) -> list[int]:
    zombies = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[-1].split()
        except OSError:
            continue
        if fields[0] == "Z" and int(fields[1]) == parent:
            zombies.append(int(entry.name))
    return zombies


async def _restarted(home: Path, name: str, restarts: int) -> dict[str, Any] | None:
    server = _state(home)["servers"][name]
    if server["restarts"] == restarts and server["status"] == "up" and server["pid"]:
        return dict(server)
    return None


def _reaped(pid: int) -> bool:
    return not Path(f"/proc/{pid}").exists()


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


async def _write_survivors(database_url: str, nats_url: str) -> int:
    """A row and a stream message written before the kills; returns the message's sequence."""
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute("CREATE TABLE survivors (name text PRIMARY KEY)")
        await conn.execute("INSERT INTO survivors VALUES ('before the kill')")
    finally:
        await conn.close()
    nc = await nats.connect(nats_url, **auth_options(credentials_path(nats_url)))
    try:
        js = nc.jetstream()
        await js.add_stream(name="SURVIVORS", subjects=["survivors.>"])
        ack = await js.publish("survivors.one", b"before the kill")
    finally:
        await nc.close()
    return ack.seq


async def _kill_and_wait(home: Path, name: str) -> tuple[int, dict[str, Any]]:
    """SIGKILL the server (its main process alone, as a crash would); wait for its restart."""
    before = _state(home)["servers"][name]
    os.kill(int(before["pid"]), signal.SIGKILL)
    after = await until(lambda: _restarted(home, name, 1), 45, f"{name} restarted")
    assert after["pid"] != before["pid"]
    assert after["port"] == before["port"]
    assert after["last_exit"] == "killed by SIGKILL"
    return int(before["pid"]), after


async def test_sigkilled_servers_come_back_on_their_port_with_their_data_and_no_zombie(home: Path) -> None:
    state = _state(home)
    seq = await _write_survivors(state["database_url"], state["nats_url"])

    # A SIGKILLed postmaster leaves backends holding its shared memory, pid and socket lock files.
    old_postgres, _ = await _kill_and_wait(home, "postgres")
    conn = await asyncpg.connect(state["database_url"])  # the same URL: same port, same data dir
    try:
        assert await conn.fetchval("SELECT name FROM survivors") == "before the kill"
    finally:
        await conn.close()

    old_nats, _ = await _kill_and_wait(home, "nats")
    nc = await nats.connect(state["nats_url"], **auth_options(credentials_path(state["nats_url"])))
    try:
        stored = await nc.jetstream().get_msg("SURVIVORS", seq)
        assert stored.data == b"before the kill"
    finally:
        await nc.close()

    assert _reaped(old_postgres), "the killed postmaster was never reaped"
    assert _reaped(old_nats), "the killed nats-server was never reaped"
    assert _zombie_children(int(state["supervisor_pid"])) == []
    rows = _status_rows(home)
    for name in ("nats", "postgres"):
        assert rows[name]["restarts"] == 1
        assert rows[name]["last_exit"] == "killed by SIGKILL"
        assert rows[name]["alive"]


def _slurm(home: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    conf = _state(home)["slurm"][SLURM_CLUSTER]["slurm_conf"]
    env = dict(os.environ, SLURM_CONF=conf)
    return subprocess.run(list(argv), env=env, capture_output=True, text=True, check=False, timeout=15)


async def _back(home: Path, name: str, old_pid: int) -> dict[str, Any] | None:
    server = _state(home)["servers"][name]
    if server["restarts"] == 1 and server["status"] == "up" and server["pid"] not in (None, old_pid):
        return dict(server)
    return None


async def _kill_daemon(home: Path, name: str) -> dict[str, Any]:
    before = _state(home)["servers"][name]
    os.kill(int(before["pid"]), signal.SIGKILL)
    after: dict[str, Any] = await until(lambda: _back(home, name, before["pid"]), 30, f"{name} back")
    assert after["port"] == before["port"] and after["last_exit"] == "killed by SIGKILL"
    assert _reaped(int(before["pid"])), f"the killed {name} was never reaped"
    return after


async def _job_state(home: Path, job: str, *states: str) -> str | None:
    done = _slurm(home, "squeue", "-h", "-t", "all", "-j", job, "-o", "%T %N")
    return (
        done.stdout.strip()
        if done.returncode == 0 and done.stdout.split()[:1] in [[s] for s in states]
        else None
    )


async def test_sigkilled_slurm_daemons_come_back_and_the_running_job_goes_on_once(home: Path) -> None:
    state = _state(home)
    servers = state["servers"]
    node = state["slurm"][SLURM_CLUSTER]["nodes"][0]
    ctld, slurmd = f"slurmctld-{SLURM_CLUSTER}", f"slurmd-{SLURM_CLUSTER}-{node}"
    assert {"munged", ctld, slurmd} <= set(servers)
    submitted = _slurm(
        home, "sbatch", "--parsable", f"--nodelist={node}", "--output=/dev/null", "--wrap=sleep 120"
    )
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    await until(lambda: _job_state(home, job, "RUNNING"), 20, "the job running")

    after = await _kill_daemon(home, ctld)
    # The restarted controller wrote its own pid file (the dead one's was removed first).
    pid_file = Path(state["slurm"][SLURM_CLUSTER]["slurm_conf"]).parents[1] / "slurmctld.pid"
    await until(
        lambda: asyncio.to_thread(_pid_file_names, pid_file, after["pid"]), 20, "slurmctld's pid file"
    )
    await _kill_daemon(home, slurmd)
    await _kill_daemon(home, "munged")
    # All three answer again (munged authenticates every request), and the job runs on, once.
    ran = await until(lambda: _job_state(home, job, "RUNNING"), 30, "the job still running")
    assert ran == f"RUNNING {node}"
    listed = _slurm(home, "squeue", "-h", "-o", "%i").stdout.split()
    assert listed == [job]
    assert _zombie_children(int(state["supervisor_pid"])) == []

    async def all_back() -> dict[str, dict[str, object]] | None:
        rows = {r["name"]: r for r in stack.process_table(home)}
        back = all(rows[n]["alive"] and int(rows[n]["restarts"]) >= 1 for n in ("munged", ctld, slurmd))
        return rows if back else None

    # Each was restarted (more than once if it died again while another was down) and is alive.
    await until(all_back, 20, "munged, slurmctld and slurmd alive after their restarts")
    assert stack.is_server(ctld) and stack.is_server(slurmd) and stack.is_server("munged")


def _pid_file_names(path: Path, pid: int) -> bool:
    try:
        return path.read_text().split()[0] == str(pid)
    except (OSError, IndexError):
        return False
