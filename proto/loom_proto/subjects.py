"""Subject names, their builders, and the JetStream streams that hold them (ARCHITECTURE.md §4).

Every builder validates the identifiers it puts into a subject, so no caller can build a subject
with a wildcard or an extra token in it.
"""

from typing import Literal

import msgspec

from loom_proto.ids import validate_id

PREFIX = "loom"

JobEventKind = Literal[
    "submitted",
    "placed",
    "started",
    "progress",
    "checkpointed",
    "completed",
    "failed",
    "rejected",
    "cancelled",
    "requeued",
    "resized",
]
ClusterCommandKind = Literal["start", "starts", "stop", "checkpoint", "drain", "resize"]

JOB_EVENT_KINDS: tuple[JobEventKind, ...] = (
    "submitted",
    "placed",
    "started",
    "progress",
    "checkpointed",
    "completed",
    "failed",
    "rejected",
    "cancelled",
    "requeued",
    "resized",
)
CLUSTER_COMMAND_KINDS: tuple[ClusterCommandKind, ...] = (
    "start",
    "starts",
    "stop",
    "checkpoint",
    "drain",
    "resize",
)


def job_submitted(tenant: str) -> str:
    """``loom.jobs.submitted.<tenant>``: where clients submit jobs."""
    return f"{PREFIX}.jobs.submitted.{validate_id(tenant, 'tenant')}"


def job_placed(tenant: str) -> str:
    """``loom.jobs.placed.<tenant>``: placement decisions, keyed by the job's tenant like every other
    lifecycle event, so a tenant's credentials see where its jobs went (the cluster is in the event).

    Keyed by the chosen cluster before issue 18; built apart from :func:`job_event` so that callers
    of that time still build a valid subject."""
    return f"{PREFIX}.jobs.placed.{validate_id(tenant, 'tenant')}"


def job_event(kind: JobEventKind, tenant: str) -> str:
    """``loom.jobs.<kind>.<tenant>`` for every lifecycle event but ``placed``."""
    if kind == "placed":
        raise ValueError("placed events have their own builder: use job_placed(tenant)")
    if kind not in JOB_EVENT_KINDS:
        raise ValueError(f"unknown job event kind {kind!r}")
    return f"{PREFIX}.jobs.{kind}.{validate_id(tenant, 'tenant')}"


ReportKind = Literal["started", "progress", "checkpointed", "completed", "failed"]
REPORT_KINDS: tuple[ReportKind, ...] = ("started", "progress", "checkpointed", "completed", "failed")
"""What a cluster's agent reports of the runs it carries out (issue 18: on :func:`job_report`)."""


def job_report(kind: ReportKind, tenant: str, cluster: str) -> str:
    """``loom.jobs.<kind>.<tenant>.<cluster>``: an agent's report of a run on its cluster.

    The job's tenant stays the fourth token (a tenant's credentials read its reports as they read
    its other events); the fifth names the reporting cluster, so nats-server lets only that
    cluster's agent publish it and the consumer checks it against the cluster of the attempt's run.
    ``completed`` and ``failed`` also exist without the cluster token: those are decided by a
    service (placement, migration), which only services may publish."""
    if kind not in REPORT_KINDS:
        raise ValueError(f"{kind!r} is not an agent report kind")
    return f"{PREFIX}.jobs.{kind}.{validate_id(tenant, 'tenant')}.{validate_id(cluster, 'cluster')}"


def job_reports(kind: ReportKind, tenant: str) -> str:
    """``loom.jobs.<kind>.<tenant>.*``: one tenant's reports of a kind, from every cluster."""
    if kind not in REPORT_KINDS:
        raise ValueError(f"{kind!r} is not an agent report kind")
    return f"{PREFIX}.jobs.{kind}.{validate_id(tenant, 'tenant')}.*"


def cluster_reports(cluster: str) -> list[str]:
    """``loom.jobs.<kind>.*.<cluster>`` for every report kind: what one cluster's agent may publish."""
    validate_id(cluster, "cluster")
    return [f"{PREFIX}.jobs.{kind}.*.{cluster}" for kind in REPORT_KINDS]


