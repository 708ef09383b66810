"""Whether a benchmark's stack ran with authentication on, and what its servers refused (issue 18).

A benchmark that starts a stack puts :func:`stack_security` of its home into its JSON before
stopping it: NATS secured (every process its own NKEY identity, ``loom.security``), PostgreSQL
secured (SCRAM passwords, one role per service), and how many publishes / subscriptions nats-server
refused and how many logins PostgreSQL refused. A figure measured on an open stack says so.
"""

from pathlib import Path
from typing import Any

VIOLATIONS = ("Publish Violation", "Subscription Violation")
"""What nats-server logs when it refuses a client a subject its permissions do not allow."""
REFUSED_LOGIN = "password authentication failed"


def _count(paths: list[Path], needles: tuple[str, ...]) -> int:
    total = 0
    for path in paths:
        if path.exists():
            text = path.read_text(errors="replace")
            total += sum(text.count(needle) for needle in needles)
    return total


def nats_violations(logs: list[Path]) -> int:
    """Permission violations nats-server logged in ``logs``."""
    return _count(logs, VIOLATIONS)


def stack_security(home: Path) -> dict[str, Any]:
    """The security of the stack at ``home`` (call it before ``stack.down``)."""
    from loom.runtime.stack import read_state

    state = read_state(home) or {}
    nats_logs = [home / "nats" / "nats.log", *sorted((home / "nats").glob("nats-*/nats.log"))]
    return {
        "nats_secured": bool(state.get("secure")),
        "postgres_secured": "passfile=" in str(state.get("database_url", "")),
        "permission_violations": nats_violations(nats_logs),
        "refused_db_logins": _count([home / "postgres" / "postgres.log"], (REFUSED_LOGIN,)),
    }
