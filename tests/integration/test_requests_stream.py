"""Clients' requests live in their own stream (REQUESTS), apart from the lifecycle log (JOBS).

JetStream's duplicate window is per stream, and nats-server cannot restrict the message id a
client sets. While submissions and cancellations shared JOBS with the events services publish
under deterministic ids (``<job>:placed:<attempt>``, ``<job>:completed:<attempt>``), a tenant
that published a cancellation of its own under such an id made the service's event a
"duplicate": dropped, on a secured server, by a tenant allowed to publish nothing but its own
requests. A deployment of that layout is moved on upgrade: the streams are narrowed and split,
and placement republishes what it had not read (:mod:`loom.bus.requests_move`).
"""

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, Final

import nats
import nats.js.errors
import pytest
from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig
from platform_helpers import Platform
from waiting import until

from loom.bus import ensure_streams
from loom.bus.connection import remember_credentials
from loom.bus.requests_move import replay_left_requests
from loom.client import LoomClient
from loom.runtime.servers import NatsServer
from loom.security import CredentialStore, Identity, admin_identity, read, tenant_identity
from loom_proto import subjects
from loom_proto.codec import encode
from loom_proto.jobs import JobSpec, JobSubmitted, Resources, Work

pytestmark = pytest.mark.security

SERVICES = {"metrics": Identity("metrics"), "placement": Identity("placement")}
IDENTITIES = [admin_identity(), *SERVICES.values(), tenant_identity("t1"), tenant_identity("t2")]
OLD_JOBS = StreamConfig(
    # The layout before REQUESTS: JOBS held every job event, clients' requests included.
    name="JOBS",
    subjects=subjects.job_events_of(*subjects.JOB_EVENT_KINDS),
    duplicate_window=120.0,
)


@pytest.fixture
def secured(tmp_path: Path) -> Iterator[tuple[NatsServer, CredentialStore]]:
    """A fresh secured server for each test (one of them builds the old layout)."""
    store = CredentialStore(tmp_path / "home")
    store.ensure_all(IDENTITIES)
    with NatsServer(tmp_path / "nats", authorization=store.auth_path) as server:
        remember_credentials(server.url, store.path(admin_identity()))
        yield server, store


async def _connect(server: NatsServer, store: CredentialStore, identity: Identity) -> nats.NATS:
    credential = read(store.path(identity))
    return await nats.connect(
        server.url,
        nkeys_seed_str=credential.seed,
        inbox_prefix=f"_INBOX.{credential.identity}",
        allow_reconnect=False,
    )


async def test_a_tenants_message_id_cannot_drop_a_services_event(
    secured: tuple[NatsServer, CredentialStore],
) -> None:
    server, store = secured
    admin = await _connect(server, store, admin_identity())
    tenant = await _connect(server, store, tenant_identity("t2"))
    placement = await _connect(server, store, SERVICES["placement"])
    try:
        await ensure_streams(admin.jetstream())
        # t2 guesses the id placement will give t1's job's placement and takes it first, on the
        # one subject it may publish a cancellation on.
        taken = await tenant.jetstream().publish(
            subjects.job_event("cancelled", "t2"), b"{}", headers={"Nats-Msg-Id": "victim:placed:1"}
        )
        assert taken.stream == "REQUESTS"
        ack = await placement.jetstream().publish(
            subjects.job_placed("t1"), b"{}", headers={"Nats-Msg-Id": "victim:placed:1"}
        )
        # In one stream this was a "duplicate": the event never stored, t1's job never placed.
        assert ack.stream == "JOBS" and not ack.duplicate
        stored = await admin.jetstream().get_last_msg("JOBS", subjects.job_placed("t1"))
        assert (stored.headers or {})["Nats-Msg-Id"] == "victim:placed:1"
        # The requests' own window still drops a client's retry of the same request.
        again = await tenant.jetstream().publish(
            subjects.job_event("cancelled", "t2"), b"{}", headers={"Nats-Msg-Id": "victim:placed:1"}
        )
        assert again.duplicate
    finally:
        for nc in (admin, tenant, placement):
            await nc.close()


def _submission(job_id: str) -> bytes:
    return encode(JobSubmitted(job_id=job_id, tenant="t1", name="", work=Work(steps=1)))


OLD_LIFECYCLE: Final = subjects.job_events_of("started", "completed", "cancelled")
"""What the old lifecycle consumers read in JOBS, cancellations among it."""


