"""Migration in the simulator: on / never / always on small cases, timed by belief (exact arithmetic)."""

from typing import Any

import pytest

from loom.model.capacity import NodeCapacity
from loom.model.profiles import relative_speed
from loom.model.topology import load_topology
from loom.sched.plugins.cost import default_economics
from loom.sched.snapshot import ClusterInfo, NetMatrix
from loom.sim.engine import simulate
from loom.sim.migration import MigrationPolicy
from loom.sim.model import Platform, SimEvent, SimJob, SimResult, Trace
from loom.sim.policies import POLICIES
from loom.sim.scenarios import drain_events
from loom.sim.truth import BELIEF
from loom_proto.jobs import Affinity, JobSpec, Resources, Work

EU = "aws-eu-central-1"
USE = "aws-us-east-2"
TASKS = ("training_compute", "training_memory", "training_comm", "inference")
RETURN_S = 1_000.0


def platform(clusters: dict[str, tuple[str, str, int]]) -> Platform:
    """``cluster -> (region, gpu_model, nodes)`` of 8 GPUs, on the packaged measured network."""
    nodes = [
        NodeCapacity(
            node=f"{cid}-n{i}", cluster=cid, region=region, zone=f"{region}-a", gpu_model=model, gpus_total=8
        )
        for cid, (region, model, count) in clusters.items()
        for i in range(count)
    ]
    models = sorted({m for _, m, _ in clusters.values()})
    return Platform(
        name="test",
        nodes=nodes,
        clusters={cid: ClusterInfo(id=cid, region=r, zone=f"{r}-a") for cid, (r, _, _) in clusters.items()},
        net=NetMatrix.from_topology(load_topology()),
        economics=default_economics(),
        speed={(m, t): relative_speed(m, t) for m in models for t in TASKS},
        gpu_memory_gib=dict.fromkeys(models, 80.0),
    )


def job(job_id: str, steps: int) -> SimJob:
    spec = JobSpec(
        job_id=job_id,
        tenant="t",
        resources=Resources(gpus=8),
        work=Work(steps=steps, step_time_s=0.5, checkpoint_every_steps=100),
    )
    return SimJob(spec=spec, arrival_s=0.0)


SLOW_STEP_S = 0.5 / relative_speed("P100", "training_compute")
FAST_STEP_S = 0.5 / relative_speed("H100", "training_compute")
LONG_STEPS = 20_000
SHORT_STEPS = round((RETURN_S + 80.0) / SLOW_STEP_S)
"""Done 80 s (on the slow GPUs) after the fast cluster returns: moving gains less than it costs."""


def run(mode: str) -> tuple[dict[str, Any], SimResult]:
    """Both jobs start on the slow cluster (the fast one is down); the fast one returns at 1,000 s."""
    plat = platform({"slow": (EU, "P100", 2), "fast": (EU, "H100", 2)})
    events = [
        SimEvent(at_s=0.0, kind="cluster_down", cluster="fast"),
        SimEvent(at_s=RETURN_S, kind="cluster_up", cluster="fast"),
    ]
    trace = Trace(jobs=[job("long", LONG_STEPS), job("short", SHORT_STEPS)], events=events)
    result = simulate(trace, plat, POLICIES["loom"](0), truth=BELIEF, migration=MigrationPolicy(mode))  # type: ignore[arg-type]
    return {r.job_id: r for r in result.records}, result


def test_on_moves_the_job_whose_gain_exceeds_its_cost_and_leaves_the_other() -> None:
    records, result = run("on")
    assert records["long"].restarts == 1
    assert records["long"].clusters == ("fast",)
    assert records["short"].restarts == 0
    assert records["short"].clusters == ("slow",)
    verdicts = {v["job_id"]: v for v in result.migration["verdicts"]}  # type: ignore[index]
    assert verdicts["long"]["decision"] == "move"
    assert verdicts["long"]["gain_s"] > verdicts["long"]["threshold_s"]
    assert verdicts["short"]["decision"] == "stay"
    assert 0 < verdicts["short"]["gain_s"] < verdicts["short"]["cost_s"] < verdicts["short"]["threshold_s"]
    assert result.migration["migrations"] == 1  # type: ignore[index]
    # The moved job: its progress kept (on-demand checkpoint), then save + copy + restart, then
    # the rest at the fast pace.
    done = RETURN_S / SLOW_STEP_S
    delay = 16e9 * 8 / 4e9 + (0.5 / 1000 + 16e9 * 8 / 100e9) + 60.0  # in-region copy
    assert records["long"].end_s is not None
    assert records["long"].end_s == pytest.approx(
        RETURN_S + delay + (LONG_STEPS - done) * FAST_STEP_S, rel=0.02
    )
    assert records["short"].end_s == pytest.approx(SHORT_STEPS * SLOW_STEP_S)


