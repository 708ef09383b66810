"""Benchmark programs behind ``loom bench …``: each prints JSON (and a readable table on stderr).

They measure; they never assert. Quote their figures, not targets.
"""

import argparse
import json
import sys
from pathlib import Path
from typing import Any


# PLR0915: the `loom bench` argument parser: flat option lists, CLI code.
def add_arguments(parser: argparse.ArgumentParser) -> None:  # noqa: PLR0915
    """Sub-commands of ``loom bench``."""
    sub = parser.add_subparsers(dest="bench", required=True)
    alerts = sub.add_parser(
        "alerts", help="alert correlation: a cluster storm, injected faults, real-stack latency"
    )
    alerts.add_argument("--faults", type=int, default=200, help="injected faults with known roots")
    alerts.add_argument("--probes", type=int, default=100, help="latency probes on the real stack")
    alerts.add_argument("--probe-hz", type=float, default=2.0, help="probes per second")
    alerts.add_argument(
        "--background-hz", type=float, default=100.0, help="attached repeats per second meanwhile"
    )
    alerts.add_argument("--skip-stack", action="store_true", help="leave out the real-stack latency part")
    alerts.add_argument("--seed", type=int, default=7)
    alerts.add_argument("--json", action="store_true", help="print only the JSON result on stdout")
    e2e = sub.add_parser("e2e", help="submit -> placed through the real bus, database and services")
    e2e.add_argument("--jobs", type=int, default=2000, help="jobs in the throughput phase")
    e2e.add_argument("--rate", type=float, default=50.0, help="jobs per second in the paced phase")
    e2e.add_argument("--paced-jobs", type=int, default=500, help="jobs in the paced phase (0 skips it)")
    e2e.add_argument("--topology", default="default")
    e2e.add_argument(
        "--without-network",
        action="store_true",
        help="leave out the probe collectors and network-perception (the placement path alone)",
    )
    e2e.add_argument(
        "--baseline",
        action="store_true",
        help="also measure the raw path (durable consume, store, publish; no scheduling) in the same stack",
    )
    e2e.add_argument(
        "--rest-s",
        type=float,
        default=10.0,
        help="seconds of the idle stack over which CPU at rest is sampled",
    )
    e2e.add_argument(
        "--shards",
        type=int,
        default=None,
        help="placement shards (regions split by GPUs); jobs then carry a one-region affinity, by GPUs",
    )
    e2e.add_argument(
        "--slurm",
        action="store_true",
        help="submit -> running in Slurm instead: two clusters on local Slurm (slurm-wlm, munge; root)",
    )
    e2e.add_argument("--slurm-jobs", type=int, default=40, help="with --slurm: jobs of one GPU, ~1 s each")
    e2e.add_argument("--slurm-rate", type=float, default=2.0, help="with --slurm: jobs submitted per second")
    e2e.add_argument("--json", action="store_true", help="print only the JSON result on stdout")
    view = sub.add_parser("view", help="the resource ledger at scale: delta apply, queries, memory per node")
    view.add_argument("--nodes", type=int, default=100_000)
    view.add_argument("--repeats", type=int, default=30)
    view.add_argument("--json", action="store_true", help="print only the JSON result on stdout")
    scu = sub.add_parser("scu", help="SCU speed ratios to the V100 vs measured (Gavel + Lambda), held out")
    scu.add_argument("--json", action="store_true", help="print only the JSON result on stdout")
    scu.add_argument("--rows", action="store_true", help="include every predicted and measured ratio")
    scu.add_argument(
        "--outside",
        action="append",
        type=Path,
        default=[],
        metavar="DIR",
        help="also predict measurements never fitted on: AdaptDL / Pollux / Sia profiles, "
        "DIR/<model>/placements-<cluster>.csv (repeatable; see loom_benchmarks.scu_outside)",
    )
    from loom_benchmarks.decide import add_parser as add_decide

    add_decide(sub)
    placement = sub.add_parser(
        "placement",
        help="scheduling decision latency of the pure core (no bus, no database) by platform size",
    )
    placement.add_argument("--nodes", default="1000,10000,100000", help="platform sizes, comma-separated")
    placement.add_argument(
        "--decisions",
        type=int,
        default=None,
        help="decisions per size (default 2000; 500 above 10,000 nodes)",
    )
    placement.add_argument("--fill", type=float, default=0.6, help="share of GPUs reserved beforehand")
    placement.add_argument(
        "--cycle",
        type=int,
        default=0,
        help="also decide the jobs in cycles of this many (schedule_many), caches on and off (0: no)",
    )
    placement.add_argument("--seed", type=int, default=7)
    placement.add_argument("--json", action="store_true", help="print only the JSON result on stdout")
    takeover = sub.add_parser(
        "takeover", help="SIGKILL the placement leader: time until another instance leads and places again"
    )
    takeover.add_argument("--trials", type=int, default=5, help="leaders killed, one after another")
    takeover.add_argument("--rate", type=float, default=50.0, help="jobs submitted per second throughout")
    takeover.add_argument("--topology", default="default")
    takeover.add_argument("--json", action="store_true", help="print only the JSON result on stdout")
    drain = sub.add_parser(
        "drain", help="drain a cluster under 20 jobs: empties it, concurrency held, no step 0"
    )
    from loom_benchmarks.drain import add_arguments as drain_arguments

    drain_arguments(drain)
    failover = sub.add_parser(
        "failover", help="SIGKILL a cluster's agent under 50+ jobs: detection, re-placement, lost, doubled"
    )
    from loom_benchmarks.failover import add_arguments as failover_arguments

    failover_arguments(failover)
    cluster = sub.add_parser(
        "nats-cluster", help="SIGKILL each node role of a 3-node JetStream cluster: where the stall goes"
    )
    cluster.add_argument("--trials", type=int, default=3, help="kills per role")
    cluster.add_argument("--roles", default="stream-leader,consumer-leader,lease-leader,meta-leader,follower")
    cluster.add_argument("--rate", type=float, default=50.0, help="publishes per second throughout")
    cluster.add_argument("--lease-ttl", type=float, default=2.0, help="the lease TTL (placement's is 2 s)")
    cluster.add_argument(
        "--lease-grace",
        type=float,
        default=10.0,
        help="how long past its TTL the lease holder keeps leading while the bucket has no leader "
        "(placement's is 10 s; 0: none)",
    )
    cluster.add_argument("--json", action="store_true", help="print only the JSON result on stdout")
    policies = sub.add_parser(
        "policies", help="Loom's placement against the baselines in the simulator: JCT, cost, traffic, report"
    )
    policies.add_argument(
        "--workload",
        default="mix",
        help="mix, alibaba, philly (the grid's Philly-like trace), scenario, or a trace file: the"
        " generic format (.jsonl, .csv) or a public trace as published (Alibaba 2023 pod list, Philly"
        " cluster_job_log, Helios / Acme job log, PAI task table; told by content) (default mix)",
    )
    policies.add_argument("--topology", default="default", help="packaged topology name or JSON path")
    policies.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="jobs in the trace (default: the workload's own; --scale 100000)",
    )
    policies.add_argument(
        "--nodes", type=int, default=None, help="platform nodes (default the topology's; --scale 100000)"
    )
    policies.add_argument(
        "--policies", default=None, help="comma-separated policy names (default all; --scale loom)"
    )
    policies.add_argument("--seed", type=int, default=7)
    policies.add_argument(
        "--rate",
        type=float,
        default=None,
        help="mix only: workload units arriving per hour (default the mix's, 300)",
    )
    policies.add_argument(
        "--out", default=None, help="report folder (default ./loom-report/; --scale writes none unless given)"
    )
    policies.add_argument(
        "--sample-every", type=float, default=None, help="timeline sample interval, simulated seconds"
    )
    policies.add_argument(
        "--truth",
        default=None,
        help="truth file timing the jobs (default the packaged Gavel + Lambda tables); 'belief': time "
        "by the scheduler's own belief",
    )
    policies.add_argument(
        "--load",
        type=float,
        default=None,
        help="spread arrivals to offer this share of the platform's reference capacity (as the grid's"
        " loads; default the workload's own arrivals)",
    )
    policies.add_argument(
        "--trace-start",
        type=float,
        default=None,
        help="a public trace file: skip the jobs submitted in its first this many seconds (Alibaba"
        " pod lists: by the trace's own creation_time); with --grid, every trace file of"
        " --grid-workloads",
    )
    policies.add_argument(
        "--trace-gpu",
        default=None,
        help="a Philly, Helios / Acme or PAI trace file: the GPU its durations were measured on"
        " (default P100, V100M16, A100, and PAI's own gpu_type per task)",
    )
    policies.add_argument(
        "--scale", action="store_true", help="Loom alone at 100,000 nodes and jobs: wall time and peak RSS"
    )
    policies.add_argument(
        "--grid",
        action="store_true",
        help="every policy over platforms x loads x spanning x workloads x seeds, timed by truth",
    )
    policies.add_argument(
        "--grid-platforms",
        default=None,
        help="grid: small,medium,default (default all); NAME:GPUS sizes one (its regions, about GPUS"
        " GPUs: medium:120,medium:1000); a path ending in .json is a topology file of your own",
    )
    policies.add_argument(
        "--grid-loads", default=None, help="grid: loads of capacity (default 0.5,0.8,1,1.2)"
    )
    policies.add_argument(
        "--grid-seeds",
        default=None,
        help="grid: one number is how many seeds to run (5: seeds 0 to 4; default 5), a comma-separated"
        " list which seeds (0,1: seeds 0 and 1; '7,': seed 7 alone)",
    )
    policies.add_argument(
        "--grid-workloads",
        default=None,
        help="grid: alibaba,mix,philly and/or trace files (default alibaba,mix,philly)",
    )
    policies.add_argument("--grid-spanning", default=None, help="grid: allowed,forbidden (default both)")
    policies.add_argument("--grid-processes", type=int, default=2, help="grid: worker processes (default 2)")
    policies.add_argument("--json", action="store_true", help="print only the JSON result on stdout")
    learn = sub.add_parser("learn", help="speed learner: runs until a profile 3x wrong is learned, sharing")
    from loom_benchmarks.learn import add_arguments as learn_arguments

    learn_arguments(learn)
    contention = sub.add_parser(
        "contention",
        help="decisions under contention: small platforms, loads 0.5-1.2, spanning allowed and forbidden",
    )
    from loom_benchmarks.contention import add_arguments as contention_arguments

    contention_arguments(contention)
    grid_summary = sub.add_parser(
        "grid-summary", help="the evaluation grid's JSON files as one table: margins, spanning penalty, flags"
    )
    from loom_benchmarks.grid_summary import add_arguments as grid_summary_arguments

    grid_summary_arguments(grid_summary)
    migration = sub.add_parser(
        "migration", help="failure, link degradation, drain: migration on / never / always, timed by truth"
    )
    from loom_benchmarks.migration import add_arguments as migration_arguments

    migration_arguments(migration)
    net = sub.add_parser("net", help="network perception: convergence, stability, accuracy, capacity")
    net.add_argument("--topology", default="default")
    net.add_argument("--seed", type=int, default=7)
    net.add_argument("--trials", type=int, default=12, help="links stepped in the convergence runs")
    net.add_argument("--periods", type=int, default=300, help="probe periods of the accuracy run")
    net.add_argument("--stability-periods", type=int, default=200, help="probe periods per stability case")
    net.add_argument("--links", type=int, default=1000, help="links in the capacity run")
    net.add_argument("--capacity-seconds", type=int, default=20, help="simulated seconds of the capacity run")
    net.add_argument("--emulator-seconds", type=float, default=10.0, help="real loopback run; 0 skips it")
    net.add_argument("--json", action="store_true", help="print only the JSON result on stdout")
    chaos = sub.add_parser(
        "chaos",
        help="a seeded fault campaign on the real stack while jobs flow: nothing lost, doubled, stuck",
    )
    from loom_benchmarks.chaos import add_arguments as chaos_arguments

    chaos_arguments(chaos)
    console_bench = sub.add_parser(
        "console", help="web console pages: p50/p95/p99 with the default topology and 10,000 jobs stored"
    )
    from loom_benchmarks.console import add_arguments as console_arguments

    console_arguments(console_bench)
    codec = sub.add_parser(
        "codec", help="strict decode cost per message: bare msgspec vs Loom's guarded codec"
    )
    codec.add_argument("--number", type=int, default=20_000, help="decodes per timing (small payloads)")
    codec.add_argument("--repeats", type=int, default=7, help="timings per payload; the best is kept")
    codec.add_argument("--json", action="store_true", help="print only the JSON result on stdout")


