"""DataLocality: run where the job's dataset is, or plan how it gets there.

A job's dataset lives in ``data.region`` and in any ``data.replicas``. For every region of the
snapshot the first copy takes ``NetMatrix.transfer_s`` from the holder that delivers it soonest
(0 where a holder is); :func:`data_placement` computes that once per cycle for every plugin.

What the copy costs the job depends on ``data.start`` (:func:`data_delay_s`): ``after_sync`` waits
for it; ``while_syncing`` starts at once and, until the copy is done, reads over the wide-area link
at :data:`READ_SLOWDOWN` times the step time.
"""

from dataclasses import dataclass
from typing import Literal

import numpy as np

from loom.sched.framework import SUCCESS, Candidates, Code, CycleState, Decision, StateKey, Status
from loom.sched.snapshot import FloatArray, Snapshot
from loom_proto.jobs import JobSpec, SyncPlan

__all__ = ["READ_SLOWDOWN", "DataLocality", "DataPlacement", "data_delay_s", "data_key", "data_placement"]

READ_SLOWDOWN = 2.0
"""Steps of a job that reads while its dataset syncs take this many times as long until the copy is
done (remote reads share the link with the copy): a simple, documented guess."""

StartMode = Literal["after_sync", "while_syncing"]


def data_delay_s(run_s: FloatArray | float, sync_s: FloatArray, start: StartMode) -> FloatArray:
    """Seconds the dataset's first copy adds to a run of ``run_s`` seconds.

    ``after_sync``: the copy, then the run. ``while_syncing``: the run starts at once at
    :data:`READ_SLOWDOWN` (f) times the step time until the copy is done after ``sync_s``, so it
    ends at ``min(f x run, run + sync x (1 - 1/f))``; the delay is that minus the run.
    """
    sync = np.maximum(np.asarray(sync_s, dtype=np.float64), 0.0)
    if start == "after_sync":
        return sync
    run = np.maximum(np.asarray(run_s, dtype=np.float64), 0.0)
    f = READ_SLOWDOWN
    delay: FloatArray = np.minimum(run * (f - 1.0), sync * (1.0 - 1.0 / f))
    return delay


@dataclass(frozen=True, slots=True)
class DataPlacement:
    """Where the job's dataset is and how long its first copy takes to each region of the snapshot."""

    dataset: str
    size_gb: float
    change_gb_per_hour: float
    start: StartMode
    holders: frozenset[str]
    sync_s: FloatArray
    """Per ``snapshot.regions``: seconds of the first copy there (0 where a holder is)."""
    source: tuple[str, ...]
    """Per ``snapshot.regions``: the holder the copy comes from."""

    def copy_to(self, snap: Snapshot, region: str) -> tuple[float, str]:
        """Seconds of the first copy to ``region`` and the holder it comes from: the snapshot's
        region from ``sync_s``, any other from the holder that delivers it soonest."""
        i = snap.region_index.get(region)
        if i is not None:
            return float(self.sync_s[i]), self.source[i]
        return min((snap.net.transfer_s(h, region, self.size_gb), h) for h in self.holders)


def data_key(job: JobSpec) -> tuple[object, ...] | None:
    """Everything :func:`data_placement` reads of the job, hashable (None: no dataset)."""
    d = job.data
    if d is None:
        return None
    return (d.dataset, d.region, tuple(d.replicas), d.size_gb, d.change_gb_per_hour, d.start)


_PLACEMENT: StateKey[DataPlacement | None] = StateKey("data.placement")


def data_placement(state: CycleState) -> DataPlacement | None:
    """The job's :class:`DataPlacement`, computed once per cycle; None when the job reads no dataset."""
    try:
        return state.read(_PLACEMENT)
    except KeyError:
        pass
    placement = _place(state)
    state.write(_PLACEMENT, placement)
    return placement