async def _old_stream(admin: nats.NATS, *readers: str) -> Any:
    """JOBS as it was, with placement's old submissions and lifecycle consumers and ``readers``
    (other durables reading the lifecycle there, as metering's); its JetStream context."""
    js = admin.jetstream()
    await js.add_stream(OLD_JOBS)
    consumers = [
        ("placement-submitted", [subjects.JOBS_SUBMITTED_ALL]),
        ("placement-lifecycle", OLD_LIFECYCLE),
    ]
    for durable, filters in consumers + [(r, OLD_LIFECYCLE) for r in readers]:
        await js.add_consumer(
            "JOBS",
            ConsumerConfig(durable_name=durable, filter_subjects=filters, ack_policy=AckPolicy.EXPLICIT),
        )
    return js


async def _old_layout(admin: nats.NATS) -> list[int]:
    """JOBS as it was, with placement's old submissions consumer that acknowledged the first of
    four submissions (the last without a message id), and one cancellation never read. Returns
    the stream sequences of the four submissions."""
    js = await _old_stream(admin)
    seqs = []
    for n in range(4):
        headers = {"Nats-Msg-Id": f"sub-{n}"} if n < 3 else None
        seqs.append(
            (await js.publish(subjects.job_submitted("t1"), _submission(f"old-{n}"), headers=headers)).seq
        )
    await js.publish(subjects.job_event("cancelled", "t1"), b'{"x": 1}', headers={"Nats-Msg-Id": "can-1"})
    old = await js.pull_subscribe_bind("placement-submitted", "JOBS")
    first = await old.fetch(1, timeout=2)
    await first[0].ack_sync()
    return seqs


async def test_the_move_republishes_what_placement_had_not_read_once(
    secured: tuple[NatsServer, CredentialStore],
) -> None:
    server, store = secured
    admin = await _connect(server, store, admin_identity())
    placement = await _connect(server, store, SERVICES["placement"])
    try:
        seqs = await _old_layout(admin)
        await ensure_streams(placement.jetstream())  # as every service does at start, JOBS first
        jobs = await admin.jetstream().stream_info("JOBS")
        assert subjects.JOBS_SUBMITTED_ALL not in jobs.config.subjects
        assert jobs.state.messages == 5, "JOBS keeps what it held"
        # Placement's own identity is enough (its narrowed JetStream API and subjects).
        moved = await replay_left_requests(
            placement.jetstream(),
            submitted_durable="placement-submitted",
            lifecycle_durable="placement-lifecycle",
        )
        assert (moved.submitted, moved.cancelled) == (3, 1), "all but the acknowledged submission"
        js = admin.jetstream()
        info = await js.stream_info("REQUESTS", subjects_filter=subjects.JOBS_SUBMITTED_ALL)
        assert sum((info.state.subjects or {}).values()) == 3
        ids = []
        for seq in range(1, 5):
            msg = await js.get_msg("REQUESTS", seq)
            ids.append((msg.headers or {}).get("Nats-Msg-Id"))
        # The one without an id gets the id placement claimed it under before (its inbox knows).
        assert ids == ["sub-1", "sub-2", f"JOBS-{seqs[3]}", "can-1"]
        with pytest.raises(nats.js.errors.NotFoundError):
            await js.consumer_info("JOBS", "placement-submitted")
        # Done once: the old consumer is gone, so a second start finds nothing to move.
        again = await replay_left_requests(
            placement.jetstream(),
            submitted_durable="placement-submitted",
            lifecycle_durable="placement-lifecycle",
        )
        assert (again.submitted, again.cancelled) == (0, 0)
        assert (await js.stream_info("REQUESTS")).state.messages == 4
    finally:
        await admin.close()
        await placement.close()


@pytest.fixture
async def platform(
    secured: tuple[NatsServer, CredentialStore],
    fresh_database: Callable[..., Awaitable[str]],
    tmp_path: Path,
) -> AsyncIterator[Platform]:
    server, store = secured
    (tmp_path / "agents").mkdir()
    p = Platform(server.url, await fresh_database("requests_stream"), tmp_path / "agents")
    p.creds = {name: store.path(identity) for name, identity in SERVICES.items()}
    yield p
    for name in list(p.tasks):
        await p.stop(name)


