"""The placement service and the simulator decide alike: fed the same events, the same decisions.

The simulator (:func:`loom.sim.engine.simulate`, timed by belief) plays a random trace on the
small packaged platform. The same events (each arrival, and each completion at the time the
simulator ended the run) are then fed to a :class:`PlacementService` the way its handlers feed it:
a completion drops the run from the book (``on_lifecycle``), a cycle runs over the new jobs and
every queued job after capacity changed, with growth once nothing waits (``_requeue_cycle``), and
the result is adopted by the service's own ``_commit`` (a preempted run queued again as its next
attempt, as ``_give_up`` does); a job a permit holds back (waiting for faster GPUs) is decided
again when its patience ends, as the service retries it when its backoff does and the simulator at
its wake. The simulator's clock-driven retries (``retry_every_s``, placement's backoff for jobs
post-filters could make room for) are switched off, as its samples are: the replay feeds no such
ticks. Only the store and the bus are left out
(the service's ``_decide`` is the in-memory half of its ``_schedule``; what ``_shrink`` and
``_grow`` write is mirrored in memory). Every job must start at the same time, on the same
clusters and GPU model, and end with the same GPUs; rejections must match.
"""

import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loom.model.family import family_of
from loom.model.topology import load_topology
from loom.sched import dag
from loom.sched.profile import build_framework
from loom.sim.engine import platform_from_topology, simulate
from loom.sim.model import ProgressReport, SimJob, Trace
from loom.sim.policies import FrameworkPolicy
from loom.sim.truth import BELIEF
from loom_proto.jobs import (
    Affinity,
    Communication,
    JobSpec,
    JobSubmitted,
    Layer,
    Pipeline,
    Resources,
    Stage,
    Work,
)
from loom_services.placement.book import QueuedJob
from loom_services.placement.service import PlacementService

TOPOLOGY = load_topology("small")
PLATFORM = platform_from_topology(TOPOLOGY)
TASKS = ("training", "inference", "fine_tuning")


REAL_TASKS = ("training_compute", "training_memory", "training_comm", "inference")
"""Task types the profiles weigh apart: GPU models differ in speed by task type, so decisions weigh
a faster GPU (waits for one, comparative advantage)."""


@st.composite
def traces(draw: Any, tasks: tuple[str, ...] = TASKS, *, spanning: bool = False) -> list[SimJob]:
    """Random traces; ``spanning``: larger gangs, half of them allowed to span clusters (the span
    guard's verdicts, spreads and the waits it tells a gang to take)."""
    count = draw(st.integers(min_value=4, max_value=28))
    jobs = []
    t = 0.0
    for i in range(count):
        # Jobs arrive together too (0.0): several in one service cycle, each placed earlier in it
        # listed running at once for the later ones (``_decide``'s ``placed``), as in the simulator.
        t += draw(st.sampled_from([0.0, 0.0, 0.5, 1.0, 30.0, 120.0, 600.0]))
        gpus = draw(st.sampled_from([1, 1, 2, 4, 8]))
        workers = draw(st.sampled_from([1, 1, 2, 3, 4, 6, 8] if spanning else [1, 1, 2, 3, 4]))
        elastic = workers > 1 and draw(st.booleans())
        spans = spanning and workers > 1 and draw(st.booleans())
        spec = JobSpec(
            job_id=f"j{i:03d}",
            tenant=draw(st.sampled_from(["a", "b", "c"])),
            priority=draw(st.sampled_from([100, 100, 100, 200])),
            task_type=draw(st.sampled_from(tasks)),
            resources=Resources(gpus=gpus),
            workers=workers,
            min_workers=1 if elastic else None,
            allow_multi_cluster=spans,
            work=Work(steps=draw(st.integers(min_value=10, max_value=400)), step_time_s=10.0),
        )
        jobs.append(SimJob(spec=spec, arrival_s=t))
    return jobs


def service() -> PlacementService:
    ctx = SimpleNamespace(db=None, publisher=None, stats={}, nc=None, debug={})
    # Timed by belief, the simulator has no speed learner and so runs no speed probes
    # (loom.sched.probe); the service runs none either (both sides' probes: test_probe.py).
    svc = PlacementService(ctx, topology=TOPOLOGY, economics=PLATFORM.economics, probe=None)  # type: ignore[arg-type]
    svc.book.nodes = {n.node: n for n in PLATFORM.nodes}
    svc.book.invalidate()
    svc.settled_at = float("-inf")
    # A service starts with one look at its loaded queue; the replay loads none (the simulator
    # starts with no such pass either), so that look would only re-decide the first instant's jobs.
    svc.capacity_changed = False
    return svc


