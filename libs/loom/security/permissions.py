"""Who may publish and subscribe where on the bus: identities and their permissions (issue 18).

Every process of a secured stack connects as its own identity: one per service role, one per
cluster agent, one per tenant, and the operator (``admin``: the CLI and the supervisor). The
permission table is generated from the subject map in :mod:`loom_proto.subjects`, never written by
hand, so a subject that moves moves its permission with it. Pure: no I/O here.

What nats-server enforces with it (and what it cannot):

* an agent publishes only its own cluster's subjects (``loom.clusters.<c>.{heartbeat,profile,
  status}`` and its reports ``loom.jobs.<kind>.<tenant>.<c>``), never a command, and consumes
  only its own durable on ``CLUSTERS``; placement records a report only when ``<c>`` is a
  cluster of that attempt's run (else it is dead-lettered with the reason, the job unchanged);
* a tenant publishes only ``loom.jobs.submitted.<its tenant>`` and ``loom.jobs.cancelled.<its
  tenant>`` (placement checks that the job cancelled is the tenant's) and reads only
  ``loom.jobs.<kind>.<its tenant>`` (plus its replies);
* a service publishes only its role's subjects (metrics cannot command an agent, the console
  cannot place a job, a probe collector cannot report a heartbeat), and calls only the JetStream
  API of Loom's streams and of the consumers on the streams it reads
  (:func:`service_jetstream_api`: no stream deletes or purges, no consumers elsewhere). What
  stays broad, and why: services still *read* all of ``loom.>`` (they are trusted readers; their
  consumers' filters span tenants and clusters), and a consumer's *name* is a wildcard on the
  streams a service reads, because placement's durables carry a shard the table does not know.

Every identity gets its own reply-inbox prefix (``_INBOX.<identity>``) and may subscribe only to
it, so no one can read another's replies; responders answer through ``allow_responses``.
"""

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from loom_proto import subjects
from loom_proto.ids import validate_id
from loom_proto.jobs import JobCancelled

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
ATTEMPTS_BUCKET = "LOOM_ATTEMPTS"
"""The consumers' attempt records (``loom.bus.attempts.ATTEMPTS_BUCKET``; this module imports no bus)."""


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