async def test_placement_started_on_the_old_layout_admits_the_submissions_left_in_jobs(
    secured: tuple[NatsServer, CredentialStore], platform: Platform
) -> None:
    server, store = secured
    admin = await _connect(server, store, admin_identity())
    try:
        await _old_layout(admin)
        await platform.start("placement")  # its start narrows the streams and moves the rest
        client = await LoomClient.connect(server.url)
        try:

            async def known() -> list[str] | None:
                found = [j for n in range(4) if (j := await client.job(f"old-{n}")) is not None]
                return sorted(j["job_id"] for j in found) if len(found) == 3 else None

            # old-0 was acknowledged by the old consumer: handled then, not again.
            assert await until(known, 15, "the three unread submissions admitted") == [
                "old-1",
                "old-2",
                "old-3",
            ]
            # A new submission goes to REQUESTS and is admitted as any other.
            await client.submit(
                JobSpec(job_id="new-1", tenant="t1", resources=Resources(gpus=1), work=Work(steps=1))
            )
            await until(lambda: client.job("new-1"), 15, "new-1 admitted")
            await asyncio.sleep(0.5)
            assert await client.job("old-0") is None
        finally:
            await client.close()
    finally:
        await admin.close()


async def _tenant_client(
    server: NatsServer, store: CredentialStore, monkeypatch: pytest.MonkeyPatch, tenant: str
) -> LoomClient:
    """An SDK client connected as ``tenant``'s identity (its credentials file in ``$LOOM_CREDS``)."""
    from loom.security import ENV_CREDS

    with monkeypatch.context() as patch:
        patch.setenv(ENV_CREDS, str(store.path(tenant_identity(tenant))))
        return await LoomClient.connect(server.url, name=tenant)


async def test_a_tenants_sdk_acts_as_its_tenant_and_refuses_what_it_cannot_do(
    secured: tuple[NatsServer, CredentialStore], platform: Platform, monkeypatch: pytest.MonkeyPatch
) -> None:
    from loom.client import QueryError, SpecError

    server, store = secured
    await platform.start("placement")
    t1 = await _tenant_client(server, store, monkeypatch, "t1")
    try:
        # The tenant comes from the identity ("missing required field `tenant`" before).
        job_id = await t1.submit({"job_id": "own-1", "resources": {"gpus": 1}, "work": {"steps": 1}})
        job = await until(lambda: t1.job(job_id), 15, "own-1 admitted")
        assert job["tenant"] == "t1"
        # Another tenant's list: nothing (it listed the asker's own jobs).
        assert await t1.jobs(tenant="t2") == []
        assert [j["job_id"] for j in await t1.jobs(tenant="t1")] == ["own-1"]
        with pytest.raises(SpecError, match="unknown job state 'bogus'"):
            await t1.jobs(state="bogus")
        # Watching another tenant raises at once (it waited for ever, the refusal only logged).
        with pytest.raises(QueryError, match="may watch its own jobs only"):
            async for _ in t1.watch("t2"):
                break
        with pytest.raises(SpecError, match="NUL"):
            await t1.cancel("own-1", reason="a\x00b")
        # An operator's query: refused by nats-server, said so (it said "the service is not running").
        with pytest.raises(QueryError, match="refused: this client's NATS permissions do not allow asking"):
            await t1.drains(timeout_s=1.0)
        # Its own watch, by default: the events of its jobs.
        seen: asyncio.Queue[str] = asyncio.Queue()

        async def follow() -> None:
            async for _subject, event in t1.watch():
                await seen.put(event.job_id)

        watcher = asyncio.create_task(follow())
        await asyncio.sleep(0.5)
        await t1.submit({"job_id": "own-2", "resources": {"gpus": 1}, "work": {"steps": 1}})
        assert await asyncio.wait_for(seen.get(), 15) == "own-2"
        watcher.cancel()
    finally:
        await t1.close()
    await t1.close()  # twice: nothing (it raised ConnectionClosedError)
    with pytest.raises(QueryError, match="this client is closed"):
        await t1.jobs()


