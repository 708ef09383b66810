"""Loss bursts: a collector probes a link it suspects of loss harder for a moment, sized by
network perception's loss rule, and stops as soon as the verdict is clear either way."""

import csv
import math
import random
from pathlib import Path
from typing import Any

import pytest

from loom.net import Expected, Perception
from loom.net.burst import (
    BURST_PROBE,
    BurstConfig,
    BurstPlanner,
    LinkBurst,
    _share,
    binomial_head,
    probes_needed,
)
from loom.net.linkstate import LinkConfig, binomial_tail, loss_evidence
from loom.netemu.probes import ProbeResult
from loom_benchmarks import net_shift
from loom_proto.net import ProbeSample
from loom_services.probe_collector.collector import BurstRounds

T0 = 1_767_225_600.0


def test_binomial_head() -> None:
    assert binomial_head(0, 100, 0.03) == pytest.approx(0.97**100)
    assert binomial_head(1, 10, 0.1) == pytest.approx(0.9**10 + 10 * 0.1 * 0.9**9)
    assert binomial_head(5, 5, 0.5) == 1.0 and binomial_head(-1, 5, 0.5) == 0.0
    assert binomial_head(0, 10, 0.0) == 1.0 and binomial_head(3, 10, 1.0) == 0.0
    # Head and tail of the same distribution add up to one.
    assert binomial_head(4, 300, 0.01) + binomial_tail(5, 300, 0.01) == pytest.approx(1.0)


def test_probes_needed_is_the_fewest_that_make_the_target_loss_significant() -> None:
    config = BurstConfig()
    link = config.link
    # A minute of steady probes (300), one lost: how many more until 3 % would be significant?
    m = probes_needed(300, 1.0, config, 5000)
    p, z = config.target_loss, config.power_z

    def significant(extra: int) -> bool:
        n = 300 + extra
        k = math.floor(1 + p * extra - z * math.sqrt(p * (1 - p) * extra))
        return k >= link.degrade_loss * n and binomial_tail(k, n, link.null_loss) < link.loss_alpha

    assert 900 < m < 1300  # 1,052 against the 1 % threshold (493 against 0.5 %: a link losing 0.9 % passed)
    assert significant(m) and not significant(m - 1)
    assert probes_needed(300, 30.0, config, 5000) == 0  # already significant: nothing to send
    assert probes_needed(300, 1.0, config, 100) == 100  # never more than the limit
    # Weaker evidence to show (2 %) or more to spare (power) takes more probes.
    assert probes_needed(300, 1.0, BurstConfig(target_loss=0.02), 5000) > m
    assert probes_needed(300, 1.0, BurstConfig(power_z=0.0), 5000) < m


def _period(burst: LinkBurst, t: float, rng: random.Random, loss: float, overdue_s: float = 0.5) -> int:
    """One 1 s period: 5 steady probes, then the burst's (all answered or lost at once, 2 s timeout
    modelled by reporting the results at the next period)."""
    for _ in range(5):
        burst.on_result(T0 + t, rng.random() < loss)
    return burst.want(T0 + t + 1.0, overdue_s)


def test_a_link_at_rest_never_bursts() -> None:
    burst = LinkBurst(BurstConfig(), T0)
    rng = random.Random(1)
    assert all(_period(burst, t, rng, 0.0) == 0 for t in range(600))
    assert burst.episodes == 0 and burst.probes == 0


def _send(burst: LinkBurst, at: float, count: int, lost: int, answer_at: float) -> None:
    burst.on_sent(T0 + at, count)
    for i in range(count):
        burst.on_result(T0 + answer_at, i < lost, burst=True, sent_at=T0 + at)


