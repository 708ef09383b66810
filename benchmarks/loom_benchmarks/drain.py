"""``loom bench drain``: drain a cluster running ``--jobs`` jobs on the real stack; does it empty,
with at most ``--concurrency`` moves in flight, and does any job restart from step 0?

A private stack (``loom up``'s services, without the probe collectors) runs every cluster of the
topology; one-GPU T4 jobs (and four-worker gangs) that prefer the drained cluster's region run
until they have passed a checkpoint, then the cluster is drained through the migration service
(the request ``loom drain`` sends). Measured from the store: the drain's duration, the most moves
in flight at any instant (from the migrations' planned/finished times), each move's record
(``moves``), each job's resume step against the step it had reached, and a new job submitted
right after the drain's answer (it must never be placed on the drained cluster, at any attempt).
The jobs are submitted once placement's view holds the cluster's T4 GPUs (its agent's heartbeats
taken in); a run in which no job landed there measures nothing: ``outcome`` is
``nothing_on_cluster`` and the exit status 1. A drain that has not emptied by ``--timeout`` says
why: ``outcome`` is ``drained``,
``waiting_for_capacity`` (jobs no placement on another open cluster has room for stay running
where they are, each listed in ``waiting_for_capacity`` with what it needs and the migration
service's reason) or ``timeout`` (moves still in flight).
"""

import argparse
import asyncio
import json
import os
import sys
import time
from typing import Any

import asyncpg
import msgspec

