"""``loom bench decide``: placement's decide phase per job, on the jobs ``loom bench e2e`` submits.

No bus and no database: what the placement service does in memory for a batch of submissions,
from the cycle to the stored form of its decision records. For each size a platform is built as
``loom bench placement`` builds it (the default topology's clusters replicated or sampled to N
nodes; ``--fill`` of the GPUs reserved beforehand, 0 by default: the e2e stack starts empty), then
``--jobs`` jobs of e2e's shape (:func:`loom_benchmarks.e2e.job_spec`: one GPU, inference, a day
long, tenant ``bench``) are decided in cycles of ``--batch`` (the service's batch, 200) by
:func:`loom.sched.cycle.run_cycle` with the default profile, each placement listed in the
snapshot's running jobs before the next job's turn (as the service's ``placed`` hook does), the
cycle folded (:func:`~loom.sched.cycle.fold_within`), and every record made what placement
stores: ``DecisionRecord.to_dict(raw=False)`` encoded to JSON once.

Measured: the thread's CPU time (``time.thread_time_ns``) and wall time over all cycles, per job;
``decisions_per_s`` is jobs over CPU seconds (the figure that does not depend on how busy the
machine is; ``wall_decisions_per_s`` is there too). ``digest`` is a SHA-256 over every decision
(parts, workers, score, predicted step, sync plan), every stored record and the free GPUs at the
end: two versions of the code that give the same digest decided and recorded the same.
"""

import argparse
import hashlib
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec
import numpy as np

from loom.model.topology import Topology, load_topology
from loom.sched.cycle import expected_end_s, fold_within, run_cycle
from loom.sched.framework import Decision
from loom.sched.profile import build_framework
from loom.sched.snapshot import RunningJob, Snapshot
from loom_benchmarks.e2e import job_spec
from loom_benchmarks.placement import NOW, OptionError, build_platform, build_snapshot, parse_sizes
from loom_proto.jobs import JobSubmitted

DEFAULT_SIZES: Final = "1000,10000"
DEFAULT_JOBS: Final = 3000
DEFAULT_BATCH: Final = 500
"""The placement service's batch (``PlacementService(batch=500)``)."""


@dataclass(slots=True)
class Queued:
    """A queued job as :func:`run_cycle` reads it (the service's ``QueuedJob`` has the same fields)."""

    job: JobSubmitted
    attempt: int = 1
    avoid: frozenset[str] = frozenset()
    tries: int = 0
    fair_share: float | None = None
    queued_s: float | None = None


@dataclass
class DecideRun:
    """One size's figures, and the digest of what was decided and stored."""

    figures: dict[str, Any]
    digest: str
    outcomes: dict[str, Any] = field(default_factory=dict)


def e2e_jobs(count: int) -> list[JobSubmitted]:
    """``count`` jobs as ``loom bench e2e`` submits them, each with its submission time (1 ms apart)."""
    return [
        msgspec.structs.replace(
            JobSubmitted(**msgspec.structs.asdict(job_spec("tp", i))), submitted_at=NOW + i * 1e-3
        )
        for i in range(count)
    ]


def _listed(snap: Snapshot) -> Callable[[Queued, Decision], None]:
    """The service's ``placed`` hook: the new run listed in the snapshot before the next job's turn."""

    def placed(q: Queued, d: Decision) -> None:
        job = q.job
        lead = d.parts[0]
        one = len(d.parts) == 1 and job.pipeline is None
        snap.running.append(
            RunningJob(
                job_id=job.job_id,
                tenant=job.tenant,
                priority=job.priority,
                cluster=lead.cluster,
                gpu_model=lead.gpu_model,
                allocations=tuple(a for p in d.parts for a in p.allocations),
                preemptible=job.preemptible,
                labels=job.labels,
                workers=d.workers,
                min_workers=job.min_workers if one else None,
                max_workers=job.workers,
                gpus_per_worker=job.resources.gpus,
                cpu_milli=job.resources.cpu_milli,
                memory_mib=job.resources.memory_mib,
                attempt=q.attempt,
                expected_end_s=expected_end_s(
                    job,
                    start_s=snap.now + d.start_after_s,
                    steps_left=job.work.steps,
                    predicted_step_s=d.predicted_step_s,
                    workers=d.workers,
                ),
            )
        )

    return placed