def test_a_lost_probe_starts_a_burst_that_ends_good_when_its_probes_come_back() -> None:
    config = BurstConfig()
    burst = LinkBurst(config, T0)
    for t in range(60):
        for _ in range(5):
            burst.on_result(T0 + t, False)
        assert burst.want(T0 + t + 1, 0.5) == 0
    burst.on_result(T0 + 61, True)  # one lost probe
    want = burst.want(T0 + 62, 0.5)
    assert burst.active and burst.episodes == 1
    long = loss_evidence(burst.window, T0 + 62, config.link).long
    assert long.lost == 1 and long.sent >= 250
    assert want == min(probes_needed(long.sent, 1.0, config, config.max_per_episode), config.max_per_period)
    granted = burst.grant(T0 + 62, want)
    assert granted == want
    _send(burst, 62.0, granted, 0, 62.2)
    assert burst.want(T0 + 63, 0.5) == 0
    assert burst.ends == {"bad": 0, "good": 1, "capped": 0}
    assert not _active(burst)
    # A cool-down, then a back-off: the next single lost probe does not start another at once ...
    burst.on_result(T0 + 64, True)
    assert burst.want(T0 + 65, 0.5) == 0 and burst.episodes == 1
    burst.on_result(T0 + 80, True)
    assert burst.want(T0 + 81, 0.5) == 0 and burst.episodes == 1  # 30 s back-off after one good
    # ... after it, one does, and starts with just enough probes to find nothing again.
    burst.on_result(T0 + 100, True)
    assert burst.want(T0 + 101, 0.5) == burst.clear_probes() == math.ceil(math.log(0.01) / math.log(0.98))
    assert burst.episodes == 2


def _active(burst: LinkBurst) -> bool:
    return burst.active  # read afresh (mypy keeps an earlier assert's narrowing otherwise)


def test_unanswered_probes_count_as_lost_until_the_verdict_is_clear() -> None:
    burst = LinkBurst(BurstConfig(), T0)
    burst.on_result(T0, True)
    want = burst.grant(T0 + 1, burst.want(T0 + 1, 0.5))
    burst.on_sent(T0 + 1, want)
    # All but 20 answered; those 20 are overdue: counted lost, the episode is not clear yet.
    for _ in range(want - 20):
        burst.on_result(T0 + 1.2, False, burst=True, sent_at=T0 + 1)
    assert burst.clear_evidence(T0 + 1.5) == (want, 20)
    assert burst.want(T0 + 2, 0.5) == 0  # 20 lost in flight: the rule's need is covered; wait
    assert burst.active


def test_a_lossy_link_ends_the_burst_with_the_rules_verdict() -> None:
    config = BurstConfig()
    burst = LinkBurst(config, T0)
    perception = Perception(["a", "b"], expected={("a", "b"): Expected(100.0, 2.0)})
    rng = random.Random(3)
    degraded_at = None
    for t in range(120):
        lost = [rng.random() < (0.03 if t >= 60 else 0.0) for _ in range(5)]
        for i, gone in enumerate(lost):
            burst.on_result(T0 + t + 0.2 * i, gone)
        perception.ingest(_sample(t * 10, T0 + t, 5, sum(lost)), T0 + t + 0.1)
        want = burst.grant(T0 + t + 1, burst.want(T0 + t + 1, 0.5))
        if want:
            burst.on_sent(T0 + t + 1, want)
            batch = [rng.random() < 0.03 for _ in range(want)]
            for gone in batch:
                burst.on_result(T0 + t + 3, gone, burst=True, sent_at=T0 + t + 1)
            sample = _sample(t * 10 + 5, T0 + t + 1, want, sum(batch), probe=BURST_PROBE)
            perception.ingest(sample, T0 + t + 3.1)
        events = perception.tick(T0 + t + 1)
        if degraded_at is None and any(e.kind == "degraded" for e in events):
            degraded_at = t
    assert burst.ends["bad"] >= 1 and not burst.active
    assert degraded_at is not None and degraded_at < 90  # steady probes alone: ~38 periods on average
    assert burst.probes <= config.max_per_episode * burst.episodes


def _sample(seq: int, at: float, sent: int, lost: int, probe: str = "udp_echo") -> ProbeSample:
    return ProbeSample(
        src="a",
        dst="b",
        probe=probe,  # type: ignore[arg-type]
        seq=seq,
        sent_at=at,
        rtt_ms=100.0 if lost < sent else None,
        sent=sent,
        lost=lost,
    )


def test_burst_samples_count_probes_not_rtts() -> None:
    perception = Perception(["a", "b"], expected={("a", "b"): Expected(100.0, 2.0)})
    tracker = perception.links["a", "b"]
    for i in range(10):
        perception.ingest(_sample(i, T0 + i, 5, 0), T0 + i + 0.1)
    rtts = len(tracker.window)
    slow = ProbeSample(
        src="a", dst="b", probe="udp_burst", seq=100, sent_at=T0 + 10, rtt_ms=900.0, sent=400, lost=20
    )
    assert perception.ingest(slow, T0 + 10.5) is None
    assert len(tracker.window) == rtts  # its RTT (probes queued behind each other) is not the link's
    loss = tracker.window.loss_stats(T0 + 11, 60.0)
    assert (loss.sent, loss.lost) == (450, 20)  # its probes are, weighed by their counts
    assert tracker.lost_run == 0  # some were answered: not a run of losses
    events = perception.tick(T0 + 11)
    assert [e.kind for e in events] == ["degraded"] and tracker.rtt_ms == pytest.approx(100.0)


