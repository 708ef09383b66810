"""The embedded stack: one supervisor process that owns NATS, PostgreSQL and every service.

``loom up`` starts the supervisor in the background and waits until it reports ready;
``loom down`` asks it to stop (SIGTERM) and waits. The supervisor starts nats-server (one, or with
``--nats-cluster 3`` three nodes of a JetStream cluster whose streams keep 3 replicas) and
PostgreSQL from their wheels (unless ``LOOM_NATS_URL`` / ``LOOM_DATABASE_URL`` name external
ones), migrates the database, launches each service as its own OS process with its log under
``<home>/logs/``, restarts a service that dies (with backoff), and on stop shuts everything down
in reverse order. It owns its servers the same way: a nats-server or PostgreSQL that dies is
reaped, what is left of it killed, its stale pid and lock files removed, and it is started again
on the same port and data directory (:class:`ServerWatch`; each node of a NATS cluster is watched
on its own and rejoins the cluster when it comes back; the local Slurm daemons of ``--slurm``,
munged, each slurmctld and each slurmd, are kept up the same way). Every child gets a parent-death
signal, so nothing outlives a killed supervisor. The state file ``<home>/stack.json`` tells other
commands where everything is, with each process's restarts and last exit.
"""

import argparse
import asyncio
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

import structlog

from loom.bus import connect, ensure_streams
from loom.bus.connection import remember_credentials
from loom.model.topology import load_topology
from loom.runtime.config import ENV_DATABASE_URL, ENV_HOME, ENV_NATS_URL, loom_home, stack_file
from loom.runtime.dbcreds import provision_roles
from loom.runtime.servers import (
    NatsCluster,
    NatsServer,
    PostgresServer,
    ServerStartError,
    check_postgres_listen,
    describe_exit,
    find_free_port,
    port_bindable,
    reap_orphans,
)
from loom.runtime.slurmlocal import LocalSlurmError, LocalSlurms, slurm_nodes
from loom.runtime.tokens import ensure_tokens
from loom.sched.shards import group_options, split_regions
from loom.security import ENV_CREDS, ENV_NATS_CA, CredentialStore, admin_identity, identity_for_process
from loom.security.http_token import (
    ENV_HTTP_TOKEN_FILE,
    ENV_TRACES_TOKEN_FILE,
    TokenFile,
    ensure_http_token,
    otlp_headers,
    read_http_token,
)
from loom.security.tls import TlsFiles, ensure_tls, is_loopback
from loom.store.migrations import migrate_url
from loom.store.roles import role_of
from loom.telemetry.metrics import ENV_METRICS_PORT
from loom.telemetry.spanstore import SpanFile, TraceServer
from loom.telemetry.tracing import OTLP_ENDPOINT_ENV
from loom_proto import subjects

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_REAP_EVERY = 10
"""Server checks between two scans for orphaned zombies (the loop checks every 0.2 s)."""
_REAP_AFTER_CHANGE_S = 5.0
"""After a server dies or restarts, scan at every check for this long: its orphans exit then."""

log = structlog.get_logger("loom.supervisor")

ENV_SECURE = "LOOM_SECURE"
"""``0``: stacks start with unauthenticated NATS unless their options say otherwise
(``StackOptions.secure``; secured is the default)."""
ENV_NEIGHBOUR_NICE = "LOOM_NEIGHBOUR_NICE"
"""The default of ``loom up --neighbour-nice`` (:attr:`StackOptions.neighbour_nice`)."""
NEIGHBOUR_NICE = 5
"""Niceness of every service but placement: under a burst the kernel gives placement (and the
NATS and PostgreSQL servers it waits on, left at 0) about 3x a neighbour's CPU share (CFS
weights 1024 vs 335)."""
MAX_NICE = 19
ENV_SECURE_DB = "LOOM_SECURE_DB"
SECURE_DB_DEFAULT = os.environ.get(ENV_SECURE_DB, "1") != "0"
"""Whether ``loom up`` secures PostgreSQL unless told (``--secure-db`` / ``--no-secure-db``): yes,
unless ``LOOM_SECURE_DB=0`` (e.g. to measure a benchmark without it)."""

ENV_STREAM_REPLICAS = "LOOM_STREAM_REPLICAS"
"""Replicas of Loom's streams, KV buckets and (inherited) consumers; read by loom.bus."""


def _child_preexec(nice: int = 0) -> Callable[[], None] | None:
    """The child's pre-exec: SIGTERM when the supervisor dies (Linux), and ``nice`` added to its
    niceness."""
    linux = sys.platform.startswith("linux")
    if not linux and not nice:
        return None
    libc = ctypes.CDLL(None, use_errno=True) if linux else None

    def preexec() -> None:
        if libc is not None:
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if nice:
            os.nice(nice)

    return preexec


CRASH_LOOP_RESTARTS = 5
CRASH_LOOP_WINDOW_S = 120.0
STABLE_S = 60.0
"""A server or service restarted ``CRASH_LOOP_RESTARTS`` times within ``CRASH_LOOP_WINDOW_S`` is
flagged crash-looping until it has stayed up ``STABLE_S``."""


def crash_looping(
    restarts_at: list[float],
    now: float,
    *,
    restarts: int = CRASH_LOOP_RESTARTS,
    window_s: float = CRASH_LOOP_WINDOW_S,
) -> tuple[list[float], bool]:
    """The restart times still within ``window_s`` (``now`` added) and whether they are ``restarts``
    or more: a crash loop (servers and services alike)."""
    kept = [t for t in restarts_at if now - t < window_s] + [now]
    return kept, len(kept) >= restarts


@dataclass
class ServiceProcess:
    """A service the supervisor runs, and how it is doing."""

    name: str
    argv: list[str]
    log: str
    pid: int | None = None
    restarts: int = 0
    started_at: float = 0.0
    last_exit: str | None = None
    """How the previous process ended (``killed by SIGKILL``), None before any exit."""
    metrics_port: int | None = None
    """Where it serves Prometheus ``/metrics``: the same port across restarts, unless it was a free
    port picked for it that another listener has taken since (then a new one)."""
    nice: int = 0
    """Added to its niceness at start (:func:`service_nice`)."""
    crash_loop: bool = False
    """It was restarted ``CRASH_LOOP_RESTARTS`` times within ``CRASH_LOOP_WINDOW_S`` and
    has not stayed up ``STABLE_S`` since (still restarted, at the backoff's delay)."""


def check_neighbour_nice(value: int) -> int:
    """``value`` if it is a neighbour niceness, 0-19 (raising a niceness needs no privilege;
    lowering one does), else ``ValueError`` saying so."""
    if not 0 <= value <= MAX_NICE:
        raise ValueError(f"neighbour niceness must be within 0-{MAX_NICE}, got {value}")
    return value


