"""The job lifecycle: what a client submits and every event that follows.

A client publishes :class:`JobSubmitted` on ``loom.jobs.submitted.<tenant>`` with ``Nats-Msg-Id``
equal to its ``job_id`` (JetStream then drops a resubmission inside the duplicate window). Every
later event is published by the service that owns that step (see ARCHITECTURE.md §5) with a
deterministic message id ``<job_id>:<kind>[:<n>]``.

All events share the tag field ``kind`` so a consumer of the whole lifecycle can decode
:data:`JobEvent`; a consumer of one event type may leave ``kind`` out.
"""

from typing import Annotated, Literal, get_args

import msgspec
from msgspec import Meta

from loom_proto.ids import GPU_MODEL_PATTERN, STAGE_NAME_PATTERN, Id

TaskType = Literal["training_compute", "training_memory", "training_comm", "inference"]
"""What dominates a job's speed: dense compute, memory bandwidth, communication, or serving."""

GpuModel = Annotated[str, Meta(pattern=GPU_MODEL_PATTERN, description="e.g. V100M32, A100, T4")]
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
    gpu_memory_gib: Annotated[float, Meta(ge=0, le=10_000)] = 0.0
    """Device memory each GPU must have (models with less are filtered out)."""


class Work(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """How much work a job is: steps, each taking ``step_time_s`` on the reference accelerator."""

    steps: Annotated[int, Meta(ge=1, le=1_000_000_000)]
    step_time_s: Annotated[float, Meta(gt=0, le=86_400)] = 1.0
    checkpoint_every_steps: Annotated[int, Meta(ge=0, le=1_000_000_000)] = 0
    """0 means the job does not checkpoint."""


class DataSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """The dataset a job reads: where it lives and how big it is.

    When the chosen cluster is in another region, placement plans a sync (an initial copy over the
    measured path, then incremental copies of what changed) and the job either waits for the copy
    (``start="after_sync"``) or starts at once and reads while it syncs (``"while_syncing"``).
    """

    dataset: Id
    region: Id
    """The region that holds the dataset now."""
    size_gb: Annotated[float, Meta(ge=0, le=10_000_000)]
    change_gb_per_hour: Annotated[float, Meta(ge=0, le=1_000_000)] = 0.0
    """How fast the dataset changes; sizes the incremental copies after the first."""
    start: Literal["after_sync", "while_syncing"] = "after_sync"
    replicas: Annotated[list[Id], Meta(max_length=64)] = []
    """Other regions that already hold a full copy."""


class Communication(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """How much a job's workers talk: bytes each worker exchanges per step, in how many rounds."""

    bytes_per_step: Annotated[int, Meta(ge=0, le=10**13)] = 0
    rounds_per_step: Annotated[int, Meta(ge=0, le=10_000)] = 1
    """Latency-bound exchanges per step (each costs at least one round trip across clusters)."""


class Affinity(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Where a job may, must or should not run, and which jobs it should be near or apart from."""

    clusters: Annotated[list[Id], Meta(max_length=256)] = []
    """Run only on these clusters (empty: any)."""
    regions: Annotated[list[Id], Meta(max_length=256)] = []
    """Run only in these regions (empty: any)."""
    avoid_clusters: Annotated[list[Id], Meta(max_length=256)] = []
    avoid_regions: Annotated[list[Id], Meta(max_length=256)] = []
    prefer_regions: Annotated[list[Id], Meta(max_length=256)] = []
    """Preferred (scored higher), not required."""
    near_jobs: Annotated[dict[Label, Label], Meta(max_length=16)] = {}
    """Prefer to run close to running jobs with these labels (jobs that talk to each other)."""
    apart_from_jobs: Annotated[dict[Label, Label], Meta(max_length=16)] = {}
    """Never share a cluster with running jobs that have these labels."""


class Layer(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """One layer of a model that may be split into pipeline stages."""

    name: Annotated[str, Meta(max_length=128)] = ""
    compute_s: Annotated[float, Meta(gt=0, le=86_400)]
    """Seconds per step of this layer on one reference GPU."""
    memory_gib: Annotated[float, Meta(ge=0, le=1_000_000)] = 0.0
    """Memory the layer needs (weights, optimiser state, activations)."""
    activation_mb: Annotated[float, Meta(ge=0, le=1_000_000)] = 0.0
    """Megabytes sent to the next layer per step (forward and backward together)."""


class Pipeline(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """A model declared as layers: placement may cut it into contiguous stages on several clusters."""

    layers: Annotated[list[Layer], Meta(min_length=1, max_length=1024)]
    max_stages: Annotated[int, Meta(ge=1, le=64)] = 8


class Stage(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """One stage of a DAG job; it starts when every stage it depends on has completed."""

    name: Annotated[str, Meta(pattern=STAGE_NAME_PATTERN)]
    depends_on: Annotated[list[str], Meta(max_length=64)] = []
    task_type: TaskType = "training_compute"
    workers: Annotated[int, Meta(ge=1, le=MAX_WORKERS)] = 1
    resources: Resources = Resources()
    work: Work
    data: DataSpec | None = None
    affinity: Affinity = Affinity()


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
    min_workers: Annotated[int, Meta(ge=1, le=MAX_WORKERS)] | None = None
    """Elastic: start with as few as ``min_workers`` when ``workers`` don't fit, grow as capacity
    frees, and shrink back (never below it) under pressure. None: exactly ``workers``."""
    preemptible: bool = True
    """Whether a job of higher priority may stop this one (it is requeued, resuming from its
    last checkpoint)."""
    allow_multi_cluster: bool = False
    """A gang may span clusters (its workers then talk over the inter-region links)."""
    comm: Communication | None = None
    data: DataSpec | None = None
    affinity: Affinity = Affinity()
    pipeline: Pipeline | None = None
    stages: Annotated[list[Stage], Meta(max_length=64)] = []
    """A DAG job: its stages run in dependency order; ``work`` is then ignored."""


class JobSubmitted(JobSpec, tag_field="kind", tag="submitted", forbid_unknown_fields=True, frozen=True):
    """A request to run a job. ``submitted_at`` is the client's clock, used only for latency figures."""

    submitted_at: UnixSeconds = 0.0


class NodeAllocation(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """GPUs of one node given to one job."""

    node: Id
    gpus: Annotated[int, Meta(ge=1, le=MAX_GPUS_PER_WORKER)]


class PlacedPart(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """One cluster's share of a job placed on several (a gang across clusters or a pipeline stage)."""

    cluster: Id
    region: Id
    gpu_model: GpuModel
    allocations: list[NodeAllocation]
    layers: tuple[int, int] | None = None
    """Pipeline stages: the first and last layer (inclusive) this part runs."""


class SyncPlan(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """How a dataset reaches the chosen region: a first full copy, then incremental ones."""

    dataset: Id
    src: Id
    dst: Id
    initial_gb: Annotated[float, Meta(ge=0)]
    initial_s: Annotated[float, Meta(ge=0)]
    incremental_gb_per_hour: Annotated[float, Meta(ge=0)] = 0.0
    start: Literal["after_sync", "while_syncing"] = "after_sync"


class JobPlaced(
    msgspec.Struct, tag_field="kind", tag="placed", forbid_unknown_fields=True, frozen=True, kw_only=True
):
    """Placement reserved capacity for a job and commanded the cluster to start it.

    ``cluster``/``allocations`` are the lead part; a job placed on several clusters lists every
    part (the lead first) in ``parts``.
    """

    job_id: Id
    tenant: Id
    cluster: Id
    region: Id
    gpu_model: GpuModel
    allocations: list[NodeAllocation]
    attempt: Annotated[int, Meta(ge=1)] = 1
    placed_at: UnixSeconds
    submitted_at: UnixSeconds = 0.0
    workers: Annotated[int, Meta(ge=1)] | None = None
    """Workers given (elastic jobs may get fewer than they asked for)."""
    parts: list[PlacedPart] = []
    predicted_step_s: Annotated[float, Meta(ge=0)] | None = None
    """Predicted wall seconds per step here (compute plus communication)."""
    sync: SyncPlan | None = None
    score: Annotated[float, Meta(ge=0, le=100)] | None = None


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
    observed_step_s: Annotated[float, Meta(gt=0, le=1e9)] | None = None
    """Seconds of the job's clock one step took since the previous progress report (None: the
    first report of the run); placement compares it with its prediction (slow nodes)."""
    compute_step_s: Annotated[float, Meta(gt=0, le=86_400)] | None = None
    """Compute seconds per step the run measured on its GPU model with all its workers, as
    :attr:`JobCompleted.observed_step_s` (no communication or pipeline waits); None: not measured.
    The first report of a run that carries it teaches placement's speed learner, so a long run
    teaches while it runs, not only when it ends (one observation per run)."""


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
    checksum: Annotated[str, Meta(max_length=128)] = ""
    """Digest of the checkpoint's content as written (empty: the agent did not say); a resume
    verifies it before trusting the checkpoint (:mod:`loom.migrate.checkpoints`)."""


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
    observed_step_s: Annotated[float, Meta(gt=0, le=86_400)] | None = None
    """Compute seconds per step the run measured on its GPU model with all its workers (no
    communication or pipeline waits). With the job's ``work.step_time_s`` it is the speed the job's
    family really has there (``step_time_s / observed_step_s``, relative to the reference), which
    placement's speed learner compares with the profile (:mod:`loom.model.learn`). None: not measured."""


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
    exit_code: int | None = None
    """The exit code of work that exited non-zero (a real backend), None otherwise."""
    stopped: bool = False
    """The run ended because Loom stopped it (a cancel, a preemption, a move): not a fault of the
    run or of its cluster, so no alert is raised for it."""


RequeueReason = Literal[
    "preempted", "start_timeout", "start_failed", "cluster_lost", "resized", "migrated", "node_lost"
]


class JobRequeued(
    msgspec.Struct, tag_field="kind", tag="requeued", forbid_unknown_fields=True, frozen=True, kw_only=True
):
    """A placed job goes back to the queue: its run (``attempt - 1``) was given up; ``attempt`` is next."""

    job_id: Id
    tenant: Id
    attempt: Annotated[int, Meta(ge=2)]
    cause: RequeueReason
    reason: Reason = ""
    avoid_clusters: list[Id] = []
    """Clusters the next placement avoids (the one that failed to start it)."""
    from_cluster: Annotated[str, Meta(max_length=128)] = ""
    """The cluster the given-up run was lost on (``cluster_lost``, ``node_lost``: a node of it failed)
    or moved off (``migrated``)."""
    at: UnixSeconds


class JobResized(
    msgspec.Struct, tag_field="kind", tag="resized", forbid_unknown_fields=True, frozen=True, kw_only=True
):
    """An elastic job's workers changed: it grew into freed capacity or shrank under pressure."""

    job_id: Id
    tenant: Id
    cluster: Id
    attempt: Annotated[int, Meta(ge=1)] = 1
    workers: Annotated[int, Meta(ge=1)]
    allocations: list[NodeAllocation]
    reason: Reason = ""
    at: UnixSeconds


RejectCode = Literal[
    "invalid", "impossible", "quota", "duplicate", "internal", "unknown_tenant", "cyclic", "span_inflation"
]
"""Why a job is refused. ``span_inflation``: a gang no cluster can hold whose every spread over the
allowed clusters would cost more GPU-hours than the span guard's bound allows (the hint says how many
times one cluster's)."""


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
    hint: Reason = ""
    """What the submitter could change so that the job fits (empty when the reason says it all)."""


class JobCancelled(
    msgspec.Struct, tag_field="kind", tag="cancelled", forbid_unknown_fields=True, frozen=True, kw_only=True
):
    """The job was cancelled before it finished."""

    job_id: Id
    tenant: Id
    reason: Reason = ""
    at: UnixSeconds


TERMINAL_STATES: frozenset[str] = frozenset({"completed", "failed", "rejected", "cancelled"})
"""A job's states it never leaves (the store's ``jobs.state``)."""
JOB_STATES: tuple[str, ...] = (
    "waiting",
    "queued",
    "placed",
    "running",
    "completed",
    "failed",
    "rejected",
    "cancelled",
)
"""Every state a job's record may be in (the store's ``jobs.state``)."""


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
    | JobRequeued
    | JobResized
)
"""Any job lifecycle event, discriminated by ``kind``."""


def _kind(event: msgspec.Struct) -> str:
    return str(type(event).__struct_config__.tag)


for _event_type in get_args(JobEvent):
    # ``event.kind``, as on the wire (the tag is no field of the struct: it raised AttributeError).
    _event_type.kind = property(_kind)

TERMINAL_KINDS = frozenset({"completed", "failed", "rejected", "cancelled"})


def nul_text(spec: msgspec.Struct) -> str | None:
    """Where a spec holds a NUL character (``\\u0000``) in a text or a key, as ``$.labels.team``;
    None when it holds none. JSON allows one, but PostgreSQL's text and jsonb cannot store it: a
    submission with one failed at its insert and was never answered (a newcomer's walk)."""

    if b"\\u0000" not in msgspec.json.encode(spec):  # how JSON writes a NUL: none, the common case
        return None

    def walk(value: object, path: str) -> str | None:
        if isinstance(value, str):
            return path if "\x00" in value else None
        if isinstance(value, dict):
            for key, item in value.items():
                if "\x00" in str(key):
                    return f"{path} (a key)"
                if (found := walk(item, f"{path}.{key}")) is not None:
                    return found
        if isinstance(value, list):
            for i, item in enumerate(value):
                if (found := walk(item, f"{path}[{i}]")) is not None:
                    return found
        return None

    return walk(msgspec.to_builtins(spec), "$")
