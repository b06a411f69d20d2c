"""The files of /v1/files in the ``<ns>_files`` object store (shared/files.py), on a real nats-server; and on a
locked bus, the edge's part of it and nobody else's."""

from __future__ import annotations

import os

import nats
import pytest
import pytest_asyncio

from infermesh.bus_roles import Role
from shared.bus import Bus
from shared.files import CHUNK_BYTES, FileNotFound, FileStore, FileTooLarge, ensure_files_bucket, is_file_id
from tests.locked_nats import LockedNats

pytestmark = [pytest.mark.integration]
LINES = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'


@pytest_asyncio.fixture
async def bus(nats_url, namespace):
    bus = await Bus.connect(nats_url, namespace, "files-test")
    await ensure_files_bucket(bus)
    yield bus
    await bus.close()


@pytest_asyncio.fixture
async def store(bus):
    return await FileStore.open(bus)


async def stored_kinds(store: FileStore) -> set[str]:
    """What the bucket's stream holds, by kind: "M" (an info), "C" (a chunk), "C.usage.<team>", "C.index..."."""
    prefix = f"$O.{store.bucket}."
    info = await store.bus.js.stream_info(store.stream, subjects_filter=f"{prefix}>")
    kinds = set()
    for subject in info.state.subjects or {}:
        kind, _, rest = subject.removeprefix(prefix).partition(".")
        named = rest.startswith(("usage.", "index."))
        kinds.add(f"{kind}.{rest}" if named else kind)
    return kinds


async def test_a_put_file_reads_back_as_openai_describes_it_with_its_bytes(store):
    file = await store.put("research", "batch", "in.jsonl", LINES)
    assert is_file_id(file.id) and file.object == "file" and file.status == "processed"
    assert (file.bytes, file.filename, file.purpose, file.expires_at) == (len(LINES), "in.jsonl", "batch", None)
    assert await store.get("research", file.id) == file
    assert await store.content("research", file.id) == LINES


async def test_a_file_of_several_chunks_round_trips_and_nats_own_object_store_reads_it(store, bus):
    data = os.urandom(3 * CHUNK_BYTES + 1234)
    file = await store.put("research", "batch_output", "out.jsonl", data)
    assert await store.content("research", file.id) == data
    chunks = [len(c) async for c in store.chunks("research", file.id)]
    assert chunks == [CHUNK_BYTES] * 3 + [1234]
    native = await (await bus.js.object_store(bus.subjects.files_bucket)).get(file.id)  # checks the digest too
    assert native.data == data and native.info.headers["Infermesh-Team"] == ["research"]


async def test_an_upload_written_in_odd_pieces_is_the_same_file(store):
    data = os.urandom(CHUNK_BYTES * 2 + 7)
    writer = store.writer("research", "pieces.jsonl")
    for start in range(0, len(data), 50_000):
        await writer.write(data[start:start + 50_000])
    file = await writer.finish("batch")
    assert file.bytes == len(data) and await store.content("research", file.id) == data


async def test_another_teams_file_an_unknown_id_and_a_deleted_file_are_all_not_found(store):
    file = await store.put("research", "batch", "in.jsonl", LINES)
    for team, file_id in (("sales", file.id), ("research", "file-" + "0" * 24), ("research", "nonsense")):
        with pytest.raises(FileNotFound):
            await store.get(team, file_id)
    with pytest.raises(FileNotFound):
        await store.delete("sales", file.id)
    with pytest.raises(FileNotFound):
        await store.content("sales", file.id)
    assert (await store.delete("research", file.id)).deleted
    for call in (store.get, store.content, store.delete):
        with pytest.raises(FileNotFound):
            await call("research", file.id)
    assert (await store.list("research")).data == []
    # the deleted info and the team's usage record: its chunks and index entry were purged
    assert await stored_kinds(store) == {"M", "C.usage.research"}


