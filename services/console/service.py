"""The console service: pages over HTTP from the store and the bus, job events live over SSE.

Reads only: jobs, their events and decision records from PostgreSQL (:mod:`loom.store.console`,
:mod:`loom.store.jobs`); the resource view from metrics and link state from network-perception
over their bus queries; job events from core-NATS subscriptions to every lifecycle and report
subject, fanned out to each open event stream (filtered by the viewer's tenant). The
subscriptions exist only while an event stream is open, and for ``UNWATCH_AFTER_S`` after the last
one closed: with nobody watching, the console receives nothing (a placement burst would otherwise
send it every event of every job).
"""

import asyncio
import contextlib
import hmac
import json
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC
from typing import Any
from urllib.parse import quote, urlencode

import asyncpg
import msgspec
import structlog
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from loom.bus.dlq import parse_since
from loom.client import LoomClient, QueryError
from loom.errors import InvalidInputError
from loom.model.topology import Topology
from loom.runtime.service import ServiceContext
from loom.runtime.tokens import Access, Tokens
from loom.sched.dag import DagError, stage_job_id
from loom.sched.explain import render
from loom.sched.framework import DecisionRecord
from loom.store import console as store
from loom.store import incidents as incident_store
from loom.store import jobs as repo
from loom.store import moves
from loom.store.roles import tenant_scope
from loom.telemetry.jaeger import jaeger_link
from loom_proto import subjects
from loom_proto.ids import ID_PATTERN
from loom_proto.jobs import TERMINAL_STATES
from loom_proto.migrations import MAX_DRAIN_CONCURRENCY
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
_CANCEL_WAIT_S = 5.0
EVENT_SUBJECTS = (subjects.JOBS_LIFECYCLE_ALL, subjects.JOBS_REPORTS_ALL)
"""What the open event streams show; subscribed to while at least one is open."""
UNWATCH_AFTER_S = 30.0
"""How long the subscriptions outlive the last open stream: moving from page to page closes one
stream and opens the next, and a subscription just made may miss an event published in the
same millisecond (the server makes it visible to other connections a moment after the flush)."""
_INCIDENTS_LISTED = 100
_ACTION_TIMEOUT_S = 5.0
USAGE_BY = store.USAGE_KEYS
DEFAULT_USAGE_SINCE = "30d"


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


class _EventFields(msgspec.Struct):
    """The fields of a job event the console shows; every other field is skipped, not decoded."""

    job_id: str
    kind: Any = None
    tenant: Any = None
    at: Any = None
    submitted_at: Any = None
    cluster: Any = None
    step: Any = None
    steps: Any = None
    reason: Any = None


_event_decoder = msgspec.json.Decoder(_EventFields)