from loom.client import LoomClient
from loom.model.topology import TopologyError, load_topology
from loom_benchmarks.private_stack import measure_on_private_stack, wait_for_cluster_gpus
from loom_benchmarks.takeover import p50_max_mean
from loom_proto import subjects
from loom_proto.jobs import Affinity, JobSpec, Resources, Work


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``loom bench drain``."""
    parser.add_argument("--cluster", default="c-aue-a", help="the cluster drained")
    parser.add_argument("--topology", default="default")
    parser.add_argument("--jobs", type=int, default=20, help="jobs on the cluster (4 of them gangs of 4)")
    parser.add_argument("--concurrency", type=int, default=3, help="moves in flight at once")
    parser.add_argument("--time-scale", type=float, default=60.0)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the drain")
    parser.add_argument("--json", action="store_true", help="print only the JSON result on stdout")
    parser.add_argument(
        "--keep-logs", default="", help="copy the stack's logs here before its home is removed (diagnosis)"
    )


async def _wait_for_cluster(db: asyncpg.Connection, cluster: str, t4_gpus: int, say: Any) -> int:
    """Wait (up to 60 s) until placement's view holds every T4 GPU of ``cluster`` (its nodes'
    rows in ``node_allocations``, written as its agent's heartbeats are taken in); the GPUs seen.
    Submitted before, the jobs would all be placed on the clusters that were seen, and the drained
    cluster would have nothing to move."""
    say(f"waiting for {cluster}'s {t4_gpus} T4 GPUs in placement's view")
    seen = await wait_for_cluster_gpus(db, cluster, t4_gpus, gpu_model="T4")
    if seen < t4_gpus:
        say(f"{cluster}: {seen} of its {t4_gpus} T4 GPUs in placement's view after 60 s; going on")
    return seen


def _jobs(args: argparse.Namespace, region: str) -> list[JobSpec]:
    """``--jobs`` one-GPU T4 jobs preferring ``region``, 4 of them gangs of 4 workers: 200 steps of
    ``--time-scale`` seconds each (one wall second), a checkpoint every 10."""
    work = Work(steps=200, step_time_s=float(args.time_scale), checkpoint_every_steps=10)
    t4 = Resources(gpus=1, gpu_models=["T4"])
    prefer = Affinity(prefer_regions=[region])
    gangs = min(4, args.jobs)
    jobs = [
        JobSpec(job_id=f"dr-gang-{i}", tenant="bench", workers=4, resources=t4, work=work, affinity=prefer)
        for i in range(gangs)
    ]
    jobs += [
        JobSpec(job_id=f"dr-{i}", tenant="bench", resources=t4, work=work, affinity=prefer)
        for i in range(args.jobs - gangs)
    ]
    return jobs


def _outcome(jobs_on_cluster: bool, drained_s: float | None, waiting: bool) -> str:
    """How the drain ended: ``nothing_on_cluster`` when no job ran there (no drain was measured),
    then ``drained``, ``waiting_for_capacity`` or ``timeout``."""
    if not jobs_on_cluster:
        return "nothing_on_cluster"
    if drained_s is not None:
        return "drained"
    return "waiting_for_capacity" if waiting else "timeout"


async def _measure(state: dict[str, Any], args: argparse.Namespace, say: Any) -> dict[str, Any]:
    cluster = load_topology(args.topology).cluster(args.cluster)
    region = cluster.region
    client = await LoomClient.connect(state["nats_url"])
    db = await asyncpg.connect(state["database_url"])
    try:
        t4_seen = await _wait_for_cluster(db, args.cluster, cluster.gpus_by_model().get("T4", 0), say)
        jobs = _jobs(args, region)
        for spec in jobs:
            await client.submit(spec)
        ids = [j.job_id for j in jobs]
        say(f"{len(jobs)} jobs submitted; waiting for them to pass a checkpoint")
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            rows = await db.fetch("SELECT state, progress FROM jobs WHERE job_id = ANY($1::text[])", ids)
            if len(rows) == len(ids) and all(r["state"] == "running" and r["progress"] >= 0.06 for r in rows):
                break
            await asyncio.sleep(0.5)
        on = await db.fetch(
            """SELECT DISTINCT j.job_id, j.attempt, j.progress FROM jobs j JOIN reservations r
                 ON r.job_id = j.job_id AND r.attempt = j.attempt AND r.state <> 'released'
               WHERE j.state = 'running' AND r.cluster = $1""",
            args.cluster,
        )
        reached = {r["job_id"]: int(r["progress"] * 200 + 1e-6) for r in on}
        say(f"draining {args.cluster} ({len(on)} jobs), {args.concurrency} at a time")
        started = time.time()
        reply = await client.nc.request(
            subjects.MIGRATE_DRAIN,
            json.dumps({"cluster": args.cluster, "concurrency": args.concurrency}).encode(),
            timeout=10,
        )
        answer = json.loads(reply.data)
        await client.submit(msgspec.structs.replace(jobs[-1], job_id="dr-late", workers=1))
        sampled_in_flight = 0
        drained_s: float | None = None
        while time.time() - started < args.timeout:
            open_now = await db.fetchval(
                "SELECT count(*) FROM migrations WHERE state IN ('planned', 'started')"
            )
            sampled_in_flight = max(sampled_in_flight, int(open_now))
            state_now = await db.fetchval("SELECT state FROM cluster_drains WHERE cluster = $1", args.cluster)
            if state_now == "drained":
                drained_s = time.time() - started
                break
            await asyncio.sleep(0.1)
        rows = await db.fetch("SELECT * FROM migrations WHERE cause = 'drain' ORDER BY planned_at")
        overlap = _max_overlap(rows)
        per_move = [
            (r["finished_at"] - r["planned_at"]).total_seconds() for r in rows if r["finished_at"] is not None
        ]
        drains = await client.nc.request(
            subjects.MIGRATE_QUERY, json.dumps({"op": "drains"}).encode(), timeout=10
        )
        mine = [d for d in json.loads(drains.data).get("result", []) if d["cluster"] == args.cluster]
        waiting = [
            {k: w[k] for k in ("job_id", "needs", "why")}
            for w in (mine[0].get("waiting", []) if mine else [])
        ]
        outcome = _outcome(bool(on), drained_s, bool(waiting))
        late = await db.fetchrow("SELECT state, cluster FROM jobs WHERE job_id = 'dr-late'")
        late_there = await db.fetchval(  # placed there at any attempt (a drain would have moved it off)
            "SELECT count(*) > 0 FROM reservations WHERE job_id = 'dr-late' AND cluster = $1", args.cluster
        )
        resumed = {r["job_id"]: r["resume_step"] for r in rows}
        return {
            "drain_answer": answer,
            "outcome": outcome,
            "waiting_for_capacity": waiting,
            "jobs_on_cluster": len(on),
            "cluster_t4_gpus_seen": t4_seen,
            "moved": sum(1 for r in rows if r["state"] == "completed"),
            "jobs_moved": len({r["job_id"] for r in rows if r["state"] == "completed"}),
            "moves": [_move_record(r, started) for r in rows],
            "states": {s: sum(1 for r in rows if r["state"] == s) for s in {r["state"] for r in rows}},
            "drained_s": None if drained_s is None else round(drained_s, 3),
            "max_in_flight_from_records": overlap,
            "max_in_flight_sampled": sampled_in_flight,
            "concurrency": args.concurrency,
            "move_s": p50_max_mean(per_move),
            "resumed_from_step_0": sorted(j for j, s in resumed.items() if s == 0),
            "resume_step_minus_reached": p50_max_mean(
                [float(resumed[j] - reached[j]) for j in resumed if j in reached]
            ),
            "late_job": dict(late) if late else None,
            "late_job_on_drained_cluster": bool(late_there),
        }
    finally:
        await db.close()
        await client.close()


def _move_record(row: asyncpg.Record, t0: float) -> dict[str, Any]:
    """One drain move as the store has it, its times in seconds after the drain request."""

    def at(column: str) -> float | None:
        value = row[column]
        return None if value is None else round(value.timestamp() - t0, 3)

    return {
        "job_id": row["job_id"],
        "from_attempt": row["from_attempt"],
        "state": row["state"],
        "to_cluster": row["to_cluster"],
        "resume_step": row["resume_step"],
        "planned_s": at("planned_at"),
        "started_s": at("started_at"),
        "finished_s": at("finished_at"),
        "why": row["why"],
    }


def _max_overlap(rows: list[asyncpg.Record]) -> int:
    """The most moves open (planned, not yet finished) at any move's planning instant."""
    best = 0
    for r in rows:
        t = r["planned_at"]
        best = max(
            best,
            sum(
                1 for o in rows if o["planned_at"] <= t and (o["finished_at"] is None or o["finished_at"] > t)
            ),
        )
    return best


