"""Connecting to NATS and making sure Loom's streams exist with the configured limits."""

import os

import nats
import structlog
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError, NotFoundError

from loom.errors import LoomError
from loom_proto.subjects import STREAMS, StreamSpec

log = structlog.get_logger("loom.bus")


class BusError(LoomError):
    """The bus could not do what was asked (connection lost, stream misconfigured)."""


async def connect(url: str, name: str, *, connect_timeout_s: float = 5.0) -> Client:
    """Connect with unbounded reconnects, so a NATS restart pauses a service instead of ending it."""

    async def on_error(exc: Exception) -> None:
        log.warning("nats error", error=str(exc), client=name)

    client: list[Client] = []

    async def on_disconnected() -> None:
        # A drain or close disconnects too; only an unexpected loss is worth a warning.
        if client and (client[0].is_closed or client[0].is_draining):
            return
        log.warning("nats disconnected", client=name)

    async def on_reconnected() -> None:
        log.info("nats reconnected", client=name)

    try:
        nc = await nats.connect(
            servers=[url],
            name=name,
            connect_timeout=connect_timeout_s,
            allow_reconnect=True,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            error_cb=on_error,
            disconnected_cb=on_disconnected,
            reconnected_cb=on_reconnected,
            # Keep queued publishes while reconnecting rather than failing them at once.
            pending_size=64 * 1024 * 1024,
        )
    except Exception as exc:  # nats raises several unrelated types for "could not connect"
        raise BusError(f"cannot connect to NATS at {url}: {exc}") from exc
    client.append(nc)
    return nc


def stream_config(spec: StreamSpec) -> StreamConfig:
    """The JetStream config of one of Loom's streams: file storage, dedup window, limits."""
    return StreamConfig(
        name=spec.name,
        subjects=list(spec.subjects),
        description=spec.description,
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        discard=DiscardPolicy.OLD,
        max_age=spec.max_age_s,
        max_bytes=spec.max_bytes,
        max_msg_size=spec.max_msg_bytes,
        duplicate_window=spec.duplicate_window_s,
        # 3 on a NATS cluster (deploy/nats/cluster-3.conf); 1 for the embedded single server.
        num_replicas=int(os.environ.get("LOOM_STREAM_REPLICAS", "1")),
    )


async def ensure_streams(js: JetStreamContext, specs: tuple[StreamSpec, ...] = STREAMS) -> None:
    """Create each stream, or update it to the configured limits when it already exists."""
    for spec in specs:
        config = stream_config(spec)
        try:
            await js.stream_info(spec.name)
        except NotFoundError:
            try:
                await js.add_stream(config)
            except BadRequestError:
                # Another service created it between our look-up and our add.
                await js.update_stream(config)
        else:
            await js.update_stream(config)
