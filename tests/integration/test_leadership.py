"""Leader election against a real JetStream KV and a real Postgres: lease, fence, and ``lead()``.

Every test uses a shard of its own in the shared ``loom_leases`` bucket, and every contender a NATS
connection of its own, so closing that connection is what a crash of its process looks like to
the server: renewals stop, nothing is released, the key expires.
"""

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import asyncpg
import pytest
from nats.aio.client import Client
from nats.js.errors import KeyNotFoundError
from structlog.testing import capture_logs
from waiting import until

from loom.bus import connect
from loom.bus.lease import LEASE_BUCKET, LeaderLease, LeaseError
from loom.runtime.leader import Leadership, lead
from loom.store import fence
from loom.store.fence import FencedError
from loom.store.pool import StoreError, create_pool, transaction

TTL_S = 2.0
"""The bucket's TTL; every lease of the session must use it, since the TTL belongs to the bucket."""

WAIT_S = 15.0
"""Upper bound for anything that should happen within a TTL or two; reached only when failing."""

FreshDatabase = Callable[..., Awaitable[str]]
Connect = Callable[[], Awaitable[Client]]


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="module")
async def pool(fresh_database: FreshDatabase) -> AsyncIterator[asyncpg.Pool]:
    db = await create_pool(await fresh_database("leadership"), min_size=1, max_size=10)
    await db.execute("CREATE TABLE leader_writes (shard text NOT NULL, token bigint NOT NULL)")
    yield db
    await db.close()


@pytest.fixture
async def client(nats_url: str) -> AsyncIterator[Connect]:
    """Opens NATS connections, one per contender; closes whatever is still open afterwards."""
    opened: list[Client] = []

    async def open_one() -> Client:
        opened.append(await connect(nats_url, unique("test-leadership")))
        return opened[-1]

    yield open_one
    for nc in opened:
        if not nc.is_closed:
            await nc.close()


@pytest.fixture
async def leases() -> AsyncIterator[list[LeaderLease]]:
    """Leases made by a test, released at its end so no renewal task outlives it."""
    made: list[LeaderLease] = []
    yield made
    for lease in made:
        await lease.release()


async def contender(client: Connect, leases: list[LeaderLease], shard: str, holder: str) -> LeaderLease:
    lease = LeaderLease((await client()).jetstream(), shard, holder, ttl_s=TTL_S)
    leases.append(lease)
    return lease


async def holder_of(nc: Client, shard: str) -> bytes | None:
    kv = await nc.jetstream().key_value(LEASE_BUCKET)
    try:
        return (await kv.get(f"placement.{shard}")).value
    except KeyNotFoundError:
        return None


async def guarded_write(pool: asyncpg.Pool, shard: str, token: int) -> None:
    """A leader's write: the row goes in, then the fence is checked in the same transaction."""
    async with transaction(pool) as conn:
        await conn.execute("INSERT INTO leader_writes (shard, token) VALUES ($1, $2)", shard, token)
        await fence.check(conn, shard, token)


async def writes_by(pool: asyncpg.Pool, shard: str, token: int) -> int:
    count: int = await pool.fetchval(
        "SELECT count(*) FROM leader_writes WHERE shard = $1 AND token = $2", shard, token
    )
    return count


# -- the lease ---------------------------------------------------------------------------------------


async def test_of_five_contenders_exactly_one_leads_and_keeps_leading_past_the_ttl(
    client: Connect, leases: list[LeaderLease]
) -> None:
    shard = unique("shard")
    contenders = [await contender(client, leases, shard, f"holder-{i}") for i in range(5)]
    tasks = [asyncio.create_task(lease.acquire()) for lease in contenders]
    done, pending = await asyncio.wait(tasks, timeout=WAIT_S, return_when=asyncio.FIRST_COMPLETED)
    assert len(done) == 1, "exactly one contender acquired"
    winner = contenders[tasks.index(done.pop())]
    # Renewals keep the key alive well past its TTL, so nobody else gets in meanwhile.
    _, still_pending = await asyncio.wait(pending, timeout=2 * TTL_S)
    assert still_pending == pending, "a second contender acquired while the leader renews"
    assert winner.is_leader and not winner.lost.is_set()
    assert sum(lease.is_leader for lease in contenders) == 1
    value = await holder_of(await client(), shard)
    assert value is not None and winner.holder_id.encode() in value
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


