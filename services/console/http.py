"""A small HTTP/1.1 server on asyncio streams: enough for the console's pages, forms and event stream.

The console lives in a service process that already runs an asyncio loop (NATS, PostgreSQL), so
the server is a coroutine on that loop rather than a thread pool: ``GET``/``POST`` with
urlencoded bodies, keep-alive, and :class:`EventStream` responses (server-sent events) that stay
open until the client leaves or the server stops.
"""

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from urllib.parse import parse_qsl, unquote, urlsplit

import structlog

log = structlog.get_logger("console.http")

_MAX_HEADER_BYTES = 16_384
_MAX_BODY_BYTES = 65_536
_IDLE_S = 30.0


@dataclass(frozen=True, slots=True)
class Request:
    """One parsed request."""

    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    """Lower-cased names."""
    form: dict[str, str] = field(default_factory=dict)

    @property
    def cookies(self) -> dict[str, str]:
        """The request's cookies by name."""
        jar: dict[str, str] = {}
        for part in self.headers.get("cookie", "").split(";"):
            name, _, value = part.strip().partition("=")
            if name:
                jar[name] = unquote(value)
        return jar


@dataclass(slots=True)
class Response:
    """A whole response."""

    status: int = 200
    body: bytes = b""
    content_type: str = "text/html; charset=utf-8"
    headers: list[tuple[str, str]] = field(default_factory=list)


@dataclass(slots=True)
class EventStream:
    """A ``text/event-stream`` response: each item of ``events`` is written as it comes."""

    events: AsyncGenerator[bytes, None]
    """Started before the response is sent (see :meth:`HttpServer._stream`), closed after."""
    headers: list[tuple[str, str]] = field(default_factory=list)


Handler = Callable[[Request], Awaitable[Response | EventStream]]


class BadRequest(Exception):
    """The bytes received are not a request this server reads."""


async def _read_request(reader: asyncio.StreamReader) -> Request | None:
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _IDLE_S)
    except (asyncio.IncompleteReadError, TimeoutError, ConnectionError):
        return None
    except asyncio.LimitOverrunError as exc:
        raise BadRequest("header too long") from exc
    if len(head) > _MAX_HEADER_BYTES:
        raise BadRequest("header too long")
    lines = head.decode("latin-1").split("\r\n")
    try:
        method, target, _version = lines[0].split(" ", 2)
    except ValueError as exc:
        raise BadRequest("bad request line") from exc
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    url = urlsplit(target)
    form: dict[str, str] = {}
    if "chunked" in headers.get("transfer-encoding", "").lower():
        raise BadRequest("send a Content-Length, not chunks")
    declared = headers.get("content-length") or "0"
    if not (
        declared.isascii() and declared.isdigit()
    ):  # "-5", "abc": before, the connection closed with no answer
        raise BadRequest(f"bad Content-Length {declared[:40]!r}")
    length = int(declared)
    if length > _MAX_BODY_BYTES:
        raise BadRequest("body too long")
    if length:
        try:
            body = await asyncio.wait_for(reader.readexactly(length), _IDLE_S)
        except (asyncio.IncompleteReadError, TimeoutError, ConnectionError):
            return None  # the client went away, or sent less than it declared
        if headers.get("content-type", "").startswith("application/x-www-form-urlencoded"):
            form = dict(parse_qsl(body.decode(), keep_blank_values=True))
    return Request(
        method=method.upper(),
        path=unquote(url.path) or "/",
        query=dict(parse_qsl(url.query, keep_blank_values=True)),
        headers=headers,
        form=form,
    )


def _head(status: int, headers: list[tuple[str, str]]) -> bytes:
    reason = HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else ""
    lines = [f"HTTP/1.1 {status} {reason}", *(f"{k}: {v}" for k, v in headers)]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


class HttpServer:
    """Serves ``handler`` on ``host:port`` (port 0: any free port; :attr:`port` says which)."""

    def __init__(self, handler: Handler, host: str = "127.0.0.1", port: int = 0) -> None:
        self.handler = handler
        self.host = host
        self.port = port
        self._server: asyncio.Server | None = None
        self._streams: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        """Listen; returns once the socket is bound."""
        self._server = await asyncio.start_server(self._serve, self.host, self.port, limit=_MAX_HEADER_BYTES)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        """Stop listening and end open event streams."""
        if self._server is not None:
            self._server.close()
        for task in list(self._streams):
            task.cancel()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        try:
            while True:
                try:
                    request = await _read_request(reader)
                except BadRequest as exc:
                    writer.write(
                        _head(400, [("Content-Length", str(len(str(exc)))), ("Connection", "close")])
                    )
                    writer.write(str(exc).encode())
                    break
                if request is None:
                    break
                try:
                    answer = await self.handler(request)
                except Exception as exc:  # a bug in a page: answer 500, keep serving
                    log.exception("request failed", method=request.method, path=request.path)
                    answer = Response(
                        status=500, body=f"internal error: {exc!r}".encode(), content_type="text/plain"
                    )
                if isinstance(answer, EventStream):
                    assert task is not None
                    self._streams.add(task)
                    await self._stream(writer, answer)
                    break
                close = request.headers.get("connection", "").lower() == "close"
                headers = [
                    ("Content-Type", answer.content_type),
                    ("Content-Length", str(len(answer.body))),
                    ("Cache-Control", "no-store"),
                    *answer.headers,
                ]
                if close:
                    headers.append(("Connection", "close"))
                writer.write(_head(answer.status, headers) + answer.body)
                await writer.drain()
                if close:
                    break
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            if task is not None:
                self._streams.discard(task)
            with contextlib.suppress(Exception):
                writer.close()

    @staticmethod
    async def _stream(writer: asyncio.StreamWriter, stream: EventStream) -> None:
        headers = [
            ("Content-Type", "text/event-stream"),
            ("Cache-Control", "no-store"),
            ("Connection", "close"),
            *stream.headers,
        ]
        # The first chunk before the headers: once a client sees the stream open, the source
        # behind it is listening (a page that acts after ``onopen`` misses nothing).
        try:
            first = await anext(stream.events)
            writer.write(_head(200, headers) + first)
            await writer.drain()
            async for chunk in stream.events:
                writer.write(chunk)
                await writer.drain()
        finally:
            await stream.events.aclose()
