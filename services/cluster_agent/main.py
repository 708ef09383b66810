"""Entry point: ``loom-cluster-agent --cluster ID [--topology FILE] [--time-scale X] [--probe-...]``."""

import argparse
import functools
import sys
from pathlib import Path

from loom.model.profiles import profile_for_model, relative_speed, wire_profile
from loom.model.scu import ScuError
from loom.model.topology import TopologyError, load_topology
from loom.runtime.config import loom_home
from loom.runtime.service import ServiceContext, run
from loom_proto.clusters import AcceleratorProfile
from loom_services.cluster_agent.agent import Agent
from loom_services.cluster_agent.backend import ClusterBackend
from loom_services.cluster_agent.probes import ProbeResponder
from loom_services.cluster_agent.sim import SimCluster, parse_true_speeds
from loom_services.cluster_agent.slurm import DEFAULT_SCRIPT, SlurmBackend


@functools.lru_cache(maxsize=1024)
def model_speed(gpu_model: str, task_type: str) -> float:
    """The speed this *simulated* cluster delivers on a node, relative to the reference: its SCU for
    the task type. This is the simulated hardware's truth, not placement's belief: a model without
    a profile delivers the reference's speed here, while the metrics service refuses its nodes
    (no library profile, no calibrated one) and placement would count it as unprofiled.

    Cached: the library's profiles do not change while the agent runs, and every run's step
    asks for it (a burst of starts asked thousands of times for the same few pairs)."""
    try:
        return relative_speed(gpu_model, task_type)
    except ScuError:
        return 1.0


def library_profile(gpu_model: str) -> AcceleratorProfile | None:
    """The reference profile of a model, in wire form (None for a model the library lacks)."""
    try:
        p = profile_for_model(gpu_model)
    except ScuError:
        return None
    return wire_profile(p)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(
        prog="loom-cluster-agent", description="Loom cluster agent (sim or slurm backend)"
    )
    parser.add_argument("--cluster", required=True, help="cluster id in the topology")
    parser.add_argument("--topology", default=None, help="topology file or packaged name (default: default)")
    parser.add_argument("--backend", choices=["sim", "slurm"], default="sim")
    parser.add_argument(
        "--slurm-conf", type=Path, default=None, help="slurm backend: the cluster's slurm.conf (SLURM_CONF)"
    )
    parser.add_argument(
        "--slurm-script",
        type=Path,
        default=DEFAULT_SCRIPT,
        help="slurm backend: the job script a lead part runs",
    )
    parser.add_argument("--slurm-partition", default=None, help="slurm backend: partition (default: Slurm's)")
    parser.add_argument(
        "--slurm-bin",
        type=Path,
        default=None,
        help="slurm backend: where sbatch, scontrol... are (default: PATH)",
    )
    parser.add_argument(
        "--slurm-command-timeout-s",
        type=float,
        default=15.0,
        help="slurm backend: longest a Slurm command may run; past it, it is killed and the call"
        " fails (a poll is retried)",
    )
    parser.add_argument(
        "--gres-model",
        action="append",
        default=[],
        metavar="TYPE=MODEL",
        help="slurm backend: GRES type TYPE is Loom GPU model MODEL (default: the type upper-cased)",
    )
    parser.add_argument("--time-scale", type=float, default=60.0, help="simulated seconds per wall second")
    parser.add_argument("--heartbeat-s", type=float, default=2.0, help="shortest heartbeat interval")
    parser.add_argument(
        "--max-heartbeat-s",
        type=float,
        default=10.0,
        help="longest heartbeat interval, while nothing changes",
    )
    parser.add_argument(
        "--efficiency",
        type=float,
        default=1.0,
        help="share of its claimed SCU this simulated cluster delivers (below 1: it under-delivers)",
    )
    parser.add_argument(
        "--true-speed",
        action="append",
        default=[],
        metavar="FAMILY:GPU=FACTOR",
        help="test/replay knob: jobs of FAMILY really run on GPU at FACTOR x the profile's speed"
        " (placement does not know; repeat for several)",
    )
    parser.add_argument(
        "--state-dir", type=Path, default=None, help="where running jobs are kept across restarts"
    )
    parser.add_argument("--probe-host", default="127.0.0.1", help="address the probe endpoints bind")
    parser.add_argument("--probe-udp-port", type=int, default=0, help="UDP echo port (0: a free one)")
    parser.add_argument("--probe-tcp-port", type=int, default=0, help="TCP echo/bulk port (0: a free one)")
    parser.add_argument(
        "--probe-advertise-host",
        default=None,
        help="host collectors reach the endpoints at (default: the bind address, or this host's name)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Console entry point."""
    args = parse_args(argv)
    # Every option checked before anything connects: a bad one is a line and exit 2, not a
    # traceback, nor a service waiting for NATS with a value it would refuse only then.
    try:
        topology = load_topology(args.topology)
        cluster = topology.cluster(args.cluster)
        true_speed = parse_true_speeds(args.true_speed)
        for option, value in (
            ("--time-scale", args.time_scale),
            ("--heartbeat-s", args.heartbeat_s),
            ("--max-heartbeat-s", args.max_heartbeat_s),
            ("--efficiency", args.efficiency),
            ("--slurm-command-timeout-s", args.slurm_command_timeout_s),
        ):
            if not 0 < value < float("inf"):
                raise ValueError(f"{option} must be a positive number, got {value}")
        if args.max_heartbeat_s < args.heartbeat_s:
            raise ValueError("--max-heartbeat-s must be at least --heartbeat-s")
        if args.slurm_conf is not None and not args.slurm_conf.is_file():
            # scontrol would retry it for 60 s and the agent said only "slurm unreachable".
            raise ValueError(f"--slurm-conf {args.slurm_conf}: no such file")
    except (TopologyError, ValueError) as exc:
        print(f"loom-cluster-agent: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    state_dir = args.state_dir or loom_home() / "agents"
    state_dir.mkdir(parents=True, exist_ok=True)

    async def body(ctx: ServiceContext) -> None:
        responder = await ProbeResponder(
            ctx,
            cluster=cluster.id,
            region=cluster.region,
            host=args.probe_host,
            udp_port=args.probe_udp_port,
            tcp_port=args.probe_tcp_port,
            advertise_host=args.probe_advertise_host,
        ).start()
        backend: ClusterBackend
        if args.backend == "slurm":
            backend = SlurmBackend(
                cluster=cluster.id,
                zone=cluster.zone,
                work_dir=state_dir / f"slurm-{cluster.id}",
                slurm_conf=args.slurm_conf,
                script=args.slurm_script,
                gres_models={t.lower(): m for t, _, m in (item.partition("=") for item in args.gres_model)},
                speed=model_speed,
                partition=args.slurm_partition,
                bin_dir=args.slurm_bin,
                command_timeout_s=args.slurm_command_timeout_s,
            )
        else:
            backend = SimCluster(
                cluster,
                speed=model_speed,
                efficiency=args.efficiency,
                true_speed=true_speed,
            )
        agent = Agent(
            ctx,
            backend,
            profile_of=library_profile,
            region=cluster.region,
            time_scale=args.time_scale,
            heartbeat_s=args.heartbeat_s,
            max_heartbeat_s=args.max_heartbeat_s,
            state_dir=state_dir,
        )
        try:
            await agent.run()
        finally:
            await responder.close()

    run(f"agent-{cluster.id}", body, needs_db=False)


if __name__ == "__main__":
    main()
