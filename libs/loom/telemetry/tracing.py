"""Tracing: one tracer provider per process, W3C trace context in NATS headers, and the spans
around publish (PRODUCER) and handle (CONSUMER).

After faststream's OpenTelemetry middleware: trace context travels only in message headers. A
publisher injects ``traceparent`` under a PRODUCER span; a handler extracts it, attaches it, and
runs under a CONSUMER span whose parent is the publisher's span, so one job is one trace across
services, processes and clusters.

The helpers take an optional ``tracer``. Without one they use the provider of the latest
:func:`setup_telemetry` call (or OpenTelemetry's global one when setup never ran), so tests can
either pass a tracer of their own provider or call ``setup_telemetry(..., exporter=...)`` as often
as they like.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    Decision,
    ParentBased,
    Sampler,
    SamplingResult,
    TraceIdRatioBased,
)
from opentelemetry.trace import Span, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util import types
from opentelemetry.util._decorator import _agnosticcontextmanager
from opentelemetry.util.types import AttributeValue

from loom.telemetry.logs import configure_logging
from loom_proto.subjects import PREFIX

__all__ = [
    "INFRA_RATIO_ENV",
    "MESSAGING_SYSTEM",
    "TRACER_NAME",
    "InfraSampler",
    "consumer_span",
    "context_from_traceparent",
    "current_span_id",
    "current_trace_id",
    "current_traceparent",
    "extract",
    "infra_ratio_from_env",
    "inject",
    "is_infrastructure_subject",
    "message_context",
    "producer_span",
    "reset_for_tests",
    "setup_telemetry",
    "shutdown_telemetry",
    "span_name",
    "span_with_parent",
]

TRACER_NAME = "loom"
"""Instrumentation scope of every span Loom's helpers start."""

MESSAGING_SYSTEM = "nats"

OTLP_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"

INFRA_RATIO_ENV = "LOOM_TRACE_INFRA_RATIO"
"""Share of infrastructure traces (heartbeats, probes, view, link state) kept; jobs are always kept."""

DEFAULT_INFRA_RATIO = 0.01
"""One heartbeat, probe or view trace in a hundred: enough to see the path, not 200 MB an hour."""

# Subjects whose traces are about jobs, tenants or operators' actions: every one is kept whole.
# Everything else (loom.clusters.*.heartbeat|status|profile, loom.view.*, loom.net.*) is periodic
# infrastructure traffic, sampled by ratio.
_ALWAYS_TRACED_PREFIXES = tuple(
    f"{PREFIX}.{domain}." for domain in ("jobs", "migrations", "alerts", "incidents")
)
_ALWAYS_TRACED_INFIXES = (".cmd.",)  # commands to agents act on jobs

# Subjects are loom.<domain>.<event>[.<key>...]; the keys (tenant, cluster, job) would make span
# names unbounded, so names keep only the leading tokens.
_SPAN_NAME_SUBJECT_TOKENS = 3

_TRACEPARENT = "traceparent"
_TRACESTATE = "tracestate"

_log = logging.getLogger(__name__)


def is_infrastructure_subject(subject: str) -> bool:
    """Whether a subject carries periodic infrastructure traffic rather than a job's or a person's.

    ``loom.clusters.c1.heartbeat`` is; ``loom.jobs.submitted.acme`` and
    ``loom.clusters.c1.cmd.start`` are not. An empty subject (a span that is not a message's) is
    not: unknown work is kept.
    """
    if not subject or subject.startswith(_ALWAYS_TRACED_PREFIXES):
        return False
    return not any(infix in subject for infix in _ALWAYS_TRACED_INFIXES)


def infra_ratio_from_env(environ: Mapping[str, str] | None = None) -> float:
    """``LOOM_TRACE_INFRA_RATIO`` as a share in [0, 1] (default 0.01); a bad value is an error."""
    raw = (environ if environ is not None else os.environ).get(INFRA_RATIO_ENV, "").strip()
    if not raw:
        return DEFAULT_INFRA_RATIO
    try:
        ratio = float(raw)
    except ValueError:
        raise ValueError(f"{INFRA_RATIO_ENV}={raw!r} is not a number between 0 and 1") from None
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"{INFRA_RATIO_ENV}={raw!r} is not a number between 0 and 1")
    return ratio


