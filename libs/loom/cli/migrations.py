"""``loom drain`` / ``loom undrain`` / ``loom migrations``: close a cluster and move its jobs, see every move.

The migration service does the work (request-reply on ``loom.migrate.drain`` and
``loom.migrate.query``); this module parses arguments and prints.
"""

import argparse
import asyncio
import json
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

from rich.table import Table

from loom.cli import CONNECT_WITHIN_S
from loom.cli.argtypes import bounded_int, non_negative_float, positive_float, positive_int
from loom.cli.output import console, err
from loom.client import LoomClient
from loom.runtime.config import nats_endpoint
from loom_proto import subjects
from loom_proto.migrations import MAX_DRAIN_CONCURRENCY

_TIMEOUT_S = 10.0


DRAIN_WAIT_S = 600.0
"""How long ``loom drain --wait`` follows a drain by default."""


def confirmation_line(answer: dict[str, Any]) -> str:
    """What ``loom drain`` / ``loom undrain`` print of the placement shards' confirmation in the
    answer: which shards confirmed, which did not answer in time, which have no leader (truthful:
    what the migration service gathered, nothing more)."""
    shards = answer.get("shards")
    if not isinstance(shards, dict):
        confirmed = answer.get("placement_confirmed")
        return f"placement confirmed: {'yes' if confirmed else 'no'} (no per-shard answer)"
    confirmed = list(shards.get("confirmed", []))
    unconfirmed = list(shards.get("unconfirmed", []))
    leaderless = list(shards.get("leaderless", []))
    parts = []
    if not shards.get("known", True):
        parts.append("the placement shards leading now could not be read, so nothing is confirmed")
    if confirmed:
        parts.append(f"placement confirmed by shard(s) {', '.join(confirmed)}")
    if unconfirmed:
        parts.append(
            f"NOT confirmed by shard(s) {', '.join(unconfirmed)} (no answer in time; each reloads the"
            " drains within seconds and may act on the old state until then)"
        )
    if leaderless:
        parts.append(
            f"shard(s) {', '.join(leaderless)} lead nowhere now (they load the drains when one starts)"
        )
    if not confirmed and not unconfirmed and shards.get("known", True):
        parts.append("no placement leader is running (each loads the drains when it starts)")
    return "; ".join(parts)


def add_parser(sub: Any) -> None:
    """Register ``loom drain``, ``loom undrain`` and ``loom migrations`` on the top-level subparsers."""

    def add(name: str, fn: Callable[[argparse.Namespace], int], help_: str) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(fn=fn)
        return p

    p = add("drain", cmd_drain, "close a cluster to new work and move its jobs off at checkpoint boundaries")
    p.add_argument("cluster")
    p.add_argument(
        "--deadline",
        type=non_negative_float,
        default=0.0,
        help="seconds; past it every job left moves at once (0: none)",
    )
    p.add_argument(
        "--concurrency",
        type=bounded_int(1, MAX_DRAIN_CONCURRENCY),
        default=2,
        help=f"moves in flight at once (1-{MAX_DRAIN_CONCURRENCY})",
    )
    p.add_argument(
        "--force", action="store_true", help="drain even where a job has no feasible GPUs on other clusters"
    )
    p.add_argument("--wait", action="store_true", help="follow the drain until the cluster is empty")
    p.add_argument(
        "--timeout",
        type=positive_float,
        default=None,
        help=f"with --wait: give up after this many seconds (default {DRAIN_WAIT_S:g})",
    )
    p.add_argument("--json", action="store_true")
    p = add("undrain", cmd_undrain, "open a drained cluster to new work again")
    p.add_argument("cluster")
    p.add_argument("--json", action="store_true")
    p = add("drains", cmd_drains, "drained and draining clusters: since when, settings, jobs waiting to move")
    p.add_argument("--json", action="store_true")
    p = add(
        "migrations",
        cmd_migrations,
        "migrations (drains, failovers, network, backflow and slow-node moves) with why and the numbers",
    )
    p.add_argument("--job", help="only this job's")
    p.add_argument("--cluster", help="only those off this cluster")
    p.add_argument("--limit", type=positive_int, default=100)
    shown = p.add_mutually_exclusive_group()
    shown.add_argument(
        "--verdicts", action="store_true", help="every job looked at (moved or not), with gain, cost and why"
    )
    shown.add_argument(
        "--replicas",
        action="store_true",
        help="checkpoint replicas (where, step, bytes; --cluster: those held there)",
    )
    p.add_argument("--json", action="store_true")


