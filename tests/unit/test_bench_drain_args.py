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


def test_a_cluster_without_t4s_is_refused_with_the_clusters_that_have_them(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The bench's jobs run on T4s: drained, a cluster without any would have nothing to move."""
    parser = argparse.ArgumentParser()
    drain.add_arguments(parser)
    assert drain.main(parser.parse_args(["--cluster", "c-euc1-a"])) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "c-euc1-a has no T4 GPUs" in err
    assert "c-aue-a" in err and "c-use2-b" in err and "c-weu-b" not in err


def test_fewer_than_one_job_is_refused_before_a_stack_starts(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    drain.add_arguments(parser)
    assert drain.main(parser.parse_args(["--jobs", "0"])) == 2
    assert "--jobs must be at least 1, got 0" in capsys.readouterr().err


def test_the_outcome_says_when_nothing_ran_on_the_drained_cluster() -> None:
    assert drain._outcome(False, None, False) == "nothing_on_cluster"
    assert drain._outcome(False, 1.0, False) == "nothing_on_cluster"  # an empty cluster "drains" at once
    assert drain._outcome(True, 4.9, False) == "drained"
    assert drain._outcome(True, None, True) == "waiting_for_capacity"
    assert drain._outcome(True, None, False) == "timeout"
