"""rare_room: a job of a common shape is moved off the only node a rare-shaped job fits, when that pays.

An outside evaluator's 120-GPU platform had one 128-core node: an 88-core task took it on arrival,
before any 120-core task had been seen (``rare_fit`` keeps room only for shapes seen), and the
120-core task after it waited 5.5 days behind it; Loom was 126-177 % behind compute-only greedy
(docs/measurements.md)."""

import dataclasses

import msgspec
import pytest

from loom.model.profiles import relative_speed
from loom.sched.plugins.rare import room_possible
from loom.sched.profile import DEFAULT_PLUGINS, build_framework
from loom.sched.snapshot import RunningJob, WorkerShape
from loom.sim.engine import simulate
from loom.sim.model import SimJob, Trace
from loom.sim.policies import POLICIES, FrameworkPolicy
from loom.sim.truth import BELIEF
from loom_proto.jobs import JobSpec, Resources, Work
from tests.unit.test_rare_fit import GIB, alibaba_like, job, snapshot_of

G3_RUN_S = 100_000 / relative_speed("G3", "training_compute")
G2_RUN_S = 100_000 / relative_speed("G2", "training_compute")


def without_rare_room(_seed: int) -> FrameworkPolicy:
    profile = {"plugins": [p for p in DEFAULT_PLUGINS if p != "rare_room"]}
    return FrameworkPolicy("loom", build_framework(profile))


def first_sighting(big_at: float = 1_000.0, **medium: object) -> Trace:
    """An 88-core job of 100,000 steps first (the G3 node is its fastest: it takes it), then one
    120-core job of 50,000 steps (only the G3 node holds it), never seen before. (A short one would
    not have the moved job run on a G2: it waits the few seconds for the G3 node, as it should.)"""
    spec = msgspec.structs.replace(job("medium", 88, 320, 100_000), **medium)
    return Trace([SimJob(spec, 0.0), SimJob(job("big", 120, 720, 50_000), big_at)])


def run(trace: Trace, policy: FrameworkPolicy | None = None, plat: object = None) -> dict[str, object]:
    result = simulate(trace, plat or alibaba_like(), policy or POLICIES["loom"](0), seed=0, truth=BELIEF)  # type: ignore[arg-type]
    return {r.job_id: r for r in result.records}


def test_a_job_that_fits_elsewhere_is_moved_off_the_only_node_a_rare_shape_fits() -> None:
    got = run(first_sighting())
    big, medium = got["big"], got["medium"]
    assert big.start_s == pytest.approx(1_000.0, abs=1.0) and big.gpu_model == "G3"  # type: ignore[attr-defined]
    # The medium job started on G3, was stopped at 1,000 s and ran again from its start on a G2.
    assert medium.gpu_model == "G2" and medium.restarts == 1  # type: ignore[attr-defined]
    assert medium.end_s == pytest.approx(1_000.0 + G2_RUN_S, rel=0.01)  # type: ignore[attr-defined]
    # Without the plugin the big job waits the medium one's whole run on G3.
    before = run(first_sighting(), without_rare_room(0))
    assert before["big"].start_s == pytest.approx(G3_RUN_S, rel=0.01)  # type: ignore[attr-defined]
    assert before["medium"].gpu_model == "G3" and before["medium"].restarts == 0  # type: ignore[attr-defined]
    # Mean completion time (by belief): the medium job pays 1,000 s redone and its slower GPU
    # (+4,200 s), the big one saves its ~20,000 s wait: about 31 % lower.
    mean = sum(r.jct_s or 0.0 for r in got.values()) / 2  # type: ignore[attr-defined]
    mean_before = sum(r.jct_s or 0.0 for r in before.values()) / 2  # type: ignore[attr-defined]
    assert mean < mean_before * 0.75


def test_the_jobs_sharing_the_node_are_moved_together_when_one_alone_would_not_make_room() -> None:
    # Two 4-GPU, 40-core jobs share the G3 node: moving either alone leaves 4 GPUs, not 8.
    def half(i: int) -> JobSpec:
        resources = Resources(gpus=4, cpu_milli=40_000, memory_mib=200 * GIB)
        return JobSpec(job_id=f"half-{i}", tenant="t", resources=resources, work=Work(steps=100_000))

    trace = Trace([SimJob(half(0), 0.0), SimJob(half(1), 1.0), SimJob(job("big", 120, 720, 50_000), 1_000.0)])
    got = run(trace)
    assert got["big"].start_s == pytest.approx(1_000.0, abs=1.0) and got["big"].gpu_model == "G3"  # type: ignore[attr-defined]
    assert [(got[f"half-{i}"].gpu_model, got[f"half-{i}"].restarts) for i in (0, 1)] == [("G2", 1)] * 2  # type: ignore[attr-defined]
    before = run(trace, without_rare_room(0))
    assert {before[f"half-{i}"].gpu_model for i in (0, 1)} == {"G3"}  # type: ignore[attr-defined]
    assert before["big"].start_s == pytest.approx(G3_RUN_S, rel=0.01)  # type: ignore[attr-defined]


