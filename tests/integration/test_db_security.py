"""PostgreSQL trust boundaries (issue 18, item 3): passwords, least-privilege roles, tenant RLS.

On a real PostgreSQL started with ``auth=True`` (SCRAM, no trust line), migrated, and with the
service roles given passwords the way ``loom up --secure-db`` does it.
"""

import argparse
import asyncio
import json
import os
import stat
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

import asyncpg
import pytest
from waiting import until

from loom.cli.credentials import cmd_rotate
from loom.migrate.benefit import LOCAL_PATH
from loom.migrate.replicas import CopyPlan
from loom.runtime import dbcreds
from loom.runtime.pgsecrets import pgpass_password
from loom.runtime.servers import PostgresServer
from loom.store import jobs as jobs_repo
from loom.store import moves, outbox, usage
from loom.store import replicas as replica_store
from loom.store.migrations import migrate_url
from loom.store.roles import GRANTS, SERVICE_ROLES, TENANT_ROLE, TENANT_TABLES, role_of, tenant_scope

pytestmark = pytest.mark.security

_PRIVILEGES = ("SELECT", "INSERT", "UPDATE", "DELETE")
_LOOM = str(Path(sys.executable).parent / "loom")


@pytest.fixture(scope="module")
def secured(postgres_dir_factory: Callable[[str], Path]) -> Iterator[PostgresServer]:
    """A PostgreSQL with auth on, its ``loom`` database migrated."""
    with PostgresServer(postgres_dir_factory("pg-auth"), durable=False, auth=True) as server:
        yield server


@pytest.fixture(scope="module")
async def role_urls(secured: PostgresServer) -> dict[str, str]:
    """Every service role's URL after ``loom up``'s steps: migrate, then a password per role."""
    await migrate_url(secured.url)
    return await dbcreds.provision_roles(secured.url, secured.secrets_dir, secured.port, secured.database)


@pytest.fixture
async def admin(secured: PostgresServer, role_urls: dict[str, str]) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(secured.url)
    yield conn
    await conn.close()


async def test_password_less_and_wrong_password_connections_are_refused(
    secured: PostgresServer, role_urls: dict[str, str], tmp_path: Path
) -> None:
    no_passwords = tmp_path / "empty.pgpass"  # so that no ~/.pgpass can help
    no_passwords.touch(mode=0o600)
    base = f"127.0.0.1:{secured.port}/{secured.database}"
    for url in (
        f"postgresql://postgres@{base}",  # no password, TCP
        f"postgresql://postgres:not-the-password@{base}",
        f"postgresql://loom_placement@{base}",
        f"postgresql://loom_placement:not-the-password@{base}",
        f"postgresql://loom_tenant@{base}",  # NOLOGIN
    ):
        with pytest.raises(asyncpg.InvalidAuthorizationSpecificationError):
            await asyncpg.connect(url, passfile=str(no_passwords))
    # The Unix socket trusts no one either.
    socket_url = f"postgresql://postgres@/{secured.database}?host={secured.socket_dir}&port={secured.port}"
    with pytest.raises(asyncpg.InvalidAuthorizationSpecificationError):
        await asyncpg.connect(socket_url, passfile=str(no_passwords))
    # With the password files: in.
    for url in [secured.url, *role_urls.values()]:
        conn = await asyncpg.connect(url)
        await conn.close()
    hba = (secured.pgdata / "pg_hba.conf").read_text()
    assert "trust" not in [line.split()[-1] for line in hba.splitlines() if line and line[0] != "#"]


def test_secrets_are_owner_only_files_and_urls_carry_no_password(
    secured: PostgresServer, role_urls: dict[str, str]
) -> None:
    files = sorted(secured.secrets_dir.iterdir())
    assert [f.name for f in files] == sorted(["postgres.pgpass", *(f"{r}.pgpass" for r in role_urls)])
    assert stat.S_IMODE(secured.secrets_dir.stat().st_mode) == 0o700
    for path in files:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        password = path.read_text().strip().split(":")[-1]
        assert len(password) >= 32
        for url in [secured.url, *role_urls.values()]:
            assert password not in url
        assert password not in secured.log_path.read_text()


