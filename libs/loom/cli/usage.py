"""``loom usage`` and ``loom usage statement``: metered usage by tenant, label, region or model.

Reads the usage rows the metrics service metered (:mod:`loom.store.usage`) from PostgreSQL and sums
them with the pure core (:mod:`loom.metering.usage`). GPU-seconds are exact (whole milliseconds);
cost is SCU-hours times the region's price per SCU-hour at each hour.

    loom usage                                  # by tenant, all time
    loom usage --by label:team --tenant acme    # one tenant's teams
    loom usage --by region --since 2026-12-01 --until 2026-12-02 --csv
    loom usage statement --tenant acme --month 2026-12
    loom usage reconcile                        # usage == GPUs x duration of placement's run records?
"""

import argparse
import asyncio
import csv
import json
import sys
from datetime import UTC, datetime
from typing import Any

import asyncpg
from rich.table import Table

from loom.bus.dlq import parse_since
from loom.cli.output import console, err
from loom.errors import InvalidInputError
from loom.metering.usage import (
    USAGE_FIELDS,
    Group,
    aggregate,
    check_grouping,
    gpu_seconds_text,
    month_window_ms,
    statement,
)
from loom.runtime.config import endpoints
from loom.store import usage as usage_store


def add_parser(sub: Any) -> None:
    """Register ``loom usage`` (and ``statement``, ``reconcile``) on the top-level subparsers."""
    p = sub.add_parser(
        "usage",
        help="metered GPU usage and charges by tenant, label, region or model",
        description="metered GPU usage and charges by tenant, label, region or model",
    )
    p.set_defaults(fn=cmd_usage)
    p.add_argument("--tenant", help="only this tenant's usage")
    p.add_argument(
        "--by",
        default="tenant",
        help="tenant, label:<name> (label:team, label:project), region, model, cluster, job or outcome",
    )
    p.add_argument("--since", help="from: an ISO time (UTC unless it says) or a duration back (2h, 1d)")
    p.add_argument("--until", help="until (exclusive): an ISO time or a duration back")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--csv", action="store_true", help="CSV on stdout")
    out.add_argument("--json", action="store_true")
    usage_sub = p.add_subparsers(dest="usage_command")
    s = usage_sub.add_parser(
        "statement", help="a tenant's monthly statement", description="a tenant's monthly statement"
    )
    s.set_defaults(fn=cmd_statement)
    s.add_argument("--tenant", required=True)
    s.add_argument("--month", required=True, help="YYYY-MM (UTC)")
    s.add_argument("--json", action="store_true")
    r = usage_sub.add_parser(
        "reconcile",
        help="check usage against placement's run records (exit 1 on any difference)",
        description="check the usage rows, run by run, against GPUs x duration computed from placement's"
        " job history (exit 1 on any difference)",
    )
    r.set_defaults(fn=cmd_reconcile)
    r.add_argument("--json", action="store_true")


def _ms(text: str | None) -> int | None:
    if text is None:
        return None
    moment = parse_since(text)  # InvalidInputError: what it cannot read and what it takes
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return round(moment.timestamp() * 1000)


async def _connect() -> asyncpg.Connection:
    url = endpoints().database_url
    try:
        return await asyncpg.connect(url, timeout=5)
    except (OSError, TimeoutError) as exc:
        raise RuntimeError(
            f"no PostgreSQL answered at {url} ({exc}); start the stack with `loom up`"
        ) from exc


def cmd_usage(args: argparse.Namespace) -> int:
    """``loom usage``."""
    try:
        # Bad input is refused before connecting, with exit status 2.
        check_grouping(args.by)
        since_ms, until_ms = _ms(args.since), _ms(args.until)
        if since_ms is not None and until_ms is not None and until_ms <= since_ms:
            raise InvalidInputError(
                f"inverted or empty range: --until ({args.until}) must be after --since ({args.since})"
            )

        async def go() -> list[Group]:
            conn = await _connect()
            try:
                if args.tenant:  # row-level security too, not only the WHERE
                    rows = await usage_store.read_tenant_rows(
                        conn, args.tenant, since_ms=since_ms, until_ms=until_ms
                    )
                else:
                    rows = await usage_store.read_rows(conn, since_ms=since_ms, until_ms=until_ms)
            finally:
                await conn.close()
            return aggregate(rows, args.by, since_ms=since_ms, until_ms=until_ms)

        groups = asyncio.run(go())
    except InvalidInputError as exc:
        err.print(f"[red]error:[/red] {exc}")
        return 2
    except (RuntimeError, OSError, asyncpg.PostgresError) as exc:
        err.print(f"[red]error:[/red] {exc}")
        return 1
    records = [g.as_dict() for g in groups]
    if args.csv:
        # The console's /usage.csv has the same columns.
        writer = csv.DictWriter(sys.stdout, fieldnames=[args.by.replace(":", "_"), *USAGE_FIELDS])
        writer.writeheader()
        for rec in records:
            writer.writerow({args.by.replace(":", "_"): rec["key"], **{c: rec[c] for c in USAGE_FIELDS}})
        return 0
    if args.json:
        print(json.dumps({"by": args.by, "groups": records}, indent=2))
        return 0
    table = Table(title=f"usage by {args.by}" + (f" (tenant {args.tenant})" if args.tenant else ""))
    for col in (args.by, "runs", "GPU-s", "SCU-s", "cost", "preempted GPU-s", "failed GPU-s"):
        table.add_column(col, justify="left" if col == args.by else "right")
    for rec in records:
        table.add_row(
            str(rec["key"]),
            str(rec["runs"]),
            str(rec["gpu_seconds"]),
            f"{rec['scu_seconds']:.1f}",
            f"{rec['cost']:.4f}",
            gpu_seconds_text(int(str(rec["preempted_gpu_ms"]))),
            gpu_seconds_text(int(str(rec["failed_gpu_ms"]))),
        )
    console.print(table)
    return 0


