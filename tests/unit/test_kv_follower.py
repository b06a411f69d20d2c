"""shared/kv_follower.py without NATS: what a snapshot changes (KeyRevisions), and a follower watching afresh after
a reconnect, on fake watchers (the real bucket, restart included, is tests/integration/test_kv_follower.py)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from shared.kv_follower import KeyRevisions, KvFollower


@pytest.mark.parametrize("held, snapshot, news, gone", [
    ({}, [("a", 1, b"x")], ["a"], []),
    ({"a": (1, b"x")}, [("a", 1, b"x")], [], []),  # a snapshot repeating what is held is no news
    ({"a": (1, b"x")}, [("a", 5, b"y")], ["a"], []),
    ({"a": (1, b"x")}, [("a", 1, b"y")], ["a"], []),  # a store wiped and written again: same revision, new bytes
    ({"a": (1, b"x"), "b": (2, b"y")}, [("b", 2, b"y")], [], ["a"]),  # a went while nobody watched
    ({"a": (1, b"x")}, [], [], ["a"]),
])
def test_a_snapshot_reports_new_values_and_the_keys_it_lacks(held, snapshot, news, gone):
    revisions = KeyRevisions()
    for key, (revision, data) in held.items():
        revisions.put(key, revision, data)
    revisions.begin_snapshot()
    assert [key for key, revision, data in snapshot if revisions.put(key, revision, data)] == news
    assert revisions.end_snapshot() == gone
    assert all(key not in revisions for key in gone)


def test_a_delete_during_a_snapshot_is_not_reported_again_as_gone():
    revisions = KeyRevisions()
    revisions.put("a", 1, b"x")
    revisions.begin_snapshot()
    assert revisions.delete("a") and not revisions.delete("a")
    assert revisions.end_snapshot() == []


def test_live_puts_and_deletes_outside_a_snapshot():
    revisions = KeyRevisions()
    assert revisions.put("a", 1, b"x") and revisions.put("a", 2, b"y")
    assert revisions.delete("a") and "a" not in revisions
    assert revisions.end_snapshot() == []  # none begun: nothing gone


@dataclass
class Entry:
    key: str
    value: bytes
    revision: int
    operation: str | None = None
    delta: int | None = None  # the server's count of entries still to come (None: not told)


class FakeWatcher:
    """nats-py's KeyWatcher as the follower uses it: an async iterator of entries (None: snapshot done), stop()."""

    def __init__(self, *entries: Entry | None) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        for entry in entries:
            self.queue.put_nowait(entry)

    async def stop(self) -> None:
        self.queue.put_nowait(StopAsyncIteration)

    def __aiter__(self):
        return self

    async def __anext__(self):
        entry = await self.queue.get()
        if entry is StopAsyncIteration:
            raise StopAsyncIteration
        return entry


async def test_after_a_reconnect_the_follower_watches_afresh_and_drops_the_keys_gone_meanwhile():
    bus = SimpleNamespace(on_reconnected=[])
    first = FakeWatcher(Entry("a", b"1", 1), Entry("b", b"2", 2), None)
    second = FakeWatcher(Entry("b", b"2", 2), Entry("c", b"3", 7), None)  # a lapsed while NATS restarted
    watchers = iter([first, second])
    follower = KvFollower(bus, "bucket", "test", lambda _key, data: data.decode())  # type: ignore[arg-type]

    async def fake_watch():
        return next(watchers)

    follower._watch_bucket = fake_watch  # type: ignore[method-assign]
    events: list[tuple] = []
    follower.on_put.append(lambda key, value, revision: events.append(("put", key, value)))
    follower.on_delete.append(lambda key: events.append(("delete", key)))
    await follower.start(1)
    assert follower.values == {"a": "1", "b": "2"} and bus.on_reconnected == [follower._on_reconnected]

    events.clear()
    bus.on_reconnected[0]()  # what Bus calls once nats-py reconnected
    for _ in range(20):
        await asyncio.sleep(0)
    assert events == [("put", "c", "3"), ("delete", "a")]  # b was unchanged: not delivered again
    assert follower.values == {"b": "2", "c": "3"} and follower.rewatches == 1

    await follower.stop()
    second.queue.put_nowait(Entry("d", b"4", 8))  # nothing is delivered once stopped
    await asyncio.sleep(0)
    assert "d" not in follower.values and bus.on_reconnected == []