async def test_no_service_role_is_superuser_bypasses_rls_or_owns_a_table(
    admin: asyncpg.Connection,
) -> None:
    roles = sorted(GRANTS)
    rows = await admin.fetch(
        """SELECT rolname, rolsuper, rolbypassrls, rolcreaterole, rolcreatedb, rolcanlogin
           FROM pg_roles WHERE rolname = ANY($1::text[]) ORDER BY rolname""",
        roles,
    )
    assert [r["rolname"] for r in rows] == roles
    for r in rows:
        assert not (r["rolsuper"] or r["rolbypassrls"] or r["rolcreaterole"] or r["rolcreatedb"]), r
        assert r["rolcanlogin"] == (r["rolname"] != TENANT_ROLE)
    owners = {
        r["tableowner"]
        for r in await admin.fetch("SELECT tableowner FROM pg_tables WHERE schemaname = 'public'")
    }
    assert owners == {"postgres"}


async def test_each_role_holds_exactly_its_grants(admin: asyncpg.Connection) -> None:
    tables = [
        r["t"] for r in await admin.fetch("SELECT tablename AS t FROM pg_tables WHERE schemaname = 'public'")
    ]
    assert {"jobs", "job_events", "usage_rows", "incidents"} <= set(tables)
    for role, grants in GRANTS.items():
        for table in tables:
            wanted = {p.strip() for p in grants.get(table, "").split(",") if p.strip()}
            held = {
                p
                for p in _PRIVILEGES
                if await admin.fetchval("SELECT has_table_privilege($1, $2, $3)", role, table, p)
            }
            assert held == wanted, (role, table)


async def test_a_role_cannot_touch_tables_outside_its_grant(role_urls: dict[str, str]) -> None:
    metrics = await asyncpg.connect(role_urls["loom_metrics"])
    console = await asyncpg.connect(role_urls["loom_console"])
    network = await asyncpg.connect(role_urls["loom_network"])
    try:
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await metrics.execute("UPDATE jobs SET state = 'failed'")
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await metrics.fetch("SELECT * FROM incidents")
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await console.execute("DELETE FROM jobs")
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await console.fetch("SELECT * FROM outbox")
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await network.fetch("SELECT * FROM jobs")
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await network.execute("CREATE TABLE sneaky (x int)")
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await metrics.execute("ALTER TABLE jobs DISABLE ROW LEVEL SECURITY")
    finally:
        for conn in (metrics, console, network):
            await conn.close()


async def _seed(admin: asyncpg.Connection) -> None:
    now = datetime.now(UTC)
    for tenant in ("acme", "globex"):
        for n in range(3):
            job_id = f"sec-{tenant}-{n}"
            await admin.execute(
                """INSERT INTO jobs (job_id, tenant, state, spec, submitted_at)
                   VALUES ($1, $2, 'queued', '{}', $3) ON CONFLICT DO NOTHING""",
                job_id,
                tenant,
                now,
            )
            await admin.execute(
                """INSERT INTO job_events (job_id, kind, msg_id, event) VALUES ($1, 'submitted', $2, '{}')
                   ON CONFLICT DO NOTHING""",
                job_id,
                f"{job_id}-submitted",
            )
            await admin.execute(
                """INSERT INTO decisions (job_id, attempt, outcome, record) VALUES ($1, 1, 'placed', '{}')
                   ON CONFLICT DO NOTHING""",
                job_id,
            )
            if n == 0 and not await admin.fetchval(
                "SELECT 1 FROM migration_verdicts WHERE job_id = $1", job_id
            ):
                await admin.execute(
                    """INSERT INTO migration_verdicts (job_id, attempt, trigger, decision, source, gain_s)
                       VALUES ($1, 1, 'cluster_joined', 'stay', 'c', 12.0)""",
                    job_id,
                )
            await admin.execute(
                """INSERT INTO usage_rows (job_id, attempt, seq, tenant, cluster, region, gpu_model, start_ms,
                       end_ms, gpus, scu_per_gpu, price_per_scu_hour, outcome)
                   VALUES ($1, 1, 0, $2, 'c', 'r', 'A100', 0, 1000, 1, 1.0, 1.0, 'completed')
                   ON CONFLICT DO NOTHING""",
                job_id,
                tenant,
            )
            await admin.execute(
                """INSERT INTO usage_runs (job_id, attempt, record) VALUES ($1, 1, '{}')
                   ON CONFLICT DO NOTHING""",
                job_id,
            )


