"""The ledger folds heartbeats in order, refuses what cannot be true, and goes stale on silence."""

from collections.abc import Sequence
from typing import Any

import pytest

from loom.model.ledger import MAX_CLOCK_SKEW_S, MAX_TTL_INTERVALS, MIN_TTL_INTERVALS, Ledger
from loom_proto import ClusterHeartbeat, NodeState

NOW = 1_700_000_000.0


def ns(
    name: str,
    *,
    total: int = 8,
    used: int = 0,
    model: str | None = "A100",
    zone: str = "z1",
    healthy: bool = True,
) -> NodeState:
    return NodeState(node=name, zone=zone, gpu_model=model, gpus_total=total, gpus_used=used, healthy=healthy)


def hb(
    seq: int,
    nodes: Sequence[NodeState] = (),
    *,
    cluster: str = "c1",
    region: str = "r1",
    epoch: int = 1,
    full: bool = False,
    removed: Sequence[str] = (),
    sent_at: float = NOW,
    interval_s: float = 5.0,
) -> ClusterHeartbeat:
    return ClusterHeartbeat(
        cluster=cluster,
        region=region,
        agent_epoch=epoch,
        seq=seq,
        sent_at=sent_at,
        full=full,
        nodes=list(nodes),
        removed=list(removed),
        interval_s=interval_s,
    )


@pytest.fixture
def ledger() -> Ledger:
    """A ledger that knows cluster c1 (epoch 1, seq 1) with nodes n1 and n2."""
    led = Ledger()
    applied = led.apply(hb(1, [ns("n1"), ns("n2")], full=True), NOW)
    assert applied.change is not None
    assert applied.change.version == 1
    return led


# -- ordering --------------------------------------------------------------------------------------


def test_a_newer_heartbeat_updates_the_node_and_bumps_the_version(ledger: Ledger) -> None:
    applied = ledger.apply(hb(2, [ns("n1", used=3)]), NOW + 5)
    assert applied.ignored is None
    assert applied.change is not None
    assert applied.change.version == 2
    assert [n.node for n in applied.change.nodes] == ["n1"]
    assert ledger.nodes["n1"].gpus_used == 3
    assert ledger.nodes["n1"].updated_at == NOW + 5


def test_a_heartbeat_that_changes_nothing_yields_no_change(ledger: Ledger) -> None:
    applied = ledger.apply(hb(2, [ns("n1")]), NOW + 5)
    assert applied.change is None
    assert applied.ignored is None
    assert ledger.clusters["c1"].last_seq == 2
    assert ledger.clusters["c1"].version == 1


def test_a_duplicate_heartbeat_is_ignored_and_counted(ledger: Ledger) -> None:
    applied = ledger.apply(hb(1, [ns("n1", used=8)]), NOW + 1)
    assert applied.change is None
    assert applied.ignored is not None
    assert "not newer" in applied.ignored
    assert ledger.refused["out_of_order"] == 1
    assert ledger.nodes["n1"].gpus_used == 0


def test_an_older_heartbeat_never_rolls_state_back(ledger: Ledger) -> None:
    assert ledger.apply(hb(5, [ns("n1", used=5)]), NOW + 1).change is not None
    applied = ledger.apply(hb(3, [ns("n1", used=1)]), NOW + 2)
    assert applied.change is None
    assert ledger.refused["out_of_order"] == 1
    assert ledger.nodes["n1"].gpus_used == 5
    assert ledger.clusters["c1"].last_seq == 5


def test_a_heartbeat_from_an_older_agent_run_is_ignored_whatever_its_seq(ledger: Ledger) -> None:
    assert ledger.apply(hb(1, [ns("n1")], epoch=2, full=True), NOW + 1).change is not None
    applied = ledger.apply(hb(99, [ns("n1", used=4)], epoch=1), NOW + 2)
    assert applied.ignored is not None
    assert ledger.refused["out_of_order"] == 1
    assert ledger.nodes["n1"].gpus_used == 0


# -- agent restarts --------------------------------------------------------------------------------


