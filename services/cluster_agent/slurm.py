"""The ``slurm`` backend: a real Slurm cluster under the cluster agent, driven by its commands.

**Why the CLI, not slurmrestd.** ``sbatch``/``squeue``/``scontrol``/``scancel`` are on every Slurm
login node, need nothing but the cluster's ``slurm.conf`` (``SLURM_CONF``) and munge, and their
options and ``-o`` output have been stable for a decade. slurmrestd is an extra daemon to run and
secure (JWT or a local socket), off by default at most sites, and its OpenAPI paths change with
each release (v0.0.37, v0.0.38...). One command costs a few milliseconds here; the agent runs at
most one per part per poll (``poll_s``) plus one per heartbeat for the inventory.

**Inventory** (:meth:`SlurmBackend.refresh`): ``scontrol -o show node``. GPUs come from ``Gres``
(``gpu:TYPE:N``), their type mapped to a Loom GPU model (``gres_models``, else the type upper-cased:
``v100m16`` → ``V100M16``); used GPUs from ``GresUsed`` (``-d``), or what this agent's
own parts hold when more (a part pending in Slurm holds its GPUs for Loom already). A node that is
down, drained, draining, failing or not responding is unavailable; one DOWN, FAIL or FAILING is
also reported ``down`` (its parts are lost: placement's node-scope failover gives them up), one
drained is not (Slurm lets its jobs end). A controller that cannot be
reached makes every node unavailable and shows in health; the agent goes on.

**Parts** (:meth:`SlurmBackend.launch`): one Slurm batch job per part, named ``loom-JOB-ATTEMPT``
with the comment ``loom:CLUSTER:JOB:ATTEMPT`` (so a launch repeated after a crash finds the first
one, and only this Loom cluster's parts are reconciled), pinned with ``--nodelist`` to the nodes
Loom chose, ``--gres=gpu:TYPE:N`` per node, ``--signal=B:USR1@grace`` so Slurm asks for a
checkpoint before a time limit, ``--no-requeue`` (Loom, not Slurm, decides where a failed attempt
goes). A lead part runs the job script (``examples/slurm/loom_job.sh`` by default) with the
``LOOM_*`` environment; a member part holds its GPUs (``sleep``) until stopped. The job reports
its steps and checkpoints in a progress file (see the script) that :meth:`SlurmBackend.poll` reads.

**State** (:meth:`SlurmBackend.poll`): ``scontrol -o show job`` mapped to a
:class:`~loom_services.cluster_agent.backend.Phase`: PENDING/CONFIGURING/REQUEUED → pending,
RUNNING/COMPLETING/SUSPENDED → running, COMPLETED → completed, FAILED/OUT_OF_MEMORY → failed with
the exit code, CANCELLED/TIMEOUT/PREEMPTED/DEADLINE/BOOT_FAIL → cancelled, NODE_FAIL → node fail;
a job the controller no longer remembers (``MinJobAge`` after its end, or state lost) is looked
up in accounting (:meth:`SlurmBackend.accounted`: ``sacct`` with slurmdbd, else ``sacct -c``, the
job completion log of ``JobCompType=jobcomp/filetxt``) for its final state and exit code, and is
vanished only when accounting does not know how it ended either. A part pending for a reason
Slurm will not get over by itself (``REFUSING_REASONS``: a down or drained node, a partition
limit, bad GRES...) is refused at once; one pending for any other reason longer than
``pending_timeout_s`` is refused with Slurm's reason. The agent stops (``scancel``) and reports
every refused, vanished or misplaced part, so no part stays "running" in Loom that does not run in Slurm.

Errors of the commands are mapped once, here: the messages Slurm's client library prints when
the controller cannot be reached (``UNREACHABLE_MARKERS``) raise
:class:`~loom_services.cluster_agent.backend.BackendUnavailable` (retried), any other failure of
``sbatch`` raises :class:`~loom_services.cluster_agent.backend.LaunchRefused` with Slurm's reason.
A command still running after ``command_timeout_s`` is killed with its process group, reaped, and
raises ``BackendUnavailable`` too; one whose caller is cancelled (the agent stops) is killed and
reaped before the cancellation goes on (:func:`run_command`).
"""

