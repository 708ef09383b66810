"""WAN emulation in user space (no ``tc netem``): relays that delay, jitter, drop, cap and blackhole.

:mod:`~loom.netemu.emulator` holds the UDP and TCP relays and their run-time changeable
:class:`~loom.netemu.emulator.LinkParams`; :mod:`~loom.netemu.probes` the echo / bulk servers
and probe clients; :mod:`~loom.netemu.wan` a set of relays between regions, each shaped like the
topology's measured link. This is I/O (asyncio); the network *logic* lives in :mod:`loom.net`.
"""

from loom.netemu.emulator import (
    BANDWIDTH_SCALE,
    LinkParams,
    RelayCounters,
    Shaper,
    TcpRelay,
    UdpRelay,
    params_from_link,
)
from loom.netemu.probes import (
    RECEIVE_BUFFER_BYTES,
    BulkResult,
    ProbeResult,
    TcpProbeServer,
    UdpEchoServer,
    UdpProber,
    receive_buffer_bytes,
    tcp_bulk,
    to_sample,
    udp_ping,
)
from loom.netemu.wan import WanEmulator

__all__ = [
    "BANDWIDTH_SCALE",
    "RECEIVE_BUFFER_BYTES",
    "BulkResult",
    "LinkParams",
    "ProbeResult",
    "RelayCounters",
    "Shaper",
    "TcpProbeServer",
    "TcpRelay",
    "UdpEchoServer",
    "UdpProber",
    "UdpRelay",
    "WanEmulator",
    "params_from_link",
    "receive_buffer_bytes",
    "tcp_bulk",
    "to_sample",
    "udp_ping",
]
