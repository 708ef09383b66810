"""Where Loom finds its servers and keeps its data: environment first, then the embedded default."""

import json
import os
from dataclasses import dataclass
from pathlib import Path

ENV_NATS_URL = "LOOM_NATS_URL"
ENV_DATABASE_URL = "LOOM_DATABASE_URL"
ENV_HOME = "LOOM_HOME"


def loom_home() -> Path:
    """``$LOOM_HOME`` or ``./.loom``: data, logs and the running stack's state file."""
    return Path(os.environ.get(ENV_HOME) or Path.cwd() / ".loom").resolve()


def stack_file(home: Path | None = None) -> Path:
    """The file `loom up` writes with the running stack's ports and processes."""
    return (home or loom_home()) / "stack.json"


@dataclass(frozen=True)
class Endpoints:
    """The NATS and PostgreSQL URLs a process should use."""

    nats_url: str
    database_url: str


def _env_or_stack(env: str, key: str, home: Path | None) -> str | None:
    """An environment variable, else the same URL from the state file of the stack `loom up` started."""
    value = os.environ.get(env)
    if value:
        return value
    path = stack_file(home)
    state: dict[str, str] = json.loads(path.read_text()) if path.exists() else {}
    return state.get(key) or None


def nats_endpoint(home: Path | None = None) -> str:
    """The NATS URL alone, for what needs no database (a tenant's CLI, an agent): ``LOOM_NATS_URL``,
    else the stack's. A tenant has NATS credentials and no database URL: every command asked for
    both (a newcomer's walk)."""
    nats_url = _env_or_stack(ENV_NATS_URL, "nats_url", home)
    if not nats_url:
        raise RuntimeError(
            f"no Loom stack found: run `loom up` (state file {stack_file(home)} is missing)"
            f" or set {ENV_NATS_URL}"
        )
    return nats_url


def endpoints(home: Path | None = None) -> Endpoints:
    """Environment variables win; otherwise the URLs of the stack `loom up` started."""
    nats_url = _env_or_stack(ENV_NATS_URL, "nats_url", home)
    database_url = _env_or_stack(ENV_DATABASE_URL, "database_url", home)
    if not nats_url or not database_url:
        raise RuntimeError(
            f"no Loom stack found: run `loom up` (state file {stack_file(home)} is missing) "
            f"or set {ENV_NATS_URL} and {ENV_DATABASE_URL}"
        )
    return Endpoints(nats_url, database_url)