import asyncio
import contextlib
import os
import re
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import structlog

from loom_proto.clusters import NodeState
from loom_proto.jobs import NodeAllocation
from loom_services.cluster_agent.backend import (
    BackendUnavailable,
    ClusterBackend,
    LaunchRefused,
    PartLaunch,
    PartStatus,
    Phase,
)

log = structlog.get_logger("cluster_agent.slurm")

DEFAULT_SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "slurm" / "loom_job.sh"
"""The example job script (in the source tree)."""

UNREACHABLE_MARKERS = (
    "Unable to contact slurm controller",
    "Socket timed out",
    "Zero Bytes were transmitted",
    "Connection refused",
    "Communication connection failure",
)
"""What Slurm's client library prints when the controller does not answer."""

REFUSING_REASONS = frozenset(
    {
        "BadConstraints",
        "PartitionConfig",
        "PartitionDown",
        "PartitionInactive",
        "PartitionNodeLimit",
        "PartitionTimeLimit",
        "InvalidAccount",
        "InvalidQOS",
        "NodeDown",
        "ReqNodeNotAvail",
        "JobHeldAdmin",
        "JobHeldUser",
        "QOSMaxGRESPerJob",
        "AssocMaxGRESPerJob",
    }
)
"""Pending reasons Slurm does not get over by itself: the part is refused at once."""

_UNAVAILABLE_FLAGS = ("DOWN", "DRAIN", "FAIL", "NOT_RESPONDING", "POWERED_DOWN", "INVAL", "MAINT", "REBOOT")

_DOWN_FLAGS = frozenset({"DOWN", "FAIL", "FAILING"})
"""Node states whose running parts are lost (reported ``down``: node-scope failover). DOWN: Slurm
kills the node's jobs (NODE_FAIL); FAIL/FAILING: an administrator says the node is failing. DRAIN,
DRAINING and DRAINED are not among them: Slurm lets a draining node's jobs run to their end, so a
drained node only takes no new work (as a cordoned node on the sim backend). NOT_RESPONDING (``*``)
alone is not either: a slurmd that stays silent past ``SlurmdTimeout`` is set DOWN by Slurm."""

_PHASES = {
    "PENDING": Phase.PENDING,
    "CONFIGURING": Phase.PENDING,
    "REQUEUED": Phase.PENDING,
    "REQUEUE_HOLD": Phase.PENDING,
    "REQUEUE_FED": Phase.PENDING,
    "RESV_DEL_HOLD": Phase.PENDING,
    "RUNNING": Phase.RUNNING,
    "COMPLETING": Phase.RUNNING,
    "SUSPENDED": Phase.RUNNING,
    "STAGE_OUT": Phase.RUNNING,
    "SIGNALING": Phase.RUNNING,
    "RESIZING": Phase.RUNNING,
    "COMPLETED": Phase.COMPLETED,
    "FAILED": Phase.FAILED,
    "OUT_OF_MEMORY": Phase.FAILED,
    "CANCELLED": Phase.CANCELLED,
    "TIMEOUT": Phase.CANCELLED,
    "PREEMPTED": Phase.CANCELLED,
    "DEADLINE": Phase.CANCELLED,
    "BOOT_FAIL": Phase.CANCELLED,
    "SPECIAL_EXIT": Phase.FAILED,
    "NODE_FAIL": Phase.NODE_FAIL,
}


def parse_record(line: str) -> dict[str, str]:
    """One ``scontrol -o show ...`` line as a dict (values may hold spaces, as ``OS=`` or ``Reason=``)."""
    fields: dict[str, str] = {}
    for token in re.split(r"\s+(?=[A-Za-z][\w:/]*=)", line.strip()):
        key, sep, value = token.partition("=")
        if sep:
            fields[key] = value.strip()
    return fields


def expand_hostlist(hostlist: str) -> list[str]:
    """Slurm's compressed host list (``node-[01-03,07],gpu1``) as names."""
    names: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", hostlist):
        m = re.fullmatch(r"(.*)\[([^\]]*)\](.*)", part)
        if m is None:
            if part and part != "(null)":
                names.append(part)
            continue
        prefix, ranges, suffix = m.groups()
        for r in ranges.split(","):
            lo, _, hi = r.partition("-")
            for i in range(int(lo), int(hi or lo) + 1):
                names.append(f"{prefix}{str(i).zfill(len(lo))}{suffix}")
    return names


