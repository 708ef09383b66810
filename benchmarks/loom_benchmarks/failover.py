"""``loom bench failover``: SIGKILL a cluster's agent and blackhole its probe endpoints while it runs
at least 50 jobs; how fast and how well Loom moves them, and what happens when the cluster returns.

A private stack (``loom up``'s services, the probe collectors and network perception included, in a
temporary home) runs every cluster of the topology; the victim's agent is started by this program
(the same command line ``loom up`` uses, its journal in the stack's home) so that, once killed, it
stays dead until the benchmark brings it back. Jobs are submitted with a soft preference for the
victim's region: one-GPU jobs, single-cluster gangs, a gang too wide for any one cluster (it spans
the victim and another cluster) and a pipeline. Once they run and have passed a checkpoint, the
victim's agent is SIGKILLed and every emulated link into its region drops all probes (``loom net
degrade … --loss 1``). Measured:

* ``detection_s``: kill → placement classifies the cluster failed (its health answer's time);
* ``all_replaced_s``: kill → every affected job (any part on the victim) runs again elsewhere at
  its next attempt (its run confirmed ``running``);
* per affected job, the progress lost: the steps its old run had reported done past the step the
  next run resumed from (``lost_steps``: a lower bound, agents report progress every tenth of the
  work), and the work redone (``redone_steps``: those steps plus what the old run computed between
  its last report and the kill, at the pace of its own reports), against the job's checkpoint
  interval;
* ``jobs_lost``: affected jobs not running again by the timeout (or failed);
* ``runs_doubled``: a job with more than one live run on the agents (their ``running_keys``), right
  after the re-placement and again after the victim's agent returns with its journal (its
  orphaned runs must be stopped by its attempt check), plus any report of an old attempt stored
  after the return.

Defaults are ``loom up``'s (heartbeats 2-10 s, placement's failover TTL 10 s, probes every 1 s);
``--max-heartbeat-s`` shortens the calm heartbeat interval, which bounds the detection time.
"""

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import asyncpg

from loom.client import LoomClient
from loom.model.topology import load_topology
from loom.runtime import stack
from loom.runtime.config import ENV_DATABASE_URL, ENV_HOME, ENV_NATS_URL
from loom_benchmarks.private_stack import wait_for_cluster_gpus
from loom_benchmarks.secured import stack_security
from loom_benchmarks.takeover import p50_max_mean
from loom_proto import subjects
from loom_proto.jobs import Affinity, JobSpec, Layer, Pipeline, Resources, Work

TARGET_S = 10.0
"""All affected jobs re-placed within this long after the kill (issue 15's target)."""

CHECKPOINT_EVERY_STEPS = 10
"""The workload's checkpoint interval (of 100 steps): the bound on progress lost."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``loom bench failover``."""
    parser.add_argument("--cluster", default="c-aue-a", help="the cluster whose agent is killed")
    parser.add_argument("--topology", default="default")
    parser.add_argument("--singles", type=int, default=44, help="one-GPU jobs")
    parser.add_argument("--gangs", type=int, default=6, help="single-cluster gangs of 4 workers")
    parser.add_argument("--time-scale", type=float, default=60.0, help="simulated seconds per wall second")
    parser.add_argument("--heartbeat-s", type=float, default=2.0, help="agents' shortest heartbeat interval")
    parser.add_argument("--max-heartbeat-s", type=float, default=10.0, help="agents' longest (calm) interval")
    parser.add_argument("--timeout", type=float, default=90.0, help="seconds to wait for the re-placement")
    parser.add_argument("--json", action="store_true", help="print only the JSON result on stdout")
    parser.add_argument(
        "--keep-logs", default="", help="copy the stack's logs here before its home is removed (diagnosis)"
    )


