"""Seeing a level shift sooner without letting one spike through: the collector's rounds close
early on a shift (a majority of a round, agreeing), the filter confirms a large shift on its
second sample, and the link is evaluated on the sample that confirms it."""

from loom.net import Expected, Perception
from loom.netemu.probes import ProbeResult
from loom_services.probe_collector.collector import RoundBuilder, send_grid, shift_in_round

T0 = 1_767_225_600.0


def _results(rtts: list[float | None], start: int = 0) -> list[ProbeResult]:
    return [ProbeResult(seq=start + i, sent_at=T0 + (start + i) * 0.2, rtt_ms=r) for i, r in enumerate(rtts)]


def _feed(
    rounds: RoundBuilder, rtts: list[float | None], start: int = 0
) -> list[tuple[float | None, int, bool]]:
    out = []
    for result in _results(rtts, start):
        for sample, urgent in rounds.add(result):
            out.append((sample.rtt_ms, sample.sent, urgent))
    return out


def test_rounds_close_early_on_a_shift_and_once_more_after_it() -> None:
    rounds = RoundBuilder("a", "b", 5, 2.0, 3)
    assert _feed(rounds, [100.0, 101.0, 99.0, 100.0, 102.0]) == [(100.0, 5, False)]
    # Two probes before the change, then five times the RTT: the round closes on the third high
    # answer (its RTT that of the three answers that show the shift, its probes all five), the
    # next round after three answers, then rounds of five again.
    samples = _feed(rounds, [100.0, 101.0, 500.0, 505.0, 498.0, 502.0, 499.0, 501.0, *[500.0] * 5], 5)
    assert samples == [(500.0, 5, True), (501.0, 3, True), (500.0, 5, False)]


def test_one_spike_or_unrelated_spikes_do_not_close_a_round() -> None:
    rounds = RoundBuilder("a", "b", 5, 2.0, 3)
    _feed(rounds, [100.0] * 5)
    assert _feed(rounds, [100.0, 480.0, 100.0, 100.0, 100.0], 5) == [(100.0, 5, False)]
    assert _feed(rounds, [250.0, 500.0, 900.0, 100.0, 100.0], 10) == [(250.0, 5, False)]
    # A lost probe is not evidence of a shift either.
    assert not shift_in_round(_results([500.0, None, 500.0]), 100.0, 2.0, 3)
    assert shift_in_round(_results([40.0, 45.0, 42.0]), 100.0, 2.0, 3)  # down by more than half


def test_only_an_answer_that_cannot_close_a_round_early_is_steady() -> None:
    """What the collector lets wait for its next send tick (``RoundBuilder.steady``): never an
    answer that could be part of a shift, nor any while a shift is going on."""
    rounds = RoundBuilder("a", "b", 5, 2.0, 3)
    assert rounds.steady(900.0)  # no sample yet: no reference, no shift
    _feed(rounds, [100.0] * 5)
    assert rounds.steady(100.0) and rounds.steady(199.0) and rounds.steady(51.0)
    assert not rounds.steady(200.0) and not rounds.steady(500.0) and not rounds.steady(50.0)
    # Every answer the shift's round is made of was not steady when it came.
    answers = [100.0, 101.0, 500.0, 505.0, 498.0]
    verdicts = []
    for result in _results(answers, 5):
        verdicts.append(rounds.steady(result.rtt_ms or 0.0))
        rounds.add(result)
    assert verdicts == [True, True, False, False, False]
    assert rounds.short_round
    # The round after a shift may close early too: nothing is steady until it has closed.
    assert not rounds.steady(500.0) and not rounds.steady(100.0)
    _feed(rounds, [502.0, 499.0, 501.0], 10)
    assert not rounds.short_round and rounds.steady(500.0) and not rounds.steady(100.0)


def _perception() -> Perception:
    return Perception(["a", "b"], expected={("a", "b"): Expected(100.0, 2.0)})


def _sample(at: float, rtt: float, seq: int) -> ProbeResult:
    return ProbeResult(seq=seq, sent_at=T0 + at, rtt_ms=rtt)