def node_gpus(gres: str) -> tuple[str | None, int]:
    """GPU type and count of a node's ``Gres`` (``gpu:v100:4(S:0)``; type None when untyped)."""
    for item in gres.split(","):
        parts = re.sub(r"\(.*?\)", "", item).split(":")
        if parts[0] != "gpu":
            continue
        if len(parts) == 2:
            return None, int(parts[1])
        if len(parts) >= 3:
            return parts[1], int(parts[2])
    return None, 0


def alloc_gpus(tres: str) -> int:
    """GPUs allocated on a node, from its ``AllocTRES`` (``cpu=2,gres/gpu=2,...``)."""
    m = re.search(r"(?:^|,)gres/gpu=(\d+)", tres)
    return int(m.group(1)) if m else 0


def job_phase(state: str) -> Phase:
    """Loom's phase of a Slurm job state (``CANCELLED by 0`` reads as CANCELLED)."""
    return _PHASES.get(state.split(maxsplit=1)[0].split("+", maxsplit=1)[0] if state else "", Phase.FAILED)


def exit_status(field: str) -> tuple[int | None, str]:
    """A Slurm ``ExitCode`` (``code:signal``): the non-zero exit code (else None) and, when a
    signal ended it, ``killed by signal N`` (else empty)."""
    code, _, sig = field.partition(":")
    exit_code = int(code) if code.isdigit() and int(code) != 0 else None
    return exit_code, f"killed by signal {sig}" if sig.isdigit() and int(sig) else ""


def read_progress(path: Path) -> tuple[int | None, tuple[tuple[int, str], ...]]:
    """The last step and the checkpoints a job wrote in its progress file (see the job script)."""
    try:
        text = path.read_text()
    except OSError:
        return None, ()
    step: int | None = None
    checkpoints: list[tuple[int, str]] = []
    for line in text.splitlines():
        words = line.split()
        try:
            if len(words) == 2 and words[0] == "step":
                step = int(words[1])
            elif len(words) == 3 and words[0] == "checkpoint":
                checkpoints.append((int(words[1]), words[2]))
        except ValueError:
            continue  # a torn or foreign line
    return step, tuple(checkpoints)


def job_name(key: str) -> str:
    """The Slurm job name of a part (``loom-JOB-ATTEMPT``)."""
    job_id, _, attempt = key.rpartition(":")
    return f"loom-{job_id}-{attempt}"


REAP_TIMEOUT_S = 5.0
"""How long a killed command may take to exit and be reaped (SIGKILL: at once, unless the machine
is overloaded); past it, it is left to asyncio's child watcher and logged."""


async def run_command(
    argv: Sequence[str], *, env: Mapping[str, str], timeout_s: float, reap_s: float = REAP_TIMEOUT_S
) -> tuple[int, bytes, bytes]:
    """Run a command to its end: its exit status, stdout and stderr. Raises :class:`TimeoutError`
    when it runs past ``timeout_s`` and :class:`OSError` when it cannot start.

    A command that times out, or whose caller is cancelled (an agent stopping), does not outlive
    the call: it runs in a session of its own, its whole process group is SIGKILLed (a wrapper
    script's children too, which would hold its pipes open) and the call waits, at most
    ``reap_s``, until it is reaped; then the timeout or the cancellation propagates.

    Killed on a cancellation so that an ``sbatch`` cancelled with its run does not submit behind
    the agent's back. Not ``proc.kill()``: it raises ProcessLookupError for a child that has just
    ended, and that error, not the cancellation, left the call: the watchdog restarted the poll
    loop it killed (a stopping agent polled on, and a CI teardown waited 60 s for it). Not
    ``asyncio.wait_for``: on Python 3.11 it returns the result of a command that ends just as its
    caller is cancelled and drops the cancellation (CPython gh-86296). And
    ``create_subprocess_exec`` itself is never cancelled (shielded; it takes milliseconds):
    cancelled while it connects the child's pipes, it can wait forever for the exit of the child
    it kills (CPython gh-103847, gh-125502).
    """
    spawning = asyncio.ensure_future(
        asyncio.create_subprocess_exec(
            *argv,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            stdin=asyncio.subprocess.DEVNULL,
            env=dict(env),
            start_new_session=True,
        )
    )
    try:
        async with asyncio.timeout(timeout_s):
            proc = await asyncio.shield(spawning)
            out, err = await proc.communicate()
    except BaseException:  # timed out, cancelled or not started: nothing of it may be left running
        await _end(spawning, argv[0], reap_s)
        raise
    return proc.returncode or 0, out, err