def test_a_new_agent_run_must_start_with_a_full_snapshot(ledger: Ledger) -> None:
    applied = ledger.apply(hb(1, [ns("n1", used=2)], epoch=2), NOW + 1)
    assert applied.change is None
    assert applied.ignored is not None
    assert "full snapshot" in applied.ignored
    assert ledger.refused["delta_from_new_epoch"] == 1
    assert ledger.nodes["n1"].gpus_used == 0
    assert ledger.clusters["c1"].agent_epoch == 1, "the refused heartbeat moves nothing"

    applied = ledger.apply(hb(1, [ns("n1", used=2), ns("n2")], epoch=2, full=True), NOW + 2)
    assert applied.change is not None
    assert (ledger.clusters["c1"].agent_epoch, ledger.clusters["c1"].last_seq) == (2, 1)
    assert ledger.apply(hb(2, [ns("n1", used=3)], epoch=2), NOW + 3).change is not None


def test_a_new_agent_run_after_an_epoch_0_run_must_also_start_with_a_full_snapshot() -> None:
    """``agent_epoch`` defaults to 0 on the wire, so 0 is a real epoch of a run that was heard.

    The ledger only demands a full snapshot when the previous epoch was non-zero, so an agent
    that ran with the default epoch and restarts with epoch 1 gets its first delta folded into
    the old run's state.
    """
    led = Ledger()
    assert led.apply(hb(1, [ns("n1"), ns("n2")], epoch=0, full=True), NOW).change is not None
    applied = led.apply(hb(1, [ns("n1", used=2)], epoch=1), NOW + 1)
    assert applied.change is None
    assert led.refused["delta_from_new_epoch"] == 1


def test_a_brand_new_cluster_may_start_with_a_delta() -> None:
    led = Ledger()
    applied = led.apply(hb(7, [ns("n1")], epoch=3), NOW)
    assert applied.change is not None
    assert set(led.clusters["c1"].nodes) == {"n1"}


# -- refusals --------------------------------------------------------------------------------------


def test_a_node_claimed_by_another_cluster_is_refused_and_stays_with_its_owner(ledger: Ledger) -> None:
    applied = ledger.apply(hb(1, [ns("n1", used=7), ns("m1")], cluster="c2", region="r2", full=True), NOW + 1)
    assert applied.change is not None
    assert any("n1" in e and "c1" in e for e in applied.node_errors)
    assert ledger.refused["node_of_other_cluster"] == 1
    assert ledger.nodes["n1"].cluster == "c1"
    assert ledger.nodes["n1"].gpus_used == 0
    assert "n1" not in ledger.clusters["c2"].nodes
    assert [n.node for n in applied.change.nodes] == ["m1"]


def test_a_cluster_cannot_remove_another_clusters_node(ledger: Ledger) -> None:
    ledger.apply(hb(1, [ns("m1")], cluster="c2", region="r2", full=True), NOW + 1)
    applied = ledger.apply(hb(2, [], cluster="c2", region="r2", removed=["n1"]), NOW + 2)
    assert applied.change is None
    assert "n1" in ledger.nodes
    assert "n1" in ledger.clusters["c1"].nodes


def test_a_node_released_by_its_cluster_may_join_another(ledger: Ledger) -> None:
    ledger.apply(hb(2, [], removed=["n2"]), NOW + 1)
    applied = ledger.apply(hb(1, [ns("n2")], cluster="c2", region="r2", full=True), NOW + 2)
    assert applied.node_errors == ()
    assert ledger.nodes["n2"].cluster == "c2"


@pytest.mark.parametrize(
    ("state", "reason"),
    [(ns("n1", total=4, used=5), "5 GPUs used of 4"), (ns("n1", total=4, model=None), "without a model")],
)
def test_impossible_node_numbers_are_refused_and_the_node_keeps_its_state(
    ledger: Ledger, state: NodeState, reason: str
) -> None:
    applied = ledger.apply(hb(2, [state, ns("n2", used=1)]), NOW + 1)
    assert ledger.refused["impossible_node"] == 1
    assert any(reason in e for e in applied.node_errors)
    assert ledger.nodes["n1"].gpus_total == 8
    assert ledger.nodes["n1"].gpus_used == 0
    assert ledger.nodes["n2"].gpus_used == 1, "the other nodes of the heartbeat still apply"


