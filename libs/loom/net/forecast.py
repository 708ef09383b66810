"""RTT forecast: an EWMA level times a learned time-of-day profile (Holt-Winters without trend).

``observe(t, value)`` is called once per evaluation period with the period's RTT. The level is
the de-seasonalised EWMA of the observations (time-based gain, so irregular periods are fine);
the profile holds one multiplicative factor per time-of-day bucket (48 half-hours by default),
each an EWMA of observation / level while the clock is in that bucket. ``predict(at)`` is
``level × factor[bucket(at)]``; a bucket seen too little keeps factor 1. The state is plain data
(:class:`ForecastState`), so the service can persist the learned profile and restore it.
"""

import math
from dataclasses import dataclass, field

import msgspec

__all__ = ["DAY_S", "Forecast", "ForecastConfig", "ForecastState"]

DAY_S = 86_400.0


@dataclass(frozen=True, slots=True)
class ForecastConfig:
    """Time constants of the level and the profile, and the profile's resolution."""

    buckets: int = 48
    level_tau_s: float = 60.0
    """The level follows the de-seasonalised RTT with this time constant."""
    profile_tau_s: float = 3_600.0
    """A bucket's factor moves with this time constant of time spent in the bucket: a half-hour
    bucket moves ~40 % toward one day's value, so a profile settles over two to three days."""
    min_bucket_s: float = 600.0
    """A bucket's factor is used once the clock has spent this long in it."""
    max_gap_s: float = 600.0
    """A gap longer than this between observations counts as this long (no giant catch-up step)."""


class ForecastState(msgspec.Struct, frozen=True, kw_only=True):
    """The learned part of a forecast, as persisted."""

    level: float | None
    factors: list[float]
    seen_s: list[float]
    updated_at: float | None


@dataclass(slots=True)
class Forecast:
    """The forecast of one link's RTT."""

    config: ForecastConfig = field(default_factory=ForecastConfig)
    level: float | None = None
    updated_at: float | None = None
    factors: list[float] = field(default_factory=list)
    seen_s: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.config.buckets < 1:
            raise ValueError("a forecast needs at least one time-of-day bucket")
        if not self.factors:
            self.factors = [1.0] * self.config.buckets
            self.seen_s = [0.0] * self.config.buckets

    def bucket(self, at: float) -> int:
        """The time-of-day bucket of unix time ``at`` (UTC)."""
        return int((at % DAY_S) / DAY_S * self.config.buckets) % self.config.buckets

    def _factor(self, index: int) -> float:
        return self.factors[index] if self.seen_s[index] >= self.config.min_bucket_s else 1.0

    def observe(self, at: float, value: float) -> None:
        """Fold in one observation (a period's RTT in ms) made at unix time ``at``."""
        if not (math.isfinite(value) and value > 0):
            return
        config = self.config
        index = self.bucket(at)
        if self.level is None or self.updated_at is None:
            self.level = value / self._factor(index)
            self.updated_at = at
            return
        dt = min(max(at - self.updated_at, 0.0), config.max_gap_s)
        self.updated_at = max(at, self.updated_at)
        level_gain = 1.0 - math.exp(-dt / config.level_tau_s)
        self.level += level_gain * (value / self._factor(index) - self.level)
        profile_gain = 1.0 - math.exp(-dt / config.profile_tau_s)
        if self.seen_s[index] == 0.0:
            self.factors[index] = value / self.level
        else:
            self.factors[index] += profile_gain * (value / self.level - self.factors[index])
        self.seen_s[index] += dt

    def predict(self, at: float) -> float | None:
        """The expected RTT (ms) at unix time ``at``; None before the first observation."""
        if self.level is None:
            return None
        return self.level * self._factor(self.bucket(at))

    def state(self) -> ForecastState:
        """The learned state, to persist."""
        return ForecastState(
            level=self.level, factors=list(self.factors), seen_s=list(self.seen_s), updated_at=self.updated_at
        )

    @classmethod
    def from_state(cls, state: ForecastState, config: ForecastConfig | None = None) -> "Forecast":
        """A forecast that resumes from persisted state; a profile of another resolution is dropped."""
        config = config or ForecastConfig()
        forecast = cls(config)
        forecast.level = state.level
        forecast.updated_at = state.updated_at
        if len(state.factors) == config.buckets == len(state.seen_s):
            forecast.factors = list(state.factors)
            forecast.seen_s = list(state.seen_s)
        return forecast
