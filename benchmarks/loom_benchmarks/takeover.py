"""``loom bench takeover``: how long placement goes without a leader after its leader is SIGKILLed.

A private stack (its own NATS, PostgreSQL and service processes in a temporary home; the probe
collectors and network-perception left out to spare the CPUs) runs two placement instances,
``placement`` and ``placement-standby``, that contend for one leader lease. A client submits
one-GPU jobs at ``--rate`` per second for the whole run. Each trial finds the leader from the
health answers (``leadership.is_leader``), SIGKILLs it at t0, and measures:

* ``takeover_s``: until an instance other than the killed process answers its health subject
  with ``is_leader: true`` (both asked every 20 ms). Either may win: the supervisor restarts the
  killed instance within about one lease TTL, and the fresh process contends for the expiring
  lease as the standby does; ``standby_won`` says which did;
* ``first_placement_after_kill_s``: until the first ``JobPlaced`` of a job submitted after t0
  reaches the client (a core subscription on ``loom.jobs.placed.*``).

The new leader's own log dates the steps in between on the same host clock: lease acquired,
fence claimed ("leading"), state rebuilt from PostgreSQL. The trial then waits for the
supervisor to restart the killed process, checks that exactly one instance leads, and lets the
stack settle before the next kill. At the end every submitted job must be placed exactly once,
both in PostgreSQL (``job_events`` of kind ``placed``) and in the JOBS stream.

Jobs are long (a day each), so the platform only fills: the submitter stops at the topology's
GPU count, which the default topology (6,212 GPUs) does not reach at 50 jobs/s in five trials.
"""

import argparse
import asyncio
import contextlib
import json
import os
import platform
import secrets
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from datetime import datetime
from pathlib import Path
from typing import Any, Final, TypeVar

import asyncpg
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg

from loom.bus import BusError
from loom.bus.lease import LEASE_BUCKET
from loom.client import LoomClient
from loom.model.topology import load_topology
from loom.runtime import stack
from loom_benchmarks.secured import stack_security
from loom_proto import subjects
from loom_proto.codec import DecodeError, decode
from loom_proto.jobs import JobPlaced, JobSpec, Resources, Work

T = TypeVar("T")

TARGET_S: Final = 3.0
"""The target (issue 13, and the README's claims): a standby leads, and placement resumes, within
3 s of the leader's death (an earlier issue's 5 s was what this bench judged by until 2026-12-05)."""
INSTANCES: Final = ("placement", "placement-standby")
HEALTH_POLL_S: Final = 0.02
SETTLE_S: Final = 2.0
"""After the killed instance is back, before the next kill."""
STEP_TIMEOUT_S: Final = 60.0
DRAIN_TIMEOUT_S: Final = 120.0
"""Waiting for the last placements: longer than the consumers' ack wait (30 s), after which the
messages a killed leader had fetched but not acknowledged are delivered again."""
TENANT: Final = "bench"
PREFIX: Final = "tk"


class OptionError(ValueError):
    """An option of ``loom bench takeover`` that cannot be used."""


class Submitter:
    """Submits one-GPU day-long jobs at a steady rate and remembers when each was first sent."""

    def __init__(self, client: LoomClient, rate_per_s: float, limit: int) -> None:
        self.client = client
        self.interval_s = 1.0 / rate_per_s
        self.limit = limit
        self.sent: dict[str, float] = {}
        """job_id -> time.perf_counter() of its first publish attempt."""
        self.retries = 0
        self.stopped_at_capacity = False

    async def run(self, stop: asyncio.Event) -> None:
        """Submit until ``stop`` is set or ``limit`` jobs are out; catch up when behind."""
        start = time.perf_counter()
        i = 0
        while not stop.is_set():
            if i >= self.limit:
                self.stopped_at_capacity = True
                return
            delay = start + i * self.interval_s - time.perf_counter()
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), delay)  # the pacing interval, or stop
                continue
            spec = JobSpec(
                job_id=f"{PREFIX}-{i}",
                tenant=TENANT,
                task_type="inference",
                resources=Resources(gpus=1),
                work=Work(steps=1, step_time_s=86_400.0),
            )
            self.sent[spec.job_id] = time.perf_counter()
            msg_id = f"{spec.job_id}:{secrets.token_hex(8)}"  # one per job, kept across its retries
            while True:
                try:
                    await self.client.submit(spec, msg_id=msg_id)
                    break
                except BusError:
                    if stop.is_set():  # never acknowledged: not counted as submitted
                        del self.sent[spec.job_id]
                        return
                    # The same msg id again: JetStream keeps one copy if the first one landed.
                    self.retries += 1
                    await asyncio.sleep(0.1)
            i += 1


