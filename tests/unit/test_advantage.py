"""Comparative advantage: while other jobs wait, a GPU model goes to the jobs it speeds up most
(the active jobs' relative speeds set each model's going rate), and the default profile acts on it."""

import numpy as np
import pytest

from loom.model.capacity import NodeCapacity
from loom.sched.framework import Candidates, CycleState
from loom.sched.plugins.advantage import ADVANTAGE_CAP, ComparativeAdvantage, going_rate
from loom.sched.profile import build_framework
from loom.sched.snapshot import NetMatrix, QueuedShape, RunningJob, Snapshot
from loom_proto.jobs import JobSpec, Resources, Work

NOW = 1000.0
FAST, SLOW = "A100", "T4"


def node(name: str, cluster: str, model: str, gpus: int = 8, used: int = 0) -> NodeCapacity:
    return NodeCapacity(
        node=name,
        cluster=cluster,
        region="r1",
        zone="r1-a",
        gpu_model=model,
        gpus_total=gpus,
        gpus_reserved=used,
    )


def job(job_id: str, family: str, gpus: int = 4) -> JobSpec:
    return JobSpec(
        job_id=job_id,
        tenant="t",
        resources=Resources(gpus=gpus),
        work=Work(steps=1000, step_time_s=1.0),
        labels={"family": family},
    )


def run(job_id: str, family: str, node_name: str, gpus: int) -> RunningJob:
    return RunningJob(
        job_id=job_id,
        tenant="t",
        priority=100,
        cluster="ca",
        gpu_model=FAST,
        allocations=((node_name, gpus),),
        labels={"family": family},
        expected_end_s=NOW + 3600.0,
    )


def platform(runs: list[RunningJob] = ()) -> Snapshot:  # type: ignore[assignment]
    """An A100 cluster (5x a T4 by the profile) and a T4 cluster; the "yolo" family is learned to
    get only 1.25x a T4 on the A100 (so 0.8 relative on the T4), the "cnn" family gets the
    profile's 5x (0.2 relative on the T4); runs measured both families on both models."""
    nodes = [
        node("a0", "ca", FAST, used=sum(r.gpus for r in runs)),
        node("a1", "ca", FAST),
        node("t0", "ct", SLOW, gpus=16),
    ]
    speed = {(FAST, "training_compute"): 5.0, (SLOW, "training_compute"): 1.0}
    snap = Snapshot(nodes, net=NetMatrix(["r1"]), speed=speed, now=NOW, running=list(runs))
    measured = [(family, model) for family in ("yolo", "cnn") for model in (FAST, SLOW)]
    snap.set_learned({("yolo", FAST): 0.25}, measured)
    return snap


def wait_for(snap: Snapshot, spec: JobSpec, only: str | None = None) -> None:
    """``spec`` waits in the queue for any pool, or those of model ``only`` (as the framework records
    a job nothing fits)."""
    pools = np.ones((len(snap.clusters), len(snap.models)), dtype=bool)
    if only is not None:
        pools[:] = False
        pools[:, snap.model_index[only]] = True
    snap.waiting.add(spec.job_id)
    snap.queued[spec.job_id] = QueuedShape(
        job_id=spec.job_id,
        key=(0,),
        workers=spec.workers,
        per_worker=spec.resources.gpus,
        pools=pools,
        job=spec,
        work_s=1000.0,
    )


def test_the_going_rate_is_the_active_jobs_relative_speed_weighted_by_their_gpus() -> None:
    snap = platform([run("r", "cnn", "a0", 8)])
    wait_for(snap, job("w", "yolo", gpus=4))
    rate, demand = going_rate(snap)
    a100, t4 = snap.model_index[FAST], snap.model_index[SLOW]
    assert demand[a100] == pytest.approx(12.0) and demand[t4] == pytest.approx(12.0)
    # 8 GPUs at 0.2 on the T4 and 4 at 0.8 (a yolo job's T4 is 0.8 of its A100).
    assert rate[t4] == pytest.approx((8 * 0.2 + 4 * 0.8) / 12)
    assert rate[a100] == pytest.approx(1.0)
    # Leaving the waiting job out leaves the running one alone.
    rate_without, demand_without = going_rate(snap, exclude="w")
    assert rate_without[t4] == pytest.approx(0.2) and demand_without[t4] == pytest.approx(8.0)


def test_a_waiting_job_counts_only_on_the_models_its_rules_allow() -> None:
    snap = platform()
    wait_for(snap, job("w", "cnn"), only=SLOW)
    rate, demand = going_rate(snap)
    assert demand[snap.model_index[FAST]] == 0.0 and rate[snap.model_index[FAST]] == 1.0
    # Its fastest allowed model is the T4: relative 1 there.
    assert demand[snap.model_index[SLOW]] == 4.0 and rate[snap.model_index[SLOW]] == pytest.approx(1.0)


def test_the_sums_kept_within_a_cycle_follow_runs_appended_and_the_queue() -> None:
    snap = platform([run("r", "cnn", "a0", 8)])
    wait_for(snap, job("w", "yolo"))
    shared: dict[object, object] = {}
    first = going_rate(snap, shared=shared)
    snap.running.append(run("r2", "yolo", "a1", 8))
    wait_for(snap, job("w2", "cnn", gpus=2))
    kept = going_rate(snap, shared=shared)
    fresh = going_rate(snap)
    assert not np.allclose(first[0], fresh[0])
    np.testing.assert_allclose(kept[0], fresh[0])
    np.testing.assert_allclose(kept[1], fresh[1])
    # A run that ends replaces the list: the kept sums are rebuilt, not left counting it.
    snap.running = [r for r in snap.running if r.job_id != "r"]
    np.testing.assert_allclose(going_rate(snap, shared=shared)[0], going_rate(snap)[0])