def report_cluster(subject: str) -> str | None:
    """The reporting cluster named by a job event's subject (its fifth token), or None when the
    subject has none (an event published by a service)."""
    tokens = subject.split(".")
    if len(tokens) == 5 and tokens[0] == PREFIX and tokens[1] == "jobs" and tokens[2] in REPORT_KINDS:
        return tokens[4]
    return None


def event_tenant(subject: str) -> str | None:
    """The tenant named by a job event's subject (its fourth token), or None for another subject."""
    tokens = subject.split(".")
    if len(tokens) in (4, 5) and tokens[0] == PREFIX and tokens[1] == "jobs" and tokens[2] in JOB_EVENT_KINDS:
        return tokens[3]
    return None


def job_events_of(*kinds: JobEventKind) -> list[str]:
    """A consumer's filter for every event of those kinds, whatever the tenant: ``loom.jobs.<kind>.*``,
    or ``loom.jobs.<kind>.>`` for a kind agents report (with and without the cluster token)."""
    unknown = [kind for kind in kinds if kind not in JOB_EVENT_KINDS]
    if unknown:
        raise ValueError(f"unknown job event kinds {unknown!r}")
    return [f"{PREFIX}.jobs.{kind}.{'>' if kind in REPORT_KINDS else '*'}" for kind in kinds]


def jobs_query(tenant: str) -> str:
    """``loom.jobs.query.<tenant>``: request-reply, job queries answered with that tenant's jobs only.

    A tenant's credentials may ask here and not on ``loom.jobs.query`` (every tenant's jobs)."""
    return f"{PREFIX}.jobs.query.{validate_id(tenant, 'tenant')}"


def tenant_job_events(tenant: str) -> str:
    """``loom.jobs.*.<tenant>``: every lifecycle event of one tenant's jobs and its submissions:
    all a tenant's credentials may read of the job subjects."""
    return f"{PREFIX}.jobs.*.{validate_id(tenant, 'tenant')}"


def tenant_job_reports(tenant: str) -> str:
    """``loom.jobs.*.<tenant>.*``: the agents' reports of one tenant's jobs (what
    :func:`tenant_job_events` misses: reports carry the cluster as a fifth token)."""
    return f"{PREFIX}.jobs.*.{validate_id(tenant, 'tenant')}.*"


def cluster_heartbeat(cluster: str) -> str:
    """``loom.clusters.<cluster>.heartbeat``."""
    return f"{PREFIX}.clusters.{validate_id(cluster, 'cluster')}.heartbeat"


def cluster_command(cluster: str, kind: ClusterCommandKind) -> str:
    """``loom.clusters.<cluster>.cmd.<kind>``."""
    if kind not in CLUSTER_COMMAND_KINDS:
        raise ValueError(f"unknown cluster command {kind!r}")
    return f"{PREFIX}.clusters.{validate_id(cluster, 'cluster')}.cmd.{kind}"


def cluster_commands(cluster: str) -> str:
    """``loom.clusters.<cluster>.cmd.*``: every command for one cluster (an agent's filter)."""
    return f"{PREFIX}.clusters.{validate_id(cluster, 'cluster')}.cmd.*"


def cluster_profiles(cluster: str) -> str:
    """``loom.clusters.<cluster>.profile``: the performance profiles of a cluster's accelerators."""
    return f"{PREFIX}.clusters.{validate_id(cluster, 'cluster')}.profile"


def cluster_status(cluster: str) -> str:
    """``loom.clusters.<cluster>.status``."""
    return f"{PREFIX}.clusters.{validate_id(cluster, 'cluster')}.status"


def view_delta(region: str) -> str:
    """``loom.view.delta.<region>``: ledger changes for one region."""
    return f"{PREFIX}.view.delta.{validate_id(region, 'region')}"


def view_summary(region: str) -> str:
    """``loom.view.summary.<region>``: capacity summary of one region."""
    return f"{PREFIX}.view.summary.{validate_id(region, 'region')}"


def probe_sample(src: str, dst: str) -> str:
    """``loom.net.probe.<src>.<dst>``."""
    return f"{PREFIX}.net.probe.{validate_id(src, 'source')}.{validate_id(dst, 'destination')}"


