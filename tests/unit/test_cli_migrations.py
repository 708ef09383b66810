"""``loom drain`` / ``undrain`` / ``migrations``: the command line and the table (no stack)."""

import argparse
import asyncio
from typing import Any

import pytest
from rich.console import Console

from loom.cli.main import build_parser
from loom.cli.migrations import confirmation_line, migrations_table, verdicts_table


def test_drain_takes_its_cluster_deadline_concurrency_and_force() -> None:
    args = build_parser().parse_args(
        ["drain", "c-weu-a", "--deadline", "600", "--concurrency", "3", "--force"]
    )
    assert (args.cluster, args.deadline, args.concurrency, args.force) == ("c-weu-a", 600.0, 3, True)
    assert build_parser().parse_args(["undrain", "c-weu-a"]).cluster == "c-weu-a"
    assert build_parser().parse_args(["migrations", "--job", "j1"]).job == "j1"


def test_the_migrations_table_shows_why_and_the_numbers() -> None:
    row = {
        "planned_at": 1_700_000_000.0,
        "job_id": "j1",
        "cause": "drain",
        "state": "completed",
        "from_cluster": "c-weu-a",
        "to_cluster": "c-sea1-a",
        "from_attempt": 1,
        "resume_step": 30,
        "steps": 100,
        "lost_steps": 0,
        "why": "drain of c-weu-a: resumes from its checkpoint at step 30 (recorded)",
    }
    console = Console(record=True, width=400)
    console.print(migrations_table([row]))
    text = console.export_text()
    assert "c-sea1-a" in text and "1 -> 2" in text and "30/100" in text and "step 30 (recorded)" in text


def test_the_verdicts_table_shows_a_job_that_stayed_with_its_numbers() -> None:
    assert build_parser().parse_args(["migrations", "--verdicts"]).verdicts is True
    row = {
        "at": 1_700_000_000.0,
        "job_id": "short",
        "trigger": "link_degraded",
        "link": "azure-westeurope->gcp-asia-southeast1",
        "decision": "stay",
        "source": "c-weu-a",
        "target": "c-use2-a",
        "gain_s": 510.7,
        "threshold_s": 923.9,
        "reason": "stays: gain 511 s (here 600 s, on c-use2-a 90 s) vs cost 851 s + margin 73 s",
    }
    console = Console(record=True, width=400)
    console.print(verdicts_table([row]))
    text = console.export_text()
    assert (
        "stay" in text and "511" in text and "924" in text and "c-use2-a" in text and "link_degraded" in text
    )


def test_loom_explain_shows_the_verdicts_with_gain_cost_margin_and_a_refusal() -> None:
    from unittest import mock

    from loom.cli import main

    verdict = {
        "at": 1_700_000_000.0,
        "job_id": "j1",
        "trigger": "cluster_joined",
        "link": "",
        "decision": "deferred",
        "source": "c-weu-a",
        "target": "c-use2-a",
        "gain_s": 4000.0,
        "cost_s": 700.0,
        "threshold_s": 830.0,
        "margin_s": 3170.0,
        "reason": "moves: gain 4000 s; deferred: 4 migrations already in flight at c-use2-a (limit 4)",
    }
    job = {"job_id": "j1", "state": "running", "cluster": "c-weu-a", "spec": {}, "verdicts": [verdict]}

    class Client:
        async def explain(self, job_id: str) -> dict[str, object]:
            return {"job": job, "decisions": []}

        async def close(self) -> None:
            return None

    async def client() -> Client:
        return Client()

    recorded = Console(record=True, width=400)
    with mock.patch.object(main, "_client", client), mock.patch.object(main, "console", recorded):
        code = main.cmd_explain(build_parser().parse_args(["explain", "j1"]))
    text = recorded.export_text()
    assert code == 0
    assert "why it moved or did not" in text and "cluster_joined" in text and "deferred" in text
    assert "4000" in text and "700" in text and "830" in text and "3170" in text
    assert "limit 4" in text


def test_loom_drain_prints_which_placement_shards_confirmed_and_which_did_not() -> None:
    shards = {"confirmed": ["global"], "unconfirmed": ["eu"], "leaderless": ["old"], "known": True}
    line = confirmation_line({"placement_confirmed": False, "shards": shards})
    assert "confirmed by shard(s) global" in line
    assert "NOT confirmed by shard(s) eu" in line
    assert "old lead nowhere now" in line
    everyone = {"confirmed": ["eu", "global"], "unconfirmed": [], "leaderless": [], "known": True}
    assert confirmation_line({"shards": everyone}) == "placement confirmed by shard(s) eu, global"
    down = confirmation_line({"shards": {"confirmed": [], "unconfirmed": [], "leaderless": ["global"]}})
    assert "no placement leader is running" in down
    unknown = confirmation_line({"shards": {"confirmed": ["global"], "known": False}})
    assert "could not be read" in unknown and "nothing is confirmed" in unknown


