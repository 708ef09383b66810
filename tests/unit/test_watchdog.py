"""The watchdog: a supervised task that dies is logged, restarted with backoff and shown in health
until it has run long enough again; one that finishes or is cancelled is let go."""

import asyncio
from typing import Any

import pytest
from structlog.testing import capture_logs
from waiting import until

from loom.cli.main import _health_text
from loom.runtime.watchdog import Watchdog


class Flaky:
    """A loop that dies ``deaths`` times (raising), then runs until cancelled."""

    def __init__(self, deaths: int) -> None:
        self.deaths = deaths
        self.starts: list[float] = []
        self.up = asyncio.Event()

    async def __call__(self) -> None:
        self.starts.append(asyncio.get_running_loop().time())
        if len(self.starts) <= self.deaths:
            raise ConnectionError(f"lost the link (run {len(self.starts)})")
        self.up.set()
        await asyncio.Event().wait()  # a healthy loop runs until cancelled


async def test_a_task_that_dies_is_logged_restarted_with_backoff_and_degrades_health_until_it_is_back() -> (
    None
):
    first_backoff_s, healthy_after_s = 0.1, 1.0
    watchdog = Watchdog(
        "svc", first_backoff_s=first_backoff_s, max_backoff_s=1.0, healthy_after_s=healthy_after_s
    )
    flaky = Flaky(deaths=3)
    seen: list[dict[str, Any]] = []
    with capture_logs() as logs:
        task = watchdog.supervise("pump", flaky)

        async def restarting() -> bool:
            health = watchdog.health()
            seen.append(health)
            return health["tasks"].get("pump", {}).get("state") == "restarting"

        await until(restarting, 5, "the pump to be seen restarting")
        await asyncio.wait_for(flaky.up.wait(), timeout=5)

    died = [e for e in logs if e["event"] == "task died; restarting"]
    assert [e["restarts"] for e in died] == [1, 2, 3]
    assert all(e["task"] == "pump" and e["service"] == "svc" and e["log_level"] == "error" for e in died)
    assert "ConnectionError: lost the link (run 3)" in died[-1]["error"]
    assert isinstance(died[0]["exc_info"], ConnectionError), "the traceback goes with the log line"

    # Backoff doubles: the gaps between runs are at least 1x, 2x, 4x the first backoff.
    gaps = [b - a for a, b in zip(flaky.starts, flaky.starts[1:], strict=False)]
    for gap, factor in zip(gaps, [1, 2, 4], strict=True):
        assert gap >= first_backoff_s * factor * 0.99
    assert [e["retry_in_s"] for e in died] == pytest.approx([0.1, 0.2, 0.4])

    restarting = next(h for h in seen if h["tasks"]["pump"]["state"] == "restarting")
    assert restarting["status"] == "degraded"
    assert restarting["problems"][0].startswith("task pump restarting (")
    assert "lost the link" in restarting["problems"][0]

    # Back, but only just: still shown as recovering, with what happened.
    health = watchdog.health()
    assert health["tasks"]["pump"] == {
        "state": "recovering",
        "restarts": 3,
        "last_error": "ConnectionError: lost the link (run 3)",
    }
    assert health["status"] == "degraded"

    async def healthy() -> bool:
        return watchdog.health()["status"] == "ok"

    await until(healthy, 5, "the pump to count as healthy again")
    assert watchdog.health()["tasks"]["pump"]["state"] == "running"
    assert watchdog.health()["tasks"]["pump"]["restarts"] == 3, "the history stays visible"
    assert len(flaky.starts) == 4 and not task.done()
    await watchdog.stop()
    assert task.cancelled()
    assert watchdog.health()["tasks"] == {}, "a cancelled task is let go"


async def test_a_loop_that_returns_when_it_must_not_is_a_death_but_a_finishing_task_is_let_go() -> None:
    watchdog = Watchdog("svc", first_backoff_s=0.01, healthy_after_s=60.0)
    runs = {"loop": 0, "job": 0}

    async def loop() -> None:
        runs["loop"] += 1
        if runs["loop"] > 2:
            await asyncio.Event().wait()

    async def job() -> None:
        runs["job"] += 1

    with capture_logs() as logs:
        looping = watchdog.supervise("loop", loop)
        await watchdog.supervise("job", job, finishes=True)
        await until(lambda: _true(runs["loop"] == 3), 5, "the loop's third run")
    assert runs["job"] == 1
    died = [e for e in logs if e["event"] == "task died; restarting"]
    assert [e["task"] for e in died] == ["loop", "loop"]
    assert "TaskDied" in died[0]["error"] and "must run until cancelled" in died[0]["error"]
    assert set(watchdog.health()["tasks"]) == {"loop"}
    looping.cancel()
    await asyncio.gather(looping, return_exceptions=True)


async def test_an_unlisted_task_shows_only_while_it_is_unhealthy_and_conditions_join_the_problems() -> None:
    watchdog = Watchdog("svc", first_backoff_s=0.2, healthy_after_s=60.0)
    pending = {"reports": 0}
    watchdog.condition(
        "bus",
        lambda: f"nats unavailable, {pending['reports']} reports journalled" if pending["reports"] else None,
    )
    calm = watchdog.supervise("job-calm", lambda: asyncio.Event().wait(), finishes=True, listed=False)
    assert watchdog.health() == {"status": "ok", "problems": [], "tasks": {}}

    pending["reports"] = 12
    assert watchdog.health()["problems"] == ["nats unavailable, 12 reports journalled"]

    async def broken() -> None:
        raise ValueError("bug")

    watchdog.supervise("job-broken", broken, finishes=True, listed=False)
    await until(lambda: _true("job-broken" in watchdog.health()["tasks"]), 5, "the broken run listed")
    health = watchdog.health()
    assert health["status"] == "degraded"
    assert set(health["tasks"]) == {"job-broken"}
    assert health["problems"][-1] == "nats unavailable, 12 reports journalled"
    with pytest.raises(ValueError, match="already supervised"):
        watchdog.supervise("job-calm", lambda: asyncio.Event().wait())
    await watchdog.stop()
    assert calm.cancelled()


def test_loom_status_prints_a_degraded_service_with_its_problems() -> None:
    assert _health_text({"uptime_s": 12.0, "status": "ok", "problems": []}) == "ok, up 12s"
    text = _health_text(
        {
            "uptime_s": 7.0,
            "status": "degraded: nats unavailable, 3 reports journalled; task [x]",
            "problems": ["nats unavailable, 3 reports journalled", "task [x]"],
        }
    )
    assert text == "[yellow]degraded: nats unavailable, 3 reports journalled; task \\[x][/yellow], up 7s"


async def _true(value: bool) -> bool:
    return value