def replay(
    svc: PlacementService,
    jobs: list[SimJob],
    ends: dict[str, float],
    reports: Sequence[ProgressReport] = (),
) -> dict[str, tuple[Any, ...]]:
    """Feed arrivals, completions and the runs' progress reports to the service in time order;
    what each job got."""
    got: dict[str, tuple[Any, ...]] = {}
    arrivals: dict[float, list[SimJob]] = {}
    for job in jobs:
        arrivals.setdefault(job.arrival_s, []).append(job)
    reported: dict[float, list[ProgressReport]] = {}
    for report in reports:
        reported.setdefault(report.t, []).append(report)
    times = sorted(set(arrivals) | set(ends.values()) | set(reported))
    # A permit's patience (Waiting.wake_in_s): the service retries the job when its backoff ends
    # (retry_in_s is at most the patience) even if nothing changed; the simulator decides it again
    # then (its wake event). The earliest wake of each job counts, as the simulator keeps it.
    wakes: dict[str, float] = {}
    while times:
        t = times.pop(0)
        woken = sorted(job_id for job_id, at in wakes.items() if at == t)
        for job_id in woken:
            del wakes[job_id]
        finished = [job_id for job_id, end in ends.items() if end == t and job_id in svc.book.runs]
        for job_id in sorted(finished):
            run = svc.book.drop_run(job_id)
            assert run is not None
            got[job_id] = (*got[job_id][:3], run.gpus)
        apply_reports(svc, reported.get(t, []))
        fresh = [
            QueuedJob(
                JobSubmitted(**{f: getattr(j.spec, f) for f in JobSpec.__struct_fields__}, submitted_at=t), {}
            )
            for j in arrivals.get(t, [])
        ]
        changed = bool(finished)
        fresh += [svc.queue[job_id] for job_id in woken if job_id in svc.queue]
        while True:
            considered = fresh + (list(svc.queue.values()) if changed else [])
            fresh = []
            applied = svc._decide(considered, now=t, grow=changed)
            result = applied.cycle
            for w in result.waiting:
                at = t + w.wake_in_s if w.wake_in_s is not None else None
                job_id = w.pending.job.job_id
                if at is not None and at > t and at < wakes.get(job_id, float("inf")):
                    wakes[job_id] = at
                    times = sorted({*times, at})
            mirror_writes(svc, applied)
            svc._commit(applied, considered)
            for p in result.placed:
                wakes.pop(p.pending.job.job_id, None)
                apply_start(svc, p.pending, reports, t)
                d = p.decision
                first = got.get(p.pending.job.job_id, (t,))[0]  # a requeued job keeps its first start
                parts = tuple(part.cluster for part in d.parts)
                got[p.pending.job.job_id] = (first, parts, d.lead.gpu_model, None)
            for r in result.rejected:
                got[r.pending.job.job_id] = ("rejected",)
            # The requeue loop runs again at once after a preemption or shrink (capacity changed).
            changed = svc.capacity_changed
            svc.capacity_changed = False
            if not changed:
                break
    for job_id, run in svc.book.runs.items():
        got[job_id] = (*got[job_id][:3], run.gpus)
    return got


def apply_reports(svc: PlacementService, reports: Sequence[ProgressReport]) -> None:
    """Progress reports, as ``on_lifecycle`` applies a ``JobProgress``: each run's progress
    (preemption prefers victims that lose least) and its end re-predicted from its pace."""
    for report in reports:
        if report.job_id in svc.book.runs:
            svc.book.set_progress(report.job_id, report.fraction, now=report.t, at=report.t)


def apply_start(svc: PlacementService, q: QueuedJob, reports: Sequence[ProgressReport], t: float) -> None:
    """A run placed at ``t`` starts, as ``on_lifecycle`` applies a ``JobStarted``: its pace is
    measured from its first step (its next report says when that was)."""
    began = next((r.began_s for r in reports if r.job_id == q.job.job_id and r.t >= t), None)
    if began is not None:
        svc.book.set_began(q.job.job_id, q.attempt, began)


def mirror_writes(svc: PlacementService, applied: Any) -> None:
    """What the service's writes of a cycle's effects record in memory (``_give_up``, ``_shrink``,
    ``_grow``), for ``_commit`` to adopt."""
    result = applied.cycle
    for pre in result.preempted:
        # What _give_up does in memory: the victim is queued again as its next attempt.
        run = svc.book.runs[pre.job_id]
        again = dataclasses.replace(run.queued, attempt=run.attempt + 1, tries=0)
        applied.requeued.append((run, again, "preempted"))
    for s in result.shrunk:
        cluster, model, _ = svc.book.runs[s.job_id].parts[0]
        applied.shrunk.append((s.job_id, [(cluster, model, s.allocations)], s.workers))
    for g in result.grown:
        if g.job_id in svc.book.runs:
            applied.grown.append((g.job_id, [(g.cluster, g.gpu_model, g.allocations)], g.workers))
        else:
            # What _grow does for a run placed in this very cycle (not committed yet): no growth
            # written, the snapshot rebuilt after the commit, and capacity changed, so the next
            # cycle, at once, grows it.
            applied.stale = True


# Derandomized: the same 60 cases every run (CI must not flip on a new draw); 1,200 random cases
# passed while building it (--hypothesis-seed 11 and 12 with max_examples=600), and 400 more once
# jobs could arrive together.
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(traces())
def test_the_service_decides_what_the_simulator_decides(jobs: list[SimJob]) -> None:
    same_decisions(jobs)


class MeasuredPolicy(FrameworkPolicy):
    """Loom with every (family, GPU model) cell measured, as the learned-speeds query marks them:
    comparative advantage acts on the ratios (a service adopts the same cells, ``set_learned``)."""

    def prepare(self, snap: Any, jobs: Any, truth: Any, seed: int) -> None:
        super().prepare(snap, jobs, truth, seed)
        snap.set_learned({}, MEASURED)


