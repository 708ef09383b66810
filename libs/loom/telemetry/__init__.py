"""Loom's telemetry: OpenTelemetry setup, trace context in NATS headers, and structlog JSON logs
that carry trace, span and job ids (ARCHITECTURE.md §8).

A service calls :func:`setup_telemetry` once at start and :func:`shutdown_telemetry` as it stops;
publishers wrap each publish in :func:`producer_span`, handlers wrap each message in
:func:`consumer_span`.
"""

from loom.telemetry.logs import (
    JOB_ID_ATTRIBUTE,
    add_trace_context,
    bind_job,
    configure_logging,
    get_logger,
    reset_logging,
)
from loom.telemetry.tracing import (
    INFRA_RATIO_ENV,
    MESSAGING_SYSTEM,
    TRACER_NAME,
    consumer_span,
    context_from_traceparent,
    current_span_id,
    current_trace_id,
    current_traceparent,
    extract,
    infra_ratio_from_env,
    inject,
    is_infrastructure_subject,
    message_context,
    producer_span,
    reset_for_tests,
    setup_telemetry,
    shutdown_telemetry,
    span_name,
    span_with_parent,
)

__all__ = [
    "INFRA_RATIO_ENV",
    "JOB_ID_ATTRIBUTE",
    "MESSAGING_SYSTEM",
    "TRACER_NAME",
    "add_trace_context",
    "bind_job",
    "configure_logging",
    "consumer_span",
    "context_from_traceparent",
    "current_span_id",
    "current_trace_id",
    "current_traceparent",
    "extract",
    "get_logger",
    "infra_ratio_from_env",
    "inject",
    "is_infrastructure_subject",
    "message_context",
    "producer_span",
    "reset_for_tests",
    "reset_logging",
    "setup_telemetry",
    "shutdown_telemetry",
    "span_name",
    "span_with_parent",
]
