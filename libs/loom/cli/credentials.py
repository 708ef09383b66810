"""``loom tenant add NAME`` and ``loom credentials rotate``: the NATS credentials of a secured stack.

The files live under ``<home>/secrets/nats/`` (0600, directory 0700); their seeds are never
printed. After a change the running nats-server re-reads its users (SIGHUP, what
``nats-server --signal reload`` sends): a new tenant can connect at once, and after a rotation
every old seed is refused while Loom's own processes reconnect with their new one.
"""

import argparse
import os
import signal
from pathlib import Path
from typing import Any

from rich.console import Console

from loom.runtime.config import loom_home
from loom.runtime.stack import read_state
from loom.security import CredentialStore, tenant_identity, write_secret
from loom_proto.ids import InvalidIdError

console = Console()
err = Console(stderr=True)


def add_parser(sub: Any) -> None:
    """Register ``loom tenant`` and ``loom credentials`` on the top-level subparsers."""
    tenant = sub.add_parser("tenant", help="tenants of a secured stack: issue their NATS credentials")
    tenant_sub = tenant.add_subparsers(dest="tenant_command", required=True)
    p = tenant_sub.add_parser("add", help="issue (or show) a tenant's credentials file")
    p.add_argument("name")
    p.add_argument("--out", type=Path, help="also write a copy here (0600) to hand to the tenant")
    p.set_defaults(fn=cmd_tenant_add)
    creds = sub.add_parser("credentials", help="NATS credentials of a secured stack")
    creds_sub = creds.add_subparsers(dest="credentials_command", required=True)
    p = creds_sub.add_parser("rotate", help="new seeds for every identity; NATS reloads, old seeds refused")
    p.set_defaults(fn=cmd_rotate)


def nats_pids(home: Path) -> list[int]:
    """The running nats-server processes of the stack at ``home`` (one, or a cluster's nodes)."""
    state = read_state(home) or {}
    servers = state.get("servers", {})
    pids = [s.get("pid") for name, s in servers.items() if name == "nats" or name.startswith("nats-")]
    return [int(pid) for pid in pids if pid]


def reload_nats(home: Path) -> int:
    """Ask every nats-server of the stack to re-read its config; returns how many were told."""
    told = 0
    for pid in nats_pids(home):
        try:
            os.kill(pid, signal.SIGHUP)
            told += 1
        except ProcessLookupError:
            continue
    return told


def _store(home: Path) -> CredentialStore | None:
    store = CredentialStore(home)
    if not store.registry_path.exists():
        err.print(f"[red]no secured stack at {home}[/red]: start one with [bold]loom up --secure[/bold]")
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
    if not reloaded:
        console.print("[yellow]NATS is not running: the tenant can connect once the stack is up[/yellow]")
    return 0


def cmd_rotate(_args: argparse.Namespace) -> int:
    """New seeds for every identity, then NATS reloads its users."""
    home = loom_home()
    store = _store(home)
    if store is None:
        return 1
    identities = store.rotate()
    reloaded = reload_nats(home)
    tenants = [i.scope for i in identities if i.role == "tenant"]
    console.print(
        f"rotated {len(identities)} credentials under {store.dir}; NATS servers reloaded: {reloaded}"
    )
    console.print("Loom's processes reconnect with their new seeds; old seeds are refused from now on.")
    if tenants:
        console.print(f"hand the tenants their new files again: {', '.join(str(t) for t in tenants)}")
    return 0
