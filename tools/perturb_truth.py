"""Write a *perturbed* truth file (developers' robustness check): the packaged tables, or
``--base FILE``, with every (family, GPU) pair's throughput multiplied by its own lognormal factor
of mean 1 (:func:`loom.sim.truth.perturbed`).

Loom's profiles and SCU weights were fitted on the packaged tables; a truth that disagrees with
them per (family, GPU), as a real fleet's measurements would, tests whether the decisions hold
when the scheduler's prior is wrong and only learning can correct it::

    .venv/bin/python tools/perturb_truth.py --sigma 0.3 --seed 1 -o /tmp/truth-s03.json
    .venv/bin/loom bench policies --grid --truth /tmp/truth-s03.json ...
"""

import argparse
import json
import math
import sys
from pathlib import Path

from loom.sim.truth import TruthError, dump_truth, load_truth, perturbed


def _sigma(text: str) -> float:
    """``--sigma``: a finite number >= 0 (argparse reports anything else as a usage error)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def _factor(value: float) -> str:
    """A factor for the summary line: two decimals, or two significant digits when that shows 0."""
    return f"{value:.2f}" if 0.01 <= value < 1e6 else f"{value:.2g}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write a perturbed truth file.")
    parser.add_argument("--base", help="truth file to perturb (default: the packaged tables)")
    parser.add_argument(
        "--sigma", type=_sigma, default=0.3, help="log standard deviation of the factors (0.3)"
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("-o", "--out", required=True, help="where to write the truth file")
    args = parser.parse_args(argv)
    try:
        base = load_truth(args.base)
        truth, factors = perturbed(base, args.sigma, args.seed)
    except (TruthError, ValueError) as exc:
        parser.error(str(exc))
    if not factors:
        parser.error(
            f"{args.base or 'the packaged tables'}: every cell is on the reference GPU"
            f" {base.reference_gpu}, which is never perturbed: nothing to perturb"
        )
    document = dump_truth(truth)
    document["description"] = (
        f"perturbed: each (family, GPU) x lognormal(sigma={args.sigma:g}), seed {args.seed}"
    )
    try:
        Path(args.out).write_text(json.dumps(document, indent=1, allow_nan=False))
    except OSError as exc:
        parser.error(f"-o {args.out}: cannot be written ({exc.strerror or exc})")
    values = sorted(factors.values())
    print(
        f"{args.out}: {len(values)} (family, GPU) pairs perturbed, factors {_factor(values[0])}"
        f" .. {_factor(values[-1])} (median {_factor(values[len(values) // 2])})",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