async def test_a_listing_is_the_teams_own_newest_first_filtered_and_paged_by_id(store):
    assert (await store.list("research")).data == []
    ours = [await store.put("research", "batch", f"{i}.jsonl", LINES) for i in range(5)]
    await store.put("sales", "batch", "theirs.jsonl", LINES)
    output = await store.put("research", "batch_output", "out.jsonl", LINES)
    everything = await store.list("research")
    assert [f.id for f in everything.data] == [f.id for f in reversed([*ours, output])]
    assert not everything.has_more and everything.first_id == output.id and everything.last_id == ours[0].id
    page = await store.list("research", purpose="batch", limit=2)
    assert [f.id for f in page.data] == [ours[4].id, ours[3].id] and page.has_more
    rest = await store.list("research", purpose="batch", limit=2, after=page.last_id)
    assert [f.id for f in rest.data] == [ours[2].id, ours[1].id] and rest.has_more
    oldest = await store.list("research", purpose="batch", order="asc", limit=10, after=ours[2].id)
    assert [f.id for f in oldest.data] == [ours[3].id, ours[4].id] and not oldest.has_more
    assert [f.filename for f in (await store.list("sales")).data] == ["theirs.jsonl"]


async def test_a_file_past_the_limit_is_refused_and_leaves_no_chunk_behind(bus):
    store = FileStore(bus, max_bytes=CHUNK_BYTES + 10)
    with pytest.raises(FileTooLarge):
        await store.put("research", "batch", "big.jsonl", b"x" * (CHUNK_BYTES + 11))
    writer = store.writer("research", "big.jsonl")
    await writer.write(b"x" * CHUNK_BYTES)  # one chunk published
    with pytest.raises(FileTooLarge):
        await writer.write(b"x" * 11)
    await writer.abort()
    assert await stored_kinds(store) <= {"C.usage.research"}  # no chunk, no info
    assert (await store.ledger.usage("research")).holds == {}
    assert (await store.list("research")).data == []


# ---------------------------------------------------------------- a locked bus


@pytest_asyncio.fixture
async def locked(tmp_path, namespace):
    server = LockedNats(tmp_path / "nats", namespace).start()
    try:
        await server.provision()  # makes <ns>_files too
        yield server
    finally:
        server.stop()


async def test_on_a_locked_bus_the_edge_uploads_lists_reads_and_deletes_files_without_a_refusal(locked):
    edge = await locked.bus(Role.EDGE)
    try:
        store = await FileStore.open(edge)
        file = await store.put("research", "batch", "in.jsonl", LINES * 3000)  # two chunks
        assert await store.content("research", file.id) == LINES * 3000
        assert [f.id for f in (await store.list("research")).data] == [file.id]
        await store.delete("research", file.id)
        assert (await store.list("research")).data == []
        assert locked.violations() == []
        # the purge it needs is of the files' stream alone
        subject = f"$JS.API.STREAM.PURGE.KV_{edge.subjects.api_keys_bucket}"
        with pytest.raises(nats.errors.TimeoutError):
            await edge.nc.request(subject, b"{}", timeout=0.3)
        await locked.wait_for_violation(f'Subject "{subject}"')
    finally:
        await edge.close()


@pytest.mark.parametrize("role", [Role.WORKER, Role.ROUTER, Role.METERING, Role.ADMIN])
async def test_on_a_locked_bus_no_other_role_writes_or_purges_files(locked, role):
    bus = await locked.bus(role)
    try:
        s = bus.subjects
        subject = f"$O.{s.files_bucket}.M.forged"
        with pytest.raises(nats.errors.TimeoutError):
            await bus.js.publish(subject, b"{}", timeout=0.3)
        await locked.wait_for_violation(f'Subject "{subject}"')
        purge = f"$JS.API.STREAM.PURGE.OBJ_{s.files_bucket}"
        with pytest.raises(nats.errors.TimeoutError):
            await bus.nc.request(purge, b"{}", timeout=0.3)
        await locked.wait_for_violation(f'Subject "{purge}"')
    finally:
        await bus.close()