async def ask(client: LoomClient, subject: str, request: dict[str, Any]) -> dict[str, Any]:
    """One request to the migration service; a missing service is a clear error."""
    try:
        reply = await client.nc.request(subject, json.dumps(request).encode(), timeout=_TIMEOUT_S)
    except Exception as exc:  # nats raises several unrelated types for "no answer"
        return {
            "ok": False,
            "code": "unavailable",
            "error": f"the migration service did not answer ({exc!r})",
        }
    answer: dict[str, Any] = json.loads(reply.data)
    return answer


def _with_client(work: Callable[[LoomClient], Any]) -> int:
    async def go() -> int:
        try:
            client = await LoomClient.connect(nats_endpoint(), first_within_s=CONNECT_WITHIN_S)
        except Exception as exc:  # no server: say so, exit 1
            err.print(f"cannot reach NATS: {exc}")
            return 1
        try:
            code: int = await work(client)
            return code
        finally:
            await client.close()

    return asyncio.run(go())


def cmd_drain(args: argparse.Namespace) -> int:
    """Drain a cluster (refused with the reason for an unknown cluster or a job with nowhere to go)."""

    if args.timeout is not None and not args.wait:
        err.print("--timeout is how long --wait follows the drain: give --wait too")
        return 2
    if args.wait and args.timeout is None:
        args.timeout = DRAIN_WAIT_S

    async def work(client: LoomClient) -> int:
        answer = await ask(
            client,
            subjects.MIGRATE_DRAIN,
            {
                "op": "drain",
                "cluster": args.cluster,
                "concurrency": args.concurrency,
                "deadline_s": args.deadline,
                "force": args.force,
            },
        )
        if not answer.get("ok"):
            if args.json:
                print(json.dumps(answer))
            err.print(f"drain refused: {answer.get('error')}")
            return 1
        if not args.wait:
            if args.json:
                print(json.dumps(answer))
            else:
                if answer.get("new") is False:  # a repeated drain updates its settings
                    console.print(f"{args.cluster} was already drained or draining: its settings are updated")
                console.print(
                    f"{args.cluster} draining: {answer['jobs']} job(s) to move,"
                    f" {answer['concurrency']} at a time (`loom migrations --cluster {args.cluster}`"
                    " lists the moves and any job that waits for capacity elsewhere)"
                )
                console.print(confirmation_line(answer))
            return 0
        return await _follow(client, args, answer)

    return _with_client(work)


async def _follow(client: LoomClient, args: argparse.Namespace, answer: dict[str, Any]) -> int:
    """Show the drain's progress until its cluster is empty (or the timeout)."""
    start = time.monotonic()
    total = int(answer["jobs"])
    if not args.json:
        console.print(confirmation_line(answer))
    state = "draining"
    moves: list[dict[str, Any]] = []
    waiting: list[dict[str, Any]] = []
    told: set[str] = set()
    last: tuple[str, int, int, frozenset[str]] | None = None
    unanswered = False
    while time.monotonic() - start < args.timeout:
        drains = await ask(client, subjects.MIGRATE_QUERY, {"op": "drains"})
        listed = await ask(client, subjects.MIGRATE_QUERY, {"op": "list", "cluster": args.cluster})
        if not drains.get("ok") or not listed.get("ok"):
            # The migration service restarting, say: the drain is still in force (it is a row in
            # the store), so keep following; before, this read as "undrained" and the wait ended.
            if not unanswered and not args.json:
                err.print(
                    f"the migration service does not answer ({drains.get('error') or listed.get('error')});"
                    " still following"
                )
            unanswered = True
            await asyncio.sleep(1.0)
            continue
        unanswered = False
        mine = [d for d in drains.get("result", []) if d["cluster"] == args.cluster]
        # This drain's moves only: an earlier drain of the cluster (undrained since) moved others.
        since = float(mine[0]["started_at"]) if mine and mine[0].get("started_at") else None
        moves = [
            m
            for m in listed.get("result", [])
            if m["cause"] == "drain" and (since is None or float(m["planned_at"]) >= since)
        ]
        state = mine[0]["state"] if mine else "undrained"
        waiting = mine[0].get("waiting", []) if mine else []
        done = sum(1 for m in moves if m["state"] == "completed")
        moving = sum(1 for m in moves if m["state"] in ("planned", "started"))
        progress = (state, done, moving, frozenset(w["job_id"] for w in waiting))
        if not args.json and progress != last:  # a line when something changed, not every second
            last = progress
            console.print(
                f"[{time.monotonic() - start:6.1f}s] {args.cluster} {state}:"
                f" {done} moved, {moving} in flight, {len(waiting)} waiting for capacity"
                f" (of {total} at the start)"
            )
            for w in waiting:
                if w["job_id"] not in told:
                    told.add(w["job_id"])
                    console.print(f"  {w['job_id']} {w['why']}")
        if state != "draining":
            break
        await asyncio.sleep(1.0)
    if args.json:
        print(json.dumps({**answer, "state": state, "moves": moves, "waiting_for_capacity": waiting}))
    elif state == "draining":
        moving = sum(1 for m in moves if m["state"] in ("planned", "started"))
        err.print(
            f"stopped following after {args.timeout:g} s (--timeout): {args.cluster} is still draining,"
            f" {moving} move(s) in flight; `loom migrations --cluster {args.cluster}` shows them"
        )
        if waiting:
            err.print(
                f"{args.cluster} not empty: {len(waiting)} job(s) wait for capacity elsewhere (they keep"
                " running here and move when room appears; a --deadline gives them up when it passes,"
                " room or not, and they then wait queued)"
            )
    return 0 if state == "drained" else 1


