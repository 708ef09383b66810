"""Ending tasks for certain (loom.tasks.cancel_and_wait) and stops that keep the caller's cancellation."""

import asyncio
from typing import Any

import pytest

from loom.bus.consumer import ConsumerRunner, ConsumerSpec, stop_runners
from loom.tasks import cancel_and_wait


async def _forever() -> None:
    await asyncio.Event().wait()


async def _swallows_first_cancel(swallowed: list[int]) -> None:
    """A loop that loses one cancellation (as a ``wait_for`` completing in Python 3.11 does)."""
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        swallowed.append(1)
    await asyncio.Event().wait()  # its next round of work: it never ends by itself


async def test_a_task_that_lost_its_cancel_is_cancelled_again() -> None:
    swallowed: list[int] = []
    lossy = asyncio.create_task(_swallows_first_cancel(swallowed))
    plain = asyncio.create_task(_forever())
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_and_wait([lossy, plain], grace_s=0.01), timeout=10)
    assert swallowed == [1]
    assert lossy.cancelled() and plain.cancelled()


async def test_the_tasks_own_ends_are_retrieved_not_raised() -> None:
    async def fails() -> None:
        raise RuntimeError("its own error")

    done = asyncio.create_task(asyncio.sleep(0, result=3))
    failed = asyncio.create_task(fails())
    await asyncio.sleep(0.01)
    running = asyncio.create_task(_forever())
    await cancel_and_wait([done, failed, running])  # no error: a task's end is not the stopper's
    assert done.result() == 3
    assert isinstance(failed.exception(), RuntimeError)
    assert running.cancelled()


async def test_a_cancelled_caller_stays_cancelled() -> None:
    swallowed: list[int] = []
    lossy = asyncio.create_task(_swallows_first_cancel(swallowed))
    await asyncio.sleep(0)
    stopper = asyncio.create_task(cancel_and_wait([lossy], grace_s=60))
    await asyncio.sleep(0.01)
    stopper.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stopper
    assert swallowed == [1]  # it was cancelled once before the caller's own cancel
    await cancel_and_wait([lossy], grace_s=0.01)


class _FakeNats:
    def jetstream(self, **_: Any) -> Any:
        return object()


def _runner() -> ConsumerRunner[Any]:
    async def handler(_: Any) -> None:
        return None

    return ConsumerRunner(
        _FakeNats(),  # type: ignore[arg-type]
        ConsumerSpec(stream="S", durable="d", filter_subjects=["s.>"]),
        bytes,
        handler=handler,
    )


async def test_a_consumer_stop_cancelled_by_its_caller_ends_the_loop_and_stays_cancelled() -> None:
    """``ConsumerRunner.stop`` waits for the batch in hand; a caller cancelled meanwhile (a stop
    under a timeout: a handler hung on the bus) ends the loop there and then, and stays cancelled
    (it used to swallow the cancel)."""
    runner = _runner()
    loop = asyncio.create_task(_forever())  # a batch that never ends
    runner._task = loop
    stopper = asyncio.create_task(runner.stop())
    await asyncio.sleep(0.01)
    stopper.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stopper
    assert loop.cancelled()


async def test_stopping_runners_together_is_not_cut_short_by_a_cancel() -> None:
    runners = [_runner(), _runner()]
    finished: list[int] = []

    async def batch(runner: ConsumerRunner[Any], i: int) -> None:
        await runner._stopping.wait()
        await asyncio.sleep(0.05)  # the batch in hand
        finished.append(i)

    for i, runner in enumerate(runners):
        runner._task = asyncio.create_task(batch(runner, i))
    stopper = asyncio.create_task(stop_runners(runners))
    await asyncio.sleep(0.01)
    stopper.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stopper
    await asyncio.wait_for(asyncio.gather(*(r._task for r in runners if r._task is not None)), timeout=10)
    assert sorted(finished) == [0, 1]  # both finished their batch: the stops went on, shielded
