"""Connecting to NATS and making sure Loom's streams exist with the configured limits.

A NATS URL may list several servers, comma-separated (``nats://a:4222,nats://b:4222``): the nodes
of a cluster, all of which a client knows from the start so it can connect and fail over to any.
"""

import asyncio
import base64
import contextlib
import os
import re
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import nats
import nats.errors
import nkeys
import structlog
from nats.aio.client import Client
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError, NotFoundError, ServiceUnavailableError

from loom import security
from loom.bus.attempts import ensure_bucket
from loom.errors import LoomError
from loom.runtime.config import loom_home
from loom.security.tls import client_context
from loom_proto.subjects import STREAMS, StreamSpec

log = structlog.get_logger("loom.bus")


async def _process_pong(self: Client) -> None:
    """nats-py's PONG handling, minus its dead-connection bug (nats-py 2.16.0).

    ``Client.flush`` that times out cancels its PONG future but leaves it first in ``_pongs``; the
    server's late PONG (a server frozen a few seconds: SIGSTOP, a stalled disk) then meets
    ``future.set_result`` on a cancelled future, ``InvalidStateError`` ends the client's read loop
    ("nats: encountered error") and the connection is never read again nor reconnected: every
    request after it times out for good. Found by ``loom bench chaos`` (a 2 s SIGSTOP of
    nats-server left metrics, migration and the placement standby deaf). The late PONG answers the
    PING of the cancelled future; it is consumed and ignored, as the library means it to be."""
    if len(self._pongs) > 0:
        future = self._pongs.pop(0)
        if not future.done():
            future.set_result(True)
        self._pongs_received += 1
        self._pings_outstanding = 0


Client._process_pong = _process_pong  # type: ignore[method-assign]


class BusError(LoomError):
    """The bus could not do what was asked (connection lost, stream misconfigured)."""


def server_urls(url: str) -> list[str]:
    """The servers a NATS URL names: ``nats://a:4222,nats://b:4222`` is two, blanks dropped."""
    servers = [part.strip() for part in url.split(",") if part.strip()]
    if not servers:
        raise BusError(f"no NATS server in {url!r}", non_retryable=True)
    return servers


_OPERATOR_CREDS: dict[str, Path] = {}
"""Operator credentials of the secured stacks this process started, by NATS URL."""


def remember_credentials(url: str, path: Path) -> None:
    """Connect to ``url`` with ``path`` unless told otherwise (``loom.runtime.stack.up`` calls it:
    whoever starts a secured stack in-process acts as its operator)."""
    _OPERATOR_CREDS[url] = Path(path)


def credentials_path(url: str | None = None) -> Path | None:
    """The credential file to connect with: ``$LOOM_CREDS``; else the operator's file of a secured
    stack this process started at ``url``; else that of the stack's home
    (``<home>/secrets/nats/admin.creds``) when that stack is secured; else none."""
    configured = os.environ.get(security.ENV_CREDS)
    if configured:
        return Path(configured)
    if url is not None and url in _OPERATOR_CREDS:
        return _OPERATOR_CREDS[url]
    default = security.CredentialStore(loom_home()).path(security.admin_identity())
    return default if default.exists() else None


def identity_at(url: str | None = None) -> str | None:
    """The identity (``tenant-acme``, ``admin``) of the credentials a client of ``url`` connects
    with (:func:`credentials_path`), None without any; :class:`BusError` for a file that cannot be
    read as credentials."""
    creds = credentials_path(url)
    try:
        return security.read(creds).identity if creds is not None else None
    except (OSError, ValueError) as exc:  # missing, unreadable or not a credential file
        raise BusError(f"cannot use the NATS credentials {creds}: {exc}") from exc


