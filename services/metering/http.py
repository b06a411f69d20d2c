"""Metering's HTTP server: the billing API and dashboards (billing_api.py), plus ``/metrics`` and ``/health``.

``/health`` is the service's (``MeteringService.health``): 200 while every usage writer runs and the
ledger keeps up with the usage stream, else 503; the JSON body says which and why.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import uvicorn
from sqlalchemy.ext.asyncio import AsyncEngine

from services.metering.billing_api import create_billing_app
from services.metering.metrics import prometheus_text


class BillingServer:
    def __init__(self, engine: AsyncEngine, service: Any, host: str, port: int, trace_url: str = "") -> None:
        self.service = service
        self.app = create_billing_app(engine, trace_url=trace_url)
        self._server = uvicorn.Server(uvicorn.Config(self._asgi, host=host, port=port, log_level="warning",
                                                     access_log=False, lifespan="off", loop="none",
                                                     interface="asgi3", proxy_headers=False))
        self._task: asyncio.Task[None] | None = None
        self.port = port

    async def _asgi(self, scope: dict, receive: Any, send: Any) -> None:
        path = scope["path"] if scope["type"] == "http" else ""
        if path == "/metrics":
            s = self.service
            body = prometheus_text(s.stats, s.lag.quantiles(), s.pending, s.db_up, s.health()).encode()
            await _respond(send, 200, b"text/plain; version=0.0.4", body)
        elif path == "/health":
            health = self.service.health()
            await _respond(send, 200 if health.ok else 503, b"application/json", json.dumps(health.body()).encode())
        else:
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


async def _respond(send: Any, status: int, content_type: bytes, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", content_type)]})
    await send({"type": "http.response.body", "body": body})
