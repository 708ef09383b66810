"""Checkpoint replicas (pure): where a copy goes, the byte budget, the incremental rule, and the
order a resume falls back in (original, replica, previous, step 0)."""

import math
import time

import pytest

from loom.migrate.benefit import LOCAL_PATH, PathState
from loom.migrate.checkpoints import Checkpoint, checksum_of, choose
from loom.migrate.replicas import (
    UNMEASURED_PATH,
    Held,
    Replica,
    ReplicaSettings,
    Site,
    changed_fraction_of,
    checkpoint_interval_s,
    delta_bytes,
    path_of,
    plan_copy,
)
from loom_proto.net import LinkState

GB = 1e9
SRC = Site("c-weu-a", "eu")
NEAR = Site("c-use2-a", "us")  # fast path from eu
FAR = Site("c-sea1-a", "asia")  # slow path from eu
SAME_REGION = Site("c-weu-b", "eu")

PATHS = {
    ("eu", "us"): PathState(rtt_ms=80.0, bandwidth_gbps=10.0),
    ("eu", "asia"): PathState(rtt_ms=200.0, bandwidth_gbps=1.0),
}


def _path(src: str, dst: str) -> PathState | None:
    if src == dst:
        return LOCAL_PATH
    return PATHS.get((src, dst))


def _plan(held: list[Held] | None = None, settings: ReplicaSettings | None = None, **kw: object):  # type: ignore[no-untyped-def]
    args: dict[str, object] = {
        "job_id": "j1",
        "attempt": 1,
        "step": 30,
        "source": SRC,
        "full_bytes": 8 * GB,
        "checkpoint_every_steps": 10,
        "changed_fraction": 0.25,
        "sites": [SRC, NEAR, FAR, SAME_REGION],
        "path": _path,
        "held": held or [],
        "settings": settings,
    }
    args.update(kw)
    return plan_copy(**args)  # type: ignore[arg-type]


def _held(job: str, cluster: str, *, stored: float, finished: bool, at: float, step: int = 10) -> Held:
    return Held(job, 1, step, cluster, stored, at, finished)


# ---- where a copy goes ---------------------------------------------------------------------------


def test_the_replica_goes_to_the_best_measured_path_in_another_region_never_the_source() -> None:
    plan, _ = _plan()
    assert plan is not None
    assert plan.target == NEAR.cluster  # not the source, not its region, the fastest path
    assert plan.full and plan.base_step is None and plan.transfer_bytes == 8 * GB
    assert plan.transfer_s == pytest.approx(0.08 + 8 * GB * 8 / 10e9)
    assert "full copy" in plan.why and "eu->us" in plan.why


def test_another_cluster_of_the_source_region_is_used_only_when_no_other_region_can_take_it() -> None:
    plan, skipped = _plan(sites=[SRC, SAME_REGION, FAR], path=lambda s, d: LOCAL_PATH if s == d else None)
    assert plan is not None and plan.target == SAME_REGION.cluster
    assert any("c-sea1-a: no path" in why for why in skipped)


def test_an_unreachable_cluster_or_a_dead_path_is_passed_over_with_its_reason() -> None:
    plan, skipped = _plan(unreachable={NEAR.cluster})
    assert plan is not None and plan.target == FAR.cluster
    assert "c-use2-a: unreachable" in skipped
    lossy = {("eu", "us"): PathState(rtt_ms=80.0, bandwidth_gbps=10.0, loss_rate=1.0)}
    plan, skipped = _plan(sites=[SRC, NEAR], path=lambda s, d: lossy.get((s, d)))
    assert plan is None and any("delivers nothing" in why for why in skipped)


def test_no_other_cluster_means_no_copy() -> None:
    plan, skipped = _plan(sites=[SRC])
    assert plan is None and skipped == []


# ---- keeping up: the increment of one interval over the measured path within the interval -------
# One interval's increment is 2 GB (8 GB x 0.25): to NEAR 0.08 + 1.6 = 1.68 s, to FAR 0.2 + 16 =
# 16.2 s, to SAME_REGION 0.0005 + 0.16 s.


