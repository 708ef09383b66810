"""Entry point of the metrics service: ``loom-metrics`` or ``python -m loom_services.metrics``."""

from loom.model.profiles import (
    DEFAULT_REFERENCE_MODEL,
    library_models,
    profile_for_model,
    relative_speed,
    scu_per_gpu,
)
from loom.runtime.service import ServiceContext, run
from loom.sched.plugins.cost import default_economics
from loom_services.metrics.service import MetricsService


async def body(ctx: ServiceContext) -> None:
    """Run metrics until the process is asked to stop."""
    await MetricsService(
        ctx,
        scu_per_gpu=scu_per_gpu,
        reference_gpu=DEFAULT_REFERENCE_MODEL,
        known_models=frozenset(library_models()),
        claimed_speed=relative_speed,
        reference_profile=profile_for_model(DEFAULT_REFERENCE_MODEL),
        # Usage is priced with the table placement's cost plugin scores with.
        price=default_economics().price,
    ).run()


def main() -> None:
    """Console entry point."""
    run("metrics", body)


if __name__ == "__main__":
    main()
