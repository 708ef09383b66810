"""Probe intensity follows use (the links running jobs span are probed densely, within a budget),
and the loss rule's sequential test that turns those probes into a verdict within periods."""

import functools
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np
import pytest

from loom.net import Expected, LinkConfig, Perception
from loom.net.burst import BURST_PROBE
from loom.net.intensity import UseConfig, dense_overdue_s, dense_plan, links_in_use
from loom.net.linkstate import LinkTracker, binomial_tail, cusum_weights, loss_evidence
from loom.net.window import LinkWindow
from loom.netemu.emulator import LinkParams
from loom.netemu.probes import ProbeResult, receive_buffer_bytes
from loom_proto.codec import DecodeError, decode, encode
from loom_proto.net import LinkInUse, LinksInUse, ProbeSample
from loom_services.probe_collector.collector import (
    BurstRounds,
    CollectorConfig,
    PeerLink,
    ProbeCollector,
    dense_phase_s,
)

T0 = 1_767_225_600.0


def test_links_in_use_are_both_directions_between_the_regions_of_each_job() -> None:
    use = links_in_use([["weu", "sea1", "weu"], ["use2"], ["sea1", "weu"], ["a", "b", "c"]])
    assert use[("weu", "sea1")] == use[("sea1", "weu")] == 2  # two jobs span it
    assert ("use2", "use2") not in use and not any("use2" in key for key in use)  # one region: no link
    assert {key for key, n in use.items() if n == 1} == {
        ("a", "b"), ("b", "a"), ("a", "c"), ("c", "a"), ("b", "c"), ("c", "b"),
    }  # fmt: skip
    assert links_in_use([]) == {}


def test_dense_plan_gives_each_link_in_use_its_rate_within_the_collectors_budget() -> None:
    config = UseConfig(probes_per_period=600, budget_per_s=1200.0)
    assert dense_plan(["b", "a"], config, 1.0) == {"a": 600, "b": 600}
    # Three links share the budget evenly: 400 each, whatever their order.
    assert dense_plan(["c", "a", "b"], config, 1.0) == {"a": 400, "b": 400, "c": 400}
    # The budget is a rate: shorter periods get proportionally fewer probes a period.
    assert dense_plan(["a"], config, 0.2) == {"a": 240}
    # At most what the collector can send on a link; nothing with no link in use, or disabled.
    assert dense_plan(["a", "b"], config, 1.0, limits={"a": 100}) == {"a": 100, "b": 600}
    assert dense_plan([], config, 1.0) == {}
    assert dense_plan(["a"], UseConfig(enabled=False), 1.0) == {}
    # A budget too small for one probe each sends none (not a share of zero).
    assert dense_plan(["a", "b", "c"], UseConfig(budget_per_s=2.0), 1.0) == {}


def test_the_default_plan_gives_one_link_in_use_the_rate_the_loss_test_needs() -> None:
    # The shipped defaults: one link in use per collector gets 1,200 a 1 s period (3 % against 1 %
    # needs ~970 probes on average), at most 240 a tick; a second link halves both (the stated limit:
    # 3 % then takes ~2.8 periods), a 0.2 s period gets a fifth.
    config = UseConfig()
    assert dense_plan(["a"], config, 1.0) == {"a": 1200}
    assert config.max_per_tick * 5 == 1200
    assert dense_plan(["a", "b"], config, 1.0) == {"a": 600, "b": 600}
    assert dense_plan(["a"], config, 0.2) == {"a": 240}


def test_the_total_never_exceeds_the_budget() -> None:
    rng = random.Random(3)
    for _ in range(200):
        config = UseConfig(probes_per_period=rng.randint(1, 1000), budget_per_s=rng.uniform(1, 5000))
        links = [f"r{i}" for i in range(rng.randint(1, 12))]
        period_s = rng.choice([0.2, 0.5, 1.0])
        plan = dense_plan(links, config, period_s)
        assert sum(plan.values()) <= config.budget_per_s * period_s
        assert all(n <= config.probes_per_period for n in plan.values())


