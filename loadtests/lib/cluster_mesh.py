"""A mesh spread over a 3-server NATS cluster on this machine (issue 19's cluster test): three hosts, each a NATS
server and the service replicas beside it; each replica connects to its host's server, the replicas of a service
live on different hosts.

    | host   | services                                                        |
    |--------|-----------------------------------------------------------------|
    | c-0    | admission-0, breaker-0, metering-1, worker-0, worker-3, edge-0  |
    | c-1    | admission-1, router-0, worker-1, edge-1                         |
    | c-2    | breaker-1, router-1, metering-0, worker-2                       |

    mesh = ClusterMesh(folder, model_path, database_url, hosts=NetnsHosts(3))
    await mesh.start()                 # hosts made, servers started, provisioned (R3), every replica ready
    mesh.kill_nats("c-1")              # SIGKILL: its clients move to the other two
    mesh.kill("edge-1")                # SIGKILL one replica
    await mesh.leased_tokens(bus)      # what admission's leases hold now
    mesh.stop()

Hosts: with ``hosts`` (``loadtests/lib/netns_hosts.py``), each host is a network namespace of its own, reached
over a bridge: its server listens on the host's address, its services reach the other hosts' servers only over
the bridge, and the ledger's Postgres (on the machine's loopback) through a forwarder on the bridge. Without,
every host is the machine's loopback (one address, ports apart). The two edges sit behind one port
(``base_url``) on the machine, as behind a load balancer: a layer-4 balancer (``tcp_balancer.py``) hands each
connection to the next edge that accepts it, so a connection lost with one edge is made again to the other.

The bus is open here (a cluster's routes and locked users are tested apart: test_bus_auth, test_replication).
Every stream and bucket has three copies (INFERMESH_STREAM_REPLICAS=3), provisioned before any service starts.
Sim workers get a small KV (``kv_blocks`` x 16 tokens) so admission's capacity binds.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

from infermesh.bus_auth import provision
from infermesh.nats_topology import plan_supercluster
from infermesh.processes import ProcessGroup
from infermesh.supercluster import Supercluster
from loadtests.lib.netns_hosts import NetnsHosts
from loadtests.lib.tcp_balancer import TcpBalancer
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


def layout(model_path: Path, database_url: str, edge_hosts: tuple[str, str], edge_port: int,
           kv_blocks: int) -> list[Replica]:
    """(name, module, host index, arguments) of every replica."""
    sim = ["--engine", "sim", "--model", MODEL, "--model-path", str(model_path), "--sim-itl-ms", "10",
           "--block-size", str(BLOCK), "--num-kv-blocks", str(kv_blocks)]
    meter = ["--database-url", database_url, "--billing-port", "-1"]
    edge = ["--http-port", str(edge_port), "--reuse-port"]  # (on one host, the two share the port)
    return [
        ("admission-0", "services.admission", 0, ["--admission-id", "admission-0"]),
        ("admission-1", "services.admission", 1, ["--admission-id", "admission-1"]),
        ("breaker-0", "services.breaker", 0, []), ("breaker-1", "services.breaker", 2, []),
        ("router-0", "services.router", 1, ["--router-id", "router-0"]),
        ("router-1", "services.router", 2, ["--router-id", "router-1"]),
        ("metering-0", "services.metering", 2, meter), ("metering-1", "services.metering", 0, meter),
        *((f"worker-{i}", "services.worker", i % 3, ["--worker-id", f"sim-{i}", *sim]) for i in range(4)),
        ("edge-0", "services.edge", 0, ["--host", edge_hosts[0], *edge]),
        ("edge-1", "services.edge", 1, ["--host", edge_hosts[1], *edge]),
    ]


class ClusterMesh:
    def __init__(self, folder: Path, model_path: Path, database_url: str, kv_blocks: int = 16,
                 hosts: NetnsHosts | None = None) -> None:
        self.folder, self.kv_blocks, self.hosts = folder, kv_blocks, hosts
        self.edge_port = free_port()
        self.base_url = ""  # the balancer's, once started
        addresses = [hosts.address(i) if hosts else "127.0.0.1" for i in range(3)]
        self.cluster = Supercluster(plan_supercluster(["c"], 3, folder / "nats", witness=False, hosts=addresses),
                                    lambda server: self._prefix(int(server.name.rpartition("-")[2])))
        self.group = ProcessGroup(folder / "logs")
        self.edges = [(addresses[0], self.edge_port), (addresses[1], self.edge_port)]
        self.database_url = database_url
        self.replicas = layout(model_path, database_url, (addresses[0], addresses[1]), self.edge_port, kv_blocks)
        self.children: dict[str, object] = {}
        self.edge_secret = secrets.token_hex(16)
        self._balancers: list[TcpBalancer] = []

    def _prefix(self, host: int) -> list[str]:
        return self.hosts.prefix(host) if self.hosts else []

    @property
    def servers(self) -> list[str]:
        return [s.name for s in self.cluster.plan.servers("c")]

    def url(self, index: int) -> str:
        """Server ``index``'s URL: a replica connects to its own host's server and learns the others from it."""
        return self.cluster.plan.servers("c")[index].url

    @property
    def capacity_tokens(self) -> int:
        return int(4 * self.kv_blocks * BLOCK * ADMIT_FRACTION)

    async def start(self, timeout_s: float = 120.0) -> None:
        if self.hosts:
            await asyncio.to_thread(self.hosts.start)
            self._reach_postgres(await self._balancer(self.hosts.gateway, [_host_port(self.database_url)]))
        self.base_url = f"http://127.0.0.1:{(await self._balancer('127.0.0.1', self.edges)).port}/v1"
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
            self.children[name] = self.group.spawn(name, [*self._prefix(server), sys.executable, "-m", module, *args],
                                                   env)
        await self.wait_ready(timeout_s)

    async def _balancer(self, host: str, targets: list[tuple[str, int]]) -> TcpBalancer:
        balancer = TcpBalancer(host, targets)
        await balancer.start()
        self._balancers.append(balancer)
        return balancer

    def _reach_postgres(self, forwarder: TcpBalancer) -> None:
        """Metering's database URL through the forwarder on the bridge (Postgres listens on loopback only)."""
        url = urllib.parse.urlsplit(self.database_url)
        netloc = f"{url.netloc.rpartition('@')[0]}@{forwarder.listen_host}:{forwarder.port}".lstrip("@")
        moved = urllib.parse.urlunsplit(url._replace(netloc=netloc))
        self.replicas = [(name, module, host, [moved if arg == self.database_url else arg for arg in args])
                         for name, module, host, args in self.replicas]

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
        return all(_edge_ready(host, port) for host, port in self.edges)

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
        for balancer in self._balancers:
            balancer.close()
        if self.hosts:
            self.hosts.stop()


def _edge_ready(host: str, port: int) -> bool:
    try:
        request = urllib.request.Request(f"http://{host}:{port}/ready", headers={"Authorization": f"Bearer {KEY}"})
        with urllib.request.urlopen(request, timeout=2) as response:
            status = json.loads(response.read())
        return status.get("status") == "ready" and int(status.get("workers", 0)) >= 4
    except Exception:
        return False


def _host_port(url: str) -> tuple[str, int]:
    parts = urllib.parse.urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or 5432
