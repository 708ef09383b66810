"""A benchmark's private stack: started in a fresh home, measured, always stopped and removed."""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import asyncpg

from loom.runtime import stack
from loom.runtime.config import ENV_DATABASE_URL, ENV_NATS_URL
from loom_benchmarks.secured import stack_security

Measure = Callable[[dict[str, Any], argparse.Namespace, Any], Coroutine[Any, Any, dict[str, Any]]]


async def wait_for_cluster_gpus(
    db: asyncpg.Connection,
    cluster: str,
    at_least: int,
    *,
    gpu_model: str | None = None,
    timeout_s: float = 60.0,
) -> int:
    """Wait until placement's view holds at least ``at_least`` schedulable GPUs of ``cluster`` (of
    ``gpu_model`` when given): its nodes' rows in ``node_allocations``, written as its agent's
    heartbeats are taken in. Returns the GPUs seen (fewer when ``timeout_s`` ran out). Jobs
    submitted before would be placed on the clusters already seen."""
    seen = 0
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        seen = int(
            await db.fetchval(
                """SELECT coalesce(sum(gpus_total), 0) FROM node_allocations
                   WHERE cluster = $1 AND schedulable AND ($2::text IS NULL OR gpu_model = $2)""",
                cluster,
                gpu_model,
            )
        )
        if seen >= at_least:
            break
        await asyncio.sleep(0.2)
    return seen


def measure_on_private_stack(
    name: str,
    args: argparse.Namespace,
    measure: Measure,
    say: Callable[[str], None],
    *,
    keep_logs: str = "",
) -> dict[str, Any]:
    """Start the default stack without the network services (``args.topology``, ``args.time_scale``)
    in a fresh home, run ``measure(state, args, say)`` on it, then stop it and remove the home,
    whatever happened; the caller's NATS / database URLs are set aside meanwhile. ``keep_logs``: a
    folder the stack's logs are copied to before the home is removed (diagnosis)."""
    home = Path(tempfile.mkdtemp(prefix=f"loom-bench-{name}-", dir="/tmp"))
    os.chmod(home, 0o755)  # PostgreSQL runs as an unprivileged user when we are root
    env_backup = {k: os.environ.pop(k) for k in (ENV_NATS_URL, ENV_DATABASE_URL) if k in os.environ}
    try:
        options = stack.StackOptions(topology=args.topology, time_scale=args.time_scale, network=False)
        say("starting the stack")
        state = stack.up(home, options, progress=lambda s: say(f"stack: {s}"))
        measured = asyncio.run(measure(state, args, say))
        return {**measured, "security": stack_security(home)}
    finally:
        say("stopping the stack")
        stack.down(home)
        if keep_logs:
            shutil.copytree(home / "logs", Path(keep_logs), dirs_exist_ok=True)
        os.environ.update(env_backup)
        shutil.rmtree(home, ignore_errors=True)