async def _end(spawning: "asyncio.Task[asyncio.subprocess.Process]", name: str, reap_s: float) -> None:
    """Kill the process group ``spawning`` started and wait, at most ``reap_s``, until it is
    reaped. A spawn in flight ends first; one that failed left nothing to kill."""
    spawning.add_done_callback(_kill_group)  # also when this wait is cut short (cancelled again)
    try:
        async with asyncio.timeout(reap_s):
            proc = await asyncio.shield(spawning)
            # Reads the pipes to their end: on Python 3.11 ``wait()`` returns only once they are
            # closed, and a pipe paused with unread output never sees its end.
            await proc.communicate()
    except TimeoutError:
        log.error("killed command not reaped", command=name, reap_s=reap_s)
    except OSError:
        return  # it never started


def _kill_group(spawning: "asyncio.Task[asyncio.subprocess.Process]") -> None:
    """SIGKILL the process group of a spawned command (its own session: the command and its children)."""
    if spawning.cancelled() or spawning.exception() is not None:
        return
    # Linux does not reuse a group's id while a member lives: the group is the command's.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(spawning.result().pid, signal.SIGKILL)


@dataclass
class SlurmNodeState:
    """A Slurm node as the agent reports it."""

    node: str
    zone: str
    gpu_model: str | None
    gpu_type: str | None
    gpus_total: int
    cpu_milli: int
    memory_mib: int
    state: str
    slurm_used: int = 0
    held: int = 0
    """GPUs this agent's parts hold here (counted from the start command on)."""
    reachable: bool = True

    @property
    def gpus_used(self) -> int:
        """GPUs in use: Slurm's count, or this agent's when higher (a part still pending in Slurm)."""
        return max(self.slurm_used, self.held)

    @property
    def healthy(self) -> bool:
        """Whether the node takes work: reachable, and neither down, drained nor failing."""
        flags = self.state.replace("*", "+NOT_RESPONDING").split("+")
        return self.reachable and not any(f.startswith(_UNAVAILABLE_FLAGS) for f in flags)

    @property
    def down(self) -> bool:
        """Whether the node has failed (``_DOWN_FLAGS``): the parts on it are lost. Not when the
        controller cannot be reached: that says nothing of the node."""
        flags = self.state.replace("*", "").split("+")
        return self.reachable and any(f in _DOWN_FLAGS for f in flags)

    def report(self) -> NodeState:
        """The node in a heartbeat."""
        return NodeState(
            node=self.node,
            zone=self.zone,
            gpu_model=self.gpu_model,
            gpus_total=self.gpus_total,
            gpus_used=min(self.gpus_used, self.gpus_total),
            cpu_milli=self.cpu_milli,
            memory_mib=self.memory_mib,
            healthy=self.healthy,
            down=self.down,
        )


