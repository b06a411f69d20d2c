"""A TCP proxy a test can cut: the database "goes away" (connections reset, new ones refused) and comes back."""

from __future__ import annotations

import asyncio

from shared.ports import free_port


class TcpProxy:
    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.port = free_port()
        self._server: asyncio.base_events.Server | None = None
        self._pipes: set[asyncio.StreamWriter] = set()

    def rewrite(self, url: str) -> str:
        """``url`` pointed at the proxy instead of the target."""
        host, port = self.target
        return url.replace(f"@{host}:{port}/", f"@127.0.0.1:{self.port}/", 1)

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        self._pipes |= {writer, up_writer}
        await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer), return_exceptions=True)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        finally:
            self._pipes.discard(writer)
            writer.close()

    async def cut(self) -> None:
        """Refuse new connections and reset every open one."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._pipes):
            writer.transport.abort()
        self._pipes.clear()

    async def restore(self) -> None:
        await self.start()

    async def stop(self) -> None:
        await self.cut()