def neighbour_nice_value(text: str) -> int:
    """A ``--neighbour-nice`` / ``$LOOM_NEIGHBOUR_NICE`` value (:func:`check_neighbour_nice`)."""
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"neighbour niceness must be an integer 0-{MAX_NICE}, got {text!r}") from None
    return check_neighbour_nice(value)


def neighbour_nice_arg(text: str) -> int:
    """:func:`neighbour_nice_value` for argparse: its message, not "invalid … value"."""
    try:
        return neighbour_nice_value(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def default_secure() -> bool:
    """Whether stacks are secured unless their options say: yes, unless ``$LOOM_SECURE`` is 0."""
    return os.environ.get(ENV_SECURE, "1") != "0"


def default_neighbour_nice() -> int:
    """``$LOOM_NEIGHBOUR_NICE`` when set (checked), else :data:`NEIGHBOUR_NICE`."""
    text = os.environ.get(ENV_NEIGHBOUR_NICE, "").strip()
    if not text:
        return NEIGHBOUR_NICE
    try:
        return neighbour_nice_value(text)
    except ValueError as exc:
        raise ValueError(f"${ENV_NEIGHBOUR_NICE}: {exc}") from None


@dataclass
class StackOptions:
    """What `loom up` starts."""

    topology: str = "default"
    clusters: list[str] = field(default_factory=list)
    """Cluster agents to run; empty means every cluster of the topology."""
    time_scale: float = 60.0
    heartbeat_s: float = 2.0
    """Shortest heartbeat interval of the agents (while their cluster changes)."""
    max_heartbeat_s: float = 10.0
    """Longest heartbeat interval (while nothing changes)."""
    durable: bool = True
    probe_period_s: float = 1.0
    """Probe period of the collectors and of network-perception's evaluation."""
    network: bool = True
    """Run the probe collectors and network-perception (off: compute placement only)."""
    placement_standby: bool = True
    """Run a standby placement instance beside the leader."""
    placement_shards: int = 1
    """Placement shards: the topology's regions split by GPUs into this many territories (the
    global shard's and ``placement_shards - 1`` region groups, :func:`loom.sched.shards.split_regions`),
    one leader (and standby) each."""
    services: bool = True
    """Run the services (off: NATS and PostgreSQL only, for running services by hand or tests)."""
    nats_cluster: int = 1
    """nats-server processes: 1, or 3 for a JetStream cluster whose streams have 3 replicas."""
    console: bool = True
    """Run the web console (services/console); ``loom console`` prints its URL with a token."""
    console_port: int = 0
    """The console's port on 127.0.0.1; 0: a free port chosen when the stack starts."""
    alerts_port: int = 0
    """The alert correlator's Alertmanager webhook port on 127.0.0.1; 0: ``$LOOM_ALERTS_HTTP_PORT``
    if set (a port fixed in Alertmanager's configuration), else a free port chosen when the stack
    starts (a fixed default would reach another stack on the same machine)."""
    traces: bool = False
    """Keep every service's spans in a trace store the supervisor runs (``loom up --traces``:
    :mod:`loom.telemetry.spanstore`, files under ``<home>/traces/``), which ``loom trace`` reads
    as it reads Jaeger; off: spans go where ``OTEL_EXPORTER_OTLP_ENDPOINT`` says, or nowhere."""
    secure_db: bool = SECURE_DB_DEFAULT
    """The embedded PostgreSQL demands SCRAM passwords (no trust), generated here into 0600 files
    under ``<home>/secrets/``, and each service logs in as its own least-privilege role
    (:mod:`loom.store.roles`); off: every local connection is trusted, as the superuser."""
    metrics_port_base: int = 0
    """Prometheus ``/metrics`` ports: services get ``base``, ``base + 1``, … in start order; 0 gives
    each a free port. ``loom status`` lists them; deploy/prometheus/ shows how to scrape them."""
    tenants: str = ""
    """Tenant quotas for placement (``loom up --tenants FILE``: YAML or JSON, as
    ``deploy/tenants.example.yaml``; an absolute path); empty: every tenant admitted, no quota."""
    neighbour_nice: int = field(default_factory=default_neighbour_nice)
    """Niceness added to every service but placement (agents, probe collectors, network perception,
    metrics, migration, alerts, console): they leave the cores to placement when both want them, and
    get them all when placement is idle. 0: every service alike. ``$LOOM_NEIGHBOUR_NICE`` sets the
    default."""

    slurm_clusters: list[str] = field(default_factory=list)
    """Clusters whose agents run on a local Slurm cluster of their own (``--slurm``) instead of the
    simulation (:mod:`loom.runtime.slurmlocal`: two of a cluster's nodes, real slurmctld/slurmd)."""
    slurm_root: str = ""
    """Where the local Slurm clusters live (set by the supervisor: ``<home>/slurm``)."""
    secure: bool = field(default_factory=default_secure)
    """Authenticated, permissioned NATS (issue 18): NKEY credentials for every process under
    ``<home>/secrets/nats/``, each process connecting as its own identity (``loom.security``).
    On unless ``loom up --no-secure`` or ``LOOM_SECURE=0`` (which turns it off for every stack
    started without saying, the demo's and the benchmarks' included)."""
    postgres_host: str = "127.0.0.1"
    """The address the embedded PostgreSQL listens on (``loom up --postgres-host``): loopback only,
    anything else is refused (:func:`loom.runtime.servers.check_postgres_listen`: no SSL in the
    embedded build)."""
    nats_host: str = "127.0.0.1"
    """The address NATS listens on (``loom up --nats-host``). Off the loopback interface, the
    server requires TLS: a CA (``<home>/secrets/tls/ca.pem``, kept) and a server certificate for
    that address are generated, and every Loom process trusts that CA only (``$LOOM_NATS_CA``)."""

    def __post_init__(self) -> None:
        check_neighbour_nice(self.neighbour_nice)


def service_nice(name: str, options: StackOptions) -> int:
    """The niceness a service is started with: 0 for placement (leaders and standbys, every shard),
    :attr:`StackOptions.neighbour_nice` for the rest."""
    return 0 if role_of(name) == role_of("placement") else options.neighbour_nice


def metrics_ports(names: list[str], base: int) -> dict[str, int]:
    """The ``/metrics`` port of each service: consecutive from ``base``, or free ports when 0."""
    if base:
        return {name: base + i for i, name in enumerate(names)}
    return {name: find_free_port() for name in names}


HEALTHY_WITHIN_S = 120.0
"""How long a starting stack's services have to answer their first health check: some 17 Python
processes importing at once on 2 cores take 20-40 s, much longer on a loaded machine."""


SLURM_CLUSTER_COUNT = 2
"""Clusters ``loom up --slurm`` backs with local Slurm: the first ones of the topology."""


def default_slurm_clusters(topology: str, wanted: list[str]) -> list[str]:
    """The clusters ``--slurm`` puts on Slurm: the first two the stack runs."""
    ids = wanted or [c.id for c in load_topology(topology).clusters]
    return ids[:SLURM_CLUSTER_COUNT]


def placement_groups(options: StackOptions) -> dict[str, list[str]]:
    """The region groups of the stack's regional placement shards (none for one shard)."""
    if options.placement_shards <= 1:
        return {}
    topology = load_topology(options.topology)
    gpus: dict[str, float] = {r.id: 0.0 for r in topology.regions}
    for cluster in topology.clusters:
        gpus[cluster.region] = gpus.get(cluster.region, 0.0) + sum(n.gpus for n in cluster.nodes)
    _, groups = split_regions(gpus, options.placement_shards)
    return groups


ENV_ALERTS_HTTP_PORT = "LOOM_ALERTS_HTTP_PORT"
"""A fixed port for the alert correlator's webhook (Alertmanager's configuration names it)."""


def choose_alerts_port(environ: Mapping[str, str], previous: int | None = None) -> int:
    """The webhook port of a stack: ``$LOOM_ALERTS_HTTP_PORT`` when it is a port number (one that is
    not is logged and ignored); else the one this home's stack had last time (``previous``) when
    nothing listens there now, so an Alertmanager pointed at it keeps reaching it across ``loom
    down`` / ``loom up``; else a free port."""
    fixed = environ.get(ENV_ALERTS_HTTP_PORT, "").strip()
    if fixed.isascii() and fixed.isdigit() and 0 < int(fixed) < 65536:
        return int(fixed)
    if fixed:
        log.warning("not a port number: a free port is used", variable=ENV_ALERTS_HTTP_PORT, value=fixed)
    if previous is not None and 0 < previous < 65536 and port_bindable(previous):
        return previous
    return find_free_port()


def _port_of(url: object) -> int | None:
    """The port of a ``http://host:port/...`` URL kept in the state file (None when there is none)."""
    port = urlsplit(url).port if isinstance(url, str) else None
    return port if isinstance(port, int) else None


def service_argvs(options: StackOptions) -> dict[str, list[str]]:
    """The command line of every service process, by name."""
    py = sys.executable
    groups = group_options(placement_groups(options))
    if options.tenants:
        groups = [*groups, "--tenants", options.tenants]  # every placement instance, every shard
    argvs = {
        "metrics": [py, "-m", "loom_services.metrics"],
        # Alerts in, incidents out; its Alertmanager webhook listens on the stack's alerts port.
        "alert-correlator": [
            py,
            "-m",
            "loom_services.alert_correlator",
            "--topology",
            options.topology,
            *(["--http-port", str(options.alerts_port)] if options.alerts_port else []),
        ],
        # Replica copies are timed on the agents' clock.
        "migration": [py, "-m", "loom_services.migration", "--time-scale", str(options.time_scale)],
        "placement": [py, "-m", "loom_services.placement", "--topology", options.topology, *groups],
    }
    if options.placement_standby:
        # A second instance waits on the lease and takes over within seconds if the leader dies.
        argvs["placement-standby"] = [
            py,
            "-m",
            "loom_services.placement",
            "--topology",
            options.topology,
            "--name",
            "placement-standby",
            *groups,
        ]
    for shard in placement_groups(options):
        for name in [f"placement-{shard}"] + (
            [f"placement-{shard}-standby"] if options.placement_standby else []
        ):
            argvs[name] = [
                py,
                "-m",
                "loom_services.placement",
                "--topology",
                options.topology,
                "--shard",
                shard,
                "--name",
                name,
                *groups,
            ]
    topology = load_topology(options.topology)
    wanted = options.clusters or [c.id for c in topology.clusters]
    probed_regions: set[str] = set()
    for cluster_id in wanted:
        probed_regions.add(topology.cluster(cluster_id).region)  # refuses an unknown id first
        argvs[f"agent-{cluster_id}"] = [
            py,
            "-m",
            "loom_services.cluster_agent",
            "--cluster",
            cluster_id,
            "--topology",
            options.topology,
            "--time-scale",
            str(options.time_scale),
            "--heartbeat-s",
            str(options.heartbeat_s),
            "--max-heartbeat-s",
            str(options.max_heartbeat_s),
        ]
        if cluster_id in options.slurm_clusters:
            conf = Path(options.slurm_root) / cluster_id / "etc" / "slurm.conf"
            argvs[f"agent-{cluster_id}"] += ["--backend", "slurm", "--slurm-conf", str(conf)]
    # One collector per region with a cluster: it probes its peers through the in-process WAN
    # emulator, shaped like the topology's links (`loom net degrade` changes them).
    for region in sorted(probed_regions) if options.network else ():
        argvs[f"probe-{region}"] = [
            py,
            "-m",
            "loom_services.probe_collector",
            "--region",
            region,
            "--topology",
            options.topology,
            "--period-s",
            str(options.probe_period_s),
        ]
    if options.console:
        argvs["console"] = [
            py,
            "-m",
            "loom_services.console",
            "--topology",
            options.topology,
            "--port",
            str(options.console_port),
        ]
    if not options.network:
        return _watch_health(argvs)
    argvs["network-perception"] = [
        py,
        "-m",
        "loom_services.network_perception",
        "--topology",
        options.topology,
        "--period-s",
        str(options.probe_period_s),
    ]
    return _watch_health(argvs)


def _watch_health(argvs: dict[str, list[str]]) -> dict[str, list[str]]:
    """The alert correlator watches every other service's health answers (an alert when one stops
    answering)."""
    for name in argvs:
        if name != "alert-correlator":
            argvs["alert-correlator"] += ["--watch-health", name]
    return argvs


def is_server(name: str) -> bool:
    """Whether a process-table row names a server the supervisor owns (``nats-2`` and the local
    Slurm daemons of ``--slurm`` included)."""
    return name in ("nats", "postgres", "munged") or name.startswith(("nats-", "slurmctld-", "slurmd-"))


async def prepare(nats_url: str, database_url: str) -> None:
    """Migrate the database and create the streams, so clients can publish as soon as we are ready."""
    await migrate_url(database_url)
    nc = await connect(nats_url, "loom-supervisor")
    try:
        await ensure_streams(nc.jetstream())
    finally:
        await nc.drain()


async def wait_healthy(
    nats_url: str, names: list[str], timeout_s: float, *, tick: Callable[[], None] | None = None
) -> list[str]:
    """Wait until every named service answers its health subject; returns those that never did.

    ``tick`` runs before each round of requests: the supervisor restarts there a service that died
    while starting (one whose ``/metrics`` port was taken between its pick and its bind, say).
    """
    nc = await connect(nats_url, "loom-supervisor")
    pending = list(names)
    deadline = time.monotonic() + timeout_s
    try:
        while pending and time.monotonic() < deadline:
            if tick is not None:
                tick()
            for name in list(pending):
                try:
                    await nc.request(subjects.service_health(name), b"", timeout=0.5)
                except Exception:  # not up yet
                    continue
                pending.remove(name)
            if pending:
                await asyncio.sleep(0.1)
    finally:
        await nc.drain()
    return pending


@dataclass
class ServerState:
    """How one server the supervisor owns is doing, as ``stack.json`` and ``loom status`` show it."""

    name: str
    pid: int | None
    port: int
    status: str = "up"
    """``up``, or ``restarting`` between its death and its next successful start."""
    restarts: int = 0
    last_exit: str | None = None
    crash_loop: bool = False
    """It restarted ``crash_loop_restarts`` times within ``crash_loop_window_s`` and has not stayed
    up ``stable_s`` since."""


class Server(Protocol):
    """What :class:`ServerWatch` keeps up: a NATS server, PostgreSQL, or a local Slurm daemon
    (:class:`~loom.runtime.slurmlocal.LocalDaemon`)."""

    @property
    def pid(self) -> int | None:
        """Its process id while it runs."""
        ...

    @property
    def port(self) -> int:
        """The port it serves on (0: none)."""
        ...

    def poll_exit(self) -> int | None:
        """Its exit status once it died on its own (reaping it), else None."""
        ...

    def clean_after_exit(self) -> None:
        """Kill what is left of it and remove its stale files."""
        ...

    def start(self) -> None:
        """Start it again."""
        ...


class ServerWatch:
    """Keeps one server up: notices its death, cleans up after it, restarts it with backoff.

    Call :meth:`check` from the thread that started the server (the parent-death signal is tied
    to it). A death is noticed by reaping the process, so it never lingers as a zombie; then
    :meth:`~loom.runtime.servers.NatsServer.clean_after_exit` makes sure nothing of it survives
    before its stale files go, and the server starts again on the same port and data directory
    (Postgres recovers from its WAL, JetStream reloads its streams). Restart attempts wait
    ``first_delay_s`` doubled per consecutive failure, at most ``max_delay_s``; the count resets
    once the server has stayed up ``stable_s``. A server that keeps dying is flagged
    ``crash_loop`` (and logged) but still restarted, at the capped delay; the flag clears once it
    has stayed up ``stable_s``.
    """

    def __init__(
        self,
        name: str,
        server: Server,
        *,
        first_delay_s: float = 0.25,
        max_delay_s: float = 30.0,
        stable_s: float = STABLE_S,
        crash_loop_restarts: int = CRASH_LOOP_RESTARTS,
        crash_loop_window_s: float = CRASH_LOOP_WINDOW_S,
        on_restart: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.server = server
        self.state = ServerState(name, server.pid, server.port)
        self.first_delay_s = first_delay_s
        self.max_delay_s = max_delay_s
        self.stable_s = stable_s
        self.crash_loop_restarts = crash_loop_restarts
        self.crash_loop_window_s = crash_loop_window_s
        self._on_restart = on_restart
        self._clock = clock
        self._failures = 0
        self._up_since = clock()
        self._next_attempt = 0.0
        self._restart_times: list[float] = []

    def delay_s(self, failures: int) -> float:
        """How long to wait before a restart after ``failures`` consecutive deaths or failed starts."""
        return float(min(self.first_delay_s * 2 ** max(failures - 1, 0), self.max_delay_s))

    def check(self) -> bool:
        """Look at the server once, restarting it when due; True when its state changed."""
        now = self._clock()
        if self.state.status == "up":
            code = self.server.poll_exit()
            if code is None:
                if self._failures and now - self._up_since >= self.stable_s:
                    self._failures = 0
                if self.state.crash_loop and now - self._up_since >= self.stable_s:
                    self.state.crash_loop = False  # up long enough again: no longer looping
                    log.info(
                        "server stable again", server=self.state.name, up_s=round(now - self._up_since, 1)
                    )
                    return True
                return False
            self._failures += 1
            self.state.status = "restarting"
            self.state.last_exit = describe_exit(code)
            self.state.pid = None
            self._next_attempt = now + self.delay_s(self._failures)
            log.warning(
                "server died, restarting",
                server=self.state.name,
                exit=self.state.last_exit,
                retry_in_s=self.delay_s(self._failures),
            )
            return True
        if now < self._next_attempt:
            return False
        try:
            self.server.clean_after_exit()
            self.server.start()
        except (ServerStartError, LocalSlurmError, OSError) as exc:  # e.g. a full disk: retried
            self._failures += 1
            self.state.last_exit = f"restart failed: {str(exc).splitlines()[0]}"
            self._next_attempt = self._clock() + self.delay_s(self._failures)
            log.error("server restart failed", server=self.state.name, error=str(exc))
            return True
        self._up_since = now = self._clock()
        self.state.status = "up"
        self.state.pid = self.server.pid
        self.state.restarts += 1
        was_looping = self.state.crash_loop
        self._restart_times, self.state.crash_loop = crash_looping(
            self._restart_times, now, restarts=self.crash_loop_restarts, window_s=self.crash_loop_window_s
        )
        if self.state.crash_loop and not was_looping:
            log.error(
                "server is crash-looping",
                server=self.state.name,
                restarts_in_window=len(self._restart_times),
                window_s=self.crash_loop_window_s,
            )
        log.info("server restarted", server=self.state.name, pid=self.state.pid, port=self.state.port)
        if self._on_restart is not None:
            self._on_restart()
        return True


class Supervisor:
    """Runs in the supervisor process: starts, watches and stops everything."""

    def __init__(self, home: Path, options: StackOptions) -> None:
        self.home = home
        self.options = options
        self.nats: NatsServer | None = None
        self.nats_cluster: NatsCluster | None = None
        self.postgres: PostgresServer | None = None
        self.services: dict[str, ServiceProcess] = {}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.restart_at: dict[str, float] = {}
        """Service -> when its restart is due (:meth:`restart_dead`; absent: not noticed dead yet)."""
        self.restarted_at: dict[str, list[float]] = {}
        """Service -> its restarts within the crash-loop window (wall s)."""
        self.state: dict[str, Any] = {}
        self.stopping = False
        self.watches: dict[str, ServerWatch] = {}
        self.slurm: LocalSlurms | None = None
        self.traces: TraceServer | None = None
        """The trace store (:meth:`start_traces`) when the stack keeps its own spans."""
        self._checks = 0
        self._reaping_until = 0.0
        self.credentials: CredentialStore | None = None
        """The stack's NATS credentials when it is secured."""
        self.role_urls: dict[str, str] = {}
        self._console_port_chosen = False
        """Whether the console's port was picked here (not asked for): then it may move."""
        """Each service role's database URL when PostgreSQL is secured (:attr:`StackOptions.secure_db`)."""

    def write_state(self, status: str, **extra: Any) -> None:
        """Atomically rewrite the state file."""
        self.state.update(
            status=status,
            supervisor_pid=os.getpid(),
            home=str(self.home),
            services={name: asdict(s) for name, s in self.services.items()},
            servers={name: asdict(w.state) for name, w in self.watches.items()},
            **extra,
        )
        path = stack_file(self.home)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state, indent=2))
        os.replace(tmp, path)

    def start_servers(self) -> tuple[str, str]:
        """Start (or adopt external) NATS and PostgreSQL; returns their URLs."""
        nats_url = os.environ.get(ENV_NATS_URL)
        database_url = os.environ.get(ENV_DATABASE_URL)
        authorization = self._issue_credentials() if self.options.secure and not nats_url else None
        if not nats_url and self.options.nats_cluster > 1:
            cluster = self.nats_cluster = NatsCluster(
                self.home / "nats", self.options.nats_cluster, authorization=authorization
            )
            # The streams (and the KV buckets, and through them the consumers) of this stack and
            # of every service it starts keep one replica per node.
            os.environ[ENV_STREAM_REPLICAS] = str(self.options.nats_cluster)
            cluster.start()
            nats_url = cluster.url
            for node in cluster.nodes:
                assert node.server_name is not None
                self.state[f"{node.server_name}_pid"] = node.pid
                # No stream check after a node's restart: the cluster's meta group keeps the
                # streams, the node gets them back from it, and asking while their leaders are
                # being elected would hold up this loop for seconds.
                self.watches[node.server_name] = ServerWatch(node.server_name, node)
        elif not nats_url:
            os.environ[ENV_STREAM_REPLICAS] = "1"
            self.nats = NatsServer(
                self.home / "nats",
                port=self.state.get("nats_port"),
                authorization=authorization,
                host=self.options.nats_host,
                tls=self._issue_tls(),
            )
            self.nats.start()
            nats_url = self.nats.url
            self.state["nats_pid"] = self.nats.pid
            self.state["nats_monitor_url"] = self.nats.monitor_url
            url = nats_url
            self.watches["nats"] = ServerWatch(
                "nats", self.nats, on_restart=lambda: self._ensure_streams(url)
            )
        if not database_url:
            self.postgres = PostgresServer(
                self.home / "postgres",
                durable=self.options.durable,
                auth=self.options.secure_db,
                secrets_dir=self.home / "secrets",
                host=self.options.postgres_host,
            )
            self.postgres.start()
            database_url = self.postgres.url
            self.state["postgres_pid"] = self.postgres.pid
            self.watches["postgres"] = ServerWatch("postgres", self.postgres)
        return nats_url, database_url

    def _issue_tls(self) -> TlsFiles | None:
        """TLS for a NATS listener off the loopback interface (none on loopback): the stack's CA
        (generated once) and a server certificate for the address; every process started from
        here trusts that CA (``$LOOM_NATS_CA``)."""
        host = self.options.nats_host
        if is_loopback(host):
            return None
        names = [socket.gethostname()] if host in ("0.0.0.0", "::") else [host]
        files = ensure_tls(self.home / "secrets" / "tls", names)
        os.environ[ENV_NATS_CA] = str(files.ca)
        self.state["nats_ca"] = str(files.ca)
        return files

    def _issue_credentials(self) -> Path:
        """Credentials for the operator and every process (kept across restarts: only missing
        ones are generated; tenants issued before keep theirs), and the users block for NATS.

        The supervisor connects as the operator from now on (``$LOOM_CREDS`` of this process)."""
        store = self.credentials = CredentialStore(self.home)
        names = service_argvs(self.options) if self.options.services else {}
        store.ensure_all([admin_identity(), *(identity_for_process(name) for name in names)])
        os.environ[ENV_CREDS] = str(store.path(admin_identity()))
        self.state["secure"] = True
        return store.auth_path

    def process_env(self, name: str, env: dict[str, str]) -> dict[str, str]:
        """The environment of one service process: its own credentials on a secured stack."""
        if self.credentials is None:
            return env
        return {**env, ENV_CREDS: str(self.credentials.path(identity_for_process(name)))}

    def log_tail(self, name: str, lines: int = 12) -> str:
        """The last ``lines`` lines of a service's log (empty when it wrote none)."""
        try:
            with open(self.home / "logs" / f"{name}.log", "rb") as f:
                f.seek(max(f.seek(0, os.SEEK_END) - 65536, 0))  # the end is enough
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    @staticmethod
    def _ensure_streams(nats_url: str) -> None:
        """After a NATS restart: the streams come back from disk; recreate any that did not."""

        async def ensure() -> None:
            nc = await connect(nats_url, "loom-supervisor")
            try:
                await ensure_streams(nc.jetstream())
            finally:
                await nc.drain()

        try:
            asyncio.run(ensure())
        except Exception as exc:  # the next restart, or the services' own start, tries again
            log.warning("could not check the streams after a NATS restart", error=repr(exc))

    def start_slurm(self) -> None:
        """Start the local Slurm clusters of ``--slurm`` (their state is kept across stacks)."""
        if not self.options.slurm_clusters:
            return
        topology = load_topology(self.options.topology)
        self.options.slurm_root = str(self.home / "slurm")
        self.slurm = LocalSlurms(
            Path(self.options.slurm_root),
            {c: slurm_nodes(topology.cluster(c)) for c in self.options.slurm_clusters},
            preexec=_child_preexec(),  # like every child: nothing outlives a killed supervisor
        )
        self.slurm.start()
        self.state["slurm"] = {
            name: {"slurm_conf": str(c.conf), "nodes": [n.name for n in c.nodes]}
            for name, c in self.slurm.clusters.items()
        }
        # Kept up like NATS and PostgreSQL: a dead munged, slurmctld or slurmd is reaped, its
        # stale pid file removed, and it starts again on its port with its state directory.
        for daemon in self.slurm.daemons():
            self.watches[daemon.name] = ServerWatch(daemon.name, daemon)

    def watch_servers(self) -> bool:
        """Check every owned server once (restarting the dead); True when any state changed."""
        changed = False
        for name, watch in self.watches.items():
            if watch.check():
                changed = True
                self.state[f"{name}_pid"] = watch.state.pid
        # Orphans of a dead server (Postgres backends) are reparented to us: reap them too. Scanning
        # /proc costs a few ms, so it runs after a change and otherwise every _REAP_EVERY checks.
        self._checks += 1
        if changed or self._reaping_until > time.monotonic() or self._checks % _REAP_EVERY == 0:
            if changed:
                self._reaping_until = time.monotonic() + _REAP_AFTER_CHANGE_S
            known = {proc.pid for proc in self.procs.values()}
            known |= {w.server.pid for w in self.watches.values() if w.server.pid is not None}
            reap_orphans(known)
        return changed

    def prepare(self, nats_url: str, database_url: str) -> None:
        """Migrate, create the streams, and (PostgreSQL secured) give each service role a password."""
        asyncio.run(prepare(nats_url, database_url))
        if self.postgres is not None and self.postgres.auth:
            pg = self.postgres
            self.role_urls = asyncio.run(
                provision_roles(database_url, self.home / "secrets", pg.port, pg.database)
            )

    def service_env(self, name: str, env: dict[str, str]) -> dict[str, str]:
        """``env`` with the database URL of the service's own role when PostgreSQL is secured (a
        process that uses no database gets a URL without credentials)."""
        if not self.role_urls or self.postgres is None:
            return env
        role = role_of(name)
        url = self.role_urls[role] if role is not None else self.postgres.url_for("loom_none", None)
        return {**env, ENV_DATABASE_URL: url}

    def spawn(self, svc: ServiceProcess, env: dict[str, str]) -> None:
        """Start one service process, its output appended to its log file."""
        env = self.service_env(svc.name, env)
        if (
            svc.metrics_port is not None
            and not self.options.metrics_port_base
            # Checked on every address (stricter than the 127.0.0.1 the service binds, with
            # SO_REUSEADDR): the TIME_WAIT of its own answered scrapes does not move it.
            and not port_bindable(svc.metrics_port, "0.0.0.0", reuse=True)
        ):
            # A free port picked for it, taken since by another listener: a restart on the same
            # port would die on "address already in use" again and again, so it gets a new one
            # (written to the state with the new pid, where `loom status` reads it).
            svc.metrics_port = find_free_port()
        if svc.metrics_port is not None:
            env = {**env, ENV_METRICS_PORT: str(svc.metrics_port)}
        if svc.name == "console" and self._console_port_chosen:
            self._console_port_free(svc)
        with open(svc.log, "ab") as log:
            proc = subprocess.Popen(
                svc.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                preexec_fn=_child_preexec(svc.nice),  # noqa: PLW1509 - prctl and nice, async-signal-safe
            )
        self.procs[svc.name] = proc
        svc.pid = proc.pid
        svc.started_at = time.time()

    def _console_port_free(self, svc: "ServiceProcess") -> None:
        """The console keeps its port across its restarts, unless the port was chosen here and
        another listener took it since (a parallel test run's server: the console crash-looped on
        "address already in use" until the stack's start timed out): then it gets a new one, in
        its argv and the state's ``console_url``."""
        port = self.options.console_port
        if port_bindable(port):
            return
        port = find_free_port()
        self.options.console_port = port
        at = svc.argv.index("--port") + 1
        svc.argv = [*svc.argv[:at], str(port), *svc.argv[at + 1 :]]
        self.state["console_url"] = f"http://127.0.0.1:{port}"

    def start_services(self, env: dict[str, str]) -> None:
        """Spawn every service of the options, each with its own ``/metrics`` port."""
        argvs = service_argvs(self.options) if self.options.services else {}
        ports = metrics_ports(list(argvs), self.options.metrics_port_base)
        for name, argv in argvs.items():
            self.services[name] = ServiceProcess(
                name,
                argv,
                str(self.home / "logs" / f"{name}.log"),
                metrics_port=ports[name],
                nice=service_nice(name, self.options),
            )
            self.spawn(self.services[name], self.process_env(name, env))

    def run(self) -> int:
        """Start everything, watch it, stop on SIGTERM/SIGINT."""
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stopping", True))
        signal.signal(signal.SIGINT, lambda *_: setattr(self, "stopping", True))
        if sys.platform.startswith("linux"):
            # Orphans of our servers (Postgres backends whose postmaster died) become our children,
            # so we can make sure they are gone and reap them, instead of leaving them to init.
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        (self.home / "logs").mkdir(parents=True, exist_ok=True)
        if self.options.tenants:
            self.state["tenants_file"] = str(Path(self.options.tenants).resolve())
        self.write_state("starting")
        try:
            nats_url, database_url = self.start_servers()
            self.prepare(nats_url, database_url)
            env = dict(
                os.environ,
                **{ENV_NATS_URL: nats_url, ENV_DATABASE_URL: database_url, ENV_HOME: str(self.home)},
            )
            if self.options.services and self.options.console:
                # Tokens before the console starts; a fixed port across its restarts.
                ensure_tokens(self.home)
                if not self.options.console_port:
                    self.options.console_port = find_free_port()
                    self._console_port_chosen = True
                self.state["console_url"] = f"http://127.0.0.1:{self.options.console_port}"
            if self.options.services:
                if not self.options.alerts_port:
                    self.options.alerts_port = choose_alerts_port(os.environ)  # `up` chose none
                self.state["alerts_webhook_url"] = f"http://127.0.0.1:{self.options.alerts_port}/alertmanager"
            token_file = None
            if self.options.services and self.options.secure:
                # /metrics, the trace store and the webhook answer only this stack's bearer token.
                token_file = ensure_http_token(self.home)
                env[ENV_HTTP_TOKEN_FILE] = str(token_file)
                self.state["http_token_file"] = str(token_file)
            if self.options.services and self.options.traces:
                env.update(self.start_traces(token_file))
            self.start_slurm()
            self.start_services(env)
            self.write_state("starting", nats_url=nats_url, database_url=database_url)
            silent = asyncio.run(
                wait_healthy(
                    nats_url,
                    list(self.services),
                    timeout_s=HEALTHY_WITHIN_S,
                    tick=lambda: self.restart_dead(env, "starting"),
                )
            )
            if silent:
                # What each silent service last said: a start that hangs is otherwise gone with
                # the stack's home (the benches remove theirs).
                tails = "".join(
                    f"\n--- {name}.log (last lines) ---\n{self.log_tail(name)}" for name in silent
                )
                raise RuntimeError(f"services never answered their health check: {', '.join(silent)}{tails}")
            self.write_state("ready")
            while not self.stopping:
                time.sleep(0.2)
                if self.watch_servers() and not self.stopping:
                    self.write_state("ready")
                self.restart_dead(env, "ready")
        except Exception as exc:
            self.write_state("failed", error=str(exc))
            self.shutdown()
            raise
        self.shutdown()
        return 0

    def restart_dead(self, env: dict[str, str], status: str) -> None:
        """Respawn each service that exited, after a backoff doubled per restart (at most 10 s).

        Runs while the stack starts as well as once it is ready: a service that dies at start-up
        (its free ``/metrics`` port taken before it bound it) is started again, on a port
        :meth:`spawn` picks anew, instead of holding the whole stack until the health timeout.
        """
        backoff = self.restart_at
        for name, proc in list(self.procs.items()):
            svc = self.services[name]
            if proc.poll() is None and svc.crash_loop and time.time() - svc.started_at >= STABLE_S:
                svc.crash_loop = False  # up long enough again
                log.info("service stable again", service=name)
                self.write_state(status)
            if proc.poll() is None or self.stopping:
                continue
            delay = min(2**svc.restarts * 0.25, 10.0)
            if time.time() < backoff.get(name, 0.0):
                continue
            if name not in backoff:
                backoff[name] = time.time() + delay
                svc.last_exit = describe_exit(proc.returncode)
                svc.pid = None
                self.write_state(status)
                continue
            del backoff[name]
            svc.restarts += 1
            was_looping = svc.crash_loop
            self.restarted_at[name], svc.crash_loop = crash_looping(
                self.restarted_at.get(name, []), time.time()
            )
            if svc.crash_loop and not was_looping:
                log.error("service is crash-looping", service=name, last_exit=svc.last_exit)
            self.spawn(svc, self.process_env(name, env))
            self.write_state(status)

    def start_traces(self, token_file: Path | None = None) -> dict[str, str]:
        """The trace store (``--traces``), served from this process on a free port of 127.0.0.1
        (``traces_url`` in the state file); the spans stay in ``<home>/traces/`` across restarts.
        ``token_file``: the bearer token it asks for (a secured stack's; read again when
        ``loom credentials rotate`` changes it). Returns the services' exporter settings."""
        store = SpanFile(self.home / "traces")
        token = TokenFile(token_file) if token_file is not None else None
        self.traces = TraceServer(store.append, store.trace, token=token).start()
        self.state["traces_url"] = self.traces.url
        self.state["traces_dir"] = str(store.directory)
        log.info("trace store", url=self.traces.url, directory=str(store.directory))
        return {
            OTLP_ENDPOINT_ENV: self.traces.url,
            # The exporters send the token as the file holds it at each export, to this store only
            # (loom.telemetry.tracing: a collector of the operator's never gets it).
            **({ENV_TRACES_TOKEN_FILE: str(token_file)} if token_file is not None else {}),
            # Spans reach the store within a second of ending (the SDK's default waits 5 s).
            "OTEL_BSP_SCHEDULE_DELAY": os.environ.get("OTEL_BSP_SCHEDULE_DELAY", "1000"),
            **(otlp_headers(token()) if token else {}),
        }

    def shutdown(self) -> None:
        """Stop services (SIGTERM, then SIGKILL after 10 s), then PostgreSQL and NATS."""
        self.write_state("stopping")
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        deadline = time.time() + 10
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(deadline - time.time(), 0.1))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.traces is not None:
            self.traces.stop()  # after the services: their last spans were flushed as they stopped
        if self.slurm is not None:
            self.slurm.stop()  # every slurmd, then every slurmctld, then munged
        if self.postgres is not None:
            self.postgres.stop()
        if self.nats is not None:
            self.nats.stop()
        if self.nats_cluster is not None:
            self.nats_cluster.stop()
        self.write_state("stopped")


