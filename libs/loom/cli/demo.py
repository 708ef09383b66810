"""``loom demo``: the stack, the example workload, live progress, a summary."""

import argparse
import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from loom.cli.usage import demo_summary
from loom.client import LoomClient, load_specs
from loom.runtime import stack
from loom.runtime.config import loom_home
from loom.sched.explain import render
from loom.sched.framework import DecisionRecord
from loom_proto.jobs import TERMINAL_STATES

DEFAULT_WORKLOAD = Path("examples/demo-workload.yaml")


def _table(jobs: dict[str, dict[str, Any] | None], started: float) -> Table:
    table = Table(title=f"Loom demo: {time.time() - started:.0f}s")
    for col in ("job", "tenant", "state", "cluster", "progress"):
        table.add_column(col)
    for job_id, j in sorted(jobs.items()):
        if j is None:
            table.add_row(job_id, "", "submitted", "", "")
            continue
        bar = "#" * int(j["progress"] * 20)
        color = {"completed": "green", "rejected": "red", "failed": "red", "running": "cyan"}.get(
            j["state"], "white"
        )
        table.add_row(
            job_id,
            j["tenant"],
            f"[{color}]{j['state']}[/{color}]",
            j["cluster"] or "",
            f"{bar:<20} {j['progress']:.0%}",
        )
    return table


async def watch_jobs(
    job: Callable[[str], Awaitable[dict[str, Any] | None]],
    jobs: dict[str, dict[str, Any] | None],
    console: Console,
    started: float,
    timeout_s: float,
) -> None:
    """Show ``jobs`` (looked up with ``job``) in a live table until all ended or ``timeout_s``."""
    with Live(_table(jobs, started), console=console, refresh_per_second=4) as live:
        while time.time() - started < timeout_s:
            for job_id, known in list(jobs.items()):
                if known is None or known["state"] not in TERMINAL_STATES:
                    jobs[job_id] = await job(job_id)
            live.update(_table(jobs, started))
            if all(j is not None and j["state"] in TERMINAL_STATES for j in jobs.values()):
                break
            await asyncio.sleep(0.5)
    if not console.is_terminal:
        # Written to a file or a pipe, the last table ends without a line break: what follows
        # would join its bottom border.
        console.line()


