"""A node lost and nothing lost (issue 19.4): the mesh spread over a 3-server NATS cluster (R3 streams and
buckets; 2 edges, 2 routers, 2 admission, 2 breakers, 2 metering, 4 sim workers: loadtests/lib/cluster_mesh.py)
under streamed and plain load, ledger on Postgres. Three hosts: each server with its services in a network
namespace of its own (``--hosts netns``, the default where root can make them), or all on loopback. First the
NATS server leading the usage stream is SIGKILLed; then one replica of each service, one after another (a worker,
a metering, a breaker, a router, the admission leader, an edge). Clients retry what fails (a closed loop sends the
next request).

Reported per phase (before, after the NATS kill, after the replica kills): requests, finished, client errors by
kind, hung (must be 0), usage shown to clients against the ledger's rows (lost and doubled must be 0), streams
cut after tokens and whether they were billed; time to the first success after each kill, and until completions
per second are back to 80% of the rate before; admission's leased tokens against its capacity, sampled (must
never exceed it). JSON + PNG + markdown.

    python -m loadtests.cluster_faults --out docs/results/cluster_faults
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Awaitable

from loadtests.faults import _create_database, _drop_database
from loadtests.lib.cluster_mesh import KEY, MODEL, ClusterMesh
from loadtests.lib.cluster_report import recovery_s, write_report
from loadtests.lib.faults_load import Load, first_success_after
from loadtests.lib.faults_report import ledger_rows, phase_report
from loadtests.lib.netns_hosts import NetnsHosts, netns_available


def _say(message: str) -> None:
    print(f"cluster_faults: {message}", file=sys.stderr, flush=True)


def _on_signals(main: asyncio.Task) -> None:
    """SIGTERM stops the run through its ``finally`` (the hosts, servers and services go); SIGUSR1 prints where
    every task of the run waits (a run that seems stuck says where)."""
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, main.cancel)

    def dump() -> None:
        for task in asyncio.all_tasks(loop):
            _say(f"task {task.get_name()}:")
            task.print_stack(limit=12, file=sys.stderr)
    loop.add_signal_handler(signal.SIGUSR1, dump)


async def _sample(mesh: ClusterMesh, samples: list[dict], t0: float) -> None:
    """Every 0.25 s: admission's leased tokens and the registered workers (as a probe connected to any server)."""
    bus = await mesh.bus()
    try:
        while True:
            try:
                leased, workers = await mesh.leased_tokens(bus), len(await mesh.workers(bus))
                samples.append({"t": time.monotonic() - t0, "leased_tokens": leased, "workers": workers})
            except Exception as exc:  # the probe's server lost a moment: the next sample
                samples.append({"t": time.monotonic() - t0, "error": type(exc).__name__})
            await asyncio.sleep(0.25)
    finally:
        await bus.close()


async def _within(step: Awaitable, limit_s: float, what: str) -> None:
    """A step that must end: past ``limit_s`` the run fails loudly, naming it (a run stuck for ~6 minutes once,
    in a step it could not name; SIGUSR1 prints every task's stack)."""
    try:
        await asyncio.wait_for(step, limit_s)
    except asyncio.TimeoutError:
        raise RuntimeError(f"{what} did not end within {limit_s:g} s") from None


async def _until_metered(mesh: ClusterMesh, limit_s: float = 120.0) -> float:
    """Until metering's consumer holds nothing pending or unacked: the ledger has every usage message the stream
    has (a killed replica's unacked messages come back after its ack wait, 30 s). Seconds it took."""
    from services.metering.config import MeteringConfig

    bus, start = await mesh.bus(), time.monotonic()
    try:
        while time.monotonic() - start < limit_s:
            try:
                info = await bus.ledger_js.consumer_info(bus.subjects.usage_stream, MeteringConfig().consumer)
                if info.num_pending == 0 and info.num_ack_pending == 0:
                    return time.monotonic() - start
            except Exception:  # a server being elected: ask again
                pass
            await asyncio.sleep(0.5)
        raise RuntimeError(f"metering still had usage to write after {limit_s:.0f} s")
    finally:
        await bus.close()


async def _usage_leader(mesh: ClusterMesh) -> str:
    bus = await mesh.bus()
    try:
        return (await bus.ledger_js.stream_info(bus.subjects.usage_stream)).cluster.leader
    finally:
        await bus.close()


