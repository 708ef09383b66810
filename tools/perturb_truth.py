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
import sys
from pathlib import Path

from loom.sim.truth import dump_truth, load_truth, perturbed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write a perturbed truth file.")
    parser.add_argument("--base", help="truth file to perturb (default: the packaged tables)")
    parser.add_argument(
        "--sigma", type=float, default=0.3, help="log standard deviation of the factors (0.3)"
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("-o", "--out", required=True, help="where to write the truth file")
    args = parser.parse_args(argv)
    try:
        truth, factors = perturbed(load_truth(args.base), args.sigma, args.seed)
    except ValueError as exc:
        parser.error(str(exc))
    document = dump_truth(truth)
    document["description"] = (
        f"perturbed: each (family, GPU) x lognormal(sigma={args.sigma:g}), seed {args.seed}"
    )
    Path(args.out).write_text(json.dumps(document, indent=1))
    values = sorted(factors.values())
    print(
        f"{args.out}: {len(values)} (family, GPU) pairs perturbed,"
        f" factors {values[0]:.2f} .. {values[-1]:.2f} (median {values[len(values) // 2]:.2f})",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
