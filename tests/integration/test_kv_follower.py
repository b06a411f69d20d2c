"""shared/kv_follower.py on real NATS, alone and inside each view built on it (api keys, breakers, registry, edges):
the snapshot at start, puts, deletes / purges / TTL lapses, nothing applied once ``stop()`` is called (even in
the middle of a burst), and the same view again within seconds of a NATS restart."""

from __future__ import annotations

import asyncio
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest

from infermesh.processes import nats_server_binary
from services.edge.keys import KeyDirectory
from shared import schema
from shared.breakers import BreakerView
from shared.bus import Bus
from shared.edges import EdgeDirectory
from shared.kv_cas import cas_put, ensure_bucket
from shared.kv_follower import KvFollower
from shared.ports import free_port
from shared.registry import WorkerDirectory
from shared.schema import ApiKeyRecord, BreakerRecord, EdgeInfo, WorkerInfo
from shared.subjects import Subjects
from tests.utils import eventually, wait_for_port

pytestmark = pytest.mark.integration


def _text_follower(bus: Bus) -> KvFollower[str]:
    return KvFollower(bus, f"{bus.subjects.namespace}_plain", "plain", lambda _key, data: data.decode())


@dataclass(frozen=True)
class View:
    """One user of the follower, as these tests drive it: its bucket, how to build it, a value, the dict it keeps."""

    name: str
    bucket: Callable[[Subjects], str]
    make: Callable[[Bus], Any]
    encode: Callable[[str], bytes]
    held: Callable[[Any], dict]


VIEWS = [
    View("follower", lambda s: f"{s.namespace}_plain", _text_follower, lambda key: key.encode(), lambda v: v.values),
    View("api keys", lambda s: s.api_keys_bucket, lambda bus: KeyDirectory(bus, {}),
         lambda key: schema.encode(ApiKeyRecord(key[:8], "t")), lambda v: v.keys),
    View("breakers", lambda s: s.breakers_bucket, BreakerView,
         lambda key: schema.encode(BreakerRecord(key, "open", 1.0, "error_rate")), lambda v: v.records),
    View("registry", lambda s: s.workers_bucket, WorkerDirectory,
         lambda key: schema.encode(WorkerInfo(key, "both", "m", "sim", 16, 100, 1024, "/tok", ts=time.time())),
         lambda v: v.workers),
    View("edges", lambda s: s.edges_bucket, EdgeDirectory, lambda key: schema.encode(EdgeInfo(key, 1.0)),
         lambda v: v.edges),
]


async def test_a_follower_starts_with_every_key_in_the_bucket_then_follows_puts_deletes_purges_and_lapses(
        writer, reader):
    bucket = f"{writer.subjects.namespace}_plain"
    kv = await ensure_bucket(writer, bucket)
    await kv.put("a", b"1")
    await kv.put("b", b"2")
    await kv.put("gone", b"x")
    await kv.delete("gone")  # its delete marker is in the snapshot: never delivered as a key
    follower = _text_follower(reader)
    puts: list[tuple[str, str]] = []
    deletes: list[str] = []
    follower.on_put.append(lambda key, value, _revision: puts.append((key, value)))
    follower.on_delete.append(deletes.append)
    await follower.start()
    assert follower.values == {"a": "1", "b": "2"} and sorted(puts) == [("a", "1"), ("b", "2")] and deletes == []

    await kv.put("a", b"1'")
    await kv.put("c", b"3")
    await kv.delete("b")
    await kv.purge("c")
    await cas_put(writer, bucket, "ttl", b"4", 0, ttl_s=1)  # no heartbeat: the server expires it
    await eventually(lambda: deletes == ["b", "c", "ttl"], 5)
    assert follower.values == {"a": "1'"}
    assert puts[2:] == [("a", "1'"), ("c", "3"), ("ttl", "4")]
    await follower.stop()


async def test_an_undecodable_value_keeps_the_old_one_and_a_failing_callback_stops_nothing(writer, reader):
    bucket = f"{writer.subjects.namespace}_json"
    kv = await ensure_bucket(writer, bucket)
    follower = KvFollower(reader, bucket, "json", lambda _key, data: schema.decode(data, ApiKeyRecord))

    def explode(key: str, _value: object, _revision: int) -> None:
        if key == "boom":
            raise RuntimeError("a callback's bug")

    follower.on_put.append(explode)
    await follower.start()
    await kv.put("k", schema.encode(ApiKeyRecord("p", "t")))
    await kv.put("k", b"not msgpack of a record")
    await kv.put("boom", schema.encode(ApiKeyRecord("b", "t")))
    await kv.put("after", schema.encode(ApiKeyRecord("q", "t")))
    await eventually(lambda: "after" in follower.values, 5)
    assert follower.values["k"] == ApiKeyRecord("p", "t") and "boom" in follower.values
    await follower.stop()


