"""The edge's real HTTP server against hostile clients: body and header limits, read deadlines, the key first.

Raw sockets say exactly what was sent (headers without their body, half a header block); a real
nats-server backs the edge (no workers: every request here is answered before any routing).
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from infermesh.local import LocalMesh
from tests.utils import eventually

pytestmark = [pytest.mark.integration]
KEY = "limits-key"
LIMIT = 64 << 10
BODY = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}).encode()


@pytest.fixture
async def edge(nats_url, namespace):
    mesh = LocalMesh(nats_url, namespace, dev_key=KEY)
    service = await mesh.start_edge(max_body_bytes=LIMIT, body_timeout_s=0.5, header_timeout_s=0.5,
                                    max_header_bytes=8 << 10, keep_alive_s=0.5)
    yield service
    await mesh.stop()


def head(length: int | None, key: str = KEY, path: str = "/v1/chat/completions", method: str = "POST") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: edge", f"Authorization: Bearer {key}",
             "Content-Type: application/json"]
    lines.append(f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def exchange(port: int, *parts: bytes, pause_s: float = 0.0) -> tuple[int, dict, bytes, float]:
    """Send ``parts`` (pausing between them), then read until the server closes: status, error, rest, seconds."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    start = time.monotonic()
    try:
        for part in parts:
            writer.write(part)
            await writer.drain()
            await asyncio.sleep(pause_s)
        raw = await asyncio.wait_for(reader.read(-1), 10)  # -1: to EOF, which only a closed connection gives
    finally:
        writer.close()
    took = time.monotonic() - start
    status_line, _, rest = raw.partition(b"\r\n")
    _, _, body = rest.partition(b"\r\n\r\n")
    return int(status_line.split()[1]), json.loads(body)["error"], rest, took


async def test_a_declared_length_over_the_limit_is_413_before_any_byte_of_it(edge):
    status, error, rest, _ = await exchange(edge.port, head(LIMIT + 1))
    assert status == 413 and error["code"] == "request_too_large" and error["type"] == "invalid_request_error"
    assert set(error) == {"message", "type", "param", "code"}
    assert b"connection: close" in rest.lower()


async def test_a_chunked_body_stops_being_read_at_the_limit(edge):
    chunk = b"x" * (16 << 10)
    framed = b"%x\r\n%s\r\n" % (len(chunk), chunk)
    status, error, _, _ = await exchange(edge.port, head(None), *[framed] * 5)  # 80 KiB, never terminated
    assert status == 413 and error["code"] == "request_too_large"


async def test_a_wrong_key_is_401_without_reading_the_body(edge):
    status, error, _, took = await exchange(edge.port, head(LIMIT, key="wrong"))  # body never sent
    assert status == 401 and error["code"] == "invalid_api_key"
    assert took < 0.4  # well before the body deadline: nothing waited for the body


async def test_a_stalled_body_is_408_and_other_requests_are_served_meanwhile(edge):
    stalled = asyncio.create_task(exchange(edge.port, head(len(BODY)) + BODY[:10]))
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{edge.port}") as client:
        health = await client.get("/health")
        assert health.status_code == 200 and not stalled.done()
    status, error, rest, took = await stalled
    assert status == 408 and error["code"] == "request_timeout" and "body" in error["message"]
    assert b"connection: close" in rest.lower() and took >= 0.5


async def test_a_trickled_body_is_408_at_the_deadline_whatever_its_pace(edge):
    pieces = [head(len(BODY))] + [BODY[i:i + 1] for i in range(12)]
    status, error, _, took = await exchange(edge.port, *pieces, pause_s=0.1)  # a byte every 0.1 s
    assert status == 408 and error["code"] == "request_timeout"
    assert took < 1.5  # the deadline is for the whole body, not for each byte


