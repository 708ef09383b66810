"""loom.telemetry: trace context through NATS headers, span kinds and parents, log fields."""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import Iterator

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from loom.telemetry import (
    JOB_ID_ATTRIBUTE,
    bind_job,
    configure_logging,
    consumer_span,
    context_from_traceparent,
    current_span_id,
    current_trace_id,
    current_traceparent,
    extract,
    get_logger,
    inject,
    producer_span,
    reset_for_tests,
    reset_logging,
    setup_telemetry,
    span_with_parent,
)

SUBJECT = "loom.jobs.submitted.acme"


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def tracer(exporter: InMemorySpanExporter) -> Iterator[trace.Tracer]:
    """A tracer of a provider of the test's own, so no test touches the global one."""
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider.get_tracer("test")
    provider.shutdown()


@pytest.fixture
def global_telemetry() -> Iterator[None]:
    yield
    reset_for_tests()
    reset_logging()


@pytest.fixture
def log_lines() -> Iterator[io.StringIO]:
    stream = io.StringIO()
    configure_logging("test-svc", level="DEBUG", stream=stream)
    yield stream
    reset_logging()


def parsed(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def hex_ids(span: ReadableSpan) -> tuple[str, str]:
    context = span.get_span_context()
    assert context is not None
    return trace.format_trace_id(context.trace_id), trace.format_span_id(context.span_id)


def finished(exporter: InMemorySpanExporter, name: str) -> ReadableSpan:
    (span,) = [s for s in exporter.get_finished_spans() if s.name == name]
    return span


# -- producer -------------------------------------------------------------------------------------


def test_producer_span_injects_a_traceparent_naming_itself(
    tracer: trace.Tracer, exporter: InMemorySpanExporter
) -> None:
    with producer_span(SUBJECT, message_id="msg-1", tracer=tracer) as (span, headers):
        context = span.get_span_context()
        trace_hex = trace.format_trace_id(context.trace_id)
        span_hex = trace.format_span_id(context.span_id)

    version, trace_part, parent_part, _flags = headers["traceparent"].split("-")
    assert (version, trace_part, parent_part) == ("00", trace_hex, span_hex)
    produced = finished(exporter, "publish loom.jobs.submitted")
    assert produced.kind is SpanKind.PRODUCER
    assert produced.parent is None
    assert dict(produced.attributes or {}) == {
        "messaging.system": "nats",
        "messaging.destination.name": SUBJECT,
        "messaging.operation.name": "publish",
        "messaging.operation.type": "send",
        "messaging.message.id": "msg-1",
    }


def test_producer_span_copies_given_headers_without_changing_them(tracer: trace.Tracer) -> None:
    given = {"Nats-Msg-Id": "msg-1"}
    with producer_span(SUBJECT, headers=given, tracer=tracer) as (_, headers):
        pass
    assert given == {"Nats-Msg-Id": "msg-1"}
    assert headers["Nats-Msg-Id"] == "msg-1"
    assert "traceparent" in headers


def test_span_names_keep_only_the_subjects_leading_tokens(
    tracer: trace.Tracer, exporter: InMemorySpanExporter
) -> None:
    with producer_span("loom.net.link.eu-west.us-east", tracer=tracer) as (_, headers):
        pass
    with consumer_span("loom.net.link.eu-west.us-east", headers, tracer=tracer):
        pass
    assert [s.name for s in exporter.get_finished_spans()] == [
        "publish loom.net.link",
        "process loom.net.link",
    ]


# -- consumer -------------------------------------------------------------------------------------


def test_consumer_span_joins_the_producers_trace_as_its_child(
    tracer: trace.Tracer, exporter: InMemorySpanExporter
) -> None:
    with producer_span(SUBJECT, message_id="msg-1", tracer=tracer) as (_, headers):
        pass
    with consumer_span(SUBJECT, headers, message_id="msg-1", tracer=tracer, attributes={"x": 1}):
        pass

    produced = finished(exporter, "publish loom.jobs.submitted")
    consumed = finished(exporter, "process loom.jobs.submitted")
    assert consumed.kind is SpanKind.CONSUMER
    assert consumed.context is not None and produced.context is not None
    assert consumed.context.trace_id == produced.context.trace_id
    assert consumed.parent is not None
    assert consumed.parent.span_id == produced.context.span_id
    assert consumed.attributes is not None
    assert consumed.attributes["messaging.system"] == "nats"
    assert consumed.attributes["messaging.destination.name"] == SUBJECT
    assert consumed.attributes["messaging.message.id"] == "msg-1"
    assert consumed.attributes["messaging.operation.type"] == "process"
    assert consumed.attributes["x"] == 1


def test_publish_inside_a_consumer_continues_the_same_trace(
    tracer: trace.Tracer, exporter: InMemorySpanExporter
) -> None:
    with producer_span(SUBJECT, tracer=tracer) as (_, submitted):
        pass
    with (
        consumer_span(SUBJECT, submitted, tracer=tracer) as handling,
        producer_span("loom.jobs.placed.c1", tracer=tracer) as (_, placed),
    ):
        pass

    with consumer_span("loom.jobs.placed.c1", placed, tracer=tracer):
        pass

    trace_ids = {s.context.trace_id for s in exporter.get_finished_spans() if s.context}
    assert len(trace_ids) == 1
    nested = finished(exporter, "publish loom.jobs.placed")
    assert nested.parent is not None
    assert nested.parent.span_id == handling.get_span_context().span_id
    last = finished(exporter, "process loom.jobs.placed")
    assert last.parent is not None and nested.context is not None
    assert last.parent.span_id == nested.context.span_id


def test_consumer_span_without_traceparent_starts_a_new_trace(
    tracer: trace.Tracer, exporter: InMemorySpanExporter
) -> None:
    # A message's handler must not adopt whatever span happens to be current.
    with producer_span(SUBJECT, tracer=tracer), consumer_span(SUBJECT, {"Nats-Msg-Id": "m"}, tracer=tracer):
        pass
    with consumer_span(SUBJECT, None, tracer=tracer):
        pass

    consumed = [s for s in exporter.get_finished_spans() if s.kind is SpanKind.CONSUMER]
    assert [s.parent for s in consumed] == [None, None]
    produced = finished(exporter, "publish loom.jobs.submitted")
    assert produced.context is not None
    assert all(s.context and s.context.trace_id != produced.context.trace_id for s in consumed)


def test_an_exception_in_a_consumer_span_marks_it_error_and_propagates(
    tracer: trace.Tracer, exporter: InMemorySpanExporter
) -> None:
    with producer_span(SUBJECT, tracer=tracer) as (_, headers):
        pass

    with pytest.raises(ValueError, match="bad payload"), consumer_span(SUBJECT, headers, tracer=tracer):
        raise ValueError("bad payload")

    consumed = finished(exporter, "process loom.jobs.submitted")
    assert consumed.status.status_code is StatusCode.ERROR
    assert [event.name for event in consumed.events] == ["exception"]
    assert current_trace_id() is None, "the consumer's context must be detached after an error"


def test_extract_matches_header_names_regardless_of_case(tracer: trace.Tracer) -> None:
    with producer_span(SUBJECT, tracer=tracer) as (span, headers):
        pass
    context = extract({"TraceParent": headers["traceparent"]})
    assert trace.get_current_span(context).get_span_context().trace_id == span.get_span_context().trace_id


def test_inject_writes_nothing_outside_any_span() -> None:
    assert inject({"a": "b"}) == {"a": "b"}
    assert current_traceparent() is None


# -- continuing a trace later ---------------------------------------------------------------------


def test_a_stored_traceparent_continues_the_jobs_trace_later(
    tracer: trace.Tracer, exporter: InMemorySpanExporter
) -> None:
    with producer_span("loom.jobs.placed.c1", tracer=tracer) as (_, headers):
        pass
    with consumer_span("loom.jobs.placed.c1", headers, tracer=tracer) as started:
        stored = current_traceparent()
    assert stored is not None
    assert current_trace_id() is None

    with (
        span_with_parent("job finished", stored, tracer=tracer) as finishing,
        producer_span("loom.jobs.completed.acme", tracer=tracer) as (_, completed),
    ):
        pass
    with producer_span("loom.jobs.failed.acme", parent=context_from_traceparent(stored), tracer=tracer):
        pass

    started_context = started.get_span_context()
    assert finishing.get_span_context().trace_id == started_context.trace_id
    assert extract(completed) is not None
    job_finished = finished(exporter, "job finished")
    assert job_finished.parent is not None
    assert job_finished.parent.span_id == started_context.span_id
    failed = finished(exporter, "publish loom.jobs.failed")
    assert failed.parent is not None
    assert failed.parent.span_id == started_context.span_id
    assert trace.format_trace_id(started_context.trace_id) in completed["traceparent"]


def test_an_invalid_stored_traceparent_starts_a_new_trace(
    tracer: trace.Tracer, exporter: InMemorySpanExporter
) -> None:
    assert not trace.get_current_span(context_from_traceparent("garbage")).get_span_context().is_valid
    with span_with_parent("job finished", "garbage", tracer=tracer):
        pass
    assert finished(exporter, "job finished").parent is None


def test_current_ids_are_hex_inside_a_span_and_none_outside(tracer: trace.Tracer) -> None:
    assert (current_trace_id(), current_span_id()) == (None, None)
    with producer_span(SUBJECT, tracer=tracer) as (span, _):
        trace_id, span_id = current_trace_id(), current_span_id()
    assert trace_id == trace.format_trace_id(span.get_span_context().trace_id)
    assert span_id == trace.format_span_id(span.get_span_context().span_id)
    assert trace_id is not None and len(trace_id) == 32
    assert span_id is not None and len(span_id) == 16


async def test_concurrent_handlers_each_keep_their_own_trace(tracer: trace.Tracer) -> None:
    with producer_span(SUBJECT, tracer=tracer) as (first, first_headers):
        pass
    with producer_span(SUBJECT, tracer=tracer) as (second, second_headers):
        pass
    both_inside = asyncio.Barrier(2)

    async def handle(headers: dict[str, str]) -> str | None:
        with consumer_span(SUBJECT, headers, tracer=tracer):
            await both_inside.wait()  # the other handler's span is open meanwhile
            return current_trace_id()

    seen = await asyncio.gather(handle(first_headers), handle(second_headers))
    assert list(seen) == [
        trace.format_trace_id(first.get_span_context().trace_id),
        trace.format_trace_id(second.get_span_context().trace_id),
    ]


# -- global setup ---------------------------------------------------------------------------------


@pytest.mark.usefixtures("global_telemetry")
def test_setup_telemetry_can_run_again_and_the_latest_provider_wins() -> None:
    first, second = InMemorySpanExporter(), InMemorySpanExporter()
    # Taken once at import by modules such as loom.bus: it must follow every later setup.
    module_tracer = trace.get_tracer("loom.bus")

    setup_telemetry("svc-a", exporter=first, log_level=None)
    with producer_span(SUBJECT), module_tracer.start_as_current_span("a"):
        pass
    setup_telemetry("svc-b", exporter=second, log_level=None)
    with producer_span(SUBJECT), module_tracer.start_as_current_span("b"):
        pass

    assert [(s.name, s.resource.attributes["service.name"]) for s in first.get_finished_spans()] == [
        ("a", "svc-a"),
        ("publish loom.jobs.submitted", "svc-a"),
    ]
    assert [(s.name, s.resource.attributes["service.name"]) for s in second.get_finished_spans()] == [
        ("b", "svc-b"),
        ("publish loom.jobs.submitted", "svc-b"),
    ]


@pytest.mark.usefixtures("global_telemetry")
def test_without_an_exporter_spans_are_not_recorded_but_still_carry_ids(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    setup_telemetry("svc", log_level=None)
    with producer_span(SUBJECT) as (span, headers):
        assert not span.is_recording(), "nothing would read a recorded span: building it is waste"
        trace_id = current_trace_id()
        assert trace_id is not None
    assert trace_id in headers["traceparent"]
    with consumer_span(SUBJECT, headers):
        assert current_trace_id() == trace_id, "the trace id still propagates, for logs downstream"


# -- logs -----------------------------------------------------------------------------------------


def test_log_lines_carry_service_trace_span_and_job(tracer: trace.Tracer, log_lines: io.StringIO) -> None:
    log = get_logger("loom.test")
    with producer_span(SUBJECT, tracer=tracer) as (_, headers):
        pass
    with consumer_span(SUBJECT, headers, tracer=tracer) as span, bind_job("job-7"):
        log.info("job placed", cluster="c1")
    trace_hex = trace.format_trace_id(span.get_span_context().trace_id)
    span_hex = trace.format_span_id(span.get_span_context().span_id)

    (line,) = parsed(log_lines)
    assert line["event"] == "job placed"
    assert line["level"] == "info"
    assert line["service"] == "test-svc"
    assert line["logger"] == "loom.test"
    assert line["cluster"] == "c1"
    assert isinstance(line["timestamp"], str) and line["timestamp"].endswith("Z")
    assert (line["trace_id"], line["span_id"], line["job_id"]) == (trace_hex, span_hex, "job-7")


def test_log_lines_outside_spans_and_jobs_have_no_such_fields(log_lines: io.StringIO) -> None:
    with bind_job("job-7"):
        pass
    get_logger("loom.test").warning("idle")
    (line,) = parsed(log_lines)
    assert line["level"] == "warning"
    assert not {"trace_id", "span_id", "job_id"} & line.keys()


def test_bind_job_records_the_job_on_the_current_span(
    tracer: trace.Tracer, exporter: InMemorySpanExporter
) -> None:
    with consumer_span(SUBJECT, None, tracer=tracer), bind_job("job-7"):
        pass
    attributes = finished(exporter, "process loom.jobs.submitted").attributes
    assert attributes is not None and attributes[JOB_ID_ATTRIBUTE] == "job-7"


def test_standard_library_records_become_json_lines_with_trace_ids(
    tracer: trace.Tracer, log_lines: io.StringIO
) -> None:
    with producer_span(SUBJECT, tracer=tracer) as (span, _), bind_job("job-7"):
        logging.getLogger("nats.test").warning("reconnecting to %s", "nats://x")

    (line,) = parsed(log_lines)
    assert line["event"] == "reconnecting to nats://x"
    assert line["level"] == "warning"
    assert line["logger"] == "nats.test"
    assert line["service"] == "test-svc"
    assert line["job_id"] == "job-7"
    assert line["trace_id"] == trace.format_trace_id(span.get_span_context().trace_id)


def test_lines_below_the_level_are_dropped() -> None:
    stream = io.StringIO()
    configure_logging("test-svc", level="WARNING", stream=stream)
    try:
        log = get_logger("loom.test")
        log.info("quiet")
        log.error("loud")
        logging.getLogger("other").info("quiet too")
    finally:
        reset_logging()
    assert [line["event"] for line in parsed(stream)] == ["loud"]


def test_console_lines_carry_the_trace_id_too(tracer: trace.Tracer) -> None:
    stream = io.StringIO()
    configure_logging("test-svc", json=False, stream=stream)
    try:
        with producer_span(SUBJECT, tracer=tracer):
            get_logger("loom.test").info("hello")
            trace_id = current_trace_id()
    finally:
        reset_logging()
    assert f"trace_id={trace_id}" in stream.getvalue()


def test_an_unknown_level_is_refused() -> None:
    with pytest.raises(ValueError, match="LOUDEST"):
        configure_logging("test-svc", level="LOUDEST")


def test_logging_follows_a_swapped_stderr_and_never_writes_to_a_closed_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The CLI configures logging to stderr once; a test harness (pytest's capture) swaps stderr per
    # test and closes the old one. Logging used to keep the closed file and raise ValueError
    # inside whatever merely logged (a lease release, a watchdog), failing unrelated tests.
    import io
    import logging
    import sys

    from loom.telemetry import configure_logging, get_logger, reset_logging

    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    try:
        configure_logging("loom-cli", level="WARNING", json=False, stream=sys.stderr)
        get_logger("t").warning("one")
        first.close()
        monkeypatch.setattr(sys, "stderr", second)
        get_logger("t").warning("two")
        logging.getLogger("stdlib").warning("three")
    finally:
        reset_logging()
    assert "two" in second.getvalue() and "three" in second.getvalue()
