"""Speed probes (loom.sched.probe): which a job calls for, how long it is held, and what they change.

The rule is pure and shared: the placement service's cycle (``run_cycle(probing=...)``) and the
simulator (at a job's arrival) both call :func:`probe_gate`. The simulator test at the end is the
point of it all: a family the profile believes 6x faster on an A100 than on a T4, while the truth
says the T4 is twice as fast, goes to the A100 without probes and to the T4 with them.
"""

import math
from types import SimpleNamespace

import msgspec
import pytest

from loom.errors import InvalidInputError
from loom.model.capacity import NodeCapacity
from loom.model.learn import SpeedLearner
from loom.model.topology import load_topology
from loom.sched.cycle import CycleResult, Probing, Waiting, admission_check, run_cycle
from loom.sched.framework import DecisionRecord
from loom.sched.plugins.cost import default_economics
from loom.sched.probe import (
    PROBE_LABEL,
    PROBE_MODEL_LABEL,
    ProbeSettings,
    is_probe,
    plan_probes,
    probe_gate,
    probe_id,
)
from loom.sched.profile import build_framework
from loom.sched.snapshot import ClusterInfo, NetMatrix
from loom.sim.engine import simulate
from loom.sim.metrics import summarize
from loom.sim.model import Platform, SimJob, Trace
from loom.sim.policies import POLICIES
from loom.sim.truth import parse_truth
from loom_proto.jobs import Affinity, JobSpec, JobSubmitted, Resources, Work
from loom_services.placement.book import QueuedJob
from loom_services.placement.service import PlacementService
from tests.unit.test_cycle import Q
from tests.unit.test_framework import full_of_elastic_and_rigid, two_clusters

SETTINGS = ProbeSettings()
"""60 believed seconds a probe, for jobs believed to run at least 20 minutes; no job held."""
HOLD = ProbeSettings(hold_s=600.0)
"""The same, a job held while its family's probes run, at most 10 minutes."""


def long_job(
    job_id: str = "j", *, workers: int = 1, gpus: int = 1, family: str = "fam", **kw: object
) -> JobSpec:
    # Believed on the A100 (speed 3.0): 30,000 x 1 s / 3 = 10,000 s, long enough to be probed for.
    return JobSpec(
        job_id=job_id,
        tenant="t",
        workers=workers,
        resources=Resources(gpus=gpus, **kw.pop("resources", {})),  # type: ignore[arg-type]
        work=Work(steps=30_000, step_time_s=1.0),
        labels={"model": family, **kw.pop("labels", {})},  # type: ignore[dict-item]
        **kw,  # type: ignore[arg-type]
    )


# ---- which probes ---------------------------------------------------------------------------------


def test_a_long_job_of_a_new_family_asks_one_probe_per_gpu_model_sized_as_its_node_share() -> None:
    snap = two_clusters()  # 2 x 8 A100 on ca, 3 x 4 T4 on cb
    probes = plan_probes(long_job(workers=6), snap, set(), SETTINGS)
    by_model = {p.resources.gpu_models[0]: p for p in probes}
    assert sorted(by_model) == ["A100", "T4"]
    # As many GPUs as the job puts on one node: 6 on an 8-GPU A100 node, 4 on a 4-GPU T4 node.
    assert by_model["A100"].resources.gpus == 6 and by_model["T4"].resources.gpus == 4
    assert all(p.workers == 1 for p in probes)
    # 60 believed seconds of the job's steps at the believed speed of each model.
    assert by_model["A100"].work.steps == math.ceil(60 * 3.0 / 1.0)
    assert by_model["T4"].work.steps == math.ceil(60 * 0.5 / 1.0)
    for model, p in by_model.items():
        assert p.job_id == probe_id("fam", model) and p.tenant == "t"
        assert p.labels[PROBE_LABEL] == "j" and p.labels[PROBE_MODEL_LABEL] == model
        assert p.labels["model"] == "fam"  # the family's labels: it teaches the family's cell
        assert is_probe(p.labels)
    # One id per cell, whoever asks: a second job of the family asks the same probes.
    again = plan_probes(long_job("k", workers=2), snap, set(), SETTINGS)
    assert {p.job_id for p in again} == {p.job_id for p in probes}
    assert probe_id("fam", "T4") != probe_id("fam", "A100") != probe_id("other", "A100")