def _jobs(args: argparse.Namespace, region: str) -> list[JobSpec]:
    """The workload: every job prefers the victim's region, checkpoints every 10 of its 100 steps."""
    # 100 steps of one wall second each (100 s in all); a checkpoint every 10 s.
    work = Work(steps=100, step_time_s=float(args.time_scale), checkpoint_every_steps=CHECKPOINT_EVERY_STEPS)
    prefer = Affinity(prefer_regions=[region])
    t4 = Resources(gpus=1, gpu_models=["T4"])
    jobs = [
        JobSpec(job_id=f"fo-single-{i}", tenant="bench", resources=t4, work=work, affinity=prefer)
        for i in range(args.singles)
    ]
    jobs += [
        JobSpec(job_id=f"fo-gang-{i}", tenant="bench", workers=4, resources=t4, work=work, affinity=prefer)
        for i in range(args.gangs)
    ]
    # Wider than any one cluster's P100s: spans the victim and another cluster.
    jobs.append(
        JobSpec(
            job_id="fo-cross-gang",
            tenant="bench",
            workers=120,
            allow_multi_cluster=True,
            resources=Resources(gpus=1, gpu_models=["P100"]),
            work=work,
            affinity=prefer,
        )
    )
    layers = [Layer(compute_s=0.2, memory_gib=10.0, activation_mb=5.0) for _ in range(4)]
    jobs.append(
        JobSpec(
            job_id="fo-pipeline",
            tenant="bench",
            resources=Resources(gpus=1, gpu_models=["T4"]),
            pipeline=Pipeline(layers=layers, max_stages=2),
            work=work,
            # Kept to the victim's region and one other (scored, it would go anywhere): it runs
            # on the victim, or across it, and has somewhere to go when the victim fails.
            affinity=Affinity(regions=[region, _partner_region(region)], prefer_regions=[region]),
        )
    )
    return jobs


def _partner_region(region: str) -> str:
    """Where the pipeline may go besides the victim's region (its T4s, in the default topology)."""
    return "aws-us-east-2" if region != "aws-us-east-2" else "azure-westeurope"


async def _placement_health(client: LoomClient) -> dict[str, Any]:
    for name in ("placement", "placement-standby"):
        with contextlib.suppress(Exception):
            reply = await client.nc.request(subjects.service_health(name), b"", timeout=1.0)
            stats: dict[str, Any] = json.loads(reply.data)
            if stats.get("leadership", {}).get("leading") or stats.get("failover", {}).get("failed"):
                return stats
    return {}


async def _running_keys(client: LoomClient, clusters: list[str]) -> dict[str, list[str]]:
    """Every agent's live runs (``job:attempt``), by cluster."""
    out: dict[str, list[str]] = {}
    for cluster in clusters:
        with contextlib.suppress(Exception):
            reply = await client.nc.request(subjects.service_health(f"agent-{cluster}"), b"", timeout=1.0)
            out[cluster] = list(json.loads(reply.data).get("running_keys", []))
    return out


def _doubled(keys: dict[str, list[str]]) -> list[str]:
    """Jobs live on the agents at two attempts at once (a gang's parts share one attempt's key)."""
    attempts: dict[str, set[str]] = {}
    for runs in keys.values():
        for key in runs:
            job_id, _, attempt = key.rpartition(":")
            attempts.setdefault(job_id, set()).add(attempt)
    return sorted(j for j, a in attempts.items() if len(a) > 1)


