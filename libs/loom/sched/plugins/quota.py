"""Tenant quotas (pre-filter, reserve) and priority preemption (post-filter).

Quota: a job whose tenant cannot take its GPUs now waits (UNSCHEDULABLE); one that could never fit
the tenant's quota, or whose tenant is unknown to a closed configuration, is rejected
(UNRESOLVABLE, typed ``quota`` or ``unknown_tenant``). The book is the snapshot's
(``Snapshot.quota``: what each tenant holds now, kept with the snapshot like its free GPUs); reserve
checks a decision against it, and applying the decision takes its GPUs from it
(:meth:`~loom.sched.framework.Framework.finish`). A snapshot without a book is an open platform
(this plugin's own open book).

Preemption: when nothing fits, look on every cluster allowed by policy for the cheapest set of
lower-priority, preemptible jobs whose GPUs make room (whole gangs; victims by lowest priority, then
least progress), give their GPUs back in the snapshot, and place the job there.
"""

import itertools
import weakref
from dataclasses import dataclass

import numpy as np

from loom.sched import preemption
from loom.sched.framework import SUCCESS, Code, CycleState, Decision, Framework, Status
from loom.sched.probe import is_probe
from loom.sched.quota import QuotaBook, QuotaVerdict, TenantConfig
from loom.sched.snapshot import BoolArray, FloatArray, IntArray, RunningJob, Snapshot


class Quota:
    """Tenant quotas with borrowing inside a cohort."""

    name = "quota"

    def __init__(self) -> None:
        self.open = QuotaBook(TenantConfig(tenants={}, open=True), {})
        """The book of a snapshot without one: an open platform."""

    def _book(self, state: CycleState) -> QuotaBook:
        """The snapshot's book (what the platform's tenants hold now), else an open one."""
        return state.snapshot.quota if state.snapshot.quota is not None else self.open

    def pre_filter(self, state: CycleState) -> Status:
        job = state.job
        g = state.per_worker
        book = self._book(state)
        verdict = book.check(job.tenant, g * state.min_workers)
        if not verdict.ok:
            return _refusal(verdict)
        if job.workers > state.min_workers:
            # Elastic: as many workers as the quota allows now (at least the minimum, checked above).
            lo, hi = state.min_workers, job.workers
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if book.check(job.tenant, g * mid).ok:
                    lo = mid
                else:
                    hi = mid - 1
            state.max_workers = lo if state.max_workers is None else min(state.max_workers, lo)
        return SUCCESS

    def reserve(self, state: CycleState, decision: Decision) -> Status:
        """Checks the decision's GPUs against the tenant's quota; applying the decision to the
        snapshot (:meth:`Framework.finish`) is what takes them from the snapshot's book."""
        gpus = sum(g for _, g in decision.allocations)
        verdict = self._book(state).check(state.job.tenant, gpus)
        if not verdict.ok:
            return _refusal(verdict)
        return SUCCESS

    def unreserve(self, state: CycleState, decision: Decision) -> None:
        """Nothing was taken by :meth:`reserve`."""


def _refusal(verdict: QuotaVerdict) -> Status:
    """A quota verdict that says no, as a status: rejected (typed) when waiting cannot help."""
    if not verdict.never:
        return Status(Code.UNSCHEDULABLE, verdict.reason)
    return Status(
        Code.UNRESOLVABLE, verdict.reason, reject="unknown_tenant" if verdict.unknown_tenant else "quota"
    )


@dataclass(frozen=True)
class _RunningTable:
    """The running jobs as arrays (cached per list of runs): what the preemption bound needs."""

    source: list[RunningJob]
    """The running list this table describes (compared by identity and length: the list is
    replaced when jobs leave, appended to when they arrive)."""
    length: int
    priority: IntArray
    preemptible: BoolArray
    pair: IntArray
    """cluster index x models + model index of the job's lead part (-1 when unknown)."""
    gpus: FloatArray
    """GPUs the job holds on its lead cluster."""
    lead_allocations: list[tuple[tuple[str, int], ...]]
    rows: dict[int, tuple[RunningJob, int, float, tuple[tuple[str, int], ...]]]
    """Per running job (by identity): reused when the list changes, so a rebuild costs little."""

    def subset(self, keep: BoolArray, running: list[RunningJob]) -> "_RunningTable":
        """The table of ``running``, the rows of this one where ``keep`` is set (no rebuild)."""
        return _RunningTable(
            source=running,
            length=len(running),
            priority=self.priority[keep],
            preemptible=self.preemptible[keep],
            pair=self.pair[keep],
            gpus=self.gpus[keep],
            lead_allocations=list(itertools.compress(self.lead_allocations, keep.tolist())),
            rows=self.rows,
        )


_TABLES: "weakref.WeakKeyDictionary[Snapshot, _RunningTable]" = weakref.WeakKeyDictionary()