def test_no_probe_for_known_cells_short_jobs_probes_pipelines_or_a_single_allowed_model() -> None:
    snap = two_clusters()
    assert [
        p.resources.gpu_models[0] for p in plan_probes(long_job(), snap, {("fam", "A100")}, SETTINGS)
    ] == ["T4"]
    assert plan_probes(long_job(), snap, {("fam", "A100"), ("fam", "T4")}, SETTINGS) == []
    # Believed 20 min or shorter: 60 s of probing would be more than 5 % of its run.
    short = msgspec.structs.replace(
        long_job(), work=Work(steps=3_000, step_time_s=1.0)
    )  # 1,000 s on the A100
    assert plan_probes(short, snap, set(), SETTINGS) == []
    # One step believed longer than a probe may take on a T4 (120 s; 20 s on an A100): the T4 is
    # not probed, the A100 still is.
    slow_steps = msgspec.structs.replace(long_job(), work=Work(steps=3_000, step_time_s=60.0))
    assert [p.resources.gpu_models[0] for p in plan_probes(slow_steps, snap, set(), SETTINGS)] == ["A100"]
    probe = plan_probes(long_job(), snap, set(), SETTINGS)[0]
    assert plan_probes(probe, snap, set(), SETTINGS) == []
    # A job that names no family (its family is its task type, shared with unlike jobs).
    unnamed = msgspec.structs.replace(long_job(), labels={"team": "x"})
    assert plan_probes(unnamed, snap, set(), SETTINGS) == []
    only_t4 = long_job(resources={"gpu_models": ["T4"]})
    assert plan_probes(only_t4, snap, set(), SETTINGS) == []
    # A job kept to region r2 (the T4s) has one model it may use: nothing to choose between.
    assert plan_probes(long_job(affinity=Affinity(regions=["r2"])), snap, set(), SETTINGS) == []


def test_a_probe_keeps_to_where_its_job_may_run() -> None:
    snap = two_clusters()
    job = long_job(affinity=Affinity(avoid_clusters=["cx"], regions=["r1", "r2"]))
    probes = plan_probes(job, snap, set(), SETTINGS)
    assert len(probes) == 2
    for p in probes:
        assert p.affinity.regions == ["r1", "r2"] and p.affinity.avoid_clusters == ["cx"]


def test_a_probe_holds_whole_workers_with_their_cpu_and_memory_and_keeps_only_the_labels_that_matter() -> (
    None
):
    snap = two_clusters()  # 8-GPU A100 nodes, 4-GPU T4 nodes
    job = long_job(workers=3, gpus=3, resources={"cpu_milli": 4000, "memory_mib": 1000})
    job = msgspec.structs.replace(
        job, labels={"model": "fam", "batch": "64", "team": "vision", **{f"x{i}": "y" for i in range(62)}}
    )
    by_model = {p.resources.gpu_models[0]: p for p in plan_probes(job, snap, set(), SETTINGS)}
    # Two of its 3-GPU workers fit an 8-GPU A100 node, one a 4-GPU T4 node.
    assert by_model["A100"].resources.gpus == 6 and by_model["T4"].resources.gpus == 3
    assert by_model["A100"].resources.cpu_milli == 8000 and by_model["A100"].resources.memory_mib == 2000
    assert by_model["T4"].resources.cpu_milli == 4000
    for p in by_model.values():
        assert set(p.labels) == {"model", "batch", "team", PROBE_LABEL, PROBE_MODEL_LABEL}
        # A valid spec: it decodes as what it says (a job with 64 labels makes no 66-label probe).
        assert msgspec.json.decode(msgspec.json.encode(p), type=JobSpec) == p


def test_a_submitter_may_not_set_a_probes_labels() -> None:
    with pytest.raises(InvalidInputError, match=r"loom\.probe-of"):
        admission_check(long_job(labels={PROBE_LABEL: "x"}))
    admission_check(long_job())  # and an ordinary job passes


# ---- the hold -------------------------------------------------------------------------------------


