"""A leader lease per shard in a JetStream KV bucket; its revision is the fencing token.

The leader of shard ``s`` is whoever holds key ``placement.<s>`` of bucket ``loom_leases``:

* **Acquire** is ``kv.create``, which succeeds only when the key is absent (never written,
  deleted, or expired), so at most one contender wins. The revision it returns is the stream
  sequence of that write, which only grows, so a later leader always holds a larger token.
* **Renew** is ``kv.update(last=revision)`` every ``renew_s``. The bucket's ``ttl`` (the
  stream's ``max_age``) removes a key that nobody renewed for ``ttl_s``: a crashed leader's
  lease disappears by itself and a standby's next ``create`` wins. The token stays the
  acquisition revision; renewals only move the revision the next update must name.
* **Loss** is declared when an update finds another revision than ours, or when no renewal
  succeeded for ``ttl_s`` since it was *sent*. The server received it later than that, so the key
  outlives the leader's belief in it; nobody can acquire while the old leader still thinks it
  leads, clock rates permitting. The fence in PostgreSQL (:mod:`loom.store.fence`) is what makes
  a stale leader harmless when that assumption breaks (a paused process, a partition).
* **Release** deletes the key only if we still hold it, so a standby takes over at once.
* **Grace** (``grace_s``, off by default; placement uses 10 s). On a NATS cluster the bucket is an
  R3 stream; when the node leading it dies, the bucket has no leader until the survivors' Raft
  election ends, 4 to 9 s later (nats-server's ``minElectionTimeout``..``maxElectionTimeout``,
  fixed). Every renewal fails meanwhile, and a 2 s lease would be lost although nobody else can
  have it. So while *every* failure since the last good renewal says the bucket has no leader
  (:func:`is_leaderless`: no responders, 503, a timeout; never a rival's revision), the leader
  keeps leading until ``ttl_s + grace_s`` after that renewal was sent, retrying every ``poll_s``.
  Why it is safe: (1) while the bucket has no leader nobody can write it, so no rival can acquire
  the lease either; (2) when a leader is elected, the key has usually expired (each replica ages
  it out on its own clock); the first write that lands decides: ours (``update`` if the key
  survived, else ``create`` followed by ``confirm``, a fence claim with our *unchanged* token that
  succeeds only if no newer token was claimed meanwhile) keeps the lease, a rival's ``create``
  makes ours fail with a wrong revision and we lose it at once; (3) whatever the cause of the
  failures (a client cut off from every node also sees timeouts while a rival may acquire), the
  fence in PostgreSQL refuses every write of ours once a rival has claimed a newer token, and the
  leader's effects on other services go through its fenced outbox. The cost of a wrong guess is
  bounded: at most ``ttl_s + grace_s`` of a leader that believes it leads without a lease, whose
  writes the fence refuses. A contender with a grace whose last ``create`` found the bucket
  leaderless reads the key until the bucket answers, and finding it gone waits ``ttl_s / 2``
  before its ``create``, so the holder riding the election out re-creates its key first (a
  standby winning that race cost a needless takeover: a state rebuild).
  A failure of another kind (a closed connection, a bad request) ends
  the grace: the plain ``ttl_s`` applies.

What we learned about nats-py (2.16) and nats-server (2.11+) KV, which shaped this module:

* An expired key leaves nothing behind (no delete marker): ``create`` with "last = 0" succeeds.
  The server removes it a few hundred milliseconds after ``ttl``, not at once.
* We do not enable ``limit_marker_ttl``: with it the server writes a ``Nats-Marker-Reason``
  marker on expiry that nats-py's ``create`` does not recognise as a deletion, so ``create`` keeps
  failing until the marker itself ages out — takeover would take up to twice the TTL.
* A ``delete(last=…)`` with a stale revision raises a plain ``BadRequestError`` (code 10071), not
  the ``KeyWrongLastSequenceError`` that ``update`` raises for the same condition.
* ``create_key_value`` on an existing bucket with another ``ttl`` fails ("stream name already in
  use with a different configuration"): the TTL is a property of the bucket, so every holder must
  agree on it; :meth:`LeaderLease.acquire` refuses a mismatch rather than guessing.
* Revisions are stream sequences: deleting and recreating the bucket restarts them at 1, and
  every fence already claimed with a larger token then refuses the new leaders. Do not recreate it.
"""

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable

