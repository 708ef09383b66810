"""Trust boundaries on a secured nats-server (issue 18): every forgery is refused by the server.

The server is the one ``loom up --secure`` runs (:class:`NatsServer` including the users block
:class:`CredentialStore` writes), with Loom's streams. Each test observes the server's permission
violation *and* that nothing reached the stream (the state every consumer reads is unchanged).
On a server without authorization (today's default) each of these forgeries is accepted.
"""

import argparse
import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import msgspec
import nats
import pytest
from nats.aio.client import Client
from nats.js.api import AckPolicy, ConsumerConfig

from loom.bus import BusError, ConsumerRunner, ConsumerSpec, Delivery, Publisher, connect, ensure_streams
from loom.bus.attempts import AttemptLog, Attempts, ensure_bucket, opened
from loom.cli.credentials import cmd_rotate
from loom.runtime.servers import NatsServer
from loom.security import CredentialStore, Identity, admin_identity, read, tenant_identity
from loom.security.message_ids import id_key, keyed
from loom_proto import subjects

pytestmark = pytest.mark.security

IDENTITIES = [
    admin_identity(),
    tenant_identity("acme"),
    tenant_identity("globex"),
    Identity("agent", "c1"),
    Identity("agent", "c2"),
    Identity("placement"),
    Identity("metrics"),
    Identity("console"),
]


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[NatsServer, CredentialStore]]:
    home = tmp_path_factory.mktemp("secured-home")
    store = CredentialStore(home)
    store.ensure_all(IDENTITIES)
    with NatsServer(home / "nats", authorization=store.auth_path) as server:
        yield server, store


class Session:
    """A client of one identity that records the server's asynchronous errors."""

    def __init__(self, nc: Client, errors: list[str]) -> None:
        self.nc = nc
        self.errors = errors

    async def violation(self, within_s: float = 2.0) -> str:
        """The first permissions violation the server reported, waiting up to ``within_s``."""
        for _ in range(int(within_s / 0.05)):
            found = [e for e in self.errors if "permissions violation" in e.lower()]
            if found:
                return found[0]
            await asyncio.sleep(0.05)
        raise AssertionError(f"no permissions violation reported; errors: {self.errors}")


@pytest.fixture
async def as_identity(
    secured: tuple[NatsServer, CredentialStore],
) -> AsyncIterator[object]:
    server, store = secured
    opened: list[Client] = []

    async def open_as(identity: Identity) -> Session:
        errors: list[str] = []

        async def on_error(exc: Exception) -> None:
            errors.append(str(exc))

        credential = read(store.path(identity))
        nc = await nats.connect(
            server.url,
            nkeys_seed_str=credential.seed,
            inbox_prefix=f"_INBOX.{credential.identity}",
            error_cb=on_error,
            allow_reconnect=False,
        )
        opened.append(nc)
        return Session(nc, errors)

    async with asyncio.timeout(30):
        admin = await connect(server.url, "test-admin", creds=store.path(admin_identity()))
        await ensure_streams(admin.jetstream())
        await admin.drain()
    yield open_as
    for nc in opened:
        await nc.close()


async def _last_on(server: NatsServer, store: CredentialStore, stream: str, subject: str) -> int:
    """The sequence of the last message on ``subject`` in ``stream`` (0: none), read as admin."""
    nc = await connect(server.url, "test-admin", creds=store.path(admin_identity()))
    try:
        info = await nc.jetstream().stream_info(stream, subjects_filter=subject)
        return int((info.state.subjects or {}).get(subject, 0))
    finally:
        await nc.close()


async def test_anonymous_client_is_refused(secured: tuple[NatsServer, CredentialStore]) -> None:
    server, _ = secured
    with pytest.raises(Exception, match=r"(?i)authorization"):
        await nats.connect(server.url, allow_reconnect=False, connect_timeout=2, max_reconnect_attempts=0)


async def test_a_forged_seed_is_refused(secured: tuple[NatsServer, CredentialStore], tmp_path: Path) -> None:
    server, _ = secured
    forged = CredentialStore(tmp_path)  # same identity name, a seed the server never saw
    forged.ensure_all([admin_identity()])
    with pytest.raises(BusError, match=r"(?i)authorization"):
        await connect(server.url, "forger", creds=forged.path(admin_identity()), first_within_s=15)


