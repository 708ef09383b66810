"""Usage rows: a finished run metered per part, GPU count and UTC hour, priced; sums and statements.

A row's GPU-milliseconds are ``gpus x (end_ms - start_ms)``, an integer; SCU-seconds are GPU-seconds
times the SCU of one GPU of the row's model for the job's task type and precision; the cost is
SCU-hours times the region's price per SCU-hour at the row's hour (``Economics.price``, the cost
plugin's table: a reference-GPU-hour is one SCU-hour). Because rows never cross an hour, a month
(or any hour-aligned window) is a set of whole rows, and :func:`clip` cuts any other window
exactly (GPU-ms stay integers; cost and SCU scale with the kept milliseconds).
"""

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime

import msgspec

from loom.errors import InvalidInputError
from loom.metering.run import Outcome, RunRecord
from loom.model.family import is_half_precision
from loom.model.profiles import speeds_for_model
from loom.model.scu import UNPROFILED_SPEED

__all__ = [
    "HOUR_MS",
    "Group",
    "PriceFn",
    "ScuFn",
    "Statement",
    "StatementLine",
    "UsageRow",
    "aggregate",
    "clip",
    "gpu_seconds_text",
    "group_key",
    "meter",
    "month_window_ms",
    "scu_of",
    "statement",
]

HOUR_MS = 3_600_000
NO_LABEL = "(none)"
"""The group of rows whose job lacks the label grouped by."""

PriceFn = Callable[[str, float], float]
"""``(region, unix_s) -> price per SCU-hour``: ``Economics.price``."""
ScuFn = Callable[[str, str, dict[str, str]], float]
"""``(gpu_model, task_type, labels) -> SCU of one GPU``: :func:`scu_of` by default."""


class UsageRow(msgspec.Struct, frozen=True, kw_only=True):
    """GPUs of one model on one cluster held by one attempt within one UTC hour."""

    job_id: str
    attempt: int
    seq: int
    """Position of the row among its run's rows (the key is job, attempt, seq)."""
    tenant: str
    labels: dict[str, str]
    cluster: str
    region: str
    gpu_model: str
    start_ms: int
    end_ms: int
    gpus: int
    scu_per_gpu: float
    price_per_scu_hour: float
    outcome: Outcome

    @property
    def gpu_ms(self) -> int:
        """GPU-milliseconds: an exact integer."""
        return self.gpus * (self.end_ms - self.start_ms)

    @property
    def scu_seconds(self) -> float:
        """SCU-seconds delivered (as priced)."""
        return self.gpu_ms * self.scu_per_gpu / 1000.0

    @property
    def cost(self) -> float:
        """SCU-hours times the price per SCU-hour of the row's region and hour."""
        return self.gpu_ms * self.scu_per_gpu * self.price_per_scu_hour / HOUR_MS


def scu_of(gpu_model: str, task_type: str, labels: dict[str, str]) -> float:
    """SCU of one GPU of ``gpu_model`` for a job's task type and precision (labels ``precision``)."""
    speeds = speeds_for_model(gpu_model)
    table = speeds.half_speed if is_half_precision(labels.get("precision", "")) else speeds.speed
    return float(table.get(task_type, UNPROFILED_SPEED))


def _timeline(run: RunRecord, index: int) -> list[tuple[int, int]]:
    """(from_ms, gpus) steps of part ``index``: its placed GPUs, then each resize of its cluster
    (a resize naming no part's cluster applies to the lead part)."""
    part = run.parts[index]
    clusters = {p.cluster for p in run.parts}
    steps = [(run.started_ms or 0, part.gpus)]
    for r in run.resizes:
        if r.cluster == part.cluster or (index == 0 and r.cluster not in clusters):
            steps.append((r.at_ms, r.gpus))
    return steps