def run_size(
    nodes: int, jobs: int, batch: int, *, fill: float, seed: int, topology: Topology, repeat: int = 1
) -> DecideRun:
    """Decide ``jobs`` e2e jobs on a platform of ``nodes`` nodes in cycles of ``batch``, ``repeat``
    times from the same start: each cycle's CPU time is the least of its repeats (another process
    on the core slows a cycle down, never speeds it up), and ``median_cpu_ms_per_job`` is the
    median of the repeats' totals."""
    built = build_platform(topology, nodes, fill, seed)
    passes = [_one_pass(topology, built, jobs, batch) for _ in range(max(repeat, 1))]
    figures, cycles_cpu, _ = passes[0]
    decided = max(sum(figures["outcomes"].values()), 1)
    best = [min(p[1][i] for p in passes) for i in range(len(cycles_cpu))]
    totals = sorted(sum(p[1]) for p in passes)
    figures["repeats"] = len(passes)
    figures["cpu_ms_per_job"] = round(sum(best) / 1e6 / decided, 4)
    figures["median_cpu_ms_per_job"] = round(totals[len(totals) // 2] / 1e6 / decided, 4)
    figures["decisions_per_s"] = round(decided / (sum(best) / 1e9), 1) if sum(best) else None
    figures["same_across_repeats"] = len({p[2] for p in passes}) == 1
    return DecideRun(figures=figures, digest=figures["digest"], outcomes=figures["outcomes"])


def _one_pass(topology: Topology, built: Any, jobs: int, batch: int) -> tuple[dict[str, Any], list[int], str]:
    """One run of every cycle from the built platform: figures, CPU ns per cycle, digest."""
    snap = build_snapshot(topology, built)
    framework = build_framework()
    queue = [Queued(job) for job in e2e_jobs(jobs)]
    placed_hook = _listed(snap)
    digest = hashlib.sha256()
    outcomes = {"placed": 0, "waiting": 0, "rejected": 0}
    record_bytes = 0
    cpu_ns = wall_ns = 0
    per_cycle: list[int] = []
    for start in range(0, len(queue), batch):
        cycle = queue[start : start + batch]
        c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
        result = run_cycle(framework, cycle, snap, backlog=0, placed=placed_hook)
        fold_within(result)
        stored = [msgspec.json.encode(p.record.to_dict(raw=False)) for p in result.placed]
        stored += [msgspec.json.encode(r.record.to_dict(raw=False)) for r in result.rejected]
        stored += [msgspec.json.encode(w.record.to_dict(raw=False)) for w in result.waiting]
        per_cycle.append(time.thread_time_ns() - c0)
        cpu_ns += per_cycle[-1]
        wall_ns += time.perf_counter_ns() - t0
        for p in result.placed:
            d = p.decision
            digest.update(repr((d.job_id, d.parts, d.workers, d.score, d.predicted_step_s, d.sync)).encode())
        for blob in stored:
            digest.update(blob)
            record_bytes += len(blob)
        outcomes["placed"] += len(result.placed)
        outcomes["waiting"] += len(result.waiting)
        outcomes["rejected"] += len(result.rejected)
    digest.update(snap.free.tobytes())
    decided = max(sum(outcomes.values()), 1)
    figures: dict[str, Any] = {
        "nodes": int(snap.free.size),
        "clusters": len(snap.clusters),
        "gpus": int(snap.total.sum()),
        "jobs": jobs,
        "batch": batch,
        "outcomes": outcomes,
        "cpu_ms_per_job": round(cpu_ns / 1e6 / decided, 4),
        "wall_ms_per_job": round(wall_ns / 1e6 / decided, 4),
        "decisions_per_s": round(decided / (cpu_ns / 1e9), 1) if cpu_ns else None,
        "wall_decisions_per_s": round(decided / (wall_ns / 1e9), 1) if wall_ns else None,
        "record_bytes_per_job": round(record_bytes / decided, 1),
        "digest": digest.hexdigest(),
    }
    return figures, per_cycle, str(figures["digest"])


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every size in ``args.nodes``; the JSON result."""
    if not 0.0 <= args.fill <= 1.0:
        raise OptionError(f"--fill is a share between 0 and 1, got {args.fill!r}")
    if args.jobs < 1 or args.batch < 1 or args.repeat < 1:
        raise OptionError(
            "--jobs, --batch and --repeat must be at least 1,"
            f" got {args.jobs!r}, {args.batch!r}, {args.repeat!r}"
        )
    load_before = os.getloadavg()[0]
    topology = load_topology()
    sizes: Sequence[int] = parse_sizes(args.nodes)
    runs = [
        run_size(
            n, args.jobs, args.batch, fill=args.fill, seed=args.seed, topology=topology, repeat=args.repeat
        ).figures
        for n in sizes
    ]
    return {
        "benchmark": "decide",
        "headline": {
            str(r["nodes"]): {"cpu_ms_per_job": r["cpu_ms_per_job"], "decisions_per_s": r["decisions_per_s"]}
            for r in runs
        },
        "method": {
            "measured": "run_cycle (default profile) over cycles of --batch e2e jobs, each placement "
            "listed in the snapshot before the next job's turn, fold_within, and every record's "
            "to_dict(raw=False) JSON-encoded (what placement stores); thread CPU time and wall time "
            "per job, each cycle's least over --repeat runs from the same start; decisions_per_s = "
            "jobs / those CPU seconds",
            "not_measured": "bus, database, messages (JobPlaced, StartJob), the service's Run book",
            "platform": "loom bench placement's: the default topology replicated or sampled to N nodes",
            "fill": args.fill,
            "seed": args.seed,
        },
        "sizes": runs,
        "environment": {
            "python": platform.python_version(),
            "numpy": np.__version__,
            "cpu_count": os.cpu_count(),
            "load_average_1m": {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2)},
        },
    }


def add_parser(sub: Any) -> None:
    """``loom bench decide`` and its options."""
    decide = sub.add_parser(
        "decide",
        help="placement's decide phase per job (cycle + stored records) on e2e's job shape, by platform size",
    )
    decide.add_argument("--nodes", default=DEFAULT_SIZES, help="platform sizes, comma-separated")
    decide.add_argument("--jobs", type=int, default=DEFAULT_JOBS, help="e2e jobs decided per size")
    decide.add_argument(
        "--batch", type=int, default=DEFAULT_BATCH, help="jobs per cycle (the service's batch)"
    )
    decide.add_argument("--fill", type=float, default=0.0, help="share of GPUs reserved beforehand")
    decide.add_argument("--repeat", type=int, default=3, help="runs per size (each cycle's least CPU time)")
    decide.add_argument("--seed", type=int, default=7)
    decide.add_argument("--json", action="store_true", help="print only the JSON result on stdout")
