"""Admission of probe samples: every refusal is counted with its reason, and link state stays sane."""

import math

import pytest

from loom.net import DropReason, Perception, SampleValidator, TokenBucket, ValidationConfig
from loom_proto.net import ProbeSample

NOW = 1_700_000_000.0
REGIONS = ("r1", "r2", "r3")


def sample(**changes: object) -> ProbeSample:
    fields: dict[str, object] = {
        "src": "r1",
        "dst": "r2",
        "probe": "udp_echo",
        "seq": 1,
        "sent_at": NOW - 0.1,
        "rtt_ms": 20.0,
    }
    fields.update(changes)
    return ProbeSample(**fields)  # type: ignore[arg-type]


def validator(**config: float) -> SampleValidator:
    return SampleValidator.for_regions(REGIONS, ValidationConfig(**config))


def test_a_good_sample_is_admitted_and_counted() -> None:
    v = validator()
    assert v.check(sample(), NOW) is None
    assert v.accepted == 1
    assert not v.dropped


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"rtt_ms": math.nan}, DropReason.NOT_FINITE),
        ({"rtt_ms": math.inf}, DropReason.NOT_FINITE),
        ({"jitter_ms": math.nan}, DropReason.NOT_FINITE),
        ({"sent_at": math.nan}, DropReason.NOT_FINITE),
        ({"rtt_ms": -1.0}, DropReason.NEGATIVE),
        ({"bandwidth_gbps": -0.5}, DropReason.NEGATIVE),
        ({"seq": -3}, DropReason.NEGATIVE),
        ({"rtt_ms": 60_001.0}, DropReason.OUT_OF_RANGE),
        ({"sent": 0}, DropReason.OUT_OF_RANGE),
        ({"sent": 2, "lost": 3}, DropReason.OUT_OF_RANGE),
        ({"rtt_ms": None, "lost": 0}, DropReason.INCONSISTENT),
        ({"rtt_ms": 20.0, "sent": 2, "lost": 2}, DropReason.INCONSISTENT),
        ({"src": "mars"}, DropReason.UNKNOWN_ENDPOINT),
        ({"dst": "venus"}, DropReason.UNKNOWN_ENDPOINT),
        ({"dst": "r1"}, DropReason.SELF_LINK),
        ({"sent_at": NOW + 3600}, DropReason.CLOCK_SKEW),
        ({"sent_at": NOW - 3600}, DropReason.TOO_OLD),
    ],
)
def test_bad_samples_are_dropped_with_their_reason(changes: dict[str, object], reason: DropReason) -> None:
    v = validator()
    assert v.check(sample(**changes), NOW) == reason
    assert v.dropped == {reason: 1}
    assert v.accepted == 0


def test_lost_probes_and_bulk_samples_without_rtt_are_admitted() -> None:
    v = validator()
    assert v.check(sample(rtt_ms=None, lost=1), NOW) is None
    assert v.check(sample(seq=2, probe="tcp_bulk", rtt_ms=None, bandwidth_gbps=2.0), NOW) is None


def test_clock_skew_within_tolerance_is_accepted() -> None:
    v = validator(max_clock_skew_s=30.0)
    assert v.check(sample(sent_at=NOW + 29.0), NOW) is None


def test_duplicates_and_reordered_samples_are_not_newer() -> None:
    v = validator()
    assert v.check(sample(seq=5, sent_at=NOW - 1), NOW) is None
    assert v.check(sample(seq=5, sent_at=NOW - 1), NOW) == DropReason.NOT_NEWER
    assert v.check(sample(seq=4, sent_at=NOW - 2), NOW) == DropReason.NOT_NEWER
    # Another probe kind on the same link has its own order; a prober restart (seq from 0) is newer.
    assert v.check(sample(seq=1, probe="tcp_echo", sent_at=NOW - 2), NOW) is None
    assert v.check(sample(seq=0, sent_at=NOW - 0.5), NOW) is None


def test_a_flood_from_one_source_is_rate_limited_without_starving_others() -> None:
    v = validator(rate_per_link_hz=10.0, burst=20.0)
    flood = [v.check(sample(seq=i, sent_at=NOW - 1 + i * 1e-4), NOW) for i in range(1000)]
    admitted = flood.count(None)
    assert admitted == 20
    assert v.dropped[DropReason.RATE_LIMITED] == 980
    # Another link of the same source, and the same link from another source, still get through.
    assert v.check(sample(dst="r3", seq=1), NOW) is None
    assert v.check(sample(seq=5000, sent_at=NOW - 0.01), NOW, source="collector-2") is None
    # The bucket refills with time: one second later, ten more.
    later = [v.check(sample(seq=10_000 + i, sent_at=NOW + 0.9), NOW + 1.0) for i in range(30)]
    assert later.count(None) == 10


def test_token_bucket_ignores_a_clock_that_goes_backwards() -> None:
    bucket = TokenBucket(rate_per_s=1.0, burst=2.0, tokens=0.0, updated_at=100.0)
    assert not bucket.take(50.0)
    assert bucket.take(102.0)
    assert bucket.tokens == pytest.approx(1.0)


def test_perception_counts_refusals_and_keeps_link_state_sane() -> None:
    perception = Perception(REGIONS)
    now = NOW
    for period in range(10):
        for k in range(5):
            seq = period * 5 + k
            assert perception.ingest(sample(seq=seq, sent_at=now, rtt_ms=20.0 + k * 0.1), now) is None
            perception.ingest(sample(seq=10_000 + seq, rtt_ms=math.nan), now)
            perception.ingest(sample(seq=20_000 + seq, rtt_ms=-5.0), now)
            perception.ingest(sample(src="mars", seq=seq), now)
            perception.ingest(sample(seq=30_000 + seq, sent_at=now + 7200), now)
            now += 0.2
        perception.tick(now)
    assert perception.accepted == 50
    assert perception.dropped == {
        DropReason.NOT_FINITE: 50,
        DropReason.NEGATIVE: 50,
        DropReason.UNKNOWN_ENDPOINT: 50,
        DropReason.CLOCK_SKEW: 50,
    }
    (state,) = perception.link_states(now)
    assert 20.0 <= state.rtt_ms_p50 <= 20.4
    assert math.isfinite(state.cost)
    assert 0.0 <= state.loss_rate <= 1.0
