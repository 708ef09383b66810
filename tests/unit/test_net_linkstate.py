"""Per-link state: hysteresis that rises at once and decays slowly, events that do not flap,
stale links priced conservatively, outages, loss, transfer feedback, persistence."""

import math

import msgspec
import pytest

from loom.net import CostWeights, Expected, LinkConfig, LinkRecord, LinkTracker
from loom_proto.net import LinkState

T0 = 1_767_225_600.0
PROBES = 5  # per one-second period


def tracker(config: LinkConfig | None = None, expected: Expected | None = None) -> LinkTracker:
    return LinkTracker("a", "b", config or LinkConfig(), expected)


def run(link: LinkTracker, start: float, periods: int, rtt_ms: float | None, *, lost_every: int = 0) -> float:
    """Feed ``periods`` one-second periods of probes at ``rtt_ms`` (None: all lost); returns the time."""
    now = start
    count = 0
    for _ in range(periods):
        for _ in range(PROBES):
            now += 1.0 / PROBES
            count += 1
            if rtt_ms is None or (lost_every and count % lost_every == 0):
                link.add(now, None, 1, 1)
            else:
                link.add(now, rtt_ms)
        link.evaluate(now)
    return now


def test_cost_rises_at_once_on_degradation_and_decays_slowly_on_recovery() -> None:
    link = tracker()
    now = run(link, T0, 20, 100.0)
    normal = link.cost(now)
    now = run(link, now, 1, 300.0)
    degraded = link.cost(now)
    assert degraded == pytest.approx(normal + 200.0, rel=0.02)  # the whole rise, in one period
    now = run(link, now, 1, 100.0)
    one_period_later = link.cost(now)
    # One period after recovery the price has come down by less than a tenth of the gap.
    assert one_period_later > normal + 0.9 * 200.0
    now = run(link, now, 120, 100.0)
    assert link.cost(now) == pytest.approx(normal, rel=0.02)


def test_a_link_that_keeps_flapping_decays_slower() -> None:
    calm, flappy = tracker(), tracker()
    now = run(calm, T0, 20, 100.0)
    run(flappy, T0, 20, 100.0)
    for _ in range(3):
        run(flappy, now, 2, 300.0)
        run(flappy, now + 2, 8, 100.0)
        now += 10
    run(calm, now - 10, 2, 300.0)
    after_calm = run(calm, now - 8, 8, 100.0)
    after_flappy = now
    assert flappy.flaps > calm.flaps + 0.5
    assert flappy.cost(after_flappy) > calm.cost(after_calm)


