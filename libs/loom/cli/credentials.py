"""``loom tenant add NAME``, ``loom credentials rotate`` and ``loom credentials init --compose``.

``init --compose`` writes docker-compose's secrets (:mod:`loom.security.compose`) with the same
code ``loom up`` uses; the compose service ``init`` runs it.

The files live under ``<home>/secrets/nats/`` (0600, directory 0700); their seeds are never
printed. After a change the running nats-server re-reads its users (SIGHUP, what
``nats-server --signal reload`` sends, and the command waits until its log says it reloaded): a
new tenant can connect at once, and after a rotation every old seed is refused while Loom's own
processes reconnect with their new one. ``rotate`` also gives every PostgreSQL role of the stack's
own secured database a new password (:func:`loom.runtime.dbcreds.rotate_passwords`: the password
files keep their names, so each service's next connection uses the new one).
"""

import argparse
import asyncio
from pathlib import Path
from typing import Any

import asyncpg

from loom.cli.output import console, err
from loom.runtime import dbcreds
from loom.runtime.config import loom_home
from loom.runtime.servers import NatsServer, reload_nats_server
from loom.runtime.stack import read_state
from loom.sched.quota import QuotaError, read_tenants
from loom.security import CredentialStore, tenant_identity, write_secret
from loom.security.http_token import HTTP_TOKEN_FILE, rotate_http_token
from loom_proto.ids import InvalidIdError


def add_parser(sub: Any) -> None:
    """Register ``loom tenant`` and ``loom credentials`` on the top-level subparsers."""
    tenant = sub.add_parser("tenant", help="tenants of a secured stack: issue their NATS credentials")
    tenant_sub = tenant.add_subparsers(dest="tenant_command", required=True)
    p = tenant_sub.add_parser("add", help="issue (or show) a tenant's credentials file")
    p.add_argument("name")
    p.add_argument("--out", type=Path, help="also write a copy here (0600) to hand to the tenant")
    p.set_defaults(fn=cmd_tenant_add)
    creds = sub.add_parser("credentials", help="NATS credentials and PostgreSQL passwords of a secured stack")
    creds_sub = creds.add_subparsers(dest="credentials_command", required=True)
    p = creds_sub.add_parser(
        "rotate",
        help="new NATS seeds, PostgreSQL passwords and HTTP bearer token; old ones refused",
    )
    p.set_defaults(fn=cmd_rotate)
    p = creds_sub.add_parser(
        "init",
        help="write docker-compose's secrets: NATS config, users and credentials, PostgreSQL passwords, TLS",
    )
    p.add_argument("--dir", type=Path, required=True, help="the secrets volume (loom-secrets)")
    p.add_argument(
        "--compose",
        action="store_true",
        required=True,
        help="the layout docker-compose.yml mounts: one directory per container (loom.security.compose)",
    )
    p.add_argument("--tenant", action="append", default=[], help="also issue this tenant's credentials")
    p.add_argument("--rotate", action="store_true", help="new seeds, passwords, CA and certificates")
    p.add_argument("process", nargs="+", help="every long-running Loom service, by its compose name")
    p.set_defaults(fn=cmd_init)


def nats_servers(home: Path) -> list[tuple[int, Path]]:
    """The running nats-server processes of the stack at ``home`` (one, or a cluster's nodes):
    each one's pid and log file (``nats-i`` of a cluster keeps its files under ``nats/nats-i``)."""
    state = read_state(home) or {}
    servers = state.get("servers", {})
    out: list[tuple[int, Path]] = []
    for name, server in servers.items():
        if not (name == "nats" or name.startswith("nats-")) or not server.get("pid"):
            continue
        data_dir = home / "nats" if name == "nats" else home / "nats" / name
        out.append((int(server["pid"]), NatsServer(data_dir).log_path))
    return out


def reload_nats(home: Path, timeout_s: float = 10.0) -> int:
    """Make every nats-server of the stack re-read its config and return once each has said so
    in its log (a rotated seed is refused when this returns); returns how many reloaded."""
    told = 0
    for pid, log_path in nats_servers(home):
        try:
            reload_nats_server(pid, log_path, timeout_s)
            told += 1
        except ProcessLookupError:
            continue
    return told


_WHERE = (
    " (a stack's state is kept in $LOOM_HOME, else ./.loom of the directory `loom up` ran in: run"
    " this there, or set LOOM_HOME)"
)


def _store(home: Path) -> CredentialStore | None:
    store = CredentialStore(home)
    if not store.registry_path.exists():
        err.print(
            f"[red]no secured stack at {home}[/red]: start one with [bold]loom up --secure[/bold]{_WHERE}"
        )
        return None
    return store


