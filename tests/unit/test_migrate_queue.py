"""The queue a move would deprive (loom.migrate.queue): one rule for placement's what-if, which the
migration service reads, and the simulator's migrator."""

import json
import math
import time

import msgspec
import numpy as np
import pytest

from loom.migrate.benefit import QueuedOption, displacement_s
from loom.migrate.queue import options_from_wire, options_to_wire, queued_options
from loom.sched.snapshot import QueuedShape
from loom_proto.jobs import JobSpec, JobSubmitted, Resources, Work
from loom_services.placement.book import QueuedJob
from tests.unit.test_contention import FAST, SLOW, node, running, snapshot
from tests.unit.test_cycle_service_vs_sim import service


def spec(job_id: str, gpus: int, workers: int = 1, steps: int = 1000) -> JobSpec:
    return JobSpec(
        job_id=job_id,
        tenant="a",
        priority=100,
        resources=Resources(gpus=gpus),
        workers=workers,
        work=Work(steps=steps, step_time_s=10.0),
    )


def shape(
    job: JobSpec, pools: list[tuple[int, int]], n_clusters: int = 2, n_models: int = 2, *, rank: int = 0
) -> QueuedShape:
    allowed = np.zeros((n_clusters, n_models), dtype=bool)
    for c, m in pools:
        allowed[c, m] = True
    work_s = float(job.work.steps) * job.work.step_time_s
    return QueuedShape(
        job.job_id, (rank, job.job_id), max(job.workers, 1), job.resources.gpus, allowed, job, work_s
    )


def test_only_waiting_jobs_the_target_pool_could_hold_are_counted_with_runs_there_and_elsewhere() -> None:
    snap = snapshot(
        [node("a0", "ca", used=8), node("b0", "cb", model=SLOW)],
        [running("r1", ("a0", 8), ends_in_s=100.0)],
    )
    ca, cb = snap.cluster_index["ca"], snap.cluster_index["cb"]
    fast, slow = snap.model_index[FAST], snap.model_index[SLOW]
    fits = spec("fits", 4)
    too_big = spec("too-big", 4, workers=3)  # 12 GPUs: more than the 8 the target pool has
    elsewhere_only = spec("elsewhere-only", 2)
    not_waiting = spec("not-waiting", 1)
    snap.queued["fits"] = shape(fits, [(ca, fast), (cb, slow)])
    snap.queued["too-big"] = shape(too_big, [(ca, fast)])
    snap.queued["elsewhere-only"] = shape(elsewhere_only, [(cb, slow)])
    snap.queued["not-waiting"] = shape(not_waiting, [(ca, fast)])
    snap.queued["mover"] = shape(spec("mover", 1), [(ca, fast)])
    snap.waiting = {"fits", "too-big", "elsewhere-only", "mover"}

    options = queued_options(snap, "mover", "ca", FAST, taken_gpus=6)

    assert [o.job_id for o in options] == ["fits"]
    (o,) = options
    assert o.steps_left * o.step_target_s == 10_000.0 / 3.0  # its work at the fast GPUs' speed (3)
    assert o.steps_left * o.step_elsewhere_s == 10_000.0  # on the slow pool (speed 1)
    assert o.wait_free_s == 100.0  # the running job's end frees the pool
    assert o.wait_taken_s == math.inf  # the move's 6 GPUs leave it no room at any known release
    # Read by the rule: a voluntary move there pays the queue's loss (the job's room comes later).
    assert displacement_s(options, held_s=3_600.0) > 0.0
    assert queued_options(snap, "mover", "nowhere", FAST, taken_gpus=4) == []
    snap.waiting = set()
    assert queued_options(snap, "mover", "ca", FAST, taken_gpus=4) == []


def test_options_cross_the_wire_unchanged_and_malformed_ones_read_as_no_queue() -> None:
    options = [QueuedOption("q", 1.0, 20.0, math.inf, wait_free_s=5.0)]
    strict = json.dumps(options_to_wire(options), allow_nan=False)  # no Infinity: any client reads it
    assert options_from_wire(json.loads(strict)) == options
    assert options_from_wire(None) == []
    assert options_from_wire({"job_id": "q"}) == []
    assert options_from_wire([{"job_id": "q", "steps_left": "many"}]) == []


def _queued_job(job: JobSpec, at: float) -> QueuedJob:
    fields = {f: getattr(job, f) for f in JobSpec.__struct_fields__}
    return QueuedJob(JobSubmitted(**fields, submitted_at=at), {})


