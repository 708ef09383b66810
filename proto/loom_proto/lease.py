"""The value of a leader lease key in the ``loom_leases`` KV bucket (see :mod:`loom.bus.lease`).

Every contender (each placement instance, in its own process) writes and reads it, so it is a
contract between processes like any message on a subject.
"""

import msgspec


class LeaseValue(msgspec.Struct, frozen=True):
    """What the key holds: who leads, and a term id that tells this acquisition from any other."""

    holder: str
    term: str
