"""Telling a dependency outage from a bad message (loom.bus.outage), without servers: probes here
are plain coroutines that fail until told otherwise."""

import asyncio
from pathlib import Path

import asyncpg
import pytest
from nats.errors import ConnectionClosedError

from loom.bus.connection import BusError
from loom.bus.outage import Dependencies, Dependency, is_bus_outage
from loom.cli.main import _health_text
from loom.errors import InvalidInputError, TransientError
from loom.store.pool import ConflictError, DatabaseUnavailableError, is_unavailable, map_error


class Switch:
    """A dependency's probe: answers only while ``up``."""

    def __init__(self, up: bool = True) -> None:
        self.up = up
        self.probes = 0

    async def probe(self) -> None:
        self.probes += 1
        if not self.up:
            raise ConnectionRefusedError("refused")


def deps(pg: Switch, nats: Switch) -> Dependencies:
    return Dependencies(
        Dependency("postgres", pg.probe, is_unavailable),
        Dependency("nats", nats.probe, is_bus_outage),
        first_backoff_s=0.01,
        max_backoff_s=0.02,
    )


@pytest.mark.parametrize(
    ("error", "suspects"),
    [
        (asyncpg.CannotConnectNowError("the database system is starting up"), ["postgres"]),
        (asyncpg.AdminShutdownError("terminating connection"), ["postgres"]),
        (asyncpg.ConnectionDoesNotExistError("closed"), ["postgres"]),
        (asyncpg.TooManyConnectionsError("too many"), ["postgres"]),
        (map_error(OSError("connection refused")), ["postgres"]),
        (BusError("publish failed after 8 attempts"), ["nats"]),
        (ConnectionClosedError(), ["nats"]),
        (ConnectionRefusedError("refused"), ["nats", "postgres"]),  # vague: probe both
        (TimeoutError(), ["nats", "postgres"]),
        (BusError("publish refused: no stream", non_retryable=True), []),
        (InvalidInputError("bad job"), []),
        (ConflictError("lost a race"), []),
        (TransientError("fenced"), []),
        (RuntimeError("bug"), []),
        (KeyError("x"), []),
    ],
    ids=repr,
)
def test_suspects_are_the_dependencies_an_error_points_at(error: BaseException, suspects: list[str]) -> None:
    assert deps(Switch(), Switch()).suspects(error) == suspects


def test_a_wrapped_error_is_recognised_through_its_cause() -> None:
    try:
        try:
            raise asyncpg.CannotConnectNowError("starting up")
        except asyncpg.PostgresError as inner:
            raise RuntimeError("handler failed") from inner
    except RuntimeError as outer:
        assert deps(Switch(), Switch()).suspects(outer) == ["postgres"]
    assert isinstance(map_error(asyncpg.CannotConnectNowError("x")), DatabaseUnavailableError)


async def test_an_outage_is_confirmed_by_its_probe_waited_out_and_reported() -> None:
    pg, nats = Switch(up=False), Switch()
    d = deps(pg, nats)
    assert await d.confirm(["postgres", "nats"]) == ["postgres"]
    assert d.status() == "degraded: postgres unavailable"
    assert d.unavailable == ["postgres"]
    waiter = asyncio.create_task(d.wait_until_up(["postgres"]))
    await asyncio.sleep(0.1)
    assert not waiter.done(), "still down: still waiting"
    pg.up = True
    assert await asyncio.wait_for(waiter, 2.0) is True
    assert d.status() == "ok"
    assert d.outages == {"postgres": 1}
    await d.close()


async def test_a_recognised_error_whose_dependency_answers_is_no_outage() -> None:
    d = deps(Switch(up=True), Switch())
    assert await d.confirm(d.suspects(asyncpg.ConnectionDoesNotExistError("stale"))) == []
    assert d.status() == "ok"


async def test_waiting_ends_when_the_consumer_stops() -> None:
    d = deps(Switch(up=False), Switch())
    await d.confirm(["postgres"])
    stopping = asyncio.Event()
    waiter = asyncio.create_task(d.wait_until_up(["postgres"], stopping))
    stopping.set()
    assert await asyncio.wait_for(waiter, 2.0) is False
    await d.close()