def test_degraded_and_recovered_events_do_not_flap_around_the_threshold() -> None:
    link = tracker()
    now = run(link, T0, 30, 100.0)
    kinds = []
    for period in range(60):
        rtt = 160.0 if (period // 2) % 2 == 0 else 140.0  # 1.6x / 1.4x the baseline, threshold 1.5x
        for _ in range(PROBES):
            now += 1.0 / PROBES
            link.add(now, rtt)
        event = link.evaluate(now)
        if event is not None:
            kinds.append(event.kind)
    assert kinds == ["degraded"]
    for _ in range(20):
        for _ in range(PROBES):
            now += 1.0 / PROBES
            link.add(now, 100.0)
        event = link.evaluate(now)
        if event is not None:
            kinds.append(event.kind)
            assert event.reason.startswith("within thresholds")
    assert kinds == ["degraded", "recovered"]


def test_degraded_event_says_why() -> None:
    link = tracker()
    now = run(link, T0, 30, 100.0)
    for _ in range(PROBES):
        now += 1.0 / PROBES
        link.add(now, 250.0)
    event = link.evaluate(now)
    assert event is not None and event.kind == "degraded"
    assert "2.50x the baseline" in event.reason
    assert event.baseline_rtt_ms == pytest.approx(100.0, rel=0.01)


def test_a_stale_link_is_priced_conservatively() -> None:
    config = LinkConfig(ttl_s=5.0, stale_factor_min=1.1, stale_factor=1.5, stale_ramp_s=30.0)
    link = tracker(config)
    now = run(link, T0, 10, 100.0)
    fresh = link.cost(now)
    assert not link.view(now).stale
    assert link.cost(now + 6.0) > fresh * 1.1 - 1e-9
    assert link.view(now + 6.0).stale
    assert link.cost(now + 100.0) == pytest.approx(fresh * 1.5)
    # Evaluating a stale link changes nothing and raises no event.
    assert link.evaluate(now + 100.0) is None
    assert link.link_state(now + 100.0).stale


def test_a_link_never_measured_is_priced_from_its_prior_times_the_stale_factor() -> None:
    weights = CostWeights()
    link = tracker(expected=Expected(rtt_ms=50.0, bandwidth_gbps=4.0))
    prior = weights.cost_ms(50.0, 0.0, 0.0, 4.0)
    assert link.cost(T0) == pytest.approx(prior * LinkConfig().stale_factor)
    assert link.view(T0).stale and link.view(T0).usable


def test_consecutive_losses_make_a_link_unusable_within_a_period() -> None:
    link = tracker()
    now = run(link, T0, 20, 100.0)
    now = run(link, now, 1, None)
    view = link.view(now)
    assert not view.usable
    assert link.degraded
    # It comes back when probes are answered again, priced above what it was.
    before = link.usable_price
    now = run(link, now, 3, 100.0)
    assert link.view(now).usable
    assert before is not None and link.cost(now) > before


def test_loss_in_probe_rounds_is_seen_within_a_couple_of_periods() -> None:
    link = tracker()
    now = T0
    for _ in range(60):
        for _ in range(PROBES):
            now += 1.0 / PROBES
            link.add(now, 100.0, sent=10, lost=0)
        link.evaluate(now)
    clean = link.cost(now)
    events = []
    for _ in range(2):
        for _ in range(PROBES):
            now += 1.0 / PROBES
            link.add(now, 100.0, sent=10, lost=2)
        event = link.evaluate(now)
        if event:
            events.append(event)
    assert link.loss_rate == pytest.approx(0.2, abs=0.05)
    assert link.cost(now) > clean + 0.15 * CostWeights().loss_ms
    assert [e.kind for e in events] == ["degraded"] and "loss" in events[0].reason


def test_single_losses_do_not_move_the_loss_estimate() -> None:
    link = tracker()
    run(link, T0, 120, 100.0, lost_every=200)  # 0.5 % loss
    assert link.loss_rate < 0.02
    assert not link.degraded


def test_transfer_feedback_raises_the_price_within_bounds_and_fades() -> None:
    config = LinkConfig(feedback_max=3.0, feedback_gain=1.0, feedback_tau_s=600.0)
    link = tracker(config, Expected(rtt_ms=100.0, bandwidth_gbps=4.0))
    now = run(link, T0, 10, 100.0)
    base = link.cost(now)
    assert link.observe_transfer(now, observed_gbps=2.0)
    assert link.cost(now) == pytest.approx(base * 2.0)
    assert link.observe_transfer(now, observed_gbps=0.1)  # 40x slower: capped at 3x
    assert link.cost(now) == pytest.approx(base * 3.0)
    assert link.feedback_now(now + 6000) == pytest.approx(1.0, abs=0.01)
    assert not link.observe_transfer(now, observed_gbps=0.0)
    assert not link.observe_transfer(now, observed_gbps=math.nan)


def test_link_state_is_a_valid_wire_struct() -> None:
    link = tracker(expected=Expected(rtt_ms=100.0))
    now = run(link, T0, 12, 100.0)
    state = link.link_state(now)
    decoded = msgspec.json.decode(msgspec.json.encode(state), type=LinkState)
    assert decoded.rtt_ms_p50 == pytest.approx(100.0)
    assert decoded.rtt_ms_p50 <= decoded.rtt_ms_p95 <= decoded.rtt_ms_p99
    assert decoded.rtt_ms_forecast == pytest.approx(100.0, rel=0.05)
    assert not decoded.stale and not decoded.degraded


def test_a_restored_link_keeps_what_it_learned_and_starts_stale() -> None:
    link = tracker()
    now = run(link, T0, 30, 100.0)
    now = run(link, now, 2, 300.0)
    record = msgspec.json.decode(msgspec.json.encode(link.record(now)), type=LinkRecord)
    restored = LinkTracker.from_record(record, LinkConfig())
    assert restored.baseline_rtt_ms == pytest.approx(link.baseline_rtt_ms)
    assert restored.degraded
    assert restored.forecast.predict(now) == pytest.approx(link.forecast.predict(now))
    assert restored.view(now).stale
    assert restored.cost(now) == pytest.approx(link.priced_cost * LinkConfig().stale_factor)  # type: ignore[operator]


def test_a_blackhole_shows_in_the_lost_run_two_periods_in_while_the_loss_rate_lags() -> None:
    from loom.migrate.health import UNREACHABLE_LOSS, link_unreachable

    link = tracker()
    now = run(link, T0, 60, 100.0, lost_every=7)  # a lossy (14 %) but live link
    state = link.link_state(now)
    assert state.lost_run < 2 and not link_unreachable(
        stale=state.stale, loss_rate=state.loss_rate, lost_run=state.lost_run
    )
    now = run(link, now, 2, None)  # blackholed: two whole periods lost
    state = link.link_state(now)
    assert state.lost_run == 2 * PROBES
    assert state.loss_rate < UNREACHABLE_LOSS  # the rate alone would not call it unreachable yet
    assert link_unreachable(stale=state.stale, loss_rate=state.loss_rate, lost_run=state.lost_run)
    assert msgspec.json.decode(msgspec.json.encode(state), type=LinkState).lost_run == 2 * PROBES
    now = run(link, now, 1, 100.0)  # one answer ends the run
    assert link.link_state(now).lost_run == 0
