"""loom bench e2e's CPU bookkeeping: which processes form which group, what counts as a neighbour."""

import os

from loom_benchmarks.e2e import neighbours_pct, non_placement_pct, stack_groups


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
