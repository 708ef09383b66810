"""Message ids that no other identity can take first: keyed with the publisher's own secret.

JetStream drops a message whose ``Nats-Msg-Id`` it saw in the last two minutes in the same
stream, and nats-server cannot restrict which id a client sets. Services and agents give their
messages deterministic ids (``<job>:placed:<attempt>``, ``<job>:completed:<attempt>``: a retry
must be recognised as one), and job ids are often guessable. So anyone allowed to publish into the
same stream could publish first under such an id and have the real message dropped: an agent's
credentials, on the one subject of its own cluster, could drop placement's ``placed`` event of
another cluster's job, a command to another cluster, or another agent's ``completed``.

On the wire, a service's or an agent's id therefore carries a tag: ``<id>~<16 hex>``, an HMAC of
the id under a key derived from the identity's own NKEY seed (:func:`id_key`), which no one else
holds. It is as deterministic as the id (a retry, or the standby of the same identity, sends the
same tag), and nobody else can compute it. Consumers read the id without its tag
(:func:`logical`), so inbox claims, job histories and traces keep the plain id, and a run's two
clusters' reports of the same event (a spread gang's ``started``) still count once: what a
publisher could claim by setting a plain id itself, a tag adds nothing to.

Tenants (their ids stay theirs: requests have a stream of their own and their claims are scoped by
tenant) and the operator's ``admin`` send ids untagged. A seed changed by
``loom credentials rotate`` gives a process restarted after it a new key; a message of an identity
resent across such a restart by another process of it may then be stored twice, and consumers'
claims of the plain id keep it from being handled twice.
"""

import hashlib
import hmac
import re

from loom.security.credentials import Credential

SEPARATOR = "~"
_TAG_HEX = 16
_TAGGED = re.compile(rf"^(?P<id>.+){SEPARATOR}[0-9a-f]{{{_TAG_HEX}}}$", re.DOTALL)


def tags_ids(identity: str) -> bool:
    """Whether an identity (by name) tags its message ids: services and agents do."""
    return identity != "admin" and not identity.startswith("tenant-")


def id_key(credential: Credential | None) -> bytes | None:
    """The key an identity tags its message ids with, from its seed (None: no credential, on an
    unsecured server, or an identity that sends plain ids: :func:`tags_ids`)."""
    if credential is None or not tags_ids(credential.identity):
        return None
    return hmac.new(credential.seed.encode(), b"loom message ids v1", hashlib.sha256).digest()


def keyed(msg_id: str, key: bytes | None) -> str:
    """The id as sent in ``Nats-Msg-Id``: tagged under ``key``, or as it is without one."""
    if key is None:
        return msg_id
    tag = hmac.new(key, msg_id.encode(), hashlib.sha256).hexdigest()[:_TAG_HEX]
    return f"{msg_id}{SEPARATOR}{tag}"


def logical(msg_id: str) -> str:
    """The id without its tag (what consumers claim and record); any other id as it is."""
    match = _TAGGED.match(msg_id)
    return match["id"] if match else msg_id
