"""The servers of a SuperclusterPlan (``infermesh/nats_topology.py``) as child processes, and a CLI.

    with Supercluster(plan_supercluster(["east", "west"], 1, folder)) as sc:   # started and ready
        sc.kill_cluster("west")          # SIGKILL: a lost region
        sc.pause_cluster("west")         # SIGSTOP: a hung or cut-off region (resume_cluster undoes it)
        sc.start_cluster("west")         # back with the same names, ports and stores; waits until ready

    python -m infermesh.supercluster east west --folder /tmp/sc    # runs until Ctrl-C; writes urls.json

Ready means: every running server has routes to its running cluster peers, gateways out to every other
running cluster, and a healthy JetStream (``/healthz``: a meta leader known, its assets current).
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Iterable, Sequence

from infermesh.nats_topology import ServerSpec, SuperclusterPlan, plan_supercluster
from infermesh.processes import ProcessGroup, nats_server_binary
from shared.ports import wait_for_port


class SuperclusterError(RuntimeError):
    """A server did not start, or the supercluster did not become ready in time."""


class Supercluster:
    """The plan's nats-servers as child processes: start, kill and restart whole clusters or single servers."""

    def __init__(self, plan: SuperclusterPlan, prefix: Callable[[ServerSpec], list[str]] = lambda _server: []) -> None:
        """``prefix(server)``: what goes before that server's command (``ip netns exec <its host>``)."""
        self.plan = plan
        self._prefix = prefix
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._group = ProcessGroup(plan.folder)

    def __enter__(self) -> "Supercluster":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------ processes
    def start(self, timeout_s: float = 30.0) -> None:
        """Write every config, start every server, and wait until the supercluster is ready."""
        self.plan.write_configs()
        try:
            self._start(self.plan.servers())
            self.wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise

    def start_cluster(self, cluster: str, timeout_s: float = 30.0) -> None:
        """Start ``cluster``'s servers again (same names, ports and stores) and wait until all are ready."""
        self._start(self.plan.servers(cluster))
        self.wait_ready(timeout_s)

    def start_server(self, name: str) -> None:
        self._start([self.plan.server(name)])

    def kill_cluster(self, cluster: str) -> None:
        """SIGKILL every server of ``cluster`` (no clean shutdown: what a lost region looks like)."""
        for server in self.plan.servers(cluster):
            self.kill_server(server.name)

    def kill_server(self, name: str) -> None:
        proc = self._procs.pop(name, None)
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)

    def pause_cluster(self, cluster: str) -> None:
        """SIGSTOP every server of ``cluster``: its sockets stay open and nothing answers (a hung region, or a
        partition before the peers' pings notice)."""
        self._signal_cluster(cluster, signal.SIGSTOP)

    def resume_cluster(self, cluster: str) -> None:
        self._signal_cluster(cluster, signal.SIGCONT)

    def _signal_cluster(self, cluster: str, sig: int) -> None:
        procs = [p for s in self.plan.servers(cluster) if (p := self._procs.get(s.name)) and p.poll() is None]
        for proc in procs:
            proc.send_signal(sig)
        if sig == signal.SIGSTOP:  # a signal is delivered asynchronously: return once each one has stopped
            deadline = time.monotonic() + 5
            while not all(_stopped(proc.pid) for proc in procs) and time.monotonic() < deadline:
                time.sleep(0.005)

    def stop(self) -> None:
        """SIGTERM every server, then SIGKILL what is left after 10 s."""
        procs, self._procs = list(self._procs.values()), {}
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)  # a paused server would not act on SIGTERM
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)

    def running(self) -> list[str]:
        return [name for name, proc in self._procs.items() if proc.poll() is None]

    def _start(self, servers: Iterable[ServerSpec]) -> None:
        started = []
        for server in servers:
            if server.name in self.running():
                continue
            server.store_dir.mkdir(parents=True, exist_ok=True)
            # ProcessGroup's children log to <folder>/<name>.log and die with the thread that started them
            # (PR_SET_PDEATHSIG is per thread): start servers from a thread that lives as long as they should
            child = self._group.spawn(server.name, [*self._prefix(server), nats_server_binary(), "-c",
                                                    str(self.plan.config_path(server))])
            self._procs[server.name] = child.popen
            started.append(server)
        for server in started:
            if not wait_for_port(server.ports.client, 15, server.host):
                raise SuperclusterError(f"{server.name} did not start: {self.tail(server.name)}")

    # ------------------------------------------------------------ readiness
    def wait_ready(self, timeout_s: float = 30.0, clusters: Sequence[str] | None = None) -> None:
        """Until every running server of ``clusters`` (default: all) has its routes to its running peers and its
        gateways to every other running cluster up, and JetStream healthy (a meta leader known, assets current).
        A paused cluster's servers count as running: they never become ready until resumed."""
        deadline = time.monotonic() + timeout_s
        running = set(self.running())
        live_clusters = {s.cluster for s in self.plan.servers() if s.name in running}
        servers = [s for s in self.plan.servers() if s.name in running and (clusters is None or s.cluster in clusters)]
        waiting = {s.name: "not asked yet" for s in servers}
        while waiting:
            for server in servers:
                if server.name in waiting:
                    why = self.not_ready(server, live_clusters - {server.cluster})
                    if why:
                        waiting[server.name] = why
                    else:
                        waiting.pop(server.name)
            if waiting and time.monotonic() > deadline:
                raise SuperclusterError(f"not ready after {timeout_s} s: {waiting}")
            if waiting:
                time.sleep(0.1)

    def not_ready(self, server: ServerSpec, other_clusters: set[str]) -> str:
        """Why ``server`` is not ready yet ("" once it is)."""
        routes = monitor(server, "routez")
        if routes is None:
            return "monitoring port not answering"
        peers = {s.name for s in self.plan.servers(server.cluster) if s.name in self.running()} - {server.name}
        routed = {route.get("remote_name") for route in routes.get("routes") or []}
        if not peers <= routed:
            return f"routes to {sorted(peers - routed)} not up"
        gateways = monitor(server, "gatewayz") or {}
        # outbound only: a server dials one server of each other cluster, but is dialled by only some of theirs
        connected = set(gateways.get("outbound_gateways") or {})
        if not other_clusters <= connected:
            return f"gateways to {sorted(other_clusters - connected)} not up"
        health = monitor(server, "healthz")
        if health is None or health.get("status") != "ok":
            return f"JetStream not healthy: {health}"
        return ""

    def meta_leader(self, name: str) -> str:
        """The JetStream meta leader as ``name`` sees it ("" when it knows none)."""
        jsz = monitor(self.plan.server(name), "jsz") or {}
        return str((jsz.get("meta_cluster") or {}).get("leader") or "")

    def tail(self, name: str, lines: int = 20) -> str:
        try:
            text = self.plan.log_path(self.plan.server(name)).read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


