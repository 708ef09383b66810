"""Spans leave the process over real OTLP/HTTP when OTEL_EXPORTER_OTLP_ENDPOINT is set."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from otlp_receiver import OtlpReceiver, ReceivedSpan

from loom.telemetry import consumer_span, producer_span, reset_for_tests, setup_telemetry, shutdown_telemetry

SUBJECT = "loom.jobs.submitted.acme"


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as running:
        yield running


@pytest.fixture
def exporting_to(receiver: OtlpReceiver, monkeypatch: pytest.MonkeyPatch) -> Iterator[OtlpReceiver]:
    """Telemetry set up the way a service does, from the environment alone."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    yield receiver
    reset_for_tests()


def by_name(spans: list[ReceivedSpan]) -> dict[str, ReceivedSpan]:
    return {span["name"]: span for span in spans}


def test_producer_and_consumer_spans_reach_the_receiver_as_one_trace(exporting_to: OtlpReceiver) -> None:
    provider = setup_telemetry("placement", log_level=None)
    with producer_span(SUBJECT, message_id="msg-1") as (_, headers):
        pass
    with consumer_span(SUBJECT, headers, message_id="msg-1"):
        pass
    assert provider.force_flush()

    spans = by_name(exporting_to.wait_for(lambda spans: len(spans) >= 2, timeout_s=10))
    produced = spans["publish loom.jobs.submitted"]
    consumed = spans["process loom.jobs.submitted"]
    assert produced["kind"] == "PRODUCER"
    assert consumed["kind"] == "CONSUMER"
    assert consumed["trace_id"] == produced["trace_id"]
    assert consumed["parent_span_id"] == produced["span_id"]
    assert produced["parent_span_id"] is None
    assert {produced["service_name"], consumed["service_name"]} == {"placement"}
    assert consumed["attributes"]["messaging.system"] == "nats"
    assert consumed["attributes"]["messaging.destination.name"] == SUBJECT
    assert consumed["attributes"]["messaging.message.id"] == "msg-1"
    assert headers["traceparent"].split("-")[1] == produced["trace_id"]
    assert exporting_to.errors == []


def test_shutdown_flushes_spans_still_buffered(exporting_to: OtlpReceiver) -> None:
    setup_telemetry("cluster-agent", log_level=None)
    with pytest.raises(RuntimeError), consumer_span(SUBJECT, None):
        raise RuntimeError("handler failed")
    shutdown_telemetry()

    (span,) = exporting_to.wait_for(lambda spans: len(spans) >= 1, timeout_s=10)
    assert span["status"] == "ERROR"
    assert span["service_name"] == "cluster-agent"
