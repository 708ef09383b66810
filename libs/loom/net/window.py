"""Sliding windows over one link's samples at several horizons (10 s, 60 s, 300 s by default).

Samples go into numpy ring buffers that store every value twice (at ``i`` and ``i + capacity``),
so the most recent ``n`` values are always one contiguous slice: appending is O(1) (two scalar
writes per column), and a window is a binary search on the time column plus a view, no copy.
Statistics (mean, p50/p95/p99, standard deviation, jitter, loss) are computed on demand, once
per evaluation period rather than per sample; one sort per horizon serves all three percentiles.

A ring grows (doubling) while its oldest value is still inside the longest horizon, up to
``max_capacity``; beyond that the oldest values are overwritten and the long horizons cover less
than they say. Admission's per-link rate limit keeps real links far below that bound.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = ["DEFAULT_HORIZONS_S", "LinkWindow", "LossStats", "RttStats"]

DEFAULT_HORIZONS_S: tuple[float, ...] = (10.0, 60.0, 300.0)

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True, slots=True)
class RttStats:
    """RTT statistics of the received probes in one window; NaN where there were none."""

    horizon_s: float
    samples: int
    mean_ms: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    stdev_ms: float
    """Standard deviation: what ``ping`` calls mdev, and what the topology's ``rtt_mdev_ms`` is."""
    jitter_ms: float
    """Mean absolute difference of consecutive RTTs (the RFC 3550 sense of jitter)."""


@dataclass(frozen=True, slots=True)
class LossStats:
    """Probes sent and lost in one window."""

    horizon_s: float
    sent: int
    lost: int

    @property
    def loss_rate(self) -> float:
        """Lost over sent; 0.0 when nothing was sent (``sent`` says whether to trust it)."""
        return self.lost / self.sent if self.sent else 0.0


_NAN = math.nan


class _Ring:
    """Fixed columns of float64, each stored twice so that any recent span is contiguous."""

    __slots__ = ("_cols", "capacity", "head", "last_t", "max_capacity", "size")

    def __init__(self, columns: int, capacity: int, max_capacity: int) -> None:
        self.capacity = capacity
        self.max_capacity = max(capacity, max_capacity)
        self.size = 0
        self.head = 0
        self.last_t = -math.inf
        self._cols = [np.zeros(2 * capacity) for _ in range(columns)]

    def append(self, t: float, values: tuple[float, ...], horizon_s: float) -> None:
        """Append a row at time ``t`` (clamped so times never go backwards: the search needs order)."""
        t = max(t, self.last_t)
        self.last_t = t
        # Grow only while the value about to be overwritten is still inside the longest horizon.
        full = self.size == self.capacity
        if full and self.capacity < self.max_capacity and self.column(0)[0] >= t - horizon_s:
            self._grow()
        i = self.head
        j = i + self.capacity
        cols = self._cols
        cols[0][i] = t
        cols[0][j] = t
        for col, value in zip(cols[1:], values, strict=True):
            col[i] = value
            col[j] = value
        self.head = i + 1 if i + 1 < self.capacity else 0
        if self.size < self.capacity:
            self.size += 1

    def column(self, index: int) -> FloatArray:
        """The ``size`` most recent values of a column, oldest first, as a view."""
        end = self.head + self.capacity
        return self._cols[index][end - self.size : end]

    def _grow(self) -> None:
        new_capacity = min(self.capacity * 2, self.max_capacity)
        cols = []
        for index in range(len(self._cols)):
            recent = self.column(index)
            col = np.zeros(2 * new_capacity)
            col[: self.size] = recent
            col[new_capacity : new_capacity + self.size] = recent
            cols.append(col)
        self._cols = cols
        self.capacity = new_capacity
        self.head = self.size % new_capacity


