"""docker-compose's PostgreSQL half, run without Docker on a PostgreSQL built with SSL (issue 18).

The embedded PostgreSQL has no SSL, so the unit tests can only show ``sslmode=verify-full`` against
stand-in servers. This runs the real thing with a system PostgreSQL (Debian's, ``/usr/lib/
postgresql/<v>/bin``): the secrets ``init`` writes (:func:`loom.security.compose.init_compose`), the
server started with the ``-c`` settings and ``pg_hba.conf`` of ``docker-compose.yml``'s postgres
command, ``loom migrate --role-passwords`` over ``migrate``'s URL, then each service's URL from
the compose file (paths and host mapped to this machine). Prints one JSON object; exit 1 if any
check fails. Run as root (the server runs as the ``postgres`` system user)::

    .venv/bin/python tools/compose_postgres_check.py [--bin /usr/lib/postgresql/15/bin]
"""

import argparse
import asyncio
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

import asyncpg
import yaml

from loom.runtime.dbcreds import apply_role_passwords
from loom.runtime.servers import find_free_port
from loom.security.compose import MOUNT, init_compose
from loom.security.tls import ensure_tls
from loom.store.roles import SERVICE_ROLES

ROOT = Path(__file__).resolve().parents[1]
SERVER_DIR = "/var/lib/postgresql/loom"
"""Where compose's postgres command copies its TLS files and pg_hba.conf."""


def _compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return data


def _server_settings(services: dict[str, Any]) -> list[tuple[str, str]]:
    script = services["postgres"]["command"][-1]
    words = script.split("exec ", 1)[1].split()
    assert words[:2] == ["docker-entrypoint.sh", "postgres"]
    rest = words[2:]
    return [tuple(rest[i + 1].split("=", 1)) for i in range(0, len(rest), 2) if rest[i] == "-c"]  # type: ignore[misc]


def _url(compose_url: str, port: int, mount: Path) -> str:
    url = compose_url.replace("@postgres:5432/", f"@127.0.0.1:{port}/")
    return url.replace(MOUNT, quote(str(mount), safe="/"))


async def _try(url: str) -> dict[str, Any]:
    try:
        conn = await asyncpg.connect(url, timeout=10)
    except Exception as exc:  # a refusal is a result here
        return {"connected": False, "error": f"{type(exc).__name__}: {exc}"[:200]}
    try:
        row = await conn.fetchrow(
            "SELECT current_user AS user, s.ssl, s.version FROM pg_stat_ssl s WHERE s.pid = pg_backend_pid()"
        )
        jobs = None
        try:
            jobs = await conn.fetchval("SELECT count(*) FROM jobs")
        except asyncpg.PostgresError as exc:
            jobs = f"{type(exc).__name__}"
        return {
            "connected": True,
            "user": row["user"],
            "ssl": row["ssl"],
            "tls": row["version"],
            "jobs": jobs,
        }
    finally:
        await conn.close()


async def _server_version(url: str) -> int:
    conn = await asyncpg.connect(url)
    try:
        return int(await conn.fetchval("SHOW server_version_num"))
    finally:
        await conn.close()


async def _bare_roles(admin: str, roles_dir: Path) -> list[str]:
    conn = await asyncpg.connect(admin)
    try:
        for role in sorted(set(SERVICE_ROLES.values())):
            if not await conn.fetchval("SELECT 1 FROM pg_roles WHERE rolname = $1", role):
                await conn.execute(f'CREATE ROLE "{role}" NOLOGIN')  # migrate may have made it
            await conn.execute(f'GRANT CONNECT ON DATABASE loom TO "{role}"')
    finally:
        await conn.close()
    return await apply_role_passwords(admin, roles_dir)