class PlacedWatch:
    """Arrival time of each job's first JobPlaced at this client, and the first one after t0."""

    def __init__(self, sent: dict[str, float]) -> None:
        self.sent = sent
        self.placed: dict[str, float] = {}
        self.any_placed = asyncio.Event()
        self._after: float | None = None
        self._first: asyncio.Future[float] | None = None

    def arm(self, t0: float) -> "asyncio.Future[float]":
        """A future that resolves to the arrival time of the first placement of a job sent after t0."""
        self._after = t0
        self._first = asyncio.get_running_loop().create_future()
        return self._first

    async def on_placed(self, msg: Msg) -> None:
        """The core subscription's callback."""
        now = time.perf_counter()
        try:
            job_id = decode(msg.data, JobPlaced).job_id
        except DecodeError:
            return
        if not job_id.startswith(f"{PREFIX}-") or job_id in self.placed:
            return
        self.placed[job_id] = now
        self.any_placed.set()
        first, after, sent = self._first, self._after, self.sent.get(job_id)
        if first is None or after is None or sent is None or first.done():
            return
        if sent >= after:
            first.set_result(now)


async def _health(nc: Client, name: str, timeout_s: float = 1.0) -> dict[str, Any] | None:
    """An instance's health answer; None while it does not answer (dead, starting, too busy)."""
    try:
        reply = await nc.request(subjects.service_health(name), b"", timeout=timeout_s)
    except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
        return None
    answer: dict[str, Any] = json.loads(reply.data)
    return answer


def _leads(answer: dict[str, Any] | None) -> bool:
    return answer is not None and bool(answer.get("leadership", {}).get("is_leader"))


async def _until(check: Callable[[], Awaitable[T | None]], timeout_s: float, what: str) -> T:
    """``check()``'s first result that is not None; TimeoutError naming ``what`` after ``timeout_s``."""
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        result = await check()
        if result is not None:
            return result
        await asyncio.sleep(HEALTH_POLL_S)  # polling interval
    raise TimeoutError(f"no {what} within {timeout_s:g} s")


async def _leader(nc: Client) -> tuple[str, dict[str, Any]] | None:
    """The one instance that says it leads; None while none does, or both do (not settled yet)."""
    leaders = []
    for name in INSTANCES:
        answer = await _health(nc, name)
        if answer is not None and _leads(answer):
            leaders.append((name, answer))
    return leaders[0] if len(leaders) == 1 else None


def _log_phases(log_file: Path, since_wall: float) -> dict[str, float | None]:
    """Seconds from ``since_wall`` to the first of each leadership step in an instance's log."""
    steps = {
        "lease acquired": "lease_acquired_s",
        "leading": "fence_claimed_s",
        "state rebuilt": "state_rebuilt_s",
    }
    found: dict[str, float | None] = dict.fromkeys(steps.values())
    failed_acquires = 0
    try:
        lines = log_file.read_text(errors="replace").splitlines()
    except OSError:
        return {**found, "lease_acquire_failures": None}
    for line in lines:
        try:
            entry = json.loads(line)
            at = datetime.fromisoformat(str(entry["timestamp"]).replace("Z", "+00:00")).timestamp()
        except (ValueError, KeyError, TypeError):
            continue  # not one of our JSON lines
        if at < since_wall:
            continue
        event = entry.get("event")
        if event == "lease acquire failed":
            failed_acquires += 1
        key = steps.get(str(event))
        if key is not None and found[key] is None:
            found[key] = round(at - since_wall, 3)
    return {**found, "lease_acquire_failures": failed_acquires}


