"""The ``loom`` command: run the embedded stack, submit and inspect jobs, view resources, benchmark."""

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.table import Table
from rich.tree import Tree

from loom.bus.connection import BusError
from loom.cli import CONNECT_WITHIN_S
from loom.cli.argtypes import bounded_int, non_negative_int, positive_float, positive_int, share
from loom.cli.output import console, err
from loom.client import LoomClient, QueryError, SpecError, load_specs
from loom.errors import InvalidInputError, LoomError
from loom.model.topology import TopologyError, load_topology
from loom.runtime import stack
from loom.runtime.config import endpoints, loom_home, nats_endpoint
from loom.sched.quota import read_tenants
from loom.security import tenant_of, write_secret
from loom.security.http_token import otlp_headers
from loom.telemetry import configure_logging, setup_telemetry, shutdown_telemetry
from loom.telemetry.tracing import OTLP_ENDPOINT_ENV
from loom_proto.jobs import JOB_STATES, TERMINAL_STATES


def _run(coro: Coroutine[Any, Any, int]) -> int:
    return asyncio.run(coro)


async def _client() -> LoomClient:
    return await LoomClient.connect(nats_endpoint(), first_within_s=CONNECT_WITHIN_S)


# ---- stack ----------------------------------------------------------------------------------------


UP_OPTIONS_FILE = "up-options.json"
"""The options a home's stack was last started with (``<home>/up-options.json``): a bare ``loom
up`` starts it with them again (after a crash of its supervisor, or a ``loom down``)."""
UP_OPTIONS = (
    "slurm",
    "topology",
    "cluster",
    "time_scale",
    "heartbeat_s",
    "placement_shards",
    "servers_only",
    "nats_cluster",
    "secure_db",
    "metrics_port_base",
    "tenants",
    "traces",
    "neighbour_nice",
    "secure",
    "nats_host",
    "postgres_host",
)
"""The ``loom up`` options that shape a stack, kept per home."""


def _same_options_as_before(args: argparse.Namespace) -> None:
    """A bare ``loom up`` (every option at its default) on a home started before with options
    takes those options again, and says so: the stack's data (its topology's clusters, tenant
    quotas) was made with them. Restarting with the defaults silently dropped tenant admission and
    started another topology's agents (an outside walk, after a supervisor crash)."""
    path = loom_home() / UP_OPTIONS_FILE
    defaults = vars(build_parser().parse_args(["up"]))
    given = getattr(args, "given", None)
    said = bool(given) if given is not None else any(getattr(args, k) != defaults[k] for k in UP_OPTIONS)
    if said or not path.exists():
        return
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    changed = {k: v for k, v in saved.items() if k in UP_OPTIONS and v != defaults[k]}
    if not changed:
        return
    for key, value in changed.items():
        setattr(args, key, value)
    shown = " ".join(_flag(k, v) for k, v in sorted(changed.items()))
    err.print(
        f"[yellow]this home's stack was started with {escape(shown)}: starting it so again"
        " (give options to start it otherwise)[/yellow]"
    )


def _flag(key: str, value: Any) -> str:
    flag = "--" + key.replace("_", "-")
    if value is True:
        return flag
    if value is False:
        return f"--no-{key.replace('_', '-')}"
    if isinstance(value, list):
        return " ".join(f"{flag} {v}" for v in value)
    return f"{flag} {value}"


def cmd_up(args: argparse.Namespace) -> int:
    """Start the embedded stack in the background."""
    if not stack.is_running(loom_home()):
        _same_options_as_before(args)
    try:
        topology = load_topology(args.topology)
    except (OSError, ValueError, TopologyError) as exc:
        err.print(f"[red]--topology {escape(args.topology)}: {escape(str(exc))}[/red]")
        return 2
    unknown = sorted(set(args.cluster or []) - {c.id for c in topology.clusters})
    if unknown:
        err.print(
            f"[red]--cluster {escape(', '.join(unknown))}: not a cluster of topology {escape(args.topology)};"
            f" its clusters: {escape(', '.join(c.id for c in topology.clusters))}[/red]"
        )
        return 2
    try:
        nice = stack.default_neighbour_nice() if args.neighbour_nice is None else args.neighbour_nice
    except ValueError as exc:
        err.print(f"[red]{escape(str(exc))}[/red]")
        return 2
    tenants = ""
    if args.tenants:
        try:
            read_tenants(args.tenants)  # refused here, not by a placement that would not start
        except (OSError, ValueError, InvalidInputError) as exc:  # ValueError: not text at all
            err.print(f"[red]cannot use --tenants {escape(args.tenants)}: {escape(str(exc))}[/red]")
            return 2
        tenants = str(Path(args.tenants).resolve())
    if args.traces and os.environ.get(OTLP_ENDPOINT_ENV):
        err.print(
            f"[red]--traces keeps the spans in the stack, but {OTLP_ENDPOINT_ENV} sends them to"
            f" {escape(os.environ[OTLP_ENDPOINT_ENV])}: unset one of the two[/red]"
        )
        return 2
    options = stack.StackOptions(
        topology=args.topology,
        clusters=args.cluster or [],
        time_scale=args.time_scale,
        heartbeat_s=args.heartbeat_s,
        placement_shards=args.placement_shards,
        services=not args.servers_only,
        nats_cluster=args.nats_cluster,
        secure_db=args.secure_db,
        metrics_port_base=args.metrics_port_base,
        neighbour_nice=nice,
        tenants=tenants,
        traces=args.traces,
        slurm_clusters=stack.default_slurm_clusters(args.topology, args.cluster or []) if args.slurm else [],
        secure=stack.default_secure() if args.secure is None else args.secure,
        nats_host=args.nats_host,
        postgres_host=args.postgres_host,
    )
    running = stack.is_running(loom_home())
    if running:
        # What runs keeps the options it was started with (its tenant quotas among them).
        err.print(
            "[yellow]a stack is already up here: it keeps the options it was started with"
            " (loom down, then loom up, to change them)[/yellow]"
        )
    with console.status("starting Loom…") as status:
        state = stack.up(loom_home(), options, progress=lambda s: status.update(f"starting Loom… {s}"))
    if not running:
        kept = {k: getattr(args, k) for k in UP_OPTIONS}
        # Files as absolute paths: a bare `loom up` from another directory reads the same ones.
        kept["tenants"] = tenants or None
        if Path(args.topology).is_file():
            kept["topology"] = str(Path(args.topology).resolve())
        write_secret(loom_home() / UP_OPTIONS_FILE, json.dumps(kept, indent=2) + "\n")
    silent = _nats_silent(state["nats_url"]) if running and options.services else None
    if silent is not None:  # the processes are there, but it is not up: say so, not "Loom is up"
        err.print(f"[red]the stack's processes run, but {escape(silent)}; `loom status` says more[/red]")
        return 1
    console.print(f"[green]Loom is up[/green]  NATS {state['nats_url']}  PostgreSQL {state['database_url']}")
    console.print(
        f"{len(state['services'])} services; logs in {loom_home() / 'logs'}; stop with [bold]loom down[/bold]"
    )
    if state.get("alerts_webhook_url"):
        console.print(f"Alertmanager webhook at {state['alerts_webhook_url']}", highlight=False)
    if state.get("traces_url"):
        console.print(
            f"trace store at {state['traces_url']} (spans in {state.get('traces_dir')}):"
            " [bold]loom trace JOB[/bold] prints a job's span tree",
            highlight=False,
        )
    elif running and args.traces:
        err.print(
            "[yellow]--traces is not on for the stack already up (loom down, then loom up --traces)[/yellow]"
        )
    if state.get("console_url"):
        console.print(
            f"web console at {state['console_url']}: [bold]loom console[/bold] prints its URL with a token"
        )
    return 0