def test_an_impossible_node_in_a_full_snapshot_is_not_removed(ledger: Ledger) -> None:
    applied = ledger.apply(hb(2, [ns("n1", total=2, used=3), ns("n2")], full=True), NOW + 1)
    assert applied.change is None or "n1" not in applied.change.removed
    assert "n1" in ledger.nodes
    assert applied.node_errors, "the impossible node is reported"


def test_a_heartbeat_from_the_future_is_refused_and_creates_nothing() -> None:
    led = Ledger()
    applied = led.apply(hb(1, [ns("n1")], sent_at=NOW + MAX_CLOCK_SKEW_S + 1), NOW)
    assert applied.change is None
    assert applied.ignored is not None
    assert "future" in applied.ignored
    assert led.refused["clock_in_future"] == 1
    assert led.clusters == {}
    assert led.nodes == {}


def test_a_heartbeat_within_the_allowed_skew_is_accepted() -> None:
    led = Ledger()
    assert led.apply(hb(1, [ns("n1")], sent_at=NOW + MAX_CLOCK_SKEW_S), NOW).change is not None
    assert led.refused["clock_in_future"] == 0


def test_a_cluster_that_changes_region_is_refused(ledger: Ledger) -> None:
    applied = ledger.apply(hb(2, [ns("n1", used=4)], region="elsewhere"), NOW + 1)
    assert applied.change is None
    assert ledger.refused["region_changed"] == 1
    assert ledger.nodes["n1"].gpus_used == 0
    assert ledger.clusters["c1"].last_seq == 1


# -- snapshots and removal -------------------------------------------------------------------------


def test_a_full_snapshot_removes_nodes_it_does_not_list(ledger: Ledger) -> None:
    ledger.apply(hb(2, [ns("n3")]), NOW + 1)
    applied = ledger.apply(hb(3, [ns("n1"), ns("n4")], full=True), NOW + 2)
    assert applied.change is not None
    assert sorted(applied.change.removed) == ["n2", "n3"]
    # The agent did not restart, so readers get only what changed, not the whole list again.
    assert not applied.change.full
    assert [n.node for n in applied.change.nodes] == ["n4"]
    assert set(ledger.nodes) == {"n1", "n4"}
    assert ledger.clusters["c1"].nodes == {"n1", "n4"}


def test_an_unchanged_full_snapshot_publishes_nothing(ledger: Ledger) -> None:
    applied = ledger.apply(hb(2, [ns("n1"), ns("n2")], full=True), NOW + 1)
    assert applied.change is None
    assert applied.ignored is None


def test_the_first_full_snapshot_of_a_restarted_agent_is_republished_whole(ledger: Ledger) -> None:
    applied = ledger.apply(hb(1, [ns("n1"), ns("n2")], full=True, epoch=2), NOW + 1)
    assert applied.change is not None and applied.change.full
    assert [n.node for n in applied.change.nodes] == ["n1", "n2"]


def test_a_delta_removes_only_the_nodes_it_names(ledger: Ledger) -> None:
    applied = ledger.apply(hb(2, [], removed=["n2", "never-seen"]), NOW + 1)
    assert applied.change is not None
    assert applied.change.removed == ("n2",)
    assert set(ledger.nodes) == {"n1"}


# -- staleness -------------------------------------------------------------------------------------


def test_expire_marks_a_silent_cluster_stale_after_its_ttl_exactly_once(ledger: Ledger) -> None:
    ttl_s = ledger.clusters["c1"].ttl_s()
    assert ttl_s == MIN_TTL_INTERVALS * 5.0, "a cluster that just joined counts as volatile"
    assert ledger.expire(NOW + ttl_s) == []
    changes = ledger.expire(NOW + ttl_s + 0.001)
    assert len(changes) == 1
    assert changes[0].stale
    assert changes[0].cluster == "c1"
    assert changes[0].version == 2
    assert ledger.clusters["c1"].stale
    assert ledger.expire(NOW + ttl_s + 60) == []


def test_the_stale_deadline_follows_the_clusters_interval() -> None:
    led = Ledger()
    led.apply(hb(1, [ns("n1")], full=True, interval_s=1.0), NOW)
    assert led.expire(NOW + MIN_TTL_INTERVALS) == []
    assert len(led.expire(NOW + MIN_TTL_INTERVALS + 0.01)) == 1


