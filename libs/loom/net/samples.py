"""Admission of raw probe samples: what is refused, and why, before any statistic sees it.

Pure and synchronous; the receiver's clock is passed in as ``now`` (unix seconds). Every refusal
is counted under a :class:`DropReason`, so a flood of bad input shows up as a number, never as a
skewed statistic. The checks run cheapest first; the per-source token bucket runs after the
value and endpoint checks, so junk from an unknown sender cannot drain a real sender's budget.
"""

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

__all__ = [
    "DropReason",
    "SampleLike",
    "SampleValidator",
    "TokenBucket",
    "ValidationConfig",
]

MAX_RTT_MS = 60_000.0
"""Matches :class:`loom_proto.net.ProbeSample`: a round trip longer than a minute is not a sample."""

MAX_BANDWIDTH_GBPS = 10_000.0


class DropReason(StrEnum):
    """Why a sample was refused; the counters are keyed by these values."""

    NOT_FINITE = "not_finite"
    """A NaN or infinite number anywhere in the sample."""
    NEGATIVE = "negative"
    """A negative RTT, jitter, bandwidth, count or timestamp."""
    OUT_OF_RANGE = "out_of_range"
    """Beyond the contract's bounds (RTT over a minute, more lost than sent, no probe sent)."""
    INCONSISTENT = "inconsistent"
    """Carries nothing to learn from, or contradicts itself (an RTT while every probe was lost)."""
    UNKNOWN_ENDPOINT = "unknown_endpoint"
    """``src`` or ``dst`` is not a known region."""
    SELF_LINK = "self_link"
    """``src`` equals ``dst``."""
    CLOCK_SKEW = "clock_skew"
    """Stamped further in the future than the skew tolerance."""
    TOO_OLD = "too_old"
    """Stamped further in the past than the age limit (a replay or a very late delivery)."""
    NOT_NEWER = "not_newer"
    """Not newer than the last admitted sample of its link and probe kind (duplicate or reordered)."""
    RATE_LIMITED = "rate_limited"
    """Its source exceeded its token bucket (a flood)."""
    OUTLIER = "outlier"
    """Counted by the outlier filter: an isolated spike, not a level shift."""


class SampleLike(Protocol):
    """What admission reads of a sample; :class:`loom_proto.net.ProbeSample` satisfies it."""

    @property
    def src(self) -> str: ...
    @property
    def dst(self) -> str: ...
    @property
    def probe(self) -> str: ...
    @property
    def seq(self) -> int: ...
    @property
    def sent_at(self) -> float: ...
    @property
    def rtt_ms(self) -> float | None: ...
    @property
    def sent(self) -> int: ...
    @property
    def lost(self) -> int: ...
    @property
    def jitter_ms(self) -> float | None: ...
    @property
    def bandwidth_gbps(self) -> float | None: ...


@dataclass(frozen=True, slots=True)
class ValidationConfig:
    """Tolerances of admission."""

    max_clock_skew_s: float = 30.0
    """A sample stamped more than this ahead of the receiver's clock is refused."""
    max_age_s: float = 120.0
    """A sample stamped more than this before the receiver's clock is refused."""
    rate_per_link_hz: float = 10.0
    """Sustained samples per second one source may send about one link: twice the 5 Hz probe rate."""
    burst: float = 20.0
    """Samples a source may send about one link at once (a collector's batch of a few seconds)."""


@dataclass(slots=True)
class TokenBucket:
    """A token bucket on a caller-supplied clock: ``rate_per_s`` tokens a second, at most ``burst``."""

    rate_per_s: float
    burst: float
    tokens: float
    updated_at: float

    def take(self, now: float, cost: float = 1.0) -> bool:
        """Take ``cost`` tokens if there are enough; a clock that goes backwards adds nothing."""
        elapsed = now - self.updated_at
        if elapsed > 0:
            self.tokens = min(self.burst, self.tokens + elapsed * self.rate_per_s)
            self.updated_at = now
        if self.tokens >= cost:
            self.tokens -= cost
            return True
        return False


@dataclass(slots=True)
class SampleValidator:
    """Decides, for each sample, admit (None) or a :class:`DropReason`; counts both outcomes."""

    endpoints: frozenset[str]
    config: ValidationConfig = field(default_factory=ValidationConfig)
    accepted: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    _buckets: dict[tuple[str, str, str], TokenBucket] = field(default_factory=dict)
    _last: dict[tuple[str, str, str], tuple[float, int]] = field(default_factory=dict)

    @classmethod
    def for_regions(cls, regions: Iterable[str], config: ValidationConfig | None = None) -> "SampleValidator":
        """A validator that knows exactly these endpoints."""
        return cls(frozenset(regions), config or ValidationConfig())

    def check(self, sample: SampleLike, now: float, source: str | None = None) -> DropReason | None:
        """Admit ``sample`` (None) or say why not; ``source`` is who sent it (default: ``sample.src``)."""
        reason = self._check(sample, now, source)
        if reason is None:
            self.accepted += 1
        else:
            self.dropped[reason] += 1
        return reason

    def _check(self, s: SampleLike, now: float, source: str | None) -> DropReason | None:
        reason = _value_problem(s)
        if reason is not None:
            return reason
        src, dst = s.src, s.dst
        if src not in self.endpoints or dst not in self.endpoints:
            return DropReason.UNKNOWN_ENDPOINT
        if src == dst:
            return DropReason.SELF_LINK
        config = self.config
        if s.sent_at > now + config.max_clock_skew_s:
            return DropReason.CLOCK_SKEW
        if s.sent_at < now - config.max_age_s:
            return DropReason.TOO_OLD
        # One bucket per (sender, link): the bucket map is bounded by known endpoints squared
        # per sender, and a sender flooding one link cannot starve its other links.
        sender = src if source is None else source
        key = (sender, src, dst)
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = TokenBucket(config.rate_per_link_hz, config.burst, config.burst, now)
            self._buckets[key] = bucket
        if not bucket.take(now):
            return DropReason.RATE_LIMITED
        order_key = (src, dst, s.probe)
        stamp = (s.sent_at, s.seq)
        last = self._last.get(order_key)
        if last is not None and stamp <= last:
            return DropReason.NOT_NEWER
        self._last[order_key] = stamp
        return None


def _value_problem(s: SampleLike) -> DropReason | None:
    """The first problem with the sample's numbers, or None; `not x >= 0` also catches NaN."""
    sent_at, sent, lost = s.sent_at, s.sent, s.lost
    if not math.isfinite(sent_at):
        return DropReason.NOT_FINITE
    if sent_at < 0 or sent < 0 or lost < 0 or s.seq < 0:
        return DropReason.NEGATIVE
    if sent < 1 or lost > sent:
        return DropReason.OUT_OF_RANGE
    rtt_ms, jitter_ms, bandwidth_gbps = s.rtt_ms, s.jitter_ms, s.bandwidth_gbps
    for value, limit in ((rtt_ms, MAX_RTT_MS), (jitter_ms, MAX_RTT_MS), (bandwidth_gbps, MAX_BANDWIDTH_GBPS)):
        if value is None:
            continue
        if not math.isfinite(value):
            return DropReason.NOT_FINITE
        if value < 0:
            return DropReason.NEGATIVE
        if value > limit:
            return DropReason.OUT_OF_RANGE
    if rtt_ms is None and lost == 0 and bandwidth_gbps is None:
        return DropReason.INCONSISTENT
    if rtt_ms is not None and lost == sent:
        return DropReason.INCONSISTENT
    return None