MEASURED = frozenset(
    (family_of({}, task), model) for task in REAL_TASKS for model in {n.gpu_model for n in PLATFORM.nodes}
)

STEADY_ON = ("P100", "V100M16")
"""The models each family has steady runs on in :class:`RiskyPolicy`; the others are untried."""
RISKY_LEARNED = {(family, model): (1.0 if model in STEADY_ON else 1.15) for family, model in MEASURED}
RISKY_MEASURED = frozenset((family, model) for family, model in MEASURED if model in STEADY_ON)
RISK = (2.0, 0.8)
"""The big-job handicap at 2 reference GPU-hours (a job of 180+ steps x 4 GPUs here), so that this
trace's jobs meet it: placement's default is 16."""


class RiskyPolicy(FrameworkPolicy):
    """Loom with learned factors, each family steady on two models only, and the big-job handicap
    on (``Snapshot.set_risk``): a big job weighs the untried models at 0.8 of their (higher)
    estimate in its choice, and its predictions and waits keep the estimate (a service adopts the
    same cells and risk)."""

    def prepare(self, snap: Any, jobs: Any, truth: Any, seed: int) -> None:
        super().prepare(snap, jobs, truth, seed)
        snap.set_learned(RISKY_LEARNED, RISKY_MEASURED)
        snap.set_risk(*RISK)


# Derandomized as the test above; 600 random cases per seed passed on 8 seeds while building it.
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(traces(REAL_TASKS), st.booleans())
def test_the_service_decides_what_the_simulator_decides_where_gpu_speeds_differ(
    jobs: list[SimJob], measured: bool
) -> None:
    """Real task types: decisions wait for faster GPUs (a permit's patience, its wake included)
    and, with every cell measured, weigh comparative advantage."""
    same_decisions(jobs, measured=measured)


# Derandomized as above; 600 random cases passed while building it.
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(traces(REAL_TASKS))
def test_the_service_decides_what_the_simulator_decides_with_the_big_job_handicap(jobs: list[SimJob]) -> None:
    """Learned factors, cells steady on some models only, and the big-job handicap on: both sides
    weigh a big job's untried models alike in the choice and predict its run alike."""
    same_decisions(jobs, risky=True)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(traces(REAL_TASKS), st.sampled_from([1, 2, 3]), st.booleans())
def test_a_pass_out_of_budget_goes_on_where_it_stopped_as_one_cycle_would(
    jobs: list[SimJob], budget: int, measured: bool
) -> None:
    """The simulator's passes make 1-3 decisions each here: a pass that runs out is taken up where
    it stopped, at the same instant, so every job is decided once in queue order, as placement's one
    cycle decides them. (Before: a pass out of budget left the rest to the next event; then it went
    on from the queue's front, with jobs that arrived decided ahead of those left over; 4,500
    random cases per seed now pass on seeds 1-3.)"""
    same_decisions(jobs, budget=budget, measured=measured)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(traces(REAL_TASKS, spanning=True), st.sampled_from([1, 64]), st.booleans())
def test_the_service_decides_what_the_simulator_decides_for_gangs_that_may_span(
    jobs: list[SimJob], budget: int, measured: bool
) -> None:
    """Gangs of up to 8 workers, half of them allowed to span clusters: spreads, the span guard's
    refusals and the waits for one cluster it tells a gang to take. (6,000 random cases on seeds
    5-8 passed while building it, with budgets 1 and 64.)"""
    same_decisions(jobs, budget=budget, measured=measured)


WIDE_CLUSTERS = ["c-sea1-a", "c-use2-a", "c-weu-a"]
WIDE_REGIONS = ["gcp-asia-southeast1", "aws-us-east-2", "azure-westeurope"]
WIDE_MODELS = ["V100M16", "V100M32", "G2", "T4", "P100"]


