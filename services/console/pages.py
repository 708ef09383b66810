"""The console's pages as HTML strings: pure functions of the data a request gathered.

Every value shown goes through :func:`esc`. Live parts carry ``data-*`` attributes that
``console.js`` updates from the event stream (rows of the jobs table, the job page's state and
timeline); everything else is rendered on the server.
"""

import csv
import html
import io
import json
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import quote, urlencode

import msgspec

from loom.metering.usage import USAGE_FIELDS, usage_fields
from loom.runtime.tokens import Access
from loom.store.console import UsageTotal
from loom_proto.alerts import IncidentChange
from loom_proto.jobs import TERMINAL_STATES
from loom_proto.migrations import MAX_DRAIN_CONCURRENCY
from loom_services.console.geo import Placed
from loom_services.console.land import LAND_PATH

STATES = ("waiting", "queued", "placed", "running", "completed", "failed", "rejected", "cancelled")


def esc(value: object) -> str:
    """Text safe inside HTML (and inside a quoted attribute)."""
    return html.escape("" if value is None else str(value), quote=True)


def _when(unix_s: float | None) -> str:
    if not unix_s:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(unix_s))


def layout(title: str, access: Access | None, body: str, *, active: str = "", events: str = "") -> str:
    """The frame of every page: navigation, who is signed in, the body; ``events``: the URL of the
    event stream the page follows (none: a static page)."""
    nav = ""
    if access is not None:
        links = [("map", "/", "Map"), ("resources", "/resources", "Resources"), ("jobs", "/jobs", "Jobs")]
        links += [
            ("queue", "/queue", "Queue"),
            ("incidents", "/incidents", "Incidents"),
            ("usage", "/usage", "Usage"),
        ]
        items = "".join(
            f'<a href="{href}"{" class=active" if key == active else ""}>{label}</a>'
            for key, href, label in links
        )
        who = "operator" if access.is_operator else f"tenant {esc(access.tenant)}"
        nav = f'<nav>{items}<span class="who" data-role="{esc(access.role)}">{who}</span></nav>'
    stream = f' data-events="{esc(events)}"' if events else ""
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        '<meta name=viewport content="width=device-width, initial-scale=1">'
        f"<title>{esc(title)} · Loom</title>"
        '<link rel=stylesheet href="/static/console.css"></head>'
        f"<body{stream}><header><strong>Loom</strong>{nav}</header>"
        f"<main><h1>{esc(title)}</h1>{body}</main>"
        '<script src="/static/console.js"></script></body></html>'
    )


def error_page(status: int, message: str, access: Access | None = None) -> str:
    """A page that says what went wrong (401, 403, 404, 501, 503)."""
    titles = {
        400: "Bad request",
        401: "Sign in",
        403: "Not yours",
        404: "Not found",
        409: "Not done",
        501: "Not available",
        503: "Unavailable",
    }
    return layout(
        titles.get(status, "Error"), access, f'<p class="error" data-status="{status}">{esc(message)}</p>'
    )


FORM_STALE = "This form is stale or did not come from this console: reload the page and try again."

NOTICES = {
    "cancel": "Cancelled: placement took the job off the queue or stopped it, and freed its GPUs.",
    "cancel-pending": "Cancel requested: placement has not recorded it yet; this page shows it when it does.",
    "cancel-live": "Cancel requested: this page shows the job cancelled as soon as placement records it.",
    "drain": "Draining: the cluster takes no new work; its jobs move elsewhere at checkpoint boundaries.",
    "undrain": "Open again: the cluster takes new work.",
    "ack": "Acknowledged.",
}


NOTICE_PAGES = {
    "cancel": "job",
    "cancel-pending": "job",
    "cancel-live": "job",
    "drain": "cluster",
    "undrain": "cluster",
    "ack": "incident",
}
"""The page each action redirects to: a notice is shown there only."""


def notice_of(done: str | None, page: str, *, holds: bool = True) -> str | None:
    """The sentence an action's redirect asks for (``?done=``): only these, never the query's
    text, only on the kind of ``page`` the action redirects to, and only while what it says
    ``holds`` (a crafted link to a completed job's page does not say it was cancelled)."""
    key = done or ""
    return NOTICES.get(key) if NOTICE_PAGES.get(key) == page and holds else None


def _notice(notice: str | None) -> str:
    return f"<p class=notice role=status>{esc(notice)}</p>" if notice else ""


def _key_field(form_key: str) -> str:
    return f'<input type=hidden name=form_key value="{esc(form_key)}">'


# ---- map ------------------------------------------------------------------------------------------


LOW_COST_MS = 80.0
HIGH_COST_MS = 180.0


