"""A request whose client leaves while it waits in admission's queue (services/edge/admission.py; issue 38, also
noted): the grant that still comes is released at once, not held (unrenewed) until it lapses. Pure: admission's
answer is a future the test resolves, as a fake bus gives it."""

from __future__ import annotations

import asyncio

from services.edge.admission import AdmissionClient
from shared.schema import LeaseGranted, LeaseRejected, LeaseRelease


class Queued:
    """``bus.request`` answering when the test says (the request waits in admission's queue); publishes kept."""

    def __init__(self) -> None:
        self.subjects = type("S", (), {"admission_acquire": "ns.admission.acquire",
                                       "admission_release": "ns.admission.release"})()
        self.answer: asyncio.Future = asyncio.get_running_loop().create_future()
        self.asked = asyncio.Event()
        self.published: list[tuple[str, object]] = []

    async def request(self, subject, message, reply_type, timeout):
        self.asked.set()
        return await asyncio.shield(self.answer)  # admission answers whether or not anyone still listens

    async def publish(self, subject, message):
        self.published.append((subject, message))


async def left_while_queued(answer) -> tuple[AdmissionClient, Queued]:
    bus = Queued()
    admission = AdmissionClient(bus, "edge-1")  # type: ignore[arg-type]
    request = asyncio.create_task(admission.acquire("t", "interactive", "m", 10, 10, wait_s=10.0))
    await bus.asked.wait()
    request.cancel()  # the client left
    await asyncio.gather(request, return_exceptions=True)
    bus.answer.set_result(answer)  # admission's answer comes after all
    await asyncio.gather(*admission._background, return_exceptions=True)  # the ask, then a release it published
    await asyncio.gather(*admission._background, return_exceptions=True)
    return admission, bus


async def test_a_lease_granted_after_its_request_left_is_released_at_once():
    admission, bus = await left_while_queued(LeaseGranted("l-late", 10.0))
    assert bus.published == [("ns.admission.release", LeaseRelease("l-late"))] and admission.held == set()


async def test_a_refusal_after_its_request_left_releases_nothing():
    admission, bus = await left_while_queued(LeaseRejected("queue_timeout", "no room", 1.0))
    assert bus.published == [] and admission.held == set()


async def test_a_request_that_stays_gets_its_lease():
    bus = Queued()
    admission = AdmissionClient(bus, "edge-1")  # type: ignore[arg-type]
    request = asyncio.create_task(admission.acquire("t", "interactive", "m", 10, 10, wait_s=10.0))
    await bus.asked.wait()
    bus.answer.set_result(LeaseGranted("l-1", 10.0))
    assert await request == "l-1" and admission.held == {"l-1"} and bus.published == []
