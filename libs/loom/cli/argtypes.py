"""argparse types for numbers with a range: a value out of it is bad usage (exit 2, before any
connection), not a refusal from a service or a database error."""

import argparse
import math
from collections.abc import Callable


def _number(text: str, kind: type[int] | type[float]) -> float:
    try:
        value = kind(text)
    except ValueError:
        what = "a whole number" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"not a finite number: {text!r}")
    return value


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    value = int(_number(text, int))
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1."""
    value = int(_number(text, int))
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def bounded_int(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an integer within ``low``-``high``."""

    def parse(text: str) -> int:
        value = int(_number(text, int))
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be within {low}-{high}, got {value}")
        return value

    return parse


def non_negative_float(text: str) -> float:
    """A finite number >= 0."""
    value = _number(text, float)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value:g}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0."""
    value = _number(text, float)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {value:g}")
    return value


def non_negative_float_below(limit: float) -> Callable[[str], float]:
    """The type of a finite number >= 0 and below ``limit`` (a noise level whose bound is open)."""

    def parse(text: str) -> float:
        value = _number(text, float)
        if not 0 <= value < limit:
            raise argparse.ArgumentTypeError(f"must be 0 or more and below {limit:g}, got {value:g}")
        return value

    return parse


def share(text: str) -> float:
    """A number within 0-1 (a share: of probes lost, say)."""
    value = _number(text, float)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be within 0-1, got {value:g}")
    return value
