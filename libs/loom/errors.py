"""The base of every Loom error, and whether a retry can help.

Each package defines its own subclasses for the cases a caller can act on. The consumer loop
decides between nak (retry later) and dead-letter from :attr:`LoomError.non_retryable`, never
from message text.
"""


class LoomError(Exception):
    """Base of Loom's errors. ``non_retryable`` is True when repeating the same call cannot succeed."""

    non_retryable: bool = False

    def __init__(self, message: str, *, non_retryable: bool | None = None) -> None:
        super().__init__(message)
        if non_retryable is not None:
            self.non_retryable = non_retryable


class InvalidInputError(LoomError):
    """Input that breaks a contract: bad JSON, unknown fields, impossible values. Never retryable."""

    non_retryable = True


class TransientError(LoomError):
    """A dependency was briefly unavailable (server restarting, timeout); a retry may succeed."""

    non_retryable = False


class NotLeaderError(TransientError):
    """This instance no longer leads what the message belongs to (a newer leader claimed the
    fence): the message is the new leader's to handle. A consumer gives it back (nak with a delay)
    without counting it toward dead-lettering: it says nothing about the message."""


class UnavailableError(TransientError):
    """A server Loom stands on (``dependency``: ``postgres``, ``nats``) did not answer. Not a
    property of the message at hand: a consumer waits the outage out instead of counting it
    toward dead-lettering."""

    dependency: str = "unknown"

    def __init__(self, message: str, *, dependency: str | None = None) -> None:
        super().__init__(message)
        if dependency is not None:
            self.dependency = dependency
