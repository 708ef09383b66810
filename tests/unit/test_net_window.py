"""Sliding windows, the outlier filter and the forecast: the statistics the link state is built on."""

import math
import random

import numpy as np
import pytest

from loom.net import Forecast, ForecastConfig, LinkWindow, OutlierFilter
from loom.net.forecast import DAY_S
from loom.net.window import summarize_rtts

T0 = 1_000.0


def test_statistics_match_numpy_on_known_values() -> None:
    rng = random.Random(3)
    values = [rng.gauss(100, 5) for _ in range(200)]
    window = LinkWindow((10.0, 60.0, 300.0))
    for i, value in enumerate(values):
        window.add_rtt(T0 + i * 0.2, value)
    stats = window.rtt_stats(T0 + 40.0, 60.0)
    array = np.array(values)
    assert stats.samples == 200
    assert stats.mean_ms == pytest.approx(array.mean())
    assert stats.p50_ms == pytest.approx(np.percentile(array, 50))
    assert stats.p95_ms == pytest.approx(np.percentile(array, 95))
    assert stats.p99_ms == pytest.approx(np.percentile(array, 99))
    assert stats.stdev_ms == pytest.approx(array.std())
    assert stats.jitter_ms == pytest.approx(np.abs(np.diff(array)).mean())


def test_each_horizon_sees_only_its_own_span() -> None:
    window = LinkWindow((10.0, 60.0, 300.0))
    for second in range(300):
        window.add_rtt(T0 + second, 50.0 if second < 250 else 80.0)
    now = T0 + 299.5
    short, middle, long = (window.rtt_stats(now, h) for h in (10.0, 60.0, 300.0))
    assert (short.samples, middle.samples, long.samples) == (10, 60, 300)
    assert short.mean_ms == 80.0
    assert middle.p50_ms == 80.0
    assert long.p50_ms == 50.0
    assert window.rtt_stats(now, 10.0, since=T0 + 297).samples == 3


def test_rings_grow_while_the_longest_horizon_needs_it_and_then_overwrite() -> None:
    window = LinkWindow((10.0, 300.0), initial_capacity=4, max_capacity=64)
    for i in range(100):
        window.add_rtt(T0 + i, float(i))
    # 300 s would need 100 values; the ring stops at 64 and keeps the newest.
    assert len(window) == 64
    recent = window.recent_rtts(T0 + 99, 300.0)
    assert recent[0] == 36.0 and recent[-1] == 99.0
    # A horizon shorter than the ring's span is exact.
    assert window.rtt_stats(T0 + 99.5, 10.0).samples == 10


def test_a_clock_that_goes_backwards_is_clamped() -> None:
    window = LinkWindow((10.0,))
    window.add_rtt(T0 + 5, 1.0)
    window.add_rtt(T0 + 3, 2.0)  # earlier than the last: stored at T0 + 5
    window.add_rtt(T0 + 6, 3.0)
    assert list(window.recent_rtts(T0 + 6, 10.0)) == [1.0, 2.0, 3.0]
    assert window.rtt_stats(T0 + 6, 1.5).samples == 3


def test_empty_and_single_windows() -> None:
    window = LinkWindow()
    empty = window.rtt_stats(T0, 10.0)
    assert empty.samples == 0 and math.isnan(empty.p50_ms)
    assert window.loss_stats(T0, 10.0).loss_rate == 0.0
    single = summarize_rtts(np.array([7.0]), 10.0)
    assert (single.p50_ms, single.p99_ms, single.jitter_ms) == (7.0, 7.0, 0.0)


def test_loss_window_widens_to_enough_probes_but_not_before_since() -> None:
    window = LinkWindow((10.0, 60.0))
    for second in range(60):
        window.add_probes(T0 + second, sent=1, lost=1 if second < 10 else 0)
    now = T0 + 59.5
    assert window.loss_stats(now, 10.0).sent == 10
    widened = window.loss_stats(now, 10.0, min_probes=40)
    assert widened.sent == 40
    everything = window.loss_stats(now, 10.0, min_probes=1000)
    assert (everything.sent, everything.lost) == (60, 10)
    assert window.loss_stats(now, 10.0, min_probes=1000, since=T0 + 20).sent == 40
    assert everything.loss_rate == pytest.approx(10 / 60)


def test_outlier_filter_drops_an_isolated_spike() -> None:
    flt = OutlierFilter()
    admitted = []
    dropped = 0
    for i, value in enumerate([100.0, 101.0, 99.0, 100.5, 480.0, 100.2, 99.8]):
        out, lost = flt.offer(T0 + i, value)
        admitted += [v for _, v in out]
        dropped += lost
    assert 480.0 not in admitted
    assert dropped == 1
    assert flt.shift_at is None


