"""Benchmark programs behind ``loom bench …``: each prints JSON (and a readable table on stderr).

They measure; they never assert. Quote their figures, not targets.
"""

import argparse
import json
import sys
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Sub-commands of ``loom bench``."""
    sub = parser.add_subparsers(dest="bench", required=True)
    e2e = sub.add_parser("e2e", help="submit -> placed through the real bus, database and services")
    e2e.add_argument("--jobs", type=int, default=2000, help="jobs in the throughput phase")
    e2e.add_argument("--rate", type=float, default=50.0, help="jobs per second in the paced phase")
    e2e.add_argument("--paced-jobs", type=int, default=500, help="jobs in the paced phase (0 skips it)")
    e2e.add_argument("--topology", default="default")
    e2e.add_argument("--json", action="store_true", help="print only the JSON result on stdout")


def emit(result: dict[str, Any], as_json: bool) -> None:
    """Print the result: JSON on stdout; a short human summary on stderr unless ``as_json``."""
    print(json.dumps(result, indent=2))
    if not as_json:
        for key, value in result.items():
            print(f"{key:>28}: {value}", file=sys.stderr)


def run_benchmark(args: argparse.Namespace) -> int:
    """Dispatch ``loom bench NAME``."""
    if args.bench == "e2e":
        from loom_benchmarks.e2e import run

        emit(run(args), args.json)
        return 0
    raise SystemExit(f"unknown benchmark {args.bench}")
