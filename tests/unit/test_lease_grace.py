"""The lease's grace while its bucket has no leader (loom.bus.lease, "Grace"), against a scripted
KV: which failures extend the lease, how the key is restored after the election, and when it is
lost all the same. Short real timings (TTL 0.4 s, grace 1.2 s) with wide margins."""

import asyncio
from typing import Any

import nats.errors
import pytest
from nats.js.errors import APIError, KeyNotFoundError, NoStreamResponseError, ServiceUnavailableError
from nats.js.errors import KeyWrongLastSequenceError as WrongRevisionError

from loom.bus.lease import LeaderLease, LeaseError, is_leaderless

TTL_S, GRACE_S = 0.4, 1.2


class Entry:
    def __init__(self, value: bytes, revision: int) -> None:
        self.value, self.revision = value, revision


class ScriptedKV:
    """One key; ``failure`` (an exception) is raised by every call while set."""

    def __init__(self) -> None:
        self.seq = 0
        self.key: Entry | None = None
        self.failure: BaseException | None = None
        self.deletes = 0

    def _fail(self) -> None:
        if self.failure is not None:
            raise self.failure

    async def create(self, key: str, value: bytes) -> int:
        self._fail()
        if self.key is not None:
            raise WrongRevisionError()
        self.seq += 1
        self.key = Entry(value, self.seq)
        return self.seq

    async def update(self, key: str, value: bytes, last: int) -> int:
        self._fail()
        if self.key is None or self.key.revision != last:
            raise WrongRevisionError()
        self.seq += 1
        self.key = Entry(value, self.seq)
        return self.seq

    async def get(self, key: str) -> Entry:
        self._fail()
        if self.key is None:
            raise KeyNotFoundError()
        return self.key

    async def delete(self, key: str, last: int | None = None) -> bool:
        self._fail()
        if self.key is not None and (last is None or self.key.revision == last):
            self.key = None
            self.deletes += 1
        return True

    def expire(self) -> None:
        """What the replicas do with a key nobody renewed for the TTL."""
        self.key = None

    def rival_takes(self) -> None:
        self.seq += 1
        self.key = Entry(b"rival", self.seq)


async def leading(kv: ScriptedKV, **kwargs: Any) -> LeaderLease:
    lease = LeaderLease(
        None,  # type: ignore[arg-type]  # the bucket is given below
        "s1",
        "me",
        ttl_s=TTL_S,
        renew_s=0.1,
        poll_s=0.05,
        **kwargs,
    )
    lease._kv = kv  # type: ignore[assignment]
    await lease.acquire()
    return lease


async def election(kv: ScriptedKV, failure: BaseException, hold_s: float) -> None:
    """The bucket fails every call for ``hold_s``; the key expires meanwhile (past the TTL)."""
    kv.failure = failure
    await asyncio.sleep(hold_s)
    kv.expire()
    kv.failure = None


async def test_a_leaderless_bucket_past_the_ttl_keeps_the_lease_and_the_key_is_recreated() -> None:
    kv = ScriptedKV()
    confirms: list[int | None] = []
    lease: LeaderLease

    async def confirm() -> bool:
        confirms.append(lease.token)
        return True

    lease = await leading(kv, grace_s=GRACE_S, confirm=confirm)
    token = lease.token
    await election(kv, nats.errors.NoRespondersError(), hold_s=2.5 * TTL_S)
    await asyncio.sleep(0.4)
    assert not lease.lost.is_set(), "nobody could take the lease while the bucket had no leader"
    assert lease.token == token, "the fencing token stays the acquisition's"
    assert lease.recreated == 1 and confirms == [token]
    assert kv.key is not None and kv.key.value == lease._value
    await asyncio.sleep(2 * TTL_S)  # renewals go on as before
    assert not lease.lost.is_set()
    await lease.release()


async def test_without_grace_the_same_election_loses_the_lease() -> None:
    kv = ScriptedKV()
    lease = await leading(kv)
    await election(kv, nats.errors.NoRespondersError(), hold_s=2.5 * TTL_S)
    assert lease.lost.is_set()


async def test_a_closed_connection_is_no_leaderless_bucket_and_gets_no_grace() -> None:
    kv = ScriptedKV()
    lease = await leading(kv, grace_s=GRACE_S, confirm=None)
    await election(kv, nats.errors.ConnectionClosedError(), hold_s=2.5 * TTL_S)
    assert lease.lost.is_set()


async def test_a_rival_that_wrote_the_key_first_after_the_election_wins() -> None:
    kv = ScriptedKV()
    lease = await leading(kv, grace_s=GRACE_S)
    kv.failure = nats.errors.TimeoutError()
    await asyncio.sleep(2.5 * TTL_S)
    kv.expire()
    kv.rival_takes()
    kv.failure = None
    await asyncio.wait_for(lease.lost.wait(), 1.0)
    assert kv.key is not None and kv.key.value == b"rival"


