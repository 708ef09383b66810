"""What every service process shares: telemetry, logging, connections, signals, health replies.

A service is an ``async def body(ctx)`` that starts its consumers and returns when
``ctx.stopping`` is set; :func:`run` does the rest. Its long-lived tasks run under
``ctx.watchdog`` (:mod:`loom.runtime.watchdog`), so a loop that dies is logged, restarted and
shown in the health answer until it is back.

Health replies carry ``status``: ``ok``, or ``degraded: `` and every problem, e.g.
``degraded: postgres unavailable`` while a dependency a consumer needs is down
(:mod:`loom.bus.outage`) or ``degraded: task commands restarting (...)``; ``problems`` lists them,
``unavailable`` the dependencies down, ``outages`` counts them per dependency since start, and
``tasks`` shows each supervised loop. A request whose body names a debug section
(:attr:`ServiceContext.debug`) gets that section too.
"""

import asyncio
import contextlib
import functools
import gc
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import msgspec
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg

from loom import security
from loom.bus import Publisher, connect, ensure_streams
from loom.bus.connection import credentials_path
from loom.bus.outage import Dependencies, Dependency, of_connection
from loom.bus.reply import answerable, respond
from loom.runtime.config import endpoints, nats_endpoint
from loom.runtime.watchdog import Watchdog
from loom.security import may_manage_streams
from loom.security.message_ids import id_key
from loom.store import pool as store_pool
from loom.store.pool import create_pool
from loom.telemetry import setup_telemetry, shutdown_telemetry
from loom.telemetry.metrics import serve_metrics
from loom_proto import subjects


@dataclass
class ServiceContext:
    """Connections and shared state handed to a service body."""

    name: str
    nc: Client
    publisher: Publisher
    pool: asyncpg.Pool | None
    stopping: asyncio.Event
    started_at: float = field(default_factory=time.time)
    stats: dict[str, Any] = field(default_factory=dict)
    live_stats: list[Callable[[], dict[str, Any]]] = field(default_factory=list)
    """Stats computed when a health answer asks for them (what would cost too much to keep up to
    date on every change, e.g. an agent's sorted list of runs); merged over :attr:`stats`."""
    debug: dict[str, Callable[[str], Any]] = field(default_factory=dict)
    """Sections only a health request that names one in its body gets (``name`` or
    ``name:argument``; the answer gains ``name``): debug figures too large for every answer, e.g.
    placement's per-job timings (``job_timings:<job id prefix>``)."""
    watchdog: Watchdog = field(init=False)
    """Supervises the service's long-lived tasks; its health joins every health answer."""
    dependencies: Dependencies | None = None
    """The servers this service stands on and which are down (consumers wait outages out)."""

    def __post_init__(self) -> None:
        self.watchdog = Watchdog(self.name)

    def health(self) -> dict[str, Any]:
        """The health reply: identity, uptime, the service's stats, then its status: dependencies
        down and the watchdog's problems."""
        deps = self.dependencies
        unavailable = list(deps.unavailable) if deps else []
        watched = self.watchdog.health()
        problems = [f"{name} unavailable" for name in unavailable] + list(watched["problems"])
        return {
            "service": self.name,
            "pid": os.getpid(),
            "uptime_s": round(time.time() - self.started_at, 3),
            **self.stats,
            **{k: v for live in self.live_stats for k, v in live().items()},
            "status": "degraded: " + "; ".join(problems) if problems else "ok",
            "problems": problems,
            "unavailable": unavailable,
            "outages": dict(deps.outages) if deps else {},
            "tasks": watched["tasks"],
        }

    @property
    def db(self) -> asyncpg.Pool:
        """The pool; only for services started with ``needs_db``."""
        assert self.pool is not None, f"{self.name} was started without a database"
        return self.pool


class GcPauses:
    """The cyclic collector's pauses in this process, per generation: how many, their total and the
    longest (ms), from :meth:`install` on (a service's health answer shows them, ``gc``)."""

    def __init__(self) -> None:
        self.started: float | None = None
        self.by_generation: dict[int, list[float]] = {0: [0, 0.0, 0.0], 1: [0, 0.0, 0.0], 2: [0, 0.0, 0.0]}

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self.started = time.perf_counter()
            return
        if self.started is None:
            return
        pause_ms = (time.perf_counter() - self.started) * 1000.0
        self.started = None
        entry = self.by_generation[info.get("generation", 2)]
        entry[0] += 1
        entry[1] += pause_ms
        entry[2] = max(entry[2], pause_ms)

    def install(self) -> None:
        if self not in gc.callbacks:
            gc.callbacks.append(self)

    def uninstall(self) -> None:
        if self in gc.callbacks:
            gc.callbacks.remove(self)

    def stats(self) -> dict[str, Any]:
        return {
            f"gen{g}": {"count": int(n), "total_ms": round(total, 2), "max_ms": round(longest, 2)}
            for g, (n, total, longest) in self.by_generation.items()
        }


