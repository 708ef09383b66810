"""Probe endpoints and probe clients for the emulator: UDP echo, TCP echo / bulk, and their clients.

* :class:`UdpEchoServer` sends every datagram back to its sender.
* :class:`TcpProbeServer` speaks a one-line header per connection: ``ECHO`` (echo every byte),
  ``UP <n>`` (read ``n`` bytes, answer ``OK <n>``) or ``DOWN <n>`` (send ``n`` bytes).
* :class:`UdpProber` sends numbered datagrams and times their echoes; a probe unanswered within
  ``timeout_s`` is lost. :func:`udp_ping` runs a fixed number of them.
* :func:`tcp_bulk` measures throughput by pushing a byte budget and waiting for the ``OK``.

:func:`to_sample` turns a probe result into the wire :class:`loom_proto.net.ProbeSample`.
"""

import asyncio
import contextlib
import heapq
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, cast

from loom_proto.net import ProbeSample

__all__ = [
    "BulkResult",
    "ProbeResult",
    "TcpProbeServer",
    "UdpEchoServer",
    "UdpProber",
    "tcp_bulk",
    "to_sample",
    "udp_ping",
]

Address = tuple[str, int]

_HEADER = struct.Struct("!Q")
_MAX_HEADER_BYTES = 64
_CHUNK_BYTES = 64 * 1024


class _Echo(asyncio.DatagramProtocol):
    def __init__(self) -> None:
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # The selector loop's datagram transport does not subclass DatagramTransport; it behaves as one.
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: Address) -> None:
        if self.transport is not None:
            self.transport.sendto(data, addr)


RECEIVE_BUFFER_BYTES = 1 << 20
"""Receive buffer asked for on probe sockets (the kernel caps it at ``net.core.rmem_max``): a
link in use gets a hundred probes or more at one send tick (:mod:`loom.net.intensity`), from
several collectors at once, and the default buffer (208 KiB: under 200 small datagrams) overflows
while the reader waits for the GIL or its event loop: losses of the probing's own making."""


def grow_receive_buffer(sock: socket.socket | None, size: int = RECEIVE_BUFFER_BYTES) -> int | None:
    """Ask for a receive buffer of ``size`` bytes on ``sock`` (best effort: never smaller than it
    was); the size the kernel reports then (Linux: twice what it grants), None if unknown."""
    if sock is None:
        return None
    with contextlib.suppress(OSError):
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) < size:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, size)
        return int(sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF))
    return None