def cmd_undrain(args: argparse.Namespace) -> int:
    """Open a drained cluster again."""

    async def work(client: LoomClient) -> int:
        answer = await ask(client, subjects.MIGRATE_DRAIN, {"op": "undrain", "cluster": args.cluster})
        if args.json:
            print(json.dumps(answer))
        if not answer.get("ok"):
            err.print(f"undrain refused: {answer.get('error')}")
            return 1
        if not args.json:
            was = "" if answer.get("was_drained") else " (it was not drained)"
            console.print(f"{args.cluster} open to new work{was}")
            console.print(confirmation_line(answer))
        return 0

    return _with_client(work)


def cmd_drains(args: argparse.Namespace) -> int:
    """Every drain the migration service holds (a cluster closed to new work until undrained)."""

    async def work(client: LoomClient) -> int:
        rows = await _rows(client, {"op": "drains"}, as_json=args.json)
        if rows is None or args.json:
            return 1 if rows is None else 0
        if not rows:
            console.print("no cluster is drained: every cluster takes new work")
            return 0
        console.print(drains_table(rows))
        _print_waiting(rows)
        return 0

    return _with_client(work)


async def _rows(client: LoomClient, request: dict[str, Any], *, as_json: bool) -> list[dict[str, Any]] | None:
    """The rows the migration service answers ``request`` with (printed as JSON with
    ``as_json``); None when it refused, said on stderr."""
    answer = await ask(client, subjects.MIGRATE_QUERY, request)
    if not answer.get("ok"):
        err.print(str(answer.get("error")))
        return None
    rows: list[dict[str, Any]] = answer["result"]
    if as_json:
        print(json.dumps(rows, indent=2))
    return rows


def _print_waiting(drains: list[dict[str, Any]], cluster: str | None = None, job: str | None = None) -> None:
    """Each drain's jobs that have not moved yet, and why (of ``cluster``'s drain, ``job`` only)."""
    for d in drains:
        for w in d.get("waiting", []):
            if cluster in (None, d["cluster"]) and job in (None, w["job_id"]):
                console.print(f"drain of {d['cluster']}: {w['job_id']} not moved, {w['why']}")


def drains_table(rows: list[dict[str, Any]]) -> Table:
    """A table of drains (``loom drains``): state (``draining``: jobs still to move; ``drained``:
    empty, closed until ``loom undrain``), since when, the drain's settings and jobs waiting."""
    table = Table(title="drains (closed to new work until `loom undrain CLUSTER`)")
    for col in ("cluster", "state", "since", "moves at once", "deadline s", "forced", "waiting to move"):
        table.add_column(col)
    for d in rows:
        table.add_row(
            d["cluster"],
            d["state"],
            datetime.fromtimestamp(d["started_at"]).strftime("%Y-%m-%d %H:%M:%S"),
            str(d["concurrency"]),
            f"{float(d['deadline_s']):g}" if d["deadline_s"] else "none",
            "yes" if d["forced"] else "no",
            str(len(d.get("waiting", []))),
        )
    return table