def test_outlier_filter_admits_a_level_shift_after_three_consistent_samples() -> None:
    flt = OutlierFilter()
    for i in range(20):
        flt.offer(T0 + i, 100.0 + (i % 3))
    # Up by half: a small shift needs three suspects.
    assert flt.offer(T0 + 20, 150.0) == ([], 0)
    assert flt.offer(T0 + 21, 152.0) == ([], 0)
    admitted, dropped = flt.offer(T0 + 22, 151.0)
    assert [v for _, v in admitted] == [150.0, 152.0, 151.0]
    assert dropped == 0
    assert flt.shift_at == T0 + 20
    assert flt.shift_samples == 3
    assert flt.srtt_ms == pytest.approx(151.0)


def test_a_large_shift_is_confirmed_on_its_second_sample_but_never_on_one() -> None:
    flt = OutlierFilter()
    for i in range(20):
        flt.offer(T0 + i, 100.0 + (i % 3))
    # One sample five times the level: held, and a normal one after it drops it.
    assert flt.offer(T0 + 20, 500.0) == ([], 0)
    assert flt.offer(T0 + 21, 101.0) == ([(T0 + 21, 101.0)], 1)
    assert flt.shift_at is None
    # Two in a row, both at least twice the level, agreeing, and each from probes that agree
    # (a round's jitter well under its distance from the level): a shift.
    assert flt.offer(T0 + 22, 500.0, 8.0) == ([], 0)
    admitted, dropped = flt.offer(T0 + 23, 510.0, 6.0)
    assert [v for _, v in admitted] == [500.0, 510.0]
    assert dropped == 0
    assert (flt.shift_at, flt.shift_samples, flt.shifts) == (T0 + 22, 2, 1)
    assert flt.srtt_ms == pytest.approx(510.0)


def test_two_large_samples_from_scattered_or_unknown_probes_wait_for_a_third() -> None:
    for spreads in ((8.0, 150.0), (None, None)):  # a round mostly of spikes; no jitter reported
        flt = OutlierFilter()
        for i in range(20):
            flt.offer(T0 + i, 100.0)
        assert flt.offer(T0 + 20, 500.0, spreads[0]) == ([], 0)
        assert flt.offer(T0 + 21, 505.0, spreads[1]) == ([], 0)
        admitted, _ = flt.offer(T0 + 22, 502.0)
        assert [v for _, v in admitted] == [500.0, 505.0, 502.0]


def test_a_large_suspect_followed_by_a_small_one_waits_for_the_third() -> None:
    flt = OutlierFilter()
    for i in range(20):
        flt.offer(T0 + i, 100.0)
    assert flt.offer(T0 + 20, 250.0) == ([], 0)
    assert flt.offer(T0 + 21, 180.0) == ([], 0)  # above the band, below twice the level
    assert flt.shift_at is None


def test_unrelated_spikes_in_a_row_are_not_a_level_shift() -> None:
    flt = OutlierFilter()
    for i in range(20):
        flt.offer(T0 + i, 100.0)
    for i, spike in enumerate([250.0, 500.0, 320.0]):
        admitted, _ = flt.offer(T0 + 20 + i, spike)
        assert admitted == []
    assert flt.shift_at is None


def _daily_rtt(at: float) -> float:
    hour = (at % DAY_S) / 3600
    return 150.0 if 12 <= hour < 18 else 100.0


def test_forecast_learns_a_time_of_day_profile() -> None:
    forecast = Forecast(ForecastConfig(buckets=48))
    assert forecast.predict(T0) is None
    start = 1_767_225_600.0  # a UTC midnight
    for minute in range(3 * 24 * 60):
        at = start + minute * 60
        forecast.observe(at, _daily_rtt(at))
    now = start + 3 * DAY_S + 10 * 3600  # 10:00, busy hours ahead
    forecast.observe(now, 100.0)
    assert forecast.predict(now + 60, now) == pytest.approx(100.0, rel=0.02)
    assert forecast.predict(now + 4 * 3600, now) == pytest.approx(150.0, rel=0.1)
    assert forecast.predict(now + 10 * 3600, now) == pytest.approx(100.0, rel=0.1)


def test_forecast_carries_a_current_anomaly_and_fades_it() -> None:
    forecast = Forecast()
    start = 1_767_225_600.0
    for minute in range(2 * 24 * 60):
        forecast.observe(start + minute * 60, 100.0)
    now = start + 2 * DAY_S
    for second in range(0, 600, 10):
        forecast.observe(now + second, 130.0)
    now += 600
    soon = forecast.predict(now + 60, now)
    later = forecast.predict(now + 6 * 3600, now)
    assert soon is not None and later is not None
    assert soon > 120.0
    assert later < 105.0


def test_forecast_state_round_trips() -> None:
    forecast = Forecast()
    for minute in range(600):
        forecast.observe(T0 + minute * 60, 80.0 + minute % 7)
    restored = Forecast.from_state(forecast.state())
    assert restored.predict(T0 + 700 * 60) == forecast.predict(T0 + 700 * 60)
    other_resolution = Forecast.from_state(forecast.state(), ForecastConfig(buckets=24))
    assert other_resolution.level == forecast.level
    assert other_resolution.seen_s == [0.0] * 24
