"""The job lifecycle: what a client submits and every event that follows.

A client publishes :class:`JobSubmitted` on ``loom.jobs.submitted.<tenant>`` with ``Nats-Msg-Id``
equal to its ``job_id`` (JetStream then drops a resubmission inside the duplicate window). Every
later event is published by the service that owns that step (see ARCHITECTURE.md §5) with a
deterministic message id ``<job_id>:<kind>[:<n>]``.

All events share the tag field ``kind`` so a consumer of the whole lifecycle can decode
:data:`JobEvent`; a consumer of one event type may leave ``kind`` out.
"""

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from loom_proto.ids import Id

TaskType = Literal["training_compute", "training_memory", "training_comm", "inference"]
"""What dominates a job's speed: dense compute, memory bandwidth, communication, or serving."""

GpuModel = Annotated[
    str, Meta(pattern=r"^[A-Za-z0-9_.+-]{1,32}(?![\s\S])", description="e.g. V100M32, A100, T4")
]
Label = Annotated[str, Meta(max_length=128)]
Reason = Annotated[str, Meta(max_length=2048)]
UnixSeconds = Annotated[float, Meta(ge=0, le=1e11, description="seconds since the Unix epoch")]

MAX_GPUS_PER_WORKER = 64
MAX_WORKERS = 4096


class Resources(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """What one worker of a job needs on one node."""

    gpus: Annotated[int, Meta(ge=1, le=MAX_GPUS_PER_WORKER)] = 1
    gpu_models: Annotated[list[GpuModel], Meta(max_length=32)] = []
    """Allowed GPU models; empty means any model."""
    cpu_milli: Annotated[int, Meta(ge=0, le=1_024_000)] = 0
    memory_mib: Annotated[int, Meta(ge=0, le=16 * 1024 * 1024)] = 0


class Work(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """How much work a job is: steps, each taking ``step_time_s`` on the reference accelerator."""

    steps: Annotated[int, Meta(ge=1, le=1_000_000_000)]
    step_time_s: Annotated[float, Meta(gt=0, le=86_400)] = 1.0
    checkpoint_every_steps: Annotated[int, Meta(ge=0, le=1_000_000_000)] = 0
    """0 means the job does not checkpoint."""


class JobSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """A job as a person writes it (YAML or JSON); the SDK turns it into :class:`JobSubmitted`."""

    job_id: Id
    tenant: Id
    name: Annotated[str, Meta(max_length=256)] = ""
    task_type: TaskType = "training_compute"
    priority: Annotated[int, Meta(ge=0, le=1000)] = 100
    workers: Annotated[int, Meta(ge=1, le=MAX_WORKERS)] = 1
    """Workers of a gang job; all are placed or none."""
    resources: Resources = Resources()
    work: Work
    labels: Annotated[dict[Label, Label], Meta(max_length=64)] = {}


class JobSubmitted(JobSpec, tag_field="kind", tag="submitted", forbid_unknown_fields=True, frozen=True):
    """A request to run a job. ``submitted_at`` is the client's clock, used only for latency figures."""

    submitted_at: UnixSeconds = 0.0


class NodeAllocation(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """GPUs of one node given to one job."""

    node: Id
    gpus: Annotated[int, Meta(ge=1, le=MAX_GPUS_PER_WORKER)]


class JobPlaced(
    msgspec.Struct, tag_field="kind", tag="placed", forbid_unknown_fields=True, frozen=True, kw_only=True
):
    """Placement reserved capacity for a job and commanded the cluster to start it."""

    job_id: Id
    tenant: Id
    cluster: Id
    region: Id
    gpu_model: GpuModel
    allocations: list[NodeAllocation]
    attempt: Annotated[int, Meta(ge=1)] = 1
    placed_at: UnixSeconds
    submitted_at: UnixSeconds = 0.0


class JobStarted(
    msgspec.Struct, tag_field="kind", tag="started", forbid_unknown_fields=True, frozen=True, kw_only=True
):
    """The cluster agent started the job's work."""

    job_id: Id
    tenant: Id
    cluster: Id
    attempt: Annotated[int, Meta(ge=1)] = 1
    started_at: UnixSeconds


class JobProgress(
    msgspec.Struct, tag_field="kind", tag="progress", forbid_unknown_fields=True, frozen=True, kw_only=True
):
    """Steps done so far."""

    job_id: Id
    tenant: Id
    cluster: Id
    attempt: Annotated[int, Meta(ge=1)] = 1
    step: Annotated[int, Meta(ge=0)]
    steps: Annotated[int, Meta(ge=1)]
    at: UnixSeconds


class JobCheckpointed(
    msgspec.Struct,
    tag_field="kind",
    tag="checkpointed",
    forbid_unknown_fields=True,
    frozen=True,
    kw_only=True,
):
    """A checkpoint of the job at ``step`` was written."""

    job_id: Id
    tenant: Id
    cluster: Id
    attempt: Annotated[int, Meta(ge=1)] = 1
    step: Annotated[int, Meta(ge=0)]
    checkpoint_uri: Annotated[str, Meta(max_length=1024)]
    checkpoint_bytes: Annotated[int, Meta(ge=0)] = 0
    at: UnixSeconds


class JobCompleted(
    msgspec.Struct, tag_field="kind", tag="completed", forbid_unknown_fields=True, frozen=True, kw_only=True
):
    """The job finished all its work."""

    job_id: Id
    tenant: Id
    cluster: Id
    attempt: Annotated[int, Meta(ge=1)] = 1
    gpu_seconds: Annotated[float, Meta(ge=0)] = 0.0
    at: UnixSeconds
    gpu_model: GpuModel | None = None
    task_type: TaskType | None = None
    delivered_speed: Annotated[float, Meta(gt=0, le=1000)] | None = None
    """Work done per second relative to the reference accelerator (its SCU as delivered), measured
    over the run; compared with the claimed SCU it teaches the decay factor and the cluster's trust."""


class JobFailed(
    msgspec.Struct, tag_field="kind", tag="failed", forbid_unknown_fields=True, frozen=True, kw_only=True
):
    """The job's run ended without finishing; ``retryable`` says whether a new placement may help."""

    job_id: Id
    tenant: Id
    cluster: Id
    attempt: Annotated[int, Meta(ge=1)] = 1
    reason: Reason
    retryable: bool = False
    at: UnixSeconds


RejectCode = Literal["invalid", "impossible", "quota", "duplicate", "internal"]


class JobRejected(
    msgspec.Struct, tag_field="kind", tag="rejected", forbid_unknown_fields=True, frozen=True, kw_only=True
):
    """Loom will not run the job; ``reason`` says what the submitter can change."""

    job_id: Annotated[str, Meta(max_length=256)]
    """The id as submitted; may be invalid (that can be the reason)."""
    tenant: Id
    code: RejectCode
    reason: Reason
    at: UnixSeconds


class JobCancelled(
    msgspec.Struct, tag_field="kind", tag="cancelled", forbid_unknown_fields=True, frozen=True, kw_only=True
):
    """The job was cancelled before it finished."""

    job_id: Id
    tenant: Id
    reason: Reason = ""
    at: UnixSeconds


JobEvent = (
    JobSubmitted
    | JobPlaced
    | JobStarted
    | JobProgress
    | JobCheckpointed
    | JobCompleted
    | JobFailed
    | JobRejected
    | JobCancelled
)
"""Any job lifecycle event, discriminated by ``kind``."""

TERMINAL_KINDS = frozenset({"completed", "failed", "rejected", "cancelled"})
