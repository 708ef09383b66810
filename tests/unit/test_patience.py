"""Waiting instead of starting much slower: the span guard's slow-GPU rule and pipeline patience.

Both are permits of Loom's default profile and judge by predicted completion, wait included: the
better option's expected wait (from running jobs' predicted ends and the GPUs claimed ahead) plus
its run must beat the run now by a margin. A refusal must leave the snapshot untouched and say
why; a job that cannot do better by waiting (no faster pool could ever hold it, the faster pool is
too far away, or it has already waited as long as the worse plan would lose) is let through.
"""

from typing import Any

import msgspec
import numpy as np
import pytest

from loom.model.capacity import NodeCapacity
from loom.model.profiles import relative_speed
from loom.model.topology import load_topology
from loom.sched.framework import IDLE_PIPELINE_PLAN, Candidates, Code, CycleState, Framework
from loom.sched.pipeline import Site
from loom.sched.plugins.compute import ScuFit
from loom.sched.plugins.cost import default_economics
from loom.sched.plugins.network import SpanGuard
from loom.sched.plugins.patience import PipelinePatience
from loom.sched.plugins.resources import ResourceFit
from loom.sched.profile import DEFAULT_PLUGINS, build_framework
from loom.sched.snapshot import ClusterInfo, FloatArray, NetMatrix, RunningJob, Snapshot
from loom.sim.engine import simulate
from loom.sim.model import Platform, SimJob, Trace
from loom.sim.policies import POLICIES
from loom.sim.truth import BELIEF
from loom_proto.jobs import Affinity, Communication, JobSpec, Layer, Pipeline, Resources, Work

FAST, SLOW = "A100", "T4"


def node(name: str, cluster: str, *, model: str, gpus: int = 8, reserved: int = 0) -> NodeCapacity:
    return NodeCapacity(
        node=name,
        cluster=cluster,
        region="r1",
        zone="r1-a",
        gpu_model=model,
        gpus_total=gpus,
        gpus_reserved=reserved,
        cpu_milli=64_000,
        memory_mib=512 * 1024,
    )


def snapshot(
    nodes: list[NodeCapacity],
    fast_speed: float = 3.0,
    now: float = 1000.0,
    running: list[RunningJob] | None = None,
) -> Snapshot:
    speed = {(m, "training_compute"): s for m, s in ((FAST, fast_speed), (SLOW, 1.0))}
    return Snapshot(nodes, net=NetMatrix(["r1"]), speed=speed, now=now, running=running or [])


def holder(
    node_id: str, cluster: str, *, ends_in_s: float | None, now: float = 1000.0, gpus: int = 8
) -> RunningJob:
    """A running job holding ``gpus`` of a node, predicted to end ``ends_in_s`` from now (None: unknown)."""
    return RunningJob(
        job_id=f"run-{node_id}",
        tenant="t",
        priority=100,
        cluster=cluster,
        gpu_model=FAST,
        allocations=((node_id, gpus),),
        expected_end_s=None if ends_in_s is None else now + ends_in_s,
    )


def busy_fast(ends_in_s: float | None = 100.0) -> Snapshot:
    """The fast pool (ca) busy until ``ends_in_s`` from now; only the slow pool (cb) is free."""
    return snapshot(
        [node("a0", "ca", model=FAST, reserved=8), node("b0", "cb", model=SLOW)],
        running=[holder("a0", "ca", ends_in_s=ends_in_s)],
    )


def gang(workers: int = 2, gpus: int = 4, *, comm: bool = True) -> JobSpec:
    return JobSpec(
        job_id="g",
        tenant="t",
        workers=workers,
        resources=Resources(gpus=gpus),
        work=Work(steps=1000, step_time_s=1.0),
        comm=Communication(bytes_per_step=10**8) if comm else None,
    )


def guarded() -> Framework:
    return Framework([ResourceFit(), ScuFit(), SpanGuard()])


# ---- span guard: slow GPUs ----------------------------------------------------------------------


def test_a_data_parallel_gang_waits_for_faster_gpus_that_free_soon_enough_to_pay() -> None:
    # The fast pool is busy for 100 s more: 100 s + 1,000 steps x 1/3 s beats 1,000 s on T4 now.
    snap = busy_fast(ends_in_s=100.0)
    outcome = guarded().schedule(gang(), snap, submitted_at=snap.now - 100.0)
    assert outcome.decision is None and outcome.status.code == Code.UNSCHEDULABLE
    assert outcome.status.plugin == "span_guard"
    assert "waiting for faster GPUs" in outcome.status.reason and "A100 in ca" in outcome.status.reason
    assert outcome.status.wait_s == pytest.approx(100.0)  # the expected wait, from the running job's end
    assert int(snap.free.sum()) == 8  # nothing taken