# ---- commands run from the user's shell -----------------------------------------------------------


def read_state(home: Path | None = None) -> dict[str, Any] | None:
    """The state file, or None when no stack was ever started here."""
    path = stack_file(home)
    return json.loads(path.read_text()) if path.exists() else None


def _alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return True


def is_running(home: Path | None = None) -> bool:
    """Whether a supervisor is alive for this home."""
    state = read_state(home)
    if not state:
        return False
    return state.get("status") in ("starting", "ready") and _alive(state.get("supervisor_pid"))


def trace_store_url(home: Path | None = None) -> str | None:
    """The trace store of the stack running here (``loom up --traces``), or None: none kept, the
    stack is down (its state file keeps the URL of a store that is gone), or ``LOOM_NATS_URL``
    names another deployment, whose spans are not these."""
    state = read_state(home)
    if not state or not state.get("traces_url") or not is_running(home):
        return None
    other = os.environ.get(ENV_NATS_URL)
    if other and other != state.get("nats_url"):
        return None
    return str(state["traces_url"])


def local_http_token(home: Path | None = None) -> str | None:
    """The bearer token of the stack running here for its local HTTP endpoints (``/metrics``, the
    trace store, the webhook), or None: it asks for none (not secured), or is not running."""
    state = read_state(home)
    if not state or not state.get("http_token_file") or not is_running(home):
        return None
    try:
        return read_http_token(Path(state["http_token_file"]))
    except (OSError, ValueError):
        return None


