"""Entry point of the migration service: ``loom-migration`` or ``python -m loom_services.migration``."""

import argparse

from loom.migrate.replicas import ReplicaSettings
from loom.runtime.service import ServiceContext, run
from loom_services.migration.service import MigrationService, MigrationSettings


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    defaults = MigrationSettings()
    parser = argparse.ArgumentParser(prog="loom-migration", description="Loom migration service")
    parser.add_argument("--poll-s", type=float, default=defaults.poll_s, help="drain loop period")
    parser.add_argument(
        "--idle-poll-s",
        type=float,
        default=defaults.idle_poll_s,
        help="the drain, moves and replica loops' period with nothing to do (this process wakes them)",
    )
    parser.add_argument(
        "--checkpoint-timeout-s",
        type=float,
        default=defaults.checkpoint_timeout_s,
        help="how long a move waits for the checkpoint it asked for before asking again",
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        default=defaults.time_scale,
        help="the agents' simulated seconds per wall second (replica copies are timed on their clock)",
    )
    parser.add_argument(
        "--replica-budget-gb",
        type=float,
        default=defaults.replicas.budget_bytes / 1e9,
        help="checkpoint replica bytes each cluster holds at most (GB)",
    )
    parser.add_argument(
        "--replica-concurrency",
        type=int,
        default=defaults.replica_concurrency,
        help="replica copies in flight",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Console entry point."""
    args = parse_args(argv)
    settings = MigrationSettings(
        poll_s=args.poll_s,
        idle_poll_s=args.idle_poll_s,
        checkpoint_timeout_s=args.checkpoint_timeout_s,
        time_scale=args.time_scale,
        replica_concurrency=args.replica_concurrency,
        replicas=ReplicaSettings(budget_bytes=args.replica_budget_gb * 1e9),
    )

    async def body(ctx: ServiceContext) -> None:
        await MigrationService(ctx, settings).run()

    run("migration", body)


if __name__ == "__main__":
    main()