def test_loom_status_shows_a_degraded_service() -> None:
    assert _health_text({"uptime_s": 12.0, "status": "ok"}) == "ok, up 12s"
    degraded = _health_text({"uptime_s": 3.0, "status": "degraded: postgres unavailable"})
    assert "degraded: postgres unavailable" in degraded
    assert "no answer" in _health_text(None)


async def test_a_check_reports_an_outage_no_consumer_met_and_its_end() -> None:
    pg, nats = Switch(up=False), Switch()
    d = deps(pg, nats)
    assert d.status() == "ok"  # nothing failed yet: an idle process knows nothing
    assert await d.check(min_interval_s=0.0) == ["postgres"]
    assert d.status() == "degraded: postgres unavailable"
    pg.up = True
    assert await d.wait_until_up(["postgres"])
    assert await d.check(min_interval_s=0.0) == []
    assert d.status() == "ok"


async def test_a_check_probes_at_most_once_per_interval_and_within_its_timeout() -> None:
    pg, nats = Switch(), Switch()
    d = deps(pg, nats)
    await d.check(min_interval_s=60.0)
    await d.check(min_interval_s=60.0)
    assert (pg.probes, nats.probes) == (1, 1)

    async def hangs() -> None:
        await asyncio.sleep(60)

    slow = Dependencies(Dependency("postgres", hangs, is_unavailable), first_backoff_s=10.0)
    started = asyncio.get_running_loop().time()
    assert await slow.check(timeout_s=0.05) == ["postgres"]
    assert asyncio.get_running_loop().time() - started < 1.0
    await slow.close()


async def test_check_soon_probes_in_the_background_once_per_interval() -> None:
    pg, nats = Switch(up=False), Switch()
    d = deps(pg, nats)
    d.check_soon()  # returns at once: a health answer is not held up by the probes
    assert d.status() == "ok"
    d.check_soon()  # one check at a time
    await asyncio.sleep(0.05)
    assert d.status() == "degraded: postgres unavailable"
    assert (pg.probes, nats.probes) >= (1, 1) and nats.probes == 1
    d.check_soon()  # within the interval: no new check
    await asyncio.sleep(0.01)
    assert nats.probes == 1
    await d.close()


async def test_close_ends_a_probe_loop_that_lost_its_cancellation() -> None:
    d = deps(Switch(up=False), Switch())
    entered = asyncio.Event()
    swallowed = 0

    async def lossy_probe(name: str, timeout_s: float | None = None) -> BaseException | None:
        # As Python 3.11's wait_for can: a cancel landing as the probe completes is lost, and the
        # probe's own answer (refused) comes back instead.
        nonlocal swallowed
        entered.set()
        try:
            await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            swallowed += 1
        return ConnectionRefusedError("refused")

    d._probe = lossy_probe  # type: ignore[method-assign]
    d.mark_down("postgres", "refused")
    probing = d._probing["postgres"]
    await entered.wait()
    probing.cancel()
    await asyncio.sleep(0.05)
    assert swallowed == 1 and not probing.done(), "the loop lives on past the lost cancel"
    closing = asyncio.ensure_future(d.close())
    await asyncio.wait([closing], timeout=20)  # never cancels the close (wait_for's cancel would)
    assert closing.done() and probing.done(), "the close ends the loop that lost its cancel"


def test_loom_status_says_down_for_a_server_that_is_gone() -> None:
    from loom.cli.main import _server_health_text

    assert _server_health_text({"alive": True, "server_status": "up"}) == "up"
    assert _server_health_text({"alive": False, "server_status": "up"}) == "[red]down[/red]"
    assert _server_health_text({"alive": False}) == "[red]down[/red]"
    assert (
        _server_health_text({"alive": False, "server_status": "crash-looping"}) == "[red]crash-looping[/red]"
    )