def supervisor_argv(home: Path, options: StackOptions) -> list[str]:
    """The supervisor's command line for ``options``."""
    argv = [
        sys.executable,
        "-m",
        "loom.runtime.stack",
        "--home",
        str(home),
        "--topology",
        options.topology,
        "--time-scale",
        str(options.time_scale),
        "--heartbeat-s",
        str(options.heartbeat_s),
        "--max-heartbeat-s",
        str(options.max_heartbeat_s),
    ]
    for cluster in options.clusters:
        argv += ["--cluster", cluster]
    # Flags that turn something off, or on.
    for flag, given in (
        ("--no-durable", not options.durable),
        ("--no-network", not options.network),
        ("--no-placement-standby", not options.placement_standby),
        ("--traces", options.traces),
    ):
        argv += [flag] if given else []
    argv += ["--placement-shards", str(options.placement_shards)]
    argv += ["--probe-period-s", str(options.probe_period_s)]
    if not options.services:
        argv.append("--servers-only")
    if options.nats_cluster != 1:
        argv += ["--nats-cluster", str(options.nats_cluster)]
    if options.metrics_port_base:
        argv += ["--metrics-port-base", str(options.metrics_port_base)]
    argv += ["--neighbour-nice", str(options.neighbour_nice)]
    argv += ["--tenants", options.tenants] if options.tenants else []
    if not options.console:
        argv.append("--no-console")
    for flag, port in (("--console-port", options.console_port), ("--alerts-port", options.alerts_port)):
        argv += [flag, str(port)] if port else []
    argv.append("--secure-db" if options.secure_db else "--insecure-db")
    for cluster in options.slurm_clusters:
        argv += ["--slurm-cluster", cluster]
    if options.secure:
        argv.append("--secure")
    if options.nats_host != StackOptions.nats_host:
        argv += ["--nats-host", options.nats_host]
    argv += ["--postgres-host", options.postgres_host]  # loopback only (check_postgres_listen)
    return argv


