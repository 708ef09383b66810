"""NATS JetStream plumbing: connect, streams, traced idempotent publish, durable pull consumers.

Every service talks to the bus through this package only, so message ids, trace headers, retry
and dead-lettering work the same way everywhere.
"""

from loom.bus.connection import BusError, connect, ensure_streams, server_urls, stream_config
from loom.bus.consumer import ConsumerRunner, ConsumerSpec, Delivery, stop_runners
from loom.bus.publisher import Publisher

__all__ = [
    "BusError",
    "ConsumerRunner",
    "ConsumerSpec",
    "Delivery",
    "Publisher",
    "connect",
    "ensure_streams",
    "server_urls",
    "stop_runners",
    "stream_config",
]
