"""services/admission/leader.py: a leader's tenure is timed from before its write was sent, on a fake clock.

The review (finding 11): the leader set its renewal time when the write's acknowledgement came back. The server
starts the key's TTL when it stores the write, which can be long before a slow ack returns: the old leader then
believed itself leader past the key's expiry, while a standby had taken over (two leaders granting at once)."""

from __future__ import annotations

import pytest

from services.admission import leader as leader_module
from services.admission.leader import TERM_HEADER, Leadership, Tenure


@pytest.mark.parametrize("sent_at, now, valid", [
    (None, 0.0, False),  # no write of ours landed
    (10.0, 10.0, True),
    (10.0, 11.99, True),  # ttl 3: 2 s of tenure
    (10.0, 12.0, False),
    (10.0, 20.0, False),
])
def test_tenure_runs_two_thirds_of_the_ttl_from_the_write_sent(sent_at, now, valid):
    tenure = Tenure(3.0)
    if sent_at is not None:
        tenure.renewed(sent_at)
    assert tenure.valid(now) is valid


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class SlowAckedKey:
    """The leader key in memory: each write lands at once, its acknowledgement comes back ``ack_s`` later."""

    def __init__(self, clock: FakeClock, ack_s: float) -> None:
        self.clock, self.ack_s, self.revision, self.term = clock, ack_s, 0, None

    async def cas_put(self, _bus, _bucket, _key, _value, _revision, _ttl, headers) -> int:
        self.revision += 1
        self.term = headers[TERM_HEADER]
        self.clock.now += self.ack_s  # the ack is slow: the key's TTL is running meanwhile
        return self.revision

    async def get_last(self, _bus, _bucket, _key):
        return (None, self.revision, {}) if self.term is None else (b"a", self.revision, {TERM_HEADER: self.term})


async def _nothing() -> None:
    return None


@pytest.mark.parametrize("step", ["campaign", "renewal"])
async def test_a_slow_acknowledgement_does_not_lengthen_the_tenure(monkeypatch, step):
    clock = FakeClock()
    key = SlowAckedKey(clock, ack_s=1.5)
    monkeypatch.setattr(leader_module, "cas_put", key.cas_put)
    monkeypatch.setattr(leader_module, "get_last_with_headers", key.get_last)
    leadership = Leadership(None, "b", "a", 3.0, _nothing, _nothing, clock=clock)  # type: ignore[arg-type]
    await leadership._campaign()
    if step == "renewal":
        await leadership._renew()
    assert leadership.is_leader
    sent_at = clock.now - 1.5  # the last write was sent before its slow ack
    clock.now = sent_at + 2.0 - 0.01
    assert leadership.still_leader()
    clock.now = sent_at + 2.0  # the server's TTL (3 s from at least sent_at) leaves no renewal period's margin
    assert not leadership.still_leader()