def test_never_moves_neither_and_always_moves_both() -> None:
    never, never_result = run("never")
    always, always_result = run("always")
    assert never["long"].restarts == never["short"].restarts == 0
    assert never_result.migration["migrations"] == 0  # type: ignore[index]
    assert always["long"].restarts == always["short"].restarts == 1
    assert always_result.migration["migrations"] == 2  # type: ignore[index]
    on, _ = run("on")
    # Moving the short job costs it more than it gains; moving the long one pays.
    assert always["short"].jct_s > on["short"].jct_s  # type: ignore[operator]
    assert on["long"].jct_s < never["long"].jct_s  # type: ignore[operator]


def test_a_drain_moves_jobs_off_the_cluster_under_on_and_leaves_them_under_never() -> None:
    plat = platform({"a": (EU, "H100", 1), "b": (EU, "H100", 1)})
    first = simulate(Trace(jobs=[job("j", 5_000)]), plat, POLICIES["loom"](0), truth=BELIEF)
    home = first.records[0].clusters[0]
    other = "b" if home == "a" else "a"
    trace = Trace(jobs=[job("j", 5_000)], events=drain_events(home, at_s=50.0, duration_s=500.0))
    on = simulate(trace, plat, POLICIES["loom"](0), truth=BELIEF, migration=MigrationPolicy("on"))
    never = simulate(trace, plat, POLICIES["loom"](0), truth=BELIEF, migration=MigrationPolicy("never"))
    assert on.records[0].clusters == (other,)
    assert on.migration is not None
    assert on.migration["by_trigger"] == {"drain": 1}
    assert never.records[0].clusters == (home,)
    assert never.records[0].restarts == 0


def test_a_failed_clusters_jobs_pay_the_checkpoint_copy_and_restart_in_every_mode() -> None:
    plat = platform({"a": (EU, "H100", 1), "b": (EU, "H100", 1)})
    first = simulate(Trace(jobs=[job("j", 5_000)]), plat, POLICIES["loom"](0), truth=BELIEF)
    home = first.records[0].clusters[0]
    events = [SimEvent(at_s=120.0, kind="cluster_down", cluster=home)]
    plain = simulate(Trace(jobs=[job("j", 5_000)], events=events), plat, POLICIES["loom"](0), truth=BELIEF)
    ends = set()
    for mode in ("on", "never", "always"):
        result = simulate(
            Trace(jobs=[job("j", 5_000)], events=events),
            plat,
            POLICIES["loom"](0),
            truth=BELIEF,
            migration=MigrationPolicy(mode),  # type: ignore[arg-type]
        )
        assert result.migration is not None
        assert result.migration["forced_restarts"] == 1
        assert result.migration["lost_steps"] > 0
        assert result.records[0].end_s is not None
        ends.add(round(result.records[0].end_s, 6))
    assert len(ends) == 1
    # The same restart as without a migration policy, later by the copy and restart.
    assert plain.records[0].end_s is not None
    assert ends.pop() >= plain.records[0].end_s + MigrationPolicy().settings.restart_s


DRAIN_DELAY_S = 16e9 * 8 / 4e9 + (0.5 / 1000 + 16e9 * 8 / 100e9) + 60.0
"""An on-demand save, an in-region copy and a restart: how long a drain's move is in flight."""


