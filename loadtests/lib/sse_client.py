"""A lean HTTP/1.1 client for streaming OpenAI requests, for benchmarks.

Like wrk, it keeps one keep-alive connection per concurrent stream and does the
least possible parsing (status line, chunked framing, a byte search for the first
content delta), so the load generator's own HTTP work does not count as mesh
overhead. Correctness of responses is the tests' job, not this client's.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import AsyncIterator

import msgspec

FIRST_CONTENT = b'"content":"'
EMPTY_CONTENT = b'"content":""'


async def read_chunks(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    """The chunks of a chunked-transfer-encoded body (each with its trailing CRLF), up to the last one."""
    while True:
        size = int((await reader.readline()).strip(), 16)
        if size == 0:
            await reader.readline()
            return
        yield await reader.readexactly(size + 2)


class LeanSseClient:
    def __init__(self, host: str, port: int, path: str, api_key: str) -> None:
        self._host, self._port, self._path, self._key = host, port, path, api_key
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    def _request(self, body: dict) -> bytes:
        payload = msgspec.json.encode(body)
        head = (f"POST {self._path} HTTP/1.1\r\nHost: {self._host}:{self._port}\r\n"
                f"Authorization: Bearer {self._key}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(payload)}\r\n\r\n")
        return head.encode() + payload

    async def _send(self, request: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes, float]:
        """Send on an idle keep-alive connection (or a new one if the server closed it); return the head."""
        while self._idle:
            reader, writer = self._idle.pop()
            start = time.perf_counter()
            writer.write(request)
            try:
                return reader, writer, await reader.readuntil(b"\r\n\r\n"), start
            except (asyncio.IncompleteReadError, ConnectionError):
                writer.close()  # the server's keep-alive timeout closed it while idle
        reader, writer = await asyncio.open_connection(self._host, self._port)
        start = time.perf_counter()
        writer.write(request)
        return reader, writer, await reader.readuntil(b"\r\n\r\n"), start

    async def ttft(self, body: dict, timeout_s: float = 10.0) -> float:
        """Seconds from sending ``body`` to the first non-empty content delta; reads the whole stream."""
        return (await self.timings(body, timeout_s))[0]

    async def timings(self, body: dict, timeout_s: float = 10.0) -> tuple[float, list[float]]:
        """(seconds to the first non-empty content delta, the gaps between the chunks with content after it)."""
        request = self._request(body)
        arrivals: list[float] = []
        async with asyncio.timeout(timeout_s):
            reader, writer, head, start = await self._send(request)
            if not head.startswith(b"HTTP/1.1 200"):
                writer.close()
                raise RuntimeError(f"unexpected response: {head[:200]!r}")
            async for chunk in read_chunks(reader):
                if FIRST_CONTENT in chunk.replace(EMPTY_CONTENT, b""):
                    arrivals.append(time.perf_counter())
        self._idle.append((reader, writer))
        if not arrivals:
            raise RuntimeError("the stream carried no content")
        return arrivals[0] - start, [b - a for a, b in itertools.pairwise(arrivals)]

    def close(self) -> None:
        for _reader, writer in self._idle:
            writer.close()
        self._idle.clear()