def event_item(subject: str, raw: bytes) -> dict[str, Any] | None:
    """The compact form of a job event that the pages' script applies (None: not a job event)."""
    try:
        body = _event_decoder.decode(raw)
    except msgspec.DecodeError:
        return None
    kind = body.kind or subject.split(".")[2]
    item: dict[str, Any] = {
        "kind": kind,
        "job_id": body.job_id,
        "tenant": body.tenant,
        "at": body.at or body.submitted_at or time.time(),
    }
    if body.cluster:
        item["cluster"] = body.cluster
    if kind == "progress" and body.steps:
        item["progress"] = round(float(body.step) / float(body.steps), 4)
    if body.reason:
        item["reason"] = str(body.reason)
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
        self._subs: list[Subscription] = []
        self._subs_lock = asyncio.Lock()
        self._unwatch_timer: asyncio.TimerHandle | None = None
        self._unwatching: set[asyncio.Task[None]] = set()
        """Unsubscriptions under way (never cancelled: one cut short would forget a live one)."""
        self.unwatch_after_s = UNWATCH_AFTER_S
        self.regions = [(r.id, r.source_name) for r in topology.regions]
        self.placed = project(self.regions)
        ctx.stats["console"] = {
            "requests": 0,
            "streams": 0,
            "events": 0,
            "dropped": 0,
            "subscribed": False,
        }

    # ---- events ---------------------------------------------------------------------------------

    async def on_event(self, msg: Msg) -> None:
        """One job event from the bus: to every stream that wants it."""
        item = event_item(msg.subject, msg.data)
        if item is None:
            return
        stats = self.ctx.stats["console"]
        stats["events"] += 1
        data = b""  # encoded for the first listener that wants it (usually nobody is watching)
        for listener in list(self.listeners):
            if not listener.wants(item):
                continue
            data = data or b"event: job\ndata: " + json.dumps(item).encode() + b"\n\n"
            try:
                listener.queue.put_nowait(data)
            except asyncio.QueueFull:
                stats["dropped"] += 1  # a stalled reader: it reconnects and the page reloads its rows

    async def watch(self) -> None:
        """Subscribe to the job events if a stream is open and they are not yet. The server has
        the subscriptions when this returns, but other connections' publishes may take a moment
        more to see them (milliseconds: an event published in that moment is missed, as one
        published before the page opened its stream is; the page's rows come from the store)."""
        async with self._subs_lock:
            if self._subs or not self.listeners:
                return
            subs = []
            try:
                for subject in EVENT_SUBJECTS:
                    subs.append(await self.ctx.nc.subscribe(subject, cb=self.on_event))
                await self.ctx.nc.flush()
            except BaseException:
                for sub in subs:
                    with contextlib.suppress(Exception):
                        await sub.unsubscribe()
                raise
            self._subs = subs
            self.ctx.stats["console"]["subscribed"] = True

    def _last_closed(self) -> None:
        """The last open stream ended: unsubscribe after :attr:`unwatch_after_s` unless one opens
        (a later close starts the wait again; only the timer is cancelled, never an unsubscription
        under way)."""
        if self._unwatch_timer is not None:
            self._unwatch_timer.cancel()
        self._unwatch_timer = asyncio.get_running_loop().call_later(self.unwatch_after_s, self._unwatch_now)

    def _unwatch_now(self) -> None:
        self._unwatch_timer = None
        task = asyncio.get_running_loop().create_task(self.unwatch())
        self._unwatching.add(task)
        task.add_done_callback(self._unwatching.discard)

    async def unwatch(self, *, closing: bool = False) -> None:
        """Drop the job-event subscriptions if no stream is open (``closing``: in any case)."""
        if closing and self._unwatch_timer is not None:
            self._unwatch_timer.cancel()
            self._unwatch_timer = None
        async with self._subs_lock:
            if (self.listeners and not closing) or not self._subs:
                return
            subs, self._subs = self._subs, []
            self.ctx.stats["console"]["subscribed"] = False
            for sub in subs:
                with contextlib.suppress(Exception):  # NATS away: the connection's end drops them
                    await sub.unsubscribe()

    async def events_of(self, listener: Listener) -> AsyncGenerator[bytes, None]:
        """An open event stream's bytes: its first line once the console is subscribed, then
        each job event the listener wants and a comment now and then to keep it alive."""
        self.listeners.add(listener)
        self.ctx.stats["console"]["streams"] = len(self.listeners)
        try:
            await self.watch()
            yield b"retry: 2000\n: connected\n\n"
            while True:
                try:
                    yield await asyncio.wait_for(listener.queue.get(), _KEEPALIVE_S)
                except TimeoutError:
                    yield b": keep-alive\n\n"
        finally:
            self.listeners.discard(listener)
            self.ctx.stats["console"]["streams"] = len(self.listeners)
            if not self.listeners:
                self._last_closed()

    # ---- requests -------------------------------------------------------------------------------

    @staticmethod
    def token_of(request: Request) -> str | None:
        """The token of a request: in the query, an ``Authorization: Bearer`` header or the cookie."""
        auth = request.headers.get("authorization", "")
        return (
            request.query.get("token")
            or (auth[7:].strip() if auth.lower().startswith("bearer ") else None)
            or request.cookies.get(COOKIE)
        )

    def access_of(self, request: Request) -> Access | None:
        """Who is asking (None: no token, or a wrong one)."""
        return self.tokens.check(self.token_of(request))

    def form_key(self, request: Request) -> str:
        """The anti-forgery key of this request's session, for the forms of its pages."""
        return self.tokens.form_key(self.token_of(request) or "")

    def form_is_ours(self, request: Request) -> bool:
        """Whether a POST came from one of our pages: its form carries the session's key. A request
        with an ``Authorization`` header needs none (a browser never adds that header on its own
        to another site's form; the cookie alone is what a forged form would ride on)."""
        if request.headers.get("authorization", "").lower().startswith("bearer "):
            return True
        given = request.form.get("form_key", "")
        return hmac.compare_digest(given.encode(), self.form_key(request).encode())

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
            return await self.action(request, parts, access)
        if request.method != "GET":
            return _page(405, pages.error_page(405, "only GET and POST", access))
        if not parts:
            return await self.map_page(access)
        head, rest = parts[0], parts[1:]
        if head == "resources" and len(rest) <= 3:
            return await self.resources_page(request, access, rest)
        if head == "jobs" and not rest:
            return await self.jobs_page(request, access)
        if head == "jobs" and len(rest) == 1:
            return await self.job_page(request, access, rest[0])
        if head in ("jobs", "clusters") and len(rest) == 2 and rest[1] in ("cancel", "drain", "undrain"):
            return await self.confirm_page(request, access, head, rest[0], rest[1])
        if head == "incidents" and not rest:
            return await self.incidents_page(request, access)
        if head == "incidents" and len(rest) == 1:
            return await self.incident_page(request, access, rest[0])
        if head in ("usage", "usage.csv") and not rest:
            return await self.usage_page(request, access, csv_out=head == "usage.csv")
        if head == "queue" and not rest:
            return await self.queue_page(access)
        if head == "events" and not rest:
            return self.events(request, access)
        return _page(404, pages.error_page(404, f"no page {request.path}", access))

    async def action(self, request: Request, parts: list[str], access: Access) -> Response:
        """Operator actions: cancel a job, drain or undrain a cluster, acknowledge an incident.
        Tenants are read-only (403), a form without this session's key is refused (403); a done
        action answers 303 to the page it acted on, which says what happened."""
        if not access.is_operator:
            return _page(403, pages.error_page(403, "only the operator token can act", access))
        if not self.form_is_ours(request):
            return _page(403, pages.error_page(403, pages.FORM_STALE, access))
        if len(parts) == 3 and parts[0] == "jobs" and parts[2] == "cancel" and _is_id(parts[1]):
            if request.form.get("live") == "1":
                return await self.cancel_live(access, parts[1])
            return await self.cancel(access, parts[1])
        if len(parts) == 3 and parts[0] == "clusters" and parts[2] in ("drain", "undrain"):
            return await self.drain(request, access, parts[1], undrain=parts[2] == "undrain")
        if len(parts) == 3 and parts[0] == "incidents" and parts[2] == "ack" and _is_id(parts[1]):
            return await self.ack(access, parts[1])
        return _page(404, pages.error_page(404, "no such action", access))

    async def cancel(self, access: Access, job_id: str) -> Response:
        """Cancel a job the way `loom cancel` does (its ``cancelled`` event on the bus)."""
        job = await repo.get_job(self.ctx.db, job_id)
        if job is None:
            return _page(404, pages.error_page(404, f"no job {job_id!r}", access))
        if job["state"] in TERMINAL_STATES:
            return _page(
                409,
                pages.error_page(
                    409, f"{job_id} had already ended ({job['state']}): nothing to cancel", access
                ),
            )
        try:
            state = await self.client.cancel(
                job_id, reason="cancelled from the console", wait_s=_CANCEL_WAIT_S
            )
        except QueryError:  # published, not recorded yet: the job page shows it when it is
            return _see_other(f"/jobs/{quote(job_id)}?done=cancel-pending")
        if state != "cancelled":
            return _page(409, pages.error_page(409, f"{job_id} ended ({state}) before the cancel", access))
        return _see_other(f"/jobs/{quote(job_id)}?done=cancel")

    async def cancel_live(self, access: Access, job_id: str) -> Response:
        """A cancel asked by the job page's script: publish it and answer at once (202, JSON);
        the page follows the job's events and shows it cancelled when placement records it."""
        job = await repo.get_job(self.ctx.db, job_id)
        if job is None or job["state"] in TERMINAL_STATES:
            message = f"no job {job_id!r}" if job is None else f"{job_id} had already ended ({job['state']})"
            return _json(404 if job is None else 409, {"job_id": job_id, "message": message})
        try:
            state = await self.client.cancel(job_id, reason="cancelled from the console", wait_s=0.0)
        except QueryError:  # published; not recorded yet (no wait): the event stream brings it
            state = str(job["state"])
        return _json(202, {"job_id": job_id, "state": state, "message": pages.NOTICES["cancel-live"]})

    def cluster_path(self, cluster: str) -> str | None:
        """The resources page of a cluster of the topology."""
        for c in self.topology.clusters:
            if c.id == cluster:
                return f"/resources/{quote(c.region)}/{quote(c.zone)}/{quote(c.id)}"
        return None

    async def drain(self, request: Request, access: Access, cluster: str, *, undrain: bool) -> Response:
        """Drain (or open again) a cluster through the migration service, as `loom drain` does."""
        where = self.cluster_path(cluster)
        if where is None:
            return _page(404, pages.error_page(404, f"no cluster {cluster!r} in the topology", access))
        ask: dict[str, Any] = {"op": "undrain" if undrain else "drain", "cluster": cluster}
        if not undrain:
            try:
                ask["concurrency"] = int(request.form.get("concurrency") or 2)
            except ValueError:
                return _page(400, pages.error_page(400, "concurrency must be a number", access))
            if not 1 <= ask["concurrency"] <= MAX_DRAIN_CONCURRENCY:
                error = f"concurrency must be within 1-{MAX_DRAIN_CONCURRENCY}"
                return _page(400, pages.error_page(400, error, access))
            ask["force"] = request.form.get("force") == "on"
        answer = await self._request(subjects.MIGRATE_DRAIN, ask, "the migration service")
        if not answer.get("ok"):
            verb = "undrain" if undrain else "drain"
            # The service words it for the command line; on this form the switch is a box.
            error = str(answer.get("error")).replace("use --force", "tick force")
            return _page(409, pages.error_page(409, f"{verb} refused: {error}", access))
        return _see_other(f"{where}?done={'undrain' if undrain else 'drain'}")

    async def ack(self, access: Access, incident_id: str) -> Response:
        """Acknowledge an incident through the alert correlator, as `loom ack` does."""
        answer = await self._request(
            subjects.INCIDENTS_ACK,
            {"incident_id": incident_id, "by": "console operator"},
            "the alert correlator",
        )
        if not answer.get("ok"):
            status = 404 if answer.get("code") == "unknown" else 409  # as GET /incidents/<unknown>
            return _page(status, pages.error_page(status, f"ack refused: {answer.get('error')}", access))
        return _see_other(f"/incidents/{quote(incident_id)}?done=ack")

    async def _request(self, subject: str, body: Mapping[str, Any], who: str) -> dict[str, Any]:
        try:
            reply = await self.ctx.nc.request(subject, json.dumps(body).encode(), timeout=_ACTION_TIMEOUT_S)
        except Exception as exc:  # nats raises several unrelated types for "no answer"
            return {"ok": False, "error": f"{who} did not answer ({type(exc).__name__}); is it running?"}
        answer = json.loads(reply.data)
        return answer if isinstance(answer, dict) else {"ok": False, "error": "an unreadable answer"}

    async def confirm_page(
        self, request: Request, access: Access, kind: str, target: str, verb: str
    ) -> Response:
        """The confirmation step before an action (its form posts the action)."""
        if not access.is_operator:
            return _page(403, pages.error_page(403, "only the operator token can act", access))
        if (kind == "jobs") != (verb == "cancel") or not _is_id(target):
            return _page(404, pages.error_page(404, f"no page {request.path}", access))
        if kind == "jobs":
            job = await repo.get_job(self.ctx.db, target)
            if job is None:
                return _page(404, pages.error_page(404, f"no job {target!r}", access))
            return _page(200, pages.confirm_cancel(access, job, self.form_key(request)))
        back = self.cluster_path(target)
        if back is None:
            return _page(404, pages.error_page(404, f"no cluster {target!r} in the topology", access))
        runs = await moves.runs_on(self.ctx.db, target)
        return _page(
            200, pages.confirm_drain(access, target, verb, len(runs), self.form_key(request), back=back)
        )

    def events(self, request: Request, access: Access) -> Response | EventStream:
        """The job event stream: the viewer's tenant only (the operator may pick one, or a job)."""
        tenant = access.tenant if not access.is_operator else (request.query.get("tenant") or None)
        job_id = request.query.get("job") or None
        if (tenant is not None and not _is_id(tenant)) or (job_id is not None and not _is_id(job_id)):
            return _page(400, pages.error_page(400, "tenant and job must be ids", access))
        return EventStream(self.events_of(Listener(tenant=tenant, job_id=job_id)))

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

    async def resources_page(self, request: Request, access: Access, path: list[str]) -> Response:
        """A level of the resource tree; drained clusters marked."""
        view = await self.client.view(
            region=path[0] if path else None, nodes=len(path) == 3, timeout_s=_QUERY_TIMEOUT_S
        )
        drains = {str(d["cluster"]): str(d["state"]) for d in await moves.drains(self.ctx.db)}
        try:
            body = pages.resources_page(
                access,
                view,
                path,
                drains=drains,
                form_key=self.form_key(request),
                notice=pages.notice_of(
                    request.query.get("done"),
                    "cluster",
                    holds=len(path) == 3 and (path[-1] in drains) == (request.query.get("done") == "drain"),
                ),
            )
        except KeyError:
            return _page(404, pages.error_page(404, f"nothing at {'/'.join(path)} in the view", access))
        return _page(200, body)

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
        """The tenant a page shows: a tenant's own; the operator's ``?tenant=`` (checked by
        :meth:`jobs_page` and the usage page as an id)."""
        if not access.is_operator:
            return access.tenant
        return request.query.get("tenant") or None

    async def jobs_page(self, request: Request, access: Access) -> Response:
        """The jobs list."""
        tenant = self._tenant_filter(request, access)
        state = request.query.get("state") or None
        if state is not None and state not in pages.STATES:
            return _page(400, pages.error_page(400, f"no state {state!r}", access))
        if tenant is not None and not _is_id(tenant):
            return _page(400, pages.error_page(400, "tenant must be an id", access))
        try:
            limit = min(int(request.query.get("limit") or 100), _MAX_LIMIT)
        except ValueError:
            return _page(400, pages.error_page(400, "limit must be a number", access))
        if limit < 1:  # 0 and -1 showed one row
            return _page(400, pages.error_page(400, "limit must be 1 or more", access))
        async with self._reader(access) as db:
            jobs = await repo.list_jobs(db, tenant=tenant, state=state, limit=limit)
            counts = await store.counts_of(db, tenant)
        return _page(
            200, pages.jobs_page(access, jobs, tenant=tenant, state=state, counts=counts, limit=limit)
        )

    async def job_page(self, request: Request, access: Access, job_id: str) -> Response:
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
        return _page(
            200,
            pages.job_page(
                access,
                job,
                explanation,
                trace_url=trace_url,
                notice=pages.notice_of(
                    request.query.get("done"),
                    "job",
                    # "Cancelled" once it is; "requested" while it is not ended otherwise.
                    holds=job["state"] == "cancelled"
                    or (request.query.get("done") != "cancel" and job["state"] not in TERMINAL_STATES),
                ),
                form_key=self.form_key(request) if access.is_operator else "",
            ),
        )

    async def queue_page(self, access: Access) -> Response:
        """The queue."""
        tenant = None if access.is_operator else access.tenant
        async with self._reader(access) as db:
            queued = await store.waiting(db, tenant)
            counts = await store.counts_of(db, tenant)
        return _page(200, pages.queue_page(access, queued, counts))

    async def incidents_page(self, request: Request, access: Access) -> Response:
        """Incidents, newest first; a tenant's: those that touch its jobs."""
        flag = request.query.get("open", "")
        if flag not in ("", "0", "1"):
            return _page(400, pages.error_page(400, "open must be 1 or 0", access))
        open_only = flag == "1"
        tenant = None if access.is_operator else access.tenant
        if tenant is None:
            found = await store.incident_briefs(self.ctx.db, open_only=open_only, limit=_INCIDENTS_LISTED)
        else:
            found = await store.incidents_of(
                self.ctx.db, tenant, open_only=open_only, limit=_INCIDENTS_LISTED
            )
        shown = [pages.scoped_incident(i, tenant) for i in found]
        return _page(200, pages.incidents_page(access, shown, open_only=open_only))

    async def incident_page(self, request: Request, access: Access, incident_id: str) -> Response:
        """One incident: root cause, affected jobs and tenants, timeline (a tenant: its jobs only)."""
        found = await incident_store.get_incident(self.ctx.db, incident_id) if _is_id(incident_id) else None
        if found is None:
            return _page(404, pages.error_page(404, f"no incident {incident_id!r}", access))
        if not access.is_operator and access.tenant not in found.tenants:
            return _page(403, pages.error_page(403, "this incident does not touch your jobs", access))
        shown = pages.scoped_incident(found, None if access.is_operator else access.tenant)
        return _page(
            200,
            pages.incident_page(
                access,
                shown,
                form_key=self.form_key(request),
                notice=pages.notice_of(
                    request.query.get("done"), "incident", holds=shown.acked_at is not None
                ),
            ),
        )

    async def usage_page(self, request: Request, access: Access, *, csv_out: bool) -> Response:
        """Metered usage over a range, grouped; a tenant's own only. ``/usage.csv``: the same as CSV."""
        tenant = access.tenant if not access.is_operator else (request.query.get("tenant") or None)
        if tenant is not None and not _is_id(tenant):
            return _page(400, pages.error_page(400, "tenant must be an id", access))
        by = request.query.get("by") or ("tenant" if access.is_operator else "model")
        if by not in USAGE_BY:
            return _page(400, pages.error_page(400, f"group by one of {', '.join(USAGE_BY)}", access))
        since = request.query.get("since", DEFAULT_USAGE_SINCE).strip()
        until = request.query.get("until", "").strip()
        try:
            since_ms = _ms(since) if since else None
            until_ms = _ms(until) if until else None
            if since_ms is not None and until_ms is not None and until_ms <= since_ms:
                raise InvalidInputError("the range is empty or inverted: until must be after since")
            groups, total = await store.usage_totals(
                self.ctx.db, by, tenant=tenant, since_ms=since_ms, until_ms=until_ms
            )
        except InvalidInputError as exc:
            return _page(400, pages.error_page(400, str(exc), access))
        if csv_out:
            return Response(
                body=pages.usage_csv(groups, by).encode(),
                content_type="text/csv; charset=utf-8",
                headers=[("Content-Disposition", 'attachment; filename="loom-usage.csv"')],
            )
        return _page(
            200,
            pages.usage_page(
                access, groups, total, by=by, tenant=tenant, since=since, until=until, by_choices=USAGE_BY
            ),
        )


def _page(status: int, body: str) -> Response:
    return Response(status=status, body=body.encode())


def _json(status: int, body: Mapping[str, Any]) -> Response:
    return Response(
        status=status, body=json.dumps(body).encode(), content_type="application/json; charset=utf-8"
    )


def _see_other(location: str) -> Response:
    return Response(status=303, headers=[("Location", location)])


def _ms(text: str) -> int:
    """A time of the usage form (a duration back such as ``7d``, or an ISO time, UTC) in ms."""
    moment = parse_since(text)
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return round(moment.timestamp() * 1000)


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
    server = HttpServer(console.handle, host, port)
    await server.start()
    ctx.stats["console"]["url"] = f"http://{host}:{server.port}"
    log.info("console listening", host=host, port=server.port)
    try:
        await ctx.stopping.wait()
    finally:
        await server.stop()
        await console.unwatch(closing=True)
