"""A mesh spread over a 3-server NATS cluster on this machine (issue 19's cluster test): each service replica
connects to one server, the replicas of a service to different ones, as on three hosts.

    | server | services                                                        |
    |--------|-----------------------------------------------------------------|
    | c-0    | admission-0, breaker-0, metering-1, worker-0, worker-3, edge-0  |
    | c-1    | admission-1, router-0, worker-1, edge-1                         |
    | c-2    | breaker-1, router-1, metering-0, worker-2                       |

    with ClusterMesh(folder, model_path, database_url) as mesh:   # started, provisioned (R3), ready
        mesh.kill_nats("c-1")          # SIGKILL: its clients move to the other two
        mesh.kill("edge-1")            # SIGKILL one replica
        await mesh.leased_tokens()     # what admission's leases hold now

The bus is open here (a cluster's routes and locked users are tested apart: test_bus_auth, test_replication).
Every stream and bucket has three copies (INFERMESH_STREAM_REPLICAS=3), provisioned before any service starts.
The two edges share one port (SO_REUSEPORT), as behind a load balancer: a connection lost with one edge is made
again to the other. Sim workers get a small KV (``kv_blocks`` x 16 tokens) so admission's capacity binds.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import time
import urllib.request
from pathlib import Path

from infermesh.bus_auth import provision
from infermesh.nats_topology import plan_supercluster
from infermesh.processes import ProcessGroup
from infermesh.supercluster import Supercluster
from shared import schema
from shared.bus import Bus
from shared.kv_keys import live_keys
from shared.nats_auth import NatsCredentials
from shared.ports import free_port
from shared.replication import ENV as REPLICAS_ENV
from shared.schema import LeaseRecord, WorkerInfo

NAMESPACE = "cluster"
KEY = "cluster-key"
MODEL = "tiny"
BLOCK = 16
ADMIT_FRACTION = 0.9  # admission's default: the share of the workers' KV it leases at once


Replica = tuple[str, str, int, list[str]]  # name, module, server index, arguments


def layout(model_path: Path, database_url: str, http_port: int, kv_blocks: int) -> list[Replica]:
    """(name, module, server index, arguments) of every replica."""
    sim = ["--engine", "sim", "--model", MODEL, "--model-path", str(model_path), "--sim-itl-ms", "10",
           "--block-size", str(BLOCK), "--num-kv-blocks", str(kv_blocks)]
    meter = ["--database-url", database_url, "--billing-port", "-1"]
    edge = ["--host", "127.0.0.1", "--http-port", str(http_port), "--reuse-port"]
    return [
        ("admission-0", "services.admission", 0, ["--admission-id", "admission-0"]),
        ("admission-1", "services.admission", 1, ["--admission-id", "admission-1"]),
        ("breaker-0", "services.breaker", 0, []), ("breaker-1", "services.breaker", 2, []),
        ("router-0", "services.router", 1, ["--router-id", "router-0"]),
        ("router-1", "services.router", 2, ["--router-id", "router-1"]),
        ("metering-0", "services.metering", 2, meter), ("metering-1", "services.metering", 0, meter),
        *((f"worker-{i}", "services.worker", i % 3, ["--worker-id", f"sim-{i}", *sim]) for i in range(4)),
        ("edge-0", "services.edge", 0, edge), ("edge-1", "services.edge", 1, edge),
    ]


class ClusterMesh:
    def __init__(self, folder: Path, model_path: Path, database_url: str, kv_blocks: int = 16) -> None:
        self.folder, self.kv_blocks = folder, kv_blocks
        self.http_port = free_port()
        self.base_url = f"http://127.0.0.1:{self.http_port}/v1"
        self.cluster = Supercluster(plan_supercluster(["c"], 3, folder / "nats", witness=False))
        self.group = ProcessGroup(folder / "logs")
        self.replicas = layout(model_path, database_url, self.http_port, kv_blocks)
        self.children: dict[str, object] = {}
        self.edge_secret = secrets.token_hex(16)

    @property
    def servers(self) -> list[str]:
        return [s.name for s in self.cluster.plan.servers("c")]

    def url(self, index: int) -> str:
        """Server ``index`` first, then the others: a replica connects to its own and learns the rest."""
        urls = [f"nats://127.0.0.1:{s.ports.client}" for s in self.cluster.plan.servers("c")]
        return urls[index]

    @property
    def capacity_tokens(self) -> int:
        return int(4 * self.kv_blocks * BLOCK * ADMIT_FRACTION)

    async def start(self, timeout_s: float = 120.0) -> None:
        await asyncio.to_thread(self.cluster.start)
        previous = os.environ.get(REPLICAS_ENV)
        os.environ[REPLICAS_ENV] = "3"  # for provisioning here only (each service is given it in its own env)
        try:
            await provision(self.url(0), NAMESPACE, NatsCredentials())
        finally:
            if previous is None:
                del os.environ[REPLICAS_ENV]
            else:
                os.environ[REPLICAS_ENV] = previous
        for name, module, server, args in self.replicas:
            env = {"INFERMESH_NATS_URL": self.url(server), "INFERMESH_NAMESPACE": NAMESPACE, REPLICAS_ENV: "3"}
            if module == "services.edge":
                env |= {"INFERMESH_DEV_KEY": KEY, "INFERMESH_EDGE_SECRET": self.edge_secret}
            self.children[name] = self.group.python_service(name, module, args, env)
        await self.wait_ready(timeout_s)

    async def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not await asyncio.to_thread(self._ready):
            dead = self.group.dead()
            if dead:
                raise RuntimeError(f"{dead[0].name} died:\n{dead[0].tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cluster mesh was not ready in {timeout_s}s (logs: {self.group.log_dir})")
            await asyncio.sleep(0.2)

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/ready", timeout=2) as response:
                status = json.loads(response.read())
            return status.get("status") == "ready" and int(status.get("workers", 0)) >= 4
        except Exception:
            return False

    def kill_nats(self, server: str) -> None:
        self.cluster.kill_server(server)

    def kill(self, name: str) -> int:
        child = self.children[name]
        child.popen.send_signal(signal.SIGKILL)  # type: ignore[attr-defined]
        return child.popen.pid  # type: ignore[attr-defined]

    def admission_leader(self) -> str:
        """The admission replica that said last that it leads."""
        for name in ("admission-0", "admission-1"):
            lines = (self.group.log_dir / f"{name}.log").read_text(errors="replace").splitlines()
            events = [line for line in lines if "is the leader" in line or "steps down" in line]
            if events and "is the leader" in events[-1]:
                return name
        raise RuntimeError("no admission replica says it leads")

    async def leased_tokens(self, bus: Bus) -> int:
        """The tokens of every lease record in the leases bucket (what admission has granted and not ended)."""
        kv = await bus.js.key_value(bus.subjects.leases_bucket)
        total = 0
        for key in await live_keys(kv):
            if key.startswith("l-"):
                entry = await kv.get(key)
                if entry.value:
                    total += schema.decode(entry.value, LeaseRecord).tokens
        return total

    async def workers(self, bus: Bus) -> list[str]:
        kv = await bus.js.key_value(bus.subjects.workers_bucket)
        out = []
        for key in await live_keys(kv):
            entry = await kv.get(key)
            if entry.value:
                out.append(schema.decode(entry.value, WorkerInfo).worker_id)
        return out

    async def bus(self) -> Bus:
        return await Bus.connect(",".join(self.url(i) for i in range(3)), NAMESPACE, "cluster-probe",
                                 NatsCredentials())

    def stop(self) -> None:
        self.group.stop()
        self.cluster.stop()
