"""A tiny HTTP/1.1 receiver on asyncio's own server: Alertmanager's webhook, nothing else.

No web framework: the service needs one POST route and a health route, and a dependency for that
is not worth its weight. One request per connection (``Connection: close``); the request line
and headers are bounded (16 KiB), the body by ``max_body_bytes``.

* ``POST /alertmanager`` (also ``/`` and ``/api/v1/alerts``, where Alertmanager is often pointed):
  the handler's answer — 200 with ``{"accepted": n}``, 400 with ``{"error": why}`` for a malformed
  payload, 503 when Loom's bus cannot take it;
* ``GET /healthz``: 200.

With a ``token`` (a secured stack's, :mod:`loom.security.http_token`) a POST without
``Authorization: Bearer <token>`` gets 401 and raises nothing: on a shared host another user could
otherwise raise (or resolve) incidents. Alertmanager sends it with ``http_config: authorization:
credentials_file: <the token file>``.
"""

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import structlog

from loom.security.http_token import CHALLENGE, Token, authorized

log = structlog.get_logger("alert-correlator")

MAX_HEAD_BYTES = 16 * 1024
POST_PATHS = frozenset({"/", "/alertmanager", "/api/v1/alerts"})
_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
    411: "Length Required",
    413: "Payload Too Large",
    503: "Service Unavailable",
}


@dataclass(frozen=True, slots=True)
class Answer:
    """An HTTP status and a JSON body."""

    status: int
    body: dict[str, object]


PostHandler = Callable[[bytes], Awaitable[Answer]]


def _response(answer: Answer) -> bytes:
    body = json.dumps(answer.body).encode()
    challenge = f"WWW-Authenticate: {CHALLENGE}\r\n" if answer.status == 401 else ""
    head = (
        f"HTTP/1.1 {answer.status} {_REASONS.get(answer.status, 'Error')}\r\n"
        "Content-Type: application/json\r\n"
        f"{challenge}"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode() + body


class Receiver:
    """Serves :data:`POST_PATHS` with ``on_post`` until :meth:`close`."""

    def __init__(
        self, on_post: PostHandler, *, max_body_bytes: int, timeout_s: float = 10.0, token: Token = None
    ) -> None:
        self.on_post = on_post
        self.token = token
        """The bearer token a POST must carry (None: none asked for)."""
        self.max_body_bytes = max_body_bytes
        self.timeout_s = timeout_s
        self.server: asyncio.Server | None = None
        self.port: int | None = None
        self.counts: dict[str, int] = {"requests": 0, "accepted": 0, "refused": 0}

    async def start(self, host: str, port: int) -> int:
        """Listen; returns the port (``port`` 0 picks a free one)."""
        self.server = await asyncio.start_server(self._serve, host, port, limit=MAX_HEAD_BYTES)
        self.port = int(self.server.sockets[0].getsockname()[1])
        return self.port

    async def close(self) -> None:
        """Stop listening."""
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(Exception):
                await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            answer = await asyncio.wait_for(self._answer(reader, writer), timeout=self.timeout_s)
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
            answer = Answer(400, {"error": f"bad request: {type(exc).__name__}"})
        except Exception as exc:  # never let one request take the receiver down
            log.warning("webhook request failed", error=repr(exc))
            answer = Answer(503, {"error": "could not take the alerts now; retry"})
        self.counts["requests"] += 1
        self.counts["accepted" if answer.status == 200 else "refused"] += 1
        with contextlib.suppress(Exception):
            writer.write(_response(answer))
            await writer.drain()
            writer.close()
            await writer.wait_closed()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Answer:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3:
            return Answer(400, {"error": "bad request line"})
        method, target, _ = parts
        path = target.split("?", 1)[0]
        headers = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        if method == "GET" and path == "/healthz":
            return Answer(200, {"status": "ok"})
        if path not in POST_PATHS:
            return Answer(404, {"error": f"no such path {path[:100]!r}"})
        if method != "POST":
            return Answer(405, {"error": "POST the webhook payload"})
        if not authorized(headers.get("authorization"), self.token):
            return Answer(401, {"error": "a bearer token is needed (the stack's http.token)"})
        if "chunked" in headers.get("transfer-encoding", "").lower():
            return Answer(411, {"error": "send a Content-Length, not chunks"})
        try:
            length = int(headers.get("content-length", ""))
        except ValueError:
            return Answer(411, {"error": "Content-Length required"})
        if length < 0 or length > self.max_body_bytes:
            return Answer(413, {"error": f"body over {self.max_body_bytes} bytes"})
        if headers.get("expect", "").lower() == "100-continue":  # curl asks before a large body
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            await writer.drain()
        body = await reader.readexactly(length)
        return await self.on_post(body)
