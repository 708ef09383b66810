"""Entry point of the placement service: ``loom-placement`` or ``python -m loom_services.placement``."""

from loom.runtime.service import ServiceContext, run
from loom_services.placement.service import PlacementService


async def body(ctx: ServiceContext) -> None:
    """Run placement until the process is asked to stop."""
    await PlacementService(ctx).run()


def main() -> None:
    """Console entry point."""
    run("placement", body)


if __name__ == "__main__":
    main()