async def _demo(
    args: argparse.Namespace, console: Console, nats_url: str, expected_clusters: int, database_url: str = ""
) -> int:
    specs = load_specs(args.workload or DEFAULT_WORKLOAD)
    client = await LoomClient.connect(nats_url, name="loom-demo")
    try:
        with console.status("waiting for the clusters' first heartbeats…"):
            deadline = time.time() + 60
            while time.time() < deadline:
                view = await client.view()
                clusters = sum(
                    len(z["clusters"]) for r in view["regions"].values() for z in r["zones"].values()
                )
                if clusters >= expected_clusters:
                    break
                await asyncio.sleep(0.5)
        started = time.time()
        before = [s.job_id for s in specs if await client.job(s.job_id) is not None]
        if before:
            # The example's job ids are taken in this home: a second submission would be refused
            # as duplicates and the run below is the first one's, which said nothing of it.
            console.print(
                f"[yellow]{len(before)} of the example's {len(specs)} jobs were submitted in this home"
                f" before (a demo ran here): showing that run. To run it afresh: `loom down`, remove"
                f" {loom_home()}, then `make demo`.[/yellow]"
            )
        else:
            console.print(f"{clusters} clusters reporting; submitting {len(specs)} jobs")
        for spec in specs:
            if spec.job_id not in before:
                await client.submit(spec)
        jobs: dict[str, dict[str, Any] | None] = {s.job_id: None for s in specs}
        await watch_jobs(client.job, jobs, console, started, args.timeout)
        done = [j for j in jobs.values() if j is not None]
        by_state: dict[str, int] = {}
        by_cluster: dict[str, int] = {}
        for j in done:
            by_state[j["state"]] = by_state.get(j["state"], 0) + 1
            if j["cluster"]:
                by_cluster[j["cluster"]] = by_cluster.get(j["cluster"], 0) + 1
        waits = [j["placed_at"] - j["submitted_at"] for j in done if j["placed_at"]]
        runs = [j["finished_at"] - j["placed_at"] for j in done if j["placed_at"] and j["finished_at"]]
        console.rule("summary")
        console.print("jobs by state: " + ", ".join(f"{k} {v}" for k, v in sorted(by_state.items())))
        console.print("jobs by cluster: " + ", ".join(f"{k} {v}" for k, v in sorted(by_cluster.items())))
        if waits:
            console.print(
                f"submit -> placed: median {statistics.median(waits) * 1000:.0f} ms,"
                f" max {max(waits) * 1000:.0f} ms"
            )
        if runs:
            console.print(f"placed -> finished (wall): median {statistics.median(runs):.1f} s")
        for j in done:
            if j["state"] == "rejected":
                console.print(f"[red]{j['job_id']} rejected:[/red] {j['reason']}")
        for job_id in ("wide-gang", "data-heavy"):
            if job_id not in jobs:
                continue
            answer = await client.explain(job_id)
            placed = [d for d in answer["decisions"] if d["outcome"] == "placed"]
            if placed:
                console.print(f"[bold]loom explain {job_id}[/bold]:")
                for line in render(DecisionRecord.from_dict(placed[-1]["record"]), limit=2)[:4]:
                    console.print(f"  {line}", highlight=False)
        if database_url:
            await _usage_summary(console, database_url, done)
        unfinished = [k for k, j in jobs.items() if j is None or j["state"] not in TERMINAL_STATES]
        if unfinished:
            console.print(
                f"[yellow]not finished within {args.timeout:.0f}s: {', '.join(unfinished)}[/yellow]"
            )
        return 0 if not unfinished and by_state.get("completed", 0) > 0 else 1
    finally:
        await client.close()


async def _usage_summary(console: Console, database_url: str, done: list[dict[str, Any]]) -> None:
    """Metered usage per tenant and team (``loom usage`` has the rest: regions, models, statements)."""
    placed = [j["job_id"] for j in done if j["placed_at"] and j["state"] == "completed"]
    try:
        usage = await demo_summary(database_url, placed, by=("tenant", "label:team"))
    except Exception as exc:  # the summary is a courtesy: never fail the demo on it
        console.print(f"[yellow]usage not available: {exc}[/yellow]")
        return
    for way, groups in usage.items():
        console.print(
            f"usage by {way.removeprefix('label:')}: "
            + "; ".join(
                f"{g.key} {len(g.runs)} runs {g.as_dict()['gpu_seconds']} GPU-s cost {g.cost:.2f}"
                for g in groups
            ),
            highlight=False,
        )


def run_demo(args: argparse.Namespace, console: Console) -> int:
    """The whole demo; returns the exit code."""
    home = loom_home()
    with console.status("starting Loom (NATS, PostgreSQL, placement, metrics, cluster agents)…") as status:
        state = stack.up(
            home,
            stack.StackOptions(time_scale=args.time_scale),
            progress=lambda s: status.update(f"starting Loom… {s}"),
        )
    console.print(f"[green]Loom is up[/green]: {len(state['services'])} services, logs in {home / 'logs'}")
    try:
        agents = sum(1 for name in state["services"] if name.startswith("agent-"))
        code = asyncio.run(_demo(args, console, state["nats_url"], agents, state.get("database_url", "")))
    finally:
        if args.down:
            stack.down(home)
            console.print("stack stopped")
    if not args.down:
        console.print(
            "The stack is still running. Try [bold]loom view[/bold], [bold]loom jobs[/bold], "
            "[bold]loom job <id>[/bold], [bold]loom explain <id>[/bold];"
            " stop it with [bold]loom down[/bold] (or [bold]make down[/bold])."
        )
    return code