def test_dense_overdue_is_six_rtts_within_its_bounds() -> None:
    config = UseConfig()
    assert dense_overdue_s(167.0, config, 2.0) == pytest.approx(1.002)
    assert dense_overdue_s(20.0, config, 2.0) == config.overdue_min_s  # short links: the floor
    assert dense_overdue_s(900.0, config, 2.0) == 2.0  # never past the probe timeout
    assert dense_overdue_s(None, config, 2.0) == 2.0  # no RTT yet: the probe timeout


def _window(rows: list[tuple[float, int, int]]) -> LinkWindow:
    window = LinkWindow()
    for t, sent, lost in rows:
        window.add_probes(T0 + t, sent, lost)
    return window


def test_loss_cusum_is_the_best_scoring_run_ending_now() -> None:
    lost_llr, kept_llr = cusum_weights(0.03, 0.005)
    assert lost_llr == pytest.approx(math.log(6.0)) and kept_llr == pytest.approx(math.log(0.97 / 0.995))
    # Clean probes, then a lossy stretch of the last two rows: the run is those two rows.
    window = _window([(float(t), 5, 0) for t in range(40)] + [(40.0, 100, 6), (41.0, 100, 5)])
    score, run = window.loss_cusum(T0 + 41, 60.0, lost_llr, kept_llr)
    assert (run.sent, run.lost) == (200, 11)
    assert score == pytest.approx(11 * lost_llr + 189 * kept_llr)
    # Clean probes after the stretch pull the score down, and a run must end now.
    window.add_probes(T0 + 42, 200, 0)
    later, run = window.loss_cusum(T0 + 42, 60.0, lost_llr, kept_llr)
    assert later == pytest.approx(score + 200 * kept_llr) and run.sent == 400
    # No loss at all: nothing scores.
    assert _window([(1.0, 300, 0)]).loss_cusum(T0 + 1, 60.0, lost_llr, kept_llr)[0] == 0.0
    # Rows older than the horizon, or before ``since``, are not looked at.
    assert window.loss_cusum(T0 + 200, 60.0, lost_llr, kept_llr)[0] == 0.0
    assert window.loss_cusum(T0 + 42, 60.0, lost_llr, kept_llr, since=T0 + 41.5)[0] == 0.0


