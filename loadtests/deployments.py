"""Failover across deployments under load: two deployments (a, b) on one supercluster (two NATS clusters joined
by a gateway, plus the witness), each with its router, admission and K sim workers as processes; one edge local
to a, in front; one ledger (a's metering). Every worker of a is SIGKILLed while N streams run on them.

Phases, the same request bodies as the undisturbed phase (prompt token ids, temperature 0, a seed each):

    undisturbed    N streams at once, no kill: the reference texts, all served by a
    a lost         the same N streams; at ``--kill-at`` of the way every worker of a is SIGKILLed: each stream must
                   move to b (token-exact migration) and complete with the undisturbed text
    during outage  M new streams sent right after the kill (a's dead workers are still in its registry for their
                   TTL): served by b, exact, none errors
    a back         K new workers of a start; recovery: from their start until a request is served by a again
                   (a's breaker cools down and its probe closes it); then N streams, all served by a

Per phase: client errors by kind, hung (must be 0), texts equal to the undisturbed run, where the streams were
served (the response header), and the ledger's rows against what the clients were told (lost and doubled must be
0). The figures' rules: loadtests/lib/migration_report.py.

    python -m loadtests.deployments --out docs/results/deployments
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from contextlib import AsyncExitStack
from pathlib import Path

import openai

from infermesh.local import LocalMesh
from infermesh.nats_topology import plan_supercluster
from infermesh.supercluster import Supercluster
from loadtests.lib.kill_bench import MODEL, Fleet, ledger_rows, stream_one
from loadtests.lib.migration_report import Kill, Seen, overall, phase_report, write_report
from loadtests.migration import request_body
from shared.bus import Bus
from shared.schema import RouteDecisionEvent

KEY = "deployments-key"  # the edge's dev key: team "default"


def _say(message: str) -> None:
    print(f"deployments: {message}", file=sys.stderr, flush=True)


class Bench:
    """The two deployments, their fleets, where each request runs, and the phases."""

    def __init__(self, args: argparse.Namespace, meshes: dict[str, LocalMesh], fleets: dict[str, Fleet]) -> None:
        self.args, self.meshes, self.fleets = args, meshes, fleets
        self.placement: dict[str, str] = {}  # request id -> the worker its latest attempt was routed to
        self.edge = meshes["a"].edge
        self.client = openai.AsyncOpenAI(base_url=meshes["a"].base_url, api_key=KEY, max_retries=0,
                                         timeout=args.hang_s + 30)
        self.probes = 0  # short requests sent to find where new traffic goes (billed too)

    async def watch_decisions(self, bus: Bus) -> None:
        async def on_decision(event: RouteDecisionEvent, _raw: object) -> None:
            self.placement[event.request_id.partition("-")[0]] = event.worker_id  # attempts: <id>-a<n>

        await bus.subscribe(bus.subjects.route_decisions, RouteDecisionEvent, on_decision)

    def live(self, name: str) -> set[str]:
        link = next(link for link in self.edge.mesh.links if link.name == name)
        return {w.worker_id for w in link.directory.live()}

    async def settle(self, timeout_s: float = 60.0) -> None:
        """Until the edge sees exactly the running worker processes of each deployment."""
        deadline = time.monotonic() + timeout_s
        while any(self.live(name) != fleet.alive() for name, fleet in self.fleets.items()):
            if time.monotonic() > deadline:
                seen = {n: (self.live(n), f.alive()) for n, f in self.fleets.items()}
                raise RuntimeError(f"fleets not settled (edge's view, processes): {seen}")
            await asyncio.sleep(0.05)

    async def served_by(self) -> str:
        self.probes += 1
        raw = await self.client.completions.with_raw_response.create(model=MODEL, prompt=[9, 9, 9], max_tokens=2)
        return raw.headers.get("x-infermesh-deployment", "")

    def streams(self, count: int, seen: list[Seen]) -> list[asyncio.Task]:
        return [asyncio.create_task(stream_one(self.client, request_body(i, self.args.max_tokens), seen[i], {},
                                               self.args.hang_s)) for i in range(count)]

    async def undisturbed(self) -> tuple[list[Seen], float, float]:
        seen = [Seen(i) for i in range(self.args.requests)]
        started = time.monotonic()
        await asyncio.gather(*self.streams(len(seen), seen))
        return seen, started, max(t for s in seen for t in s.chunk_times[-1:]) - started

    async def a_lost(self, reference_s: float) -> tuple[list[Seen], list[Kill], float, list[Seen], float]:
        """The N streams, every worker of a SIGKILLed ``kill_at`` of the way; M arrivals right after."""
        seen = [Seen(i) for i in range(self.args.requests)]
        started = time.monotonic()
        tasks = self.streams(len(seen), seen)
        await asyncio.wait(tasks, timeout=self.args.kill_at * reference_s)
        kills, now = [], time.monotonic()
        for worker_id in sorted(self.fleets["a"].alive()):
            hit = [s.request_id for s in seen if s.request_id and s.finish_reason is None and not s.error
                   and self.placement.get(s.request_id) == worker_id]
            self.fleets["a"].kill(worker_id)
            kills.append(Kill(worker_id, now, (now - started) / reference_s, hit, 0,
                              [len(s.chunk_times) for s in seen if s.request_id in hit], "(none: a is down)"))
        _say(f"a lost: SIGKILLed every worker of a ({len(kills)}) with {sum(len(k.hit) for k in kills)} streams "
             f"open, {now - started:.1f}s in")
        arrivals = [Seen(i) for i in range(self.args.arrivals)]
        arrivals_started = time.monotonic()
        arrival_tasks = self.streams(len(arrivals), arrivals)
        await asyncio.gather(*tasks, *arrival_tasks)
        return seen, kills, started, arrivals, arrivals_started

    async def a_back(self) -> tuple[float, list[Seen], float]:
        """K new workers of a; seconds until new traffic is served by a again; then the N streams."""
        await self.settle()  # a's dead workers have left its registry
        started = time.monotonic()
        for _ in range(self.args.workers):
            self.fleets["a"].start()
        while await self.served_by() != "a":
            if time.monotonic() - started > 60:
                raise RuntimeError("traffic did not return to a within 60 s")
            await asyncio.sleep(0.25)
        recovery_s = time.monotonic() - started
        _say(f"a back: new traffic served by a {recovery_s:.1f}s after its workers started")
        await self.settle()
        seen = [Seen(i) for i in range(self.args.requests)]
        phase_started = time.monotonic()
        await asyncio.gather(*self.streams(len(seen), seen))
        return recovery_s, seen, phase_started


async def start(args: argparse.Namespace, state: Path, stack: AsyncExitStack) -> Bench:
    """The supercluster, each deployment's router and admission, a's metering (a fresh ledger) and the edge
    in-process, the sim workers as processes; all stopped by ``stack``."""
    from infermesh.models import make_tiny_llama
    from services.metering.db import migrate

    supercluster = Supercluster(plan_supercluster(["a", "b"], 1, state / "nats"))
    supercluster.start(timeout_s=60)
    stack.callback(supercluster.stop)
    model = make_tiny_llama(state / "tiny")
    database_url = args.database_url or f"sqlite+aiosqlite:///{state / 'ledger.db'}"
    await migrate(database_url)
    suffix = f"{random.randrange(16**6):06x}"
    namespaces = {name: f"dep{name}{suffix}" for name in ("a", "b")}
    meshes = {name: LocalMesh(supercluster.plan.url(name), ns, dev_key=KEY) for name, ns in namespaces.items()}
    fleets = {name: Fleet(supercluster.plan.url(name), ns, model, args.sim_itl_ms, args.ttl_s, state, prefix=name)
              for name, ns in namespaces.items()}
    for mesh in meshes.values():
        stack.push_async_callback(mesh.stop)
        await mesh.start_router()
        await mesh.start_admission()
    await meshes["a"].start_metering(database_url=database_url, sync_s=0.5)
    await meshes["a"].start_edge(deployment="a", deployments=",".join(f"{n}={ns}" for n, ns in namespaces.items()),
                                 edge_secret=meshes["a"].edge_secret, max_migrations=args.max_migrations)
    for fleet in fleets.values():
        stack.callback(fleet.stop)  # before the meshes' (last in, first out)
        for _ in range(args.workers):
            fleet.start()
    bench = Bench(args, meshes, fleets)
    bench.database_url = database_url  # type: ignore[attr-defined]
    for name, ns in namespaces.items():
        bus = await Bus.connect(supercluster.plan.url(name), ns, f"deployments-bench-{name}")
        stack.push_async_callback(bus.close)
        await bench.watch_decisions(bus)
    return bench


def where(seen: list[Seen]) -> dict[str, int]:
    return dict(Counter(s.deployment or "(none)" for s in seen))


async def main_async(args: argparse.Namespace) -> dict:
    state = Path(tempfile.mkdtemp(prefix="im-deployments-"))
    async with AsyncExitStack() as stack:
        bench = await start(args, state, stack)
        await bench.settle(90)
        await asyncio.wait_for(_until_leaders(bench), 30)
        _say(f"{args.workers} workers in each of a and b (logs: {state})")
        reference, ref_started, reference_s = await bench.undisturbed()
        _say(f"undisturbed: {len(reference)} streams in {reference_s:.1f}s, served by {where(reference)}")
        lost, kills, lost_started, arrivals, arrivals_started = await bench.a_lost(reference_s)
        recovery_s, back, back_started = await bench.a_back()
        runs = [("undisturbed", reference, [], ref_started), ("a lost", lost, kills, lost_started),
                ("during outage", arrivals, [], arrivals_started), ("a back", back, [], back_started)]
        expected = sum(1 for _n, seen, _k, _t in runs for s in seen if s.request_id) + bench.probes
        rows = await ledger_rows(bench.database_url, expected, args.settle_s)  # type: ignore[attr-defined]
        usage_lost = bench.edge.mesh.usage.lost
        failovers = bench.edge.mesh.failover.stats["failovers"]
    texts = {s.index: s.text for s in reference}
    phases = []
    for name, seen, phase_kills, started in runs:
        phase = phase_report(name, seen, phase_kills, rows, texts, started, args.max_tokens)
        phase["served_by"] = where(seen)
        phases.append(phase)
    return {"requests": args.requests, "arrivals": args.arrivals, "workers_per_deployment": args.workers,
            "max_tokens": args.max_tokens, "sim_itl_ms": args.sim_itl_ms, "heartbeat_ttl_s": args.ttl_s,
            "max_migrations": args.max_migrations, "kill_at": args.kill_at, "hang_s": args.hang_s,
            "ledger": "postgres" if args.database_url.startswith("postgres") else "sqlite",
            "undisturbed_s": round(reference_s, 3), "recovery_s": round(recovery_s, 3),
            "probe_requests": bench.probes, "ledger_rows": sum(len(r) for r in rows.values()),
            "edge_failovers": failovers, "usage_lost_by_edge": usage_lost, "phases": phases,
            "overall": overall(phases)}


async def _until_leaders(bench: Bench) -> None:
    while not all(any(x.leadership.is_leader for x in m.admissions) for m in bench.meshes.values()):
        await asyncio.sleep(0.05)


def failures(report: dict) -> list[str]:
    """What must not happen: an error, a hang, a text off the reference, a bill lost or doubled; the undisturbed
    and the a-back streams served anywhere but a; the outage's new streams anywhere but b."""
    bad = []
    for p in report["phases"]:
        if p["errors"] or p["hung"] or p["exact"] != p["requests"]:
            bad.append(f"{p['phase']}: errors {p['errors']}, hung {p['hung']}, "
                       f"{p['requests'] - p['exact']} texts off the reference")
        if p["lost"] or p["doubled"] or p["mismatched"]:
            bad.append(f"{p['phase']}: lost {p['lost']}, doubled {p['doubled']}, mismatched {p['mismatched']}")
    expected = {"undisturbed": "a", "a lost": "a", "during outage": "b", "a back": "a"}
    for p in report["phases"]:
        if set(p["served_by"]) != {expected[p["phase"]]}:
            bad.append(f"{p['phase']}: served by {p['served_by']}, expected all {expected[p['phase']]}")
    if report["ledger_rows"] != report["overall"]["requests"] + report["probe_requests"]:
        bad.append(f"ledger rows {report['ledger_rows']} != requests {report['overall']['requests']} "
                   f"+ probes {report['probe_requests']}")
    return bad


