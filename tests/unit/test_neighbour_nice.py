"""Every service but placement starts niced, so placement gets the cores when both want them."""

import dataclasses
import os
import sys
from pathlib import Path

import pytest

from loom.runtime.stack import (
    NEIGHBOUR_NICE,
    ServiceProcess,
    StackOptions,
    Supervisor,
    parse_supervisor_argv,
    service_argvs,
    service_nice,
    supervisor_argv,
)


def test_placement_runs_at_the_supervisors_niceness_and_every_other_service_niced() -> None:
    options = StackOptions(placement_shards=2, neighbour_nice=7)
    names = list(service_argvs(options))
    placement = [n for n in names if n.startswith("placement")]
    assert "placement" in placement and "placement-standby" in placement
    assert any(n.endswith("-standby") and n != "placement-standby" for n in placement)  # a shard's
    assert {service_nice(n, options) for n in placement} == {0}
    others = [n for n in names if n not in placement]
    assert any(n.startswith("agent-") for n in others) and "metrics" in others
    assert {service_nice(n, options) for n in others} == {7}
    assert {service_nice(n, StackOptions(neighbour_nice=0)) for n in names} == {0}


def test_the_default_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOOM_NEIGHBOUR_NICE", raising=False)
    assert StackOptions().neighbour_nice == NEIGHBOUR_NICE
    monkeypatch.setenv("LOOM_NEIGHBOUR_NICE", "2")
    assert StackOptions().neighbour_nice == 2


def test_a_niceness_outside_0_to_19_is_refused_with_a_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    for bad in (-1, 20):
        with pytest.raises(ValueError, match="within 0-19"):
            StackOptions(neighbour_nice=bad)
    monkeypatch.setenv("LOOM_NEIGHBOUR_NICE", "high")
    with pytest.raises(ValueError, match=r"\$LOOM_NEIGHBOUR_NICE: .*integer 0-19, got 'high'"):
        StackOptions()
    with pytest.raises(SystemExit):
        parse_supervisor_argv(["--home", "/tmp/x", "--neighbour-nice", "-3"])


def test_loom_up_refuses_a_bad_niceness_before_starting_anything(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from loom.cli.main import main

    monkeypatch.setenv("LOOM_HOME", str(tmp_path))
    monkeypatch.setenv("LOOM_NEIGHBOUR_NICE", "-2")
    assert main(["up"]) == 2
    assert "within 0-19" in capsys.readouterr().err
    assert not (tmp_path / "stack.json").exists()
    with pytest.raises(SystemExit):
        main(["up", "--neighbour-nice", "42"])


def test_start_services_gives_each_service_its_niceness(tmp_path: Path) -> None:
    options = StackOptions(neighbour_nice=6)
    supervisor = Supervisor(tmp_path, options)
    spawned: dict[str, int] = {}
    supervisor.spawn = lambda svc, env: spawned.__setitem__(svc.name, svc.nice)  # type: ignore[method-assign]
    supervisor.start_services({})
    assert spawned == {name: (0 if name.startswith("placement") else 6) for name in service_argvs(options)}
    assert spawned["placement"] == 0 and spawned["metrics"] == 6


def test_a_spawned_service_runs_at_its_niceness(tmp_path: Path) -> None:
    supervisor = Supervisor(tmp_path, StackOptions())
    seen = {}
    for nice in (0, 4):
        log = tmp_path / f"svc-{nice}.log"
        argv = [sys.executable, "-c", "import os; print(os.nice(0))"]
        svc = ServiceProcess(f"svc-{nice}", argv, str(log), nice=nice)
        supervisor.spawn(svc, dict(os.environ))
        assert supervisor.procs[svc.name].wait(timeout=30) == 0
        seen[nice] = int(log.read_text().strip())
    assert seen[4] - seen[0] == min(4, 19 - seen[0])  # niceness tops out at 19


def test_the_supervisor_command_line_carries_the_options() -> None:
    """What `loom up` chose reaches the supervisor process (its own command line)."""
    options = StackOptions(
        topology="small",
        clusters=["c-a"],
        time_scale=30.0,
        heartbeat_s=1.5,
        max_heartbeat_s=8.0,
        durable=False,
        network=False,
        placement_standby=False,
        placement_shards=2,
        probe_period_s=0.5,
        nats_cluster=3,
        console=False,
        console_port=9999,
        alerts_port=9998,
        traces=True,
        secure_db=False,
        metrics_port_base=9500,
        neighbour_nice=3,
        tenants="/etc/loom/tenants.yaml",
        slurm_clusters=["c-a"],
        services=False,
        secure=not StackOptions().secure,
        nats_host="10.1.2.3",
        postgres_host="::1",
    )
    defaults = StackOptions()
    carried = [f.name for f in dataclasses.fields(StackOptions) if f.name != "slurm_root"]
    # Every field the command line carries differs from its default here, so a lost one shows.
    assert [n for n in carried if getattr(options, n) == getattr(defaults, n)] == []
    argv = supervisor_argv(Path("/tmp/loom-home"), options)
    assert argv[1:3] == ["-m", "loom.runtime.stack"]
    home, parsed = parse_supervisor_argv(argv[3:])
    assert home == Path("/tmp/loom-home")
    assert {n: getattr(parsed, n) for n in carried} == {n: getattr(options, n) for n in carried}


def test_a_silent_service_is_reported_with_the_last_lines_of_its_log(tmp_path: Path) -> None:
    """A stack whose service never answers its health check says what that service last logged
    (the benches remove the stack's home, and with it the log)."""
    supervisor = Supervisor(tmp_path, StackOptions())
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "migration.log").write_text("".join(f"line {i}\n" for i in range(30)))
    assert supervisor.log_tail("migration").splitlines() == [f"line {i}" for i in range(18, 30)]
    assert supervisor.log_tail("never-started") == ""
