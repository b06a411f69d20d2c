"""Small helpers shared by tests."""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable

from shared.ports import wait_for_port  # noqa: F401  (re-exported for tests)


async def eventually(check: Callable[[], bool | Awaitable[bool]], timeout_s: float, interval_s: float = 0.05) -> float:
    """Wait until ``check()`` is true; return the seconds it took. Fails the test on timeout."""
    start = time.monotonic()
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return time.monotonic() - start
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"condition not met within {timeout_s}s")
        await asyncio.sleep(interval_s)
