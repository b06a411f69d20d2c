"""Cross-check our fleet simulator against NVIDIA Dynamo's engine simulator on one Mooncake trace.

Both sides replay the same trace with matched constants (workers, KV block size and count,
per-step token budget, max running requests, round-robin routing, the same step-time
polynomials), and both are summarized by the same code (loadtests/lib/report.summarize):

* ``infermesh-sim (dynamo cost) Nw``: loadtests/lib/fleet_sim.FleetSim with
  services/worker/engines/poly_cost.DynamoPolynomialCost as every worker's step-time model
  (the profile only names the run; every size is passed explicitly).
* ``dynamo mocker Nw``: Dynamo's offline replay (loadtests/dynamo_crosscheck.py, run with the
  python of a venv holding ``ai-dynamo-runtime==1.6.1``), its per-request records turned into
  RequestRecords. Dynamo keeps no per-token times, only each request's first and last token:
  its token times are spread evenly in between, so its pooled ``itl_*`` figures are replaced by
  Dynamo's own per-token ITL percentiles (``itl_source`` says so). ``tpot_*`` (each request's
  mean inter-token gap) is computed the same way on both sides.

    .venv/bin/python -m loadtests.crosscheck            # 4 and 8 workers, the whole trace
    .venv/bin/python -m loadtests.crosscheck --workers 4 --limit 500 --out-stem /tmp/cc

With ``--router-mode kv_router`` Dynamo routes with its KV router (its default KvRouterConfig) and our
side runs ``--policies`` (default ``kv_aware``; any loadtests/lib/policy_spec.py spec, e.g.
``round_robin,kv_aware,kv_aware:decode=0.1``). Dynamo's KV router breaks cost ties at random, unseeded
(``minimum_cost_index`` in lib/kv-router/src/scheduling/selector/default.rs), so its replay varies from
run to run: ``--dynamo-runs N`` replays it N times and reports each figure's median (every run is in the
JSON). ``--bounds`` adds the infinite-cache and pooled-LRU hit rates of the trace's requests
(loadtests/lib/cache_bounds.py) and splits every row's gap to the ceiling into capacity and placement.

    .venv/bin/python -m loadtests.crosscheck --workers 16 --num-gpu-blocks 8192 \
        --router-mode round_robin kv_router --policies round_robin,kv_aware,kv_aware:decode=0.1 \
        --dynamo-runs 9 --bounds --out-stem /tmp/mr

Writes <out-stem>.json and .png (loadtests/lib/report.write_report) and prints markdown tables.
docs/results/dynamo_crosscheck.md explains the differences; docs/results/mooncake_routing/ the routing runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from loadtests.lib.cache_bounds import Recording, bounds_table, gap_split, hit_bounds, replayed
from loadtests.lib.fleet_sim import FleetConfig, FleetSim
from loadtests.lib.policy_spec import fleet_overrides
from loadtests.lib.report import RequestRecord, summarize, write_markdown_table, write_report
from loadtests.lib.stats import percentile
from loadtests.lib.workloads import MooncakeTrace
from services.worker.engines.cost_model import load_profile
from services.worker.engines.poly_cost import DynamoPolynomialCost

DEFAULT_TRACE = "/work/shared/data/mooncake_synthetic_trace.jsonl"
DYNAMO_PYTHON = "/tmp/dynamo-venv/bin/python"
DYNAMO_SCRIPT = Path(__file__).with_name("dynamo_crosscheck.py")
INSTALL_HINT = ("python3 -m venv /tmp/dynamo-venv && "
                "/tmp/dynamo-venv/bin/pip install ai-dynamo-runtime==1.6.1")
OURS, THEIRS = "infermesh-sim (dynamo cost)", "dynamo mocker"


def run_ours(args: argparse.Namespace, workers: int, policy: str = "round_robin"
             ) -> tuple[list[RequestRecord], float, dict | None]:
    """Our fleet sim with Dynamo's step-time polynomials: its records, its wall time (s) and, with
    ``--bounds``, the hit-rate bounds of its requests."""
    capacity = args.num_gpu_blocks * args.block_size
    config = FleetConfig(
        profile=load_profile(args.profile), num_workers=workers,
        block_size=args.block_size, num_kv_blocks=args.num_gpu_blocks,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        host_kv=False, label=f"{OURS} {workers}w", cost=lambda: DynamoPolynomialCost(capacity),
        **fleet_overrides(policy))
    workload = Recording(MooncakeTrace(args.trace, block_tokens=args.trace_block_size, limit=args.limit))
    t0 = time.perf_counter()
    result = FleetSim(config).run(workload)
    wall = time.perf_counter() - t0
    bounds = (hit_bounds(replayed(result.records, workload), args.block_size, workers * args.num_gpu_blocks)
              if args.bounds else None)
    return result.records, wall, bounds


def dynamo_command(args: argparse.Namespace, workers: int, out: str, router: str = "round_robin") -> list[str]:
    """The dynamo_crosscheck.py command line for one worker count and router (its JSON goes to ``out``)."""
    cmd = [args.dynamo_python, str(DYNAMO_SCRIPT), args.trace, "--workers", str(workers),
           "--router", router, "--backend", "vllm", "--trace-block-size", str(args.trace_block_size),
           "--block-size", str(args.block_size), "--num-gpu-blocks", str(args.num_gpu_blocks),
           "--max-num-batched-tokens", str(args.max_num_batched_tokens),
           "--max-num-seqs", str(args.max_num_seqs), "--per-request", "--out", out]
    if args.limit is not None:
        cmd += ["--limit", str(args.limit)]
    return cmd


def run_dynamo(args: argparse.Namespace, workers: int, router: str = "round_robin") -> dict:
    """Dynamo's replay for one worker count and router, as the JSON dynamo_crosscheck.py writes."""
    fd, out = tempfile.mkstemp(prefix="dynamo_crosscheck_", suffix=".json")
    os.close(fd)
    try:
        cmd = dynamo_command(args, workers, out, router)
        print("$ " + shlex.join(cmd), file=sys.stderr)
        subprocess.run(cmd, check=True)
        with open(out, encoding="utf-8") as f:
            return json.load(f)
    finally:
        os.unlink(out)


