"""Elastic shrink (post-filter): under pressure, elastic jobs give back workers before anyone is stopped.

When nothing fits, look for a (cluster, GPU model) where running elastic jobs of lower or equal
priority, shrunk toward their ``min_workers`` (lowest priority first, whole workers), free enough
room; give those workers back in the snapshot and place the job there. The decision lists the
shrunk jobs (:attr:`~loom.sched.framework.Decision.shrunk`) so the service resizes them in the
same transaction. Runs before preemption in the default profile: shrinking loses no work.
"""

from loom.sched.elastic import ElasticJob, plan_shrink, with_sizes
from loom.sched.framework import CycleState, Decision, Framework
from loom.sched.probe import is_probe
from loom.sched.snapshot import RunningJob


class ElasticShrink:
    """Shrink elastic jobs to make room for a waiting one."""

    name = "elastic_shrink"

    def post_filter(self, state: CycleState, framework: Framework) -> Decision | None:
        snap = state.snapshot
        job = state.job
        if job.pipeline is not None or is_probe(job.labels):
            return None  # a speed probe runs only in room that is free: it shrinks no one
        elastic = [
            r
            for r in snap.running
            if r.min_workers is not None and r.workers > r.min_workers and r.priority <= job.priority
        ]
        if not elastic:
            return None
        allowed = state.policy_mask if state.policy_mask is not None else state.cluster_mask
        need = state.per_worker * state.min_workers
        by_group: dict[tuple[int, int], list[RunningJob]] = {}
        for r in elastic:
            c, m = snap.cluster_index.get(r.cluster), snap.model_index.get(r.gpu_model)
            if c is None or m is None or not allowed[c] or not state.model_mask[m]:
                continue
            by_group.setdefault((c, m), []).append(r)
        for (c, m), jobs in sorted(by_group.items()):
            spare = sum((r.workers - (r.min_workers or r.workers)) * r.gpus_per_worker for r in jobs)
            short = need - int(snap.free_sum[c, m])
            if short <= 0 or spare < short:
                continue
            cluster = snap.clusters[c].id
            plans = plan_shrink(
                [
                    ElasticJob(
                        job_id=r.job_id,
                        priority=r.priority,
                        gpus_per_worker=r.gpus_per_worker,
                        min_workers=r.min_workers or r.workers,
                        max_workers=r.max_workers,
                        workers=r.workers,
                        cluster=cluster,
                        allocations=r.allocations,
                    )
                    for r in jobs
                ],
                {cluster: short},
                job.priority,
            )
            if not plans:
                continue
            by_id = {r.job_id: r for r in jobs}
            freed = [(p, [(n, -g) for n, g in p.delta_allocations if g < 0]) for p in plans]
            for p, back in freed:
                r = by_id[p.job_id]
                snap.give_back(back, r.gpus_per_worker, r.cpu_milli, r.memory_mib)
            saved_clusters, saved_models = state.cluster_mask.copy(), state.model_mask.copy()
            state.cluster_mask[:] = False
            state.cluster_mask[c] = True
            state.model_mask[:] = False
            state.model_mask[m] = True
            candidates = framework.find_candidates(state)
            state.cluster_mask, state.model_mask = saved_clusters, saved_models
            if len(candidates) == 0:
                # Packing did not work out (GPUs freed on the wrong nodes): undo, try elsewhere.
                for p, back in freed:
                    r = by_id[p.job_id]
                    snap.take(back, r.gpus_per_worker, r.cpu_milli, r.memory_mib)
                continue
            totals = framework.score(state, candidates)
            decision = framework.choose(state, candidates, totals)
            decision.shrunk = tuple((p.job_id, p.workers, p.allocations) for p in plans)
            before = snap.running
            returned = [(by_id[p.job_id], back) for p, back in freed]

            def undo(
                returned: list[tuple[RunningJob, list[tuple[str, int]]]] = returned,
                before: list[RunningJob] = before,
            ) -> None:
                # The decision was refused after all: the elastic jobs keep their workers.
                for r, back in returned:
                    snap.take(back, r.gpus_per_worker, r.cpu_milli, r.memory_mib)
                snap.running = before

            decision.undo = undo
            # Fewer workers: what is left of each takes longer (its predicted end rescaled).
            snap.running = with_sizes(
                snap.running, {p.job_id: (p.workers, p.allocations) for p in plans}, snap.now
            )
            return decision
        return None


__all__ = ["ElasticShrink"]