def monitor(server: ServerSpec, endpoint: str, timeout_s: float = 1.0) -> dict | None:
    """``server``'s monitoring endpoint (``varz``, ``jsz``, ``gatewayz``, ``healthz``) as JSON; None if down."""
    try:
        with urllib.request.urlopen(f"{server.monitor_url}/{endpoint}", timeout=timeout_s) as reply:
            return json.loads(reply.read())
    except urllib.error.HTTPError as exc:  # healthz answers 503 with a JSON body while not healthy
        try:
            return json.loads(exc.read())
        except ValueError:
            return {"status": "error", "code": exc.code}
    except (OSError, ValueError):
        return None


def _stopped(pid: int) -> bool:
    """Whether the process is stopped by a signal (state T in /proc/<pid>/stat)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return True


def describe(plan: SuperclusterPlan) -> dict[str, object]:
    """What ``urls.json`` holds: each cluster's client URLs, and where each server's config and log are."""
    return {"clusters": {name: [s.url for s in plan.servers(name)] for name in plan.cluster_names},
            "servers": {s.name: {"url": s.url, "monitor": s.monitor_url, "config": str(plan.config_path(s)),
                                 "log": str(plan.log_path(s))} for s in plan.servers()}}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infermesh.supercluster",
                                     description="Start NATS clusters on loopback joined by gateways, one per "
                                                 "deployment, and keep them up until Ctrl-C.")
    parser.add_argument("clusters", nargs="+", help="cluster (deployment) names, e.g. east west")
    parser.add_argument("--folder", type=Path, required=True, help="configs, logs, stores and urls.json")
    parser.add_argument("--servers", type=int, default=1, help="servers per cluster (default 1)")
    parser.add_argument("--no-witness", dest="witness", action="store_false",
                        help="no one-server voting cluster (fine with three deployments or more)")
    parser.add_argument("--ping-interval-s", type=float, default=None,
                        help="server pings (a hung peer is dropped after 2 missed); default nats-server's")
    args = parser.parse_args(argv)
    plan = plan_supercluster(args.clusters, args.servers, args.folder.resolve(), witness=args.witness,
                             ping_interval_s=args.ping_interval_s)
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    with Supercluster(plan) as supercluster:
        (plan.folder / "urls.json").write_text(json.dumps(describe(plan), indent=1))
        for name in plan.cluster_names:
            print(f"{name}: {plan.url(name)}", flush=True)
        print(f"ready; details in {plan.folder / 'urls.json'}; Ctrl-C stops", flush=True)
        while not stopping:
            dead = [s for s in plan.servers() if s.name not in supercluster.running()]
            if dead:
                print(f"{dead[0].name} died:\n{supercluster.tail(dead[0].name)}", file=sys.stderr)
                return 1
            time.sleep(0.5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
