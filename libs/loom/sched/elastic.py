"""Elastic jobs: start with what fits, grow into freed GPUs, shrink under pressure, never below min.

An elastic job runs ``min_workers <= workers <= max_workers`` workers (``max_workers`` is the
spec's ``workers``), each of ``gpus_per_worker`` GPUs on one node. Resizes change whole workers
and stay on the job's own cluster.
"""

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from loom.errors import InvalidInputError
from loom.sched.firstfit import pack_workers
from loom.sched.snapshot import RunningJob
from loom_proto.jobs import JobSpec

__all__ = [
    "ElasticError",
    "ElasticJob",
    "Resize",
    "initial_workers",
    "pace_scale",
    "plan_grow",
    "plan_shrink",
    "resized_end_s",
    "with_sizes",
]

Allocations = tuple[tuple[str, int], ...]
"""(node, gpus) per node used, one entry per node."""


class ElasticError(InvalidInputError):
    """Elastic bounds or a job's state that cannot be right (min above max, GPUs not whole workers)."""


def _check_bounds(gpus_per_worker: int, min_workers: int, max_workers: int) -> None:
    if gpus_per_worker < 1:
        raise ElasticError(f"gpus_per_worker must be at least 1, not {gpus_per_worker}")
    if not 1 <= min_workers <= max_workers:
        raise ElasticError(
            f"min_workers ({min_workers}) must be at least 1 and at most workers ({max_workers})"
        )