def test_a_job_near_its_end_is_not_moved_when_redoing_its_work_costs_more_than_the_wait_saved() -> None:
    # The big job arrives when the medium one has ~1,500 s left of ~21,000 s on G3: moving it would
    # redo ~19,500 s of work (it keeps no checkpoint) to save the big job ~1,500 s.
    late = G3_RUN_S - 1_500.0
    got = run(first_sighting(big_at=late))
    assert got["medium"].restarts == 0 and got["medium"].gpu_model == "G3"  # type: ignore[attr-defined]
    assert got["big"].start_s == pytest.approx(G3_RUN_S, rel=0.01)  # type: ignore[attr-defined]


def test_a_job_that_checkpoints_loses_only_its_last_interval_so_moving_it_pays_later_in_its_run() -> None:
    # Half way: without checkpoints the move would redo ~10,000 s to save the big job ~10,000 s (no
    # move); checkpointing every 1,000 steps it redoes at most ~210 s, and moves.
    half = G3_RUN_S / 2
    assert run(first_sighting(big_at=half))["medium"].restarts == 0  # type: ignore[attr-defined]
    work = Work(steps=100_000, step_time_s=1.0, checkpoint_every_steps=1_000)
    got = run(first_sighting(big_at=half, work=work))
    assert got["medium"].restarts == 1 and got["medium"].gpu_model == "G2"  # type: ignore[attr-defined]
    assert got["big"].start_s == pytest.approx(half, abs=1.0)  # type: ignore[attr-defined]


def test_no_job_is_moved_without_room_elsewhere_now_nor_one_that_may_not_be_stopped() -> None:
    # The three G2 nodes are busy: the medium job would have nowhere to go.
    fillers = [SimJob(job(f"fill-{i}", 88, 320, 500_000), 10.0 + i) for i in range(3)]
    trace = Trace([*first_sighting().jobs[:1], *fillers, *first_sighting().jobs[1:]])
    got = run(trace)
    assert got["medium"].restarts == 0 and got["big"].start_s == pytest.approx(G3_RUN_S, rel=0.01)  # type: ignore[attr-defined]
    # Not preemptible, or of a higher priority than the job deciding: left alone.
    for change in ({"preemptible": False}, {"priority": 200}):
        got = run(first_sighting(**change))
        assert got["medium"].restarts == 0  # type: ignore[attr-defined]
        assert got["big"].start_s == pytest.approx(G3_RUN_S, rel=0.01)  # type: ignore[attr-defined]


def test_a_shape_most_nodes_hold_is_not_rare_and_moves_no_one() -> None:
    # An 88-core job waiting (every node busy with one-GPU jobs) is not rare beside them: 4 of 4
    # nodes hold it. The plugin's bound says so before any running job is looked at.
    snap = snapshot_of(alibaba_like())
    assert not room_possible(snap, WorkerShape(8, 88_000, 320 * GIB))
    assert room_possible(snap, WorkerShape(8, 120_000, 720 * GIB))


def test_the_move_is_the_largest_saving_and_the_decision_record_names_the_stopped_job() -> None:
    snap = snapshot_of(alibaba_like())
    snap.now = 1_000.0
    medium = job("medium", 88, 320, 100_000)
    snap.take([("a-big", 8)], 8, 88_000, 320 * GIB)
    snap.running = [
        RunningJob(
            job_id="medium",
            tenant="t",
            priority=100,
            cluster="a",
            gpu_model="G3",
            allocations=(("a-big", 8),),
            gpus_per_worker=8,
            cpu_milli=88_000,
            memory_mib=320 * GIB,
            expected_end_s=G3_RUN_S,
            spec=medium,
        )
    ]
    framework = build_framework()
    outcome = framework.schedule(job("big", 120, 720, 100), snap, submitted_at=1_000.0)
    assert outcome.decision is not None and outcome.decision.victims == ("medium",)
    assert [p.allocations for p in outcome.decision.parts] == [(("a-big", 8),)]
    assert any("rare_room: made room by stopping medium" in n for n in outcome.record.notes)
    assert snap.running == [] and int(snap.free[snap.node_index["a-big"]]) == 0
    # A running job whose spec is not known is not weighed (nothing is stopped on a guess).
    snap2 = snapshot_of(alibaba_like())
    snap2.now = 1_000.0
    snap2.take([("a-big", 8)], 8, 88_000, 320 * GIB)
    snap2.running = [dataclasses.replace(_run(medium), spec=None)]
    assert framework.schedule(job("big", 120, 720, 100), snap2, submitted_at=1_000.0).decision is None


def _run(spec: JobSpec) -> RunningJob:
    return RunningJob(
        job_id=spec.job_id,
        tenant="t",
        priority=100,
        cluster="a",
        gpu_model="G3",
        allocations=(("a-big", 8),),
        gpus_per_worker=8,
        cpu_milli=88_000,
        memory_mib=320 * GIB,
        expected_end_s=G3_RUN_S,
        spec=spec,
    )


def test_no_move_when_another_queued_job_could_take_the_room_the_moved_job_would_need() -> None:
    snap = snapshot_of(alibaba_like())
    snap.now = 1_000.0
    snap.take([("a-big", 8)], 8, 88_000, 320 * GIB)
    snap.running = [_run(job("medium", 88, 320, 100_000))]
    framework = build_framework()
    # Another job queued (its shape not known: it may want any pool): the moved job would queue
    # behind it rather than run now, so nothing is moved.
    snap.join_queue("other")
    assert framework.schedule(job("big", 120, 720, 100), snap, submitted_at=1_000.0).decision is None
    assert [r.job_id for r in snap.running] == ["medium"]
