"""The ``sim`` backend: a cluster of simulated GPUs from a topology, running jobs in accelerated time.

A job of ``steps`` steps, each ``step_time_s`` on the reference accelerator, takes
``steps * step_time_s / (speed * efficiency) / time_scale`` wall seconds: ``speed`` is the node
model's SCU for the job's task type (the same SCU model placement believes), ``efficiency`` how
much of it this cluster really delivers (1.0: as claimed; lower simulates a cluster whose
hardware or software falls short of its profile), and ``time_scale`` how many simulated seconds
pass per wall second.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from loom.model.topology import Cluster
from loom_proto.clusters import NodeState
from loom_proto.jobs import NodeAllocation

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
            healthy=self.healthy and not self.draining,
        )


@dataclass
class SimCluster:
    """The simulated hardware of one cluster; tracks which nodes changed since the last report."""

    cluster: Cluster
    speed: SpeedFn = reference_speed
    efficiency: float = 1.0
    nodes: dict[str, SimNode] = field(init=False)
    dirty: set[str] = field(init=False, default_factory=set)

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
            if not node.healthy or node.draining:
                return f"node {a.node} is not accepting work"
            if node.gpus_total - node.gpus_used < a.gpus:
                return f"node {a.node} has {node.gpus_total - node.gpus_used} free GPUs, {a.gpus} asked"
        return None

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

    def drain(self, nodes: Sequence[str]) -> None:
        """Stop offering the nodes (all nodes when empty)."""
        for name in nodes or list(self.nodes):
            if name in self.nodes:
                self.nodes[name].draining = True
                self.dirty.add(name)

    def report(self, full: bool) -> list[NodeState]:
        """Node states for a heartbeat: all of them, or those changed since the last report."""
        names = list(self.nodes) if full else sorted(self.dirty)
        self.dirty.clear()
        return [self.nodes[n].state() for n in names]

    def delivered_speed(self, gpu_model: str, task_type: str) -> float:
        """Work per second relative to the reference accelerator, as this cluster really runs it."""
        return max(self.speed(gpu_model, task_type) * self.efficiency, 1e-9)

    def wall_seconds(
        self, steps: int, step_time_s: float, gpu_model: str, task_type: str, time_scale: float
    ) -> float:
        """Wall-clock seconds ``steps`` take here."""
        return steps * step_time_s / self.delivered_speed(gpu_model, task_type) / time_scale
