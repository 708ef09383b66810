"""PostgreSQL roles: one per service with the least privilege it needs, and tenant row-level security.

The tables belong to whoever migrates (the stack's superuser ``postgres``); no service owns a table
or is superuser. Each service logs in as its own role (:data:`SERVICE_ROLES`, :func:`role_of`)
holding exactly the privileges its SQL needs, table by table (:data:`GRANTS`: read off the SQL of
:mod:`loom.store` and the services; tables of parts not merged yet are skipped until they exist).

Tenant-owned tables (:data:`TENANT_TABLES`) have row-level security: a platform role sees every row
(a permissive ``USING (true)`` policy names them), while ``loom_tenant``, a NOLOGIN role without
BYPASSRLS, sees only the rows of the tenant named by the transaction's ``loom.tenant`` setting. A
service answering *for a tenant* (the console behind a tenant token, placement's ``loom.jobs.query``
with a tenant, usage queries) runs its queries in :func:`tenant_scope`, which switches the
transaction to ``loom_tenant`` (``SET LOCAL ROLE``) and sets ``loom.tenant``: whatever SQL runs
there, another tenant's rows are invisible, by the database's own rule.

:func:`ensure_roles` (run by :func:`loom.store.migrations.migrate` after the migrations, idempotent)
creates the roles (NOLOGIN, no password) and applies grants and policies; :func:`set_password`
lets a role log in with a password (sent as a SCRAM verifier), as ``loom up`` does for each
service it starts.
"""

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import asyncpg
import structlog

from loom.runtime.pgsecrets import scram_verifier

log = structlog.get_logger("loom.store.roles")

TENANT_ROLE = "loom_tenant"
"""The NOLOGIN role a tenant's queries run as (subject to RLS); the services that serve tenants
are its members so that they may ``SET ROLE`` to it."""

SERVICE_ROLES = {
    "placement": "loom_placement",
    "metrics": "loom_metrics",
    "network-perception": "loom_network",
    "console": "loom_console",
    "alert-correlator": "loom_alerts",
    "migration": "loom_migration",
}
"""The login role of each service that uses the database (placement's standbys and shards share
placement's)."""

_R = "SELECT"
_RW = "SELECT, INSERT, UPDATE"
_RWD = "SELECT, INSERT, UPDATE, DELETE"
_APPEND = "SELECT, INSERT"

GRANTS: dict[str, dict[str, str]] = {
    "loom_placement": {
        "jobs": _RW,
        "job_events": _APPEND,
        "decisions": _RW,
        "node_allocations": _RW,
        "reservations": _RW,
        "inbox": _APPEND,
        "outbox": _RW,
        "fences": _RW,
        "speed_observations": _APPEND,
        "ledger_clusters": _R,
        # The migration branch: checkpoints recorded by placement, drained clusters read.
        "checkpoints": _APPEND,
        "cluster_drains": _R,
        "migrations": _R,  # a job's moves, shown with it (loom.store.jobs.get_job)
        "checkpoint_replicas": _R,  # a failover resumes from a replica; shown with the job
        "migration_verdicts": _R,  # why it moved or not, shown with it (get_job, loom explain)
        "failed_clusters": _RWD,  # its failure classification, for the next leader
    },
    "loom_metrics": {
        "ledger_clusters": _RW,
        "ledger_nodes": _RWD,
        "cluster_profiles": _RW,
        "scu_decay": _RW,
        "reservations": _R,
        "inbox": _APPEND,
        "outbox": _RW,
        # Metering (its own branch): runs and usage rows written, jobs and their events read.
        "usage_runs": _RW,
        "usage_rows": _RWD,
        "jobs": _R,
        "job_events": _R,
    },
    "loom_network": {
        "net_link_records": _RW,
        "net_link_events": _APPEND,
    },
    "loom_console": {
        "jobs": _R,
        "job_events": _R,
        "decisions": _R,
        "migrations": _R,
        "checkpoint_replicas": _R,  # a job's replicas, shown with it (loom.store.jobs.get_job)
        "migration_verdicts": _R,  # a job's verdicts, on its page (loom.store.jobs.get_job)
        "cluster_drains": _R,  # drained clusters marked on the resources page
        "reservations": _R,  # the jobs a drain would move (its confirmation page)
        "incidents": _R,  # the incidents pages (a tenant's scoped by the console)
        "usage_rows": _R,  # the usage page (a tenant's own only)
    },
    "loom_alerts": {
        "incidents": _RW,
        "jobs": _R,
        "reservations": _R,
    },
    # The migration service (its own branch, loom.store.moves): its migrations and drains, the
    # checkpoints placement records, jobs and capacity read, events out through its outbox.
    "loom_migration": {
        "migrations": _RW,
        "migration_verdicts": _APPEND,  # every job a link review looked at, moved or not
        "checkpoints": _R,
        "cluster_drains": _RWD,
        "jobs": _R,
        "node_allocations": _R,
        "reservations": _R,
        "outbox": _RW,
        # Checkpoint replicas (migration 013): copies recorded and advanced; live clusters read.
        "checkpoint_replicas": _RW,
        "ledger_clusters": _R,
        # A drain's answer waits for every placement shard leading now: the shards are read here.
        "fences": _R,
    },
    TENANT_ROLE: {
        "jobs": _R,
        "job_events": _R,
        "decisions": _R,
        "migrations": _R,
        "checkpoint_replicas": _R,
        "migration_verdicts": _R,
        "usage_rows": _R,
        "usage_runs": _R,
    },
}
"""Role -> table -> privileges. Nothing else is granted: a role reads or writes no other table."""