def drained(events: list[SimEvent], jobs: list[SimJob], *, mode: str = "on", clusters: int = 2) -> SimResult:
    """``a`` holds the jobs (``b`` is down until 10 s); ``b`` has ``clusters`` nodes."""
    plat = platform({"a": (EU, "H100", 2), "b": (EU, "H100", clusters)})
    trace = Trace(
        jobs=jobs,
        events=[
            SimEvent(at_s=0.0, kind="cluster_down", cluster="b"),
            SimEvent(at_s=10.0, kind="cluster_up", cluster="b"),
            *events,
        ],
    )
    return simulate(
        trace,
        plat,
        POLICIES["loom"](0),
        truth=BELIEF,
        sample_every_s=60.0,
        migration=MigrationPolicy(mode, per_cluster=1),  # type: ignore[arg-type]
    )


def test_a_drain_moves_at_most_its_concurrency_at_once_outside_the_voluntary_budget() -> None:
    """As ``loom drain --concurrency 1``: the second job moves once the first's new run computes,
    not at the next sample; the migration budget (1 per cluster here) neither holds nor counts it."""
    result = drained(drain_events("a", at_s=50.0, concurrency=1), [job("j1", 20_000), job("j2", 20_000)])
    assert result.migration is not None
    assert result.migration["by_trigger"] == {"drain": 2}
    assert result.migration["deferred_by_budget"] == 0
    assert all(r.clusters == ("b",) and r.restarts == 1 for r in result.records)
    moved_at = sorted(v["at_s"] for v in result.migration["verdicts"] if v["decision"] == "move")
    assert len(moved_at) == 2  # a verdict per move (a review: the waiting one was recorded each pass)
    assert moved_at[0] == pytest.approx(50.0)
    # At the instant the first lands (not at the sample after it, 180 s).
    assert moved_at[-1] == pytest.approx(50.0 + DRAIN_DELAY_S, abs=0.05)
    (figures,) = result.migration["drains"]
    assert figures == {
        "cluster": "a",
        "at_s": 50.0,
        "concurrency": 1,
        "deadline_s": 0.0,
        "emptied_after_s": pytest.approx(moved_at[-1] - 50.0, abs=0.05),
        "moved": 2,
        "given_up": 0,
    }


def test_a_drain_moves_two_at_once_by_default_as_loom_drain_does() -> None:
    result = drained(drain_events("a", at_s=50.0), [job("j1", 20_000), job("j2", 20_000)], clusters=3)
    assert result.migration is not None
    moved_at = [v["at_s"] for v in result.migration["verdicts"] if v["decision"] == "move"]
    assert moved_at == [pytest.approx(50.0), pytest.approx(50.0)]
    # The same with room for both but one in flight at a time: the second waits for the first.
    one = drained(
        drain_events("a", at_s=50.0, concurrency=1), [job("j1", 20_000), job("j2", 20_000)], clusters=3
    )
    assert one.migration is not None
    assert sorted(v["at_s"] for v in one.migration["verdicts"] if v["decision"] == "move")[-1] > 50.0


def test_a_drained_job_without_checkpoints_stays_until_the_deadline_and_one_without_room_is_given_up() -> (
    None
):
    """The service's gate: a job that declares no checkpoints would restart from step 0, so it
    moves only at the drain's deadline; past it every job goes, given up to the queue where no
    cluster has room (``b`` has one node, taken by the other job)."""
    bare = SimJob(
        spec=JobSpec(
            job_id="bare", tenant="t", resources=Resources(gpus=8), work=Work(steps=20_000, step_time_s=0.5)
        ),
        arrival_s=0.0,
    )
    events = drain_events("a", at_s=50.0, deadline_s=500.0)
    result = drained(events, [job("j", 20_000), bare], clusters=1)
    assert result.migration is not None
    records = {r.job_id: r for r in result.records}
    (figures,) = result.migration["drains"]
    assert figures["moved"] == 1 and figures["given_up"] == 1
    assert records["j"].clusters == ("b",)
    assert records["bare"].restarts == 1  # given up at 550 s: queued, it restarts from step 0
    # It ran on a until the deadline, then waited for b (no checkpoint: from step 0 there).
    assert records["bare"].end_s is not None and records[
        "bare"
    ].end_s > 550.0 + 20_000 * 0.5 / relative_speed("H100", "training_compute")
    assert figures["emptied_after_s"] == pytest.approx(500.0)
    # Without a deadline it finishes in place: the drain empties only then.
    kept = drained(drain_events("a", at_s=50.0), [job("j", 20_000), bare], clusters=1)
    assert kept.migration is not None
    (figures,) = kept.migration["drains"]
    bare_record = next(r for r in kept.records if r.job_id == "bare")
    assert bare_record.restarts == 0 and bare_record.clusters == ("a",)
    assert figures["given_up"] == 0 and figures["moved"] == 1
    assert bare_record.end_s is not None
    assert figures["emptied_after_s"] == pytest.approx(bare_record.end_s - 50.0, abs=0.05)