def auth_options(creds: Path | None) -> dict[str, str]:
    """``nats.connect`` keyword arguments for the identity of ``creds`` (none when None): its NKEY
    seed and its own reply-inbox prefix, the only one its permissions let it read."""
    if creds is None:
        return {}
    try:
        credential = security.read(creds)
    except (OSError, ValueError) as exc:
        raise BusError(f"cannot read the NATS credentials {creds}: {exc}", non_retryable=True) from exc
    return {"nkeys_seed_str": credential.seed, "inbox_prefix": f"_INBOX.{credential.identity}"}


def tls_options() -> dict[str, Any]:
    """``nats.connect``'s ``tls`` for a stack serving TLS: a context trusting only its CA
    (``$LOOM_NATS_CA``, else ``<home>/secrets/tls/ca.pem`` when the stack generated one). The
    client upgrades only when the server requires TLS, so a loopback server is unaffected."""
    configured = os.environ.get(security.ENV_NATS_CA)
    ca = Path(configured) if configured else loom_home() / "secrets" / "tls" / "ca.pem"
    if not ca.exists():
        if configured:
            raise BusError(f"no CA certificate at {ca} (${security.ENV_NATS_CA})", non_retryable=True)
        return {}
    return {"tls": client_context(ca)}


def _follow_rotation(nc: Client, path: Path) -> None:
    """Sign each (re)connection with the seed the file holds *then*, announcing its public key.

    nats-py reads the seed file at every signature but fixes the public key at the first
    connection, so after `loom credentials rotate` its reconnections would be refused forever.
    The CONNECT message is built after the signature, so updating the key there follows a rotation.
    """

    def sign(nonce: str) -> bytes:
        pair = nkeys.from_seed(bytearray(security.read(path).seed.encode()))
        try:
            nc._public_nkey = pair.public_key.decode()
            return base64.b64encode(pair.sign(nonce.encode()))
        finally:
            pair.wipe()

    nc._signature_cb = sign


async def connect(
    url: str,
    name: str,
    *,
    connect_timeout_s: float = 5.0,
    first_within_s: float | None = None,
    creds: Path | None = None,
) -> Client:
    """Connect with unbounded reconnects, so a NATS restart pauses a service instead of ending it.

    ``url`` may list the nodes of a cluster, comma-separated: the client connects to any of them
    and, when its server goes, reconnects to another. A service waits for the first connection as
    long as it takes; a command line gives ``first_within_s`` and gets a :class:`BusError` saying
    what to do when no server answers by then.

    On a secured stack the client authenticates with the NKEY of ``creds`` (default
    :func:`credentials_path`) and takes its replies on its identity's own inbox prefix, the only
    one its permissions let it read; a server that requires TLS is trusted only when the stack's
    CA signed its certificate (:func:`tls_options`).
    """
    creds = creds or credentials_path(url)
    auth = auth_options(creds)

    async def on_error(exc: Exception) -> None:
        if client:
            note_denial(client[0], str(exc))
            log.warning("nats error", error=str(exc), client=name)
        else:  # not connected yet: the caller waits (a service) or gives up in time (a command)
            log.info("waiting for nats", error=str(exc), client=name)
            # Sticky: the retries after a refusal fail with other errors (a closed connection),
            # which must not hide that the server refused these credentials.
            if "authorization" in str(exc).lower() and not refused.done():
                refused.set_result(str(exc))

    refused: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    client: list[Client] = []

    async def on_disconnected() -> None:
        # A drain or close disconnects too; only an unexpected loss is worth a warning.
        if client and (client[0].is_closed or client[0].is_draining):
            return
        log.warning("nats disconnected", client=name)

    async def on_reconnected() -> None:
        log.info("nats reconnected", client=name)
        for listener in list(_RECONNECT_LISTENERS.get(client[0], ())) if client else ():
            try:
                listener()
            except Exception:  # one listener's bug must not keep the others from hearing
                log.exception("reconnect listener failed", client=name)

    opening = nats.connect(
        servers=server_urls(url),
        name=name,
        connect_timeout=connect_timeout_s,
        allow_reconnect=True,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        error_cb=on_error,
        disconnected_cb=on_disconnected,
        reconnected_cb=on_reconnected,
        # Keep queued publishes while reconnecting rather than failing them at once.
        pending_size=64 * 1024 * 1024,
        **auth,
        **tls_options(),
    )
    try:
        if first_within_s is None:
            nc = await opening
        else:
            # A command gives up in time, and at once when the server refuses its credentials.
            opened = asyncio.ensure_future(opening)
            either: set[asyncio.Future[Any]] = {opened, refused}
            await asyncio.wait(either, timeout=first_within_s, return_when=asyncio.FIRST_COMPLETED)
            if not opened.done():
                opened.cancel()
                with contextlib.suppress(BaseException):
                    await opened
                if refused.done():
                    raise BusError(
                        f"NATS at {url} refused the credentials {creds or '(none)'}: {refused.result()};"
                        f" set {security.ENV_CREDS} to a credential file of this stack (`loom tenant add`)",
                        non_retryable=True,
                    )
                raise BusError(
                    f"no NATS server answered at {url} within {first_within_s:g} s: if the stack is"
                    " down, start it with `loom up` (or set LOOM_NATS_URL); if it is up, its NATS"
                    " server is not answering (`loom status` says)"
                )
            nc = opened.result()
    except BusError:
        raise
    except Exception as exc:  # nats raises several unrelated types for "could not connect"
        raise BusError(f"cannot connect to NATS at {url}: {exc}") from exc
    client.append(nc)
    _ANNOUNCING.add(nc)
    if creds is not None:
        _follow_rotation(nc, creds)
    return nc


