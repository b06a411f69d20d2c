"""Router KV prefix index: event ingest rate, find_matches latency and memory, ours vs Dynamo's RadixTree.

One synthetic fleet, fed to both indexes: N workers holding M blocks in total (a block held by
two workers counts twice). A few apps, each with a system prompt of 32-128 blocks; many chat
sessions, each an app's system prompt plus a history of 64-2560 blocks (log-uniform), stored on
one worker turn by turn (a prefill chunk of up to 128 blocks, then one decode block per event),
and on a second worker, cut short, for a quarter of them. A block's 16 tokens follow from its id
(``tokens_of``), so the workload file handed to the Dynamo side only lists block ids.

While the fleet fills (until as many blocks have been stored as it will hold), after 3 in 10 of the sessions
stored an earlier one is evicted: its own blocks removed leaf first, on every worker holding it, its room
reused. Both indexes apply the same removals; ingest counts stored and removed blocks.

Prompts of 2K, 8K, 32K tokens are session prefixes (padded with uncached blocks when the
session is shorter): every worker holding the app's system prompt matches it, the session's own
workers match further. Three timings per prompt: ``find_matches`` given the hashes (the index alone);
the prompt's hashes from its token ids and then ``find_matches`` (Dynamo's scope: its router hashes
the request; ours from the uint32 array the edge holds, Dynamo's from the list its Python API takes);
and ours alone, the whole decision (hashes, then ``KvAwarePolicy.route``: filters, find_matches, a
cost per candidate, pick), which Dynamo's Python API does not expose. Ingest hashes inside apply on
our side (the router recomputes its chain from token ids); Dynamo's events carry the per-block
hashes, computed before the timing, as its engine-side publisher does.

Dynamo's side runs this same file under the Dynamo venv (``--dynamo-worker``; stdlib-only imports
at module level for that reason); without that venv only ours is measured::

    python3.11 -m venv /tmp/dynamo-venv && /tmp/dynamo-venv/bin/pip install ai-dynamo-runtime==1.6.1
    python -m loadtests.index_bench --workers 64 --blocks 1000000 --reps 3 --out docs/results/router_index_bench
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from array import array
from dataclasses import dataclass, field
from pathlib import Path

MODEL = "bench-model"
PROMPT_TOKENS = (2048, 8192, 32768)
DYNAMO_PYTHON = "/tmp/dynamo-venv/bin/python"
REMOVED = -1  # an event (REMOVED, ids) evicts those blocks (leaf first); (parent or None, ids) stores them
Event = tuple


def tokens_of(block_ids: list[int], block_size: int) -> list[int]:
    """The tokens of consecutive blocks: a fixed function of each block's id, its first two tokens spelling
    the id (so no two blocks below 2.5e9 share their tokens), the rest filler."""
    return [t for b in block_ids
            for t in (b % 50000, b // 50000 % 50000, *[(b * 7919 + j * 104729) % 50000 for j in range(block_size - 2)])]


@dataclass(slots=True)
class Session:
    app: int
    chain: list[int]  # block ids: the app's system prompt, then the history
    primary: int  # holds the whole chain
    replica: int | None = None
    replica_depth: int = 0  # blocks of the chain the replica holds


@dataclass(slots=True)
class Workload:
    block_size: int
    num_workers: int
    system: list[list[int]]
    sessions: list[Session] = field(default_factory=list)
    events: list[list[Event]] = field(default_factory=list)  # per worker, in order
    apps_on: list[set[int]] = field(default_factory=list)  # per worker: apps whose system prompt it holds
    next_id: int = 1
    stored: int = 0  # blocks stored so far, removed ones included

    @property
    def num_blocks(self) -> int:
        """Blocks held once every event is applied."""
        return sum(len(ids) * (-1 if parent == REMOVED else 1) for evs in self.events for parent, ids in evs)

    @property
    def num_touched(self) -> int:
        """Blocks stored or removed by the events."""
        return sum(len(ids) for evs in self.events for _, ids in evs)

    @property
    def num_events(self) -> int:
        return sum(len(evs) for evs in self.events)


def _store(w: Workload, rng: random.Random, worker: int, s: Session, depth: int, turns: bool) -> None:
    """Events putting the first `depth` blocks of a session's chain on a worker."""
    events, sys_len = w.events[worker], len(w.system[s.app])
    start = 0 if s.app not in w.apps_on[worker] else sys_len
    w.apps_on[worker].add(s.app)
    pos = start
    while pos < depth:
        n = min(128, depth - pos, sys_len - pos if pos < sys_len else rng.randint(8, 96) if turns else 128)
        decode = rng.randint(1, 8) if turns and pos >= sys_len else 0
        for size in [n] + [1] * decode:
            if pos >= depth:
                break
            events.append((s.chain[pos - 1] if pos else None, s.chain[pos:pos + size]))
            w.stored += min(size, depth - pos)
            pos += size