def test_a_job_is_held_while_its_familys_probes_are_in_flight_and_no_longer_than_the_hold() -> None:
    snap = two_clusters()
    now = snap.now
    asked = probe_gate(long_job(), snap, known=set(), probing={}, queued_s=now, settings=HOLD)
    assert len(asked.probes) == 2 and asked.hold_s == HOLD.probe_s
    assert "waiting for speed probes of fam on A100, T4" in asked.reason
    # Asked already (known), still running: held, without asking again.
    cells = {("fam", "A100"), ("fam", "T4")}
    held = probe_gate(long_job(), snap, known=cells, probing={"fam": 2}, queued_s=now, settings=HOLD)
    assert held.probes == [] and held.hold_s == HOLD.probe_s
    # Near the end of its hold, only what is left of it.
    late = probe_gate(long_job(), snap, known=cells, probing={"fam": 2}, queued_s=now - 590, settings=HOLD)
    assert late.hold_s == pytest.approx(10.0)
    # Past the hold, or with its family's probes done, or another family's in flight: decided now.
    for queued_s, probing in ((now - 600, {"fam": 2}), (now, {}), (now, {"other": 1})):
        gate = probe_gate(long_job(), snap, known=cells, probing=probing, queued_s=queued_s, settings=HOLD)
        assert gate.hold_s is None and gate.probes == []
    # By default no job is held: the probes are asked, and the job decided at once.
    default = probe_gate(long_job(), snap, known=set(), probing={}, queued_s=now, settings=SETTINGS)
    assert len(default.probes) == 2 and default.hold_s is None


def test_settings_are_checked() -> None:
    for bad in ({"probe_s": 0.0}, {"max_share": 0.0}, {"max_share": 1.5}, {"hold_s": -1.0}):
        with pytest.raises(ValueError):
            ProbeSettings(**bad)  # type: ignore[arg-type]


# ---- in the cycle ---------------------------------------------------------------------------------


def test_the_cycle_asks_each_probe_once_and_holds_the_familys_jobs_while_others_are_placed() -> None:
    snap = two_clusters()
    learner = SpeedLearner()
    for model in ("A100", "T4"):
        learner.probe_asked("known", model)
    probing = Probing(HOLD, learner.known_cells(), {})
    queue = [Q(long_job("a")), Q(long_job("b")), Q(long_job("c", family="known"))]
    result = run_cycle(build_framework(), queue, snap, probing=probing)
    assert sorted(p.job_id for p in result.probes) == sorted([probe_id("fam", "A100"), probe_id("fam", "T4")])
    waiting = {w.pending.job.job_id: w for w in result.waiting}
    assert sorted(waiting) == ["a", "b"]
    assert "speed probes of fam" in waiting["a"].record.reason and waiting["a"].wake_in_s == HOLD.probe_s
    assert "speed probes of fam" in waiting["b"].record.reason
    # A job of a family with its cells known is decided in the same cycle.
    assert [p.pending.job.job_id for p in result.placed] == ["c"]
    # Held jobs are not decided: no try counts (their backoff starts when they are).
    assert all(w.held for w in result.waiting)
    # With its cells known and no probe in flight, a job is decided as before.
    for model in ("A100", "T4"):
        learner.probe_asked("fam", model)
    result = run_cycle(
        build_framework(), [Q(long_job("a"))], snap, probing=Probing(HOLD, learner.known_cells(), {})
    )
    assert [p.pending.job.job_id for p in result.placed] == ["a"] and not result.probes
    # By default the probes are asked and the family's jobs decided in the same cycle.
    fresh = SpeedLearner()
    result = run_cycle(
        build_framework(),
        [Q(long_job("d", family="other")), Q(long_job("e", family="other"))],
        two_clusters(),
        probing=Probing(SETTINGS, fresh.known_cells(), {}),
    )
    assert sorted(p.job_id for p in result.probes) == sorted(probe_id("other", m) for m in ("A100", "T4"))
    assert sorted(p.pending.job.job_id for p in result.placed) == ["d", "e"] and not result.waiting
    # Without probing, the cycle never holds a job for them.
    result = run_cycle(build_framework(), [Q(long_job("z", family="new"))], two_clusters())
    assert [p.pending.job.job_id for p in result.placed] == ["z"] and not result.probes