def link_cost_ms(link: Mapping[str, Any]) -> float:
    """A link's routing cost (milliseconds-equivalent: RTT, jitter, loss, transfer time); the RTT
    when it has not been measured yet."""
    cost = link.get("cost")
    return float(cost if cost is not None else link.get("rtt_ms") or 0.0)


def link_colour(link: Mapping[str, Any]) -> str:
    """Degraded or unusable links red; otherwise by cost: green below 80 ms, amber below 180 ms, red."""
    if link.get("degraded") or not link.get("usable", True):
        return "#d62728"
    cost = link_cost_ms(link)
    if cost < LOW_COST_MS:
        return "#2ca02c"
    if cost < HIGH_COST_MS:
        return "#e6a700"
    return "#d62728"


def water_bar(used: float, total: float) -> str:
    """A bar of GPUs in use or reserved over all GPUs, with the percentage."""
    level = used / total if total else 0.0
    return (
        f'<span class=bar title="{used:g} of {total:g} GPUs in use or reserved">'
        f'<span style="width:{level * 100:.0f}%"></span></span> {level * 100:.0f}%'
    )


def _used(totals: Mapping[str, Any]) -> float:
    return float(totals.get("gpus_used", 0)) + float(totals.get("gpus_reserved", 0))


def map_page(
    access: Access,
    regions: Sequence[tuple[str, str]],
    placed: Mapping[str, Placed],
    view: Mapping[str, Any],
    links: Sequence[Mapping[str, Any]],
    *,
    links_measured: bool,
) -> str:
    """The world map: every region (GPUs free / total, water level) and every measured link."""
    parts = [
        '<svg class=map viewBox="0 0 1000 500" role=img aria-label="regions and links">',
        "<rect width=1000 height=500 class=sea />",
        f'<path class=land d="{LAND_PATH}" />',  # Natural Earth 1:110m (public domain)
    ]
    for lon in range(-150, 180, 30):
        x = (lon + 180) / 360 * 1000
        parts.append(f'<line class=grid x1="{x:.0f}" y1="0" x2="{x:.0f}" y2="500" />')
    for lat in range(-60, 90, 30):
        y = (90 - lat) / 180 * 500
        parts.append(f'<line class=grid x1="0" y1="{y:.0f}" x2="1000" y2="{y:.0f}" />')
    drawn: set[tuple[str, str]] = set()
    for link in links:
        src, dst = str(link["src"]), str(link["dst"])
        a, b = placed.get(src), placed.get(dst)
        if a is None or b is None or (dst, src) in drawn:
            continue
        drawn.add((src, dst))
        rtt_ms, cost = float(link.get("rtt_ms") or 0), link_cost_ms(link)
        title = f"{src} → {dst}: rtt {rtt_ms:.0f} ms, cost {cost:.0f} ms"
        if link.get("degraded"):
            title += ", degraded"
        dash = ' stroke-dasharray="6 4"' if link.get("degraded") else ""
        parts.append(
            f'<line class=link data-src="{esc(src)}" data-dst="{esc(dst)}" x1="{a.x}" y1="{a.y}" '
            f'x2="{b.x}" y2="{b.y}" stroke="{link_colour(link)}"{dash}><title>{esc(title)}</title></line>'
        )
    by_region = view.get("regions", {})
    for rid, _name in regions:
        p = placed[rid]
        totals = by_region.get(rid, {})
        total = float(totals.get("gpus_total", 0))
        label = f"{rid} · {totals.get('gpus_free', 0)}/{total:g} free"
        parts.append(
            f'<a href="/resources/{quote(rid)}"><g class=region data-region="{esc(rid)}">'
            f'<circle cx="{p.x}" cy="{p.y}" r="7" />'
            f'<text x="{p.x + 10}" y="{p.y + 4}">{esc(label)}{"" if p.known else " (position unknown)"}'
            "</text></g></a>"
        )
    parts.append("</svg>")
    legend = (
        "<p class=legend>Links by cost: <span style=color:#2ca02c>■ under 80 ms</span> "
        "<span style=color:#e6a700>■ under 180 ms</span> "
        "<span style=color:#d62728>■ higher, or degraded</span> "
        "(dashed: degraded). "
        + (
            "Measured by network-perception."
            if links_measured
            else "Not measured yet: the topology's figures are shown."
        )
        + "</p>"
    )
    rows = "".join(
        f"<tr><td>{esc(link['src'])}</td><td>{esc(link['dst'])}</td>"
        f"<td>{float(link.get('rtt_ms') or 0):.1f}</td><td>{_gbps(link.get('bandwidth_gbps'))}</td>"
        f"<td>{link_cost_ms(link):.0f}</td><td>{'yes' if link.get('degraded') else 'no'}</td></tr>"
        for link in links
    )
    table = (
        "<h2>Links</h2><table class=links><tr><th>from</th><th>to</th><th>rtt ms</th>"
        f"<th>Gbps</th><th>cost ms</th><th>degraded</th></tr>{rows}</table>"
    )
    return layout("World map", access, "".join(parts) + legend + table, active="map")