def test_placements_what_if_answers_the_queue_the_candidate_would_deprive() -> None:
    """The migration service's candidate comes with the waiting jobs its pool could hold, as the
    simulator's migrator counts them on the same snapshot: the benefit rule's queue's loss."""
    svc = service()
    now = time.time()
    jobs = [spec("r", 1), spec("f", 4, workers=7), spec("g", 4, workers=3), spec("w", 4, workers=3)]
    considered = [_queued_job(j, now) for j in jobs]
    svc._commit(svc._decide(considered, now=now, grow=False), considered)
    assert "r" in svc.book.runs and svc.queue, "one job waits behind the others"
    (waiting,) = svc.queue

    answer = svc._whatif(svc.book.runs["r"], ["c-sea1-a", "c-weu-a"])

    candidate = answer["candidate"]
    assert candidate is not None and candidate["cluster"] == "c-use2-a"
    queued = options_from_wire(json.loads(json.dumps(answer))["candidate"]["queued"])
    assert [o.job_id for o in queued] == [waiting]
    # The same rule on the same snapshot (the run's GPUs held, as in the simulator's look).
    snap = svc.book.snapshot(time.time())
    by_model = {m: queued_options(snap, "r", "c-use2-a", m, taken_gpus=1) for m in ("G2", "V100M32")}
    same = by_model["G2"]  # the candidate's pool: the only one that can hold the waiting job
    assert by_model["V100M32"] == []
    assert [(o.job_id, o.step_target_s, o.step_elsewhere_s) for o in same] == [
        (o.job_id, o.step_target_s, o.step_elsewhere_s) for o in queued
    ]
    assert [o.wait_free_s for o in same] == pytest.approx([o.wait_free_s for o in queued], abs=5.0)


def test_the_first_waiting_jobs_in_queue_order_are_counted_up_to_the_limit() -> None:
    """The GPUs a move takes would go to the first waiting job that fits: the front of the queue
    (its keys' order, not the ids'), at most ``limit`` of it."""
    snap = snapshot([node("a0", "ca", used=8)], [running("r1", ("a0", 8), ends_in_s=100.0)])
    ca, fast = snap.cluster_index["ca"], snap.model_index[FAST]
    for rank, job_id in enumerate(["z-first", "m-second", "a-third"]):
        snap.queued[job_id] = shape(spec(job_id, 2), [(ca, fast)], n_clusters=1, n_models=1, rank=rank)
    snap.waiting = {"z-first", "m-second", "a-third"}
    assert [o.job_id for o in queued_options(snap, "mover", "ca", FAST, 4)] == [
        "z-first",
        "m-second",
        "a-third",
    ]
    assert [o.job_id for o in queued_options(snap, "mover", "ca", FAST, 4, limit=2)] == [
        "z-first",
        "m-second",
    ]


def test_a_moves_next_attempt_avoids_what_it_asks_and_a_failures_adds_to_what_was_avoided() -> None:
    from loom.sched.cycle import requeue_avoid

    carried = frozenset({"c-failed"})  # an earlier start failed there
    assert requeue_avoid("migrated", ["c-left"], carried) == {"c-left"}
    assert requeue_avoid("start_failed", ["c-left"], carried) == {"c-left", "c-failed"}
    assert requeue_avoid("start_timeout", [], carried) == {"c-failed"}


def test_placements_what_if_times_an_inference_step_with_its_users_round_trip_at_both_ends() -> None:
    """An inference job answers its users each step (the simulator times it so, the jct plugin
    scores it so): the what-if's step here and there include the mean round trip from its users,
    so a degraded link to them is a reason to move it, in the service as in the simulator (before,
    the migration service saw no difference and never moved such a job)."""
    from loom.sched.plugins.network import predict_step_s, users_wait_s
    from loom_proto.jobs import Affinity

    svc = service()
    now = time.time()
    users = "gcp-asia-southeast1"
    job = JobSpec(
        job_id="serve",
        tenant="a",
        task_type="inference",
        resources=Resources(gpus=1),
        affinity=Affinity(prefer_regions=[users]),
        work=Work(steps=1000, step_time_s=0.05),
    )
    considered = [_queued_job(job, now)]
    svc._commit(svc._decide(considered, now=now, grow=False), considered)
    run = svc.book.runs["serve"]
    here_cluster = run.parts[0][0]
    answer = svc._whatif(run, [here_cluster])
    snap = svc.book.snapshot(time.time())
    region = answer["current"]["regions"][0]
    wait = users_wait_s(job, region, snap.net)
    assert wait == pytest.approx(snap.net.link(users, region)[0] / 1000.0)
    speed = snap.job_gpu_speed(job, run.parts[0][1]) * float(snap.trust[snap.cluster_index[here_cluster]])
    bare = predict_step_s(job, speeds=[speed], regions=[region], net=snap.net, workers=run.workers).step_s
    assert answer["current"]["step_s"] == pytest.approx(bare + wait)
    candidate = answer["candidate"]
    assert candidate is not None and candidate["cluster"] != here_cluster
    there_wait = users_wait_s(job, candidate["region"], snap.net)
    assert there_wait == pytest.approx(snap.net.link(users, candidate["region"])[0] / 1000.0)
    # Placed next to its users; the candidate away from them pays their round trip on every step.
    assert region == users and there_wait > 100 * wait
    assert candidate["step_s"] > there_wait
    training = msgspec.structs.replace(job, task_type="training")
    assert users_wait_s(training, region, snap.net) == 0.0
