"""The ``sim`` backend: a cluster of simulated GPUs from a topology, running jobs in accelerated time.

A job of ``steps`` steps, each ``step_time_s`` on the reference accelerator, takes
``steps * step_time_s * slowdown / (speed * efficiency * workers / spec_workers) / time_scale``
wall seconds:

- ``speed`` is the node model's SCU for the job's task type (the same SCU model placement
  believes), ``efficiency`` how much of it this cluster really delivers (1.0: as claimed; lower
  simulates a cluster whose hardware or software falls short of its profile);
- ``slowdown`` (at least 1) is how much longer than its compute alone the run takes, as placement
  predicted it (communication across clusters, pipeline bubbles);
- ``workers / spec_workers`` is the share of the workers it asked for that an elastic run has:
  the job's work is fixed, so a run given half its workers goes half as fast (and one given more
  goes proportionally faster);
- ``time_scale`` is how many simulated seconds pass per wall second;
- ``true_speed`` (a test and replay knob, ``--true-speed FAMILY:GPU=FACTOR``) makes jobs of one
  family (:func:`loom.model.family.job_family`) run on one GPU model at ``FACTOR`` times what its
  profile says (``0.33``: a third), unknown to placement: the truth its speed learner must find.
  The compute seconds per step a run really had (``step_time_s / (speed * efficiency * FACTOR)``)
  are reported on completion as ``observed_step_s``; ``delivered_speed`` (the cluster's trust and
  the metrics decay) stays the cluster's own, family-free figure.
"""

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from loom.model.family import fold_family
from loom.model.topology import Cluster
from loom_proto.clusters import NodeState
from loom_proto.jobs import NodeAllocation
from loom_services.cluster_agent.backend import ClusterBackend, PartLaunch, PartStatus, Phase

SpeedFn = Callable[[str, str], float]


def reference_speed(_gpu_model: str, _task_type: str) -> float:
    """Every model runs at reference speed until a calibrated model is plugged in."""
    return 1.0


@dataclass
class SimNode:
    """One simulated node: its GPUs and how many are in use."""

    node: str
    zone: str
    gpu_model: str | None
    gpus_total: int
    cpu_milli: int
    memory_mib: int
    gpus_used: int = 0
    healthy: bool = True
    draining: bool = False
    down: bool = False
    """Failed (fault injection, :meth:`SimCluster.fail_node`): reported down, its parts lost."""

    def state(self) -> NodeState:
        """The node as a heartbeat reports it."""
        return NodeState(
            node=self.node,
            zone=self.zone,
            gpu_model=self.gpu_model,
            gpus_total=self.gpus_total,
            gpus_used=self.gpus_used,
            cpu_milli=self.cpu_milli,
            memory_mib=self.memory_mib,
            healthy=self.healthy and not self.draining and not self.down,
            down=self.down,
        )