def test_the_collector_share_and_the_token_bucket_bound_bursts() -> None:
    assert _share({"a": 100, "b": 700, "c": 700}, 1000) == {"a": 100, "b": 450, "c": 450}
    assert _share({"a": 10, "b": 20}, 1000) == {"a": 10, "b": 20}
    assert sum(_share({"a": 999, "b": 999, "c": 999}, 1000).values()) == 1000
    config = BurstConfig(max_per_collector_period=500, max_per_episode=600, budget_per_s=1.0)
    planner = BurstPlanner(config)
    for key in ("x", "y", "z"):
        planner.on_result(key, T0, True)
    for key in ("q", "u", "v", "w"):  # most links lost nothing (all losing at once holds bursts)
        planner.on_result(key, T0, False)
    plan = planner.plan(T0 + 1, 0.5)
    assert sum(plan.values()) <= 500 and set(plan) == {"x", "y", "z"}
    # The bucket: what a link sent is gone from it, refilled at budget_per_s.
    link = planner.links["x"]
    assert link.bucket.tokens == pytest.approx(600 - plan["x"])
    assert link.grant(T0 + 1, 10_000) == int(600 - plan["x"])
    assert link.grant(T0 + 11, 10_000) == 10


def test_burst_rounds_go_out_in_the_order_they_were_sent() -> None:
    rounds = BurstRounds("a", "b")
    for seq in (1, 2, 3):
        rounds.sent(seq)
    assert rounds.seal() == []
    for seq in (4, 5):
        rounds.sent(seq)
    assert rounds.seal() == []
    # The second period's probes all come back first; its sample waits for the first period's.
    assert rounds.add(ProbeResult(4, T0 + 1.0, 50.0)) == []
    assert rounds.add(ProbeResult(5, T0 + 1.0, 52.0)) == []
    assert rounds.add(ProbeResult(1, T0, 50.0)) == []
    assert rounds.add(ProbeResult(2, T0, 51.0)) == []
    samples = rounds.add(ProbeResult(3, T0, None))  # lost: its timeout completes both periods
    assert [(s.probe, s.seq, s.sent, s.lost, s.jitter_ms) for s in samples] == [
        ("udp_burst", 3, 3, 1, None),
        ("udp_burst", 5, 2, 0, None),
    ]
    assert not rounds.owns(4) and rounds.add(ProbeResult(9, T0, 1.0)) == []


def test_the_policy_keeps_its_length_in_periods_at_other_periods() -> None:
    fast = BurstConfig().for_period(0.2)
    assert fast.cooldown_s == pytest.approx(2.0) and fast.backoff_max_s == pytest.approx(120.0)
    assert fast.link.loss_horizon_s == pytest.approx(12.0) and fast.budget_per_s == pytest.approx(5.0)
    assert fast.link.horizons_s == pytest.approx((2.0, 12.0, 60.0))
    assert BurstConfig().for_period(1.0) == BurstConfig()


def test_disabled_bursts_send_nothing() -> None:
    planner = BurstPlanner(BurstConfig(enabled=False, link=LinkConfig()))
    planner.on_result("x", T0, True)
    assert planner.plan(T0 + 1, 0.5) == {}


def test_the_model_of_the_chain_sees_3_percent_loss_sooner_with_bursts() -> None:
    # The same trials (seed) through the chain with and without bursts (net_shift's model: the
    # collector's rounds and burst policy, network perception's core, on a simulated clock).
    kwargs: dict[str, Any] = {
        "trials": 6,
        "seed": 4,
        "period_s": 1.0,
        "base_ms": 100.0,
        "mdev_ms": 2.0,
        "factor": 1.0,
        "loss": 0.03,
        "periods_after": 40,
    }
    steady = net_shift.timing(net_shift.STEADY, **kwargs)
    burst = net_shift.timing(net_shift.AFTER, **kwargs)
    assert steady["burst_probes_per_trial"]["max"] == 0
    assert burst["missed"] == 0 and burst["burst_probes_per_trial"]["mean"] > 0
    assert burst["event_periods"]["mean"] < steady["event_periods"]["mean"] or steady["missed"] > 0
    # Once a probe is lost, the burst's verdict comes within a few periods (two probe timeouts).
    assert burst["event_after_first_lost_probe_periods"]["max"] < 10


