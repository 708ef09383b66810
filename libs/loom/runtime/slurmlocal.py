"""Local Slurm clusters on one machine, for tests and ``loom up --slurm``.

Each :class:`LocalSlurmCluster` is an independent Slurm cluster (Debian's ``slurm-wlm`` 22.05):
its own ``slurm.conf`` and ``gres.conf``, ``ClusterName``, controller port, state and spool
directories, one ``slurmctld`` and one ``slurmd`` per node (``slurmd -N NODE``, each on its own
port), all in the foreground as child processes. GPUs are fake: character device nodes made with
``mknod`` (the null device's numbers), listed in ``gres.conf`` so Slurm counts, allocates and
exports them (``CUDA_VISIBLE_DEVICES``) as it would real ones. One ``munged`` with its own key
and socket authenticates every cluster (:class:`LocalMunge`).

Stopping is the reverse of starting: every ``slurmd`` first, then ``slurmctld``, then ``munged``.
Needs root (``SlurmUser=root``; ``mknod``) and the ``slurm-wlm`` and ``munge`` packages
(:func:`ensure_installed` installs them with apt when missing).
"""

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Self

from loom.model.topology import Cluster
from loom.runtime.servers import find_free_port

SLURM_PACKAGES = ("slurm-wlm", "munge")
SLURM_BINARIES = ("slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "sinfo", "munged")


class LocalSlurmError(RuntimeError):
    """A local Slurm daemon could not be installed, started or brought to idle."""


def missing_binaries() -> list[str]:
    """The Slurm and munge programs not found on ``PATH`` (``/usr/sbin`` included)."""
    path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    return [b for b in SLURM_BINARIES if shutil.which(b, path=path) is None]


def ensure_installed() -> None:
    """Install ``slurm-wlm`` and ``munge`` with apt when a program is missing (non-interactive).

    Raises :class:`LocalSlurmError` when they are still missing afterwards.
    """
    if not missing_binaries():
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "install", "-y", *SLURM_PACKAGES], env=env, check=False, capture_output=True)
    missing = missing_binaries()
    if missing:
        raise LocalSlurmError(
            f"Slurm is not installed (missing {', '.join(missing)}); apt-get install failed"
        )


def _sbin(name: str) -> str:
    found = shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")
    if found is None:
        raise LocalSlurmError(f"{name} not found (install slurm-wlm and munge)")
    return found


def _stop(proc: subprocess.Popen[bytes], timeout_s: float = 10.0) -> None:
    _stop_all([proc], timeout_s)