import msgspec
import nats.errors
import structlog
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig
from nats.js.errors import (
    APIError,
    BadRequestError,
    BucketNotFoundError,
    KeyNotFoundError,
    NoStreamResponseError,
    ServiceUnavailableError,
)
from nats.js.errors import KeyWrongLastSequenceError as WrongRevisionError
from nats.js.kv import KeyValue

from loom.bus.connection import BusError
from loom.tasks import cancel_and_wait
from loom_proto.ids import InvalidIdError, validate_id
from loom_proto.lease import LeaseValue

LEASE_BUCKET = "loom_leases"
_WRONG_LAST_SEQUENCE = 10071  # JetStream's err_code for "wrong last sequence"

log = structlog.get_logger("loom.lease")


class LeaseError(BusError):
    """The lease cannot work as configured (bad shard, a bucket with another TTL). Not retryable."""

    non_retryable = True


# Errors that say "NATS did not answer this time", after which the next try may work.
_TRANSIENT = (nats.errors.Error, TimeoutError, OSError)


def is_leaderless(error: BaseException) -> bool:
    """Whether a failed write says the bucket's stream has no leader right now: nobody answered
    (no responders, no stream response), JetStream answered 503, or the request timed out (a
    Raft election: the request waits for a leader that is not there). Not a rival's revision
    (``KeyWrongLastSequenceError``), not a closed or refused connection."""
    if isinstance(error, nats.errors.NoRespondersError | NoStreamResponseError | ServiceUnavailableError):
        return True
    if isinstance(error, APIError):
        return getattr(error, "code", None) == 503
    return isinstance(error, TimeoutError)  # nats.errors.TimeoutError is one too


