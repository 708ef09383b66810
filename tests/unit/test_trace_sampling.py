"""Sampling infrastructure traces while keeping every job's trace whole, and reading a job's trace
back from Jaeger's query API shape."""

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from loom.telemetry import (
    extract,
    infra_ratio_from_env,
    inject,
    is_infrastructure_subject,
    reset_for_tests,
    setup_telemetry,
)
from loom.telemetry.jaeger import jaeger_link, parse_jaeger_trace, render_tree, trace_id_of


@pytest.mark.parametrize(
    ("subject", "infra"),
    [
        ("loom.clusters.c1.heartbeat", True),
        ("loom.clusters.c1.status", True),
        ("loom.view.delta.eu", True),
        ("loom.net.samples.a.b", True),
        ("loom.jobs.submitted.acme", False),
        ("loom.jobs.placed.c1", False),
        ("loom.clusters.c1.cmd.start", False),
        ("loom.migrations.planned.acme", False),
        ("", False),
    ],
)
def test_only_periodic_infrastructure_subjects_are_sampled_by_ratio(subject: str, infra: bool) -> None:
    assert is_infrastructure_subject(subject) is infra


def test_the_ratio_comes_from_the_environment_and_a_bad_one_is_an_error() -> None:
    assert infra_ratio_from_env({}) == 0.01
    assert infra_ratio_from_env({"LOOM_TRACE_INFRA_RATIO": "0.25"}) == 0.25
    for bad in ("lots", "-0.1", "1.5"):
        with pytest.raises(ValueError, match="between 0 and 1"):
            infra_ratio_from_env({"LOOM_TRACE_INFRA_RATIO": bad})


def _sampled(carrier: dict[str, str]) -> bool:
    """The W3C ``sampled`` bit of a traceparent's flags (other bits, such as "random", vary)."""
    return bool(int(carrier["traceparent"].rsplit("-", 1)[1], 16) & 1)


def _publish(tracer: trace.Tracer, subject: str) -> None:
    attributes = {"messaging.destination.name": subject}
    with tracer.start_as_current_span(f"publish {subject}", kind=SpanKind.PRODUCER, attributes=attributes):
        pass


def test_job_traces_are_all_kept_and_infrastructure_ones_at_the_ratio() -> None:
    exporter = InMemorySpanExporter()
    try:
        setup_telemetry("t", exporter=exporter, log_level=None, infra_ratio=0.1)
        tracer = trace.get_tracer("t")
        for _ in range(2000):
            _publish(tracer, "loom.clusters.c1.heartbeat")
        for _ in range(200):
            _publish(tracer, "loom.jobs.submitted.acme")
    finally:
        reset_for_tests()
    names = [s.name for s in exporter.get_finished_spans()]
    assert names.count("publish loom.jobs.submitted.acme") == 200
    heartbeats = names.count("publish loom.clusters.c1.heartbeat")
    assert 120 <= heartbeats <= 290, heartbeats  # 10 % of 2000, with room for chance (±4.5 sigma)


def test_a_kept_or_dropped_decision_follows_the_trace_into_other_processes() -> None:
    # Only a trace's first span decides: a job event published while handling a sampled-out
    # heartbeat stays out, and a heartbeat handled under a job's trace stays in, so no kept trace
    # loses a span in the middle.
    exporter = InMemorySpanExporter()
    try:
        setup_telemetry("t", exporter=exporter, log_level=None, infra_ratio=0.0)
        tracer = trace.get_tracer("t")
        with tracer.start_as_current_span(
            "publish", attributes={"messaging.destination.name": "loom.clusters.c1.heartbeat"}
        ):
            carrier = inject({})
        with tracer.start_as_current_span(
            "process", context=extract(carrier), attributes={"messaging.destination.name": "loom.jobs.x"}
        ):
            pass
        with tracer.start_as_current_span(
            "publish job", attributes={"messaging.destination.name": "loom.jobs.submitted.acme"}
        ):
            job_carrier = inject({})
        with tracer.start_as_current_span(
            "process heartbeat",
            context=extract(job_carrier),
            attributes={"messaging.destination.name": "loom.clusters.c1.heartbeat"},
        ):
            pass
    finally:
        reset_for_tests()
    assert not _sampled(carrier) and _sampled(job_carrier)
    assert sorted(s.name for s in exporter.get_finished_spans()) == ["process heartbeat", "publish job"]


