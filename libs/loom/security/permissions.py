"""Who may publish and subscribe where on the bus: identities and their permissions (issue 18).

Every process of a secured stack connects as its own identity: one per service role, one per
cluster agent, one per tenant, and the operator (``admin``: the CLI and the supervisor). The
permission table is generated from the subject map in :mod:`loom_proto.subjects`, never written by
hand, so a subject that moves moves its permission with it. Pure: no I/O here.

What nats-server enforces with it (and what it cannot):

* an agent publishes only its own cluster's subjects (``loom.clusters.<c>.{heartbeat,profile,
  status}``), never a command, and consumes only its own durable on ``CLUSTERS``;
* a tenant publishes only ``loom.jobs.submitted.<its tenant>`` and reads only
  ``loom.jobs.<kind>.<its tenant>`` (plus its replies);
* a service publishes only its role's subjects (metrics cannot command an agent, the console
  cannot place a job, a probe collector cannot report a heartbeat).

Every identity gets its own reply-inbox prefix (``_INBOX.<identity>``) and may subscribe only to
it, so no one can read another's replies; responders answer through ``allow_responses``.
"""

from dataclasses import dataclass, field
from typing import Literal

from loom_proto import subjects
from loom_proto.ids import validate_id

Role = Literal[
    "admin",
    "placement",
    "metrics",
    "network-perception",
    "probe-collector",
    "alert-correlator",
    "console",
    "migration",
    "agent",
    "tenant",
]
SERVICE_ROLES: tuple[Role, ...] = (
    "placement",
    "metrics",
    "network-perception",
    "probe-collector",
    "alert-correlator",
    "console",
    "migration",
)

P = subjects.PREFIX
JS_API = "$JS.API"


@dataclass(frozen=True)
class Identity:
    """One NATS user: a role and, for agents and tenants, the cluster or tenant it speaks for."""

    role: Role
    scope: str | None = None
    """The cluster of an agent, the tenant of a tenant, the region of a probe collector."""

    def __post_init__(self) -> None:
        if self.role in ("agent", "tenant") and self.scope is None:
            raise ValueError(
                f"a {self.role} identity needs its {(self.role == 'agent' and 'cluster') or 'tenant'}"
            )
        if self.scope is not None:
            validate_id(self.scope, "identity scope")

    @property
    def name(self) -> str:
        """``placement``, ``agent-c1``, ``tenant-acme``, ``probe-collector-eu``: a subject token."""
        return self.role if self.scope is None else f"{self.role}-{self.scope}"

    @property
    def inbox_prefix(self) -> str:
        """Where this identity's replies arrive; nobody else may subscribe there."""
        return f"_INBOX.{self.name}"


@dataclass(frozen=True)
class Permissions:
    """Publish / subscribe allow lists (and publish denies) of one identity."""

    publish: list[str]
    subscribe: list[str]
    publish_deny: list[str] = field(default_factory=list)
    allow_responses: bool = True

    def as_config(self) -> dict[str, object]:
        """The ``permissions`` block of a nats-server user."""
        publish: dict[str, list[str]] = {"allow": self.publish}
        if self.publish_deny:
            publish["deny"] = self.publish_deny
        config: dict[str, object] = {"publish": publish, "subscribe": {"allow": self.subscribe}}
        if self.allow_responses:
            config["allow_responses"] = True
        return config


def identity_for_process(name: str) -> Identity:
    """The identity the supervisor gives a service process, from its name in ``service_argvs``."""
    if name.startswith("agent-"):
        return Identity("agent", name.removeprefix("agent-"))
    if name.startswith("probe-"):
        return Identity("probe-collector", name.removeprefix("probe-"))
    if name.startswith("placement"):
        return Identity("placement")
    for role in SERVICE_ROLES:
        if name == role or name.startswith(f"{role}-"):
            return Identity(role)
    raise ValueError(f"no identity for process {name!r}")


# Read-only request-reply subjects every service may ask (answers go to its own inbox).
_QUERIES = [subjects.VIEW_QUERY, subjects.JOBS_QUERY, subjects.NET_QUERY_PATH, subjects.NET_QUERY_POINT]


def _events(*kinds: subjects.JobEventKind) -> list[str]:
    return subjects.job_events_of(*kinds)


