"""``loom console``: print the web console's URL with a token (the operator's, or a tenant's).

``loom up`` starts the console service on a free port of 127.0.0.1 and writes the tokens to
``<home>/console-tokens.json`` (mode 0600); this command reads both and prints the URL to open.
"""

import argparse
import json
from typing import Any
from urllib.parse import urlencode

from loom.cli.output import console, err
from loom.runtime import stack
from loom.runtime.config import loom_home
from loom.runtime.tokens import load_tokens, tokens_path


def add_parser(sub: Any) -> None:
    """Register ``loom console`` on the top-level subparsers."""
    p = sub.add_parser(
        "console",
        help="the web console's URL with the operator token (or a tenant's)",
        description="Print the URL of the running stack's web console, with a token in it.",
    )
    p.add_argument(
        "--tenant", help="print this tenant's URL (sees only its own jobs) instead of the operator's"
    )
    p.add_argument("--json", action="store_true", help="print {url, role, tenant} as JSON")
    p.set_defaults(fn=cmd_console)


def console_url(home: Any = None, tenant: str | None = None) -> str:
    """The console's URL with a token; raises LookupError when no console is running here."""
    if tenant is not None and not tenant.strip():
        # An empty variable in a script must not hand out the operator's token.
        raise ValueError("--tenant is empty: name a tenant, or leave the option out for the operator's URL")
    home = home or loom_home()
    state = stack.read_state(home)
    if not state or not stack.is_running(home) or not state.get("console_url"):
        raise LookupError("no Loom stack with a console is running here: start one with `loom up`")
    try:
        tokens = load_tokens(home)
    except FileNotFoundError as exc:
        raise LookupError(
            f"the console's token file {tokens_path(home)} is gone (deleting it revokes every token):"
            " run `loom down` and `loom up` to write new ones"
        ) from exc
    token = tokens.tenant_token(tenant) if tenant is not None else tokens.operator
    return f"{state['console_url']}/?{urlencode({'token': token})}"


def cmd_console(args: argparse.Namespace) -> int:
    """Print the console's URL."""
    home = loom_home()
    try:
        url = console_url(home, args.tenant)
    except LookupError as exc:
        err.print(f"[red]{exc}[/red]")
        return 1
    except ValueError as exc:
        err.print(f"[red]{exc}[/red]")
        return 2
    role = "tenant" if args.tenant is not None else "operator"
    if args.json:
        print(json.dumps({"url": url, "role": role, "tenant": args.tenant}))
        return 0
    console.print(f"Loom console ({role}{' ' + args.tenant if args.tenant else ''}):", highlight=False)
    print(url)
    console.print(f"[dim]keep this URL private: it carries a token ({tokens_path(home)})[/dim]")
    return 0
