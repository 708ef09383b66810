"""ServerWatch's policy: restart after a death with doubling, capped delays; flag a crash loop."""

import json
import signal
from pathlib import Path
from typing import Any

from loom.runtime import stack
from loom.runtime.servers import ServerStartError
from loom.runtime.stack import ServerWatch


class FakeServer:
    """Stands in for a NatsServer: dies when told, fails the next ``failing_starts`` starts."""

    def __init__(self) -> None:
        self.port = 4222
        self.pid: int | None = 100
        self.exit_code: int | None = None
        self.failing_starts = 0
        self.cleaned = 0
        self.started = 0

    def poll_exit(self) -> int | None:
        return self.exit_code

    def clean_after_exit(self) -> None:
        self.cleaned += 1

    def start(self) -> None:
        if self.failing_starts:
            self.failing_starts -= 1
            raise ServerStartError("nats on port 4222 did not start: it exited with status 1")
        self.started += 1
        self.exit_code = None
        self.pid = 100 + self.started

    def die(self) -> None:
        self.exit_code = -signal.SIGKILL
        self.pid = None


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _watch(server: FakeServer, clock: Clock, **kwargs: Any) -> ServerWatch:
    return ServerWatch("nats", server, clock=clock, first_delay_s=1.0, max_delay_s=4.0, **kwargs)  # type: ignore[arg-type]


def test_a_dead_server_is_cleaned_up_before_it_is_restarted_after_the_first_delay() -> None:
    server, clock = FakeServer(), Clock()
    watch = _watch(server, clock)
    assert not watch.check()
    server.die()
    assert watch.check()
    assert watch.state.status == "restarting"
    assert watch.state.last_exit == "killed by SIGKILL"
    clock.now = 0.5
    assert not watch.check()
    assert server.started == 0
    clock.now = 1.0
    assert watch.check()
    assert (server.cleaned, server.started) == (1, 1)
    assert watch.state.status == "up"
    assert watch.state.restarts == 1
    assert watch.state.pid == 101


def test_failed_restarts_back_off_doubling_up_to_the_cap() -> None:
    server, clock = FakeServer(), Clock()
    watch = _watch(server, clock)
    server.die()
    server.failing_starts = 3
    watch.check()
    attempts = []
    while watch.state.status != "up" and clock.now < 60:
        clock.now += 0.25
        before = server.cleaned
        watch.check()
        if server.cleaned != before:
            attempts.append(clock.now)
    # Deaths/failures 1, 2, 3, 4 wait 1, 2, 4 and then 4 s (the cap).
    assert attempts == [1.0, 3.0, 7.0, 11.0]
    assert watch.state.last_exit is not None
    assert watch.state.restarts == 1


def test_a_server_that_keeps_dying_is_flagged_crash_looping_and_still_restarted() -> None:
    server, clock = FakeServer(), Clock()
    watch = _watch(server, clock, crash_loop_restarts=3, crash_loop_window_s=100.0)
    for _ in range(3):
        server.die()
        watch.check()
        clock.now += 5.0
        watch.check()
        assert watch.state.status == "up"
    assert watch.state.crash_loop
    assert watch.state.restarts == 3


def test_a_crash_loop_flag_clears_once_the_server_stays_up_long_enough() -> None:
    server, clock = FakeServer(), Clock()
    watch = _watch(server, clock, crash_loop_restarts=2, crash_loop_window_s=100.0, stable_s=30.0)
    for _ in range(2):
        server.die()
        watch.check()
        clock.now += 5.0
        watch.check()
    assert watch.state.crash_loop
    up_at = clock.now
    clock.now = up_at + 29.0
    assert not watch.check() and watch.state.crash_loop  # not stable yet
    clock.now = up_at + 30.0
    assert watch.check()  # changed: stack.json is rewritten
    assert not watch.state.crash_loop and watch.state.status == "up"
    assert not watch.check()


def test_a_server_that_stayed_up_long_enough_restarts_after_the_first_delay_again() -> None:
    server, clock = FakeServer(), Clock()
    watch = _watch(server, clock, stable_s=10.0)
    for _ in range(3):
        server.die()
        watch.check()
        clock.now += 5.0
        watch.check()
    assert watch.delay_s(3) == 4.0
    clock.now += 10.0
    watch.check()  # stable: the failure count resets
    server.die()
    watch.check()
    clock.now += 1.0
    watch.check()
    assert watch.state.status == "up"


def test_the_process_table_shows_restarts_and_last_exit_of_servers_and_services(tmp_path: Path) -> None:
    server = {"pid": None, "port": 1, "status": "restarting", "restarts": 2, "last_exit": "killed by SIGKILL"}
    state = {
        "status": "ready",
        "supervisor_pid": None,
        "servers": {
            "nats": {**server, "crash_loop": True},
            "postgres": {**server, "restarts": 0, "last_exit": None, "status": "up", "crash_loop": False},
        },
        "services": {
            "metrics": {"pid": None, "restarts": 1, "last_exit": "exited with status 3"},
        },
    }
    (tmp_path / "stack.json").write_text(json.dumps(state))
    rows = {row["name"]: row for row in stack.process_table(tmp_path)}
    assert (rows["nats"]["restarts"], rows["nats"]["last_exit"]) == (2, "killed by SIGKILL")
    assert rows["nats"]["server_status"] == "crash-looping"
    assert rows["postgres"]["server_status"] == "up"
    assert (rows["metrics"]["restarts"], rows["metrics"]["last_exit"]) == (1, "exited with status 3")
    assert not rows["nats"]["alive"]
