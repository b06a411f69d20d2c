"""The batch benchmark's mesh: every service its own process on one open nats-server, the batch service
restartable with another dispatch order (``--dispatch-order``), so both orders run on the same fleet in one run.

    nats-server -js            the bus, JetStream for files and batch results
    router, admission          KV tokens x admit_fraction per pool; batch_share (for class batch)
    metering                   a SQLite ledger (migrated by metering; the batch service keeps its jobs there)
    edge                       HTTP on ``port``, static keys, leases from admission
    workers                    ``processes`` x ``engines`` sim engines (fixed timings, prefix-caching KV)
    batch                      jobs from /v1/batches, lines to the edges; stopped and started again by
                               ``restart_batch`` with the other dispatch order
"""

from __future__ import annotations

import json
import signal
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from infermesh.processes import Child, ProcessGroup
from shared.ports import free_port, wait_for_port

MODEL = "sim-batch"
KEY, TEAM = "key-batch-bench", "bench"


@dataclass(frozen=True, slots=True)
class FleetSpec:
    """The sim fleet: what sets its capacity (see the report's setup)."""

    processes: int = 2
    engines: int = 2  # sim engines per worker process
    kv_blocks: int = 96  # per engine, of block_size tokens
    block_size: int = 16
    ttft_ms: float = 10.0  # a step with prefill work: this + prefill_us_per_token x uncached prompt tokens
    prefill_us_per_token: float = 20.0
    itl_ms: float = 10.0  # a decode-only step
    stream_interval: int = 4

    @property
    def workers(self) -> int:
        return self.processes * self.engines

    @property
    def kv_tokens(self) -> int:
        return self.workers * self.kv_blocks * self.block_size


class BenchMesh:
    """The processes above; ``port`` is the edge's."""

    def __init__(self, state: Path, fleet: FleetSpec, tokenizer: str, max_in_flight: int,
                 admission_args: Sequence[str] = ()) -> None:
        self.state, self.fleet, self.tokenizer, self.max_in_flight = state, fleet, tokenizer, max_in_flight
        self.admission_args = list(admission_args)  # e.g. --batch-share 0.9 (none: admission's defaults)
        self.group = ProcessGroup(state / "logs")
        self.namespace = f"bb{uuid.uuid4().hex[:8]}"
        self.port = free_port()
        self.database_url = f"sqlite:///{state / 'ledger.db'}"
        self.env: dict[str, str] = {}
        self.batch: Child | None = None
        self.dispatch_order = ""

    def start(self, dispatch_order: str, timeout_s: float = 120.0) -> None:
        nats_port = free_port()
        self.group.spawn_nats(nats_port, self.state / "jetstream")
        if not wait_for_port(nats_port, 15):
            raise RuntimeError("nats-server did not start")
        self.env = {"INFERMESH_NATS_URL": f"nats://127.0.0.1:{nats_port}", "INFERMESH_NAMESPACE": self.namespace,
                    "INFERMESH_DATABASE_URL": self.database_url}
        f = self.fleet
        self.group.python_service("router", "services.router", [], self.env)
        self.group.python_service("admission", "services.admission", self.admission_args, self.env)
        self.group.python_service("metering", "services.metering", ["--billing-port", "-1"], self.env)
        for i in range(f.processes):
            self.group.python_service(f"worker-{i}", "services.worker", [
                "--worker-id", f"sim{i}", "--num-engines", str(f.engines), "--engine", "sim", "--model", MODEL,
                "--model-path", self.tokenizer, "--max-model-len", "4096", "--block-size", str(f.block_size),
                "--num-kv-blocks", str(f.kv_blocks), "--sim-ttft-ms", str(f.ttft_ms),
                "--sim-prefill-us-per-token", str(f.prefill_us_per_token), "--sim-itl-ms", str(f.itl_ms),
                "--sim-stream-interval", str(f.stream_interval)], self.env)
        self.group.python_service("edge", "services.edge", ["--http-port", str(self.port), "--admission"],
                                  {**self.env, "INFERMESH_API_KEYS": f"{KEY}:{TEAM}"})
        self._start_batch(dispatch_order)
        self._wait(lambda: self._ready(), timeout_s, "the edge did not see every worker")
        self._wait(lambda: self._batch_ready(), timeout_s, "the batch service did not answer")

    def restart_batch(self, dispatch_order: str, timeout_s: float = 60.0) -> None:
        """Stop the batch service (it gives up the leader key) and start one with ``dispatch_order``; back once
        the new one answers (a create sent before got 503: no responder)."""
        if self.batch is not None:
            self.batch.popen.send_signal(signal.SIGTERM)
            self.batch.popen.wait(30)
            self.group.children.remove(self.batch)
        self._start_batch(dispatch_order)
        self._wait(lambda: self._batch_ready(), timeout_s, "the restarted batch service did not answer")

    def _start_batch(self, dispatch_order: str) -> None:
        self.dispatch_order = dispatch_order
        self.batch = self.group.python_service("batch", "services.batch", [
            "--dispatch-order", dispatch_order, "--max-in-flight", str(self.max_in_flight), "--tick-s", "0.1",
            "--retry-s", "0.2", "--retry-max-s", "2", "--leader-ttl-s", "1"], self.env)

    def _ready(self) -> bool:
        """The edge is ready and sees every sim engine (a 503 while not: urlopen raises)."""
        try:
            request = urllib.request.Request(f"http://127.0.0.1:{self.port}/ready",
                                             headers={"Authorization": f"Bearer {KEY}"})  # workers: a key's holder's
            with urllib.request.urlopen(request, timeout=2) as response:
                return json.loads(response.read())["workers"] >= self.fleet.workers
        except OSError:
            return False

    def _batch_ready(self) -> bool:
        """The batch service answers the edge's batch list (503 while it is not leading yet: urlopen raises)."""
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/batches?limit=1",
                                         headers={"Authorization": f"Bearer {KEY}"})
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                return response.status == 200
        except OSError:
            return False

    def _wait(self, condition, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            dead = self.group.dead()
            if dead:
                raise RuntimeError(f"{dead[0].name} died:\n{dead[0].tail()}")
            if condition():
                return
            time.sleep(0.2)
        raise RuntimeError(what)

    def stop(self) -> None:
        self.group.stop()
