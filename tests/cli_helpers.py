"""The ``loom`` CLI run as a user runs it (a subprocess), against a test's bus and database."""

import os
import subprocess
import sys


def loom_cli(
    *args: str, nats_url: str, database_url: str, timeout_s: float = 60.0
) -> subprocess.CompletedProcess[str]:
    """``loom ARGS`` with ``LOOM_NATS_URL`` / ``LOOM_DATABASE_URL`` set; never raises on exit codes."""
    env = dict(os.environ, LOOM_NATS_URL=nats_url, LOOM_DATABASE_URL=database_url)
    return subprocess.run(
        [sys.executable, "-m", "loom.cli.main", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
