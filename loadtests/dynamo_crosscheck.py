"""Replay a Mooncake-format trace through NVIDIA Dynamo's engine simulator ("mocker").

A cross-check for our own simulator: the same trace, run through Dynamo's offline
virtual-clock replay (``dynamo._core.run_mocker_trace_replay``, Rust, in the PyPI wheel
``ai-dynamo-runtime``). Offline replay needs no GPU, NATS, etcd or HTTP frontend, and runs
the whole 3,993-request Mooncake synthetic trace in a second or two.

Self-contained on purpose (no infermesh imports): run it with the Dynamo venv's python,
e.g.

    python3 -m venv /tmp/dynamo-venv
    /tmp/dynamo-venv/bin/pip install ai-dynamo-runtime==1.6.1
    /tmp/dynamo-venv/bin/python loadtests/dynamo_crosscheck.py \\
        /work/shared/data/mooncake_synthetic_trace.jsonl --workers 4 --out /tmp/dyn.json

See docs/results/dynamo_notes.md for the mocker's performance model and what each knob
means. Capacity note: ``--num-gpu-blocks`` counts blocks of ``--block-size`` tokens, so
changing the block size without changing the block count changes the KV capacity (and
with it the decode-step time, which depends on KV utilisation).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from importlib import metadata


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default method); None for no data."""
    if not values:
        return None
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def limited_trace(path: str, limit: int | None) -> tuple[str, int, str | None]:
    """The trace path to hand to Dynamo, its request count, and a temp file to delete."""
    with open(path, encoding="utf-8") as f:
        lines = [line for line in f if line.strip()]
    if limit is None or limit >= len(lines):
        return path, len(lines), None
    fd, tmp = tempfile.mkstemp(prefix="dynamo_trace_", suffix=".jsonl")
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.writelines(lines[:limit])
    return tmp, limit, tmp