def test_a_stable_cluster_is_given_more_intervals_before_it_goes_stale(ledger: Ledger) -> None:
    volatile_ttl_s = ledger.clusters["c1"].ttl_s()
    for seq in range(2, 30):  # quiet heartbeats: nothing changes
        ledger.apply(hb(seq, [ns("n1")]), NOW + seq)
    stable = ledger.clusters["c1"]
    assert stable.volatility < 0.01
    assert volatile_ttl_s < stable.ttl_s() <= MAX_TTL_INTERVALS * 5.0
    assert stable.ttl_s() > 0.99 * MAX_TTL_INTERVALS * 5.0
    ledger.apply(hb(30, [ns("n1", used=3)]), NOW + 30)
    assert ledger.clusters["c1"].ttl_s() < stable.ttl_s() or ledger.clusters["c1"].volatility > 0.1


def test_reservations_show_until_settled_and_repeats_change_nothing(ledger: Ledger) -> None:
    change = ledger.reserve("job-1:1", [("n1", 3), ("unknown-node", 2)])
    assert change is not None and [n.node for n in change.nodes] == ["n1"]
    assert ledger.nodes["n1"].gpus_reserved == 3 and ledger.nodes["n1"].gpus_free == 5
    assert ledger.reserve("job-1:1", [("n1", 3)]) is None, "a redelivered placement is not counted twice"
    assert ledger.nodes["n1"].gpus_reserved == 3
    # A heartbeat keeps the reservation: only the run starting (or ending) settles it.
    ledger.apply(hb(2, [ns("n1", used=1)]), NOW + 1)
    assert ledger.nodes["n1"].gpus_reserved == 3
    assert ledger.settle("job-1:1") is not None
    assert ledger.nodes["n1"].gpus_reserved == 0
    assert ledger.settle("job-1:1") is None


def test_summaries_count_reserved_and_offer_nothing_from_a_stale_cluster(ledger: Ledger) -> None:
    ledger.reserve("job-1:1", [("n1", 2)])
    summary = ledger.summaries(lambda model: 2.0 if model == "A100" else 1.0)["r1"]
    assert summary["models"]["A100"] == {"gpus_total": 16, "gpus_available": 14, "gpus_reserved": 2}
    assert summary["scu_total"] == 32.0 and summary["scu_available"] == 28.0
    assert summary["zones"]["z1"]["models"]["A100"]["gpus_available"] == 14
    ledger.expire(NOW + 1_000)
    stale = ledger.summaries(lambda _m: 1.0)["r1"]
    assert stale["models"]["A100"]["gpus_available"] == 0 and stale["models"]["A100"]["gpus_total"] == 16


def test_queries_filter_by_zone_model_free_capacity_and_freshness() -> None:
    led = Ledger()
    led.apply(hb(1, [ns("a1", zone="za"), ns("a2", zone="zb", model="T4", total=4, used=4)], full=True), NOW)
    led.apply(hb(1, [ns("b1")], cluster="c2", region="r1", full=True), NOW)
    view = led.query(now=NOW + 1, zone="zb")
    assert list(view["regions"]["r1"]["zones"]) == ["zb"]
    assert led.query(now=NOW + 1, gpu_model="T4", min_free_gpus=1)["regions"] == {}
    both = led.query(now=NOW + 1, min_free_gpus=8)["regions"]["r1"]
    assert both["gpus_free"] == 16 and set(both["zones"]["z1"]["clusters"]) == {"c2"}
    led.expire(NOW + 1_000)
    assert led.query(now=NOW + 1_000, fresh_only=True)["regions"] == {}
    cluster = led.query(now=NOW + 1_000)["regions"]["r1"]["zones"]["z1"]["clusters"]["c2"]
    assert cluster["stale"] and cluster["gpus_free"] == 0 and cluster["age_s"] == 1_000


def test_a_node_of_an_unknown_gpu_model_is_refused_and_counted() -> None:
    led = Ledger(known_models=frozenset({"A100"}))
    applied = led.apply(hb(1, [ns("n1"), ns("n2", model="Z9000")], full=True), NOW)
    assert "n2" not in led.nodes and "n1" in led.nodes
    assert led.refused["unknown_gpu_model"] == 1
    assert any("Z9000" in e and "loom calibrate" in e for e in applied.node_errors)


