"""Metering's HTTP server: the billing API and dashboards (billing_api.py), plus ``/metrics``."""

from __future__ import annotations

import asyncio
from typing import Any

import uvicorn
from sqlalchemy.ext.asyncio import AsyncEngine

from services.metering.billing_api import create_billing_app
from services.metering.metrics import prometheus_text


class BillingServer:
    def __init__(self, engine: AsyncEngine, service: Any, host: str, port: int) -> None:
        self.service = service
        self.app = create_billing_app(engine)
        self._server = uvicorn.Server(uvicorn.Config(self._asgi, host=host, port=port, log_level="warning",
                                                     access_log=False, lifespan="off", loop="none",
                                                     interface="asgi3", proxy_headers=False))
        self._task: asyncio.Task[None] | None = None
        self.port = port

    async def _asgi(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/metrics":
            s = self.service
            body = prometheus_text(s.stats, s.lag.quantiles(), s.pending, s.db_up).encode()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/plain; version=0.0.4")]})
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._server.serve(), name="billing-http")
        while not self._server.started:
            if self._task.done():
                await self._task
                raise RuntimeError("the billing HTTP server exited before it started")
            await asyncio.sleep(0.02)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]

    async def stop(self) -> None:
        self._server.should_exit = True
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