async def _measure(state: dict[str, Any], home: Path, args: argparse.Namespace, say: Any) -> dict[str, Any]:  # noqa: PLR0912, PLR0915  # one scripted scenario
    topology = load_topology(args.topology)
    victim = topology.cluster(args.cluster)
    region = victim.region
    env = dict(
        os.environ,
        **{ENV_NATS_URL: state["nats_url"], ENV_DATABASE_URL: state["database_url"], ENV_HOME: str(home)},
    )
    argv = stack.service_argvs(_options(args, [victim.id]))[f"agent-{victim.id}"]
    # The benchmark's own process, not a server: blocking calls here cost nothing measured.
    log = open(home / "logs" / f"agent-{victim.id}.log", "ab")  # noqa: SIM115, ASYNC230  # both runs
    agent = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)  # noqa: ASYNC220
    client = await LoomClient.connect(state["nats_url"])
    db = await asyncpg.connect(state["database_url"])
    result: dict[str, Any] = {}
    try:
        say("waiting for the victim's capacity")
        await wait_for_cluster_gpus(db, victim.id, 1)
        jobs = _jobs(args, region)
        for spec in jobs:
            await client.submit(spec)
        say(f"{len(jobs)} jobs submitted; waiting for them to run and pass a checkpoint")
        ids = [j.job_id for j in jobs]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            rows = await db.fetch("SELECT state, progress FROM jobs WHERE job_id = ANY($1::text[])", ids)
            running = [r for r in rows if r["state"] == "running"]
            if len(running) == len(ids) and min(r["progress"] for r in running) >= 0.15:
                break
            await asyncio.sleep(0.5)
        affected_rows = await db.fetch(
            """SELECT DISTINCT j.job_id, j.attempt, j.cluster AS lead FROM jobs j JOIN reservations r
                 ON r.job_id = j.job_id AND r.attempt = j.attempt AND r.state <> 'released'
               WHERE j.state = 'running' AND r.cluster = $1""",
            victim.id,
        )
        affected = {r["job_id"]: r["attempt"] for r in affected_rows}
        kinds = {
            "singles": sum(1 for j in affected if j.startswith("fo-single")),
            "gangs": sum(1 for j in affected if j.startswith("fo-gang")),
            "cross_cluster_gang": "fo-cross-gang" in affected,
            "pipeline": "fo-pipeline" in affected,
        }
        spans = await db.fetch(
            """SELECT job_id, array_agg(DISTINCT cluster) AS clusters FROM reservations
               WHERE job_id = ANY($1::text[]) AND state <> 'released' GROUP BY job_id""",
            ["fo-cross-gang", "fo-pipeline"],
        )
        result["workload"] = {
            "submitted": len(jobs),
            "affected": len(affected),
            "affected_kinds": kinds,
            "clusters_of": {r["job_id"]: sorted(r["clusters"]) for r in spans},
        }
        # A failed cluster's checkpoints go with it: a job resumes from its replica in another
        # cluster (the migration service copies each latest checkpoint in the background). Wait
        # for every affected job to hold one (60 s at most: a wide gang's first full copy over a
        # slow link takes a while), as a cluster that has run a while does.
        waited = time.monotonic()
        replicated = 0
        while time.monotonic() - waited < 60:
            replicated = await db.fetchval(
                """SELECT count(DISTINCT r.job_id) FROM checkpoint_replicas r JOIN jobs j
                     ON j.job_id = r.job_id AND j.attempt = r.attempt
                   WHERE r.job_id = ANY($1::text[]) AND r.state = 'ready'""",
                list(affected),
            )
            if replicated >= len(affected):
                break
            await asyncio.sleep(0.5)
        result["replicas_before_kill"] = {
            "jobs_with_a_replica": replicated,
            "waited_s": round(time.monotonic() - waited, 2),
        }
        say(f"{len(affected)} jobs on {victim.id}: SIGKILL its agent, blackhole {region}")
        killed = time.time()
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait()
        blackholed = []
        for other in sorted({c.region for c in topology.clusters} - {region}):
            with contextlib.suppress(Exception):
                await client.net_emulate(other, region, {"op": "degrade", "loss": 1.0})
                blackholed.append(other)
        result["blackholed_from"] = blackholed

        detection_s: float | None = None
        suspect_s: float | None = None
        replaced_s: float | None = None
        end = time.monotonic() + args.timeout
        while time.monotonic() < end:
            health = await _placement_health(client)
            failover = health.get("failover", {})
            if suspect_s is None and victim.id in failover.get("health", {}):
                suspect_s = time.time() - killed
            if detection_s is None and victim.id in failover.get("failed", {}):
                detection_s = float(failover["failed"][victim.id]["at"]) - killed
                result["failed_reason"] = failover["failed"][victim.id]["reason"]
            rows = await db.fetch(
                "SELECT job_id, state, attempt FROM jobs WHERE job_id = ANY($1::text[])", list(affected)
            )
            moved = [r for r in rows if r["state"] == "running" and r["attempt"] > affected[r["job_id"]]]
            if len(moved) == len(affected):
                replaced_s = time.time() - killed
                break
            await asyncio.sleep(0.2)
        result["detection_s"] = None if detection_s is None else round(detection_s, 3)
        result["first_unhealthy_seen_s"] = None if suspect_s is None else round(suspect_s, 3)
        result["all_replaced_s"] = None if replaced_s is None else round(replaced_s, 3)

        # Progress lost per job: steps the old run reported done past the next run's resume step
        # (a lower bound), and the work redone: those steps plus what the old run computed between
        # its last report and the kill, at the pace its own reports show.
        lost: dict[str, dict[str, Any]] = {}
        for job_id, attempt in affected.items():
            row = await db.fetchrow(
                "SELECT state, attempt, resume_step, spec FROM jobs WHERE job_id = $1", job_id
            )
            reports = await db.fetch(
                """SELECT (event->>'step')::int AS step, (event->>'at')::float8 AS at FROM job_events
                   WHERE job_id = $1 AND kind = 'progress' AND (event->>'attempt')::int = $2
                   ORDER BY 1""",
                job_id,
                attempt,
            )
            spec = json.loads(row["spec"])
            every = int(spec["work"]["checkpoint_every_steps"])
            done = reports[-1]["step"] if reports else 0
            redone = float(max(done - row["resume_step"], 0))
            if reports:
                first, last = reports[0], reports[-1]
                if last["at"] > first["at"]:
                    pace = (last["step"] - first["step"]) / (last["at"] - first["at"])
                else:  # one report: the nominal pace, a step every step_time_s simulated seconds
                    pace = args.time_scale / float(spec["work"]["step_time_s"])
                redone += pace * max(killed - last["at"], 0.0)
            lost[job_id] = {
                "state": row["state"],
                "attempt": row["attempt"],
                "reported_step": done,
                "resume_step": row["resume_step"],
                "lost_steps": max(done - row["resume_step"], 0),
                "redone_steps": round(redone, 2),
                "checkpoint_every_steps": every,
            }
        lost_steps = [float(v["lost_steps"]) for v in lost.values()]
        result["progress_lost_steps"] = p50_max_mean(lost_steps)
        result["work_redone_steps"] = p50_max_mean([float(v["redone_steps"]) for v in lost.values()])
        result["within_one_checkpoint_interval"] = sum(
            1 for v in lost.values() if v["lost_steps"] <= v["checkpoint_every_steps"]
        )
        result["redone_within_one_checkpoint_interval"] = sum(
            1 for v in lost.values() if v["redone_steps"] <= v["checkpoint_every_steps"]
        )
        result["resumed_from_step_0"] = sorted(j for j, v in lost.items() if v["resume_step"] == 0)
        result["not_replaced_by_timeout"] = sorted(
            j
            for j, v in lost.items()
            if not (v["state"] in ("running", "completed") and v["attempt"] > affected[j])
        )
        clusters = [c.id for c in topology.clusters]
        result["runs_doubled_after_replacement"] = _doubled(await _running_keys(client, clusters))
        result["not_replaced_detail"] = await _stuck_detail(db, result["not_replaced_by_timeout"])

        say("the victim's agent returns with its journal")
        for other in blackholed:
            with contextlib.suppress(Exception):
                await client.net_emulate(other, region, {"op": "restore"})
        returned_at = time.time()
        agent = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)  # noqa: ASYNC220
        back: dict[str, Any] = {}
        for _ in range(100):
            with contextlib.suppress(Exception):
                reply = await client.nc.request(
                    subjects.service_health(f"agent-{victim.id}"), b"", timeout=1.0
                )
                back = json.loads(reply.data)
                break
            await asyncio.sleep(0.2)
        await asyncio.sleep(3.0)
        keys = await _running_keys(client, clusters)
        result["after_return"] = {
            "orphans_stopped_by_attempt_check": back.get("orphans_stopped", 0),
            "victim_live_runs": len(keys.get(victim.id, [])),
            "runs_doubled": _doubled(keys),
            "old_attempt_reports_stored_after_return": await db.fetchval(
                """SELECT count(*) FROM job_events e JOIN jobs j ON j.job_id = e.job_id
                   WHERE e.job_id = ANY($1::text[]) AND e.at > to_timestamp($2)
                     AND (e.event->>'attempt')::int < j.attempt
                     AND e.kind IN ('progress', 'checkpointed', 'completed')""",
                list(affected),
                returned_at,
            ),
        }
        # Lost: an affected job the platform no longer runs nor queues (failed, cancelled, gone).
        states = dict(
            await db.fetch("SELECT job_id, state FROM jobs WHERE job_id = ANY($1::text[])", list(affected))
        )
        live = ("queued", "placed", "running", "completed")
        result["jobs_lost"] = sorted(j for j in affected if states.get(j) not in live)
        result["final_states"] = {
            s: sum(1 for v in states.values() if v == s) for s in sorted(set(states.values()))
        }
        failed_over = {
            r["job_id"]
            for r in await db.fetch(
                "SELECT DISTINCT job_id FROM migrations WHERE cause = 'failover' AND from_cluster = $1",
                victim.id,
            )
        }
        result["migrations_recorded"] = await db.fetchval(
            "SELECT count(*) FROM migrations WHERE cause = 'failover' AND from_cluster = $1", victim.id
        )
        # The README says one failover migration per affected job: which had none, and what it has.
        result["affected_without_migration"] = {
            j: [
                dict(r)
                for r in await db.fetch(
                    "SELECT migration_id, cause, state, from_cluster, to_cluster FROM migrations"
                    " WHERE job_id = $1",
                    j,
                )
            ]
            for j in sorted(set(affected) - failed_over)
        }
        result["per_job"] = lost
    finally:
        with contextlib.suppress(ProcessLookupError):
            agent.terminate()
        with contextlib.suppress(Exception):
            agent.wait(timeout=10)
        log.close()
        await db.close()
        await client.close()
    return result


