"""Entry point of the metrics service: ``loom-metrics`` or ``python -m loom_services.metrics``."""

from loom.runtime.service import ServiceContext, run
from loom_services.metrics.service import MetricsService


async def body(ctx: ServiceContext) -> None:
    """Run metrics until the process is asked to stop."""
    await MetricsService(ctx).run()


def main() -> None:
    """Console entry point."""
    run("metrics", body)


if __name__ == "__main__":
    main()