TENANT_MEMBERS = ("loom_placement", "loom_console", "loom_metrics")
"""Services that answer for tenants, so may switch to :data:`TENANT_ROLE` in :func:`tenant_scope`."""

_OWN_TENANT = "current_setting('loom.tenant', true)"
_VIA_JOB = f"EXISTS (SELECT 1 FROM jobs j WHERE j.job_id = {{table}}.job_id AND j.tenant = {_OWN_TENANT})"

TENANT_TABLES: dict[str, str] = {
    "jobs": f"tenant = {_OWN_TENANT}",
    "job_events": _VIA_JOB.format(table="job_events"),
    "decisions": _VIA_JOB.format(table="decisions"),
    "usage_rows": f"tenant = {_OWN_TENANT}",
    "usage_runs": _VIA_JOB.format(table="usage_runs"),
    "migrations": f"tenant = {_OWN_TENANT}",
    "checkpoint_replicas": f"tenant = {_OWN_TENANT}",
    "migration_verdicts": _VIA_JOB.format(table="migration_verdicts"),
}
"""Tables under row-level security, with the condition a tenant's row meets (its own tenant)."""


def role_of(service: str) -> str | None:
    """The login role of a service process by its name (``placement-standby`` -> placement's), or
    None for a process that does not use the database (agents, probes)."""
    if service in SERVICE_ROLES:
        return SERVICE_ROLES[service]
    for prefix in ("placement", "migration"):
        if service.startswith(prefix + "-"):
            return SERVICE_ROLES[prefix]
    return None


def _ident(name: str) -> str:
    """``name`` quoted as an SQL identifier."""
    escaped = name.replace('"', '""')
    return f'"{escaped}"'


async def can_manage_roles(conn: asyncpg.Connection) -> bool:
    """Whether the connected user may create roles and grant on the tables (superuser, in practice)."""
    return bool(await conn.fetchval("SELECT rolsuper FROM pg_roles WHERE rolname = current_user"))


