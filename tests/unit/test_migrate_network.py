"""Network-driven rescheduling (pure): which jobs a link concerns, the decision's inputs, and the
decision on a degraded link: a long job moves, a nearly finished one stays, a moved one does not
bounce back inside its cool-down."""

import math

import msgspec
import pytest

from loom.migrate.benefit import LOCAL_PATH, MigrationSettings, RunningJobState, decide, link_trigger
from loom.migrate.network import (
    DegradedLinks,
    candidate_of,
    concerned_by_link,
    path_between,
    running_state,
    spans,
    users_of,
)
from loom_proto.jobs import Affinity, Communication, JobSpec, Resources, Work
from loom_proto.net import LinkState

WEU, SEA1, USE2 = "azure-westeurope", "gcp-asia-southeast1", "aws-us-east-2"


def _link(src: str, dst: str, rtt_ms: float, bandwidth_gbps: float = 1.0, loss: float = 0.0) -> LinkState:
    return LinkState(
        src=src,
        dst=dst,
        rtt_ms_p50=rtt_ms,
        rtt_ms_p95=rtt_ms,
        rtt_ms_p99=rtt_ms,
        jitter_ms=0.0,
        loss_rate=loss,
        bandwidth_gbps=bandwidth_gbps,
        cost=0.0,
        updated_at=0.0,
    )


def _spec(job_id: str, steps: int = 1000) -> JobSpec:
    return JobSpec(
        job_id=job_id,
        tenant="t1",
        workers=3,
        allow_multi_cluster=True,
        resources=Resources(gpus=2, gpu_models=["T4", "G2"]),
        work=Work(steps=steps, step_time_s=60.0, checkpoint_every_steps=10),
        comm=Communication(bytes_per_step=100_000_000, rounds_per_step=20),
    )


def test_a_job_spans_a_link_when_it_has_parts_at_both_ends_either_way() -> None:
    assert spans({WEU, SEA1}, WEU, SEA1) and spans({WEU, SEA1}, SEA1, WEU)
    assert not spans({WEU}, WEU, SEA1)
    assert not spans({WEU, USE2}, WEU, SEA1)
    assert not spans({WEU}, WEU, WEU)


def test_a_link_concerns_the_jobs_over_it_and_inference_served_across_it_from_its_users() -> None:
    assert concerned_by_link({WEU, SEA1}, WEU, SEA1)  # talks over it
    assert concerned_by_link({WEU}, WEU, SEA1, users=[SEA1])  # serves SEA1's users from WEU
    assert concerned_by_link({WEU}, SEA1, WEU, users=[SEA1, USE2])
    assert not concerned_by_link({WEU}, WEU, SEA1, users=[WEU])  # its users are where it runs
    assert not concerned_by_link({WEU}, WEU, USE2, users=[SEA1])  # another link
    assert not concerned_by_link({USE2}, WEU, SEA1, users=[SEA1])  # neither end is where it runs
    assert not concerned_by_link({WEU}, WEU, WEU, users=[WEU])
    inference = JobSpec(
        job_id="i",
        tenant="t",
        task_type="inference",
        affinity=Affinity(prefer_regions=[SEA1]),
        work=Work(steps=1),
    )
    training = msgspec.structs.replace(inference, task_type="training")
    assert users_of(inference) == (SEA1,) and users_of(training) == ()


def test_the_path_is_local_in_one_region_else_the_measured_link_either_direction() -> None:
    links = {(WEU, USE2): _link(WEU, USE2, 90.0, 2.0, 0.02)}
    assert path_between(links, WEU, WEU) == LOCAL_PATH
    there = path_between(links, WEU, USE2)
    back = path_between(links, USE2, WEU)
    assert there is not None and there == back
    assert (there.rtt_ms, there.bandwidth_gbps) == (90.0, 2.0) and math.isclose(there.loss_rate, 0.02)
    assert path_between(links, WEU, SEA1) is None


