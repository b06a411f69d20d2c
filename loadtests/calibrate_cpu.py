"""Calibrate the ``cpu-gemma3-270m`` sim profile against vLLM's CPU backend on this machine.

Starts one :class:`VllmEngine` on the prepared Gemma 3 270M (bf16, pinned to one core),
measures prefill (time to first token of single uncached prompts) and decode (median
inter-token gap at several batch sizes and contexts), then fits the profile's
hardware constants so that :class:`CostModel` reproduces those times:

    step = step_overhead_s + max(flops / F, bytes / B)    F = peak_flops * prefill_mfu,
                                                          B = hbm_bytes_per_s * hbm_efficiency

The model facts (active_params, weight_bytes_per_step, num_layers, kv rows, attention
FLOPs) stay as they are. The fit minimises the squared relative error over all points:
a log grid over (F, B) with the best non-negative overhead in closed form at each node.

    python -m loadtests.calibrate_cpu --out docs/results/cpu_profile_calibration
    python -m loadtests.calibrate_cpu --refit docs/results/cpu_profile_calibration.json   # no engine
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import statistics
import sys
import time
import uuid
from dataclasses import replace
from itertools import pairwise
from pathlib import Path
from typing import Any

from services.worker.engines.cost_model import CostModel, Profile, load_profile
from shared.schema import SamplingParams

PROFILE = "cpu-gemma3-270m"
PREFILL_LENGTHS = (64, 256, 1024, 2048)
DECODE_CASES = ((1, 128), (4, 128), (16, 128), (1, 1500))  # (batch, prompt tokens)
TOKEN_RANGE = (1000, 200_000)  # ordinary vocabulary ids of Gemma 3 (262k vocab), no special tokens


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [2] + [rng.randrange(*TOKEN_RANGE) for _ in range(n - 1)]  # <bos> + random ids: never a cache hit


async def _timed(engine: Any, prompt: list[int], max_tokens: int) -> tuple[float, list[float]]:
    """Submit one request; return its start time and the arrival time of every output token."""
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    arrivals: list[float] = []
    async for out in engine.generate(uuid.uuid4().hex, prompt, sampling):
        now = time.perf_counter()
        arrivals.extend(now for _ in out.token_ids)
        if out.finish_reason is not None:
            break
    assert len(arrivals) == max_tokens, (len(arrivals), max_tokens)
    return start, arrivals


def stream_bandwidth(core: int) -> float:
    """Bytes/s one core reads from DRAM (best of 5 sums over a 512 MiB array), pinned to ``core``."""
    import numpy as np

    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})
    try:
        a = np.ones(2**27, dtype=np.float32)
        best = 0.0
        for _ in range(5):
            t = time.perf_counter()
            a.sum()
            best = max(best, a.nbytes / (time.perf_counter() - t))
        return best
    finally:
        os.sched_setaffinity(0, before)


async def measure(model_path: str, core: int, repeats: int, decode_tokens: int, seed: int) -> dict[str, Any]:
    from services.worker.engines.vllm_engine import VllmEngine, VllmEngineConfig

    engine = VllmEngine(VllmEngineConfig(model="gemma-3-270m", model_path=model_path, max_model_len=4096,
                                         kv_cache_gib=1.0, cpu_core=core, kv_events=False))
    t0 = time.perf_counter()
    spec = await engine.start()
    startup_s = time.perf_counter() - t0
    cfg = engine._llm.vllm_config
    engine_info = {
        "startup_s": round(startup_s, 1), "block_size": spec.block_size, "num_kv_blocks": spec.num_kv_blocks,
        "dtype": str(cfg.model_config.dtype),
        "max_num_batched_tokens": int(cfg.scheduler_config.max_num_batched_tokens),
        "max_num_seqs": int(cfg.scheduler_config.max_num_seqs),
        "chunked_prefill": bool(cfg.scheduler_config.enable_chunked_prefill),
    }
    print(f"engine up in {startup_s:.1f}s: {engine_info}", flush=True)
    rng = random.Random(seed)
    try:
        for n in (64, 512, 64):  # warm-up: first-call allocations, oneDNN primitive creation
            await _timed(engine, _prompt(rng, n), 4)
        prefill = []
        for n in PREFILL_LENGTHS:
            ttfts = []
            for _ in range(repeats):
                start, arrivals = await _timed(engine, _prompt(rng, n), 1)
                ttfts.append(arrivals[0] - start)
            prefill.append({"tokens": n, "ttft_s": ttfts, "median_s": statistics.median(ttfts)})
            print(f"prefill {n:5d} tokens: ttft median {statistics.median(ttfts) * 1e3:8.1f} ms  {ttfts}", flush=True)
        decode = []
        for batch, ctx in DECODE_CASES:
            results = await asyncio.gather(*(_timed(engine, _prompt(rng, ctx), decode_tokens) for _ in range(batch)))
            # steady state: only gaps after every request of the batch has its first token
            steady_from = max(arrivals[0] for _, arrivals in results)
            gaps = [b - a for _, arrivals in results for a, b in pairwise(arrivals) if a >= steady_from]
            gap = statistics.median(gaps)
            decode.append({"batch": batch, "prompt_tokens": ctx, "output_tokens": decode_tokens,
                           "mean_context": ctx + decode_tokens / 2, "num_gaps": len(gaps), "median_gap_s": gap,
                           "p10_gap_s": statistics.quantiles(gaps, n=10)[0],
                           "p90_gap_s": statistics.quantiles(gaps, n=10)[-1]})
            print(f"decode batch {batch:2d} ctx {ctx:5d}: median step {gap * 1e3:7.1f} ms over {len(gaps)} gaps",
                  flush=True)
    finally:
        await engine.stop()
    return {"engine": engine_info, "prefill": prefill, "decode": decode}


# ---------------------------------------------------------------------------------------------- model and fit

def _points(measured: dict[str, Any]) -> list[dict[str, Any]]:
    chunk = measured["engine"]["max_num_batched_tokens"]
    pts = []
    for p in measured["prefill"]:
        n = p["tokens"]
        chunks = [(min(chunk, n - s), s) for s in range(0, n, chunk)]  # chunked prefill: one step per chunk
        pts.append({"kind": "prefill", "label": f"prefill {n} tok", "measured_s": p["median_s"],
                    "steps": [(chunks, [])]})
    for d in measured["decode"]:
        ctx = int(d["mean_context"])
        pts.append({"kind": "decode", "label": f"decode b={d['batch']} ctx~{ctx}", "measured_s": d["median_gap_s"],
                    "steps": [([], [ctx] * d["batch"])]})
    return pts


def _predict(model: CostModel, point: dict[str, Any]) -> float:
    return sum(model.step_time(prefills, decodes) for prefills, decodes in point["steps"])


def _terms(profile: Profile, point: dict[str, Any]) -> list[tuple[int, float, float]]:
    """Per step: (1 overhead, FLOPs, bytes), so that step = o + max(flops / F, bytes / B)."""
    model = CostModel(profile, "bf16")
    return [(1, *model.step_work(prefills, decodes)) for prefills, decodes in point["steps"]]


def fit(profile: Profile, points: list[dict[str, Any]], max_byte_rate: float = math.inf,
        ) -> tuple[float, float, float, float]:
    """(overhead, F, B, rms relative error) minimising sum((pred - meas) / meas)^2 over a log grid of F and B.

    B is capped at ``max_byte_rate`` (the measured stream bandwidth of one core): a decode
    step cannot read its weights faster than the core streams DRAM.
    """
    terms = [_terms(profile, p) for p in points]
    meas = [p["measured_s"] for p in points]

    def best_at(flop_rate: float, byte_rate: float) -> tuple[float, float]:
        # pred_i = o * steps_i + r_i; weighted LS in o with weights 1/m_i^2, clamped to o >= 0
        steps = [sum(t[0] for t in ts) for ts in terms]
        roof = [sum(max(f / flop_rate, b / byte_rate) for _, f, b in ts) for ts in terms]
        num = sum(s * (m - r) / m**2 for s, r, m in zip(steps, roof, meas, strict=True))
        den = sum(s * s / m**2 for s, m in zip(steps, meas, strict=True))
        o = max(0.0, num / den)
        err = sum(((o * s + r - m) / m) ** 2 for s, r, m in zip(steps, roof, meas, strict=True))
        return o, err

    best = (math.inf, 0.0, 0.0, 0.0)
    lo_f, hi_f, lo_b, hi_b = 1e9, 1e12, 1e8, 1e11
    for _ in range(4):  # coarse-to-fine log grid
        n = 80
        for i in range(n + 1):
            f = lo_f * (hi_f / lo_f) ** (i / n)
            for j in range(n + 1):
                b = min(max_byte_rate, lo_b * (hi_b / lo_b) ** (j / n))
                o, err = best_at(f, b)
                if err < best[0]:
                    best = (err, o, f, b)
        _, _, f, b = best
        lo_f, hi_f, lo_b, hi_b = f / 1.5, f * 1.5, b / 1.5, b * 1.5
    err, o, f, b = best
    return o, f, b, math.sqrt(err / len(points))


def _table(profile: Profile, points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    model = CostModel(profile, "bf16")
    rows = []
    for p in points:
        pred = _predict(model, p)
        rows.append({"point": p["label"], "kind": p["kind"], "measured_s": p["measured_s"], "predicted_s": pred,
                     "rel_error": (pred - p["measured_s"]) / p["measured_s"]})
    return rows


def _rms(rows: list[dict[str, Any]]) -> float:
    return math.sqrt(sum(r["rel_error"] ** 2 for r in rows) / len(rows))


def analyse(measured: dict[str, Any]) -> dict[str, Any]:
    before = load_profile(PROFILE)
    points = _points(measured)
    stream = measured["stream_bytes_per_s"]
    o, f, b, _ = fit(before, points, stream)
    after = replace(before, step_overhead_s=o, prefill_mfu=f / before.peak_flops,
                    hbm_bytes_per_s=stream, hbm_efficiency=b / stream)
    rows_before, rows_after = _table(before, points), _table(after, points)
    # the same fit on each kind alone shows how far one roofline is from serving both
    sub = {}
    for kind in ("prefill", "decode"):
        kp = [p for p in points if p["kind"] == kind]
        so, sf, sb, srms = fit(before, kp, stream)
        sub[kind] = {"step_overhead_s": so, "flop_rate": sf, "byte_rate": sb, "rms_rel_error": srms}
    return {
        "constants_before": {k: getattr(before, k) for k in
                             ("peak_flops", "prefill_mfu", "hbm_bytes_per_s", "hbm_efficiency", "step_overhead_s")},
        "fit": {"step_overhead_s": o, "flop_rate": f, "byte_rate": b, "prefill_mfu": f / before.peak_flops,
                "hbm_bytes_per_s": stream, "hbm_efficiency": b / stream},
        "fit_by_kind": sub,
        "before": rows_before, "after": rows_after,
        "rms_rel_error_before": _rms(rows_before), "rms_rel_error_after": _rms(rows_after),
    }


def _markdown(result: dict[str, Any], command: str) -> str:
    m, a, fit_ = result["measured"], result["analysis"], result["analysis"]["fit"]
    lines = [
        "# cpu-gemma3-270m profile calibration",
        "",
        f"Command: `{command}` ({result['date']}, {result['host']['cpu']}, {result['host']['cores']} cores, "
        f"load average at start {result['host']['loadavg_start']}, at end {result['host']['loadavg_end']}).",
        "",
        f"Engine: vLLM {result['host']['vllm']} CPU backend, eager, pinned to core {result['core']}, "
        f"dtype {m['engine']['dtype']}, block size {m['engine']['block_size']}, "
        f"max_num_batched_tokens {m['engine']['max_num_batched_tokens']}, started in {m['engine']['startup_s']} s.",
        "Prefill = time to first token of one uncached random prompt (max_tokens=1, median of "
        f"{result['repeats']}); decode = median inter-token gap once every request of the batch is decoding "
        f"({m['decode'][0]['output_tokens']} output tokens each, context = prompt + half the output).",
        "",
        "| point | measured ms | before ms | err before | after ms | err after |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for rb, ra in zip(a["before"], a["after"], strict=True):
        lines.append(f"| {rb['point']} | {rb['measured_s'] * 1e3:.1f} | {rb['predicted_s'] * 1e3:.1f} | "
                     f"{rb['rel_error']:+.0%} | {ra['predicted_s'] * 1e3:.1f} | {ra['rel_error']:+.0%} |")
    cb = a["constants_before"]
    lines += [
        "",
        f"RMS relative error: before {a['rms_rel_error_before']:.0%}, after {a['rms_rel_error_after']:.0%}.",
        "",
        "| constant | before | fitted |",
        "|---|---:|---:|",
        f"| step_overhead_s | {cb['step_overhead_s']:.4g} | {fit_['step_overhead_s']:.4g} |",
        f"| peak_flops * prefill_mfu (FLOP/s) | {cb['peak_flops'] * cb['prefill_mfu']:.3g} | {fit_['flop_rate']:.3g} |",
        f"| hbm_bytes_per_s (B/s; after: one core's measured DRAM read rate) | {cb['hbm_bytes_per_s']:.3g} | "
        f"{fit_['hbm_bytes_per_s']:.3g} |",
        f"| hbm_bytes_per_s * hbm_efficiency (B/s) | {cb['hbm_bytes_per_s'] * cb['hbm_efficiency']:.3g} | "
        f"{fit_['byte_rate']:.3g} |",
        "",
        "Fitting each kind alone (same grid):",
        "",
        "| points | overhead s | FLOP/s | B/s | RMS rel err |",
        "|---|---:|---:|---:|---:|",
    ]
    for kind, s in a["fit_by_kind"].items():
        lines.append(f"| {kind} only | {s['step_overhead_s']:.4g} | {s['flop_rate']:.3g} | {s['byte_rate']:.3g} | "
                     f"{s['rms_rel_error']:.0%} |")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default="", help="Gemma folder (default: infermesh prepare-model's)")
    parser.add_argument("--core", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="docs/results/cpu_profile_calibration", help="writes OUT.json and OUT.md")
    parser.add_argument("--refit", default="", help="re-analyse the measurements of an earlier OUT.json")
    args = parser.parse_args(argv)
    command = "python -m loadtests.calibrate_cpu " + " ".join(argv if argv is not None else sys.argv[1:])

    if args.refit:
        result = json.loads(Path(args.refit).read_text())
        if "stream_bytes_per_s" not in result["measured"]:
            result["measured"]["stream_bytes_per_s"] = stream_bandwidth(result.get("core", args.core))
    else:
        model_path = args.model_path
        if not model_path:
            from infermesh.models import prepare_gemma

            model_path = str(prepare_gemma())
        import vllm

        load_start = os.getloadavg()
        measured = asyncio.run(measure(model_path, args.core, args.repeats, args.decode_tokens, args.seed))
        measured["stream_bytes_per_s"] = stream_bandwidth(args.core)
        result = {
            "date": time.strftime("%Y-%m-%d"), "command": command, "core": args.core, "repeats": args.repeats,
            "host": {"cpu": _cpu_name(), "cores": os.cpu_count(), "vllm": vllm.__version__,
                     "loadavg_start": [round(x, 2) for x in load_start],
                     "loadavg_end": [round(x, 2) for x in os.getloadavg()]},
            "measured": measured,
        }
    result["analysis"] = analyse(result["measured"])
    a = result["analysis"]
    for rb, ra in zip(a["before"], a["after"], strict=True):
        print(f"{rb['point']:24s} measured {rb['measured_s'] * 1e3:8.1f} ms  before {rb['predicted_s'] * 1e3:8.1f} "
              f"({rb['rel_error']:+6.0%})  after {ra['predicted_s'] * 1e3:8.1f} ({ra['rel_error']:+6.0%})")
    print(f"fit: {json.dumps(a['fit'])}")
    print(f"rms rel error before {a['rms_rel_error_before']:.1%} after {a['rms_rel_error_after']:.1%}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    md = out.with_suffix(".md")
    if not args.refit or not md.exists():
        md.write_text(_markdown(result, result.get("command", command)))
    print(f"wrote {out.with_suffix('.json')} and {md}")
    return 0


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


if __name__ == "__main__":
    raise SystemExit(main())
