"""``loom bench e2e --slurm``: submit → running in Slurm, through the real stack on real Slurm.

A private stack (``loom up --slurm`` in a temporary home: its own NATS, PostgreSQL, services and
two local Slurm clusters standing in for the small topology's c-weu-a and c-sea1-a) is started;
jobs of one GPU are submitted at a steady rate, each running about a second in Slurm. For each job
the client times, on one clock, its publish, the arrival of its ``placed`` event, and the arrival
of its ``started`` event, which the agent sends when Slurm reports the job RUNNING on the node
Loom chose (it polls ``scontrol`` every ``poll_s``, 0.5 s). Reported: p50 / p99 / max of
submit → placed, placed → running and submit → running, and how many jobs never ran; then, for the
floor under them, Slurm alone (``sbatch`` → RUNNING in ``scontrol``, 10 jobs, no Loom).
"""

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from loom.client import LoomClient
from loom.runtime import stack
from loom_benchmarks.e2e import _percentile
from loom_benchmarks.secured import stack_security
from loom_proto import subjects
from loom_proto.jobs import JobSpec, Resources, Work

CLUSTERS = ["c-weu-a", "c-sea1-a"]
TIME_SCALE = 100.0


def _stats(values: list[float]) -> dict[str, float]:
    return {
        "p50_ms": round(_percentile(values, 50) * 1000, 1),
        "p99_ms": round(_percentile(values, 99) * 1000, 1),
        "max_ms": round(max(values, default=float("nan")) * 1000, 1),
    }


async def _measure(nats_url: str, jobs: int, rate: float) -> dict[str, Any]:
    client = await LoomClient.connect(nats_url)
    sent: dict[str, float] = {}
    placed: dict[str, float] = {}
    started: dict[str, float] = {}
    all_ran = asyncio.Event()

    def recorder(into: dict[str, float]) -> Any:
        async def on(msg: Any) -> None:
            job_id = _job_id(msg.data)
            into.setdefault(job_id, time.perf_counter())
            if len(started) >= jobs:
                all_ran.set()

        return on

    try:
        await client.nc.subscribe(subjects.JOBS_PLACED_ALL, cb=recorder(placed))
        await client.nc.subscribe(subjects.job_reports("started", "bench"), cb=recorder(started))
        for i in range(jobs):
            spec = JobSpec(
                job_id=f"slurm-{i}",
                tenant="bench",
                resources=Resources(gpus=1),
                work=Work(steps=5, step_time_s=20.0),  # 100 simulated s: 1 s at 100x
            )
            sent[spec.job_id] = time.perf_counter()
            await client.submit(spec)
            await asyncio.sleep(1 / rate)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(all_ran.wait(), timeout=60)
        missing = {}
        for job_id in [j for j in sent if j not in started][:10]:
            job = await client.job(job_id)
            missing[job_id] = (
                {"state": job["state"], "reason": job["reason"], "events": [e["kind"] for e in job["events"]]}
                if job
                else None
            )
    finally:
        await client.close()
    ran = [j for j in sent if j in started]
    return {
        "jobs": jobs,
        "rate_per_s": rate,
        "ran": len(ran),
        "never_ran": jobs - len(ran),
        "never_ran_jobs": missing,
        "submit_to_placed": _stats([placed[j] - sent[j] for j in sent if j in placed]),
        "placed_to_running": _stats([started[j] - placed[j] for j in ran if j in placed]),
        "submit_to_running": _stats([started[j] - sent[j] for j in ran]),
    }


def _slurm_alone(slurm_conf: str, jobs: int) -> dict[str, float]:
    """Slurm without Loom: ``sbatch`` of a 1-GPU job, then ``scontrol`` every 50 ms until it is
    RUNNING, one job after another, on the same local cluster (the floor under Loom's figure)."""
    env = {**os.environ, "SLURM_CONF": slurm_conf}
    times: list[float] = []
    for _ in range(jobs):
        began = time.perf_counter()
        out = subprocess.run(
            [
                "sbatch",
                "--parsable",
                "--gres=gpu:1",
                "--job-name=bench-alone",
                "--output=/dev/null",
                "--wrap=sleep 1",
            ],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        ref = out.stdout.strip().split(";")[0]
        while (
            "JobState=RUNNING"
            not in subprocess.run(
                ["scontrol", "-o", "show", "job", ref], env=env, capture_output=True, text=True, check=False
            ).stdout
        ):
            if time.perf_counter() - began > 30:
                break
            time.sleep(0.05)
        times.append(time.perf_counter() - began)
    return _stats(times)


def _job_id(data: bytes) -> str:
    job_id: str = json.loads(data)["job_id"]
    return job_id


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start a private stack on local Slurm, measure, stop it."""
    home = Path(tempfile.mkdtemp(prefix="loom-bench-slurm-", dir="/tmp"))
    os.chmod(home, 0o755)  # PostgreSQL runs as an unprivileged user when we are root
    env_backup = {k: os.environ.pop(k) for k in ("LOOM_NATS_URL", "LOOM_DATABASE_URL") if k in os.environ}
    try:
        options = stack.StackOptions(
            topology="small",
            clusters=CLUSTERS,
            slurm_clusters=CLUSTERS,
            time_scale=TIME_SCALE,
            heartbeat_s=0.5,
            max_heartbeat_s=2.0,
            network=False,
            placement_standby=False,
        )
        started = time.time()
        state = stack.up(home, options)
        jobs = getattr(args, "slurm_jobs", 40)
        result = asyncio.run(_measure(state["nats_url"], jobs, getattr(args, "slurm_rate", 2.0)))
        result["slurm_alone_submit_to_running"] = _slurm_alone(state["slurm"][CLUSTERS[0]]["slurm_conf"], 10)
        result["security"] = stack_security(home)
        result.update(
            {
                "benchmark": "e2e-slurm",
                "topology": "small",
                "slurm_clusters": CLUSTERS,
                "slurm": "slurm-wlm 22.05, local slurmctld + 2 slurmd per cluster, sched/builtin",
                "agent_poll_s": 0.5,
                "cpu_cores": os.cpu_count(),
                "wall_s": round(time.time() - started, 1),
            }
        )
        return result
    finally:
        stack.down(home)
        os.environ.update(env_backup)
        shutil.rmtree(home, ignore_errors=True)