def _stop_all(procs: list[subprocess.Popen[bytes]], timeout_s: float = 10.0) -> None:
    """SIGTERM them all, then wait for each (SIGKILL after ``timeout_s``)."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout_s)


class LocalMunge:
    """A ``munged`` with its own key and socket under ``root``."""

    def __init__(self, root: Path, preexec: Callable[[], None] | None = None) -> None:
        self.root = root
        self.preexec = preexec
        self.socket = root / "munge.socket"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 10.0) -> None:
        """Write a key and start the daemon; returns once its socket exists."""
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o755)  # munged wants its socket's directory traversable
        key = self.root / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
            key.chmod(0o600)
        log = open(self.root / "munged.out", "ab")  # noqa: SIM115 - closed with the process
        self.proc = subprocess.Popen(
            [
                _sbin("munged"),
                "--foreground",
                "--force",
                f"--key-file={key}",
                f"--socket={self.socket}",
                f"--pid-file={self.root / 'munged.pid'}",
                f"--log-file={self.root / 'munged.log'}",
                f"--seed-file={self.root / 'munged.seed'}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=self.preexec,  # noqa: PLW1509 - a parent-death signal only, async-signal-safe
        )
        log.close()
        deadline = time.monotonic() + timeout_s
        while not self.socket.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise LocalSlurmError(
                    f"munged did not start: {(self.root / 'munged.out').read_text()[-2000:]}"
                )
            time.sleep(0.05)

    def stop(self) -> None:
        """Stop the daemon."""
        if self.proc is not None:
            _stop(self.proc)
            self.proc = None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


@dataclass
class LocalDaemon:
    """One daemon of local Slurm (``munged``, a ``slurmctld``, a ``slurmd``) in the shape the
    stack's supervisor keeps a server up (:class:`loom.runtime.stack.ServerWatch`): its pid, its
    exit once it died on its own, cleaning up after it, starting it again."""

    name: str
    port: int
    process: Callable[[], subprocess.Popen[bytes] | None]
    """The daemon's process now (None: never started, or stopped on purpose)."""
    launch: Callable[[], None]
    """Start it again (same configuration, port and state directory)."""
    pid_file: Path
    stale: tuple[Path, ...] = ()
    """Other files a dead daemon leaves that its next start must not find (munged's socket)."""

    @property
    def pid(self) -> int | None:
        """The daemon's process id while it runs, else None."""
        proc = self.process()
        return proc.pid if proc is not None and proc.poll() is None else None

    def poll_exit(self) -> int | None:
        """The exit status of a daemon that died (reaping it), else None."""
        proc = self.process()
        return proc.poll() if proc is not None else None

    def clean_after_exit(self) -> None:
        """Remove the dead daemon's pid file (never one naming a live process). Its children end
        with it (slurmctld's slurmscriptd; a slurmd's jobs run on under their own slurmstepd,
        which the next slurmd finds again in its spool directory)."""
        try:
            pid = int(self.pid_file.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            pid = 0
        if pid and _pid_alive(pid) and pid != self.pid:
            raise LocalSlurmError(f"{self.name}: {self.pid_file} names process {pid}, still alive")
        for path in (self.pid_file, *self.stale):
            path.unlink(missing_ok=True)

    def start(self) -> None:
        """Start the daemon again (a no-op while it runs)."""
        if self.pid is None:
            self.launch()


@dataclass(frozen=True)
class SlurmNode:
    """One node of a local cluster: its name, GPU type (Slurm's GRES type) and GPU count."""

    name: str
    gpu_type: str
    gpus: int
    cpus: int = 16
    memory_mib: int = 64_000


def slurm_nodes(cluster: Cluster, limit: int = 2) -> list[SlurmNode]:
    """Nodes for a local Slurm cluster standing in for a Loom cluster: up to ``limit`` of its GPU
    nodes, one of each GPU model first, under their topology names, with their GPUs as GRES of
    type ``model.lower()`` (the slurm backend maps it back by upper-casing)."""
    gpu_nodes = [n for n in cluster.nodes if n.gpu_model and n.gpus > 0]
    firsts = list({n.gpu_model: n for n in reversed(gpu_nodes)}.values())[::-1]
    chosen = (firsts + [n for n in gpu_nodes if n not in firsts])[:limit]
    return [
        SlurmNode(name=n.id, gpu_type=str(n.gpu_model).lower(), gpus=n.gpus)
        for n in sorted(chosen, key=lambda n: n.id)
    ]


@dataclass
class LocalSlurmCluster:
    """One independent Slurm cluster under ``root`` (see the module docstring)."""

    name: str
    root: Path
    nodes: list[SlurmNode]
    munge_socket: Path
    preexec: Callable[[], None] | None = None
    """Run in each daemon before it starts (the stack's parent-death signal)."""
    ctld_port: int = 0
    node_ports: dict[str, int] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def conf(self) -> Path:
        """The cluster's ``slurm.conf``: ``SLURM_CONF`` for every Slurm command aimed at it."""
        return self.root / "etc" / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """The environment for Slurm commands aimed at this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def write_config(self) -> None:
        """Write ``slurm.conf``, ``gres.conf`` and the fake GPU device nodes."""
        etc = self.root / "etc"
        for d in (etc, self.root / "state", self.root / "spool", self.root / "log", self.root / "dev"):
            d.mkdir(parents=True, exist_ok=True)
        self.ctld_port = self.ctld_port or find_free_port()
        host = socket.gethostname()
        lines = [
            f"ClusterName={self.name}",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={self.ctld_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={self.root / 'state'}",
            f"SlurmdSpoolDir={self.root / 'spool'}/%n",
            f"SlurmctldPidFile={self.root / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.root / 'spool'}/slurmd-%n.pid",
            f"SlurmctldLogFile={self.root / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={self.root / 'log'}/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "GresTypes=gpu",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "MailProg=/bin/true",
            # Accounting without slurmdbd: every ended job's record in a file, for `sacct -c`.
            "JobCompType=jobcomp/filetxt",
            f"JobCompLoc={self.root / 'log' / 'jobcomp.txt'}",
            "SlurmdParameters=config_overrides",
            "ReturnToService=2",
            "SchedulerType=sched/builtin",
            "SchedulerParameters=sched_min_interval=0,batch_sched_delay=0",
            "MinJobAge=600",
            "KillWait=2",
            "InactiveLimit=0",
            "SlurmdTimeout=60",
            "MessageTimeout=5",
        ]
        gres = []
        for node in self.nodes:
            port = self.node_ports.setdefault(node.name, find_free_port())
            (self.root / "spool" / node.name).mkdir(parents=True, exist_ok=True)
            devices = self.root / "dev" / node.name
            devices.mkdir(parents=True, exist_ok=True)
            for i in range(node.gpus):
                dev = devices / f"nvidia{i}"
                if not dev.exists():
                    os.mknod(dev, 0o666 | 0o020000, os.makedev(1, 3))  # a character device, like /dev/null
            lines.append(
                f"NodeName={node.name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port}"
                f" CPUs={node.cpus} RealMemory={node.memory_mib} Gres=gpu:{node.gpu_type}:{node.gpus}"
                " State=UNKNOWN"
            )
            last = f"[0-{node.gpus - 1}]" if node.gpus > 1 else "0"
            gres.append(f"NodeName={node.name} Name=gpu Type={node.gpu_type} File={devices}/nvidia{last}")
        lines.append("PartitionName=gpu Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")
        (etc / "gres.conf").write_text("\n".join(gres) + "\n")

    def _spawn(self, key: str, argv: list[str]) -> None:
        out = open(self.root / "log" / f"{key}.out", "ab")  # noqa: SIM115 - closed with the process
        self.procs[key] = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.env,
            preexec_fn=self.preexec,  # noqa: PLW1509 - a parent-death signal only, async-signal-safe
        )
        out.close()

    def start_controller(self) -> None:
        """Start ``slurmctld`` (state kept from a previous run of this cluster)."""
        self._spawn("slurmctld", [_sbin("slurmctld"), "-D", "-f", str(self.conf)])

    def start_node(self, node: str) -> None:
        """Start the ``slurmd`` of one node."""
        self._spawn(f"slurmd-{node}", [_sbin("slurmd"), "-D", "-N", node, "-f", str(self.conf)])

    def daemons(self) -> list[LocalDaemon]:
        """The cluster's daemons for the supervisor to keep up: slurmctld, then each slurmd."""
        found = [
            LocalDaemon(
                name=f"slurmctld-{self.name}",
                port=self.ctld_port,
                process=lambda: self.procs.get("slurmctld"),
                launch=self.start_controller,
                pid_file=self.root / "slurmctld.pid",
            )
        ]
        for node in self.nodes:
            key = f"slurmd-{node.name}"
            found.append(
                LocalDaemon(
                    name=f"slurmd-{self.name}-{node.name}",
                    port=self.node_ports.get(node.name, 0),
                    process=lambda key=key: self.procs.get(key),  # type: ignore[misc]
                    launch=lambda name=node.name: self.start_node(name),  # type: ignore[misc]
                    pid_file=self.root / "spool" / f"slurmd-{node.name}.pid",
                )
            )
        return found

    def start(self, timeout_s: float = 30.0) -> None:
        """Write the configuration, start the controller and every node, wait until all are idle."""
        self.write_config()
        self.start_controller()
        for node in self.nodes:
            self.start_node(node.name)
        self.wait_idle(timeout_s)

    def node_states(self) -> dict[str, str]:
        """Each node's state as ``sinfo`` shows it (``idle``, ``mix``, ``down*``...); empty while the
        controller does not answer."""
        try:
            out = subprocess.run(
                ["sinfo", "-h", "-N", "-o", "%N %t"],
                check=False,
                env=self.env,
                capture_output=True,
                text=True,
                timeout=10,
            )
        except subprocess.TimeoutExpired:
            return {}
        if out.returncode != 0:
            return {}
        return dict(line.split(maxsplit=1) for line in out.stdout.splitlines() if line.strip())

    def wait_idle(self, timeout_s: float = 30.0) -> None:
        """Wait until every node is idle; raises :class:`LocalSlurmError` with the logs if not."""
        deadline = time.monotonic() + timeout_s
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            for key, proc in self.procs.items():
                if proc.poll() is not None:
                    raise LocalSlurmError(f"{self.name}: {key} exited ({proc.returncode}): {self.logs()}")
            states = self.node_states()
            if len(states) == len(self.nodes) and all(s in ("idle", "mix", "alloc") for s in states.values()):
                return
            time.sleep(0.1)
        raise LocalSlurmError(
            f"{self.name}: nodes not idle after {timeout_s:.0f} s ({states}): {self.logs()}"
        )

    def logs(self, tail_chars: int = 3000) -> str:
        """The end of every daemon's output, for an error message."""
        parts = []
        for path in sorted((self.root / "log").glob("*")):
            parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-tail_chars:]}")
        return "\n".join(parts)

    def cancel_jobs(self, timeout_s: float = 10.0) -> None:
        """Cancel every job and wait until none is active: a job's ``slurmstepd`` outlives its
        ``slurmd`` (it is not its child), so jobs must end before the daemons stop."""
        if "slurmctld" not in self.procs:
            return
        try:
            subprocess.run(
                ["scancel", "--user=root"], env=self.env, capture_output=True, check=False, timeout=timeout_s
            )
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                out = subprocess.run(
                    ["squeue", "-h", "-o", "%i"],
                    env=self.env,
                    capture_output=True,
                    text=True,
                    check=False,
                    timeout=10,
                )
                if out.returncode != 0 or not out.stdout.strip():
                    return
                time.sleep(0.1)
        except subprocess.TimeoutExpired:
            return

    def stop_nodes(self) -> None:
        """Stop every ``slurmd`` (all at once)."""
        _stop_all([self.procs.pop(k) for k in list(self.procs) if k.startswith("slurmd-")])

    def stop_controller(self) -> None:
        """Stop ``slurmctld``."""
        proc = self.procs.pop("slurmctld", None)
        if proc is not None:
            _stop(proc)

    def stop(self) -> None:
        """Cancel the jobs, stop the nodes, then the controller."""
        self.cancel_jobs()
        self.stop_nodes()
        self.stop_controller()


