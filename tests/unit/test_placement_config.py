"""Placement's command line: tenant quota files and defaults."""

from pathlib import Path

import pytest

from loom.sched.quota import OPEN, QuotaError
from loom_services.placement.main import parse_args, read_tenants

ROOT = Path(__file__).resolve().parents[2]


def test_the_example_tenant_file_loads_as_a_closed_configuration() -> None:
    config = read_tenants(str(ROOT / "deploy" / "tenants.example.yaml"))
    assert config.open is False
    assert set(config.tenants) == {"vision", "language", "bench"}
    assert config.tenants["vision"].cohort == "research"
    assert config.tenants["vision"].borrowing_limit == 128


def test_no_tenant_file_means_every_tenant_is_admitted_without_quota() -> None:
    assert read_tenants(None) is OPEN


def test_a_bad_tenant_file_is_refused_with_the_reason(tmp_path: Path) -> None:
    bad = tmp_path / "tenants.yaml"
    bad.write_text("tenants:\n  acme: {gpus: -4}\n")
    with pytest.raises(QuotaError, match="acme"):
        read_tenants(str(bad))


def test_defaults() -> None:
    args = parse_args([])
    assert (args.shard, args.name, args.lease_ttl_s, args.confirm_timeout_s) == (
        "global",
        "placement",
        2.0,
        60.0,
    )


def test_loom_up_tenants_reach_every_placement_instance_through_the_supervisor(tmp_path: Path) -> None:
    from loom.runtime.stack import StackOptions, parse_supervisor_argv, service_argvs, supervisor_argv

    quotas = str(ROOT / "deploy" / "tenants.example.yaml")
    options = StackOptions(placement_shards=2, tenants=quotas)
    # The supervisor (a process of its own) is given the file and hands it on.
    _, passed = parse_supervisor_argv(supervisor_argv(tmp_path, options)[3:])
    assert passed.tenants == quotas
    argvs = service_argvs(passed)
    placement = {name: argv for name, argv in argvs.items() if name.startswith("placement")}
    # Two shards: the global one and the regional g1, each a leader and a standby.
    assert len(placement) == 4 and {"placement", "placement-standby"} < set(placement)
    for argv in placement.values():
        assert parse_args(argv[3:]).tenants == quotas
    assert all("--tenants" not in argv for name, argv in argvs.items() if name not in placement)
    # Without a file no placement gets the option: every tenant admitted.
    assert all("--tenants" not in argv for argv in service_argvs(StackOptions()).values())


def test_loom_up_refuses_a_bad_tenant_file_before_starting_anything(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from loom.cli.main import main

    monkeypatch.setenv("LOOM_HOME", str(tmp_path / "home"))
    bad = tmp_path / "tenants.yaml"
    bad.write_text("tenants:\n  acme: {gpus: -4}\n")
    assert main(["up", "--tenants", str(bad)]) == 2
    assert "acme" in capsys.readouterr().err
    assert main(["up", "--tenants", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml" in "".join(capsys.readouterr().err.split())  # the console wraps long lines
    assert not (tmp_path / "home" / "stack.json").exists()
