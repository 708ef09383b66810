"""User-space link emulator: asyncio UDP and TCP relays with per-direction delay, jitter, loss,
a bandwidth cap and blackholing, all changeable while traffic flows (:meth:`UdpRelay.set_params`).

A relay listens on ``127.0.0.1:<port>`` and forwards to a target ``host:port``; the *forward*
direction is client → target, *reverse* is target → client. Per direction, a :class:`Shaper`
decides each datagram's (or chunk's) fate:

* **blackhole** drops every datagram; for TCP it stalls the stream (data waits, as a real
  blackhole leaves TCP retransmitting) until lifted;
* **loss** drops a datagram with probability ``loss``. TCP cannot lose bytes, so for TCP a chunk
  carrying ``n`` MSS-sized segments is hit with probability ``1 − (1 − loss)^n`` and then
  delivered after a retransmission-like stall of ``max(200 ms, 2 × RTT)`` (Linux's minimum RTO,
  or two round trips of this link when longer), which is what loss does to a TCP stream's timing;
* **bandwidth cap** serialises traffic at ``bandwidth_mbps`` through a shared tail-drop queue (a
  token bucket one packet deep): a datagram that would wait longer than ``queue_ms`` is dropped,
  a TCP chunk waits (the relay stops reading, so the sender sees flow control);
* **delay + jitter**: each datagram is delivered ``delay_ms + N(0, jitter_ms)`` (not below 0)
  after it leaves the queue. UDP datagrams may be reordered by jitter, as with netem; TCP chunks
  keep their order (delivery times never go backwards within a stream).

Bandwidths from measured WAN links are scaled by :data:`BANDWIDTH_SCALE` for loopback: a link
measured at 4 Gbps is emulated at 4 Mbps, which keeps a Python relay's CPU use negligible while
preserving every ratio between links.
"""

import asyncio
import contextlib
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from loom.model.topology import Link
from loom.netemu.probes import grow_receive_buffer
from loom.tasks import cancel_and_wait

__all__ = [
    "BANDWIDTH_SCALE",
    "MIN_RTO_S",
    "TCP_SEGMENT_BYTES",
    "InProcessClient",
    "LinkParams",
    "RelayCounters",
    "Shaper",
    "TcpRelay",
    "UdpRelay",
    "params_from_link",
]

BANDWIDTH_SCALE = 1e-3
"""Emulated bandwidth ÷ measured bandwidth: Gbps on the WAN become Mbps on loopback."""

MIN_RTO_S = 0.2
"""Linux's minimum TCP retransmission timeout; the shortest stall a lost TCP segment causes."""

TCP_SEGMENT_BYTES = 1448
"""Payload of one TCP segment on a 1500-byte MTU path; a chunk of n bytes is ceil(n / this) segments."""

_TCP_CHUNK_BYTES = 64 * 1024
_TCP_QUEUE_CHUNKS = 64
_CONNECT_TIMEOUT_S = 10.0

Address = tuple[str, int]

_IN_PROCESS_HOST = "in-process"
"""The host part of an in-process client's address (:meth:`UdpRelay.attach`); never a socket's."""


