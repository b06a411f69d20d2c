"""A layer-4 balancer, as a Kubernetes Service or a cloud load balancer in front of several edges: each connection
accepted goes to the next target in turn; a target that refuses (a dead edge) is skipped. Also a plain forwarder
(one target): hosts in network namespaces reach the machine's Postgres, which listens on loopback only, through
one bound to the bridge's address."""

from __future__ import annotations

import asyncio
import itertools


class TcpBalancer:
    def __init__(self, listen_host: str, targets: list[tuple[str, int]], connect_timeout_s: float = 1.0) -> None:
        assert targets
        self.listen_host, self.targets = listen_host, targets
        self.port = 0
        self._turn = itertools.cycle(range(len(targets)))
        self._connect_timeout_s = connect_timeout_s
        self._server: asyncio.base_events.Server | None = None
        self._pipes: set[asyncio.Task[None]] = set()

    async def start(self, port: int = 0) -> None:
        self._server = await asyncio.start_server(self._serve, self.listen_host, port)
        self.port = self._server.sockets[0].getsockname()[1]

    def close(self) -> None:
        """No new connections; the open ones are cut."""
        if self._server is not None:
            self._server.close()
        for pipe in list(self._pipes):
            pipe.cancel()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream = await self._connect()
        if upstream is None:
            writer.close()
            return
        up_reader, up_writer = upstream
        pipes = [asyncio.create_task(_copy(reader, up_writer)), asyncio.create_task(_copy(up_reader, writer))]
        self._pipes.update(pipes)
        try:
            await asyncio.gather(*pipes, return_exceptions=True)
        finally:
            self._pipes.difference_update(pipes)

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        for _ in self.targets:
            host, port = self.targets[next(self._turn)]
            try:
                return await asyncio.wait_for(asyncio.open_connection(host, port), self._connect_timeout_s)
            except (OSError, asyncio.TimeoutError):
                continue
        return None


async def _copy(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
    """Until ``source`` ends or fails; then ``sink`` is closed (a reset on one side closes the other)."""
    try:
        while data := await source.read(65536):
            sink.write(data)
            await sink.drain()
    except (OSError, asyncio.IncompleteReadError):
        pass
    finally:
        sink.close()
