"""Affinity: where a job must, must not, and would rather run.

Pre-filter (hard rules) narrows ``state.cluster_mask``, recording each cluster's reason:

* ``affinity.clusters`` / ``affinity.regions``: only these (both given: both must hold);
* ``affinity.avoid_clusters`` / ``avoid_regions``: never these;
* ``affinity.apart_from_jobs``: never a cluster running a job that carries all those labels.

Job selectors (``apart_from_jobs``, ``near_jobs``) match the job's own tenant's running jobs only
(:func:`~loom.sched.plugins.network.jobs_labelled`).

A required id the snapshot does not know is ignored while the job names at least one that exists;
when it names none, the job is UNRESOLVABLE (a typo waits forever otherwise). A known region with
no cluster yet, or rules that leave nothing only because of running jobs, are UNSCHEDULABLE (that
can change); rules that contradict each other are UNRESOLVABLE.

Score (soft): ``prefer_regions`` (100 inside, 0 outside) and ``near_jobs`` co-location (100 in a
cluster running a matching job, else 80 x q(rtt to the nearest one), q(rtt) = 50 / (50 + rtt_ms):
78 in the same region, about 28 an ocean away); the mean of those that apply. A job with neither
(or with near_jobs that match nothing running) is SKIPped after its hard rules are applied, so the
score does not dilute the others.
"""

import numpy as np

from loom.sched.framework import SUCCESS, Candidates, Code, CycleState, Status
from loom.sched.plugins.network import jobs_labelled, latency_quality, near_jobs
from loom.sched.snapshot import BoolArray, FloatArray

__all__ = ["NEAR_OTHER_CLUSTER", "Affinity"]

NEAR_OTHER_CLUSTER = 80.0
"""The most a cluster without a matching job can score for ``near_jobs`` (at zero latency)."""


def _listed(ids: list[str]) -> str:
    return ", ".join(ids)


class Affinity:
    """Hard placement rules as a pre-filter; preferred regions and neighbouring jobs as a score."""

    name = "affinity"

    def pre_filter(self, state: CycleState) -> Status:
        aff = state.job.affinity
        snap = state.snapshot
        if not (
            aff.clusters
            or aff.regions
            or aff.avoid_clusters
            or aff.avoid_regions
            or aff.prefer_regions
            or aff.near_jobs
            or aff.apart_from_jobs
        ):
            return Status(Code.SKIP)
        ids = [c.id for c in snap.clusters]
        regions = [c.region for c in snap.clusters]
        known_clusters = [c for c in aff.clusters if c in snap.cluster_index]
        known_regions = [r for r in aff.regions if r in snap.region_index]
        if aff.clusters and not known_clusters:
            return Status(
                Code.UNRESOLVABLE,
                f"none of the required clusters ({_listed(aff.clusters)}) is known;"
                f" known clusters: {_listed(ids) or 'none'}",
            )
        if aff.regions and not known_regions:
            return Status(
                Code.UNRESOLVABLE,
                f"none of the required regions ({_listed(aff.regions)}) is known;"
                f" known regions: {_listed(snap.regions) or 'none'}",
            )
        allowed = np.ones(len(ids), dtype=np.bool_)
        if aff.clusters:
            wanted = np.array([c in aff.clusters for c in ids], dtype=np.bool_)
            state.prune(
                ~wanted, lambda _c: f"not one of the clusters the job requires ({_listed(known_clusters)})"
            )
            allowed &= wanted
        if aff.regions:
            wanted = np.array([r in aff.regions for r in regions], dtype=np.bool_)
            state.prune(
                ~wanted,
                lambda c: f"in region {regions[c]}, not one the job requires ({_listed(known_regions)})",
            )
            if not aff.clusters and not wanted.any():
                return Status(
                    Code.UNSCHEDULABLE,
                    f"no cluster has joined in the required region(s) {_listed(known_regions)} yet",
                )
            allowed &= wanted
            if not allowed.any():
                return Status(
                    Code.UNRESOLVABLE,
                    f"none of the required clusters ({_listed(known_clusters)}) is in a required region"
                    f" ({_listed(known_regions)})",
                )
        avoided = np.array(
            [c in aff.avoid_clusters or r in aff.avoid_regions for c, r in zip(ids, regions, strict=True)],
            dtype=np.bool_,
        )
        state.prune(
            avoided,
            lambda c: (
                "the job avoids this cluster"
                if ids[c] in aff.avoid_clusters
                else f"the job avoids region {regions[c]}"
            ),
        )
        allowed &= ~avoided
        if not allowed.any():
            required = [snap.cluster_index[c] for c in known_clusters]
            required_avoided = bool(required) and bool(avoided[required].all())
            regions_avoided = bool(known_regions) and all(r in aff.avoid_regions for r in known_regions)
            if required_avoided or regions_avoided:
                return Status(Code.UNRESOLVABLE, "the job avoids every cluster or region it requires")
            return Status(
                Code.UNSCHEDULABLE,
                "the job's avoid rules exclude every cluster that has joined; waiting for more",
            )
        status = self._apart(state, allowed)
        if not status.ok:
            return status
        if not (
            aff.prefer_regions
            or jobs_labelled(snap, aff.near_jobs, tenant=state.job.tenant, exclude_job=state.job.job_id)
        ):
            # The hard rules are applied; with nothing to prefer, the score would only dilute the others.
            return Status(Code.SKIP)
        return SUCCESS

    def _apart(self, state: CycleState, allowed: BoolArray) -> Status:
        aff = state.job.affinity
        snap = state.snapshot
        apart = jobs_labelled(
            snap, aff.apart_from_jobs, tenant=state.job.tenant, exclude_job=state.job.job_id
        )
        if not apart:
            return SUCCESS
        by_cluster: dict[int, list[str]] = {}
        for job in apart:
            by_cluster.setdefault(snap.cluster_index[job.cluster], []).append(job.job_id)
        taken = np.zeros(len(snap.clusters), dtype=np.bool_)
        taken[list(by_cluster)] = True
        labels = ", ".join(f"{k}={v}" for k, v in sorted(aff.apart_from_jobs.items()))
        held_off = taken & state.cluster_mask  # for as long as those jobs run, not for ever
        state.held_off = held_off if state.held_off is None else state.held_off | held_off
        state.prune(
            taken,
            lambda c: (
                f"runs {_listed(sorted(by_cluster[c]))} labelled {labels} (the job keeps apart from those)"
            ),
        )
        if not (allowed & ~taken).any():
            return Status(
                Code.UNSCHEDULABLE,
                f"every cluster the job may run on runs a job labelled {labels} (apart_from_jobs);"
                " waiting for one to finish",
            )
        return SUCCESS

    def score(self, state: CycleState, candidates: Candidates) -> FloatArray:
        aff = state.job.affinity
        snap = state.snapshot
        parts: list[FloatArray] = []
        if aff.prefer_regions:
            preferred = np.array([r in aff.prefer_regions for r in snap.regions], dtype=np.bool_)
            parts.append(np.where(preferred[snap.cluster_region[candidates.cluster]], 100.0, 0.0))
        near = near_jobs(state, candidates.cluster)
        if near is not None:
            parts.append(
                np.where(near.same_cluster, 100.0, NEAR_OTHER_CLUSTER * latency_quality(near.rtt_ms))
            )
        if not parts:
            return np.full(len(candidates), 100.0)
        mean: FloatArray = np.mean(parts, axis=0)
        return mean

    def normalize(self, state: CycleState, raw: FloatArray) -> FloatArray:
        return np.clip(raw, 0.0, 100.0)
