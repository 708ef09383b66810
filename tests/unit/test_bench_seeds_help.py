"""``--seeds`` is a list of seed numbers in ``loom bench contention`` and ``migration`` but a count in
``loom bench learn`` (and one number is a count in ``--grid-seeds``): every help text says which."""

import argparse

import pytest


def _help(bench: str, option: str) -> str:
    from loom_benchmarks import add_arguments

    parser = argparse.ArgumentParser(prog="loom bench")
    add_arguments(parser)
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    (action,) = (a for a in sub.choices[bench]._actions if option in a.option_strings)
    assert action.help, f"loom bench {bench} {option} has no help"
    return str(action.help)


@pytest.mark.parametrize("bench", ["contention", "migration"])
def test_seeds_as_seed_numbers_say_they_are_not_a_count(bench: str) -> None:
    text = _help(bench, "--seeds")
    assert "which seeds to run" in text and "not a count" in text


def test_learns_seeds_say_they_are_a_count() -> None:
    text = _help("learn", "--seeds")
    assert "how many seeds to run" in text and "a count" in text


def test_grid_seeds_say_one_number_is_a_count_and_a_list_names_seeds() -> None:
    text = _help("policies", "--grid-seeds")
    assert "one number is how many seeds to run" in text and "list which seeds" in text


@pytest.mark.parametrize("bench", ["contention", "migration"])
def test_loads_say_what_a_load_is_and_their_default(bench: str) -> None:
    text = _help(bench, "--loads")
    assert "capacity" in text and "> 0" in text and "default" in text
