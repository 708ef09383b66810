"""An emulated WAN between regions on one machine: every directed region pair gets its own relays.

Each region runs a :class:`~loom.netemu.probes.UdpEchoServer` and a
:class:`~loom.netemu.probes.TcpProbeServer` (its probe responders). Traffic from region ``a``
to region ``b`` is sent to ``udp_address(a, b)`` / ``tcp_address(a, b)``: relays that forward to
``b``'s responders shaped like the topology's measured link ``a → b`` (half its RTT each way,
its deviation as jitter, its bandwidth scaled for loopback; the reverse direction takes the
bandwidth of ``b → a`` where it was measured). ``set_params`` changes one link at run time.
"""

import asyncio
from collections.abc import Iterable
from dataclasses import replace

from loom.model.topology import Topology, TopologyError
from loom.netemu.emulator import BANDWIDTH_SCALE, LinkParams, TcpRelay, UdpRelay, params_from_link
from loom.netemu.probes import Address, TcpProbeServer, UdpEchoServer

__all__ = ["WanEmulator"]


class WanEmulator:
    """Relays between the given regions of a topology, on 127.0.0.1."""

    def __init__(
        self,
        topology: Topology,
        regions: Iterable[str] | None = None,
        *,
        bandwidth_scale: float = BANDWIDTH_SCALE,
        loss: float = 0.0,
        seed: int | None = None,
    ) -> None:
        self.topology = topology
        self.regions = list(regions) if regions is not None else [r.id for r in topology.regions]
        for region in self.regions:
            topology.region(region)  # raises TopologyError for an unknown region
        self.bandwidth_scale = bandwidth_scale
        self.loss = loss
        self.seed = seed
        self.udp_echo: dict[str, UdpEchoServer] = {}
        self.tcp_servers: dict[str, TcpProbeServer] = {}
        self.udp_relays: dict[tuple[str, str], UdpRelay] = {}
        self.tcp_relays: dict[tuple[str, str], TcpRelay] = {}

    def link_params(self, src: str, dst: str) -> tuple[LinkParams, LinkParams]:
        """Forward and reverse parameters of the measured link ``src -> dst``."""
        link = self.topology.link(src, dst)
        if link is None:
            raise TopologyError(f"topology {self.topology.name!r} has no link {src!r} -> {dst!r}")
        forward = params_from_link(link, bandwidth_scale=self.bandwidth_scale, loss=self.loss)
        back = self.topology.link(dst, src)
        reverse = forward
        if back is not None and back.bandwidth_gbps is not None:
            reverse = replace(forward, bandwidth_mbps=back.bandwidth_gbps * 1000.0 * self.bandwidth_scale)
        return forward, reverse

    def pairs(self) -> list[tuple[str, str]]:
        """Every directed pair of distinct regions with a measured link."""
        return [
            (a, b)
            for a in self.regions
            for b in self.regions
            if a != b and self.topology.link(a, b) is not None
        ]

    async def start(self) -> "WanEmulator":
        """Start every responder and relay."""
        for region in self.regions:
            self.udp_echo[region] = await UdpEchoServer().start()
            self.tcp_servers[region] = await TcpProbeServer().start()
        for index, (src, dst) in enumerate(self.pairs()):
            forward, reverse = self.link_params(src, dst)
            seed = None if self.seed is None else self.seed * 10_000 + index
            self.udp_relays[src, dst] = await UdpRelay(
                self.udp_echo[dst].address, forward, reverse, seed=seed
            ).start()
            self.tcp_relays[src, dst] = await TcpRelay(
                self.tcp_servers[dst].address, forward, reverse, seed=seed
            ).start()
        return self

    async def close(self) -> None:
        """Stop everything."""
        relays: list[UdpRelay | TcpRelay] = [*self.udp_relays.values(), *self.tcp_relays.values()]
        await asyncio.gather(*(relay.close() for relay in relays))
        servers: list[UdpEchoServer | TcpProbeServer] = [*self.udp_echo.values(), *self.tcp_servers.values()]
        await asyncio.gather(*(server.close() for server in servers))
        self.udp_relays.clear()
        self.tcp_relays.clear()
        self.udp_echo.clear()
        self.tcp_servers.clear()

    async def __aenter__(self) -> "WanEmulator":
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def udp_address(self, src: str, dst: str) -> Address:
        """Where ``src`` sends UDP meant for ``dst``'s echo."""
        return self.udp_relays[src, dst].address

    def tcp_address(self, src: str, dst: str) -> Address:
        """Where ``src`` connects to reach ``dst``'s TCP probe server."""
        return self.tcp_relays[src, dst].address

    def set_params(self, src: str, dst: str, forward: LinkParams, reverse: LinkParams | None = None) -> None:
        """Change the link ``src -> dst`` (both its relays) now."""
        self.udp_relays[src, dst].set_params(forward, reverse)
        self.tcp_relays[src, dst].set_params(forward, reverse)