def test_one_sample_at_five_times_never_degrades_a_link_two_do_at_once() -> None:
    perception = _perception()
    rounds = RoundBuilder("a", "b", 5, 2.0, 3)
    now = 0.0
    seq = 0
    degraded = []

    def feed(rtts: list[float]) -> None:
        nonlocal now, seq
        for rtt in rtts:
            now += 0.2
            seq += 1
            for sample, _ in rounds.add(_sample(now, rtt, seq)):
                perception.ingest(sample, T0 + now)
                degraded.extend(e for e in perception.evaluate_shifted(T0 + now) if e.kind == "degraded")
        degraded.extend(e for e in perception.tick(T0 + now) if e.kind == "degraded")

    for _ in range(30):
        feed([100.0] * 5)
    # A burst of three probes at five times the RTT: one early sample, then back to normal.
    for _ in range(3):
        feed([500.0, 502.0, 501.0, 100.0, 100.0])
        feed([100.0] * 5)
    assert degraded == []
    assert perception.links["a", "b"].filter.shifts == 0
    # A real step: degraded on the sample that confirms it, before the period's tick.
    perception.tick(T0 + now)
    for rtt in [500.0, 505.0, 498.0, 502.0, 499.0, 501.0]:
        now += 0.2
        seq += 1
        for sample, _ in rounds.add(_sample(now, rtt, seq)):
            perception.ingest(sample, T0 + now)
            degraded.extend(e for e in perception.evaluate_shifted(T0 + now) if e.kind == "degraded")
    assert [e.kind for e in degraded] == ["degraded"]
    assert degraded[0].rtt_ms > 2.0 * degraded[0].baseline_rtt_ms


def test_the_round_after_a_shift_closes_early_only_if_the_shift_goes_on() -> None:
    rounds = RoundBuilder("a", "b", 5, 2.0, 3)
    _feed(rounds, [100.0] * 5)
    # A burst of three high answers closes a round; the next three are back at the old level (a
    # shift down against the burst, closed early too): one high sample, never two.
    samples = _feed(rounds, [500.0, 505.0, 498.0, 100.0, 101.0, 99.0], 5)
    assert samples == [(500.0, 3, True), (100.0, 3, True)]
    # Three high answers, then two normal ones: the round after the early one does not close on
    # three answers that do not continue the shift; it runs its five probes.
    rounds = RoundBuilder("a", "b", 5, 2.0, 3)
    _feed(rounds, [100.0] * 5)
    samples = _feed(rounds, [500.0, 505.0, 498.0, 500.0, 100.0, 100.0, 500.0, 100.0], 5)
    assert samples == [(500.0, 3, True), (100.0, 5, False)]


def test_two_large_suspects_that_spread_wait_for_a_third() -> None:
    from loom.net.outliers import OutlierFilter

    flt = OutlierFilter()
    for i in range(20):
        flt.offer(T0 + i, 100.0)
    assert flt.offer(T0 + 20, 330.0, 5.0) == ([], 0)
    assert flt.offer(T0 + 21, 450.0, 5.0) == ([], 0)  # both large, but 120 ms apart: not one level yet
    admitted, _ = flt.offer(T0 + 22, 430.0)
    assert [v for _, v in admitted] == [330.0, 450.0, 430.0]


def test_collectors_started_at_any_time_send_on_the_same_grid() -> None:
    """``send_grid``: the wait from any start to the next multiple of the tick interval, so every
    collector's ticks fall together (a probed endpoint is woken once for all of them)."""
    interval_s = 0.2
    for start in (T0, T0 + 0.05, T0 + 0.199, T0 + 0.2, T0 + 1234.567):
        wait = send_grid(start, interval_s)
        assert 0.0 <= wait < interval_s
        tick = round((start + wait) / interval_s)
        assert abs(start + wait - tick * interval_s) < 1e-6
    assert send_grid(T0 + 0.05, 0.0) == 0.0
