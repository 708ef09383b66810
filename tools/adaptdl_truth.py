"""Write a Loom truth file from AdaptDL / Pollux / Sia throughput profiles (never used to fit Loom).

The simulator then times jobs by what those schedulers' authors measured on their clusters (T4,
V100, A100 40 GB, Quadro RTX 6000, RTX 2080 Ti), while Loom schedules with its profiles and what
it learns::

    git clone https://github.com/siasosp23/artifacts /tmp/sia
    .venv/bin/python tools/adaptdl_truth.py /tmp/sia/sia-simulator/traces /tmp/sia/adaptdl/sched/traces \\
        -o /tmp/truth-sia.json
    .venv/bin/loom bench contention --truth /tmp/truth-sia.json --json
    .venv/bin/loom bench policies --grid --truth /tmp/truth-sia.json --json

Layout and rules: :mod:`loom_benchmarks.scu_outside`.
"""

import argparse
import json
import sys
from pathlib import Path

from loom.sim.truth import TruthError, parse_truth
from loom_benchmarks.scu_outside import OutsideDataError, truth_document


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write a Loom truth file from AdaptDL/Pollux/Sia profiles.")
    parser.add_argument("folders", nargs="+", type=Path, help="DIR/<model>/placements-<cluster>.csv trees")
    parser.add_argument("-o", "--out", required=True, type=Path, help="where to write the truth file")
    args = parser.parse_args(argv)
    if args.out.exists():
        print(f"{args.out}: exists; not overwritten", file=sys.stderr)
        return 2
    try:
        document = truth_document(args.folders)
        parse_truth(document, str(args.out))  # the file must load as the simulator reads it
    except (OutsideDataError, TruthError) as exc:
        print(exc, file=sys.stderr)
        return 2
    args.out.write_text(json.dumps(document, indent=1) + "\n")
    families = sorted(document["families"])
    print(
        f"{args.out}: {len(document['cells'])} cells, families {', '.join(families)}; "
        f"GPUs {', '.join(sorted({c['gpu_model'] for c in document['cells']}))}"
        + (f"; skipped {len(document['skipped'])} file(s)" if document["skipped"] else ""),
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
