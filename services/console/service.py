"""The console service: pages over HTTP from the store and the bus, job events live over SSE.

Reads only: jobs, their events and decision records from PostgreSQL (:mod:`loom.store.console`,
:mod:`loom.store.jobs`); the resource view from metrics and link state from network-perception
over their bus queries; job events from one core-NATS subscription to every lifecycle subject,
fanned out to each open event stream (filtered by the viewer's tenant).
"""

import asyncio
import contextlib
import json
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, urlencode

import asyncpg
import structlog
from nats.aio.msg import Msg

from loom.client import LoomClient, QueryError
from loom.model.topology import Topology
from loom.runtime.service import ServiceContext
from loom.runtime.tokens import Access, Tokens
from loom.sched.dag import DagError, stage_job_id
from loom.sched.explain import render
from loom.sched.framework import DecisionRecord
from loom.store import console as store
from loom.store import jobs as repo
from loom.store.roles import tenant_scope
from loom.telemetry.jaeger import jaeger_link
from loom_proto import subjects
from loom_proto.ids import ID_PATTERN
from loom_services.console import pages
from loom_services.console.assets import CSS, JS
from loom_services.console.geo import project
from loom_services.console.http import EventStream, HttpServer, Request, Response

log = structlog.get_logger("console")

COOKIE = "loom_token"
_QUERY_TIMEOUT_S = 1.0
_KEEPALIVE_S = 15.0
_LISTENER_BACKLOG = 1000
_MAX_LIMIT = 1000


@dataclass(eq=False)
class Listener:
    """One open event stream: what it wants and its pending events."""

    tenant: str | None
    job_id: str | None
    queue: asyncio.Queue[bytes] = field(default_factory=lambda: asyncio.Queue(_LISTENER_BACKLOG))

    def wants(self, event: Mapping[str, Any]) -> bool:
        """Whether this stream shows the event."""
        if self.tenant is not None and event.get("tenant") != self.tenant:
            return False
        return self.job_id is None or event.get("job_id") == self.job_id


def event_item(subject: str, raw: bytes) -> dict[str, Any] | None:
    """The compact form of a job event that the pages' script applies (None: not a job event)."""
    try:
        body = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(body, dict) or not isinstance(body.get("job_id"), str):
        return None
    kind = body.get("kind") or subject.split(".")[2]
    item: dict[str, Any] = {
        "kind": kind,
        "job_id": body["job_id"],
        "tenant": body.get("tenant"),
        "at": body.get("at") or body.get("submitted_at") or time.time(),
    }
    if body.get("cluster"):
        item["cluster"] = body["cluster"]
    if kind == "progress" and body.get("steps"):
        item["progress"] = round(float(body["step"]) / float(body["steps"]), 4)
    if body.get("reason"):
        item["reason"] = str(body["reason"])
    return item


def _is_id(value: str) -> bool:
    return re.fullmatch(ID_PATTERN, value) is not None