def test_the_running_state_reads_progress_checkpoints_and_history() -> None:
    job = running_state(
        _spec("a"),
        attempt=2,
        progress=0.25,
        cluster="c-weu-a",
        region=WEU,
        step_s=80.0,
        checkpoint_step=240,
        moves=1,
        last_moved_s=100.0,
    )
    assert job.job_class == "network_training"
    assert (job.steps_done, job.steps_left, job.last_checkpoint_step) == (250.0, 750.0, 240)
    assert job.checkpoint_bytes == 8e8 and job.attempt == 2 and job.moves == 1
    assert math.isinf(
        running_state(
            _spec("b"),
            attempt=1,
            progress=0,
            cluster="c",
            region=WEU,
            step_s=0.0,
            checkpoint_step=None,
            moves=0,
            last_moved_s=None,
        ).step_s
    )


def test_a_missing_candidate_means_no_placement_elsewhere() -> None:
    assert candidate_of(None) is None
    assert candidate_of({"cluster": "c", "region": USE2, "step_s": None}) is None
    c = candidate_of({"cluster": "c-use2-a", "region": USE2, "step_s": 70.0, "start_after_s": 5.0})
    assert c is not None and (c.cluster, c.step_s, c.start_after_s) == ("c-use2-a", 70.0, 5.0)


def test_on_a_link_degraded_five_fold_the_long_job_moves_the_nearly_done_one_stays_and_none_bounces() -> None:
    baseline, degraded = _link(WEU, SEA1, 160.0), _link(WEU, SEA1, 800.0)
    settings = MigrationSettings()
    base_path, now_path = (
        path_between({(WEU, SEA1): baseline}, WEU, SEA1),
        path_between({(WEU, SEA1): degraded}, WEU, SEA1),
    )
    assert base_path is not None and now_path is not None
    assert link_trigger(base_path, now_path, settings) == "link_degraded"
    # Step over the degraded link: 60 s compute + 2 x 0.8 Gb at 1 Gb/s + 20 rounds x 0.8 s.
    step_here = 60.0 + 1.6 + 16.0
    target = candidate_of({"cluster": "c-use2-a", "region": USE2, "step_s": 61.0})
    path = path_between({(WEU, USE2): _link(WEU, USE2, 90.0)}, WEU, USE2)
    assert target is not None and path is not None

    def state(
        job_id: str, progress: float, last_moved_s: float | None = None, moves: int = 0
    ) -> RunningJobState:
        return running_state(
            _spec(job_id),
            attempt=1,
            progress=progress,
            cluster="c-weu-a",
            region=WEU,
            step_s=step_here,
            checkpoint_step=None,
            moves=moves,
            last_moved_s=last_moved_s,
        )

    long = decide(state("long", 0.1), target, path, now_s=1000.0, trigger="link_degraded")
    done = decide(state("done", 0.998), target, path, now_s=1000.0, trigger="link_degraded")
    assert long.cost is not None
    assert long.move and long.gain_s > long.threshold_s > long.cost.total_s
    assert not done.move and done.gain_s < done.threshold_s
    assert "stays" in done.reason and "gain" in done.reason
    # Moved 10 s ago: even a large gain does not bring it back inside the cool-down.
    back = decide(
        state("long", 0.2, last_moved_s=990.0, moves=1),
        target,
        path,
        now_s=1000.0,
        trigger="link_improved",
    )
    assert not back.move and "cool-down" in back.reason


def test_degraded_links_are_due_for_a_recheck_every_recheck_s_until_both_directions_recover() -> None:
    links = DegradedLinks(recheck_s=30.0)
    assert links.next_due() is None and links.due(1_000.0) == []
    assert links.degraded("a", "b", 100.0) is True  # a new degradation: reviewed now
    assert links.degraded("b", "a", 110.0) is False  # the other direction of the same pair
    assert DegradedLinks.pair("b", "a") in links and len(links) == 1
    assert links.next_due() == 130.0
    assert links.due(129.9) == []
    assert links.due(130.0) == [frozenset({"a", "b"})]
    assert links.due(140.0) == []  # counted as reviewed at 130
    assert links.next_due() == 160.0
    assert links.recovered("a", "b") is False  # b -> a is still degraded
    assert links.due(160.0) == [frozenset({"a", "b"})]
    assert links.recovered("b", "a") is True
    assert links.recovered("b", "a") is False  # idempotent
    assert links.due(10_000.0) == [] and links.next_due() is None and list(links) == []


def test_degraded_links_refuse_a_recheck_period_that_is_not_positive() -> None:
    with pytest.raises(ValueError, match="recheck_s"):
        DegradedLinks(recheck_s=0.0)
