"""Several NATS clusters on one machine, joined by gateways into one supercluster: names, ports, configs. Pure.

    plan = plan_supercluster(["east", "west"], servers_per_cluster=1, folder=tmp)   # ports, names, stores
    plan.config(server)                          # one nats-server's config (a dict; JSON is config syntax)
    plan.url("east")                             # what a deployment's services and edges connect to
    with Supercluster(plan) as sc: ...           # the servers as processes: infermesh/supercluster.py

One deployment (its workers, routers, admission, edges) is one cluster here, and uses its own infermesh
namespace (``shared/deployments.py``): subjects ``<ns>.…`` and buckets ``<ns>_…`` never collide, so all of
them live in one account of one supercluster, and a client of any cluster reaches every deployment's
subjects, queue groups and KV buckets through the gateways (``docs/deployments.md``).

Invariants:

    | what             | how                                                                             |
    |------------------|---------------------------------------------------------------------------------|
    | server names     | ``<cluster>-<i>``, unique in the supercluster (JetStream needs that)            |
    | JetStream        | on everywhere, one store folder per server, no domain: a supercluster is one    |
    |                  | JetStream meta group (servers given different domains across a gateway form one |
    |                  | broken group instead), so placement, not domains, keeps each deployment's data  |
    | stream placement | a stream lands in the cluster of the client that created it                     |
    | witness          | on by default: a one-server cluster ``witness`` that serves no deployment and  |
    |                  | only votes, so with two deployments the meta group keeps its quorum when either |
    |                  | is lost (without it, the survivor's JetStream API stops: docs/deployments.md)   |
    | ports            | client, route, gateway and monitoring port per server, loopback, all distinct   |
    | restart          | a server started again keeps its name, ports and store: it rejoins              |
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from shared.bus_limits import MAX_PAYLOAD_BYTES

WITNESS = "witness"


@dataclass(frozen=True, slots=True)
class ServerPorts:
    client: int
    route: int
    gateway: int
    monitor: int


@dataclass(frozen=True, slots=True)
class ServerSpec:
    """One nats-server of the supercluster."""

    name: str
    cluster: str
    ports: ServerPorts
    store_dir: Path
    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.ports.client}"

    @property
    def route_url(self) -> str:
        return f"nats://{self.host}:{self.ports.route}"

    @property
    def gateway_url(self) -> str:
        return f"nats://{self.host}:{self.ports.gateway}"

    @property
    def monitor_url(self) -> str:
        return f"http://{self.host}:{self.ports.monitor}"


@dataclass(frozen=True, slots=True)
class SuperclusterPlan:
    """Every server of every cluster; ``config(server)`` is what that server runs with."""

    folder: Path
    clusters: tuple[tuple[str, tuple[ServerSpec, ...]], ...]
    # how often a server pings each connection (clients, routes, gateways) and how many unanswered pings drop
    # it: a hung or cut-off cluster is noticed after about ping_interval_s * ping_max (None: nats-server's 2 min)
    ping_interval_s: float | None = None
    ping_max: int = 2

    def __post_init__(self) -> None:
        names = [s.name for s in self.servers()]
        assert len(names) == len(set(names)), f"server names must be unique: {names}"
        assert len(self.clusters) >= 1 and all(servers for _, servers in self.clusters)

    @property
    def cluster_names(self) -> list[str]:
        return [name for name, _ in self.clusters]

    def servers(self, cluster: str | None = None) -> list[ServerSpec]:
        return [s for name, servers in self.clusters if cluster in (None, name) for s in servers]

    def server(self, name: str) -> ServerSpec:
        found = [s for s in self.servers() if s.name == name]
        if not found:
            raise KeyError(f"no server {name!r} in {[s.name for s in self.servers()]}")
        return found[0]

    def url(self, cluster: str) -> str:
        """A client URL of ``cluster`` (its first server; the client learns the others from it)."""
        servers = self.servers(cluster)
        if not servers:
            raise KeyError(f"no cluster {cluster!r} in {self.cluster_names}")
        return servers[0].url

    def config_path(self, server: ServerSpec) -> Path:
        return self.folder / f"{server.name}.json"

    def log_path(self, server: ServerSpec) -> Path:
        return self.folder / f"{server.name}.log"

    def config(self, server: ServerSpec) -> dict[str, object]:
        """The nats-server config: JetStream, routes to its cluster's peers, a gateway to every cluster."""
        # every server of the cluster, itself included (nats-server skips a route to itself): a one-server
        # cluster then has a route configured, without which JetStream refuses to start in clustered mode
        routes = [s.route_url for s in self.servers(server.cluster)]
        config: dict[str, object] = {
            "server_name": server.name,
            "listen": f"{server.host}:{server.ports.client}",
            "max_payload": MAX_PAYLOAD_BYTES,
            "http": f"{server.host}:{server.ports.monitor}",
            "jetstream": {"store_dir": str(server.store_dir)},
            "cluster": {"name": server.cluster, "listen": f"{server.host}:{server.ports.route}", "routes": routes},
            "gateway": {"name": server.cluster, "listen": f"{server.host}:{server.ports.gateway}",
                        "gateways": [{"name": name, "urls": [s.gateway_url for s in servers]}
                                     for name, servers in self.clusters if name != server.cluster]},
        }
        if self.ping_interval_s is not None:
            config["ping_interval"] = f"{max(1, round(self.ping_interval_s * 1000))}ms"
            config["ping_max"] = self.ping_max
        return config

    def write_configs(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        for server in self.servers():
            self.config_path(server).write_text(json.dumps(self.config(server), indent=1))


def plan_supercluster(cluster_names: Sequence[str], servers_per_cluster: int, folder: Path, *,
                      witness: bool = True, ping_interval_s: float | None = None, host: str = "127.0.0.1",
                      ports: Callable[[int], list[int]] | None = None,
                      hosts: Sequence[str] | None = None) -> SuperclusterPlan:
    """Names, ports (``ports(n)``: n distinct ones; default free ones) and store folders for
    ``servers_per_cluster`` servers per cluster.

    ``witness`` adds a one-server cluster named ``witness`` that serves no deployment and only votes in the
    JetStream meta group (leave it out with three deployments or more: any two then hold the quorum).
    ``hosts``: each server's own address, in order (servers on separate hosts); else all on ``host``."""
    names = list(cluster_names)
    if not names or len(names) != len(set(names)):
        raise ValueError(f"cluster names must be distinct and at least one: {names}")
    if WITNESS in names and witness:
        raise ValueError(f"{WITNESS!r} is the witness cluster's name")
    for name in names:
        if not name or not all(c.isalnum() or c in "-_" for c in name):
            raise ValueError(f"cluster name {name!r}: letters, digits, '-' and '_' only")
    if servers_per_cluster < 1:
        raise ValueError(f"servers_per_cluster must be at least 1, not {servers_per_cluster}")
    sizes = [(name, servers_per_cluster) for name in names] + ([(WITNESS, 1)] if witness else [])
    total = sum(size for _, size in sizes)
    if hosts is not None and len(hosts) != total:
        raise ValueError(f"{len(hosts)} hosts for {total} servers")
    numbers = iter((ports or free_ports)(4 * total))
    addresses = iter(hosts or [host] * total)
    clusters = tuple(
        (name, tuple(ServerSpec(f"{name}-{i}", name, ServerPorts(*(next(numbers) for _ in range(4))),
                                folder / "store" / f"{name}-{i}", next(addresses)) for i in range(size)))
        for name, size in sizes)
    return SuperclusterPlan(folder, clusters, ping_interval_s)


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports free right now: all bound at once, so the kernel cannot hand one out twice
    (``free_port()`` called in a loop can; a server then dies on "address already in use")."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()