async def ensure_roles(conn: asyncpg.Connection) -> bool:
    """Create the roles, grant exactly :data:`GRANTS`, and put :data:`TENANT_TABLES` under RLS.

    Idempotent, and safe beside another database of the same server doing the same (roles are
    server-wide). Grants on a table are replaced, not added to. Returns False (changing nothing)
    when the connected user is not a superuser, e.g. an external database whose migrator only
    owns the schema.
    """
    if not await can_manage_roles(conn):
        log.warning("not a superuser: database roles and row-level security left as they are")
        return False
    platform = [role for role in GRANTS if role != TENANT_ROLE]
    for role in GRANTS:
        await conn.execute(
            f"""DO $$ BEGIN
                    CREATE ROLE {_ident(role)} NOLOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOBYPASSRLS;
                EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL;
                END $$"""
        )
    for member in TENANT_MEMBERS:
        # SET only, no INHERIT: the member may switch to the tenant role (in tenant_scope) but holds
        # none of its privileges, nor falls under its policies, as itself.
        await conn.execute(f"GRANT {_ident(TENANT_ROLE)} TO {_ident(member)} WITH INHERIT FALSE, SET TRUE")
    existing = {
        r["tablename"]
        for r in await conn.fetch("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
    }
    everyone = ", ".join(_ident(r) for r in GRANTS)
    database = await conn.fetchval("SELECT current_database()")
    async with conn.transaction():
        await conn.execute(f"REVOKE ALL ON DATABASE {_ident(database)} FROM PUBLIC")
        await conn.execute(f"GRANT CONNECT ON DATABASE {_ident(database)} TO {everyone}")
        await conn.execute(f"GRANT USAGE ON SCHEMA public TO {everyone}")
        for table in sorted(existing):
            await conn.execute(f"REVOKE ALL ON TABLE {_ident(table)} FROM PUBLIC, {everyone}")
        for role, tables in GRANTS.items():
            for table, privileges in tables.items():
                if table in existing:
                    await conn.execute(f"GRANT {privileges} ON TABLE {_ident(table)} TO {_ident(role)}")
        # bigserial columns: inserting draws from their sequence.
        await conn.execute(f"REVOKE ALL ON ALL SEQUENCES IN SCHEMA public FROM {everyone}")
        for row in await conn.fetch(
            """SELECT s.relname AS seq, t.relname AS tab FROM pg_class s
               JOIN pg_depend d ON d.objid = s.oid AND d.deptype = 'a'
               JOIN pg_class t ON t.oid = d.refobjid
               WHERE s.relkind = 'S'"""
        ):
            for role, tables in GRANTS.items():
                if "INSERT" in tables.get(row["tab"], ""):
                    await conn.execute(f"GRANT USAGE ON SEQUENCE {_ident(row['seq'])} TO {_ident(role)}")
        for table, condition in TENANT_TABLES.items():
            if table not in existing:
                continue
            await conn.execute(f"ALTER TABLE {_ident(table)} ENABLE ROW LEVEL SECURITY")
            await conn.execute(f"DROP POLICY IF EXISTS loom_platform ON {_ident(table)}")
            await conn.execute(
                f"CREATE POLICY loom_platform ON {_ident(table)} FOR ALL "
                f"TO {', '.join(_ident(r) for r in platform)} USING (true) WITH CHECK (true)"
            )
            await conn.execute(f"DROP POLICY IF EXISTS loom_own_tenant ON {_ident(table)}")
            await conn.execute(
                f"CREATE POLICY loom_own_tenant ON {_ident(table)} FOR SELECT "
                f"TO {_ident(TENANT_ROLE)} USING ({condition})"
            )
    return True


async def set_password(conn: asyncpg.Connection, role: str, password: str) -> None:
    """Let ``role`` log in with ``password``; the server gets only its SCRAM verifier."""
    if role not in GRANTS or role == TENANT_ROLE:
        raise ValueError(f"{role!r} is not a Loom service role")
    await conn.execute(f"ALTER ROLE {_ident(role)} LOGIN PASSWORD '{scram_verifier(password)}'")


@asynccontextmanager
async def tenant_scope(
    pool: asyncpg.Pool | asyncpg.Connection, tenant: str
) -> AsyncIterator[asyncpg.Connection]:
    """A connection in a transaction that sees only ``tenant``'s rows of :data:`TENANT_TABLES`.

    The transaction runs as :data:`TENANT_ROLE` (``SET LOCAL ROLE``, undone when it ends) with
    ``loom.tenant`` set to ``tenant``: row-level security then filters every query on a
    tenant-owned table, whatever its ``WHERE`` says, and the role may only read. The connecting
    role must be a member of :data:`TENANT_ROLE` (a superuser always is).
    """
    if not isinstance(pool, asyncpg.Pool):
        async with pool.transaction():
            await _enter_tenant(pool, tenant)
            yield pool
        return
    async with pool.acquire() as conn, conn.transaction():
        await _enter_tenant(conn, tenant)
        yield conn


async def _enter_tenant(conn: asyncpg.Connection, tenant: str) -> None:
    # One round trip (a parameterless execute may hold two statements); the tenant is quoted as an
    # SQL literal (standard_conforming_strings: doubling the quotes is the whole escaping).
    if "\0" in tenant:
        raise ValueError("a tenant id cannot hold a NUL character")
    literal = "'" + tenant.replace("'", "''") + "'"
    await conn.execute(f"SET LOCAL ROLE {_ident(TENANT_ROLE)}; SET LOCAL loom.tenant = {literal}")
