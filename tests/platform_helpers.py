"""Loom's services as asyncio tasks in the test process, on real NATS and PostgreSQL."""

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from loom.model.profiles import library_models, profile_for_model, relative_speed, scu_per_gpu
from loom.model.topology import Cluster, load_topology
from loom.runtime.service import ServiceContext, close_context, open_context
from loom.security import ENV_CREDS
from loom_services.cluster_agent.agent import Agent
from loom_services.cluster_agent.backend import ClusterBackend
from loom_services.cluster_agent.main import library_profile, model_speed
from loom_services.cluster_agent.sim import SimCluster
from loom_services.metrics.service import MetricsService
from loom_services.migration.service import MigrationService, MigrationSettings
from loom_services.placement.service import PlacementService


@dataclass
class Platform:
    """Services running as tasks; start and stop them one by one."""

    nats_url: str
    database_url: str
    state_dir: Path
    tasks: dict[str, tuple[asyncio.Task[None], ServiceContext]] = field(default_factory=dict)
    services: dict[str, Any] = field(default_factory=dict)
    """Name -> the service object :meth:`start` started (for a test to read its state)."""
    placement: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for PlacementService."""
    migration: dict[str, Any] = field(default_factory=dict)
    """Fields of the migration service's MigrationSettings (besides the fast polls)."""
    progress_every: float = 0.1
    """Share of a run's steps between two progress reports of an agent."""
    time_scale: float = 2000.0
    backends: dict[str, Callable[[Cluster], ClusterBackend]] = field(default_factory=dict)
    """Per agent name, the backend it runs on instead of the simulation (a Slurm cluster)."""
    creds: dict[str, Path] = field(default_factory=dict)
    """Per service name, the NATS credential file it connects with (a secured server)."""

    async def start(
        self, name: str, *, efficiency: float = 1.0, true_speed: dict[tuple[str, str], float] | None = None
    ) -> Any:
        database_url = None if name.startswith("agent") else self.database_url
        if name in self.creds:
            # Read when the connection is opened: the service keeps this identity afterwards.
            with pytest.MonkeyPatch.context() as patch:
                patch.setenv(ENV_CREDS, str(self.creds[name]))
                ctx = await open_context(name, nats_url=self.nats_url, database_url=database_url)
        else:
            ctx = await open_context(name, nats_url=self.nats_url, database_url=database_url)
        topology = load_topology("small")
        service: Any
        if name.startswith("placement"):
            kwargs = {"settle_s": 0.5, "topology": topology, **self.placement}
            service = PlacementService(ctx, holder=name, **kwargs)
        elif name == "migration":
            # Replica copies timed on the agents' clock, as `loom up` runs it.
            settings = {
                "poll_s": 0.1,
                "checkpoint_timeout_s": 3.0,
                "replica_poll_s": 0.2,
                "time_scale": self.time_scale,
                **self.migration,
            }
            service = MigrationService(ctx, MigrationSettings(**settings))
        elif name == "metrics":
            service = MetricsService(
                ctx,
                scu_per_gpu=scu_per_gpu,
                known_models=frozenset(library_models()),
                claimed_speed=relative_speed,
                reference_profile=profile_for_model("V100M16"),
            )
        else:
            cluster = topology.cluster(name.removeprefix("agent-"))
            make = self.backends.get(name)
            service = Agent(
                ctx,
                make(cluster)
                if make is not None
                else SimCluster(
                    cluster, speed=model_speed, efficiency=efficiency, true_speed=dict(true_speed or {})
                ),
                profile_of=library_profile,
                region=cluster.region,
                time_scale=self.time_scale,
                progress_every=self.progress_every,
                heartbeat_s=0.3,
                max_heartbeat_s=1.0,
                state_dir=self.state_dir,
            )
        self.tasks[name] = (asyncio.create_task(service.run()), ctx)
        self.services[name] = service
        return service

    async def stop(self, name: str, timeout_s: float = 15.0) -> None:
        task, ctx = self.tasks.pop(name)
        ctx.stopping.set()
        try:
            # A service cut off from NATS (a test closed its connection) ends with an error: its
            # context is closed all the same, else its dependency probes outlive the test.
            await asyncio.wait_for(task, timeout=timeout_s)
        finally:
            await close_context(ctx)
