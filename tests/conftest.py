"""Shared fixtures: one real NATS (JetStream) and one real Postgres for the whole test session.

Both come from the wheels via :mod:`loom.runtime.servers`, the same code ``loom up`` runs. They
start lazily, on the first test that asks, so unit-only runs pay nothing. ``nats_cluster`` is the
embedded 3-node JetStream cluster (``loom up --nats-cluster 3``), a fresh one per test, since
tests kill its nodes.
"""

import asyncio
import os
import shutil
import sys
import tempfile
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from loom.runtime.servers import NatsCluster, NatsServer, PostgresServer
from loom.tasks import cancel_and_wait


@pytest_asyncio.fixture(scope="session", loop_scope="session", autouse=True)
async def _tasks_left_running_are_ended() -> AsyncIterator[None]:
    """Tasks still running when a worker's session ends are ended here, each cancelled again until
    it stops (:func:`loom.tasks.cancel_and_wait`), before the session's event loop closes.

    The loop's own close cancels every task once and waits for all of them with no bound. Python
    3.11 loses a cancel that lands as an ``asyncio.wait_for`` completes (the NATS client's requests
    go through it), and a loop that lost its cancel goes on: CI hung in that wait until
    pytest-timeout failed the teardown of whichever test ran last on the worker. A task that never
    ends even so is a real fault: its stack is printed and the session fails (after pytest-timeout,
    since the loop's close still waits on it)."""
    yield
    current = asyncio.current_task()
    left = [task for task in asyncio.all_tasks() if task is not current and not task.done()]
    if not left:
        return
    names = sorted({task.get_name() + " " + _coroutine_name(task) for task in left})
    try:
        async with asyncio.timeout(60):
            await cancel_and_wait(left)
    except TimeoutError:
        stuck = [task for task in left if not task.done()]
        for task in stuck:
            task.print_stack(file=sys.__stderr__)
        # The loop's close then waits on them until pytest-timeout ends the worker; the stacks
        # above say where they hang.
        raise RuntimeError(f"{len(stuck)} task(s) never ended though cancelled again and again") from None
    finally:
        # After the cleanup (a warning filtered into an error must not skip it). A warning reaches
        # the run's summary, from an xdist worker too (a print to stderr does not).
        warnings.warn(f"{len(left)} task(s) left running at session end: {names[:20]}", stacklevel=1)


def _coroutine_name(task: asyncio.Task[object]) -> str:
    coro = task.get_coro()
    return getattr(coro, "__qualname__", type(coro).__name__)


@pytest.fixture(autouse=True)
def _logging_left_as_found() -> Iterator[None]:
    """A test that configures logging in this process (the CLI's ``main`` does, at WARNING) puts it
    back: a later test on the same worker that captures log events (``structlog.testing.capture_logs``)
    would otherwise see its info events filtered out, depending on which files share the worker."""
    import structlog

    before = structlog.get_config()
    yield
    if structlog.get_config() != before:
        from loom.telemetry.logs import reset_logging

        reset_logging()
        structlog.configure(**before)


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    """A JetStream-enabled ``nats-server`` on free ports, stopped at the end of the session."""
    with NatsServer(tmp_path_factory.mktemp("nats")) as server:
        yield server


@pytest.fixture
def nats_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[NatsCluster]:
    """Three ``nats-server`` nodes in one JetStream cluster, with Loom's streams set to 3 replicas.

    Its :attr:`~loom.runtime.servers.NatsCluster.url` lists the three nodes, as ``LOOM_NATS_URL``
    does for a stack started with ``--nats-cluster 3``; ``LOOM_STREAM_REPLICAS`` is 3 for the test.
    """
    monkeypatch.setenv("LOOM_STREAM_REPLICAS", "3")
    with NatsCluster(tmp_path / "nats-cluster", 3) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def postgres_dir_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], Path]]:
    """Makes data directories a Postgres can keep using for the whole session.

    As root, Postgres runs as an unprivileged user that must traverse every parent of its data
    dir. Below ``/tmp/pytest-of-root`` that breaks at random: every pytest session that starts
    (another engineer's, another worktree's) chmods that directory back to 0700, and the server
    then fails to open its own files. So as root the dirs go straight under the system temp dir
    (sticky, world-traversable) and are removed at the end of the session.
    """
    if os.geteuid() != 0:
        yield tmp_path_factory.mktemp
        return
    made: list[Path] = []

    def make(name: str) -> Path:
        made.append(Path(tempfile.mkdtemp(prefix=f"loom-test-{name}-")))
        return made[-1]

    yield make
    for path in made:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres_server(postgres_dir_factory: Callable[[str], Path]) -> Iterator[PostgresServer]:
    """A Postgres with an empty ``loom`` database; not durable (no fsync), which tests do not need."""
    with PostgresServer(postgres_dir_factory("postgres"), durable=False) as server:
        yield server


@pytest.fixture(scope="session")
def nats_url(nats_server: NatsServer) -> str:
    """``nats://127.0.0.1:PORT`` of the session's NATS."""
    return nats_server.url


@pytest.fixture(scope="session")
def database_url(postgres_server: PostgresServer) -> str:
    """``postgresql://postgres@127.0.0.1:PORT/loom`` of the session's Postgres."""
    return postgres_server.url


@pytest.fixture(scope="session")
def fresh_database(postgres_server: PostgresServer) -> Callable[..., Awaitable[str]]:
    """Makes an empty database of its own on the session's Postgres and returns its URL.

    ``await fresh_database("store")`` creates ``test_store_<random>`` and migrates it;
    ``migrate=False`` leaves it empty (for tests of the migrations themselves). The databases go
    when the session's server does.
    """
    import uuid

    import asyncpg

    from loom.store.migrations import migrate_url

    async def make(hint: str = "db", *, migrate: bool = True) -> str:
        name = f"test_{hint}_{uuid.uuid4().hex[:8]}"
        admin = await asyncpg.connect(
            host="127.0.0.1", port=postgres_server.port, user="postgres", database="postgres"
        )
        try:
            await admin.execute(f'CREATE DATABASE "{name}"')
        finally:
            await admin.close()
        url = f"postgresql://postgres@127.0.0.1:{postgres_server.port}/{name}"
        if migrate:
            await migrate_url(url)
        return url

    return make