def scores(snap: Snapshot, spec: JobSpec) -> dict[str, float]:
    """The plugin's normalised score of each model, both pools candidates."""
    plugin = ComparativeAdvantage()
    state = CycleState(
        job=spec,
        snapshot=snap,
        cluster_mask=np.ones(len(snap.clusters), dtype=bool),
        model_mask=np.ones(len(snap.models), dtype=bool),
    )
    models = np.array([snap.model_index[FAST], snap.model_index[SLOW]])
    clusters = np.array([snap.cluster_index["ca"], snap.cluster_index["ct"]])
    candidates = Candidates(
        cluster=clusters,
        model=models,
        capacity=np.ones(2, dtype=np.int64),
        workers=np.ones(2, dtype=np.int64),
        nodes=lambda c, m: (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)),
    )
    normalised = plugin.normalize(state, plugin.score(state, candidates))
    return {FAST: float(normalised[0]), SLOW: float(normalised[1])}


def test_with_nobody_waiting_it_has_no_say() -> None:
    snap = platform([run("r", "cnn", "a0", 8)])
    assert scores(snap, job("y", "yolo")) == {FAST: 100.0, SLOW: 100.0}


def test_while_others_wait_a_job_that_loses_less_on_the_slow_model_scores_it_higher() -> None:
    snap = platform([run("r", "cnn", "a0", 8)])
    wait_for(snap, job("w", "cnn"))
    yolo = scores(snap, job("y", "yolo"))
    # yolo: 0.8 on the T4 against the others' 0.2 (capped at 4x), 1 on the A100 like them.
    assert yolo[SLOW] == 100.0 and yolo[FAST] == pytest.approx(100.0 / ADVANTAGE_CAP)
    # A job like the others is indifferent.
    assert scores(snap, job("c", "cnn")) == {FAST: pytest.approx(100.0), SLOW: pytest.approx(100.0)}


def test_a_ratio_no_run_of_the_family_measured_on_every_candidate_model_has_no_say() -> None:
    snap = platform([run("r", "cnn", "a0", 8)])
    wait_for(snap, job("w", "cnn"))
    # The same factors, but the yolo family was never measured on the T4 (its factor there shared
    # from other cells, or the profile's): the ratio is no ground to send it there.
    snap.set_learned(dict(snap.learned), [("yolo", FAST), ("cnn", FAST), ("cnn", SLOW)])
    assert scores(snap, job("y", "yolo")) == {FAST: 100.0, SLOW: 100.0}
    snap.set_learned(dict(snap.learned))  # None keeps the measured cells
    assert ("yolo", SLOW) not in snap.measured and ("cnn", SLOW) in snap.measured


def test_the_default_profile_gives_the_fast_gpus_to_the_job_they_speed_up_most_while_others_wait() -> None:
    framework = build_framework()
    # Nobody waits: the yolo job takes the A100s, its fastest (1.25x).
    alone = framework.schedule(job("y", "yolo"), platform([run("r", "cnn", "a0", 8)]), submitted_at=NOW)
    assert alone.decision is not None and alone.decision.parts[0].gpu_model == FAST
    # A cnn job waits (5x on the A100): the yolo job leaves the A100s to such jobs ...
    busy = platform([run("r", "cnn", "a0", 8)])
    wait_for(busy, job("w", "cnn", gpus=16))
    placed = framework.schedule(job("y", "yolo"), busy, submitted_at=NOW)
    assert placed.decision is not None and placed.decision.parts[0].gpu_model == SLOW
    # ... while a cnn job, which loses 5x on a T4, still takes the A100s.
    busy_again = platform([run("r", "cnn", "a0", 8)])
    wait_for(busy_again, job("w", "cnn", gpus=16))
    cnn = framework.schedule(job("c", "cnn"), busy_again, submitted_at=NOW)
    assert cnn.decision is not None and cnn.decision.parts[0].gpu_model == FAST


def test_a_model_no_other_job_may_use_is_scored_by_the_jobs_own_speed_there() -> None:
    # Nothing runs; the one waiting gang may use the A100s only, so nobody else wants the T4s.
    snap = platform()
    wait_for(snap, job("w", "cnn", gpus=16), only=FAST)
    # A cnn job loses 5x on the T4: that nobody else wants the T4s is no reason to send it there.
    cnn = scores(snap, job("c", "cnn"))
    assert cnn[FAST] == 100.0 and cnn[SLOW] == pytest.approx(20.0)


def test_relative_speeds_are_against_the_jobs_fastest_allowed_model_even_when_it_is_full() -> None:
    snap = platform([run("r", "cnn", "a0", 8)])
    wait_for(snap, job("w", "cnn"))
    plugin = ComparativeAdvantage()
    spec = job("y", "yolo")
    state = CycleState(
        job=spec,
        snapshot=snap,
        cluster_mask=np.ones(len(snap.clusters), dtype=bool),
        model_mask=np.ones(len(snap.models), dtype=bool),
    )
    # Only the T4s are candidates (the A100s full): the yolo job's relative speed there is still
    # 0.8 of its A100's, not 1.
    only_t4 = Candidates(
        cluster=np.array([snap.cluster_index["ct"]]),
        model=np.array([snap.model_index[SLOW]]),
        capacity=np.ones(1, dtype=np.int64),
        workers=np.ones(1, dtype=np.int64),
        nodes=lambda c, m: (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)),
    )
    rate, _ = going_rate(snap, exclude="y")
    raw = plugin.score(state, only_t4)
    assert raw[0] == pytest.approx(min(0.8 / rate[snap.model_index[SLOW]], ADVANTAGE_CAP))