def _nats_silent(nats_url: str) -> str | None:
    """Why the stack's NATS does not answer within the CLI's connect budget, or None when it does."""

    async def ask() -> None:
        client = await LoomClient.connect(nats_url, name="loom-up", first_within_s=CONNECT_WITHIN_S)
        await client.close()

    try:
        asyncio.run(ask())
    except BusError as exc:
        return _without_start_hint(str(exc))
    return None


def _without_start_hint(message: str) -> str:
    """A connect error without its "start it with `loom up`" advice (a stack is up: NATS is what
    does not answer)."""
    return message.split(": is the Loom stack running?", 1)[0]


def cmd_down(_args: argparse.Namespace) -> int:
    """Stop the embedded stack."""
    with console.status("stopping Loom…"):
        stopped = stack.down(loom_home())
    console.print("Loom stopped" if stopped else "no Loom stack is running here")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """Show each process and whether it answers health checks."""
    state = stack.read_state(loom_home())
    if not state:
        console.print("no Loom stack has been started here (run [bold]loom up[/bold])")
        return 1
    rows = stack.process_table(loom_home())
    health: dict[str, dict[str, Any]] = {}
    nats_down: str | None = None
    if state.get("status") == "ready" and state.get("nats_url"):
        try:
            health = _run_health(state["nats_url"], [r["name"] for r in rows])
        except BusError as exc:  # the processes are still worth showing: NATS is what is down
            nats_down = _without_start_hint(str(exc))
    for r in rows:
        r["health"] = health.get(r["name"])
        if stack.is_server(r["name"]):
            r["server_status"] = _server_status(r, health, nats_down)  # the table and --json agree
    status = state.get("status")
    problems = _stack_problems(rows, nats_down, asked=status == "ready")
    if problems and status == "ready":
        status = "ready, degraded"
    if args.json:
        report = {"status": status, "problems": problems, "processes": rows}
        if state.get("alerts_webhook_url"):
            report["alerts_webhook_url"] = state["alerts_webhook_url"]
        if stack.trace_store_url(loom_home()):  # not a stopped stack's, gone with it
            report["traces_url"] = state["traces_url"]
        if state.get("http_token_file"):
            report["http_token_file"] = state["http_token_file"]
        print(json.dumps(report, indent=2))
    else:
        table = Table(title=f"Loom stack: {status}")
        for col in ("process", "pid", "alive", "restarts", "last exit", "health"):
            table.add_column(col)
        for r in rows:
            h = r["health"]
            if r["name"] == "supervisor":
                text = "-"
            elif stack.is_server(r["name"]):
                text = _server_health_text(r)
            elif status != "ready" and not h:
                text = f"not asked (stack {escape(str(status))})"
            else:
                text = _health_text(h) if h else "[red]no answer[/red]"
            if r.get("crash_loop"):
                text = f"[red]crash-looping[/red], {text}"
            table.add_row(
                r["name"],
                str(r["pid"]),
                "yes" if r["alive"] else "[red]no[/red]",
                str(r["restarts"]),
                r.get("last_exit") or "-",
                text,
            )
        console.print(table)
        for line in _suspect_lines(rows):
            console.print(line, highlight=False, soft_wrap=True)
        # Only of live processes: a stopped stack's ports serve nothing (or another stack now).
        metrics_endpoints = [
            (r["name"], r["metrics_url"]) for r in rows if r.get("metrics_url") and r["alive"]
        ]
        if metrics_endpoints:
            console.print("Prometheus /metrics:")
            for name, url in metrics_endpoints:
                console.print(f"  {name:<28} {url}", highlight=False, soft_wrap=True)
        if state.get("alerts_webhook_url") and status not in ("stopped", "stopping", "failed"):
            console.print(
                f"Alertmanager webhook: {state['alerts_webhook_url']}", highlight=False, soft_wrap=True
            )
        if state.get("traces_url") and status not in ("stopped", "stopping", "failed"):
            console.print(f"trace store: {state['traces_url']}", highlight=False, soft_wrap=True)
        if state.get("http_token_file") and status not in ("stopped", "stopping", "failed"):
            console.print(
                f"these HTTP endpoints answer only the bearer token in {state['http_token_file']}"
                " (Prometheus / Alertmanager: authorization: credentials_file)",
                highlight=False,
                soft_wrap=True,
            )
        for problem in problems:
            err.print(f"[red]{escape(problem)}[/red]")
    return 1 if problems else 0


def _suspect_lines(rows: list[dict[str, Any]], now: float | None = None) -> list[str]:
    """Nodes a placement leader closed to new work after a slow run, with why and for how long
    (its health's ``suspect_nodes``): by design, not a problem, but a pool closed for minutes
    showed nowhere else."""
    now = time.time() if now is None else now
    seen: dict[str, dict[str, Any]] = {}
    for r in rows:
        seen.update((r.get("health") or {}).get("suspect_nodes") or {})
    if not seen:
        return []
    lines = [f"{len(seen)} node(s) take no new work for now (suspect after a slow run):"]
    for node, about in sorted(seen.items()):
        left = max(float(about.get("until", now)) - now, 0.0)
        lines.append(f"  {node}: {escape(str(about.get('why', '')))} ({left:.0f} s more)")
    return lines


def _stack_problems(rows: list[dict[str, Any]], nats_down: str | None, *, asked: bool = True) -> list[str]:
    """What keeps the stack from being healthy, one line each (none: exit 0): a process not
    alive, a server not up or not answering, a service crash-looping, with no answer or not
    ``ok``; ``asked``: whether the services were asked (not while the stack starts or stops)."""
    problems = [f"NATS does not answer: {nats_down}"] if nats_down else []
    if not asked:
        problems.append("the stack is not ready: its services were not asked")
    for r in rows:
        name = r["name"]
        if r.get("crash_loop"):
            problems.append(
                f"{name}: crash-looping ({r['restarts']} restarts in all, last exit {r.get('last_exit')})"
            )
        if not r["alive"]:
            problems.append(f"{name} is not running")
        elif stack.is_server(name):
            if r["server_status"] != "up" and not (name == "nats" and nats_down):
                problems.append(f"{name}: {r['server_status']}")
        elif name != "supervisor" and not nats_down and asked:
            status = (r["health"] or {}).get("status")
            if status is None:
                problems.append(f"{name} does not answer its health check")
            elif status != "ok":
                problems.append(f"{name}: {status}")
    return problems


