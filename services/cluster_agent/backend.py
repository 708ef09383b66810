"""What the cluster agent needs from the machinery that really runs jobs: a backend.

The agent's heartbeats, journal, attempt fencing, report sending and command handling are the same
whatever runs the jobs; a backend only knows its cluster's nodes and how to run, stop, signal and
follow one *part* of a job (the GPUs of one attempt on this cluster). Two backends exist:

- ``sim`` (:class:`loom_services.cluster_agent.sim.SimCluster`): simulated GPUs. It has a
  *clock* (:attr:`ClusterBackend.clock` is True): the agent itself advances the run's steps in
  accelerated time, so :meth:`~ClusterBackend.launch`, :meth:`~ClusterBackend.stop` and
  :meth:`~ClusterBackend.poll` have nothing to do.
- ``slurm`` (:class:`loom_services.cluster_agent.slurm.SlurmBackend`): a real Slurm cluster.
  The work runs as a Slurm job; the agent follows it by polling (:meth:`~ClusterBackend.poll`)
  and reports what Slurm and the job's progress file say.

Inventory is :attr:`~ClusterBackend.nodes` (refreshed by :meth:`~ClusterBackend.refresh` before
each heartbeat); :meth:`~ClusterBackend.allocate` / :meth:`~ClusterBackend.free` keep the agent's
own account of the GPUs its runs hold, so a heartbeat shows a start at once, before the backend's
next refresh.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

from loom_proto.clusters import NodeState
from loom_proto.jobs import NodeAllocation


class BackendError(Exception):
    """A backend could not carry out a request; ``non_retryable`` when trying again cannot help."""

    non_retryable = False


class LaunchRefused(BackendError):
    """The backend refused to run a part (bad GRES, over a partition limit...): ``reason`` says why."""

    non_retryable = True


class BackendUnavailable(BackendError):
    """The backend cannot be reached now (controller down, command timed out)."""


class Phase(StrEnum):
    """Where a part is in its life, as the backend sees it (mapped to Loom's job events)."""

    PENDING = "pending"
    """Accepted, waiting for its resources (``reason`` says why when the backend says)."""
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    """The work ended with an error (``exit_code`` when it exited non-zero)."""
    CANCELLED = "cancelled"
    """Cancelled, by someone other than this agent."""
    NODE_FAIL = "node_fail"
    """A node under it failed or went down."""
    REFUSED = "refused"
    """The backend will never run it as asked (``reason``): e.g. the chosen node cannot take it."""
    VANISHED = "vanished"
    """The backend no longer knows it."""

    @property
    def terminal(self) -> bool:
        """Whether the part will not run any more."""
        return self not in (Phase.PENDING, Phase.RUNNING)


@dataclass(frozen=True)
class PartStatus:
    """One look at a part: its phase, where it runs, and what its progress file said."""

    phase: Phase
    nodes: tuple[str, ...] = ()
    """The nodes it runs on (empty while pending)."""
    reason: str = ""
    exit_code: int | None = None
    step: int | None = None
    """The last step the work reported done (None: it reported none)."""
    checkpoints: tuple[tuple[int, str], ...] = ()
    """(step, uri) of every checkpoint the work reported, oldest first."""


@dataclass(frozen=True)
class PartLaunch:
    """What a backend needs to run one part: the job, the attempt, the GPUs Loom chose."""

    key: str
    """``job:attempt``: names the part in the backend, so a repeated launch finds the first."""
    job_id: str
    tenant: str
    attempt: int
    role: str
    """``lead`` runs the work; ``member`` only holds its GPUs until stopped."""
    gpu_model: str
    allocations: tuple[tuple[str, int], ...]
    steps: int
    start_step: int
    step_time_s: float
    """Wall seconds per step for this run (already scaled and slowed)."""
    checkpoint_every_steps: int
    labels: Mapping[str, str] = field(default_factory=dict)


class ClusterNode(Protocol):
    """A node as the agent reads it from a backend's inventory."""

    @property
    def node(self) -> str:
        """Its name."""
        ...

    @property
    def gpu_model(self) -> str | None:
        """Its GPUs' Loom model (None: no GPUs)."""
        ...

    @property
    def gpus_total(self) -> int:
        """Its GPUs."""
        ...

    @property
    def gpus_used(self) -> int:
        """Its GPUs in use."""
        ...


class ClusterBackend(Protocol):
    """The machinery under one cluster agent (see the module docstring)."""

    name: str
    """``sim`` or ``slurm``."""
    clock: bool
    """True: the agent advances runs itself (simulated time); False: the backend runs them and
    the agent follows them with :meth:`poll`."""
    poll_s: float
    """How often the agent polls a running part (backends without a clock)."""

    @property
    def cluster_id(self) -> str:
        """The Loom cluster this backend runs."""
        ...

    @property
    def nodes(self) -> Mapping[str, ClusterNode]:
        """The cluster's nodes by name, as last refreshed."""
        ...

    def changed(self) -> bool:
        """Whether a node changed since the last :meth:`report`."""
        ...

    async def refresh(self) -> None:
        """Read the inventory again (nothing to do for a backend that is its own inventory)."""
        ...

    def problem(self) -> str | None:
        """Why the backend cannot be used now (for health), or None."""
        ...

    def report(self, full: bool) -> list[NodeState]:
        """Node states for a heartbeat: all of them, or those changed since the last report."""
        ...

    def refusal(self, gpu_model: str, allocations: Sequence[NodeAllocation]) -> str | None:
        """Why these allocations cannot start here, or None when they can."""
        ...

    def resize_refusal(
        self, gpu_model: str, current: Sequence[NodeAllocation], wanted: Sequence[NodeAllocation]
    ) -> str | None:
        """Why a run holding ``current`` cannot change to ``wanted``, or None when it can."""
        ...

    def allocate(self, allocations: Sequence[NodeAllocation]) -> None:
        """Count GPUs as used by a run of this agent."""
        ...

    def free(self, allocations: Sequence[NodeAllocation]) -> None:
        """Give GPUs of a run back."""
        ...

    async def drain(self, nodes: Sequence[str]) -> None:
        """Stop offering the nodes (all nodes when empty)."""
        ...

    async def launch(self, part: PartLaunch) -> str:
        """Run a part; returns the backend's id for it. A part already launched under
        ``part.key`` is found, not launched twice. Raises :class:`LaunchRefused` or
        :class:`BackendUnavailable`."""
        ...

    async def stop(self, ref: str) -> None:
        """Stop a part (cancel or preempt); stopping one that has ended does nothing."""
        ...

    async def signal_checkpoint(self, ref: str) -> None:
        """Ask a running part to checkpoint now."""
        ...

    async def poll(self, ref: str, key: str) -> PartStatus:
        """Where the part is now; raises :class:`BackendUnavailable` when the backend cannot say."""
        ...

    def delivered_speed(self, gpu_model: str, task_type: str) -> float:
        """Work per second relative to the reference accelerator, as this cluster runs it."""
        ...

    def compute_step_seconds(
        self, step_time_s: float, gpu_model: str, task_type: str, family: str = ""
    ) -> float:
        """Compute seconds per step (simulated time) with all the workers asked for."""
        ...

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
        """Seconds (simulated time) one step of a run takes here."""
        ...

    async def running(self) -> dict[str, str]:
        """Parts the backend runs or holds now, ``job:attempt`` key to backend id (after a restart:
        what survived)."""
        ...
