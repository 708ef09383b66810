"""``loom trace JOB``: the job's trace id, its Jaeger link, and its span tree when Jaeger answers,
or the stack's own trace store (``loom up --traces``, which answers Jaeger's query API).

The parsing lives in :mod:`loom.telemetry.jaeger`; this module asks placement for the job's
record (its stored trace context) and prints.
"""

import argparse
import asyncio
import os
from typing import Any

from rich.markup import escape

from loom.bus.connection import BusError
from loom.cli.output import console, err
from loom.client import LoomClient, QueryError
from loom.security.http_token import bearer_header
from loom.telemetry.jaeger import (
    DEFAULT_JAEGER_URL,
    JAEGER_URL_ENV,
    fetch_trace,
    jaeger_link,
    parse_jaeger_trace,
    render_tree,
)


def add_parser(sub: Any) -> None:
    """Register ``loom trace`` on the top-level subparsers."""
    help_ = (
        "a job's trace: id, Jaeger link, and the span tree from Jaeger's query API"
        " or from the stack's trace store (loom up --traces)"
    )
    p: argparse.ArgumentParser = sub.add_parser("trace", help=help_, description=help_)
    p.add_argument("job_id")
    p.add_argument(
        "--jaeger",
        default=os.environ.get(JAEGER_URL_ENV),
        help=f"Jaeger's base URL (default: ${JAEGER_URL_ENV}, else the stack's trace store when it was"
        " started with --traces; without either only the id and link print)",
    )
    p.set_defaults(fn=cmd_trace)


def _from_files(job_id: str, exc: Exception) -> dict[str, Any] | None:
    """The job's trace id from the stack's trace files when placement cannot be asked (printed
    why), or None when they do not name it (the question's error printed)."""
    from loom.runtime.config import loom_home
    from loom.telemetry.spanstore import SpanFile

    stored = SpanFile(loom_home() / "traces")
    trace_id = stored.trace_of_job(job_id) if stored.current.exists() else None
    if trace_id is None:
        err.print(f"[red]{escape(str(exc))}[/red]")
        return None
    err.print(f"placement did not answer ({escape(str(exc))}); the trace store's files name the job")
    return {"trace_id": trace_id}


def cmd_trace(args: argparse.Namespace) -> int:
    """Print the job's trace id and link; with Jaeger configured, its span tree."""
    from loom.cli.main import _client

    async def get() -> dict[str, Any] | None:
        client: LoomClient = await _client()
        try:
            return await client.job(args.job_id)
        finally:
            await client.close()

    try:
        job = asyncio.run(get())
    except (QueryError, BusError) as exc:
        # No service answers (the stack is down): its trace store's files may still name the job.
        job = _from_files(args.job_id, exc)
        if job is None:
            return 1
    if job is None:
        err.print(f"[red]no job {escape(args.job_id)}[/red]")
        return 1
    trace_id = job.get("trace_id")
    if not trace_id:
        err.print(f"[red]{escape(args.job_id)} has no trace context (submitted without one)[/red]")
        return 1
    console.print(f"trace {trace_id}")
    source, name = args.jaeger, "Jaeger"
    headers: dict[str, str] = {}
    if source:
        console.print(f"jaeger {jaeger_link(trace_id, source)}")
    else:
        from loom.runtime import stack
        from loom.runtime.config import loom_home
        from loom.telemetry.spanstore import SpanFile, jaeger_answer

        source = stack.trace_store_url(loom_home())
        stored = SpanFile(loom_home() / "traces")
        if not source and not stored.current.exists():
            console.print(f"jaeger {jaeger_link(trace_id, None)}")
            console.print(
                f"(set {JAEGER_URL_ENV} or --jaeger, e.g. {DEFAULT_JAEGER_URL}, or start the stack with"
                " `loom up --traces`, to print the span tree)"
            )
            return 0
        name = "the stack's trace store"
        if not source:  # its store is gone with the stack (or another is asked): its files remain
            console.print(f"trace store {stored.directory} (its files)", highlight=False)
            answer = jaeger_answer(trace_id, stored.trace(trace_id))
            if answer is None:
                err.print(f"[red]no span of trace {trace_id} in {stored.directory}[/red]")
                return 1
            for line in render_tree(parse_jaeger_trace(answer, trace_id)):
                console.print(escape(line), highlight=False)
            return 0
        console.print(f"trace store {source} (loom up --traces)", highlight=False)
        headers = bearer_header(stack.local_http_token(loom_home()))
    try:
        roots = parse_jaeger_trace(fetch_trace(source, trace_id, name=name, headers=headers), trace_id)
    except (OSError, LookupError, ValueError, QueryError) as exc:
        err.print(f"[red]{escape(str(exc))}[/red]")
        return 1
    for line in render_tree(roots):
        console.print(escape(line), highlight=False)
    return 0
