"""A benchmark's mesh, started exactly as ``infermesh up --engine sim`` starts it (``infermesh.up.start_processes``):
a locked nats-server, two routers, the breaker, two admission replicas (leader and standby), metering with a
ledger of its own (SQLite in the state folder unless a database URL is given), the batch service, one sim worker
(``sim-0``) and two edges sharing one port; ``service_env`` goes to every service (e.g. OpenTelemetry's settings).

The direct path to the worker uses the edge role's own bus credentials, so it may do exactly what an edge may."""

from __future__ import annotations

import threading
import uuid
from pathlib import Path

from infermesh.processes import ProcessGroup
from infermesh.up import MeshOptions, start_processes, wait_ready
from shared.bus import Bus
from shared.ports import free_port

KEY = "bench-key"
MODEL = "bench"
WORKER_ID = "sim-0"


class UpMesh:
    def __init__(self, state: Path, model_path: Path, sim_ttft_ms: float, sim_itl_ms: float,
                 service_env: dict[str, str] | None = None, database_url: str = "", **options: object) -> None:
        """``options``: more of ``MeshOptions`` (``edge_replicas``, ``sim_stream_interval``, ...)."""
        state.mkdir(parents=True, exist_ok=True)
        self.state, self.model_path, self.service_env = state, model_path, service_env or {}
        self.options = MeshOptions(
            engine="sim", num_workers=1, model=MODEL, model_path=str(model_path), http_port=free_port(),
            namespace=f"mo{uuid.uuid4().hex[:8]}", dev_key=KEY, billing_port=free_port(), metrics_port_base=-1,
            database_url=database_url or f"sqlite:///{state / 'ledger.db'}", sim_ttft_ms=sim_ttft_ms,
            sim_itl_ms=sim_itl_ms, state_dir=str(state), ready_timeout_s=120.0, **options)
        self.group = ProcessGroup(state / "logs")
        self.nats_url = ""

    @property
    def port(self) -> int:
        return self.options.http_port

    def start(self) -> None:
        self.nats_url = start_processes(self.group, self.options, str(self.model_path), self.state,
                                        service_env=self.service_env)
        if not wait_ready(self.group, self.options, threading.Event()):
            dead = self.group.dead()
            detail = f"{dead[0].name} died:\n{dead[0].tail()}" if dead else "not ready in time"
            self.stop()
            raise RuntimeError(f"the mesh did not become ready ({detail}); logs in {self.group.log_dir}")

    async def direct_bus(self) -> Bus:
        return await Bus.connect(self.nats_url, self.options.namespace, "bench-direct",
                                 self.group.bus_credentials["edge"])

    def cpu_seconds(self) -> dict[str, float]:
        """User+system CPU each service has used so far (with its own children, e.g. a worker's helpers)."""
        import psutil

        out: dict[str, float] = {}
        for child in self.group.children:
            try:
                process = psutil.Process(child.popen.pid)
                total = 0.0
                for p in (process, *process.children(recursive=True)):
                    times = p.cpu_times()
                    total += times.user + times.system
                out[child.name] = total
            except psutil.NoSuchProcess:
                pass
        return out

    def stop(self) -> None:
        self.group.stop()
