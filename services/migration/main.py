"""Entry point of the migration service: ``loom-migration`` or ``python -m loom_services.migration``."""

import argparse

from loom.runtime.service import ServiceContext, run
from loom_services.migration.service import MigrationService, MigrationSettings


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    defaults = MigrationSettings()
    parser = argparse.ArgumentParser(prog="loom-migration", description="Loom migration service")
    parser.add_argument("--poll-s", type=float, default=defaults.poll_s, help="drain loop period")
    parser.add_argument(
        "--checkpoint-timeout-s",
        type=float,
        default=defaults.checkpoint_timeout_s,
        help="how long a move waits for the checkpoint it asked for before asking again",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Console entry point."""
    args = parse_args(argv)
    settings = MigrationSettings(poll_s=args.poll_s, checkpoint_timeout_s=args.checkpoint_timeout_s)

    async def body(ctx: ServiceContext) -> None:
        await MigrationService(ctx, settings).run()

    run("migration", body)


if __name__ == "__main__":
    main()
