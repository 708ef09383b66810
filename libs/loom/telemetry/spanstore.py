"""A trace store for a stack without Jaeger: an OTLP/HTTP receiver that keeps every span it is sent
on disk and answers Jaeger's query API for one trace (``GET /api/traces/<trace id>``).

``loom up --traces`` runs one in the supervisor and points every service's exporter at it
(``OTEL_EXPORTER_OTLP_ENDPOINT``); ``loom trace JOB`` then reads the job's span tree from it as it
would from Jaeger, and ``loom submit`` exports its own span there. Spans are JSON lines in
``<home>/traces/spans.jsonl`` (:class:`SpanFile`), the file before it kept as ``spans.1.jsonl`` once
it passes :data:`ROTATE_BYTES`, so the store holds between one and two files' worth of the newest
spans whatever the stack runs for: at 300-600 bytes a span, some 100,000-400,000 spans (hours of an
ordinary stack; under a burst of hundreds of jobs a second, less than a minute of it). The files
are the home owner's alone (0600 in a 0700 directory): they name every tenant's jobs. For the same
reason a store given a ``token`` (a secured stack's, :mod:`loom.security.http_token`) answers
only requests that carry it as a bearer token, exports and queries alike (401 otherwise): another
user of the host can neither read the spans nor post false ones.

Only protobuf bodies (what ``opentelemetry-exporter-otlp-proto-http`` sends, gzip or deflate
allowed) are understood; a body that does not decode gets 400 and is counted in ``errors``. Logs
and metrics posted to it are accepted and dropped, so an exporter of them logs no errors.
"""

from __future__ import annotations

import gzip
import json
import os
import threading
import zlib
from collections.abc import Callable, Iterable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypedDict

from loom.security.http_token import Token, authorized, reply

__all__ = [
    "JAEGER_TRACES_PATH",
    "MAX_BODY_BYTES",
    "ROTATE_BYTES",
    "TRACES_PATH",
    "ReceivedSpan",
    "SpanFile",
    "TraceServer",
    "decode_spans",
    "decompress",
    "jaeger_answer",
]

TRACES_PATH = "/v1/traces"
"""Where OTLP/HTTP exporters post spans (the endpoint plus this path)."""
JAEGER_TRACES_PATH = "/api/traces/"
"""Jaeger's query API for one trace: ``GET /api/traces/<trace id>``."""
MAX_BODY_BYTES = 32 * 1024 * 1024
"""A larger export request is refused (413) before it is read."""
ROTATE_BYTES = 64 * 1024 * 1024
"""The span file is set aside as ``spans.1.jsonl`` (replacing the one before) past this size."""


class ReceivedSpan(TypedDict):
    """One span as the receiver decoded it; ids are lowercase hex, as Jaeger and logs show them."""

    trace_id: str
    span_id: str
    parent_span_id: str | None
    name: str
    kind: str  # "INTERNAL", "SERVER", "CLIENT", "PRODUCER", "CONSUMER" or "UNSPECIFIED"
    status: str  # "UNSET", "OK" or "ERROR"
    service_name: str | None
    scope_name: str
    attributes: dict[str, Any]
    start_time_unix_nano: int
    end_time_unix_nano: int


def _value(value: Any) -> Any:
    field = value.WhichOneof("value")
    if field is None:
        return None
    if field == "array_value":
        return [_value(item) for item in value.array_value.values]
    if field == "kvlist_value":
        return _attributes(value.kvlist_value.values)
    if field == "bytes_value":
        return bytes(value.bytes_value).hex()  # JSON has no bytes
    return getattr(value, field)


def _attributes(pairs: Iterable[Any]) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs}


def decode_spans(body: bytes) -> list[ReceivedSpan]:
    """The spans of one serialized ``ExportTraceServiceRequest`` (protobuf)."""
    # Imported here: protobuf costs import time in processes that never receive spans.
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (  # noqa: PLC0415
        ExportTraceServiceRequest,
    )
    from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status  # noqa: PLC0415

    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    spans: list[ReceivedSpan] = []
    for resource_spans in request.resource_spans:
        resource = _attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(
                    ReceivedSpan(
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex() or None,
                        name=span.name,
                        kind=Span.SpanKind.Name(span.kind).removeprefix("SPAN_KIND_"),
                        status=Status.StatusCode.Name(span.status.code).removeprefix("STATUS_CODE_"),
                        service_name=resource.get("service.name"),
                        scope_name=scope_spans.scope.name,
                        attributes=_attributes(span.attributes),
                        start_time_unix_nano=span.start_time_unix_nano,
                        end_time_unix_nano=span.end_time_unix_nano,
                    )
                )
    return spans


