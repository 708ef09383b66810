"""The policy report: PNG plots and a Markdown page that links them, from simulation results.

:func:`write_report` writes, into one folder, always under the same names (:data:`PLOTS`):

- ``jct_cdf.png``: the distribution of job completion times per policy (log time axis);
- ``gpu_utilisation.png``: the share of GPUs in use over simulated time per policy;
- ``cross_region_bytes.png``: bytes moved between regions in total, a bar per policy;
- ``cross_region_cumulative.png``: the same bytes accumulating over simulated time;
- ``jct_by_class.png``: mean JCT per job class, a bar per policy in each class;
- ``summary.json``: the summaries, comparison and claims the page shows;
- ``report.md``: the context, the claims with their numbers, the summary tables and the plots.

Plots are drawn with matplotlib's object API on the Agg canvas (no pyplot, no display, no global
backend switched), so a report can be written from a test or a headless machine.
:func:`check_report_folder` tells beforehand whether a folder can take the report, so that a
caller refuses a bad one before a long simulation rather than after it.
"""

import json
import math
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from loom.errors import InvalidInputError
from loom.sim import metrics
from loom.sim.model import SimResult

PLOTS: Final = {
    "jct_cdf": "jct_cdf.png",
    "gpu_utilisation": "gpu_utilisation.png",
    "cross_region_bytes": "cross_region_bytes.png",
    "cross_region_cumulative": "cross_region_cumulative.png",
    "jct_by_class": "jct_by_class.png",
}
"""Plot key -> file name inside the report folder."""
REPORT_NAME: Final = "report.md"
SUMMARY_NAME: Final = "summary.json"

_PLOT_TITLES: Final = {
    "jct_cdf": "Job completion time, CDF per policy",
    "gpu_utilisation": "GPU utilisation over time",
    "cross_region_bytes": "Cross-region traffic per policy",
    "cross_region_cumulative": "Cross-region traffic over time",
    "jct_by_class": "Mean JCT by job class",
}
_DPI: Final = 110
_TIME_UNITS: Final = (("d", 86_400.0), ("h", 3_600.0), ("min", 60.0), ("s", 1.0))
_BYTE_UNITS: Final = (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3), ("B", 1.0))


# ---- formatting (shared with the benchmark's table) -------------------------------------------


def time_unit(largest_s: float) -> tuple[str, float]:
    """The largest unit (name, seconds) in which ``largest_s`` reads as at least 1 (else seconds)."""
    for name, size in _TIME_UNITS:
        if largest_s >= size:
            return name, size
    return "s", 1.0


def fmt_duration(seconds: float | None) -> str:
    """``5400`` -> ``"1.5 h"``; None -> ``""``."""
    if seconds is None:
        return ""
    name, size = time_unit(abs(seconds))
    return f"{seconds / size:.3g} {name}"


def fmt_bytes(count: float | None) -> str:
    """``2.5e12`` -> ``"2.5 TB"`` (decimal units); None -> ``""``."""
    if count is None:
        return ""
    for name, size in _BYTE_UNITS:
        if abs(count) >= size:
            return f"{count / size:.3g} {name}"
    return "0 B"


def fmt_share(value: float | None, *, signed: bool = False) -> str:
    """``0.253`` -> ``"25.3 %"`` (``"+25.3 %"`` when signed); None -> ``""``."""
    if value is None:
        return ""
    return f"{value * 100:+.1f} %" if signed else f"{value * 100:.1f} %"


def fmt_number(value: float | None, digits: int = 2) -> str:
    """A plain number with thousands separators; None -> ``""``."""
    return "" if value is None else f"{value:,.{digits}f}"


Column = tuple[str, str, Callable[[Any], str]]
"""A table column: header, key of a summary's ``overall``, and how its value is written."""