async def open_context(
    name: str, *, nats_url: str, database_url: str | None, stopping: asyncio.Event | None = None
) -> ServiceContext:
    """Connect to NATS (and PostgreSQL), ensure streams, answer health requests."""
    nc = await connect(nats_url, name)
    creds = credentials_path(nats_url)
    credential = security.read(creds) if creds is not None else None
    if credential is None or may_manage_streams(credential.identity):
        # An agent's or tenant's identity may not touch streams: the supervisor made them.
        await ensure_streams(nc.jetstream())
    pool = await create_pool(database_url, max_size=8) if database_url else None
    dependencies = of_connection(nc)
    if pool is not None:
        dependencies.add(
            Dependency("postgres", functools.partial(store_pool.probe, pool), store_pool.is_unavailable)
        )
    ctx = ServiceContext(
        name=name,
        nc=nc,
        publisher=Publisher(nc, id_key=id_key(credential)),
        pool=pool,
        stopping=stopping or asyncio.Event(),
        dependencies=dependencies,
    )

    async def on_health(msg: Msg) -> None:
        if not answerable(msg):  # a reply that is no inbox: dropped (loom.bus.reply)
            return
        # Probe the dependencies (in the background, at most once a second): an idle service meets
        # no error that would reveal an outage; the next health answer shows what the probes found.
        dependencies.check_soon()
        answer = ctx.health()
        if msg.data:
            name, _, argument = msg.data.decode(errors="replace").partition(":")
            section = ctx.debug.get(name)
            if section is not None:
                answer[name] = section(argument)
        await respond(msg, msgspec.json.encode(answer))

    await nc.subscribe(subjects.service_health(name), cb=on_health)
    return ctx


async def close_context(ctx: ServiceContext) -> None:
    """Stop the tasks still supervised and the dependency probes, drain NATS and close the pool."""
    await ctx.watchdog.stop()
    if ctx.dependencies is not None:
        await ctx.dependencies.close()
    with contextlib.suppress(Exception):
        await ctx.nc.drain()
    if ctx.pool is not None:
        with contextlib.suppress(Exception):
            await ctx.pool.close()


def run(name: str, body: Callable[[ServiceContext], Awaitable[None]], *, needs_db: bool = True) -> None:
    """Run a service process until SIGTERM / SIGINT, then shut down cleanly."""
    setup_telemetry(name)  # also configures JSON logs with trace ids
    log = structlog.get_logger(name)
    metrics_port = serve_metrics(name)  # /metrics on $LOOM_METRICS_PORT, when set

    async def main() -> None:
        stopping = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stopping.set)
        nats_url = nats_endpoint()
        database_url = endpoints().database_url if needs_db else None
        # A SIGTERM or Ctrl-C while NATS (or PostgreSQL) cannot be reached yet stops the process:
        # the connect retries for ever otherwise, and only SIGKILL ended it.
        opening = asyncio.ensure_future(
            open_context(name, nats_url=nats_url, database_url=database_url, stopping=stopping)
        )
        stopped = asyncio.ensure_future(stopping.wait())
        await asyncio.wait([opening, stopped], return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if not opening.done():
            opening.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await opening
            log.info("service stopped before it connected")
            return
        ctx = opening.result()
        # Everything loaded so far lives as long as the process: keep it out of the collector's
        # scans, and collect young objects less often, so a busy service does not stall for a
        # full collection in the middle of a decision.
        if metrics_port is not None:
            ctx.stats["metrics_port"] = metrics_port
        gc.freeze()
        gc.set_threshold(50_000, 20, 50)
        pauses = GcPauses()
        pauses.install()
        ctx.live_stats.append(lambda: {"gc": pauses.stats()})
        log.info("service started", pid=os.getpid(), metrics_port=metrics_port)
        try:
            await body(ctx)
        finally:
            await close_context(ctx)
            log.info("service stopped")

    try:
        asyncio.run(main())
    finally:
        shutdown_telemetry()