class LeaderLease:
    """One contender for the leadership of one shard; see the module docstring for the protocol.

    ``acquire()`` waits until this holder leads and returns the fencing token; a background task
    renews until :meth:`release` or until the lease is lost, which sets :attr:`lost`. The same
    object can acquire again after a loss or a release.
    """

    def __init__(
        self,
        js: JetStreamContext,
        shard: str,
        holder_id: str,
        *,
        ttl_s: float = 2.0,
        renew_s: float = 0.5,
        poll_s: float = 0.2,
        grace_s: float = 0.0,
        confirm: Callable[[], Awaitable[bool]] | None = None,
    ) -> None:
        try:
            validate_id(shard, "shard")
        except InvalidIdError as exc:
            raise LeaseError(str(exc)) from exc
        if not holder_id:
            raise LeaseError("a lease holder needs a non-empty id")
        if not 0 < renew_s < ttl_s:
            raise LeaseError(f"renew_s must be above 0 and below ttl_s, got {renew_s} and {ttl_s}")
        if poll_s <= 0:
            raise LeaseError(f"poll_s must be above 0, got {poll_s}")
        if grace_s < 0:
            raise LeaseError(f"grace_s must not be negative, got {grace_s}")
        self.shard = shard
        self.holder_id = holder_id
        self.key = f"placement.{shard}"
        self.ttl_s = ttl_s
        self.renew_s = renew_s
        self.poll_s = poll_s
        self.grace_s = grace_s
        """How long past ``ttl_s`` a leader whose renewals fail only because the bucket has no
        leader keeps leading (see "Grace"); 0 turns it off."""
        self._confirm = confirm
        """Asked after the key was re-created following a leaderless spell: True if this holder's
        token is still the newest fence claimed (nobody led in between)."""
        self.recreated = 0
        """How many times the key was re-created after a leaderless spell and leadership kept."""
        self.lost = asyncio.Event()
        """Set when leadership ended without :meth:`release`: another revision, or no renewal."""
        self._js = js
        self._kv: KeyValue | None = None
        self._token: int | None = None
        self._revision = 0
        self._value = b""
        self._renewer: asyncio.Task[None] | None = None
        self._stopping = False
        """Set while :meth:`_stop_renewing` ends the renewer: it renews no more."""

    @property
    def token(self) -> int | None:
        """The fencing token (acquisition revision) while leading, else None."""
        return self._token if self.is_leader else None

    @property
    def is_leader(self) -> bool:
        """Whether this holder believes it leads: acquired, not released, not lost."""
        return self._token is not None and not self.lost.is_set()

    async def acquire(self) -> int:
        """Wait until this holder leads; return the fencing token. Tries again every ``poll_s``."""
        if self.is_leader:
            raise LeaseError(f"{self.holder_id} already leads shard {self.shard}")
        await self._stop_renewing()
        self._token = None
        self.lost.clear()
        self._value = msgspec.json.encode(LeaseValue(holder=self.holder_id, term=uuid.uuid4().hex))
        # When a create's reply was lost, it may have landed: the key would then hold our value,
        # written no earlier than that create was sent.
        unconfirmed_at: float | None = None
        after_leaderless = False
        while True:
            sent_at = time.monotonic()
            revision: int | None = None
            try:
                kv = await self._bucket()
                if after_leaderless and self.grace_s > 0:
                    # The holder, if any, is riding the same election out under its grace and
                    # re-creates its key as soon as the bucket answers: once it answers, give the
                    # holder that head start, or the first create after the election may be ours
                    # and cost a needless takeover.
                    with contextlib.suppress(KeyNotFoundError):
                        await kv.get(self.key)
                        after_leaderless = False  # held: poll on as usual
                        await asyncio.sleep(self.poll_s)
                        continue
                    await asyncio.sleep(self.ttl_s / 2)
                    after_leaderless = False
                sent_at = time.monotonic()
                revision = await kv.create(self.key, self._value)
            except WrongRevisionError:
                after_leaderless = False  # the bucket answers, and someone holds the key
                if unconfirmed_at is not None:
                    revision = await self._our_revision(kv)
                    sent_at, unconfirmed_at = unconfirmed_at, None
            except _TRANSIENT as exc:
                log.warning("lease acquire failed", shard=self.shard, holder=self.holder_id, error=str(exc))
                unconfirmed_at = sent_at if unconfirmed_at is None else unconfirmed_at
                after_leaderless = is_leaderless(exc)
            if revision is not None:
                break
            await asyncio.sleep(self.poll_s)  # the holder's key expires on the server's clock
        self._token = self._revision = revision
        self._renewer = asyncio.create_task(self._renew(kv, sent_at), name=f"lease-renew-{self.key}")
        self._renewer.add_done_callback(self._renewer_ended)
        log.info("lease acquired", shard=self.shard, holder=self.holder_id, token=revision)
        return revision

    async def release(self) -> None:
        """Stop renewing and delete the key if we still hold it; safe to call at any time."""
        await self._stop_renewing()
        held = self.is_leader
        self._token = None
        if not held or self._kv is None:
            return
        kv = self._kv
        for _ in range(2):
            try:
                await kv.delete(self.key, last=self._revision)
            except BadRequestError as exc:
                # A renewal cancelled in flight may have landed after all: look before giving up.
                if exc.err_code != _WRONG_LAST_SEQUENCE or not (revision := await self._our_revision(kv)):
                    return
                self._revision = revision
            except _TRANSIENT as exc:
                # The key expires on its own within ttl_s; a standby then takes over.
                log.warning("lease release failed", shard=self.shard, holder=self.holder_id, error=str(exc))
                return
            else:
                log.info("lease released", shard=self.shard, holder=self.holder_id)
                return

    async def _renew(self, kv: KeyValue, last_ok_at: float) -> None:
        """Renew until the lease is lost; ``last_ok_at`` is when the last good write was *sent*.

        While every failure since the last good write says the bucket has no leader
        (:func:`leaderless`), the deadline is ``ttl_s + grace_s`` instead of ``ttl_s``, renewals
        are retried every ``poll_s``, and the first write the re-elected bucket accepts restores
        the lease: see "Grace" in the module docstring.
        """
        leaderless = False
        """Whether every renewal since the last good one failed because the bucket had no leader."""
        other_failure = False
        while True:
            deadline = last_ok_at + self.ttl_s + (self.grace_s if leaderless else 0.0)
            period_s = self.poll_s if leaderless else self.renew_s
            await asyncio.sleep(min(period_s, max(deadline - time.monotonic(), 0.0)))  # the renewal period
            if self._stopping:
                return
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                self._lose(
                    f"no renewal within the lease ttl and the leaderless grace ({self.grace_s}s)"
                    if leaderless
                    else "no renewal succeeded within the lease ttl"
                )
                return
            sent_at = time.monotonic()
            try:
                async with asyncio.timeout(min(remaining_s, self.ttl_s)):
                    self._revision = await kv.update(self.key, self._value, last=self._revision)
            except WrongRevisionError:
                left_s = deadline - time.monotonic()
                revision = await self._our_revision(kv, timeout_s=left_s) if left_s > 0 else None
                if revision is None and leaderless:
                    revision = await self._recreate(kv, timeout_s=deadline - time.monotonic())
                    if revision is not None:
                        last_ok_at, leaderless, other_failure = sent_at, False, False
                if revision is None:
                    self._lose("the lease key was taken over or removed")
                    return
                # Our previous update landed but its reply was lost; we still hold the key.
                self._revision = revision
            except _TRANSIENT as exc:
                first = not leaderless and not other_failure
                other_failure = other_failure or not is_leaderless(exc)
                leaderless = not other_failure
                # Retried every poll_s while leaderless: the first failure of a spell is enough.
                (log.warning if first or not leaderless else log.debug)(
                    "lease renewal failed",
                    shard=self.shard,
                    holder=self.holder_id,
                    error=repr(exc),
                    leaderless=leaderless,
                )
            else:
                if leaderless:
                    log.info(
                        "lease kept through a leaderless bucket", shard=self.shard, holder=self.holder_id
                    )
                last_ok_at, leaderless, other_failure = sent_at, False, False

    async def _recreate(self, kv: KeyValue, *, timeout_s: float) -> int | None:
        """After a leaderless spell the key may have expired on the new bucket leader: create it
        again, and keep leading only if the fence still holds our token (``confirm``); None if
        another holder has the key, the fence moved on, or the bucket does not answer."""
        if timeout_s <= 0:
            return None
        deadline = time.monotonic() + timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                revision = await kv.create(self.key, self._value)
        except (WrongRevisionError, *_TRANSIENT) as exc:
            log.warning("lease re-creation failed", shard=self.shard, holder=self.holder_id, error=repr(exc))
            return None
        try:
            # Within the same bound: a fence that cannot be read in time leaves us unconfirmed.
            async with asyncio.timeout(max(deadline - time.monotonic(), 0.0)):
                confirmed = True if self._confirm is None else await self._confirm()
        except Exception as exc:  # the fence cannot be read: do not lead unconfirmed
            log.warning(
                "lease re-creation not confirmed", shard=self.shard, holder=self.holder_id, error=repr(exc)
            )
            confirmed = False
        if not confirmed:
            with contextlib.suppress(BadRequestError, *_TRANSIENT):  # else it expires within ttl_s
                await kv.delete(self.key, last=revision)
            return None
        self.recreated += 1
        log.info(
            "lease re-created after a leaderless bucket",
            shard=self.shard,
            holder=self.holder_id,
            token=self._token,
            revision=revision,
        )
        return revision

    def _renewer_ended(self, task: asyncio.Task[None]) -> None:
        """A renewer that died leaves the lease to expire: say so and count the lease lost at once,
        so the leader steps down and contends again instead of leading on an expiring lease."""
        if task.cancelled() or task.exception() is None:
            return
        log.error("lease renewer died", shard=self.shard, holder=self.holder_id, error=repr(task.exception()))
        self._lose(f"renewer died: {task.exception()!r}")

    def _lose(self, reason: str) -> None:
        log.warning("lease lost", shard=self.shard, holder=self.holder_id, token=self._token, reason=reason)
        self.lost.set()

    async def _our_revision(self, kv: KeyValue, *, timeout_s: float | None = None) -> int | None:
        """The key's revision if it still holds this acquisition's value, else None."""
        try:
            async with asyncio.timeout(timeout_s):
                entry = await kv.get(self.key)
        except (KeyNotFoundError, *_TRANSIENT):
            return None
        return entry.revision if entry.value == self._value else None

    async def _stop_renewing(self) -> None:
        if self._renewer is not None:
            renewer = self._renewer
            self._stopping = True
            # A cancel can be lost where it lands as a request completes (``wait_for`` in Python
            # 3.11, used by the NATS client): the renewer then ends at its next round
            # (``_stopping``), and is cancelled again meanwhile. A renewer that died was logged
            # (and lost the lease) already: its error is not ours.
            await cancel_and_wait([renewer])
            self._renewer = None
            self._stopping = False

    async def _bucket(self) -> KeyValue:
        """Open ``loom_leases``, creating it with ``ttl = ttl_s`` when absent; refuse another TTL."""
        if self._kv is not None:
            return self._kv
        try:
            kv = await self._js.key_value(LEASE_BUCKET)
        except BucketNotFoundError:
            config = KeyValueConfig(
                bucket=LEASE_BUCKET,
                description="leader leases, one key per shard",
                history=1,
                ttl=self.ttl_s,
                replicas=int(os.environ.get("LOOM_STREAM_REPLICAS", "1")),
            )
            try:
                kv = await self._js.create_key_value(config)
            except APIError:
                # Another contender created it first (or with another TTL, checked below).
                kv = await self._js.key_value(LEASE_BUCKET)
        bucket_ttl_s = (await kv.status()).ttl
        if bucket_ttl_s is None or abs(bucket_ttl_s - self.ttl_s) > 1e-6:
            raise LeaseError(
                f"bucket {LEASE_BUCKET} expires keys after {bucket_ttl_s}s but this lease wants "
                f"ttl_s={self.ttl_s}; every holder must use the bucket's TTL"
            )
        self._kv = kv
        return kv


