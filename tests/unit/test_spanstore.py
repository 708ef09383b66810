"""The stack's own trace store (`loom up --traces`): OTLP/HTTP in, span files, Jaeger's query API out."""

import gzip
import http.client
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import SpanKind, Status, StatusCode

from loom.telemetry.jaeger import fetch_trace, parse_jaeger_trace, render_tree
from loom.telemetry.spanstore import SpanFile, TraceServer, decode_spans


class _Keep(SpanExporter):
    def __init__(self) -> None:
        self.spans: list[ReadableSpan] = []

    def export(self, spans: object) -> SpanExportResult:
        self.spans.extend(spans)  # type: ignore[arg-type]
        return SpanExportResult.SUCCESS


def _spans(service: str = "svc") -> list[ReadableSpan]:
    """A parent with a producer child (error status), as the SDK records them."""
    keep = _Keep()
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(SimpleSpanProcessor(keep))
    tracer = provider.get_tracer("test")
    with (
        tracer.start_as_current_span("parent", attributes={"job": "j-1", "n": 3}),
        tracer.start_as_current_span("publish x", kind=SpanKind.PRODUCER) as child,
    ):
        child.set_status(Status(StatusCode.ERROR, "refused"))
    provider.shutdown()
    return keep.spans


def _body(spans: list[ReadableSpan]) -> bytes:
    return encode_spans(spans).SerializeToString()


def test_an_sdk_export_request_decodes_to_its_spans_with_parents_kinds_status_and_service() -> None:
    sdk = _spans()
    decoded = decode_spans(_body(sdk))
    by_name = {s["name"]: s for s in decoded}
    parent, child = by_name["parent"], by_name["publish x"]
    assert parent["trace_id"] == child["trace_id"] == format(sdk[0].context.trace_id, "032x")
    assert child["parent_span_id"] == parent["span_id"] and parent["parent_span_id"] is None
    assert (child["kind"], child["status"], parent["status"]) == ("PRODUCER", "ERROR", "UNSET")
    assert parent["attributes"] == {"job": "j-1", "n": 3} and parent["service_name"] == "svc"
    assert parent["end_time_unix_nano"] >= parent["start_time_unix_nano"] > 0


def test_span_file_keeps_traces_apart_and_sets_the_old_file_aside_past_its_size(tmp_path: Path) -> None:
    store = SpanFile(tmp_path / "traces", rotate_bytes=2000)
    first, second = decode_spans(_body(_spans("a"))), decode_spans(_body(_spans("b")))
    store.append(first)
    store.append(second)
    assert [s["name"] for s in store.trace(first[0]["trace_id"])] == [s["name"] for s in first]
    assert {s["service_name"] for s in store.trace(second[0]["trace_id"].upper())} == {"b"}
    assert store.trace("0" * 32) == []
    # Past the size, the current file becomes spans.1.jsonl (replacing the one before it): the
    # newest spans stay readable, the oldest go.
    batches = [decode_spans(_body(_spans(f"s{i}"))) for i in range(8)]
    for batch in batches:
        store.append(batch)
    assert store.previous.exists() and store.current.stat().st_size <= 2000
    assert store.trace(batches[-1][0]["trace_id"]) == batches[-1]
    assert store.trace(first[0]["trace_id"]) == []
    assert len(store.spans()) < 2 * (len(batches) + 2)
    # Every tenant's job ids are in there: the home's owner's alone.
    assert stat.S_IMODE(store.directory.stat().st_mode) == 0o700
    assert {stat.S_IMODE(p.stat().st_mode) for p in (store.current, store.previous)} == {0o600}


def _post(url: str, body: bytes, headers: dict[str, str], path: str = "/v1/traces") -> tuple[int, bytes]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    try:
        conn.request("POST", path, body=body, headers=headers)
        answer = conn.getresponse()
        return answer.status, answer.read()
    finally:
        conn.close()


