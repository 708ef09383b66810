"""``loom demo``'s live table written to a file or a pipe (``make demo | tee``, CI logs)."""

import asyncio
import io
import time
from typing import Any

from rich.console import Console

from loom.cli.demo import watch_jobs


def test_what_follows_the_live_table_starts_on_a_line_of_its_own_when_not_a_terminal() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=100)
    states = {"a": "completed", "b": "rejected"}

    async def job(job_id: str) -> dict[str, Any] | None:
        return {"tenant": "acme", "state": states[job_id], "cluster": "c-1", "progress": 1.0}

    jobs: dict[str, dict[str, Any] | None] = {"a": None, "b": None}
    asyncio.run(watch_jobs(job, jobs, console, time.time(), timeout_s=10.0))
    console.rule("summary")
    lines = out.getvalue().splitlines()
    rule = next(i for i, line in enumerate(lines) if "summary" in line)
    assert lines[rule - 1].startswith("└"), lines[rule - 1]  # the table's bottom border, alone
    assert lines[rule].lstrip("─").startswith(" summary"), lines[rule]
    assert [j["state"] for j in jobs.values() if j is not None] == ["completed", "rejected"]