def _gbps(value: object) -> str:
    return "-" if value is None else f"{float(str(value)):g}"


# ---- resources ------------------------------------------------------------------------------------


def _crumbs(path: Sequence[str]) -> str:
    items = ['<a href="/resources">all regions</a>']
    for i, name in enumerate(path):
        href = "/resources/" + "/".join(quote(p) for p in path[: i + 1])
        items.append(f'<a href="{href}">{esc(name)}</a>')
    return "<p class=crumbs>" + " › ".join(items) + "</p>"


def _level_table(
    kind: str,
    base: str,
    children: Mapping[str, Any],
    *,
    trust: bool = False,
    drains: Mapping[str, str] | None = None,
) -> str:
    head = f"<tr><th>{kind}</th><th>GPUs</th><th>free</th><th>water level</th>"
    head += "<th>trust</th><th>heartbeat age</th><th>drain</th></tr>" if trust else "</tr>"
    rows = []
    for name, totals in sorted(children.items()):
        href = f"{base}/{quote(name)}"
        total = float(totals.get("gpus_total", 0))
        row = (
            f'<tr data-{kind}="{esc(name)}"><td><a href="{href}">{esc(name)}</a></td>'
            f"<td>{total:g}</td><td>{esc(totals.get('gpus_free', 0))}</td>"
            f"<td>{water_bar(_used(totals), total)}</td>"
        )
        if trust:
            stale = " <span class=bad>stale</span>" if totals.get("stale") else ""
            trust_now, age_s = float(totals.get("trust", 1.0)), float(totals.get("age_s", 0))
            row += f"<td>{trust_now:.2f}</td><td>{age_s:.1f} s{stale}</td>"
            drain = (drains or {}).get(name)
            row += f'<td class=drain data-drain="{esc(drain)}">{esc(drain)}</td>' if drain else "<td>-</td>"
        rows.append(row + "</tr>")
    return f"<table>{head}{''.join(rows)}</table>"


def resources_page(
    access: Access,
    view: Mapping[str, Any],
    path: Sequence[str],
    *,
    drains: Mapping[str, str] | None = None,
    form_key: str = "",
    notice: str | None = None,
) -> str:
    """Region → zone → cluster → node, each level with its GPUs, water level and (clusters) trust
    and drain state (``drains``: cluster → draining / drained)."""
    drains = drains or {}
    regions = view.get("regions", {})
    title = "Resources" if not path else " / ".join(path)
    body = _notice(notice) + _crumbs(path)
    if not path:
        body += _level_table("region", "/resources", regions)
    elif len(path) == 1:
        body += _level_table("zone", f"/resources/{quote(path[0])}", regions[path[0]]["zones"])
    elif len(path) == 2:
        clusters = regions[path[0]]["zones"][path[1]]["clusters"]
        body += _level_table(
            "cluster", f"/resources/{quote(path[0])}/{quote(path[1])}", clusters, trust=True, drains=drains
        )
    else:
        cluster = regions[path[0]]["zones"][path[1]]["clusters"][path[2]]
        total = float(cluster.get("gpus_total", 0))
        stale = " · <span class=bad>stale</span>" if cluster.get("stale") else ""
        body += (
            f"<p>trust {float(cluster.get('trust', 1.0)):.2f} · heartbeat"
            f" {float(cluster.get('age_s', 0)):.1f} s ago"
            f" (stale after {float(cluster.get('ttl_s', 0)):.0f} s)"
            f"{stale} · water level {water_bar(_used(cluster), total)}</p>"
        )
        drain = drains.get(path[2])
        if drain:
            body += (
                f'<p class=drain data-drain="{esc(drain)}">This cluster is <b>{esc(drain)}</b>:'
                " it takes no new work.</p>"
            )
        body += _drain_button(access, path[2], drained=drain is not None)
        rows = "".join(
            f'<tr data-node="{esc(n["node"])}"><td>{esc(n["node"])}</td>'
            f"<td>{esc(n.get('gpu_model') or '-')}</td>"
            f"<td>{esc(n['gpus_total'])}</td><td>{esc(n['gpus_used'])}</td><td>{esc(n['gpus_reserved'])}</td>"
            f"<td>{water_bar(float(n['gpus_used']) + float(n['gpus_reserved']), float(n['gpus_total']))}</td>"
            f"<td>{'yes' if n.get('healthy', True) else '<span class=bad>no</span>'}</td></tr>"
            for n in cluster.get("nodes", [])
        )
        body += (
            "<table><tr><th>node</th><th>GPU</th><th>GPUs</th><th>used</th><th>reserved</th>"
            f"<th>water level</th><th>healthy</th></tr>{rows}</table>"
        )
    return layout(title, access, body, active="resources")


