"""The web console's pure parts: tokens, map, pages, event items, the HTTP server, `loom console`;
and its job-event subscriptions on a real NATS (held only while a stream is open)."""

import asyncio
import contextlib
import json
import os
import stat
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path

import nats
import pytest

from loom.bus import Publisher
from loom.cli.console import console_url
from loom.model.topology import load_topology
from loom.runtime import stack
from loom.runtime.service import ServiceContext
from loom.runtime.tokens import Access, Tokens, ensure_tokens, load_tokens, tokens_path
from loom_proto import subjects
from loom_services.console import pages
from loom_services.console.geo import project
from loom_services.console.http import EventStream, HttpServer, Request, Response
from loom_services.console.land import LAND_PATH
from loom_services.console.service import Console, Listener, event_item

# ---- tokens ---------------------------------------------------------------------------------------


def test_tokens_are_written_once_readable_by_the_owner_only(tmp_path: Path) -> None:
    first = ensure_tokens(tmp_path)
    assert stat.S_IMODE(os.stat(tokens_path(tmp_path)).st_mode) == 0o600
    assert ensure_tokens(tmp_path) == first == load_tokens(tmp_path)


def test_the_operator_token_grants_the_operator_and_a_tenant_token_its_tenant_only(tmp_path: Path) -> None:
    tokens = ensure_tokens(tmp_path)
    assert tokens.check(tokens.operator) == Access("operator")
    alpha = tokens.check(tokens.tenant_token("alpha"))
    assert alpha == Access("tenant", "alpha")
    assert alpha.can_see("alpha") and not alpha.can_see("beta") and not alpha.is_operator
    assert Access("operator").can_see("beta")


def test_a_tenant_token_cannot_be_forged_or_renamed(tmp_path: Path) -> None:
    tokens = ensure_tokens(tmp_path)
    mac = tokens.tenant_token("alpha").rsplit(".", 1)[1]
    assert tokens.check(f"tenant.beta.{mac}") is None  # alpha's mac under beta's name
    assert tokens.check("tenant.alpha.0123456789abcdef0123456789abcdef") is None
    other = Tokens(operator="op.x", secret="another secret")
    assert tokens.check(other.tenant_token("alpha")) is None  # another stack's token
    assert tokens.check(other.operator) is None
    assert tokens.check("") is None and tokens.check(None) is None and tokens.check("tenant..") is None


