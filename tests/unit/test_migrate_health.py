import pytest

from loom.migrate.health import (
    AGENT_GONE_MISSES,
    UNREACHABLE_RUN,
    Liveness,
    classify,
    link_unreachable,
    region_reachable,
)
from loom.migrate.resume import resume_point


def test_both_signals_fail_the_cluster() -> None:
    h = classify("c1", heartbeat_lost_s=6.0, ttl_s=5.0, probes_reach=False, region="eu")
    assert h.state == "failed" and h.failed
    assert "probes cannot reach region eu" in h.reason and "no heartbeat" in h.reason


def test_one_signal_alone_is_suspect_with_its_reason() -> None:
    beat = classify("c1", heartbeat_lost_s=6.0, ttl_s=5.0, probes_reach=True, region="eu")
    assert beat.state == "suspect" and "probes still reach" in beat.reason
    probe = classify("c1", heartbeat_lost_s=None, ttl_s=5.0, probes_reach=False, region="eu")
    assert probe.state == "suspect" and "heartbeats are fresh" in probe.reason
    young = classify("c1", heartbeat_lost_s=4.9, ttl_s=5.0, probes_reach=False)
    assert young.state == "suspect"


def test_no_probe_information_waits_twice_the_ttl() -> None:
    early = classify("c1", heartbeat_lost_s=7.0, ttl_s=5.0, probes_reach=None, region="eu")
    assert early.state == "suspect" and "no probe information" in early.reason
    late = classify("c1", heartbeat_lost_s=10.0, ttl_s=5.0, probes_reach=None, region="eu")
    assert late.state == "failed" and "no probe information" in late.reason
    assert classify("c1", heartbeat_lost_s=None, ttl_s=5.0, probes_reach=None).state == "healthy"
    assert classify("c1", heartbeat_lost_s=None, ttl_s=5.0, probes_reach=True).state == "healthy"


def test_bad_parameters_refused() -> None:
    with pytest.raises(ValueError):
        classify("c1", heartbeat_lost_s=1.0, ttl_s=0, probes_reach=None)
    with pytest.raises(ValueError):
        classify("c1", heartbeat_lost_s=1.0, ttl_s=1, probes_reach=None, unknown_probe_factor=0.5)


def test_region_reachability_from_links() -> None:
    links = {("eu", "us"): True, ("us", "eu"): True, ("us", "ap"): False}
    assert region_reachable(links, "eu") is False
    assert region_reachable(links, "us") is True
    assert region_reachable(links, "sa") is None
    assert region_reachable({("eu", "eu"): True}, "eu") is None


def test_links_unreachable_when_stale_or_all_probes_lost() -> None:
    assert link_unreachable(stale=True, loss_rate=0.0)
    assert link_unreachable(stale=False, loss_rate=1.0)
    assert not link_unreachable(stale=False, loss_rate=0.02)
    assert link_unreachable(stale=False, loss_rate=0.3, lost_run=UNREACHABLE_RUN)
    assert not link_unreachable(stale=False, loss_rate=0.3, lost_run=UNREACHABLE_RUN - 1)


def test_agent_gone_and_probes_lost_fail_before_the_heartbeat_ttl() -> None:
    h = classify("c1", heartbeat_lost_s=None, ttl_s=10.0, probes_reach=False, region="eu", agent_gone_s=2.0)
    assert h.state == "failed" and h.failed
    assert "connection gone" in h.reason and "probes cannot reach region eu" in h.reason


def test_agent_gone_alone_is_only_suspect() -> None:
    reach = classify("c1", heartbeat_lost_s=None, ttl_s=10.0, probes_reach=True, agent_gone_s=30.0)
    assert reach.state == "suspect" and "probes still reach" in reach.reason
    # No probe information: the unknown-probe grace counts lost heartbeats only, never the ping.
    unknown = classify("c1", heartbeat_lost_s=None, ttl_s=10.0, probes_reach=None, agent_gone_s=300.0)
    assert unknown.state == "suspect" and "no probe information" in unknown.reason