@st.composite
def varied(draw: Any) -> list[SimJob]:
    """Random traces of every kind of job the placement framework tells apart: affinity (clusters,
    regions, avoidance, preference, labelled jobs kept apart or near), GPU models, priorities,
    non-preemptible jobs, CPU requests, communication, pipelines and elastic gangs."""
    count = draw(st.integers(min_value=3, max_value=22))
    jobs = []
    t = 0.0
    for i in range(count):
        t += draw(st.sampled_from([0.0, 0.0, 0.5, 1.0, 30.0, 120.0, 600.0]))
        pipe = draw(st.integers(0, 9)) == 0
        gpus = 1 if pipe else draw(st.sampled_from([1, 1, 2, 4, 8]))
        workers = 1 if pipe else draw(st.sampled_from([1, 1, 2, 3, 4]))
        elastic = workers > 1 and draw(st.booleans())
        models: list[str] = []
        if draw(st.integers(0, 3)) == 0:
            models = sorted(draw(st.sets(st.sampled_from(WIDE_MODELS), min_size=1, max_size=3)))
        aff = Affinity()
        k = draw(st.integers(0, 7))
        if k == 0:
            aff = Affinity(clusters=[draw(st.sampled_from(WIDE_CLUSTERS))])
        elif k == 1:
            aff = Affinity(avoid_clusters=[draw(st.sampled_from(WIDE_CLUSTERS))])
        elif k == 2:
            aff = Affinity(prefer_regions=[draw(st.sampled_from(WIDE_REGIONS))])
        elif k == 3:
            aff = Affinity(regions=[draw(st.sampled_from(WIDE_REGIONS))])
        labels: dict[str, str] = {}
        k = draw(st.integers(0, 5))
        if k == 0:
            labels = {"team": draw(st.sampled_from(["x", "y"]))}
        elif k == 1:
            aff = Affinity(clusters=aff.clusters, apart_from_jobs={"team": draw(st.sampled_from(["x", "y"]))})
        elif k == 2:
            aff = Affinity(clusters=aff.clusters, near_jobs={"team": draw(st.sampled_from(["x", "y"]))})
        comm = None
        if workers > 1 and draw(st.booleans()):
            comm = Communication(
                bytes_per_step=draw(st.sampled_from([10**6, 10**8, 10**9])),
                rounds_per_step=draw(st.sampled_from([0, 1, 4])),
            )
        pipeline = None
        if pipe:
            pipeline = Pipeline(
                layers=[
                    Layer(
                        compute_s=draw(st.sampled_from([0.5, 1.0, 2.0])),
                        memory_gib=draw(st.sampled_from([2.0, 8.0, 20.0])),
                        activation_mb=draw(st.sampled_from([0.0, 50.0])),
                    )
                    for _ in range(draw(st.integers(2, 6)))
                ],
                max_stages=draw(st.sampled_from([1, 2, 4])),
            )
        spec = JobSpec(
            job_id=f"j{i:03d}",
            tenant=draw(st.sampled_from(["a", "b", "c"])),
            priority=draw(st.sampled_from([100, 100, 50, 200, 300])),
            task_type=draw(st.sampled_from(REAL_TASKS)),
            resources=Resources(
                gpus=gpus, gpu_models=models, cpu_milli=draw(st.sampled_from([0, 0, 4000, 30000]))
            ),
            workers=workers,
            min_workers=draw(st.sampled_from([1, workers - 1])) if elastic else None,
            allow_multi_cluster=workers > 1 and draw(st.integers(0, 3)) == 0,
            preemptible=draw(st.integers(0, 3)) != 0,
            labels=labels,
            affinity=aff,
            comm=comm,
            pipeline=pipeline,
            work=Work(steps=draw(st.integers(min_value=10, max_value=400)), step_time_s=10.0),
        )
        jobs.append(SimJob(spec=spec, arrival_s=t))
    return jobs


# Derandomized as the tests above. Found nine faults (2026-12-05, cases below); then 3,000 random
# cases passed, timed by belief and by truth's measured speeds, budgets 1 and 64.
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(varied(), st.booleans(), st.sampled_from([1, 64]))
def test_the_service_decides_what_the_simulator_decides_for_every_kind_of_job(
    jobs: list[SimJob], measured: bool, budget: int
) -> None:
    same_decisions(jobs, measured=measured, budget=budget)


@st.composite
def rare_shapes(draw: Any) -> list[SimJob]:
    """Random traces where ``rare_fit`` has its say: workers of one, two or eight GPUs and 4 cores,
    and of eight GPUs and 700 GiB, which only one node of the small platform holds (a rare shape
    once seen twice), of runs long and short."""
    count = draw(st.integers(min_value=6, max_value=26))
    jobs = []
    t = 0.0
    for i in range(count):
        t += draw(st.sampled_from([0.0, 5.0, 60.0, 600.0]))
        big = draw(st.integers(0, 3)) == 0
        resources = (
            Resources(gpus=8, cpu_milli=8000, memory_mib=700 * 1024)
            if big
            else Resources(gpus=draw(st.sampled_from([1, 2, 8])), cpu_milli=4000)
        )
        spec = JobSpec(
            job_id=f"r{i:03d}",
            tenant="a",
            task_type=draw(st.sampled_from(REAL_TASKS)),
            resources=resources,
            work=Work(steps=draw(st.sampled_from([10, 100, 2_000, 20_000])), step_time_s=10.0),
        )
        jobs.append(SimJob(spec=spec, arrival_s=t))
    return jobs


# rare_fit's score and permit read the shapes seen (the simulator notes the jobs it skips, the
# framework every job it decides) and wait for other pools: both sides must see the same.
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(rare_shapes(), st.sampled_from([1, 64]))
def test_the_service_decides_what_the_simulator_decides_where_a_worker_shape_is_rare(
    jobs: list[SimJob], budget: int
) -> None:
    same_decisions(jobs, budget=budget)


def test_a_job_the_simulator_skips_on_arrival_counts_as_seen_as_placement_counts_it() -> None:
    # b1 arrives while b0, of its shape, waits: the simulator skips its decision (nothing fits) and
    # did not note it as seen, placement decides and notes it. s0 was then decided with the rare
    # shape seen once in the simulator and twice in the service, and took the rare node's last
    # room in the simulator only (found by a review).
    rare_big = Resources(gpus=4, cpu_milli=8000, memory_mib=700 * 1024)
    only_m32 = Resources(gpus=6, cpu_milli=4000, gpu_models=["V100M32"])
    small = Resources(gpus=2, cpu_milli=4000, gpu_models=["V100M32", "V100M16"])
    jobs = [
        SimJob(
            JobSpec(job_id="x", tenant="a", resources=only_m32, work=Work(steps=10, step_time_s=10.0)), 0.0
        ),
        SimJob(
            JobSpec(job_id="b0", tenant="a", resources=rare_big, work=Work(steps=100, step_time_s=10.0)), 1.0
        ),
        SimJob(
            JobSpec(job_id="b1", tenant="a", resources=rare_big, work=Work(steps=100, step_time_s=10.0)), 2.0
        ),
        SimJob(
            JobSpec(
                job_id="s0",
                tenant="a",
                task_type="inference",
                resources=small,
                work=Work(steps=230, step_time_s=10.0),
            ),
            3.0,
        ),
    ]
    same_decisions(jobs)