def link_state(src: str, dst: str) -> str:
    """``loom.net.link.<src>.<dst>``."""
    return f"{PREFIX}.net.link.{validate_id(src, 'source')}.{validate_id(dst, 'destination')}"


NetEventKind = Literal["degraded", "recovered"]
NET_EVENT_KINDS: tuple[NetEventKind, ...] = ("degraded", "recovered")


def net_transfer(src: str, dst: str) -> str:
    """``loom.net.transfer.<src>.<dst>``: a job's observed inter-region transfer throughput."""
    return f"{PREFIX}.net.transfer.{validate_id(src, 'source')}.{validate_id(dst, 'destination')}"


def net_event(kind: NetEventKind) -> str:
    """``loom.net.event.<kind>``: a link became degraded or recovered."""
    if kind not in NET_EVENT_KINDS:
        raise ValueError(f"unknown network event kind {kind!r}")
    return f"{PREFIX}.net.event.{kind}"


def net_emulator(src: str, dst: str) -> str:
    """``loom.net.emu.<src>.<dst>``: request-reply control of the emulated link (its collector answers)."""
    return f"{PREFIX}.net.emu.{validate_id(src, 'source')}.{validate_id(dst, 'destination')}"


def net_emulator_region(src: str) -> str:
    """``loom.net.emu.<src>.*``: every emulated link out of one region (a collector's filter)."""
    return f"{PREFIX}.net.emu.{validate_id(src, 'source')}.*"


def net_endpoints(cluster: str) -> str:
    """``loom.net.endpoints.<cluster>``: request-reply, where a cluster's agent answers probes."""
    return f"{PREFIX}.net.endpoints.{validate_id(cluster, 'cluster')}"


def alert(source: str) -> str:
    """``loom.alerts.<source>``."""
    return f"{PREFIX}.alerts.{validate_id(source, 'source')}"


def alert_raw(source: str) -> str:
    """``loom.alerts.raw.<source>``: raw alerts of a monitoring source, before correlation."""
    return f"{PREFIX}.alerts.raw.{validate_id(source, 'source')}"


IncidentChangeKind = Literal["opened", "updated", "resolved"]
INCIDENT_CHANGES: tuple[IncidentChangeKind, ...] = ("opened", "updated", "resolved")


def incident(change: IncidentChangeKind) -> str:
    """``loom.incidents.<change>``: an incident opened, updated or resolved (the alert correlator)."""
    if change not in INCIDENT_CHANGES:
        raise ValueError(f"unknown incident change {change!r}")
    return f"{PREFIX}.incidents.{change}"


def service_health(instance: str) -> str:
    """``loom.health.<instance>``: request-reply, where one service instance answers health checks."""
    return f"{PREFIX}.health.{validate_id(instance, 'instance')}"


def agent_alive(cluster: str) -> str:
    """``loom.alive.<cluster>``: request-reply, no stream; the cluster's agent answers (empty) while
    its NATS connection lives, so placement's ping meets *no responders* as soon as it is gone."""
    return f"{PREFIX}.alive.{validate_id(cluster, 'cluster')}"


MigrationEventKind = Literal["planned", "started", "completed", "failed"]
MIGRATION_EVENT_KINDS: tuple[MigrationEventKind, ...] = ("planned", "started", "completed", "failed")


def migration_event(kind: MigrationEventKind, tenant: str) -> str:
    """``loom.migrations.<kind>.<tenant>``: a job's migration planned, started, completed or failed."""
    if kind not in MIGRATION_EVENT_KINDS:
        raise ValueError(f"unknown migration event kind {kind!r}")
    return f"{PREFIX}.migrations.{kind}.{validate_id(tenant, 'tenant')}"