def test_an_unknown_gpu_model_is_admitted_once_its_cluster_published_a_profile_for_it() -> None:
    led = Ledger(known_models=frozenset({"A100"}))
    led.published_models["c1"] = frozenset({"Z9000"})
    applied = led.apply(hb(1, [ns("n1", model="Z9000")], full=True), NOW)
    assert "n1" in led.nodes and not applied.node_errors
    # Another cluster's profile does not vouch for this one's nodes.
    other = led.apply(hb(1, [ns("m1", model="Z9000")], cluster="c2", full=True), NOW)
    assert "m1" not in led.nodes and other.node_errors


def test_a_heartbeat_after_staleness_yields_a_fresh_change_even_when_nothing_changed(ledger: Ledger) -> None:
    ledger.expire(NOW + 100)
    applied = ledger.apply(hb(2, [ns("n1")]), NOW + 101)
    assert applied.change is not None
    assert not applied.change.stale
    assert not ledger.clusters["c1"].stale
    assert applied.change.version == 3


def test_a_cluster_back_from_stale_is_republished_whole(ledger: Ledger) -> None:
    """Readers closed its nodes when it went stale; a heartbeat that changes nothing must still
    tell them every node's state, or the unlisted nodes stay closed for good."""
    ledger.expire(NOW + 100)
    applied = ledger.apply(hb(2, []), NOW + 101)
    assert applied.change is not None and applied.change.full and not applied.change.stale
    assert [n.node for n in applied.change.nodes] == ["n1", "n2"]
    again = ledger.apply(hb(3, []), NOW + 102)
    assert again.change is None, "once fresh, an unchanged heartbeat publishes nothing"


def test_expire_leaves_fresh_clusters_alone(ledger: Ledger) -> None:
    ledger.apply(hb(1, [ns("m1")], cluster="c2", region="r2", full=True, interval_s=60), NOW)
    changes = ledger.expire(NOW + 20)
    assert [c.cluster for c in changes] == ["c1"]


# -- tree --------------------------------------------------------------------------------------------


def test_tree_totals_add_up_at_every_level() -> None:
    led = Ledger()
    led.apply(
        hb(1, [ns("a1", used=2), ns("a2", total=4, used=4, zone="z2")], cluster="ca", region="r1", full=True),
        NOW,
    )
    led.apply(hb(1, [ns("b1", total=16, used=1, model="V100")], cluster="cb", region="r1", full=True), NOW)
    led.apply(hb(1, [ns("c1", total=2, model="T4")], cluster="cc", region="r2", full=True), NOW)

    regions: Any = led.tree()["regions"]
    assert set(regions) == {"r1", "r2"}
    r1 = regions["r1"]
    assert (r1["gpus_total"], r1["gpus_used"]) == (28, 7)
    assert (r1["zones"]["z1"]["gpus_total"], r1["zones"]["z1"]["gpus_used"]) == (24, 3)
    assert (r1["zones"]["z2"]["gpus_total"], r1["zones"]["z2"]["gpus_used"]) == (4, 4)
    ca = r1["zones"]["z1"]["clusters"]["ca"]
    assert (ca["gpus_total"], ca["gpus_used"], ca["stale"]) == (8, 2, False)
    assert [n["node"] for n in ca["nodes"]] == ["a1"]
    assert (regions["r2"]["gpus_total"], regions["r2"]["gpus_used"]) == (2, 0)


def test_tree_filters_by_region_and_model() -> None:
    led = Ledger()
    led.apply(hb(1, [ns("a1"), ns("a2", model="V100", total=4)], cluster="ca", region="r1", full=True), NOW)
    led.apply(hb(1, [ns("c1", total=2, model="T4")], cluster="cc", region="r2", full=True), NOW)
    assert set(led.tree(region="r2")["regions"]) == {"r2"}
    only_v100: Any = led.tree(gpu_model="V100")["regions"]
    assert only_v100["r1"]["gpus_total"] == 4


def test_tree_shows_stale_clusters() -> None:
    led = Ledger()
    led.apply(hb(1, [ns("a1")], cluster="ca", region="r1", full=True), NOW)
    led.expire(NOW + 1000)
    tree: Any = led.tree()["regions"]
    assert tree["r1"]["zones"]["z1"]["clusters"]["ca"]["stale"] is True