def test_a_dense_stretch_at_three_percent_is_significant_and_one_at_the_threshold_is_not() -> None:
    config = LinkConfig()
    # A minute of a densely probed link losing 0.5 % (600 probes a second, 3 lost).
    steady = [(float(t), 600, 3) for t in range(59)]
    # Then 1,200 probes losing 3 % (36): the sequential test holds (3 % against 1 %: 15.8), the
    # long window alone (210 of 36,000) would not.
    bad = _window([*steady, (59.0, 600, 18), (60.0, 600, 18)])
    evidence = loss_evidence(bad, T0 + 60, config)
    assert evidence.cusum >= config.cusum_h
    assert evidence.significant and evidence.degrading(config)
    assert evidence.tested == pytest.approx(0.03) and evidence.used.loss_rate == pytest.approx(0.03)
    assert binomial_tail(evidence.long.lost, evidence.long.sent, config.null_loss) > config.loss_alpha
    # One period's 600 at 3 % are not yet enough against 1 % (7.9; against 0.5 % they were).
    evidence = loss_evidence(_window([*steady, (59.0, 600, 3), (60.0, 600, 18)]), T0 + 60, config)
    assert 0 < evidence.cusum < config.cusum_h and not evidence.significant
    # The same 1,200 probes losing 1 % (12), 1.5 % (18) or 2 % (24): no verdict.
    for lost in (12, 18, 24):
        window = _window([*steady, (59.0, 600, lost // 2), (60.0, 600, lost - lost // 2)])
        evidence = loss_evidence(window, T0 + 60, config)
        assert evidence.cusum < config.cusum_h and not evidence.significant, lost
    # A short run of bad luck (5 of the latest 50 lost) is no verdict either: the fixed short
    # window alone no longer makes one (it alarmed on every such stretch).
    sparse = [(float(t), 5, 0) for t in range(60)]
    unlucky = _window([*sparse[:-10], *[(float(t), 5, int(t % 2 == 0)) for t in range(50, 60)]])
    evidence = loss_evidence(unlucky, T0 + 60, config)
    assert evidence.long.lost == 5 and not evidence.significant


def _dense_events(tracker: LinkTracker, rows: Sequence[int], start: int = 0) -> list[tuple[int, str]]:
    """Not a test: feed ``tracker`` 5 ticks a second, each a steady probe and a row of 240 extra
    probes (a link in use at the default rate), ``rows[i]`` of them lost, evaluating after each;
    the (row, kind) of each event."""
    events = []
    for i, lost in enumerate(rows):
        now = T0 + (start + i) * 0.2
        tracker.add(now, 100.0)
        tracker.add(now, 100.0, 240, int(lost), counts_only=True)
        event = tracker.evaluate(now)
        if event is not None:
            events.append((start + i, event.kind))
    return events


@pytest.mark.parametrize("loss", [0.007, 0.009])
def test_a_dense_link_losing_just_under_one_percent_is_not_degraded_in_a_quarter_of_an_hour(
    loss: float,
) -> None:
    # 15 minutes of 1,200 probes a second (over a million) losing a steady 0.7 % or 0.9 %: the
    # threshold is 1 %, so no verdict. The rule before (3 % weighed against 0.5 %, cusum_h 11,
    # the long window tested against 0.5 %) took these very rows for degraded within 8 minutes.
    rows = np.random.default_rng(2).binomial(240, loss, 15 * 60 * 5).tolist()
    tracker = LinkTracker("a", "b", expected=Expected(100.0, 5.0))
    assert _dense_events(tracker, rows) == []
    assert not tracker.degraded and tracker.loss_rate < 0.01
    before = LinkTracker("a", "b", LinkConfig(null_loss=0.005, cusum_h=11.0), Expected(100.0, 5.0))
    assert [kind for _, kind in _dense_events(before, rows)][:1] == ["degraded"]


def test_a_dense_link_losing_three_percent_is_degraded_within_two_seconds() -> None:
    # From a minute at 0.5 %, 3 % at 1,200 probes a second: degraded within 8 rows of 240
    # (1,920 probes) in each of 20 runs (3 % against 1 % needs about 970 on average).
    for seed in range(20):
        rng = np.random.default_rng(100 + seed)
        tracker = LinkTracker("a", "b", expected=Expected(100.0, 5.0))
        assert _dense_events(tracker, rng.binomial(240, 0.005, 300).tolist()) == []
        events = _dense_events(tracker, rng.binomial(240, 0.03, 8).tolist(), start=300)
        assert [kind for _, kind in events] == ["degraded"], seed


@pytest.mark.parametrize(("after", "recovers"), [(0.005, True), (0.008, False), (0.01, False)])
def test_a_degraded_link_recovers_only_once_its_loss_is_back_at_half_a_percent(
    after: float, recovers: bool
) -> None:
    # Hysteresis: degraded on loss shown above 1 %, recovered only once it is no longer shown above
    # 0.5 %. A link back at 0.8 % or 1 % after 3 % stays degraded (before the review's fix its
    # windows, not significant against 1 %, read as 0 and it recovered within half a minute).
    rng = np.random.default_rng(7)
    tracker = LinkTracker("a", "b", expected=Expected(100.0, 5.0))
    assert _dense_events(tracker, rng.binomial(240, 0.005, 300).tolist()) == []
    events = _dense_events(tracker, rng.binomial(240, 0.03, 50).tolist(), start=300)
    assert [kind for _, kind in events] == ["degraded"]
    events = _dense_events(tracker, rng.binomial(240, after, 4 * 60 * 5).tolist(), start=350)
    assert [kind for _, kind in events] == (["recovered"] if recovers else [])


@pytest.mark.parametrize("loss", [0.0105, 0.011, 0.012])
def test_a_dense_link_hovering_just_above_the_threshold_does_not_flap(loss: float) -> None:
    # 20 minutes at a steady 1.05-1.2 %: degraded once, and it stays so (the exit test is against
    # 0.5 %); the rule as merged went degraded / recovered about ten times at 1.1 %.
    rows = np.random.default_rng(3).binomial(240, loss, 20 * 60 * 5).tolist()
    tracker = LinkTracker("a", "b", expected=Expected(100.0, 5.0))
    assert [kind for _, kind in _dense_events(tracker, rows)] == ["degraded"]


def test_loss_thresholds_out_of_order_are_refused() -> None:
    for bad in (
        {"null_loss": 0.0},
        {"null_loss": 0.004},  # below recover_loss
        {"null_loss": 0.03, "degrade_loss": 0.03},  # no room for the sequential test
        {"cusum_loss": 1.0},
        {"cusum_h": 0.0},
    ):
        with pytest.raises(ValueError, match=r"loss thresholds|cusum_h"):
            LinkConfig(**bad)  # type: ignore[arg-type]


def test_a_counts_only_sample_that_lost_probes_is_evaluated_at_once() -> None:
    perception = Perception(["a", "b"], expected={("a", "b"): Expected(100.0, 5.0)})
    t = T0
    for k in range(60):  # a minute of clean steady rounds, the link known
        t = T0 + k
        perception.ingest(
            ProbeSample(src="a", dst="b", probe="udp_echo", seq=k, sent_at=t - 0.5, rtt_ms=100.0, sent=5), t
        )
        perception.tick(t)

    def dense(seq: int, lost: int, at: float) -> ProbeSample:
        return ProbeSample(
            src="a", dst="b", probe=BURST_PROBE, seq=seq, sent_at=at - 1, rtt_ms=100.0, sent=120, lost=lost
        )

    assert perception.ingest(dense(1, 0, t + 0.1), t + 0.1) is None
    assert perception.shifted() == []  # nothing lost: waits for the period's tick
    events = []
    for j in range(5):  # ticks of 120 probes losing 3.3 %: the fifth makes the run score 10.1
        at = t + 0.2 * (j + 1)
        assert perception.ingest(dense(2 + j, 4, at), at) is None
        assert perception.shifted() == [("a", "b")]
        events.append(perception.evaluate_shifted(at))
    assert [[e.kind for e in tick] for tick in events] == [[], [], [], [], ["degraded"]]
    assert "loss" in events[4][0].reason
    # Degraded already: further lossy samples wait for the tick.
    assert perception.ingest(dense(9, 4, t + 1.2), t + 1.2) is None
    assert perception.shifted() == []


def test_a_dropped_extra_probe_counts_neither_sent_nor_lost() -> None:
    rounds = BurstRounds("a", "b")
    for seq in range(4):
        rounds.sent(seq)
    assert rounds.seal() == []  # nothing answered yet
    assert rounds.add(ProbeResult(seq=0, sent_at=T0, rtt_ms=100.0)) == []
    assert rounds.add(ProbeResult(seq=1, sent_at=T0, rtt_ms=None)) == []
    assert rounds.drop(2) == []  # its timeout fired late: no evidence either way
    assert rounds.drop(2) == []  # dropping twice changes nothing
    (sample,) = rounds.add(ProbeResult(seq=3, sent_at=T0 + 0.01, rtt_ms=101.0))
    assert (sample.probe, sample.sent, sample.lost) == (BURST_PROBE, 3, 1)
    assert not rounds.owns(2)


def test_links_in_use_travel_as_a_strict_contract() -> None:
    use = LinksInUse(links=[LinkInUse(src="weu", dst="sea1", jobs=2)], ttl_s=20.0, at=T0)
    assert decode(encode(use), LinksInUse) == use
    with pytest.raises(DecodeError):  # unknown fields are refused, as every contract's
        decode(b'{"kind": "links_in_use", "links": [], "ttl_s": 20, "at": 1, "extra": 1}', LinksInUse)
    with pytest.raises(DecodeError):
        decode(b'{"kind": "links_in_use", "links": [], "ttl_s": 0, "at": 1}', LinksInUse)


def _dense_tracker(
    tracker: LinkTracker, seconds: int, lost_of_row: Callable[[int], int], start: int = 0
) -> list[float]:
    """Not a test: feed ``tracker`` 5 ticks a second, each a steady probe and a row of 120 extra
    probes losing ``lost_of_row(tick)``, evaluating after each; the loss rates read."""
    rates = []
    for k in range(start, start + seconds * 5):
        now = T0 + k * 0.2
        tracker.add(now, 100.0)
        tracker.add(now, 100.0, 120, lost_of_row(k), counts_only=True)  # some were answered
        tracker.evaluate(now)
        rates.append(tracker.loss_rate)
    return rates


def test_a_dense_link_below_the_threshold_is_neither_degraded_nor_priced_up_by_one_unlucky_tick() -> None:
    # 0.5 % (0.6 of a row of 120 on average): one tick losing 3 is no rise (before: priced at 2.5 %).
    tracker = LinkTracker("a", "b", expected=Expected(100.0, 5.0))
    rates = _dense_tracker(tracker, 120, lambda k: int(k % 5 < 3))[-100:]
    rates += _dense_tracker(tracker, 1, lambda k: 3 if k == 600 else 0, start=600)
    assert max(rates) < 0.007 and not tracker.degraded
    # 0.7 %: the long window (36,000 probes) is not significant against the 1 % threshold (it
    # was against 0.5 %), and one tick losing 4 (3.3 %) does not make it a verdict (before: degraded).
    tracker = LinkTracker("a", "b", expected=Expected(100.0, 5.0))
    _dense_tracker(tracker, 120, lambda k: int(k % 6 != 0))
    assert not loss_evidence(tracker.window, T0 + 119.8, LinkConfig()).significant
    assert loss_evidence(tracker.window, T0 + 119.8, LinkConfig(null_loss=0.005)).significant
    rates = _dense_tracker(tracker, 1, lambda k: 4 if k == 600 else 1, start=600)
    assert not tracker.degraded and max(rates) < 0.01
    # 3 % from there (18 of a period's 600): degraded within two seconds, and priced so.
    rates = _dense_tracker(tracker, 2, lambda k: (4, 4, 3, 4, 3)[k % 5], start=605)
    assert tracker.degraded and rates[-1] >= 0.02


class _StallingCollector:
    """Not a test: what ``ProbeCollector._dense_result`` reads of its collector, the loop having
    stalled after ``stall_at`` (wall s)."""

    def __init__(self, stall_at: float) -> None:
        self.config = CollectorConfig()
        self.counts: Counter[str] = Counter()
        self.stall_at = stall_at
        self._dense = {"b": (120, 30.0)}  # this period's deadline: not the one the probes went out with
        self.samples: list[ProbeSample] = []

    def _stalled_since(self, at: float) -> bool:
        return at <= self.stall_at

    def _enqueue_dense(self, sample: ProbeSample) -> None:
        self.samples.append(sample)


def test_extra_probes_sent_across_a_stall_are_dropped_answered_or_not_by_their_own_deadline() -> None:
    now = time.time()
    collector = _StallingCollector(stall_at=now - 10.0)
    link = PeerLink("a", "b", LinkParams(delay_ms=50.0), LinkParams(delay_ms=50.0))
    dense = BurstRounds("a", "b")
    for seq in range(5):
        dense.sent(seq, 0.5)
    assert dense.deadline_s(0) == 0.5 and dense.deadline_s(9) is None
    dense.seal()
    handle = functools.partial(ProbeCollector._dense_result, collector, link, dense)  # type: ignore[arg-type]
    handle(ProbeResult(seq=0, sent_at=now - 11.0, rtt_ms=100.0))  # answered, but sent before the stall
    handle(ProbeResult(seq=1, sent_at=now - 11.0, rtt_ms=None))  # lost across the stall
    handle(ProbeResult(seq=2, sent_at=now - 5.0, rtt_ms=None))  # its 0.5 s deadline fired 4.5 s late
    handle(ProbeResult(seq=3, sent_at=now - 0.6, rtt_ms=None))  # lost, on time
    assert collector.counts["dense_probes_dropped_late"] == 3 and collector.counts["dense_probes_lost"] == 1
    handle(ProbeResult(seq=4, sent_at=now - 0.2, rtt_ms=101.0))
    (sample,) = collector.samples
    assert (sample.sent, sample.lost) == (2, 1) and dense.deadline_s(4) is None


def test_each_collector_sends_its_extra_probes_at_its_own_phase_of_the_tick() -> None:
    regions = ["weu", "sea1", "use2", "aue"]
    phases = [dense_phase_s(region, regions, 0.2) for region in regions]
    assert sorted(phases) == pytest.approx([0.0, 0.025, 0.05, 0.075])  # the first half, in turn
    assert dense_phase_s("aue", ["weu", "aue"], 0.2) == 0.0 == dense_phase_s("solo", [], 0.2)


def test_a_probe_socket_reports_the_receive_buffer_it_got() -> None:
    got = receive_buffer_bytes(4096)
    assert got is not None and got >= 4096  # a small buffer is never capped (Linux reports twice it)