def test_liveness_needs_consecutive_no_responders() -> None:
    live = Liveness()
    for i in range(AGENT_GONE_MISSES - 1):
        live.record("c1", 100.0 + i, "no_responders")
    assert live.gone_s("c1", 110.0) is None
    live.record("c1", 100.0 + AGENT_GONE_MISSES, "no_responders")
    assert live.gone_s("c1", 110.0) == pytest.approx(10.0)  # timed from the run's first miss
    live.record("c1", 111.0, "answered")
    assert live.gone_s("c1", 112.0) is None and live.answered_at["c1"] == 111.0
    live.forget([])
    assert live.answered_at == {}
    with pytest.raises(ValueError):
        Liveness(misses=0)


def test_a_healthy_but_slow_cluster_is_never_failed() -> None:
    """Pings that time out (a busy agent) break the run of misses; late heartbeats with probes
    answering stay suspect — whatever the heartbeat age, a slow cluster is never failed."""
    live = Liveness()
    t = 0.0
    for i in range(50):
        t = float(i)
        # Mostly timeouts, with the occasional no-responders of a reconnecting client in between.
        live.record("slow", t, "no_responders" if i % 3 == 0 else "timeout")
        assert live.gone_s("slow", t) is None
    for lost in (None, 5.0, 15.0, 120.0):
        h = classify(
            "slow", heartbeat_lost_s=lost, ttl_s=10.0, probes_reach=True, agent_gone_s=live.gone_s("slow", t)
        )
        assert h.state != "failed"
    # Even a gone connection, while probes still reach the region, is suspect only.
    for i in range(AGENT_GONE_MISSES):
        live.record("slow", t + 1 + i, "no_responders")
    gone = live.gone_s("slow", t + 10)
    assert gone is not None
    assert (
        classify("slow", heartbeat_lost_s=None, ttl_s=10.0, probes_reach=True, agent_gone_s=gone).state
        == "suspect"
    )


def test_resume_from_the_recorded_checkpoint_else_the_interval_else_zero() -> None:
    recorded = resume_point(steps=100, checkpoint_every_steps=10, progress=0.57, checkpoint_step=40)
    assert recorded.step == 40 and "recorded" in recorded.why
    interval = resume_point(steps=100, checkpoint_every_steps=10, progress=0.57, checkpoint_step=None)
    assert interval.step == 50 and "interval" in interval.why
    none = resume_point(steps=100, checkpoint_every_steps=0, progress=0.57, checkpoint_step=None)
    assert none.step == 0 and "declares no checkpoints" in none.why
    early = resume_point(steps=100, checkpoint_every_steps=10, progress=0.05, checkpoint_step=None)
    assert early.step == 0 and "no checkpoint reached" in early.why
    assert resume_point(steps=100, checkpoint_every_steps=10, progress=1.0, checkpoint_step=None).step == 99
    assert resume_point(steps=100, checkpoint_every_steps=10, progress=0.7, checkpoint_step=None).step == 70


def test_every_job_with_a_part_on_a_failed_cluster_is_affected_once() -> None:
    from loom.migrate.health import affected_jobs

    clusters_of = {
        "single": ["c-a"],
        "gang": ["c-b", "c-a"],  # a member part on c-a
        "pipeline": ["c-b", "c-c"],
        "elsewhere": ["c-d"],
    }
    assert affected_jobs(clusters_of, ["c-a"]) == {"single": "c-a", "gang": "c-a"}
    assert affected_jobs(clusters_of, ["c-c", "c-b"]) == {"gang": "c-b", "pipeline": "c-b"}
    assert affected_jobs(clusters_of, []) == {}


def test_reachability_in_one_pass_agrees_with_region_reachable() -> None:
    from loom.migrate.health import reachability

    links = {("eu", "us"): True, ("us", "eu"): True, ("us", "ap"): False, ("sa", "sa"): True}
    every = reachability(links)
    for region in ("eu", "us", "ap", "sa"):
        assert every.get(region) == region_reachable(links, region)


