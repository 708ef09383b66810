"""Outlier filtering of RTT samples: drop isolated spikes, admit level shifts quickly.

A robust filter cannot tell a spike from a step on one sample. This one holds a sample that
falls outside ``k · rttvar + floor`` of the smoothed RTT as a *suspect* (the smoothing is TCP's
SRTT/RTTVAR estimator, RFC 6298, O(1) per sample). A normal sample after a suspect drops the
suspects as outliers; ``confirm_after`` suspects in a row on the same side are a level shift:
they are all admitted, the estimator re-centres on them, and :attr:`OutlierFilter.shift_at`
records when, so the caller can restart its short window there and see the new level at once.
Suspects must also agree with each other (spread within ``consistency`` of their distance
from the old level): a run of unrelated spikes is not a new level; its oldest is dropped and
the filter keeps waiting. A *large* shift (suspects at least ``large_ratio`` times, or at most
``1 / large_ratio`` of, the smoothed RTT) is confirmed after ``confirm_large`` suspects if
they agree closely and so do the probes behind each (the caller passes a round's jitter as its
spread): a link whose RTT doubles is seen a sample sooner, while one lone sample, however far
off, never is, nor two rounds that are mostly spikes.
"""

from dataclasses import dataclass, field

__all__ = ["Admitted", "OutlierConfig", "OutlierFilter"]

Admitted = list[tuple[float, float]]
"""``(time, rtt_ms)`` pairs the filter lets through, in arrival order."""


@dataclass(frozen=True, slots=True)
class OutlierConfig:
    """How far from the smoothed RTT a sample may fall, and how many suspects make a shift."""

    k: float = 4.0
    """Width of the band in units of RTTVAR (the mean absolute deviation)."""
    floor_ms: float = 1.0
    """The band is never narrower than this (quiet links would flag every wobble)."""
    floor_ratio: float = 0.1
    """... nor narrower than this fraction of the smoothed RTT."""
    confirm_after: int = 3
    """Consecutive suspects on the same side that make a level shift."""
    confirm_large: int = 2
    """... or this many, when every one of them is a *large* departure (see ``large_ratio``);
    never below 2, so a single sample cannot shift the level."""
    large_ratio: float = 1.5
    """A suspect at least this many times the smoothed RTT (or at most its inverse) is large: the
    link's degrade ratio (``LinkConfig.degrade_rtt_ratio``), so that an RTT that doubles (issue
    15's trigger) takes the fast path; at 2.0 half the samples of a doubled RTT fell below it and
    waited for a third suspect (``python -m loom_benchmarks.net_shift --factors 2``: change to
    decision 3.41 periods on average, 16 % within 3; at 1.5, 2.01 and 96 %; no false shift on
    measured links with 1 % or 10 % of probes spiking 2-5x either way)."""
    large_consistency: float = 0.25
    """... and the ``confirm_large`` suspects must agree this closely (as ``consistency``): a
    step is one level, a run of spikes is spread over their range."""
    large_spread: float = 0.3
    """... and each must come with the spread of the probes behind it (a round's jitter), at most
    this fraction of its distance from the smoothed RTT: the probes of a round taken over by a
    shift agree with each other, a round that is mostly spikes does not (without a spread, only
    ``confirm_after`` suspects make a shift)."""
    consistency: float = 0.35
    """Suspects make a level shift only if none is further from their median than this fraction
    of the median's distance from the smoothed RTT."""
    gain: float = 0.125
    """RFC 6298 alpha: weight of a new sample in SRTT."""
    var_gain: float = 0.25
    """RFC 6298 beta: weight of a new deviation in RTTVAR."""


@dataclass(slots=True)
class OutlierFilter:
    """The filter state of one link."""

    config: OutlierConfig = field(default_factory=OutlierConfig)
    srtt_ms: float | None = None
    rttvar_ms: float = 0.0
    shift_at: float | None = None
    """Arrival time of the first sample of the last confirmed level shift."""
    shift_samples: int = 0
    """How many samples the last confirmed level shift admitted at once."""
    shifts: int = 0
    """Level shifts confirmed so far."""
    _suspects: Admitted = field(default_factory=list)
    _tight: list[bool] = field(default_factory=list)
    """Per suspect: its probes agreed (see ``large_spread``)."""
    _suspect_high: bool = False

    def offer(self, t: float, rtt_ms: float, spread_ms: float | None = None) -> tuple[Admitted, int]:
        """Offer one sample (``spread_ms``: the jitter of the probes behind it, if known); returns
        what to admit now and how many earlier suspects were dropped."""
        srtt = self.srtt_ms
        config = self.config
        if srtt is None:
            self.srtt_ms = rtt_ms
            self.rttvar_ms = rtt_ms * 0.05
            return [(t, rtt_ms)], 0
        deviation = rtt_ms - srtt
        band = config.k * self.rttvar_ms + max(config.floor_ms, config.floor_ratio * srtt)
        suspects = self._suspects
        if -band <= deviation <= band:
            dropped = len(suspects)
            if dropped:
                suspects.clear()
                self._tight.clear()
            self.srtt_ms = srtt + config.gain * deviation
            self.rttvar_ms += config.var_gain * (abs(deviation) - self.rttvar_ms)
            return [(t, rtt_ms)], dropped
        high = deviation > 0
        dropped = 0
        if suspects and high != self._suspect_high:
            dropped = len(suspects)
            suspects.clear()
            self._tight.clear()
        suspects.append((t, rtt_ms))
        self._tight.append(spread_ms is not None and spread_ms <= config.large_spread * abs(deviation))
        self._suspect_high = high
        needed = config.confirm_after
        if (
            len(suspects) >= max(config.confirm_large, 2)
            and _all_large(suspects, srtt, config.large_ratio)
            and _agree(suspects, srtt, config.large_consistency)
            and all(self._tight)
        ):
            needed = max(config.confirm_large, 2)
        if len(suspects) < needed:
            return [], dropped
        values = sorted(value for _, value in suspects)
        centre = values[len(values) // 2]
        if max(centre - values[0], values[-1] - centre) > config.consistency * abs(centre - srtt):
            del suspects[0]
            del self._tight[0]
            return [], dropped + 1
        self.srtt_ms = centre
        self.rttvar_ms = max(sum(abs(v - centre) for v in values) / len(values), centre * 0.01)
        self.shift_at = suspects[0][0]
        self.shift_samples = len(suspects)
        self.shifts += 1
        admitted = list(suspects)
        suspects.clear()
        self._tight.clear()
        return admitted, dropped


def _all_large(suspects: Admitted, srtt: float, ratio: float) -> bool:
    """Every suspect is at least ``ratio`` times ``srtt``, or every one at most its inverse."""
    if srtt <= 0 or ratio <= 1.0:
        return False
    values = [value for _, value in suspects]
    return all(v >= ratio * srtt for v in values) or all(v * ratio <= srtt for v in values)


def _agree(suspects: Admitted, srtt: float, consistency: float) -> bool:
    """No suspect is further from their median than ``consistency`` of its distance from ``srtt``."""
    values = sorted(value for _, value in suspects)
    centre = values[len(values) // 2]
    return max(centre - values[0], values[-1] - centre) <= consistency * abs(centre - srtt)