def test_a_job_that_would_wait_for_a_faster_pool_longer_than_it_gains_starts_now() -> None:
    # Busy for 800 s more: 800 + 333 s is no sooner than 1,000 s now (the margin included).
    late = busy_fast(ends_in_s=800.0)
    outcome = guarded().schedule(gang(), late, submitted_at=late.now)
    assert outcome.decision is not None and outcome.decision.parts[0].gpu_model == SLOW
    # The fast pool's running job has no predicted end: waiting for it is priced as forever.
    unknown = busy_fast(ends_in_s=None)
    outcome = guarded().schedule(gang(), unknown, submitted_at=unknown.now)
    assert outcome.decision is not None and outcome.decision.parts[0].gpu_model == SLOW
    # Busy for 500 s: 500 + 333 s beats 1,000 s by 17 %, more than the 10 % margin: it waits.
    soon = busy_fast(ends_in_s=500.0)
    assert guarded().schedule(gang(), soon, submitted_at=soon.now).decision is None


def test_a_gang_stops_waiting_for_faster_gpus_once_it_has_waited_what_the_slow_start_would_lose() -> None:
    # 1,000 steps x (1 s on T4 - 1/3 s on A100) = 667 s the slow start would lose; 700 s waited.
    snap = busy_fast(ends_in_s=100.0)
    outcome = guarded().schedule(gang(), snap, submitted_at=snap.now - 700.0)
    assert outcome.decision is not None and outcome.decision.parts[0].gpu_model == SLOW


def test_a_gang_counts_the_gpus_claimed_ahead_of_it_in_its_wait() -> None:
    from loom.sched.availability import Reservation, WaitBook

    # Two fast nodes free in 100 s and 900 s; a job ahead waits for 8 of them: this gang's room
    # forms at 900 s, and 900 + 333 s no longer beats the slow start (1,000 s, plus the
    # opportunity cost of the GPU-seconds it holds longer while a job waits) by the margin.
    nodes = [
        node("a0", "ca", model=FAST, reserved=8),
        node("a1", "ca", model=FAST, reserved=8),
        node("b0", "cb", model=SLOW),
    ]
    running = [holder("a0", "ca", ends_in_s=100.0), holder("a1", "ca", ends_in_s=900.0)]
    book = WaitBook()
    alone = Framework([ResourceFit(), ScuFit(), SpanGuard(book=book)])
    snap = snapshot(nodes, running=running)
    waits = alone.schedule(gang(), snap, submitted_at=snap.now)
    assert waits.decision is None and waits.status.wait_s == pytest.approx(100.0)
    book.drop("g")
    ahead = Reservation(
        job_id="first",
        priority=100,
        submitted_at=0.0,
        cluster="ca",
        gpu_model=FAST,
        workers=1,
        per_worker=8,
        start_s=1100.0,
        expires_s=1e9,
    )
    book.reserve(ahead)
    snap = snapshot(nodes, running=running)
    outcome = alone.schedule(gang(), snap, submitted_at=snap.now)
    assert outcome.decision is not None and outcome.decision.parts[0].gpu_model == SLOW


def test_a_gang_does_not_wait_for_a_fast_pool_it_cannot_get() -> None:
    fast_down = snapshot([node("a0", "ca", model=FAST), node("b0", "cb", model=SLOW)])
    fast_down.schedulable[fast_down.cluster_of == fast_down.cluster_index["ca"]] = False
    outcome = guarded().schedule(gang(), fast_down, submitted_at=fast_down.now)
    assert outcome.decision is not None and outcome.decision.parts[0].cluster == "cb"
    avoided = guarded().schedule(gang(), busy_fast(), avoid_clusters=["ca"], submitted_at=1000.0)
    assert avoided.decision is not None and avoided.decision.parts[0].cluster == "cb"
    # An elastic gang whose slow placement runs 2 workers, where the fast pool holds only 1.
    elastic = msgspec.structs.replace(gang(workers=2), min_workers=1)
    small_fast = [node("a0", "ca", model=FAST, gpus=4, reserved=4), node("b0", "cb", model=SLOW)]
    running = [holder("a0", "ca", ends_in_s=10.0, gpus=4)]
    outcome = guarded().schedule(elastic, snapshot(small_fast, running=running), submitted_at=1000.0)
    assert outcome.decision is not None and outcome.decision.workers == 2


