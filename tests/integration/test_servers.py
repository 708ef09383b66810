"""The embedded servers are real: JetStream acks, Postgres answers, state outlives restarts and kills."""

import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import asyncpg
import nats
import pytest

from loom.runtime.servers import NatsServer, PostgresServer, ServerStartError


@pytest.fixture
def own_nats(tmp_path: Path) -> Iterator[NatsServer]:
    """A NATS of the test's own, so stopping and killing it disturbs no other test."""
    with NatsServer(tmp_path / "nats") as server:
        yield server


@pytest.fixture(scope="module")
def own_postgres_dir(postgres_dir_factory: Callable[[str], Path]) -> Path:
    """One cluster directory for the module: initdb runs once, each test restarts on it."""
    return postgres_dir_factory("own-postgres")


@pytest.fixture
def own_postgres(own_postgres_dir: Path) -> Iterator[PostgresServer]:
    """A Postgres of the test's own (on a shared cluster dir), started fresh and stopped after."""
    with PostgresServer(own_postgres_dir, durable=False) as server:
        yield server


async def _stream_messages(url: str, stream: str) -> list[bytes]:
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        info = await js.stream_info(stream)
        return [(await js.get_msg(stream, seq)).data or b"" for seq in range(1, info.state.messages + 1)]
    finally:
        await nc.close()


async def _publish(url: str, stream: str, subject: str, payloads: list[bytes]) -> None:
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        await js.add_stream(name=stream, subjects=[subject])
        for payload in payloads:
            await js.publish(subject, payload)
    finally:
        await nc.close()


async def test_nats_server_acks_jetstream_publishes(nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        await js.add_stream(name="SERVERS_SMOKE", subjects=["servers.smoke"])
        ack = await js.publish("servers.smoke", b"hello")
        assert (ack.stream, ack.seq) == ("SERVERS_SMOKE", 1)
        await js.delete_stream("SERVERS_SMOKE")
    finally:
        await nc.close()


async def test_nats_restart_on_same_dir_and_port_keeps_stream_messages(own_nats: NatsServer) -> None:
    url_before = own_nats.url
    await _publish(own_nats.url, "KEEP", "keep.it", [b"one", b"two", b"three"])

    own_nats.stop()
    assert not own_nats.running
    own_nats.start()

    assert own_nats.url == url_before
    assert await _stream_messages(own_nats.url, "KEEP") == [b"one", b"two", b"three"]


async def test_nats_acked_messages_survive_kill(own_nats: NatsServer) -> None:
    await _publish(own_nats.url, "CRASH", "crash.it", [b"acked"])

    own_nats.kill()
    own_nats.start()

    assert await _stream_messages(own_nats.url, "CRASH") == [b"acked"]


def test_nats_start_on_a_taken_port_raises_with_the_log_tail(tmp_path: Path) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        server = NatsServer(tmp_path / "nats", squatter.getsockname()[1])
        with pytest.raises(ServerStartError, match="address already in use"):
            server.start(timeout_s=5)
    assert not server.running


def test_nats_whose_own_picked_port_is_taken_before_it_binds_starts_on_another(tmp_path: Path) -> None:
    server = NatsServer(tmp_path / "nats")  # port picked free now ...
    picked = server.port
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", picked))  # ... and taken by someone else before the start
        squatter.listen()
        server.start(timeout_s=10)
        try:
            assert server.running and server.port != picked
            with socket.create_connection(("127.0.0.1", server.port), timeout=2) as conn:
                assert conn.recv(4) == b"INFO"  # nats-server greets on the new port
        finally:
            server.stop()
    assert "address already in use" in server.log_path.read_text()  # the refused bind is logged


async def test_postgres_answers_queries_in_the_loom_database(database_url: str) -> None:
    conn = await asyncpg.connect(database_url)
    try:
        assert await conn.fetchval("select 1") == 1
        assert await conn.fetchval("select current_database()") == "loom"
    finally:
        await conn.close()


async def test_postgres_data_survives_stop_and_start(own_postgres: PostgresServer) -> None:
    conn = await asyncpg.connect(own_postgres.url)
    try:
        await conn.execute("create table if not exists kept (v text)")
        await conn.execute("truncate kept; insert into kept values ('x')")
    finally:
        await conn.close()

    own_postgres.stop()
    own_postgres.start()

    conn = await asyncpg.connect(own_postgres.url)
    try:
        assert await conn.fetchval("select v from kept") == "x"
    finally:
        await conn.close()


async def test_postgres_kill_ends_the_server(own_postgres: PostgresServer) -> None:
    pid = own_postgres.pid
    assert pid is not None

    own_postgres.kill()

    assert not own_postgres.running
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    with pytest.raises(OSError):
        await asyncpg.connect(own_postgres.url, timeout=5)