def test_never_moves_nothing_off_a_drain_but_says_when_it_emptied() -> None:
    result = drained(drain_events("a", at_s=50.0), [job("j1", 2_000)], mode="never")
    assert result.migration is not None
    (figures,) = result.migration["drains"]
    end = result.records[0].end_s
    assert figures["moved"] == 0 and end is not None
    assert figures["emptied_after_s"] == pytest.approx(end - 50.0, abs=0.05)


def test_backflow_moves_a_job_only_onto_the_returning_cluster_never_elsewhere() -> None:
    """The framework's ``avoid_clusters`` is a preference (an avoided cluster is tried again when
    nothing else fits): when the returning cluster is full again, the backflow candidate must not
    fall back to another cluster that has room (``home`` or ``other``, whichever ``j`` did not
    take). ``always`` moved every job with a candidate there before."""
    plat = platform({"home": (EU, "H100", 1), "other": (EU, "H100", 1), "back": (EU, "H100", 1)})
    pinned = JobSpec(
        job_id="b",
        tenant="t",
        resources=Resources(gpus=8),
        work=Work(steps=LONG_STEPS, step_time_s=0.5, checkpoint_every_steps=100),
        affinity=Affinity(clusters=["back"]),
    )
    jobs = [SimJob(spec=pinned, arrival_s=0.0), SimJob(spec=job("j", LONG_STEPS).spec, arrival_s=1.0)]
    events = [
        SimEvent(at_s=100.0, kind="cluster_down", cluster="back"),
        SimEvent(at_s=200.0, kind="cluster_up", cluster="back"),  # b takes it again first
    ]
    for mode in ("on", "always"):
        result = simulate(
            Trace(jobs=jobs, events=events),
            plat,
            POLICIES["loom"](0),
            truth=BELIEF,
            migration=MigrationPolicy(mode),  # type: ignore[arg-type]
        )
        assert result.migration is not None
        assert result.migration["migrations"] == 0, mode
        j = next(r for r in result.records if r.job_id == "j")
        assert j.restarts == 0, mode  # it never moved (from home or other, where it started)
        b = next(r for r in result.records if r.job_id == "b")
        assert b.clusters == ("back",) and b.restarts == 1


def _queue_case(with_waiting_gang: bool) -> SimResult:
    """``j`` runs on A100s while the H100 cluster is down; when it returns, a short job pinned
    there takes half of it and (optionally) a 2 x 8-GPU gang pinned there waits for the rest,
    expected to have room when the short job ends a minute later."""
    plat = platform({"slow": (EU, "A100", 1), "fast": (EU, "H100", 2)})

    def pinned(job_id: str, steps: int, workers: int, at: float) -> SimJob:
        spec = JobSpec(
            job_id=job_id,
            tenant="t",
            workers=workers,
            resources=Resources(gpus=8),
            work=Work(steps=steps, step_time_s=0.5, checkpoint_every_steps=100),
            affinity=Affinity(clusters=["fast"]),
        )
        return SimJob(spec=spec, arrival_s=at)

    jobs = [job("j", 10_000), pinned("r", round(60.0 / FAST_STEP_S), 1, 1.0)]
    if with_waiting_gang:
        jobs.append(pinned("q", LONG_STEPS, 2, 2.0))
    events = [
        SimEvent(at_s=0.0, kind="cluster_down", cluster="fast"),
        SimEvent(at_s=100.0, kind="cluster_up", cluster="fast"),
    ]
    return simulate(
        Trace(jobs=jobs, events=events),
        plat,
        POLICIES["loom"](0),
        truth=BELIEF,
        migration=MigrationPolicy("on"),
    )