def test_no_episode_starts_while_the_collector_lags_or_most_links_lose_a_probe() -> None:
    planner = BurstPlanner(BurstConfig())
    keys = ("x", "y", "z")
    for key in keys:
        planner.on_result(key, T0, False)
    # A stall: the probe timers of every link fired late, each link "lost" a probe.
    for key in keys:
        planner.on_result(key, T0 + 0.5, True)
    assert planner.plan(T0 + 1, dict.fromkeys(keys, 0.5)) == {}  # most links at once: the host
    assert planner.held == 1 and planner.counts()["burst_episodes"] == 0
    # One link alone losing a probe starts one, unless the collector says it is lagging.
    planner.on_result("x", T0 + 1.5, True)
    assert planner.plan(T0 + 2, dict.fromkeys(keys, 0.5), lagging=True) == {}
    assert planner.counts()["burst_held"] == 2 and not planner.links["x"].active
    planner.on_result("x", T0 + 2.5, True)
    plan = planner.plan(T0 + 3, dict.fromkeys(keys, 0.5))
    assert set(plan) == {"x"} and planner.counts()["burst_episodes"] == 1
    # An episode going on goes on while the collector lags; none starts elsewhere.
    planner.on_result("y", T0 + 3.5, True)
    again = planner.plan(T0 + 4, dict.fromkeys(keys, 0.5), lagging=True)
    assert planner.links["x"].active and "y" not in again and not planner.links["y"].active


def test_only_the_links_being_probed_are_planned_and_the_limits_hold() -> None:
    config = BurstConfig(max_per_collector_period=300)
    planner = BurstPlanner(config)
    for key in ("gone", "x"):
        planner.on_result(key, T0, True)
    # "gone" has no prober (not in overdue_s): not planned, and takes none of the collector's budget.
    plan = planner.plan(T0 + 1, {"x": 0.5})
    assert set(plan) == {"x"} and plan["x"] == 300
    assert not planner.links["gone"].active and planner.links["gone"].bucket.tokens == config.max_per_episode
    # A per-period limit (what the collector can send on the link) caps the grant and the tokens taken.
    other = BurstPlanner(config)
    other.on_result("x", T0, True)
    assert other.plan(T0 + 1, {"x": 0.5}, limits={"x": 120}) == {"x": 120}
    assert other.links["x"].bucket.tokens == pytest.approx(config.max_per_episode - 120)


def test_burst_counts_never_go_backwards_when_a_link_is_reset() -> None:
    planner = BurstPlanner(BurstConfig())
    planner.on_result("x", T0, True)
    plan = planner.plan(T0 + 1, {"x": 0.5})
    planner.on_sent("x", T0 + 1, plan["x"])
    for _ in range(plan["x"]):
        planner.on_result("x", T0 + 1.2, False, burst=True, sent_at=T0 + 1)
    planner.plan(T0 + 2, {"x": 0.5})
    before = planner.counts()
    assert before["burst_episodes"] == 1 and before["burst_ended_good"] == 1
    assert before["burst_probes"] == plan["x"]
    planner.reset("x")  # a new prober for the link
    after = planner.counts()
    assert {k: after[k] for k in before if k != "burst_active"} == {
        k: before[k] for k in before if k != "burst_active"
    }
    planner.on_result("x", T0 + 100, True)
    planner.plan(T0 + 101, {"x": 0.5})
    assert planner.counts()["burst_episodes"] == 2


def test_the_false_positive_model_reads_the_measured_links_packaged_with_it() -> None:
    """``net_shift`` runs from an installed package: its measured links are package data (it read
    ``../shared`` beside the checkout, so a copy elsewhere stopped with FileNotFoundError)."""
    package = Path(net_shift.__file__).resolve().parent
    assert net_shift.DATA.is_relative_to(package) and net_shift.DATA.is_file()
    with net_shift.DATA.open() as f:
        rows = list(csv.DictReader(f))
    columns = ("src_region", "dst_region", "min_rtt_ms", "avg_rtt_ms", "max_rtt_ms", "mdev_rtt_ms")
    assert len(rows) == 8010 and tuple(rows[0]) == columns
    out = net_shift.false_positives(net_shift.AFTER, links=3, periods=20, seed=1, spikes=0.01)
    assert out["links"] == 3