@pytest.mark.parametrize(("budget", "halves"), [(1, False), (64, False), (1, True), (64, True)])
def test_jobs_moved_to_make_room_for_a_rare_shape_are_moved_alike_in_the_service(
    budget: int, halves: bool
) -> None:
    # rare_room: "s" (8 GPUs, any model) takes the V100M32 node, the only one a 700-GiB worker fits,
    # while four long jobs hold the G2 nodes; "big" arrives and waits. When the G2 jobs end, s is
    # stopped and placed again on a G2 (its run there is about what it had left), and big starts.
    # ``halves``: two 4-GPU, 380-GiB jobs share the node instead (no other node has the memory for
    # one but the G2 ones): both are moved.
    g2 = Resources(gpus=8, cpu_milli=4000, gpu_models=["G2"])
    jobs = [
        SimJob(
            JobSpec(job_id=f"f{i}", tenant="a", resources=g2, work=Work(steps=70_000, step_time_s=10.0)), 0.0
        )
        for i in range(4)
    ]
    movers = ["h0", "h1"] if halves else ["s"]
    size = (
        Resources(gpus=4, cpu_milli=4000, memory_mib=380 * 1024)
        if halves
        else Resources(gpus=8, cpu_milli=4000)
    )
    for k, job_id in enumerate(movers):
        # Two to move: each must have less left to redo (the move pays for both together only
        # when each loses little on a G2), yet still start on the V100M32 rather than wait.
        work = Work(steps=21_500 if halves else 20_000, step_time_s=10.0)
        jobs.append(SimJob(JobSpec(job_id=job_id, tenant="a", resources=size, work=work), 1.0 + k))
    rare_big = Resources(gpus=8, cpu_milli=8000, memory_mib=700 * 1024)
    jobs.append(
        SimJob(
            JobSpec(job_id="big", tenant="a", resources=rare_big, work=Work(steps=2_000, step_time_s=10.0)),
            5_000.0,
        )
    )
    framework = build_framework(context={"economics": PLATFORM.economics})
    sim = simulate(
        Trace(list(jobs)), PLATFORM, FrameworkPolicy("loom", framework), truth=BELIEF, sample_every_s=0
    )
    got = {r.job_id: r for r in sim.records}
    fillers_end = got["f0"].end_s
    for job_id in movers:
        assert got[job_id].restarts == 1 and got[job_id].gpu_model == "G2", got[job_id]
    assert got["big"].gpu_model == "V100M32" and got["big"].start_s == pytest.approx(fillers_end)
    same_decisions(jobs, budget=budget)


def rare_spec(job_id: str, resources: Resources, steps: int) -> JobSpec:
    return JobSpec(job_id=job_id, tenant="a", resources=resources, work=Work(steps=steps, step_time_s=10.0))


def rare_queue_scenario() -> list[SimJob]:
    g2 = Resources(gpus=8, cpu_milli=4000, gpu_models=["G2"])
    big = Resources(gpus=8, cpu_milli=8000, memory_mib=700 * 1024, gpu_models=["V100M32"])
    jobs = [SimJob(rare_spec(f"f{i}", g2, 70_000), 0.0) for i in (0, 1)]  # end together
    jobs += [SimJob(rare_spec(f"f{i}", g2, 900_000), 0.0) for i in (2, 3)]
    jobs.append(SimJob(rare_spec("s", Resources(gpus=8, cpu_milli=4000), 20_000), 1.0))  # takes V100M32
    # Queued before the G2 nodes free up, in this queue order (shortest first): J1, K, J2.
    jobs.append(SimJob(rare_spec("j1", big, 4_000), 100.0))
    jobs.append(SimJob(rare_spec("k", g2, 8_000), 101.0))
    jobs.append(SimJob(rare_spec("j2", big, 16_000), 102.0))
    return jobs


@pytest.mark.parametrize("budget", [1, 64])
def test_a_later_job_of_a_rare_shape_is_decided_when_the_queue_ahead_changed(budget: int) -> None:
    # Queue order j1 (rare), k (G2 only), j2 (rare): j1 finds no move (k waits for the G2 pool); k
    # is placed; placement then moves s for j2. The simulator skipped j2 as "its shape failed in
    # this pass" (a review): a shape rare_room may move jobs for is not skipped so.
    same_decisions(rare_queue_scenario(), budget=budget)


CASES = json.loads((Path(__file__).parent / "data" / "service_vs_sim_cases.json").read_text())
"""Random cases the simulator decided otherwise than placement (found by 1,500-4,500 random cases a
seed, 2026-12-04 evening; the last with gangs that may span), each with what was wrong: each fails
on the code before its fix."""