async def run(args: argparse.Namespace) -> dict:
    from infermesh.models import make_tiny_llama

    state = Path(tempfile.mkdtemp(prefix="im-cluster-"))
    db_name, database_url = await _create_database(args.postgres_admin_url)
    hosts = NetnsHosts(3) if args.hosts == "netns" else None
    mesh = ClusterMesh(state, make_tiny_llama(state / "tiny"), database_url, kv_blocks=args.kv_blocks, hosts=hosts)
    kills: list[dict] = []
    samples: list[dict] = []
    _on_signals(asyncio.current_task())
    try:
        started = time.monotonic()
        await mesh.start()
        _say(f"ready in {time.monotonic() - started:.1f}s (logs: {state})")
        load = Load(mesh.base_url, KEY, MODEL, max_tokens=args.max_tokens, hang_s=args.hang_s)
        t0 = time.monotonic()
        driver = asyncio.create_task(load.run(args.concurrency))
        sampler = asyncio.create_task(_sample(mesh, samples, t0))
        await asyncio.sleep(args.before_s)

        server = await _usage_leader(mesh)
        killed_at = time.monotonic()
        mesh.kill_nats(server)
        _say(f"SIGKILLed NATS server {server} (the usage stream's leader)")
        first = await first_success_after(mesh.base_url, KEY, MODEL, killed_at, 60)
        kills.append({"what": f"nats {server}", "t": killed_at - t0, "first_success_s": first})
        await asyncio.sleep(max(0.0, args.between_s - (time.monotonic() - killed_at)))

        # one after another, the edge last: a request whose worker and edge die at once is billed by nobody (the
        # worker that generated it and the edge that streamed it are both gone: a double fault, not measured here)
        victims = ["worker-1", "metering-0", "breaker-0", "router-0", mesh.admission_leader(), "edge-1"]
        killed_at = time.monotonic()
        for i, name in enumerate(victims):
            if i:
                await asyncio.sleep(args.kill_gap_s)
            mesh.kill(name)
        last_at = time.monotonic()
        _say(f"SIGKILLed {', '.join(victims)}, {args.kill_gap_s:g} s apart")
        first = await first_success_after(mesh.base_url, KEY, MODEL, last_at, 60)
        kills.append({"what": "one replica of each service", "victims": victims, "t": killed_at - t0,
                      "last_t": last_at - t0, "first_success_s": first})  # (after the last kill)
        _say(f"first success {first}s after the last kill")
        await asyncio.sleep(args.after_s)
        load.stop()
        await _within(driver, args.hang_s + 15, "the clients' last requests")
        sampler.cancel()
        await _within(asyncio.gather(sampler, return_exceptions=True), 15, "the sampler's stop")
        _say(f"load stopped; waiting {args.settle_s:g} s for orphan reports, then for metering")
        await asyncio.sleep(args.settle_s)  # orphan reports of the killed edge reach a surviving one, and are billed
        metered_s = await _until_metered(mesh)
        _say(f"metered after {metered_s:.1f} s; reading the ledger")
        rows = await ledger_rows(database_url, settle_s=2.0)
    finally:
        mesh.stop()
        if not args.keep_database:
            await _drop_database(args.postgres_admin_url, db_name)
    bounds = [0.0, kills[0]["t"], kills[1]["t"], float("inf")]
    phases = []
    for name, low, high in zip(("before", "after the NATS kill", "after the replica kills"), bounds, bounds[1:],
                               strict=False):
        outcomes = [o for o in load.outcomes if low <= o.started - t0 < high]
        phases.append(phase_report({"fault": name, "outcomes": outcomes, "first_success_s": None, "back_s": None},
                                   rows))
    unbilled = [o.request_id for o in load.outcomes if o.error and o.chunks and o.request_id not in rows]
    for kill in kills:
        kill["throughput_back_s"] = recovery_s(load.outcomes, t0, kill.get("last_t", kill["t"]), bounds[1])
    leased = [s["leased_tokens"] for s in samples if "leased_tokens" in s]
    return {"command": "python -m loadtests.cluster_faults " + " ".join(args.argv), "hosts": args.hosts,
            "concurrency": args.concurrency, "max_tokens": args.max_tokens, "capacity_tokens": mesh.capacity_tokens,
            "max_leased_tokens": max(leased, default=0), "metered_after_s": metered_s, "samples": samples,
            "kills": kills, "phases": phases, "unbilled_cut_streams": unbilled,
            "timeline": [{"started": o.started - t0, "ended": o.ended - t0, "error": o.error} for o in load.outcomes]}


def failed(report: dict) -> list[str]:
    """The guarantees: nothing hung, lost, doubled or left unbilled; admission never past its capacity."""
    bad = [f"{p['fault']}: {k} {p[k]}" for p in report["phases"]
           for k in ("hung", "lost", "doubled", "unbilled_cut_streams") if p[k]]
    if report["max_leased_tokens"] > report["capacity_tokens"]:
        bad.append(f"admission leased {report['max_leased_tokens']} tokens of {report['capacity_tokens']}")
    return bad


def unrecovered(report: dict) -> list[str]:
    """What did not come back within the run (reported, not a failure of the guarantees above)."""
    return [f"no success within 60 s after {k['what']}" for k in report["kills"] if k["first_success_s"] is None]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=16, help="client loops, half streamed, half plain")
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--kv-blocks", type=int, default=16, help="per sim worker, of 16 tokens: the capacity")
    parser.add_argument("--before-s", type=float, default=10.0)
    parser.add_argument("--between-s", type=float, default=15.0, help="from the NATS kill to the replica kills")
    parser.add_argument("--after-s", type=float, default=15.0)
    parser.add_argument("--kill-gap-s", type=float, default=2.0, help="between the replica kills")
    parser.add_argument("--hang-s", type=float, default=45.0, help="a request unanswered this long hung")
    parser.add_argument("--settle-s", type=float, default=15.0,
                        help="after the load: for a dead edge's workers to report its requests to another edge")
    parser.add_argument("--postgres-admin-url", default=os.environ.get(
        "INFERMESH_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres"))
    parser.add_argument("--keep-database", action="store_true")
    parser.add_argument("--hosts", choices=("netns", "loopback"), default="",
                        help="each NATS server and its services in a network namespace of its own (netns: root "
                             "and iproute2), or all on the machine's loopback; default netns where it works")
    parser.add_argument("--out", default="", help="write cluster_faults.{json,png,md} here")
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    if not args.hosts:
        why = netns_available()
        args.hosts = "loopback" if why else "netns"
        if why:
            _say(f"hosts on loopback: {why}")
    report = asyncio.run(run(args))
    report["failed"], report["unrecovered"] = failed(report), unrecovered(report)
    summary = {k: v for k, v in report.items() if k not in ("samples", "timeline")}
    print(json.dumps(summary, indent=2))
    if args.out:
        write_report(report, Path(args.out))
    if report["failed"] and argv is None:
        _say("FAILED: " + "; ".join(report["failed"]))
        sys.exit(1)
    return report


if __name__ == "__main__":
    main()