def decompress(body: bytes, encoding: str | None) -> bytes:
    """A request body as sent with ``Content-Encoding`` gzip, deflate or none."""
    if encoding == "gzip":
        return gzip.decompress(body)
    if encoding == "deflate":
        return zlib.decompress(body)
    return body


def jaeger_answer(trace_id: str, spans: list[ReceivedSpan]) -> dict[str, Any] | None:
    """One trace's spans as Jaeger's ``/api/traces/<id>`` answers them (the fields ``loom trace``
    reads: spans, CHILD_OF references, processes, microsecond times); None without spans."""
    if not spans:
        return None
    processes: dict[str, dict[str, Any]] = {}
    pid_of: dict[str, str] = {}
    out = []
    for span in spans:
        service = str(span["service_name"])
        pid = pid_of.get(service)
        if pid is None:
            pid = pid_of[service] = f"p{len(processes) + 1}"
            processes[pid] = {"serviceName": service, "tags": []}
        refs = (
            [{"refType": "CHILD_OF", "traceID": trace_id, "spanID": span["parent_span_id"]}]
            if span["parent_span_id"]
            else []
        )
        tags: list[dict[str, Any]] = [
            {"key": k, "type": "string", "value": str(v)} for k, v in span["attributes"].items()
        ]
        if span["status"] == "ERROR":
            tags.append({"key": "error", "type": "bool", "value": True})
        out.append(
            {
                "traceID": trace_id,
                "spanID": span["span_id"],
                "operationName": span["name"],
                "references": refs,
                "startTime": span["start_time_unix_nano"] // 1000,
                "duration": (span["end_time_unix_nano"] - span["start_time_unix_nano"]) // 1000,
                "tags": tags,
                "processID": pid,
            }
        )
    return {"data": [{"traceID": trace_id, "spans": out, "processes": processes}]}


