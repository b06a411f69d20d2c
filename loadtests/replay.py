"""Offline replay: a workload through the fleet simulator, several configurations side by side.

    python -m loadtests.replay trace [PATH] --workers 8 --policies round_robin,least_loaded,session
    python -m loadtests.replay agents --sessions 64 --workers 8 --kv-dtypes fp8,nvfp4 --scale 0.5

Every combination of the comma-separated options is one configuration; each sees the same
seeded traffic. Writes <out>.json and <out>.png (loadtests/lib/report.py) and prints a table.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

from loadtests.lib.fleet_sim import FleetConfig, FleetSim
from loadtests.lib.report import summarize, write_markdown_table, write_report
from loadtests.lib.workloads import AgentSessions, MooncakeTrace, Workload
from services.worker.engines.cost_model import load_profile

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
    parser.add_argument("--policies", default="least_loaded")
    parser.add_argument("--kv-dtypes", default="fp8")
    parser.add_argument("--budgets", default="0", help="per-step prompt-token budgets (0: the profile's)")
    parser.add_argument("--host-kv", action="store_true", help="give every worker the profile's host KV tier")
    parser.add_argument("--limit", type=int, default=None, help="trace: the first N requests")
    parser.add_argument("--time-scale", type=float, default=1.0, help="trace: stretch (>1) or squeeze arrivals")
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--scale", type=float, default=1.0, help="agents: token-count scale")
    parser.add_argument("--think-s", type=float, default=30.0)
    parser.add_argument("--duration-s", type=float, default=900.0, help="agents: simulated seconds")
    parser.add_argument("--warmup-s", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="", help="report path stem (default: no report files)")
    return parser.parse_args(argv)


def make_workload(args: argparse.Namespace) -> Workload:
    if args.workload == "trace":
        return MooncakeTrace(args.trace, limit=args.limit, time_scale=args.time_scale)
    return AgentSessions(args.sessions, think_time_s=args.think_s, scale=args.scale, seed=args.seed,
                         stagger_s=min(args.duration_s / 3, 300.0), steady_until_s=None)


def main(argv: list[str] | None = None) -> dict[str, dict]:
    args = parse_args(argv)
    profile = load_profile(args.profile)
    configs: dict[str, dict] = {}
    grid = itertools.product(_list(args.workers), _list(args.prefill), _list(args.policies), _list(args.kv_dtypes),
                             _list(args.budgets))
    for workers, prefill, policy, dtype, budget in grid:
        label = f"{policy} {workers}w" + (f"+{prefill}p" if int(prefill) else "") + f" {dtype}" + (
            f" budget {budget}" if int(budget) else "")
        config = FleetConfig(profile=profile, num_workers=int(workers), num_prefill=int(prefill), policy=policy,
                             kv_dtype=dtype, max_num_batched_tokens=int(budget), host_kv=args.host_kv,
                             seed=args.seed, label=label)
        workload = make_workload(args)
        started = time.perf_counter()
        until = args.duration_s if args.workload == "agents" else float("inf")
        result = FleetSim(config).run(workload, until_s=until)
        wall = time.perf_counter() - started
        records = [r for r in result.records if r.finish_t is not None or r.error]
        summary = summarize(records, num_gpus=config.num_gpus, warmup_s=args.warmup_s)
        summary.update(sim_wall_s=round(wall, 2), simulated_s=round(result.duration_s, 1), events=result.num_events)
        configs[label] = summary
        print(f"{label}: {len(records)} requests, {result.duration_s:.0f} simulated s in {wall:.1f} s wall",
              file=sys.stderr)
    print(write_markdown_table(configs))
    if args.out:
        command = "python -m loadtests.replay " + " ".join(sys.argv[1:] if argv is None else argv)
        write_report(Path(args.out), title=f"Offline replay: {args.workload}", command=command, configs=configs,
                     notes={"profile": args.profile, "workload": args.workload,
                            "trace": args.trace if args.workload == "trace" else None})
    return configs


if __name__ == "__main__":
    main()