def dynamo_records(report: dict) -> list[RequestRecord]:
    """Dynamo's per-request records as RequestRecords; token times spread evenly from first to last token."""
    records = []
    for i, r in enumerate(sorted(report["per_request"], key=lambda r: r["arrival_time_ms"])):
        done = r["terminal_status"] == "completed"
        first, last, n = r["first_token_ms"], r["last_token_ms"], r["output_length"] or 0
        times: list[float] = []
        if done and first is not None and last is not None and n > 0:
            step = (last - first) / (n - 1) if n > 1 else 0.0
            times = [(first + k * step) / 1000.0 for k in range(n)]
        records.append(RequestRecord(
            request_id=f"dynamo-{i}", kind="trace", session_id=None, arrival_t=r["arrival_time_ms"] / 1000.0,
            scheduled_t=None if r["first_admit_ms"] is None else r["first_admit_ms"] / 1000.0,
            first_token_t=None if first is None else first / 1000.0,
            finish_t=None if last is None else last / 1000.0, token_times=times,
            num_prompt_tokens=r["input_length"], num_cached_tokens=r["reused_input_tokens"] or 0,
            worker_id=str(r["decode_worker_idx"]), error=None if done else r["terminal_status"]))
    return records


def agreement(ours: list[RequestRecord], report: dict) -> dict:
    """Request by request, how far the two runs differ (requests matched by arrival, prompt and output length)."""
    def key(arrival_ms: float, prompt: int, output: int) -> tuple:
        return round(arrival_ms, 3), prompt, output

    mine = sorted(ours, key=lambda r: key(r.arrival_t * 1000, r.num_prompt_tokens, len(r.token_times)))
    theirs = sorted(report["per_request"], key=lambda d: key(d["arrival_time_ms"], d["input_length"],
                                                             d["output_length"]))
    # not strict: the two runs may finish different numbers of requests ("of" below reports the larger)
    pairs = [(r, d) for r, d in zip(mine, theirs, strict=False)
             if r.first_token_t is not None and d["first_token_ms"] is not None]
    first = [abs(r.first_token_t * 1000 - d["first_token_ms"]) for r, d in pairs]
    last = [abs(r.finish_t * 1000 - d["last_token_ms"]) for r, d in pairs]
    return {"matched": len(pairs), "of": max(len(mine), len(theirs)),
            "max_abs_first_token_diff_ms": max(first, default=math.nan),
            "max_abs_last_token_diff_ms": max(last, default=math.nan),
            "cached_tokens_differ": sum(r.num_cached_tokens != (d["reused_input_tokens"] or 0) for r, d in pairs),
            "worker_differs": sum(r.worker_id.rsplit("-", 1)[-1] != str(d["decode_worker_idx"]) for r, d in pairs),
            "dynamo_readmissions": sum(d.get("readmission_count") or 0 for d in theirs)}