async def lease_holders(js: JetStreamContext, shards: Iterable[str]) -> dict[str, str | None]:
    """Each shard -> the holder of its lease now, or None where nobody holds it (expired, released,
    never acquired, or no bucket yet). Read only: another service (migration) asks which shards
    lead before it waits for their answers. Raises :class:`BusError` when NATS does not answer."""
    names = list(shards)
    try:
        kv = await js.key_value(LEASE_BUCKET)
    except BucketNotFoundError:
        return dict.fromkeys(names)
    except _TRANSIENT as exc:
        raise BusError(f"the lease bucket did not answer: {exc!r}") from exc
    holders: dict[str, str | None] = {}
    for shard in names:
        try:
            entry = await kv.get(f"placement.{validate_id(shard, 'shard')}")
        except KeyNotFoundError:
            holders[shard] = None
            continue
        except InvalidIdError:
            holders[shard] = None  # no lease can have that name
            continue
        except _TRANSIENT as exc:
            raise BusError(f"the lease of shard {shard} could not be read: {exc!r}") from exc
        try:
            holders[shard] = msgspec.json.decode(entry.value or b"", type=LeaseValue).holder
        except msgspec.DecodeError:
            holders[shard] = "?"  # held, by a value this version cannot read: it leads all the same
    return holders
