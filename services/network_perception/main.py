"""Entry point: ``loom-network-perception [--topology FILE] [--period-s S] [--persist-every-s S]``."""

import argparse

from loom.model.topology import load_topology
from loom.runtime.service import ServiceContext, run
from loom_services.network_perception.service import DESIGN_PERIOD_S, NetworkPerception


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(
        prog="loom-network-perception", description="Loom network perception: the writer of link state"
    )
    parser.add_argument("--topology", default=None, help="topology file or packaged name (default: default)")
    parser.add_argument(
        "--period-s", type=float, default=DESIGN_PERIOD_S, help="probe period: links are evaluated once per"
    )
    parser.add_argument(
        "--persist-every-s", type=float, default=10.0, help="how often learned link records are saved"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Console entry point."""
    args = parse_args(argv)
    topology = load_topology(args.topology)

    async def body(ctx: ServiceContext) -> None:
        await NetworkPerception(
            ctx, topology, period_s=args.period_s, persist_every_s=args.persist_every_s
        ).run()

    run("network-perception", body)


if __name__ == "__main__":
    main()
