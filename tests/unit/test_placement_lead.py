"""A placement leader whose term ends while it still loads its state (the lease lost, the body
cancelled) holds nothing afterwards, and a drain confirmation asked of it then neither waits for a
load that will never end nor answers for a territory it no longer leads.

The service runs without NATS or PostgreSQL here: its load is replaced by one that waits until
cancelled, and the store's drained clusters by a constant.
"""

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest

from loom.model.topology import load_topology
from loom_services.placement import service as placement
from loom_services.placement.service import PlacementService


class _Request:
    """A drain-confirm request as the migration service sends it (it has a reply inbox)."""

    def __init__(self) -> None:
        self.reply = "_INBOX.test"
        self.data = b""
        self.answers: list[dict[str, Any]] = []

    async def respond(self, data: bytes) -> None:
        self.answers.append(json.loads(data))


def _service() -> PlacementService:
    ctx = SimpleNamespace(db=None, publisher=None, stats={}, nc=None, debug={})
    return PlacementService(ctx, topology=load_topology("small"))  # type: ignore[arg-type]


async def _drained(pool: Any) -> list[str]:
    return []


async def test_a_term_cut_short_during_the_load_leaves_nothing_held_and_no_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(placement.moves, "drained_clusters", _drained)
    svc = _service()
    loading = asyncio.Event()

    async def load_forever() -> None:
        loading.set()
        await asyncio.Event().wait()  # the lease goes before the load ends

    svc.load = load_forever  # type: ignore[method-assign]
    svc.leadership.is_leader, svc.leadership.token = True, 7  # as loom.runtime.leader.lead sets them
    body = asyncio.create_task(svc._lead(7))
    await asyncio.wait_for(loading.wait(), timeout=30)
    assert svc.held == {svc.shard: 7}  # it holds its shard while it loads
    body.cancel()  # the lease was lost: lead() cancels the body, then marks the status
    await asyncio.wait([body])
    svc.leadership.is_leader, svc.leadership.token = False, None
    assert body.cancelled()
    assert svc.held == {}
    assert svc.stats["shard"]["territories"] == []

    request = _Request()
    # Bounded far above the load wait (10 s) the old code spent here before answering anyway.
    await asyncio.wait_for(svc.on_drains_changed(request), timeout=60)  # type: ignore[arg-type]
    assert request.answers == []


async def test_an_instance_that_no_longer_leads_answers_for_no_territory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Held territories left over without leadership (the status already says it ended) are not
    answered for; while it leads, with its state loaded, it answers with them."""
    monkeypatch.setattr(placement.moves, "drained_clusters", _drained)
    svc = _service()
    svc.held = {svc.shard: 3}
    svc._loaded.set()
    svc.leadership.is_leader = True
    leading = _Request()
    await svc.on_drains_changed(leading)  # type: ignore[arg-type]
    assert [a["territories"] for a in leading.answers] == [{svc.shard: 3}]

    svc.leadership.is_leader = False
    deposed = _Request()
    await svc.on_drains_changed(deposed)  # type: ignore[arg-type]
    assert deposed.answers == []