async def test_headers_that_never_end_are_408_and_closed(edge):
    status, error, _, took = await exchange(edge.port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: e")
    assert status == 408 and "headers" in error["message"] and 0.5 <= took < 2


async def test_an_idle_connection_is_closed_at_the_header_deadline(edge):
    status, _, _, took = await exchange(edge.port)  # connects, sends nothing
    assert status == 408 and 0.5 <= took < 2


async def test_headers_sent_across_a_stall_of_the_edges_loop_are_served_not_408(edge):
    """The loop (the edge's and this client's) stalls past the 0.5 s header deadline right after the
    connection is accepted; the headers written as it resumes come due with the deadline: they are read."""
    connections = edge._server.server_state.connections
    reader, writer = await asyncio.open_connection("127.0.0.1", edge.port)
    try:
        await eventually(lambda: len(connections) == 1, 5, 0.001)  # accepted: its header deadline runs
        time.sleep(1.5)  # the whole loop held up (a GC pause, a starved host)
        await asyncio.sleep(0)  # resume in the turn in which the deadline is due too
        writer.write(b"GET /health HTTP/1.1\r\nHost: edge\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    finally:
        writer.close()
    assert head.startswith(b"HTTP/1.1 200"), head


async def test_a_request_sent_on_a_kept_alive_connection_across_a_stall_is_served_not_closed(edge):
    """The loop stalls past the 0.5 s keep-alive timeout of an idle connection; the request the client writes as it
    resumes comes due with the timeout: it is answered. (uvicorn's plain timer closed the connection first: the
    client's ReadError in a CI run, under an in-process mesh whose loop stalled.)"""
    reader, writer = await asyncio.open_connection("127.0.0.1", edge.port)
    ping = b"GET /health HTTP/1.1\r\nHost: edge\r\n\r\n"
    try:
        writer.write(ping)
        first = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        length = int(first.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        await asyncio.wait_for(reader.readexactly(length), 10)  # the reply is whole: the keep-alive timer runs
        time.sleep(1.5)  # the whole loop held up
        await asyncio.sleep(0)
        writer.write(ping)
        second = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)  # closed instead: IncompleteReadError
    finally:
        writer.close()
    assert first.startswith(b"HTTP/1.1 200") and second.startswith(b"HTTP/1.1 200"), second


async def test_an_idle_kept_alive_connection_is_still_closed_at_its_timeout(edge):
    reader, writer = await asyncio.open_connection("127.0.0.1", edge.port)
    try:
        writer.write(b"GET /health HTTP/1.1\r\nHost: edge\r\n\r\n")
        start = time.monotonic()
        raw = await asyncio.wait_for(reader.read(-1), 10)  # to EOF: the edge closes the idle connection
    finally:
        writer.close()
    assert raw.startswith(b"HTTP/1.1 200") and 0.5 <= time.monotonic() - start < 3


async def test_headers_over_the_cap_are_431(edge):
    big = b"X-Pad: " + b"a" * (16 << 10) + b"\r\n"
    status, error, _, _ = await exchange(edge.port, b"POST /v1/chat/completions HTTP/1.1\r\n" + big)
    assert status == 431 and error["code"] == "headers_too_large"


async def test_a_real_client_sending_a_big_body_reads_the_413(edge):
    """The lingering close: the client is still writing when the edge answers; it must still read the 413."""
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{edge.port}/v1",
                                 headers={"Authorization": f"Bearer {KEY}"}) as client:
        reply = await client.post("/chat/completions", content=b"x" * (4 << 20))
    assert reply.status_code == 413 and reply.json()["error"]["code"] == "request_too_large"


async def test_get_on_the_chat_endpoint_is_405(edge):
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{edge.port}/v1") as client:
        reply = await client.get("/chat/completions", headers={"Authorization": f"Bearer {KEY}"})
    assert reply.status_code == 405 and reply.json()["error"]["code"] == "method_not_allowed"


async def test_any_route_answered_before_its_body_ended_closes_the_connection(edge):
    status, _, _, took = await exchange(edge.port, head(10 << 20, path="/v1/models"))  # Litestar's own route
    assert status == 405 and took < 2  # closed at once (half-closed), not kept open until the keep-alive timeout


async def test_requests_within_the_limits_still_keep_their_connection(edge):
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{edge.port}/v1",
                                 headers={"Authorization": f"Bearer {KEY}"}) as client:
        for _ in range(2):  # the same connection: an unknown model is answered after reading the body
            reply = await client.post("/chat/completions", content=BODY)
            assert reply.status_code == 404 and reply.headers.get("connection") != "close"