async def _stuck_detail(db: asyncpg.Connection, job_ids: list[str]) -> dict[str, Any]:
    """For each job not running again by the timeout: its row, its reservations and its latest
    events (the store goes with the benchmark's home; this is what a diagnosis needs)."""
    out: dict[str, Any] = {}
    for job_id in job_ids:
        row = await db.fetchrow(
            "SELECT state, attempt, cluster, resume_step, progress, reason FROM jobs WHERE job_id = $1",
            job_id,
        )
        reservations = await db.fetch(
            """SELECT attempt, cluster, state, count(*) AS parts FROM reservations WHERE job_id = $1
               GROUP BY attempt, cluster, state ORDER BY attempt, cluster""",
            job_id,
        )
        events = await db.fetch(
            """SELECT kind, at, event FROM job_events WHERE job_id = $1 AND kind <> 'progress'
               ORDER BY id DESC LIMIT 12""",
            job_id,
        )
        out[job_id] = {
            "job": None if row is None else dict(row),
            "reservations": [dict(r) for r in reservations],
            "events": [
                {"kind": e["kind"], "at": e["at"].timestamp(), "event": json.loads(e["event"])}
                for e in reversed(events)
            ],
        }
    return out


def _options(args: argparse.Namespace, clusters: list[str]) -> stack.StackOptions:
    return stack.StackOptions(
        topology=args.topology,
        clusters=clusters,
        time_scale=args.time_scale,
        heartbeat_s=args.heartbeat_s,
        max_heartbeat_s=args.max_heartbeat_s,
        network=True,
    )


