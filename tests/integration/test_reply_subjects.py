"""Services answer requests only on inboxes, on a real NATS.

nats-server checks what a client publishes, never the reply subject it names: before, a tenant's
query naming ``$KV.loom_leases.placement.global`` as its reply had placement overwrite its own
lease (every placement lost it for as long as the queries went on), and naming
``loom.jobs.completed.acme`` put junk on another tenant's subjects, each with the answering
service's permissions (a red-team walk). Every responder goes through :mod:`loom.bus.reply`.
"""

import asyncio
import json
from types import SimpleNamespace

import nats
from nats.aio.msg import Msg

from loom.runtime.service import close_context, open_context
from loom_proto import subjects
from loom_services.metrics.service import MetricsService

FOREIGN = ["loom.jobs.completed.acme", "$KV.loom_leases.placement.global", "loom.clusters.c1.cmd.stop"]


async def test_a_request_naming_a_reply_that_is_no_inbox_is_not_answered(nats_url: str) -> None:
    ctx = await open_context("reply-guard", nats_url=nats_url, database_url=None)  # answers its health
    service = MetricsService(SimpleNamespace(db=None, publisher=None, stats={}))  # type: ignore[arg-type]
    nc = await nats.connect(nats_url)
    watcher = await nats.connect(nats_url)
    seen: list[str] = []

    async def saw(msg: Msg) -> None:
        seen.append(msg.subject)

    try:
        await nc.subscribe(subjects.VIEW_QUERY, cb=service.on_query)
        for subject in FOREIGN:
            await watcher.subscribe(subject, cb=saw)
        await watcher.flush()
        asker = await nats.connect(nats_url)
        try:
            for reply in FOREIGN:
                await asker.publish(subjects.VIEW_QUERY, b"{}", reply=reply)
                await asker.publish(subjects.service_health("reply-guard"), b"", reply=reply)
            await asker.flush()
            # Asked the usual way (an inbox), both answer: the guard refuses only the others.
            view = json.loads((await asker.request(subjects.VIEW_QUERY, b"{}", timeout=5)).data)
            health = json.loads(
                (await asker.request(subjects.service_health("reply-guard"), b"", timeout=5)).data
            )
        finally:
            await asker.close()
        await asyncio.sleep(0.5)  # what was published to the foreign subjects has arrived by now
        await watcher.flush()
    finally:
        await nc.close()
        await watcher.close()
        await close_context(ctx)
    assert view["ok"] is True and "status" in health
    assert seen == []


def test_no_responder_answers_but_through_the_guard() -> None:
    # A new request handler calling ``msg.respond`` itself would reopen the hole.
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    direct = [
        f"{path.relative_to(root)}:{n}"
        for tree in ("services", "libs")
        for path in sorted((root / tree).rglob("*.py"))
        if path.name != "reply.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if ".respond(" in line and "await respond(" not in line
    ]
    assert direct == []
