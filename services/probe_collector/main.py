"""Entry point: ``loom-probe-collector --region ID [--topology FILE] [--period-s S] [--direct]``."""

import argparse

from loom.model.topology import load_topology
from loom.runtime.service import ServiceContext, run
from loom_services.probe_collector.collector import CollectorConfig, ProbeCollector


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    defaults = CollectorConfig()
    parser = argparse.ArgumentParser(
        prog="loom-probe-collector", description="Loom probe collector: measures one region's links"
    )
    parser.add_argument("--region", required=True, help="region id in the topology")
    parser.add_argument("--topology", default=None, help="topology file or packaged name (default: default)")
    parser.add_argument("--period-s", type=float, default=defaults.period_s, help="probe period")
    parser.add_argument(
        "--probes-per-period", type=int, default=defaults.probes_per_period, help="UDP probes per period"
    )
    parser.add_argument("--probe-timeout-s", type=float, default=defaults.probe_timeout_s)
    parser.add_argument(
        "--bandwidth-every-s",
        type=float,
        default=defaults.bandwidth_every_s,
        help="seconds between bandwidth probes of a link (0: none)",
    )
    parser.add_argument(
        "--bulk-bytes", type=int, default=defaults.bulk_bytes, help="bytes per bandwidth probe"
    )
    parser.add_argument(
        "--bulk-budget-bytes-per-hour",
        type=int,
        default=defaults.bulk_budget_bytes_per_hour,
        help="most bytes all bandwidth probes push in an hour",
    )
    parser.add_argument(
        "--direct",
        action="store_true",
        help="probe the peers' endpoints directly (a real WAN), without the in-process emulator",
    )
    return parser.parse_args(argv)


def config_of(args: argparse.Namespace) -> CollectorConfig:
    """The collector configuration the options describe."""
    return CollectorConfig(
        period_s=args.period_s,
        probes_per_period=args.probes_per_period,
        probe_timeout_s=args.probe_timeout_s,
        bandwidth_every_s=args.bandwidth_every_s,
        bulk_bytes=args.bulk_bytes,
        bulk_budget_bytes_per_hour=args.bulk_budget_bytes_per_hour,
        emulate=not args.direct,
    )


def main(argv: list[str] | None = None) -> None:
    """Console entry point."""
    args = parse_args(argv)
    topology = load_topology(args.topology)
    topology.region(args.region)  # refuses an unknown region before connecting
    config = config_of(args)

    async def body(ctx: ServiceContext) -> None:
        await ProbeCollector(ctx, topology, args.region, config).run()

    run(f"probe-{args.region}", body, needs_db=False)


if __name__ == "__main__":
    main()