def main() -> int:  # noqa: PLR0915 - one script, top to bottom
    parser = argparse.ArgumentParser()
    parser.add_argument("--bin", type=Path, default=next(Path("/usr/lib/postgresql").glob("*/bin"), None))
    args = parser.parse_args()
    services = _compose()["services"]
    running = [n for n, s in services.items() if "build" in s and n not in ("init", "migrate")]
    tmp = Path(tempfile.mkdtemp(prefix="loom-compose-pg-"))
    os.chmod(tmp, 0o755)
    user = pwd.getpwnam("postgres")
    server: subprocess.Popen[bytes] | None = None
    out: dict[str, Any] = {"postgres": str(args.bin)}
    ok = True
    try:
        secrets = tmp / "secrets"
        init_compose(secrets, running)
        # What compose's postgres command does: copy its files, owned by postgres, 0600.
        server_dir = tmp / "server"
        server_dir.mkdir(mode=0o700)
        for name in ("server.pem", "server-key.pem", "pg_hba.conf", "superuser-password"):
            shutil.copy(secrets / "postgres" / name, server_dir / name)
            os.chmod(server_dir / name, 0o600)
        pgdata = tmp / "pgdata"
        for path in (server_dir, *server_dir.iterdir()):
            os.chown(path, user.pw_uid, user.pw_gid)
        pgdata.mkdir(mode=0o700)
        os.chown(pgdata, user.pw_uid, user.pw_gid)
        run_as = {"user": user.pw_uid, "group": user.pw_gid}
        subprocess.run(
            [str(args.bin / "initdb"), "-D", str(pgdata), "-U", "postgres", "--auth=scram-sha-256",
             f"--pwfile={server_dir / 'superuser-password'}"],
            check=True, capture_output=True, **run_as,
        )  # fmt: skip
        port = find_free_port()
        settings = [(k, v.replace(SERVER_DIR, str(server_dir))) for k, v in _server_settings(services)]
        command = [str(args.bin / "postgres"), "-D", str(pgdata), "-p", str(port), "-k", str(tmp / "server")]
        command += ["-c", "listen_addresses=127.0.0.1"]
        for key, value in settings:
            command += ["-c", f"{key}={value}"]
        log = open(tmp / "postgres.log", "wb")  # noqa: SIM115 - closed with the server
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, **run_as)  # type: ignore[call-overload]
        for _ in range(100):
            ready = subprocess.run(
                [str(args.bin / "pg_isready"), "-h", "127.0.0.1", "-p", str(port)],
                capture_output=True,
                check=False,
            )
            if ready.returncode == 0:
                break
            time.sleep(0.2)
        out["server_settings"] = dict(settings)
        admin = _url(services["migrate"]["environment"]["LOOM_DATABASE_URL"], port, secrets / "migrate")

        async def create_db() -> None:
            conn = await asyncpg.connect(admin.replace("/loom?", "/postgres?"))
            try:
                await conn.execute("CREATE DATABASE loom")
            finally:
                await conn.close()

        asyncio.run(create_db())
        # compose's migrate: its command, its URL (the superuser over verify-full).
        argv = [str(a) for a in services["migrate"]["command"]]
        argv = [a.replace(MOUNT, str(secrets / "migrate")) for a in argv]
        migrate = subprocess.run(
            [str(Path(sys.executable).parent / argv[0]), *argv[1:]],
            env={**os.environ, "LOOM_DATABASE_URL": admin, "LOOM_NATS_URL": "nats://unused:4222"},
            capture_output=True, text=True, check=False, timeout=300,
        )  # fmt: skip
        out["migrate"] = {
            "rc": migrate.returncode,
            "out": migrate.stdout.strip().splitlines()[-2:],
            "err": migrate.stderr.strip().splitlines()[-3:],
        }
        version = asyncio.run(_server_version(admin))
        out["server_version_num"] = version
        if version >= 160000:
            ok &= migrate.returncode == 0
        else:
            # Loom's roles need PostgreSQL >= 16 (`GRANT ... WITH INHERIT FALSE, SET TRUE`; compose
            # runs postgres:16): here only migrate's second half, the roles' passwords from init's
            # files, on roles created bare, so the logins below are still the compose ones.
            out["migrate"]["note"] = "PostgreSQL < 16: migrations not applied; roles created bare"
            out["roles_given_passwords"] = asyncio.run(_bare_roles(admin, secrets / "migrate" / "roles"))
        out["services"] = {}
        for name in running:
            url = _url(services[name]["environment"]["LOOM_DATABASE_URL"], port, secrets / name)
            result = asyncio.run(_try(url))
            out["services"][name] = result
            if "loom_none" in url:
                ok &= not result["connected"]
            else:
                ok &= result["connected"] and result["ssl"] is True and result["user"] != "postgres"
        # Refusals: plain TCP (no TLS), a wrong password, another CA.
        placement = _url(
            services["placement"]["environment"]["LOOM_DATABASE_URL"], port, secrets / "placement"
        )
        plain = placement.split("?")[0] + f"?passfile={secrets / 'placement' / 'db.pgpass'}&sslmode=disable"
        wrong = tmp / "wrong.pgpass"
        wrong.write_text("*:*:*:loom_placement:not-the-password\n")
        wrong.chmod(0o600)
        other = ensure_tls(tmp / "other-ca", ["postgres"], server="postgres")
        refusals = {
            "plain_tcp": asyncio.run(_try(plain)),
            "wrong_password": asyncio.run(
                _try(placement.replace(str(secrets / "placement" / "db.pgpass"), str(wrong)))
            ),
            "other_ca": asyncio.run(
                _try(placement.replace(str(secrets / "placement" / "ca.pem"), str(other.ca)))
            ),
        }
        out["refused"] = refusals
        ok &= not any(r["connected"] for r in refusals.values())
    finally:
        if server is not None:
            server.terminate()
            server.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)
    out["ok"] = bool(ok)
    print(json.dumps(out, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
