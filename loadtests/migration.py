"""Token-exact migration under SIGKILL: N streamed completions at once while the sim worker holding the most of
them is SIGKILLed at ~1/3 of the way and another at ~2/3, each replaced at once by a worker process under a new
id. With migration on, the edge sends each cut stream's prompt and tokens so far to another worker: the client's
one stream must be the undisturbed text, billed once. The control sends ``X-Infermesh-Max-Migrations: 0``, and
the same kills cut those streams.

Phases, the same N requests each (prompt token ids, temperature 0, a fixed seed each, ignore_eos):

    undisturbed   no kill: the reference texts, and the normal gap between chunks
    migration     the kills, migration on (the edge's --max-migrations)
    control       the kills, X-Infermesh-Max-Migrations: 0

Its own nats-server; a router, an edge and metering (a SQLite ledger) in-process (infermesh.local.LocalMesh);
K sim workers as processes. The figures and their rules: loadtests/lib/migration_report.py.

    python -m loadtests.migration --out docs/results/migration
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path

import openai

from infermesh.local import LocalMesh
from loadtests.lib.kill_bench import MODEL, Fleet, ledger_rows, start_nats, stream_one
from loadtests.lib.migration_report import Kill, Seen, overall, phase_report, write_report
from shared.bus import Bus
from shared.schema import RouteDecisionEvent

KEY = "migration-key"  # the edge's dev key: team "default"


def _say(message: str) -> None:
    print(f"migration: {message}", file=sys.stderr, flush=True)


def request_body(index: int, max_tokens: int) -> dict:
    """Request ``index``: the same prompt token ids and seed on every run and phase."""
    rng = random.Random(1000 + index)
    prompt = [rng.randrange(3, 1000) for _ in range(rng.randrange(16, 48))]
    return dict(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, seed=index + 1,
                extra_body={"ignore_eos": True})


class Bench:
    """The mesh, its fleet, where each request runs (the router's decisions), and the phases run on them."""

    def __init__(self, args: argparse.Namespace, mesh: LocalMesh, fleet: Fleet, bus: Bus) -> None:
        self.args, self.mesh, self.fleet, self.bus = args, mesh, fleet, bus
        self.placement: dict[str, str] = {}  # request id -> the worker its latest attempt was routed to
        self.client = openai.AsyncOpenAI(base_url=mesh.base_url, api_key=KEY, max_retries=0,
                                         timeout=args.hang_s + 30)

    async def watch_decisions(self) -> None:
        async def on_decision(event: RouteDecisionEvent, _raw: object) -> None:
            # an attempt after the first is routed as <request_id>-a<index> (services/edge/attempt.py)
            self.placement[event.request_id.partition("-")[0]] = event.worker_id

        await self.bus.subscribe(self.bus.subjects.route_decisions, RouteDecisionEvent, on_decision)

    def in_directory(self) -> set[str]:
        return {w.worker_id for w in self.mesh.edge.mesh.directory.live()}

    async def settle_fleet(self, timeout_s: float = 60.0) -> float:
        """Until the edge's and the router's live workers are exactly the running processes (killed ones gone)."""
        start = time.monotonic()
        while True:
            alive = self.fleet.alive()
            router = {w.worker_id for w in self.mesh.router.directory.live()}
            if self.in_directory() == alive == router and self.mesh.edge.mesh.is_ready():
                return time.monotonic() - start
            if time.monotonic() - start > timeout_s:
                raise RuntimeError(f"fleet not settled: processes {alive}, edge {self.in_directory()}, "
                                   f"router {router}")
            await asyncio.sleep(0.05)

    async def _live_after(self, kill: Kill) -> None:
        while kill.replacement not in self.in_directory():
            if self.fleet.procs[kill.replacement].poll() is not None:
                return
            await asyncio.sleep(0.02)
        kill.replacement_live_s = round(time.monotonic() - kill.at, 3)

    def _victim(self, seen: list[Seen], hit_before: set[str]) -> tuple[str, list[str]]:
        """The running worker with the most open streams an earlier kill hit (their second migration), then with
        the most open streams; and their request ids."""
        on: dict[str, list[str]] = {w: [] for w in sorted(self.fleet.alive())}
        for s in seen:
            worker = self.placement.get(s.request_id)
            if s.request_id and s.finish_reason is None and not s.error and worker in on:
                on[worker].append(s.request_id)
        victim = max(on, key=lambda w: (len(hit_before.intersection(on[w])), len(on[w])))
        return victim, on[victim]

    async def run_phase(self, name: str, kill_after_s: list[float], headers: dict,
                        reference_s: float) -> tuple[list[Seen], list[Kill], float, float]:
        """The N streams at once, a SIGKILL ``kill_after_s`` into the phase (each): what the clients saw, the
        kills, when the phase started and how long it took."""
        args = self.args
        seen = [Seen(i) for i in range(args.requests)]
        started = time.monotonic()
        tasks = [asyncio.create_task(stream_one(self.client, request_body(i, args.max_tokens), seen[i], headers,
                                                args.hang_s)) for i in range(args.requests)]
        kills: list[Kill] = []
        watchers: list[asyncio.Task] = []
        for after_s in kill_after_s:
            await asyncio.wait(tasks, timeout=max(0.0, started + after_s - time.monotonic()))
            if watchers:  # the last kill's replacement first: capacity stays K
                await asyncio.wait_for(watchers[-1], 60)
            hit_before = {r for k in kills for r in k.hit}
            victim, hit = self._victim(seen, hit_before)
            if not hit:
                _say(f"{name}: no open stream on any worker {after_s:.1f}s in: no kill")
                continue
            by_id = {s.request_id: s for s in seen}
            now = time.monotonic()
            self.fleet.kill(victim)
            kill = Kill(victim, now, (now - started) / reference_s, hit, len(hit_before.intersection(hit)),
                        [len(by_id[r].chunk_times) for r in hit], self.fleet.start())
            kills.append(kill)
            watchers.append(asyncio.create_task(self._live_after(kill)))
            _say(f"{name}: SIGKILLed {victim} with {len(hit)} streams open ({kill.hit_before} hit before) "
                 f"{now - started:.1f}s in; {kill.replacement} starts")
        await asyncio.gather(*tasks)
        took = max((s.chunk_times[-1] for s in seen if s.chunk_times), default=time.monotonic()) - started
        await asyncio.gather(*watchers)
        errors = sum(1 for s in seen if s.error)
        _say(f"{name}: {len(seen)} streams in {took:.1f}s, {errors} errors")
        return seen, kills, started, took


async def start_mesh(args: argparse.Namespace, nats_url: str, namespace: str, state: Path,
                     stack: AsyncExitStack) -> tuple[LocalMesh, Fleet, str]:
    """The router, metering (a fresh SQLite ledger) and the edge in-process, K sim workers as processes; each
    stopped by ``stack``, however far this got."""
    from infermesh.models import make_tiny_llama
    from services.metering.db import migrate

    model = make_tiny_llama(state / "tiny")
    database_url = f"sqlite+aiosqlite:///{state / 'ledger.db'}"
    await migrate(database_url)
    mesh = LocalMesh(nats_url, namespace, dev_key=KEY)
    stack.push_async_callback(mesh.stop)
    await mesh.start_router()
    await mesh.start_metering(database_url=database_url, sync_s=0.5)
    await mesh.start_edge(max_migrations=args.max_migrations)
    fleet = Fleet(nats_url, namespace, model, args.sim_itl_ms, args.ttl_s, state)
    stack.callback(fleet.stop)  # before the mesh's (last in, first out); every stream is over by then
    for _ in range(args.workers):
        fleet.start()
    return mesh, fleet, database_url


async def main_async(args: argparse.Namespace) -> dict:
    state = Path(tempfile.mkdtemp(prefix="im-migration-"))
    namespace = f"mig{random.randrange(16**6):06x}"
    plan = [("undisturbed", [], {}), ("migration", args.kill_at, {}),
            ("control", args.kill_at, {"X-Infermesh-Max-Migrations": "0"})]
    runs, reference_s = [], 0.0
    async with AsyncExitStack() as stack:
        nats_url = args.nats_url
        if not nats_url:
            nats, nats_url = start_nats(state / "nats")
            stack.callback(nats.wait, 10)
            stack.callback(nats.terminate)
        mesh, fleet, database_url = await start_mesh(args, nats_url, namespace, state, stack)
        bus = await Bus.connect(nats_url, namespace, "migration-bench")
        stack.push_async_callback(bus.close)
        bench = Bench(args, mesh, fleet, bus)
        await bench.watch_decisions()
        _say(f"{args.workers} workers ready in {await bench.settle_fleet(90):.1f}s (logs: {state})")
        for name, kill_at, headers in plan[:3 if args.control else 2]:
            seen, kills, started, took = await bench.run_phase(name, [f * reference_s for f in kill_at], headers,
                                                               reference_s)
            reference_s = reference_s or took
            runs.append((name, seen, kills, started))
            await bench.settle_fleet()
        expected = sum(1 for _n, seen, _k, _t in runs for s in seen if s.request_id)
        rows = await ledger_rows(database_url, expected, args.settle_s)
        usage_lost = mesh.edge.mesh.usage.lost
    reference = {s.index: s.text for s in runs[0][1]}
    phases = [phase_report(name, seen, kills, rows, reference, started, args.max_tokens)
              for name, seen, kills, started in runs]
    return {"requests": args.requests, "workers": args.workers, "max_tokens": args.max_tokens,
            "sim_itl_ms": args.sim_itl_ms, "heartbeat_ttl_s": args.ttl_s, "max_migrations": args.max_migrations,
            "hang_s": args.hang_s, "kill_at": args.kill_at, "undisturbed_s": round(reference_s, 3),
            "usage_lost_by_edge": usage_lost, "phases": phases, "overall": overall(phases)}


def failures(report: dict) -> list[str]:
    """What must not happen: a hang anywhere; with migration on, an error, a text off the reference, a bill off."""
    bad = [f"{p['phase']}: {p['hung']} hung" for p in report["phases"] if p["hung"]]
    for p in report["phases"][:2]:
        if p["errors"] or p["exact"] != p["requests"]:
            bad.append(f"{p['phase']}: errors {p['errors']}, {p['requests'] - p['exact']} texts off the reference")
    for p in report["phases"]:
        if p["lost"] or p["doubled"] or p["mismatched"]:
            bad.append(f"{p['phase']}: lost {p['lost']}, doubled {p['doubled']}, mismatched {p['mismatched']}")
    return bad


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=24, help="N: streams per phase, all at once")
    parser.add_argument("--workers", type=int, default=3, help="K sim worker processes")
    parser.add_argument("--max-tokens", type=int, default=300)
    parser.add_argument("--sim-itl-ms", type=float, default=20.0, help="the sim's time per decode step")
    parser.add_argument("--ttl-s", type=float, default=2.0, help="the workers' registry TTL (heartbeat: 0.5 s)")
    parser.add_argument("--kill-at", type=float, nargs="*", default=[1 / 3, 2 / 3],
                        help="SIGKILL at these shares of the undisturbed phase's duration, one kill each")
    parser.add_argument("--max-migrations", type=int, default=3, help="the edge's --max-migrations")
    parser.add_argument("--hang-s", type=float, default=45.0, help="a stream not over by then is hung")
    parser.add_argument("--settle-s", type=float, default=2.0, help="ledger row count unchanged this long")
    parser.add_argument("--no-control", dest="control", action="store_false", help="skip the control phase")
    parser.add_argument("--nats-url", default="", help="use this nats-server (default: start one)")
    parser.add_argument("--out", default="", help="write migration.json, migration.png and table.md here")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    report = {"command": "python -m loadtests.migration " + " ".join(sys.argv[1:]), **asyncio.run(main_async(args))}
    slim = {**report, "phases": [{k: v for k, v in p.items() if k != "streams"} for p in report["phases"]]}
    print(json.dumps(slim, indent=2))
    if args.out:
        write_report(report, Path(args.out))
    bad = failures(report)
    if bad:
        _say("FAILED: " + "; ".join(bad))
        sys.exit(1)


if __name__ == "__main__":
    main()