def test_a_slow_other_region_that_would_lag_loses_to_a_same_region_cluster_that_keeps_up() -> None:
    sites = [SRC, FAR, SAME_REGION]
    plan, _ = _plan(sites=sites, interval_s=10.0)
    assert plan is not None and plan.target == SAME_REGION.cluster and plan.keeps_up is True
    assert plan.increment_s == pytest.approx(0.0005 + 2 * GB * 8 / 100e9)
    assert "keeps up" in plan.why and "another region would lag: c-sea1-a" in plan.why
    # Without a known interval nothing is judged: another region first, as before.
    plan, _ = _plan(sites=sites)
    assert plan is not None and plan.target == FAR.cluster and plan.keeps_up is None


def test_another_region_that_keeps_up_comes_first_even_when_slower() -> None:
    plan, _ = _plan(sites=[SRC, FAR, SAME_REGION], interval_s=20.0)  # 16.2 s <= 20 s
    assert plan is not None and plan.target == FAR.cluster and plan.keeps_up is True
    assert plan.increment_s == pytest.approx(16.2)
    assert "keeps up: an interval's increment takes 16.2 s <= the 20 s interval" in plan.why


def test_among_other_regions_that_keep_up_the_fastest_wins_and_a_lagging_one_is_not_taken() -> None:
    plan, _ = _plan(interval_s=20.0)  # both keep up: the faster
    assert plan is not None and plan.target == NEAR.cluster
    plan, _ = _plan(sites=[SRC, FAR, NEAR], interval_s=10.0)
    assert plan is not None and plan.target == NEAR.cluster
    # FAR holds the job's previous replica (a 2 GB delta, 16.2 s): it lags, so NEAR gets a full
    # copy (6.48 s, longer than this 5 s interval: keeping up is judged on the increment).
    far_base = Held("j1", 1, 20, FAR.cluster, 8 * GB, 10.0, False)
    plan, _ = _plan([far_base], sites=[SRC, FAR, NEAR], interval_s=5.0)
    assert plan is not None and plan.target == NEAR.cluster and plan.full and plan.keeps_up is True
    assert plan.transfer_s == pytest.approx(6.48)


def test_when_every_target_lags_the_least_lagging_one_is_taken_in_any_region() -> None:
    plan, _ = _plan(interval_s=0.1)  # even the local copy (0.16 s) lags
    assert plan is not None and plan.target == SAME_REGION.cluster and plan.keeps_up is False
    assert "lags" in plan.why and "every target lags" in plan.why
    plan, _ = _plan(sites=[SRC, NEAR, FAR], interval_s=1.0)  # NEAR 1.68 s, FAR 16.2 s
    assert plan is not None and plan.target == NEAR.cluster and plan.keeps_up is False


def test_the_interval_is_measured_from_the_two_latest_checkpoints() -> None:
    args = {"step": 30, "at_s": 160.0, "previous_step": 20, "previous_at_s": 100.0}
    assert checkpoint_interval_s(**args, checkpoint_every_steps=10) == pytest.approx(60.0)  # type: ignore[arg-type]
    # An on-demand checkpoint off the grid: seconds per step times the steps of an interval.
    assert checkpoint_interval_s(
        step=25, at_s=130.0, previous_step=20, previous_at_s=100.0, checkpoint_every_steps=10, time_scale=2.0
    ) == pytest.approx(120.0)
    assert checkpoint_interval_s(**{**args, "previous_step": None}, checkpoint_every_steps=10) is None  # type: ignore[arg-type]
    assert checkpoint_interval_s(**{**args, "previous_at_s": 160.0}, checkpoint_every_steps=10) is None  # type: ignore[arg-type]
    assert checkpoint_interval_s(**{**args, "previous_step": 30}, checkpoint_every_steps=10) is None  # type: ignore[arg-type]
    assert checkpoint_interval_s(**args, checkpoint_every_steps=0) is None  # type: ignore[arg-type]


# ---- byte budget -------------------------------------------------------------------------------


