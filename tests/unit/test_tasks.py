"""cancel_and_wait stops a task whose cancel Python 3.11's wait_for lost (the race that hung a CI teardown)."""

from __future__ import annotations

import asyncio
import sys

import pytest

from shared.tasks import cancel_and_wait


async def _loop_with_a_lost_cancel(inner: asyncio.Future[int], laps: list[int]) -> None:
    """A service loop: each lap awaits a reply under wait_for, as nats-py's requests do."""
    while True:
        laps.append(await asyncio.wait_for(inner, 10) if not laps else 0)
        await asyncio.sleep(0.01)


# Justified skip: the lost cancel is Python 3.11's own race (the venv runs 3.11, so CI runs this test);
# on 3.12+ wait_for cannot lose it, and the helper's other tests still run there
@pytest.mark.skipif(sys.version_info >= (3, 12), reason="the race is 3.11's: 3.12 rebuilt wait_for on asyncio.timeout")
async def test_wait_for_loses_a_cancel_that_lands_as_its_future_completes():
    inner: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    laps: list[int] = []
    task = asyncio.create_task(_loop_with_a_lost_cancel(inner, laps))
    await asyncio.sleep(0)
    inner.set_result(1)
    task.cancel()  # lands together with the reply: wait_for returns it instead of raising
    done, _ = await asyncio.wait({task}, timeout=0.3)
    assert not done and len(laps) > 1  # cancel() + gather() would wait here forever
    await cancel_and_wait(task, recancel_s=0.05)
    assert task.cancelled()


async def test_cancel_and_wait_cancels_again_until_the_task_is_done():
    swallowed = 0

    async def stubborn() -> None:
        nonlocal swallowed
        while swallowed < 2:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                swallowed += 1  # lost, as in wait_for's race
        await asyncio.sleep(10)

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_and_wait(task, recancel_s=0.05), 2)
    assert task.cancelled() and swallowed == 2


async def test_exceptions_are_retrieved_and_finished_tasks_and_none_are_fine():
    async def fails() -> None:
        raise ValueError("boom")

    failed = asyncio.create_task(fails())
    await asyncio.sleep(0)
    finished = asyncio.create_task(asyncio.sleep(0))
    await finished
    await cancel_and_wait(failed, finished, None)  # no raise
    assert isinstance(failed.exception(), ValueError)