@dataclass
class SlurmBackend:
    """One Slurm cluster under one agent (see the module docstring)."""

    cluster: str
    zone: str
    work_dir: Path
    """Where each part's progress file and output go (shared with the nodes)."""
    slurm_conf: Path | None = None
    """The cluster's ``slurm.conf`` (None: Slurm's default)."""
    script: Path = DEFAULT_SCRIPT
    gres_models: Mapping[str, str] = field(default_factory=dict)
    """GRES type (lower case) → Loom GPU model, when the upper-cased type is not the model."""
    speed: Callable[[str, str], float] = lambda _model, _task: 1.0
    """A model's SCU for a task type (what placement believes; reported as delivered speed)."""
    partition: str | None = None
    checkpoint_grace_s: int = 60
    pending_timeout_s: float = 60.0
    command_timeout_s: float = 15.0
    """Longest a Slurm command (``sbatch``, ``squeue``, ``scontrol``, ``sacct``, ``scancel``) may run:
    past it, it is killed and reaped and the call fails as unavailable (a poll is retried)."""
    bin_dir: Path | None = None
    """Where Slurm's commands are (None: found on the ``PATH``)."""
    poll_s: float = 0.5
    name: str = field(init=False, default="slurm")
    clock: bool = field(init=False, default=False)
    _nodes: dict[str, SlurmNodeState] = field(init=False, default_factory=dict)
    _reported: dict[str, NodeState] = field(init=False, default_factory=dict)
    _held: dict[str, int] = field(init=False, default_factory=dict)
    _pending_since: dict[str, float] = field(init=False, default_factory=dict)
    _problem: str | None = field(init=False, default=None)

    # ---- commands ------------------------------------------------------------------------------

    async def _command(self, *argv: str, env: Mapping[str, str] | None = None) -> tuple[int, str, str]:
        full_env = {**os.environ, **(env or {})}
        if self.slurm_conf is not None:
            full_env["SLURM_CONF"] = str(self.slurm_conf)
        program = str(self.bin_dir / argv[0]) if self.bin_dir is not None else argv[0]
        try:
            rc, out, err = await run_command(
                (program, *argv[1:]), env=full_env, timeout_s=self.command_timeout_s
            )
        except TimeoutError as exc:
            log.warning(
                "slurm command timed out; killed",
                command=argv[0],
                args=argv[1:4],
                timeout_s=self.command_timeout_s,
            )
            raise BackendUnavailable(f"{argv[0]} did not answer in {self.command_timeout_s:g} s") from exc
        except OSError as exc:
            raise BackendUnavailable(f"cannot run {argv[0]}: {exc}") from exc
        stderr = err.decode(errors="replace").strip()
        if rc != 0 and any(m in stderr for m in UNREACHABLE_MARKERS):
            raise BackendUnavailable(f"{argv[0]}: {stderr[:500]}")
        return rc, out.decode(errors="replace"), stderr

    # ---- inventory -----------------------------------------------------------------------------

    @property
    def cluster_id(self) -> str:
        """The Loom cluster this Slurm cluster is."""
        return self.cluster

    @property
    def nodes(self) -> Mapping[str, SlurmNodeState]:
        """The nodes as last read."""
        return self._nodes

    async def refresh(self) -> None:
        """Read the nodes from ``scontrol``; an unreachable controller makes every node unavailable."""
        try:
            rc, out, err = await self._command("scontrol", "-o", "-d", "show", "node")
            if rc != 0:
                raise BackendUnavailable(f"scontrol show node: {err[:500]}")
        except BackendUnavailable as exc:
            if self._problem is None:
                log.warning("slurm unreachable", cluster=self.cluster, error=str(exc))
            self._problem = f"slurm unreachable: {exc}"
            for node in self._nodes.values():
                node.reachable = False
            raise
        self._problem = None
        seen: dict[str, SlurmNodeState] = {}
        for line in out.splitlines():
            rec = parse_record(line)
            name = rec.get("NodeName")
            if not name:
                continue
            gpu_type, gpus = node_gpus(rec.get("Gres", ""))
            seen[name] = SlurmNodeState(
                node=name,
                zone=self.zone,
                gpu_model=self.model_of(gpu_type) if gpus else None,
                gpu_type=gpu_type,
                gpus_total=gpus,
                cpu_milli=int(rec.get("CPUTot", "0") or 0) * 1000,
                memory_mib=int(rec.get("RealMemory", "0") or 0),
                state=rec.get("State", "UNKNOWN"),
                slurm_used=node_gpus(rec["GresUsed"])[1]
                if "GresUsed" in rec
                else alloc_gpus(rec.get("AllocTRES", "")),
                held=self._held.get(name, 0),
            )
        self._nodes = seen

    def model_of(self, gpu_type: str | None) -> str | None:
        """The Loom GPU model of a GRES type."""
        if gpu_type is None:
            return None
        return self.gres_models.get(gpu_type.lower(), gpu_type.upper())

    def problem(self) -> str | None:
        """Why Slurm cannot be used now, or None."""
        return self._problem

    def changed(self) -> bool:
        """Whether a node's report differs from the last heartbeat's."""
        return any(self._reported.get(n) != node.report() for n, node in self._nodes.items()) or (
            set(self._reported) != set(self._nodes)
        )

    def report(self, full: bool) -> list[NodeState]:
        """Node states for a heartbeat: all, or those changed since the last one."""
        states = {n: node.report() for n, node in self._nodes.items()}
        changed = [s for n, s in states.items() if full or self._reported.get(n) != s]
        self._reported = states
        return changed

    def refusal(self, gpu_model: str, allocations: Sequence[NodeAllocation]) -> str | None:
        """Why the allocations cannot start here (the nodes as Slurm showed them last), or None."""
        for a in allocations:
            node = self._nodes.get(a.node)
            if node is None:
                return f"node {a.node} is not part of Slurm cluster {self.cluster}"
            if node.gpu_model != gpu_model:
                return f"node {a.node} has {node.gpu_model}, not {gpu_model}"
            if not node.healthy:
                return f"node {a.node} is not accepting work (slurm state {node.state})"
            # Against the agent's own parts only: Slurm's count lags (a part that just ended is
            # still COMPLETING there, the inventory is a heartbeat old). GPUs busy with work Loom
            # does not know keep the part pending in Slurm, refused after ``pending_timeout_s``.
            if node.gpus_total - node.held < a.gpus:
                return (
                    f"node {a.node} has {node.gpus_total - node.held} GPUs not held by Loom, {a.gpus} asked"
                )
        return None

    def resize_refusal(
        self, gpu_model: str, current: Sequence[NodeAllocation], wanted: Sequence[NodeAllocation]
    ) -> str | None:
        """A Slurm batch job keeps the resources it started with."""
        return "a Slurm job cannot be resized while it runs"

    def allocate(self, allocations: Sequence[NodeAllocation]) -> None:
        """Count GPUs as held by a part of this agent."""
        for a in allocations:
            self._held[a.node] = self._held.get(a.node, 0) + a.gpus
            if a.node in self._nodes:
                self._nodes[a.node].held = self._held[a.node]

    def free(self, allocations: Sequence[NodeAllocation]) -> None:
        """A part of this agent gave its GPUs back."""
        for a in allocations:
            self._held[a.node] = max(self._held.get(a.node, 0) - a.gpus, 0)
            if a.node in self._nodes:
                self._nodes[a.node].held = self._held[a.node]

    async def drain(self, nodes: Sequence[str]) -> None:
        """Drain the nodes in Slurm (all when empty): running jobs go on, no new ones start."""
        names = list(nodes) or list(self._nodes)
        if not names:
            return
        rc, _, err = await self._command(
            "scontrol", "update", f"NodeName={','.join(names)}", "State=DRAIN", "Reason=drained by loom"
        )
        if rc != 0:
            log.warning("slurm drain failed", nodes=names, error=err)
        await self.refresh()

    # ---- parts ---------------------------------------------------------------------------------

    def part_dir(self, key: str) -> Path:
        """Where a part's progress file, checkpoints and output are."""
        return self.work_dir / job_name(key)

    def comment(self, key: str) -> str:
        """The Slurm comment that marks a part as this Loom cluster's (several Loom clusters may
        share one Slurm cluster: each finds and reconciles only its own parts)."""
        return f"loom:{self.cluster}:{key}"

    async def _find(self, key: str) -> str | None:
        rc, out, _ = await self._command("squeue", "-h", "-n", job_name(key), "-o", "%i %k")
        for line in out.splitlines() if rc == 0 else []:
            ref, _, comment = line.strip().partition(" ")
            if comment == self.comment(key):
                return ref
        return None

    async def launch(self, part: PartLaunch) -> str:
        """Submit the part with ``sbatch`` on the nodes Loom chose (or find it submitted already)."""
        existing = await self._find(part.key)
        if existing is not None:
            return existing
        per_node: dict[str, int] = {}
        for node, gpus in part.allocations:
            per_node[node] = per_node.get(node, 0) + gpus
        counts = set(per_node.values())
        if len(counts) != 1:
            raise LaunchRefused(
                f"unequal GPUs per node {per_node}: one Slurm job takes the same GRES on each"
            )
        gpus = counts.pop()
        gpu_types = {self._nodes[n].gpu_type for n in per_node if n in self._nodes}
        gres = (
            f"gpu:{gpu_types.pop()}:{gpus}"
            if len(gpu_types) == 1 and None not in gpu_types
            else f"gpu:{gpus}"
        )
        directory = self.part_dir(part.key)
        (directory / "checkpoints").mkdir(parents=True, exist_ok=True)
        progress = directory / "progress"
        env = {
            "LOOM_JOB_ID": part.job_id,
            "LOOM_TENANT": part.tenant,
            "LOOM_ATTEMPT": str(part.attempt),
            "LOOM_STEPS": str(part.steps),
            "LOOM_START_STEP": str(part.start_step),
            "LOOM_STEP_S": f"{part.step_time_s:.6f}",
            "LOOM_CHECKPOINT_EVERY": str(part.checkpoint_every_steps),
            "LOOM_PROGRESS_FILE": str(progress),
            "LOOM_CHECKPOINT_DIR": str(directory / "checkpoints"),
        }
        for label, value in part.labels.items():
            env["LOOM_LABEL_" + re.sub(r"[^A-Za-z0-9]", "_", label).upper()] = value
        argv = [
            "sbatch",
            "--parsable",
            f"--job-name={job_name(part.key)}",
            f"--comment={self.comment(part.key)}",
            f"--nodelist={','.join(sorted(per_node))}",
            f"--nodes={len(per_node)}",
            "--ntasks-per-node=1",
            f"--gres={gres}",
            f"--signal=B:USR1@{self.checkpoint_grace_s}",
            "--no-requeue",
            "--export=ALL",
            f"--chdir={directory}",
            f"--output={directory}/slurm-%j.out",
        ]
        if self.partition:
            argv.append(f"--partition={self.partition}")
        if part.role == "lead":
            argv.append(str(self.script))
        else:
            argv.append("--wrap=exec sleep 1000000000")  # a member holds its GPUs until stopped
        rc, out, err = await self._command(*argv, env=env)
        if rc != 0:
            raise LaunchRefused(err.removeprefix("sbatch: error: ").strip() or f"sbatch exited {rc}")
        return out.strip().split(";")[0]

    async def stop(self, ref: str) -> None:
        """Cancel the Slurm job (one that has ended already is left as it is)."""
        rc, _, err = await self._command("scancel", ref)
        if rc != 0:
            log.info("scancel refused", ref=ref, error=err)

    async def signal_checkpoint(self, ref: str) -> None:
        """Send SIGUSR1 to the job's batch script: it writes a checkpoint and reports it."""
        rc, _, err = await self._command("scancel", "--batch", "--signal=USR1", ref)
        if rc != 0:
            log.info("checkpoint signal refused", ref=ref, error=err)

    async def accounted(self, ref: str, key: str) -> PartStatus | None:
        """How a part the controller no longer remembers ended, from Slurm's accounting: ``sacct``
        (slurmdbd) or, where that is disabled, ``sacct -c`` (the job completion log). None when
        neither has an ended record of that job under the part's name."""
        fields = ("-X", "-n", "-P", "-j", ref, "-o", "JobID,JobName,State,ExitCode,NodeList")
        for source in ((), ("-c",)):
            rc, out, _ = await self._command("sacct", *source, *fields)
            if rc != 0:
                continue  # "Slurm accounting storage is disabled": try the completion log
            records = [line.split("|") for line in out.splitlines() if line.count("|") == 4]
            mine = [r for r in records if r[0] == ref and r[1] == job_name(key)]
            if not mine:
                continue
            _, _, state, exit_field, nodelist = mine[-1]
            phase = job_phase(state)
            if not phase.terminal:
                return None  # accounting thinks it runs, the controller does not know it: gone
            exit_code, killed = exit_status(exit_field)
            reason = f"{state} (from Slurm accounting{'' if not source else ': job completion log'})"
            return PartStatus(
                phase=phase,
                nodes=tuple(expand_hostlist(nodelist)),
                reason=f"{killed}, {reason}" if phase is Phase.FAILED and killed else reason,
                exit_code=exit_code,
            )
        return None

    async def poll(self, ref: str, key: str) -> PartStatus:
        """The part's phase from ``scontrol show job`` (from accounting once the controller has
        forgotten it), its progress from its progress file."""
        rc, out, err = await self._command("scontrol", "-o", "show", "job", ref)
        step, checkpoints = read_progress(self.part_dir(key) / "progress")
        if rc != 0 or not out.strip():
            if "Invalid job id" in err:
                ended = await self.accounted(ref, key)
                if ended is not None:
                    return replace(ended, step=step, checkpoints=checkpoints)
                return PartStatus(
                    phase=Phase.VANISHED,
                    reason=f"Slurm job {ref} is gone (and not in Slurm's accounting)",
                    step=step,
                )
            raise BackendUnavailable(f"scontrol show job {ref}: {err[:500]}")
        rec = parse_record(out.splitlines()[0])
        phase = job_phase(rec.get("JobState", ""))
        nodes = tuple(expand_hostlist(rec.get("NodeList", "")))
        reason = rec.get("Reason", "None")
        exit_code, killed = exit_status(rec.get("ExitCode", "0:0"))
        if phase is Phase.FAILED and exit_code is None and killed:
            reason = killed
        if phase is Phase.PENDING:
            since = self._pending_since.setdefault(ref, time.monotonic())
            waited_s = time.monotonic() - since
            if reason.split(",")[0] in REFUSING_REASONS or waited_s > self.pending_timeout_s:
                return PartStatus(
                    phase=Phase.REFUSED,
                    reason=f"pending in Slurm for {waited_s:.0f} s: {reason}",
                    step=step,
                    checkpoints=checkpoints,
                )
        else:
            self._pending_since.pop(ref, None)
        return PartStatus(
            phase=phase,
            nodes=nodes,
            reason=f"{rec.get('JobState', '')} ({reason})" if reason != "None" else rec.get("JobState", ""),
            exit_code=exit_code,
            step=step,
            checkpoints=checkpoints,
        )

    async def running(self) -> dict[str, str]:
        """Loom's parts Slurm runs or queues now, ``job:attempt`` → Slurm job id."""
        rc, out, err = await self._command("squeue", "-h", "-o", "%i %k")
        if rc != 0:
            raise BackendUnavailable(f"squeue: {err[:500]}")
        parts: dict[str, str] = {}
        mine = self.comment("")
        for line in out.splitlines():
            ref, _, comment = line.strip().partition(" ")
            if comment.startswith(mine) and comment != mine:
                parts[comment.removeprefix(mine)] = ref
        return parts

    # ---- speed (what the profile says: the real hardware decides the rest) ----------------------

    def delivered_speed(self, gpu_model: str, task_type: str) -> float:
        """The model's SCU for the task type: the profile's claim (the run's time shows the truth)."""
        return max(self.speed(gpu_model, task_type), 1e-9)

    def compute_step_seconds(
        self, step_time_s: float, gpu_model: str, task_type: str, family: str = ""
    ) -> float:
        """Compute seconds per step the profile predicts on this model."""
        return step_time_s / self.delivered_speed(gpu_model, task_type)

    def step_seconds(
        self,
        step_time_s: float,
        gpu_model: str,
        task_type: str,
        *,
        slowdown: float = 1.0,
        worker_share: float = 1.0,
        family: str = "",
    ) -> float:
        """Seconds one step should take (the example job sleeps that long, scaled)."""
        compute_s = self.compute_step_seconds(step_time_s, gpu_model, task_type, family)
        return compute_s * max(slowdown, 1.0) / max(worker_share, 1e-9)


def _conforms(backend: SlurmBackend) -> ClusterBackend:
    return backend  # mypy checks that SlurmBackend satisfies the backend protocol