SUMMARY_COLUMNS: Final[tuple[Column, ...]] = (
    ("jobs", "jobs", lambda v: f"{v:,}"),
    ("finished", "finished", lambda v: f"{v:,}"),
    ("rejected", "rejected", lambda v: f"{v:,}"),
    ("unfinished", "unfinished", lambda v: f"{v:,}"),
    ("mean JCT", "jct_mean_s", fmt_duration),
    ("p50 JCT", "jct_p50_s", fmt_duration),
    ("p99 JCT", "jct_p99_s", fmt_duration),
    ("mean queue", "queue_mean_s", fmt_duration),
    ("p99 queue", "queue_p99_s", fmt_duration),
    ("makespan", "makespan_s", fmt_duration),
    ("GPU util", "gpu_utilisation_mean", fmt_share),
    ("SCU-h", "scu_hours", lambda v: fmt_number(v, 1)),
    ("cost $", "cost", fmt_number),
    ("cross-region", "cross_region_bytes", fmt_bytes),
)
"""(header, key of a summary's ``overall``, format) of the summary table, policies as rows."""


def summary_rows(
    summaries: Sequence[Mapping[str, Any]], columns: Sequence[Column] = SUMMARY_COLUMNS
) -> list[list[str]]:
    """A summary table's cells: the policy, then each column's figure ("" where there is none)."""
    rows = []
    for s in summaries:
        overall = s["overall"]
        cells = [fmt(overall[key]) if overall.get(key) is not None else "" for _, key, fmt in columns]
        rows.append([str(s["policy"]), *cells])
    return rows


# ---- plots ------------------------------------------------------------------------------------


