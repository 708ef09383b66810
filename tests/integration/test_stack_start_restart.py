"""A service that dies while the stack starts is started again, not left dead until the health
timeout fails the whole stack (a CI run lost a stack so: a probe collector's free ``/metrics``
port was taken between its pick and its bind, and nothing restarted it during start-up; the
re-pick of a taken port at spawn is tested in ``tests/unit/test_metrics_ports.py``)."""

import asyncio
import os
import sys
import textwrap
from pathlib import Path

from loom.runtime.stack import ServiceProcess, StackOptions, Supervisor, wait_healthy
from loom_proto import subjects

SERVICE = textwrap.dedent(
    """
    import asyncio, pathlib, sys
    import nats

    async def main() -> None:
        first = pathlib.Path(sys.argv[3])
        if not first.exists():
            first.write_text("died")
            sys.exit("OSError: [Errno 98] Address already in use")  # as the metrics bind did
        nc = await nats.connect(sys.argv[1])

        async def health(msg):
            await msg.respond(b"ok")

        await nc.subscribe(sys.argv[2], cb=health)
        await asyncio.sleep(3600)

    asyncio.run(main())
    """
)


def _start_dying_service(nats_url: str, tmp_path: Path) -> tuple[Supervisor, ServiceProcess]:
    script = tmp_path / "svc.py"
    script.write_text(SERVICE)
    supervisor = Supervisor(tmp_path, StackOptions())
    svc = ServiceProcess(
        "probe-x",
        [sys.executable, str(script), nats_url, subjects.service_health("probe-x"), str(tmp_path / "first")],
        str(tmp_path / "probe-x.log"),
    )
    supervisor.services[svc.name] = svc
    supervisor.spawn(svc, dict(os.environ))
    assert supervisor.procs[svc.name].wait(timeout=30) == 1
    return supervisor, svc


def test_a_service_dead_at_start_up_is_restarted_while_the_stack_waits(nats_url: str, tmp_path: Path) -> None:
    supervisor, svc = _start_dying_service(nats_url, tmp_path)
    env = dict(os.environ)
    try:
        silent = asyncio.run(
            wait_healthy(
                nats_url,
                [svc.name],
                timeout_s=30,
                tick=lambda: supervisor.restart_dead(env, "starting"),
            )
        )
        assert silent == []
        assert svc.restarts == 1
        assert svc.last_exit == "exited with status 1"
        assert supervisor.state["status"] == "starting"
        assert supervisor.state["services"]["probe-x"]["restarts"] == 1
        assert "Address already in use" in Path(svc.log).read_text()
    finally:
        for proc in supervisor.procs.values():
            proc.kill()
            proc.wait()


def test_without_a_restart_the_dead_service_stays_silent(nats_url: str, tmp_path: Path) -> None:
    """The same start with nothing restarting it (the code before the fix): it never answers."""
    _, svc = _start_dying_service(nats_url, tmp_path)
    assert asyncio.run(wait_healthy(nats_url, [svc.name], timeout_s=2)) == [svc.name]