def test_a_cluster_over_its_budget_with_running_jobs_replicas_is_not_a_candidate() -> None:
    held = [_held("other", NEAR.cluster, stored=15 * GB, finished=False, at=1.0)]
    settings = ReplicaSettings(budget_bytes=100 * GB, budgets_bytes={NEAR.cluster: 20 * GB})
    plan, skipped = _plan(held, settings)
    assert plan is not None and plan.target == FAR.cluster  # the near one is full of a running job's
    assert any(why.startswith("c-use2-a: over its byte budget") for why in skipped)


def test_finished_jobs_replicas_are_evicted_oldest_first_to_make_room() -> None:
    held = [
        _held("done-new", NEAR.cluster, stored=6 * GB, finished=True, at=300.0),
        _held("done-old", NEAR.cluster, stored=6 * GB, finished=True, at=100.0),
        _held("running", NEAR.cluster, stored=6 * GB, finished=False, at=50.0),
    ]
    settings = ReplicaSettings(budgets_bytes={NEAR.cluster: 19 * GB})
    plan, _ = _plan(held, settings)
    # 18 GB held, 1 GB free, 8 GB needed: evicting the oldest finished one (6 GB) is not enough,
    # the second one too; the running job's replica is never evicted.
    assert plan is not None and plan.target == NEAR.cluster
    assert [h.job_id for h in plan.evict] == ["done-old", "done-new"]
    settings = ReplicaSettings(budgets_bytes={NEAR.cluster: 22 * GB})
    plan, _ = _plan(held, settings)
    assert plan is not None and [h.job_id for h in plan.evict] == ["done-old"]


def test_the_job_s_own_previous_replica_does_not_count_against_the_budget() -> None:
    mine = Held("j1", 1, 20, NEAR.cluster, 8 * GB, 10.0, False)
    plan, _ = _plan([mine], ReplicaSettings(budgets_bytes={NEAR.cluster: 10 * GB}))
    assert plan is not None and plan.target == NEAR.cluster and not plan.evict


# ---- incremental rule ----------------------------------------------------------------------------


def test_the_first_copy_is_full_and_later_ones_send_the_changed_fraction_per_interval() -> None:
    assert (
        delta_bytes(8 * GB, base_step=None, step=30, checkpoint_every_steps=10, changed_fraction=0.25)
        == 8 * GB
    )
    one = delta_bytes(8 * GB, base_step=20, step=30, checkpoint_every_steps=10, changed_fraction=0.25)
    two = delta_bytes(8 * GB, base_step=10, step=30, checkpoint_every_steps=10, changed_fraction=0.25)
    assert (one, two) == (2 * GB, 4 * GB)
    # Capped at the full size; a base at the same step (another attempt) counts one interval.
    assert (
        delta_bytes(8 * GB, base_step=0, step=100, checkpoint_every_steps=10, changed_fraction=0.25) == 8 * GB
    )
    assert (
        delta_bytes(8 * GB, base_step=30, step=30, checkpoint_every_steps=10, changed_fraction=0.25) == 2 * GB
    )


def test_a_cluster_holding_the_job_s_previous_replica_gets_the_delta_and_keeps_winning() -> None:
    # The far cluster holds step 20: its delta (2 GB at 1 Gbps, 16.2 s) beats a full copy to the
    # near one (8 GB at 10 Gbps, 6.5 s)? No: 16.2 s > 6.5 s, the near one wins on this copy's time.
    far_base = Held("j1", 1, 20, FAR.cluster, 8 * GB, 10.0, False)
    plan, _ = _plan([far_base])
    assert plan is not None and plan.target == NEAR.cluster and plan.full
    # Once the near one holds a base, the next copy there is incremental.
    near_base = Held("j1", 1, 20, NEAR.cluster, 8 * GB, 10.0, False)
    plan, _ = _plan([near_base])
    assert plan is not None and plan.target == NEAR.cluster
    assert not plan.full and plan.base_step == 20 and plan.transfer_bytes == 2 * GB
    assert plan.stored_bytes == 8 * GB and "delta onto its replica at step 20" in plan.why


