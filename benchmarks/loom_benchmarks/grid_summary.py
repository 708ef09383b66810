"""``loom bench grid-summary FILE...``: the evaluation grid's verdict, one line per cell.

Reads the JSON of one or more ``loom bench policies --grid --json`` runs (a grid split by platform
or workload into several runs reads as one) and prints a Markdown table: per cell Loom's mean JCT,
its margin over the best baseline (positive: Loom faster; on each policy's mean JCT over the seeds,
against the baseline best on that mean) and which baseline, the range over the seeds of each
seed's own margin (against *that seed's* best baseline, which may differ from seed to seed: the
overall margin can lie outside this range) and the standard error of those per-seed margins, and,
for a cell with spanning allowed, Loom's spanning penalty against itself with spanning forbidden
(the same jobs, paired over every file's seeds; positive: slower when allowed), and Loom's margin
over compute-only greedy on network-sensitive training (the ``mix``'s class;
:func:`loom_benchmarks.grid.class_margin`). A cell is **flagged** when Loom is
more than ``--threshold`` (3 %) worse than the best baseline, when Loom finished fewer jobs than a
baseline (no mean-JCT margin: the margin on the jobs both finished is shown instead), when its
spanning penalty is above the threshold, or, in a contended cell (:func:`loom_benchmarks.grid.contended`:
load >= 1.0 and jobs queue under greedy; a line without greedy's figures counts by its load alone),
when that class's margin is below ``--class-target`` (25 %).

:func:`summarize` is pure (no I/O): tests call it on hand-made grid results.
"""

import argparse
import json
import math
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

PLATFORM_ORDER: Final = ("small", "medium", "default")
THRESHOLD: Final = 0.03
"""The issue's bound: Loom no more than 3 % worse than the best baseline, or than itself forbidden."""
CLASS_TARGET: Final = 0.25
"""The issue's bound on network-sensitive training against compute-only greedy, contended cells."""


@dataclass(frozen=True)
class CellVerdict:
    """One cell of the grid, judged."""

    cell: str
    seeds: int
    loom_jct_s: float | None
    margin: float | None
    best_baseline: str | None
    margin_min: float | None
    margin_max: float | None
    common_margin: float | None
    common_baseline: str | None
    finished_fewer_than: tuple[str, ...]
    spanning_penalty: float | None
    flags: tuple[str, ...]
    class_margin: float | None = None
    class_margin_min: float | None = None
    class_margin_max: float | None = None
    contended: bool = False
    margin_per_seed_se: float | None = None
    """The standard error of the mean of the per-seed margins (each seed against its own best
    baseline); None under two seeds."""

    def as_dict(self) -> dict[str, Any]:
        """The JSON form (``--json``)."""
        return {
            **self.__dict__,
            "finished_fewer_than": list(self.finished_fewer_than),
            "flags": list(self.flags),
        }


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.1%}"


def _standard_error(values: Sequence[float]) -> float | None:
    """The standard error of the mean of ``values``; None under two."""
    if len(values) < 2:
        return None
    return statistics.stdev(values) / math.sqrt(len(values))


def _penalties(results: Sequence[Mapping[str, Any]]) -> dict[str, float | None]:
    """``platform/load/workload`` -> Loom's paired spanning penalty, from every run's seeds together
    (so a cell with spanning allowed pairs with its forbidden twin run in another file; a
    (cell, seed) in several files keeps its last); a result without seeds gives its own
    ``spanning_penalty``."""
    from loom_benchmarks.grid import spanning_penalty

    found: dict[str, float | None] = {}
    runs: dict[tuple[str, int], Mapping[str, Any]] = {}
    for result in results:
        for item in result.get("spanning_penalty") or []:
            found[str(item["cells"])] = item.get("penalty")
        for run in result.get("seeds") or []:
            runs[(str(run["cell"]), int(run["seed"]))] = run
    for item in spanning_penalty(list(runs.values())):
        found[str(item["cells"])] = item.get("penalty")
    return found