def test_a_round_where_every_agent_missed_is_no_evidence() -> None:
    """All agents "gone" at once is the observer's trouble (its reconnection, the bus): no run grows;
    one agent gone among live ones is counted."""
    live = Liveness()
    for i in range(AGENT_GONE_MISSES + 2):
        live.record_round(float(i), {"a": "no_responders", "b": "no_responders"})
    assert live.gone_s("a", 10.0) is None and live.gone_s("b", 10.0) is None
    for i in range(AGENT_GONE_MISSES):
        live.record_round(20.0 + i, {"a": "no_responders", "b": "answered"})
    assert live.gone_s("a", 30.0) == pytest.approx(10.0) and live.gone_s("b", 30.0) is None
    # A single watched cluster (a shard owning one) is judged on its own.
    solo = Liveness()
    for i in range(AGENT_GONE_MISSES):
        solo.record_round(float(i), {"a": "no_responders"})
    assert solo.gone_s("a", 5.0) == pytest.approx(5.0)


def test_notices_tell_failed_at_once_suspect_only_when_it_lasts_and_healthy_only_after_a_notice() -> None:
    from loom.migrate.health import Health, HealthNotices

    notices = HealthNotices(suspect_after_s=5.0)
    suspect = {"a": Health("a", "suspect", "probes cannot reach its region")}
    # Before placement settled after taking the lead: nothing.
    assert notices.due(suspect, 0.0, settled=False) == []
    assert notices.due(suspect, 4.9, settled=True) == []  # a brief blip: nobody paged
    [told] = notices.due(suspect, 5.0, settled=True)
    assert told.state == "suspect"
    notices.told(told, 5.0)
    assert notices.due(suspect, 6.0, settled=True) == []  # told once
    [failed] = notices.due(
        {"a": Health("a", "failed", "both lost"), "b": Health("b", "failed", "x")}, 6.5, settled=True
    )[:1]
    assert (failed.cluster, failed.state) == ("a", "failed")
    notices.told(failed, 6.5)
    [back] = notices.due({}, 7.0, settled=True)
    assert (back.cluster, back.state) == ("a", "healthy")
    notices.told(back, 7.0)
    assert notices.due({}, 8.0, settled=True) == []
    # A cluster suspect for a moment, never told, is never told healthy either; a new spell restarts.
    assert notices.due({"c": Health("c", "suspect", "late")}, 9.0, settled=True) == []
    assert notices.due({}, 10.0, settled=True) == []
    assert notices.due({"c": Health("c", "suspect", "late")}, 13.0, settled=True) == []
    # Not sent (publish failed): due again next cycle.
    [again] = notices.due({"c": Health("c", "suspect", "late")}, 18.0, settled=True)
    assert notices.due({"c": Health("c", "suspect", "late")}, 19.0, settled=True) == [again]


def test_notices_tell_an_unhealthy_state_again_while_it_lasts() -> None:
    """The notice is core NATS: a correlator restarting when it went out hears it again, and the
    correlator lets a state nobody re-tells lapse (CLUSTER_HEALTH_LEASE_S)."""
    from loom.migrate.health import Health, HealthNotices
    from loom_proto.clusters import CLUSTER_HEALTH_LEASE_S, CLUSTER_HEALTH_RETELL_S

    assert CLUSTER_HEALTH_LEASE_S > 2 * CLUSTER_HEALTH_RETELL_S
    notices = HealthNotices(suspect_after_s=5.0, retell_s=30.0)
    failed = {"a": Health("a", "failed", "both lost")}
    [first] = notices.due(failed, 100.0, settled=True)
    notices.told(first, 100.0)
    assert notices.due(failed, 129.9, settled=True) == []
    [again] = notices.due(failed, 130.0, settled=True)
    assert (again.cluster, again.state) == ("a", "failed")
    assert notices.due(failed, 131.0, settled=True) == [again]  # not sent yet: due until told
    notices.told(again, 131.0)
    assert notices.due(failed, 160.0, settled=True) == []
    [back] = notices.due({}, 161.0, settled=True)
    assert back.state == "healthy"
    notices.told(back, 161.0)
    assert notices.due({}, 300.0, settled=True) == []  # healthy is told once, not again