def _service_publish(role: Role) -> list[str]:
    """What a trusted service role may publish besides JetStream's API and queries."""
    if role == "placement":
        return [
            *_events("placed", "rejected", "resized", "requeued", "failed", "completed"),
            *[f"{P}.clusters.*.cmd.{kind}" for kind in subjects.CLUSTER_COMMAND_KINDS],
            "$KV.loom_leases.>",
            f"{P}.alive.*",  # the leader's liveness ping of each agent (core NATS)
            subjects.PLACEMENT_SLOW,  # a slow run, for the migration service (core NATS)
        ]
    if role == "migration":
        return [
            f"{P}.migrations.*",
            f"{P}.migrations.*.*",
            subjects.PLACEMENT_MIGRATE,
            subjects.PLACEMENT_WHATIF,
            subjects.MIGRATE_DRAINS_CHANGED,
            *_events("requeued", "resized", "failed"),
            *[f"{P}.clusters.*.cmd.{kind}" for kind in subjects.CLUSTER_COMMAND_KINDS],
            "$KV.loom_leases.>",
        ]
    if role == "metrics":
        # Metrics republishes profiles it learnt and marks a silent cluster's heartbeat offline.
        return [f"{P}.view.delta.*", f"{P}.view.summary.*", subjects.HEARTBEATS_ALL, subjects.PROFILES_ALL]
    if role == "network-perception":
        return [subjects.NET_TRANSFERS_ALL, subjects.LINK_STATES_ALL, subjects.NET_EVENTS_ALL]
    if role == "probe-collector":
        return [subjects.PROBE_SAMPLES_ALL, f"{P}.net.endpoints.*"]
    if role == "alert-correlator":
        return [f"{P}.alerts.*", subjects.ALERTS_RAW_ALL, *subjects.INCIDENTS_ALL]
    if role == "console":
        return [subjects.INCIDENTS_ACK, f"{P}.net.emu.>"]
    raise ValueError(f"{role} is not a service role")


def permissions(identity: Identity) -> Permissions:
    """The permissions of ``identity``: the table nats-server enforces."""
    inbox = f"{identity.inbox_prefix}.>"
    role, scope = identity.role, identity.scope
    if role == "admin":
        return Permissions(publish=[">"], subscribe=[">"])
    if role == "tenant":
        assert scope is not None
        return Permissions(
            publish=[
                subjects.job_submitted(scope),
                subjects.jobs_query(scope),
                *(q for q in _QUERIES if q != subjects.JOBS_QUERY),
            ],
            subscribe=[subjects.tenant_job_events(scope), inbox],
        )
    if role == "agent":
        assert scope is not None
        durable = f"agent-{scope}"
        own = f"{P}.clusters.{scope}"
        return Permissions(
            publish=[
                subjects.cluster_heartbeat(scope),
                subjects.cluster_profiles(scope),
                subjects.cluster_status(scope),
                # Reports of the jobs it runs: the subject names the job's tenant, not the
                # cluster, so which agent may report a job is checked by the consumer (gap).
                *_events("started", "progress", "checkpointed", "completed", "failed"),
                f"{P}.dlq.{own}.cmd.*",
                subjects.PLACEMENT_ATTEMPTS,  # after a restart: which of its runs are still current
                f"{JS_API}.INFO",
                f"{JS_API}.STREAM.INFO.CLUSTERS",
                f"{JS_API}.CONSUMER.DURABLE.CREATE.CLUSTERS.{durable}",
                f"{JS_API}.CONSUMER.CREATE.CLUSTERS.{durable}",
                f"{JS_API}.CONSUMER.CREATE.CLUSTERS.{durable}.{own}.cmd.*",
                f"{JS_API}.CONSUMER.INFO.CLUSTERS.{durable}",
                f"{JS_API}.CONSUMER.MSG.NEXT.CLUSTERS.{durable}",
                f"$JS.ACK.CLUSTERS.{durable}.>",
            ],
            subscribe=[
                subjects.net_endpoints(scope),
                subjects.service_health(f"agent-{scope}"),
                subjects.agent_alive(scope),
                inbox,
            ],
        )
    return Permissions(
        publish=[
            *_service_publish(role),
            *_QUERIES,
            f"{P}.dlq.>",
            f"{P}.health.*",
            f"{JS_API}.>",
            "$JS.ACK.>",
        ],
        # Services are trusted readers of the whole bus; what they may say is what is narrowed.
        subscribe=[f"{P}.>", inbox],
    )


def may_manage_streams(identity: str) -> bool:
    """Whether the identity (by name) creates / updates streams at start (agents and tenants do not)."""
    return not identity.startswith(("agent-", "tenant-"))