class InfraSampler(Sampler):
    """Root sampler: every trace about a job is kept; infrastructure traces by ``ratio``.

    Wrapped in :class:`~opentelemetry.sdk.trace.sampling.ParentBased`, so only a trace's first
    span decides and every later span, in any process, follows the ``sampled`` flag it finds in
    ``traceparent``: a kept trace stays whole. The decision reads the span's
    ``messaging.destination.name`` (every span Loom starts is a message's).
    """

    def __init__(self, ratio: float) -> None:
        self.ratio = ratio
        self._ratio_sampler = TraceIdRatioBased(ratio)

    def should_sample(  # noqa: PLR0917 - Sampler's signature
        self,
        parent_context: Context | None,
        trace_id: int,
        name: str,
        kind: SpanKind | None = None,
        attributes: types.Attributes = None,
        links: Sequence[trace.Link] | None = None,
        trace_state: trace.TraceState | None = None,
    ) -> SamplingResult:
        """Keep job traces; keep infrastructure ones when the trace id falls in the ratio."""
        subject = str((attributes or {}).get("messaging.destination.name", ""))
        if is_infrastructure_subject(subject):
            return self._ratio_sampler.should_sample(
                parent_context, trace_id, name, kind, attributes, links, trace_state
            )
        return SamplingResult(Decision.RECORD_AND_SAMPLE, attributes, None)

    def get_description(self) -> str:
        """How the sampler is configured, for OpenTelemetry's debug output."""
        return f"LoomInfraSampler{{jobs=always, infrastructure={self.ratio}}}"


def loom_sampler(ratio: float | None = None) -> Sampler:
    """The sampler a Loom process records with: parent-based, infrastructure roots by ratio."""
    return ParentBased(InfraSampler(infra_ratio_from_env() if ratio is None else ratio))


# Always W3C TraceContext, whatever OTEL_PROPAGATORS says: every Loom process must read what the
# others write.
_propagator = TraceContextTextMapPropagator()

_lock = threading.Lock()
_provider: TracerProvider | None = None
"""The provider of the latest setup_telemetry, until shutdown_telemetry."""


class _FollowingTracer(trace.Tracer):
    """A tracer that starts each span with the provider of the latest :func:`setup_telemetry`.

    Code that took a tracer once (``trace.get_tracer(...)`` at import, as the bus does) thus
    follows a later setup, which OpenTelemetry's own tracers cannot: they keep their provider.
    """

    def __init__(
        self,
        name: str,
        version: str | None,
        schema_url: str | None,
        attributes: types.Attributes,
    ) -> None:
        self._scope = (name, version, schema_url, attributes)
        self._resolved: tuple[TracerProvider, trace.Tracer] | None = None

    def _tracer(self) -> trace.Tracer:
        provider = _provider
        if provider is None:
            return _NO_OP_TRACER
        resolved = self._resolved
        if resolved is None or resolved[0] is not provider:
            resolved = (provider, provider.get_tracer(*self._scope))
            self._resolved = resolved
        return resolved[1]

    def start_span(  # noqa: PLR0917 - trace.Tracer's signature
        self,
        name: str,
        context: Context | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: types.Attributes = None,
        links: Sequence[trace.Link] | None = None,
        start_time: int | None = None,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
    ) -> Span:
        """Start a span with the current provider's tracer."""
        return self._tracer().start_span(
            name, context, kind, attributes, links, start_time, record_exception, set_status_on_exception
        )

    @_agnosticcontextmanager
    def start_as_current_span(  # noqa: PLR0917 - trace.Tracer's signature
        self,
        name: str,
        context: Context | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: types.Attributes = None,
        links: Sequence[trace.Link] | None = None,
        start_time: int | None = None,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
        end_on_exit: bool = True,
    ) -> Iterator[Span]:
        """Start a span with the current provider's tracer and make it current in the block."""
        with self._tracer().start_as_current_span(
            name,
            context,
            kind,
            attributes,
            links,
            start_time,
            record_exception,
            set_status_on_exception,
            end_on_exit,
        ) as span:
            yield span


