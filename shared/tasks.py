"""Stopping tasks for sure.

On Python 3.11 ``asyncio.wait_for`` loses a cancel that lands just as the awaited future completes (it
returns the result instead of raising). nats-py's requests and fetches run under ``wait_for``, so a
service loop cancelled by its ``stop()`` at that moment runs on, and ``cancel(); await gather(task)``
waits for it forever (seen in CI: an admission leadership loop held a mesh's teardown for 300 s and left
its metering running into the next test). ``cancel_and_wait`` cancels again until the task is done.
"""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger(__name__)

RECANCEL_S = 2.0


async def cancel_and_wait(*tasks: asyncio.Future[object] | None, recancel_s: float = RECANCEL_S) -> None:
    """Cancel every task and wait until each is done, cancelling again any still running after
    ``recancel_s`` (its cancel was lost). The tasks' own exceptions are retrieved, not raised."""
    pending = {task for task in tasks if task is not None}
    for task in pending:
        task.cancel()
    while pending:
        done, pending = await asyncio.wait(pending, timeout=recancel_s)
        for task in done:
            if not task.cancelled():
                task.exception()  # retrieved: a stop does not log "exception was never retrieved"
        for task in pending:
            name = task.get_name() if isinstance(task, asyncio.Task) else repr(task)
            log.warning("task %s still runs %.1f s after its cancel: cancelling it again", name, recancel_s)
            task.cancel()