def test_loom_status_json_says_down_for_a_server_that_is_gone_as_the_table_does(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import argparse
    import json

    from loom.cli import main as cli

    rows = [
        {"name": "nats", "pid": 1, "alive": False, "server_status": "up"},
        {"name": "postgres", "pid": 2, "alive": True, "server_status": "up"},
    ]
    monkeypatch.setattr(cli.stack, "read_state", lambda _home: {"status": "stopped"})
    monkeypatch.setattr(cli.stack, "process_table", lambda _home: [dict(r) for r in rows])
    assert cli.cmd_status(argparse.Namespace(json=True)) == 1
    shown = {p["name"]: p["server_status"] for p in json.loads(capsys.readouterr().out)["processes"]}
    assert shown == {"nats": "down", "postgres": "up"}


def test_loom_status_shows_the_processes_when_nats_does_not_answer_and_fails_on_a_degraded_service(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: with NATS frozen, `loom status` printed only "start it with loom up" (a stack was
    # up); with PostgreSQL down it said "ready", postgres "up", and exited 0.
    import argparse
    import json

    from loom.bus.connection import BusError
    from loom.cli import main as cli

    rows = [
        {"name": "supervisor", "pid": 1, "alive": True, "restarts": 0},
        {"name": "nats", "pid": 2, "alive": True, "server_status": "up", "restarts": 0},
        {"name": "postgres", "pid": 3, "alive": True, "server_status": "up", "restarts": 0},
        {"name": "placement", "pid": 4, "alive": True, "restarts": 0},
    ]
    monkeypatch.setattr(cli.stack, "read_state", lambda _home: {"status": "ready", "nats_url": "nats://x"})
    monkeypatch.setattr(cli.stack, "process_table", lambda _home: [dict(r) for r in rows])

    def frozen(_url: str, _names: list[str]) -> dict[str, dict[str, object]]:
        raise BusError("no NATS server answered at nats://x within 2.5 s")

    monkeypatch.setattr(cli, "_run_health", frozen)
    assert cli.cmd_status(argparse.Namespace(json=True)) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["status"] == "ready, degraded" and [p["name"] for p in report["processes"]] == [
        r["name"] for r in rows
    ]
    assert {p["name"]: p.get("server_status") for p in report["processes"]}["nats"] == "not answering"
    assert report["problems"] == ["NATS does not answer: no NATS server answered at nats://x within 2.5 s"]

    def degraded(_url: str, _names: list[str]) -> dict[str, dict[str, object]]:
        status = "degraded: postgres unavailable"
        return {
            "placement": {"status": status, "problems": ["postgres unavailable"], "unavailable": ["postgres"]}
        }

    monkeypatch.setattr(cli, "_run_health", degraded)
    assert cli.cmd_status(argparse.Namespace(json=True)) == 1
    report = json.loads(capsys.readouterr().out)
    shown = {p["name"]: p.get("server_status") for p in report["processes"]}
    assert shown["postgres"].startswith("not answering") and shown["nats"] == "up"
    assert "placement: degraded: postgres unavailable" in report["problems"]

    def healthy(_url: str, _names: list[str]) -> dict[str, dict[str, object]]:
        return {"placement": {"status": "ok", "pid": 4, "uptime_s": 9.0}}

    monkeypatch.setattr(cli, "_run_health", healthy)
    assert cli.cmd_status(argparse.Namespace(json=False)) == 0
    assert "Loom stack: ready" in capsys.readouterr().out


def test_loom_status_while_the_stack_starts_and_with_a_service_crash_looping(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: while the stack started, every service read "no answer" and was listed as a problem
    # ("does not answer its health check"); a service restarting again and again was not flagged.
    import argparse
    import json

    from loom.cli import main as cli

    rows = [
        {"name": "supervisor", "pid": 1, "alive": True, "restarts": 0},
        {"name": "nats", "pid": 2, "alive": True, "server_status": "up", "restarts": 0},
        {"name": "placement", "pid": 4, "alive": True, "restarts": 0},
    ]
    state: dict[str, object] = {"status": "starting", "nats_url": "nats://x"}
    monkeypatch.setattr(cli.stack, "read_state", lambda _home: state)
    monkeypatch.setattr(cli.stack, "process_table", lambda _home: [dict(r) for r in rows])
    asked: list[list[str]] = []

    def health(_url: str, names: list[str]) -> dict[str, dict[str, object]]:
        asked.append(names)
        return {"placement": {"status": "ok", "pid": 4, "uptime_s": 9.0}}

    monkeypatch.setattr(cli, "_run_health", health)
    assert cli.cmd_status(argparse.Namespace(json=False)) == 1
    out = capsys.readouterr()
    assert "not asked (stack starting)" in out.out and "no answer" not in out.out and not asked
    assert "not ready" in out.err and "does not answer" not in out.err

    state["status"] = "ready"
    rows[2] = {**rows[2], "crash_loop": True, "restarts": 7, "last_exit": "exit status 1"}
    assert cli.cmd_status(argparse.Namespace(json=True)) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["problems"] == ["placement: crash-looping (7 restarts in all, last exit exit status 1)"]
    assert cli.cmd_status(argparse.Namespace(json=False)) == 1
    assert "crash-looping" in capsys.readouterr().out


def test_a_service_restarted_again_and_again_is_flagged_until_it_stays_up(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from loom.runtime import stack

    sup = stack.Supervisor(tmp_path, stack.StackOptions())
    svc = stack.ServiceProcess("metrics", ["x"], str(tmp_path / "m.log"))
    sup.services["metrics"] = svc
    now = [1000.0]
    monkeypatch.setattr(stack.time, "time", lambda: now[0])

    class Proc:
        def __init__(self) -> None:
            self.returncode: int | None = 1

        def poll(self) -> int | None:
            return self.returncode

    proc = Proc()
    sup.procs["metrics"] = proc  # type: ignore[assignment]

    def spawn(s: stack.ServiceProcess, _env: dict[str, str]) -> None:
        s.started_at = now[0]
        proc.returncode = None

    monkeypatch.setattr(sup, "spawn", spawn)
    monkeypatch.setattr(sup, "process_env", lambda _name, env: env)
    monkeypatch.setattr(sup, "write_state", lambda *_a, **_k: None)
    for _ in range(stack.CRASH_LOOP_RESTARTS):
        proc.returncode = 1
        sup.restart_dead({}, "ready")  # noticed dead
        now[0] += 11.0
        sup.restart_dead({}, "ready")  # restarted after its backoff
    assert svc.restarts == stack.CRASH_LOOP_RESTARTS and svc.crash_loop
    now[0] += stack.STABLE_S - 1
    sup.restart_dead({}, "ready")
    assert svc.crash_loop
    now[0] += 1
    sup.restart_dead({}, "ready")
    assert not svc.crash_loop


def test_loom_status_lists_the_nodes_a_slow_run_made_suspect_with_why_and_for_how_long() -> None:
    # A grown job's false slow verdict closed a whole pool for ten minutes and nothing but explain's
    # "nodes unschedulable" said so (a newcomer's walk).
    from loom.cli.main import _suspect_lines

    rows = [
        {
            "name": "placement",
            "health": {"suspect_nodes": {"n2": {"why": "j: delivers 41%", "until": 1600.0}}},
        },
        {"name": "placement-standby", "health": {"suspect_nodes": {}}},
        {"name": "metrics", "health": None},
    ]
    assert _suspect_lines(rows, now=1000.0) == [
        "1 node(s) take no new work for now (suspect after a slow run):",
        "  n2: j: delivers 41% (600 s more)",
    ]
    assert _suspect_lines(rows[1:], now=1000.0) == []


async def test_a_probe_loop_cancelled_once_ends_though_wait_for_lost_the_cancel() -> None:
    # The cancel lands as the probe completes (the probe itself cancels the loop, then fails):
    # Python 3.11's wait_for then returns the probe's end instead of the cancel. The loop must end
    # all the same, on that one cancel (an event loop's close cancels each task once and waits on
    # all of them: CI hung there until pytest-timeout).
    d: Dependencies

    async def fails_as_it_is_cancelled() -> None:
        d._probing["nats"].cancel()
        raise ConnectionRefusedError("refused")

    d = Dependencies(Dependency("nats", fails_as_it_is_cancelled, is_bus_outage), first_backoff_s=0.01)
    d.mark_down("nats", BusError("gone"))
    loop_task = d._probing["nats"]
    done, _ = await asyncio.wait([loop_task], timeout=2.0)
    assert loop_task in done and loop_task.cancelled()
