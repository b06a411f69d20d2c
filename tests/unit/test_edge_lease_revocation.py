"""The edge's side of a revoked batch lease (services/edge/admission.py, api.py), pure: who is told, when, and
what a revoked request's events do. No bus: the client's handlers are called as the bus would call them."""

from __future__ import annotations

import asyncio

import pytest

from services.edge.admission import EARLY_REVOCATIONS, AdmissionClient
from services.edge.api import _Bill, _until_revoked
from services.edge.keys import Caller
from shared import errors
from shared.schema import LeaseRevoked


def client() -> AdmissionClient:
    admission = AdmissionClient(None, "edge-1")  # type: ignore[arg-type]  (watch and revocations touch no bus)
    admission.held.update({"l1", "l2"})
    return admission


async def test_a_watched_lease_is_told_once():
    admission, told = client(), []
    admission.watch("l1", lambda: told.append("l1"))
    await admission._on_revoked(LeaseRevoked("l1"), None)
    await admission._on_revoked(LeaseRevoked("l1"), None)  # again, from a renewal's reply: no second call
    assert told == ["l1"]


async def test_a_revocation_that_crossed_the_grant_is_kept_for_its_watch():
    admission, told = client(), []
    await admission._on_revoked(LeaseRevoked("l2"), None)  # before its request watched it
    admission.watch("l2", lambda: told.append("l2"))
    assert told == ["l2"]


async def test_a_released_lease_is_not_told_and_early_revocations_stay_bounded():
    admission, told = client(), []
    admission.watch("l1", lambda: told.append("l1"))
    admission._watchers.pop("l1")  # its request ended (release() also publishes: not here, with no bus)
    for i in range(EARLY_REVOCATIONS + 10):
        await admission._on_revoked(LeaseRevoked(f"gone-{i}"), None)  # leases that ended before their revocation
    assert told == [] and len(admission._early) == EARLY_REVOCATIONS
    assert "gone-0" not in admission._early and f"gone-{EARLY_REVOCATIONS + 9}" in admission._early


def bill() -> _Bill:
    return _Bill("r1", Caller("team", "sk-1"), "m", 0.0, None, asyncio.get_running_loop().create_future(),
                 lambda: None, "")


async def test_events_end_in_429_preempted_once_the_revoked_run_settled():
    closed, settled_at = [], []
    the_bill = bill()

    async def events():
        try:
            yield "a"
            await asyncio.Event().wait()  # a long generation
        finally:
            closed.append(True)  # the run winds up (its worker aborts); it settles a moment later
            asyncio.get_running_loop().call_later(0.05, lambda: (settled_at.append(1), the_bill.settle(None)))

    revoked = asyncio.get_running_loop().create_future()
    out = _until_revoked(events(), revoked, the_bill, 5.0)
    assert await out.__anext__() == "a"
    revoked.set_result(None)
    with pytest.raises(errors.ApiError) as caught:
        await out.__anext__()
    assert caught.value.status == 429 and caught.value.code == "preempted"
    assert closed == [True] and settled_at == [1] and the_bill.preempted  # raised only after it settled


async def test_events_that_end_first_are_not_preempted():
    the_bill = bill()

    async def events():
        yield "a"
        yield "b"

    revoked = asyncio.get_running_loop().create_future()
    got = [item async for item in _until_revoked(events(), revoked, the_bill, 5.0)]
    revoked.set_result(None)  # too late: the request ended
    assert got == ["a", "b"] and not the_bill.preempted
