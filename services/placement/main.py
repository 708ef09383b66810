"""Entry point of the placement service: ``loom-placement`` or ``python -m loom_services.placement``.

Options: ``--topology`` (the network prior before probes report), ``--shard`` (one leader per
shard), ``--tenants FILE`` (YAML or JSON quotas; none: every tenant admitted without quota),
``--confirm-timeout-s`` (a start not confirmed by then is placed again elsewhere),
``--probe-s`` (believed seconds of a speed probe, :mod:`loom.sched.probe`; 0: none),
``--explore-share`` (the largest share of scheduling cycles that offer still-uncertain learned
speeds optimistically; 0, the default, never explores), ``--region-group NAME=r1,r2`` (repeatable)
or ``--shards FILE`` (``{groups: {NAME: [region, ...]}}``): the region groups of the regional
shards (:mod:`loom.sched.shards`); every placement instance must be given the same groups.
"""

import argparse

from loom.model.topology import load_topology
from loom.runtime.service import ServiceContext, run
from loom.sched.plugins.cost import default_economics
from loom.sched.probe import ProbeSettings
from loom.sched.quota import read_tenants
from loom.sched.shards import load_config, parse_group
from loom_services.placement.service import PlacementService


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(prog="loom-placement", description="Loom placement: the scheduler")
    parser.add_argument("--topology", default=None, help="topology file or packaged name (default: default)")
    parser.add_argument("--shard", default="global", help="placement shard this instance may lead")
    parser.add_argument("--tenants", default=None, help="tenant quotas (YAML or JSON file)")
    parser.add_argument("--confirm-timeout-s", type=float, default=60.0, help="start confirmation timeout")
    parser.add_argument("--lease-ttl-s", type=float, default=2.0, help="leader lease time to live")
    parser.add_argument(
        "--lease-grace-s",
        type=float,
        default=None,
        help="how long past its ttl the leader keeps leading while the lease bucket has no leader"
        " (default: 10 s on a replicated bus, LOOM_STREAM_REPLICAS > 1; 0 on a single server)",
    )
    parser.add_argument(
        "--explore-share",
        type=float,
        default=0.0,
        help="largest share of cycles that try uncertain (family, GPU) speeds optimistically (0: never)",
    )
    parser.add_argument(
        "--probe-s",
        type=float,
        default=ProbeSettings().probe_s,
        help="believed seconds a speed probe runs before a job of a family new to a GPU model"
        " is decided (0: no probes)",
    )
    parser.add_argument(
        "--region-group",
        action="append",
        default=[],
        metavar="NAME=REGION,...",
        help="a regional shard and its regions (repeatable; the same on every instance)",
    )
    parser.add_argument(
        "--shards", default=None, help="region groups from a file: {groups: {NAME: [region]}}"
    )
    parser.add_argument("--name", default="placement", help="instance name (health subject, lease holder)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Console entry point."""
    args = parse_args(argv)
    topology = load_topology(args.topology)
    tenants = read_tenants(args.tenants)
    groups = load_config(args.shards) if args.shards else {}
    for option in args.region_group:
        name, regions = parse_group(option)
        groups[name] = regions

    async def body(ctx: ServiceContext) -> None:
        await PlacementService(
            ctx,
            shard=args.shard,
            topology=topology,
            tenants=tenants,
            economics=default_economics(),
            confirm_timeout_s=args.confirm_timeout_s,
            lease_ttl_s=args.lease_ttl_s,
            lease_grace_s=args.lease_grace_s,
            holder=args.name,
            explore_share=args.explore_share,
            probe=ProbeSettings(probe_s=args.probe_s) if args.probe_s > 0 else None,
            region_groups=groups,
        ).run()

    run(args.name, body)


if __name__ == "__main__":
    main()