MIGRATIONS_ALL = f"{PREFIX}.migrations.*.*"
MIGRATIONS_FAILED_ALL = f"{PREFIX}.migrations.failed.*"
"""Every tenant's failed migrations (the alert correlator's source)."""
"""Every migration event (the MIGRATIONS stream's subjects)."""
MIGRATE_DRAIN = f"{PREFIX}.migrate.drain"
"""Request-reply: drain or undrain a cluster (the migration service answers)."""
MIGRATE_QUERY = f"{PREFIX}.migrate.query"
"""Request-reply: migrations and drains (the migration service answers)."""
MIGRATE_DRAINS_CHANGED = f"{PREFIX}.migrate.drains"
"""Core NATS notice that the set of drained clusters changed: placement reloads it from the store.
Sent as a request when a drain or undrain is asked for: every leading placement instance answers
once it has reloaded them, with its shard, holder and the territories it holds with their fence
tokens (the drain is answered once the leader of every live shard did, or after a short wait)."""
PLACEMENT_MIGRATE = f"{PREFIX}.placement.migrate"
"""Request-reply: give a job's run up so that it is placed again elsewhere from a checkpoint step
(the placement instance holding the run answers)."""
PLACEMENT_WHATIF = f"{PREFIX}.placement.whatif"
"""Request-reply: where the scheduling framework would place a running job now, its own run's GPUs
counted free (no side effects); with its current placement's predicted step under today's links."""
PLACEMENT_ATTEMPTS = f"{PREFIX}.placement.attempts"
"""Request-reply: the current attempt and state of jobs (a returning agent fences its old runs)."""
PLACEMENT_SLOW = f"{PREFIX}.placement.slow"
"""Core NATS, placement to the migration service: a run delivers less than half its predicted step
rate over a window; its nodes are suspect (the migration service decides whether it moves)."""
PLACEMENT_CLUSTER_HEALTH = f"{PREFIX}.placement.cluster_health"
"""Core NATS, placement to the alert correlator: a cluster's classification changed (suspect,
failed, healthy again)."""


DEAD_LETTERS = f"{PREFIX}.dlq.>"
"""Every dead letter (the DLQ stream's subjects)."""


def dead_letter(original_subject: str) -> str:
    """``loom.dlq.<original subject>``: where a poison message goes, with its error in headers."""
    if original_subject.startswith(f"{PREFIX}.dlq."):
        return original_subject
    return f"{PREFIX}.dlq.{original_subject}"


JOBS_SUBMITTED_ALL = f"{PREFIX}.jobs.submitted.*"
JOBS_CANCELLED_ALL = f"{PREFIX}.jobs.cancelled.*"
JOBS_LIFECYCLE_ALL = f"{PREFIX}.jobs.*.*"
"""Every job event published by a client or a service (four tokens)."""
JOBS_REPORTS_ALL = f"{PREFIX}.jobs.*.*.*"
"""Every agent's report of every job (five tokens: the cluster last); subscribe to both."""
JOBS_PLACED_ALL = f"{PREFIX}.jobs.placed.*"
"""Placement decisions of every tenant."""
HEARTBEATS_ALL = f"{PREFIX}.clusters.*.heartbeat"
PROFILES_ALL = f"{PREFIX}.clusters.*.profile"
VIEW_DELTAS_ALL = f"{PREFIX}.view.delta.*"
PROBE_SAMPLES_ALL = f"{PREFIX}.net.probe.*.*"
LINK_STATES_ALL = f"{PREFIX}.net.link.*.*"
NET_EVENTS_ALL = f"{PREFIX}.net.event.*"
NET_TRANSFERS_ALL = f"{PREFIX}.net.transfer.*.*"

# Request-reply subjects (core NATS, no stream).
VIEW_QUERY = f"{PREFIX}.view.query"
JOBS_QUERY = f"{PREFIX}.jobs.query"
JOBS_QUERY_TENANTS = f"{PREFIX}.jobs.query.*"
"""Every tenant's own query subject (placement answers each only with that tenant's jobs)."""
NET_QUERY_PATH = f"{PREFIX}.net.query.path"
NET_QUERY_POINT = f"{PREFIX}.net.query.point"
NET_EMU_ALL = f"{PREFIX}.net.emu.all"
NET_USE = f"{PREFIX}.net.use"
"""The links running jobs span (core NATS: a collector needs only the latest)."""
ALERTS_RAW_ALL = f"{PREFIX}.alerts.raw.*"
INCIDENTS_ALL = [f"{PREFIX}.incidents.{change}" for change in INCIDENT_CHANGES]
INCIDENTS_ACK = f"{PREFIX}.incidents.ack"
"""Request-reply: the alert correlator acknowledges an incident (``{incident_id, by}``)."""
"""Every collector answers (scatter-gather): used to restore or list every emulated link."""


