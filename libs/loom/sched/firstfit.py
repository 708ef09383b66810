"""First-fit placement: the first cluster (in a stable order) that can hold every worker of a job.

This is the foundation's placement policy; the plugin framework replaces the choice of cluster
but keeps the contract: a :class:`Placement`, or an :class:`Unschedulable` that says whether
waiting can help and what the submitter could change.
"""

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from loom.model.capacity import NodeCapacity
from loom_proto.jobs import JobSpec


@dataclass(frozen=True, slots=True)
class Placement:
    """Where each worker goes: ``allocations`` is (node, gpus) with one entry per node used."""

    cluster: str
    region: str
    gpu_model: str
    allocations: tuple[tuple[str, int], ...]


@dataclass(frozen=True, slots=True)
class Unschedulable:
    """No placement now. ``impossible`` means waiting cannot help: reject with ``reason``."""

    reason: str
    impossible: bool


def pack_workers(
    free_gpus: Iterable[tuple[str, int]], gpus_per_worker: int, workers: int
) -> list[tuple[str, int]] | None:
    """Pack workers onto nodes (most free first, to keep gangs on few nodes); None if they don't fit."""
    allocations: list[tuple[str, int]] = []
    left = workers
    for node, free in sorted(free_gpus, key=lambda nf: (-nf[1], nf[0])):
        fit = min(free // gpus_per_worker, left)
        if fit > 0:
            allocations.append((node, fit * gpus_per_worker))
            left -= fit
            if left == 0:
                return allocations
    return None


class CapacityIndex:
    """Free GPUs grouped by (cluster, model), built once per scheduling cycle.

    Deciding for a batch of jobs then costs each job a pass over the groups (skipping any whose
    total free GPUs cannot hold it) plus a pass over the nodes of the group it lands in, not a
    pass over every node.
    """

    def __init__(self, nodes: Mapping[str, NodeCapacity]) -> None:
        self.nodes = nodes
        self.groups: dict[tuple[str, str], dict[str, int]] = {}
        self.free: dict[tuple[str, str], int] = {}
        self.region: dict[str, str] = {}
        for cap in nodes.values():
            if cap.gpu_model is None:
                continue
            key = (cap.cluster, cap.gpu_model)
            self.groups.setdefault(key, {})[cap.node] = cap.gpus_free
            self.free[key] = self.free.get(key, 0) + cap.gpus_free
            self.region[cap.cluster] = cap.region
        self.order = sorted(self.groups)

    def place(self, job: JobSpec) -> Placement | Unschedulable:
        """First (cluster, model) in id order that holds every worker now; nothing is taken."""
        allowed = job.resources.gpu_models
        need = job.resources.gpus * job.workers
        for key in self.order:
            if (allowed and key[1] not in allowed) or self.free[key] < need:
                continue
            allocations = pack_workers(self.groups[key].items(), job.resources.gpus, job.workers)
            if allocations is not None:
                return Placement(
                    cluster=key[0],
                    region=self.region[key[0]],
                    gpu_model=key[1],
                    allocations=tuple(allocations),
                )
        by_cluster_model: dict[tuple[str, str], list[NodeCapacity]] = {}
        for cap in sorted(self.nodes.values(), key=lambda c: (c.cluster, c.node)):
            if cap.gpu_model is not None and (not allowed or cap.gpu_model in allowed):
                by_cluster_model.setdefault((cap.cluster, cap.gpu_model), []).append(cap)
        return explain_unschedulable(job, by_cluster_model, any_nodes=bool(self.nodes))

    def take(self, placement: Placement) -> None:
        """Account for a placement so later jobs of the cycle see the GPUs as used."""
        key = (placement.cluster, placement.gpu_model)
        group = self.groups[key]
        for node, gpus in placement.allocations:
            group[node] -= gpus
            self.free[key] -= gpus


def place(job: JobSpec, nodes: Mapping[str, NodeCapacity]) -> Placement | Unschedulable:
    """Choose the first cluster (by id) and GPU model that can hold all ``job.workers`` now."""
    return CapacityIndex(nodes).place(job)


def explain_unschedulable(
    job: JobSpec, by_cluster_model: Mapping[tuple[str, str], list[NodeCapacity]], *, any_nodes: bool
) -> Unschedulable:
    """Say why nothing fits, and whether it ever could on the clusters known now."""
    per_worker = job.resources.gpus
    need = f"{job.workers} worker(s) x {per_worker} GPU(s)"
    models = ", ".join(sorted(job.resources.gpu_models)) or "any model"
    if not any_nodes:
        return Unschedulable(reason="no cluster has joined yet; the job waits for capacity", impossible=False)
    if not by_cluster_model:
        return Unschedulable(
            reason=f"no cluster has GPUs of the allowed models ({models}); allow other models",
            impossible=True,
        )
    best: tuple[int, str, str] | None = None
    for (cluster, model), caps in sorted(by_cluster_model.items()):
        capacity_workers = sum(c.gpus_total // per_worker for c in caps)
        if pack_workers(((c.node, c.gpus_total) for c in caps), per_worker, job.workers) is not None:
            return Unschedulable(
                reason=f"{need} of {models} fit on {cluster} ({model}) but its GPUs are taken;"
                " waiting for capacity",
                impossible=False,
            )
        if best is None or capacity_workers > best[0]:
            best = (capacity_workers, cluster, model)
    assert best is not None
    largest_node = max(c.gpus_total for caps in by_cluster_model.values() for c in caps)
    if per_worker > largest_node:
        hint = (
            f"the largest node has {largest_node} GPUs of an allowed model:"
            f" ask for at most {largest_node} per worker"
        )
    else:
        hint = (
            f"the most any cluster can hold is {best[0]} worker(s) on {best[1]} ({best[2]}):"
            " ask for fewer workers"
        )
    return Unschedulable(reason=f"{need} of {models} can never fit on one cluster; {hint}", impossible=True)
