"""The server's asynchronous "permissions violation" errors, remembered per client and subject so a
refused publish fails at once (loom.bus.connection.note_denial / publish_denied)."""

import time

import pytest
from nats.aio.client import Client

from loom.bus import connection
from loom.bus.connection import note_denial, publish_denied


def test_a_refusal_is_noted_by_subject_without_case_and_only_for_publishes_after_it() -> None:
    nc = Client()
    before = time.monotonic()
    # nats-py hands the error text lower-cased; ids may have held capitals.
    assert note_denial(nc, 'nats: permissions violation for publish to "loom.jobs.submitted.globex"') == (
        "loom.jobs.submitted.globex"
    )
    assert publish_denied(nc, "loom.jobs.submitted.GloBex", since=before)
    # A publish started after the refusal (permissions may have changed since) is not refused by it.
    assert not publish_denied(nc, "loom.jobs.submitted.globex", since=time.monotonic() + 1.0)
    # Other subjects, other clients, other errors: nothing.
    assert not publish_denied(nc, "loom.jobs.submitted.globe", since=before)
    assert not publish_denied(Client(), "loom.jobs.submitted.globex", since=before)
    assert note_denial(nc, 'nats: permissions violation for subscription to "loom.>"') is None
    assert note_denial(nc, "nats: stale connection") is None
    # The server's own spelling, unquoted too.
    assert note_denial(nc, "Permissions Violation for Publish to loom.x.y") == "loom.x.y"


def test_refusals_older_than_the_freshness_window_are_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    nc = Client()
    note_denial(nc, 'permissions violation for publish to "a.b"')
    monkeypatch.setattr(connection, "DENIAL_FRESH_S", 0.0)
    note_denial(nc, 'permissions violation for publish to "c.d"')
    assert set(connection._DENIED[nc]) == {"c.d"}
