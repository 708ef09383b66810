"""Staging a queued job's dataset: copy it while the job waits, not while it holds GPUs.

A job whose dataset is in another region than the cluster it starts in first copies it
(:class:`~loom.sched.plugins.data.DataLocality`: ``after_sync`` waits for the copy on the GPUs it was
given, ``while_syncing`` reads slowly until it is done). Under contention those GPUs are the ones
every queued job is waiting for. Measured on ``loom bench contention`` (``small3`` net, loads 1.0 /
1.2, seeds 1-3, issue 12): 6.9 % of the G2 pool's GPU-seconds (the fastest pool, busy 97 % of the
time while jobs queued) went to first copies, and Loom's network-sensitive gangs queued 2,361 s on
average before starting. A copy begun when the job is queued is done, or nearly, by the time it
starts, and the bottleneck pool runs work instead.

**The rule** (:func:`staging_plan`): when a job with a dataset is queued (nothing fits it now), its
dataset is copied to the region of the pool it is most likely to run in: among the (cluster, GPU
model) pools that could ever hold its workers whole and that its affinity allows, the one where it
runs fastest (the snapshot's per-job speed, :meth:`Snapshot.job_speeds`: what placement scores
with); ties go to the larger pool, then to the shorter copy. No plan when the dataset is already
there (a holder or an earlier copy), when the job is a pipeline (its stages may land in several
regions), or when no pool could ever hold it. The copy goes from the holder closest by transfer
time. It is a belief like any other: if the job then starts elsewhere, that region copies as
before and the staged bytes were spent for nothing (the simulator counts them as cross-region
bytes either way).

Pure: the simulator applies a plan (``simulate(..., stage_data=True)``: the copy runs from when the
job is queued; a start in that region waits only for what is left of it). The placement service
does not yet send staging copies (a follow-up: the plan carries what a :class:`SyncPlan` needs).
"""

import math
from dataclasses import dataclass

from loom.sched.allowed import cluster_allowed
from loom.sched.snapshot import Snapshot
from loom_proto.jobs import JobSpec

__all__ = ["StagePlan", "staging_plan"]


@dataclass(frozen=True, slots=True)
class StagePlan:
    """Copy ``dataset`` (``size_gb``) from ``src`` to ``dst`` while the job waits (``sync_s``: the
    copy's predicted seconds over the measured path)."""

    job_id: str
    dataset: str
    src: str
    dst: str
    size_gb: float
    sync_s: float


def staging_plan(job: JobSpec, snap: Snapshot, *, copied: frozenset[str] = frozenset()) -> StagePlan | None:
    """Where to copy a queued job's dataset while it waits (the module docstring), or None.

    ``copied``: regions that already hold a copy made for this job (no second one)."""
    data = job.data
    if data is None or job.pipeline is not None or not snap.clusters:
        return None
    # A replica in a region Loom does not know is left out (no measured link to copy over).
    holders = [data.region, *(r for r in data.replicas if r != data.region and r in snap.region_index)]
    per_worker = max(job.resources.gpus, 1)
    need = max(job.min_workers or job.workers, 1) * per_worker  # an elastic job may start smaller
    speeds = snap.job_speeds(job)
    best: tuple[float, int, float, str, str] | None = None
    for c, info in enumerate(snap.clusters):
        region = info.region
        if not cluster_allowed(job.affinity, info.id, region):
            continue
        for m in range(len(snap.models)):
            total = int(snap.total_sum[c, m])
            if total < need:
                continue
            speed = float(speeds[m]) * float(snap.trust[c])
            if not speed > 0:
                continue
            sync_s, src = _copy(snap, holders, region, data.size_gb)
            key = (-speed, -total, sync_s, region, src)
            if best is None or key < best:
                best = key
    if best is None:
        return None
    _, _, sync_s, region, src = best
    if region in holders or region in copied or not math.isfinite(sync_s):
        return None
    return StagePlan(
        job_id=job.job_id,
        dataset=data.dataset,
        src=src,
        dst=region,
        size_gb=float(data.size_gb),
        sync_s=float(sync_s),
    )


def _copy(snap: Snapshot, holders: list[str], region: str, size_gb: float) -> tuple[float, str]:
    """The first copy's seconds to ``region`` from the closest holder (0 where one is), and it."""
    if region in holders:
        return 0.0, region
    return min((float(snap.net.transfer_s(h, region, size_gb)), h) for h in holders)