def test_a_tenant_token_needs_a_tenant_id(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tenant id"):
        ensure_tokens(tmp_path).tenant_token("a.b")


# ---- map ------------------------------------------------------------------------------------------


def test_regions_are_placed_by_their_coordinates_zone_letters_ignored() -> None:
    placed = project(
        [("ohio", "aws:us-east-2"), ("frankfurt", "aws:eu-central-1"), ("sg", "gcp:asia-southeast1-a")]
    )
    assert placed["ohio"].x < placed["frankfurt"].x < placed["sg"].x  # west to east
    assert placed["frankfurt"].y < placed["ohio"].y < placed["sg"].y  # north to south
    assert all(p.known for p in placed.values())


def test_unknown_regions_are_marked_and_regions_in_one_city_do_not_overlap() -> None:
    placed = project([("a", "aws:ap-southeast-1"), ("b", "gcp:asia-southeast1"), ("x", "mars:olympus")])
    assert not placed["x"].known and placed["x"].y == 480.0
    assert (placed["a"].x, placed["a"].y) != (placed["b"].x, placed["b"].y)


# ---- pages ----------------------------------------------------------------------------------------


def test_links_are_coloured_by_cost_and_degraded_links_red() -> None:
    assert pages.link_colour({"cost": 20.0}) == "#2ca02c"
    assert pages.link_colour({"cost": 120.0}) == "#e6a700"
    assert pages.link_colour({"cost": 300.0}) == "#d62728"
    assert pages.link_colour({"cost": 20.0, "degraded": True}) == "#d62728"
    assert pages.link_colour({"cost": 20.0, "usable": False}) == "#d62728"
    assert pages.link_colour({"rtt_ms": 20.0}) == "#2ca02c"  # not measured yet: the topology's RTT


JOB = {
    "job_id": "j-1",
    "tenant": "alpha",
    "state": "running",
    "cluster": "c-1",
    "attempt": 1,
    "progress": 0.5,
    "reason": "<script>alert(1)</script>",
    "submitted_at": 1.0,
    "spec": {"name": "<b>x</b>"},
    "events": [{"kind": "submitted", "at": 1.0, "event": {}}],
}


def test_values_are_escaped() -> None:
    html = pages.job_page(Access("operator"), JOB, [("attempt 1", ["<i>why</i>"])], trace_url=None)
    assert "<script>" not in html and "&lt;script&gt;" in html
    assert "<i>why</i>" not in html and "<b>x</b>" not in html


def test_the_operator_sees_a_cancel_a_tenant_none() -> None:
    operator = pages.job_page(Access("operator"), JOB, [], trace_url="http://jaeger/trace/ab")
    assert 'href="/jobs/j-1/cancel"' in operator and ">Cancel job…</a>" in operator
    assert 'href="http://jaeger/trace/ab"' in operator
    tenant = pages.job_page(Access("tenant", "alpha"), JOB, [], trace_url=None)
    assert "Cancel job" not in tenant and "no trace context recorded" in tenant


def test_a_dag_job_page_points_at_its_stage_jobs() -> None:
    dag = dict(JOB, stage_jobs=["j-1--prep", "j-1--train"])
    html = pages.job_page(Access("operator"), dag, [], trace_url=None)
    assert 'href="/jobs/j-1--prep"' in html and 'href="/jobs/j-1--train"' in html


def test_a_tenant_jobs_page_has_no_tenant_filter_and_follows_its_filters() -> None:
    tenant = pages.jobs_page(
        Access("tenant", "alpha"), [JOB], tenant="alpha", state=None, counts={}, limit=100
    )
    assert "name=tenant" not in tenant
    assert 'data-events="/events?tenant=alpha"' in tenant
    assert 'data-job="j-1"' in tenant
    operator = pages.jobs_page(Access("operator"), [], tenant=None, state="queued", counts={}, limit=100)
    assert "name=tenant" in operator and 'data-events="/events?state=queued"' in operator


def test_the_cluster_page_lists_nodes_with_water_level_and_trust() -> None:
    view = {
        "regions": {
            "r": {
                "zones": {
                    "z": {
                        "clusters": {
                            "c": {
                                "gpus_total": 8,
                                "gpus_used": 2,
                                "gpus_reserved": 2,
                                "gpus_free": 4,
                                "trust": 0.75,
                                "age_s": 1.0,
                                "ttl_s": 10.0,
                                "stale": False,
                                "nodes": [
                                    {
                                        "node": "n1",
                                        "gpu_model": "T4",
                                        "gpus_total": 8,
                                        "gpus_used": 2,
                                        "gpus_reserved": 2,
                                        "healthy": True,
                                    }
                                ],
                            }
                        }
                    }
                }
            }
        }
    }
    html = pages.resources_page(Access("operator"), view, ["r", "z", "c"])
    assert "trust 0.75" in html and 'data-node="n1"' in html and "50%" in html
    assert 'href="/clusters/c/drain">Drain c…</a>' in html
    assert "Drain" not in pages.resources_page(Access("tenant", "t"), view, ["r", "z", "c"])


# ---- events ---------------------------------------------------------------------------------------


def test_a_job_event_becomes_a_compact_item_with_its_progress() -> None:
    raw = json.dumps(
        {"kind": "progress", "job_id": "j", "tenant": "t", "cluster": "c", "step": 5, "steps": 20, "at": 3.0}
    ).encode()
    assert event_item("loom.jobs.progress.t", raw) == {
        "kind": "progress",
        "job_id": "j",
        "tenant": "t",
        "at": 3.0,
        "cluster": "c",
        "progress": 0.25,
    }
    assert event_item("loom.jobs.progress.t", b"not json") is None
    assert event_item("loom.jobs.progress.t", b'{"kind": "progress"}') is None


def test_a_stream_gets_its_tenants_events_and_its_jobs_only() -> None:
    event = {"job_id": "j", "tenant": "t"}
    assert Listener(tenant=None, job_id=None).wants(event)
    assert Listener(tenant="t", job_id=None).wants(event)
    assert not Listener(tenant="u", job_id=None).wants(event)
    assert not Listener(tenant=None, job_id="k").wants(event)


# ---- HTTP -----------------------------------------------------------------------------------------


async def _exchange(port: int, raw: bytes, until: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    data = b""
    while until not in data:
        chunk = await asyncio.wait_for(reader.read(65536), 5)
        if not chunk:
            break
        data += chunk
    writer.close()
    return data


async def test_the_server_answers_requests_on_one_connection_and_reads_forms() -> None:
    seen: list[Request] = []

    async def handler(request: Request) -> Response | EventStream:
        if request.path == "/boom":
            raise RuntimeError("a bug")
        seen.append(request)
        return Response(body=f"{request.method} {request.path} {request.form or request.query}".encode())

    server = HttpServer(handler)
    await server.start()
    try:
        two = (
            b"GET /a?x=1 HTTP/1.1\r\nHost: h\r\nCookie: k=v%20w\r\n\r\n"
            b"POST /b HTTP/1.1\r\nContent-Type: application/x-www-form-urlencoded\r\n"
            b"Content-Length: 3\r\nConnection: close\r\n\r\ny=2"
        )
        answer = await _exchange(server.port, two, b"{'y': '2'}")
        assert answer.count(b"HTTP/1.1 200 OK") == 2
        assert b"GET /a {'x': '1'}" in answer and b"POST /b {'y': '2'}" in answer
        assert seen[0].cookies == {"k": "v w"}
        boom = await _exchange(server.port, b"GET /boom HTTP/1.1\r\nConnection: close\r\n\r\n", b"a bug")
        assert boom.startswith(b"HTTP/1.1 500")
        bad = await _exchange(server.port, b"nonsense\r\n\r\n", b"bad request line")
        assert bad.startswith(b"HTTP/1.1 400")
        # Before: no answer at all (the connection closed on an exception in the server's callback).
        for length in (b"-5", b"abc", b"1e3"):
            head = b"POST /b HTTP/1.1\r\nContent-Length: " + length + b"\r\n\r\n"
            answer = await _exchange(server.port, head, b"Content-Length")
            assert answer.startswith(b"HTTP/1.1 400") and b"bad Content-Length" in answer, answer
        chunked = await _exchange(
            server.port, b"POST /b HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n", b"chunks"
        )
        assert chunked.startswith(b"HTTP/1.1 400")
    finally:
        await server.stop()


async def test_an_event_stream_is_listening_before_its_headers_are_sent() -> None:
    listening = asyncio.Event()

    async def events() -> AsyncGenerator[bytes, None]:
        listening.set()
        yield b": hello\n\n"
        yield b"event: job\ndata: {}\n\n"

    async def handler(_request: Request) -> Response | EventStream:
        return EventStream(events())

    server = HttpServer(handler)
    await server.start()
    try:
        answer = await _exchange(server.port, b"GET /events HTTP/1.1\r\n\r\n", b"data: {}")
        assert listening.is_set()
        head, _, body = answer.partition(b"\r\n\r\n")
        assert b"Content-Type: text/event-stream" in head
        assert body == b": hello\n\nevent: job\ndata: {}\n\n"
    finally:
        await server.stop()


class _Watched:
    """A console on the session's NATS, and another connection that publishes job events."""

    def __init__(self, console: Console, nc: nats.NATS, other: nats.NATS) -> None:
        self.console, self.nc, self.other = console, nc, other
        self.stats = console.ctx.stats["console"]

    async def publish(self, job_id: str) -> None:
        body = {"job_id": job_id, "tenant": "alpha", "kind": "placed", "at": 1.0, "cluster": "c"}
        await self.other.publish(subjects.job_placed("alpha"), json.dumps(body).encode())
        await self.other.flush()

    async def published_and_settled(self, job_id: str) -> None:
        await self.publish(job_id)
        await self.nc.flush()  # a round trip after the publish: anything delivered has arrived
        await asyncio.sleep(0.1)

    async def opened(
        self, tenant: str | None = None, job_id: str | None = None
    ) -> AsyncGenerator[bytes, None]:
        stream = self.console.events_of(Listener(tenant=tenant, job_id=job_id))
        assert (await anext(stream)).startswith(b"retry:")
        assert self.stats["subscribed"]
        return stream

    async def shown(self, stream: AsyncGenerator[bytes, None], job_id: str) -> bytes:
        # Published again until it shows: the server lets other connections see a subscription
        # a moment after its flush (an event in that moment is missed: UNWATCH_AFTER_S).
        item = asyncio.ensure_future(anext(stream))
        for _ in range(25):
            await self.publish(job_id)
            done, _ = await asyncio.wait([item], timeout=0.2)
            if done:
                return item.result()
        item.cancel()
        raise AssertionError(f"{job_id} never reached the stream: {self.stats}")

    async def unsubscribed(self) -> None:
        for _ in range(100):
            if not self.stats["subscribed"]:
                return
            await asyncio.sleep(0.01)
        raise AssertionError("still subscribed")


@contextlib.asynccontextmanager
async def _watched(tmp_path: Path, nats_url: str) -> AsyncIterator[_Watched]:
    nc = await nats.connect(nats_url)
    other = await nats.connect(nats_url)
    ctx = ServiceContext(name="console", nc=nc, publisher=Publisher(nc), pool=None, stopping=asyncio.Event())
    console = Console(ctx, load_topology("small"), ensure_tokens(tmp_path), jaeger_url=None)
    try:
        yield _Watched(console, nc, other)
        await console.unwatch(closing=True)
    finally:
        await nc.close()
        await other.close()


async def test_job_events_are_received_only_while_an_event_stream_is_open(
    tmp_path: Path, nats_url: str
) -> None:
    async with _watched(tmp_path, nats_url) as w:
        w.console.unwatch_after_s = 0.0
        await w.published_and_settled("nobody-watching")
        assert w.stats["events"] == 0 and not w.stats["subscribed"]

        first = await w.opened(tenant="alpha")
        second = await w.opened(job_id="j-2")
        assert w.stats["streams"] == 2
        item = await w.shown(first, "j-1")
        assert item.startswith(b"event: job\n") and b'"job_id": "j-1"' in item
        await first.aclose()  # one stream left open: still subscribed
        await asyncio.sleep(0.05)
        assert w.stats["subscribed"] and w.stats["streams"] == 1
        assert b'"job_id": "j-2"' in await w.shown(second, "j-2")

        await second.aclose()  # the last one: unsubscribed
        await w.unsubscribed()
        received = w.stats["events"]
        await w.published_and_settled("after-the-last")
        assert w.stats["events"] == received

        third = await w.opened()  # and subscribed again
        assert b'"job_id": "j-3"' in await w.shown(third, "j-3")
        await third.aclose()
        await w.unsubscribed()


async def test_the_subscriptions_outlive_the_last_stream_for_a_while(tmp_path: Path, nats_url: str) -> None:
    async with _watched(tmp_path, nats_url) as w:
        w.console.unwatch_after_s = 2.0
        first = await w.opened()
        await first.aclose()  # the page is left ...
        await asyncio.sleep(1.0)
        assert w.stats["subscribed"] and w.stats["streams"] == 0
        second = await w.opened()  # ... for the next one: no gap
        await second.aclose()
        await asyncio.sleep(1.5)  # past the first close's time (2.0 s), not the second's (3.0 s)
        assert w.stats["subscribed"]
        for _ in range(300):  # then the second close's time passes
            if not w.stats["subscribed"]:
                break
            await asyncio.sleep(0.01)
        assert not w.stats["subscribed"]


# ---- the stack and `loom console` -------------------------------------------------------------------


def test_the_stack_runs_the_console_on_its_port_unless_told_not_to() -> None:
    argv = stack.service_argvs(stack.StackOptions(console_port=8123))["console"]
    assert argv[1:3] == ["-m", "loom_services.console"] and argv[-2:] == ["--port", "8123"]
    assert "console" not in stack.service_argvs(stack.StackOptions(console=False))
    assert "--no-console" in stack.supervisor_argv(Path("/x"), stack.StackOptions(console=False))


def test_loom_console_prints_the_url_with_the_operator_or_a_tenant_token(tmp_path: Path) -> None:
    with pytest.raises(LookupError, match="loom up"):
        console_url(tmp_path)
    tokens = ensure_tokens(tmp_path)
    state = {"status": "ready", "supervisor_pid": os.getpid(), "console_url": "http://127.0.0.1:9"}
    (tmp_path / "stack.json").write_text(json.dumps(state))
    url = console_url(tmp_path)
    assert url.startswith("http://127.0.0.1:9/?token=")
    assert tokens.check(url.split("token=")[1]) == Access("operator")
    assert tokens.check(console_url(tmp_path, "alpha").split("token=")[1]) == Access("tenant", "alpha")
    # An empty tenant (an unset variable in a script) is refused: before, it printed the operator's.
    for empty in ("", "  "):
        with pytest.raises(ValueError, match="--tenant is empty"):
            console_url(tmp_path, empty)
    # The token file deleted (every token revoked): a clear way out, not a traceback.
    (tmp_path / "console-tokens.json").unlink()
    with pytest.raises(LookupError, match="loom down"):
        console_url(tmp_path)


def _land_rings() -> list[list[tuple[float, float]]]:
    rings = []
    for part in LAND_PATH.split("M")[1:]:
        points = [p.split() for p in part.rstrip("Z").split("L")]
        rings.append([(float(x), float(y)) for x, y in points])
    return rings


def _on_land(x: float, y: float) -> bool:
    """Even-odd point in polygon over every ring of the land path."""
    inside = False
    for ring in _land_rings():
        for (x1, y1), (x2, y2) in zip(ring, ring[1:] + ring[:1], strict=True):
            if (y1 > y) != (y2 > y) and x < x1 + (y - y1) * (x2 - x1) / (y2 - y1):
                inside = not inside
    return inside


def test_the_world_map_draws_the_land_under_the_regions_in_the_same_projection() -> None:
    regions = [("eu", "aws:eu-central-1"), ("us", "aws:us-east-2"), ("sg", "aws:ap-southeast-1")]
    placed = project(regions)
    html = pages.map_page(Access("operator"), regions, placed, {"regions": {}}, [], links_measured=False)
    assert html.count("<path class=land d=") == 1 and LAND_PATH in html
    assert len(_land_rings()) > 100  # continents and islands, not a placeholder
    # No edge runs across the map: rings over the antimeridian (Chukotka, Fiji) are drawn at both
    # edges instead of jumping from one to the other (only Antarctica's southern edge spans it).
    across = [
        (a, b)
        for ring in _land_rings()
        for a, b in zip(ring, ring[1:] + ring[:1], strict=True)
        if abs(a[0] - b[0]) > 500
    ]
    assert all(a[1] > 480 and b[1] > 480 for a, b in across), across[:3]
    for rid, _ in regions:  # Frankfurt, Ohio and Singapore are on land where the map puts them
        assert _on_land(placed[rid].x, placed[rid].y), rid
    for lat, lon in ((30.0, -40.0), (-30.0, 80.0), (0.0, -150.0)):  # mid-Atlantic, Indian, Pacific
        assert not _on_land((lon + 180) / 360 * 1000, (90 - lat) / 180 * 500), (lat, lon)