def _drain_button(access: Access, cluster: str, *, drained: bool) -> str:
    """The operator's way to the drain (or undrain) confirmation."""
    if not access.is_operator:
        return ""
    verb = "undrain" if drained else "drain"
    label = f"Undrain {cluster}…" if drained else f"Drain {cluster}…"
    return (
        f'<p><a class=button data-action={verb} href="/clusters/{quote(cluster)}/{verb}">{esc(label)}</a></p>'
    )


def confirm_drain(
    access: Access, cluster: str, verb: str, running: int, form_key: str, *, back: str = "/resources"
) -> str:
    """The confirmation step of a drain or an undrain (``back``: the cluster's page)."""
    if verb == "undrain":
        text = f"Open {cluster} to new work again? Moves planned by its drain and not started are dropped."
        options = ""
    else:
        text = (
            f"Drain {cluster}? It takes no new work, and its {running} running job(s) move to other"
            " clusters at their checkpoint boundaries. Refused when a job has nowhere else to go,"
            " unless forced."
        )
        options = (
            "<label>moves at a time <input name=concurrency type=number min=1"
            f" max={MAX_DRAIN_CONCURRENCY} value=2></label> "
            "<label><input name=force type=checkbox> force</label> "
        )
    return layout(
        f"{verb.capitalize()} {cluster}",
        access,
        f'<p>{esc(text)}</p><form method=post action="/clusters/{quote(cluster)}/{verb}">'
        f"{_key_field(form_key)}{options}<button class=danger>Yes, {verb} {esc(cluster)}</button></form>"
        f'<p><a href="{esc(back)}">No, back to {esc(cluster)}</a></p>',
        active="resources",
    )


def confirm_cancel(access: Access, job: Mapping[str, Any], form_key: str) -> str:
    """The confirmation step of a cancel."""
    jid = str(job["job_id"])
    state = str(job["state"])
    if state in TERMINAL_STATES:
        body = f"<p>{esc(jid)} has already ended ({esc(state)}): nothing to cancel.</p>"
    else:
        body = (
            f"<p>Cancel {esc(jid)} of tenant {esc(job['tenant'])}, now {esc(state)}? A queued job leaves"
            " the queue; a running one is stopped on every cluster and its GPUs are freed. It cannot be"
            " undone.</p>"
            f'<form method=post action="/jobs/{quote(jid)}/cancel">{_key_field(form_key)}'
            f"<button class=danger>Yes, cancel {esc(jid)}</button></form>"
        )
    body += f'<p><a href="/jobs/{quote(jid)}">No, back to the job</a></p>'
    return layout(f"Cancel {jid}", access, body, active="jobs")


# ---- jobs -----------------------------------------------------------------------------------------


def job_row(job: Mapping[str, Any]) -> str:
    """One row of the jobs table (also the shape console.js builds for a new job)."""
    jid = str(job["job_id"])
    return (
        f'<tr data-job="{esc(jid)}" data-history="{esc(job["state"])}">'
        f'<td><a href="/jobs/{quote(jid)}">{esc(jid)}</a></td><td>{esc(job["tenant"])}</td>'
        f'<td data-field=state class="state {esc(job["state"])}">{esc(job["state"])}</td>'
        f"<td data-field=cluster>{esc(job.get('cluster') or '-')}</td>"
        f"<td data-field=progress>{float(job.get('progress') or 0) * 100:.0f}%</td>"
        f"<td>{_when(job.get('submitted_at'))}</td></tr>"
    )


