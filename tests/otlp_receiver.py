"""A real OTLP/HTTP trace receiver for tests: what a collector or Jaeger would get, decoded, kept
in memory (the library's :class:`loom.telemetry.spanstore.TraceServer` with a list for a store).

Start it, point processes at it with ``OTEL_EXPORTER_OTLP_ENDPOINT=<receiver.url>`` (the exporter
appends ``/v1/traces``), and wait for the spans you expect::

    with OtlpReceiver() as receiver:
        env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url}
        ...
        spans = receiver.wait_for(lambda spans: len(spans) >= 2, timeout_s=10)

It also answers ``GET /api/traces/<trace id>`` in the JSON shape of Jaeger's query API, as
``loom up --traces``'s store does.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any, Self

from loom.telemetry.spanstore import TRACES_PATH, ReceivedSpan, TraceServer, jaeger_answer

__all__ = ["OtlpReceiver", "ReceivedSpan"]


class OtlpReceiver:
    """An OTLP/HTTP receiver on 127.0.0.1 and a free port, recording the spans it is sent."""

    def __init__(self) -> None:
        self._spans: list[ReceivedSpan] = []
        self._changed = threading.Condition()
        self._server = TraceServer(self._record, self.trace)

    @property
    def url(self) -> str:
        """The base URL, for ``OTEL_EXPORTER_OTLP_ENDPOINT``."""
        return self._server.url

    @property
    def traces_url(self) -> str:
        """The full traces URL, for ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or an exporter's endpoint."""
        return self.url + TRACES_PATH

    @property
    def requests(self) -> int:
        """How many trace export requests arrived, including failed ones."""
        return self._server.requests

    @property
    def errors(self) -> list[str]:
        """Why requests were refused (a body that did not decode); tests may assert it is empty."""
        return self._server.errors

    @property
    def spans(self) -> list[ReceivedSpan]:
        """A snapshot of every span received so far, in arrival order."""
        with self._changed:
            return list(self._spans)

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        """The spans received so far of one trace."""
        return [span for span in self.spans if span["trace_id"] == trace_id.lower()]

    def jaeger_trace(self, trace_id: str) -> dict[str, Any] | None:
        """The spans of one trace as Jaeger's ``/api/traces/<id>`` answers them (None: unknown)."""
        return jaeger_answer(trace_id.lower(), self.trace(trace_id))

    def clear(self) -> None:
        """Forget the spans received so far."""
        with self._changed:
            self._spans.clear()

    def start(self) -> Self:
        """Listen on a free port and serve in a background thread."""
        self._server.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the port; the spans stay readable."""
        self._server.stop()

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
            self._spans.extend(spans)
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
