"""Logging: structlog JSON lines that carry the service, the current trace and span, and the job.

Every line has ``timestamp``, ``level``, ``event`` and ``service``; inside a span also ``trace_id``
and ``span_id`` (the ids Jaeger shows), and inside :func:`bind_job` also ``job_id``. Records of
the standard ``logging`` module (nats, OpenTelemetry's exporter) go through the same processors.
"""

from __future__ import annotations

import io
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO, cast

import structlog
from opentelemetry import trace
from structlog.typing import EventDict, FilteringBoundLogger, Processor, WrappedLogger

__all__ = [
    "JOB_ID_ATTRIBUTE",
    "add_trace_context",
    "bind_job",
    "configure_logging",
    "get_logger",
    "reset_logging",
]

JOB_ID_ATTRIBUTE = "loom.job.id"
"""Span attribute :func:`bind_job` sets, so a job's spans can be found by its id."""


# The root logger's level before the first configure_logging (at most one item), which
# reset_logging restores.
_root_level_before: list[int] = []


class _LoomHandler(logging.StreamHandler[TextIO]):
    """The root handler configure_logging installs; its type marks it for replacement."""


class _CurrentStderr(io.TextIOBase):
    """Whatever ``sys.stderr`` is when a line is written, not when logging was configured.

    A process that configures logging once and later swaps ``sys.stderr`` (pytest's capture does,
    per test, and closes the one it swapped out) keeps logging instead of writing to a closed
    file, which raised ``ValueError`` inside whatever code merely logged.
    """

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def writable(self) -> bool:
        return True


class _NamedPrintLogger(structlog.PrintLogger):
    """A PrintLogger that knows the name it was asked for, as stdlib loggers do."""

    def __init__(self, file: TextIO, name: str | None) -> None:
        super().__init__(file)
        self.name = name


def _add_logger_name(logger: WrappedLogger, _method_name: str, event_dict: EventDict) -> EventDict:
    """``logger``: the name given to ``get_logger`` or of the stdlib logger that made the record."""
    record = event_dict.get("_record")
    name = record.name if isinstance(record, logging.LogRecord) else getattr(logger, "name", None)
    if name:
        event_dict.setdefault("logger", name)
    return event_dict


def add_trace_context(_logger: WrappedLogger, _method_name: str, event_dict: EventDict) -> EventDict:
    """structlog processor: add ``trace_id`` and ``span_id`` of the current span, if any."""
    span_context = trace.get_current_span().get_span_context()
    if span_context.is_valid:
        event_dict.setdefault("trace_id", trace.format_trace_id(span_context.trace_id))
        event_dict.setdefault("span_id", trace.format_span_id(span_context.span_id))
    return event_dict


def _add_service(service_name: str) -> Processor:
    def add_service(_logger: WrappedLogger, _method_name: str, event_dict: EventDict) -> EventDict:
        event_dict.setdefault("service", service_name)
        return event_dict

    return add_service


def _level_number(level: str | int) -> int:
    if isinstance(level, int):
        return level
    try:
        return logging.getLevelNamesMapping()[level.upper()]
    except KeyError:
        raise ValueError(f"unknown log level {level!r}") from None


def configure_logging(
    service_name: str,
    level: str | int = "INFO",
    json: bool = True,
    stream: TextIO | None = None,
) -> None:
    """Send structlog and standard-library logs to ``stream`` (stderr by default), one per line.

    JSON lines when ``json``, coloured console lines otherwise. Calling it again replaces the
    previous configuration.
    """
    out: TextIO = stream if stream is not None and stream is not sys.stderr else _CurrentStderr()  # type: ignore[assignment]
    threshold = _level_number(level)
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        _add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _add_service(service_name),
        add_trace_context,
        structlog.processors.StackInfoRenderer(),
    ]
    renderer: Processor
    if json:
        # Tracebacks as data, without frame locals: locals can hold secrets and make one error
        # line many kilobytes long.
        shared.append(
            structlog.processors.ExceptionRenderer(
                structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
            )
        )
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=False)

    structlog.configure(
        processors=[*shared, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(threshold),
        # The first positional argument of structlog.get_logger is the logger's name.
        logger_factory=lambda *args: _NamedPrintLogger(out, str(args[0]) if args else None),
        # Not cached: module-level loggers must follow a later configure_logging (tests do that).
        cache_logger_on_first_use=False,
    )

    handler = _LoomHandler(out)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    root = logging.getLogger()
    if not _root_level_before:
        _root_level_before.append(root.level)
    _remove_loom_handlers(root)
    root.addHandler(handler)
    root.setLevel(threshold)


def reset_logging() -> None:
    """Undo :func:`configure_logging`: structlog's defaults, and our root handler removed."""
    structlog.reset_defaults()
    structlog.contextvars.clear_contextvars()
    root = logging.getLogger()
    _remove_loom_handlers(root)
    if _root_level_before:
        root.setLevel(_root_level_before.pop())


def _remove_loom_handlers(root: logging.Logger) -> None:
    for handler in [h for h in root.handlers if isinstance(h, _LoomHandler)]:
        root.removeHandler(handler)


def get_logger(name: str) -> FilteringBoundLogger:
    """A logger whose lines carry ``logger=name``; resolved lazily, so configure at any time.

    ``structlog.get_logger(name)`` gives the same lines; this one is typed.
    """
    return cast(FilteringBoundLogger, structlog.get_logger(name))


@contextmanager
def bind_job(job_id: str) -> Iterator[None]:
    """Within the block, every log line carries ``job_id`` and the current span records the job.

    Bound through context variables, so it holds across ``await`` within one task.
    """
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attribute(JOB_ID_ATTRIBUTE, job_id)
    with structlog.contextvars.bound_contextvars(job_id=job_id):
        yield