def _place(state: CycleState) -> DataPlacement | None:
    data = state.job.data
    if data is None:
        return None
    snap = state.snapshot
    # A replica in a region Loom does not know is left out (no measured link to copy over).
    holders = [data.region, *(r for r in data.replicas if r != data.region and r in snap.region_index)]
    staged = snap.staged.get(state.job.job_id, {})
    sync_s = np.zeros(len(snap.regions))
    source: list[str] = []
    for i, region in enumerate(snap.regions):
        if region in holders:
            source.append(region)
            continue
        seconds, src = min((snap.net.transfer_s(h, region, data.size_gb), h) for h in holders)
        if region in staged:  # a copy begun while it queued (loom.sched.staging): what is left
            seconds = min(seconds, max(staged[region] - snap.now, 0.0))
        sync_s[i] = seconds
        source.append(src)
    return DataPlacement(
        dataset=data.dataset,
        size_gb=data.size_gb,
        change_gb_per_hour=data.change_gb_per_hour,
        start=data.start,
        holders=frozenset(holders),
        sync_s=sync_s,
        source=tuple(source),
    )


class DataLocality:
    """Score by the dataset's first-copy time to the candidate's region; plan the sync on permit.

    Score: raw = first-copy seconds; normalised ``100 x (R + d_min) / (R + d)`` with R the job's
    run time on the reference GPU (``steps x step_time_s``) and d the delay the copy adds
    (:func:`data_delay_s`), so a copy that adds 10 % to the job costs about 9 points, and a copy
    short next to the job costs next to nothing (a copy begun while the job queued,
    ``Snapshot.staged``, :mod:`loom.sched.staging`, counts what is left of it). Permit: a lead
    region without the data gets a :class:`~loom_proto.jobs.SyncPlan` from the best holder;
    ``after_sync`` jobs WAIT for the copy.
    SKIP for jobs that read no dataset.
    """

    name = "data_locality"

    def normalize_key(self, state: CycleState) -> tuple[()]:
        """Normalising reads the raw scores only (see :class:`~loom.sched.framework.ScorePlugin`)."""
        return ()

    def score_key(self, state: CycleState) -> tuple[object, ...]:
        """The job's dataset and run, and the copies staged for it (all that scoring and
        normalising read of the job)."""
        work = state.job.work
        staged = state.snapshot.staged.get(state.job.job_id, {})
        return (data_key(state.job), work.steps, work.step_time_s, tuple(sorted(staged.items())))

    def pre_filter(self, state: CycleState) -> Status:
        data = state.job.data
        if data is None:
            return Status(Code.SKIP)
        snap = state.snapshot
        if data.region not in snap.region_index:
            # A copy from a region nobody measured would be priced with made-up links (a typo,
            # "mars-1", got "waits 800 s for the copy"). A replica elsewhere is only one more place
            # to copy from: one Loom does not know is left out, as affinity leaves out unknown names.
            return Status(
                Code.UNRESOLVABLE,
                f"dataset {data.dataset} is said to be in region {data.region}, which Loom does not know;"
                f" known regions: {', '.join(snap.regions) or 'none'}",
            )
        return SUCCESS

    def score(self, state: CycleState, candidates: Candidates) -> FloatArray:
        placement = data_placement(state)
        if placement is None:
            return np.zeros(len(candidates))
        sync: FloatArray = placement.sync_s[state.snapshot.cluster_region[candidates.cluster]]
        return sync

    def normalize(self, state: CycleState, raw: FloatArray) -> FloatArray:
        placement = data_placement(state)
        if placement is None or raw.size == 0:
            return np.full(raw.shape, 100.0)
        run_s = state.job.work.steps * state.job.work.step_time_s
        delay = data_delay_s(run_s, raw, placement.start)
        best = float(delay.min())
        scores: FloatArray = np.clip((run_s + best) / np.maximum(run_s + delay, 1e-12) * 100.0, 0.0, 100.0)
        return scores

    def permit(self, state: CycleState, decision: Decision) -> Status:
        placement = data_placement(state)
        if placement is None or not decision.parts:
            return SUCCESS
        lead = decision.lead.region
        if lead in placement.holders:
            return SUCCESS
        seconds, src = placement.copy_to(state.snapshot, lead)
        decision.sync = SyncPlan(
            dataset=placement.dataset,
            src=src,
            dst=lead,
            initial_gb=placement.size_gb,
            initial_s=seconds,
            incremental_gb_per_hour=placement.change_gb_per_hour,
            start=placement.start,
        )
        if placement.start == "after_sync" and seconds > 0:
            return Status(
                Code.WAIT,
                f"dataset {placement.dataset} ({placement.size_gb:g} GB) is first copied {src} -> {lead}",
                wait_s=seconds,
            )
        return SUCCESS