async def test_tenant_submits_only_as_itself(
    secured: tuple[NatsServer, CredentialStore], as_identity
) -> None:  # type: ignore[no-untyped-def]
    server, store = secured
    acme = await as_identity(tenant_identity("acme"))
    ack = await acme.nc.jetstream().publish(subjects.job_submitted("acme"), b"{}")
    assert ack.stream == "REQUESTS"
    before = await _last_on(server, store, "REQUESTS", subjects.job_submitted("globex"))
    await acme.nc.publish(subjects.job_submitted("globex"), b"{}")
    assert "loom.jobs.submitted.globex" in await acme.violation()
    assert await _last_on(server, store, "REQUESTS", subjects.job_submitted("globex")) == before
    # It cancels its own jobs (placement checks the job is acme's), not on another tenant's subject.
    ack = await acme.nc.jetstream().publish(subjects.job_event("cancelled", "acme"), b"{}")
    assert ack.stream == "REQUESTS"
    acme.errors.clear()
    before = await _last_on(server, store, "REQUESTS", subjects.job_event("cancelled", "globex"))
    await acme.nc.publish(subjects.job_event("cancelled", "globex"), b"{}")
    assert "loom.jobs.cancelled.globex" in await acme.violation()
    assert await _last_on(server, store, "REQUESTS", subjects.job_event("cancelled", "globex")) == before
    for query in (subjects.JOBS_QUERY, subjects.jobs_query("globex")):  # every tenant's jobs, globex's
        acme.errors.clear()
        await acme.nc.publish(query, b'{"op": "list"}', reply="_INBOX.tenant-acme.q")
        assert query in await acme.violation()


async def test_a_publish_the_server_refuses_fails_at_once_instead_of_being_retried(
    secured: tuple[NatsServer, CredentialStore], as_identity
) -> None:  # type: ignore[no-untyped-def]
    # (as_identity: its set-up creates the streams.)
    from loom.bus import Publisher
    from loom.bus.connection import publish_denied

    server, store = secured
    nc = await connect(server.url, "test-acme", creds=store.path(tenant_identity("acme")))
    try:
        publisher = Publisher(nc, timeout_s=1.0, attempts=8)
        ack = await publisher.publish_bytes(subjects.job_submitted("acme"), b"{}", msg_id="own-1")
        assert ack.stream == "REQUESTS" and not publish_denied(nc, subjects.job_submitted("acme"), since=0.0)
        with pytest.raises(BusError, match="permissions do not allow") as refused:
            await publisher.publish_bytes(subjects.job_submitted("globex"), b"{}", msg_id="other-1")
        # Refused after the first attempt's timeout, not after eight: retrying would not help.
        assert refused.value.non_retryable and "attempts" not in str(refused.value)
        assert publish_denied(nc, subjects.job_submitted("globex"), since=0.0)
        # Ids may hold capitals; nats-py lowers the server's error text: still refused at once.
        with pytest.raises(BusError, match="permissions do not allow"):
            await publisher.publish_bytes(subjects.job_submitted("GloBex"), b"{}", msg_id="other-2")
    finally:
        await nc.close()


async def test_tenant_cannot_read_another_tenants_events(as_identity) -> None:  # type: ignore[no-untyped-def]
    acme = await as_identity(tenant_identity("acme"))
    await acme.nc.subscribe(subjects.job_event("completed", "acme"))
    await acme.nc.flush()
    assert acme.errors == []
    await acme.nc.subscribe(subjects.job_event("started", "globex"))
    assert "subscription" in (await acme.violation()).lower()
    acme.errors.clear()
    await acme.nc.subscribe(subjects.JOBS_LIFECYCLE_ALL)  # every tenant's events at once
    await acme.violation()
    acme.errors.clear()
    await acme.nc.subscribe("_INBOX.globex.>")  # nor its replies
    await acme.violation()