@pytest.mark.parametrize("case", CASES, ids=[c["case"] for c in CASES])
def test_cases_where_the_simulator_decided_otherwise(case: dict[str, Any]) -> None:
    jobs = [SimJob(spec=msgspec.convert(j["spec"], JobSpec), arrival_s=j["arrival_s"]) for j in case["jobs"]]
    same_decisions(jobs, measured=case["measured"], budget=case["budget"])


def same_decisions(
    jobs: list[SimJob], *, measured: bool = False, budget: int = 64, risky: bool = False
) -> None:
    """The simulator plays ``jobs`` (``budget``: its decisions per pass, the rest in passes at the
    same instant); the service, fed the same events, decides every job alike."""
    framework = build_framework(context={"economics": PLATFORM.economics})
    kind = RiskyPolicy if risky else MeasuredPolicy if measured else FrameworkPolicy
    policy = kind("loom", framework)
    sim = simulate(
        Trace(list(jobs)),
        PLATFORM,
        policy,
        truth=BELIEF,
        sample_every_s=0,
        retry_every_s=0,
        max_decisions_per_event=budget,
    )
    expected: dict[str, tuple[Any, ...]] = {}
    ends: dict[str, float] = {}
    for rec in sim.records:
        if rec.rejected:
            expected[rec.job_id] = ("rejected",)
        elif rec.start_s is not None:
            expected[rec.job_id] = (rec.start_s, rec.clusters, rec.gpu_model, rec.gpus)
            if rec.end_s is not None:
                ends[rec.job_id] = rec.end_s
    svc = service()
    if measured:
        svc.book.set_learned({}, MEASURED)
    if risky:
        svc.book.set_learned(RISKY_LEARNED, RISKY_MEASURED)
        svc.book.risk = RISK
    got = replay(svc, jobs, ends, sim.reports)
    assert to_the_nanosecond(got, expected) == expected


def to_the_nanosecond(
    got: dict[str, tuple[Any, ...]], expected: dict[str, tuple[Any, ...]]
) -> dict[str, tuple[Any, ...]]:
    """``got`` with each start time within 1 ns of the expected one taken as equal: a permit's wake
    is now plus a wait computed from the running jobs' predicted ends, which the simulator and the
    book compute by different sums (the same decision, at instants 1e-13 s apart)."""
    out = dict(got)
    for job_id, mine in got.items():
        theirs = expected.get(job_id)
        if (
            theirs is not None
            and isinstance(mine[0], float)
            and isinstance(theirs[0], float)
            and math.isclose(mine[0], theirs[0], rel_tol=0.0, abs_tol=1e-9)
        ):
            out[job_id] = (theirs[0], *mine[1:])
    return out


def test_an_elastic_job_grows_back_in_the_simulator_as_in_the_service() -> None:
    """The drift this cycle removed: the simulator never grew elastic jobs back; now both do."""
    pool = [n for n in PLATFORM.nodes if n.gpu_model == "V100M32"]
    total = sum(n.gpus_total for n in pool)
    assert total >= 4 and len({n.cluster for n in pool}) == 1
    v100 = Resources(gpus=1, gpu_models=["V100M32"])
    hog = JobSpec(
        job_id="hog", tenant="a", resources=v100, workers=total - 2, work=Work(steps=10, step_time_s=10.0)
    )
    elastic = JobSpec(
        job_id="el",
        tenant="a",
        resources=v100,
        workers=total,
        min_workers=1,
        work=Work(steps=100_000, step_time_s=10.0),
    )
    jobs = [SimJob(spec=hog, arrival_s=0.0), SimJob(spec=elastic, arrival_s=1.0)]
    policy = FrameworkPolicy("loom", build_framework(context={"economics": PLATFORM.economics}))
    sim = simulate(Trace(list(jobs)), PLATFORM, policy, truth=BELIEF, sample_every_s=0, retry_every_s=0)
    rec = {r.job_id: r for r in sim.records}
    assert rec["hog"].end_s is not None and rec["el"].start_s == 1.0
    # It started on the 2 GPUs the hog left and grew to the whole pool once the hog ended.
    assert rec["el"].gpus == total
    got = replay(service(), jobs, {"hog": rec["hog"].end_s})
    assert got["el"] == (1.0, rec["el"].clusters, "V100M32", total)


def job(job_id: str, gpus: int, workers: int, steps: int, **extra: Any) -> JobSpec:
    """A job of tenant "a" for the real-task-type cases (a training job unless ``task_type`` says)."""
    return JobSpec(
        **{
            "job_id": job_id,
            "tenant": "a",
            "task_type": "training_compute",
            "resources": Resources(gpus=gpus),
            "workers": workers,
            "work": Work(steps=steps, step_time_s=10.0),
            **extra,
        }
    )


