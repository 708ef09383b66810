"""Comparative advantage: while jobs wait, a GPU model goes to the jobs it speeds up most.

A job that is only a little faster on a scarce fast model than on a slower one (YOLOv3 on an A100
against a T4, by Sia's measurements) takes those GPUs from the waiting jobs that are many times
faster there (ResNet-18, BERT); every job choosing its own fastest GPU leaves the platform slower
in all. Gavel (Narayanan et al., OSDI 2020) allocates by throughput *normalised* per job for this
reason; :class:`ComparativeAdvantage` is the same idea as one score among the framework's.

For the job and each GPU model, its *relative speed* is its per-GPU speed there (what it believes,
learned speeds included, as a choice weighs it: :meth:`~loom.sched.snapshot.Snapshot.job_speeds`,
with a big job's handicap on untried models) over its speed on its
fastest model. The *going rate* of a model is the relative speed there of the jobs that hold GPUs
or wait for them (:func:`going_rate`), weighted by their GPUs. The raw score is the job's relative
speed over the going rate: 1 everywhere for a job like the others, above 1 on the models the job
loses less on than they do, capped at :data:`ADVANTAGE_CAP`; normalised to the best candidate. A
model no other active job may use has a going rate of 1, so there the job's own relative speed
decides.

It has a say only while other jobs wait (``Snapshot.waiting``: with GPUs to spare for everyone,
every job takes what is fastest for it), and only on ratios measured for the job's family on every
candidate's model by runs of its own that are not known to disagree (``Snapshot.measured``, from
:meth:`~loom.model.learn.SpeedLearner.steady_cells`; a family with one run per model counts). A
profile's ratio, or the average ratio of a "family" whose jobs differ, is no ground to send one job
to slower GPUs (both cost mean JCT in ``docs/measurements.md``, 2026-12-04, "comparative
advantage").
"""

from collections.abc import Hashable
from typing import Any

import numpy as np

from loom.model.family import job_family
from loom.sched.framework import Candidates, CycleState
from loom.sched.snapshot import BoolArray, FloatArray, Snapshot

ADVANTAGE_CAP = 4.0
"""A raw score above this (a job that loses far less on a model than the queue) counts as this:
beyond it, more contrast would only let this one plugin outvote a job's own predicted run."""


def _relative(speeds: FloatArray, allowed: BoolArray) -> FloatArray | None:
    """Speeds over the fastest of the ``allowed`` models, 0 where not allowed; None: no speed."""
    top = float(speeds[allowed].max(initial=0.0))
    return np.where(allowed, speeds / top, 0.0) if top > 0 else None


def going_rate(
    snap: Snapshot, exclude: str = "", shared: dict[Hashable, Any] | None = None
) -> tuple[FloatArray, FloatArray]:
    """Per GPU model (indexed like ``snap.models``): the active jobs' relative speed there,
    weighted by their GPUs, and those GPUs (0: no active job may use the model; the rate is then 1).

    The active jobs: those holding GPUs (``snap.running``, every model counted as theirs to use)
    and those waiting for them (:attr:`Snapshot.queued` of the jobs in :attr:`Snapshot.waiting`
    whose run is known, over the models their rules allow), other than ``exclude``. Within a cycle
    (``shared``) the running jobs' sums are kept and grow with the runs appended to the list (a list
    that loses a run is replaced, never changed in place, by every writer of ``snap.running``), and
    the waiting jobs' are kept while the queue is unchanged.
    """
    running = _running_sums(snap, shared)
    waiting = _waiting_sums(snap, shared)
    weighted, demand = running.weighted + waiting.weighted, running.demand + waiting.demand
    for part in (running.parts.get(exclude), waiting.parts.get(exclude)):
        if part is not None:
            weighted, demand = weighted - part[0], demand - part[1]
    rate: FloatArray = np.where(demand > 1e-9, weighted / np.maximum(demand, 1e-12), 1.0)
    return rate, np.where(demand > 1e-9, demand, 0.0)