def test_the_trace_server_stores_what_exporters_send_and_answers_jaegers_query_api(tmp_path: Path) -> None:
    store = SpanFile(tmp_path / "traces")
    server = TraceServer(store.append, store.trace).start()
    try:
        sdk = _spans("placement")
        trace_id = format(sdk[0].context.trace_id, "032x")
        protobuf = {"Content-Type": "application/x-protobuf"}
        gzipped = {**protobuf, "Content-Encoding": "gzip"}
        assert _post(server.url, gzip.compress(_body(sdk)), gzipped)[0] == 200
        assert {s["name"] for s in store.trace(trace_id)} == {"parent", "publish x"}
        # What `loom trace` reads: Jaeger's answer, parsed and drawn as a tree.
        roots = parse_jaeger_trace(fetch_trace(server.url, trace_id), trace_id)
        lines = render_tree(roots)
        assert lines[0].split()[-2:] == ["placement:", "parent"] and "0.000s" in lines[0]
        assert lines[1].split()[-3:] == ["placement:", "publish", "x"] and "!" in lines[1].split()
        # Refusals change nothing and say why.
        assert _post(server.url, b"\xff\xff not protobuf", protobuf)[0] == 400
        assert server.errors and "DecodeError" in server.errors[-1]
        assert _post(server.url, b"x", {**protobuf, "Content-Length": str(64 * 1024 * 1024)})[0] == 413
        assert _post(server.url, b"{}", protobuf, path="/v1/logs")[0] == 200  # accepted, dropped
        assert len(store.spans()) == 2
        with pytest.raises(LookupError, match="no trace"):
            fetch_trace(server.url, "1" * 32, name="the stack's trace store")
        with pytest.raises(OSError, match="answered 400"):
            fetch_trace(server.url, "not-a-trace-id")
        assert (server.requests, server.spans) == (3, 2)
    finally:
        server.stop()


def test_loom_up_traces_refuses_an_otlp_endpoint_set_elsewhere(tmp_path: Path) -> None:
    env = dict(os.environ, LOOM_HOME=str(tmp_path), OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:4318")
    out = subprocess.run(
        [sys.executable, "-m", "loom.cli.main", "up", "--traces"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert "unset one of the two" in out.stderr
    assert not (tmp_path / "stack.json").exists()  # nothing started


def test_a_trace_store_with_a_token_answers_only_requests_that_carry_it(tmp_path: Path) -> None:
    """A secured stack's store: another user of the host can neither read the spans (they name
    every tenant's jobs) nor post false ones; an SDK exporter given the token's header by the
    environment the stack sets (`otlp_headers`) is let in."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    from loom.security.http_token import bearer_header, otlp_headers

    store = SpanFile(tmp_path / "traces")
    server = TraceServer(store.append, store.trace, token="s3cret-token").start()
    try:
        sdk = _spans("placement")
        trace_id = format(sdk[0].context.trace_id, "032x")
        protobuf = {"Content-Type": "application/x-protobuf"}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret-token"}):
            status, _ = _post(server.url, _body(sdk), {**protobuf, **headers})
            assert status == 401
        assert store.spans() == [] and len(server.errors) == 3 and "bearer token" in server.errors[-1]
        with pytest.raises(OSError, match="bearer token"):
            fetch_trace(server.url, trace_id)
        # The exporter the services run, configured only by the environment `loom up` gives them.
        saved = os.environ.copy()
        os.environ.update(otlp_headers("s3cret-token"))
        try:
            exporter = OTLPSpanExporter(endpoint=f"{server.url}/v1/traces")
        finally:
            os.environ.clear()
            os.environ.update(saved)
        assert exporter.export(sdk) == SpanExportResult.SUCCESS
        assert {s["name"] for s in store.trace(trace_id)} == {"parent", "publish x"}
        roots = parse_jaeger_trace(
            fetch_trace(server.url, trace_id, headers=bearer_header("s3cret-token")), trace_id
        )
        assert [r.name for r in roots] == ["parent"]
    finally:
        server.stop()