def _server_status(
    row: dict[str, Any], health: Mapping[str, Mapping[str, Any]] | None = None, nats_down: str | None = None
) -> str:
    """A server's state: the supervisor's word for it (``up``, ``restarting``, ``crash-looping``),
    but ``down`` for a process that is gone while that word still says ``up`` (after ``loom down``,
    or before the supervisor noticed), and ``not answering`` for one that is alive but refuses its
    work: NATS when the health check cannot connect, PostgreSQL when a service reports it
    unavailable (a frozen or recovering server: before, it showed ``up``)."""
    server_status = str(row.get("server_status", "up"))
    if server_status == "up" and not row.get("alive"):
        server_status = "down"
    elif server_status == "up" and row.get("name") == "nats" and nats_down:
        server_status = "not answering"
    elif (
        server_status == "up"
        and row.get("name") == "postgres"
        and any("postgres" in h.get("unavailable", ()) for h in (health or {}).values())
    ):
        server_status = "not answering (services report it unavailable)"
    return server_status


def _server_health_text(row: dict[str, Any]) -> str:
    """A server's health cell (:func:`_server_status`, in red unless up)."""
    server_status = _server_status(row)
    return "up" if server_status == "up" else f"[red]{escape(server_status)}[/red]"


def _health_text(health: dict[str, Any] | None) -> str:
    """A service's health cell: ``ok, up 12s``, ``degraded: postgres unavailable, up 12s`` (every
    problem: dependencies down, supervised tasks restarting) or no answer."""
    if not health:
        return "[red]no answer[/red]"
    status = str(health.get("status", "ok"))
    shown = "ok" if status == "ok" else f"[yellow]{escape(status)}[/yellow]"
    return f"{shown}, up {health['uptime_s']:.0f}s"


def _run_health(nats_url: str, names: list[str]) -> dict[str, dict[str, Any]]:
    from loom_proto import subjects

    async def ask() -> dict[str, dict[str, Any]]:
        client = await LoomClient.connect(nats_url, name="loom-status", first_within_s=CONNECT_WITHIN_S)
        out: dict[str, dict[str, Any]] = {}
        try:
            for name in names:
                try:
                    reply = await client.nc.request(subjects.service_health(name), b"", timeout=1.0)
                    out[name] = json.loads(reply.data)
                except Exception:  # no answer is what we report
                    continue
        finally:
            await client.close()
        return out

    return asyncio.run(ask())


