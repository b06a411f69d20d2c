"""The edge's lease request (services/edge/admission.py), pure: admission's answers as a fake bus gives them.
A leader that is moving or cannot record a lease is asked again until the deadline; a full pool is not."""

from __future__ import annotations

import pytest

from services.edge.admission import ASK_EVERY_S, AdmissionClient
from shared import errors
from shared.bus import BusError
from shared.schema import LeaseGranted, LeaseRejected


class Answers:
    """``bus.request`` answering from a list, one per call."""

    def __init__(self, *replies) -> None:
        self.replies, self.asked = list(replies), 0
        self.subjects = type("S", (), {"admission_acquire": "ns.admission.acquire"})()

    async def request(self, subject, message, reply_type, timeout):
        self.asked += 1
        return self.replies.pop(0)


@pytest.mark.parametrize("code", ["admission_moved", "admission_unavailable"])
async def test_admissions_own_moment_is_asked_again(code):
    bus = Answers(LeaseRejected(code, "again", 0.01), LeaseGranted("l-1", 10.0))
    admission = AdmissionClient(bus, "edge-1")  # type: ignore[arg-type]
    assert await admission.acquire("t", "interactive", "m", 10, 10, wait_s=0.0) == "l-1"
    assert bus.asked == 2 and admission.held == {"l-1"}


async def test_a_full_pool_is_not_asked_again():
    bus = Answers(LeaseRejected("queue_full", "full", 1.0), LeaseGranted("l-1", 10.0))
    admission = AdmissionClient(bus, "edge-1")  # type: ignore[arg-type]
    with pytest.raises(errors.PoolFull):
        await admission.acquire("t", "interactive", "m", 10, 10, wait_s=0.0)
    assert bus.asked == 1


class Lost(Answers):
    """The first ask is lost (its leader died with it): a timeout; then the replies as given."""

    def __init__(self, *replies) -> None:
        super().__init__(*replies)
        self.requests, self.timeouts = [], []

    async def request(self, subject, message, reply_type, timeout):
        self.requests.append(message)
        self.timeouts.append(timeout)
        if len(self.requests) == 1:
            raise BusError(f"timeout after {timeout}s on {subject}")
        return await super().request(subject, message, reply_type, timeout)


async def test_an_unanswered_ask_is_asked_again_soon_with_the_same_ticket():
    """A queued request used to wait its whole wait (12 s) for a leader that had died with its ask."""
    bus = Lost(LeaseGranted("t-1", 10.0))
    admission = AdmissionClient(bus, "edge-1")  # type: ignore[arg-type]
    assert await admission.acquire("t", "interactive", "m", 10, 10, wait_s=10.0) == "t-1"
    first, again = bus.requests
    assert first.ticket == again.ticket  # the same request, so admission never counts it twice
    assert max(bus.timeouts) <= ASK_EVERY_S < 10.0