async def test_tenant_cannot_forge_a_completion_or_a_heartbeat(
    secured: tuple[NatsServer, CredentialStore],
    as_identity,  # type: ignore[no-untyped-def]
) -> None:
    server, store = secured
    acme = await as_identity(tenant_identity("acme"))
    heartbeat = subjects.cluster_heartbeat("c1")
    before = await _last_on(server, store, "CLUSTERS", heartbeat)
    forged = msgspec.json.encode({"cluster": "c1", "agent_epoch": 1 << 40, "free_gpus": 0})
    await acme.nc.publish(heartbeat, forged)
    assert heartbeat in await acme.violation()
    acme.errors.clear()
    await acme.nc.publish(subjects.job_event("completed", "acme"), b"{}")
    await acme.violation()
    assert await _last_on(server, store, "CLUSTERS", heartbeat) == before


async def test_agent_speaks_only_for_its_cluster(
    secured: tuple[NatsServer, CredentialStore],
    as_identity,  # type: ignore[no-untyped-def]
) -> None:
    server, store = secured
    c1 = await as_identity(Identity("agent", "c1"))
    ack = await c1.nc.jetstream().publish(subjects.cluster_heartbeat("c1"), b"{}")
    assert ack.stream == "CLUSTERS"
    for forged in (
        subjects.cluster_heartbeat("c2"),
        subjects.cluster_status("c2"),
        subjects.cluster_command("c2", "start"),
        subjects.cluster_command("c1", "start"),  # not even a command to itself
        subjects.job_submitted("acme"),
    ):
        before = await _last_on(server, store, "CLUSTERS" if "clusters" in forged else "REQUESTS", forged)
        c1.errors.clear()
        await c1.nc.publish(forged, b"{}")
        assert forged in await c1.violation()
        assert (
            await _last_on(server, store, "CLUSTERS" if "clusters" in forged else "REQUESTS", forged)
            == before
        )
    c1.errors.clear()
    await c1.nc.subscribe(subjects.net_endpoints("c2"))  # cannot answer probes for another cluster
    await c1.violation()


async def test_agent_consumes_its_commands_under_its_permissions(
    as_identity,  # type: ignore[no-untyped-def]
) -> None:
    """The JetStream API subjects the agent is allowed are enough for its durable pull consumer."""
    placement = await as_identity(Identity("placement"))
    c1 = await as_identity(Identity("agent", "c1"))
    js = c1.nc.jetstream()
    await js.add_consumer(
        "CLUSTERS",
        ConsumerConfig(
            durable_name="agent-c1",
            name="agent-c1",
            ack_policy=AckPolicy.EXPLICIT,
            filter_subject=subjects.cluster_commands("c1"),
        ),
    )
    await placement.nc.jetstream().publish(subjects.cluster_command("c1", "start"), b'{"n": 1}')
    sub = await js.pull_subscribe_bind(durable="agent-c1", stream="CLUSTERS")
    messages = await sub.fetch(10, timeout=5)
    assert [m.subject for m in messages][-1] == subjects.cluster_command("c1", "start")
    for message in messages:
        await message.ack_sync()
    assert c1.errors == []
    c1.errors.clear()
    # Another cluster's durable is out of reach.
    await c1.nc.publish("$JS.API.CONSUMER.MSG.NEXT.CLUSTERS.agent-c2", b"{}", reply="_INBOX.agent-c1.x")
    await c1.violation()


async def test_the_agents_command_consumer_runs_as_the_agent_runs_it_without_a_violation(
    as_identity,  # type: ignore[no-untyped-def]
) -> None:
    """The agent's consumer as the agent builds it (a standing pull request, commands handled
    concurrently) needs nothing its role lacks: its consumer leader's election advisory too."""
    placement = await as_identity(Identity("placement"))
    c2 = await as_identity(Identity("agent", "c2"))
    got: asyncio.Queue[str] = asyncio.Queue()

    async def handle(d: Delivery[bytes]) -> None:
        await got.put(d.subject)

    runner: ConsumerRunner[bytes] = ConsumerRunner(
        c2.nc,
        ConsumerSpec(
            stream="CLUSTERS", durable="agent-c2", filter_subjects=[subjects.cluster_commands("c2")]
        ),
        bytes,
        handler=handle,
        concurrent=True,
        callback_pull=True,
    )
    await runner.start()
    try:
        await placement.nc.jetstream().publish(subjects.cluster_command("c2", "start"), b'{"n": 1}')
        assert await asyncio.wait_for(got.get(), 10) == subjects.cluster_command("c2", "start")
        await c2.nc.flush()  # the server's answer to every subscription made is in
        assert c2.errors == []
    finally:
        await runner.stop()


