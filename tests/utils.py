"""Small helpers shared by tests."""

from __future__ import annotations

import asyncio
import subprocess
import time
from contextlib import contextmanager
from typing import Awaitable, Callable, Iterator

from infermesh.processes import nats_server_binary
from shared.ports import wait_for_port  # (re-exported for tests)


@contextmanager
def nats_server(port: int, args: list[str]) -> Iterator[str]:
    """A nats-server (``args``: its flags or ``-c <config>``) listening on ``port`` of loopback; its URL."""
    proc = subprocess.Popen([nats_server_binary(), *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_for_port(port, 10), "nats-server did not start"
        yield f"nats://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


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
