"""A job's trace as people read it: the trace id from the job's stored context, the Jaeger link,
and the span tree from Jaeger's query API (``GET /api/traces/<trace id>``).

Pure parsing and formatting; :func:`fetch_trace` is the only I/O (one HTTP GET, stdlib).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "JAEGER_URL_ENV",
    "TraceSpan",
    "fetch_trace",
    "jaeger_link",
    "parse_jaeger_trace",
    "render_tree",
    "trace_id_of",
]

JAEGER_URL_ENV = "LOOM_JAEGER_URL"
"""Base URL of Jaeger (UI and query API share it in all-in-one), e.g. ``http://localhost:16686``."""

DEFAULT_JAEGER_URL = "http://localhost:16686"
"""Where docker-compose publishes Jaeger's UI."""

_TRACE_ID_HEX = 32


def trace_id_of(carrier: Mapping[str, str] | None) -> str | None:
    """The trace id (32 lowercase hex digits) in a W3C ``traceparent`` carrier, or None.

    ``{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}`` gives
    ``4bf92f3577b34da6a3ce929d0e0e4736``; a missing, malformed or all-zero id gives None.
    """
    if not carrier:
        return None
    parts = str(carrier.get("traceparent", "")).strip().lower().split("-")
    if len(parts) < 4 or len(parts[1]) != _TRACE_ID_HEX:
        return None
    trace_id = parts[1]
    if trace_id == "0" * _TRACE_ID_HEX or any(c not in "0123456789abcdef" for c in trace_id):
        return None
    return trace_id


def jaeger_link(trace_id: str, base_url: str | None = None) -> str:
    """The Jaeger UI page of a trace."""
    return f"{(base_url or DEFAULT_JAEGER_URL).rstrip('/')}/trace/{trace_id}"


@dataclass
class TraceSpan:
    """One span of a fetched trace, with its children in start order."""

    span_id: str
    parent_id: str | None
    name: str
    service: str
    start_us: int
    duration_us: int
    error: bool = False
    children: list[TraceSpan] = field(default_factory=list)


def _tag(span: Mapping[str, Any], key: str) -> Any:
    for tag in span.get("tags") or []:
        if tag.get("key") == key:
            return tag.get("value")
    return None


def parse_jaeger_trace(body: Mapping[str, Any], trace_id: str) -> list[TraceSpan]:
    """The root spans (children attached) of ``trace_id`` in a query-API answer.

    A span whose parent is not in the answer (not yet exported, or sampled out in a process that
    started it) is shown as a root, so nothing received is hidden. Raises ValueError when the
    answer holds no such trace.
    """
    traces = [
        t
        for t in body.get("data") or []
        if str(t.get("traceID", "")).lower().lstrip("0") == trace_id.lstrip("0")
    ]
    if not traces:
        raise ValueError(f"Jaeger has no trace {trace_id}")
    processes: Mapping[str, Any] = traces[0].get("processes") or {}
    spans: dict[str, TraceSpan] = {}
    for raw in traces[0].get("spans") or []:
        parent = next(
            (r.get("spanID") for r in raw.get("references") or [] if r.get("refType") == "CHILD_OF"), None
        )
        process = processes.get(str(raw.get("processID", ""))) or {}
        spans[str(raw["spanID"])] = TraceSpan(
            span_id=str(raw["spanID"]),
            parent_id=str(parent) if parent else None,
            name=str(raw.get("operationName", "?")),
            service=str(process.get("serviceName", "?")),
            start_us=int(raw.get("startTime", 0)),
            duration_us=int(raw.get("duration", 0)),
            error=_tag(raw, "error") in (True, "true") or _tag(raw, "otel.status_code") == "ERROR",
        )
    roots: list[TraceSpan] = []
    for span in spans.values():
        parent_span = spans.get(span.parent_id) if span.parent_id else None
        (parent_span.children if parent_span is not None else roots).append(span)
    for span in spans.values():
        span.children.sort(key=lambda s: (s.start_us, s.span_id))
    roots.sort(key=lambda s: (s.start_us, s.span_id))
    return roots


def render_tree(roots: list[TraceSpan]) -> list[str]:
    """One line per span, indented under its parent: offset from the trace's start, duration,
    service and name (``!`` marks an error)."""
    if not roots:
        return []
    origin = min(r.start_us for r in roots)
    lines: list[str] = []

    def walk(span: TraceSpan, depth: int) -> None:
        mark = "!" if span.error else " "
        lines.append(
            f"{(span.start_us - origin) / 1e6:>9.3f}s {span.duration_us / 1e3:>9.1f}ms {mark} "
            f"{'  ' * depth}{span.service}: {span.name}"
        )
        for child in span.children:
            walk(child, depth + 1)

    for root in roots:
        walk(root, 0)
    return lines


def fetch_trace(
    base_url: str,
    trace_id: str,
    *,
    timeout_s: float = 5.0,
    name: str = "Jaeger",
    headers: dict[str, str] | None = None,
) -> dict[str, Any]:
    """``GET <base_url>/api/traces/<trace_id>`` from Jaeger's query API (or a store answering it:
    ``name`` says which in errors), decoded; ``headers`` go with the request (a secured trace
    store's bearer token).

    Raises ValueError for an answer that is not JSON, OSError when it cannot be reached, and
    LookupError when it does not know the trace (404).
    """
    url = f"{base_url.rstrip('/')}/api/traces/{trace_id}"
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url, headers=headers or {}), timeout=timeout_s
        ) as answer:
            raw = answer.read()
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            raise LookupError(
                f"{name} at {base_url} has no trace {trace_id} (yet: spans arrive within seconds of"
                " ending; none ever do for a job submitted with an unsampled traceparent, flags 00)"
            ) from exc
        if exc.code == 401:
            raise OSError(
                f"{name} at {base_url} refused the request: it needs the stack's bearer token"
            ) from exc
        raise OSError(f"{name} at {base_url} answered {exc.code}") from exc
    except urllib.error.URLError as exc:
        raise OSError(f"{name} at {base_url} cannot be reached: {exc.reason}") from exc
    try:
        body: dict[str, Any] = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{name} at {base_url} did not answer JSON") from exc
    return body