async def test_a_renewer_that_dies_is_logged_and_loses_the_lease_rather_than_leading_on_an_expiring_key(
    client: Connect, leases: list[LeaderLease]
) -> None:
    lease = await contender(client, leases, unique("shard"), "leader")
    await lease.acquire()
    assert lease._kv is not None

    async def broken_update(*_args: object, **_kwargs: object) -> int:
        raise RuntimeError("a bug in renewal")

    lease._kv.update = broken_update  # type: ignore[method-assign]  # the renewer's next write dies
    with capture_logs() as logs:
        await asyncio.wait_for(lease.lost.wait(), WAIT_S)
    died = [e for e in logs if e["event"] == "lease renewer died"]
    assert len(died) == 1 and "a bug in renewal" in died[0]["error"] and died[0]["log_level"] == "error"
    lost = [e for e in logs if e["event"] == "lease lost"]
    assert len(lost) == 1 and lost[0]["reason"].startswith("renewer died: RuntimeError")
    assert not lease.is_leader


async def test_a_crashed_leader_is_replaced_after_the_ttl_by_a_larger_token(
    client: Connect, leases: list[LeaderLease]
) -> None:
    shard = unique("shard")
    old_nc = await client()
    old = LeaderLease(old_nc.jetstream(), shard, "old", ttl_s=TTL_S)
    leases.append(old)
    new = await contender(client, leases, shard, "new")
    old_token = await old.acquire()
    standby = asyncio.create_task(new.acquire())

    await old_nc.close()  # the process dies: no renewal, no release

    new_token = await asyncio.wait_for(standby, WAIT_S)
    assert new_token > old_token
    assert new.is_leader
    await asyncio.wait_for(old.lost.wait(), WAIT_S)
    assert not old.is_leader and old.token is None


async def test_a_graceful_release_hands_over_to_the_standby(
    client: Connect, leases: list[LeaderLease]
) -> None:
    shard = unique("shard")
    first = await contender(client, leases, shard, "first")
    second = await contender(client, leases, shard, "second")
    first_token = await first.acquire()
    standby = asyncio.create_task(second.acquire())

    await first.release()

    assert not first.is_leader
    assert not first.lost.is_set(), "a release is not a loss"
    second_token = await asyncio.wait_for(standby, WAIT_S)
    assert second_token > first_token


async def test_a_leader_that_lost_its_lease_does_not_release_its_successors(
    client: Connect, leases: list[LeaderLease]
) -> None:
    shard = unique("shard")
    observer = await client()
    old = await contender(client, leases, shard, "old")
    new = await contender(client, leases, shard, "new")
    await old.acquire()
    kv = await observer.jetstream().key_value(LEASE_BUCKET)
    await kv.delete(old.key)  # an operator removes the key: the leader's next renewal finds out
    await asyncio.wait_for(old.lost.wait(), WAIT_S)
    new_token = await asyncio.wait_for(new.acquire(), WAIT_S)

    await old.release()

    value = await holder_of(observer, shard)
    assert value is not None and b'"new"' in value
    assert new.is_leader and new.token == new_token


async def test_a_lease_reacquires_after_losing_with_a_larger_token(
    client: Connect, leases: list[LeaderLease]
) -> None:
    shard = unique("shard")
    lease = await contender(client, leases, shard, "again")
    first_token = await lease.acquire()
    kv = await (await client()).jetstream().key_value(LEASE_BUCKET)
    await kv.delete(lease.key)
    await asyncio.wait_for(lease.lost.wait(), WAIT_S)

    second_token = await asyncio.wait_for(lease.acquire(), WAIT_S)

    assert second_token > first_token
    assert lease.is_leader and not lease.lost.is_set()


