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
