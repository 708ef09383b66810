"""``loom incidents [--open]``, ``loom incident ID``, ``loom ack ID``: the alert correlator's incidents.

Listing and showing read the ``incidents`` table (PostgreSQL); acknowledging asks the correlator
over NATS (``loom.incidents.ack``), which owns the incident's state and announces the change.
"""

import argparse
import asyncio
import getpass
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg
import msgspec
from rich.markup import escape
from rich.table import Table

from loom.bus.connection import BusError, connect
from loom.cli import CONNECT_WITHIN_S
from loom.cli.argtypes import positive_int
from loom.cli.output import console, err
from loom.runtime.config import endpoints, nats_endpoint
from loom.store import incidents as store
from loom_proto import subjects
from loom_proto.alerts import IncidentChange

_CONNECT_TIMEOUT_S = 3.0
_JOBS_SHOWN = 50


def add_parser(sub: Any) -> None:
    """Register ``loom incidents``, ``loom incident`` and ``loom ack``."""
    p = sub.add_parser(
        "incidents",
        help="incidents from the alert correlator, newest first",
        description="incidents from the alert correlator, newest first",
    )
    p.add_argument("--open", action="store_true", help="only open and acknowledged ones")
    p.add_argument("--limit", type=positive_int, default=50)
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_incidents)
    p = sub.add_parser(
        "incident",
        help="one incident: root cause, affected jobs, timeline",
        description="one incident: root cause, affected jobs, timeline",
    )
    p.add_argument("incident_id")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_incident)
    p = sub.add_parser(
        "ack",
        help="acknowledge an incident (the correlator announces it)",
        description="acknowledge an incident (the correlator announces it)",
    )
    p.add_argument("incident_id")
    p.add_argument("--by", default=None, help="who acknowledges (default: your user name)")
    p.set_defaults(fn=cmd_ack)


def _with_db(work: Callable[[asyncpg.Connection], Awaitable[int]]) -> int:
    async def go() -> int:
        url = endpoints().database_url
        try:
            conn = await asyncpg.connect(url, timeout=_CONNECT_TIMEOUT_S)
        except (OSError, asyncpg.PostgresError, TimeoutError) as exc:
            err.print(
                f"[red]cannot reach PostgreSQL at {url}: is the Loom stack running? (loom up)[/red] ({exc})"
            )
            return 1
        try:
            return await work(conn)
        except asyncpg.UndefinedTableError:
            err.print("[red]no incidents table: run `loom migrate`[/red]")
            return 1
        finally:
            await conn.close()

    return asyncio.run(go())


def _ago(at: float | None) -> str:
    if at is None:
        return "-"
    s = max(time.time() - at, 0.0)
    return f"{s:.0f}s ago" if s < 120 else f"{s / 60:.0f}m ago" if s < 7200 else f"{s / 3600:.1f}h ago"


def _root(i: IncidentChange) -> str:
    name = i.root.replace("~", " <-> ") if i.root_kind == "link" else i.root
    return f"{i.root_kind} {name}" + ("" if i.root_known else " (unknown)")


def cmd_incidents(args: argparse.Namespace) -> int:
    """List incidents."""

    async def work(conn: asyncpg.Connection) -> int:
        rows = await store.list_incidents(conn, open_only=args.open, limit=args.limit)
        if args.json:
            print(json.dumps([_brief(i) for i in rows], indent=2))
            return 0
        table = Table(title=f"{len(rows)} incident(s)" + (" open" if args.open else ""))
        # Whole on one line (the other columns give way): `loom incident` takes it, copied.
        table.add_column("id", no_wrap=True, min_width=max((len(i.incident_id) for i in rows), default=2))
        for col in (
            "state",
            "severity",
            "root cause",
            "jobs",
            "tenants",
            "alerts",
            "opened",
            "summary",
        ):
            table.add_column(col)
        for i in rows:
            table.add_row(
                i.incident_id,
                i.state,
                i.severity,
                _root(i),
                str(i.jobs_total),
                ",".join(i.tenants[:3]) + ("…" if len(i.tenants) > 3 else ""),
                str(i.alerts),
                _ago(i.opened_at),
                i.summary[:60],
            )
        console.print(table)
        return 0

    return _with_db(work)


