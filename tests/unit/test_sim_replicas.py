"""Checkpoint replicas in the simulator (``loom.sim.replicas``): a failed cluster's job resumes from
the newest replica that was copied in time, with the migration service's core."""

from typing import Any

import pytest
from test_sim_migration import platform

from loom.sim.engine import simulate
from loom.sim.migration import MigrationPolicy
from loom.sim.model import SimEvent, SimJob, Trace
from loom.sim.policies import POLICIES
from loom.sim.truth import BELIEF
from loom_proto.jobs import Affinity, JobSpec, Resources, Work

EU = "aws-eu-central-1"
US = "aws-us-east-2"
EVERY = 100
FAIL_S = 600.0


def simulated(checkpoint_bytes: float, *, steps: int, replicas: bool = True, every: int = EVERY) -> Any:
    """One 8-GPU job of ``steps`` 0.5 s steps on the EU cluster (the US one is busy-free but slower
    to reach); the EU cluster fails at 600 s. The simulation's result."""
    plat = platform({"eu": (EU, "H100", 1), "us": (US, "H100", 1)})
    spec = JobSpec(
        job_id="j",
        tenant="t",
        resources=Resources(gpus=8),
        work=Work(steps=steps, step_time_s=0.5, checkpoint_every_steps=every),
        labels={"checkpoint_bytes": f"{checkpoint_bytes:g}"},
        affinity=Affinity(prefer_regions=[EU]),
    )
    events = [SimEvent(at_s=FAIL_S, kind="cluster_down", cluster="eu")]
    policy = MigrationPolicy("never") if replicas else MigrationPolicy("never", replicas=None)
    result = simulate(
        Trace(jobs=[SimJob(spec=spec, arrival_s=0.0)], events=events),
        plat,
        POLICIES["loom"](0),
        truth=BELIEF,
        migration=policy,
    )
    assert result.migration is not None
    return result


def run(checkpoint_bytes: float, *, replicas: bool) -> tuple[dict[str, Any], float]:
    """A 20,000-step job, still running at the failure: the migration figures and the job's end."""
    result = simulated(checkpoint_bytes, steps=20_000, replicas=replicas)
    record = result.records[0]
    assert record.clusters == ("us",) and record.end_s is not None
    return result.migration, record.end_s


def test_a_small_checkpoint_is_replicated_in_time_and_resumed_from_another_region() -> None:
    mig, end = run(1e6, replicas=True)
    rep = mig["replicas"]
    assert rep["copies"] > 1 and rep["full_copies"] == 1  # then deltas onto the US replica
    assert rep["resumed_from_replica"] == 1 and rep["resumed_from_zero"] == 0
    assert rep["steps_behind"] <= EVERY  # at most the checkpoint whose copy was still in flight
    ideal, ideal_end = run(1e6, replicas=False)
    assert ideal["replicas"] is None
    assert mig["lost_steps"] == pytest.approx(ideal["lost_steps"] + rep["steps_behind"])
    assert end >= ideal_end


def test_a_run_that_writes_no_checkpoints_restarts_from_step_0_when_its_cluster_fails() -> None:
    # The simulator's own speed probes write none: `loom bench migration` stopped with a
    # ZeroDivisionError when a failed cluster ran one.
    result = simulated(1e6, steps=20_000, every=0)
    rep = result.migration["replicas"]
    assert rep["resumed_from_zero"] == 1 and rep["copies"] == 0
    assert result.records[0].clusters == ("us",) and result.records[0].end_s is not None


def test_a_checkpoint_too_big_to_copy_before_the_failure_restarts_from_step_0() -> None:
    # 1 TB over a 0.1-1 Gbps WAN link: hours, the cluster fails after 600 s.
    mig, end = run(1e12, replicas=True)
    rep = mig["replicas"]
    assert rep["copies"] == 1 and rep["resumed_from_zero"] == 1 and rep["resumed_from_replica"] == 0
    assert rep["lost_copies"] == 1  # its source failed mid-copy
    assert rep["steps_behind"] >= EVERY
    ideal, ideal_end = run(1e12, replicas=False)
    # Every step done before the failure is redone; the ideal replica loses under one interval.
    assert ideal["lost_steps"] < EVERY < mig["lost_steps"]
    assert mig["lost_steps"] == pytest.approx(ideal["lost_steps"] + rep["steps_behind"])
    assert end > ideal_end


