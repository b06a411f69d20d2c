"""Read deadlines that blame the client for its own slowness, never for the edge's.

A ``call_later`` timer measures wall time. When the edge's event loop is held up (a GC pause, a
CPU-starved host, a blocking call) past a deadline, the timer and the client's bytes that arrived
meanwhile become due in the same loop turn, and asyncio runs timers before the callbacks that the
bytes' arrival schedules: the client is told 408 for headers or a body it sent on time (seen in CI:
a loop stalled for 30 s answered a waiting OpenAI client with "The request headers did not arrive
within 30 s"). So a deadline that fires late by more than ``STALL_S`` counts as the loop's stall and
grants ``GRACE_S`` more, in which whatever the client did send is read; a client that really is slow
still gets its 408, a grace later. A slowloris gains time only while the edge itself stalls.
"""

from __future__ import annotations

import asyncio
from typing import Callable

STALL_S = 0.5  # a timer this much later than its due time was held up by the loop, not by the client
GRACE_S = 1.0  # then the client gets this long, with the loop running, before the deadline holds


class PatientDeadline:
    """``callback`` runs ``delay_s`` after arming, unless cancelled; a late firing (a stalled loop) defers it."""

    def __init__(self, loop: asyncio.AbstractEventLoop, delay_s: float, callback: Callable[[], None]) -> None:
        self._loop = loop
        self._callback = callback
        self._handle: asyncio.TimerHandle | None = None
        self.deferrals = 0  # how often a stall deferred it (for tests and logs)
        self._arm(delay_s)

    def _arm(self, delay_s: float) -> None:
        self._due = self._loop.time() + delay_s
        self._handle = self._loop.call_at(self._due, self._fire)

    def _fire(self) -> None:
        if self._loop.time() - self._due > STALL_S:
            self.deferrals += 1
            self._arm(GRACE_S)
            return
        self._handle = None
        self._callback()

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    @property
    def armed(self) -> bool:
        return self._handle is not None
