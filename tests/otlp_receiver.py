"""A real OTLP/HTTP trace receiver for tests: what a collector or Jaeger would get, decoded.

Start it, point processes at it with ``OTEL_EXPORTER_OTLP_ENDPOINT=<receiver.url>`` (the exporter
appends ``/v1/traces``), and wait for the spans you expect::

    with OtlpReceiver() as receiver:
        env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url}
        ...
        spans = receiver.wait_for(lambda spans: len(spans) >= 2, timeout_s=10)

Only protobuf bodies (what opentelemetry-exporter-otlp-proto-http sends) are understood. Logs and
metrics posted to it are accepted and dropped, so a process exporting them does not log errors.

It also answers ``GET /api/traces/<trace id>`` in the JSON shape of Jaeger's query API (the
fields ``loom trace`` reads: spans, CHILD_OF references, processes, microsecond times), built
from the spans it received: no Jaeger binary can run here, and this is what Jaeger would answer
for the same export.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import threading
import zlib
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any, Self, TypedDict

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

TRACES_PATH = "/v1/traces"
JAEGER_TRACES_PATH = "/api/traces/"


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


def _value(value: AnyValue) -> Any:
    field = value.WhichOneof("value")
    if field is None:
        return None
    if field == "array_value":
        return [_value(item) for item in value.array_value.values]
    if field == "kvlist_value":
        return _attributes(value.kvlist_value.values)
    return getattr(value, field)


def _attributes(pairs: Any) -> dict[str, Any]:
    result: dict[str, Any] = {}
    pair: KeyValue
    for pair in pairs:
        result[pair.key] = _value(pair.value)
    return result


def decode_spans(body: bytes) -> list[ReceivedSpan]:
    """The spans of one serialized ``ExportTraceServiceRequest``."""
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


def _decompress(body: bytes, encoding: str | None) -> bytes:
    if encoding == "gzip":
        return gzip.decompress(body)
    if encoding == "deflate":
        return zlib.decompress(body)
    return body


class OtlpReceiver:
    """An OTLP/HTTP receiver on 127.0.0.1 and a free port, recording the spans it is sent."""

    def __init__(self) -> None:
        self._spans: list[ReceivedSpan] = []
        self._changed = threading.Condition()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.requests = 0
        """How many trace export requests arrived, including failed ones."""
        self.errors: list[str] = []
        """Why requests were refused (a body that did not decode); tests may assert it is empty."""

    @property
    def url(self) -> str:
        """The base URL, for ``OTEL_EXPORTER_OTLP_ENDPOINT``."""
        if self._server is None:
            raise RuntimeError("the receiver is not started")
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    @property
    def traces_url(self) -> str:
        """The full traces URL, for ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or an exporter's endpoint."""
        return self.url + TRACES_PATH

    @property
    def spans(self) -> list[ReceivedSpan]:
        """A snapshot of every span received so far, in arrival order."""
        with self._changed:
            return list(self._spans)

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        """The spans received so far of one trace."""
        return [span for span in self.spans if span["trace_id"] == trace_id]

    def jaeger_trace(self, trace_id: str) -> dict[str, Any] | None:
        """The spans of one trace as Jaeger's ``/api/traces/<id>`` answers them (None: unknown)."""
        spans = self.trace(trace_id.lower())
        if not spans:
            return None
        processes: dict[str, dict[str, Any]] = {}
        out = []
        for span in spans:
            service = str(span["service_name"])
            pid = next((k for k, v in processes.items() if v["serviceName"] == service), None)
            if pid is None:
                pid = f"p{len(processes) + 1}"
                processes[pid] = {"serviceName": service, "tags": []}
            refs = (
                [{"refType": "CHILD_OF", "traceID": trace_id, "spanID": span["parent_span_id"]}]
                if span["parent_span_id"]
                else []
            )
            tags = [{"key": k, "type": "string", "value": str(v)} for k, v in span["attributes"].items()]
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

    def clear(self) -> None:
        """Forget the spans received so far."""
        with self._changed:
            self._spans.clear()

    def start(self) -> Self:
        """Listen on a free port and serve in a background thread."""
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as the exporter's session expects

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                if self.path.split("?")[0] != TRACES_PATH:
                    self._reply(HTTPStatus.OK, b"")
                    return
                try:
                    spans = decode_spans(_decompress(body, self.headers.get("Content-Encoding")))
                except Exception as exc:  # any undecodable body is the sender's bug; report it
                    receiver._record_error(f"{type(exc).__name__}: {exc}")
                    self._reply(HTTPStatus.BAD_REQUEST, str(exc).encode())
                    return
                receiver._record(spans)
                self._reply(HTTPStatus.OK, ExportTraceServiceResponse().SerializeToString())

            def do_GET(self) -> None:
                path = self.path.split("?")[0]
                if not path.startswith(JAEGER_TRACES_PATH):
                    self._reply(HTTPStatus.NOT_FOUND, b"", "application/json")
                    return
                found = receiver.jaeger_trace(path.removeprefix(JAEGER_TRACES_PATH))
                if found is None:
                    self._reply(HTTPStatus.NOT_FOUND, b'{"data": null}', "application/json")
                    return
                self._reply(HTTPStatus.OK, json.dumps(found).encode(), "application/json")

            def _reply(
                self, status: HTTPStatus, payload: bytes, content_type: str = "application/x-protobuf"
            ) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, format: str, *args: Any) -> None:
                """Quiet: one stderr line per export would drown test output."""

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-receiver", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the port; the spans stay readable."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def wait_for(
        self, predicate: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 10.0
    ) -> list[ReceivedSpan]:
        """Block until ``predicate(spans)`` holds and return those spans; TimeoutError otherwise.

        Rechecked whenever spans arrive, so no polling interval bounds how fast it returns.
        """
        with self._changed:
            if not self._changed.wait_for(lambda: predicate(list(self._spans)), timeout=timeout_s):
                raise TimeoutError(
                    f"no match within {timeout_s} s among {len(self._spans)} spans: "
                    f"{[(s['name'], s['service_name']) for s in self._spans]}"
                )
            return list(self._spans)

    async def wait_for_async(
        self, predicate: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 10.0
    ) -> list[ReceivedSpan]:
        """:meth:`wait_for` from async code, without blocking the event loop."""
        return await asyncio.to_thread(self.wait_for, predicate, timeout_s)

    def _record(self, spans: list[ReceivedSpan]) -> None:
        with self._changed:
            self.requests += 1
            self._spans.extend(spans)
            self._changed.notify_all()

    def _record_error(self, error: str) -> None:
        with self._changed:
            self.requests += 1
            self.errors.append(error)
            self._changed.notify_all()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
