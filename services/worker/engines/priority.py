"""Engine processes yield the CPU to the mesh's control plane.

An engine's compute (vLLM's EngineCore, NIXL's busy-polling UCX threads) will use every cycle it is
given; NATS, the heartbeat and the services' event loops need a few milliseconds at a time but need
them now. On a 2-core machine two vLLM engines with NIXL starved nats-server until every JetStream
call timed out and a decoder "left the mesh" mid-stream. So engine processes run at a lower
priority (a higher nice value): they still get every idle cycle, the control plane runs first.

    spawned = SpawnedProcesses()          # before the engine starts its processes
    ... AsyncLLM.from_engine_args(...)
    spawned.renice(10)                    # those processes (and theirs), never the others of this process
    spawned.pin(core)                     # and on the engine's own core, every thread of them

Linux keeps a nice value per thread, and a new thread inherits its creator's: every thread of each
engine process is reniced, and threads those threads start later inherit the value. Only processes
that appeared since ``SpawnedProcesses`` was made are touched: a worker run inside another program
(a test runner that also started nats-server) must not renice that program's other children.
"""

from __future__ import annotations

import logging
import os
from typing import Callable

import psutil

log = logging.getLogger(__name__)


class SpawnedProcesses:
    """The child processes this process starts from now on (and their descendants)."""

    def __init__(self) -> None:
        self._before = {p.pid for p in psutil.Process().children(recursive=True)}
        self._engine: set[int] = set()

    def processes(self) -> list[psutil.Process]:
        """Children that appeared since construction, and every descendant of those (also later ones)."""
        found = []
        for child in psutil.Process().children(recursive=True):
            if child.pid in self._engine or child.pid not in self._before:
                self._engine.add(child.pid)
                found.append(child)
        return found

    def renice(self, nice: int) -> int:
        """Give every thread of those processes at least ``nice``; returns how many threads changed."""
        def lower(thread_id: int) -> bool:
            if os.getpriority(os.PRIO_PROCESS, thread_id) >= nice:
                return False
            os.setpriority(os.PRIO_PROCESS, thread_id, nice)
            return True

        changed = self._each_thread(lower)
        if changed:
            log.info("engine processes reniced to %d (%d threads)", nice, changed)
        return changed

    def pin(self, core: int) -> int:
        """Bind every thread of those processes to ``core``; returns how many threads changed. vLLM CPU binds only
        its compute threads (``VLLM_CPU_OMP_THREADS_BIND``); its engine core's scheduler busy-polls the model
        runner and, unbound, takes most of another core (the one the mesh's services run on; measured by
        loadtests/peers.py). Threads started later inherit their creator's binding."""
        def bind(thread_id: int) -> bool:
            if os.sched_getaffinity(thread_id) == {core}:
                return False
            os.sched_setaffinity(thread_id, {core})
            return True

        changed = self._each_thread(bind)
        if changed:
            log.info("engine processes bound to core %d (%d threads)", core, changed)
        return changed

    def _each_thread(self, change: Callable[[int], bool]) -> int:
        """``change`` every thread of those processes (by thread id); how many it changed. A thread or process
        gone meanwhile is skipped."""
        changed = 0
        for process in self.processes():
            try:
                threads = process.threads()
            except psutil.Error:
                continue  # gone already
            for thread in threads:
                try:
                    changed += change(thread.id)
                except (ProcessLookupError, PermissionError):
                    continue
        return changed