class _FollowingTracerProvider(trace.TracerProvider):
    """OpenTelemetry's global provider once Loom set it up: its tracers follow each setup."""

    def get_tracer(
        self,
        instrumenting_module_name: str,
        instrumenting_library_version: str | None = None,
        schema_url: str | None = None,
        attributes: types.Attributes = None,
    ) -> trace.Tracer:
        """A tracer following the provider of the latest :func:`setup_telemetry`."""
        return _FollowingTracer(
            instrumenting_module_name, instrumenting_library_version, schema_url, attributes
        )

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        """Export every span the current provider still buffers."""
        provider = _provider
        return provider.force_flush(timeout_millis) if provider is not None else True


_NO_OP_TRACER = trace.NoOpTracer()
_GLOBAL_PROVIDER = _FollowingTracerProvider()
_TRACER = _FollowingTracer(TRACER_NAME, None, None, None)


def setup_telemetry(
    service_name: str,
    *,
    exporter: SpanExporter | None = None,
    log_level: str | None = "INFO",
    always_identify: bool = False,
    infra_ratio: float | None = None,
) -> TracerProvider:
    """Create this process's tracer provider, have every tracer use it, and configure logging.

    Spans go to ``exporter`` synchronously when one is given (tests); otherwise to OTLP/HTTP in
    batches when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set (the exporter appends ``/v1/traces``);
    otherwise nowhere, though they still get ids so logs carry trace ids.

    When exporting, every trace about a job is kept whole and infrastructure traces (heartbeats,
    probes, view, link state) are kept at ``infra_ratio`` (default ``LOOM_TRACE_INFRA_RATIO``,
    else 0.01); see :class:`InfraSampler`. ``always_identify`` samples the same way even with
    nowhere to export, for a client whose ``traceparent`` must say "sampled" so that services
    downstream keep the job's trace (``loom submit``): a client recording spans into nothing
    costs little, a service doing so costs throughput.

    OpenTelemetry's global provider becomes one whose tracers follow the latest setup, so
    calling this again (tests do) replaces the previous provider, flushed and shut down, for
    Loom's helpers and for every ``trace.get_tracer(...)`` alike. ``log_level=None`` leaves
    logging alone; otherwise :func:`loom.telemetry.configure_logging` runs with JSON to stderr.
    """
    global _provider

    exporting = exporter is not None or bool(os.environ.get(OTLP_ENDPOINT_ENV))
    # With nowhere to send spans, record none: sampled-out spans still carry (and propagate)
    # valid trace and span ids, so logs and downstream services keep the trace, at a fraction of
    # the cost of building spans nobody reads.
    sampler = loom_sampler(infra_ratio) if exporting or always_identify else ALWAYS_OFF
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name}), sampler=sampler)
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    elif os.environ.get(OTLP_ENDPOINT_ENV):
        # Imported here: requests and protobuf cost import time in processes that never export.
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # noqa: PLC0415
            OTLPSpanExporter,
        )

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(session=_token_session())))

    with _lock:
        previous, _provider = _provider, provider
        current = trace.get_tracer_provider()
        if isinstance(current, trace.ProxyTracerProvider):
            trace.set_tracer_provider(_GLOBAL_PROVIDER)
        elif current is not _GLOBAL_PROVIDER:
            _log.warning("a global TracerProvider is already set; only Loom's helpers use Loom's provider")
    if previous is not None:
        previous.shutdown()

    if log_level is not None:
        configure_logging(service_name, level=log_level)
    return provider


def shutdown_telemetry() -> None:
    """Flush every span still buffered and shut the provider down; call once as a service stops.

    Spans started afterwards are not recorded (until the next :func:`setup_telemetry`), though
    they still pass on the trace context they were started in.
    """
    global _provider

    with _lock:
        provider, _provider = _provider, None
    if provider is not None:
        provider.force_flush()
        provider.shutdown()