async def test_a_lease_refuses_a_bad_shard_and_another_ttl(
    client: Connect, leases: list[LeaderLease]
) -> None:
    js = (await client()).jetstream()
    with pytest.raises(LeaseError, match="invalid shard"):
        LeaderLease(js, "a.b", "holder")
    with pytest.raises(LeaseError, match="renew_s"):
        LeaderLease(js, "shard", "holder", ttl_s=1.0, renew_s=1.0)
    await (await contender(client, leases, unique("shard"), "bucket-maker")).acquire()  # bucket exists
    other_ttl = LeaderLease(js, unique("shard"), "holder", ttl_s=TTL_S * 2, renew_s=0.5)
    with pytest.raises(LeaseError, match="TTL") as caught:
        await other_ttl.acquire()
    assert caught.value.non_retryable


# -- the fence ---------------------------------------------------------------------------------------


async def test_a_claim_with_an_older_token_is_refused(pool: asyncpg.Pool) -> None:
    shard = unique("shard")
    assert await fence.claim(pool, shard, 10, "a")
    assert await fence.claim(pool, shard, 10, "a"), "the same claim again (a retry) succeeds"
    assert not await fence.claim(pool, shard, 10, "b"), "the same token for another holder"
    assert await fence.claim(pool, shard, 12, "b")
    assert not await fence.claim(pool, shard, 11, "a")
    row = await pool.fetchrow("SELECT token, holder FROM fences WHERE shard = $1", shard)
    assert (row["token"], row["holder"]) == (12, "b")


async def test_a_deposed_leaders_write_is_refused_and_rolled_back(
    client: Connect, leases: list[LeaderLease], pool: asyncpg.Pool
) -> None:
    shard = unique("shard")
    old_nc = await client()
    old = LeaderLease(old_nc.jetstream(), shard, "old", ttl_s=TTL_S)
    leases.append(old)
    new = await contender(client, leases, shard, "new")
    old_token = await old.acquire()
    assert await fence.claim(pool, shard, old_token, "old")
    await guarded_write(pool, shard, old_token)
    assert await writes_by(pool, shard, old_token) == 1

    await old_nc.close()  # the old leader is cut off but still running, unaware
    new_token = await asyncio.wait_for(new.acquire(), WAIT_S)
    assert await fence.claim(pool, shard, new_token, "new")

    with pytest.raises(FencedError) as caught:
        await guarded_write(pool, shard, old_token)
    assert caught.value.non_retryable
    assert await writes_by(pool, shard, old_token) == 1, "the refused write was rolled back"
    await guarded_write(pool, shard, new_token)
    assert await writes_by(pool, shard, new_token) == 1


async def test_a_claim_waits_for_the_old_leaders_open_transaction_then_fences_it_off(
    pool: asyncpg.Pool,
) -> None:
    shard = unique("shard")
    assert await fence.claim(pool, shard, 1, "old")
    async with pool.acquire() as conn:
        tx = conn.transaction()
        await tx.start()
        await fence.check(conn, shard, 1)
        await conn.execute("INSERT INTO leader_writes (shard, token) VALUES ($1, 1)", shard)
        claim = asyncio.create_task(fence.claim(pool, shard, 2, "new"))

        async def claim_waits_on_a_lock() -> bool:
            waiting: bool = await pool.fetchval(
                """SELECT count(*) > 0 FROM pg_stat_activity
                   WHERE datname = current_database() AND wait_event_type = 'Lock'"""
            )
            return waiting

        await until(claim_waits_on_a_lock, WAIT_S, "the claim to wait for the old leader's lock")
        assert not claim.done()
        await tx.commit()  # checked before the claim: it commits, ordered before the new leader
    assert await asyncio.wait_for(claim, WAIT_S)
    assert await writes_by(pool, shard, 1) == 1
    with pytest.raises(FencedError):
        await guarded_write(pool, shard, 1)
    assert await writes_by(pool, shard, 1) == 1


async def test_check_refuses_an_unclaimed_shard_and_a_call_outside_a_transaction(pool: asyncpg.Pool) -> None:
    with pytest.raises(FencedError, match="no claimed leader"):
        await guarded_write(pool, unique("shard"), 1)
    shard = unique("shard")
    assert await fence.claim(pool, shard, 3, "a")
    async with pool.acquire() as conn:
        with pytest.raises(StoreError, match="inside the transaction") as caught:
            await fence.check(conn, shard, 3)
    assert caught.value.non_retryable