def test_a_job_shaped_like_one_that_waits_for_faster_gpus_gets_a_decision_of_its_own() -> None:
    """The simulator queued a job without a decision when a job of its shape had failed and no
    pool had freed since; but when that one was held back by a permit's choice (waiting for faster
    GPUs) the choice reads the job's own place in the queue, and placement decides the next one
    otherwise. Real task types (speeds differ by model), unlike the property test's."""

    jobs = [
        SimJob(spec=job("j000", 1, 1, 10), arrival_s=0.0),
        SimJob(spec=job("j001", 8, 4, 28, priority=200), arrival_s=0.0),
        SimJob(spec=job("j002", 1, 1, 11), arrival_s=0.0),
        SimJob(spec=job("j003", 1, 1, 10), arrival_s=0.5),
    ]
    policy = FrameworkPolicy("loom", build_framework(context={"economics": PLATFORM.economics}))
    sim = simulate(Trace(list(jobs)), PLATFORM, policy, truth=BELIEF, sample_every_s=0, retry_every_s=0)
    rec = {r.job_id: r for r in sim.records}
    # j002 waits for the G2s the gang holds; j003, behind it, starts at once on a V100.
    assert rec["j002"].gpu_model == "G2" and rec["j002"].start_s == rec["j001"].end_s
    assert (rec["j003"].start_s, rec["j003"].gpu_model) == (0.5, "V100M16")
    ends = {r.job_id: r.end_s for r in sim.records if r.end_s is not None}
    got = replay(service(), jobs, ends)
    assert got == {r.job_id: (r.start_s, r.clusters, r.gpu_model, r.gpus) for r in sim.records}


def test_an_elastic_run_grown_later_is_predicted_from_the_time_it_grew() -> None:
    """The simulator grew elastic runs on a snapshot whose clock was its last decision's, so a run
    grown at 265 s had its predicted end rescaled as if grown at 0 s (598.6 s instead of 664.9 s),
    and a job arriving at 600 s waited for GPUs it believed already free; placement rescales from
    the time of the growth. Real task types, as in the test above."""

    jobs = [
        SimJob(spec=job("j000", 1, 1, 110, task_type="training_compute"), arrival_s=0.0),
        SimJob(spec=job("j001", 8, 4, 129, task_type="inference", min_workers=1), arrival_s=0.0),
        *(
            SimJob(spec=job(f"j00{i}", 1, 1, 10, task_type="training_compute"), arrival_s=0.0)
            for i in range(2, 7)
        ),
        SimJob(spec=job("j007", 1, 1, 10, task_type="training_compute"), arrival_s=600.0),
    ]
    policy = FrameworkPolicy("loom", build_framework(context={"economics": PLATFORM.economics}))
    sim = simulate(Trace(list(jobs)), PLATFORM, policy, truth=BELIEF, sample_every_s=0, retry_every_s=0)
    rec = {r.job_id: r for r in sim.records}
    assert rec["j001"].gpus == 32 and rec["j001"].end_s is not None and rec["j001"].end_s > 600.0
    assert (rec["j007"].start_s, rec["j007"].gpu_model) == (600.0, "V100M16")
    ends = {r.job_id: r.end_s for r in sim.records if r.end_s is not None}
    got = replay(service(), jobs, ends)
    assert got == {r.job_id: (r.start_s, r.clusters, r.gpu_model, r.gpus) for r in sim.records}


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__])


def test_two_tenants_alike_but_for_whom_they_keep_apart_from_are_decided_each_on_its_own() -> None:
    # `apart_from_jobs` matches the job's own tenant's jobs: two jobs alike in every way but the
    # tenant may be allowed different clusters. The simulator grouped them as one shape, so one
    # tenant's failure held back the other's job for days (t 241,347 s) where placement started it
    # at once (found by the review of the tenant scoping).
    from loom_proto.jobs import Affinity

    def spec(job_id: str, tenant: str, gpus: int = 1, steps: int = 100_000, **kw: Any) -> JobSpec:
        model = kw.pop("model", None)
        res = Resources(gpus=gpus, gpu_models=[model]) if model else Resources(gpus=gpus)
        return JobSpec(
            job_id=job_id, tenant=tenant, resources=res, work=Work(steps=steps, step_time_s=10.0), **kw
        )

    jobs: list[SimJob] = []
    labelled = False
    for k, n in enumerate(sorted(PLATFORM.nodes, key=lambda n: (n.cluster, n.gpu_model, n.node))):
        only_here = Affinity(clusters=[n.cluster])
        if n.cluster == "c-use2-a" and not labelled:
            labelled = True  # tenant b's labelled job holds one node of c-use2-a
            held = spec(
                "lab-b", "b", n.gpus_total, model=n.gpu_model, labels={"team": "x"}, affinity=only_here
            )
            jobs.append(SimJob(spec=held, arrival_s=0.0))
            continue
        steps = 10 if n.cluster == "c-use2-a" else 100_000  # c-use2-a frees up soon, the rest not
        filler = spec(f"fill{k:02d}", "a", n.gpus_total, steps=steps, model=n.gpu_model, affinity=only_here)
        jobs.append(SimJob(spec=filler, arrival_s=0.0))
    apart = Affinity(apart_from_jobs={"team": "x"})
    jobs += [
        SimJob(spec=spec("ja", "a", steps=100, affinity=apart), arrival_s=5.0),
        SimJob(spec=spec("jb", "b", steps=100, affinity=apart), arrival_s=5.0),
    ]
    same_decisions(jobs)