def served_table(report: dict) -> str:
    rows = "\n".join(f"| {p['phase']} | {p['requests']} | "
                     + ", ".join(f"{d} {n}" for d, n in sorted(p["served_by"].items())) + " |"
                     for p in report["phases"])
    return ("\n| phase | streams | served by (x-infermesh-deployment) |\n|---|---|---|\n" + rows
            + f"\n\nRecovery: new traffic served by a again {report['recovery_s']:.1f} s after its new workers "
              f"started. Ledger: {report['ledger_rows']} rows for {report['overall']['requests']} streams + "
              f"{report['probe_requests']} probe requests ({report['ledger']}).\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=16, help="N: streams per phase, all at once")
    parser.add_argument("--arrivals", type=int, default=8, help="M: new streams sent right after the kill")
    parser.add_argument("--workers", type=int, default=2, help="K sim worker processes per deployment")
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--sim-itl-ms", type=float, default=20.0, help="the sim's time per decode step")
    parser.add_argument("--ttl-s", type=float, default=2.0, help="the workers' registry TTL (heartbeat: 0.5 s)")
    parser.add_argument("--kill-at", type=float, default=0.4, help="share of the undisturbed duration")
    parser.add_argument("--max-migrations", type=int, default=3, help="the edge's --max-migrations")
    parser.add_argument("--hang-s", type=float, default=45.0, help="a stream not over by then is hung")
    parser.add_argument("--settle-s", type=float, default=2.0, help="ledger row count unchanged this long")
    parser.add_argument("--database-url", default="", help="the ledger (default: a fresh SQLite file)")
    parser.add_argument("--out", default="", help="write deployments.json, deployments.png and table.md here")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    report = {"command": "python -m loadtests.deployments " + " ".join(sys.argv[1:]),
              **asyncio.run(main_async(args))}
    slim = {**report, "phases": [{k: v for k, v in p.items() if k != "streams"} for p in report["phases"]]}
    print(json.dumps(slim, indent=2))
    if args.out:
        write_report(report, Path(args.out), "deployments", served_table(report))
    bad = failures(report)
    if bad:
        _say("FAILED: " + "; ".join(bad))
        sys.exit(1)


if __name__ == "__main__":
    main()