def cmd_migrate(args: argparse.Namespace) -> int:
    """Apply pending database migrations to LOOM_DATABASE_URL (or the running stack's)."""
    import asyncpg

    from loom.store.migrations import migrate_url

    url = endpoints().database_url
    try:
        applied = asyncio.run(migrate_url(url))
        console.print(f"applied migrations: {applied}" if applied else "database is up to date")
        if args.role_passwords is not None:
            from loom.runtime.dbcreds import apply_role_passwords

            roles = asyncio.run(apply_role_passwords(url, args.role_passwords))
            console.print(f"passwords set for {len(roles)} roles: {', '.join(roles)}")
    except (OSError, ValueError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        # A traceback ended in ConnectionRefusedError or "invalid DSN".
        where = _redacted(url)
        why = str(exc) or type(exc).__name__
        err.print(f"[red]cannot migrate the database at {escape(where)}: {escape(why)}[/red]")
        return 1
    return 0


def _redacted(url: str) -> str:
    """A database URL without what may hold a secret: its user and password, and its query
    (``?password=…``); host, port and database only."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        host = parts.netloc.rpartition("@")[2]
    except ValueError:
        return "(a URL that cannot be read)"
    return f"{host}{parts.path}" if host else "(a URL naming no host)"


# ---- jobs -----------------------------------------------------------------------------------------


def _own_tenant() -> str | None:
    """The tenant the CLI's NATS credentials are (``LOOM_CREDS`` of ``tenant-acme``: ``acme``), the
    tenant of specs that name none; None for the operator or an open stack."""
    from loom.bus.connection import identity_at

    try:
        return tenant_of(identity_at(nats_endpoint()))
    except (RuntimeError, LoomError):  # no stack, or unreadable credentials: the submission says so
        return None


def cmd_submit(args: argparse.Namespace) -> int:
    """Validate and submit every job in FILE."""
    try:
        specs = load_specs(args.file, default_tenant=args.tenant or _own_tenant())
    except (SpecError, OSError) as exc:
        err.print(f"[red]cannot submit:[/red] {exc}")
        return 2

    async def go() -> int:
        client = await _client()
        refused = False
        follow: set[str] = set()
        # The submission's span is the root of the job's trace: record it (exported when
        # OTEL_EXPORTER_OTLP_ENDPOINT is set, else to the stack's trace store when it keeps one)
        # so the traceparent says "sampled" downstream.
        store = stack.trace_store_url(loom_home())
        if store and not os.environ.get(OTLP_ENDPOINT_ENV):
            os.environ[OTLP_ENDPOINT_ENV] = store
            token = stack.local_http_token(loom_home())
            if token:
                os.environ.update(otlp_headers(token))
        setup_telemetry("loom-cli", log_level=None, always_identify=True)
        try:
            for spec in specs:
                admission = await client.submit_checked(spec)
                refused |= _print_admission(spec, admission)
                if admission.outcome in ("accepted", "duplicate", "unanswered"):
                    follow.add(spec.job_id)
            shutdown_telemetry()  # flush the submission spans before waiting
            if args.wait and follow:
                code = await _follow(client, follow, timeout_s=args.timeout)
                return 1 if refused else code
        finally:
            shutdown_telemetry()
            await client.close()
        return 1 if refused else 0

    return _run(go())


def _print_admission(spec: Any, admission: Any) -> bool:
    """One line per submission; True when it was refused (rejected, or its id taken)."""
    name = f"[bold]{escape(spec.job_id)}[/bold] (tenant {escape(spec.tenant)})"
    if admission.outcome == "accepted":
        trace = f"; trace {admission.trace_id}" if admission.trace_id else ""
        if admission.state in ("rejected", "failed"):
            # Accepted, then refused or failed before the first look (a DAG whose stage id is
            # taken, a stage that failed at once): a refusal all the same, exit 1.
            why = f": {escape(admission.reason)}" if admission.reason else ""
            err.print(f"[red]submitted {name}: accepted, then {admission.state}{why}[/red]{trace}")
            return True
        console.print(f"submitted {name}: accepted, {admission.state}{trace}")
    elif admission.outcome == "duplicate":
        console.print(
            f"{name}: already submitted ({escape(admission.state or admission.reason)}); nothing sent again"
        )
        # Submitted before and rejected then: still a rejection (exit 1), as the first time.
        return bool(admission.state == "rejected")
    elif admission.outcome == "unanswered":
        console.print(f"submitted {name}: [yellow]{escape(admission.reason)}[/yellow]; it waits on the bus")
    elif admission.outcome == "conflict":
        err.print(f"[red]{name}: {escape(admission.reason)}[/red]")
        return True
    else:
        hint = f"\n  hint: {escape(admission.hint)}" if admission.hint else ""
        err.print(f"[red]{name} rejected ({escape(admission.code)}): {escape(admission.reason)}[/red]{hint}")
        return True
    return False


async def _follow(client: LoomClient, job_ids: set[str], *, timeout_s: float) -> int:
    """Poll until every job is terminal; print one line per state change, and while a job runs, its
    progress every tenth of the way (or every 10 s) with its rate and an ETA."""
    seen: dict[str, str] = {}
    shown: dict[str, tuple[float, float]] = {}  # job -> (progress shown, when)
    running_since: dict[str, tuple[float, float]] = {}  # job -> (progress, when) at the first running look
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        now = time.time()
        for job_id in sorted(job_ids):
            job = await client.job(job_id)
            state = job["state"] if job else "submitted"
            if seen.get(job_id) != state:
                where = f" on {job['cluster']}" if job and job.get("cluster") else ""
                why = f": {job['reason']}" if job and job.get("reason") else ""
                console.print(f"{job_id}: {state}{where}{why}")
                seen[job_id] = state
            if job is not None and state == "running":
                progress = float(job.get("progress") or 0.0)
                start = running_since.setdefault(job_id, (progress, now))
                last = shown.get(job_id, (start[0], start[1]))
                if progress - last[0] >= 0.1 or (progress > last[0] and now - last[1] >= 10.0):
                    console.print(
                        f"{job_id}: {_progress_line(progress, start, now)} on {job.get('cluster') or '-'}"
                    )
                    shown[job_id] = (progress, now)
        if all(seen.get(j) in TERMINAL_STATES for j in job_ids):
            return 0 if all(seen[j] == "completed" for j in job_ids) else 1
        await asyncio.sleep(0.5)
    err.print("[yellow]timed out waiting for the jobs[/yellow]")
    return 1


def _progress_line(progress: float, start: tuple[float, float], now: float) -> str:
    """``42% done, 3.1%/min, about 19 min left`` from the progress seen first while running."""
    elapsed = now - start[1]
    rate = (progress - start[0]) / elapsed if elapsed > 0 else 0.0
    if rate <= 0:
        return f"{progress:.0%} done"
    left_s = (1.0 - progress) / rate
    left = f"{left_s:.0f} s" if left_s < 120 else f"{left_s / 60:.0f} min"
    return f"{progress:.0%} done, {rate * 60:.1%}/min, about {left} left"


def _where(job: dict[str, Any]) -> str:
    """A job's cluster, or where its last attempt ran while it waits to be placed again."""
    if job.get("cluster"):
        return str(job["cluster"])
    return f"- (last ran on {job['last_cluster']})" if job.get("last_cluster") else "-"


def cmd_jobs(args: argparse.Namespace) -> int:
    """List jobs, newest first."""

    async def go() -> int:
        client = await _client()
        try:
            rows = await client.jobs(tenant=args.tenant, state=args.state, limit=args.limit)
        finally:
            await client.close()
        if args.json:
            print(json.dumps(rows, indent=2))
            return 0
        table = Table(title=f"{len(rows)} job(s)")
        # Whole on one line (the other columns give way): the next command takes it, copied.
        table.add_column("job", no_wrap=True, min_width=max((len(str(r["job_id"])) for r in rows), default=3))
        for col in ("tenant", "state", "cluster", "progress"):
            table.add_column(col)
        table.add_column("reason", overflow="fold")  # wrapped at words, never cut
        for r in rows:
            table.add_row(
                r["job_id"],
                r["tenant"],
                r["state"],
                r["cluster"] or "",
                f"{r['progress']:.0%}",
                escape(r["reason"] or ""),
            )
        console.print(table)
        return 0

    return _run(go())


def cmd_cancel(args: argparse.Namespace) -> int:
    """Cancel jobs; exit 1 when one is unknown or was not recorded in time."""

    async def go() -> int:
        client = await _client()
        code = 0
        try:
            for job_id in args.job_ids:
                try:
                    state, already = await client.cancel_outcome(job_id, reason=args.reason)
                except QueryError as exc:
                    err.print(f"[red]{escape(str(exc))}[/red]")
                    code = 1
                    continue
                if already:
                    console.print(f"{escape(job_id)}: already {state}; nothing to cancel")
                elif state == "cancelled":
                    console.print(f"{escape(job_id)}: cancelled")
                else:  # it ended another way while the cancellation was on its way
                    console.print(f"{escape(job_id)}: {state} before the cancellation took effect")
        finally:
            await client.close()
        return code

    return _run(go())


def cmd_explain(args: argparse.Namespace) -> int:
    """Why a job is where it is (or why it waits, or was rejected): every decision, in plain words."""
    from loom.sched.explain import render
    from loom.sched.framework import DecisionRecord

    async def go() -> int:
        client = await _client()
        try:
            answer = await client.explain(args.job_id)
        finally:
            await client.close()
        if answer["job"] is None:
            err.print(
                f"no job {args.job_id!r} (it was never accepted: check `loom jobs` or the rejected events)"
            )
            return 1
        if args.json:
            print(json.dumps(answer, indent=2))
            return 0
        job = answer["job"]
        console.print(
            f"[bold]{job['job_id']}[/bold]  state [bold]{job['state']}[/bold]  cluster {_where(job)}"
        )
        stages = (job.get("spec") or {}).get("stages") or []
        if not answer["decisions"] and stages:
            from loom.sched.dag import stage_job_id

            console.print(
                "a DAG is not placed itself: each stage is a job of its own, decided when its"
                " dependencies end. Explain a stage: "
                + ", ".join(f"loom explain {stage_job_id(job['job_id'], st['name'])}" for st in stages)
            )
        elif not answer["decisions"] and job["state"] in TERMINAL_STATES:
            console.print(f"no decision was recorded: the job ended ({job['state']}) before it was decided")
        elif not answer["decisions"]:
            console.print("no decision recorded yet (the job has not had a scheduling cycle)")
        for d in answer["decisions"]:
            console.print(f"\n[bold]attempt {d['attempt']}[/bold] ({d['outcome']})")
            for line in render(DecisionRecord.from_dict(d["record"]), limit=args.limit):
                console.print(f"  {line}", highlight=False)
        if job.get("migrations"):
            from loom.cli.migrations import migrations_table

            console.print(migrations_table(job["migrations"], title="why it moved"))
        if job.get("verdicts"):
            from loom.cli.migrations import verdicts_table

            console.print(
                verdicts_table(job["verdicts"], title="why it moved or did not (migration verdicts)")
            )
        return 0

    return _run(go())


def cmd_job(args: argparse.Namespace) -> int:
    """One job and its event history."""

    async def go() -> int:
        client = await _client()
        try:
            job = await client.job(args.job_id)
            stages = await _stage_jobs(client, job) if job is not None else []
        finally:
            await client.close()
        if job is None:
            err.print(
                f"no job {args.job_id!r} (it was never accepted: check `loom jobs` or the rejected events)"
            )
            return 1
        if args.json:
            print(json.dumps({**job, "stage_jobs": stages} if stages else job, indent=2))
            return 0
        console.print(
            f"[bold]{job['job_id']}[/bold]  tenant {job['tenant']}  state [bold]{job['state']}[/bold]"
            f"  cluster {_where(job)}  progress {job['progress']:.0%}"
        )
        if job.get("reason"):
            console.print(f"reason: {job['reason']}")
        if job.get("trace_id"):
            console.print(f"trace: {job['trace_id']}  (`loom trace {job['job_id']}`)")
        if stages:
            _print_stages(stages)
        if job.get("migrations"):
            from loom.cli.migrations import migrations_table

            console.print(migrations_table(job["migrations"], title="moves"))
        if job.get("replicas"):
            from loom.cli.migrations import replicas_table

            console.print(replicas_table(job["replicas"], title="checkpoint replicas"))
        if job.get("verdicts"):
            from loom.cli.migrations import verdicts_table

            console.print(verdicts_table(job["verdicts"], title="migration verdicts (moved or not, and why)"))
        table = Table(title="history")
        for col in ("time", "event", "detail"):
            table.add_column(col)
        t0 = job["events"][0]["at"] if job["events"] else 0.0
        for e in job["events"]:
            ev = e["event"]
            detail = _event_detail(e["kind"], ev)
            table.add_row(f"+{e['at'] - t0:.3f}s", e["kind"], detail)
        console.print(table)
        return 0

    return _run(go())


async def _stage_jobs(client: LoomClient, job: dict[str, Any]) -> list[dict[str, Any]]:
    """A DAG's stages as jobs (``<job>--<stage>``) with their state; empty for other jobs."""
    from loom.sched.dag import stage_job_id

    out: list[dict[str, Any]] = []
    for stage in (job.get("spec") or {}).get("stages") or []:
        stage_id = stage_job_id(job["job_id"], stage["name"])
        found = await client.job(stage_id)
        if found is None:
            # A DAG that ended (rejected, failed, cancelled) creates no more stages.
            ended = job.get("state") in ("rejected", "failed", "cancelled", "completed")
            state, cluster = (
                (f"not created (the DAG is {job['state']})" if ended else "not yet created"),
                None,
            )
        elif found.get("parent") != job["job_id"]:  # another job's id (why a DAG was rejected)
            state, cluster = "not created (the id is another job's)", None
        else:
            state, cluster = found["state"], found.get("cluster")
        out.append(
            {
                "stage": stage["name"],
                "job_id": stage_id,
                "depends_on": stage.get("depends_on", []),
                "state": state,
                "cluster": cluster,
            }
        )
    return out


def _print_stages(stages: list[dict[str, Any]]) -> None:
    table = Table(title="stages (each is a job of its own: loom job / loom explain STAGE-JOB)")
    for col in ("stage", "job", "after", "state", "cluster"):
        table.add_column(col)
    for st in stages:
        table.add_row(
            st["stage"], st["job_id"], ", ".join(st["depends_on"]) or "-", st["state"], st["cluster"] or "-"
        )
    console.print(table)


def _event_detail(kind: str, ev: dict[str, Any]) -> str:
    """One line about an event for the history table."""
    if kind == "placed":
        # Every part of a job placed on several clusters, the lead first (it showed the lead only).
        parts = ev.get("parts") or [ev]
        return "; ".join(
            f"{p['cluster']} ({p['gpu_model']}) nodes "
            + ", ".join(f"{a['node']}x{a['gpus']}" for a in p["allocations"])
            for p in parts
        )
    if kind in ("progress", "checkpointed"):
        return f"step {ev['step']}" + (f"/{ev['steps']}" if "steps" in ev else "")
    if kind == "requeued":
        # The cause on this row: the given-up attempt's own report comes after it.
        off = f" off {ev['from_cluster']}" if ev.get("from_cluster") else ""
        avoid = f"; avoids {', '.join(ev['avoid_clusters'])}" if ev.get("avoid_clusters") else ""
        why = f": {ev['reason']}" if ev.get("reason") else ""
        given_up, cause = ev["attempt"] - 1, ev["cause"]
        return f"attempt {given_up} given up ({cause}){off}{why}; attempt {ev['attempt']} next{avoid}"
    if kind == "resized":  # its row was empty
        gpus = sum(int(a.get("gpus", 0)) for a in ev.get("allocations") or [])
        why = f": {ev['reason']}" if ev.get("reason") else ""
        return f"{ev['workers']} worker(s), {gpus} GPU(s) on {ev['cluster']}{why}"
    if kind == "cancelled" and ev.get("reason"):
        return str(ev["reason"])
    if kind == "failed" and ev.get("stopped"):
        return f"attempt {ev.get('attempt', 1)} stopped by Loom: {ev['reason']}"
    if kind in ("failed", "rejected"):
        return str(ev["reason"])
    if kind == "completed":
        # The agent's count on the job's own clock (a simulated cluster runs it time-scaled);
        # what is billed is metered in wall time: `loom usage --by job`.
        return f"{ev['gpu_seconds']:.0f} GPU-seconds on the job's clock (billed: loom usage --by job)"
    return ""


def cmd_view(args: argparse.Namespace) -> int:
    """The resource tree: region -> zone -> cluster (-> nodes with --nodes)."""

    async def go() -> int:
        client = await _client()
        try:
            view = await client.view(
                region=args.region,
                zone=args.zone,
                gpu_model=args.model,
                min_free_gpus=args.min_free,
                fresh_only=args.fresh,
                nodes=True,
            )
            learned: list[dict[str, Any]] | None = None
            drains: dict[str, str] | None = None
            # Learned speeds and drains are the operators': a tenant may ask neither.
            if tenant_of(client.identity) is None:
                try:
                    learned = await client.learned_speeds(timeout_s=2.0)
                except QueryError as exc:
                    err.print(f"learned speeds unavailable: {exc}")
                try:
                    drains = {d["cluster"]: d["state"] for d in await client.drains(timeout_s=2.0)}
                except QueryError as exc:
                    err.print(f"drain states unavailable: {exc}")
            filters = _view_filters(args)
            models_here = (
                _models(await client.view(nodes=True)) if not view["regions"] and args.model else set()
            )
        finally:
            await client.close()
        if args.model and learned:
            learned = [e for e in learned if e["gpu_model"] == args.model]
        if not view["regions"] and filters:
            err.print(f"[red]no cluster matches {escape(filters)}[/red]")
            if args.model and args.model not in models_here:
                known = ", ".join(sorted(models_here)) or "none yet"
                err.print(f"GPU models on the platform (names as written): {escape(known)}")
            return 1
        _mark_drains(view, drains)
        if args.json:
            if not args.nodes:
                _drop_nodes(view)
            print(json.dumps({**view, "learned_speeds": learned}, indent=2))
            return 0
        console.print(_view_tree(view, with_nodes=args.nodes))
        if learned:
            console.print(_learned_table(learned))
        return 0

    return _run(go())


def _view_filters(args: argparse.Namespace) -> str:
    """The filters given to ``loom view``, as typed (empty when none)."""
    given = [
        ("--region", args.region),
        ("--zone", args.zone),
        ("--model", args.model),
        ("--min-free", args.min_free or None),
        ("--fresh", True if args.fresh else None),
    ]
    return " ".join(
        flag if value is True else f"{flag} {value}" for flag, value in given if value is not None
    )


def _models(view: dict[str, Any]) -> set[str]:
    """The GPU models of a view's nodes."""
    return {
        n["gpu_model"]
        for r in view["regions"].values()
        for z in r["zones"].values()
        for c in z["clusters"].values()
        for n in c.get("nodes", [])
        if n["gpu_model"]
    }


def _mark_drains(view: dict[str, Any], drains: dict[str, str] | None) -> None:
    """Each cluster's ``drain`` state (``draining`` / ``drained``; None: open to new work; the key
    is left out when the migration service did not answer)."""
    if drains is None:
        return
    for r in view["regions"].values():
        for z in r["zones"].values():
            for cluster, c in z["clusters"].items():
                c["drain"] = drains.get(cluster)


def _drop_nodes(view: dict[str, Any]) -> None:
    """Leave the node lists out of a view (``--json`` without ``--nodes``): clusters keep their
    counts per GPU model instead."""
    for r in view["regions"].values():
        for z in r["zones"].values():
            for c in z["clusters"].values():
                models: dict[str, int] = {}
                for n in c.pop("nodes", []):
                    key = n["gpu_model"] or "cpu"
                    models[key] = models.get(key, 0) + n["gpus_total"]
                c["gpus_by_model"] = models


def _learned_table(learned: list[dict[str, Any]]) -> Table:
    """Learned speeds: per (family, GPU model), the factor on the profile's speed, its sd and runs;
    the family's spread (how far its runs on one model disagree) and whether comparative advantage
    acts on the cell's ratios (measured by runs that agree)."""
    table = Table(title="learned speeds (x the profile's speed)")
    for col in ("family", "GPU", "factor", "±sd", "runs", "source", "spread", "ratios used"):
        table.add_column(col)
    for e in learned:
        spread = e.get("spread")
        table.add_row(
            e["family"],
            e["gpu_model"],
            f"{e['factor']:.3f}",
            f"±{e['log_sd']:.0%}",
            str(e["runs"]),
            e["source"],
            "—" if spread is None else f"{spread:.0%}",
            "yes" if e.get("steady") else "no",
        )
    return table


def _capacity(level: dict[str, Any]) -> str:
    return (
        f"{level['gpus_free']} free / {level['gpus_total']} GPUs"
        f" ({level['gpus_used']} used, {level['gpus_reserved']} reserved)"
    )


def _view_tree(view: dict[str, Any], *, with_nodes: bool) -> Tree:
    root = Tree("[bold]Loom[/bold]")
    for region, r in sorted(view["regions"].items()):
        rt = root.add(f"[bold]{region}[/bold]  {_capacity(r)}")
        for zone, z in sorted(r["zones"].items()):
            zt = rt.add(f"{zone}  {_capacity(z)}")
            for cluster, c in sorted(z["clusters"].items()):
                fresh = (
                    f"[red]STALE[/red] (silent {c['age_s']:.0f}s)"
                    if c["stale"]
                    else f"[green]fresh[/green] {c['age_s']:.1f}s ago, ttl {c['ttl_s']:.0f}s"
                )
                models: dict[str, int] = {}
                for n in c["nodes"]:
                    models[n["gpu_model"] or "cpu"] = models.get(n["gpu_model"] or "cpu", 0) + n["gpus_total"]
                mix = ", ".join(f"{m} {g}" for m, g in sorted(models.items()))
                trust = f"trust {c['trust']:.2f}" if "trust" in c else ""
                drain = (
                    f"  [yellow]{c['drain'].upper()}[/yellow] (no new work; `loom drains`)"
                    if c.get("drain")
                    else ""
                )
                ct = zt.add(f"{cluster}  {_capacity(c)}  {escape(f'[{mix}]')}  {trust}  {fresh}{drain}")
                if with_nodes:
                    for n in c["nodes"]:
                        ct.add(
                            f"{n['node']} {n['gpu_model']} used {n['gpus_used']}/{n['gpus_total']}"
                            + (f", reserved {n['gpus_reserved']}" if n["gpus_reserved"] else "")
                            + ("" if n["healthy"] else " [red]unhealthy[/red]")
                        )
    return root


# ---- network --------------------------------------------------------------------------------------


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def cmd_net_links(args: argparse.Namespace) -> int:
    """Every link's state as network-perception sees it now."""

    async def go() -> int:
        client = await _client()
        try:
            answer = await client.net_point(region=args.region)
        finally:
            await client.close()
        # A region's answer holds its links out, then in; otherwise it is every link.
        links: list[dict[str, Any]] = (
            [*answer["outgoing"], *answer["incoming"]] if isinstance(answer, dict) else answer
        )
        if args.json:
            print(json.dumps(links, indent=2))
            return 0
        table = Table(title="Loom links (p95 / p99 over the shortest window with probes)")
        columns = (
            "link",
            "rtt ms",
            "p95",
            "p99",
            "forecast",
            "baseline",
            "jitter",
            "loss",
            "Gbps",
            "cost",
            "state",
        )
        for col in columns:
            table.add_column(col, justify="left" if col in ("link", "state") else "right")
        for link in links:
            state = []
            if link["degraded"]:
                state.append("[red]degraded[/red]")
            if link["stale"]:
                state.append("[yellow]stale[/yellow]")
            if not link["usable"]:
                state.append("[red]unusable[/red]")
            rtt_window = _shortest_window(link)
            table.add_row(
                f"{link['src']} -> {link['dst']}",
                _ms(link["rtt_ms"]),
                _ms(rtt_window.get("p95_ms")),
                _ms(rtt_window.get("p99_ms")),
                _ms(link.get("rtt_ms_forecast")),
                _ms(link["baseline_rtt_ms"]),
                _ms(link["jitter_ms"]),
                f"{link['loss_rate']:.2%}" if link["loss_rate"] is not None else "-",
                f"{link['bandwidth_gbps']:.2f}" if link["bandwidth_gbps"] is not None else "-",
                _ms(link["cost"]),
                ", ".join(state) or "[green]ok[/green]",
            )
        console.print(table)
        return 0

    return _run(go())


def _shortest_window(link: dict[str, Any]) -> dict[str, Any]:
    """RTT statistics of the link's shortest window that received probes (empty when none)."""
    for window in link.get("windows") or []:
        rtt = window[0] if isinstance(window, list) and window else {}
        if isinstance(rtt, dict) and rtt.get("samples"):
            return rtt
    return {}


def cmd_net_path(args: argparse.Namespace) -> int:
    """The chosen path between two regions, the momentary best, and why."""

    async def go() -> int:
        client = await _client()
        try:
            answer = await client.net_path(args.src, args.dst)
        finally:
            await client.close()
        if args.json:
            print(json.dumps(answer, indent=2))
            return 0
        path = answer["path"]
        if path is None:
            console.print(f"[red]no path[/red] from {args.src} to {args.dst} ({answer['reason']})")
            return 1
        console.print(
            f"[bold]{' -> '.join(path['nodes'])}[/bold]  cost {_ms(path['cost'])}"
            f"  rtt {_ms(path['rtt_ms'])} ms"
            f"  loss {path['loss_rate']:.2%}"
            + (
                f"  bottleneck {path['bottleneck_gbps']:.2f} Gbps"
                if path.get("bottleneck_gbps") is not None
                else "  bottleneck unknown"
            )
            + f"  ({answer['reason']}; the route changed {answer['changes']} time(s) so far)"
        )
        best = answer["best"]
        if best is not None and best["nodes"] != path["nodes"]:
            console.print(f"momentary best: {' -> '.join(best['nodes'])}  cost {_ms(best['cost'])}")
        return 0

    return _run(go())


def _print_emulated(links: list[dict[str, Any]]) -> None:
    table = Table(title="emulated links")
    for col in ("link", "rtt ms", "jitter ms", "loss", "Gbps", "state"):
        table.add_column(col)
    for link in links:
        fwd, rev = link["forward"], link["reverse"]
        gbps = link.get("wan_gbps")
        table.add_row(
            f"{link['src']} -> {link['dst']}",
            f"{fwd['delay_ms'] + rev['delay_ms']:.1f}",
            f"{fwd['jitter_ms']:.1f}",
            f"{fwd['loss']:.1%}",
            "-" if gbps is None else f"{gbps:.2f}",
            ("[red]degraded[/red]" if link["degraded"] else "as measured")
            + ("" if link["up"] else " [yellow](peer not found yet)[/yellow]"),
        )
    console.print(table)


def cmd_net_degrade(args: argparse.Namespace) -> int:
    """Make one emulated link of the local stack worse: RTT, loss, bandwidth."""
    request: dict[str, Any] = {"op": "degrade"}
    for key in ("rtt_ms", "rtt_factor", "loss", "gbps"):
        if getattr(args, key) is not None:
            request[key] = getattr(args, key)
    if len(request) == 1:
        err.print("say how: --rtt-ms, --rtt-factor, --loss and/or --gbps")
        return 2

    async def go() -> int:
        client = await _client()
        try:
            try:
                links = await client.net_emulate(args.src, args.dst, request)
            except QueryError as exc:
                return await _emulation_refused(client, args.src, args.dst, exc)
        finally:
            await client.close()
        _print_emulated(links)
        return 0

    return _run(go())


async def _emulation_refused(client: LoomClient, src: str, dst: str, exc: QueryError) -> int:
    """Why a request about one emulated link failed: the collector's own refusal of a known link
    (a value out of range), or no such link (the known ones listed); exit 2 either way. No
    collector at all: the error is raised."""
    known = await client.net_emulate_all({"op": "show"})
    if not known:
        raise exc
    pairs = sorted({(k["src"], k["dst"]) for k in known})
    if (src, dst) in pairs:
        err.print(f"[red]{escape(src)} -> {escape(dst)}: {escape(str(exc))}[/red]")
    else:
        err.print(
            f"[red]no emulated link {escape(src)} -> {escape(dst)}[/red]; known: "
            + ", ".join(f"{a} -> {b}" for a, b in pairs)
        )
    return 2


def cmd_net_restore(args: argparse.Namespace) -> int:
    """Put emulated links back as the topology measured them: one link, or every link."""
    if (args.src is None) != (args.dst is None):
        err.print("give both SRC and DST, or neither (every link)")
        return 2

    async def go() -> int:
        client = await _client()
        try:
            if args.src is not None:
                try:
                    links = await client.net_emulate(args.src, args.dst, {"op": "restore"})
                except QueryError as exc:
                    return await _emulation_refused(client, args.src, args.dst, exc)
            else:
                links = await client.net_emulate_all({"op": "restore"})
        finally:
            await client.close()
        if not links:
            err.print("no probe collector answered: is the stack up?")
            return 1
        _print_emulated(links)
        return 0

    return _run(go())


# ---- demo and bench -------------------------------------------------------------------------------


def cmd_demo(args: argparse.Namespace) -> int:
    """Bring the stack up, run the example workload with live progress, print a summary."""
    from loom.cli.demo import run_demo

    return run_demo(args, console)


def cmd_bench(args: argparse.Namespace) -> int:
    """Run a benchmark program and print its JSON."""
    from loom_benchmarks import run_benchmark

    return run_benchmark(args)


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Measure this machine's performance profile: GEMM, convolution, transformer layer, memory."""
    import msgspec

    from loom.runtime.calibrate import CalibrationError, CalibrationOptions, calibrate, render_table

    options = CalibrationOptions(quick=args.quick, device=args.device, model=args.model)
    try:
        with err.status("calibrating…") as status:
            report = calibrate(options, progress=lambda s: status.update(f"calibrating… {s}"))
    except CalibrationError as exc:
        err.print(f"[red]{escape(str(exc))}[/red]")
        return 2
    if args.json:
        print(msgspec.json.encode(report).decode())
        return 0
    console.print(render_table(report))
    p = report.profile
    console.print(
        f"profile [bold]{p.model}[/bold]: FP32 {p.compute_fp32_tflops:.3g} TFLOPS,"
        f" TF32 {p.fp32_matrix_tflops:.3g}, FP16 {p.compute_fp16_tflops:.3g} TFLOPS,"
        f" memory {p.memory_bandwidth_gbps / 8:.3g} GB/s,"
        f" {p.memory_gib:.1f} GiB (--json for the whole profile)"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The full command line."""
    parser = argparse.ArgumentParser(
        prog="loom", description="Loom: network-aware scheduling over GPU clusters"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, fn: Callable[[argparse.Namespace], int], help_: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(fn=fn)
        return p

    p = add("up", cmd_up, "start NATS, PostgreSQL and every service in the background")
    p.add_argument(
        "--slurm",
        action="store_true",
        help="run two of the clusters on local Slurm clusters (slurm-wlm, munge; root), not simulated",
    )
    p.add_argument("--topology", default="default", help="packaged topology name or file")
    p.add_argument("--cluster", action="append", help="run only these cluster agents (repeatable)")
    p.add_argument(
        "--time-scale", type=positive_float, default=60.0, help="simulated seconds per wall second"
    )
    p.add_argument("--heartbeat-s", type=positive_float, default=2.0)
    p.add_argument(
        "--placement-shards",
        type=bounded_int(1, 64),
        default=1,
        help="placement shards over a GPU-balanced split of the regions",
    )
    p.add_argument(
        "--servers-only",
        action="store_true",
        help="start (and keep up) NATS and PostgreSQL only; run the services yourself",
    )
    p.add_argument(
        "--nats-cluster",
        type=int,
        choices=(1, 3),
        default=1,
        help="nats-server processes: 3 runs a JetStream cluster with 3 replicas of every stream",
    )
    p.add_argument(
        "--secure-db",
        action=argparse.BooleanOptionalAction,
        default=stack.SECURE_DB_DEFAULT,
        help="PostgreSQL with SCRAM passwords (0600 files under LOOM_HOME/secrets) and a "
        "least-privilege role per service; --no-secure-db trusts every local connection",
    )
    p.add_argument(
        "--metrics-port-base",
        type=bounded_int(0, 65_000),
        default=0,
        help="Prometheus /metrics ports: consecutive from this one (default: a free port each)",
    )
    p.add_argument(
        "--tenants",
        default=None,
        metavar="FILE",
        help="tenant quotas for placement (YAML or JSON, as deploy/tenants.example.yaml); "
        "default: every tenant admitted with no quota",
    )
    p.add_argument(
        "--traces",
        action="store_true",
        help="keep every service's spans in a trace store of the stack (files under LOOM_HOME/traces),"
        " which `loom trace JOB` reads: job traces without Jaeger (it costs the services some CPU)",
    )
    p.add_argument(
        "--neighbour-nice",
        type=stack.neighbour_nice_arg,
        default=None,
        help="niceness added to every service but placement, so that placement gets the cores when"
        f" both want them (default {stack.NEIGHBOUR_NICE}, or $LOOM_NEIGHBOUR_NICE; 0: all alike)",
    )
    p.add_argument(
        "--secure",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="authenticated NATS: every process its own NKEY identity and permissions (loom.security);"
        " on unless --no-secure or LOOM_SECURE=0",
    )
    p.add_argument(
        "--nats-host",
        default=stack.StackOptions.nats_host,
        help="address NATS listens on; off loopback it requires TLS with a CA generated under secrets/tls",
    )
    p.add_argument(
        "--postgres-host",
        default=stack.StackOptions.postgres_host,
        help="address the embedded PostgreSQL listens on: loopback only (its build has no SSL)",
    )
    add("down", cmd_down, "stop the embedded stack")
    p = add("status", cmd_status, "show the stack's processes and their health")
    p.add_argument("--json", action="store_true")
    p = add("migrate", cmd_migrate, "apply database migrations")
    p.add_argument(
        "--role-passwords",
        type=Path,
        help="a directory of <role>.pgpass files: give each service role its password (docker-compose)",
    )
    p = add("submit", cmd_submit, "submit the jobs in a YAML or JSON file")
    p.add_argument("file", type=Path)
    p.add_argument("--tenant", help="tenant for specs that name none")
    p.add_argument("--wait", action="store_true", help="follow the jobs until they finish")
    p.add_argument("--timeout", type=float, default=600.0)
    p = add("jobs", cmd_jobs, "list jobs")
    p.add_argument("--tenant")
    p.add_argument(
        "--state",
        choices=JOB_STATES,
    )
    p.add_argument("--limit", type=positive_int, default=50)
    p.add_argument("--json", action="store_true")
    p = add("job", cmd_job, "one job and its event history")
    p.add_argument("job_id")
    p.add_argument("--json", action="store_true")
    p = add(
        "cancel",
        cmd_cancel,
        "cancel jobs: queued ones leave the queue, running ones stop and free their GPUs",
    )
    p.add_argument("job_ids", nargs="+", metavar="JOB_ID")
    p.add_argument("--reason", default="", help="recorded in the job's history")
    p = add("explain", cmd_explain, "why a job runs where it does, and why not elsewhere")
    p.add_argument("job_id")
    p.add_argument("--limit", type=positive_int, default=10, help="candidates and ruled-out clusters to show")
    p.add_argument("--json", action="store_true")
    p = add("view", cmd_view, "the resource tree: region -> zone -> cluster -> node")
    p.add_argument("--region")
    p.add_argument("--zone")
    p.add_argument("--model", help="only nodes of this GPU model")
    p.add_argument(
        "--min-free", type=non_negative_int, default=0, help="only nodes with at least this many free GPUs"
    )
    p.add_argument("--fresh", action="store_true", help="leave out stale clusters")
    p.add_argument("--nodes", action="store_true", help="list nodes too")
    p.add_argument("--json", action="store_true")
    net = sub.add_parser("net", help="network links, paths and the local WAN emulator")
    net_sub = net.add_subparsers(dest="net_command", required=True)

    def add_net(name: str, fn: Callable[[argparse.Namespace], int], help_: str) -> argparse.ArgumentParser:
        p = net_sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(fn=fn)
        return p

    p = add_net("links", cmd_net_links, "every link's state: RTT, jitter, loss, bandwidth, cost")
    p.add_argument("--region", help="only this region's links (out and in)")
    p.add_argument("--json", action="store_true")
    p = add_net("path", cmd_net_path, "the chosen path between two regions")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--json", action="store_true")
    p = add_net("degrade", cmd_net_degrade, "degrade one emulated link of the local stack")
    p.add_argument("src")
    p.add_argument("dst")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--rtt-ms", type=positive_float, help="round-trip time to emulate")
    how.add_argument("--rtt-factor", type=positive_float, help="multiply the measured round-trip time")
    p.add_argument("--loss", type=share, help="share of probes lost per round trip (0..1)")
    p.add_argument("--gbps", type=positive_float, help="bandwidth to emulate, in WAN Gbps")
    p = add_net("restore", cmd_net_restore, "restore one emulated link (or every link) as measured")
    p.add_argument("src", nargs="?")
    p.add_argument("dst", nargs="?")
    from loom.cli.credentials import add_parser as add_credentials_parser
    from loom.cli.dlq import add_parser as add_dlq_parser
    from loom.cli.trace import add_parser as add_trace_parser

    add_dlq_parser(sub)
    add_credentials_parser(sub)
    add_trace_parser(sub)
    from loom.cli.console import add_parser as add_console_parser

    add_console_parser(sub)
    from loom.cli.incidents import add_parser as add_incidents_parser

    add_incidents_parser(sub)
    from loom.cli.usage import add_parser as add_usage_parser

    add_usage_parser(sub)
    from loom.cli.migrations import add_parser as add_migrations_parser

    add_migrations_parser(sub)
    p = add("demo", cmd_demo, "start the stack, run the example workload, show progress and a summary")
    p.add_argument(
        "--workload", type=Path, default=None, help="job file (default: examples/demo-workload.yaml)"
    )
    p.add_argument("--time-scale", type=float, default=600.0)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--down", action="store_true", help="stop the stack when the demo ends")
    p = add("calibrate", cmd_calibrate, "measure this machine's performance profile (SCU input)")
    p.add_argument("--quick", action="store_true", help="fewer sizes and repeats (< 2 s on a CPU)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--model", help="GPU model name for the profile (default: from the device name)")
    p.add_argument("--json", action="store_true")
    p = add("bench", cmd_bench, "benchmarks (JSON out)")
    from loom_benchmarks import add_arguments

    add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Console entry point."""
    words = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(words)
    args.given = [w.split("=", 1)[0] for w in words if w.startswith("--")]  # what was said, not defaulted
    # Library warnings go to stderr, so `--json` output on stdout stays parseable.
    configure_logging("loom-cli", level="WARNING", json=False, stream=sys.stderr)
    # asyncio's note on every TLS connection nats-py closes (its protocol's eof_received returns
    # True): a line before each command's output on a stack off loopback, and nothing to act on.
    logging.getLogger("asyncio").addFilter(lambda record: "eof_received()" not in record.getMessage())
    try:
        code: int = args.fn(args)
    except BrokenPipeError:
        # The reader went away (``loom view --json | head``): no traceback, nothing more to write.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 0
    except InvalidInputError as exc:  # bad input a command did not catch itself: still exit 2
        err.print(f"[red]{escape(str(exc))}[/red]")
        code = 2
    except (QueryError, BusError) as exc:
        err.print(f"[red]{escape(str(exc))}[/red]")
        code = 1
    except RuntimeError as exc:
        err.print(f"[red]{exc}[/red]")
        code = 1
    except KeyboardInterrupt:
        code = 130
    return code


if __name__ == "__main__":
    sys.exit(main())


def entry() -> None:
    """The ``loom`` console script."""
    sys.exit(main())