async def test_under_rls_a_tenant_sees_only_its_rows(
    admin: asyncpg.Connection, role_urls: dict[str, str]
) -> None:
    await _seed(admin)
    assert set(TENANT_TABLES) == {
        "jobs",
        "job_events",
        "decisions",
        "usage_rows",
        "usage_runs",
        "migrations",
        "checkpoint_replicas",
        "migration_verdicts",
    }
    pool = await asyncpg.create_pool(role_urls["loom_console"], min_size=1, max_size=2)
    assert pool is not None
    try:
        # The service itself (platform role) sees both tenants.
        assert {r["tenant"] for r in await pool.fetch("SELECT tenant FROM jobs")} >= {"acme", "globex"}
        async with tenant_scope(pool, "acme") as conn:
            assert await conn.fetchval("SELECT current_user") == TENANT_ROLE
            # No WHERE at all: row-level security alone filters.
            assert {r["tenant"] for r in await conn.fetch("SELECT tenant FROM jobs")} == {"acme"}
            events = await conn.fetch("SELECT job_id FROM job_events WHERE job_id LIKE 'sec-%'")
            assert sorted(r["job_id"] for r in events) == [f"sec-acme-{n}" for n in range(3)]
            assert {r["job_id"] for r in await conn.fetch("SELECT job_id FROM decisions")} <= {
                f"sec-acme-{n}" for n in range(3)
            }
            assert await conn.fetchval("SELECT count(*) FROM jobs WHERE tenant = 'globex'") == 0
            # What `loom job ID` shows (job, events, moves): a job of another tenant is not there.
            mine = await jobs_repo.get_job(conn, "sec-acme-0")
            assert mine is not None and mine["tenant"] == "acme"
            # ... nor its migration verdicts (`loom explain`): its own are, with their numbers.
            assert [v["gain_s"] for v in mine["verdicts"]] == [12.0]
            seen = await conn.fetch("SELECT job_id FROM migration_verdicts WHERE job_id LIKE 'sec-%'")
            assert {r["job_id"] for r in seen} == {"sec-acme-0"}
            assert await jobs_repo.get_job(conn, "sec-globex-0") is None
            assert {r["tenant"] for r in await conn.fetch("SELECT tenant FROM usage_rows")} == {"acme"}
            assert await conn.fetchval("SELECT count(*) FROM usage_runs WHERE job_id LIKE 'sec-globex%'") == 0
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await conn.execute("UPDATE jobs SET state = 'cancelled'")
        # A tenant id is data, never SQL.
        async with tenant_scope(pool, "x'; RESET ROLE; --") as conn:
            assert await conn.fetchval("SELECT current_user") == TENANT_ROLE
            assert await conn.fetchval("SELECT current_setting('loom.tenant')") == "x'; RESET ROLE; --"
            assert await conn.fetchval("SELECT count(*) FROM jobs") == 0
        # The scope ends with its transaction: the connection is the service's again.
        assert await pool.fetchval("SELECT current_user") == "loom_console"
        # No tenant named: nothing at all.
        async with pool.acquire() as raw, raw.transaction():
            await raw.execute(f"SET LOCAL ROLE {TENANT_ROLE}")
            assert await raw.fetchval("SELECT count(*) FROM jobs") == 0
        # loom usage --tenant's read goes through the same scope.
        rows = await usage.read_tenant_rows(pool, "globex")
        assert rows and {r.tenant for r in rows} == {"globex"}
    finally:
        await pool.close()


async def test_a_role_outside_the_tenant_group_cannot_take_a_tenant_scope(role_urls: dict[str, str]) -> None:
    conn = await asyncpg.connect(role_urls["loom_network"])
    try:
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            async with tenant_scope(conn, "acme"):
                pass
    finally:
        await conn.close()


def test_service_role_of_each_process() -> None:
    assert role_of("placement-standby") == SERVICE_ROLES["placement"]
    assert role_of("placement-g1-standby") == SERVICE_ROLES["placement"]
    assert role_of("agent-c-weu-a") is None
    assert role_of("probe-aws-us-east-2") is None