@dataclass(frozen=True, slots=True)
class LinkParams:
    """One direction of an emulated link."""

    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    """Standard deviation of a normally distributed extra delay."""
    loss: float = 0.0
    """Probability that a datagram is dropped (0..1)."""
    bandwidth_mbps: float | None = None
    """None: unlimited."""
    blackhole: bool = False
    queue_ms: float = 250.0
    """Longest a datagram may wait in the bandwidth queue before it is dropped instead."""

    def __post_init__(self) -> None:
        for name in ("delay_ms", "jitter_ms", "queue_ms"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a non-negative number, got {value!r}")
        if not 0.0 <= self.loss <= 1.0:
            raise ValueError(f"loss must be within 0..1, got {self.loss!r}")
        if self.bandwidth_mbps is not None and not (
            math.isfinite(self.bandwidth_mbps) and self.bandwidth_mbps > 0
        ):
            raise ValueError(f"bandwidth_mbps must be positive or None, got {self.bandwidth_mbps!r}")


def params_from_link(
    link: Link, *, bandwidth_scale: float = BANDWIDTH_SCALE, loss: float = 0.0
) -> LinkParams:
    """One direction's parameters for a measured topology link.

    Half the mean RTT each way; jitter ``mdev / √2`` each way, so the round trip's deviation is the
    measured ``mdev``; bandwidth ``bandwidth_gbps × 1000 × bandwidth_scale`` Mbps (unlimited when
    the link has none). The topology records no loss, so ``loss`` is the caller's.
    """
    bandwidth = None if link.bandwidth_gbps is None else link.bandwidth_gbps * 1000.0 * bandwidth_scale
    return LinkParams(
        delay_ms=link.rtt_ms / 2.0,
        jitter_ms=link.rtt_mdev_ms / math.sqrt(2.0),
        loss=loss,
        bandwidth_mbps=bandwidth,
    )


class Shaper:
    """The fate of traffic in one direction: dropped, or delivered at a computed time.

    Pure apart from its random generator: the clock is passed in, so it is tested without sockets.
    """

    def __init__(self, params: LinkParams, rng: random.Random | None = None) -> None:
        self.params = params
        self.rng = rng or random.Random()
        self._busy_until = 0.0

    def _delay_s(self) -> float:
        params = self.params
        delay_ms = params.delay_ms
        if params.jitter_ms > 0:
            delay_ms = max(0.0, delay_ms + self.rng.gauss(0.0, params.jitter_ms))
        return delay_ms / 1000.0

    def _departure(self, now: float, size: int) -> float:
        """When ``size`` bytes entering now have left the bandwidth queue (now if uncapped)."""
        rate = self.params.bandwidth_mbps
        if rate is None:
            return now
        start = max(now, self._busy_until)
        self._busy_until = start + size * 8.0 / (rate * 1e6)
        return self._busy_until

    def datagram(self, now: float, size: int) -> float | None:
        """Delivery time of a datagram entering at ``now``, or None if it is dropped."""
        params = self.params
        if params.blackhole or (params.loss > 0 and self.rng.random() < params.loss):
            return None
        if params.bandwidth_mbps is not None:
            queued_s = max(self._busy_until - now, 0.0)
            if queued_s * 1000.0 > params.queue_ms:
                return None
        return self._departure(now, size) + self._delay_s()

    def chunk(self, now: float, size: int) -> float:
        """Delivery time of a TCP chunk entering at ``now`` (never dropped; see the module doc on loss)."""
        params = self.params
        at = self._departure(now, size) + self._delay_s()
        if params.loss > 0:
            segments = max(1, math.ceil(size / TCP_SEGMENT_BYTES))
            if self.rng.random() < 1.0 - (1.0 - params.loss) ** segments:
                at += max(MIN_RTO_S, 4.0 * params.delay_ms / 1000.0)
        return at


@dataclass(slots=True)
class RelayCounters:
    """Datagrams (UDP) or chunks (TCP) per direction: delivered and dropped."""

    forwarded: int = 0
    forward_dropped: int = 0
    returned: int = 0
    reverse_dropped: int = 0


@dataclass(slots=True)
class _Direction:
    shaper: Shaper
    open: asyncio.Event = field(default_factory=asyncio.Event)

    def apply(self, params: LinkParams) -> None:
        self.shaper.params = params
        if params.blackhole:
            self.open.clear()
        else:
            self.open.set()


class _RelayBase:
    """What both relays share: where they listen, where they forward, and the two directions."""

    def __init__(
        self,
        target: Address,
        forward: LinkParams,
        reverse: LinkParams | None,
        *,
        host: str,
        port: int,
        seed: int | None,
    ) -> None:
        self.target = target
        self._host = host
        self._port = port
        rng = random.Random(seed)
        self._forward = _Direction(Shaper(forward, random.Random(rng.random())))
        self._reverse = _Direction(Shaper(reverse or forward, random.Random(rng.random())))
        self._forward.apply(forward)
        self._reverse.apply(reverse or forward)
        self.counters = RelayCounters()
        self.address: Address = (host, port)

    @property
    def forward(self) -> LinkParams:
        """Parameters client → target."""
        return self._forward.shaper.params

    @property
    def reverse(self) -> LinkParams:
        """Parameters target → client."""
        return self._reverse.shaper.params

    def set_params(self, forward: LinkParams, reverse: LinkParams | None = None) -> None:
        """Change the link now; ``reverse`` defaults to ``forward``. Traffic in flight keeps its time."""
        self._forward.apply(forward)
        self._reverse.apply(reverse or forward)

    def update(self, **changes: object) -> None:
        """Change some fields of both directions (``relay.update(blackhole=True)``)."""
        # dataclasses.replace checks field names at run time and LinkParams checks values; mypy
        # cannot type **changes against the fields.
        forward = replace(self.forward, **changes)  # type: ignore[arg-type]
        reverse = replace(self.reverse, **changes)  # type: ignore[arg-type]
        self.set_params(forward, reverse)


class UdpRelay(_RelayBase):
    """A UDP relay: one upstream socket per client address, so replies find their way back.

    With ``echo`` the target is known to answer each datagram with the same bytes (a probe
    responder): a datagram then goes up at once and its forward delay is added to its echo's on
    the way back, so a round trip costs the relay one timer instead of two. What the client sees
    (round-trip time, loss, order) is the same; only the target sees datagrams early.
    """

    _ECHO_MEMORY = 1024
    """Forward delays remembered for echoes not back yet (the oldest are forgotten first)."""

    def __init__(
        self,
        target: Address,
        forward: LinkParams | None = None,
        reverse: LinkParams | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        seed: int | None = None,
        echo: bool = False,
    ) -> None:
        super().__init__(target, forward or LinkParams(), reverse, host=host, port=port, seed=seed)
        self.echo = echo
        self._owed: dict[tuple[Address, bytes], float] = {}
        """Echo mode: the forward delay still owed to each datagram's echo, by (client, bytes)."""
        self._transport: asyncio.DatagramTransport | None = None
        self._upstreams: dict[Address, asyncio.DatagramTransport] = {}
        self._pending: dict[Address, list[tuple[float, bytes]]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._timers: set[asyncio.TimerHandle] = set()
        self._local: dict[Address, Callable[[bytes], None]] = {}
        """In-process clients (:meth:`attach`): where their answers are handed over, by client."""
        self._take: dict[Address, Callable[[bytes, float], bool]] = {}
        """In-process clients that may take an answer over before it is due (:meth:`attach`'s ``take``)."""
        self._attached = 0

    async def start(self) -> "UdpRelay":
        """Bind the listening socket; :attr:`address` is then the real one."""
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_datagram_endpoint(
            lambda: _Listener(self), local_addr=(self._host, self._port)
        )
        grow_receive_buffer(transport.get_extra_info("socket"))
        self._transport = transport
        self.address = transport.get_extra_info("sockname")[:2]
        return self

    async def __aenter__(self) -> "UdpRelay":
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop relaying; datagrams still in flight are dropped."""
        for timer in self._timers:
            timer.cancel()
        self._timers.clear()
        await cancel_and_wait(list(self._tasks))
        for upstream in self._upstreams.values():
            upstream.close()
        self._upstreams.clear()
        if self._transport is not None:
            self._transport.close()
            self._transport = None

    def attach(
        self, deliver: Callable[[bytes], None], *, take: Callable[[bytes, float], bool] | None = None
    ) -> "InProcessClient":
        """An in-process client of the relay: its :meth:`InProcessClient.send` sends one datagram
        through the relay (as a client's ``sendto`` to :attr:`address` would), and ``deliver`` is
        called with each answer when it would have reached that client's socket.

        The shaping, the counters and the socket to the target are the same as for a client on
        the loopback; only the two hops between the client and the relay's listening socket are
        gone (a system call and an event-loop round each way, per datagram).

        With ``take``, each answer is first offered to it, with the loop time at which it reaches
        the client, as soon as the relay has shaped it: ``take`` returning True takes it over
        (counted returned; handing it over at that time or later is then the client's), so the
        relay sets no timer for it; False leaves it to ``deliver`` at that time, as without ``take``."""
        self._attached += 1
        client = InProcessClient(self, (_IN_PROCESS_HOST, self._attached))
        self._local[client.address] = deliver
        if take is not None:
            self._take[client.address] = take
        return client

    def _detach(self, client: Address) -> None:
        self._take.pop(client, None)
        if self._local.pop(client, None) is None:
            return
        upstream = self._upstreams.pop(client, None)
        if upstream is not None:
            upstream.close()

    def _later(self, at: float, send: Callable[[], None]) -> None:
        loop = asyncio.get_running_loop()

        def fire() -> None:
            self._timers.discard(handle)
            send()

        handle = loop.call_at(at, fire)
        self._timers.add(handle)

    def _from_client(self, data: bytes, client: Address) -> None:
        now = asyncio.get_running_loop().time()
        at = self._forward.shaper.datagram(now, len(data))
        if at is None:
            self.counters.forward_dropped += 1
            return
        if self.echo:
            owed = self._owed
            owed.pop((client, data), None)  # a repeated datagram owes its latest delay
            owed[client, data] = at - now
            if len(owed) > self._ECHO_MEMORY:
                del owed[next(iter(owed))]
            at = now
        upstream = self._upstreams.get(client)
        if upstream is None:
            pending = self._pending.get(client)
            if pending is None:
                self._pending[client] = [(at, data)]
                task = asyncio.get_running_loop().create_task(self._open_upstream(client))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            else:
                pending.append((at, data))
            return
        if self.echo and not upstream.is_closing():
            upstream.sendto(data)  # no timer: the delay is paid on the way back
            self.counters.forwarded += 1
            return
        self._send_up(upstream, at, data)

    def _send_up(self, upstream: asyncio.DatagramTransport, at: float, data: bytes) -> None:
        def send() -> None:
            if not upstream.is_closing():
                upstream.sendto(data)
                self.counters.forwarded += 1

        self._later(at, send)

    async def _open_upstream(self, client: Address) -> None:
        loop = asyncio.get_running_loop()
        try:
            upstream, _ = await loop.create_datagram_endpoint(
                lambda: _Upstream(self, client), remote_addr=self.target
            )
            grow_receive_buffer(upstream.get_extra_info("socket"))
        except OSError:
            self.counters.forward_dropped += len(self._pending.pop(client, []))
            return
        self._upstreams[client] = upstream
        for at, data in self._pending.pop(client, []):
            self._send_up(upstream, at, data)

    def _from_target(self, data: bytes, client: Address) -> None:
        now = asyncio.get_running_loop().time()
        if self.echo:
            # The echo reaches the relay when it would have, had its datagram waited on the way up.
            now += self._owed.pop((client, data), 0.0)
        at = self._reverse.shaper.datagram(now, len(data))
        if at is None:
            self.counters.reverse_dropped += 1
            return

        local = self._local.get(client)
        if local is not None:
            take = self._take.get(client)
            if take is not None and take(data, at):
                self.counters.returned += 1
                return

            def hand_over() -> None:
                if self._local.get(client) is local:
                    self.counters.returned += 1
                    local(data)

            self._later(at, hand_over)
            return

        def send() -> None:
            transport = self._transport
            if transport is not None and not transport.is_closing():
                transport.sendto(data, client)
                self.counters.returned += 1

        self._later(at, send)


class InProcessClient:
    """A client of a :class:`UdpRelay` in the relay's own process (:meth:`UdpRelay.attach`)."""

    def __init__(self, relay: UdpRelay, address: Address) -> None:
        self.relay = relay
        self.address = address
        """Its key in the relay (never a socket's address)."""

    def send(self, data: bytes) -> None:
        """Send one datagram through the relay (dropped once the relay or this client is closed)."""
        relay = self.relay
        if relay._transport is None or self.address not in relay._local:
            relay.counters.forward_dropped += 1
            return
        relay._from_client(data, self.address)

    def detach(self) -> None:
        """End this client: answers still in flight are dropped, its socket to the target closed."""
        self.relay._detach(self.address)


class _Listener(asyncio.DatagramProtocol):
    def __init__(self, relay: UdpRelay) -> None:
        self.relay = relay

    def datagram_received(self, data: bytes, addr: Address) -> None:
        self.relay._from_client(data, addr[:2])


class _Upstream(asyncio.DatagramProtocol):
    def __init__(self, relay: UdpRelay, client: Address) -> None:
        self.relay = relay
        self.client = client

    def datagram_received(self, data: bytes, addr: Address) -> None:
        self.relay._from_target(data, self.client)

    def error_received(self, exc: Exception) -> None:
        # ICMP port unreachable from a target that went away: the datagram is simply lost.
        self.relay.counters.forward_dropped += 1


class TcpRelay(_RelayBase):
    """A TCP relay: each accepted connection is joined to a new connection to the target."""

    def __init__(
        self,
        target: Address,
        forward: LinkParams | None = None,
        reverse: LinkParams | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        seed: int | None = None,
    ) -> None:
        super().__init__(target, forward or LinkParams(), reverse, host=host, port=port, seed=seed)
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self._pumps: set[asyncio.Task[None]] = set()
        self._closing = False

    async def start(self) -> "TcpRelay":
        """Start listening; :attr:`address` is then the real one."""
        self._server = await asyncio.start_server(self._accept, self._host, self._port)
        self.address = self._server.sockets[0].getsockname()[:2]
        return self

    async def __aenter__(self) -> "TcpRelay":
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop listening and cut every relayed connection."""
        self._closing = True
        if self._server is not None:
            self._server.close()
        # Cancel the pumps, not the connection tasks: asyncio's stream server reports a
        # cancelled callback task as an error; the connection tasks end once their pumps have.
        for pump in list(self._pumps):
            pump.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None  # a server callback always runs in a task
        self._connections.add(task)
        try:
            await self._join(reader, writer)
        finally:
            self._connections.discard(task)

    async def _join(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection(*self.target), _CONNECT_TIMEOUT_S
            )
        except (OSError, TimeoutError):
            client_writer.close()
            return
        if self._closing:  # close() ran while we were connecting
            up_writer.close()
            client_writer.close()
            return
        pumps = [
            asyncio.create_task(self._pump(client_reader, up_writer, self._forward, forward=True)),
            asyncio.create_task(self._pump(up_reader, client_writer, self._reverse, forward=False)),
        ]
        self._pumps.update(pumps)
        try:
            # Both directions run until each ends (half-close), or one fails, or close() cancels.
            await asyncio.wait(pumps, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for pump in pumps:
                pump.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            self._pumps.difference_update(pumps)
            for writer in (up_writer, client_writer):
                writer.close()

    async def _pump(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        direction: _Direction,
        *,
        forward: bool,
    ) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue(maxsize=_TCP_QUEUE_CHUNKS)

        async def read() -> None:
            try:
                while chunk := await reader.read(_TCP_CHUNK_BYTES):
                    await queue.put((loop.time(), chunk))
            finally:
                await queue.put(None)

        reading = asyncio.create_task(read())
        last_at = 0.0
        try:
            while (item := await queue.get()) is not None:
                entered, chunk = item
                if not direction.open.is_set():
                    await direction.open.wait()
                    entered = loop.time()
                at = max(direction.shaper.chunk(entered, len(chunk)), last_at)
                last_at = at
                wait = at - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)  # the emulated delay itself, not a synchronisation
                writer.write(chunk)
                await writer.drain()
                if forward:
                    self.counters.forwarded += 1
                else:
                    self.counters.returned += 1
            if writer.can_write_eof():
                writer.write_eof()
        finally:
            reading.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await reading
