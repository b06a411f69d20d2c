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

Writes <out-stem>.json and .png (loadtests/lib/report.write_report) and prints markdown tables.
docs/results/dynamo_crosscheck.md explains the differences.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from loadtests.lib.fleet_sim import FleetConfig, FleetSim
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


def run_ours(args: argparse.Namespace, workers: int) -> tuple[list[RequestRecord], float]:
    """Our fleet sim with Dynamo's step-time polynomials: its records and its wall time (s)."""
    capacity = args.num_gpu_blocks * args.block_size
    config = FleetConfig(
        profile=load_profile(args.profile), num_workers=workers, policy="round_robin",
        block_size=args.block_size, num_kv_blocks=args.num_gpu_blocks,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        host_kv=False, label=f"{OURS} {workers}w", cost=lambda: DynamoPolynomialCost(capacity))
    t0 = time.perf_counter()
    result = FleetSim(config).run(MooncakeTrace(args.trace, block_tokens=args.trace_block_size, limit=args.limit))
    return result.records, time.perf_counter() - t0


def dynamo_command(args: argparse.Namespace, workers: int, out: str) -> list[str]:
    """The dynamo_crosscheck.py command line for one worker count (its JSON goes to ``out``)."""
    cmd = [args.dynamo_python, str(DYNAMO_SCRIPT), args.trace, "--workers", str(workers),
           "--router", "round_robin", "--backend", "vllm", "--trace-block-size", str(args.trace_block_size),
           "--block-size", str(args.block_size), "--num-gpu-blocks", str(args.num_gpu_blocks),
           "--max-num-batched-tokens", str(args.max_num_batched_tokens),
           "--max-num-seqs", str(args.max_num_seqs), "--per-request", "--out", out]
    if args.limit is not None:
        cmd += ["--limit", str(args.limit)]
    return cmd


def run_dynamo(args: argparse.Namespace, workers: int) -> dict:
    """Dynamo's replay for one worker count, as the JSON dynamo_crosscheck.py writes."""
    fd, out = tempfile.mkstemp(prefix="dynamo_crosscheck_", suffix=".json")
    os.close(fd)
    try:
        cmd = dynamo_command(args, workers, out)
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", nargs="?", default=DEFAULT_TRACE, help="Mooncake JSONL trace")
    p.add_argument("--workers", type=int, nargs="+", default=[4, 8], help="worker counts to compare (default 4 8)")
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--trace-block-size", type=int, default=512, help="tokens per trace hash_id (Mooncake: 512)")
    p.add_argument("--block-size", type=int, default=64, help="KV block size (Dynamo's vLLM default 64)")
    p.add_argument("--num-gpu-blocks", type=int, default=16384, help="KV blocks per worker (Dynamo's default)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--profile", default="gb200-glm53", help="our profile; names the run only, sizes are explicit")
    p.add_argument("--dynamo-python", default=DYNAMO_PYTHON, help="python of a venv with ai-dynamo-runtime")
    p.add_argument("--out-stem", default="docs/results/dynamo_crosscheck", help="writes <stem>.json and .png")
    args = p.parse_args(argv)

    if not Path(args.dynamo_python).exists():
        print(f"Dynamo's replay needs a python with ai-dynamo-runtime; {args.dynamo_python} is missing.\n"
              f"Install it with:\n    {INSTALL_HINT}\n(or pass --dynamo-python)", file=sys.stderr)
        return 2

    configs: dict[str, dict] = {}
    dynamo_own: dict[str, dict] = {}
    agree: dict[str, dict] = {}
    for workers in args.workers:
        ours, wall = run_ours(args, workers)
        configs[f"{OURS} {workers}w"] = {**summarize(ours, num_gpus=workers), **e2e_figures(ours),
                                        "itl_source": "per token", "wall_s": wall}
        print(f"{OURS} {workers}w: {len(ours)} requests in {wall:.1f}s", file=sys.stderr)
        report = run_dynamo(args, workers)
        records = dynamo_records(report)
        summary = {**summarize(records, num_gpus=workers), **e2e_figures(records),
                   "wall_s": report["summary"]["wall_s"]}
        own = report["summary"]["itl_ms"]  # Dynamo's per-token ITL percentiles (its own percentile method)
        summary.update({f"itl_p{q}_ms": own[f"p{q}"] for q in (50, 90, 99)}, itl_source="dynamo per token")
        configs[f"{THEIRS} {workers}w"] = summary
        agree[f"{workers}w"] = agreement(ours, report)
        print(f"per-request agreement {workers}w: {agree[f'{workers}w']}", file=sys.stderr)
        dynamo_own[f"{THEIRS} {workers}w"] = {"summary": report["summary"], "engine": report["engine"],
                                              "versions": report["versions"]}

    command = shlex.join([".venv/bin/python", "-m", "loadtests.crosscheck", *(argv if argv is not None
                                                                             else sys.argv[1:])])
    write_report(Path(args.out_stem), title="infermesh fleet sim vs NVIDIA Dynamo mocker (matched constants, "
                 "round robin, Dynamo's polynomial step times)", command=command, configs=configs,
                 notes={"trace": os.path.abspath(args.trace), "limit": args.limit,
                        "matched": {"block_size": args.block_size, "num_gpu_blocks": args.num_gpu_blocks,
                                    "max_num_batched_tokens": args.max_num_batched_tokens,
                                    "max_num_seqs": args.max_num_seqs, "router": "round_robin",
                                    "trace_block_size": args.trace_block_size},
                        "dynamo_itl": "itl_p* of the dynamo rows are Dynamo's own per-token percentiles; "
                                      "tpot_p* (per-request mean gap) are computed alike on both sides",
                        "per_request_agreement": agree, "dynamo_own": dynamo_own})
    print(write_markdown_table(configs))
    print(detail_table(configs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