def engine_config(args: argparse.Namespace) -> dict:
    """The mocker engine config (AISimulate canonical form: top level + ``engine``)."""
    engine: dict = {"backend": args.backend}
    for key in ("block_size", "num_gpu_blocks", "max_num_batched_tokens", "max_num_seqs",
                "max_model_len", "speedup_ratio", "decode_speedup_ratio", "preemption_mode"):
        value = getattr(args, key)
        if value is not None:
            engine[key] = value
    if args.no_prefix_caching:
        engine["enable_prefix_caching"] = False
    if args.no_chunked_prefill:
        engine["enable_chunked_prefill"] = False
    if args.fixed_timing:
        engine["timing_model"] = {"type": "fixed", "prefill_ms": args.fixed_timing[0],
                                  "decode_ms": args.fixed_timing[1]}
    if args.engine_json:
        engine.update(json.loads(args.engine_json))
    return {"engine": engine}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", help="Mooncake JSONL: timestamp (ms), input_length, output_length, hash_ids")
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--workers", type=int, default=1, help="aggregated mocker workers (default 1)")
    p.add_argument("--router", choices=("round_robin", "kv_router"), default="round_robin",
                   help="how requests are spread over workers (default round_robin)")
    p.add_argument("--backend", choices=("vllm", "trtllm", "sglang"), default="vllm",
                   help="scheduler the mocker imitates (default vllm)")
    p.add_argument("--trace-block-size", type=int, default=512,
                   help="tokens per trace hash_id (Mooncake: 512)")
    p.add_argument("--block-size", type=int, default=None, help="engine KV block size (mocker default: vllm 64)")
    p.add_argument("--num-gpu-blocks", type=int, default=None, help="KV blocks per worker (mocker default 16384)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget per step (default 8192)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="running requests per worker (default 256)")
    p.add_argument("--max-model-len", type=int, default=None, help="reject prompts at or above this (default: none)")
    p.add_argument("--speedup-ratio", type=float, default=None, help="divide prefill and decode times by this")
    p.add_argument("--decode-speedup-ratio", type=float, default=None, help="extra divisor for decode only")
    p.add_argument("--preemption-mode", choices=("lifo", "fifo"), default=None)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--no-chunked-prefill", action="store_true")
    p.add_argument("--fixed-timing", type=float, nargs=2, metavar=("PREFILL_MS", "DECODE_MS"),
                   help="constant step times instead of the default polynomial")
    p.add_argument("--engine-json", default=None,
                   help="extra engine fields as JSON, merged last (e.g. '{\"prefill_schedule_interval\": 1}')")
    p.add_argument("--arrival-speedup", type=float, default=1.0, help="compress trace timestamps by this factor")
    p.add_argument("--per-request", action="store_true", help="include slim per-request records in the JSON")
    p.add_argument("--out", default=None, help="write the JSON here (default: stdout)")
    args = p.parse_args(argv)

    # The Rust side logs one INFO line per routing decision under kv_router; that floods
    # stderr and slows the replay. DYN_LOG (Dynamo's RUST_LOG) is read when _core loads.
    os.environ.setdefault("DYN_LOG", "warn")
    try:
        from dynamo._core import _normalize_mocker_config, run_mocker_trace_replay
    except ImportError as exc:  # pragma: no cover - wrong interpreter
        print(f"needs ai-dynamo-runtime (pip install ai-dynamo-runtime): {exc}", file=sys.stderr)
        return 2

    trace_path, n_requests, tmp = limited_trace(args.trace, args.limit)
    config = engine_config(args)
    try:
        normalized = _normalize_mocker_config(config)
        t0 = time.perf_counter()
        result = run_mocker_trace_replay(
            [trace_path],
            extra_engine_args=config,
            num_workers=args.workers,
            router_mode=args.router,
            arrival_speedup_ratio=args.arrival_speedup,
            trace_block_size=args.trace_block_size,
            trace_format="mooncake",
            capture_per_request=True,
        )
        wall_s = time.perf_counter() - t0
    finally:
        if tmp:
            os.unlink(tmp)

    s = dict(result.summary)
    records = result.per_request or []
    done = [r for r in records if r.get("terminal_status") == "completed"]
    ttft = [r["ttft_ms"] for r in done if r.get("ttft_ms") is not None]
    tpot = [r["itl_ms"] for r in done if r.get("itl_ms") is not None and r["output_length"] > 1]
    e2e = [r["e2e_latency_ms"] for r in done if r.get("e2e_latency_ms") is not None]
    in_tokens = sum(r["input_length"] for r in done)
    reused = sum(r.get("reused_input_tokens") or 0 for r in done)
    out_tokens = sum(r["output_length"] for r in done)
    duration_s = s["duration_ms"] / 1000.0
    # Token-weighted mean ITL from the per-request means; equals Dynamo's mean_itl_ms when
    # its ITL statistics are per token (they are: see docs/results/dynamo_notes.md).
    gaps = sum(r["output_length"] - 1 for r in done if r["output_length"] > 1)
    itl_token_mean = (sum(r["itl_ms"] * (r["output_length"] - 1) for r in done if r["output_length"] > 1) / gaps
                      if gaps else None)

    report = {
        "tool": "dynamo mocker offline trace replay (dynamo._core.run_mocker_trace_replay)",
        "versions": {pkg: _version(pkg) for pkg in ("ai-dynamo-runtime", "ai-dynamo", "aisimulate")},
        "trace": os.path.abspath(args.trace),
        "requests": n_requests,
        "replay": {"workers": args.workers, "router": args.router, "trace_block_size": args.trace_block_size,
                   "arrival_speedup": args.arrival_speedup},
        "engine": normalized["engine"],
        "summary": {
            "completed": len(done),
            "rejected_or_other": len(records) - len(done),
            "ttft_ms": {"p50": s.get("median_ttft_ms"), "p90": s.get("p90_ttft_ms"), "p99": s.get("p99_ttft_ms"),
                        "mean": s.get("mean_ttft_ms")},
            "itl_ms": {"p50": s.get("median_itl_ms"), "p90": s.get("p90_itl_ms"), "p99": s.get("p99_itl_ms"),
                       "mean": s.get("mean_itl_ms")},
            "e2e_ms": {"p50": s.get("median_e2e_latency_ms"), "p90": s.get("p90_e2e_latency_ms"),
                       "p99": s.get("p99_e2e_latency_ms")},
            "output_tok_s": s.get("output_throughput_tok_s"),
            "input_tok_s": s.get("input_throughput_tok_s"),
            "prefix_hit_rate": s.get("prefix_cache_reused_ratio"),
            "sim_duration_s": duration_s,
            "wall_s": wall_s,
            "dynamo_wall_ms": s.get("wall_time_ms"),
        },
        # Recomputed here from the per-request records (linear-interpolated percentiles),
        # so the two sets can be compared; per-token ITL percentiles exist only in Dynamo's.
        "recomputed": {
            "ttft_ms": {q: percentile(ttft, v) for q, v in (("p50", 50), ("p90", 90), ("p99", 99))},
            "tpot_ms_per_request": {q: percentile(tpot, v) for q, v in (("p50", 50), ("p90", 90), ("p99", 99))},
            "e2e_ms": {q: percentile(e2e, v) for q, v in (("p50", 50), ("p90", 90), ("p99", 99))},
            "itl_ms_token_weighted_mean": itl_token_mean,
            "prefix_hit_rate": reused / in_tokens if in_tokens else None,
            "output_tok_s": out_tokens / duration_s if duration_s else None,
        },
        "dynamo_summary": s,
    }
    if args.per_request:
        keep = ("arrival_time_ms", "first_admit_ms", "first_token_ms", "last_token_ms", "ttft_ms", "itl_ms",
                "e2e_latency_ms", "input_length", "output_length", "reused_input_tokens", "decode_worker_idx",
                "readmission_count", "terminal_status")
        report["per_request"] = [{k: r.get(k) for k in keep} for r in records]

    text = json.dumps(report, indent=1, default=str)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
        sm = report["summary"]
        print(f"{n_requests} requests, {args.workers} worker(s), {args.router}: "
              f"TTFT p50/p90/p99 {_fmt(sm['ttft_ms'])} ms, ITL p50/p90/p99 {_fmt(sm['itl_ms'])} ms, "
              f"{sm['output_tok_s']:.1f} out tok/s, prefix hit {sm['prefix_hit_rate']:.3f}, "
              f"wall {wall_s:.2f}s -> {args.out}")
    else:
        print(text)
    return 0


def _fmt(d: dict) -> str:
    return "/".join("-" if d[k] is None else f"{d[k]:.1f}" for k in ("p50", "p90", "p99"))


def _version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
