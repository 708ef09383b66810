"""Answers to requests go only to inboxes.

nats-server checks what a client may publish, never the reply subject it names: a request whose
reply is ``loom.jobs.completed.acme`` or ``$KV.loom_leases.placement.global`` had a service
publish its answer there with the *service's* permissions (a red-team walk stopped every
placement with a tenant's credentials by naming the placement lease as the reply of tenant
queries). A request-reply client's reply is always an inbox (``_INBOX.`` or, secured,
``_INBOX.<identity>.``): any other is not answered, and a query is not even run (an operator's
action on a subject only operators may publish still runs; its answer is not sent).
"""

import time

import structlog
from nats.aio.msg import Msg

from loom.security.permissions import is_inbox

__all__ = ["answerable", "respond"]

log = structlog.get_logger("loom.bus")

_LOG_EVERY_S = 10.0
_last_logged = 0.0
_unlogged = 0


def answerable(msg: Msg) -> bool:
    """Whether ``msg`` asks for an answer on an inbox; a request naming any other reply is logged
    (at most once every 10 s, with the count since) and is not answered (one naming none is not
    logged: there is nothing to answer)."""
    global _last_logged, _unlogged  # noqa: PLW0603 - one process-wide rate limit on the log line
    if is_inbox(msg.reply):
        return True
    if not msg.reply:
        return False
    now = time.monotonic()
    if now - _last_logged >= _LOG_EVERY_S:
        log.warning(
            "request dropped: its reply subject is no inbox",
            subject=msg.subject,
            reply=(msg.reply or "")[:200],
            dropped_since_last_line=_unlogged,
        )
        _last_logged, _unlogged = now, 0
    else:
        _unlogged += 1
    return False


async def respond(msg: Msg, data: bytes) -> bool:
    """Answer ``msg`` on its reply subject if that is an inbox (:func:`answerable`); whether it was."""
    if not answerable(msg):
        return False
    await msg.respond(data)
    return True