def reset_for_tests() -> None:
    """Shut down the provider, as a test's teardown; the next setup_telemetry starts clean."""
    shutdown_telemetry()


def _default_tracer() -> trace.Tracer:
    # Before any setup_telemetry, defer to whatever global provider there is.
    return _TRACER if _provider is not None else trace.get_tracer(TRACER_NAME)


# -- propagation ----------------------------------------------------------------------------------


def inject(headers: dict[str, str], context: Context | None = None) -> dict[str, str]:
    """Write the trace context (``traceparent``, ``tracestate``) into ``headers`` and return them.

    Uses the current context unless ``context`` is given; writes nothing when it holds no span.
    """
    _propagator.inject(headers, context=context)
    return headers


def extract(headers: Mapping[str, str] | None) -> Context:
    """The trace context carried by NATS headers; an empty context when they carry none.

    Header names are matched without regard to case, since not every NATS client keeps them.
    """
    carrier = {key.lower(): value for key, value in (headers or {}).items()}
    return _propagator.extract(carrier)


def message_context(headers: Mapping[str, str] | None, subject: str, message_key: str) -> Context:
    """The trace context a consumed message continues.

    Its ``traceparent`` when it has one. A message about a job published without one (any NATS
    client may submit) continues a trace whose ids are derived from ``message_key`` (its message
    id, else its stream and sequence): every delivery of it, to whichever process (a new leader
    after a takeover), joins the same trace instead of starting one each. Infrastructure messages
    without a ``traceparent`` start a new trace, sampled by ratio.
    """
    if headers and _TRACEPARENT in headers:
        return extract(headers)
    if not message_key or is_infrastructure_subject(subject):
        return Context()
    digest = hashlib.sha256(f"{subject}|{message_key}".encode()).digest()
    parent = trace.SpanContext(
        trace_id=int.from_bytes(digest[:16], "big") or 1,
        span_id=int.from_bytes(digest[16:24], "big") or 1,
        is_remote=True,
        trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED),
    )
    return trace.set_span_in_context(trace.NonRecordingSpan(parent), Context())


def context_from_traceparent(traceparent: str, tracestate: str | None = None) -> Context:
    """The context of a stored ``traceparent``, to continue a trace long after it was received.

    An invalid value gives an empty context, so the spans started under it begin a new trace.
    """
    carrier = {_TRACEPARENT: traceparent}
    if tracestate:
        carrier[_TRACESTATE] = tracestate
    return _propagator.extract(carrier)


def current_traceparent() -> str | None:
    """The ``traceparent`` of the current span, to store and continue the trace later."""
    return inject({}).get(_TRACEPARENT)


def current_trace_id() -> str | None:
    """The current trace id as 32 hex digits, or None outside any span."""
    span_context = trace.get_current_span().get_span_context()
    return trace.format_trace_id(span_context.trace_id) if span_context.is_valid else None


def current_span_id() -> str | None:
    """The current span id as 16 hex digits, or None outside any span."""
    span_context = trace.get_current_span().get_span_context()
    return trace.format_span_id(span_context.span_id) if span_context.is_valid else None


# -- spans ----------------------------------------------------------------------------------------


def span_name(operation: str, subject: str) -> str:
    """A low-cardinality span name: the operation and the subject's leading tokens.

    ``loom.jobs.submitted.acme`` published is ``publish loom.jobs.submitted``.
    """
    prefix = ".".join(subject.split(".")[:_SPAN_NAME_SUBJECT_TOKENS])
    return f"{operation} {prefix}"


def _messaging_attributes(
    subject: str,
    operation: str,
    operation_type: str,
    message_id: str | None,
    extra: Mapping[str, AttributeValue] | None,
) -> dict[str, AttributeValue]:
    attributes: dict[str, AttributeValue] = {
        "messaging.system": MESSAGING_SYSTEM,
        "messaging.destination.name": subject,
        "messaging.operation.name": operation,
        "messaging.operation.type": operation_type,
    }
    if message_id is not None:
        attributes["messaging.message.id"] = message_id
    if extra:
        attributes.update(extra)
    return attributes