@dataclass
class SimCluster:
    """The simulated hardware of one cluster; tracks which nodes changed since the last report.

    The ``sim`` :class:`~loom_services.cluster_agent.backend.ClusterBackend`: it has a clock (the
    agent advances each run's steps itself), so launching, stopping and polling a part do nothing.
    """

    cluster: Cluster
    speed: SpeedFn = reference_speed
    efficiency: float = 1.0
    true_speed: dict[tuple[str, str], float] = field(default_factory=dict)
    """(job family, gpu_model) -> factor on the profile's speed that jobs of the family really get."""
    nodes: dict[str, SimNode] = field(init=False)
    dirty: set[str] = field(init=False, default_factory=set)
    name: str = field(init=False, default="sim")
    clock: bool = field(init=False, default=True)
    poll_s: float = field(init=False, default=1.0)

    def __post_init__(self) -> None:
        self.nodes = {
            n.id: SimNode(
                node=n.id,
                zone=self.cluster.zone,
                gpu_model=n.gpu_model,
                gpus_total=n.gpus,
                cpu_milli=n.cpu_milli,
                memory_mib=n.memory_mib,
            )
            for n in self.cluster.nodes
        }

    def refusal(self, gpu_model: str, allocations: Sequence[NodeAllocation]) -> str | None:
        """Why these allocations cannot start here, or None when they can."""
        for a in allocations:
            node = self.nodes.get(a.node)
            if node is None:
                return f"node {a.node} is not part of cluster {self.cluster.id}"
            if node.gpu_model != gpu_model:
                return f"node {a.node} has {node.gpu_model}, not {gpu_model}"
            if not node.healthy or node.draining or node.down:
                return f"node {a.node} is not accepting work"
            if node.gpus_total - node.gpus_used < a.gpus:
                return f"node {a.node} has {node.gpus_total - node.gpus_used} free GPUs, {a.gpus} asked"
        return None

    def resize_refusal(
        self, gpu_model: str, current: Sequence[NodeAllocation], wanted: Sequence[NodeAllocation]
    ) -> str | None:
        """Why a run holding ``current`` cannot change to ``wanted``, or None when it can.

        Only GPUs added on a node are checked: a run keeps what it holds, even on a draining node.
        """
        held: dict[str, int] = {}
        for a in current:
            held[a.node] = held.get(a.node, 0) + a.gpus
        totals: dict[str, int] = {}
        for a in wanted:
            totals[a.node] = totals.get(a.node, 0) + a.gpus
        added = [
            NodeAllocation(node=node, gpus=gpus - held.get(node, 0))
            for node, gpus in sorted(totals.items())
            if gpus > held.get(node, 0)
        ]
        return self.refusal(gpu_model, added)

    def allocate(self, allocations: Sequence[NodeAllocation]) -> None:
        """Mark GPUs used (call :meth:`refusal` first)."""
        for a in allocations:
            self.nodes[a.node].gpus_used += a.gpus
            self.dirty.add(a.node)

    def free(self, allocations: Sequence[NodeAllocation]) -> None:
        """Give GPUs back."""
        for a in allocations:
            node = self.nodes.get(a.node)
            if node is not None:
                node.gpus_used = max(node.gpus_used - a.gpus, 0)
                self.dirty.add(a.node)

    async def drain(self, nodes: Sequence[str]) -> None:
        """Stop offering the nodes (all nodes when empty)."""
        for name in nodes or list(self.nodes):
            if name in self.nodes:
                self.nodes[name].draining = True
                self.dirty.add(name)

    def fail_node(self, name: str, *, down: bool = True) -> None:
        """Fault injection: the node fails (its heartbeat reports it down) or, with ``down=False``,
        comes back."""
        self.nodes[name].down = down
        self.dirty.add(name)

    @property
    def cluster_id(self) -> str:
        """The cluster simulated."""
        return self.cluster.id

    def changed(self) -> bool:
        """Whether a node changed since the last report."""
        return bool(self.dirty)

    async def refresh(self) -> None:
        """Nothing to read: the simulation is its own inventory."""

    def problem(self) -> str | None:
        """A simulation is always there."""
        return None

    async def launch(self, part: PartLaunch) -> str:
        """Nothing to start: the agent's clock runs the part."""
        return f"sim:{part.key}"

    async def stop(self, ref: str) -> None:
        """Nothing to stop: cancelling the agent's run task stops the part."""

    async def signal_checkpoint(self, ref: str) -> None:
        """Nothing to signal: the agent reports the checkpoint itself."""

    async def poll(self, ref: str, key: str) -> PartStatus:
        """A simulated part runs as long as the agent runs it."""
        return PartStatus(phase=Phase.RUNNING)

    async def running(self) -> dict[str, str]:
        """Nothing outlives the agent here: its journal is the whole truth."""
        return {}

    def report(self, full: bool) -> list[NodeState]:
        """Node states for a heartbeat: all of them, or those changed since the last report."""
        names = list(self.nodes) if full else sorted(self.dirty)
        self.dirty.clear()
        return [self.nodes[n].state() for n in names]

    def delivered_speed(self, gpu_model: str, task_type: str) -> float:
        """Work per second relative to the reference accelerator, as this cluster really runs it."""
        return max(self.speed(gpu_model, task_type) * self.efficiency, 1e-9)

    def true_factor(self, family: str, gpu_model: str) -> float:
        """What jobs of ``family`` really get on ``gpu_model`` over the profile (1.0 unless set)."""
        return self.true_speed.get((family, gpu_model), 1.0)

    def compute_step_seconds(
        self, step_time_s: float, gpu_model: str, task_type: str, family: str = ""
    ) -> float:
        """Simulated compute seconds per step with all the workers asked for (what a run observes)."""
        speed = self.delivered_speed(gpu_model, task_type) * self.true_factor(family, gpu_model)
        return step_time_s / max(speed, 1e-9)

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
        """Simulated seconds one step takes here.

        ``slowdown`` stretches the compute time; ``worker_share`` is the workers a run has over
        the workers it asked for (speed is proportional to it); ``family`` picks a true speed.
        """
        compute_s = self.compute_step_seconds(step_time_s, gpu_model, task_type, family)
        return compute_s * max(slowdown, 1.0) / max(worker_share, 1e-9)

    def wall_seconds(
        self,
        steps: float,
        step_time_s: float,
        gpu_model: str,
        task_type: str,
        time_scale: float,
        *,
        slowdown: float = 1.0,
        worker_share: float = 1.0,
        family: str = "",
    ) -> float:
        """Wall-clock seconds ``steps`` take here."""
        step_s = self.step_seconds(
            step_time_s, gpu_model, task_type, slowdown=slowdown, worker_share=worker_share, family=family
        )
        return steps * step_s / time_scale


def parse_true_speeds(items: Iterable[str]) -> dict[tuple[str, str], float]:
    """``FAMILY:GPU=FACTOR`` options as a ``true_speed`` table (families folded like job families).

    Raises ValueError on a malformed item or a factor that is not positive.
    """
    table: dict[tuple[str, str], float] = {}
    for item in items:
        key, sep, value = item.rpartition("=")
        family, colon, gpu = key.rpartition(":")
        if not sep or not colon or not family or not gpu:
            raise ValueError(f"true speed {item!r} is not FAMILY:GPU=FACTOR")
        factor = float(value)
        if not (factor > 0 and factor < float("inf")):
            raise ValueError(f"true speed factor in {item!r} must be positive")
        folded = family.partition("@")
        name = fold_family(folded[0]) + (f"@{folded[2]}" if folded[1] else "")
        table[(name, gpu)] = factor
    return table


def _conforms(sim: SimCluster) -> ClusterBackend:
    return sim  # mypy checks that SimCluster satisfies the backend protocol
