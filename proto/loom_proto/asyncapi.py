"""Generate the checked-in AsyncAPI document and JSON Schemas from the Structs.

``python -m loom_proto.asyncapi --write`` regenerates them; ``--check`` exits 1 when the files in
the package differ from what the Structs say (a test runs the same check).
"""

import argparse
import inspect
import json
import sys
from pathlib import Path
from typing import Any

import msgspec

from loom_proto.alerts import Alert, IncidentChange
from loom_proto.clusters import (
    CheckpointJob,
    ClusterHeartbeat,
    ClusterProfiles,
    ClusterStatus,
    DrainCluster,
    ResizeJob,
    StartJob,
    StartJobs,
    StopJob,
)
from loom_proto.jobs import (
    JobCancelled,
    JobCheckpointed,
    JobCompleted,
    JobFailed,
    JobPlaced,
    JobProgress,
    JobRejected,
    JobRequeued,
    JobResized,
    JobStarted,
    JobSubmitted,
)
from loom_proto.migrations import MigrationEvent
from loom_proto.net import LinkDegraded, LinkRecovered, LinkState, ProbeSample, TransferObserved
from loom_proto.subjects import REQUEST_KINDS
from loom_proto.view import RegionSummary, ViewDelta

# The generated files live in the top-level proto/ folder, beside this package, for other languages.
HERE = Path(__file__).resolve().parent.parent

# channel address -> (parameters, message type, description)
CHANNELS: dict[str, tuple[tuple[str, ...], type[msgspec.Struct], str]] = {
    "loom.jobs.submitted.{tenant}": (
        ("tenant",),
        JobSubmitted,
        "Submit a job (a client's request, held by the REQUESTS stream). Set Nats-Msg-Id to"
        " `<job_id>:<random>`, an id nobody can guess, and reuse it only to retry this submission:"
        " JetStream drops a second message with an id it saw in the last 2 minutes, so a guessable"
        " id (the job id alone) can be taken first by another tenant and this submission dropped.",
    ),
    "loom.jobs.placed.{tenant}": (("tenant",), JobPlaced, "Placement reserved capacity on a cluster."),
    # Agents' reports name the reporting cluster last: only its agent may publish there.
    "loom.jobs.started.{tenant}.{cluster}": (("tenant", "cluster"), JobStarted, "A job's run started."),
    "loom.jobs.progress.{tenant}.{cluster}": (("tenant", "cluster"), JobProgress, "Steps done so far."),
    "loom.jobs.checkpointed.{tenant}.{cluster}": (
        ("tenant", "cluster"),
        JobCheckpointed,
        "A checkpoint was written.",
    ),
    "loom.jobs.completed.{tenant}.{cluster}": (("tenant", "cluster"), JobCompleted, "A job's run finished."),
    "loom.jobs.failed.{tenant}.{cluster}": (("tenant", "cluster"), JobFailed, "A job's run failed."),
    "loom.jobs.completed.{tenant}": (("tenant",), JobCompleted, "A service recorded a job as finished."),
    "loom.jobs.failed.{tenant}": (("tenant",), JobFailed, "A service gave a job up as failed."),
    "loom.jobs.rejected.{tenant}": (("tenant",), JobRejected, "Loom will not run the job, and why."),
    "loom.jobs.cancelled.{tenant}": (
        ("tenant",),
        JobCancelled,
        "Ask placement to cancel a job (a client's request, held by the REQUESTS stream; an id as for"
        " a submission). Its outcome is the job's state (ask `loom.jobs.query.{tenant}`): a running"
        " job's run reports `failed` with `stopped`; a refused request is dead-lettered.",
    ),
    "loom.jobs.requeued.{tenant}": (("tenant",), JobRequeued, "A placed job went back to the queue."),
    "loom.jobs.resized.{tenant}": (("tenant",), JobResized, "An elastic job grew or shrank."),
    "loom.clusters.{cluster}.heartbeat": (("cluster",), ClusterHeartbeat, "An agent's heartbeat."),
    "loom.clusters.{cluster}.cmd.start": (("cluster",), StartJob, "Start a job on given nodes."),
    "loom.clusters.{cluster}.cmd.starts": (
        ("cluster",),
        StartJobs,
        "Start several jobs placement decided in one cycle (one message per cluster and cycle).",
    ),
    "loom.clusters.{cluster}.cmd.stop": (("cluster",), StopJob, "Stop a job's run."),
    "loom.clusters.{cluster}.cmd.checkpoint": (("cluster",), CheckpointJob, "Checkpoint a job now."),
    "loom.clusters.{cluster}.cmd.drain": (("cluster",), DrainCluster, "Stop accepting work."),
    "loom.clusters.{cluster}.cmd.resize": (("cluster",), ResizeJob, "Change an elastic job's workers."),
    "loom.clusters.{cluster}.status": (("cluster",), ClusterStatus, "An agent's state changes."),
    "loom.clusters.{cluster}.profile": (("cluster",), ClusterProfiles, "Accelerator profiles of a cluster."),
    "loom.view.delta.{region}": (("region",), ViewDelta, "Ledger changes of one cluster."),
    "loom.view.summary.{region}": (("region",), RegionSummary, "Capacity of a region and its zones."),
    "loom.net.probe.{src}.{dst}": (("src", "dst"), ProbeSample, "A raw probe sample."),
    "loom.net.link.{src}.{dst}": (("src", "dst"), LinkState, "A link's current state."),
    "loom.net.transfer.{src}.{dst}": (("src", "dst"), TransferObserved, "A job's observed transfer rate."),
    "loom.net.event.degraded": ((), LinkDegraded, "A link crossed its degrade thresholds."),
    "loom.net.event.recovered": ((), LinkRecovered, "A degraded link is within its thresholds again."),
    "loom.alerts.{source}": (("source",), Alert, "An alert from a monitoring source."),
    "loom.alerts.raw.{source}": (("source",), Alert, "A raw alert for the alert correlator."),
    "loom.incidents.opened": ((), IncidentChange, "An incident opened (or re-opened on relapse)."),
    "loom.incidents.updated": ((), IncidentChange, "An incident changed: root, jobs, severity, ack."),
    "loom.incidents.resolved": ((), IncidentChange, "An incident resolved (or merged into another)."),
    "loom.migrations.planned.{tenant}": (("tenant",), MigrationEvent, "A job's move was chosen."),
    "loom.migrations.started.{tenant}": (("tenant",), MigrationEvent, "A job's old run was given up."),
    "loom.migrations.completed.{tenant}": (("tenant",), MigrationEvent, "A moved job runs elsewhere."),
    "loom.migrations.failed.{tenant}": (("tenant",), MigrationEvent, "A job's move did not happen."),
}


