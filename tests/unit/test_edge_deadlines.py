"""Read deadlines do not count the edge's own loop stalls against the client (services/edge/deadlines.py).

Real event loops, stalled on purpose with ``time.sleep``; the stalls are what is tested, not a wait."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.edge import deadlines
from services.edge.deadlines import PatientDeadline
from services.edge.http import BodyLimits, read_body
from shared import errors
from tests.utils import eventually


async def test_a_deadline_fires_on_time_when_the_loop_runs():
    loop = asyncio.get_running_loop()
    fired, armed_at = asyncio.Event(), loop.time()
    deadline = PatientDeadline(loop, 0.05, fired.set)
    await asyncio.wait_for(fired.wait(), 5)
    assert not deadline.armed
    # deferred only if this (shared, loaded) machine really held the loop up meanwhile (CI once did)
    stalled = [stall for stall in deadlines.loop_stalls(loop).stalls if stall[1] > armed_at]
    assert deadline.deferrals == 0 or stalled, deadline.deferrals


async def test_a_deadline_that_fires_late_waits_a_grace_then_holds():
    fired: list[float] = []
    deadline = PatientDeadline(asyncio.get_running_loop(), 0.01, lambda: fired.append(time.monotonic()))
    time.sleep(deadlines.STALL_S + 0.3)  # the loop held up well past the due time
    resumed = time.monotonic()
    await eventually(lambda: deadline.deferrals == 1, 5, 0.001)
    assert fired == [] and deadline.armed  # the late firing was the loop's fault: deferred
    await eventually(lambda: fired, deadlines.GRACE_S + 5)
    assert fired[0] - resumed >= deadlines.GRACE_S * 0.9  # a grace with the loop running, then it holds


async def test_a_stall_that_began_before_the_due_time_does_not_count_against_the_client():
    """The loop is held up from just after arming until just past the due time: the timer fires only a little
    late (less than STALL_S, which alone looks punctual), but the client had no running loop for its bytes."""
    fired: list[float] = []
    deadlines.loop_stalls(asyncio.get_running_loop())  # the ticker runs (an edge arms deadlines all the time)
    await asyncio.sleep(deadlines.TICK_S * 2)
    deadline = PatientDeadline(asyncio.get_running_loop(), 1.0, lambda: fired.append(time.monotonic()))
    time.sleep(1.0 + deadlines.STALL_S / 2)  # due 1.0 s after arming: fires ~0.25 s late
    resumed = time.monotonic()
    await eventually(lambda: deadline.deferrals >= 1, 5, 0.001)
    assert fired == [] and deadline.armed
    await eventually(lambda: fired, deadlines.GRACE_S + 5)
    assert fired[0] - resumed >= deadlines.GRACE_S * 0.9


async def test_a_cancelled_deadline_never_fires():
    fired: list[bool] = []
    deadline = PatientDeadline(asyncio.get_running_loop(), 0.01, lambda: fired.append(True))
    deadline.cancel()
    other = asyncio.Event()
    PatientDeadline(asyncio.get_running_loop(), 0.05, other.set)
    await asyncio.wait_for(other.wait(), 5)  # a later deadline fired: the cancelled one had its turn
    assert fired == [] and not deadline.armed


def _body_arriving_after_a_stall(stall_s: float, body: bytes):
    """A receive() whose body arrives as I/O does: the loop stalls, then the bytes are handed over a
    loop turn later than the timers that came due during the stall (asyncio runs due timers first)."""

    async def receive() -> dict:
        loop = asyncio.get_running_loop()
        time.sleep(stall_s)
        arrived = loop.create_future()
        loop.call_soon(lambda: loop.call_soon(arrived.set_result, None))
        await arrived
        return {"type": "http.request", "body": body, "more_body": False}

    return receive


async def test_a_body_sent_in_time_across_a_loop_stall_is_read_not_408():
    limits = BodyLimits(max_bytes=1 << 10, timeout_s=0.2)
    body = await read_body(_body_arriving_after_a_stall(0.2 + deadlines.STALL_S + 0.3, b"{}"), limits)
    assert body == b"{}"


async def test_a_body_that_never_comes_is_still_408():
    async def never() -> dict:
        await asyncio.Event().wait()
        return {}

    with pytest.raises(errors.ApiError) as caught:
        await read_body(never, BodyLimits(max_bytes=1 << 10, timeout_s=0.1))
    assert caught.value.status == 408


class _FakeLoop:
    def __init__(self) -> None:
        self.now, self.tick = 0.0, None

    def time(self) -> float:
        return self.now

    def call_at(self, _when: float, callback) -> None:
        self.tick = callback

    def is_closed(self) -> bool:
        return False


def test_loop_stalls_counts_each_stall_once_however_often_it_is_asked():
    loop = _FakeLoop()
    stalls = deadlines.LoopStalls(loop)  # type: ignore[arg-type]  (ticks due every TICK_S from 0)
    loop.now = 3.0  # held up since the first tick was due (0.1)
    assert stalls.lost(0.0) == pytest.approx((2.9, 3.0))
    loop.now = 3.2  # later in the same turn, before the ticker ran: the same stall, longer
    assert stalls.lost(0.0) == pytest.approx((3.1, 3.2)) and len(stalls.stalls) == 1
    loop.tick()  # the ticker runs at last: still one stall; next tick due at 3.3
    loop.now = 3.35
    assert stalls.lost(0.0) == pytest.approx((3.1, 3.2))
    assert stalls.lost(2.0) == pytest.approx((1.2, 3.2))  # only the part since 2.0
    loop.now = 3.3 + deadlines.STALL_S / 2  # a tick late by less than STALL_S is no stall
    loop.tick()
    loop.now += deadlines.TICK_S + 1.0  # a second stall of 1 s
    assert stalls.lost(0.0) == pytest.approx((4.1, loop.now)) and len(stalls.stalls) == 2
