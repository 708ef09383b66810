"""loom bench e2e: CPU bookkeeping (which processes form which group, what counts as a neighbour),
where a paced job's time went (its path through placement) and placement's collector pauses."""

import asyncio
import os

import pytest

from loom.runtime import cpu
from loom_benchmarks import e2e
from loom_benchmarks.e2e import (
    PATH,
    gc_between,
    neighbours_pct,
    non_placement_pct,
    path_breakdown,
    stack_groups,
)


def test_stack_groups_name_every_process_and_put_the_parents_last() -> None:
    state = {
        "supervisor_pid": 10,
        "nats_pid": 11,
        "postgres_pid": 12,
        "services": {"placement": {"pid": 20}, "probe-a": {"pid": 21}, "dead": {"pid": None}},
    }
    groups = stack_groups(state, {"bench-client": os.getpid(), "bench-baseline": 30})
    assert groups == {
        "placement": [20],
        "probe-a": [21],
        "nats": [11],
        "postgres": [12],
        "bench-baseline": [30],
        "supervisor": [10],
        "bench-client": [os.getpid()],
    }
    # The sampler gives a process to the first group that reaches it: the parents come last.
    assert list(groups)[-2:] == ["supervisor", "bench-client"]


def test_neighbours_are_the_non_scheduling_services() -> None:
    shares = {
        "probe-aws-us-east-2": 1.5,
        "probe-gcp-asia-southeast1": 1.0,
        "network-perception": 2.0,
        "agent-c-aue-a": 0.5,
        "metrics": 0.25,
        "placement": 40.0,
        "placement-standby": 1.0,
        "nats": 10.0,
        "postgres": 5.0,
        "supervisor": 0.1,
        "bench-client": 3.0,
        "bench-baseline": 2.0,
    }
    assert neighbours_pct(shares) == 5.25


def test_non_placement_adds_migration_the_correlator_and_the_console() -> None:
    shares = {
        "probe-aws-us-east-2": 1.5,
        "network-perception": 2.0,
        "agent-c-aue-a": 0.5,
        "metrics": 0.25,
        "migration": 1.0,
        "alert-correlator": 0.5,
        "console": 0.125,
        "placement": 40.0,
        "placement-standby": 1.0,
        "placement-eu-standby": 1.0,
        "nats": 10.0,
        "postgres": 5.0,
        "supervisor": 0.1,
        "bench-client": 3.0,
    }
    assert neighbours_pct(shares) == 4.25
    assert non_placement_pct(shares) == 5.88  # 4.25 + 1.625, rounded to hundredths


def _stamps(base: float, order: list[str], gaps_ms: list[float]) -> dict[str, float]:
    at, out = base, {}
    for name, gap in zip(order, gaps_ms, strict=True):
        at += gap / 1000
        out[name] = at
    return out


def test_path_breakdown_splits_each_jobs_latency_into_segments_in_the_order_the_stamps_came() -> None:
    # Stamps in an order other than PATH's (as placement's were when it took the lock before it
    # admitted): the segments follow the order the stamps came in.
    order = ["stored", "received", "handled", "cycle", "admitted", "decided", "committed", "sent"]
    client, placed, timings, latency = {}, {}, {}, {}
    for i in range(100):
        job = f"paced-{i}"
        slow = i == 99  # the one job at the p99: it waited 500 ms for the lock
        gaps = [1.0, 2.0, 3.0, 500.0 if slow else 4.0, 5.0, 6.0, 7.0, 8.0]
        timings[job] = _stamps(1000.0 + i, order, gaps)
        client[job] = (1000.0 + i, 1000.0 + i + 0.0015)
        placed[job] = timings[job]["sent"] + 0.009 + i * 1e-6  # latencies all differ
        latency[job] = (placed[job] - client[job][0]) * 1000
    timings["paced-x"] = {"stored": 1.0}  # incomplete: left out
    out = path_breakdown(latency, client, placed, timings)
    assert out["jobs"] == 100
    assert out["missing"] == {}
    assert out["order"] == order
    ms = out["ms"]
    assert list(ms) == [
        "publish_to_stored",
        "stored_to_received",
        "received_to_handled",
        "handled_to_cycle",
        "cycle_to_admitted",
        "admitted_to_decided",
        "decided_to_committed",
        "committed_to_sent",
        "sent_to_observed",
        "ack",
    ]
    assert abs(ms["publish_to_stored"]["p50"] - 1.0) < 0.01
    assert abs(ms["handled_to_cycle"]["p50"] - 4.0) < 0.01
    assert abs(ms["handled_to_cycle"]["max"] - 500.0) < 0.01
    assert abs(ms["sent_to_observed"]["p50"] - 9.05) < 0.01
    assert abs(ms["ack"]["p50"] - 1.5) < 0.01
    # The tail (jobs at or above the latency p99 of 100: the two slowest): the slow job's lock
    # wait shows in its mean, the other segments stay what they were.
    assert out["tail_jobs"] == 2
    assert abs(ms["handled_to_cycle"]["tail"] - (500.0 + 4.0) / 2) < 0.01
    assert abs(ms["cycle_to_admitted"]["tail"] - 5.0) < 0.01