def jobs_page(
    access: Access,
    jobs: Sequence[Mapping[str, Any]],
    *,
    tenant: str | None,
    state: str | None,
    counts: Mapping[str, int],
    limit: int,
) -> str:
    """Newest jobs first, filtered by state (and tenant, for the operator); rows follow the event stream."""
    options = "".join(
        f'<option value="{s}"{" selected" if s == state else ""}>{s} ({counts.get(s, 0)})</option>'
        for s in STATES
    )
    tenant_field = (
        f'<label>tenant <input name=tenant value="{esc(tenant or "")}"></label> '
        if access.is_operator
        else ""
    )
    form = (
        f"<form class=filters method=get action=/jobs>{tenant_field}"
        f'<label>state <select name=state><option value="">any</option>{options}</select></label> '
        f'<label>show <input name=limit type=number min=1 max=1000 value="{limit}"></label> '
        "<button>Filter</button></form>"
    )
    rows = "".join(job_row(j) for j in jobs)
    table = (
        f'<table class=jobs data-live-jobs data-filter-state="{esc(state or "")}" '
        f'data-filter-tenant="{esc(tenant or "")}"><thead><tr><th>job</th><th>tenant</th><th>state</th>'
        f"<th>cluster</th><th>progress</th><th>submitted (UTC)</th></tr></thead><tbody>{rows}</tbody></table>"
    )
    if not jobs:
        table += (
            "<p class=empty>No job matches these filters yet; new ones appear here as they are submitted.</p>"
        )
    query = urlencode({k: v for k, v in (("tenant", tenant), ("state", state)) if v})
    return layout(
        "Jobs", access, form + table, active="jobs", events="/events" + (f"?{query}" if query else "")
    )


def _event_line(event: Mapping[str, Any]) -> str:
    body = event.get("event") or {}
    details = []
    for key in ("cluster", "attempt", "step", "steps", "reason", "code"):
        if key in body and body[key] not in (None, ""):
            details.append(f"{key} {body[key]}")
    return (
        f'<li data-kind="{esc(event["kind"])}"><time>{_when(event.get("at"))}</time> '
        f"<b>{esc(event['kind'])}</b> {esc(', '.join(str(d) for d in details))}</li>"
    )


def job_page(
    access: Access,
    job: Mapping[str, Any],
    explanation: Iterable[tuple[str, Sequence[str]]],
    *,
    trace_url: str | None,
    notice: str | None = None,
    form_key: str = "",
) -> str:
    """One job: state (live), timeline (live), migrations, placement explanation per attempt,
    trace link; the operator's cancel while it has not ended: a link to the confirmation page,
    which the page's script turns into an in-page confirmation and request (``form_key``) whose
    outcome, the ``cancelled`` event, arrives live on this page."""
    jid = str(job["job_id"])
    state = str(job["state"])
    facts = (
        f'<dl id=job data-job-id="{esc(jid)}" data-history="{esc(state)}">'
        f"<dt>tenant</dt><dd>{esc(job['tenant'])}</dd>"
        f'<dt>state</dt><dd data-field=state class="state {esc(state)}">{esc(state)}</dd>'
        f"<dt>cluster</dt><dd data-field=cluster>{esc(job.get('cluster') or '-')}</dd>"
        f"<dt>progress</dt><dd data-field=progress>{float(job.get('progress') or 0) * 100:.0f}%</dd>"
        f"<dt>attempt</dt><dd>{esc(job.get('attempt'))}</dd>"
        f"<dt>submitted</dt><dd>{_when(job.get('submitted_at'))}</dd>"
        f"<dt>reason</dt><dd data-field=reason>{esc(job.get('reason') or '-')}</dd>"
        "<dt>trace</dt><dd>"
        + (
            f'<a class=trace href="{esc(trace_url)}" target=_blank rel=noopener>open in Jaeger</a>'
            if trace_url
            else "no trace context recorded"
        )
        + "</dd></dl>"
    )
    actions = ""
    if access.is_operator and state not in TERMINAL_STATES:
        question = f"Cancel {jid}? A running job is stopped and its GPUs freed. It cannot be undone."
        actions = (
            f'<p><a class=button data-action=cancel href="/jobs/{quote(jid)}/cancel"'
            f' data-form-key="{esc(form_key)}" data-confirm="{esc(question)}">Cancel job…</a></p>'
        )
    timeline = (
        "<h2>Timeline</h2><ol id=timeline>" + "".join(_event_line(e) for e in job.get("events", [])) + "</ol>"
    )
    blocks = []
    for heading, lines in explanation:
        items = "".join(f"<li>{esc(line)}</li>" for line in lines)
        blocks.append(f"<h3>{esc(heading)}</h3><ul>{items}</ul>")
    stages = [str(stage) for stage in job.get("stage_jobs", [])]
    if not blocks and stages:
        links = ", ".join(f'<a href="/jobs/{quote(stage)}">{esc(stage)}</a>' for stage in stages)
        blocks.append(f"<p>A DAG is not placed itself: each stage is a job of its own. Stages: {links}.</p>")
    explain = "<h2>Placement</h2>" + ("".join(blocks) or "<p>No decision recorded yet.</p>")
    spec = (
        f"<details><summary>spec</summary><pre>{esc(json.dumps(job.get('spec'), indent=2))}</pre></details>"
    )
    return layout(
        f"Job {jid}",
        access,
        _notice(notice)
        + facts
        + actions
        + timeline
        + _migrations(job.get("migrations") or [])
        + explain
        + spec,
        active="jobs",
        events="/events?" + urlencode({"job": jid}),
    )