class LinkWindow:
    """The recent RTTs (received probes) and probe counts (all probes) of one directed link."""

    __slots__ = ("_longest_s", "_loss", "_rtt", "horizons_s")

    def __init__(
        self,
        horizons_s: Sequence[float] = DEFAULT_HORIZONS_S,
        *,
        initial_capacity: int = 64,
        max_capacity: int = 16_384,
    ) -> None:
        if not horizons_s or any(not h > 0 for h in horizons_s):
            raise ValueError(f"horizons must be positive, got {horizons_s!r}")
        self.horizons_s = tuple(sorted(horizons_s))
        self._longest_s = self.horizons_s[-1]
        self._rtt = _Ring(2, initial_capacity, max_capacity)
        self._loss = _Ring(3, initial_capacity, max_capacity)

    def add_rtt(self, t: float, rtt_ms: float) -> None:
        """Record one RTT of a received probe, at arrival time ``t``."""
        self._rtt.append(t, (rtt_ms,), self._longest_s)

    def add_probes(self, t: float, sent: int, lost: int) -> None:
        """Record ``sent`` probes of which ``lost`` got no answer, at arrival time ``t``."""
        self._loss.append(t, (float(sent), float(lost)), self._longest_s)

    def __len__(self) -> int:
        """RTT values held (across all horizons)."""
        return self._rtt.size

    def recent_rtts(self, now: float, horizon_s: float, since: float | None = None) -> FloatArray:
        """The RTTs that arrived in ``(now - horizon_s, now]`` and not before ``since``, oldest first."""
        ring = self._rtt
        times = ring.column(0)
        first = int(np.searchsorted(times, now - horizon_s, side="right"))
        if since is not None:
            first = max(first, int(np.searchsorted(times, since, side="left")))
        return ring.column(1)[first:]

    def rtt_stats(self, now: float, horizon_s: float, since: float | None = None) -> RttStats:
        """RTT statistics over one horizon (optionally only since ``since``)."""
        return summarize_rtts(self.recent_rtts(now, horizon_s, since), horizon_s)

    def loss_stats(
        self, now: float, horizon_s: float, min_probes: int = 0, since: float | None = None
    ) -> LossStats:
        """Probe counts over ``horizon_s``, widened back in time until at least ``min_probes`` were sent.

        Widening keeps a loss estimate meaningful on slow probe rates: 1 % loss cannot be read off
        fifty probes. It stops at the ring's oldest value, and never reaches before ``since``.
        """
        ring = self._loss
        if ring.size == 0:
            return LossStats(horizon_s, 0, 0)
        times = ring.column(0)
        sent_col = ring.column(1)
        floor = 0 if since is None else int(np.searchsorted(times, since, side="left"))
        first = max(int(np.searchsorted(times, now - horizon_s, side="right")), floor)
        sent = float(sent_col[first:].sum())
        if sent < min_probes and first > floor:
            # Walk back through the cumulative counts to the latest start that has enough probes.
            cumulative = np.cumsum(sent_col[::-1])
            needed = int(np.searchsorted(cumulative, min_probes, side="left"))
            first = max(floor, ring.size - 1 - needed)
            sent = float(sent_col[first:].sum())
        lost = float(ring.column(2)[first:].sum())
        return LossStats(horizon_s, int(sent), int(lost))

    def loss_cusum(
        self, now: float, horizon_s: float, lost_llr: float, kept_llr: float, since: float | None = None
    ) -> tuple[float, LossStats]:
        """The largest log-likelihood ratio over any run of the latest rows within ``horizon_s``
        (not before ``since``), each lost probe counting ``lost_llr`` and each answered one
        ``kept_llr``, and that run's probe counts; ``(0.0, empty)`` when no run scores above 0.

        This is a CUSUM statistic (Page's test) restricted to the window: the run that ends now
        and speaks most for the higher loss rate against the lower one."""
        ring = self._loss
        if ring.size == 0:
            return 0.0, LossStats(horizon_s, 0, 0)
        times = ring.column(0)
        first = int(np.searchsorted(times, now - horizon_s, side="right"))
        if since is not None:
            first = max(first, int(np.searchsorted(times, since, side="left")))
        sent = ring.column(1)[first:]
        if sent.shape[0] == 0:
            return 0.0, LossStats(horizon_s, 0, 0)
        lost = ring.column(2)[first:]
        scores = np.cumsum((lost * lost_llr + (sent - lost) * kept_llr)[::-1])
        best = int(np.argmax(scores))
        score = float(scores[best])
        if score <= 0.0:
            return 0.0, LossStats(horizon_s, 0, 0)
        rows = best + 1
        return score, LossStats(horizon_s, int(sent[-rows:].sum()), int(lost[-rows:].sum()))

    def all_stats(self, now: float) -> list[tuple[RttStats, LossStats]]:
        """RTT and loss statistics at every configured horizon, shortest first."""
        return [(self.rtt_stats(now, h), self.loss_stats(now, h)) for h in self.horizons_s]


def summarize_rtts(values: FloatArray, horizon_s: float) -> RttStats:
    """Mean, percentiles (linear interpolation, as numpy's default), deviation and jitter of RTTs."""
    n = int(values.shape[0])
    if n == 0:
        return RttStats(horizon_s, 0, _NAN, _NAN, _NAN, _NAN, _NAN, _NAN)
    ordered = np.sort(values)
    # Plain reductions: numpy's mean/std/diff helpers cost more in overhead than in arithmetic here.
    mean = float(ordered.sum()) / n
    if n == 1:
        return RttStats(horizon_s, 1, mean, mean, mean, mean, 0.0, 0.0)
    variance = max(float(np.dot(ordered, ordered)) / n - mean * mean, 0.0)
    jitter = float(np.abs(values[1:] - values[:-1]).sum()) / (n - 1)
    return RttStats(
        horizon_s,
        n,
        mean,
        _quantile(ordered, 0.50),
        _quantile(ordered, 0.95),
        _quantile(ordered, 0.99),
        math.sqrt(variance),
        jitter,
    )


def _quantile(ordered: FloatArray, q: float) -> float:
    position = q * (ordered.shape[0] - 1)
    low = int(position)
    fraction = position - low
    value = float(ordered[low])
    if fraction > 0.0:
        value += fraction * (float(ordered[low + 1]) - value)
    return value