async def _trial(
    index: int, nc: Client, home: Path, watch: PlacedWatch, say: Callable[[str], None]
) -> dict[str, Any]:
    say(f"trial {index + 1}: finding the leader")
    killed, before = await _until(lambda: _leader(nc), STEP_TIMEOUT_S, "single leader")
    standby = next(name for name in INSTANCES if name != killed)

    async def standby_ready() -> dict[str, Any] | None:
        answer = await _health(nc, standby)
        return answer if answer is not None and not _leads(answer) else None

    await _until(standby_ready, STEP_TIMEOUT_S, f"answer from the standby {standby}")
    pid = int(before["pid"])
    t0 = time.perf_counter()
    t0_wall = time.time()
    first = watch.arm(t0)
    os.kill(pid, signal.SIGKILL)
    say(f"trial {index + 1}: killed {killed} (pid {pid}); waiting for a new leader")

    # Either instance may win: the supervisor restarts the killed one within about a TTL, and the
    # fresh process contends for the expiring lease like the standby does.
    async def new_leader() -> tuple[float, str, dict[str, Any]] | None:
        for name in INSTANCES:
            answer = await _health(nc, name, timeout_s=0.5)
            if answer is not None and _leads(answer) and answer.get("pid") != pid:
                return time.perf_counter(), name, answer
        return None

    async def restarted() -> float | None:
        state = stack.read_state(home) or {}
        new_pid = state.get("services", {}).get(killed, {}).get("pid")
        if not new_pid or new_pid == pid:
            return None
        answer = await _health(nc, killed)
        return time.perf_counter() if answer is not None and answer.get("pid") == new_pid else None

    # Watched from the kill on, beside the takeover: the restart may well come first.
    restart = asyncio.ensure_future(_until(restarted, STEP_TIMEOUT_S, f"restart of {killed}"))
    try:
        led_at, winner, after = await _until(new_leader, STEP_TIMEOUT_S, "new leader")
        first_placed_at = await asyncio.wait_for(first, STEP_TIMEOUT_S)
        say(f"trial {index + 1}: {winner} leads; waiting for the supervisor to restart {killed}")
        restarted_at = await restart
    finally:
        restart.cancel()
    leader_now, _ = await _until(lambda: _leader(nc), STEP_TIMEOUT_S, "single leader after the restart")
    phases = _log_phases(home / "logs" / f"{winner}.log", t0_wall)
    await asyncio.sleep(SETTLE_S)  # let the restarted process finish starting before the next kill
    return {
        "trial": index + 1,
        "killed": killed,
        "killed_pid": pid,
        "new_leader": winner,
        "standby_won": winner == standby,
        "old_token": before["leadership"]["token"],
        "new_token": after["leadership"]["token"],
        "takeover_s": round(led_at - t0, 3),
        "first_placement_after_kill_s": round(first_placed_at - t0, 3),
        "new_leader_log_s": phases,
        "restart_s": round(restarted_at - t0, 3),
        "one_leader_after_restart": leader_now == winner,
        "t0": t0,
    }


async def _placed_rows(database_url: str, job_ids: list[str]) -> dict[str, int]:
    conn = await asyncpg.connect(database_url)
    try:
        rows = await conn.fetch(
            "SELECT job_id, count(*) AS n FROM job_events WHERE kind = 'placed' AND job_id = ANY($1::text[]) "
            "GROUP BY job_id",
            job_ids,
        )
    finally:
        await conn.close()
    return {str(r["job_id"]): int(r["n"]) for r in rows}


async def _histories(database_url: str, job_ids: list[str]) -> dict[str, list[str]]:
    """Each job's placed and requeued events as ``placed a1``, ``requeued a2 (start_timeout)``."""
    conn = await asyncpg.connect(database_url)
    try:
        rows = await conn.fetch(
            "SELECT job_id, kind, event->>'attempt' AS attempt, event->>'cause' AS cause FROM job_events"
            " WHERE kind IN ('placed', 'requeued') AND job_id = ANY($1::text[]) ORDER BY id",
            job_ids,
        )
    finally:
        await conn.close()
    out: dict[str, list[str]] = {}
    for r in rows:
        why = f" ({r['cause']})" if r["cause"] else ""
        out.setdefault(str(r["job_id"]), []).append(f"{r['kind']} a{r['attempt']}{why}")
    return out