def _migrations(migrations: Sequence[Mapping[str, Any]]) -> str:
    if not migrations:
        return ""
    rows = "".join(
        f'<tr data-migration="{esc(m.get("migration_id"))}"><td>{_when(m.get("planned_at"))}</td>'
        f'<td>{esc(m.get("cause"))}</td><td class="state {esc(m.get("state"))}">{esc(m.get("state"))}</td>'
        f"<td>{esc(m.get('from_cluster'))} → {esc(m.get('to_cluster') or '?')}</td>"
        f"<td>{esc(m.get('resume_step'))}</td><td>{esc(m.get('lost_steps'))}</td><td>{esc(m.get('why'))}</td></tr>"
        for m in migrations
    )
    return (
        "<h2>Migrations</h2><table class=migrations><tr><th>planned (UTC)</th><th>cause</th><th>state</th>"
        f"<th>from → to</th><th>resume step</th><th>lost steps</th><th>why</th></tr>{rows}</table>"
    )


def queue_page(access: Access, queued: Sequence[Mapping[str, Any]], counts: Mapping[str, int]) -> str:
    """Jobs waiting for capacity, in the order placement considers them (priority, then age)."""
    summary = " · ".join(f"{s} {counts.get(s, 0)}" for s in STATES)
    rows = "".join(
        f'<tr data-job="{esc(j["job_id"])}">'
        f'<td><a href="/jobs/{quote(str(j["job_id"]))}">{esc(j["job_id"])}</a></td>'
        f"<td>{esc(j['tenant'])}</td><td>{esc(j['priority'])}</td><td>{esc(j['gpus'])}</td>"
        f"<td>{_when(j['submitted_at'])}</td><td>{float(j['waiting_s']):.0f} s</td></tr>"
        for j in queued
    )
    table = (
        "<table class=queue><tr><th>job</th><th>tenant</th><th>priority</th><th>GPUs</th>"
        f"<th>submitted (UTC)</th><th>waiting</th></tr>{rows}</table>"
    )
    if not queued:
        table += "<p class=empty>Nothing is waiting.</p>"
    return layout("Queue", access, f"<p class=counts>{esc(summary)}</p>{table}", active="queue")


# ---- incidents ------------------------------------------------------------------------------------

_WORDS = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]*")
WITHHELD = "(withheld: it names other tenants' jobs)"


def scoped_incident(incident: IncidentChange, tenant: str | None) -> IncidentChange:
    """What a viewer may see of an incident: all of it for the operator (``tenant`` None); for a
    tenant, its own jobs only, itself as the only tenant, no DAG list, and any text that names
    another tenant or another tenant's job withheld."""
    if tenant is None:
        return incident
    own = [j for j in incident.jobs if j.tenant == tenant]
    others = {j.job_id for j in incident.jobs if j.tenant != tenant} | {
        t for t in incident.tenants if t != tenant
    }

    def clean(text: str) -> str:
        return WITHHELD if others.intersection(_WORDS.findall(text)) else text

    timeline = [msgspec.structs.replace(e, what=clean(e.what)) for e in incident.timeline]
    return msgspec.structs.replace(
        incident,
        jobs=own,
        jobs_total=len(own),
        tenants=[tenant] if tenant in incident.tenants else [],
        dags=[],
        summary=clean(incident.summary),
        reason=clean(incident.reason),
        root_reason=clean(incident.root_reason),
        timeline=timeline,
    )


def _root(i: IncidentChange) -> str:
    name = i.root.replace("~", " ↔ ") if i.root_kind == "link" else i.root
    return f"{i.root_kind} {name}" + ("" if i.root_known else " (unknown)")


