"""The edge's prep processes: each one its own process and pipe, so one job can be given to one process and a
process running past its job's deadline can be killed alone (a ``ProcessPoolExecutor`` can do neither: one
death breaks every job of the pool).

A process takes pickled jobs from its pipe one at a time and answers each; it starts from a fork server that
imported the edge's modules once, runs at a lower priority than the event loop, and loads the tokenizers it is
told to preload before its first job (a replacement starts warm). The blocking pipe I/O runs in a thread per busy
process, never on the event loop.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
from multiprocessing.connection import Connection
from typing import Callable, Sequence

log = logging.getLogger("infermesh.edge")
WORKER_NICENESS = 10
JOIN_TIMEOUT_S = 5.0


class WorkerDied(Exception):
    """The process ended (killed, out of memory, past its deadline) before answering."""


WorkerMain = Callable[[Connection, Sequence[str]], None]  # (its end of the pipe, tokenizer paths to preload)


def serve_jobs(conn: Connection, handle: Callable[[bytes], bytes]) -> None:
    """A prep process's loop: each job read from ``conn`` is answered with ``handle``'s reply."""
    os.nice(WORKER_NICENESS)  # on a busy machine the event loop (every stream) gets the core first
    while True:
        try:
            payload = conn.recv_bytes()
        except (EOFError, OSError):  # the edge closed its end: nothing more to do
            return
        conn.send_bytes(handle(payload))


def context() -> multiprocessing.context.BaseContext:
    """Processes fork from a fresh single-threaded server that imported all they need once (never from the
    edge itself: forking a process with threads is unsafe), so a new one starts in a moment."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["services.edge.prep", "transformers.models.auto.tokenization_auto",
                                "transformers.tokenization_utils_fast"])
    return ctx


class WorkerProcess:
    """One prep process and the edge's end of its pipe. ``call`` blocks: run it in a thread."""

    def __init__(self, index: int, main: WorkerMain, preload: Sequence[str]) -> None:
        ctx = context()
        parent, child = ctx.Pipe()
        self.index = index
        self.process = ctx.Process(target=main, args=(child, tuple(preload)), name=f"infermesh-prep-{index}",
                                   daemon=True)
        self.process.start()
        child.close()  # only the process holds its end now: its death is EOF here
        self._conn = parent

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def call(self, payload: bytes) -> bytes:
        try:
            self._conn.send_bytes(payload)
            return self._conn.recv_bytes()
        except (EOFError, OSError) as exc:
            raise WorkerDied(f"prep process {self.index} (pid {self.pid}) died") from exc

    def kill(self) -> None:
        """End it now (a thread blocked in ``call`` then raises WorkerDied)."""
        if self.process.is_alive():
            self.process.kill()

    def close(self) -> None:
        """Kill, reap and release it (blocks up to JOIN_TIMEOUT_S: run it in a thread)."""
        self.kill()
        self.process.join(JOIN_TIMEOUT_S)
        self._conn.close()
