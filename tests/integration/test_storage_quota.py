"""One team cannot exhaust storage (issue 38.2), on a real nats-server whose ``max_file_store`` is what
``infermesh up`` writes (shared/storage_caps.py): per-team file quotas, exact under concurrent uploads from two
edges; the files store full at its own cap while usage publishes and lease writes go on; per-team listings."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
import pytest_asyncio

from shared.bus import Bus
from shared.file_quota import FileQuota, QuotaExceeded
from shared.files import FileStore, ensure_files_bucket, is_store_full
from shared.kv_cas import cas_put, ensure_bucket
from shared.ports import free_port
from shared.storage_caps import ENV, max_file_store, store_caps
from shared.usage import ensure_usage_stream
from tests.utils import nats_server

pytestmark = [pytest.mark.integration]
MiB = 1 << 20
BUDGET = 16 * MiB  # the smallest namespace budget: the files store's cap is 8 MiB
QUOTA = FileQuota(max_bytes=3 * MiB, max_files=4)


@pytest.fixture
def capped_nats(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A nats-server with the max_file_store ``up`` gives it for one namespace of BUDGET bytes."""
    monkeypatch.setenv(ENV, str(BUDGET))
    port = free_port()
    config = tmp_path / "nats.json"
    config.write_text(json.dumps({"listen": f"127.0.0.1:{port}", "jetstream": {
        "store_dir": str(tmp_path / "store"), "max_file_store": max_file_store()}}))
    with nats_server(port, ["-c", str(config)]) as url:
        yield url


@pytest_asyncio.fixture
async def edges(capped_nats, namespace):
    """Two edges' buses and stores over one files bucket."""
    buses = [await Bus.connect(capped_nats, namespace, f"edge-{i}") for i in range(2)]
    await ensure_files_bucket(buses[0])
    yield [FileStore(bus, max_bytes=4 * MiB, quota=QUOTA) for bus in buses]
    for bus in buses:
        await bus.close()


async def test_a_team_at_its_quota_is_refused_another_team_is_not_and_a_delete_frees_room(edges):
    store = edges[0]
    kept = await store.put("research", "batch", "a.jsonl", os.urandom(2 * MiB))
    await store.put("research", "batch", "b.jsonl", os.urandom(MiB))
    with pytest.raises(QuotaExceeded) as refused:
        await store.put("research", "batch", "c.jsonl", b"one byte too many")
    assert (refused.value.kind, refused.value.used, refused.value.limit) == ("bytes", 3 * MiB, 3 * MiB)
    assert len((await store.list("research")).data) == 2  # the refused upload left nothing
    await store.put("sales", "batch", "theirs.jsonl", os.urandom(2 * MiB))  # another team's room is its own
    await store.delete("research", kept.id)
    await store.put("research", "batch", "c.jsonl", os.urandom(2 * MiB))
    usage = await store.ledger.usage("research")
    assert (usage.used_bytes(), usage.used_files(), usage.holds) == (3 * MiB, 2, {})


async def test_concurrent_uploads_on_two_edges_never_pass_the_file_count(edges):
    async def upload(i: int) -> bool:
        try:
            await edges[i % 2].put("research", "batch", f"{i}.jsonl", b"line\n")
            return True
        except QuotaExceeded:
            return False

    stored = await asyncio.gather(*(upload(i) for i in range(10)))
    assert sum(stored) == QUOTA.max_files
    assert len((await edges[1].list("research")).data) == QUOTA.max_files
    assert (await edges[0].ledger.usage("research")).used_files() == QUOTA.max_files


async def test_the_files_store_full_at_its_cap_leaves_usage_and_leases_their_room(edges):
    bus = edges[0].bus
    await ensure_usage_stream(bus)
    await ensure_bucket(bus, bus.subjects.leases_bucket)
    with pytest.raises(Exception) as full:  # teams within their quotas, together past the store's 8 MiB
        for team in ("t1", "t2", "t3", "t4"):
            await edges[0].put(team, "batch", "fill.jsonl", os.urandom(3 * MiB - 4096))
    assert is_store_full(full.value), full.value
    info = await bus.js.stream_info(edges[0].stream)
    assert info.config.max_bytes == store_caps().files and info.state.bytes <= store_caps().files
    revision = 0
    for i in range(50):  # billing and admission still write
        await bus.js.publish(bus.subjects.usage, b'{"usage": %d}' % i)
        revision = await cas_put(bus, bus.subjects.leases_bucket, "lease-1", b"held", revision)
    assert (await bus.js.stream_info(bus.subjects.usage_stream)).state.messages == 50
    assert [f.filename for f in (await edges[1].list("t1")).data] == ["fill.jsonl"]  # a full store still lists,
    await edges[1].delete("t1", (await edges[1].list("t1")).data[0].id)  # deletes, and takes uploads again
    await edges[1].put("t1", "batch", "small.jsonl", b"line\n")


async def test_a_listing_reads_the_teams_index_not_every_teams_files(edges, monkeypatch):
    store = edges[0]
    for team in ("research", "sales", "ops"):
        await store.put(team, "batch", f"{team}.jsonl", b"line\n")

    async def every_file():
        raise AssertionError("a listing read every team's files")

    monkeypatch.setattr(store, "_all", every_file)
    assert [f.filename for f in (await store.list("research")).data] == ["research.jsonl"]


async def test_a_bucket_from_before_the_index_is_indexed_and_counted_per_team_on_first_sight(capped_nats, namespace):
    bus = await Bus.connect(capped_nats, namespace, "old-edge")
    try:
        await bus.js.create_object_store(bus.subjects.files_bucket)  # as the old code made it: no layout metadata
        old = FileStore(bus, quota=QUOTA)
        files = [await old.put("research", "batch", f"{i}.jsonl", b"line\n" * (i + 1)) for i in range(2)]
        await old.put("sales", "batch", "theirs.jsonl", b"line\n")
        await bus.js.purge_stream(old.stream, subject=f"$O.{old.bucket}.C.usage.>")  # what the old code never wrote
        await bus.js.purge_stream(old.stream, subject=f"$O.{old.bucket}.C.index.>")
        store = FileStore(bus, quota=QUOTA)
        assert [f.id for f in (await store.list("research", order="asc")).data] == [f.id for f in files]
        usage = await store.ledger.usage("research")
        assert usage.files == {f.id: f.bytes for f in files}
    finally:
        await bus.close()