def test_the_learner_remembers_probed_cells_across_a_restart() -> None:
    learner = SpeedLearner()
    learner.probe_asked("fam", "T4")
    learner.observe("fam", "A100", prior_speed=3.0, observed_speed=1.0)
    assert learner.known_cells() == {("fam", "T4"), ("fam", "A100")}
    # Only the cell a run measured is measured: one asked for, with no run yet, is not.
    assert learner.measured_cells() == {("fam", "A100")}
    again = SpeedLearner.from_bytes(learner.to_bytes())
    assert again.known_cells() == learner.known_cells() and again.probed == {("fam", "T4")}
    assert again.measured_cells() == {("fam", "A100")}


# ---- in the simulator -----------------------------------------------------------------------------

EU = "aws-eu-central-1"


def a100_and_t4() -> Platform:
    nodes = [
        NodeCapacity(node="a0", cluster="c", region=EU, zone=f"{EU}-a", gpu_model="A100", gpus_total=8),
        NodeCapacity(node="t0", cluster="c", region=EU, zone=f"{EU}-a", gpu_model="T4", gpus_total=8),
    ]
    tasks = ("training_compute", "inference", "training_memory")
    return Platform(
        name="probe-test",
        nodes=nodes,
        clusters={"c": ClusterInfo(id="c", region=EU, zone=f"{EU}-a")},
        net=NetMatrix.from_topology(load_topology()),
        economics=default_economics(),
        speed={("A100", t): 3.0 for t in tasks} | {("T4", t): 0.5 for t in tasks},
        gpu_memory_gib={"A100": 80.0, "T4": 16.0},
    )


def t4_faster_truth() -> object:
    """Noise-free: ``fam`` runs on an A100 at the reference's speed and on a T4 at twice it."""
    cells = [
        {
            "family": "fam",
            "gpu_model": g,
            "precision": "fp32",
            "gpus_per_node": 1,
            "throughput": v,
            "series": "s",
        }
        for g, v in (("V100M16", 10.0), ("A100", 10.0), ("T4", 20.0))
    ]
    return parse_truth(
        {
            "format": "loom-truth",
            "version": 1,
            "cells": cells,
            "families": {"fam": {"task_type": "training_compute"}},
        }
    )


def test_probes_send_a_family_to_the_gpu_the_truth_favours_and_cost_what_they_ran() -> None:
    job = JobSpec(
        job_id="j", tenant="t", work=Work(steps=100_000, step_time_s=0.6), labels={"model": "fam"}
    )  # believed 20,000 s on the A100, 120,000 s on the T4; truly 60,000 and 30,000
    trace = Trace(jobs=[SimJob(spec=job, arrival_s=0.0)])
    truth = t4_faster_truth()
    without = POLICIES["loom"](0)
    without.probe = None  # type: ignore[attr-defined]
    (plain,) = simulate(trace, a100_and_t4(), without, truth=truth).records  # type: ignore[arg-type]
    assert plain.gpu_model == "A100" and plain.jct_s == pytest.approx(60_000)
    holding = POLICIES["loom"](0)
    holding.probe = HOLD  # type: ignore[attr-defined]
    result = simulate(trace, a100_and_t4(), holding, truth=truth)  # type: ignore[arg-type]
    (r,) = result.records
    probes = {p.gpu_model: p for p in result.probes}
    assert sorted(probes) == ["A100", "T4"] and all(p.job_class == "probe" for p in probes.values())
    # The A100 probe: 300 steps (60 believed s at speed 3, of 0.6 s each) of 0.6 true s; the T4: 50 of 0.3 s.
    assert probes["A100"].end_s - probes["A100"].start_s == pytest.approx(300 * 0.6)
    assert probes["T4"].end_s - probes["T4"].start_s == pytest.approx(50 * 0.3)
    # Held until the last probe ended, then sent where the probes measured it faster.
    assert r.gpu_model == "T4" and r.start_s == pytest.approx(probes["A100"].end_s)
    assert r.jct_s == pytest.approx(probes["A100"].end_s + 30_000)
    assert r.arrival_s == 0.0 and r.queue_s == pytest.approx(probes["A100"].end_s)
    # The probes are not jobs of the trace; the platform paid for them.
    overall = summarize(result)["overall"]
    assert overall["jobs"] == 1 and overall["probes"]["runs"] == 2
    probe_hours = (300 * 0.6 + 50 * 0.3) / 3600
    assert overall["probes"]["gpu_hours"] == pytest.approx(probe_hours)
    assert overall["gpu_hours"] == pytest.approx(30_000 / 3600 + probe_hours)