def meter(run: RunRecord, price: PriceFn, scu: ScuFn = scu_of) -> list[UsageRow]:
    """The usage rows of a finished run (none before it is complete or when it never ran)."""
    if not run.complete or run.outcome is None:
        return []
    assert run.started_ms is not None and run.ended_ms is not None
    start, end = run.started_ms, max(run.ended_ms, run.started_ms)
    rows: list[UsageRow] = []
    for index, part in enumerate(run.parts):
        steps = _timeline(run, index)
        scu_per_gpu = scu(part.gpu_model, run.task_type, run.labels)
        for k, (step_from, gpus) in enumerate(steps):
            step_to = steps[k + 1][0] if k + 1 < len(steps) else end
            t, stop = max(step_from, start), min(step_to, end)
            while gpus > 0 and t < stop:
                hour_end = min((t // HOUR_MS + 1) * HOUR_MS, stop)
                rows.append(
                    UsageRow(
                        job_id=run.job_id,
                        attempt=run.attempt,
                        seq=len(rows),
                        tenant=run.tenant,
                        labels=dict(run.labels),
                        cluster=part.cluster,
                        region=part.region,
                        gpu_model=part.gpu_model,
                        start_ms=t,
                        end_ms=hour_end,
                        gpus=gpus,
                        scu_per_gpu=scu_per_gpu,
                        price_per_scu_hour=price(part.region, t / 1000.0),
                        outcome=run.outcome,
                    )
                )
                t = hour_end
    return rows


def clip(row: UsageRow, since_ms: int | None, until_ms: int | None) -> UsageRow | None:
    """The part of ``row`` inside ``[since_ms, until_ms)``; None when nothing is."""
    start = row.start_ms if since_ms is None else max(row.start_ms, since_ms)
    end = row.end_ms if until_ms is None else min(row.end_ms, until_ms)
    if end <= start:
        return None
    if (start, end) == (row.start_ms, row.end_ms):
        return row
    return msgspec.structs.replace(row, start_ms=start, end_ms=end)


GROUPINGS = ("tenant", "region", "model", "cluster", "job", "outcome")
"""What usage groups by, besides ``label:<name>``."""


def check_grouping(by: str) -> str:
    """``by`` if usage can be grouped by it; else :class:`InvalidInputError` (also when there is
    nothing to group: a wrong ``--by`` is refused, not answered with an empty table)."""
    if by in GROUPINGS or (by.startswith("label:") and by.removeprefix("label:").strip()):
        return by
    raise InvalidInputError(
        f"cannot group usage by {by!r}: use tenant, label:<name>, region, model, cluster, job or outcome"
    )


def group_key(row: UsageRow, by: str) -> str:
    """The group a row sums into: ``tenant``, ``region``, ``model``, ``cluster``, ``job``,
    ``outcome`` or ``label:<name>`` (``(none)`` for a job without that label)."""
    if by.startswith("label:"):
        return row.labels.get(by.removeprefix("label:"), NO_LABEL)
    fields = {
        "tenant": row.tenant,
        "region": row.region,
        "model": row.gpu_model,
        "cluster": row.cluster,
        "job": row.job_id,
        "outcome": row.outcome,
    }
    return fields[check_grouping(by)]


@dataclass
class Group:
    """Usage summed over rows that share a key."""

    key: str
    gpu_ms: int = 0
    scu_seconds: float = 0.0
    cost: float = 0.0
    runs: set[tuple[str, int]] = field(default_factory=set)
    marked_gpu_ms: dict[str, int] = field(default_factory=dict)
    """GPU-ms of runs that did not complete, by outcome (preempted, failed, requeued, cancelled)."""

    def add(self, row: UsageRow) -> None:
        """Add one row."""
        self.gpu_ms += row.gpu_ms
        self.scu_seconds += row.scu_seconds
        self.cost += row.cost
        self.runs.add((row.job_id, row.attempt))
        if row.outcome != "completed":
            self.marked_gpu_ms[row.outcome] = self.marked_gpu_ms.get(row.outcome, 0) + row.gpu_ms

    def as_dict(self) -> dict[str, object]:
        """JSON form (:func:`usage_fields` and the exact ``gpu_ms``)."""
        return {
            "key": self.key,
            "gpu_ms": self.gpu_ms,
            **usage_fields(
                len(self.runs),
                self.gpu_ms,
                self.scu_seconds,
                self.cost,
                preempted_gpu_ms=self.marked_gpu_ms.get("preempted", 0),
                failed_gpu_ms=self.marked_gpu_ms.get("failed", 0),
            ),
        }


USAGE_FIELDS = (
    "runs",
    "gpu_seconds",
    "gpu_hours",
    "scu_seconds",
    "scu_hours",
    "cost",
    "preempted_gpu_ms",
    "failed_gpu_ms",
)
"""The columns of a usage group in every export (``loom usage --csv`` / ``--json``, the console's
``/usage.csv``), after its key."""


def usage_fields(
    runs: int, gpu_ms: int, scu_seconds: float, cost: float, *, preempted_gpu_ms: int, failed_gpu_ms: int
) -> dict[str, object]:
    """One group's :data:`USAGE_FIELDS`: exact GPU-seconds as text, hours and cost rounded to 1e-6."""
    return {
        "runs": runs,
        "gpu_seconds": gpu_seconds_text(gpu_ms),
        "gpu_hours": round(gpu_ms / 3_600_000, 6),
        "scu_seconds": round(scu_seconds, 3),
        "scu_hours": round(scu_seconds / 3600, 6),
        "cost": round(cost, 6),
        "preempted_gpu_ms": preempted_gpu_ms,
        "failed_gpu_ms": failed_gpu_ms,
    }


def gpu_seconds_text(gpu_ms: int) -> str:
    """GPU-milliseconds as exact seconds (``12.345``)."""
    sign = "-" if gpu_ms < 0 else ""
    whole, frac = divmod(abs(gpu_ms), 1000)
    return f"{sign}{whole}.{frac:03d}"


def aggregate(
    rows: Iterable[UsageRow],
    by: str = "tenant",
    *,
    since_ms: int | None = None,
    until_ms: int | None = None,
) -> list[Group]:
    """Rows clipped to ``[since_ms, until_ms)`` and summed by ``by`` (see :func:`group_key`),
    sorted by key."""
    check_grouping(by)
    if since_ms is not None and until_ms is not None and until_ms <= since_ms:
        raise InvalidInputError("the usage window is empty or inverted: --until must be after --since")
    groups: dict[str, Group] = {}
    for row in rows:
        kept = clip(row, since_ms, until_ms)
        if kept is None:
            continue
        key = group_key(kept, by)
        groups.setdefault(key, Group(key)).add(kept)
    return [groups[k] for k in sorted(groups)]


_MONTH = re.compile(r"^(\d{4})-(\d{2})$")


def month_window_ms(month: str) -> tuple[int, int]:
    """``YYYY-MM`` -> [first ms of the month, first ms of the next) in UTC."""
    match = _MONTH.match(month)
    if not match or not 1 <= int(match.group(2)) <= 12:
        raise InvalidInputError(f"month {month!r} is not YYYY-MM")
    year, mon = int(match.group(1)), int(match.group(2))
    if not 1970 <= year <= 9998:  # datetime's years, and none before metering could have been
        raise InvalidInputError(f"month {month!r}: the year must be within 1970-9998")
    start = datetime(year, mon, 1, tzinfo=UTC)
    end = datetime(year + (mon == 12), mon % 12 + 1, 1, tzinfo=UTC)
    return int(start.timestamp()) * 1000, int(end.timestamp()) * 1000


@dataclass
class StatementLine:
    """A statement's line: one project, team, region and GPU model."""

    project: str
    team: str
    region: str
    gpu_model: str
    usage: Group


@dataclass
class Statement:
    """What a tenant used in one month, line by line, and the totals."""

    tenant: str
    month: str
    lines: list[StatementLine]
    total: Group

    def as_dict(self) -> dict[str, object]:
        """JSON form."""
        return {
            "tenant": self.tenant,
            "month": self.month,
            "lines": [
                {"project": ln.project, "team": ln.team, "region": ln.region, "gpu_model": ln.gpu_model}
                | ln.usage.as_dict()
                for ln in self.lines
            ],
            "total": self.total.as_dict(),
        }


def statement(rows: Iterable[UsageRow], tenant: str, month: str) -> Statement:
    """Tenant ``tenant``'s usage in ``month`` (``YYYY-MM``, UTC) by project, team, region and model."""
    since, until = month_window_ms(month)
    lines: dict[tuple[str, str, str, str], StatementLine] = {}
    total = Group("total")
    for row in rows:
        kept = clip(row, since, until) if row.tenant == tenant else None
        if kept is None:
            continue
        key = (
            kept.labels.get("project", NO_LABEL),
            kept.labels.get("team", NO_LABEL),
            kept.region,
            kept.gpu_model,
        )
        if key not in lines:
            lines[key] = StatementLine(*key, usage=Group("/".join(key)))
        lines[key].usage.add(kept)
        total.add(kept)
    return Statement(tenant, month, [lines[k] for k in sorted(lines)], total)