def cmd_migrations(args: argparse.Namespace) -> int:
    """Every migration, newest first, with why and the numbers."""

    async def work(client: LoomClient) -> int:
        op = "verdicts" if getattr(args, "verdicts", False) else "list"
        op = "replicas" if getattr(args, "replicas", False) else op
        request = {"op": op, "job_id": args.job, "cluster": args.cluster, "limit": args.limit}
        rows = await _rows(client, request, as_json=args.json)
        if rows is None or args.json:
            return 1 if rows is None else 0
        tables = {"verdicts": verdicts_table, "replicas": replicas_table}
        console.print(tables.get(op, migrations_table)(rows))
        if op == "list":  # a drain's jobs that have not moved yet, and why
            drains = await ask(client, subjects.MIGRATE_QUERY, {"op": "drains"})
            _print_waiting(drains.get("result", []) if drains.get("ok") else [], args.cluster, args.job)
        return 0

    return _with_client(work)


def migrations_table(rows: list[dict[str, Any]], title: str = "migrations") -> Table:
    """A table of migration rows (``loom migrations``, ``loom job ID``)."""
    table = Table(title=title)
    for col in (
        "planned",
        "job",
        "cause",
        "state",
        "from",
        "to",
        "attempt",
        "resume step",
        "lost steps",
        "why",
    ):
        table.add_column(col)
    for m in rows:
        table.add_row(
            datetime.fromtimestamp(m["planned_at"]).strftime("%H:%M:%S"),
            m["job_id"],
            m["cause"],
            m["state"],
            m["from_cluster"],
            m.get("to_cluster") or "-",
            f"{m['from_attempt']} -> {m['from_attempt'] + 1}",
            f"{m['resume_step']}/{m['steps']}",
            str(m["lost_steps"]),
            m["why"],
        )
    return table


def verdicts_table(rows: list[dict[str, Any]], title: str = "migration verdicts") -> Table:
    """A table of migration verdicts (``loom migrations --verdicts``, ``loom job ID``, ``loom
    explain ID``): moved or not, the trigger, gain, cost, threshold (cost + margin), the net
    (gain − threshold: what is left over the threshold; the why's "margin" is the rule's margin in
    the threshold) and why — a cool-down or a rate-limit refusal says so."""
    table = Table(title=title)
    for col in (
        "at",
        "job",
        "trigger",
        "link",
        "decision",
        "from",
        "to",
        "gain s",
        "cost s",
        "threshold s",
        "net s",
        "why",
    ):
        table.add_column(col)

    def num(value: Any) -> str:
        return "-" if value is None else f"{float(value):.0f}"

    for v in rows:
        table.add_row(
            datetime.fromtimestamp(v["at"]).strftime("%H:%M:%S"),
            v["job_id"],
            v["trigger"],
            v["link"] or "-",
            v["decision"],
            v["source"],
            v.get("target") or "-",
            num(v.get("gain_s")),
            num(v.get("cost_s")),
            num(v.get("threshold_s")),
            num(v.get("margin_s")),
            v["reason"],
        )
    return table


def replicas_table(rows: list[dict[str, Any]], title: str = "checkpoint replicas") -> Table:
    """A table of checkpoint replicas (``loom migrations --replicas``, ``loom job ID``): where each
    lies, of which step, the bytes its copy sent (full or delta) and what it holds."""
    table = Table(title=title)
    for col in (
        "requested",
        "job",
        "attempt",
        "step",
        "from",
        "in",
        "state",
        "copy",
        "sent GB",
        "held GB",
        "s",
    ):
        table.add_column(col)
    for r in rows:
        table.add_row(
            datetime.fromtimestamp(r["requested_at"]).strftime("%H:%M:%S"),
            r["job_id"],
            str(r["attempt"]),
            str(r["step"]),
            r["source_cluster"],
            r["cluster"],
            r["state"] + (" (corrupt)" if r.get("corrupt") else ""),
            "full" if r["full_copy"] else f"delta on {r['base_step']}",
            f"{r['transfer_bytes'] / 1e9:.3g}",
            f"{r['stored_bytes'] / 1e9:.3g}",
            f"{float(r['transfer_s']):.2f}",
        )
    return table