def incidents_page(access: Access, incidents: Sequence[IncidentChange], *, open_only: bool) -> str:
    """Incidents newest first: state, severity, root cause, jobs and tenants hit."""
    rows = "".join(
        f'<tr data-incident="{esc(i.incident_id)}"><td><a href="/incidents/{quote(i.incident_id)}">'
        f'{esc(i.incident_id)}</a></td><td class="inc {esc(i.state)}">{esc(i.state)}</td>'
        f"<td>{esc(i.severity)}</td><td>{esc(_root(i))}</td><td>{i.jobs_total}</td>"
        f"<td>{esc(', '.join(i.tenants[:5]) + ('…' if len(i.tenants) > 5 else ''))}</td>"
        f"<td>{i.alerts}</td><td>{_when(i.opened_at)}</td><td>{esc(i.summary[:120])}</td></tr>"
        for i in incidents
    )
    switch = (
        '<p><a href="/incidents">all incidents</a></p>'
        if open_only
        else '<p><a href="/incidents?open=1">open and acknowledged only</a></p>'
    )
    table = (
        "<table class=incidents><tr><th>incident</th><th>state</th><th>severity</th><th>root cause</th>"
        "<th>jobs</th><th>tenants</th><th>alerts</th><th>opened (UTC)</th><th>summary</th></tr>"
        f"{rows}</table>"
    )
    if not incidents:
        table += "<p class=empty>No incident" + ("" if access.is_operator else " touches your jobs") + ".</p>"
    return layout("Incidents", access, switch + table, active="incidents")


def incident_page(access: Access, i: IncidentChange, *, form_key: str, notice: str | None = None) -> str:
    """One incident (already scoped to the viewer): root cause and why, ranked candidates,
    affected jobs and tenants, timeline; the operator's acknowledge while it is open."""
    facts = (
        f'<dl id=incident data-incident-id="{esc(i.incident_id)}">'
        f'<dt>state</dt><dd class="inc {esc(i.state)}">{esc(i.state)}'
        + (f" (by {esc(i.acked_by)} at {_when(i.acked_at)})" if i.acked_by else "")
        + "</dd>"
        f"<dt>severity</dt><dd>{esc(i.severity)}</dd>"
        f"<dt>root cause</dt><dd class=root>{esc(_root(i))}</dd>"
        f"<dt>why</dt><dd>{esc(i.root_reason or '-')}</dd>"
        f"<dt>summary</dt><dd>{esc(i.summary or '-')}</dd>"
        f"<dt>opened</dt><dd>{_when(i.opened_at)}</dd>"
        f"<dt>resolved</dt><dd>{_when(i.resolved_at)}</dd>"
        f"<dt>alerts</dt><dd>{i.alerts} ({i.distinct_alerts} distinct), re-opened {i.reopened}</dd>"
        + (f"<dt>merged into</dt><dd>{esc(i.merged_into)}</dd>" if i.merged_into else "")
        + "</dl>"
    )
    if len(i.candidates) > 1:
        facts += (
            "<p>Ranked causes: "
            + esc(", ".join(f"{c.kind} {c.name} ({c.score:.2f})" for c in i.candidates[:5]))
            + "</p>"
        )
    action = ""
    if access.is_operator and i.state == "open":
        action = (
            f'<form method=post action="/incidents/{quote(i.incident_id)}/ack">{_key_field(form_key)}'
            "<button>Acknowledge</button></form>"
        )
    if i.unattributed:
        affected = "<h2>Affected</h2><p>No job known (unattributed).</p>"
    else:
        jobs = "".join(
            f'<tr data-job="{esc(j.job_id)}"><td><a href="/jobs/{quote(j.job_id)}">{esc(j.job_id)}</a></td>'
            f"<td>{esc(j.tenant or '-')}</td></tr>"
            for j in i.jobs[:200]
        )
        affected = (
            f"<h2>Affected</h2><p>{i.jobs_total} job(s); tenants: {esc(', '.join(i.tenants) or '-')}"
            + (f"; DAGs: {esc(', '.join(i.dags[:20]))}" if i.dags else "")
            + f"</p><table class=affected><tr><th>job</th><th>tenant</th></tr>{jobs}</table>"
        )
    timeline = "".join(f"<li><time>+{e.at - i.opened_at:.1f} s</time> {esc(e.what)}</li>" for e in i.timeline)
    body = _notice(notice) + facts + action + affected + f"<h2>Timeline</h2><ol id=timeline>{timeline}</ol>"
    return layout(f"Incident {i.incident_id}", access, body, active="incidents")


# ---- usage ----------------------------------------------------------------------------------------


def usage_csv(groups: Sequence[UsageTotal], by: str) -> str:
    """The usage table as CSV, the columns of ``loom usage --csv`` (:data:`USAGE_FIELDS`)."""
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow([by.replace(":", "_"), *USAGE_FIELDS])
    for g in groups:
        fields = usage_fields(
            g.runs,
            g.gpu_ms,
            g.scu_seconds,
            g.cost,
            preempted_gpu_ms=g.preempted_gpu_ms,
            failed_gpu_ms=g.failed_gpu_ms,
        )
        writer.writerow([g.key, *(fields[c] for c in USAGE_FIELDS)])
    return out.getvalue()


