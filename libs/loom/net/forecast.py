"""RTT forecast: a fast EWMA for "now" plus a learned time-of-day profile for "later".

``observe(t, value)`` is called once per evaluation period with the period's RTT. Two things
are learned from it:

* the **level**, an EWMA of the RTT (time-based gain, so irregular periods are fine) — the
  best guess for the next minutes;
* the **profile**, one EWMA of the RTT per time-of-day bucket (48 half-hours by default,
  UTC), moving with the time the clock spends in that bucket — the daily pattern.

``predict(at)`` starts from the profile's value for ``at``'s bucket and carries over today's
anomaly (level ÷ profile value of the current bucket), fading it out with ``anomaly_tau_s``: a
link that is 20 % slow right now is forecast 20 % slow in a minute and back on its daily
pattern in a few hours. Buckets not yet seen long enough fall back to the level. The learned
state is plain data (:class:`ForecastState`) for the service to persist and restore.
"""

import math
from dataclasses import dataclass, field

import msgspec

__all__ = ["DAY_S", "Forecast", "ForecastConfig", "ForecastState"]

DAY_S = 86_400.0


@dataclass(frozen=True, slots=True)
class ForecastConfig:
    """Time constants and the profile's resolution."""

    buckets: int = 48
    level_tau_s: float = 60.0
    """The level follows the RTT with this time constant."""
    profile_tau_s: float = 1_800.0
    """A bucket moves with this time constant of time spent in it: a half-hour bucket moves
    ~60 % toward one day's value, so the profile settles over two to three days."""
    min_bucket_s: float = 600.0
    """A bucket is trusted once the clock has spent this long in it."""
    anomaly_tau_s: float = 3_600.0
    """How long today's deviation from the profile is expected to persist."""
    max_gap_s: float = 600.0
    """A gap longer than this between observations counts as this long."""


class ForecastState(msgspec.Struct, frozen=True, kw_only=True):
    """The learned part of a forecast, as persisted."""

    level: float | None
    profile: list[float]
    seen_s: list[float]
    updated_at: float | None


@dataclass(slots=True)
class Forecast:
    """The forecast of one link's RTT (ms)."""

    config: ForecastConfig = field(default_factory=ForecastConfig)
    level: float | None = None
    updated_at: float | None = None
    profile: list[float] = field(default_factory=list)
    seen_s: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.config.buckets < 1:
            raise ValueError("a forecast needs at least one time-of-day bucket")
        if not self.profile:
            self.profile = [0.0] * self.config.buckets
            self.seen_s = [0.0] * self.config.buckets

    def bucket(self, at: float) -> int:
        """The time-of-day bucket of unix time ``at`` (UTC)."""
        buckets = self.config.buckets
        return int((at % DAY_S) / DAY_S * buckets) % buckets

    def _trusted(self, index: int) -> float | None:
        return self.profile[index] if self.seen_s[index] >= self.config.min_bucket_s else None

    def observe(self, at: float, value: float) -> None:
        """Fold in one observation (a period's RTT in ms) made at unix time ``at``."""
        if not (math.isfinite(value) and value > 0):
            return
        config = self.config
        index = self.bucket(at)
        if self.level is None or self.updated_at is None:
            self.level = value
            self.updated_at = at
            self.profile[index] = value
            return
        dt = min(max(at - self.updated_at, 0.0), config.max_gap_s)
        self.updated_at = max(at, self.updated_at)
        self.level += (1.0 - math.exp(-dt / config.level_tau_s)) * (value - self.level)
        if self.seen_s[index] == 0.0 and self.profile[index] == 0.0:
            self.profile[index] = value
        else:
            gain = 1.0 - math.exp(-dt / config.profile_tau_s)
            self.profile[index] += gain * (value - self.profile[index])
        self.seen_s[index] += dt

    def predict(self, at: float, now: float | None = None) -> float | None:
        """The expected RTT (ms) at unix time ``at``, seen from ``now`` (default: the last observation).

        None before the first observation.
        """
        level = self.level
        if level is None:
            return None
        now = self.updated_at if now is None else now
        later = self._trusted(self.bucket(at))
        if later is None or now is None:
            return level
        current = self._trusted(self.bucket(now))
        anomaly = level / current if current else 1.0
        fade = math.exp(-max(at - now, 0.0) / self.config.anomaly_tau_s)
        return later * (1.0 + (anomaly - 1.0) * fade)

    def state(self) -> ForecastState:
        """The learned state, to persist."""
        return ForecastState(
            level=self.level, profile=list(self.profile), seen_s=list(self.seen_s), updated_at=self.updated_at
        )

    @classmethod
    def from_state(cls, state: ForecastState, config: ForecastConfig | None = None) -> "Forecast":
        """A forecast that resumes from persisted state; a profile of another resolution is dropped."""
        config = config or ForecastConfig()
        forecast = cls(config)
        forecast.level = state.level
        forecast.updated_at = state.updated_at
        if len(state.profile) == config.buckets == len(state.seen_s):
            forecast.profile = list(state.profile)
            forecast.seen_s = list(state.seen_s)
        return forecast