def e2e_figures(records: list[RequestRecord]) -> dict:
    """End-to-end latency percentiles (summarize gives TTFT, ITL and TPOT), computed alike on both sides."""
    e2e = [(r.finish_t - r.arrival_t) * 1000 for r in records if r.finish_t is not None]
    return {f"e2e_p{q}_ms": percentile(e2e, q) for q in (50, 90, 99)}


def detail_table(configs: dict[str, dict]) -> str:
    """A markdown table of the figures write_markdown_table leaves out."""
    cols = [("TTFT p90", "ttft_p90_ms"), ("ITL p90", "itl_p90_ms"), ("ITL source", "itl_source"),
            ("TPOT p50", "tpot_p50_ms"), ("TPOT p90", "tpot_p90_ms"), ("TPOT p99", "tpot_p99_ms"),
            ("E2E p50", "e2e_p50_ms"), ("E2E p99", "e2e_p99_ms"), ("duration s", "duration_s"),
            ("wall s", "wall_s")]
    lines = ["| config | " + " | ".join(h for h, _ in cols) + " |", "|---|" + "---:|" * len(cols)]
    for label, s in configs.items():
        cells = [v if isinstance(v := s.get(key), str) else "n/a" if v is None or not math.isfinite(v)
                 else f"{v:,.1f}" for _, key in cols]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def dynamo_summary(report: dict, workers: int) -> dict:
    """One Dynamo replay summarized as ours are; its ITL percentiles are Dynamo's own (per token)."""
    records = dynamo_records(report)
    summary = {**summarize(records, num_gpus=workers), **e2e_figures(records), "wall_s": report["summary"]["wall_s"]}
    own = report["summary"]["itl_ms"]  # Dynamo's per-token ITL percentiles (its own percentile method)
    summary.update({f"itl_p{q}_ms": own[f"p{q}"] for q in (50, 90, 99)}, itl_source="dynamo per token")
    return summary