def run(args: argparse.Namespace, progress: Any = None) -> dict[str, Any]:
    """Start a private stack, drain, stop it; the JSON result."""
    say = progress or (lambda _s: None)
    t0 = time.perf_counter()
    measured = measure_on_private_stack("drain", args, _measure, say, keep_logs=args.keep_logs)
    return {
        "benchmark": "drain",
        "headline": {
            "jobs_on_cluster": measured["jobs_on_cluster"],
            "moved": measured["moved"],
            "jobs_moved": measured["jobs_moved"],
            "outcome": measured["outcome"],
            "waiting_for_capacity": len(measured["waiting_for_capacity"]),
            "drained_s": measured["drained_s"],
            "max_in_flight": measured["max_in_flight_from_records"],
            "concurrency": args.concurrency,
            "restarted_from_step_0": len(measured["resumed_from_step_0"]),
        },
        **measured,
        "wall_s": round(time.perf_counter() - t0, 1),
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
    }


def main(args: argparse.Namespace) -> int:
    """``loom bench drain``: JSON on stdout; progress on stderr."""
    from rich.console import Console

    console = Console(stderr=True)
    try:  # before any stack starts
        topology = load_topology(args.topology)
    except (OSError, TopologyError) as exc:
        console.print(f"--topology {args.topology}: {exc}")
        return 2
    try:
        drained = topology.cluster(args.cluster)
    except TopologyError as exc:
        console.print(f"{exc}: name one with --cluster")
        return 2
    if args.jobs < 1:
        console.print(f"--jobs must be at least 1, got {args.jobs}")
        return 2
    if not drained.gpus_by_model().get("T4"):
        with_t4 = [c.id for c in topology.clusters if c.gpus_by_model().get("T4")]
        console.print(
            f"cluster {args.cluster} has no T4 GPUs, and the bench's jobs run on T4s: name one that has"
            f" with --cluster ({', '.join(with_t4) or 'none in this topology'})"
        )
        return 2
    with console.status("drain benchmark…") as status:
        result = run(args, progress=lambda s: status.update(f"drain benchmark: {s}"))
    print(json.dumps(result, indent=2, default=str))
    if not args.json:
        console.print(result["headline"])
    sys.stdout.flush()
    if result["headline"]["outcome"] == "nothing_on_cluster":
        console.print(f"no job ran on {args.cluster} when the drain was asked: nothing was measured")
        return 1
    return 0
