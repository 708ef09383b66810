"""The console's pages as HTML strings: pure functions of the data a request gathered.

Every value shown goes through :func:`esc`. Live parts carry ``data-*`` attributes that
``console.js`` updates from the event stream (rows of the jobs table, the job page's state and
timeline); everything else is rendered on the server.
"""

import html
import json
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import quote, urlencode

from loom.runtime.tokens import Access
from loom_services.console.geo import Placed

STATES = ("waiting", "queued", "placed", "running", "completed", "failed", "rejected", "cancelled")
TERMINAL = frozenset({"completed", "failed", "rejected", "cancelled"})


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
        links.append(("queue", "/queue", "Queue"))
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
    titles = {401: "Sign in", 403: "Not yours", 404: "Not found", 501: "Not available", 503: "Unavailable"}
    return layout(
        titles.get(status, "Error"), access, f'<p class="error" data-status="{status}">{esc(message)}</p>'
    )


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


def _level_table(kind: str, base: str, children: Mapping[str, Any], *, trust: bool = False) -> str:
    head = f"<tr><th>{kind}</th><th>GPUs</th><th>free</th><th>water level</th>"
    head += "<th>trust</th><th>heartbeat age</th></tr>" if trust else "</tr>"
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
        rows.append(row + "</tr>")
    return f"<table>{head}{''.join(rows)}</table>"


def resources_page(access: Access, view: Mapping[str, Any], path: Sequence[str]) -> str:
    """Region → zone → cluster → node, each level with its GPUs, water level and (clusters) trust."""
    regions = view.get("regions", {})
    title = "Resources" if not path else " / ".join(path)
    body = _crumbs(path)
    if not path:
        body += _level_table("region", "/resources", regions)
    elif len(path) == 1:
        body += _level_table("zone", f"/resources/{quote(path[0])}", regions[path[0]]["zones"])
    elif len(path) == 2:
        clusters = regions[path[0]]["zones"][path[1]]["clusters"]
        body += _level_table("cluster", f"/resources/{quote(path[0])}/{quote(path[1])}", clusters, trust=True)
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
        body += _drain_button(access, path[2])
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


DRAIN_MISSING = "Drain is not available: this build of Loom has no drain command yet."
CANCEL_MISSING = (
    "Cancel is not available: this build of Loom has no cancel command yet"
    " (placement does not act on a cancellation)."
)


def _drain_button(access: Access, cluster: str) -> str:
    if not access.is_operator:
        return ""
    return (
        f'<form method=post action="/clusters/{quote(cluster)}/drain">'
        f'<button disabled title="{esc(DRAIN_MISSING)}">Drain {esc(cluster)}</button> '
        f"<small>{esc(DRAIN_MISSING)}</small></form>"
    )


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
) -> str:
    """One job: state (live), timeline (live), placement explanation per attempt, trace link."""
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
    if access.is_operator and state not in TERMINAL:
        actions = (
            f'<form method=post action="/jobs/{quote(jid)}/cancel">'
            f'<button disabled title="{esc(CANCEL_MISSING)}">Cancel job</button> '
            f"<small>{esc(CANCEL_MISSING)}</small></form>"
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
        facts + actions + timeline + explain + spec,
        active="jobs",
        events="/events?" + urlencode({"job": jid}),
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