async def _unpublished(database_url: str) -> int:
    """Outbox rows committed and not yet published (the relays publish after the commit)."""
    conn = await asyncpg.connect(database_url)
    try:
        return int(await conn.fetchval("SELECT count(*) FROM outbox WHERE published_at IS NULL"))
    finally:
        await conn.close()


async def _placed_on_bus(nc: Client) -> dict[str, int]:
    """JobPlaced messages per job of this run in the JOBS stream (the stored copies, not deliveries)."""
    js = nc.jetstream()
    sub = await js.subscribe(subjects.JOBS_PLACED_ALL, ordered_consumer=True)
    seen: dict[str, int] = {}
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=5)
            except nats.errors.TimeoutError:
                break
            job_id = str(json.loads(msg.data)["job_id"])
            if job_id.startswith(f"{PREFIX}-"):
                seen[job_id] = seen.get(job_id, 0) + 1
            if msg.metadata.num_pending == 0:
                break
    finally:
        await sub.unsubscribe()
    return seen


async def _verify(
    nc: Client, database_url: str, sent: list[str], say: Callable[[str], None]
) -> dict[str, Any]:
    """Wait until PostgreSQL has a placement of every job (or give up), then count both records."""
    say(f"waiting for all {len(sent)} jobs to be placed")
    started = time.perf_counter()
    in_db: dict[str, int] = {}
    while time.perf_counter() - started < DRAIN_TIMEOUT_S:
        in_db = await _placed_rows(database_url, sent)
        if len(in_db) == len(sent):
            break
        await asyncio.sleep(0.5)  # polling interval
    # A placed event is committed in the outbox with its placement and published just after: wait
    # for the relays to empty the outbox too, so a message still on its way is not counted lost.
    while time.perf_counter() - started < DRAIN_TIMEOUT_S:
        if not await _unpublished(database_url):
            break
        await asyncio.sleep(0.5)  # polling interval
    drain_s = time.perf_counter() - started
    say("counting placements in PostgreSQL and the JOBS stream")
    in_db = await _placed_rows(database_url, sent)
    on_bus = await _placed_on_bus(nc)
    wanted = set(sent)
    lost = sorted(j for j in wanted if j not in in_db or j not in on_bus)
    doubled = sorted(j for j in wanted if in_db.get(j, 0) > 1 or on_bus.get(j, 0) > 1)
    return {
        "submitted": len(sent),
        "placed_in_db": len(in_db),
        "placed_on_bus": len(on_bus),
        "lost": len(lost),
        "doubled": len(doubled),
        "lost_examples": lost[:10],
        "doubled_examples": doubled[:10],
        # What each doubled job's history says: the attempts placed and why any was given up (a
        # later attempt's placement counts as doubled too; one run in ten on a host at load 6 had
        # four, and nothing said which kind).
        "doubled_detail": await _histories(database_url, doubled[:10]) if doubled else {},
        "strangers_on_bus": len(set(on_bus) - wanted),
        "drain_s": round(drain_s, 2),
    }


def p50_max_mean(values: list[float], digits: int = 3) -> dict[str, float | None]:
    """Median, maximum and mean of ``values``, rounded (all None when there are none)."""
    if not values:
        return {"p50": None, "max": None, "mean": None}
    return {
        "p50": round(statistics.median(values), digits),
        "max": round(max(values), digits),
        "mean": round(statistics.fmean(values), digits),
    }