_RECONNECT_LISTENERS: "weakref.WeakKeyDictionary[Client, list[Callable[[], None]]]" = (
    weakref.WeakKeyDictionary()
)
_ANNOUNCING: "weakref.WeakSet[Client]" = weakref.WeakSet()
"""The clients made by :func:`connect`: the ones whose reconnects reach :func:`on_reconnected`'s listeners."""

_DENIED: "weakref.WeakKeyDictionary[Client, dict[str, float]]" = weakref.WeakKeyDictionary()
_DENIAL = re.compile(r'permissions violation for publish to "?([^"\s]+)"?', re.IGNORECASE)

DENIAL_FRESH_S = 60.0
"""How long a server's refusal to let this client publish to a subject is kept."""


def note_denial(nc: Client, error: str) -> str | None:
    """Remember a NATS "permissions violation for publish to SUBJECT" error of ``nc`` (it comes
    asynchronously, through the error callback): the subject refused (lower-cased: nats-py lowers
    the server's whole error text), or None for another error. Refusals older than
    :data:`DENIAL_FRESH_S` are forgotten."""
    found = _DENIAL.search(error)
    if found is None:
        return None
    now = time.monotonic()
    denied = _DENIED.setdefault(nc, {})
    for stale in [s for s, at in denied.items() if now - at >= DENIAL_FRESH_S]:
        del denied[stale]
    subject = found.group(1).lower()
    denied[subject] = now
    return subject


def publish_denied(nc: Client, subject: str, *, since: float) -> bool:
    """Whether the server refused ``nc`` a publish to ``subject`` at or after ``since`` (a
    ``time.monotonic()`` reading: the publish's own start, so that a refusal from before a change
    of permissions never fails a later publish): retrying will not change that. Subjects compare
    without case, as nats-py reports them."""
    at = _DENIED.get(nc, {}).get(subject.lower())
    return at is not None and at >= since


def announces_reconnects(nc: Client) -> bool:
    """Whether :func:`on_reconnected`'s listeners hear ``nc``'s reconnects (it was made by
    :func:`connect`); a client made otherwise never calls them, so whoever waits on one must look."""
    return nc in _ANNOUNCING