def tenant_of(identity: str | None) -> str | None:
    """The tenant an identity's name speaks for (``tenant-acme`` is ``acme``), None for any other
    identity or none (an unsecured connection)."""
    return identity.removeprefix("tenant-") if identity and identity.startswith("tenant-") else None


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
            # Only to republish, on an upgrade, the requests an older layout left in JOBS
            # (loom.bus.requests_move); placement decides every job's fate in any case.
            *subjects.REQUESTS_ALL,
            *[f"{P}.clusters.*.cmd.{kind}" for kind in subjects.CLUSTER_COMMAND_KINDS],
            "$KV.loom_leases.>",
            f"{P}.alive.*",  # the leader's liveness ping of each agent (core NATS)
            subjects.PLACEMENT_SLOW,  # a slow run, for the migration service (core NATS)
            subjects.PLACEMENT_CLUSTER_HEALTH,  # a cluster's classification, for the alert correlator
        ]
    if role == "migration":
        return [
            f"{P}.migrations.*",
            f"{P}.migrations.*.*",
            subjects.PLACEMENT_MIGRATE,
            subjects.PLACEMENT_WHATIF,
            subjects.MIGRATE_DRAINS_CHANGED,
            subjects.NET_USE,  # the links running jobs span, for the collectors' probe intensity
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
        # ... and asks every watched service for its health (request-reply, core NATS).
        return [f"{P}.alerts.*", subjects.ALERTS_RAW_ALL, *subjects.INCIDENTS_ALL, f"{P}.health.*"]
    if role == "console":
        # An operator's actions on the console: cancel a job (its ``cancelled`` event, as `loom
        # cancel`), drain or open a cluster (the migration service's drain request), ack an incident.
        return [subjects.INCIDENTS_ACK, f"{P}.net.emu.>", *_events("cancelled"), subjects.MIGRATE_DRAIN]
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
                subjects.job_event("cancelled", scope),  # placement cancels only its own jobs
                subjects.jobs_query(scope),
                *(q for q in _QUERIES if q != subjects.JOBS_QUERY),
            ],
            subscribe=[subjects.tenant_job_events(scope), subjects.tenant_job_reports(scope), inbox],
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
                # Reports of the runs it carries out, on subjects that name its own cluster
                # (``loom.jobs.<kind>.<tenant>.<cluster>``): placement checks that cluster
                # against the attempt's run, so another cluster's job cannot be reported.
                *subjects.cluster_reports(scope),
                f"{P}.dlq.{own}.cmd.*",
                subjects.PLACEMENT_ATTEMPTS,  # after a restart: which of its runs are still current
                f"{JS_API}.INFO",
                f"{JS_API}.STREAM.INFO.CLUSTERS",
                # Its durable, created (or updated) only with its own commands' filter: the
                # server checks the filter named in this subject against the request's; the
                # other creation subjects do not, and with them its durable read another
                # cluster's start commands, other tenants' job specs in them.
                f"{JS_API}.CONSUMER.CREATE.CLUSTERS.{durable}.{own}.cmd.*",
                f"{JS_API}.CONSUMER.INFO.CLUSTERS.{durable}",
                f"{JS_API}.CONSUMER.MSG.NEXT.CLUSTERS.{durable}",
                f"$JS.ACK.CLUSTERS.{durable}.>",
                # Its consumer's attempt records (crash-loop detection, loom.bus.attempts) only.
                # Read by direct get, whose subject names the key (the stream's message-get API
                # takes the key in the request, and read every consumer's records).
                f"{JS_API}.STREAM.INFO.KV_{ATTEMPTS_BUCKET}",
                f"{JS_API}.DIRECT.GET.KV_{ATTEMPTS_BUCKET}.$KV.{ATTEMPTS_BUCKET}.CLUSTERS.{durable}.>",
                f"$KV.{ATTEMPTS_BUCKET}.CLUSTERS.{durable}.>",
            ],
            subscribe=[
                subjects.net_endpoints(scope),
                subjects.service_health(f"agent-{scope}"),
                subjects.agent_alive(scope),
                inbox,
                # Its command consumer (a standing pull request) follows its consumer leader's
                # election, as the services' consumers do (loom.bus.consumer asks again at once).
                f"$JS.EVENT.ADVISORY.CONSUMER.LEADER_ELECTED.CLUSTERS.{durable}",
            ],
        )
    return Permissions(
        publish=[
            *_service_publish(role),
            *_QUERIES,
            f"{P}.dlq.>",
            f"{P}.health.*",
            *service_jetstream_api(role),
            f"$KV.{ATTEMPTS_BUCKET}.>",  # consumers' attempt records (loom.bus.attempts)
        ],
        # Services are trusted readers of the whole bus; what they may say is what is narrowed.
        # Their consumers also follow their leader's election (a standing pull request dies with
        # the node that held it: loom.bus.consumer asks again when another is elected).
        subscribe=[
            f"{P}.>",
            *(f"$JS.EVENT.ADVISORY.CONSUMER.LEADER_ELECTED.{name}.*" for name in CONSUMED_STREAMS[role]),
            inbox,
        ],
    )


CONSUMED_STREAMS: dict[Role, tuple[str, ...]] = {
    "placement": ("VIEW", "JOBS", "REQUESTS"),
    "metrics": ("CLUSTERS", "JOBS", "REQUESTS"),
    "network-perception": ("NET",),
    "migration": ("JOBS",),
    "alert-correlator": ("ALERTS", "DLQ", "JOBS", "MIGRATIONS", "NET", "VIEW"),
    "console": (),
    "probe-collector": (),
}
"""The streams each service role holds durable consumers on (its ``ConsumerSpec``s): a service
that starts consuming another stream adds it here, or nats-server refuses its consumer."""

LEASE_STREAM = "KV_loom_leases"
"""The stream behind the leader-lease bucket (:data:`loom.bus.lease.LEASE_BUCKET`)."""
LEASE_HOLDERS: tuple[Role, ...] = ("placement", "migration")