def _evict(w: Workload, rng: random.Random, left: list[int]) -> None:
    """A random live session leaves every worker that holds it, its own blocks removed leaf first (its app's
    system prompt stays: other sessions share it)."""
    s = w.sessions.pop(rng.randrange(len(w.sessions)))
    sys_len = len(w.system[s.app])
    for worker, depth in ((s.primary, len(s.chain)), (s.replica, s.replica_depth)):
        if worker is None or depth <= sys_len:
            continue
        own = s.chain[sys_len:depth][::-1]
        for i in range(0, len(own), 128):
            w.events[worker].append((REMOVED, own[i:i + 128]))
        left[worker] += len(own)


def make_workload(num_workers: int, total_blocks: int, *, num_apps: int = 4, replica_frac: float = 0.25,
                  evict_frac: float = 0.3, min_history: int = 64, max_history: int = 2560, block_size: int = 16,
                  seed: int = 0) -> Workload:
    """Sessions stored on workers until the workers hold `total_blocks` blocks between them; after a session is
    stored, with probability `evict_frac` an earlier one is evicted (its room reused by later sessions), until
    `total_blocks` have been stored in all (so the fill ends)."""
    rng = random.Random(seed)
    w = Workload(block_size, num_workers, [], events=[[] for _ in range(num_workers)],
                 apps_on=[set() for _ in range(num_workers)])
    for _ in range(num_apps):
        n = rng.randint(32, 128)
        w.system.append(list(range(w.next_id, w.next_id + n)))
        w.next_id += n
    left = [total_blocks // num_workers + (i < total_blocks % num_workers) for i in range(num_workers)]

    def cost(worker: int, app: int) -> int:
        return 0 if app in w.apps_on[worker] else len(w.system[app])

    while True:
        open_ = [i for i in range(num_workers) if left[i] > 0]
        if not open_:
            return w
        primary, app = rng.choice(open_), rng.randrange(num_apps)
        history = int(math.exp(rng.uniform(math.log(min_history), math.log(max_history))))
        history = min(history, left[primary] - cost(primary, app))
        if history < 1:  # no room for this app's system prompt: one the worker holds, else overshoot a little
            app = next((a for a in range(num_apps) if a in w.apps_on[primary]), app)
            history = max(1, left[primary] - cost(primary, app))
        ids = list(range(w.next_id, w.next_id + history))
        w.next_id += history
        s = Session(app, w.system[app] + ids, primary)
        left[primary] -= cost(primary, app) + history
        _store(w, rng, primary, s, len(s.chain), turns=True)
        others = [i for i in open_ if i != primary and left[i] > cost(i, app)]
        if others and rng.random() < replica_frac:
            s.replica = rng.choice(others)
            room = left[s.replica] - cost(s.replica, app)
            s.replica_depth = min(rng.randint(len(w.system[app]) + 1, len(s.chain)), len(w.system[app]) + room)
            left[s.replica] -= cost(s.replica, app) + s.replica_depth - len(w.system[app])
            _store(w, rng, s.replica, s, s.replica_depth, turns=False)
        w.sessions.append(s)
        if len(w.sessions) > 1 and w.stored < total_blocks and rng.random() < evict_frac:
            _evict(w, rng, left)


def make_queries(w: Workload, prompt_blocks: int, count: int, seed: int = 1) -> list[tuple[list[int], dict[int, int]]]:
    """(prompt block ids, expected matched blocks per worker) for session prefixes of `prompt_blocks` blocks;
    sessions shorter than that are padded with blocks no worker holds."""
    rng = random.Random(seed * 1_000_003 + prompt_blocks)
    long_enough = [s for s in w.sessions if len(s.chain) >= prompt_blocks]
    pool = long_enough if len(long_enough) >= 10 else sorted(w.sessions, key=lambda s: -len(s.chain))[:50]
    fresh = w.next_id + 10**9
    queries = []
    for _ in range(count):
        s = rng.choice(pool)
        ids = s.chain[:prompt_blocks]
        ids += list(range(fresh, fresh + prompt_blocks - len(ids)))
        fresh += prompt_blocks
        expected = {i: min(prompt_blocks, len(w.system[s.app])) for i in range(w.num_workers) if s.app in w.apps_on[i]}
        expected[s.primary] = len(ids) if len(s.chain) >= prompt_blocks else len(s.chain)
        if s.replica is not None:
            expected[s.replica] = min(prompt_blocks, s.replica_depth)
        queries.append((ids, expected))
    return queries


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _lat_us(ns: list[int]) -> dict:
    xs = sorted(n / 1000.0 for n in ns)
    pick = lambda q: xs[min(len(xs) - 1, int(round((len(xs) - 1) * q / 100)))]  # noqa: E731
    return {"p50_us": pick(50), "p99_us": pick(99), "mean_us": statistics.fmean(xs), "n": len(xs)}


# ------------------------------------------------------------------ ours
def bench_ours(w: Workload, queries: dict[int, list], *, batch: int = 32) -> dict:
    """Ingest every worker's events into a fresh PrefixIndex (timing apply only), then time find_matches."""
    from services.router.index import PrefixIndex
    from shared.prefix_hash import prompt_hashes
    from shared.schema import BlockRemoved, BlockStored

    gc.collect()
    rss0 = rss_bytes()
    index = PrefixIndex(w.block_size)
    busy = 0.0
    for worker, evs in enumerate(w.events):
        index.add_worker(f"w{worker}", MODEL)
        structs = [BlockRemoved(ids) if parent == REMOVED else
                   BlockStored(ids, parent, tokens_of(ids, w.block_size), w.block_size) for parent, ids in evs]
        for i in range(0, len(structs), batch):
            t0 = time.perf_counter()
            index.apply(f"w{worker}", structs[i:i + batch])
            busy += time.perf_counter() - t0
    del structs
    gc.collect()
    out = {"ingest_s": busy, "events_per_s": w.num_events / busy, "blocks_per_s": w.num_touched / busy,
           "rss_growth_mb": (rss_bytes() - rss0) / 2**20, "skipped_blocks": index.num_skipped_blocks,
           "find_matches": {}, "mismatches": 0}
    for size, qs in queries.items():
        hashes = [prompt_hashes(tokens_of(ids, w.block_size), MODEL, block_size=w.block_size) for ids, _ in qs]
        for h in hashes[:20]:
            index.find_matches(h)  # warm-up
        ns = []
        for h, (_, expected) in zip(hashes, qs, strict=True):
            t0 = time.perf_counter_ns()
            got = index.find_matches(h)
            ns.append(time.perf_counter_ns() - t0)
            out["mismatches"] += {int(k[1:]): v.blocks for k, v in got.items()} != expected
        out["find_matches"][size] = _lat_us(ns)
        tokens = [array("I", tokens_of(ids, w.block_size)) for ids, _ in qs]  # as the edge holds them
        ns = []
        for ids in tokens:  # Dynamo's scope: the prompt's hashes, then the index
            t0 = time.perf_counter_ns()
            index.find_matches(prompt_hashes(ids, MODEL, block_size=w.block_size))
            ns.append(time.perf_counter_ns() - t0)
        out.setdefault("hash_find", {})[size] = _lat_us(ns)
        routed = bench_policy(index, w, size, tokens, [expected for _, expected in qs])
        if routed is not None:
            out.setdefault("route", {})[size] = routed
    out["index"] = index
    return out


def bench_policy(index, w: Workload, size: int, tokens: list[array], expected: list[dict]) -> dict | None:
    """The whole routing decision (the prompt's hashes from its token ids, then filters, find_matches, costs,
    pick); None when services/router/policy.py has no KvAwarePolicy. Hashing is the edge's in the mesh, timed
    here with the router's work as one decision, as Dynamo's router does both."""
    import services.router.policy as policy
    from services.router.scoring import LoadView
    from shared.prefix_hash import prompt_hashes
    from shared.schema import LoadSnapshot, RouteRequest, WorkerInfo

    if not hasattr(policy, "KvAwarePolicy"):
        return None
    now, rng = time.time(), random.Random(size)
    workers = [WorkerInfo(f"w{i}", "both", MODEL, "sim", w.block_size, 65536, 131072, "bench", ts=now)
               for i in range(w.num_workers)]
    loads = LoadView()
    for i in range(w.num_workers):  # moderate, uneven load: overlap should still decide most picks
        running = rng.randint(0, 16)
        loads.observe(LoadSnapshot(f"w{i}", 1, now, running, rng.randint(0, 4), running * 200, 65536,
                                   num_prefill_tokens=rng.randint(0, 4096)))
    view, router = policy.RouteView(workers, loads, now), policy.KvAwarePolicy(index)
    ns, best = [], 0
    for n, (ids, exp) in enumerate(zip(tokens, expected, strict=True)):
        t0 = time.perf_counter_ns()
        h = prompt_hashes(ids, MODEL, block_size=w.block_size)
        request = RouteRequest(f"r{n}", MODEL, len(ids), f"s{n}", block_hashes=h, block_size=w.block_size)
        plan = router.route(request, view)
        ns.append(time.perf_counter_ns() - t0)
        best += exp.get(int(plan.reply.worker_id[1:]), 0) == max(exp.values())
    return {**_lat_us(ns), "picked_max_overlap": best / len(ns)}


# ------------------------------------------------------------------ Dynamo (runs under the Dynamo venv)
def dynamo_worker(workload_path: str, result_path: str) -> None:
    from dynamo.llm import RadixTree, compute_block_hash_for_seq

    spec = json.loads(Path(workload_path).read_text())
    bs = spec["block_size"]
    local = lambda ids: compute_block_hash_for_seq(tokens_of(ids, bs), bs)  # noqa: E731
    payloads = []  # (worker, serialized event), built before any timing
    for worker, evs in enumerate(spec["events"]):
        for n, (parent, ids) in enumerate(evs):
            if parent == REMOVED:
                data = {"removed": {"block_hashes": ids}}
            else:
                blocks = [{"block_hash": b, "tokens_hash": h} for b, h in zip(ids, local(ids), strict=True)]
                data = {"stored": {"parent_hash": parent, "blocks": blocks}}
            payloads.append((worker, json.dumps({"event_id": n, "data": data}).encode()))
    queries = {int(k): [local(ids) for ids in qs] for k, qs in spec["queries"].items()}
    prompts = {int(k): [tokens_of(ids, bs) for ids in qs] for k, qs in spec["queries"].items()}
    runs = []
    for rep in range(spec["reps"]):
        gc.collect()
        rss0 = rss_bytes()
        tree = RadixTree()
        t0 = time.perf_counter()
        for worker, data in payloads:
            tree.apply_event(worker, data)
        tree.find_matches([0])  # a barrier, in case events are applied on the tree's own thread
        busy = time.perf_counter() - t0
        run = {"ingest_s": busy, "rss_growth_mb": (rss_bytes() - rss0) / 2**20, "find_matches": {}, "scores": {}}
        for size, qs in queries.items():
            for q in qs[:20]:
                tree.find_matches(q)
            ns = []
            for q in qs:
                t1 = time.perf_counter_ns()
                scores = tree.find_matches(q).scores
                ns.append(time.perf_counter_ns() - t1)
                if rep == 0:
                    run["scores"].setdefault(size, []).append({str(k[0]): v for k, v in scores.items()})
            run["find_matches"][size] = ns
            ns = []
            for tokens in prompts[size]:  # the decision with its hashing: Python's only way in is a list
                t1 = time.perf_counter_ns()
                tree.find_matches(compute_block_hash_for_seq(tokens, bs))
                ns.append(time.perf_counter_ns() - t1)
            run.setdefault("decide", {})[size] = ns
        runs.append(run)
        del tree
    from importlib import metadata
    Path(result_path).write_text(json.dumps({"version": metadata.version("ai-dynamo-runtime"), "runs": runs}))


def bench_dynamo(w: Workload, queries: dict[int, list], reps: int, python: str) -> dict | None:
    """Run the Dynamo side in its venv on the same workload; None when that venv is missing."""
    if not Path(python).exists():
        return None
    with tempfile.TemporaryDirectory(prefix="index_bench_") as tmp:
        spec = {"block_size": w.block_size, "reps": reps, "events": w.events,
                "queries": {size: [ids for ids, _ in qs] for size, qs in queries.items()}}
        Path(tmp, "workload.json").write_text(json.dumps(spec))
        subprocess.run([python, __file__, "--dynamo-worker", f"{tmp}/workload.json", f"{tmp}/result.json"],
                       check=True)
        raw = json.loads(Path(tmp, "result.json").read_text())
    runs = []
    for run in raw["runs"]:
        runs.append({"ingest_s": run["ingest_s"], "events_per_s": w.num_events / run["ingest_s"],
                     "blocks_per_s": w.num_touched / run["ingest_s"], "rss_growth_mb": run["rss_growth_mb"],
                     "find_matches": {int(k): _lat_us(ns) for k, ns in run["find_matches"].items()},
                     "hash_find": {int(k): _lat_us(ns) for k, ns in run["decide"].items()}})
    scores = raw["runs"][0]["scores"]
    mismatches = sum({int(k): v for k, v in got.items()} != expected
                     for size, qs in queries.items() for got, (_, expected) in zip(scores[str(size)], qs, strict=True))
    return {"version": raw["version"], "runs": runs, "mismatches": mismatches}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=64)
    p.add_argument("--blocks", type=int, default=1_000_000, help="blocks held, all workers together")
    p.add_argument("--queries", type=int, default=300, help="prompts per prompt size")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dynamo-python", default=DYNAMO_PYTHON)
    p.add_argument("--out", default="docs/results/router_index_bench")
    p.add_argument("--dynamo-worker", nargs=2, metavar=("WORKLOAD", "RESULT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.dynamo_worker:
        return dynamo_worker(*args.dynamo_worker)
    from loadtests.lib.index_bench_report import markdown, median_run, plot  # not in the Dynamo venv's process

    t0 = time.perf_counter()
    w = make_workload(args.workers, args.blocks, seed=args.seed)
    queries = {t // w.block_size: make_queries(w, t // w.block_size, args.queries, args.seed) for t in PROMPT_TOKENS}
    print(f"workload: {w.num_blocks:,} blocks in {w.num_events:,} events, {len(w.sessions):,} sessions "
          f"({time.perf_counter() - t0:.1f}s)", flush=True)
    ours = []
    for rep in range(args.reps):
        run = bench_ours(w, queries)
        run.pop("index")
        print(f"ours rep {rep}: {run['blocks_per_s']:,.0f} blocks/s, {run['rss_growth_mb']:.0f} MB, "
              f"{run['mismatches']} mismatches", flush=True)
        ours.append(run)
    indexes = {"infermesh PrefixIndex": median_run(ours)}
    checks = {"ours_mismatches": ours[0]["mismatches"], "ours_skipped_blocks": ours[0]["skipped_blocks"]}
    dyn = bench_dynamo(w, queries, args.reps, args.dynamo_python)
    if dyn is not None:
        indexes[f"Dynamo RadixTree ({dyn['version']})"] = median_run(dyn["runs"])
        checks["dynamo_mismatches"] = dyn["mismatches"]
    import services.router.policy as policy

    notes = {"policy": "KvAwarePolicy measured" if hasattr(policy, "KvAwarePolicy") else
             "services/router/policy.py has no KvAwarePolicy yet: routing-decision latency not measured",
             "dynamo": "measured" if dyn else f"{args.dynamo_python} missing: Dynamo not measured"}
    result = {"title": "Router KV prefix index: ours vs Dynamo RadixTree",
              "command": "python -m loadtests.index_bench " + " ".join(argv if argv is not None else sys.argv[1:]),
              "workers": args.workers, "blocks": w.num_blocks, "events": w.num_events,
              "sessions": len(w.sessions), "block_size": w.block_size, "prompt_tokens": list(PROMPT_TOKENS),
              "queries_per_size": args.queries, "reps": args.reps,
              "mean_best_overlap_blocks": {size: statistics.fmean(max(e.values()) for _, e in qs)
                                           for size, qs in queries.items()}, "checks": checks, "notes": notes,
              "indexes": indexes, "elapsed_s": time.perf_counter() - t0}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "index_bench.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out / "index_bench.png")
    table = markdown(result)
    (out / "index_bench.md").write_text(
        f"# {result['title']}\n\n```\n{result['command']}\n```\n\n{w.num_blocks:,} blocks held by {args.workers} "
        f"workers at the end ({w.num_events:,} events storing or removing {w.num_touched:,} blocks; "
        f"{len(w.sessions):,} sessions held); medians of {args.reps} builds; ingest blocks/s counts stored and "
        f"removed blocks; find_matches over {args.queries} prompts per size, hashing excluded; the decision "
        f"rows include hashing the prompt's token ids.\n\n{table}\n"
        f"Checks: {json.dumps(checks)}. Notes: {json.dumps(notes)}\n")
    print(table + json.dumps({"checks": checks, "notes": notes}, indent=1))


if __name__ == "__main__":
    main()
