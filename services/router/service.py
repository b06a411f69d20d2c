"""Router service: answers ``<ns>.router.route`` from the registry and the workers' load stream.

Replicas join one queue group, so any replica answers any request.
"""

from __future__ import annotations

import logging

from nats.aio.msg import Msg

from services.router.config import RouterConfig
from services.router.policy import LeastLoadedPolicy, LoadView
from shared.bus import Bus
from shared.registry import WorkerDirectory
from shared.schema import LoadSnapshot, RouteDecision, RouteRequest
from shared.telemetry import tracer

log = logging.getLogger("infermesh.router")
_tracer = tracer("infermesh.router")
QUEUE_GROUP = "router"


class RouterService:
    def __init__(self, bus: Bus, config: RouterConfig | None = None) -> None:
        config = config or RouterConfig()
        self.bus = bus
        self.directory = WorkerDirectory(bus)
        self.loads = LoadView()
        self.policy = LeastLoadedPolicy(min_remote_prefill_tokens=config.min_remote_prefill_tokens)
        self._subs: list[object] = []

    async def start(self) -> None:
        self.directory.on_removed.append(self.loads.forget)
        await self.directory.start()
        s = self.bus.subjects
        self._subs = [
            await self.bus.subscribe(s.load_all, LoadSnapshot, self._on_load),
            await self.bus.subscribe(s.route, RouteRequest, self._on_route, queue=QUEUE_GROUP),
        ]
        log.info("router ready (%s policy)", self.policy.name)

    async def stop(self) -> None:
        for sub in self._subs:
            await sub.unsubscribe()  # type: ignore[attr-defined]
        await self.directory.stop()

    async def _on_load(self, snapshot: LoadSnapshot, _raw: Msg) -> None:
        if snapshot.source_id in self.directory.workers:
            self.loads.observe(snapshot)

    async def _on_route(self, request: RouteRequest, raw: Msg) -> None:
        with _tracer.start_as_current_span("router.route") as span:
            reply = self.policy.route(request, self.directory.live(), self.loads)
            span.set_attribute("infermesh.request_id", request.request_id)
            if isinstance(reply, RouteDecision):
                span.set_attribute("infermesh.worker_id", reply.worker_id)
            else:
                span.set_attribute("infermesh.route_rejected", reply.code)
            await self.bus.respond(raw, reply)