def test_a_gang_the_scores_put_on_slower_gpus_while_faster_ones_are_free_is_not_held() -> None:
    # Both pools free; a plugin prefers cb: waiting would change nothing, so nothing waits.
    class PreferSlow:
        name = "prefer_slow"

        def score(self, state: CycleState, candidates: Candidates) -> FloatArray:
            cb = state.snapshot.cluster_index["cb"]
            return np.where(candidates.cluster == cb, 100.0, 0.0)

        def normalize(self, state: CycleState, raw: FloatArray) -> FloatArray:
            return raw

    snap = snapshot([node("a0", "ca", model=FAST), node("b0", "cb", model=SLOW)])
    framework = Framework([ResourceFit(), PreferSlow(), SpanGuard()])
    outcome = framework.schedule(gang(), snap, submitted_at=snap.now)
    assert outcome.decision is not None and outcome.decision.parts[0].cluster == "cb"


def test_slow_gpus_are_taken_when_waiting_cannot_help_or_would_not_pay() -> None:
    # The fast pool is only 1.1x faster: 100 s + 909 s does not beat 1,000 s by the margin.
    slight = snapshot(
        [node("a0", "ca", model=FAST, reserved=8), node("b0", "cb", model=SLOW)],
        fast_speed=1.1,
        running=[holder("a0", "ca", ends_in_s=100.0)],
    )
    assert guarded().schedule(gang(), slight).decision is not None
    # A gang the fast pool could never hold (12 GPUs > its 8): let through, onto the slow pool.
    big = [
        node("a0", "ca", model=FAST, reserved=8),
        node("b0", "cb", model=SLOW),
        node("b1", "cb", model=SLOW),
    ]
    outcome = guarded().schedule(gang(workers=3), snapshot(big, running=[holder("a0", "ca", ends_in_s=1.0)]))
    assert outcome.decision is not None and {p.gpu_model for p in outcome.decision.parts} == {SLOW}


def test_the_default_profile_keeps_both_guards() -> None:
    assert {"span_guard", "pipeline_patience"} <= set(DEFAULT_PLUGINS)
    names = {p.name for p in build_framework().permits}
    assert {"span_guard", "pipeline_patience"} <= names


# ---- pipeline patience --------------------------------------------------------------------------


def pipeline_job(steps: int = 100) -> JobSpec:
    layers = [Layer(compute_s=1.0, memory_gib=1.0, activation_mb=1.0) for _ in range(2)]
    return JobSpec(
        job_id="p",
        tenant="t",
        work=Work(steps=steps, step_time_s=2.0),
        pipeline=Pipeline(layers=layers, max_stages=2),
    )


def two_sites(now: float = 1000.0) -> Snapshot:
    # Two clusters of one region; cb is full, so the plan free now is one stage on ca (2 s per step)
    # where the idle platform gives two stages (about 1 s per step).
    # cb's running job is predicted to end in 50 s: the better plan is near enough to wait for.
    return snapshot(
        [node("a0", "ca", model=FAST), node("b0", "cb", model=FAST, reserved=8)],
        fast_speed=1.0,
        now=now,
        running=[holder("b0", "cb", ends_in_s=50.0, now=now)],
    )


def patient() -> Framework:
    return Framework([ResourceFit(), ScuFit(), PipelinePatience()])


def test_a_pipeline_waits_for_a_much_better_plan_within_what_the_worse_plan_would_lose() -> None:
    snap = two_sites()
    outcome = patient().schedule(pipeline_job(), snap, submitted_at=snap.now - 10.0)
    assert outcome.decision is None and outcome.status.code == Code.UNSCHEDULABLE
    assert outcome.status.plugin == "pipeline_patience"
    # 100 steps x (2 s - about 1 s) = about 100 s to lose; 10 s waited, so about 90 s more.
    assert "waiting for a better plan (at most 9" in outcome.status.reason
    assert int(snap.free.sum()) == 8  # nothing taken


