"""Loom's wire contracts: every event as a msgspec Struct, subject builders and stream definitions.

This package imports nothing else of Loom, so clients in any language can rely on the generated
AsyncAPI document and JSON Schemas beside it (``asyncapi.json``, ``schemas/``), and Python clients
can depend on it alone.
"""

from loom_proto.alerts import Alert, Severity
from loom_proto.clusters import (
    CheckpointJob,
    ClusterCommand,
    ClusterHeartbeat,
    ClusterStatus,
    DrainCluster,
    NodeAllocation,
    NodeState,
    StartJob,
    StartJobs,
    StopJob,
)
from loom_proto.codec import DecodeError, decode, encode
from loom_proto.ids import ID_PATTERN, Id, InvalidIdError, validate_id
from loom_proto.jobs import (
    JobCancelled,
    JobCheckpointed,
    JobCompleted,
    JobEvent,
    JobFailed,
    JobPlaced,
    JobProgress,
    JobRejected,
    JobSpec,
    JobStarted,
    JobSubmitted,
    Resources,
    TaskType,
    Work,
)
from loom_proto.net import (
    LinkDegraded,
    LinkEventMessage,
    LinkRecovered,
    LinkState,
    ProbeEndpoints,
    ProbeKind,
    ProbeSample,
)
from loom_proto.view import ModelCapacity, NodeView, RegionSummary, ViewDelta, ZoneSummary

__all__ = [
    "ID_PATTERN",
    "Alert",
    "CheckpointJob",
    "ClusterCommand",
    "ClusterHeartbeat",
    "ClusterStatus",
    "DecodeError",
    "DrainCluster",
    "Id",
    "InvalidIdError",
    "JobCancelled",
    "JobCheckpointed",
    "JobCompleted",
    "JobEvent",
    "JobFailed",
    "JobPlaced",
    "JobProgress",
    "JobRejected",
    "JobSpec",
    "JobStarted",
    "JobSubmitted",
    "LinkDegraded",
    "LinkEventMessage",
    "LinkRecovered",
    "LinkState",
    "ModelCapacity",
    "NodeAllocation",
    "NodeState",
    "NodeView",
    "ProbeEndpoints",
    "ProbeKind",
    "ProbeSample",
    "RegionSummary",
    "Resources",
    "Severity",
    "StartJob",
    "StartJobs",
    "StopJob",
    "TaskType",
    "ViewDelta",
    "Work",
    "ZoneSummary",
    "decode",
    "encode",
    "validate_id",
]