# ---- in placement's memory (the store and the bus: tests/integration/test_learned_speeds.py) -------


def test_placement_counts_a_probe_as_holding_until_its_first_decision_finds_no_room() -> None:
    ctx = SimpleNamespace(db=None, publisher=None, stats={}, nc=None, debug={})
    svc = PlacementService(ctx, topology=load_topology("small"))  # type: ignore[arg-type]
    spec = plan_probes(long_job(), two_clusters(), set(), SETTINGS)[0]
    probe = QueuedJob(JobSubmitted(**{f: getattr(spec, f) for f in spec.__struct_fields__}), {})
    parent = QueuedJob(JobSubmitted(**{f: getattr(long_job(), f) for f in JobSpec.__struct_fields__}), {})
    svc.queue = {probe.job.job_id: probe, parent.job.job_id: parent}
    assert svc._probes_in_flight() == {"fam": 1}  # asked, not yet decided: it holds
    record = DecisionRecord("j", 0.0, "waiting", "held", {}, [], {}, [])
    svc.capacity_changed = False
    # The parent held for it: no try counted, nothing to wake.
    svc._adopt_waiting(CycleResult(waiting=[Waiting(parent, record, 60.0, 60.0, held=True)]))
    assert parent.tries == 0 and not svc.capacity_changed
    # The probe's first decision found no room: it queues on, holds no one, and the jobs it held
    # are decided again at once.
    svc._adopt_waiting(CycleResult(waiting=[Waiting(probe, record, 0.25)]))
    assert probe.tries == 1 and svc.capacity_changed
    assert svc._probes_in_flight() == {}


def test_by_default_the_probes_teach_the_familys_next_job_and_the_first_goes_by_belief() -> None:
    first = JobSpec(
        job_id="j1", tenant="t", work=Work(steps=100_000, step_time_s=0.6), labels={"model": "fam"}
    )
    second = msgspec.structs.replace(first, job_id="j2")
    trace = Trace(jobs=[SimJob(spec=first, arrival_s=0.0), SimJob(spec=second, arrival_s=1_000.0)])
    result = simulate(trace, a100_and_t4(), POLICIES["loom"](0), truth=t4_faster_truth())  # type: ignore[arg-type]
    records = {r.job_id: r for r in result.records}
    assert sorted(p.gpu_model for p in result.probes) == ["A100", "T4"]
    # The first is decided at once, on the profile (the A100); the probes end by 180 s and teach the
    # second, which goes to the T4 the truth favours.
    assert records["j1"].gpu_model == "A100" and records["j1"].queue_s == 0.0
    assert records["j1"].jct_s == pytest.approx(60_000)
    assert records["j2"].gpu_model == "T4" and records["j2"].jct_s == pytest.approx(30_000)


def test_a_probe_runs_only_in_free_room_it_preempts_shrinks_and_claims_nothing() -> None:
    full = full_of_elastic_and_rigid
    vip = long_job("vip", workers=4, priority=500)
    probe = msgspec.structs.replace(
        vip, job_id=probe_id("fam", "A100"), labels={**vip.labels, PROBE_LABEL: "x"}
    )
    # An ordinary job of that priority gets room by shrinking the elastic job or preempting.
    outcome = build_framework().schedule(vip, full())
    assert outcome.decision is not None and (outcome.decision.shrunk or outcome.decision.victims)
    # A probe of the same shape and priority waits for room that is free.
    snap = full()
    outcome = build_framework().schedule(probe, snap)
    assert outcome.decision is None
    assert not outcome.record.victims and (snap.free == 0).all()