def service_jetstream_api(role: Role) -> list[str]:
    """The JetStream API subjects a service role may call (issue 18: no more ``$JS.API.>``).

    * Every service makes sure Loom's streams exist at start (``ensure_streams``): it may read,
      create and update them (never delete or purge them, nor touch a stream Loom does not define).
    * It creates, reads and pulls from consumers only on the streams it consumes
      (:data:`CONSUMED_STREAMS`), and acks only there. The consumer's *name* stays a wildcard:
      placement's durables carry its shard (``placement-view-<shard>``), which the supervisor's
      options decide and the table does not know; a service could thus create or drain another
      role's durable on a stream it also reads, which no role's subjects would let it forge.
    * Placement and migration hold the lease bucket (``KV_loom_leases``): its stream's info,
      creation and direct gets, besides publishing on ``$KV.loom_leases.>``.
    The operator (``admin``: the CLI, the DLQ commands) keeps ``$JS.API.>``.
    """
    if role not in CONSUMED_STREAMS:
        raise ValueError(f"{role} is not a service role")
    allowed = [f"{JS_API}.INFO"]
    for stream in subjects.STREAMS:
        allowed += [f"{JS_API}.STREAM.{op}.{stream.name}" for op in ("INFO", "CREATE", "UPDATE")]
    for name in CONSUMED_STREAMS[role]:
        allowed += [
            f"{JS_API}.CONSUMER.CREATE.{name}.>",
            f"{JS_API}.CONSUMER.DURABLE.CREATE.{name}.*",
            f"{JS_API}.CONSUMER.INFO.{name}.*",
            f"{JS_API}.CONSUMER.MSG.NEXT.{name}.*",
            f"$JS.ACK.{name}.>",
        ]
    # Every service's consumers keep attempt records (crash-loop detection, loom.bus.attempts):
    # the bucket's stream is created with the streams at start, read by direct or leader gets.
    attempts = f"KV_{ATTEMPTS_BUCKET}"
    allowed += [
        f"{JS_API}.STREAM.INFO.{attempts}",
        f"{JS_API}.STREAM.CREATE.{attempts}",
        f"{JS_API}.STREAM.UPDATE.{attempts}",  # a bucket made before direct gets: updated to serve them
        f"{JS_API}.STREAM.MSG.GET.{attempts}",
        f"{JS_API}.DIRECT.GET.{attempts}.>",
        f"{JS_API}.DIRECT.GET.{attempts}",
    ]
    if role == "placement":
        # An upgrade's move of clients' requests left in JOBS (loom.bus.requests_move): read them
        # by sequence, then delete the old submissions consumer there.
        allowed += [f"{JS_API}.STREAM.MSG.GET.JOBS", f"{JS_API}.CONSUMER.DELETE.JOBS.*"]
    if role in LEASE_HOLDERS:
        allowed += [
            f"{JS_API}.STREAM.INFO.{LEASE_STREAM}",
            f"{JS_API}.STREAM.CREATE.{LEASE_STREAM}",
            f"{JS_API}.STREAM.MSG.GET.{LEASE_STREAM}",
            f"{JS_API}.DIRECT.GET.{LEASE_STREAM}.>",
            f"{JS_API}.DIRECT.GET.{LEASE_STREAM}",
        ]
    return allowed


def foreign_report(
    reporter: str | None, event_cluster: str | None, run_clusters: Collection[str] | None = None
) -> str | None:
    """Why a job report must not be recorded, or None.

    ``reporter`` is the cluster named by the report's subject (None: a service published it on a
    subject without one, which agents may not); ``event_cluster`` the cluster its payload names;
    ``run_clusters`` the clusters holding a part of that attempt's run (None: not looked up yet).
    nats-server lets only the reporter's agent publish on its subject, so this is what makes an
    agent's credentials unable to speak of another cluster's job."""
    if reporter is None:
        return None
    if event_cluster != reporter:
        return f"a report on cluster {reporter}'s subject about a run on {event_cluster or 'no cluster'}"
    if run_clusters is not None and reporter not in run_clusters:
        return f"cluster {reporter} holds no part of that attempt's run: only its own agent may report it"
    return None