def test_a_pipeline_stops_waiting_once_it_has_waited_what_the_worse_plan_would_lose() -> None:
    snap = two_sites()
    outcome = patient().schedule(pipeline_job(), snap, submitted_at=snap.now - 150.0)
    assert outcome.decision is not None and len(outcome.decision.parts) == 1
    assert outcome.decision.predicted_step_s == pytest.approx(2.0)


def test_a_pipeline_takes_the_plan_when_it_is_close_to_the_best() -> None:
    snap = two_sites()
    unknown = patient().schedule(pipeline_job(), snap)  # no submission time: counts as just submitted
    # It waits the expected 50 s (shorter than the 100 s the worse plan would lose), not the bound.
    assert unknown.decision is None and unknown.status.wait_s == pytest.approx(50.0)
    # A better plan too far away (its stage pool busy for 500 s) is not waited for: 500 + 100 s
    # does not beat 200 s now.
    far = snapshot(
        [node("a0", "ca", model=FAST), node("b0", "cb", model=FAST, reserved=8)],
        fast_speed=1.0,
        running=[holder("b0", "cb", ends_in_s=500.0)],
    )
    outcome = patient().schedule(pipeline_job(), far, submitted_at=far.now)
    assert outcome.decision is not None and len(outcome.decision.parts) == 1
    idle = snapshot([node("a0", "ca", model=FAST), node("b0", "cb", model=FAST)], fast_speed=1.0)
    outcome = patient().schedule(pipeline_job(), idle, submitted_at=idle.now)
    assert outcome.decision is not None and len(outcome.decision.parts) == 2


