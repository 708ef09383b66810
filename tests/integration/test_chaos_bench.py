"""``loom bench chaos --quick``: a short seeded campaign on a real private stack.

Three faults (PostgreSQL stopped 2 s, poison ``started`` events, an agent SIGKILLed) while jobs
flow; the JSON has a record per fault and per fault kind, and nothing acknowledged is lost or run
twice. The final checks read the real state: a reservation the test leaves confirmed for a finished
job is reported leaked, a finished job set back to ``running`` (no agent runs it) stuck, and a node
whose book holds more GPUs than it has overbooked -- each by its name.
"""

import argparse

import asyncpg

from loom_benchmarks import chaos


def args(**overrides: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    chaos.add_arguments(parser)
    ns = parser.parse_args(["--quick", "--faults", "3", "--seed", "32", "--warmup-s", "1", "--gap-s", "0.5"])
    ns.drain_s = 40.0
    ns.recheck_s = 3.0
    for key, value in overrides.items():
        setattr(ns, key, value)
    return ns


def test_plan_is_seeded_and_covers_every_fault_kind() -> None:
    full = chaos.build_plan("small", 7, quick=False, faults=None)
    assert len([f for f in full if f.kind != "control"]) >= 30
    kinds = {f.kind for f in full}
    assert kinds == {
        "sigkill", "sigstop", "postgres-outage", "postgres-sigkill", "nats-outage", "nats-sigkill", "poison",
        "redelivery", "control",
    }  # fmt: skip
    assert sum(f.kind == "control" for f in full) == chaos.CONTROLS
    assert sorted(f.hold_s for f in full if f.kind == "postgres-outage") == [5, 15, 60, 120]
    assert sorted(f.hold_s for f in full if f.kind == "nats-outage") == [5, 60, 120]
    roles = {f.group for f in full if f.kind == "sigkill"} | {f.group for f in full if f.kind == "sigstop"}
    assert roles == {f"{signal} {role}" for signal in ("sigkill", "sigstop") for role in chaos.ROLES}
    assert {f.target for f in full if f.kind == "poison"} == set(chaos.consumed_subjects("small"))
    again = chaos.build_plan("small", 7, quick=False, faults=None)
    assert [f.describe() for f in again] == [f.describe() for f in full]
    other = chaos.build_plan("small", 8, quick=False, faults=None)
    assert [f.describe() for f in other] != [f.describe() for f in full]
    assert all(f.hold_s == chaos.QUICK_HOLD_S for f in chaos.build_plan("small", 7, True, None) if f.hold_s)


def test_a_cluster_plan_kills_each_node_role_and_drops_the_single_servers_faults() -> None:
    full = chaos.build_plan("small", 7, quick=False, faults=None, cluster_kills=2)
    kills = [f for f in full if f.kind == "nats-node-sigkill"]
    assert sorted(f.target for f in kills) == sorted(chaos.CLUSTER_TARGETS * 2)
    assert {f.group for f in kills} == {f"nats-node-sigkill {t}" for t in chaos.CLUSTER_TARGETS}
    kinds = {f.kind for f in full}
    assert "nats-outage" not in kinds and "nats-sigkill" not in kinds  # no single nats-server to stop
    assert {"sigkill", "postgres-outage", "poison", "redelivery"} <= kinds
    assert [f.index for f in full] == list(range(1, len(full) + 1))
    only = chaos.build_plan("small", 7, quick=False, faults=None, cluster_kills=1, cluster_only=True)
    assert sorted(f.kind for f in only) == ["control"] * chaos.CONTROLS + ["nats-node-sigkill"] * 4


def test_quick_campaign_reports_every_fault_and_finds_planted_defects() -> None:
    planted: dict[str, str] = {}

    async def plant(database_url: str) -> None:
        conn = await asyncpg.connect(database_url)
        try:
            done = await conn.fetch(
                "SELECT job_id, attempt, cluster FROM jobs WHERE state = 'completed' AND job_id LIKE 'cx-%' "
                "ORDER BY job_id LIMIT 2"
            )
            leak, stuck = done[0], done[1]
            node = await conn.fetchval(
                "SELECT node FROM node_allocations WHERE cluster = $1 ORDER BY node LIMIT 1", leak["cluster"]
            )
            await conn.execute(
                "INSERT INTO reservations (job_id, attempt, node, cluster, gpus, state) "
                "VALUES ($1, $2, $3, $4, 1, 'confirmed')",
                leak["job_id"],
                leak["attempt"],
                node,
                leak["cluster"],
            )
            planted["leaked"] = f"{leak['job_id']}:{leak['attempt']}:{node}"
            await conn.execute("UPDATE jobs SET state = 'running' WHERE job_id = $1", stuck["job_id"])
            planted["stuck"] = f"{stuck['job_id']}:{stuck['attempt']}"
            full = await conn.fetchrow(
                "SELECT node, gpus_total FROM node_allocations WHERE gpus_total > 0 "
                "ORDER BY node DESC LIMIT 1"
            )
            await conn.execute(
                "UPDATE node_allocations SET gpus_reserved = gpus_total + 1 WHERE node = $1", full["node"]
            )
            planted["overbooked"] = f"book {full['node']} {full['gpus_total'] + 1}/{full['gpus_total']}"
        finally:
            await conn.close()

    result = chaos.run(args(), before_final=plant)

    plan = result["config"]["plan"]
    assert [(f["kind"], f["target"]) for f in plan] == [
        ("postgres-outage", "postgres"),
        ("poison", "loom.jobs.started.chaos.c-sea1-a"),  # an agent's report: the cluster last
        ("sigkill", "agent-c-sea1-a"),
    ]
    faults = result["faults"]
    assert [f["index"] for f in faults] == [1, 2, 3]
    for fault in faults:
        assert fault["error"] is None, fault
        assert fault["recovered"], fault
        assert fault["recovery_s"] is not None and fault["recovery_s"] >= fault["first_placement_s"] >= 0
        assert set(fault["jobs"]) >= {"acknowledged", "lost", "doubled"}
        assert fault["placement_stall_s"] is not None and fault["placement_stall_s"] >= 0
        if fault["kind"] == "postgres-outage":  # nothing is placed while the database is away
            assert fault["placement_stall_s"] > 0, fault
        assert set(fault["state_after"]) >= {"stuck", "leaked", "overbooked"}
        assert fault["dead_letters"]["count"] == fault["dead_letters"]["injected"]
    assert faults[0]["done"]["pids_stopped"] >= 2  # the postmaster and its backends
    assert faults[0]["fault_s"] >= chaos.QUICK_HOLD_S
    # The two consumers of agents' reports (placement's lifecycle events and metering) each
    # dead-letter the four injected events they can never decode, named so: eight dead letters
    # (before, the second consumer's was dropped as a duplicate of the first's message id).
    assert faults[1]["dead_letters"] == {"count": 8, "injected": 8, "not_injected": []}
    assert faults[2]["done"]["service"] == "agent-c-sea1-a"
    assert set(result["by_kind"]) == {"sigkill agent", "poison", "postgres-outage 2s"}

    head = result["headline"]
    assert head["faults"] == 3 and head["recovered"] == 3
    assert head["acknowledged"] > 20
    assert head["lost"] == 0 and head["doubled"] == 0
    assert head["dead_letters_not_injected"] == 0
    # What the test planted after the drain, found by name from the database and the agents.
    state = result["final_state"]
    assert state["leaked_examples"] == [planted["leaked"]]
    assert state["stuck_examples"] == [planted["stuck"]]
    assert planted["overbooked"] in state["overbooked_examples"]
    assert head["leaked"] == 1 and head["stuck"] == 1 and head["overbooked"] >= 1
    assert head["pass"] is False
    assert len(result["not_available"]) == 1 and "nats cluster" in result["not_available"][0]