class Console:
    """Routes requests to pages; holds the event fan-out."""

    def __init__(
        self, ctx: ServiceContext, topology: Topology, tokens: Tokens, *, jaeger_url: str | None
    ) -> None:
        self.ctx = ctx
        self.client = LoomClient(ctx.nc)
        self.topology = topology
        self.tokens = tokens
        self.jaeger_url = jaeger_url.rstrip("/") if jaeger_url else None
        self.listeners: set[Listener] = set()
        self.regions = [(r.id, r.source_name) for r in topology.regions]
        self.placed = project(self.regions)
        ctx.stats["console"] = {"requests": 0, "streams": 0, "events": 0, "dropped": 0}

    # ---- events ---------------------------------------------------------------------------------

    async def on_event(self, msg: Msg) -> None:
        """One job event from the bus: to every stream that wants it."""
        item = event_item(msg.subject, msg.data)
        if item is None:
            return
        stats = self.ctx.stats["console"]
        stats["events"] += 1
        data = b"event: job\ndata: " + json.dumps(item).encode() + b"\n\n"
        for listener in list(self.listeners):
            if not listener.wants(item):
                continue
            try:
                listener.queue.put_nowait(data)
            except asyncio.QueueFull:
                stats["dropped"] += 1  # a stalled reader: it reconnects and the page reloads its rows

    async def _stream(self, listener: Listener) -> AsyncGenerator[bytes, None]:
        self.listeners.add(listener)
        self.ctx.stats["console"]["streams"] = len(self.listeners)
        try:
            yield b"retry: 2000\n: connected\n\n"
            while True:
                try:
                    yield await asyncio.wait_for(listener.queue.get(), _KEEPALIVE_S)
                except TimeoutError:
                    yield b": keep-alive\n\n"
        finally:
            self.listeners.discard(listener)
            self.ctx.stats["console"]["streams"] = len(self.listeners)

    # ---- requests -------------------------------------------------------------------------------

    def access_of(self, request: Request) -> Access | None:
        """Who is asking: the token in the query, an ``Authorization: Bearer`` header or the cookie."""
        auth = request.headers.get("authorization", "")
        token = (
            request.query.get("token")
            or (auth[7:].strip() if auth.lower().startswith("bearer ") else None)
            or request.cookies.get(COOKIE)
        )
        return self.tokens.check(token)

    async def handle(self, request: Request) -> Response | EventStream:
        """Answer one request; errors become pages with their status."""
        self.ctx.stats["console"]["requests"] += 1
        if request.path == "/static/console.css":
            return Response(body=CSS, content_type="text/css; charset=utf-8")
        if request.path == "/static/console.js":
            return Response(body=JS, content_type="text/javascript; charset=utf-8")
        if request.path == "/favicon.ico":
            return Response(status=204)
        access = self.access_of(request)
        if access is None:
            return _page(
                401,
                pages.error_page(
                    401, "A token is needed: open the URL that `loom console` prints (it carries one)."
                ),
            )
        if "token" in request.query:
            # Keep the token in a cookie, and out of the address bar and the history.
            rest = {k: v for k, v in request.query.items() if k != "token"}
            # One leading slash: "//host" would send the browser to another site.
            location = "/" + quote(request.path.lstrip("/")) + (f"?{urlencode(rest)}" if rest else "")
            cookie = f"{COOKIE}={quote(request.query['token'])}; HttpOnly; SameSite=Strict; Path=/"
            return Response(status=303, headers=[("Location", location), ("Set-Cookie", cookie)])
        try:
            return await self.route(request, access)
        except QueryError as exc:
            return _page(503, pages.error_page(503, f"a service did not answer: {exc}", access))

    async def route(self, request: Request, access: Access) -> Response | EventStream:
        """Dispatch by method and path."""
        parts = [p for p in request.path.split("/") if p]
        if request.method == "POST":
            return await self.action(parts, access)
        if request.method != "GET":
            return _page(405, pages.error_page(405, "only GET and POST", access))
        if not parts:
            return await self.map_page(access)
        head, rest = parts[0], parts[1:]
        if head == "resources" and len(rest) <= 3:
            return await self.resources_page(access, rest)
        if head == "jobs" and not rest:
            return await self.jobs_page(request, access)
        if head == "jobs" and len(rest) == 1:
            return await self.job_page(access, rest[0])
        if head == "queue" and not rest:
            return await self.queue_page(access)
        if head == "events" and not rest:
            return self.events(request, access)
        return _page(404, pages.error_page(404, f"no page {request.path}", access))

    async def action(self, parts: list[str], access: Access) -> Response:
        """Operator actions; on this build both say what is missing."""
        if not access.is_operator:
            return _page(403, pages.error_page(403, "only the operator token can act", access))
        if len(parts) == 3 and parts[0] == "jobs" and parts[2] == "cancel":
            return _page(501, pages.error_page(501, pages.CANCEL_MISSING, access))
        if len(parts) == 3 and parts[0] == "clusters" and parts[2] == "drain":
            return _page(501, pages.error_page(501, pages.DRAIN_MISSING, access))
        return _page(404, pages.error_page(404, "no such action", access))

    def events(self, request: Request, access: Access) -> Response | EventStream:
        """The job event stream: the viewer's tenant only (the operator may pick one, or a job)."""
        tenant = access.tenant if not access.is_operator else (request.query.get("tenant") or None)
        job_id = request.query.get("job") or None
        if (tenant is not None and not _is_id(tenant)) or (job_id is not None and not _is_id(job_id)):
            return _page(400, pages.error_page(400, "tenant and job must be ids", access))
        return EventStream(self._stream(Listener(tenant=tenant, job_id=job_id)))

    async def map_page(self, access: Access) -> Response:
        """The world map."""
        view = await self.client.view(nodes=False, timeout_s=_QUERY_TIMEOUT_S)
        links: list[dict[str, Any]]
        try:
            links = list(await self.client.net_point(timeout_s=_QUERY_TIMEOUT_S))
            measured = bool(links)
        except QueryError:
            links, measured = [], False
        if not links:
            links = [
                {
                    "src": ln.src,
                    "dst": ln.dst,
                    "rtt_ms": ln.rtt_ms,
                    "bandwidth_gbps": ln.bandwidth_gbps,
                    "cost": 0.0,
                }
                for ln in self.topology.links
            ]
        body = pages.map_page(access, self.regions, self.placed, view, links, links_measured=measured)
        return _page(200, body)

    async def resources_page(self, access: Access, path: list[str]) -> Response:
        """A level of the resource tree."""
        view = await self.client.view(
            region=path[0] if path else None, nodes=len(path) == 3, timeout_s=_QUERY_TIMEOUT_S
        )
        try:
            return _page(200, pages.resources_page(access, view, path))
        except KeyError:
            return _page(404, pages.error_page(404, f"nothing at {'/'.join(path)} in the view", access))

    @contextlib.asynccontextmanager
    async def _reader(self, access: Access) -> AsyncIterator[asyncpg.Pool | asyncpg.Connection]:
        """Where a page reads: the pool for the operator; for a tenant, a transaction under
        row-level security as that tenant (:func:`loom.store.roles.tenant_scope`)."""
        if access.is_operator or access.tenant is None:
            yield self.ctx.db
            return
        async with tenant_scope(self.ctx.db, access.tenant) as conn:
            yield conn

    def _tenant_filter(self, request: Request, access: Access) -> str | None:
        if not access.is_operator:
            return access.tenant
        return request.query.get("tenant") or None

    async def jobs_page(self, request: Request, access: Access) -> Response:
        """The jobs list."""
        tenant = self._tenant_filter(request, access)
        state = request.query.get("state") or None
        if state is not None and state not in pages.STATES:
            return _page(400, pages.error_page(400, f"no state {state!r}", access))
        try:
            limit = min(max(int(request.query.get("limit") or 100), 1), _MAX_LIMIT)
        except ValueError:
            return _page(400, pages.error_page(400, "limit must be a number", access))
        async with self._reader(access) as db:
            jobs = await repo.list_jobs(db, tenant=tenant, state=state, limit=limit)
            counts = await store.counts_of(db, tenant)
        return _page(
            200, pages.jobs_page(access, jobs, tenant=tenant, state=state, counts=counts, limit=limit)
        )

    async def job_page(self, access: Access, job_id: str) -> Response:
        """One job (403 for another tenant's)."""
        job, decisions = None, []
        if _is_id(job_id):
            async with self._reader(access) as db:
                job = await repo.get_job(db, job_id)
                decisions = await repo.decisions_of(db, job_id) if job is not None else []
        if job is None:
            if _is_id(job_id) and not access.is_operator:
                async with self.ctx.db.acquire() as conn:
                    if await repo.existing_jobs(conn, [job_id]):
                        return _page(403, pages.error_page(403, "this job belongs to another tenant", access))
            return _page(404, pages.error_page(404, f"no job {job_id!r}", access))
        if not access.can_see(str(job["tenant"])):
            return _page(403, pages.error_page(403, "this job belongs to another tenant", access))
        explanation = []
        for decision in decisions:
            try:
                lines = render(DecisionRecord.from_dict(decision["record"]))
            except (KeyError, TypeError, ValueError) as exc:
                lines = [f"(this record could not be read: {exc})"]
            explanation.append((f"attempt {decision['attempt']} ({decision['outcome']})", lines))
        stages = (job.get("spec") or {}).get("stages") or []
        try:
            job["stage_jobs"] = [stage_job_id(job_id, str(stage.get("name"))) for stage in stages]
        except DagError:  # a DAG rejected for its stage ids: it has no stage jobs
            job["stage_jobs"] = []
        trace_id = job.get("trace_id")
        trace_url = jaeger_link(str(trace_id), self.jaeger_url) if trace_id and self.jaeger_url else None
        return _page(200, pages.job_page(access, job, explanation, trace_url=trace_url))

    async def queue_page(self, access: Access) -> Response:
        """The queue."""
        tenant = None if access.is_operator else access.tenant
        async with self._reader(access) as db:
            queued = await store.waiting(db, tenant)
            counts = await store.counts_of(db, tenant)
        return _page(200, pages.queue_page(access, queued, counts))


def _page(status: int, body: str) -> Response:
    return Response(status=status, body=body.encode())


async def serve(
    ctx: ServiceContext,
    topology: Topology,
    tokens: Tokens,
    *,
    host: str,
    port: int,
    jaeger_url: str | None,
) -> None:
    """Run the console until the service stops."""
    console = Console(ctx, topology, tokens, jaeger_url=jaeger_url)
    sub = await ctx.nc.subscribe(subjects.JOBS_LIFECYCLE_ALL, cb=console.on_event)
    server = HttpServer(console.handle, host, port)
    await server.start()
    ctx.stats["console"]["url"] = f"http://{host}:{server.port}"
    log.info("console listening", host=host, port=server.port)
    try:
        await ctx.stopping.wait()
    finally:
        await server.stop()
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
