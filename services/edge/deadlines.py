"""Read deadlines that blame the client for its own slowness, never for the edge's.

A ``call_later`` timer measures wall time. When the edge's event loop is held up (a GC pause, a
CPU-starved host, a blocking call) past a deadline, the timer and the client's bytes that arrived
meanwhile become due in the same loop turn, and asyncio runs timers before the callbacks that the
bytes' arrival schedules: the client is told 408 for headers or a body it sent on time (seen in CI:
a loop stalled for 30 s answered a waiting OpenAI client with "The request headers did not arrive
within 30 s"). So a deadline counts only the time the loop was running: a ``LoopStalls`` ticker per
loop (every ``TICK_S``) records each stretch the loop was held up by more than ``STALL_S``, and a
deadline that comes due after such a stall in its window is pushed back by the time lost, and to at
least ``GRACE_S`` after the stall ended, in which whatever the client did send is read. A deadline
due just after a long stall ended counts too (the loop held up from just after the deadline was armed
until just past its due time: a late firing of a few hundred ms, which alone looks punctual). A
client that really is slow still gets its 408; a slowloris gains time only while the edge stalls.
"""

from __future__ import annotations

import asyncio
import weakref
from collections import deque
from typing import Callable

STALL_S = 0.5  # a timer this much later than its due time was held up by the loop, not by the client
GRACE_S = 1.0  # then the client gets this long, with the loop running, before the deadline holds
TICK_S = 0.1  # how often the stall ticker looks
KEEP_S = 600.0  # stalls older than this are forgotten (longer than any read deadline)


class LoopStalls:
    """The stretches (start, end) one loop was held up by more than STALL_S, as a ticker saw them."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.stalls: deque[tuple[float, float]] = deque()
        self._due = loop.time() + TICK_S
        loop.call_at(self._due, self._tick)

    def _tick(self) -> None:
        now = self._loop.time()
        self._note(now)
        while self.stalls and self.stalls[0][1] < now - KEEP_S:
            self.stalls.popleft()
        self._due = now + TICK_S
        if not self._loop.is_closed():
            self._loop.call_at(self._due, self._tick)

    def _note(self, now: float) -> None:
        if now - self._due <= STALL_S:
            return
        if self.stalls and self.stalls[-1][0] == self._due:  # the same stall, seen again later in its turn
            self.stalls[-1] = (self._due, now)
        else:
            self.stalls.append((self._due, now))

    def lost(self, since: float) -> tuple[float, float]:
        """Seconds the loop was held up since ``since`` (a stall still going on included), and when the last
        such stall ended (0.0: none)."""
        self._note(self._loop.time())  # a stall that ends in this very turn: the ticker has not run yet
        lost, last_end = 0.0, 0.0
        for start, end in self.stalls:
            if end > since:
                lost += end - max(start, since)
                last_end = end
        return lost, last_end


_stalls: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopStalls]" = weakref.WeakKeyDictionary()


def loop_stalls(loop: asyncio.AbstractEventLoop) -> LoopStalls:
    tracker = _stalls.get(loop)
    if tracker is None:
        tracker = _stalls[loop] = LoopStalls(loop)
    return tracker


class PatientDeadline:
    """``callback`` runs ``delay_s`` of running loop after arming, unless cancelled: time the loop was held up
    (``LoopStalls``) does not count, and after a stall the client gets at least ``GRACE_S`` more."""

    def __init__(self, loop: asyncio.AbstractEventLoop, delay_s: float, callback: Callable[[], None]) -> None:
        self._loop = loop
        self._callback = callback
        self._stalls = loop_stalls(loop)
        self._armed_at = loop.time()
        self._delay_s = delay_s
        self._handle: asyncio.TimerHandle | None = None
        self.deferrals = 0  # how often a stall deferred it (for tests and logs)
        self._arm(delay_s)

    def _arm(self, delay_s: float) -> None:
        self._due = self._loop.time() + delay_s
        self._handle = self._loop.call_at(self._due, self._fire)

    def _fire(self) -> None:
        now = self._loop.time()
        lost, last_end = self._stalls.lost(self._armed_at)
        due = max(self._armed_at + self._delay_s + lost, last_end + GRACE_S if last_end else 0.0)
        if due > now + 0.001:
            self.deferrals += 1
            self._arm(due - now)
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