def amount(value: float) -> str:
    """A usage figure with the digits that matter: ``1,234``, ``12.35``, ``0.00123``."""
    if value == 0:
        return "0"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 1:
        return f"{value:,.2f}"
    return f"{value:.3g}"


def bar_chart(title: str, items: Sequence[tuple[str, float]], unit: str) -> str:
    """A horizontal bar chart as inline SVG (one bar per item, longest = the largest value)."""
    top = max((v for _k, v in items), default=0.0)
    row_h, label_w, bar_w = 22, 180, 560
    parts = [
        f'<svg class=chart role=img aria-label="{esc(title)}" width="{label_w + bar_w + 110}" '
        f'height="{row_h * len(items) + 8}">'
    ]
    for n, (key, value) in enumerate(items):
        y = 4 + n * row_h
        width = bar_w * value / top if top > 0 else 0.0
        parts.append(
            f'<g class=bar-row data-key="{esc(key)}"><text x="{label_w - 6}" y="{y + 15}" text-anchor=end>'
            f'{esc(key[:28])}</text><rect x="{label_w}" y="{y + 3}" width="{width:.1f}" height="{row_h - 6}">'
            f"<title>{esc(key)}: {value:,.3f} {esc(unit)}</title></rect>"
            f'<text x="{label_w + width + 6:.1f}" y="{y + 15}">{amount(value)}</text></g>'
        )
    parts.append("</svg>")
    return f"<figure><figcaption>{esc(title)}</figcaption>{''.join(parts)}</figure>"


def usage_page(
    access: Access,
    groups: Sequence[UsageTotal],
    total: UsageTotal,
    *,
    by: str,
    tenant: str | None,
    since: str,
    until: str,
    by_choices: Sequence[str],
) -> str:
    """GPU-hours, SCU-hours and cost by the chosen key over a range, charted, with a CSV link;
    ``total`` counts distinct runs (one spanning two groups is one run)."""
    options = "".join(f"<option{' selected' if b == by else ''}>{esc(b)}</option>" for b in by_choices)
    tenant_field = (
        f'<label>tenant <input name=tenant value="{esc(tenant or "")}"></label> '
        if access.is_operator
        else ""
    )
    form = (
        f"<form class=filters method=get action=/usage>{tenant_field}"
        f"<label>by <select name=by>{options}</select></label> "
        f'<label>since <input name=since value="{esc(since)}" placeholder="7d or 2026-12-01"></label> '
        f'<label>until <input name=until value="{esc(until)}" placeholder="now"></label> '
        "<button>Show</button></form>"
    )
    query = {"by": by, "since": since, "until": until}
    if access.is_operator and tenant:
        query["tenant"] = tenant
    csv_link = f'<p><a class=csv href="/usage.csv?{esc(urlencode(query))}" download>Download CSV</a></p>'
    rows = "".join(
        f'<tr data-key="{esc(g.key)}"><td>{esc(g.key)}</td><td>{g.runs}</td>'
        f"<td>{amount(g.gpu_ms / 3_600_000)}</td><td>{amount(g.scu_seconds / 3600)}</td>"
        f"<td>{amount(g.cost)}</td></tr>"
        for g in groups
    )
    table = (
        f"<table class=usage><tr><th>{esc(by)}</th><th>runs</th><th>GPU-hours</th><th>SCU-hours</th>"
        f"<th>cost</th></tr>{rows}<tr class=total><td>total</td><td>{total.runs}</td>"
        f"<td>{amount(total.gpu_ms / 3_600_000)}</td><td>{amount(total.scu_seconds / 3600)}</td>"
        f"<td>{amount(total.cost)}</td></tr></table>"
    )
    shown = sorted(groups, key=lambda g: -g.gpu_ms)[:25]
    charts = ""
    if groups:
        charts = bar_chart(
            f"GPU-hours by {by}" + (" (top 25)" if len(groups) > 25 else ""),
            [(g.key, g.gpu_ms / 3_600_000) for g in shown],
            "GPU-hours",
        ) + bar_chart(f"cost by {by}", [(g.key, g.cost) for g in shown], "")
    else:
        table += (
            "<p class=empty>No metered usage in this range"
            + ("" if access.is_operator else " for you")
            + ".</p>"
        )
    scope = "" if access.is_operator else f"<p>Tenant {esc(access.tenant)}: your own usage only.</p>"
    return layout("Usage", access, scope + form + csv_link + charts + table, active="usage")