async def test_the_grace_is_bounded() -> None:
    kv = ScriptedKV()
    lease = await leading(kv, grace_s=GRACE_S)
    kv.failure = ServiceUnavailableError()
    loop = asyncio.get_running_loop()
    started = loop.time()
    await asyncio.wait_for(lease.lost.wait(), TTL_S + GRACE_S + 1.0)
    assert loop.time() - started >= TTL_S + GRACE_S - 0.2, "lost before the grace ran out"


async def test_a_recreated_key_whose_fence_moved_on_loses_the_lease_and_is_removed() -> None:
    kv = ScriptedKV()

    async def fence_moved_on() -> bool:
        return False

    lease = await leading(kv, grace_s=GRACE_S, confirm=fence_moved_on)
    await election(kv, NoStreamResponseError(), hold_s=2.5 * TTL_S)
    await asyncio.wait_for(lease.lost.wait(), 1.0)
    assert kv.key is None and kv.deletes == 1, "the key we wrote is removed so a standby need not wait"


async def test_a_fence_that_does_not_answer_in_time_loses_the_lease_within_the_bound() -> None:
    kv = ScriptedKV()

    async def hangs() -> bool:
        await asyncio.Event().wait()
        return True

    lease = await leading(kv, grace_s=GRACE_S, confirm=hangs)
    loop = asyncio.get_running_loop()
    started = loop.time()
    await election(kv, nats.errors.NoRespondersError(), hold_s=2.5 * TTL_S)
    await asyncio.wait_for(lease.lost.wait(), TTL_S + GRACE_S + 1.0)
    assert loop.time() - started <= TTL_S + GRACE_S + 0.5


async def test_a_mixed_spell_gets_no_grace() -> None:
    kv = ScriptedKV()
    lease = await leading(kv, grace_s=GRACE_S)
    kv.failure = nats.errors.ConnectionClosedError()
    await asyncio.sleep(0.2)
    kv.failure = nats.errors.NoRespondersError()
    await asyncio.wait_for(lease.lost.wait(), TTL_S + 0.5)


def test_which_errors_say_the_bucket_has_no_leader() -> None:
    assert is_leaderless(nats.errors.NoRespondersError())
    assert is_leaderless(NoStreamResponseError())
    assert is_leaderless(ServiceUnavailableError())
    assert is_leaderless(APIError(code=503))
    assert is_leaderless(nats.errors.TimeoutError())
    assert is_leaderless(TimeoutError())
    assert not is_leaderless(WrongRevisionError())
    assert not is_leaderless(nats.errors.ConnectionClosedError())
    assert not is_leaderless(ConnectionRefusedError())
    assert not is_leaderless(APIError(code=400))


def test_a_negative_grace_is_refused() -> None:
    with pytest.raises(LeaseError):
        LeaderLease(None, "s1", "me", grace_s=-1.0)  # type: ignore[arg-type]


async def test_a_standby_gives_the_holder_a_head_start_after_a_leaderless_bucket() -> None:
    """Both ride out the same election: the holder under its grace, a standby polling ``create``
    (faster than the holder retries, here). When the bucket answers again the key has expired; the
    holder must re-create it first (a standby winning that race made a needless takeover)."""
    for _ in range(3):  # the race went either way before; each round must go to the holder
        kv = ScriptedKV()
        holder = await leading(kv, grace_s=GRACE_S, confirm=None)
        token = holder.token
        standby = LeaderLease(None, "s1", "standby", ttl_s=TTL_S, renew_s=0.1, poll_s=0.01, grace_s=GRACE_S)  # type: ignore[arg-type]
        standby._kv = kv  # type: ignore[assignment]
        contender = asyncio.create_task(standby.acquire())
        await asyncio.sleep(0.1)  # the standby finds the key held
        await election(kv, nats.errors.NoRespondersError(), hold_s=2.5 * TTL_S)
        await asyncio.sleep(0.5)
        assert not holder.lost.is_set() and holder.token == token
        assert holder.recreated == 1
        assert not contender.done(), "the standby took the lease from a holder riding the election out"
        contender.cancel()
        with pytest.raises(asyncio.CancelledError):
            await contender
        await holder.release()


class LossyKV(ScriptedKV):
    """A renewal that swallows a cancel landing in it, as a request through Python 3.11's
    ``wait_for`` can when the cancel lands just as the reply arrives."""

    def __init__(self) -> None:
        super().__init__()
        self.in_update = asyncio.Event()
        self.swallowed = 0

    async def update(self, key: str, value: bytes, last: int) -> int:
        self.in_update.set()
        try:
            await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            self.swallowed += 1
        return await super().update(key, value, last)


async def test_a_release_ends_a_renewer_that_lost_its_cancel_and_deletes_the_key() -> None:
    kv = LossyKV()
    lease = await leading(kv)
    kv.in_update.clear()
    await kv.in_update.wait()  # a renewal is in flight: the release's cancel lands in it
    releasing = asyncio.ensure_future(lease.release())
    await asyncio.wait([releasing], timeout=20)  # never cancels the release (wait_for would)
    assert kv.swallowed >= 1, "the cancel was lost in the renewal"
    assert releasing.done() and releasing.exception() is None, "the release ends all the same"
    assert kv.key is None and kv.deletes == 1, "and removes the key"
