"""/v1/files through an in-process edge with the official openai SDK: upload, list, retrieve, content, delete, as
OpenAI's Files API; another team sees none of it; bad purposes, oversized and garbage uploads are refused with
OpenAI's errors and leave nothing in the store; and the same on a locked bus, without one refusal."""

from __future__ import annotations

import io
import json
import os

import httpx
import openai
import pytest
import pytest_asyncio

from infermesh.bus_roles import Role
from infermesh.local import LocalMesh
from shared.files import ensure_files_bucket
from tests.locked_nats import LockedNats

pytestmark = [pytest.mark.e2e]
KEY, SALES_KEY = "research-key", "sales-key"
MAX_FILE_BYTES = 600 << 10  # a small limit, so an oversized upload is cheap
CHAT_BYTES = 64 << 10  # the chat body limit, smaller still: uploads have their own
LINES = b"".join(json.dumps({"custom_id": f"r-{i}", "method": "POST", "url": "/v1/chat/completions",
                             "body": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}}).encode()
                 + b"\n" for i in range(3))


@pytest_asyncio.fixture
async def mesh(nats_url, namespace):
    mesh = LocalMesh(nats_url, namespace, dev_key=KEY)
    await mesh.start_edge(api_keys=f"{SALES_KEY}:sales", max_file_bytes=MAX_FILE_BYTES, max_body_bytes=CHAT_BYTES)
    yield mesh
    await mesh.stop()


def client(mesh: LocalMesh, key: str = KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=mesh.base_url, api_key=key, max_retries=0)


async def stored_messages(mesh: LocalMesh) -> int:
    """Chunks and infos in the files' stream (made on the edge's first files request), the teams' usage records
    (shared/file_ledger.py) left out."""
    bus = mesh.edge.mesh.bus
    await ensure_files_bucket(bus)
    prefix = f"$O.{bus.subjects.files_bucket}."
    info = await bus.js.stream_info(f"OBJ_{bus.subjects.files_bucket}", subjects_filter=f"{prefix}>")
    return sum(n for subject, n in (info.state.subjects or {}).items() if not subject.startswith(f"{prefix}C.usage."))


async def test_a_team_uploads_lists_retrieves_reads_and_deletes_a_batch_file(mesh):
    research = client(mesh)
    file = await research.files.create(file=("requests.jsonl", io.BytesIO(LINES)), purpose="batch")
    assert file.id.startswith("file-") and file.object == "file" and file.purpose == "batch"
    assert (file.bytes, file.filename, file.status) == (len(LINES), "requests.jsonl", "processed")
    assert await research.files.retrieve(file.id) == file
    assert (await research.files.content(file.id)).read() == LINES
    second = await research.files.create(file=("more.jsonl", LINES * 2), purpose="batch")
    page = await research.files.list()
    assert [f.id for f in page.data] == [second.id, file.id] and not page.has_more
    assert [f.id for f in (await research.files.list(order="asc", limit=1)).data] == [file.id]
    assert [f.id async for f in research.files.list(limit=1)] == [second.id, file.id]  # the SDK pages by ``after``
    assert (await research.files.list(purpose="batch_output")).data == []
    deleted = await research.files.delete(file.id)
    assert (deleted.id, deleted.object, deleted.deleted) == (file.id, "file", True)
    with pytest.raises(openai.NotFoundError):
        await research.files.retrieve(file.id)
    assert [f.id for f in (await research.files.list()).data] == [second.id]


async def test_a_file_of_several_chunks_and_past_the_chat_body_limit_comes_back_byte_for_byte(mesh):
    research = client(mesh)
    data = (LINES * 6000)[:MAX_FILE_BYTES - 1000]  # five stored chunks, nine times the chat limit
    file = await research.files.create(file=("big.jsonl", data), purpose="batch")
    assert file.bytes == len(data) and (await research.files.content(file.id)).read() == data


async def test_another_team_sees_404_and_an_empty_list_and_a_stranger_401(mesh):
    file = await client(mesh).files.create(file=("requests.jsonl", LINES), purpose="batch")
    sales = client(mesh, SALES_KEY)
    for call in (sales.files.retrieve, sales.files.content, sales.files.delete):
        with pytest.raises(openai.NotFoundError) as refused:
            await call(file.id)
        assert refused.value.body["param"] == "id" and file.id in refused.value.body["message"]
    assert (await sales.files.list()).data == []
    with pytest.raises(openai.NotFoundError):
        await client(mesh).files.retrieve("file-" + "0" * 24)
    stranger = client(mesh, "not-a-key")
    with pytest.raises(openai.AuthenticationError):
        await stranger.files.list()
    with pytest.raises(openai.AuthenticationError):
        await stranger.files.create(file=("requests.jsonl", LINES), purpose="batch")
    assert (await client(mesh).files.retrieve(file.id)).id == file.id  # still there


async def test_a_purpose_other_than_batch_is_400_naming_purpose_and_nothing_is_kept(mesh):
    research = client(mesh)
    before = await stored_messages(mesh)
    for purpose in ("fine-tune", "batch_output"):
        with pytest.raises(openai.BadRequestError) as refused:
            await research.files.create(file=("requests.jsonl", LINES), purpose=purpose)  # type: ignore[arg-type]
        assert refused.value.body["param"] == "purpose"
    with pytest.raises(openai.BadRequestError) as empty:
        await research.files.create(file=("empty.jsonl", b""), purpose="batch")
    assert empty.value.body["param"] == "file"
    with pytest.raises(openai.BadRequestError) as binary:
        await research.files.create(file=("bad.jsonl", b"\xff\xfe not utf-8\n"), purpose="batch")
    assert binary.value.body["param"] == "file"
    assert await stored_messages(mesh) == before and (await research.files.list()).data == []