def cmd_statement(args: argparse.Namespace) -> int:
    """``loom usage statement --tenant T --month YYYY-MM``."""
    try:
        since_ms, until_ms = month_window_ms(args.month)

        async def go() -> Any:
            conn = await _connect()
            try:
                rows = await usage_store.read_tenant_rows(
                    conn, args.tenant, since_ms=since_ms, until_ms=until_ms
                )
            finally:
                await conn.close()
            return statement(rows, args.tenant, args.month)

        result = asyncio.run(go())
    except InvalidInputError as exc:  # a month not YYYY-MM: refused before connecting
        err.print(f"[red]error:[/red] {exc}")
        return 2
    except (RuntimeError, OSError, asyncpg.PostgresError) as exc:
        err.print(f"[red]error:[/red] {exc}")
        return 1
    if args.json:
        print(json.dumps(result.as_dict(), indent=2))
        return 0
    table = Table(title=f"statement: tenant {args.tenant}, {args.month} (UTC)")
    for col in ("project", "team", "region", "GPU model", "runs", "GPU-h", "SCU-h", "cost"):
        table.add_column(col, justify="right" if col in ("runs", "GPU-h", "SCU-h", "cost") else "left")
    for line in [*result.lines, None]:
        usage = result.total if line is None else line.usage
        names = (
            ("total", "", "", "") if line is None else (line.project, line.team, line.region, line.gpu_model)
        )
        table.add_row(
            *names,
            str(len(usage.runs)),
            f"{usage.gpu_ms / 3_600_000:.4f}",
            f"{usage.scu_seconds / 3600:.4f}",
            f"{usage.cost:.2f}",
        )
    console.print(table)
    return 0


def cmd_reconcile(args: argparse.Namespace) -> int:
    """``loom usage reconcile``: metered GPU-ms per run and tenant against placement's run records."""

    async def go() -> dict[str, Any]:
        conn = await _connect()
        try:
            return await reconcile(conn)
        finally:
            await conn.close()

    try:
        report = asyncio.run(go())
    except (RuntimeError, OSError, asyncpg.PostgresError) as exc:
        err.print(f"[red]error:[/red] {exc}")
        return 1
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for tenant, (metered, recorded) in sorted(report["tenants"].items()):
            mark = "[green]=[/green]" if metered == recorded else "[red]≠[/red]"
            console.print(
                f"{tenant}: metered {gpu_seconds_text(metered)} GPU-s {mark} run records "
                f"{gpu_seconds_text(recorded)} GPU-s"
            )
        console.print(f"runs checked: {report['runs']}; differences: {len(report['differences'])}")
    return 0 if not report["differences"] else 1


async def reconcile(conn: asyncpg.Connection) -> dict[str, Any]:
    """Metered GPU-ms per run and per tenant against the run records of placement's job history
    (:func:`loom.store.usage.recorded_runs`); lists every run that differs (missing, doubled, off)."""
    metered: dict[tuple[str, int], int] = {
        (r["job_id"], r["attempt"]): int(r["gpu_ms"])
        for r in await conn.fetch(
            "SELECT job_id, attempt, sum(gpu_ms)::bigint AS gpu_ms FROM usage_rows GROUP BY 1, 2"
        )
    }
    recorded = await usage_store.recorded_runs(conn)
    tenants: dict[str, list[int]] = {}
    differences = []
    for key in sorted(set(recorded) | set(metered)):
        tenant, expected = recorded.get(key, ("?", 0))
        got = metered.get(key, 0)
        if expected == 0 and got == 0:
            continue
        pair = tenants.setdefault(tenant, [0, 0])
        pair[0] += got
        pair[1] += expected
        if got != expected:
            differences.append(
                {"run": f"{key[0]}:{key[1]}", "metered_gpu_ms": got, "recorded_gpu_ms": expected}
            )
    return {
        "runs": sum(1 for v in recorded.values() if v[1] > 0),
        "tenants": {t: tuple(v) for t, v in tenants.items()},
        "differences": differences,
        "at": datetime.now(UTC).isoformat(),
    }


async def demo_summary(
    database_url: str,
    placed_job_ids: list[str],
    *,
    by: tuple[str, ...] = ("tenant",),
    timeout_s: float = 10.0,
) -> dict[str, list[Group]]:
    """Usage grouped each way of ``by`` once every finished job of ``placed_job_ids`` is metered
    (``loom demo``'s summary); waits at most ``timeout_s`` for the metering consumer to catch up."""
    conn = await asyncpg.connect(database_url, timeout=5)
    try:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while asyncio.get_running_loop().time() < deadline:
            metered = await conn.fetchval(
                "SELECT count(DISTINCT job_id) FROM usage_rows WHERE job_id = ANY($1::text[])", placed_job_ids
            )
            if int(metered) >= len(placed_job_ids):
                break
            await asyncio.sleep(0.2)
        rows = await usage_store.read_rows(conn)
    finally:
        await conn.close()
    return {way: aggregate(rows, way) for way in by}