def initial_workers(
    free: Mapping[str, int], gpus_per_worker: int, min_workers: int, max_workers: int
) -> tuple[int, Allocations] | None:
    """As many workers as fit now (at most ``max_workers``) and where; None if fewer than ``min_workers``."""
    _check_bounds(gpus_per_worker, min_workers, max_workers)
    capacity = sum(max(gpus, 0) // gpus_per_worker for gpus in free.values())
    workers = min(capacity, max_workers)
    if workers < min_workers:
        return None
    allocations = pack_workers(free.items(), gpus_per_worker, workers)
    assert allocations is not None  # capacity counts exactly the workers pack_workers can place
    return workers, tuple(allocations)


@dataclass(frozen=True, slots=True)
class ElasticJob:
    """A running elastic job: its bounds, its workers now, and the GPUs they hold on ``cluster``."""

    job_id: str
    priority: int
    gpus_per_worker: int
    min_workers: int
    max_workers: int
    workers: int
    cluster: str
    allocations: Allocations

    def __post_init__(self) -> None:
        _check_bounds(self.gpus_per_worker, self.min_workers, self.max_workers)
        if not self.min_workers <= self.workers <= self.max_workers:
            raise ElasticError(
                f"job {self.job_id!r} runs {self.workers} workers, outside [{self.min_workers},"
                f" {self.max_workers}]"
            )
        held = 0
        for node, gpus in self.allocations:
            if gpus < 1 or gpus % self.gpus_per_worker:
                raise ElasticError(
                    f"job {self.job_id!r} holds {gpus} GPUs on {node}, not whole workers of"
                    f" {self.gpus_per_worker}"
                )
            held += gpus
        if held != self.workers * self.gpus_per_worker:
            raise ElasticError(
                f"job {self.job_id!r} holds {held} GPUs for {self.workers} workers of {self.gpus_per_worker}"
            )


@dataclass(frozen=True, slots=True)
class Resize:
    """A job's new size: ``allocations`` is the new full set, ``delta_allocations`` the change per node.

    A delta is positive where GPUs are added and negative where they are given back.
    """

    job_id: str
    cluster: str
    workers: int
    allocations: Allocations
    delta_allocations: Allocations


def _resize(job: ElasticJob, held: Mapping[str, int]) -> Resize:
    before = dict(job.allocations)
    nodes = [node for node, _ in job.allocations] + sorted(set(held) - set(before))
    allocations = tuple((node, held[node]) for node in nodes if held.get(node, 0) > 0)
    delta = tuple(
        (node, held.get(node, 0) - before.get(node, 0))
        for node in nodes
        if held.get(node, 0) != before.get(node, 0)
    )
    workers = sum(gpus for _, gpus in allocations) // job.gpus_per_worker
    return Resize(
        job_id=job.job_id,
        cluster=job.cluster,
        workers=workers,
        allocations=allocations,
        delta_allocations=delta,
    )


def plan_grow(jobs: Sequence[ElasticJob], free_by_cluster: Mapping[str, Mapping[str, int]]) -> list[Resize]:
    """Give free GPUs to elastic jobs below their max, each only on its own cluster.

    Higher priority is served first; jobs of equal priority take one worker at a time in turn
    (by job id), so peers grow evenly. A new worker goes on a node the job already uses when one
    has room (fewer nodes, less cross-node traffic), else on the node with most free GPUs.
    Returns one :class:`Resize` per job that grows, highest priority first.
    """
    free = {cluster: dict(nodes) for cluster, nodes in free_by_cluster.items()}
    held = {job.job_id: dict(job.allocations) for job in jobs}
    workers = {job.job_id: job.workers for job in jobs}
    ordered = sorted(jobs, key=lambda job: (-job.priority, job.job_id))
    tiers: dict[int, list[ElasticJob]] = {}
    for job in ordered:
        tiers.setdefault(job.priority, []).append(job)
    for tier in tiers.values():
        growing = [job for job in tier if job.workers < job.max_workers and job.cluster in free]
        while growing:
            still: list[ElasticJob] = []
            for job in growing:
                node = _node_for_worker(free[job.cluster], held[job.job_id], job.gpus_per_worker)
                if node is None:
                    continue
                free[job.cluster][node] -= job.gpus_per_worker
                held[job.job_id][node] = held[job.job_id].get(node, 0) + job.gpus_per_worker
                workers[job.job_id] += 1
                if workers[job.job_id] < job.max_workers:
                    still.append(job)
            growing = still
    return [_resize(job, held[job.job_id]) for job in ordered if workers[job.job_id] != job.workers]


def _node_for_worker(free: Mapping[str, int], held: Mapping[str, int], gpus_per_worker: int) -> str | None:
    fitting = [(node, gpus) for node, gpus in free.items() if gpus >= gpus_per_worker]
    if not fitting:
        return None
    return min(fitting, key=lambda ng: (ng[0] not in held, -ng[1], ng[0]))[0]


def plan_shrink(
    jobs: Sequence[ElasticJob], need_gpus_by_cluster: Mapping[str, int], priority: int
) -> list[Resize]:
    """Shrink elastic jobs to free ``need_gpus_by_cluster`` for a pending job of ``priority``.

    Only jobs of lower or equal priority shrink, lowest priority first (then by job id), whole
    workers at a time and never below their min. A job gives back workers from the node where it
    holds least first, so it stays on few nodes and whole nodes come free. Returns [] unless every
    cluster's need is met (the caller may then consider preemption).
    """
    held = {job.job_id: dict(job.allocations) for job in jobs}
    changed: list[ElasticJob] = []
    for cluster, need in sorted(need_gpus_by_cluster.items()):
        freed = 0
        candidates = sorted(
            (job for job in jobs if job.cluster == cluster and job.priority <= priority),
            key=lambda job: (job.priority, job.job_id),
        )
        for job in candidates:
            if freed >= need:
                break
            spare = job.workers - job.min_workers
            if spare <= 0:
                continue
            nodes = held[job.job_id]
            for _ in range(spare):
                if freed >= need:
                    break
                node = min(nodes, key=lambda n: (nodes[n], n))
                nodes[node] -= job.gpus_per_worker
                if nodes[node] == 0:
                    del nodes[node]
                freed += job.gpus_per_worker
            changed.append(job)
        if freed < need:
            return []
    return [_resize(job, held[job.job_id]) for job in changed]


def pace_scale(job: JobSpec, workers: int) -> float:
    """How much slower than predicted an elastic job given ``workers`` of the workers it asked for
    steps (the prediction is for the gang as asked; a pipeline's is for its stages as planned):
    synchronous data-parallel workers share its steps' work, so half of them take twice as long.
    The rule of placement's book, the simulator's clock and the span guard's runs alike."""
    return job.workers / workers if (job.pipeline is None and 0 < workers != job.workers) else 1.0


def resized_end_s(run: RunningJob, workers: int, now: float) -> float | None:
    """A running job's predicted end once it runs ``workers`` workers from ``now``: what was left at
    its old size, stretched or shrunk in proportion (synchronous data-parallel workers). The rule
    for every resize, shrink or growth, in placement's book and the simulator alike."""
    end = run.expected_end_s
    if end is None or workers <= 0:
        return end
    return now + max(end - now, 0.0) * run.workers / workers


def with_sizes(
    running: Sequence[RunningJob], sizes: Mapping[str, tuple[int, Allocations]], now: float
) -> list[RunningJob]:
    """A new list of running jobs (never one changed in place: plugins cache tables per list) with
    the jobs in ``sizes`` at their new (workers, allocations), their predicted ends rescaled
    (:func:`resized_end_s`). What a shrink and a growth leave in the snapshot."""
    return [
        dataclasses.replace(
            r,
            workers=sizes[r.job_id][0],
            allocations=sizes[r.job_id][1],
            expected_end_s=resized_end_s(r, sizes[r.job_id][0], now),
        )
        if r.job_id in sizes
        else r
        for r in running
    ]