class StreamSpec(msgspec.Struct, frozen=True, kw_only=True):
    """A JetStream stream Loom creates; ``bus`` turns it into a server config."""

    name: str
    subjects: list[str]
    description: str
    max_age_s: float = 0.0
    """0 keeps messages until the size limit."""
    max_bytes: int = 1 << 30
    duplicate_window_s: float = 120.0
    max_msg_bytes: int = 1 << 20


REQUEST_KINDS: tuple[JobEventKind, ...] = ("submitted", "cancelled")
"""What clients publish of a job (tenants, the console, the CLI): held by the REQUESTS stream."""
REQUESTS_ALL = job_events_of(*REQUEST_KINDS)
"""``loom.jobs.submitted.*`` and ``loom.jobs.cancelled.*``: the REQUESTS stream's subjects."""

STREAMS: tuple[StreamSpec, ...] = (
    # JOBS before REQUESTS: a deployment of the time when JOBS held the requests too has its
    # subjects narrowed first, or REQUESTS could not be created beside it (streams may not overlap).
    StreamSpec(
        name="JOBS",
        # Each kind listed, not ``loom.jobs.>``: the request-reply subject ``loom.jobs.query`` must
        # not be captured by the stream (JetStream would answer the request with a PubAck).
        subjects=job_events_of(*(kind for kind in JOB_EVENT_KINDS if kind not in REQUEST_KINDS)),
        description="the job lifecycle log: what services decide and agents report",
        max_age_s=7 * 86_400,
    ),
    StreamSpec(
        name="REQUESTS",
        # Apart from JOBS because JetStream's duplicate window is per stream: a message id a tenant
        # chose (any id: nats-server cannot restrict headers) would otherwise drop a service's
        # event carrying the same deterministic id, such as another tenant's ``<job>:completed:1``.
        subjects=REQUESTS_ALL,
        description="what clients ask of jobs: submissions (placement's work queue) and cancellations",
        max_age_s=7 * 86_400,
    ),
    StreamSpec(
        name="CLUSTERS",
        subjects=[
            f"{PREFIX}.clusters.*.heartbeat",
            f"{PREFIX}.clusters.*.cmd.*",
            f"{PREFIX}.clusters.*.status",
            f"{PREFIX}.clusters.*.profile",
        ],
        description="agent heartbeats, durable commands to agents, agent status",
        max_age_s=86_400,
    ),
    StreamSpec(
        name="VIEW",
        subjects=[f"{PREFIX}.view.delta.*", f"{PREFIX}.view.summary.*"],
        description="incremental ledger changes and per-region summaries",
        max_age_s=86_400,
    ),
    StreamSpec(
        name="NET",
        subjects=[PROBE_SAMPLES_ALL, LINK_STATES_ALL, NET_EVENTS_ALL, NET_TRANSFERS_ALL],
        description="raw probe samples (short-lived), link state and degraded/recovered events",
        max_age_s=3_600,
    ),
    StreamSpec(
        name="MIGRATIONS",
        subjects=[MIGRATIONS_ALL],
        description="migrations planned, started, completed, failed",
        max_age_s=7 * 86_400,
    ),
    StreamSpec(
        name="ALERTS",
        # Each incident change listed, not ``loom.incidents.*``: the request-reply subject
        # ``loom.incidents.ack`` must not be captured by the stream.
        subjects=[f"{PREFIX}.alerts.*", ALERTS_RAW_ALL, *INCIDENTS_ALL],
        description="raw alerts and the incidents correlated from them",
        max_age_s=7 * 86_400,
    ),
    StreamSpec(
        name="DLQ",
        subjects=[DEAD_LETTERS],
        description="poison messages with the error that stopped them, in headers",
        max_age_s=30 * 86_400,
    ),
)
