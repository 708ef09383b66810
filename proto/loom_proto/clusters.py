"""What cluster agents report and what they are told to do.

Heartbeats carry a per-agent sequence number; ``full`` snapshots list every node, deltas list only
nodes that changed (``removed`` names nodes gone since the last heartbeat). Commands are durable on
the CLUSTERS stream, so an agent that reconnects misses none.
"""

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from loom_proto.ids import Id
from loom_proto.jobs import GpuModel, JobSpec, NodeAllocation, UnixSeconds

__all__ = [
    "AcceleratorProfile",
    "CheckpointJob",
    "ClusterCommand",
    "ClusterHealthChanged",
    "ClusterHeartbeat",
    "ClusterProfiles",
    "ClusterStatus",
    "DrainCluster",
    "NodeAllocation",
    "NodeState",
    "SlowRun",
    "StartJob",
    "StartJobs",
    "StopJob",
]


class NodeState(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """One node as its agent sees it."""

    node: Id
    zone: Id
    gpu_model: GpuModel | None = None
    gpus_total: Annotated[int, Meta(ge=0, le=64)] = 0
    gpus_used: Annotated[int, Meta(ge=0, le=64)] = 0
    cpu_milli: Annotated[int, Meta(ge=0, le=1_024_000)] = 0
    memory_mib: Annotated[int, Meta(ge=0, le=16 * 1024 * 1024)] = 0
    healthy: bool = True
    down: bool = False
    """The node failed (hardware, lost to its scheduler): the parts running on it are lost. An
    unhealthy node that is not down (drained, cordoned) only takes no new work."""


class ClusterHeartbeat(
    msgspec.Struct, tag_field="kind", tag="heartbeat", forbid_unknown_fields=True, frozen=True, kw_only=True
):
    """A cluster's periodic report; ``seq`` increases by one per heartbeat of one agent run."""

    cluster: Id
    region: Id
    agent_epoch: Annotated[int, Meta(ge=0)] = 0
    """Changes when the agent restarts, so a restarted agent's ``seq`` may start again at 1."""
    seq: Annotated[int, Meta(ge=1)]
    sent_at: UnixSeconds
    full: bool = False
    nodes: Annotated[list[NodeState], Meta(max_length=20_000)] = []
    removed: Annotated[list[Id], Meta(max_length=20_000)] = []
    running_jobs: Annotated[list[Id], Meta(max_length=100_000)] = []
    interval_s: Annotated[float, Meta(gt=0, le=3600)] = 5.0


class StartJob(
    msgspec.Struct, tag_field="kind", tag="start", forbid_unknown_fields=True, frozen=True, kw_only=True
):
    """Start ``spec`` on the given nodes; ``attempt`` distinguishes re-placements of one job."""

    job_id: Id
    spec: JobSpec
    gpu_model: GpuModel
    allocations: list[NodeAllocation]
    attempt: Annotated[int, Meta(ge=1)] = 1
    resume_from_step: Annotated[int, Meta(ge=0)] = 0
    role: Literal["lead", "member"] = "lead"
    """A job on several clusters has one lead part, which runs the job's clock and reports its
    progress; member parts hold their GPUs and run until stopped."""
    slowdown: Annotated[float, Meta(gt=0, le=1_000_000)] = 1.0
    """How much longer than its compute alone on the lead's GPUs a step takes, as placement
    predicted it: above 1 for communication across clusters, below 1 for a pipeline whose stages
    share the work over many GPUs."""
    workers: Annotated[int, Meta(ge=1)] | None = None
    start_after_s: Annotated[float, Meta(ge=0, le=30 * 86_400)] = 0.0
    """Simulated seconds to wait before starting (the dataset's first copy is still on its way)."""


MAX_STARTS_PER_MESSAGE = 64
"""The most starts one :class:`StartJobs` carries (placement splits a larger cycle)."""

MAX_TRACE_VALUE_CHARS = 512
"""The longest trace-context value (``traceparent``, ``tracestate``) a :class:`StartJobs` carries
per start (placement leaves a longer one out)."""


class StartJobs(
    msgspec.Struct, tag_field="kind", tag="starts", forbid_unknown_fields=True, frozen=True, kw_only=True
):
    """Several starts placement decided for one cluster in one cycle, in one message: each is
    carried out as its own :class:`StartJob` would be (a repeated one changes nothing), so a
    burst costs one command message per cluster and cycle instead of one per job.

    ``traces[i]`` is the W3C trace context (``traceparent``, ``tracestate``) that ``starts[i]``
    continues, so every job's trace goes on through its own start; the message itself is in no
    job's trace. Published on ``loom.clusters.<cluster>.cmd.starts`` (agents of
    this version and later; a lone start still goes as a :class:`StartJob`)."""

    starts: Annotated[list[StartJob], Meta(min_length=1, max_length=MAX_STARTS_PER_MESSAGE)]
    traces: Annotated[
        list[
            Annotated[dict[str, Annotated[str, Meta(max_length=MAX_TRACE_VALUE_CHARS)]], Meta(max_length=8)]
        ],
        Meta(max_length=MAX_STARTS_PER_MESSAGE),
    ] = []


class StopJob(
    msgspec.Struct, tag_field="kind", tag="stop", forbid_unknown_fields=True, frozen=True, kw_only=True
):
    """Stop a job's run (attempt) on this cluster."""

    job_id: Id
    attempt: Annotated[int, Meta(ge=1)] = 1
    reason: Annotated[str, Meta(max_length=1024)] = ""


class ResizeJob(
    msgspec.Struct, tag_field="kind", tag="resize", forbid_unknown_fields=True, frozen=True, kw_only=True
):
    """An elastic job's run now has these workers on these nodes."""

    job_id: Id
    attempt: Annotated[int, Meta(ge=1)] = 1
    workers: Annotated[int, Meta(ge=1)]
    allocations: list[NodeAllocation]


class CheckpointJob(
    msgspec.Struct, tag_field="kind", tag="checkpoint", forbid_unknown_fields=True, frozen=True, kw_only=True
):
    """Write a checkpoint of a running job now."""

    job_id: Id
    attempt: Annotated[int, Meta(ge=1)] = 1


class DrainCluster(
    msgspec.Struct, tag_field="kind", tag="drain", forbid_unknown_fields=True, frozen=True, kw_only=True
):
    """Accept no new work on these nodes (all nodes when empty)."""

    nodes: list[Id] = []
    reason: Annotated[str, Meta(max_length=1024)] = ""


ClusterCommand = StartJob | StartJobs | StopJob | CheckpointJob | DrainCluster | ResizeJob
"""Any command to an agent, discriminated by ``kind``."""


class ClusterStatus(
    msgspec.Struct, tag_field="kind", tag="status", forbid_unknown_fields=True, frozen=True, kw_only=True
):
    """An agent's answer to a command it could not carry out, or a change of its own state."""

    cluster: Id
    state: Literal["ready", "draining", "degraded", "stopping"]
    detail: Annotated[str, Meta(max_length=2048)] = ""
    job_id: Id | None = None
    at: UnixSeconds


class AcceleratorProfile(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """What one accelerator model delivers, per dimension (bandwidths in gigabits per second)."""

    gpu_model: GpuModel
    compute_fp32_tflops: Annotated[float, Meta(gt=0, le=100_000)]
    compute_fp16_tflops: Annotated[float, Meta(gt=0, le=100_000)]
    memory_bandwidth_gbps: Annotated[float, Meta(gt=0, le=10_000_000)]
    memory_gib: Annotated[float, Meta(gt=0, le=100_000)]
    interconnect_gbps: Annotated[float, Meta(gt=0, le=10_000_000)]
    network_gbps: Annotated[float, Meta(gt=0, le=10_000_000)]
    compute_tf32_tflops: Annotated[float, Meta(gt=0, le=100_000)] | None = None
    """Dense FP32-input matrix rate (TF32 tensor cores, AMD FP32 matrix cores); None: the part has
    none, its FP32 matrix math runs at ``compute_fp32_tflops``."""


class ClusterProfiles(
    msgspec.Struct, tag_field="kind", tag="profiles", forbid_unknown_fields=True, frozen=True, kw_only=True
):
    """The performance profile of every accelerator model a cluster has, published by its agent at start."""

    cluster: Id
    agent_epoch: Annotated[int, Meta(ge=0)] = 0
    source: Literal["library", "calibrated"]
    """``library``: the model's reference numbers; ``calibrated``: measured by ``loom calibrate``."""
    profiles: Annotated[list[AcceleratorProfile], Meta(max_length=64)]
    measured_at: UnixSeconds


ClusterHealthState = Literal["healthy", "suspect", "failed"]

CLUSTER_HEALTH_RETELL_S = 30.0
"""Placement tells a cluster's unhealthy state again this often while it lasts: the notice is core
NATS, so one missed by a restarting alert correlator is told again, and a classification nobody
re-tells (placement restarted, the healthy notice lost) lapses (``CLUSTER_HEALTH_LEASE_S``)."""
CLUSTER_HEALTH_LEASE_S = 3 * CLUSTER_HEALTH_RETELL_S + 5.0
"""How long the alert correlator holds a cluster's unhealthy state without hearing it again."""


class ClusterHealthChanged(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Placement's classification of a cluster changed (core NATS, ``loom.placement.cluster_health``):
    ``suspect`` when one signal is lost (heartbeats past the TTL, or its region's probes), ``failed``
    when both are (its work is re-placed), ``healthy`` again when neither is. An unhealthy state is
    told again every ``CLUSTER_HEALTH_RETELL_S`` while it lasts."""

    cluster: Id
    state: ClusterHealthState
    reason: Annotated[str, Meta(max_length=512)] = ""
    region: Id | None = None
    at: UnixSeconds


class SlowRun(msgspec.Struct, frozen=True, kw_only=True):
    """A run delivering under half its predicted step rate over a window (core NATS,
    ``loom.placement.slow``): its nodes are suspect; the migration service reviews the move."""

    job_id: Id
    attempt: Annotated[int, Meta(ge=0)]
    observed_step_s: Annotated[float, Meta(gt=0)]
    predicted_step_s: Annotated[float, Meta(gt=0)] | None = None
    nodes: Annotated[list[Id], Meta(max_length=4096)] = []
    reason: Annotated[str, Meta(max_length=512)] = ""
    tenant: Id | None = None
    cluster: Id | None = None
    at: UnixSeconds | None = None