def test_a_copy_under_way_when_its_job_ends_is_stopped_and_a_failure_after_it_finds_nothing_to_lose() -> None:
    # A job of ~460 s with a 1 TB checkpoint: its first copy (from the sample at 300 s) takes
    # hours, and the job ends while it is under way; then its cluster fails. Before, the ended
    # job's replica record was rewritten as finished while its copy still named the old one, and
    # the failure's bookkeeping of copies lost raised "list.remove(x): x not in list" (held-out
    # seed 44 of loom bench migration, wide32, load 0.5, failure).
    result = simulated(1e12, steps=10_000)
    rep = result.migration["replicas"]
    record = result.records[0]
    assert record.clusters == ("eu",) and record.end_s is not None and record.end_s < FAIL_S
    assert rep["copies"] == 1 and rep["cancelled_copies"] == 1 and rep["lost_copies"] == 0


@pytest.mark.parametrize(("checkpoint_bytes", "abroad"), [(1e9, True), (20e9, False)])
def test_a_replica_goes_abroad_only_where_its_copies_keep_up_with_the_checkpoints(
    checkpoint_bytes: float, abroad: bool
) -> None:
    """The migration service judges a target by the job's checkpoint interval and keeps replicas
    in the region when another region's copies would lag behind; the simulator passed no interval,
    so a 20 GB checkpoint every ~8 s was copied to the US (23 copies, 460 GB across regions) where
    the service keeps it in the EU (192 copies, none across regions)."""
    plat = platform({"eu": (EU, "H100", 1), "eu2": (EU, "H100", 1), "us": (US, "H100", 1)})
    spec = JobSpec(
        job_id="j",
        tenant="t",
        resources=Resources(gpus=8),
        work=Work(steps=20_000, step_time_s=0.5, checkpoint_every_steps=EVERY),
        labels={"checkpoint_bytes": f"{checkpoint_bytes:g}"},
        affinity=Affinity(clusters=["eu"]),
    )
    result = simulate(
        Trace(jobs=[SimJob(spec=spec, arrival_s=0.0)], events=[]),
        plat,
        POLICIES["loom"](0),
        truth=BELIEF,
        migration=MigrationPolicy("never"),
    )
    assert result.migration is not None
    assert (result.records[0].cross_region_bytes > 0) is abroad
    assert result.migration["replicas"]["copies"] > 100  # every checkpoint's copy, or nearly


def test_copies_in_flight_never_pass_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    # The migration service copies at most `replica_concurrency` (8) at once, jobs with no replica
    # first; the simulator started one per job at once, without a cap.
    from loom.migrate.replicas import ReplicaSettings
    from loom.sim.replicas import SimReplicas

    plat = platform({"eu": (EU, "H100", 2), "us": (US, "H100", 2)})
    jobs = [
        SimJob(
            spec=JobSpec(
                job_id=f"j{n:02d}",
                tenant="t",
                resources=Resources(gpus=1),
                work=Work(steps=20_000, step_time_s=0.5, checkpoint_every_steps=EVERY),
                labels={"checkpoint_bytes": "5e10"},  # 50 GB: a copy to another region takes minutes
                affinity=Affinity(prefer_regions=[EU]),
            ),
            arrival_s=0.0,
        )
        for n in range(12)
    ]
    most: list[int] = []
    advance = SimReplicas.advance

    def counted(self: SimReplicas, now: float) -> None:
        advance(self, now)
        most.append(len(self.copying))

    monkeypatch.setattr(SimReplicas, "advance", counted)
    copies = {}
    for cap in (3, 8, 1_000):
        most.clear()
        result = simulate(
            Trace(jobs=jobs, events=[SimEvent(at_s=3_000.0, kind="cluster_down", cluster="eu")]),
            plat,
            POLICIES["loom"](0),
            truth=BELIEF,
            migration=MigrationPolicy("never", replicas=ReplicaSettings(concurrency=cap)),
        )
        assert result.migration is not None
        copies[cap] = result.migration["replicas"]["copies"]
        assert max(most) == min(cap, 12)  # the cap reached, never passed (12 jobs: one copy each)
    assert copies[3] < copies[8] <= copies[1_000]
    assert ReplicaSettings().concurrency == 8  # the service's default