def _running_table(snap: Snapshot) -> _RunningTable:
    cached = _TABLES.get(snap)
    if cached is not None and cached.source is snap.running and cached.length == len(snap.running):
        return cached
    m_count = snap.total_sum.shape[1]
    rows = cached.rows if cached is not None else {}
    fresh: dict[int, tuple[RunningJob, int, float, tuple[tuple[str, int], ...]]] = {}
    for r in snap.running:
        row = rows.get(id(r))
        if row is None or row[0] is not r:
            c = snap.cluster_index.get(r.cluster)
            m = snap.model_index.get(r.gpu_model)
            lead = tuple(
                (n, g)
                for n, g in r.allocations
                if c is not None and n in snap.node_index and int(snap.cluster_of[snap.node_index[n]]) == c
            )
            pair = c * m_count + m if c is not None and m is not None else -1
            row = (r, pair, float(sum(g for _, g in lead)), lead)
        fresh[id(r)] = row
    ordered = [fresh[id(r)] for r in snap.running]
    table = _RunningTable(
        source=snap.running,
        length=len(snap.running),
        priority=np.array([r.priority for r in snap.running], dtype=np.int64),
        preemptible=np.array([r.preemptible for r in snap.running], dtype=np.bool_),
        pair=np.array([row[1] for row in ordered], dtype=np.int64),
        gpus=np.array([row[2] for row in ordered], dtype=np.float64),
        lead_allocations=[row[3] for row in ordered],
        rows=fresh,
    )
    valid = table.pair >= 0
    table.preemptible[~valid] = False
    table.pair[~valid] = 0
    _TABLES[snap] = table
    return table


PREEMPTION_GROUPS = 8
"""(cluster, model) groups a preemption search examines at most: those with the most free room."""


class Preempt:
    """Priority preemption: stop the least valuable lower-priority jobs when nothing else fits."""

    name = "preemption"

    # PLR0915: victim choice and the plan it implies, in one pass.
    def post_filter(self, state: CycleState, framework: Framework) -> Decision | None:  # noqa: PLR0915
        snap = state.snapshot
        job = state.job
        if not snap.running or job.pipeline is not None or is_probe(job.labels):
            return None  # a speed probe runs only in room that is free: it stops no one
        allowed = state.policy_mask if state.policy_mask is not None else state.cluster_mask
        models = state.model_mask[: snap.total_sum.shape[1]]
        m_count = snap.total_sum.shape[1]
        table = _running_table(snap)
        lower = table.preemptible & (table.priority < job.priority)
        if not lower.any():
            return None
        # A bound first, per (cluster, model): free GPUs plus every lower-priority job's GPUs there.
        freeable = np.bincount(
            table.pair[lower], weights=table.gpus[lower], minlength=len(snap.clusters) * m_count
        ).reshape(len(snap.clusters), m_count)
        need = state.per_worker * state.min_workers
        hopeful = (snap.free_sum + freeable >= need) & allowed[:, None] & models[None, :]
        if not hopeful.any():
            return None
        # Look closely at the most promising groups only (most room already free, so fewest
        # victims): the search is then bounded however large the platform is.
        pairs = np.argwhere(hopeful)
        if len(pairs) > PREEMPTION_GROUPS:
            room = snap.free_sum[pairs[:, 0], pairs[:, 1]]
            pairs = pairs[np.lexsort((pairs[:, 1], pairs[:, 0], -room))[:PREEMPTION_GROUPS]]
            hopeful = np.zeros_like(hopeful)
            hopeful[pairs[:, 0], pairs[:, 1]] = True
        groups: dict[tuple[str, str], dict[str, int]] = {}
        for c, m in pairs.tolist():
            idx, _ = snap.node_slice(c, m)
            usable = idx[snap.schedulable[idx]]
            groups[(snap.clusters[c].id, snap.models[m])] = dict(
                zip((snap.node_ids[i] for i in usable.tolist()), snap.free[usable].tolist(), strict=True)
            )
        chosen = np.flatnonzero(lower & hopeful.ravel()[table.pair])
        running = []
        for i in chosen.tolist():
            r = snap.running[i]
            running.append(
                preemption.RunningJob(
                    job_id=r.job_id,
                    tenant=r.tenant,
                    priority=r.priority,
                    progress=r.progress,
                    preemptible=r.preemptible,
                    cluster=r.cluster,
                    gpu_model=r.gpu_model,
                    # Only the part on its lead cluster frees room there (a gang's other parts do not).
                    allocations=table.lead_allocations[i],
                )
            )
        if not running:
            return None
        best = preemption.choose(
            priority=job.priority,
            gpus_per_worker=state.per_worker,
            workers=state.min_workers,
            free_by_group=groups,
            running=running,
        )
        if best is None or not best.victims:
            return None
        victims = {v.job_id for v in best.victims}
        positions = [i for i in chosen.tolist() if snap.running[i].job_id in victims]
        stopped = [snap.running[i] for i in positions]
        for r in stopped:
            snap.give_back(r.allocations, r.gpus_per_worker, r.cpu_milli, r.memory_mib)
        target = snap.cluster_index[best.cluster]
        mask = np.zeros_like(state.cluster_mask)
        mask[target] = True
        saved = state.cluster_mask
        state.cluster_mask = mask
        model_saved = state.model_mask.copy()
        state.model_mask[:] = False
        state.model_mask[snap.model_index[best.gpu_model]] = True
        candidates = framework.find_candidates(state)
        state.cluster_mask, state.model_mask = saved, model_saved
        if len(candidates) == 0:
            for r in stopped:
                snap.take(r.allocations, r.gpus_per_worker, r.cpu_milli, r.memory_mib)
            return None
        totals = framework.score(state, candidates)
        decision = framework.choose(state, candidates, totals)
        decision.victims = tuple(sorted(victims))
        before = snap.running
        keep = np.ones(len(before), dtype=np.bool_)
        keep[positions] = False
        snap.running = list(itertools.compress(before, keep.tolist()))
        _TABLES[snap] = table.subset(keep, snap.running)

        def undo() -> None:
            # The decision was refused after all (quota, permit): the victims keep running.
            for r in stopped:
                snap.take(r.allocations, r.gpus_per_worker, r.cpu_milli, r.memory_mib)
            snap.running = before
            _TABLES[snap] = table

        decision.undo = undo
        return decision