@pytest.mark.parametrize("query, param", [("limit=0", "limit"), ("limit=10001", "limit"), ("limit=x", "limit"),
                                          ("order=newest", "order")])
async def test_bad_list_parameters_are_400_naming_them(mesh, query, param):
    async with httpx.AsyncClient(base_url=mesh.base_url, headers={"authorization": f"Bearer {KEY}"}) as http:
        reply = await http.get(f"/files?{query}")
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param


async def test_an_oversized_upload_is_413_declared_or_streamed_and_leaves_no_chunk(mesh):
    research = client(mesh)
    before = await stored_messages(mesh)
    with pytest.raises(openai.APIStatusError) as declared:  # Content-Length over the limit: refused unread
        await research.files.create(file=("big.jsonl", b"x" * (MAX_FILE_BYTES + 1)), purpose="batch")
    assert declared.value.status_code == 413

    async def chunked():  # no Content-Length: refused once the file passes the limit
        yield b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        yield b'--b\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n\r\n'
        for _ in range(MAX_FILE_BYTES // (64 << 10) + 2):
            yield os.urandom(32 << 10).hex().encode()

    headers = {"authorization": f"Bearer {KEY}", "content-type": "multipart/form-data; boundary=b"}
    async with httpx.AsyncClient(base_url=mesh.base_url, headers=headers) as http:
        try:
            reply = await http.post("/files", content=chunked())
            assert reply.status_code == 413 and reply.json()["error"]["code"] == "file_too_large"
        except httpx.RemoteProtocolError:  # the edge may close while the client still sends
            pass
    assert await stored_messages(mesh) == before and (await research.files.list()).data == []


@pytest.mark.parametrize("content_type, body", [
    ("multipart/form-data; boundary=xyz", b"garbage, not a form"),
    ("multipart/form-data", b"--xyz\r\n"),  # no boundary
    ("application/json", b'{"purpose": "batch"}'),
    ("multipart/form-data; boundary=xyz",  # a form without its end
     b'--xyz\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
     b'--xyz\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n{}\n'),
    ("multipart/form-data; boundary=xyz",  # no file
     b'--xyz\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--xyz--\r\n'),
])
async def test_a_body_that_is_not_a_whole_upload_form_is_400(mesh, content_type, body):
    headers = {"authorization": f"Bearer {KEY}", "content-type": content_type}
    async with httpx.AsyncClient(base_url=mesh.base_url, headers=headers) as http:
        reply = await http.post("/files", content=body)
    assert reply.status_code == 400, reply.text
    assert set(reply.json()["error"]) == {"message", "type", "param", "code"}
    assert (await client(mesh).files.list()).data == []


# ---------------------------------------------------------------- a locked bus


async def test_on_a_locked_bus_the_edge_serves_files_without_a_refusal(tmp_path, namespace):
    locked = LockedNats(tmp_path / "nats", namespace).start()
    mesh = LocalMesh(locked.url, namespace, dev_key=KEY,
                     credentials={role.value: locked.credentials(role) for role in Role})
    try:
        await locked.provision()
        await mesh.start_edge(max_file_bytes=MAX_FILE_BYTES)
        research = client(mesh)
        file = await research.files.create(file=("requests.jsonl", LINES * 1000), purpose="batch")
        assert (await research.files.content(file.id)).read() == LINES * 1000
        assert [f.id for f in (await research.files.list()).data] == [file.id]
        assert (await research.files.delete(file.id)).deleted
        # what files traffic could be refused: JetStream API calls, object subjects, inbox subscriptions (other
        # edge features have their own locked-bus tests)
        assert [v for v in locked.violations() if any(s in v for s in ("$JS", "$O.", "_INBOX", "files"))] == []
    finally:
        await mesh.stop()
        locked.stop()


async def test_a_team_past_its_storage_quota_gets_a_400_naming_it_and_another_team_still_uploads(nats_url, namespace):
    mesh = LocalMesh(nats_url, namespace, dev_key=KEY)
    await mesh.start_edge(api_keys=f"{SALES_KEY}:sales", team_file_bytes=1000, team_files=2)
    try:
        research, line = client(mesh), b'{"custom_id": "a"}\n'
        first = await research.files.create(file=("a.jsonl", line * 30), purpose="batch")
        with pytest.raises(openai.BadRequestError) as refused:  # 30 + 30 lines > 1000 bytes
            await research.files.create(file=("b.jsonl", line * 30), purpose="batch")
        error = refused.value.body
        assert (error["code"], error["param"], error["type"]) == ("storage_quota_exceeded", "file",
                                                                 "invalid_request_error")
        assert "of its 1000 bytes" in error["message"] and "DELETE /v1/files" in error["message"]
        await client(mesh, SALES_KEY).files.create(file=("theirs.jsonl", line * 30), purpose="batch")
        await research.files.delete(first.id)
        await research.files.create(file=("b.jsonl", line * 30), purpose="batch")
    finally:
        await mesh.stop()