def test_path_breakdown_without_any_complete_job_says_so() -> None:
    latency = {"paced-0": 5.0}
    out = path_breakdown(latency, {"paced-0": (1.0, 1.001)}, {"paced-0": 1.005}, {"paced-0": {"stored": 1.0}})
    assert out == {"jobs": 0, "missing": dict.fromkeys(PATH[1:], 1)}


def test_collector_pauses_between_two_readings_are_summed_over_the_instances() -> None:
    def gen(count: int, total: float, longest: float) -> dict[str, float]:
        return {"count": count, "total_ms": total, "max_ms": longest}

    before = {"placement": {"gc": {"gen0": gen(10, 20.0, 4.0), "gen2": gen(1, 30.0, 30.0)}}}
    after = {
        "placement": {"gc": {"gen0": gen(13, 29.5, 5.0), "gen2": gen(1, 30.0, 30.0)}},
        "placement-standby": {"gc": {"gen0": gen(2, 1.5, 1.0)}},  # not read before: counted whole
    }
    assert gc_between(before, after) == {
        "gen0": {"count": 5, "total_ms": 11.0, "max_ms_since_start": 5.0},
        "gen2": {"count": 0, "total_ms": 0.0, "max_ms_since_start": 30.0},
    }


class _Backlog:
    """A sampler whose stack burns ``per_window`` CPU seconds in each successive second."""

    def __init__(self, per_window: list[float]) -> None:
        self.per_window = per_window
        self.t = 0.0
        self.used = 0.0
        self.calls = 0
        self.windows = 0

    def sample(self) -> cpu.Sample:
        # Sampled once a second: the CPU of a window shows at the sample that ends it.
        self.calls += 1
        if self.calls > 1:
            self.used += self.per_window[min(self.windows, len(self.per_window) - 1)]
            self.windows += 1
            self.t += 1.0
        return cpu.Sample(at=self.t, cpu_s={"stack": {1: self.used}})


def test_the_paced_phase_waits_until_the_stack_is_back_near_its_cpu_at_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # At rest the stack used 5 % of a core; a backlog keeps it at 90 %, then 60 %, then 12 %.
    sampler = _Backlog([0.9, 0.6, 0.12, 0.05])
    waited, used = asyncio.run(e2e._until_quiet(sampler, 5.0))  # type: ignore[arg-type]
    assert used == pytest.approx(12.0) and sampler.windows == 3
    assert 3.0 <= waited < 5.0
    # A stack that never quiets: the wait gives up at the limit and says how busy it still was.
    monkeypatch.setattr(e2e, "QUIET_LIMIT_S", 2.0)
    busy = _Backlog([0.9] * 10)
    waited, used = asyncio.run(e2e._until_quiet(busy, 5.0))  # type: ignore[arg-type]
    assert used == pytest.approx(90.0) and 2.0 <= waited < 4.0
