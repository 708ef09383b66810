"""Ordered SQL migrations with a version table; safe when several services start at once."""

from dataclasses import dataclass
from importlib import resources

import asyncpg

from loom.store.roles import ensure_roles

# Any constant works; it only has to be the same in every process that migrates.
_MIGRATION_LOCK_KEY = 0x10_0A_11


@dataclass(frozen=True)
class Migration:
    """One SQL file: ``NNN_name.sql`` applied in ascending ``version``."""

    version: int
    name: str
    sql: str


def available() -> list[Migration]:
    """Every migration shipped in ``loom.store/migrations``, in order; refuses repeats.

    Numbers are handed out per piece of work, so a branch may hold 009 before 008 lands: a gap is
    allowed (each pending number is applied in ascending order), a repeat never is.
    """
    found: list[Migration] = []
    for entry in resources.files("loom.store").joinpath("migrations").iterdir():
        if not entry.name.endswith(".sql"):
            continue
        number, _, rest = entry.name.partition("_")
        found.append(Migration(int(number), rest.removesuffix(".sql"), entry.read_text()))
    found.sort(key=lambda m: m.version)
    versions = [m.version for m in found]
    if len(set(versions)) != len(versions) or (versions and versions[0] < 1):
        raise RuntimeError(f"migrations must be numbered from 1 without repeats, found {versions}")
    return found


async def migrate(conn: asyncpg.Connection) -> list[int]:
    """Apply every pending migration, each in its own transaction; return the versions applied.

    Then, as a superuser, (re)apply the service roles' grants and the tenant row-level security
    (:func:`loom.store.roles.ensure_roles`), so they cover every table that exists now.
    """
    applied_now: list[int] = []
    await conn.execute("SELECT pg_advisory_lock($1)", _MIGRATION_LOCK_KEY)
    try:
        await conn.execute(
            """CREATE TABLE IF NOT EXISTS schema_migrations (
                   version integer PRIMARY KEY,
                   name text NOT NULL,
                   applied_at timestamptz NOT NULL DEFAULT now())"""
        )
        done = {r["version"] for r in await conn.fetch("SELECT version FROM schema_migrations")}
        for migration in available():
            if migration.version in done:
                continue
            async with conn.transaction():
                await conn.execute(migration.sql)
                await conn.execute(
                    "INSERT INTO schema_migrations (version, name) VALUES ($1, $2)",
                    migration.version,
                    migration.name,
                )
            applied_now.append(migration.version)
        # Roles, grants and row-level security follow the tables, including ones just created.
        await ensure_roles(conn)
    finally:
        await conn.execute("SELECT pg_advisory_unlock($1)", _MIGRATION_LOCK_KEY)
    return applied_now


async def migrate_url(url: str) -> list[int]:
    """Connect, migrate, disconnect."""
    conn = await asyncpg.connect(url)
    try:
        return await migrate(conn)
    finally:
        await conn.close()
