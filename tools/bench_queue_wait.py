"""Micro-benchmark of the queue-aware gang wait (``behind_queue``) over a requeue cycle.

A platform of 10 clusters x 3 GPU models (30 pools, 4 nodes of 8 GPUs each), every node busy with
a job ending in 100-5,000 s; 200 queued jobs (1-4 workers of 4 or 8 GPUs, each allowed a random
third of the pools); then every queued gang is decided once in queue order, as a requeue pass
does: ``behind_queue`` over its options (each pool it may use, the queue-blind options of
``single_cluster_options``). Prints JSON: seconds per pass and per gang, and a checksum of the
waits found (the same before and after a change that keeps behaviour).

    .venv/bin/python tools/bench_queue_wait.py [--queued 200] [--repeats 3] [--unpruned]

``--unpruned`` (this tree only): the options are every pool the gang may use (``prune=False``, as
the span guard passes them under a queue), their queue-blind waits timed with the walk.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import numpy as np

from loom.model.capacity import NodeCapacity
from loom.sched.framework import CycleState
from loom.sched.plugins.network import behind_queue, single_cluster_options
from loom.sched.snapshot import NetMatrix, QueuedShape, RunningJob, Snapshot
from loom_proto.jobs import Communication, JobSpec, Resources, Work

MODELS = ("A100", "H100", "V100")
NOW = 1_000.0


def build(queued: int, seed: int) -> tuple[Snapshot, list[tuple[JobSpec, QueuedShape]]]:
    rng = random.Random(seed)
    nodes, runs = [], []
    for c in range(10):
        for m in MODELS:
            for n in range(4):
                name = f"c{c}-{m}-{n}"
                nodes.append(
                    NodeCapacity(
                        node=name,
                        cluster=f"c{c}",
                        region="r1",
                        zone="r1-a",
                        gpu_model=m,
                        gpus_total=8,
                        gpus_reserved=8,
                    )
                )
                runs.append(
                    RunningJob(
                        job_id=f"run-{name}",
                        tenant="t",
                        priority=100,
                        cluster=f"c{c}",
                        gpu_model=m,
                        allocations=((name, 8),),
                        expected_end_s=NOW + rng.uniform(100.0, 5_000.0),
                    )
                )
    speed = {(m, "training_compute"): s for m, s in zip(MODELS, (3.0, 5.0, 1.0), strict=True)}
    snap = Snapshot(nodes, net=NetMatrix(["r1"]), speed=speed, now=NOW, running=runs)
    jobs: list[tuple[JobSpec, QueuedShape]] = []
    shape_of = (len(snap.clusters), len(snap.models))
    for i in range(queued):
        workers, gpus = rng.randint(1, 4), rng.choice((4, 8))
        job = JobSpec(
            job_id=f"q{i:04d}",
            tenant="t",
            workers=workers,
            resources=Resources(gpus=gpus),
            work=Work(steps=rng.randint(500, 5_000), step_time_s=1.0),
            comm=Communication(bytes_per_step=10**8),
        )
        pools = np.zeros(shape_of, dtype=np.bool_)
        while not pools.any():
            pools = np.array([[rng.random() < 1 / 3 for _ in MODELS] for _ in range(10)], dtype=np.bool_)
        key = (0, NOW - queued + i, job.job_id)
        shape = QueuedShape(job.job_id, key, workers, gpus, pools, job, float(job.work.steps))
        snap.queued[job.job_id] = shape
        snap.waiting.add(job.job_id)
        jobs.append((job, shape))
    return snap, jobs


def one_pass(
    snap: Snapshot, jobs: list[tuple[JobSpec, QueuedShape]], *, unpruned: bool = False
) -> tuple[float, int, float]:
    """Every queued gang's ``behind_queue`` once: (seconds, gangs decided, checksum of waits)."""
    total, gangs, checksum = 0.0, 0, 0.0
    for job, shape in jobs:
        if shape.workers < 2:
            continue
        state = CycleState(
            job=job,
            snapshot=snap,
            cluster_mask=np.ones(len(snap.clusters), dtype=np.bool_),
            model_mask=np.ones(len(snap.models), dtype=np.bool_),
            submitted_at=shape.key[1],
        )
        state.queue_key = shape.key
        start = time.perf_counter()
        if unpruned:  # the span guard's options under a queue: every pool, timed with the walk
            options = single_cluster_options(state, shape.pools, shape.workers, prune=False)
        else:
            options = single_cluster_options(state, shape.pools, shape.workers)
            start = time.perf_counter()
        best = behind_queue(state, options, shape.workers, None)
        total += time.perf_counter() - start
        gangs += 1
        if best is not None and np.isfinite(best.wait_s):
            checksum += best.wait_s
    return total, gangs, checksum


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--queued", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--unpruned", action="store_true", help="options of every pool (prune=False), their waits timed too"
    )
    args = parser.parse_args()
    snap, jobs = build(args.queued, args.seed)
    passes = []
    checksum = 0.0
    gangs = 0
    for _ in range(args.repeats):
        seconds, gangs, checksum = one_pass(snap, jobs, unpruned=args.unpruned)
        passes.append(seconds)
    print(
        json.dumps(
            {
                "queued": args.queued,
                "unpruned": args.unpruned,
                "pools": len(snap.clusters) * len(snap.models),
                "gangs_per_pass": gangs,
                "pass_s": [round(s, 4) for s in passes],
                "ms_per_gang_first_pass": round(1e3 * passes[0] / max(gangs, 1), 3),
                "ms_per_gang_best_pass": round(1e3 * min(passes) / max(gangs, 1), 3),
                "checksum_wait_s": round(checksum, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