class _Sums:
    """GPU-weighted relative speeds and GPUs per model, with each job's part (to leave one out)."""

    def __init__(self, models: int) -> None:
        self.weighted: FloatArray = np.zeros(models)
        self.demand: FloatArray = np.zeros(models)
        self.parts: dict[str, tuple[FloatArray, FloatArray]] = {}
        self.seen = 0

    def add(self, job_id: str, weighted: FloatArray, demand: FloatArray) -> None:
        self.weighted += weighted
        self.demand += demand
        self.parts[job_id] = (weighted, demand)


def _running_sums(snap: Snapshot, shared: dict[Hashable, Any] | None) -> _Sums:
    running = snap.running
    held = shared.get(_RUNNING) if shared is not None else None
    if held is not None and held[0] is running and held[1].seen <= len(running):
        sums: _Sums = held[1]
    else:
        sums = _Sums(len(snap.models))
    every = np.ones(len(snap.models), dtype=bool)
    for run in running[sums.seen :]:
        rel = _relative(snap.job_speeds(run), every)
        if rel is not None:
            gpus = float(max(run.gpus, 1))
            sums.add(run.job_id, gpus * rel, np.full(len(every), gpus))
    sums.seen = len(running)
    if shared is not None:
        shared[_RUNNING] = (running, sums)
    return sums


def _waiting_sums(snap: Snapshot, shared: dict[Hashable, Any] | None) -> _Sums:
    waiting = snap.waiting
    key = (len(waiting), snap.queued.version)
    held = shared.get(_WAITING) if shared is not None else None
    if held is not None and held[0] is waiting and held[1] == key:
        found: _Sums = held[2]
        return found
    models = len(snap.models)
    sums = _Sums(models)
    for job_id in sorted(waiting):
        shape = snap.queued.get(job_id)
        if shape is None or shape.job is None:
            continue
        allowed: BoolArray = (
            np.asarray(shape.pools.any(axis=0), dtype=bool)
            if shape.pools.ndim == 2
            else np.ones(models, dtype=bool)
        )
        rel = _relative(snap.job_speeds(shape.job), allowed)
        if rel is not None:
            gpus = float(max(shape.workers * shape.per_worker, 1))
            sums.add(job_id, gpus * rel, np.where(allowed, gpus, 0.0))
    if shared is not None:
        shared[_WAITING] = (waiting, key, sums)
    return sums


_RUNNING = "comparative_advantage.running"
_WAITING = "comparative_advantage.waiting"


def _measured(state: CycleState, candidates: Candidates) -> bool:
    """Whether runs of the job's family measured its speed on every candidate's GPU model, runs not
    known to disagree (``Snapshot.measured``)."""
    snap = state.snapshot
    if not snap.measured:
        return False
    family = job_family(state.job)
    return all((family, snap.models[m]) in snap.measured for m in np.unique(candidates.model))


class ComparativeAdvantage:
    """While jobs wait, the GPU models where the job loses least against the active jobs."""

    name = "comparative_advantage"

    def score_key(self, state: CycleState) -> Hashable | None:
        """Not keyed: the raw scores read the queue, which changes within a cycle."""
        return None

    def score(self, state: CycleState, candidates: Candidates) -> FloatArray:
        snap = state.snapshot
        if snap.waiting_count(exclude=state.job.job_id) == 0 or not _measured(state, candidates):
            return np.ones(len(candidates))  # the common case, at once: nobody waits
        speeds = snap.job_speeds(state.job)
        # Relative to the job's fastest model its rules allow, whether or not it has room now.
        top = float(speeds[state.model_mask].max(initial=0.0)) if state.model_mask.any() else 0.0
        if top <= 0:
            return np.ones(len(candidates))
        rate, _ = going_rate(snap, exclude=state.job.job_id, shared=state.shared)
        relative = speeds[candidates.model] / top
        # A model no other active job may use has a going rate of 1: the job's own relative
        # speed decides there (nobody loses by its taking it, and nor should the job).
        raw: FloatArray = np.minimum(relative / np.maximum(rate[candidates.model], 1e-12), ADVANTAGE_CAP)
        return raw

    def normalize(self, state: CycleState, raw: FloatArray) -> FloatArray:
        top = float(raw.max(initial=0.0))
        if top <= 0:
            return np.full(raw.shape, 100.0)
        scores: FloatArray = raw / top * 100.0
        return scores


__all__ = ["ADVANTAGE_CAP", "ComparativeAdvantage", "going_rate"]