def emit(result: dict[str, Any], as_json: bool) -> None:
    """Print the result: JSON on stdout; a short human summary on stderr unless ``as_json``."""
    print(json.dumps(result, indent=2))
    if not as_json:
        for key, value in result.items():
            print(f"{key:>28}: {value}", file=sys.stderr)


def run_benchmark(args: argparse.Namespace) -> int:  # noqa: PLR0912, PLR0915 - a branch per benchmark
    """Dispatch ``loom bench NAME``."""
    if args.bench == "console":
        from loom_benchmarks.console import main as run_console

        return run_console(args)
    if args.bench == "codec":
        from loom_benchmarks.codec import main as run_codec

        return run_codec(args)
    if args.bench == "chaos":
        from loom_benchmarks.chaos import main as run_chaos

        return run_chaos(args)
    if args.bench == "e2e" and args.slurm:
        from loom_benchmarks.slurm_e2e import run as run_slurm

        emit(run_slurm(args), args.json)
        return 0
    if args.bench == "e2e":
        from loom_benchmarks.e2e import run

        emit(run(args), args.json)
        return 0
    if args.bench == "view":
        from loom_benchmarks.view import run as run_view

        emit(run_view(args), args.json)
        return 0
    if args.bench == "scu":
        from loom_benchmarks.scu import main

        return main(args)
    if args.bench == "decide":
        from loom_benchmarks.decide import run as run_decide

        emit(run_decide(args), args.json)
        return 0
    if args.bench == "placement":
        from loom_benchmarks.placement import main as run_placement

        return run_placement(args)
    if args.bench == "drain":
        from loom_benchmarks.drain import main as run_drain

        return run_drain(args)
    if args.bench == "failover":
        from loom_benchmarks.failover import main as run_failover

        return run_failover(args)
    if args.bench == "takeover":
        from loom_benchmarks.takeover import main as run_takeover

        return run_takeover(args)
    if args.bench == "nats-cluster":
        from loom_benchmarks.nats_cluster import main as run_nats_cluster

        return run_nats_cluster(args)
    if args.bench == "policies":
        from loom_benchmarks.policies import main as run_policies

        return run_policies(args)
    if args.bench == "learn":
        from loom_benchmarks.learn import run as run_learn

        result = run_learn(args)
        print(json.dumps(result, indent=2))
        return 0
    if args.bench == "grid-summary":
        from loom_benchmarks.grid_summary import main as run_grid_summary

        return run_grid_summary(args)
    if args.bench == "contention":
        from loom_benchmarks.contention import main as run_contention

        return run_contention(args)
    if args.bench == "migration":
        from loom_benchmarks.migration import main as run_migration

        return run_migration(args)
    if args.bench == "net":
        from loom_benchmarks import net

        result = net.run(args)
        emit(result, True)
        if not args.json:
            net.report(result)
        return 0
    if args.bench == "alerts":
        from loom_benchmarks import alerts

        result = alerts.run(args)
        emit(result, True)
        if not args.json:
            alerts.report(result)
        return 0
    raise SystemExit(f"unknown benchmark {args.bench}")