def _brief(i: IncidentChange) -> dict[str, Any]:
    out = msgspec.to_builtins(i)
    out.pop("timeline", None)
    out.pop("jobs", None)
    out.pop("kind", None)
    return dict(out)


def cmd_incident(args: argparse.Namespace) -> int:
    """Show one incident."""

    async def work(conn: asyncpg.Connection) -> int:
        i = await store.get_incident(conn, args.incident_id)
        if i is None:
            err.print(f"no incident {args.incident_id!r} (see `loom incidents`)")
            return 1
        if args.json:
            print(json.dumps(msgspec.to_builtins(i), indent=2))
            return 0
        console.print(
            f"[bold]{i.incident_id}[/bold]  [bold]{i.state}[/bold]  {i.severity}  opened {_ago(i.opened_at)}"
            + (f"  acknowledged by {i.acked_by}" if i.acked_by else "")
            + (f"  resolved {_ago(i.resolved_at)}" if i.resolved_at else "")
            + (f"  merged into {i.merged_into}" if i.merged_into else "")
        )
        console.print(f"root cause: [bold]{_root(i)}[/bold] — {i.root_reason}")
        if len(i.candidates) > 1:
            console.print(
                "  ranked: " + ", ".join(f"{c.kind} {c.name} ({c.score:.2f})" for c in i.candidates[:5])
            )
        console.print(f"alerts: {i.alerts} ({i.distinct_alerts} distinct)  re-opened: {i.reopened}")
        if i.unattributed:
            console.print("affected jobs: none (no job placed here uses what it names)")
        else:
            console.print(f"affected jobs: {i.jobs_total}; tenants: {', '.join(i.tenants)}")
            if i.dags:
                console.print(f"DAGs: {', '.join(i.dags[:20])}")
            jobs = Table(title=f"jobs (first {min(_JOBS_SHOWN, len(i.jobs))} of {i.jobs_total})")
            jobs.add_column("job")
            jobs.add_column("tenant")
            for j in i.jobs[:_JOBS_SHOWN]:
                jobs.add_row(j.job_id, j.tenant or "-")
            console.print(jobs)
        timeline = Table(title="timeline")
        timeline.add_column("time")
        timeline.add_column("what")
        for e in i.timeline:
            timeline.add_row(f"+{e.at - i.opened_at:.1f}s", e.what)
        console.print(timeline)
        return 0

    return _with_db(work)


def cmd_ack(args: argparse.Namespace) -> int:
    """Acknowledge an incident through the correlator."""

    async def go() -> int:
        url = nats_endpoint()
        try:
            nc = await connect(url, "loom-ack", first_within_s=CONNECT_WITHIN_S)  # quietly, in seconds
        except BusError as exc:
            err.print(f"[red]{escape(str(exc))}[/red]")
            return 1
        try:
            body = json.dumps({"incident_id": args.incident_id, "by": args.by or getpass.getuser()}).encode()
            try:
                reply = await nc.request(subjects.INCIDENTS_ACK, body, timeout=5)
            except Exception as exc:  # no responder or timeout: the correlator is not running
                err.print(f"[red]the alert correlator did not answer: {exc}[/red]")
                return 1
            answer = json.loads(reply.data)
        finally:
            await nc.close()
        if not answer.get("ok"):
            err.print(f"[red]{answer.get('error')}[/red]")
            return 1
        state = answer.get("state")
        console.print(f"{args.incident_id}: {state}" + ("" if answer.get("changed") else " (unchanged)"))
        return 0

    return asyncio.run(go())
