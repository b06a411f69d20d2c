"""Edge service: the mesh client (EdgeMesh) plus the HTTP server (uvicorn running Litestar, on the guarded
httptools protocol of connection.py)."""

from __future__ import annotations

import asyncio
import logging
import socket
import uuid
from pathlib import Path

import uvicorn

from services.edge.api import EdgeApi
from services.edge.app import create_app
from services.edge.batch_lines import BatchLineServer
from services.edge.config import EdgeConfig
from services.edge.connection import HeaderLimits, guarded_protocol
from services.edge.mesh import EdgeMesh
from shared.bus import Bus
from shared.metrics import StatsCollector
from shared.usage_journal import UsageJournal

log = logging.getLogger("infermesh.edge")


class EdgeService:
    def __init__(self, config: EdgeConfig, bus: Bus) -> None:
        self.config = config
        self.edge_id = f"e{uuid.uuid4().hex[:10]}"
        # the usage outbox of this edge's slot: locked now (JournalLocked if another edge of the slot runs)
        self.journal = UsageJournal.open(Path(config.usage_outbox_dir)) if config.usage_outbox_dir else None
        self.mesh = EdgeMesh(config, bus, self.edge_id, self.journal)
        self.api = EdgeApi(config, self.mesh)
        self.app = create_app(self.api)
        self.batch_lines = BatchLineServer(bus, {"/v1/chat/completions": self.api.chat_completions,
                                                 "/v1/completions": self.api.completions})
        self.metrics = self.api.metrics  # the GenAI histograms (model, team) and the edge's own counters
        self.metrics.register(StatsCollector("infermesh_edge", self._counters))
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None
        self.port = config.http_port

    async def start(self) -> None:
        if not self.config.dev_key:
            log.warning("no API key configured (INFERMESH_DEV_KEY): every request will get 401")
        if self.journal is not None:
            await self.journal.start()
        await self.mesh.start()
        if replayed := await self.mesh.usage.replay():  # what the last edge of this slot left unpublished
            log.warning("edge %s: publishing %d usage records its slot's previous edge left", self.edge_id, replayed)
        await self.batch_lines.start()
        server_config = uvicorn.Config(
            self.app, host=self.config.host, port=self.config.http_port, log_level="warning",
            access_log=False, lifespan="off", loop="none", timeout_graceful_shutdown=2, proxy_headers=False,
            timeout_keep_alive=self.config.keep_alive_s,
            http=guarded_protocol(HeaderLimits(self.config.max_header_bytes, self.config.header_timeout_s)),
        )
        self._server = uvicorn.Server(server_config)
        sockets = [self._shared_socket()] if self.config.reuse_port else None
        self._task = asyncio.create_task(self._server.serve(sockets=sockets), name="http")
        while not self._server.started:
            if self._task.done():
                await self._task  # raises the bind error
                raise RuntimeError("HTTP server exited before it started")
            await asyncio.sleep(0.02)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        log.info("edge %s listening on http://%s:%d/v1", self.edge_id, self.config.host, self.port)

    def _counters(self) -> dict[str, int]:
        orphans = self.mesh.orphans.stats if self.mesh.orphans is not None else {}
        return {**{f"batch_lines:{k}": v for k, v in self.batch_lines.stats.items()},
                **{f"orphans:{k}": v for k, v in orphans.items()},
                **{f"deployments:{k}": v for k, v in self.mesh.failover.stats.items()}}

    def _shared_socket(self) -> socket.socket:
        """A listening socket other edges may bind too (SO_REUSEPORT): the kernel spreads new connections."""
        sock = socket.socket(socket.AF_INET6 if ":" in self.config.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((self.config.host, self.config.http_port))
        sock.listen(2048)
        sock.setblocking(False)
        return sock

    async def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        await self.batch_lines.stop()
        await self.api.drain_billing()
        await self.mesh.usage.stop()  # what is still unpublished stays in the outbox for the slot's next edge
        if self.journal is not None:
            await self.journal.stop()
        self.api.prep.close()
        await self.mesh.stop()
