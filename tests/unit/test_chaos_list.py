"""``loom bench chaos --list``: the plan, and which fault sets the run it describes would leave out."""

import json

import pytest

from loom.cli.main import build_parser
from loom_benchmarks.chaos import main


def _listed(capsys: pytest.CaptureFixture[str], *options: str) -> dict[str, list[object]]:
    args = build_parser().parse_args(["bench", "chaos", "--list", *options])
    assert main(args) == 0
    listed: dict[str, list[object]] = json.loads(capsys.readouterr().out)
    return listed


def test_the_list_of_a_three_node_campaign_leaves_out_no_nats_cluster_faults(
    capsys: pytest.CaptureFixture[str],
) -> None:
    listed = _listed(capsys, "--nats-cluster", "3", "--cluster-only")
    assert listed["not_available"] == []  # it said "it has one nats-server" before
    assert any("nats-node-sigkill" in json.dumps(fault) for fault in listed["plan"])


def test_the_list_of_a_one_server_campaign_says_the_node_kills_are_left_out(
    capsys: pytest.CaptureFixture[str],
) -> None:
    listed = _listed(capsys)
    [why] = listed["not_available"]
    assert "nats cluster faults" in str(why)
    assert not any("nats-node-sigkill" in json.dumps(fault) for fault in listed["plan"])