async def _measure(
    state: dict[str, Any], home: Path, args: argparse.Namespace, capacity: int, say: Callable[[str], None]
) -> dict[str, Any]:
    client = await LoomClient.connect(state["nats_url"], name="loom-bench-takeover")
    submitter = Submitter(client, args.rate, capacity)
    watch = PlacedWatch(submitter.sent)
    sub = await client.nc.subscribe(subjects.JOBS_PLACED_ALL, cb=watch.on_placed)
    stop = asyncio.Event()
    submitting = asyncio.create_task(submitter.run(stop))
    trials: list[dict[str, Any]] = []
    error: str | None = None
    try:
        kv = await client.nc.jetstream().key_value(LEASE_BUCKET)
        lease_ttl_s = (await kv.status()).ttl
        # The first placement needs the capacity view from the agents' heartbeats.
        say("warming up: waiting for the first placement")
        await asyncio.wait_for(watch.any_placed.wait(), STEP_TIMEOUT_S * 2)
        for i in range(args.trials):
            try:
                trials.append(await _trial(i, client.nc, home, watch, say))
            except TimeoutError as exc:
                error = f"trial {i + 1}: {exc}"
                break
    finally:
        stop.set()
        await submitting
    try:
        jobs = await _verify(client.nc, state["database_url"], list(submitter.sent), say)
    finally:
        await sub.unsubscribe()
        await client.close()
    # Jobs sent between the previous kill and this one but placed after this one: what the dead
    # leader had in hand or in its queue.
    previous_t0 = 0.0
    for trial in trials:
        t0 = trial.pop("t0")
        late = [
            watch.placed[j] - t0
            for j, sent_at in submitter.sent.items()
            if previous_t0 <= sent_at < t0 and watch.placed.get(j, 0.0) > t0
        ]
        previous_t0 = t0
        trial["placed_after_kill_sent_before"] = len(late)
        trial["last_of_those_placed_s"] = round(max(late), 3) if late else None
    jobs.update(
        {
            "rate_per_s": args.rate,
            "submit_retries": submitter.retries,
            "submitter_stopped_at_capacity": submitter.stopped_at_capacity,
            "capacity_gpus": capacity,
        }
    )
    return {"trials": trials, "jobs": jobs, "lease_ttl_s": lease_ttl_s, "error": error}


