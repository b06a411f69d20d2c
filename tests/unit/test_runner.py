"""A dying service process must not wait forever for a task that swallows its cancellation."""

from __future__ import annotations

import asyncio
import time

from shared.runner import _cancel_leftovers


def test_leftover_tasks_are_cancelled_with_a_bound():
    loop = asyncio.new_event_loop()
    survived = []

    async def stubborn() -> None:  # like a reconnect loop that catches CancelledError
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                survived.append(True)

    async def polite() -> None:
        await asyncio.sleep(3600)

    stubborn_task = loop.create_task(stubborn())
    polite_task = loop.create_task(polite())
    loop.run_until_complete(asyncio.sleep(0))
    start = time.monotonic()
    _cancel_leftovers(loop, timeout_s=0.3)
    assert time.monotonic() - start < 2
    assert polite_task.cancelled() and survived and not stubborn_task.done()
    loop.close()