def _spec2(job_id: str, priority: int = 100, steps: int = 1000) -> JobSpec:
    return JobSpec(
        job_id=job_id,
        tenant="a",
        priority=priority,
        resources=Resources(gpus=2, gpu_models=["P100"]),
        work=Work(steps=steps, step_time_s=10.0),
    )


def test_preemption_takes_the_run_that_reported_least_progress_in_both() -> None:
    # The P100 pool holds two 2-GPU runs. lo-a has reported a tenth of its steps when hi arrives,
    # lo-b (started at 2,000 s) nothing yet: preemption takes lo-b, which loses least. Before, the
    # simulator never set a run's progress and took lo-a (the first by id), and the service, fed no
    # reports by this test, did too.
    jobs = [
        SimJob(_spec2("lo-a"), 0.0),
        SimJob(_spec2("lo-b"), 2000.0),
        SimJob(_spec2("hi", 200, 10), 3000.0),
    ]
    policy = FrameworkPolicy("loom", build_framework(context={"economics": PLATFORM.economics}))
    sim = simulate(Trace(list(jobs)), PLATFORM, policy, truth=BELIEF, sample_every_s=0, retry_every_s=0)
    restarts = {r.job_id: r.restarts for r in sim.records}
    assert restarts == {"lo-a": 0, "lo-b": 1, "hi": 0}
    assert [(r.job_id, round(r.fraction, 6)) for r in sim.reports if r.t < 3000.0] == [("lo-a", 0.1)]
    same_decisions(jobs)


P100 = Resources(gpus=2, gpu_models=["P100"])


def _submitted(spec: JobSpec, t: float) -> JobSubmitted:
    return JobSubmitted(**{f: getattr(spec, f) for f in JobSpec.__struct_fields__}, submitted_at=t)


def _two_stage_dag(second: Resources, second_steps: int) -> JobSpec:
    """DAG ``d``: stage s1 (2 P100s, 10 steps), then s2 of ``second`` after it."""
    return JobSpec(
        job_id="d",
        tenant="a",
        work=Work(steps=1),
        stages=[
            Stage(name="s1", resources=P100, work=Work(steps=10, step_time_s=10.0)),
            Stage(
                name="s2",
                depends_on=["s1"],
                resources=second,
                work=Work(steps=second_steps, step_time_s=10.0),
            ),
        ],
    )


def test_a_released_dag_stage_keeps_its_dags_place_in_the_queue_in_both() -> None:
    # A stage released when its parent ends (~24 s) competes with a job queued at 5 s for the
    # same freed P100s: placement queues the stage at its DAG's submission (dag.expand), so it goes
    # first; the simulator queued it at its release, behind the other job.
    hog = JobSpec(job_id="hog", tenant="a", resources=P100, work=Work(steps=1000, step_time_s=10.0))
    dag_job = _two_stage_dag(P100, 50)
    other = JobSpec(job_id="x", tenant="a", resources=P100, work=Work(steps=50, step_time_s=10.0))
    jobs = [SimJob(hog, 0.0), SimJob(dag_job, 0.0), SimJob(other, 5.0)]
    policy = FrameworkPolicy("loom", build_framework(context={"economics": PLATFORM.economics}))
    sim = simulate(Trace(list(jobs)), PLATFORM, policy, truth=BELIEF, sample_every_s=0, retry_every_s=0)
    rec = {r.job_id: r for r in sim.records}
    s1, s2 = dag.stage_job_id("d", "s1"), dag.stage_job_id("d", "s2")
    end = rec[s1].end_s
    assert end is not None and rec[s2].start_s == end and rec["x"].start_s != end

    svc = service()  # fed the same events: hog and the DAG's first stage at 0, x at 5, s1's end
    stages = {c.job_id: c for c in dag.expand(_submitted(dag_job, 0.0))}
    for queued, t in (
        ([QueuedJob(_submitted(hog, 0.0), {}), QueuedJob(stages[s1], {}, parent="d")], 0.0),
        ([QueuedJob(_submitted(other, 5.0), {})], 5.0),
    ):
        svc._commit(svc._decide(queued, now=t), queued)
    assert set(svc.book.runs) == {"hog", s1} and "x" in svc.queue
    svc.book.drop_run(s1)
    considered = [QueuedJob(stages[s2], {}, parent="d"), *svc.queue.values()]
    applied = svc._decide(considered, now=end, grow=True)
    assert [p.pending.job.job_id for p in applied.cycle.placed] == [s2]


def test_a_dag_with_a_stage_that_could_never_run_is_refused_whole_in_both() -> None:
    # Placement refuses it at admission, before any stage runs; the simulator ran s1 and rejected
    # only s2 when its turn came.
    dag_job = _two_stage_dag(Resources(gpus=16), 5)
    policy = FrameworkPolicy("loom", build_framework(context={"economics": PLATFORM.economics}))
    sim = simulate(
        Trace([SimJob(dag_job, 0.0)]), PLATFORM, policy, truth=BELIEF, sample_every_s=0, retry_every_s=0
    )
    never = service()._stage_never_fits(
        {c.labels[dag.STAGE_LABEL]: c for c in dag.expand(_submitted(dag_job, 0.0))}
    )
    assert never is not None
    assert [(r.job_id, r.start_s, r.rejected) for r in sim.records] == [
        ("d", None, f"stage {never[0]}: {never[1].reason}")
    ]
