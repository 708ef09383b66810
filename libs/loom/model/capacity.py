"""One node as placement sees it: its place in the topology, its GPUs, CPU and RAM, what is promised.

A plain value shared by the scheduler (:mod:`loom.sched`), the simulator, the store and the
services, so it lives in the model rather than in one placement policy.
"""

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class NodeCapacity:
    """What placement knows about one node: where it is, its GPUs, and how many are promised."""

    node: str
    cluster: str
    region: str
    zone: str
    gpu_model: str | None
    gpus_total: int
    gpus_reserved: int = 0
    schedulable: bool = True
    cpu_milli: int = 0
    """CPU of the node (0: not reported, not checked)."""
    memory_mib: int = 0
    """RAM of the node (0: not reported, not checked)."""
    cpu_reserved: int = 0
    memory_reserved: int = 0

    @property
    def gpus_free(self) -> int:
        """GPUs not yet promised; 0 when the node takes no new work."""
        return max(self.gpus_total - self.gpus_reserved, 0) if self.schedulable else 0
