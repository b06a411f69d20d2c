"""Notices that one AsyncLLM's engine core died, without polling.

An engine core dies two ways, and either resolves the same ``died()``:

    process gone (SIGKILL, OOM killer, segfault, SIGILL)   a pidfd per engine core process, read by the event
                                                           loop: readable the moment the process exits
    a step raised inside it (vLLM sends ENGINE_CORE_DEAD)  ``generate`` sees vLLM's EngineDeadError (vLLM
                                                           fails every request it has) and calls ``dead``

vLLM notices the first case itself too (MPClientEngineMonitor, a thread waiting on the process sentinels): it
marks the client dead and shuts it down, which fails the running requests with EngineDeadError, but nothing
tells an idle server. Our own pidfds (not vLLM's sentinels, which its shutdown closes) tell it at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from services.worker.engines.base import EngineDead

log = logging.getLogger("infermesh.worker.vllm")


class CoreWatch:
    """The death of one AsyncLLM's engine core processes; ``close`` before shutting the AsyncLLM down."""

    def __init__(self, llm: Any) -> None:
        self._loop = asyncio.get_running_loop()
        self._dead: asyncio.Future[str] = self._loop.create_future()
        self._fds: list[int] = []
        for proc in core_processes(llm):
            fd = os.pidfd_open(proc.pid)
            self._fds.append(fd)
            self._loop.add_reader(fd, self._exited, fd, proc)
        if not self._fds:
            log.warning("no engine core process to watch (in-process engine core?): only a failing request "
                        "shows that the engine died")

    @property
    def is_dead(self) -> bool:
        return self._dead.done()

    async def died(self) -> str:
        return await asyncio.shield(self._dead)

    def dead(self, reason: str) -> EngineDead:
        """The engine is dead for ``reason`` (the first reason given wins); the error to raise in a request."""
        if not self._dead.done():
            log.error("vLLM engine died: %s", reason)
            self._dead.set_result(reason)
        return EngineDead(f"the engine died: {self._dead.result()}")

    def close(self) -> None:
        for fd in self._fds:
            self._loop.remove_reader(fd)
            os.close(fd)
        self._fds.clear()

    def _exited(self, fd: int, proc: Any) -> None:
        self._loop.remove_reader(fd)
        os.close(fd)
        self._fds.remove(fd)
        code = proc.exitcode  # None when vLLM's monitor thread reaped it first
        how = "" if code is None else f" (killed by signal {-code})" if code < 0 else f" (exit code {code})"
        self.dead(f"engine core process {proc.pid} ({proc.name}) exited{how}")


def core_processes(llm: Any) -> list[Any]:
    """The engine core processes of an AsyncLLM (multiprocessing.Process objects); [] when it runs in-process."""
    resources = getattr(getattr(llm, "engine_core", None), "resources", None)
    manager = getattr(resources, "engine_manager", None)
    return list(getattr(manager, "processes", None) or [])