class LocalSlurms:
    """Several independent local Slurm clusters sharing one ``munged``; a context manager."""

    def __init__(
        self, root: Path, clusters: dict[str, list[SlurmNode]], preexec: Callable[[], None] | None = None
    ) -> None:
        self.root = root
        self.munge = LocalMunge(root / "munge", preexec)
        self.clusters = {
            name: LocalSlurmCluster(
                name=name, root=root / name, nodes=nodes, munge_socket=self.munge.socket, preexec=preexec
            )
            for name, nodes in clusters.items()
        }

    def start(self, timeout_s: float = 60.0) -> None:
        """Start munge, then every cluster's daemons, then wait until all nodes are idle."""
        ensure_installed()
        self.munge.start()
        try:
            for cluster in self.clusters.values():
                cluster.write_config()
                cluster.start_controller()
                for node in cluster.nodes:
                    cluster.start_node(node.name)
            for cluster in self.clusters.values():
                cluster.wait_idle(timeout_s)
        except BaseException:
            self.stop()
            raise

    def daemons(self) -> list[LocalDaemon]:
        """Every daemon for the supervisor to keep up: munged, then each cluster's."""
        munge = LocalDaemon(
            name="munged",
            port=0,
            process=lambda: self.munge.proc,
            launch=self.munge.start,
            pid_file=self.munge.root / "munged.pid",
            stale=(self.munge.socket,),
        )
        return [munge, *(d for c in self.clusters.values() for d in c.daemons())]

    def stop(self) -> None:
        """Cancel every cluster's jobs, stop the nodes, then the controllers, then munge."""
        for cluster in self.clusters.values():
            cluster.cancel_jobs()
        _stop_all([c.procs.pop(k) for c in self.clusters.values() for k in list(c.procs) if k != "slurmctld"])
        _stop_all([c.procs.pop("slurmctld") for c in self.clusters.values() if "slurmctld" in c.procs])
        self.munge.stop()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