def receive_buffer_bytes(size: int = RECEIVE_BUFFER_BYTES) -> int | None:
    """The receive buffer a probe socket gets when it asks for ``size`` (as the kernel reports it):
    below ``size``, the kernel capped it (``net.core.rmem_max``)."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        return grow_receive_buffer(sock, size)
    return None


class UdpEchoServer:
    """Echoes datagrams on ``host:port`` (port 0 picks a free one; see :attr:`address`).

    With ``threaded`` a thread of its own answers, blocked in ``recvfrom`` between datagrams: an
    answer costs a wake-up of that thread and two system calls, not a round of the event loop
    (on a shared two-core host a third of the CPU per probe, measured at 25 probes a second), and
    a busy event loop does not delay it. The thread takes the GIL only for the few bytecodes of
    each answer."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, threaded: bool = False) -> None:
        self._host = host
        self._port = port
        self.threaded = threaded
        self._transport: asyncio.DatagramTransport | None = None
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.address: Address = (host, port)

    async def start(self) -> "UdpEchoServer":
        """Bind and start echoing."""
        if self.threaded:
            family, kind, proto, _, sockaddr = socket.getaddrinfo(
                self._host, self._port, type=socket.SOCK_DGRAM
            )[0]
            sock = socket.socket(family, kind, proto)
            grow_receive_buffer(sock)
            sock.bind(sockaddr)
            self._sock = sock
            self.address = sock.getsockname()[:2]
            self._stopping = False
            self._thread = threading.Thread(
                target=self._echo_forever, args=(sock,), name="udp-echo", daemon=True
            )
            self._thread.start()
            return self
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_datagram_endpoint(_Echo, local_addr=(self._host, self._port))
        grow_receive_buffer(transport.get_extra_info("socket"))
        self._transport = transport
        self.address = transport.get_extra_info("sockname")[:2]
        return self

    def _echo_forever(self, sock: socket.socket) -> None:
        while True:
            try:
                data, addr = sock.recvfrom(65535)
            except OSError:
                return  # closed
            if self._stopping:
                return
            # A client gone (ICMP port unreachable) fails a later send: ignored, as the
            # event loop's transport ignores it.
            with contextlib.suppress(OSError):
                sock.sendto(data, addr)

    async def close(self) -> None:
        """Stop echoing."""
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        sock, thread = self._sock, self._thread
        if sock is not None and thread is not None:
            self._stopping = True
            host, port = self.address
            wildcard = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}  # bound to any: say loopback
            # An empty datagram to itself wakes the thread out of recvfrom to see it must stop.
            with contextlib.suppress(OSError):
                sock.sendto(b"", (wildcard.get(host, host), port))
            await asyncio.to_thread(thread.join, 2.0)
            sock.close()
            self._sock = self._thread = None

    async def __aenter__(self) -> "UdpEchoServer":
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class TcpProbeServer:
    """The TCP end of probes: echo, sink (``UP``) or source (``DOWN``) of a byte budget."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._host = host
        self._port = port
        self._server: asyncio.Server | None = None
        self._handlers: dict[asyncio.Task[None], asyncio.StreamWriter] = {}
        self.address: Address = (host, port)

    async def start(self) -> "TcpProbeServer":
        """Start listening."""
        self._server = await asyncio.start_server(self._serve, self._host, self._port)
        self.address = self._server.sockets[0].getsockname()[:2]
        return self

    async def close(self) -> None:
        """Stop listening and drop open connections."""
        if self._server is not None:
            self._server.close()
        # Abort the connections rather than cancel the handlers (asyncio's stream server reports
        # a cancelled callback task as an error); each handler then ends on its own.
        for writer in list(self._handlers.values()):
            writer.transport.abort()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def __aenter__(self) -> "TcpProbeServer":
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None  # a server callback always runs in a task
        self._handlers[task] = writer
        try:
            header = await reader.readline()
            command, _, argument = header[:_MAX_HEADER_BYTES].strip().partition(b" ")
            if command == b"ECHO":
                while data := await reader.read(_CHUNK_BYTES):
                    writer.write(data)
                    await writer.drain()
            elif command == b"UP":
                remaining = int(argument)
                while remaining > 0 and (data := await reader.read(min(remaining, _CHUNK_BYTES))):
                    remaining -= len(data)
                writer.write(b"OK %d\n" % (int(argument) - remaining))
                await writer.drain()
            elif command == b"DOWN":
                remaining = int(argument)
                block = bytes(_CHUNK_BYTES)
                while remaining > 0:
                    writer.write(block[: min(remaining, _CHUNK_BYTES)])
                    remaining -= min(remaining, _CHUNK_BYTES)
                    await writer.drain()
        except (OSError, ValueError, asyncio.IncompleteReadError):
            pass
        finally:
            self._handlers.pop(task, None)
            writer.close()


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """One probe: its number, when it was sent (unix seconds) and its RTT (None: lost)."""

    seq: int
    sent_at: float
    rtt_ms: float | None


class RelayClient(Protocol):
    """An in-process client of a relay (:class:`loom.netemu.emulator.InProcessClient`)."""

    def send(self, data: bytes) -> None:
        """Send one datagram through the relay."""

    def detach(self) -> None:
        """Stop being a client of the relay."""


class Relay(Protocol):
    """A relay a prober in the same process can send through without a socket of its own
    (:meth:`loom.netemu.emulator.UdpRelay.attach`)."""

    def attach(
        self, deliver: Callable[[bytes], None], *, take: Callable[[bytes, float], bool] | None = None
    ) -> RelayClient:
        """A client whose answers are handed to ``deliver``, unless ``take`` (offered each answer
        with the loop time it arrives at, as soon as that is known) takes it over."""
        ...


class _ProberProtocol(asyncio.DatagramProtocol):
    def __init__(self, prober: "UdpProber") -> None:
        self.prober = prober

    def datagram_received(self, data: bytes, addr: Address) -> None:
        self.prober._answered(data)


class UdpProber:
    """Numbered UDP probes to one echo target; results arrive on :attr:`results` as they complete."""

    def __init__(
        self,
        target: Address,
        *,
        timeout_s: float = 1.0,
        payload_bytes: int = 64,
        on_result: Callable[[ProbeResult], None] | None = None,
        relay: Relay | None = None,
        hold: Callable[[int, float], bool] | None = None,
    ) -> None:
        self.target = target
        self.relay = relay
        """With a relay in this process (in front of ``target``), probes go through it directly
        (:meth:`Relay.attach`): the same shaping and timing, without the loopback hops to it."""
        self.hold = hold
        """With a relay: ``hold(seq, rtt_ms)`` says whether the answer to probe ``seq``, known to
        arrive after ``rtt_ms``, may wait for the next :meth:`send` (or :meth:`flush`, or a probe's
        timeout) instead of waking the loop when it arrives. A held answer keeps its RTT (from the
        time it arrived, not the time it is handed over) and its order among the answers; it is
        handed over before any probe sent later and before any loss reported later."""
        self._held: list[tuple[float, int, bytes]] = []
        """Answers taken over from the relay: (arrival loop time, seq, payload), a heap."""
        self.timeout_s = timeout_s
        self.payload_bytes = max(payload_bytes, _HEADER.size)
        self.results: asyncio.Queue[ProbeResult] = asyncio.Queue()
        """Results as they complete, unless ``on_result`` takes them (called at once, no task wakes)."""
        self._deliver: Callable[[ProbeResult], None] = on_result or self.results.put_nowait
        self._payload_tail = bytes(self.payload_bytes - _HEADER.size)
        self._transport: asyncio.DatagramTransport | None = None
        self._via: RelayClient | None = None
        self._outstanding: dict[int, tuple[float, float, asyncio.TimerHandle]] = {}
        self._next_seq = 0

    async def start(self) -> "UdpProber":
        """Open the probing socket (or attach to the relay)."""
        if self.relay is not None:
            self._via = self.relay.attach(self._answered, take=self._take if self.hold is not None else None)
            return self
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_datagram_endpoint(
            lambda: _ProberProtocol(self), remote_addr=self.target
        )
        grow_receive_buffer(transport.get_extra_info("socket"))
        self._transport = transport
        return self

    async def close(self) -> None:
        """Close the socket; held answers already arrived are handed over, outstanding probes
        reported lost."""
        self.flush()
        for seq in list(self._outstanding):
            self._expire(seq)
        if self._via is not None:
            self._via.detach()
            self._via = None
        if self._transport is not None:
            self._transport.close()
            self._transport = None

    async def __aenter__(self) -> "UdpProber":
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def outstanding(self) -> int:
        """Probes sent and neither answered nor timed out."""
        return len(self._outstanding)

    def send(self, timeout_s: float | None = None) -> int:
        """Send the next probe now (after handing over the held answers that have arrived);
        returns its sequence number. ``timeout_s``: this probe's timeout, if not the prober's
        (an answer after it is late and ignored: the probe was reported lost)."""
        via = self._via
        if self._transport is None and via is None:
            raise RuntimeError("prober is not started")
        if self._held:
            self.flush()
        loop = asyncio.get_running_loop()
        seq = self._next_seq
        self._next_seq += 1
        payload = _HEADER.pack(seq) + self._payload_tail
        timer = loop.call_later(self.timeout_s if timeout_s is None else timeout_s, self._expire, seq)
        self._outstanding[seq] = (loop.time(), time.time(), timer)
        if via is not None:
            via.send(payload)
        elif self._transport is not None:
            self._transport.sendto(payload)
        return seq

    def flush(self) -> None:
        """Hand over the held answers that have arrived by now, in the order they arrived."""
        held = self._held
        if not held:
            return
        now = asyncio.get_running_loop().time()
        while held and held[0][0] <= now:
            at, _, data = heapq.heappop(held)
            self._answered(data, at)

    def _take(self, data: bytes, at: float) -> bool:
        # Offered by the relay as soon as it knows when the answer arrives: keep it for the next
        # send (no timer, no wake-up of its own) when ``hold`` allows.
        if self.hold is None or len(data) < _HEADER.size:
            return False
        (seq,) = _HEADER.unpack_from(data)
        entry = self._outstanding.get(seq)
        if entry is None or not self.hold(seq, (at - entry[0]) * 1000.0):
            return False
        heapq.heappush(self._held, (at, seq, data))
        return True

    def _answered(self, data: bytes, at: float | None = None) -> None:
        if len(data) < _HEADER.size:
            return
        (seq,) = _HEADER.unpack_from(data)
        entry = self._outstanding.pop(seq, None)
        if entry is None:
            return  # late (already counted lost) or duplicated
        sent_mono, sent_wall, timer = entry
        timer.cancel()
        if at is None:
            at = asyncio.get_running_loop().time()
        self._deliver(ProbeResult(seq, sent_wall, (at - sent_mono) * 1000.0))

    def _expire(self, seq: int) -> None:
        if self._held:
            self.flush()  # an answer that arrived before this timeout is no loss
        entry = self._outstanding.pop(seq, None)
        if entry is not None:
            entry[2].cancel()
            self._deliver(ProbeResult(seq, entry[1], None))


async def udp_ping(
    target: Address, *, count: int, interval_s: float = 0.01, timeout_s: float = 1.0
) -> list[ProbeResult]:
    """Send ``count`` probes ``interval_s`` apart; every result (answered or lost), by sequence number."""
    async with UdpProber(target, timeout_s=timeout_s) as prober:
        for i in range(count):
            if i:
                await asyncio.sleep(interval_s)  # pacing the probes, not a synchronisation
            prober.send()
        results = [await asyncio.wait_for(prober.results.get(), timeout_s + 1.0) for _ in range(count)]
    return sorted(results, key=lambda r: r.seq)


@dataclass(frozen=True, slots=True)
class BulkResult:
    """A bulk transfer: bytes moved, seconds taken (first byte sent to ``OK`` received), and the rate."""

    nbytes: int
    seconds: float

    @property
    def mbps(self) -> float:
        """Megabits per second."""
        return self.nbytes * 8.0 / self.seconds / 1e6 if self.seconds > 0 else float("inf")


async def tcp_bulk(target: Address, nbytes: int, *, timeout_s: float = 30.0) -> BulkResult:
    """Push ``nbytes`` to a :class:`TcpProbeServer` (``UP``) and time it until the server's ``OK``.

    The time includes one round trip (the ``OK`` coming back); use a budget that takes much
    longer than that.
    """

    async def run() -> BulkResult:
        reader, writer = await asyncio.open_connection(*target)
        try:
            loop = asyncio.get_running_loop()
            writer.write(b"UP %d\n" % nbytes)
            started = loop.time()
            block = bytes(_CHUNK_BYTES)
            remaining = nbytes
            while remaining > 0:
                size = min(remaining, _CHUNK_BYTES)
                writer.write(block[:size])
                remaining -= size
                await writer.drain()
            answer = await reader.readline()
            if not answer.startswith(b"OK"):
                raise ConnectionError(f"bulk target answered {answer!r}")
            return BulkResult(int(answer.split()[1]), loop.time() - started)
        finally:
            writer.close()

    return await asyncio.wait_for(run(), timeout_s)


def to_sample(src: str, dst: str, result: ProbeResult) -> ProbeSample:
    """The wire sample of one UDP echo probe result."""
    lost = result.rtt_ms is None
    return ProbeSample(
        src=src,
        dst=dst,
        probe="udp_echo",
        seq=result.seq,
        sent_at=result.sent_at,
        rtt_ms=result.rtt_ms,
        sent=1,
        lost=1 if lost else 0,
    )