def run(args: argparse.Namespace, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Start a private stack, run the trials, stop it; the JSON result."""
    if args.trials < 1:
        raise OptionError(f"--trials must be at least 1, got {args.trials!r}")
    if not args.rate > 0:
        raise OptionError(f"--rate must be above 0 jobs/s, got {args.rate!r}")
    say = progress or (lambda _s: None)
    capacity = sum(cluster.total_gpus for cluster in load_topology(args.topology).clusters)
    home = Path(tempfile.mkdtemp(prefix="loom-bench-takeover-", dir="/tmp"))
    os.chmod(home, 0o755)  # PostgreSQL runs as an unprivileged user when we are root
    env_backup = {k: os.environ.pop(k) for k in ("LOOM_NATS_URL", "LOOM_DATABASE_URL") if k in os.environ}
    started = time.perf_counter()
    try:
        options = stack.StackOptions(
            topology=args.topology, time_scale=1.0, heartbeat_s=2.0, durable=True, network=False
        )
        say("starting the stack")
        state = stack.up(home, options, progress=lambda s: say(f"stack: {s}"))
        measured = asyncio.run(_measure(state, home, args, capacity, say))
        services = len(state["services"])
        security = stack_security(home)
    finally:
        say("stopping the stack")
        stack.down(home)
        os.environ.update(env_backup)
        shutil.rmtree(home, ignore_errors=True)
    trials = measured["trials"]
    takeover = [float(t["takeover_s"]) for t in trials]
    first = [float(t["first_placement_after_kill_s"]) for t in trials]
    jobs = measured["jobs"]
    complete = len(trials) == args.trials and measured["error"] is None
    exactly_once = jobs["lost"] == 0 and jobs["doubled"] == 0
    takeover_ok = complete and max(takeover) <= TARGET_S
    first_ok = complete and max(first) <= TARGET_S
    return {
        "benchmark": "takeover",
        "security": security,
        "headline": {
            "takeover_s": p50_max_mean(takeover),
            "first_placement_after_kill_s": p50_max_mean(first),
            "lost": jobs["lost"],
            "doubled": jobs["doubled"],
            "standby_won": sum(1 for t in trials if t["standby_won"]),
            "last_job_in_flight_at_kill_placed_s_max": max(
                (t["last_of_those_placed_s"] for t in trials if t["last_of_those_placed_s"] is not None),
                default=None,
            ),
            "one_leader_after_every_restart": all(t["one_leader_after_restart"] for t in trials),
            "target_s": TARGET_S,
            "takeover_meets_target": takeover_ok,
            "first_placement_meets_target": first_ok,
            "pass": takeover_ok and first_ok and exactly_once,
        },
        "targets": {
            "takeover_s_max": TARGET_S,
            "first_placement_after_kill_s_max": TARGET_S,
            "lost": 0,
            "doubled": 0,
            "source": "issue 13: a standby takes over within 3 s of the leader's death; no job is lost "
            "or placed twice",
        },
        "lease_ttl_s": measured["lease_ttl_s"],
        "trials": trials,
        "jobs": jobs,
        "error": measured["error"],
        "method": {
            "kill": "SIGKILL of the instance whose health answer says leadership.is_leader",
            "takeover_s": f"from the kill until a health answer from another process says is_leader (both "
            f"instances asked every {HEALTH_POLL_S * 1000:.0f} ms)",
            "first_placement_after_kill_s": "from the kill until the first JobPlaced of a job submitted "
            "after it reaches the client",
            "new_leader_log_s": "seconds from the kill to the new leader's own log lines (same host clock)",
            "restart_s": "from the kill until the restarted process answers its health subject",
            "placed_after_kill_sent_before": "jobs submitted after the previous kill and before this one, "
            "placed after this one; the last of them (last_of_those_placed_s) waits for the consumer's ack "
            "wait when the dead leader had fetched it without acknowledging",
            "exactly_once": "job_events of kind placed in PostgreSQL and JobPlaced messages in the JOBS "
            "stream, per job",
            "between_trials": f"the supervisor restarts the killed process; exactly one instance must lead; "
            f"then {SETTLE_S:g} s",
        },
        "config": {
            "topology": args.topology,
            "trials": args.trials,
            "rate_per_s": args.rate,
            "services": services,
            "network_services": False,
        },
        "environment": {
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
            "machine": platform.machine(),
        },
        "wall_s": round(time.perf_counter() - started, 1),
    }


def print_table(result: dict[str, Any]) -> None:
    """The figures as a readable table on stderr."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"placement leader takeover after SIGKILL (lease TTL {result['lease_ttl_s']} s), seconds",
        caption="log: the new leader's lease acquired / fence claimed / state rebuilt, from the kill",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    for col in ("trial", "killed -> leader", "takeover", "first placed", "log", "restart", "one leader"):
        table.add_column(col, justify="right", no_wrap=True)
    for t in result["trials"]:
        log = t["new_leader_log_s"]
        steps = (log["lease_acquired_s"], log["fence_claimed_s"], log["state_rebuilt_s"])
        table.add_row(
            str(t["trial"]),
            f"{t['killed']} -> {t['new_leader']}",
            f"{t['takeover_s']:.2f}",
            f"{t['first_placement_after_kill_s']:.2f}",
            " / ".join("-" if s is None else f"{s:.2f}" for s in steps),
            f"{t['restart_s']:.1f}",
            "yes" if t["one_leader_after_restart"] else "[red]no[/red]",
        )
    console = Console(stderr=True)
    console.print(table)
    head = result["headline"]
    jobs = result["jobs"]

    def verdict(ok: bool) -> str:
        return "met" if ok else "[red]missed[/red]"

    console.print(
        f"takeover p50 {head['takeover_s']['p50']} s, max {head['takeover_s']['max']} s "
        f"(target <= {head['target_s']:g} s: {verdict(head['takeover_meets_target'])}); "
        f"first placement p50 {head['first_placement_after_kill_s']['p50']} s, "
        f"max {head['first_placement_after_kill_s']['max']} s "
        f"({verdict(head['first_placement_meets_target'])})"
    )
    console.print(
        f"jobs: {jobs['submitted']} submitted, {jobs['placed_in_db']} placed; lost {jobs['lost']}, "
        f"doubled {jobs['doubled']} -> {'[green]pass[/green]' if head['pass'] else '[red]fail[/red]'}"
    )
    if result["error"]:
        console.print(f"[red]{result['error']}[/red]")


def main(args: argparse.Namespace) -> int:
    """``loom bench takeover``: JSON on stdout, the table on stderr unless ``--json``; progress on stderr."""
    from rich.console import Console

    console = Console(stderr=True)
    try:
        with console.status("takeover benchmark…") as status:
            result = run(args, progress=lambda s: status.update(f"takeover benchmark: {s}"))
    except OptionError as exc:
        console.print(f"[red]{exc}[/red]")
        return 2
    print(json.dumps(result, indent=2))
    if not args.json:
        print_table(result)
    sys.stdout.flush()
    return 0