# -- lead() ------------------------------------------------------------------------------------------


class Body:
    """A leader body that records the tokens it started with and how each run ended."""

    def __init__(self) -> None:
        self.started: list[int] = []
        self.cancelled: list[int] = []

    async def __call__(self, token: int) -> None:
        self.started.append(token)
        try:
            await asyncio.Event().wait()  # leads until cancelled
        except asyncio.CancelledError:
            self.cancelled.append(token)
            raise


async def test_lead_cancels_the_body_on_loss_and_restarts_it_with_a_new_token(
    client: Connect, pool: asyncpg.Pool
) -> None:
    shard = unique("shard")
    body, stopping = Body(), asyncio.Event()
    leadership = Leadership(shard=shard, holder="leader")
    leading = asyncio.create_task(
        lead(
            (await client()).jetstream(),
            pool,
            shard=shard,
            holder="leader",
            body=body,
            stopping=stopping,
            leadership=leadership,
        )
    )
    try:

        async def started(count: int) -> bool:
            return len(body.started) >= count

        await until(lambda: started(1), WAIT_S, "the body to start")
        first_token = body.started[0]
        assert leadership.is_leader and leadership.token == first_token
        kv = await (await client()).jetstream().key_value(LEASE_BUCKET)
        await kv.delete(f"placement.{shard}")  # the lease is gone: the next renewal notices

        await until(lambda: started(2), WAIT_S, "the body to start again")
        assert body.cancelled == [first_token]
        assert body.started[1] > first_token
        assert leadership.token == body.started[1] and leadership.terms == 2
        row = await pool.fetchrow("SELECT token, holder FROM fences WHERE shard = $1", shard)
        assert (row["token"], row["holder"]) == (body.started[1], "leader")
    finally:
        stopping.set()
        await asyncio.wait_for(leading, WAIT_S)
    assert body.cancelled == body.started
    assert not leadership.is_leader and leadership.token is None


async def test_lead_hands_over_to_a_standby_when_the_leader_stops(
    client: Connect, pool: asyncpg.Pool
) -> None:
    shard = unique("shard")
    bodies = {"a": Body(), "b": Body()}
    stops = {"a": asyncio.Event(), "b": asyncio.Event()}
    status = {name: Leadership(shard=shard, holder=name) for name in bodies}
    tasks = {
        name: asyncio.create_task(
            lead(
                (await client()).jetstream(),
                pool,
                shard=shard,
                holder=name,
                body=bodies[name],
                stopping=stops[name],
                leadership=status[name],
            )
        )
        for name in bodies
    }
    try:

        async def someone_leads() -> str | None:
            return next((name for name, s in status.items() if s.is_leader), None)

        leader = await until(someone_leads, WAIT_S, "a leader")
        standby = "b" if leader == "a" else "a"
        assert not status[standby].is_leader and bodies[standby].started == []

        stops[leader].set()
        await asyncio.wait_for(tasks[leader], WAIT_S)

        assert bodies[leader].cancelled == bodies[leader].started
        await until(someone_leads, WAIT_S, "the standby to lead")
        assert status[standby].is_leader
        assert bodies[standby].started[0] > bodies[leader].started[0]
    finally:
        for name in bodies:
            stops[name].set()
        await asyncio.wait_for(asyncio.gather(*tasks.values()), WAIT_S)


async def test_lead_returns_at_once_when_stopping_while_standby(
    client: Connect, leases: list[LeaderLease], pool: asyncpg.Pool
) -> None:
    shard = unique("shard")
    holder = await contender(client, leases, shard, "holder")
    await holder.acquire()
    body, stopping = Body(), asyncio.Event()
    js = (await client()).jetstream()
    standby = asyncio.create_task(lead(js, pool, shard=shard, holder="standby", body=body, stopping=stopping))
    stopping.set()
    await asyncio.wait_for(standby, WAIT_S)
    assert body.started == []
    assert holder.is_leader, "the standby's exit left the leader's key alone"
