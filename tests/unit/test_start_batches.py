"""Placement's start commands of one cycle: one message per cluster, each start in its job's trace."""

from collections.abc import Iterator

import msgspec
import pytest
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from loom.telemetry import extract, reset_for_tests, setup_telemetry
from loom_proto import subjects
from loom_proto.clusters import MAX_STARTS_PER_MESSAGE, StartJob, StartJobs
from loom_proto.codec import MAX_PAYLOAD_BYTES, decode
from loom_proto.jobs import JobSpec, NodeAllocation, Work
from loom_services.placement.service import MAX_BATCH_BYTES, PendingStart, batch_carrier, start_messages


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


def _large(job_id: str, allocations: int) -> PendingStart:
    """A start whose command is large: one allocation per node of a wide gang."""
    spec = JobSpec(job_id=job_id, tenant="t1", work=Work(steps=1, step_time_s=1.0))
    nodes = [NodeAllocation(node=f"node-{job_id}-{i:05d}", gpus=1) for i in range(allocations)]
    return PendingStart(
        "c1",
        StartJob(job_id=job_id, spec=spec, gpu_model="T4", allocations=nodes),
        f"{job_id}:start:1",
        Context(),
    )


def test_batches_are_cut_by_size_too_and_every_one_is_readable_by_an_agent() -> None:
    # 12 starts of ~25 KiB each: far fewer than MAX_STARTS_PER_MESSAGE, but together beyond what
    # an agent decodes (256 KiB); every batch stays within MAX_BATCH_BYTES of commands.
    starts = [_large(f"w{i}", 600) for i in range(12)]
    size = len(msgspec.json.encode(starts[0].command))
    assert 20_000 < size < MAX_BATCH_BYTES // 4
    messages = start_messages(starts)
    assert len(messages) > 1
    batches = [decode(m.payload, StartJobs) for m in messages]  # the agents' decode limit holds
    assert [s.job_id for b in batches for s in b.starts] == [f"w{i}" for i in range(12)]
    assert all(len(m.payload) <= MAX_PAYLOAD_BYTES for m in messages)


def test_a_start_too_large_to_share_a_batch_goes_alone_as_a_lone_start() -> None:
    big = _large("big", 6000)
    assert len(msgspec.json.encode(big.command)) > MAX_BATCH_BYTES
    messages = start_messages([_pending("a", "c1", Context()), big, _pending("b", "c1", Context())])
    assert [m.subject.rsplit(".", 1)[-1] for m in messages] == ["start", "start", "start"]
    assert [m.msg_id for m in messages] == ["a:start:1", "big:start:1", "b:start:1"]


def test_a_tenants_long_tracestate_is_left_out_of_a_batch_so_the_batch_stays_readable() -> None:
    parent = trace.SpanContext(
        trace_id=0x1234,
        span_id=0x99,
        is_remote=True,
        trace_flags=trace.TraceFlags(1),
        trace_state=trace.TraceState([(f"k{i}", "v" * 200) for i in range(5)]),
    )
    context = trace.set_span_in_context(trace.NonRecordingSpan(parent))
    messages = start_messages([_pending("a", "c1", context), _pending("b", "c1", Context())])
    batch = decode(messages[0].payload, StartJobs)  # would fail on a tracestate over 512 characters
    assert set(batch.traces[0]) <= {"traceparent", "tracestate"}
    assert "tracestate" not in batch.traces[0]
    span_context = trace.get_current_span(extract(batch.traces[0])).get_span_context()
    assert span_context.trace_id == 0x1234  # the job's trace goes on
    assert batch_carrier({"traceparent": "x", "tracestate": "a=b", "baggage": "c"}) == {
        "traceparent": "x",
        "tracestate": "a=b",
    }