def _order(cell: str) -> tuple[int, int, str, float, str]:
    """Cells by platform (small, medium, default, then others; a sized one, ``medium:120``, after
    its platform, smallest first), workload, load, forbidden first."""
    platform, load, span, workload = cell.split("/")
    base, _, size = platform.partition(":")
    rank = PLATFORM_ORDER.index(base) if base in PLATFORM_ORDER else len(PLATFORM_ORDER)
    sized = int(size) if size.isdigit() else -1
    return (rank, sized, workload, float(load), "" if span == "nospan" else span)


def summarize(
    results: Sequence[Mapping[str, Any]],
    threshold: float = THRESHOLD,
    class_target: float = CLASS_TARGET,
) -> list[CellVerdict]:
    """Every cell of ``results`` (grid JSONs; a cell in several keeps its last, which ``main`` says),
    judged against
    ``threshold``: Loom's margin worse than ``-threshold``, Loom finishing fewer jobs than a
    baseline, or a spanning penalty above ``threshold`` flag the cell; so does, in a contended
    cell (:func:`loom_benchmarks.grid.contended`), a network-sensitive-training margin over greedy
    below ``class_target``."""
    from loom_benchmarks.grid import CONTENDED_LOAD, contended

    lines: dict[str, Mapping[str, Any]] = {}
    for result in results:
        for line in result.get("lines") or []:
            lines[str(line["cell"])] = line
    penalties = _penalties(results)
    verdicts = []
    for cell, line in sorted(lines.items(), key=lambda item: _order(item[0])):
        platform, load, span, workload = cell.split("/")
        per_seed = [m for m in line.get("margin_per_seed") or [] if m is not None]
        penalty = penalties.get(f"{platform}/{load}/{workload}") if span == "span" else None
        fewer = tuple(line.get("loom_finished_fewer") or ())
        m = line.get("margin")
        flags = []
        if m is not None and m < -threshold:
            flags.append(f"loom {-m:.1%} worse than {line.get('best_baseline')}")
        if fewer:
            flags.append(f"loom finished fewer than {', '.join(fewer)}")
        if m is None and not fewer:
            flags.append("no margin")
        if penalty is not None and penalty > threshold:
            flags.append(f"spanning penalty {penalty:+.1%}")
        klass = line.get("class_margin")
        class_seeds = [m for m in line.get("class_margin_per_seed") or [] if m is not None]
        busy = contended(cell, line.get("policies") or {})
        busy = float(load) >= CONTENDED_LOAD if busy is None else busy
        if klass is not None and busy and klass < class_target:
            flags.append(f"net-training {klass:+.1%} vs greedy (< {class_target:.0%})")
        verdicts.append(
            CellVerdict(
                cell=cell,
                seeds=len(line.get("seeds") or []),
                loom_jct_s=(line.get("policies") or {}).get("loom", {}).get("jct_mean_s"),
                margin=m,
                best_baseline=line.get("best_baseline"),
                margin_min=min(per_seed) if per_seed else None,
                margin_max=max(per_seed) if per_seed else None,
                common_margin=line.get("common_margin"),
                common_baseline=line.get("common_best_baseline"),
                finished_fewer_than=fewer,
                spanning_penalty=penalty,
                flags=tuple(flags),
                class_margin=klass,
                class_margin_min=min(class_seeds) if class_seeds else None,
                class_margin_max=max(class_seeds) if class_seeds else None,
                contended=busy,
                margin_per_seed_se=_standard_error(per_seed),
            )
        )
    return verdicts


LEGEND: Final = (
    "Margin vs best baseline (overall): (best - Loom) / best on each policy's mean JCT over the seeds,"
    " against the baseline best on that mean (positive: Loom faster). Per seed (vs that seed's best):"
    " the range of each seed's margin against that seed's own best baseline, which may be another"
    " one, so the overall margin can lie outside this range. Per-seed SE: the standard error of the"
    " mean of the per-seed margins (none under two seeds)."
)
"""The line under the table that says what its margin columns compare."""


