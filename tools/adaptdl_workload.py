"""Write a Pollux / Sia workload file as Loom's generic workload (JSON lines), and Sia's cluster as a
topology, so ``loom bench policies`` replays their jobs on their GPUs, timed by their measurements::

    .venv/bin/python tools/adaptdl_workload.py /tmp/sia/sia-simulator/workloads/philly/workload-1.csv \\
        /tmp/pollux/simulator/traces /tmp/sia/sia-simulator/traces /tmp/sia/adaptdl/sched/traces \\
        -o /tmp/sia-philly-1.jsonl --topology-out /tmp/sia3.json
    .venv/bin/loom bench policies --workload /tmp/sia-philly-1.jsonl --topology /tmp/sia3.json \\
        --truth /tmp/truth-sia.json --json

Durations: :func:`loom_benchmarks.scu_outside.workload_jobs` (the folders must hold the validation
curves, ``<model>/validation-<batch>.csv``, and the V100 profiles, ``placements-azure.csv``).
"""

import argparse
import importlib.resources
import json
import sys
from pathlib import Path

import msgspec

from loom.model.topology import load_topology
from loom_benchmarks.contention import sia_topology
from loom_benchmarks.scu_outside import OutsideDataError, workload_jobs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="A Pollux/Sia workload as Loom's generic workload.")
    parser.add_argument("workload", type=Path, help="name,time,application,num_replicas,batch_size CSV")
    parser.add_argument(
        "folders", nargs="+", type=Path, help="trace folders (<model>/validation-*.csv, placements)"
    )
    parser.add_argument("-o", "--out", required=True, type=Path, help="the JSON lines to write")
    parser.add_argument("--topology-out", type=Path, help="also write Sia's 64-GPU cluster as a topology")
    args = parser.parse_args(argv)
    for out in (args.out, args.topology_out):
        if out is not None and out.exists():
            print(f"{out}: exists; not overwritten", file=sys.stderr)
            return 2
    try:
        jobs = workload_jobs(args.workload, args.folders)
    except OutsideDataError as exc:
        print(exc, file=sys.stderr)
        return 2
    lines = [f"# source: {args.workload} (Pollux/Sia workload; tools/adaptdl_workload.py)"]
    lines += [json.dumps(job, sort_keys=True) for job in jobs]
    args.out.write_text("\n".join(lines) + "\n")
    if args.topology_out is not None:
        small = load_topology(str(importlib.resources.files("loom") / "topologies" / "small.json"))
        args.topology_out.write_bytes(msgspec.json.format(msgspec.json.encode(sia_topology(small))))
    hours = sum(j["steps"] * j["step_time_s"] * j["workers"] for j in jobs) / 3600
    print(f"{args.out}: {len(jobs)} jobs, {hours:.1f} reference GPU-hours", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