@pytest.mark.parametrize("view", VIEWS, ids=[v.name for v in VIEWS])
async def test_nothing_is_applied_once_stop_is_called_even_in_the_middle_of_a_burst(writer, reader, view,
                                                                                       monkeypatch):
    """Python 3.11's ``wait_for`` swallows a cancel that lands just as its get completes: a follower stopped that
    way went on applying its queued updates (up to 255) while and after it stopped."""
    # 6,000 records: more than a bucket's share of the suite's small store budget (tests/conftest.py) holds
    monkeypatch.setenv("INFERMESH_STORE_BYTES", str(1 << 30))
    bucket = view.bucket(writer.subjects)
    await ensure_bucket(writer, bucket)
    for trial in range(3):
        followed = view.make(reader)
        await followed.start()
        held = view.held(followed)
        already = len(held)
        for i in range(2000):  # fire and forget: updates arrive in batches and queue up in the watcher
            await writer.nc.publish(f"$KV.{bucket}.k{trial}-{i}", view.encode(f"k{trial}-{i}"))
        await writer.nc.flush()
        await eventually(lambda held=held, already=already: len(held) > already, 5, 0)
        at_stop = len(held)
        await followed.stop()
        assert len(held) == at_stop, f"trial {trial}: {len(held) - at_stop} updates applied after stop()"
        await asyncio.sleep(0.2)
        assert len(held) == at_stop, f"trial {trial}: {len(held) - at_stop} updates applied after stop() returned"


class RestartableNats:
    """A nats-server of this test's own, with JetStream on disk: it can be killed and started again."""

    def __init__(self, store: Path) -> None:
        self.port = free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self._store = store
        self._proc: subprocess.Popen | None = None

    def start(self) -> None:
        self._proc = subprocess.Popen([nats_server_binary(), "-js", "-a", "127.0.0.1", "-p", str(self.port),
                                       "-sd", str(self._store)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        assert wait_for_port(self.port, 10), "nats-server did not start"

    def kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(10)


@pytest.fixture
async def own_nats(tmp_path, monkeypatch):
    for name in ("INFERMESH_NATS_USER", "INFERMESH_NATS_PASSWORD", "INFERMESH_NATS_CREDS"):
        monkeypatch.delenv(name, raising=False)  # a server of its own, without credentials
    server = RestartableNats(tmp_path / "js")
    server.start()
    yield server
    server.kill()


async def _retried(call: Callable[[], Any], timeout_s: float = 10) -> Any:
    """A call right after a restart: JetStream may still be recovering its streams."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await call()
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


@pytest.mark.parametrize("view", VIEWS, ids=[v.name for v in VIEWS])
async def test_a_view_is_current_within_seconds_of_a_nats_restart(own_nats, namespace, view):
    """nats-py's own watcher resumes only after missed heartbeats (about 20 s) and by stream sequence, so a key
    that lapsed meanwhile, its expiry marker gone after 10 s, never left the view."""
    writer = await Bus.connect(own_nats.url, namespace, "writer")
    reader = await Bus.connect(own_nats.url, namespace, "reader")
    bucket = view.bucket(writer.subjects)
    kv = await ensure_bucket(writer, bucket)
    followed = view.make(reader)
    try:
        await kv.put("kept", view.encode("kept"))
        await kv.put("revoked", view.encode("revoked"))
        await cas_put(writer, bucket, "lapses", view.encode("lapses"), 0, ttl_s=2)
        await followed.start()
        held = view.held(followed)
        assert set(held) == {"kept", "revoked", "lapses"}
        reconnected = [asyncio.Event(), asyncio.Event()]
        writer.on_reconnected.append(reconnected[0].set)
        reader.on_reconnected.append(reconnected[1].set)
        own_nats.kill()
        own_nats.start()
        await asyncio.wait_for(asyncio.gather(*(event.wait() for event in reconnected)), 10)
        kv = await _retried(lambda: ensure_bucket(writer, bucket))
        await _retried(lambda: kv.put("new", view.encode("new")))
        await _retried(lambda: kv.delete("revoked"))
        await eventually(lambda: set(held) == {"kept", "new"}, 5)  # nats-py alone: about 20 s, and "lapses" stays
    finally:
        await followed.stop()
        await writer.close()
        await reader.close()