def site_calls(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Every call of ``Framework.pipeline_sites`` from now on: whether it asked for the idle platform."""
    calls: list[bool] = []
    original = Framework.pipeline_sites

    def counting(self: Framework, state: CycleState, **kwargs: Any) -> list[Site]:
        calls.append(bool(kwargs.get("idle", False)))
        return original(self, state, **kwargs)

    monkeypatch.setattr(Framework, "pipeline_sites", counting)
    return calls


def test_the_idle_plan_is_computed_once_per_job_while_nothing_it_depends_on_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    framework = patient()
    calls = site_calls(monkeypatch)
    snap = two_sites()
    for _ in range(3):
        assert framework.schedule(pipeline_job(), snap, submitted_at=snap.now).decision is None
    assert calls.count(True) == 1
    snap.trust[0] = 0.5  # trust changed: planned again
    framework.schedule(pipeline_job(), snap, submitted_at=snap.now)
    assert calls.count(True) == 2


def test_patience_refuses_bad_settings() -> None:
    with pytest.raises(ValueError, match="max_slowdown"):
        PipelinePatience(max_slowdown=0.5)
    with pytest.raises(ValueError, match="cache_size"):
        PipelinePatience(cache_size=0)


def test_the_lower_bound_never_exceeds_the_idle_plan_and_spares_planning_when_it_suffices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from loom.sched.plugins.patience import lower_bound_step_s

    idle_plans: list[float] = []
    original = Framework.schedule_pipeline

    def spy(self: Framework, state: object, record: object, *, apply: bool) -> object:
        outcome = original(self, state, record, apply=apply)  # type: ignore[arg-type]
        idle = state.read(IDLE_PIPELINE_PLAN)()  # type: ignore[attr-defined]
        assert idle is not None
        bound = lower_bound_step_s(state)  # type: ignore[arg-type]
        assert 0 < bound <= idle.step_s
        idle_plans.append(idle.step_s)
        return outcome

    monkeypatch.setattr(Framework, "schedule_pipeline", spy)
    for reserved in (0, 4, 8):
        snap = snapshot(
            [node("a0", "ca", model=FAST), node("b0", "cb", model=SLOW, reserved=reserved)], fast_speed=2.0
        )
        patient().schedule(pipeline_job(), snap, submitted_at=snap.now)
    assert len(idle_plans) == 3
    monkeypatch.setattr(Framework, "schedule_pipeline", original)
    # On an idle platform the plan free now is the idle plan: the bound lets it through unplanned.
    calls = site_calls(monkeypatch)
    idle = snapshot([node("a0", "ca", model=FAST), node("b0", "cb", model=FAST)], fast_speed=1.0)
    assert patient().schedule(pipeline_job(), idle, submitted_at=idle.now).decision is not None
    assert calls == [False]


# ---- in the simulator ---------------------------------------------------------------------------


def sim_platform(clusters: dict[str, tuple[str, int]]) -> Platform:
    """``cluster -> (gpu_model, nodes of 8 GPUs)``, all in one region of the packaged topology."""
    region = "aws-us-east-2"
    nodes = [
        NodeCapacity(
            node=f"{cid}-n{i}", cluster=cid, region=region, zone=f"{region}-a", gpu_model=m, gpus_total=8
        )
        for cid, (m, count) in clusters.items()
        for i in range(count)
    ]
    models = sorted({m for m, _ in clusters.values()})
    tasks = ("training_compute", "training_comm")
    return Platform(
        name="test",
        nodes=nodes,
        clusters={cid: ClusterInfo(id=cid, region=region, zone=f"{region}-a") for cid in clusters},
        net=NetMatrix.from_topology(load_topology()),
        economics=default_economics(),
        speed={(m, t): relative_speed(m, t) for m in models for t in tasks},
        gpu_memory_gib=dict.fromkeys(models, 80.0),
    )


def blocker(cluster: str, steps: int = 10_000_000) -> SimJob:
    """Holds one whole 8-GPU node of ``cluster`` (by default far longer than anything else runs)."""
    spec = JobSpec(
        job_id=f"block-{cluster}",
        tenant="t",
        resources=Resources(gpus=8),
        work=Work(steps=steps, step_time_s=1.0),
        affinity=Affinity(clusters=[cluster]),
    )
    return SimJob(spec=spec, arrival_s=0.0)


def test_the_simulator_starts_a_pipeline_at_once_when_the_better_plan_is_far_away() -> None:
    # The blocker holds cb for about 10^7 s: waiting for the two-stage plan would buy nothing.
    built = sim_platform({"ca": (FAST, 1), "cb": (FAST, 1)})
    pipe = SimJob(spec=msgspec.structs.replace(pipeline_job(steps=1000), job_id="pipe"), arrival_s=10.0)
    result = simulate(Trace([blocker("cb"), pipe]), built, POLICIES["loom"](0), seed=0)
    records = {r.job_id: r for r in result.records}
    assert records["pipe"].start_s == 10.0 and records["pipe"].clusters == ("ca",)


def test_the_simulator_lets_a_pipeline_wait_for_a_better_plan_that_frees_soon() -> None:
    # The blocker frees cb after 300 s (it arrived at 0): worth waiting 290 s to run 1,000 steps
    # about twice as fast (2 s per step on one stage now, about 1 s on two).
    built = sim_platform({"ca": (FAST, 1), "cb": (FAST, 1)})
    pipe = SimJob(spec=msgspec.structs.replace(pipeline_job(steps=1000), job_id="pipe"), arrival_s=10.0)
    result = simulate(Trace([blocker("cb", steps=300), pipe]), built, POLICIES["loom"](0), seed=0)
    records = {r.job_id: r for r in result.records}
    started = records["pipe"].start_s
    blocked_until = records["block-cb"].end_s
    assert started is not None and blocked_until is not None
    assert started == pytest.approx(blocked_until)  # it waited for the better plan, no longer
    assert len(records["pipe"].clusters) == 2


def test_the_simulator_does_not_hold_a_job_back_behind_a_refused_gang_of_the_same_size() -> None:
    built = sim_platform({"ca": (FAST, 1), "cb": (SLOW, 2)})
    comm = SimJob(spec=msgspec.structs.replace(gang(), job_id="comm"), arrival_s=1.0)
    # A short job without communication: starting now on the T4s ends it before the fast pool
    # would (behind the gang's claim there, served in turn since 2026-12-07), so it starts at once.
    short = msgspec.structs.replace(gang(comm=False), job_id="plain", work=Work(steps=50, step_time_s=1.0))
    plain = SimJob(spec=short, arrival_s=2.0)
    # The fast pool frees at 200 s: the gang waits for it (its run there is a third of the T4's).
    result = simulate(
        Trace([blocker("ca", steps=200), comm, plain]), built, POLICIES["loom"](0), seed=0, truth=BELIEF
    )
    records = {r.job_id: r for r in result.records}
    assert records["plain"].start_s == 2.0 and records["plain"].clusters == ("cb",)
    started = records["comm"].start_s
    assert started is not None and started > 1.0  # the gang waited for the fast GPUs
    assert records["comm"].clusters == ("ca",)