def _figure(width_in: float = 8.0, height_in: float = 4.5) -> tuple[Figure, Axes]:
    fig = Figure(figsize=(width_in, height_in), dpi=_DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def _save(fig: Figure, path: Path) -> None:
    # No software/date metadata, so the same results give the same bytes.
    fig.savefig(path, format="png", metadata={"Software": None})


def _colours(policies: Sequence[str]) -> dict[str, Any]:
    """A stable colour per policy: tab10 in result order."""
    cmap = colormaps["tab10"]
    return {p: cmap(i % 10) for i, p in enumerate(policies)}


def _empty(ax: Axes, what: str) -> None:
    ax.text(0.5, 0.5, what, ha="center", va="center", transform=ax.transAxes)


def plot_jct_cdf(results: Sequence[SimResult], path: Path) -> None:
    """Empirical CDF of JCT per policy, log time axis (finished jobs only)."""
    fig, ax = _figure()
    colours = _colours([r.policy for r in results])
    all_jcts = {r.policy: sorted(metrics.jcts(r.records)) for r in results}
    largest = max((v[-1] for v in all_jcts.values() if v), default=0.0)
    unit, size = time_unit(largest)
    positive = [x for v in all_jcts.values() for x in v if x > 0]
    floor = min(positive) / size if positive else 1.0
    drawn = False
    for policy, values in all_jcts.items():
        if not values:
            continue
        xs = [max(v / size, floor) for v in values]
        ys = [(i + 1) / len(values) for i in range(len(values))]
        ax.step(xs, ys, where="post", label=f"{policy} ({len(values):,})", color=colours[policy])
        drawn = True
    if drawn:
        ax.set_xscale("log")
        ax.legend(loc="lower right", fontsize="small")
    else:
        _empty(ax, "no job finished")
    ax.set_xlabel(f"job completion time ({unit}, log)")
    ax.set_ylabel("share of finished jobs")
    ax.set_ylim(0.0, 1.02)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title(_PLOT_TITLES["jct_cdf"])
    _save(fig, path)


def _span(results: Sequence[SimResult]) -> tuple[float, str, float]:
    """(start time, unit, unit size) of the timelines' x axis."""
    times = [s.t_s for r in results for s in r.timeline]
    if not times:
        return 0.0, "s", 1.0
    start = min(times)
    unit, size = time_unit(max(times) - start)
    return start, unit, size


def plot_utilisation(results: Sequence[SimResult], path: Path) -> None:
    """Share of GPUs in use over simulated time, one step line per policy."""
    fig, ax = _figure()
    colours = _colours([r.policy for r in results])
    start, unit, size = _span(results)
    drawn = False
    for r in results:
        times, shares = metrics.utilisation_series(r.timeline)
        if not times:
            continue
        mean = metrics.mean_utilisation(r.timeline)
        ax.step(
            [(t - start) / size for t in times],
            [100 * s for s in shares],
            where="post",
            label=f"{r.policy} (mean {fmt_share(mean)})",
            color=colours[r.policy],
            linewidth=1.0,
        )
        drawn = True
    if drawn:
        ax.legend(loc="best", fontsize="small")
    else:
        _empty(ax, "no timeline")
    ax.set_xlabel(f"simulated time ({unit})")
    ax.set_ylabel("GPUs in use (%)")
    ax.set_ylim(0.0, 102.0)
    ax.grid(True, alpha=0.3)
    ax.set_title(_PLOT_TITLES["gpu_utilisation"])
    _save(fig, path)


def _byte_unit(largest: float) -> tuple[str, float]:
    for name, size in _BYTE_UNITS:
        if largest >= size:
            return name, size
    return "B", 1.0


def plot_cross_region_bytes(results: Sequence[SimResult], path: Path) -> None:
    """Total bytes moved between regions, a bar per policy."""
    fig, ax = _figure()
    colours = _colours([r.policy for r in results])
    totals = [sum(rec.cross_region_bytes for rec in r.records) for r in results]
    unit, size = _byte_unit(max(totals, default=0.0))
    names = [r.policy for r in results]
    bars = ax.bar(names, [t / size for t in totals], color=[colours[n] for n in names])
    ax.bar_label(bars, labels=[fmt_bytes(t) for t in totals], fontsize="small")
    ax.set_ylabel(f"cross-region bytes ({unit})")
    ax.tick_params(axis="x", labelrotation=20)
    ax.grid(True, axis="y", alpha=0.3)
    ax.set_title(_PLOT_TITLES["cross_region_bytes"])
    _save(fig, path)


def plot_cross_region_cumulative(results: Sequence[SimResult], path: Path) -> None:
    """Cross-region bytes moved so far, over simulated time, per policy."""
    fig, ax = _figure()
    colours = _colours([r.policy for r in results])
    start, unit, size = _span(results)
    largest = max((s.cross_region_bytes for r in results for s in r.timeline), default=0.0)
    bunit, bsize = _byte_unit(largest)
    drawn = False
    for r in results:
        ordered = sorted(r.timeline, key=lambda s: s.t_s)
        if not ordered:
            continue
        ax.step(
            [(s.t_s - start) / size for s in ordered],
            [s.cross_region_bytes / bsize for s in ordered],
            where="post",
            label=r.policy,
            color=colours[r.policy],
        )
        drawn = True
    if drawn:
        ax.legend(loc="upper left", fontsize="small")
    else:
        _empty(ax, "no timeline")
    ax.set_xlabel(f"simulated time ({unit})")
    ax.set_ylabel(f"cross-region bytes so far ({bunit})")
    ax.grid(True, alpha=0.3)
    ax.set_title(_PLOT_TITLES["cross_region_cumulative"])
    _save(fig, path)


def plot_jct_by_class(summaries: Sequence[Mapping[str, Any]], path: Path) -> None:
    """Mean JCT per job class: classes along x, a bar per policy within each."""
    fig, ax = _figure(9.0, 4.5)
    policies = [str(s["policy"]) for s in summaries]
    colours = _colours(policies)
    classes: list[str] = []
    for s in summaries:
        classes.extend(c for c in s["by_class"] if c not in classes)
    means = {
        p: [s["by_class"].get(c, {}).get("jct_mean_s") for c in classes]
        for p, s in zip(policies, summaries, strict=True)
    }
    largest = max((m for ms in means.values() for m in ms if m is not None), default=0.0)
    unit, size = time_unit(largest)
    width = 0.8 / max(len(policies), 1)
    for i, p in enumerate(policies):
        xs = [k - 0.4 + width * (i + 0.5) for k in range(len(classes))]
        ax.bar(
            xs,
            [0.0 if m is None else m / size for m in means[p]],
            width=width,
            label=p,
            color=colours[p],
        )
    if classes:
        ax.set_xticks(range(len(classes)), classes)
        ax.legend(loc="best", fontsize="small", ncols=min(len(policies), 4))
    else:
        _empty(ax, "no job finished")
    ax.set_ylabel(f"mean JCT ({unit})")
    ax.grid(True, axis="y", alpha=0.3)
    ax.set_title(_PLOT_TITLES["jct_by_class"])
    _save(fig, path)


# ---- the page ---------------------------------------------------------------------------------


def _md_table(headers: Sequence[str], rows: Sequence[Sequence[str]], right_from: int = 1) -> list[str]:
    align = ["---" if i < right_from else "---:" for i in range(len(headers))]
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(align) + " |"]
    lines.extend("| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows)
    return lines


def _verdict(passed: bool | None) -> str:
    return "not run" if passed is None else ("**pass**" if passed else "**FAIL**")


def _claims_section(claims: Mapping[str, Any] | None) -> list[str]:
    lines = ["## Claims", ""]
    if not claims:
        return [*lines, "No claim was checked on this workload.", ""]
    for name, check in claims.get("checks", {}).items():
        lines.append(f"### {name}: {_verdict(check.get('passed'))}")
        lines.append("")
        lines.append(f"Claim: {check.get('claim', name)}.")
        lines.append("")
        if check.get("passed") is None:
            lines.extend([f"Not checked: {check.get('reason', '')}.", ""])
            continue
        if "classes" in check:
            rows = [
                [
                    c,
                    fmt_duration(v["target_jct_mean_s"]),
                    fmt_duration(v["baseline_jct_mean_s"]),
                    f"{v['paired_jobs']:,}",
                    fmt_share(v["improvement"], signed=True),
                    f">= {fmt_share(v['required'], signed=True)}",
                    "pass" if v["passed"] else "FAIL",
                ]
                for c, v in check["classes"].items()
            ]
            lines.extend(
                _md_table(
                    [
                        "class",
                        f"{check['target']} mean JCT",
                        f"{check['baseline']} mean JCT",
                        "paired jobs",
                        "improvement",
                        "required",
                        "",
                    ],
                    rows,
                )
            )
            lines.append("")
            lines.append("Mean JCT over the jobs that finished under both policies; improvement is")
            lines.append("(baseline - target) / baseline.")
        if "time_improvement" in check:
            t, c, f = check["total_time_s"], check["cost"], check["finished"]
            rows = [
                [
                    "total time (makespan)",
                    fmt_duration(t["target"]),
                    fmt_duration(t["baseline"]),
                    fmt_share(check["time_improvement"], signed=True),
                    f"> {fmt_share(check['required']['time'])}",
                ],
                [
                    "cost $",
                    fmt_number(c["target"]),
                    fmt_number(c["baseline"]),
                    fmt_share(check["cost_improvement"], signed=True),
                    f"> {fmt_share(check['required']['cost'])}",
                ],
                ["jobs finished", f"{f['target']:,}", f"{f['baseline']:,}", "", f"all {f['jobs']:,}"],
            ]
            lines.extend(_md_table(["", check["target"], check["baseline"], "improvement", "required"], rows))
        lines.append("")
    return lines


def _comparison_section(comparison: Mapping[str, Any] | None) -> list[str]:
    if not comparison:
        return []
    target = comparison["target"]
    lines = [
        f"## {target} against each policy",
        "",
        f"Improvement of {target}: (other - {target}) / other; positive means {target} is lower (better).",
        "",
    ]
    keys = (
        ("mean JCT (paired)", "jct_mean_paired"),
        ("p99 JCT", "jct_p99_s"),
        ("mean queue", "queue_mean_s"),
        ("makespan", "makespan_s"),
        ("cost", "cost"),
        ("cross-region bytes", "cross_region_bytes"),
    )
    rows = [
        [name, *(fmt_share(v["overall"].get(k), signed=True) for _, k in keys)]
        for name, v in comparison["vs"].items()
    ]
    lines.extend(_md_table(["policy", *(h for h, _ in keys)], rows))
    lines.append("")
    return lines


def _class_table(summaries: Sequence[Mapping[str, Any]]) -> list[str]:
    classes: list[str] = []
    for s in summaries:
        classes.extend(c for c in s["by_class"] if c not in classes)
    if not classes:
        return []
    rows = [
        [
            str(s["policy"]),
            *(fmt_duration(s["by_class"].get(c, {}).get("jct_mean_s")) for c in classes),
        ]
        for s in summaries
    ]
    counts = [
        "jobs",
        *(f"{max(s['by_class'].get(c, {}).get('jobs', 0) for s in summaries):,}" for c in classes),
    ]
    return ["## Mean JCT by job class", "", *_md_table(["policy", *classes], [counts, *rows]), ""]


def _rejected_section(summaries: Sequence[Mapping[str, Any]]) -> list[str]:
    """Why jobs were rejected, per policy (the most frequent reasons), and what unfinished means."""
    lines: list[str] = []
    for s in summaries:
        reasons = (s.get("overall") or {}).get("rejected_reasons") or {}
        if reasons:
            lines.append(f"Rejected by {s['policy']}:")
            lines.extend(f"- {n:,} x {why}" for why, n in reasons.items())
            lines.append("")
    if any((s.get("overall") or {}).get("unfinished") for s in summaries):
        lines.extend(
            [
                "Unfinished: jobs still queued or running when the run ended (e.g. asking for GPU models",
                "the platform does not have, or too many GPUs for what is free).",
                "",
            ]
        )
    return lines


def _belief_section(summaries: Sequence[Mapping[str, Any]]) -> list[str]:
    """Belief error next to the outcomes: per policy, and per GPU model."""
    errors = [(str(s["policy"]), s.get("belief_error") or {}) for s in summaries]
    if not any(e.get("jobs") for _, e in errors):
        return []
    lines = [
        "## Belief error (predicted vs true step time)",
        "",
        "|predicted / true - 1| of each job's step time where it last ran: what the scheduler expected",
        "(profiles and what it had learned) against what the simulator's truth gave. Bias: geometric",
        "mean of predicted / true (below 1: steps slower than expected).",
        "",
    ]
    rows = [
        [
            name,
            f"{e.get('jobs', 0):,}",
            str(e.get("timed_by") or "-"),
            fmt_share(e.get("median")),
            fmt_share(e.get("p90")),
            fmt_number(e.get("bias"), 3),
            fmt_share(e.get("derived_share")),
        ]
        for name, e in errors
    ]
    lines.extend(_md_table(["policy", "jobs", "timed by", "median", "p90", "bias", "truth derived"], rows))
    models = sorted({m for _, e in errors for m in e.get("by_gpu_model", {})})
    if models:
        lines.extend(["", "Median error by GPU model (jobs):", ""])
        by_model = [
            [
                name,
                *(
                    f"{fmt_share(g['median'])} ({g['jobs']:,})"
                    if (g := e.get("by_gpu_model", {}).get(m))
                    else "-"
                    for m in models
                ),
            ]
            for name, e in errors
        ]
        lines.extend(_md_table(["policy", *models], by_model))
    rules = [(name, e.get("truth_rules") or {}) for name, e in errors]
    if any(r for _, r in rules):
        lines.extend(["", "How the truth timed each policy's jobs (`loom.sim.truth` rules; jobs):", ""])
        lines.extend(f"- {name}: " + ", ".join(f"{k} {v:,}" for k, v in r.items()) for name, r in rules if r)
    lines.append("")
    return lines


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


class ReportFolderError(InvalidInputError):
    """A report folder that cannot be written: a file stands at its path or on the way to it, or
    the place it would be made in refuses writing."""


def check_report_folder(out_dir: str | Path) -> None:
    """:class:`ReportFolderError` unless :func:`write_report` could write into ``out_dir``: it is
    a folder, or could be made where its nearest existing parent is (a folder), and that place
    accepts a new entry. Tried with a temporary folder, removed again: nothing is left behind."""
    out = Path(out_dir)
    existing = out
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        what = "exists and is not a folder" if existing == out else f"{existing} is not a folder"
        raise ReportFolderError(f"report folder {out}: {what}")
    try:
        tempfile.TemporaryDirectory(dir=existing).cleanup()
    except OSError as exc:
        raise ReportFolderError(
            f"report folder {out}: cannot write in {existing}: {exc.strerror or exc}"
        ) from None


def write_report(
    results: Sequence[SimResult],
    out_dir: str | Path,
    *,
    title: str,
    context: Mapping[str, object] | None = None,
    claims: Mapping[str, Any] | None = None,
    comparison: Mapping[str, Any] | None = None,
) -> Path:
    """Write every plot of :data:`PLOTS`, ``summary.json`` and ``report.md`` into ``out_dir``
    (created if missing; files of an earlier report there are replaced); return the page's path.

    ``context`` (workload, topology, seed, …) is listed at the top; ``claims`` is
    :func:`loom.sim.metrics.check_claims`'s answer and ``comparison`` :func:`~loom.sim.metrics.compare`'s.
    """
    if not results:
        raise ValueError("a report needs at least one policy's result")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summaries = [metrics.summarize(r) for r in results]
    plot_jct_cdf(results, out / PLOTS["jct_cdf"])
    plot_utilisation(results, out / PLOTS["gpu_utilisation"])
    plot_cross_region_bytes(results, out / PLOTS["cross_region_bytes"])
    plot_cross_region_cumulative(results, out / PLOTS["cross_region_cumulative"])
    plot_jct_by_class(summaries, out / PLOTS["jct_by_class"])
    (out / SUMMARY_NAME).write_text(
        json.dumps(
            _json_safe(
                {
                    "title": title,
                    "context": dict(context or {}),
                    "summaries": summaries,
                    "comparison": comparison,
                    "claims": claims,
                }
            ),
            indent=2,
            default=str,
        )
        + "\n"
    )
    lines = [f"# {title}", ""]
    if context:
        lines.extend(f"- **{key}**: {value}" for key, value in context.items())
        lines.append("")
    lines.extend(_claims_section(claims))
    lines.extend(["## Summary", ""])
    lines.extend(_md_table(["policy", *(h for h, _, _ in SUMMARY_COLUMNS)], summary_rows(summaries)))
    lines.extend(
        [
            "",
            "JCT: arrival to end, finished jobs only (rejected and unfinished jobs counted apart);",
            "queue: arrival to first start; GPU util: time-weighted share of GPUs in use; percentiles",
            "interpolate linearly.",
            "",
        ]
    )
    lines.extend(_rejected_section(summaries))
    lines.extend(_class_table(summaries))
    lines.extend(_belief_section(summaries))
    lines.extend(_comparison_section(comparison))
    lines.extend(["## Plots", ""])
    for key, name in PLOTS.items():
        lines.extend([f"### {_PLOT_TITLES[key]}", "", f"![{_PLOT_TITLES[key]}]({name})", ""])
    lines.append(f"Figures as JSON: [{SUMMARY_NAME}]({SUMMARY_NAME}).")
    page = out / REPORT_NAME
    page.write_text("\n".join(lines) + "\n")
    return page