async def test_service_publishes_only_within_its_role(
    secured: tuple[NatsServer, CredentialStore],
    as_identity,  # type: ignore[no-untyped-def]
) -> None:
    server, store = secured
    metrics = await as_identity(Identity("metrics"))
    ack = await metrics.nc.jetstream().publish(subjects.view_delta("eu"), b"{}")
    assert ack.stream == "VIEW"
    start = subjects.cluster_command("c1", "start")
    before = await _last_on(server, store, "CLUSTERS", start)
    await metrics.nc.publish(start, b"{}")
    assert start in await metrics.violation()
    console = await as_identity(Identity("console"))
    for forged in (subjects.job_placed("c1"), subjects.job_event("completed", "acme"), start):
        console.errors.clear()
        await console.nc.publish(forged, b"{}")
        assert forged in await console.violation()
    assert await _last_on(server, store, "CLUSTERS", start) == before


async def test_rotation_refuses_old_seeds_and_clients_follow(
    secured: tuple[NatsServer, CredentialStore], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server, store = secured
    home = store.dir.parent.parent  # the server's files are under <home>/nats, as `loom up` puts them
    (home / "stack.json").write_text(json.dumps({"servers": {"nats": {"pid": server.pid}}}))
    monkeypatch.setenv("LOOM_HOME", str(home))
    old = store.path(tenant_identity("acme")).read_text()
    follower = await connect(server.url, "follower", creds=store.path(tenant_identity("acme")))
    try:
        # `loom credentials rotate` returns once the server has reloaded: the old seed is refused
        # by the very next connection (before the server got to the SIGHUP, it was accepted).
        assert await asyncio.to_thread(cmd_rotate, argparse.Namespace()) == 0
        stale = tmp_path / "stale.creds"
        stale.write_text(old)
        with pytest.raises(BusError, match=r"(?i)authorization"):
            await connect(server.url, "stale", creds=stale, first_within_s=3)
        # The connected client is dropped by the reload, reconnects with the rotated seed.
        async with asyncio.timeout(15):
            while True:
                try:
                    await follower.jetstream().publish(subjects.job_submitted("acme"), b"{}", timeout=1)
                    break
                except Exception:
                    await asyncio.sleep(0.2)
        assert store.path(tenant_identity("acme")).read_text() != old
    finally:
        await follower.close()


async def test_an_agent_keeps_its_own_consumers_attempt_records_and_no_one_elses(as_identity: object) -> None:
    assert callable(as_identity)
    agent: Session = await as_identity(Identity("agent", "c1"))
    own = AttemptLog(agent.nc.jetstream(timeout=2.0), "CLUSTERS", "agent-c1")
    await own.put(7, Attempts(open=1))
    assert (await own.get(7)).open == 1
    await own.forget(7)
    assert (await own.get(7)).open == 0
    # Opened as a consumer opens it: written at the revision read (the removal's marker here).
    assert await own.change(7, lambda r: opened(r, 3)) == (Attempts(), Attempts(open=1))
    assert (await own.get(7)).open == 1
    other = AttemptLog(agent.nc.jetstream(timeout=1.0), "CLUSTERS", "agent-c2")
    with pytest.raises((nats.errors.Error, TimeoutError)):  # refused: the client gets no ack
        await other.put(7, Attempts(open=1))
    assert "loom_attempts.clusters.agent-c2" in (await agent.violation()).lower()


async def test_an_agent_reads_no_other_consumers_attempt_records(as_identity: object) -> None:
    # A record's error names the message's job (and its tenant). Read through the stream's
    # message-get API, whose request carries the key, an agent read every consumer's records.
    assert callable(as_identity)
    service: Session = await as_identity(Identity("placement"))
    theirs = AttemptLog(service.nc.jetstream(timeout=2.0), "JOBS", "placement-submissions")
    await theirs.put(11, Attempts(open=1, error="acme-secret-job failed"))
    agent: Session = await as_identity(Identity("agent", "c1"))
    js = agent.nc.jetstream(timeout=1.0)
    with pytest.raises((nats.errors.Error, TimeoutError)):
        await AttemptLog(js, "JOBS", "placement-submissions").get(11)
    with pytest.raises((nats.errors.Error, TimeoutError)):  # nor by asking the stream's API itself
        await js.get_last_msg("KV_LOOM_ATTEMPTS", "$KV.LOOM_ATTEMPTS.JOBS.placement-submissions.11")
    assert (await theirs.get(11)).error == "acme-secret-job failed"  # there, and the service reads it


async def test_a_bucket_made_before_direct_gets_is_updated_to_serve_them(
    secured: tuple[NatsServer, CredentialStore],
) -> None:
    server, store = secured
    nc = await connect(server.url, "test-admin", creds=store.path(admin_identity()))
    try:
        js = nc.jetstream()
        info = await js.stream_info("KV_LOOM_ATTEMPTS")
        await js.update_stream(dataclasses.replace(info.config, allow_direct=False))
        assert not (await js.stream_info("KV_LOOM_ATTEMPTS")).config.allow_direct
        kv = await ensure_bucket(js)
        assert (await js.stream_info("KV_LOOM_ATTEMPTS")).config.allow_direct
        await kv.put("JOBS.x.1", b"{}")
        assert (await kv.get("JOBS.x.1")).value == b"{}"
    finally:
        await nc.close()


async def test_an_agent_that_opened_the_bucket_before_it_served_direct_gets_reads_once_it_does(
    secured: tuple[NatsServer, CredentialStore], as_identity: object
) -> None:
    # nats-py decides when it opens a bucket whether to read by direct get: an agent that opened it
    # before a service updated it kept the message-get API, which its permissions no longer allow.
    server, store = secured
    assert callable(as_identity)
    admin = await connect(server.url, "test-admin", creds=store.path(admin_identity()))
    agent: Session = await as_identity(Identity("agent", "c1"))
    try:
        js = admin.jetstream()
        info = await js.stream_info("KV_LOOM_ATTEMPTS")
        await js.update_stream(dataclasses.replace(info.config, allow_direct=False))
        own = AttemptLog(agent.nc.jetstream(timeout=1.0), "CLUSTERS", "agent-c1")
        with pytest.raises((nats.errors.Error, TimeoutError)):
            await own.get(3)  # by the message-get API: refused
        await ensure_bucket(js)  # a service starting: the bucket serves direct gets again
        await own.put(3, Attempts(open=2))
        assert (await own.get(3)).open == 2
    finally:
        await admin.close()


async def test_an_agent_cannot_take_first_the_message_id_of_another_identitys_message(
    secured: tuple[NatsServer, CredentialStore],
    as_identity,  # type: ignore[no-untyped-def]
) -> None:
    """nats-server lets a client set any ``Nats-Msg-Id``, and a stream drops an id it saw in the
    last two minutes: with plain deterministic ids, agent c2's credentials could publish first,
    on the one report subject of its own cluster, under the id placement gives a ``placed`` event,
    a command to another cluster, or agent c1's ``completed`` of its job, and have each dropped as
    a duplicate. Services' and agents' ids go out tagged with a key of their own identity."""
    _, store = secured

    def publisher(session: Session, identity: Identity) -> Publisher:
        return Publisher(session.nc, id_key=id_key(read(store.path(identity))), attempts=1)

    c2 = await as_identity(Identity("agent", "c2"))
    squatted = {
        "JOBS": ["victim:placed:1", "victim:completed:1"],
        "CLUSTERS": ["victim:start:1"],
    }
    for stream, guessed in squatted.items():
        # The reports and heartbeats c2 may publish, under the ids it guessed.
        subject = (
            subjects.job_report("completed", "acme", "c2")
            if stream == "JOBS"
            else subjects.cluster_heartbeat("c2")
        )
        for msg_id in guessed:
            taken = await c2.nc.jetstream().publish(subject, b"{}", headers={"Nats-Msg-Id": msg_id})
            assert taken.stream == stream and not taken.duplicate
    # Even a tag c2 computes with its own key is not the owner's.
    own_tag = keyed("victim:completed:1", id_key(read(store.path(Identity("agent", "c2")))))
    await c2.nc.jetstream().publish(
        subjects.job_report("completed", "acme", "c2"), b"{}", headers={"Nats-Msg-Id": own_tag}
    )

    placement = publisher(await as_identity(Identity("placement")), Identity("placement"))
    c1 = publisher(await as_identity(Identity("agent", "c1")), Identity("agent", "c1"))
    sent = [
        await placement.publish_bytes(subjects.job_placed("acme"), b"{}", msg_id="victim:placed:1"),
        await placement.publish_bytes(
            subjects.cluster_command("c1", "start"), b"{}", msg_id="victim:start:1"
        ),
        await c1.publish_bytes(
            subjects.job_report("completed", "acme", "c1"), b"{}", msg_id="victim:completed:1"
        ),
    ]
    assert [(a.stream, bool(a.duplicate)) for a in sent] == [
        ("JOBS", False),
        ("CLUSTERS", False),
        ("JOBS", False),
    ]
    # As deterministic as the plain id: another process of the same identity (placement's standby
    # taking over) sending the same message is its duplicate.
    standby = publisher(await as_identity(Identity("placement")), Identity("placement"))
    again = await standby.publish_bytes(subjects.job_placed("acme"), b"{}", msg_id="victim:placed:1")
    assert again.duplicate and again.seq == sent[0].seq


async def test_a_consumer_reads_a_tagged_id_as_the_plain_id(
    secured: tuple[NatsServer, CredentialStore],
    as_identity,  # type: ignore[no-untyped-def]
) -> None:
    """Inbox claims, job histories and spans keep the plain id: the tag is for the stream only."""
    server, store = secured
    c1 = await as_identity(Identity("agent", "c1"))
    key = id_key(read(store.path(Identity("agent", "c1"))))
    assert key is not None
    await Publisher(c1.nc, id_key=key).publish_bytes(
        subjects.job_report("started", "acme", "c1"), b"{}", msg_id="tagged:started:1"
    )
    admin = await connect(server.url, "test-admin", creds=store.path(admin_identity()))
    got: asyncio.Queue[tuple[str | None, str]] = asyncio.Queue()

    async def handle(d: Delivery[bytes]) -> None:
        await got.put((d.msg_id, d.headers["Nats-Msg-Id"]))

    runner: ConsumerRunner[bytes] = ConsumerRunner(
        admin,
        ConsumerSpec(
            stream="JOBS",
            durable="tag-reader",
            filter_subjects=[subjects.job_report("started", "acme", "c1")],
        ),
        bytes,
        handler=handle,
    )
    await runner.start()
    try:
        plain, sent = await asyncio.wait_for(got.get(), 10)
    finally:
        await runner.stop()
        await admin.close()
    assert plain == "tagged:started:1"
    assert sent == keyed("tagged:started:1", key) and sent != plain


async def test_an_agents_durable_takes_no_filter_but_its_own_commands(
    as_identity,  # type: ignore[no-untyped-def]
) -> None:
    """An agent may create its durable, but not point it at another cluster's commands: before,
    the creation subjects that do not name a filter (which nats-server then does not check) let
    c1's durable read c2's start commands, other tenants' job specs in them."""
    c1 = await as_identity(Identity("agent", "c1"))
    js = c1.nc.jetstream()
    other = subjects.cluster_commands("c2")
    for config in (
        ConsumerConfig(durable_name="agent-c1", ack_policy=AckPolicy.EXPLICIT, filter_subject=other),
        ConsumerConfig(
            durable_name="agent-c1", name="agent-c1", ack_policy=AckPolicy.EXPLICIT, filter_subject=other
        ),
        ConsumerConfig(name="agent-c1", ack_policy=AckPolicy.EXPLICIT, filter_subjects=[other, "loom.>"]),
    ):
        c1.errors.clear()
        with pytest.raises(Exception):  # noqa: B017 (no answer: the request was refused)
            await js.add_consumer("CLUSTERS", config, timeout=1)
        await c1.violation()
    # The request naming the filter in its subject must carry that same filter.
    c1.errors.clear()
    body = {
        "stream_name": "CLUSTERS",
        "config": {
            "durable_name": "agent-c1",
            "name": "agent-c1",
            "filter_subject": other,
            "ack_policy": "explicit",
        },
        "action": "",
    }
    answer = await c1.nc.request(
        f"$JS.API.CONSUMER.CREATE.CLUSTERS.agent-c1.{subjects.cluster_commands('c1')}",
        json.dumps(body).encode(),
        timeout=5,
    )
    assert "error" in json.loads(answer.data), answer.data