@pytest.mark.slow  # `loom up --servers-only` as the user runs it
def test_loom_up_secure_db_keeps_passwords_out_of_state_and_logs(
    postgres_dir_factory: Callable[[str], Path],
) -> None:
    home = postgres_dir_factory("secure-home")
    env = {k: v for k, v in os.environ.items() if k not in ("LOOM_NATS_URL", "LOOM_DATABASE_URL")}
    env["LOOM_HOME"] = str(home)
    up = subprocess.run(
        [_LOOM, "up", "--servers-only", "--secure-db"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        status = subprocess.run(
            [_LOOM, "status", "--json"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        state = json.loads((home / "stack.json").read_text())
        passwords = [p.read_text().strip().split(":")[-1] for p in (home / "secrets").glob("*.pgpass")]
        assert len(passwords) == 1 + len(set(SERVICE_ROLES.values()))
        shown = up.stdout + up.stderr + status.stdout + status.stderr + json.dumps(state)
        shown += "".join(p.read_text(errors="replace") for p in home.rglob("*.log"))
        for password in passwords:
            assert password not in shown
        assert "passfile=" in state["database_url"]
    finally:
        subprocess.run([_LOOM, "down"], env=env, capture_output=True, timeout=60, check=False)


async def test_rotation_replaces_every_password_and_the_urls_keep_working(
    secured: PostgresServer, role_urls: dict[str, str]
) -> None:
    files = {
        role: dbcreds.service_role_passfile(secured.secrets_dir, role) for role in [*role_urls, "postgres"]
    }
    old = {role: pgpass_password(path) for role, path in files.items()}
    held = await asyncpg.connect(role_urls["loom_placement"])  # open across the rotation
    try:
        rotated = await dbcreds.rotate_passwords(secured.url, secured.secrets_dir)
        assert sorted(rotated) == sorted(files)
        for role, path in files.items():
            assert stat.S_IMODE(path.stat().st_mode) == 0o600
            new = pgpass_password(path)
            assert new is not None and new != old[role]
            with pytest.raises(asyncpg.InvalidPasswordError):
                await asyncpg.connect(
                    f"postgresql://{role}@127.0.0.1:{secured.port}/{secured.database}", password=old[role]
                )
        for url in [secured.url, *role_urls.values()]:  # same files, new passwords
            conn = await asyncpg.connect(url)
            await conn.close()
        assert await held.fetchval("SELECT 1") == 1
        assert not list(secured.secrets_dir.glob("*.new"))
    finally:
        await held.close()


async def test_loom_credentials_rotate_rotates_the_stacks_postgres_passwords(
    secured: PostgresServer, role_urls: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``loom credentials rotate`` on a stack whose PostgreSQL is secured (and NATS is not)."""
    home = secured.secrets_dir.parent  # the stack keeps its password files in <home>/secrets
    (home / "stack.json").write_text(json.dumps({"database_url": secured.url}))
    monkeypatch.setenv("LOOM_HOME", str(home))
    files = {
        role: dbcreds.service_role_passfile(secured.secrets_dir, role) for role in [*role_urls, "postgres"]
    }
    old = {role: pgpass_password(path) for role, path in files.items()}
    held = await asyncpg.connect(role_urls["loom_placement"])  # a service's open connection
    try:
        assert await asyncio.to_thread(cmd_rotate, argparse.Namespace()) == 0
        for role, path in files.items():
            assert pgpass_password(path) != old[role], role
            with pytest.raises(asyncpg.InvalidPasswordError):
                await asyncpg.connect(
                    f"postgresql://{role}@127.0.0.1:{secured.port}/{secured.database}", password=old[role]
                )
        for url in role_urls.values():  # a service's next connection: same URL, the new password
            conn = await asyncpg.connect(url)
            await conn.close()
        assert await held.fetchval("SELECT 1") == 1
    finally:
        await held.close()


async def test_a_trust_cluster_is_converted_and_a_lost_password_file_replaced(
    postgres_dir_factory: Callable[[str], Path], tmp_path: Path
) -> None:
    no_passwords = tmp_path / "empty.pgpass"
    no_passwords.touch(mode=0o600)
    data_dir = postgres_dir_factory("pg-convert")
    with PostgresServer(data_dir, durable=False) as trusting:  # as `loom up` made it before
        port = trusting.port
        conn = await asyncpg.connect(trusting.url, passfile=str(no_passwords))
        await conn.close()
    for _ in range(2):
        with PostgresServer(data_dir, port, durable=False, auth=True) as server:
            conn = await asyncpg.connect(server.url)
            await conn.close()
            with pytest.raises(asyncpg.InvalidAuthorizationSpecificationError):
                await asyncpg.connect(
                    f"postgresql://postgres@127.0.0.1:{port}/loom", passfile=str(no_passwords)
                )
        server.admin_passfile.unlink()  # lost: the next start gives the superuser a new one


async def test_the_migration_role_can_do_its_work_and_no_more(role_urls: dict[str, str]) -> None:
    """Every statement of loom.store.moves the migration service runs, as its own role."""
    conn = await asyncpg.connect(role_urls["loom_migration"])
    try:
        async with conn.transaction():
            await moves.start_drain(conn, "c-sec", concurrency=1, deadline_s=60.0, forced=False)
            await moves.mark_drained(conn, "c-sec")
            assert await moves.hold_drain(conn, "c-sec")
            assert "c-sec" in await moves.drained_clusters(conn)
            assert [d["cluster"] for d in await moves.drains(conn)] == ["c-sec"]
            assert await moves.end_drain(conn, "c-sec")
            assert not await moves.hold_drain(conn, "c-sec")
            await moves.known_clusters(conn)
            await moves.runs_on(conn, "c-sec")
            assert await moves.job_states(conn, ["sec-acme-0"]) == {"sec-acme-0": ("queued", 0)}
            await moves.checkpoints_of(conn, ["sec-acme-0"])
            assert await moves.plan(
                conn,
                migration_id="sec-m1",
                job_id="sec-acme-0",
                tenant="acme",
                cause="drain",
                state="planned",
                from_cluster="c-sec",
                from_attempt=1,
                steps=10,
                why="test",
                trace_context={},
            )
            await moves.mark_started(conn, "sec-m1", resume_step=0, lost_steps=0, why="test")
            await moves.fail(conn, "sec-m1", "test")
            assert await moves.moves_of_run(conn, "sec-acme-0", 1) == {"sec-m1": "failed"}
            assert [m["migration_id"] for m in await moves.list_migrations(conn, job_id="sec-acme-0")] == [
                "sec-m1"
            ]
            await moves.open_migrations(conn)
            # Checkpoint replicas (migration 013): the copy loop's reads and writes.
            await replica_store.latest_checkpoints(conn)
            await replica_store.live_sites(conn)
            await replica_store.held(conn)
            await replica_store.copying(conn)
            latest = replica_store.Latest("sec-acme-0", "acme", 1, 10, "c-sec", "sim://c-sec/x", 0, "", {})
            plan = CopyPlan(
                job_id="sec-acme-0",
                attempt=1,
                step=10,
                source="c-sec",
                target="c-sec-2",
                full=True,
                base_step=None,
                transfer_bytes=1e9,
                stored_bytes=1e9,
                path=LOCAL_PATH,
                transfer_s=0.1,
                evict=(),
                why="test",
            )
            assert await replica_store.start_copy(conn, plan, latest, "replica://c-sec-2/x")
            assert await replica_store.finish_copy(conn, "sec-acme-0", 1, 10, "c-sec-2", ok=True)
            assert [r["step"] for r in await replica_store.list_replicas(conn, job_id="sec-acme-0")] == [10]
            assert await replica_store.ready_replicas(conn, ["sec-acme-0"])
            await outbox.add(
                conn, "migration", [outbox.OutboxMessage("sec-out-1", "loom.test.sec", b"{}", {})]
            )
            raise _Rollback
    except _Rollback:
        pass
    try:
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await conn.execute("UPDATE jobs SET state = 'failed' WHERE job_id = 'sec-acme-0'")
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await conn.execute("DELETE FROM checkpoints")
    finally:
        await conn.close()


class _Rollback(Exception):
    """Leaves the transaction without keeping what the test wrote."""


async def test_an_undrain_waits_for_a_move_being_planned_under_the_drain(role_urls: dict[str, str]) -> None:
    """A drain pass planning a move holds the drain row (``hold_drain``): an undrain's delete waits
    until that plan commits (then fails it with the drain's other planned moves); a plan after the
    undrain finds no drain and plans nothing."""
    planner = await asyncpg.connect(role_urls["loom_migration"])
    undrain = await asyncpg.connect(role_urls["loom_migration"])
    try:
        await moves.start_drain(planner, "c-hold", concurrency=1, deadline_s=0.0, forced=False)
        pid = undrain.get_server_pid()
        tx = planner.transaction()
        await tx.start()
        assert await moves.hold_drain(planner, "c-hold")
        ending = asyncio.ensure_future(moves.end_drain(undrain, "c-hold"))

        async def waits_on_the_lock() -> bool:
            event = await planner.fetchval("SELECT wait_event_type FROM pg_stat_activity WHERE pid = $1", pid)
            return event == "Lock"

        await until(waits_on_the_lock, 10, "the undrain waiting for the planning transaction")
        assert not ending.done()
        await tx.commit()
        assert await ending  # the drain row is gone once the plan committed
        async with planner.transaction():
            assert not await moves.hold_drain(planner, "c-hold")
    finally:
        await planner.close()
        await undrain.close()