def test_a_copy_in_flight_is_no_base_and_a_held_step_is_not_copied_again() -> None:
    in_flight = Held("j1", 1, 20, NEAR.cluster, 8 * GB, 10.0, False, ready=False)
    plan, _ = _plan([in_flight])
    assert plan is not None and plan.full
    held = Held("j1", 1, 30, NEAR.cluster, 8 * GB, 10.0, False)
    plan, skipped = _plan([held])
    assert plan is not None and plan.target == FAR.cluster
    assert "c-use2-a: holds step 30 already" in skipped


def test_the_changed_fraction_comes_from_the_job_s_label_when_valid() -> None:
    assert changed_fraction_of({"checkpoint_changed_fraction": "0.1"}) == 0.1
    assert changed_fraction_of({"checkpoint_changed_fraction": "3"}, 0.25) == 0.25
    assert changed_fraction_of({"checkpoint_changed_fraction": "x"}, 0.3) == 0.3
    assert changed_fraction_of({}, 0.25) == 0.25


# ---- measured paths ----------------------------------------------------------------------------


def _link(
    src: str, dst: str, *, stale: bool = False, loss: float = 0.0, gbps: float | None = 5.0
) -> LinkState:
    return LinkState(
        src=src,
        dst=dst,
        rtt_ms_p50=120.0,
        rtt_ms_p95=130.0,
        rtt_ms_p99=140.0,
        jitter_ms=1.0,
        loss_rate=loss,
        bandwidth_gbps=gbps,
        cost=1.0,
        stale=stale,
        updated_at=time.time(),
    )


def test_paths_come_from_the_latest_link_states_and_a_stale_link_is_no_path() -> None:
    links = {("eu", "us"): _link("eu", "us"), ("asia", "eu"): _link("asia", "eu", stale=True)}
    path = path_of(links, "eu", "us")
    assert path is not None and path.rtt_ms == 120.0 and path.bandwidth_gbps == 5.0
    assert path_of(links, "us", "eu") == path  # the reverse direction's when only it is known
    assert path_of(links, "eu", "asia") is None
    assert path_of(links, "eu", "eu") == LOCAL_PATH
    assert path_of(links, "eu", "africa") == UNMEASURED_PATH
    assert path_of({("eu", "us"): _link("eu", "us", loss=1.0)}, "eu", "us") is None
    # One direction stale, the other live (measured from that side only): the live one is used.
    one_sided = {
        ("asia", "eu"): _link("asia", "eu", stale=True),
        ("eu", "asia"): _link("eu", "asia", gbps=2.0),
    }
    path = path_of(one_sided, "asia", "eu")
    assert path is not None and path.bandwidth_gbps == 2.0
    assert math.isfinite(UNMEASURED_PATH.transfer_s(GB))


# ---- the fallback order of a resume ------------------------------------------------------------


def _checkpoint(step: int, cluster: str = "c-weu-a", *, good: bool = True, attempt: int = 1) -> Checkpoint:
    uri = f"sim://{cluster}/j1/{attempt}/{step}"
    checksum = checksum_of("j1", attempt, step, uri) if good else "sha256:bad"
    return Checkpoint("j1", attempt, step, cluster, uri, checksum)


def _replica(step: int, cluster: str = "c-use2-a", *, good: bool = True, source: str = "c-weu-a") -> Replica:
    uri = f"sim://{source}/j1/1/{step}"
    checksum = checksum_of("j1", 1, step, uri) if good else "sha256:bad"
    return Replica("j1", 1, step, cluster, source, uri, checksum)


def test_a_reachable_verified_latest_checkpoint_wins_over_its_replica() -> None:
    chosen = choose([_checkpoint(30), _checkpoint(20)], replicas=[_replica(30)])
    assert chosen is not None and chosen.step == 30 and chosen.replica is None
    assert chosen.why == "resumes from its checkpoint at step 30 (recorded)"


