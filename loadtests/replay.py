"""Offline replay: a workload through the fleet simulator, several configurations side by side.

    python -m loadtests.replay trace [PATH] --workers 8 --policies round_robin,least_loaded,session
    python -m loadtests.replay agents --sessions 64 --workers 8 --kv-dtypes fp8,nvfp4 --scale 0.5
    python -m loadtests.replay trace --workers 16 --kv-tokens 524288 --block-size 64 --cost dynamo \
        --policies round_robin,least_loaded,kv_aware,kv_aware:decode=0.1

Every combination of the comma-separated options is one configuration; each sees the same
seeded traffic. A policy may carry knobs (loadtests/lib/policy_spec.py: ``kv_aware:decode=0.1``).
``--kv-tokens`` and ``--block-size`` set each worker's device KV (0: the profile's); ``--cost dynamo``
prices steps with Dynamo's polynomials (services/worker/engines/poly_cost.py) instead of the
profile's roofline. Every run also gets its bounds (loadtests/lib/cache_bounds.py): the
infinite-cache hit rate of its own requests and that of one pooled LRU cache of the fleet's KV,
and the gap to the first split into capacity and placement.
Writes <out>.json and <out>.png (loadtests/lib/report.py) and prints tables.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

from loadtests.lib.cache_bounds import Recording, bounds_table, gap_split, hit_bounds, replayed
from loadtests.lib.fleet_sim import FleetConfig, FleetSim
from loadtests.lib.policy_spec import fleet_overrides
from loadtests.lib.report import summarize, write_markdown_table, write_report
from loadtests.lib.workloads import AgentSessions, MooncakeTrace, Workload
from services.worker.engines.cost_model import load_profile
from services.worker.engines.poly_cost import DynamoPolynomialCost

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared" / "data" / "mooncake_synthetic_trace.jsonl"


def _list(text: str) -> list[str]:
    return [item for item in text.split(",") if item]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workload", choices=["trace", "agents"])
    parser.add_argument("trace", nargs="?", default=str(DEFAULT_TRACE), help="a Mooncake-format JSONL trace")
    parser.add_argument("--profile", default="gb200-glm53")
    parser.add_argument("--workers", default="8", help="decode (or aggregated) workers, comma-separated values")
    parser.add_argument("--prefill", default="0", help="prefill workers (0: aggregated)")
    parser.add_argument("--policies", default="least_loaded",
                        help="comma-separated; kv_aware may carry knobs, e.g. kv_aware:decode=0.1 (policy_spec.py)")
    parser.add_argument("--kv-dtypes", default="fp8")
    parser.add_argument("--budgets", default="0", help="per-step prompt-token budgets (0: the profile's)")
    parser.add_argument("--host-kv", action="store_true", help="give every worker the profile's host KV tier")
    parser.add_argument("--kv-tokens", type=int, default=0, help="device KV per worker, in tokens (0: the profile's)")
    parser.add_argument("--block-size", type=int, default=0, help="KV block size in tokens (0: the profile's)")
    parser.add_argument("--max-num-seqs", type=int, default=0, help="running requests per worker (0: the profile's)")
    parser.add_argument("--cost", choices=("roofline", "dynamo"), default="roofline",
                        help="step times: the profile's roofline, or Dynamo's mocker polynomials")
    parser.add_argument("--trace-block-size", type=int, default=512, help="trace: tokens per hash id")
    parser.add_argument("--no-bounds", action="store_true", help="skip the infinite-cache and pooled-LRU replays")
    parser.add_argument("--limit", type=int, default=None, help="trace: the first N requests")
    parser.add_argument("--time-scale", type=float, default=1.0, help="trace: stretch (>1) or squeeze arrivals")
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--scale", type=float, default=1.0, help="agents: token-count scale")
    parser.add_argument("--think-s", type=float, default=30.0)
    parser.add_argument("--duration-s", type=float, default=900.0, help="agents: simulated seconds")
    parser.add_argument("--warmup-s", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="", help="report path stem (default: no report files)")
    args = parser.parse_args(argv)
    if args.kv_tokens and not args.block_size:
        parser.error("--kv-tokens needs --block-size (the capacity is a whole number of blocks)")
    if min(args.kv_tokens, args.block_size, args.max_num_seqs) < 0 or args.kv_tokens % max(args.block_size, 1):
        parser.error("--kv-tokens must be a non-negative multiple of --block-size")
    try:
        args.policy_overrides = {spec: fleet_overrides(spec) for spec in _list(args.policies)}
    except ValueError as exc:
        parser.error(str(exc))
    return args


def make_workload(args: argparse.Namespace) -> Workload:
    if args.workload == "trace":
        return MooncakeTrace(args.trace, block_tokens=args.trace_block_size, limit=args.limit,
                             time_scale=args.time_scale)
    return AgentSessions(args.sessions, think_time_s=args.think_s, scale=args.scale, seed=args.seed,
                         stagger_s=min(args.duration_s / 3, 300.0), steady_until_s=None)


def fleet_config(args: argparse.Namespace, profile, workers: int, prefill: int, spec: str, dtype: str,
                 budget: int, label: str) -> FleetConfig:
    num_kv_blocks = args.kv_tokens // args.block_size if args.kv_tokens else 0
    cost = None
    if args.cost == "dynamo":
        assert num_kv_blocks, "--cost dynamo needs --kv-tokens and --block-size (its decode time is per KV capacity)"
        capacity = args.kv_tokens
        cost = lambda: DynamoPolynomialCost(capacity)  # noqa: E731 - one per worker
    return FleetConfig(profile=profile, num_workers=workers, num_prefill=prefill, kv_dtype=dtype,
                       max_num_batched_tokens=budget, host_kv=args.host_kv, block_size=args.block_size,
                       num_kv_blocks=num_kv_blocks, max_num_seqs=args.max_num_seqs, cost=cost, seed=args.seed,
                       label=label, **args.policy_overrides[spec])


def run_one(args: argparse.Namespace, config: FleetConfig) -> dict:
    """One configuration: its summary, with its bounds and the sim's wall time."""
    workload = Recording(make_workload(args))
    started = time.perf_counter()
    until = args.duration_s if args.workload == "agents" else float("inf")
    sim = FleetSim(config)
    result = sim.run(workload, until_s=until)
    wall = time.perf_counter() - started
    records = [r for r in result.records if r.finish_t is not None or r.error]
    summary = summarize(records, num_gpus=config.num_gpus, warmup_s=args.warmup_s)
    pool = sim.decoders[0].pool
    summary.update(sim_wall_s=round(wall, 2), simulated_s=round(result.duration_s, 1), events=result.num_events,
                   repins=result.num_repins, kv_tokens_per_worker=pool.num_blocks * pool.block_size,
                   block_size=pool.block_size)
    if not args.no_bounds:
        bounds = hit_bounds(replayed(result.records, workload, args.warmup_s), pool.block_size,
                            pool.num_blocks * len(sim.decoders))
        summary.update(bounds, **gap_split(summary["prefix_hit_rate"], bounds))
    print(f"{config.label}: {len(records)} requests, hit {summary['prefix_hit_rate']:.4f}, TTFT p50/p90 "
          f"{summary['ttft_p50_ms']:.1f}/{summary['ttft_p90_ms']:.1f} ms; {result.duration_s:.0f} simulated s "
          f"in {wall:.1f} s wall", file=sys.stderr)
    return summary


def main(argv: list[str] | None = None) -> dict[str, dict]:
    args = parse_args(argv)
    profile = load_profile(args.profile)
    configs: dict[str, dict] = {}
    grid = itertools.product(_list(args.workers), _list(args.prefill), _list(args.policies), _list(args.kv_dtypes),
                             _list(args.budgets))
    for workers, prefill, spec, dtype, budget in grid:
        label = f"{spec} {workers}w" + (f"+{prefill}p" if int(prefill) else "") + f" {dtype}" + (
            f" budget {budget}" if int(budget) else "")
        config = fleet_config(args, profile, int(workers), int(prefill), spec, dtype, int(budget), label)
        configs[label] = run_one(args, config)
    print(write_markdown_table(configs))
    if not args.no_bounds:
        print(bounds_table(configs))
    if args.out:
        command = "python -m loadtests.replay " + " ".join(sys.argv[1:] if argv is None else argv)
        write_report(Path(args.out), title=f"Offline replay: {args.workload}", command=command, configs=configs,
                     notes={"profile": args.profile, "workload": args.workload, "cost": args.cost,
                            "trace": args.trace if args.workload == "trace" else None})
    return configs


if __name__ == "__main__":
    main()