def test_on_does_not_take_the_gpus_a_waiting_job_is_about_to_get_but_moves_when_nobody_waits() -> None:
    alone = _queue_case(with_waiting_gang=False)
    assert alone.migration is not None
    assert alone.migration["migrations"] == 1  # backflow onto the H100s: 2.3x faster
    assert alone.migration["held_by_queue"] == 0
    queued = _queue_case(with_waiting_gang=True)
    assert queued.migration is not None
    # The gang would wait for j's whole run there instead of a minute: the queue's loss outweighs
    # j's gain, and j stays.
    assert queued.migration["migrations"] == 0
    assert queued.migration["held_by_queue"] >= 1
    verdict = next(v for v in queued.migration["verdicts"] if v["trigger"] == "cluster_joined")
    assert verdict["queue_s"] > 0 and verdict["decision"] == "stay"
    q = next(r for r in queued.records if r.job_id == "q")
    r = next(r for r in queued.records if r.job_id == "r")
    assert q.start_s is not None and r.end_s is not None and q.start_s == pytest.approx(r.end_s)


def test_the_queues_loss_counts_the_gpus_a_move_takes_not_gpus_times_gpus_per_worker() -> None:
    # The H100 cluster (2 nodes of 8) returns at 100 s: ``r`` (3 workers of 4 GPUs, a minute)
    # takes 12 of its GPUs, so ``q`` (one 8-GPU worker) waits for r's end; ``j`` (one 4-GPU worker
    # on the A100s) could move into the 4 left. After the move q still gets its node when r ends:
    # the move takes 4 GPUs, no room q needs, so the queue loses nothing and j moves. Counting the
    # move as 16 GPUs (its 4 GPUs times 4 per worker) left q no room at any known release.
    plat = platform({"slow": (EU, "A100", 1), "fast": (EU, "H100", 2)})

    def pinned(job_id: str, steps: int, workers: int, gpus: int, at: float) -> SimJob:
        spec = JobSpec(
            job_id=job_id,
            tenant="t",
            workers=workers,
            resources=Resources(gpus=gpus),
            work=Work(steps=steps, step_time_s=0.5, checkpoint_every_steps=100),
            affinity=Affinity(clusters=["fast"]),
        )
        return SimJob(spec=spec, arrival_s=at)

    mover = JobSpec(
        job_id="j",
        tenant="t",
        resources=Resources(gpus=4),
        work=Work(steps=LONG_STEPS, step_time_s=0.5, checkpoint_every_steps=100),
    )
    jobs = [
        SimJob(spec=mover, arrival_s=0.0),
        pinned("r", round(60.0 / FAST_STEP_S), 3, 4, 1.0),
        pinned("q", LONG_STEPS, 1, 8, 2.0),
    ]
    events = [
        SimEvent(at_s=0.0, kind="cluster_down", cluster="fast"),
        SimEvent(at_s=100.0, kind="cluster_up", cluster="fast"),
    ]
    result = simulate(
        Trace(jobs=jobs, events=events),
        plat,
        POLICIES["loom"](0),
        truth=BELIEF,
        migration=MigrationPolicy("on"),
    )
    assert result.migration is not None
    verdict = next(v for v in result.migration["verdicts"] if v["job_id"] == "j")
    assert verdict["trigger"] == "cluster_joined" and verdict["target"] == "fast"
    assert verdict["queue_s"] == 0.0, verdict
    assert verdict["decision"] == "move"
    records = {r.job_id: r for r in result.records}
    assert records["j"].clusters == ("fast",)
    # q started when r ended, as it would have without the move.
    assert records["q"].start_s == pytest.approx(records["r"].end_s)


