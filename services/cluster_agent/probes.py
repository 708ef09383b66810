"""The cluster's probe responders: a UDP echo and a TCP echo / bulk endpoint, and where to find them.

Collectors in other regions measure RTT, loss and jitter against the UDP echo and bandwidth
against the TCP endpoint (see :mod:`loom.netemu.probes` for the protocol). The agent announces
both on ``loom.net.endpoints.<cluster>`` (request-reply), so ports may be picked at random.
"""

import socket

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from loom.bus.reply import respond
from loom.netemu import TcpProbeServer, UdpEchoServer
from loom.runtime.service import ServiceContext
from loom_proto import subjects
from loom_proto.codec import encode
from loom_proto.net import ProbeEndpoints


class ProbeResponder:
    """Serves the probe endpoints of one cluster while it runs; :meth:`start`, then :meth:`close`."""

    def __init__(
        self,
        ctx: ServiceContext,
        *,
        cluster: str,
        region: str,
        host: str = "127.0.0.1",
        udp_port: int = 0,
        tcp_port: int = 0,
        advertise_host: str | None = None,
    ) -> None:
        self.ctx = ctx
        self.cluster = cluster
        self.region = region
        # Its own thread answers the probes: no event-loop round per probe (UdpEchoServer's threaded).
        self.udp = UdpEchoServer(host, udp_port, threaded=True)
        self.tcp = TcpProbeServer(host, tcp_port)
        # A wildcard bind is reached under the machine's name (a container's service name in compose).
        self.advertise_host = advertise_host or (socket.gethostname() if host in ("0.0.0.0", "::") else host)
        self._sub: Subscription | None = None

    @property
    def endpoints(self) -> ProbeEndpoints:
        """What ``loom.net.endpoints.<cluster>`` answers."""
        return ProbeEndpoints(
            cluster=self.cluster,
            region=self.region,
            host=self.advertise_host,
            udp_port=self.udp.address[1],
            tcp_port=self.tcp.address[1],
        )

    async def start(self) -> "ProbeResponder":
        """Bind both endpoints and start answering where they are."""
        await self.udp.start()
        await self.tcp.start()
        self.ctx.stats["probe_endpoints"] = {"udp_port": self.udp.address[1], "tcp_port": self.tcp.address[1]}
        self._sub = await self.ctx.nc.subscribe(subjects.net_endpoints(self.cluster), cb=self._on_request)
        return self

    async def _on_request(self, msg: Msg) -> None:
        await respond(msg, encode(self.endpoints))

    async def close(self) -> None:
        """Stop answering and close both endpoints."""
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None
        await self.tcp.close()
        await self.udp.close()