@contextmanager
def producer_span(
    subject: str,
    *,
    message_id: str | None = None,
    headers: Mapping[str, str] | None = None,
    parent: Context | None = None,
    tracer: trace.Tracer | None = None,
    attributes: Mapping[str, AttributeValue] | None = None,
) -> Iterator[tuple[Span, dict[str, str]]]:
    """A PRODUCER span around one publish; yields it and the headers to publish with.

    The yielded headers are a copy of ``headers`` plus ``traceparent`` naming this span. The span
    is a child of the current span, or of ``parent`` when given (see
    :func:`context_from_traceparent`). An exception inside marks the span ERROR and propagates.
    """
    with (tracer or _default_tracer()).start_as_current_span(
        span_name("publish", subject),
        context=parent,
        kind=SpanKind.PRODUCER,
        attributes=_messaging_attributes(subject, "publish", "send", message_id, attributes),
    ) as span:
        yield span, inject(dict(headers or {}))


@contextmanager
def consumer_span(
    subject: str,
    headers: Mapping[str, str] | None,
    *,
    message_id: str | None = None,
    tracer: trace.Tracer | None = None,
    attributes: Mapping[str, AttributeValue] | None = None,
) -> Iterator[Span]:
    """A CONSUMER span around handling one message, child of the span that published it.

    The context extracted from ``headers`` is attached for the duration, so spans and publishes
    inside the handler continue the publisher's trace; without a ``traceparent`` the span starts
    a new trace. An exception inside is recorded, marks the span ERROR, and propagates.
    """
    parent = extract(headers)
    token = otel_context.attach(parent)
    try:
        with (tracer or _default_tracer()).start_as_current_span(
            span_name("process", subject),
            context=parent,
            kind=SpanKind.CONSUMER,
            attributes=_messaging_attributes(subject, "process", "process", message_id, attributes),
        ) as span:
            yield span
    finally:
        otel_context.detach(token)


@contextmanager
def span_with_parent(
    name: str,
    traceparent: str | None,
    *,
    kind: SpanKind = SpanKind.INTERNAL,
    tracer: trace.Tracer | None = None,
    attributes: Mapping[str, AttributeValue] | None = None,
) -> Iterator[Span]:
    """A span continuing the trace of a stored ``traceparent``, made current for its duration.

    For work that resumes a trace later (a cluster agent reporting a job's completion minutes
    after it started): publishes inside it join the job's trace. With ``traceparent`` None the
    span starts a new trace.
    """
    parent = context_from_traceparent(traceparent) if traceparent else Context()
    token = otel_context.attach(parent)
    try:
        with (tracer or _default_tracer()).start_as_current_span(
            name, context=parent, kind=kind, attributes=dict(attributes or {})
        ) as span:
            yield span
    finally:
        otel_context.detach(token)


def _token_session() -> Any:
    """The exporter's HTTP session: exporting to a secured stack's own trace store
    (``$LOOM_TRACES_TOKEN_FILE``, which only such a stack sets, beside the store's endpoint) every
    export carries the token as the file holds it *now*, so a token ``loom credentials rotate``
    renews keeps the spans flowing without a restart (the header fixed in the environment at start
    would be refused from then on); None elsewhere (the exporter's own session, with the headers
    the environment gives: a collector of the operator's never gets Loom's token)."""
    from loom.security.http_token import ENV_TRACES_TOKEN_FILE, token_file_from_env  # noqa: PLC0415

    found = token_file_from_env(variable=ENV_TRACES_TOKEN_FILE)
    if found is None:
        return None
    source = found  # narrowed for the class below
    import requests  # noqa: PLC0415 - the exporter's own dependency, loaded with it

    class Bearer(requests.auth.AuthBase):
        def __call__(self, request: requests.PreparedRequest) -> requests.PreparedRequest:
            request.headers["Authorization"] = f"Bearer {source()}"
            return request

    session = requests.Session()
    session.auth = Bearer()
    return session