def report_claim_id(subject: str, event: object, msg_id: str | None) -> str:
    """The id an agent's report (on ``subject``) is claimed and recorded under: the id it came
    with when that is one its own payload makes (``<job>:<kind>:<attempt>``, with ``:<step>`` for
    progress and checkpoints, a failure's also with ``:<cluster>``), else the payload's own.

    An agent's credentials set any message id, and consumers keep one record per id: a report of
    the agent's own job sent under ``<another job>:completed:1`` took that id first, and the other
    job's real completion was then dropped as its duplicate. Bound to the payload, an id names the
    job, kind and attempt the report is about, which :func:`foreign_report` checks against the
    reporter; the same event reported by two clusters of one run still counts once."""
    kind = subject.split(".")[2]
    base = f"{getattr(event, 'job_id', '')}:{kind}:{getattr(event, 'attempt', '')}"
    if kind in ("progress", "checkpointed"):
        base = f"{base}:{getattr(event, 'step', '')}"
    allowed = {base, f"{base}:{getattr(event, 'cluster', '')}"} if kind == "failed" else {base}
    return msg_id if msg_id in allowed else base


def is_inbox(reply: str | None) -> bool:
    """Whether a request's reply subject is an inbox (``_INBOX.``, ``_INBOX.<identity>.`` secured):
    the only place a service answers (:mod:`loom.bus.reply`)."""
    if not reply:
        return False
    return reply.startswith("_INBOX.") and len(reply) > len("_INBOX.")


def attempts_scope(reply: str | None) -> tuple[bool, str | None]:
    """Whom a ``loom.placement.attempts`` answer sent to ``reply`` reaches, as (answer at all, only
    about this agent's cluster's runs). An identity reads only its own inbox
    (``_INBOX.<identity>.``): an agent's is answered about its own cluster's jobs, a service's or
    the operator's (or any client's on an unsecured server) about any; a reply anywhere else is
    not answered (an agent named a subject it reads, ``loom.health.agent-<C>``, and got any job's
    attempt), nor is a tenant's."""
    if not is_inbox(reply):
        return False, None
    assert reply is not None
    if reply.startswith("_INBOX.tenant-"):
        return False, None
    if reply.startswith("_INBOX.agent-"):
        cluster = reply.removeprefix("_INBOX.agent-").split(".", 1)[0]
        return bool(cluster), cluster or None
    return True, None


def may_manage_streams(identity: str) -> bool:
    """Whether the identity (by name) creates / updates streams at start (agents and tenants do not)."""
    return not identity.startswith(("agent-", "tenant-"))


def received_cancellation(
    subject: str, event: JobCancelled, stored_at_s: float
) -> tuple[JobCancelled, str | None]:
    """A cancellation as placement and metering both take it: at the time the server stored it
    (``stored_at_s``), not the ``at`` its publisher claims (a tenant publishes cancellations: an
    early ``at`` would end a run, and bill it, back then); and why it must be refused, or None (the
    tenant it names is not its subject's: a tenant's credentials publish on their own subject)."""
    why = None
    if subjects.event_tenant(subject) != event.tenant:
        why = f"a cancellation on {subject!r} names tenant {event.tenant!r}"
    elif "\x00" in event.reason:  # no text column stores it: the whole batch's write failed
        why = "a cancellation's reason holds a NUL character (\\u0000), which stored text cannot hold"
    return msgspec.structs.replace(event, at=stored_at_s), why


def tenant_claim_id(subject: str, msg_id: str) -> str:
    """The inbox key of a message a tenant may publish (a submission, a cancellation): its message
    id within its subject's tenant. A tenant chooses its message ids, so a bare id could be taken
    first by another tenant's message, and the owner's, claimed as done, dropped as its duplicate
    (a squatted id, found by a newcomer's walk); scoped, a tenant's ids collide only with its own."""
    return f"{msg_id}@{subjects.event_tenant(subject) or '?'}"


def foreign_cancellation(tenant: str, job_id: str, owner: str | None) -> str | None:
    """Why tenant ``tenant`` may not cancel ``job_id``, whose tenant is ``owner`` (None: no such
    job), or None when it may."""
    if owner is None:
        return f"no job {job_id} to cancel"
    if owner != tenant:
        return f"tenant {tenant!r} may not cancel job {job_id}: it is another tenant's"
    return None