def on_reconnected(nc: Client, listener: Callable[[], None]) -> Callable[[], None]:
    """Call ``listener`` each time ``nc`` (made by :func:`connect`) is connected again, to the
    same server or another node; returns the function that removes it.

    Whatever was waiting for a reply on the lost connection (a pull request, an ack) may never get
    it: a listener asks again at once instead of waiting out its timeout.
    """
    listeners = _RECONNECT_LISTENERS.setdefault(nc, [])
    listeners.append(listener)

    def remove() -> None:
        if listener in listeners:
            listeners.remove(listener)

    return remove


def stream_config(spec: StreamSpec) -> StreamConfig:
    """The JetStream config of one of Loom's streams: file storage, dedup window, limits."""
    return StreamConfig(
        name=spec.name,
        subjects=list(spec.subjects),
        description=spec.description,
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        discard=DiscardPolicy.OLD,
        max_age=spec.max_age_s,
        max_bytes=spec.max_bytes,
        max_msg_size=spec.max_msg_bytes,
        duplicate_window=spec.duplicate_window_s,
        # 3 on a NATS cluster (`loom up --nats-cluster 3` sets it; deploy/nats/cluster-3.conf);
        # 1 for a single server. Consumers leave num_replicas unset and so inherit it.
        num_replicas=int(os.environ.get("LOOM_STREAM_REPLICAS", "1")),
    )


NO_SUITABLE_PEERS = 10005
"""JetStream's error code when it cannot place a stream's replicas: "no suitable peers for
placement, peer offline", while a starting cluster's nodes have not all joined its meta group."""


def placement_refused(exc: BadRequestError) -> bool:
    """Whether JetStream refused to create a stream because it cannot place its replicas yet (not
    because the stream exists)."""
    return exc.err_code == NO_SUITABLE_PEERS


class PeersNotReadyError(Exception):
    """A cluster cannot place a stream yet: not all its nodes have joined (retried like a missing
    meta leader). A CI run of the supervised 3-node stack failed on it: the refusal was taken for
    "another service created it", and the update that followed found no stream."""


_JETSTREAM_NOT_READY = (
    ServiceUnavailableError,
    NoRespondersError,
    NatsTimeoutError,
    asyncio.TimeoutError,
    PeersNotReadyError,
)
"""What JetStream answers while a cluster has no meta leader yet (at start, or after losing it), or
not yet the peers a stream's replicas need."""


async def ensure_streams(
    js: JetStreamContext, specs: tuple[StreamSpec, ...] = STREAMS, *, ready_timeout_s: float = 30.0
) -> None:
    """Create each stream, or update it to the configured limits when it already exists.

    On a cluster, JetStream refuses requests until its nodes have elected a meta leader; those
    refusals are retried for up to ``ready_timeout_s`` before the last one is raised.
    """
    deadline = time.monotonic() + ready_timeout_s
    delay_s = 0.1
    for spec in specs:
        while True:
            try:
                await _ensure_stream(js, stream_config(spec))
                break
            except _JETSTREAM_NOT_READY as exc:
                if time.monotonic() + delay_s >= deadline:
                    raise
                log.info("jetstream not ready, retrying", stream=spec.name, error=repr(exc))
                await asyncio.sleep(delay_s)
                delay_s = min(delay_s * 2, 1.0)
    if specs is STREAMS:
        # The consumers' attempt records (crash-loop detection); agents may not create it.
        try:
            await ensure_bucket(js)
        except (nats.errors.Error, TimeoutError, OSError) as exc:  # consumers create it lazily too
            log.warning("attempts bucket not ensured", error=repr(exc))


async def _ensure_stream(js: JetStreamContext, config: StreamConfig) -> None:
    assert config.name is not None
    try:
        await js.stream_info(config.name)
    except NotFoundError:
        try:
            await js.add_stream(config)
        except BadRequestError as exc:
            if placement_refused(exc):
                raise PeersNotReadyError(str(exc)) from exc
            # Another service created it between our look-up and our add.
            await js.update_stream(config)
    else:
        await js.update_stream(config)
