"""The stack's database credentials: a password per service role, given at ``loom up`` and rotated.

Every password is written to its own 0600 password file under ``<home>/secrets/`` and sent to the
server only as a SCRAM verifier (:mod:`loom.runtime.pgsecrets`). Rotation keeps the file names, so
a running service's URL (``?passfile=``) stays valid: its next connection reads the new password,
and the connections it holds stay open.
"""

from pathlib import Path

import asyncpg

from loom.runtime.pgsecrets import generate_password, pgpass_password, role_url, scram_verifier, write_pgpass
from loom.store.roles import SERVICE_ROLES, set_password

__all__ = ["apply_role_passwords", "provision_roles", "rotate_passwords", "service_role_passfile"]

ADMIN_ROLE = "postgres"


def service_role_passfile(secrets_dir: Path, role: str) -> Path:
    """Where ``role``'s password file lives."""
    return secrets_dir / f"{role}.pgpass"


async def provision_roles(admin_url: str, secrets_dir: Path, port: int, database: str) -> dict[str, str]:
    """Give every service role a fresh password (0600 file each); returns each role's URL.

    Runs at every start of the stack, so a ``loom up`` also rotates the services' passwords. A
    role's URL names its own password file, never the password.
    """
    urls: dict[str, str] = {}
    conn = await asyncpg.connect(admin_url)
    try:
        for role in sorted(set(SERVICE_ROLES.values())):
            password = generate_password()
            passfile = service_role_passfile(secrets_dir, role)
            write_pgpass(passfile, role, password)
            await set_password(conn, role, password)
            urls[role] = role_url(role, port, database, passfile)
    finally:
        await conn.close()
    return urls


async def rotate_passwords(admin_url: str, secrets_dir: Path) -> list[str]:
    """New passwords for every service role and for the superuser; returns the roles rotated.

    For each role the new password goes to a side file first, then to the server, then replaces
    the role's file: a failure in between leaves the old file, which still matches the server's
    old verifier, or the new one written beside it (``.new``), never a password lost.
    """
    rotated: list[str] = []
    conn = await asyncpg.connect(admin_url)
    try:
        roles = sorted({*SERVICE_ROLES.values()})
        for role in [*roles, ADMIN_ROLE]:
            final = service_role_passfile(secrets_dir, role)
            if role != ADMIN_ROLE and not final.exists():
                continue  # never provisioned here
            password = generate_password()
            side = final.with_name(final.name + ".new")
            write_pgpass(side, role, password)
            if role == ADMIN_ROLE:
                await conn.execute(f"ALTER ROLE {ADMIN_ROLE} PASSWORD '{scram_verifier(password)}'")
            else:
                await set_password(conn, role, password)
            side.replace(final)
            assert pgpass_password(final) == password
            rotated.append(role)
    finally:
        await conn.close()
    return rotated


async def apply_role_passwords(admin_url: str, directory: Path) -> list[str]:
    """Let every service role with a password file ``<directory>/<role>.pgpass`` log in with that
    password (its SCRAM verifier only); returns the roles given one.

    docker-compose's ``migrate`` runs it (``loom migrate --role-passwords``) with the files
    ``loom credentials init --compose`` generated, after the migrations created the roles."""
    given: list[str] = []
    conn = await asyncpg.connect(admin_url)
    try:
        for role in sorted(set(SERVICE_ROLES.values())):
            password = pgpass_password(service_role_passfile(directory, role))
            if password is None:
                continue
            await set_password(conn, role, password)
            given.append(role)
    finally:
        await conn.close()
    return given