def _drain_answers(monkeypatch: pytest.MonkeyPatch, states: list[str], moves: list[dict[str, Any]]) -> None:
    """`loom drain --wait`'s questions answered from ``states`` (one a poll) and ``moves``."""
    from loom.cli import migrations as cli_migrations

    polls = iter(states)
    state = {"now": states[0]}

    async def ask(client: Any, subject: str, request: dict[str, Any]) -> dict[str, Any]:
        if request["op"] == "drains":
            state["now"] = next(polls, state["now"])
            return {"ok": True, "result": [{"cluster": "c-1", "state": state["now"], "started_at": 100.0}]}
        return {"ok": True, "result": moves}

    monkeypatch.setattr(cli_migrations, "ask", ask)


def test_drain_wait_counts_this_drains_moves_only(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from loom.cli import migrations as cli_migrations

    earlier = {"cause": "drain", "state": "completed", "planned_at": 50.0}  # a drain undrained since
    ours = {"cause": "drain", "state": "completed", "planned_at": 150.0}
    _drain_answers(monkeypatch, ["drained"], [earlier, earlier, ours])
    args = argparse.Namespace(cluster="c-1", timeout=30.0, json=False)
    assert asyncio.run(cli_migrations._follow(None, args, {"jobs": 1, "placement_confirmed": True})) == 0  # type: ignore[arg-type]
    out = " ".join(capsys.readouterr().out.split())  # rich wraps at the terminal's width
    assert "1 moved, 0 in flight" in out and "(of 1 at the start)" in out


def test_drain_wait_says_when_it_stops_following_a_drain_still_under_way(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from loom.cli import migrations as cli_migrations

    moving = {"cause": "drain", "state": "started", "planned_at": 150.0}
    _drain_answers(monkeypatch, ["draining"], [moving])
    args = argparse.Namespace(cluster="c-1", timeout=0.01, json=False)
    assert asyncio.run(cli_migrations._follow(None, args, {"jobs": 1, "placement_confirmed": True})) == 1  # type: ignore[arg-type]
    err = " ".join(capsys.readouterr().err.split())
    assert "stopped following after 0.01 s" in err and "still draining, 1 move(s) in flight" in err


def test_drain_wait_keeps_following_while_the_migration_service_does_not_answer(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: a restarting migration service's silence read as "undrained" and the wait ended,
    # exit 1, while the drain was still in force.
    from loom.cli import migrations as cli_migrations

    answers = iter([False, False, True])

    async def ask(client: Any, subject: str, request: dict[str, Any]) -> dict[str, Any]:
        if request["op"] == "drains":
            if not next(answers):
                return {"ok": False, "code": "unavailable", "error": "the migration service did not answer"}
            return {"ok": True, "result": [{"cluster": "c-1", "state": "drained", "started_at": 100.0}]}
        return {"ok": True, "result": [{"cause": "drain", "state": "completed", "planned_at": 150.0}]}

    async def no_wait(_s: float) -> None:
        return None

    monkeypatch.setattr(cli_migrations, "ask", ask)
    monkeypatch.setattr(cli_migrations.asyncio, "sleep", no_wait)
    args = argparse.Namespace(cluster="c-1", timeout=30.0, json=False)
    assert asyncio.run(cli_migrations._follow(None, args, {"jobs": 1, "placement_confirmed": True})) == 0  # type: ignore[arg-type]
    captured = capsys.readouterr()
    assert " ".join(captured.err.split()).count("does not answer") == 1  # said once, not every poll
    assert "undrained" not in captured.out and "drained: 1 moved" in " ".join(captured.out.split())


def test_a_moved_jobs_history_says_why_on_the_requeued_row_and_the_stopped_run_is_not_a_failure() -> None:
    from loom.cli.main import _event_detail

    requeued = {
        "attempt": 2,
        "cause": "migrated",
        "reason": "drain of c-weu-a",
        "from_cluster": "c-weu-a",
        "avoid_clusters": ["c-weu-a"],
    }
    assert _event_detail("requeued", requeued) == (
        "attempt 1 given up (migrated) off c-weu-a: drain of c-weu-a; attempt 2 next; avoids c-weu-a"
    )
    stopped = {"attempt": 1, "reason": "drain of c-weu-a: resumes from its checkpoint", "stopped": True}
    assert _event_detail("failed", stopped) == (
        "attempt 1 stopped by Loom: drain of c-weu-a: resumes from its checkpoint"
    )
    assert _event_detail("failed", {"reason": "exit code 3"}) == "exit code 3"
    # A resize and a cancellation said nothing on their rows.
    resized = {
        "cluster": "c-use2-a",
        "workers": 8,
        "allocations": [{"node": "n1", "gpus": 16}, {"node": "n2", "gpus": 16}],
        "reason": "grew into freed capacity",
    }
    assert _event_detail("resized", resized) == "8 worker(s), 32 GPU(s) on c-use2-a: grew into freed capacity"
    assert _event_detail("cancelled", {"reason": "not needed"}) == "not needed"
    # A gang across clusters: every part, the lead first (before: the lead's only).
    lead = {"cluster": "c-sea1-a", "gpu_model": "T4", "allocations": [{"node": "n1", "gpus": 2}]}
    member = {
        "cluster": "c-weu-a",
        "gpu_model": "T4",
        "allocations": [{"node": "n7", "gpus": 2}, {"node": "n8", "gpus": 2}],
    }
    placed = {**lead, "parts": [lead, member]}
    assert _event_detail("placed", placed) == "c-sea1-a (T4) nodes n1x2; c-weu-a (T4) nodes n7x2, n8x2"
    assert _event_detail("placed", lead) == "c-sea1-a (T4) nodes n1x2"


def test_the_drains_table_and_the_view_tree_say_which_clusters_take_no_new_work() -> None:
    from loom.cli.main import _mark_drains, _view_tree
    from loom.cli.migrations import drains_table

    row = {
        "cluster": "c-weu-a",
        "state": "drained",
        "started_at": 1_700_000_000.0,
        "concurrency": 2,
        "deadline_s": 0.0,
        "forced": False,
        "waiting": [],
    }
    console = Console(record=True, width=400)
    console.print(
        drains_table([row, {**row, "cluster": "c-aue-a", "state": "draining", "deadline_s": 600.0}])
    )
    text = console.export_text()
    assert "c-weu-a" in text and "drained" in text and "none" in text
    assert "c-aue-a" in text and "draining" in text and "600" in text
    assert build_parser().parse_args(["drains", "--json"]).json is True

    def cluster() -> dict[str, Any]:
        level = {"gpus_free": 8, "gpus_total": 8, "gpus_used": 0, "gpus_reserved": 0}
        return {**level, "stale": False, "age_s": 1.0, "ttl_s": 15.0, "nodes": []}

    view = {
        "regions": {
            "eu": {
                "gpus_free": 16, "gpus_total": 16, "gpus_used": 0, "gpus_reserved": 0,
                "zones": {
                    "eu-a": {
                        "gpus_free": 16, "gpus_total": 16, "gpus_used": 0, "gpus_reserved": 0,
                        "clusters": {"c-weu-a": cluster(), "c-weu-b": cluster()},
                    }
                },
            }
        }
    }  # fmt: skip
    _mark_drains(view, {"c-weu-a": "drained"})
    clusters = view["regions"]["eu"]["zones"]["eu-a"]["clusters"]
    assert (clusters["c-weu-a"]["drain"], clusters["c-weu-b"]["drain"]) == ("drained", None)
    console = Console(record=True, width=400)
    console.print(_view_tree(view, with_nodes=False))
    lines = console.export_text().splitlines()
    assert any("c-weu-a" in line and "DRAINED" in line for line in lines)
    assert not any("c-weu-b" in line and "DRAIN" in line for line in lines)


def test_a_repeated_drain_says_it_updated_the_drains_settings(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: draining a draining cluster again changed its concurrency without a word.
    from loom.cli import migrations as cli_migrations

    answer = {"ok": True, "jobs": 2, "new": False, "concurrency": 5, "shards": {"confirmed": ["global"]}}

    async def ask(client: Any, subject: str, request: dict[str, Any]) -> dict[str, Any]:
        return answer

    async def run(work: Any) -> int:
        return int(await work(None))

    monkeypatch.setattr(cli_migrations, "ask", ask)
    monkeypatch.setattr(cli_migrations, "_with_client", lambda work: asyncio.run(run(work)))
    args = argparse.Namespace(
        cluster="c-1", concurrency=5, deadline=0.0, force=True, wait=False, json=False, timeout=None
    )
    assert cli_migrations.cmd_drain(args) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "c-1 was already drained or draining: its settings are updated" in out and "5 at a time" in out
    answer["new"] = True
    assert cli_migrations.cmd_drain(args) == 0
    assert "already" not in capsys.readouterr().out
