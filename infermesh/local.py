"""An in-process mesh: router, workers and edge as asyncio services in one event loop.

Used by tests (one trace provider sees every span) and by benchmarks that want the
engine on the bus without HTTP. ``infermesh up`` runs the same services as processes.
Edges ask for admission leases when the mesh runs an admission service (start it first).
"""

from __future__ import annotations

import asyncio
import io
import logging
import secrets
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, Callable

from services.admission.config import AdmissionConfig
from services.admission.service import AdmissionService
from services.batch.config import BatchConfig
from services.batch.service import BatchService
from services.breaker.config import BreakerConfig
from services.breaker.service import BreakerService
from services.edge.config import EdgeConfig
from services.edge.service import EdgeService
from services.metering.config import MeteringConfig
from services.metering.service import MeteringService
from services.router.config import RouterConfig
from services.router.service import RouterService
from services.worker.config import WorkerConfig
from services.worker.service import WorkerService
from shared.bus import Bus
from shared.nats_auth import NatsCredentials

log = logging.getLogger(__name__)


@dataclass
class LocalMesh:
    nats_url: str
    namespace: str
    dev_key: str = "test-key"
    buses: list[Bus] = field(default_factory=list)
    routers: list[RouterService] = field(default_factory=list)  # replicas: one queue group
    workers: list[WorkerService] = field(default_factory=list)
    edges: list[EdgeService] = field(default_factory=list)
    breakers: list[BreakerService] = field(default_factory=list)
    admissions: list[AdmissionService] = field(default_factory=list)
    meterings: list[MeteringService] = field(default_factory=list)
    batches: list[BatchService] = field(default_factory=list)
    credentials: dict[str, NatsCredentials] = field(default_factory=dict)  # role -> its credentials (locked bus)
    edge_secret: str = field(default_factory=lambda: secrets.token_hex(32), repr=False)  # one for every edge

    @property
    def router(self) -> RouterService | None:
        return self.routers[0] if self.routers else None

    @property
    def edge(self) -> EdgeService | None:
        return self.edges[0] if self.edges else None

    async def _bus(self, name: str) -> Bus:
        bus = await Bus.connect(self.nats_url, self.namespace, name, self.credentials.get(name.partition("-")[0]))
        self.buses.append(bus)
        return bus

    async def _start(self, name: str, started: list, build: Callable[[Bus], Any]) -> Any:
        """Connect a bus for one more service, build it, start it, and keep it in ``started``."""
        service = build(await self._bus(f"{name}-{len(started)}"))
        await service.start()
        started.append(service)
        return service

    def _config(self, kind: type, **options: object) -> Any:
        return kind(nats_url=self.nats_url, namespace=self.namespace, **options)

    async def start_router(self, **options: object) -> RouterService:
        config = self._config(RouterConfig, **options)
        return await self._start("router", self.routers, lambda bus: RouterService(bus, config))

    async def start_breaker(self, **options: object) -> BreakerService:
        config = self._config(BreakerConfig, **options)
        return await self._start("breaker", self.breakers, lambda bus: BreakerService(bus, config))

    async def start_admission(self, **options: object) -> AdmissionService:
        config = self._config(AdmissionConfig, **options)
        return await self._start("admission", self.admissions, lambda bus: AdmissionService(bus, config))

    async def start_metering(self, **options: object) -> MeteringService:
        options.setdefault("billing_port", 0)
        config = self._config(MeteringConfig, **options)
        return await self._start("metering", self.meterings, lambda bus: MeteringService(bus, config))

    async def start_batch(self, **options: object) -> BatchService:
        config = self._config(BatchConfig, **options)
        return await self._start("batch", self.batches, lambda bus: BatchService(bus, config))

    async def start_worker(self, **options: object) -> WorkerService:
        config = self._config(WorkerConfig, **options)
        return await self._start("worker", self.workers, lambda bus: WorkerService(config, bus))

    async def start_edge(self, **options: object) -> EdgeService:
        options.setdefault("admission", bool(self.admissions))  # edges ask for leases when admission runs
        options.setdefault("edge_secret", self.edge_secret)  # any edge bills the orphans of another
        config = self._config(EdgeConfig, dev_key=self.dev_key, http_port=0, **options)
        return await self._start("edge", self.edges, lambda bus: EdgeService(config, bus))

    @property
    def base_url(self) -> str:
        return self.url_of(0)

    def url_of(self, edge_index: int) -> str:
        return f"http://127.0.0.1:{self.edges[edge_index].port}/v1"

    async def stop(self) -> None:
        """Stop everything, each service within ``STOP_WITHIN_S``: one that hangs is named (with every task's
        stack) and the rest still stop, so a hang fails the caller instead of leaking services into the next."""
        stuck: list[str] = []
        groups: list[tuple[str, list[Any]]] = [
            ("batch", self.batches),  # first: its lines in flight get their answers from the edges
            ("edge", self.edges), ("admission", self.admissions), ("metering", self.meterings),
            ("worker", self.workers), ("router", self.routers), ("breaker", self.breakers)]
        for kind, services in groups:
            for index, service in enumerate(services):
                if not await _stop_within(service.stop(), f"{kind} {index}"):
                    stuck.append(f"{kind} {index}")
        for bus in self.buses:
            await bus.close()
        if stuck:
            raise RuntimeError(f"did not stop within {STOP_WITHIN_S:.0f} s: {', '.join(stuck)}")


STOP_WITHIN_S = 60.0


async def _stop_within(stopping: Coroutine[Any, Any, None], name: str) -> bool:
    task = asyncio.ensure_future(stopping)
    done, _ = await asyncio.wait({task}, timeout=STOP_WITHIN_S)
    if done:
        task.result()
        return True
    stacks = io.StringIO()
    for other in asyncio.all_tasks():
        other.print_stack(limit=12, file=stacks)
    log.error("%s did not stop within %.0f s; the tasks:\n%s", name, STOP_WITHIN_S, stacks.getvalue())
    task.cancel()
    return False
