"""Placement's start commands of one cycle: one message per cluster, each start in its job's trace."""

from collections.abc import Iterator

import pytest
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from loom.telemetry import extract, reset_for_tests, setup_telemetry
from loom_proto import subjects
from loom_proto.clusters import MAX_STARTS_PER_MESSAGE, StartJob, StartJobs
from loom_proto.codec import decode
from loom_proto.jobs import JobSpec, NodeAllocation, Work
from loom_services.placement.service import PendingStart, start_messages


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    spans = InMemorySpanExporter()
    setup_telemetry("start-batches", exporter=spans, log_level=None)
    yield spans
    reset_for_tests()


def _pending(job_id: str, cluster: str, context: Context) -> PendingStart:
    spec = JobSpec(job_id=job_id, tenant="t1", work=Work(steps=1, step_time_s=1.0))
    command = StartJob(
        job_id=job_id, spec=spec, gpu_model="T4", allocations=[NodeAllocation(node="n1", gpus=1)]
    )
    return PendingStart(cluster, command, f"{job_id}:start:1", context)


def _job_context(name: str) -> tuple[Context, int]:
    with trace.get_tracer("test").start_as_current_span(name) as span:
        return trace.set_span_in_context(span), span.get_span_context().trace_id


def test_a_cycles_starts_go_as_one_message_per_cluster_and_a_lone_start_as_before(
    exporter: InMemorySpanExporter,
) -> None:
    contexts = [_job_context(f"submit {i}") for i in range(3)]
    starts = [
        _pending("a", "c1", contexts[0][0]),
        _pending("lone", "c2", contexts[1][0]),
        _pending("b", "c1", contexts[2][0]),
    ]
    messages = start_messages(starts)
    assert [m.subject for m in messages] == [
        subjects.cluster_command("c1", "starts"),
        subjects.cluster_command("c2", "start"),
    ]
    batch = decode(messages[0].payload, StartJobs)
    assert [s.job_id for s in batch.starts] == ["a", "b"]  # in decision order
    lone = decode(messages[1].payload, StartJob)
    assert (lone.job_id, messages[1].msg_id) == ("lone", "lone:start:1")
    # Every start in the batch continues its own job's trace, through a publish span of its own.
    for carrier, (_, trace_id) in zip(batch.traces, [contexts[0], contexts[2]], strict=True):
        span_context = trace.get_current_span(extract(carrier)).get_span_context()
        assert span_context.trace_id == trace_id
        (publish,) = [
            s
            for s in exporter.get_finished_spans()
            if s.context is not None and s.context.span_id == span_context.span_id
        ]
        assert (publish.name, publish.kind) == ("publish loom.clusters.c1", SpanKind.PRODUCER)
    # The batch itself is in no job's trace.
    assert "traceparent" not in messages[0].headers


def test_a_batch_id_depends_only_on_the_starts_it_carries() -> None:
    context = Context()
    first = start_messages([_pending("a", "c1", context), _pending("b", "c1", context)])
    again = start_messages([_pending("a", "c1", context), _pending("b", "c1", context)])
    other = start_messages([_pending("a", "c1", context), _pending("c", "c1", context)])
    assert first[0].msg_id == again[0].msg_id
    assert first[0].msg_id != other[0].msg_id


def test_a_cluster_with_more_starts_than_a_message_holds_gets_several_messages() -> None:
    n = MAX_STARTS_PER_MESSAGE + 3
    messages = start_messages([_pending(f"j{i}", "c1", Context()) for i in range(n)])
    batches = [decode(m.payload, StartJobs) for m in messages]
    assert [len(b.starts) for b in batches] == [MAX_STARTS_PER_MESSAGE, 3]
    assert [s.job_id for b in batches for s in b.starts] == [f"j{i}" for i in range(n)]
    assert len({m.msg_id for m in messages}) == 2