class SpanFile:
    """Spans as JSON lines in ``directory/spans.jsonl``, set aside as ``spans.1.jsonl`` past
    ``rotate_bytes``. Safe for one writing process with several threads (a lock per instance)."""

    def __init__(self, directory: Path, *, rotate_bytes: int = ROTATE_BYTES) -> None:
        self.directory = directory
        self.rotate_bytes = rotate_bytes
        self._lock = threading.Lock()

    @property
    def current(self) -> Path:
        """The file spans are appended to."""
        return self.directory / "spans.jsonl"

    @property
    def previous(self) -> Path:
        """The file set aside at the last rotation."""
        return self.directory / "spans.1.jsonl"

    def append(self, spans: list[ReceivedSpan]) -> None:
        """Write ``spans``, one line each, in one write (a reader never sees half a batch's line)."""
        if not spans:
            return
        data = "".join(json.dumps(span, separators=(",", ":")) + "\n" for span in spans).encode()
        with self._lock:
            # Every tenant's job and tenant ids are in there: the home's owner's alone.
            self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            try:
                size = self.current.stat().st_size
            except FileNotFoundError:
                size = 0
            if size and size + len(data) > self.rotate_bytes:
                os.replace(self.current, self.previous)
            fd = os.open(self.current, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            with os.fdopen(fd, "ab") as f:
                f.write(data)

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        """Every stored span of ``trace_id`` (lowercase hex), oldest file first, in write order."""
        # Most lines are other traces': a byte search spares decoding them.
        return self._read(f'"trace_id":"{trace_id.lower()}"'.encode())

    def trace_of_job(self, job_id: str) -> str | None:
        """The trace of the job ``job_id`` as its stored spans name it (the ``loom.job.id``
        attribute the services set, :func:`loom.telemetry.logs.bind_job`): the newest span's, or
        None. What ``loom trace JOB`` falls back on when no service can answer (the stack down)."""
        from loom.telemetry.logs import JOB_ID_ATTRIBUTE  # noqa: PLC0415 - structlog, on use

        needle = json.dumps(job_id).encode()
        found = None
        for span in self._read(needle):
            if span.get("attributes", {}).get(JOB_ID_ATTRIBUTE) == job_id:
                found = span["trace_id"]
        return found

    def spans(self) -> list[ReceivedSpan]:
        """Every stored span, oldest file first, in write order."""
        return self._read(b"")

    def _read(self, needle: bytes) -> list[ReceivedSpan]:
        found: list[ReceivedSpan] = []
        for path in (self.previous, self.current):
            try:
                with open(path, "rb") as f:
                    for line in f:
                        if needle in line and line.endswith(b"\n"):  # a line being written: not yet
                            span: ReceivedSpan = json.loads(line)
                            found.append(span)
            except FileNotFoundError:
                continue
        return found


class TraceServer:
    """An OTLP/HTTP receiver and Jaeger query endpoint on ``host``, port ``port`` (0: a free one),
    served from a background thread: received spans go to ``sink``, and ``GET
    /api/traces/<id>`` answers what ``lookup(id)`` returns. With a ``token`` only requests that carry
    ``Authorization: Bearer <token>`` are served (the others get 401 and count in ``errors``)."""

    def __init__(
        self,
        sink: Callable[[list[ReceivedSpan]], None],
        lookup: Callable[[str], list[ReceivedSpan]],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: Token = None,
    ) -> None:
        self._sink = sink
        self._token = token
        self._lookup = lookup
        self._address = (host, port)
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.requests = 0
        """Trace export requests received, refused ones included."""
        self.spans = 0
        """Spans received."""
        self.errors: list[str] = []
        """Why requests were refused (the newest 100)."""

    @property
    def url(self) -> str:
        """The base URL: ``OTEL_EXPORTER_OTLP_ENDPOINT`` for exporters, the Jaeger URL for readers."""
        if self._server is None:
            raise RuntimeError("the trace server is not started")
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> TraceServer:
        """Listen and serve in a daemon thread."""
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as the exporter's session expects

            def _allowed(self) -> bool:
                if authorized(self.headers.get("Authorization"), owner._token):
                    return True
                owner._refused(f"{self.command} {self.path.split('?')[0]}: no or a wrong bearer token")
                self.close_connection = True  # the body, if any, is left unread
                self._reply(HTTPStatus.UNAUTHORIZED, b"a bearer token is needed\n", "text/plain")
                return False

            def do_POST(self) -> None:
                if not self._allowed():
                    return
                try:
                    length = int(self.headers.get("Content-Length") or 0)
                except ValueError:
                    length = -1
                if length < 0 or length > MAX_BODY_BYTES:
                    owner._refused(f"Content-Length {self.headers.get('Content-Length')!r}")
                    self.close_connection = True
                    status = HTTPStatus.BAD_REQUEST if length < 0 else HTTPStatus.REQUEST_ENTITY_TOO_LARGE
                    self._reply(status, b"")
                    return
                body = self.rfile.read(length)
                if self.path.split("?")[0] != TRACES_PATH:
                    self._reply(HTTPStatus.OK, b"")  # logs, metrics: accepted, dropped
                    return
                try:
                    spans = decode_spans(decompress(body, self.headers.get("Content-Encoding")))
                except Exception as exc:  # an undecodable body is the sender's fault: say why
                    owner._refused(f"{type(exc).__name__}: {exc}")
                    self._reply(HTTPStatus.BAD_REQUEST, str(exc).encode())
                    return
                try:
                    owner._received(spans)
                except OSError as exc:  # the disk: the exporter retries later
                    owner._refused(f"not stored: {exc}")
                    self._reply(HTTPStatus.SERVICE_UNAVAILABLE, str(exc).encode())
                    return
                self._reply(HTTPStatus.OK, b"")  # an empty ExportTraceServiceResponse

            def do_GET(self) -> None:
                if not self._allowed():
                    return
                path = self.path.split("?")[0]
                if not path.startswith(JAEGER_TRACES_PATH):
                    self._reply(HTTPStatus.NOT_FOUND, b"", "application/json")
                    return
                trace_id = path.removeprefix(JAEGER_TRACES_PATH).lower()
                if len(trace_id) != 32 or any(c not in "0123456789abcdef" for c in trace_id):
                    self._reply(HTTPStatus.BAD_REQUEST, b'{"data": null}', "application/json")
                    return
                found = jaeger_answer(trace_id, owner._lookup(trace_id))
                if found is None:
                    self._reply(HTTPStatus.NOT_FOUND, b'{"data": null}', "application/json")
                    return
                self._reply(HTTPStatus.OK, json.dumps(found).encode(), "application/json")

            def _reply(
                self, status: HTTPStatus, payload: bytes, content_type: str = "application/x-protobuf"
            ) -> None:
                reply(self, status, payload, content_type)

            def log_message(self, format: str, *args: Any) -> None:
                """Quiet: one line per export would drown the supervisor's log."""

        self._server = ThreadingHTTPServer(self._address, Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="trace-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the port."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _received(self, spans: list[ReceivedSpan]) -> None:
        self._sink(spans)
        with self._lock:
            self.requests += 1
            self.spans += len(spans)

    def _refused(self, why: str) -> None:
        with self._lock:
            self.requests += 1
            self.errors = [*self.errors[-99:], why]