def test_a_client_that_exports_nothing_still_marks_its_job_trace_sampled() -> None:
    try:
        setup_telemetry("cli", log_level=None, always_identify=True)
        tracer = trace.get_tracer("t")
        with tracer.start_as_current_span("loom submit"):
            identified = inject({})
        setup_telemetry("cli", log_level=None)  # a service with nowhere to export
        with tracer.start_as_current_span("loom submit"):
            silent = inject({})
    finally:
        reset_for_tests()
    assert _sampled(identified)  # services downstream keep the job's trace
    assert not _sampled(silent)


def test_the_trace_id_of_a_stored_context() -> None:
    tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    assert trace_id_of({"traceparent": tp}) == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert trace_id_of({"traceparent": tp.upper()}) == "4bf92f3577b34da6a3ce929d0e0e4736"
    zero = "00-" + "0" * 32 + "-00f067aa0ba902b7-01"
    for bad in ({}, None, {"traceparent": "junk"}, {"traceparent": zero}):
        assert trace_id_of(bad) is None
    assert jaeger_link("abc", "http://j:16686/") == "http://j:16686/trace/abc"


def _span(  # noqa: PLR0917 - a row of the table below
    span_id: str, parent: str | None, name: str, pid: str, start: int, error: bool = False
) -> dict:
    return {
        "traceID": "t1",
        "spanID": span_id,
        "operationName": name,
        "references": [{"refType": "CHILD_OF", "traceID": "t1", "spanID": parent}] if parent else [],
        "startTime": start,
        "duration": 1500,
        "processID": pid,
        "tags": [{"key": "error", "type": "bool", "value": True}] if error else [],
    }


def test_a_jaeger_answer_becomes_an_indented_tree_in_start_order() -> None:
    body = {
        "data": [
            {
                "traceID": "t1",
                "processes": {"p1": {"serviceName": "loom-cli"}, "p2": {"serviceName": "placement"}},
                "spans": [
                    _span("c", "a", "process loom.jobs.submitted", "p2", 1_002_000),
                    _span("a", None, "loom submit", "p1", 1_000_000),
                    _span("b", "a", "publish loom.jobs.submitted", "p1", 1_001_000),
                    _span("d", "c", "publish loom.jobs.placed", "p2", 1_003_000, error=True),
                    _span("e", "zz", "process loom.jobs.completed", "p2", 1_004_000),  # parent missing
                ],
            }
        ]
    }
    roots = parse_jaeger_trace(body, "t1")
    assert [r.name for r in roots] == ["loom submit", "process loom.jobs.completed"]
    lines = render_tree(roots)
    # offset, duration, error mark, then the span indented two spaces per level under its parent
    assert [line[25:] for line in lines] == [
        "loom-cli: loom submit",
        "  loom-cli: publish loom.jobs.submitted",
        "  placement: process loom.jobs.submitted",
        "    placement: publish loom.jobs.placed",
        "placement: process loom.jobs.completed",
    ]
    assert [line[23] for line in lines] == [" ", " ", " ", "!", " "]
    assert [line.split()[:2] for line in lines[:2]] == [["0.000s", "1.5ms"], ["0.001s", "1.5ms"]]
    with pytest.raises(ValueError, match="no trace"):
        parse_jaeger_trace({"data": []}, "t1")


def test_a_job_message_without_trace_context_joins_one_trace_on_every_delivery() -> None:
    # A raw NATS client submits without traceparent; the leader that took it died before acking,
    # and the new leader's delivery used to start a second trace for the same job.
    from loom.telemetry import message_context

    def trace_of(ctx: object) -> trace.SpanContext:
        return trace.get_current_span(ctx).get_span_context()  # type: ignore[arg-type]

    first = trace_of(message_context({}, "loom.jobs.submitted.acme", "job-1"))
    again = trace_of(message_context({"Nats-Msg-Id": "job-1"}, "loom.jobs.submitted.acme", "job-1"))
    other = trace_of(message_context({}, "loom.jobs.submitted.acme", "job-2"))
    assert first.is_valid and first.trace_flags.sampled
    assert first.trace_id == again.trace_id and first.trace_id != other.trace_id
    # A message that carries a trace continues it; infrastructure traffic without one starts anew.
    tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    carried = trace_of(message_context({"traceparent": tp}, "loom.jobs.submitted.acme", "job-1"))
    assert format(carried.trace_id, "032x") == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert not trace_of(message_context({}, "loom.clusters.c1.heartbeat", "hb-1")).is_valid
    assert not trace_of(message_context({}, "loom.jobs.submitted.acme", "")).is_valid