def _clean_descriptions(node: Any) -> Any:
    """Dedent every description the way ``inspect.cleandoc`` does.

    msgspec versions differ in whether they dedent docstrings; the generated files must not
    depend on which one is installed.
    """
    if isinstance(node, dict):
        return {
            k: inspect.cleandoc(v) if k == "description" and isinstance(v, str) else _clean_descriptions(v)
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [_clean_descriptions(v) for v in node]
    return node


def schemas() -> dict[str, dict[str, Any]]:
    """JSON Schema (2020-12) of every message, by message name."""
    out: dict[str, dict[str, Any]] = {}
    for _, message_type, _ in CHANNELS.values():
        schema = _clean_descriptions(msgspec.json.schema(message_type))
        schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
        schema["$id"] = f"loom/{message_type.__name__}.json"
        out[message_type.__name__] = schema
    return out


def document() -> dict[str, Any]:
    """The AsyncAPI 3.0 document for every channel."""
    types = sorted({t for _, t, _ in CHANNELS.values()}, key=lambda t: t.__name__)
    _, components = msgspec.json.schema_components(types, ref_template="#/components/schemas/{name}")
    components = _clean_descriptions(components)
    channels: dict[str, Any] = {}
    operations: dict[str, Any] = {}
    messages: dict[str, Any] = {}
    for address, (params, message_type, description) in CHANNELS.items():
        name = message_type.__name__
        channel_id = address.replace(".{", "_").replace("}", "").replace(".", "_")
        messages[name] = {
            "name": name,
            "contentType": "application/json",
            "payload": {"$ref": f"#/components/schemas/{name}"},
            "headers": {
                "type": "object",
                "properties": {
                    "Nats-Msg-Id": {
                        "type": "string",
                        "description": "the id JetStream deduplicates on (2 minutes, per stream): a"
                        " service's or an agent's is deterministic (retries are one message) and, on a"
                        " secured stack, ends in `~` and 16 hex digits, a tag keyed with its own"
                        " identity's secret (read the id without it); a client's must be one nobody"
                        " can guess",
                    },
                    "traceparent": {"type": "string", "description": "W3C trace context"},
                },
            },
        }
        channels[channel_id] = {
            "address": address,
            "description": description,
            "parameters": {p: {"description": "[A-Za-z0-9_-]{1,64}"} for p in params},
            "messages": {name: {"$ref": f"#/components/messages/{name}"}},
        }
        # A client's view: it sends requests (submissions, cancellations) and receives the rest.
        sends = address.split(".")[2] in REQUEST_KINDS if address.startswith("loom.jobs.") else False
        operations[f"{'publish' if sends else 'receive'}_{channel_id}"] = {
            "action": "send" if sends else "receive",
            "channel": {"$ref": f"#/channels/{channel_id}"},
        }
    return {
        "asyncapi": "3.0.0",
        "info": {
            "title": "Loom events",
            "version": "0.1.0",
            "description": "Every event Loom's services exchange over NATS JetStream, JSON-encoded;"
            " the operations are a client's: it sends requests (submissions, cancellations) and"
            " receives the rest. Request-reply queries (`loom.jobs.query.{tenant}`, `loom.view.query`,"
            ' `loom.net.query.*`) answer `{"ok": true, "result": ...}` or `{"ok": false,'
            ' "error": ...}` and are described in the README, as are tenants\' credentials.',
        },
        "defaultContentType": "application/json",
        "channels": channels,
        "operations": operations,
        "components": {"schemas": components, "messages": messages},
    }


def rendered() -> dict[Path, str]:
    """Every generated file and its content."""
    files = {HERE / "asyncapi.json": json.dumps(document(), indent=2, sort_keys=True) + "\n"}
    for name, schema in schemas().items():
        files[HERE / "schemas" / f"{name}.json"] = json.dumps(schema, indent=2, sort_keys=True) + "\n"
    return files


def stale_files() -> list[Path]:
    """Generated files that are missing or differ from what the Structs produce."""
    return [p for p, text in rendered().items() if not p.exists() or p.read_text() != text]


def main(argv: list[str] | None = None) -> int:
    """Write or check the generated files."""
    parser = argparse.ArgumentParser(prog="python -m loom_proto.asyncapi")
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--write", action="store_true")
    group.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    if args.write:
        (HERE / "schemas").mkdir(exist_ok=True)
        for path, text in rendered().items():
            path.write_text(text)
        return 0
    stale = stale_files()
    for path in stale:
        print(f"stale: {path} (run python -m loom_proto.asyncapi --write)", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
