"""Several sim engines in one process: a fleet of simulated workers on a small machine.

Each engine is a full WorkerService (its own worker id ``<worker_id>-<i>``, registry
entry, subjects, load and KV events) sharing the process's one bus connection and event
loop. Only the sim engine allows it: a vLLM engine owns its process's cores.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid

from services.worker.config import WorkerConfig
from services.worker.service import WorkerService
from shared.bus import Bus


class WorkerGroup:
    def __init__(self, config: WorkerConfig, bus: Bus) -> None:
        base = config.worker_id or f"w-{uuid.uuid4().hex[:8]}"
        self.services = [
            WorkerService(dataclasses.replace(config, worker_id=f"{base}-{i}", num_engines=1), bus)
            for i in range(config.num_engines)
        ]

    async def start(self) -> None:
        await asyncio.gather(*(service.start() for service in self.services))

    async def stop(self) -> None:
        await asyncio.gather(*(service.stop() for service in self.services), return_exceptions=True)


def build_worker(config: WorkerConfig, bus: Bus) -> WorkerService | WorkerGroup:
    """One WorkerService, or a WorkerGroup when the config asks for several engines."""
    return WorkerService(config, bus) if config.num_engines == 1 else WorkerGroup(config, bus)