async def test_a_watch_closed_after_its_client_closed_raises_nothing(
    secured: tuple[NatsServer, CredentialStore], platform: Platform, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The README's example leaves `async for ... in client.watch()` with `break`, then awaits
    # `client.close()`: the generator is closed afterwards, from the event loop, and its
    # unsubscribe on the draining or closed connection raised ("Task exception was never
    # retrieved ... ConnectionDrainingError" after the example's output).

    server, store = secured
    await platform.start("placement")
    client = await _tenant_client(server, store, monkeypatch, "t1")
    watch = client.watch()

    async def submit_soon() -> None:
        await asyncio.sleep(0.5)
        await client.submit({"job_id": "watched-1", "resources": {"gpus": 1}, "work": {"steps": 1}})

    submitting = asyncio.create_task(submit_soon())
    _subject, event = await asyncio.wait_for(anext(watch), 15)
    assert event.job_id == "watched-1"
    await submitting
    await client.close()
    await watch.aclose()  # what the loop's finalizer does later: nothing raised


def test_loom_dlq_as_a_tenant_is_refused_in_one_line(
    secured: tuple[NatsServer, CredentialStore], tmp_path: Path
) -> None:
    # It printed a nats TimeoutError traceback (a client developer's walk).
    import os
    import subprocess
    import sys

    from loom.security import ENV_CREDS

    server, store = secured
    env = {
        **os.environ,
        "LOOM_NATS_URL": server.url,
        ENV_CREDS: str(store.path(tenant_identity("t1"))),
        "LOOM_HOME": str(tmp_path / "home"),
    }
    done = subprocess.run(
        [sys.executable, "-m", "loom.cli.main", "dlq", "list"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert "refused: dead letters are the operator's, and this is tenant-t1" in done.stderr


async def test_a_submission_without_an_ack_says_it_may_be_stored_and_the_id_to_retry_under(
    tmp_path: Path,
) -> None:
    # After a NATS outage the SDK raised "failed after 8 attempts" for submissions that had been
    # stored and ran; retried under a new id they came back "duplicate" (a hostile walk).
    import os
    import signal

    from loom.bus import Publisher
    from loom.client import SubmissionUnsure

    with NatsServer(tmp_path / "nats") as server:
        client = await LoomClient.connect(server.url)
        try:
            await ensure_streams(client.nc.jetstream())
            client.publisher = Publisher(client.nc, timeout_s=0.3, attempts=2)
            spec = JobSpec(job_id="unsure-1", tenant="t1", resources=Resources(gpus=1), work=Work(steps=1))
            assert server.pid is not None
            os.kill(server.pid, signal.SIGSTOP)
            try:
                # Every thread of it stopped before the submission is sent (a group stop takes
                # each thread as it next runs: under a loaded parallel run one of nats-server's
                # threads stored and acknowledged the submission first, once in a CI run).
                await until(lambda: _all_stopped(server.pid), 5, "nats-server's threads to stop")
                with pytest.raises(SubmissionUnsure) as unsure:
                    await client.submit(spec)
            finally:
                os.kill(server.pid, signal.SIGCONT)
            msg_id = unsure.value.msg_id
            assert msg_id.startswith("unsure-1:") and f"msg_id={msg_id!r}" in str(unsure.value)
            # Retried under that id: one copy, whether or not the first was stored.
            client.publisher = Publisher(client.nc)
            await client.submit(spec, msg_id=msg_id)
            info = await client.nc.jetstream().stream_info(
                "REQUESTS", subjects_filter=subjects.JOBS_SUBMITTED_ALL
            )
            assert sum((info.state.subjects or {}).values()) == 1
        finally:
            await client.close()


async def test_the_move_replays_a_cancellation_metering_had_not_read_though_placement_had(
    secured: tuple[NatsServer, CredentialStore],
) -> None:
    # From placement's floor alone, a cancellation metering had not folded yet was never replayed
    # (metering's new consumer reads REQUESTS only): its run ended "failed", not "cancelled".
    server, store = secured
    admin = await _connect(server, store, admin_identity())
    placement = await _connect(server, store, SERVICES["placement"])
    try:
        js = await _old_stream(admin, "metrics-metering")
        await js.publish(subjects.job_event("cancelled", "t1"), b'{"x": 1}', headers={"Nats-Msg-Id": "can-2"})
        read = await js.pull_subscribe_bind("placement-lifecycle", "JOBS")
        (msg,) = await read.fetch(1, timeout=2)
        await msg.ack_sync()  # placement handled it; metering had not
        await ensure_streams(placement.jetstream())
        moved = await replay_left_requests(
            placement.jetstream(),
            submitted_durable="placement-submitted",
            lifecycle_durable="placement-lifecycle",
        )
        assert moved.cancelled == 1, moved
        stored = await js.get_msg("REQUESTS", 1)
        assert (stored.headers or {})["Nats-Msg-Id"] == "can-2"
    finally:
        await admin.close()
        await placement.close()


async def _all_stopped(pid: int | None) -> bool:
    """Whether every thread of process ``pid`` is stopped (state ``T`` in ``/proc``)."""
    assert pid is not None
    return _threads_stopped(pid)


def _threads_stopped(pid: int) -> bool:
    states = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
        except OSError:  # a thread that ended meanwhile
            continue
    return bool(states) and all(state in ("T", "t") for state in states)
