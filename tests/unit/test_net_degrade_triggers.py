"""Issue 15's link triggers (RTT x2, loss > 1 %) on the probe path: a round holding a late lost
probe is not dropped as "not newer", loss degrades a link only when significant (one lost probe
never does, a healthy link's own loss does not), and an RTT that doubles takes the fast path."""

import random

import pytest

from loom.net import Expected, LinkConfig, LinkTracker, Perception, SampleValidator
from loom.net.linkstate import binomial_tail
from loom.netemu.probes import ProbeResult
from loom_services.probe_collector.collector import CollectorConfig, RoundBuilder, round_sample

T0 = 1_767_225_600.0


def test_a_round_holding_a_late_lost_probe_is_stamped_with_its_newest_probe_and_admitted() -> None:
    # Probes 0-4 answered; probe 5 lost (its result comes at its 2 s timeout, after 6-14's answers).
    validator = SampleValidator(["a", "b"])
    first = round_sample("a", "b", [ProbeResult(i, T0 + 0.2 * i, 100.0) for i in range(5)])
    assert validator.check(first, T0 + 1.2) is None
    answers = [ProbeResult(i, T0 + 0.2 * i, 100.0) for i in range(6, 10)]
    second = round_sample("a", "b", [*answers, ProbeResult(5, T0 + 1.0, None)])
    assert (second.seq, second.sent, second.lost) == (9, 5, 1)
    assert second.sent_at == pytest.approx(T0 + 1.8)
    assert validator.check(second, T0 + 3.0) is None  # stamped with probe 5 it was "not newer"


def test_binomial_tail() -> None:
    assert binomial_tail(0, 10, 0.01) == 1.0
    assert binomial_tail(1, 10, 0.005) == pytest.approx(1 - 0.995**10)
    assert binomial_tail(2, 15, 0.005) == pytest.approx(1 - 0.995**15 - 15 * 0.005 * 0.995**14)
    assert binomial_tail(3, 2, 0.5) == 0.0 and binomial_tail(1, 5, 0.0) == 0.0
    assert binomial_tail(1, 1000, 0.005) == 1.0  # at or below the mean
    assert 0.0 < binomial_tail(150, 3000, 0.005) < 1e-80  # a long window does not overflow


def _run(
    link: LinkTracker, rng: random.Random, start: float, periods: int, loss: float
) -> tuple[float, list[str]]:
    """Rounds of 5 probes per one-second period, each lost with probability ``loss``."""
    now, kinds = start, []
    for _ in range(periods):
        now += 1.0
        lost = sum(rng.random() < loss for _ in range(5))
        link.add(now, 100.0 if lost < 5 else None, 5, lost)
        event = link.evaluate(now)
        if event is not None:
            kinds.append(event.kind)
    return now, kinds


def test_one_lost_probe_never_degrades_a_link_however_few_probes_it_is_among() -> None:
    link = LinkTracker("a", "b", LinkConfig(), Expected(100.0))
    now, _ = _run(link, random.Random(1), T0, 60, 0.0)
    link.add(now + 0.5, 100.0, 5, 1)
    assert link.evaluate(now + 0.5) is None and not link.degraded
    assert link.loss_rate > 0  # it is priced, it just does not degrade the link


def test_a_healthy_link_losing_0_2_percent_is_not_degraded_in_an_hour_and_3_percent_is() -> None:
    healthy = LinkTracker("a", "b", LinkConfig(), Expected(100.0))
    _, kinds = _run(healthy, random.Random(7), T0, 3600, 0.002)
    assert kinds == []
    # Without the significance test the 1 % threshold is crossed by chance (the long window of
    # 300 probes reads 3 lost as 1 %).
    unguarded = LinkTracker("a", "b", LinkConfig(loss_alpha=2.0), Expected(100.0))  # every window passes
    _, kinds = _run(unguarded, random.Random(7), T0, 3600, 0.002)
    assert "degraded" in kinds
    lossy = LinkTracker("a", "b", LinkConfig(), Expected(100.0))
    now, _ = _run(lossy, random.Random(7), T0, 60, 0.0)
    # Tested against the 1 % threshold, 300 probes a minute take a few minutes to tell 3 % from
    # it (a minute against 0.5 %): what bursts and dense probing are for.
    _, kinds = _run(lossy, random.Random(7), now, 300, 0.03)
    assert kinds[:1] == ["degraded"]


def test_an_rtt_that_doubles_takes_the_fast_path() -> None:
    """The collector closes a round on 3 answers at 1.5x or more, the filter confirms a large
    shift on its second such sample: degraded on the 6th probe after the change."""
    config = CollectorConfig()
    rounds = RoundBuilder("a", "b", 5, config.shift_ratio, config.shift_probes)
    perception = Perception(["a", "b"], expected={("a", "b"): Expected(100.0, 2.0)})
    rng = random.Random(3)
    now, seq, degraded_at = 0.0, 0, None
    for level, count in ((100.0, 150), (200.0, 10)):
        for _ in range(count):
            now += 0.2
            seq += 1
            for sample, _ in rounds.add(ProbeResult(seq, T0 + now, rng.gauss(level, level * 0.02))):
                perception.ingest(sample, T0 + now)
                for event in perception.evaluate_shifted(T0 + now):
                    if event.kind == "degraded" and degraded_at is None:
                        degraded_at = seq - 150
            if seq % 5 == 0:
                perception.tick(T0 + now)
    assert degraded_at == 6