def up(
    home: Path | None = None,
    options: StackOptions | None = None,
    *,
    timeout_s: float = HEALTHY_WITHIN_S + 60.0,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Start the supervisor in the background and wait until everything is up."""
    home = home or loom_home()
    options = options or StackOptions()
    if not os.environ.get(ENV_DATABASE_URL):
        check_postgres_listen(options.postgres_host)  # refused before anything starts
    home.mkdir(parents=True, exist_ok=True)
    if is_running(home):
        state = read_state(home)
        assert state is not None
        return _operator_of(home, state)
    if options.services and not options.alerts_port:
        # The webhook port this home's stack had last time, while free: read before the state goes.
        previous = _port_of((read_state(home) or {}).get("alerts_webhook_url"))
        options = replace(options, alerts_port=choose_alerts_port(os.environ, previous))
    argv = supervisor_argv(home, options)
    stack_file(home).unlink(missing_ok=True)
    (home / "logs").mkdir(parents=True, exist_ok=True)
    with open(home / "logs" / "supervisor.log", "ab") as log:
        ours = log.tell()  # the log is appended to: a failure shows this start's lines only
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
    deadline = time.time() + timeout_s
    last = ""
    while time.time() < deadline:
        state = read_state(home)
        status = state.get("status", "") if state else ""
        if status != last and progress is not None:
            progress(status or "launching")
            last = status
        if status == "ready":
            assert state is not None
            return _operator_of(home, state)
        if status == "failed" or proc.poll() is not None:
            with open(home / "logs" / "supervisor.log", "rb") as f:
                f.seek(ours)
                log_tail = f.read().decode(errors="replace")[-3000:]
            raise RuntimeError(
                f"the stack failed to start: {state.get('error') if state else ''}\n{log_tail}"
            )
        time.sleep(0.1)
    raise RuntimeError(f"the stack did not become ready within {timeout_s}s; see {home / 'logs'}")


def _operator_of(home: Path, state: dict[str, Any]) -> dict[str, Any]:
    """This process connects to a secured stack it started as its operator (``admin``)."""
    if state.get("secure") and state.get("nats_url"):
        remember_credentials(state["nats_url"], CredentialStore(home).path(admin_identity()))
    return state


def down(home: Path | None = None, *, timeout_s: float = 60.0) -> bool:
    """Stop the stack; returns False when none was running."""
    state = read_state(home)
    if not state or not _alive(state.get("supervisor_pid")):
        return False
    pid = int(state["supervisor_pid"])
    os.kill(pid, signal.SIGTERM)
    deadline = time.time() + timeout_s
    while time.time() < deadline and _alive(pid):
        time.sleep(0.1)
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)
    return True


def process_table(home: Path | None = None) -> list[dict[str, Any]]:
    """Every process of the stack with its pid and whether it is alive."""
    state = read_state(home) or {}
    rows = [
        {
            "name": "supervisor",
            "pid": state.get("supervisor_pid"),
            "alive": _alive(state.get("supervisor_pid")),
            "restarts": 0,
        },
    ]
    servers = state.get("servers", {})
    for name in [*servers, *(n for n in ("nats", "postgres") if n not in servers)]:
        server = servers.get(name)
        if server is not None:
            rows.append(
                {
                    "name": name,
                    "pid": server["pid"],
                    "alive": _alive(server["pid"]),
                    "restarts": server["restarts"],
                    "last_exit": server["last_exit"],
                    "server_status": "crash-looping" if server["crash_loop"] else server["status"],
                }
            )
        elif pid := state.get(f"{name}_pid"):
            rows.append({"name": name, "pid": pid, "alive": _alive(pid), "restarts": 0, "last_exit": None})
    for name, svc in sorted(state.get("services", {}).items()):
        rows.append(
            {
                "name": name,
                "pid": svc["pid"],
                "alive": _alive(svc["pid"]),
                "restarts": svc["restarts"],
                "last_exit": svc.get("last_exit"),
                "crash_loop": bool(svc.get("crash_loop")),
                "metrics_url": f"http://127.0.0.1:{svc['metrics_port']}/metrics"
                if svc.get("metrics_port")
                else None,
            }
        )
    return rows


def parse_supervisor_argv(argv: list[str] | None = None) -> tuple[Path, StackOptions]:
    """The home and options a supervisor command line (:func:`supervisor_argv`) carries."""
    parser = argparse.ArgumentParser(prog="python -m loom.runtime.stack")
    parser.add_argument("--home", type=Path, required=True)
    parser.add_argument("--topology", default="default")
    parser.add_argument("--cluster", action="append", default=[])
    parser.add_argument("--time-scale", type=float, default=60.0)
    parser.add_argument("--heartbeat-s", type=float, default=2.0)
    parser.add_argument("--max-heartbeat-s", type=float, default=10.0)
    parser.add_argument("--no-durable", action="store_true")
    parser.add_argument("--no-network", action="store_true")
    parser.add_argument("--no-placement-standby", action="store_true")
    parser.add_argument("--placement-shards", type=int, default=1)
    parser.add_argument("--probe-period-s", type=float, default=1.0)
    parser.add_argument("--servers-only", action="store_true")
    parser.add_argument("--nats-cluster", type=int, choices=(1, 3), default=1)
    parser.add_argument("--no-console", action="store_true")
    parser.add_argument("--console-port", type=int, default=0)
    parser.add_argument("--alerts-port", type=int, default=0)
    parser.add_argument("--traces", action="store_true")
    parser.add_argument("--secure-db", action=argparse.BooleanOptionalAction, default=SECURE_DB_DEFAULT)
    parser.add_argument("--insecure-db", dest="secure_db", action="store_false")
    parser.add_argument("--metrics-port-base", type=int, default=0)
    parser.add_argument("--neighbour-nice", type=neighbour_nice_arg, default=NEIGHBOUR_NICE)
    parser.add_argument("--tenants", default="")
    parser.add_argument("--slurm-cluster", action="append", default=[])
    parser.add_argument("--secure", action="store_true")
    parser.add_argument("--nats-host", default=StackOptions.nats_host)
    parser.add_argument("--postgres-host", default=StackOptions.postgres_host)
    args = parser.parse_args(argv)
    options = StackOptions(
        topology=args.topology,
        clusters=args.cluster,
        time_scale=args.time_scale,
        heartbeat_s=args.heartbeat_s,
        max_heartbeat_s=args.max_heartbeat_s,
        durable=not args.no_durable,
        network=not args.no_network,
        placement_standby=not args.no_placement_standby,
        placement_shards=args.placement_shards,
        probe_period_s=args.probe_period_s,
        services=not args.servers_only,
        nats_cluster=args.nats_cluster,
        console=not args.no_console,
        console_port=args.console_port,
        alerts_port=args.alerts_port,
        traces=args.traces,
        secure_db=args.secure_db,
        metrics_port_base=args.metrics_port_base,
        neighbour_nice=args.neighbour_nice,
        tenants=args.tenants,
        slurm_clusters=args.slurm_cluster,
        secure=args.secure,
        nats_host=args.nats_host,
        postgres_host=args.postgres_host,
    )
    return args.home.resolve(), options


def main(argv: list[str] | None = None) -> int:
    """The supervisor process's entry point (started by :func:`up`)."""
    home, options = parse_supervisor_argv(argv)
    return Supervisor(home, options).run()


if __name__ == "__main__":
    sys.exit(main())
