"""rare_fit's memory survives a change of placement leader, on real NATS and PostgreSQL.

``rare_fit`` keeps room for a worker shape only few nodes hold once it has seen that shape twice
among the latest jobs (``Snapshot.seen``). A leader that takes over rebuilds that memory from the
jobs table; before, it started empty, and the first jobs after a restart could take the last room
a rare shape had, as if it had never been seen.
"""

import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from loom.bus import Delivery
from loom.runtime.service import ServiceContext, close_context, open_context
from loom.sched.plugins.rare import rare_shapes
from loom.sched.snapshot import WorkerShape
from loom.store import fence
from loom_proto.jobs import JobSubmitted, Resources, Work
from loom_services.placement.service import PlacementService
from tests.integration.test_placement_pipeline import PLATFORM, TOPOLOGY, leading_service, submission

BIG = Resources(gpus=8, cpu_milli=8_000, memory_mib=700 * 1024)
"""Eight GPUs and 700 GiB: one node of the small platform holds it (8 GPUs, 768 GiB)."""


def submissions(jobs: list[tuple[str, Resources]]) -> list[Delivery[bytes]]:
    return [
        submission(
            JobSubmitted(
                job_id=job_id,
                tenant="t1",
                resources=resources,
                work=Work(steps=10, step_time_s=60.0),
                submitted_at=time.time(),
            ),
            i + 1,
        )
        for i, (job_id, resources) in enumerate(jobs)
    ]


@pytest.fixture
async def ctx(nats_url: str, fresh_database: Callable[..., Awaitable[str]]) -> AsyncIterator[ServiceContext]:
    context = await open_context("rare-restart", nats_url=nats_url, database_url=await fresh_database("rare"))
    yield context
    await close_context(context)


async def test_a_new_leader_remembers_the_shapes_the_last_one_saw(ctx: ServiceContext) -> None:
    first = await leading_service(ctx)
    small = Resources(gpus=1, cpu_milli=4_000)
    jobs = [("big-1", BIG), ("small-1", small), ("big-2", BIG), ("small-2", small)]
    answers = await first.on_submitted(submissions(jobs))
    assert all(a is None for a in answers)
    big, one_gpu = WorkerShape(8, 8_000, 700 * 1024), WorkerShape(1, 4_000, 0)
    assert first.book.seen.counts == {big: 2, one_gpu: 2}
    eight_gpus = WorkerShape(8, 4_000, 0)  # fits every 8-GPU node: the big shape is rare for it
    assert [g.shape for g in rare_shapes(first.book.snapshot(time.time()), eight_gpus)] == [big]

    # Another instance takes over (a higher fencing token) and loads its state from the store.
    assert await fence.claim(ctx.db, "global", 2, "rare-restart-2")
    second = PlacementService(ctx, topology=TOPOLOGY, economics=PLATFORM.economics, settle_s=0.0)
    second.token = 2
    second.held = {"global": 2}
    assert len(second.book.seen) == 0
    await second.load()
    assert second.book.seen.counts == {big: 2, one_gpu: 2}
    snap = second.book.snapshot(time.time())
    assert snap.seen is second.book.seen
    groups = rare_shapes(snap, eight_gpus)
    assert [(g.shape, g.count, g.holders) for g in groups] == [(big, 2, 1)]


async def test_a_new_leader_reads_the_store_a_page_at_a_time_and_no_more_than_its_pages(
    ctx: ServiceContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    from loom_services.placement import service as placement

    first = await leading_service(ctx)
    small = Resources(gpus=1, cpu_milli=4_000)
    jobs = [("big-1", BIG), ("small-1", small), ("big-2", BIG), ("small-2", small)]
    assert all(a is None for a in await first.on_submitted(submissions(jobs)))
    big, one_gpu = WorkerShape(8, 8_000, 700 * 1024), WorkerShape(1, 4_000, 0)
    monkeypatch.setattr(placement, "SEEN_PAGE_ROWS", 1)
    await first.load()  # pages of one row: every job read, none twice
    assert first.book.seen.counts == {big: 2, one_gpu: 2}
    monkeypatch.setattr(placement, "SEEN_PAGES", 2)
    await first.load()  # two pages: the two latest only
    assert first.book.seen.counts == {big: 1, one_gpu: 1}
    assert len(first.book.seen) == 2