def median_of_runs(runs: list[dict]) -> dict:
    """Figure by figure, the median over Dynamo's replays (a median row is not one run)."""
    out = dict(runs[0])
    for key, value in runs[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            values = [r[key] for r in runs if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
            out[key] = statistics.median(values) if values else math.nan
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", nargs="?", default=DEFAULT_TRACE, help="Mooncake JSONL trace")
    p.add_argument("--workers", type=int, nargs="+", default=[4, 8], help="worker counts to compare (default 4 8)")
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--trace-block-size", type=int, default=512, help="tokens per trace hash_id (Mooncake: 512)")
    p.add_argument("--block-size", type=int, default=64, help="KV block size (Dynamo's vLLM default 64)")
    p.add_argument("--num-gpu-blocks", type=int, default=16384, help="KV blocks per worker (Dynamo's default)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--router-mode", choices=("round_robin", "kv_router"), nargs="+", default=["round_robin"],
                   help="Dynamo's routing, one run (set) each (default round_robin)")
    p.add_argument("--policies", default=None,
                   help="our side, comma-separated policy specs (default: round_robin, or kv_aware with kv_router)")
    p.add_argument("--dynamo-runs", type=int, default=1, help="replay Dynamo this many times, report medians")
    p.add_argument("--bounds", action="store_true", help="add the infinite-cache and pooled-LRU hit-rate bounds")
    p.add_argument("--profile", default="gb200-glm53", help="our profile; names the run only, sizes are explicit")
    p.add_argument("--dynamo-python", default=DYNAMO_PYTHON, help="python of a venv with ai-dynamo-runtime")
    p.add_argument("--out-stem", default="docs/results/dynamo_crosscheck", help="writes <stem>.json and .png")
    args = p.parse_args(argv)
    if args.policies is None:
        args.policies = ",".join("round_robin" if mode == "round_robin" else "kv_aware" for mode in args.router_mode)
    args.policy_list = [spec for spec in args.policies.split(",") if spec]
    try:
        for spec in args.policy_list:
            fleet_overrides(spec)
    except ValueError as exc:
        p.error(str(exc))
    if args.dynamo_runs < 1:
        p.error("--dynamo-runs must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not Path(args.dynamo_python).exists():
        print(f"Dynamo's replay needs a python with ai-dynamo-runtime; {args.dynamo_python} is missing.\n"
              f"Install it with:\n    {INSTALL_HINT}\n(or pass --dynamo-python)", file=sys.stderr)
        return 2

    configs: dict[str, dict] = {}
    dynamo_own: dict[str, dict] = {}
    dynamo_runs: dict[str, list[dict]] = {}
    agree: dict[str, dict] = {}
    bounds: dict[str, dict] = {}
    for workers in args.workers:
        ours_by_policy = {}
        for policy in args.policy_list:
            ours, wall, run_bounds = run_ours(args, workers, policy)
            label = f"{OURS} {workers}w" if policy == "round_robin" else f"{OURS} {policy} {workers}w"
            configs[label] = {**summarize(ours, num_gpus=workers), **e2e_figures(ours),
                              "itl_source": "per token", "wall_s": wall}
            ours_by_policy[policy] = ours
            if run_bounds is not None:
                bounds.setdefault(f"{workers}w", run_bounds)  # the trace's requests: the same in every run
            print(f"{label}: {len(ours)} requests in {wall:.1f}s", file=sys.stderr)
        for mode in args.router_mode:
            theirs = f"{THEIRS} {workers}w" if mode == "round_robin" else f"{THEIRS} {mode} {workers}w"
            # round robin is deterministic; Dynamo's KV router breaks ties at random
            reports = [run_dynamo(args, workers, mode) for _ in range(1 if mode == "round_robin" else args.dynamo_runs)]
            runs = [dynamo_summary(report, workers) for report in reports]
            configs[theirs] = median_of_runs(runs) if len(runs) > 1 else runs[0]
            configs[theirs]["dynamo_runs"] = len(runs)
            dynamo_runs[theirs] = [{k: r[k] for k in ("prefix_hit_rate", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms")}
                                   for r in runs]
            if mode == "round_robin" and "round_robin" in ours_by_policy:
                agree[f"{workers}w"] = agreement(ours_by_policy["round_robin"], reports[0])
                print(f"per-request agreement {workers}w: {agree[f'{workers}w']}", file=sys.stderr)
            dynamo_own[theirs] = {"summary": reports[0]["summary"], "engine": reports[0]["engine"],
                                  "versions": reports[0]["versions"]}
        if f"{workers}w" in bounds:
            for label, summary in configs.items():
                if label.endswith(f" {workers}w"):
                    summary.update(bounds[f"{workers}w"], **gap_split(summary["prefix_hit_rate"],
                                                                      bounds[f"{workers}w"]))

    command = shlex.join([".venv/bin/python", "-m", "loadtests.crosscheck", *(argv if argv is not None
                                                                             else sys.argv[1:])])
    write_report(Path(args.out_stem), title="infermesh fleet sim vs NVIDIA Dynamo mocker (matched constants, "
                 f"Dynamo {' + '.join(args.router_mode)}, Dynamo's polynomial step times)", command=command,
                 configs=configs,
                 notes={"trace": os.path.abspath(args.trace), "limit": args.limit,
                        "matched": {"block_size": args.block_size, "num_gpu_blocks": args.num_gpu_blocks,
                                    "max_num_batched_tokens": args.max_num_batched_tokens,
                                    "max_num_seqs": args.max_num_seqs, "router": args.router_mode,
                                    "trace_block_size": args.trace_block_size},
                        "our_policies": args.policy_list,
                        "dynamo_itl": "itl_p* of the dynamo rows are Dynamo's own per-token percentiles; "
                                      "tpot_p* (per-request mean gap) are computed alike on both sides",
                        "dynamo_runs": dynamo_runs, "bounds": bounds,
                        "per_request_agreement": agree, "dynamo_own": dynamo_own})
    print(write_markdown_table(configs))
    print(detail_table(configs))
    if bounds:
        print(bounds_table({k: {**v, "sim_wall_s": v.get("wall_s")} for k, v in configs.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