def test_a_checkpoint_moved_to_another_region_is_in_the_jobs_traffic_and_bill() -> None:
    # The migrator's checkpoint copies were counted in its own figures only: a policy that moves
    # jobs across regions looked as if it moved no bytes and paid nothing for them.
    from loom.model.egress import transfer_price_per_gb

    plat = platform({"a": (EU, "H100", 1), "b": (USE, "H100", 1)})
    first = simulate(Trace(jobs=[job("j", 5_000)]), plat, POLICIES["loom"](0), truth=BELIEF)
    home = first.records[0].clusters[0]
    trace = Trace(jobs=[job("j", 5_000)], events=drain_events(home, at_s=50.0, duration_s=500.0))
    result = simulate(trace, plat, POLICIES["loom"](0), truth=BELIEF, migration=MigrationPolicy("on"))
    assert result.migration is not None
    moved = result.migration["bytes_moved"]
    replicated = result.migration["replicas"]["bytes_sent"]  # each copy to the other region here
    (rec,) = result.records
    assert moved > 0 and replicated > 0
    assert rec.cross_region_bytes == pytest.approx(moved + replicated)
    assert rec.transfer_cost == pytest.approx((moved + replicated) / 1e9 * transfer_price_per_gb(EU, USE))


def _back_and_forth(events: list[SimEvent], mode: str = "on") -> tuple[dict[str, Any], dict[str, Any]]:
    plat = platform({"fast": (EU, "H100", 1), "slow": (EU, "P100", 1)})
    trace = Trace(jobs=[job("j", 200_000)], events=events)
    result = simulate(trace, plat, POLICIES["loom"](0), truth=BELIEF, migration=MigrationPolicy(mode))  # type: ignore[arg-type]
    assert result.migration is not None
    return {r.job_id: r for r in result.records}, result.migration


def test_a_failover_starts_the_cool_down_as_the_services_move_history_counts_it() -> None:
    """A job failed over to the slow cluster does not move straight back when the fast one
    returns 200 s later: the migration service counts the failover in its move history (its
    cool-down, 1,800 s); the simulator did not, and moved it back at once."""
    records, figures = _back_and_forth(
        [
            SimEvent(at_s=100.0, kind="cluster_down", cluster="fast"),
            SimEvent(at_s=300.0, kind="cluster_up", cluster="fast"),
        ]
    )
    assert figures["by_trigger"].get("cluster_joined", 0) == 0
    assert records["j"].restarts == 1  # the failover only, nothing at the return


def test_an_undrained_cluster_is_offered_to_the_jobs_that_left_it_as_a_joining_one() -> None:
    """The migration service reviews an undrained cluster as a joining one (backflow); the
    simulator only forgot the drain, so a job drained off the fast cluster never went back."""
    records, figures = _back_and_forth(
        [
            SimEvent(at_s=100.0, kind="cluster_drain", cluster="fast"),
            SimEvent(at_s=4_000.0, kind="cluster_undrain", cluster="fast"),  # past the drain's cool-down
        ]
    )
    assert figures["by_trigger"].get("drain", 0) == 1
    assert figures["by_trigger"].get("cluster_joined", 0) == 1
    assert records["j"].clusters[-1:] == ("fast",)


def test_a_drain_scenario_refuses_a_concurrency_or_deadline_loom_drain_would() -> None:
    from loom.sim.scenarios import ScenarioError

    with pytest.raises(ScenarioError, match="concurrency must be an integer within 1-64, got 0"):
        drain_events("a", at_s=1.0, concurrency=0)
    with pytest.raises(ScenarioError, match="deadline_s must be a finite number >= 0, got inf"):
        drain_events("a", at_s=1.0, deadline_s=float("inf"))


def test_a_far_drain_deadline_does_not_keep_the_simulation_going_after_the_jobs_end() -> None:
    # A review: the deadline's instant was asked for whatever happened, so a drain with a deadline
    # of a million seconds sampled until then (16,669 samples, utilisation 0.00012).
    for mode in ("on", "never"):
        result = drained(drain_events("a", at_s=50.0, deadline_s=1e6), [job("j1", 2_000)], mode=mode)
        end = result.records[0].end_s
        assert end is not None and end < 5_000
        assert result.timeline[-1].t_s < end + 2 * 60.0, mode  # sampled up to the end, not the deadline