def markdown(verdicts: Sequence[CellVerdict], threshold: float = THRESHOLD) -> str:
    """The table: one row per cell, flagged cells marked, then a count."""
    rows = [
        "| cell | seeds | Loom mean JCT | margin vs best baseline (overall) | best baseline | "
        "per seed (vs that seed's best) | per-seed SE | "
        "on jobs both finished (closest baseline) | spanning penalty | "
        "net-training vs greedy (per seed) | flag |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for v in verdicts:
        seeds = "" if v.margin_min is None else f"{_pct(v.margin_min)} .. {_pct(v.margin_max)}"
        se = "" if v.margin_per_seed_se is None else f"±{v.margin_per_seed_se:.1%}"
        common = "" if v.common_margin is None else f"{_pct(v.common_margin)} vs {v.common_baseline}"
        jct = "n/a" if v.loom_jct_s is None else f"{v.loom_jct_s:,.0f} s"
        flag = ("**FLAG**: " + "; ".join(v.flags)) if v.flags else ""
        penalty = "" if v.spanning_penalty is None else _pct(v.spanning_penalty)
        best = v.best_baseline or ""
        klass = (
            ""
            if v.class_margin is None
            else f"{_pct(v.class_margin)} ({_pct(v.class_margin_min)} .. {_pct(v.class_margin_max)})"
            + (" contended" if v.contended else "")
        )
        cells = (v.cell, str(v.seeds), jct, _pct(v.margin), best, seeds, se, common, penalty, klass, flag)
        rows.append("| " + " | ".join(cells) + " |")
    flagged = [v for v in verdicts if v.flags]
    rows.append("")
    rows.append(LEGEND)
    rows.append("")
    rows.append(
        f"{len(verdicts)} cells, {len(flagged)} flagged (threshold {threshold:.0%}): "
        + (", ".join(v.cell for v in flagged) if flagged else "none")
    )
    return "\n".join(rows) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``loom bench grid-summary``'s options."""
    parser.add_argument("files", nargs="+", help="JSON files of `loom bench policies --grid --json` runs")
    parser.add_argument(
        "--threshold", type=float, default=THRESHOLD * 100, help="flag cells worse by more than this %% (3)"
    )
    parser.add_argument(
        "--class-target",
        type=float,
        default=CLASS_TARGET * 100,
        help="flag contended cells where network-sensitive training beats greedy by less than this %% (25)",
    )
    parser.add_argument("--json", action="store_true", help="print the verdicts as JSON, not Markdown")


def main(args: argparse.Namespace) -> int:
    """Read the files, print the table (or ``--json``); 2 on a file that is not a grid's JSON."""
    results = []
    for name in args.files:
        try:
            data = json.loads(Path(name).read_text())
        except (OSError, ValueError) as exc:
            print(f"{name}: {exc}", file=sys.stderr)
            return 2
        if not isinstance(data, dict) or data.get("mode") != "grid":
            print(f"{name}: not the JSON of `loom bench policies --grid --json`", file=sys.stderr)
            return 2
        results.append(data)
    held: dict[str, str] = {}
    for name, data in zip(args.files, results, strict=True):
        for line in data.get("lines") or []:
            cell = str(line.get("cell"))
            if cell in held and held[cell] != name:
                # The last file's run replaces the earlier (a re-run of some cells over an older
                # grid), but it did so silently: the same cell read -9.5 % (flagged) or +0.5 % by the
                # order the files were given in, and nothing said which.
                print(
                    f"note: {cell} is in both {held[cell]} and {name}: {name}'s run is used (the later"
                    " file given; seeds are not merged)",
                    file=sys.stderr,
                )
            held[cell] = name
    threshold = float(args.threshold) / 100.0
    verdicts = summarize(results, threshold, float(args.class_target) / 100.0)
    if args.json:
        print(json.dumps([v.as_dict() for v in verdicts], indent=2))
    else:
        print(markdown(verdicts, threshold), end="")
    return 0
