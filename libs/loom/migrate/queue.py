"""The queue a move's target would deprive: the waiting jobs its pool could hold (pure, no I/O).

:func:`loom.migrate.benefit.decide` charges a voluntary move the *queue's loss*
(:func:`~loom.migrate.benefit.displacement_s`): while jobs wait that the target's pool could hold,
the GPUs the move takes there are not idle. :func:`queued_options` lists those jobs from the
scheduler's :class:`~loom.sched.snapshot.Snapshot`: the queue (``waiting``) with each job's shape as
the framework recorded it (``queued``: workers, GPUs per worker, allowed pools, work). One function
for both callers: placement's what-if answers it to the migration service, and the simulator's
migrator calls it on its own snapshot, so that both apply the same rule to the same queue.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import msgspec

from loom.migrate.benefit import QueuedOption
from loom.sched.availability import expected_wait_s
from loom.sched.framework import Part
from loom.sched.snapshot import QueuedShape, Snapshot

__all__ = ["MAX_OPTIONS", "options_from_wire", "options_to_wire", "queued_for_part", "queued_options"]


MAX_OPTIONS = 64
"""At most this many waiting jobs, the first in queue order: the GPUs a move takes would go to
the first of them that fits, and the what-if's answer stays small and cheap under a long queue."""


def queued_options(
    snap: Snapshot, job_id: str, cluster: str, gpu_model: str, taken_gpus: int, *, limit: int = MAX_OPTIONS
) -> list[QueuedOption]:
    """The waiting jobs (``snap.waiting``, each with its ``snap.queued`` shape) other than
    ``job_id`` that pool (``cluster``, ``gpu_model``) could hold when free (their rules allow it;
    its schedulable GPUs are enough), the first ``limit`` in queue order
    (:meth:`~loom.sched.snapshot.Snapshot.queue_order`): each job's predicted run there and on its
    fastest other pool that could hold it (its work at the scheduler's speed x the cluster's trust;
    a gang's exchange is left out), and when the pool is expected to have room for it without the
    move and once the move has taken ``taken_gpus`` GPUs there (:func:`expected_wait_s`,
    ``ahead_gpus``; computed once per shape of workers). A job whose work is unknown is left out.
    ``QueuedOption`` carries the run as one step (``steps_left`` 1):
    :func:`~loom.migrate.benefit.displacement_s` reads only ``steps_left x step``."""
    c, m = snap.cluster_index.get(cluster), snap.model_index.get(gpu_model)
    if c is None or m is None or not snap.waiting:
        return []
    capacity: dict[tuple[int, int], int] = {}
    waits: dict[tuple[int, int], tuple[float, float]] = {}

    def holds(ci: int, mi: int) -> int:
        if (ci, mi) not in capacity:
            pool = snap.pool(ci, mi)
            capacity[ci, mi] = int((snap.total[pool] * snap.schedulable[pool]).sum())
        return capacity[ci, mi]

    out: list[QueuedOption] = []
    for shape in snap.queue_order():
        if len(out) >= limit:
            break
        if shape.job_id == job_id or shape.job is None or not math.isfinite(shape.work_s):
            continue
        workers, each = max(shape.workers, 1), shape.per_worker
        gpus = workers * each
        if not shape.pools[c, m] or holds(c, m) < gpus:
            continue
        if (workers, each) not in waits:
            waits[workers, each] = (
                expected_wait_s(snap, c, m, workers, each),
                expected_wait_s(snap, c, m, workers, each, ahead_gpus=taken_gpus),
            )
        free_s, taken_s = waits[workers, each]
        elsewhere = min(
            (
                _run_s(snap, shape, int(ci), int(mi))
                for ci, mi in zip(*shape.pools.nonzero(), strict=True)
                if (int(ci), int(mi)) != (c, m) and holds(int(ci), int(mi)) >= gpus
            ),
            default=math.inf,
        )
        out.append(
            QueuedOption(
                shape.job_id,
                1.0,
                _run_s(snap, shape, c, m),
                elsewhere,
                wait_free_s=free_s,
                wait_taken_s=taken_s,
            )
        )
    return out


def queued_for_part(
    snap: Snapshot, job_id: str, part: Part, *, limit: int = MAX_OPTIONS
) -> list[QueuedOption]:
    """:func:`queued_options` for the pool of a candidate placement's ``part`` (its lead), the move
    taking the GPUs of its allocations ((node, GPUs) pairs): the one call of placement's what-if and
    the simulator's migrator."""
    taken = sum(gpus for _, gpus in part.allocations)
    return queued_options(snap, job_id, part.cluster, part.gpu_model, taken, limit=limit)


def _run_s(snap: Snapshot, shape: QueuedShape, c: int, m: int) -> float:
    assert shape.job is not None
    speed = snap.job_gpu_speed(shape.job, snap.models[m]) * float(snap.trust[c])
    return shape.work_s / speed if speed > 0 else math.inf


def options_to_wire(options: list[QueuedOption]) -> list[dict[str, Any]]:
    """The options as strict-JSON dicts (placement's what-if answer): an infinite time as null."""
    return [
        {
            k: (None if isinstance(v, float) and math.isinf(v) else v)
            for k, v in msgspec.to_builtins(o).items()
        }
        for o in options
    ]


def options_from_wire(raw: object) -> list[QueuedOption]:
    """Options read back from a what-if answer (null: an infinite time); anything malformed reads
    as no queue (the rule without the queue's loss), never as an error of the review."""
    if not isinstance(raw, list):
        return []
    try:
        return [
            msgspec.convert({k: (math.inf if v is None else v) for k, v in o.items()}, QueuedOption)
            for o in raw
            if isinstance(o, Mapping)
        ]
    except msgspec.ValidationError:
        return []