def test_a_failed_cluster_s_checkpoint_falls_back_to_its_replica() -> None:
    chosen = choose([_checkpoint(30), _checkpoint(20)], replicas=[_replica(30)], unreachable={"c-weu-a"})
    assert chosen is not None and chosen.step == 30 and chosen.checkpoint is None
    assert chosen.replica is not None and chosen.replica.cluster == "c-use2-a"
    assert chosen.why.startswith("resumes from replica in c-use2-a at step 30")
    assert "step 30 (cluster c-weu-a unreachable)" in chosen.why


def test_a_corrupt_checkpoint_falls_back_to_the_replica_then_the_previous_then_step_0() -> None:
    # Checksum fails: the replica of the same step.
    chosen = choose([_checkpoint(30, good=False), _checkpoint(20)], replicas=[_replica(30)])
    assert chosen is not None and chosen.replica is not None and chosen.step == 30
    assert "step 30 (checksum mismatch)" in chosen.why
    # The replica corrupt too: the previous checkpoint.
    chosen = choose([_checkpoint(30, good=False), _checkpoint(20)], replicas=[_replica(30, good=False)])
    assert chosen is not None and chosen.checkpoint is not None and chosen.step == 20
    assert "previous checkpoint at step 20" in chosen.why and "replica in c-use2-a at step 30" in chosen.why
    # Nothing readable: step 0, saying what was rejected.
    chosen = choose([_checkpoint(30), _checkpoint(20)], replicas=[], unreachable={"c-weu-a"})
    assert chosen is not None and chosen.step == 0 and chosen.checkpoint is None and chosen.replica is None
    assert chosen.why.startswith("restarts from step 0") and "cluster c-weu-a unreachable" in chosen.why


def test_a_lagging_replica_is_used_before_an_older_readable_checkpoint_elsewhere() -> None:
    # The failed cluster held steps 40 and 30; the replica lags at 30; attempt 1 left step 20 on
    # a cluster still up.
    recorded = [_checkpoint(40, attempt=2), _checkpoint(30, attempt=2), _checkpoint(20, "c-sea1-a")]
    replica = Replica("j1", 2, 30, "c-use2-a", "c-weu-a", "sim://c-weu-a/j1/2/30", "")
    chosen = choose(recorded, replicas=[replica], unreachable={"c-weu-a"})
    assert chosen is not None and chosen.step == 30 and chosen.replica is replica
    chosen = choose(recorded, replicas=[], unreachable={"c-weu-a"})
    assert chosen is not None and chosen.step == 20 and chosen.checkpoint is not None
    assert chosen.checkpoint.cluster == "c-sea1-a"


def test_a_replica_on_an_unreachable_cluster_is_not_read_and_last_step_clamps() -> None:
    chosen = choose([_checkpoint(30)], replicas=[_replica(30)], unreachable={"c-weu-a", "c-use2-a"})
    assert chosen is not None and chosen.step == 0
    chosen = choose([_checkpoint(30)], replicas=[_replica(30)], unreachable={"c-weu-a"}, last_step=25)
    assert chosen is not None and chosen.step == 25 and chosen.replica is not None


# ---- visibility --------------------------------------------------------------------------------


def test_loom_migrations_replicas_shows_where_which_step_and_the_bytes() -> None:
    from rich.console import Console

    from loom.cli.main import build_parser
    from loom.cli.migrations import replicas_table

    assert build_parser().parse_args(["migrations", "--replicas", "--job", "j1"]).replicas is True
    row = {
        "requested_at": 1_700_000_000.0,
        "job_id": "j1",
        "attempt": 1,
        "step": 30,
        "source_cluster": "c-weu-a",
        "cluster": "c-use2-a",
        "state": "ready",
        "corrupt": False,
        "full_copy": False,
        "base_step": 20,
        "transfer_bytes": 2_000_000_000,
        "stored_bytes": 8_000_000_000,
        "transfer_s": 1.68,
    }
    console = Console(record=True, width=400)
    console.print(replicas_table([row]))
    text = console.export_text()
    assert "c-use2-a" in text and "delta on 20" in text and " 2 " in text and " 8 " in text and "1.68" in text
