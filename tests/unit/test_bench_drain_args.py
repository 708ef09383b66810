"""``loom bench drain``: a cluster the topology lacks is refused before any stack starts."""

import argparse

import pytest

from loom_benchmarks import drain


def test_a_cluster_the_topology_lacks_is_refused_with_its_name_before_a_stack_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = argparse.ArgumentParser()
    drain.add_arguments(parser)
    args = parser.parse_args(["--topology", "small"])  # the default cluster is the default topology's
    assert drain.main(args) == 2
    err = capsys.readouterr().err
    assert "has no cluster 'c-aue-a'" in err and "--cluster" in err


def test_an_unknown_topology_is_named_as_such(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    drain.add_arguments(parser)
    assert drain.main(parser.parse_args(["--topology", "nosuch"])) == 2
    err = capsys.readouterr().err
    assert "--topology nosuch" in err and "no packaged topology" in err and "--cluster" not in err