def run(args: argparse.Namespace, progress: Any = None) -> dict[str, Any]:
    """Start a private stack, run the scenario, stop it; the JSON result."""
    say = progress or (lambda _s: None)
    topology = load_topology(args.topology)
    others = [c.id for c in topology.clusters if c.id != args.cluster]
    home = Path(tempfile.mkdtemp(prefix="loom-bench-failover-", dir="/tmp"))
    os.chmod(home, 0o755)  # PostgreSQL runs as an unprivileged user when we are root
    env_backup = {k: os.environ.pop(k) for k in (ENV_NATS_URL, ENV_DATABASE_URL) if k in os.environ}
    started = time.perf_counter()
    try:
        say("starting the stack")
        state = stack.up(home, _options(args, others), progress=lambda s: say(f"stack: {s}"))
        measured = asyncio.run(_measure(state, home, args, say))
        security = stack_security(home)
    finally:
        say("stopping the stack")
        stack.down(home)
        if args.keep_logs:
            shutil.copytree(home / "logs", Path(args.keep_logs), dirs_exist_ok=True)
        os.environ.update(env_backup)
        shutil.rmtree(home, ignore_errors=True)
    replaced = measured.get("all_replaced_s")
    after = measured.get("after_return", {})
    return {
        "benchmark": "failover",
        "security": security,
        "headline": {
            "affected_jobs": measured["workload"]["affected"],
            "detection_s": measured.get("detection_s"),
            "all_replaced_s": replaced,
            "target_s": TARGET_S,
            "met": replaced is not None and replaced <= TARGET_S,
            "progress_lost_steps_max": measured["progress_lost_steps"]["max"],
            "work_redone_steps_max": measured["work_redone_steps"]["max"],
            "checkpoint_every_steps": CHECKPOINT_EVERY_STEPS,
            "jobs_lost": len(measured["jobs_lost"]),
            "not_replaced_by_timeout": len(measured["not_replaced_by_timeout"]),
            "runs_doubled": len(measured["runs_doubled_after_replacement"])
            + len(after.get("runs_doubled", [])),
        },
        "settings": {
            "cluster": args.cluster,
            "time_scale": args.time_scale,
            "heartbeat_s": args.heartbeat_s,
            "max_heartbeat_s": args.max_heartbeat_s,
            "placement_failover_ttl_s": 10.0,
            "probe_period_s": 1.0,
        },
        **measured,
        "wall_s": round(time.perf_counter() - started, 1),
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
    }


def main(args: argparse.Namespace) -> int:
    """``loom bench failover``: JSON on stdout, a summary on stderr unless ``--json``; progress on stderr."""
    from rich.console import Console

    console = Console(stderr=True)
    with console.status("failover benchmark…") as status:
        result = run(args, progress=lambda s: status.update(f"failover benchmark: {s}"))
    print(json.dumps(result, indent=2))
    if not args.json:
        h = result["headline"]
        met = "met" if h["met"] else "missed"
        console.print(
            f"{h['affected_jobs']} jobs on {args.cluster}: failed after {h['detection_s']} s,"
            f" all re-placed after {h['all_replaced_s']} s (target {h['target_s']} s: {met}),"
            f" lost {h['jobs_lost']}, doubled {h['runs_doubled']},"
            f" progress lost {h['progress_lost_steps_max']} steps reported,"
            f" {h['work_redone_steps_max']} redone (checkpoint interval {h['checkpoint_every_steps']})"
        )
    sys.stdout.flush()
    return 0