def cmd_tenant_add(args: argparse.Namespace) -> int:
    """Issue a tenant's credentials (kept if it has some) and let NATS know it."""
    home = loom_home()
    store = _store(home)
    if store is None:
        return 1
    try:
        identity = tenant_identity(args.name)
    except (InvalidIdError, ValueError) as exc:
        err.print(f"[red]{exc}[/red]")
        return 2
    path = store.ensure(identity)
    store.write_auth()
    reloaded = reload_nats(home)
    if args.out is not None:
        write_secret(args.out, path.read_text())
        path = args.out
    console.print(f"tenant [bold]{args.name}[/bold]: credentials in {path} (0600)")
    console.print(f"use them with: export LOOM_CREDS={path}")
    if (refusal := _closed_to(home, args.name)) is not None:
        err.print(f"[yellow]{refusal}[/yellow]")
    if not reloaded:
        console.print("[yellow]NATS is not running: the tenant can connect once the stack is up[/yellow]")
    return 0


def _closed_to(home: Path, tenant: str) -> str | None:
    """Why the stack's placement will refuse ``tenant``'s jobs: a closed tenants file (``loom up
    --tenants``) that does not list it; None when it admits them (or cannot be read here)."""
    path = (read_state(home) or {}).get("tenants_file")
    if not path:
        return None
    try:
        config = read_tenants(str(path))
    except (OSError, QuotaError):
        return None
    if config.open or tenant in config.tenants:
        return None
    return (
        f"but the stack's tenants file {path} is closed and does not list {tenant}: its jobs are"
        f" rejected (unknown_tenant) until the file lists it and the stack restarts (loom down, loom up)"
    )


def database_admin_url(home: Path) -> str | None:
    """The superuser URL of the stack's own secured PostgreSQL (its password in a file under
    ``<home>/secrets/``), or None when the stack has none (an external database, or no auth)."""
    state = read_state(home) or {}
    url = state.get("database_url")
    if not url or not dbcreds.service_role_passfile(home / "secrets", dbcreds.ADMIN_ROLE).exists():
        return None
    return str(url)


def cmd_rotate(_args: argparse.Namespace) -> int:
    """New seeds for every NATS identity (NATS reloads its users), new passwords for every
    PostgreSQL role of the stack and a new HTTP bearer token (the old ones refused at once)."""
    home = loom_home()
    store = CredentialStore(home)
    admin_url = database_admin_url(home)
    if not store.registry_path.exists() and admin_url is None and not (home / HTTP_TOKEN_FILE).exists():
        err.print(
            f"[red]no secured stack at {home}[/red]: start one with [bold]loom up --secure[/bold]"
            f" (NATS) or [bold]--secure-db[/bold] (PostgreSQL){_WHERE}"
        )
        return 1
    status = 0
    if store.registry_path.exists():
        identities = store.rotate()
        try:
            reloaded = reload_nats(home)
        except RuntimeError as exc:
            err.print(f"[red]{exc}[/red]")
            reloaded, status = 0, 1
        tenants = [i.scope for i in identities if i.role == "tenant"]
        console.print(
            f"rotated {len(identities)} NATS credentials under {store.dir}; NATS servers reloaded: {reloaded}"
        )
        console.print("Loom's processes reconnect with their new seeds; old seeds are refused from now on.")
        if tenants:
            console.print(f"hand the tenants their new files again: {', '.join(str(t) for t in tenants)}")
    token_file = rotate_http_token(home)
    if token_file is not None:
        console.print(
            f"rotated the HTTP bearer token in {token_file}: /metrics, the trace store, the webhook and"
            " the services' span exporters use it from their next request; the old one is refused"
        )
    if admin_url is not None:
        try:
            roles = asyncio.run(dbcreds.rotate_passwords(admin_url, home / "secrets"))
        except (OSError, asyncpg.PostgresError) as exc:
            err.print(f"[red]PostgreSQL passwords not rotated: {exc}[/red]")
            return 1
        console.print(
            f"rotated {len(roles)} PostgreSQL passwords ({', '.join(roles)}) under {home / 'secrets'}:"
            " new connections use them, the old ones are refused from now on"
        )
    return status


def cmd_init(args: argparse.Namespace) -> int:
    """Write docker-compose's secrets; print where, never what."""
    from loom.security.compose import init_compose

    try:
        written = init_compose(args.dir, args.process, tenants=args.tenant, rotate=args.rotate)
    except (InvalidIdError, ValueError) as exc:
        err.print(f"[red]{exc}[/red]")
        return 2
    for name, identity in written.identities.items():
        role = written.db_roles.get(name, "no database")
        console.print(f"{name}: NATS identity {identity.name}, PostgreSQL {role}")
    console.print(f"secrets under {written.root} (0600 files, 0700 directories), one directory per container")
    return 0
