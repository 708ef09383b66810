"""Queue sort ``fair_share_srsf``: priority, the tenant's quota band, then shortest predicted
service first with aging (Tiresias / SRSF, with a bounded wait), Loom's default queue order.

Under contention a job's completion time is mostly queueing, and which job takes the GPUs that come
free is the queue's order. First come, first served makes a one-GPU job of ten minutes wait behind
a 16-GPU gang of an hour; serving the small one first costs the gang ten GPU-minutes and saves the
small job the gang's whole run. Ordering by predicted service lowers the mean completion time;
aging bounds what any job waits. (The baselines of the simulator keep ``priority_fair_share``:
fair share, then arrival.)

The key of a queued job, taken once when it is queued (lower goes first):

1. ``-priority``: a higher priority always goes first, as with ``priority_fair_share``;
2. the tenant's **quota band**: 0 while its fair share (:func:`loom.sched.cycle.fair_share_of`,
   GPUs held over its weighted nominal quota) is under :attr:`ShortestServiceFirst.band` (default
   1: within its quota), else 1 (borrowing). A tenant within its quota goes before one borrowing.
   Only when the quota book lists quotas (:attr:`QueueItem.own_quota`): in an open book no tenant
   has a quota, so none borrows and every job is in band 0 (counted against a nominal of 1, a
   tenant holding one GPU was "borrowing", and its jobs went behind every job of a tenant holding
   none, queued however much later). Where the book lists quotas, a tenant without one of its own
   (admitted by an open platform) has no guarantee: it is always in band 1, so tenants without a
   quota are ordered among themselves by their virtual start, not by which holds nothing;
3. the **virtual start** ``submitted_at + aging_s x service_gpu_h + share_s x fair_share``: when
   the job was queued, plus ``aging_s`` seconds per GPU-hour of predicted service
   (:func:`service_gpu_s`: steps x reference step time x GPUs), plus ``share_s`` seconds per unit
   of its tenant's fair share (a tenant using more waits a little longer, as Slurm's multifactor
   priority weighs fair share against age and size). Without quotas (an open book: nominal 0,
   counted as 1) the fair share is the GPUs the tenant holds, so ``share_s`` is seconds per GPU held;
4. the job id (a total order).

**No starvation.** A key never changes once taken, and every term past ``submitted_at`` is 0 or
more. So within its priority and band, a job queued at ``t`` with key ``v`` is overtaken only by
jobs queued before ``v``: by those queued within :func:`overtake_window_s` (``aging_s x S +
share_s x share``) after it. Its wait is bounded by the work of those and of the jobs queued or
running when it arrived (the unit test ``test_no_job_starves_under_aging`` checks it against an
endless stream of small jobs, which pure shortest-first would let overtake it forever). With
``aging_s = share_s = 0`` the order is first come, first served within the band.

The defaults: ``share_s`` 60, chosen on ``loom bench contention`` (3 seeds; 0 to 600 gave close
results). ``aging_s`` 3000 s per GPU-hour since 2026-12-06 (1000 before, chosen when 300 to 10,000
gave close results): once the quota band stopped sending every job of a tenant holding a GPU behind
the idle tenants' jobs, the order by service counted for more. Against 1000 on ``loom bench
contention`` (loads 0.5 to 1.2, geometric mean JCT): seeds 1-3 -1.6 %, 4-6 -1.3 %, 7-9 -1.7 %, and
seeds 10-12 never run before -0.6 % (300: +5.7 % on seeds 7-9; 10,000: -1.3 / -1.5 % on seeds 1-3 /
7-9); on the grid (``--grid``, loads 0.8 to 1.2, seeds 0-4, and seeds 50-54) -0.03 / -0.14 %, the
spanning penalty 0 and the class margins as before (``docs/measurements.md``). The bound below
triples with it: a 16-GPU gang of one reference hour may be overtaken by jobs queued up to 13 h
after it, where 1000 allowed 4.4 h.
"""

import math
from dataclasses import dataclass
from typing import Final

from loom.sched.framework import QueueItem
from loom_proto.jobs import JobSpec

__all__ = [
    "DEFAULT_AGING_S",
    "DEFAULT_BAND",
    "DEFAULT_SHARE_S",
    "ShortestServiceFirst",
    "overtake_window_s",
    "service_gpu_s",
    "virtual_start_s",
]

DEFAULT_AGING_S: Final = 3000.0
"""Seconds of queueing one GPU-hour of predicted service is worth (see the module docstring)."""
DEFAULT_BAND: Final = 1.0
"""The fair share from which a tenant is borrowing (queued in the second band): its whole quota."""
DEFAULT_SHARE_S: Final = 60.0
"""Seconds of virtual start per unit of the tenant's fair share (open book: per GPU it holds)."""


def service_gpu_s(job: JobSpec) -> float:
    """A job's predicted service in reference-GPU seconds: its steps x reference step time x the GPUs
    it holds (workers x GPUs per worker); a pipeline (one model split over GPUs by the planner) counts
    its steps x step time once: its whole model's work on one reference GPU."""
    work = float(job.work.steps) * float(job.work.step_time_s)
    if job.pipeline is not None:
        return work
    return work * max(job.workers, 1) * max(job.resources.gpus, 1)


def virtual_start_s(item: QueueItem, aging_s: float = DEFAULT_AGING_S) -> float:
    """When the job is served as if it had been queued: its queue time plus ``aging_s`` per GPU-hour
    of predicted service."""
    return item.submitted_at + aging_s * service_gpu_s(item.job) / 3600.0


def overtake_window_s(
    job: JobSpec, aging_s: float = DEFAULT_AGING_S, *, share: float = 0.0, share_s: float = DEFAULT_SHARE_S
) -> float:
    """How long after a job is queued a job of the same priority and band may still be queued and go
    before it (the bound of the module docstring): ``aging_s`` x its service in GPU-hours, plus
    ``share_s`` x its tenant's fair share when it was queued."""
    return aging_s * service_gpu_s(job) / 3600.0 + share_s * max(share, 0.0)


def _band(item: QueueItem, band: float) -> float:
    """The quota band: 1 for a tenant borrowing (at or over ``band`` of its quota, or without a
    quota where the book lists others), 0 otherwise; always 0 in an open book."""
    if item.own_quota is None:
        return 0.0
    return 1.0 if not item.own_quota or item.fair_share >= band else 0.0


@dataclass(frozen=True, slots=True)
class ShortestServiceFirst:
    """Queue sort: priority, fair-share band, virtual start (see the module docstring)."""

    aging_s: float = DEFAULT_AGING_S
    band: float = DEFAULT_BAND
    share_s: float = DEFAULT_SHARE_S
    name: str = "fair_share_srsf"

    def __post_init__(self) -> None:
        if not (math.isfinite(self.aging_s) and self.aging_s >= 0):
            raise ValueError(f"aging_s must be a finite number >= 0, got {self.aging_s!r}")
        if not (math.isfinite(self.band) and self.band > 0):
            raise ValueError(f"band must be a finite number > 0, got {self.band!r}")
        if not (math.isfinite(self.share_s) and self.share_s >= 0):
            raise ValueError(f"share_s must be a finite number >= 0, got {self.share_s!r}")

    def sort_key(self, item: QueueItem) -> tuple[float, float, float, str]:
        return (
            -item.job.priority,
            _band(item, self.band),
            virtual_start_s(item, self.aging_s) + self.share_s * max(item.fair_share, 0.0),
            item.job.job_id,
        )
