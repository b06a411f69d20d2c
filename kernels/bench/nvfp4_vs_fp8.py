"""GPU benchmark: sparse MLA decode attention over NVFP4 rows vs the same Triton kernel over FP8 rows, and pack speed.

    python -m kernels.bench.nvfp4_vs_fp8 [--out PATH]      # JSON to PATH, else $OUT/nvfp4_vs_fp8.json, else ./

Needs an NVIDIA GPU (written for an H200); without one it prints why and exits 0. First checks the kernels against the
torch reference on the GPU (pack bit-exactness, attention error), then times each kernel with CUDA events (L2 flushed
before every timed call, median of ITERS) over batch sizes x selected-token counts, for two KV tile sizes. Stops adding
configurations after TIME_BUDGET_S so the whole run stays under 3 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from functools import partial
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

NUM_SLOTS = 262_144  # NVFP4 cache 92 MB, FP8 cache 151 MB: both well past the 50-60 MB L2
BATCHES = (1, 4, 16, 64)
SELECTED = (512, 1024, 2048)
HEADS = (16, 64)
BLOCK_TS = (16, 32)
ITERS = 20
WARMUP = 3
FLUSH_BYTES = 256 << 20
TIME_BUDGET_S = 150.0
SM_SCALE = 1 / 192 ** 0.5
CHECK_ROWS = 4096
CHECK_T = 2048


def out_path(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    return Path(os.environ.get("OUT") or ".") / "nvfp4_vs_fp8.json"


def timed_ms(fn, flush: torch.Tensor) -> float:
    """Median milliseconds of fn() over ITERS calls, each after an L2 flush (outside the timed region)."""
    for _ in range(WARMUP):
        fn()
    torch.cuda.synchronize()
    pairs = []
    for _ in range(ITERS):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in pairs)


def correctness(api, ref, rows: torch.Tensor) -> dict:
    """Kernels vs the torch reference on the GPU (the same checks the CPU interpreter tests make)."""
    sample = rows[:CHECK_ROWS]
    scales = ref.calibrate_nvfp4_scales(sample)
    nv_kernel, _ = api.nvfp4_pack(sample, *scales)
    nv_ref, nv_scales = ref.pack_nvfp4(sample, *scales)
    f8_kernel, _ = api.fp8_pack(sample, ref.calibrate_fp8_scale(sample))
    f8_ref, f8_scale = ref.pack_fp8(sample, ref.calibrate_fp8_scale(sample))
    unpack_equal = torch.equal(api.nvfp4_unpack(nv_ref, nv_scales), ref.unpack_nvfp4(nv_ref, nv_scales))
    gen = torch.Generator(device=rows.device).manual_seed(0)
    q = torch.randn(2, 16, 576, device=rows.device, generator=gen).bfloat16()
    idx = torch.randint(0, sample.shape[0], (2, CHECK_T), device=rows.device, generator=gen, dtype=torch.int32)
    idx[:, ::7] = -1
    errors = {}
    for name, got, want in (
        ("nvfp4", api.nvfp4_decode_attention(q, nv_ref, nv_scales, idx, SM_SCALE),
         ref.nvfp4_decode_attention(q, nv_ref, nv_scales, idx, SM_SCALE)),
        ("fp8", api.fp8_decode_attention(q, f8_ref, f8_scale, idx, SM_SCALE),
         ref.fp8_decode_attention(q, f8_ref, f8_scale, idx, SM_SCALE)),
    ):
        errors[name] = {"max_abs_err": float((got - want).abs().max()),
                        "rel_err": float((got - want).norm() / want.norm())}
    return {"nvfp4_pack_bytes_differing": int((nv_kernel != nv_ref).sum()),
            "fp8_pack_bytes_differing": int((f8_kernel != f8_ref).sum()),
            "nvfp4_unpack_bit_exact": bool(unpack_equal), "attention_vs_reference": errors}


def bench_pack(api, rows: torch.Tensor, flush: torch.Tensor) -> dict:
    """Pack throughput over the whole cache (bf16 rows in)."""
    results = {}
    for name, fn, row_bytes in (("nvfp4", lambda: api.nvfp4_pack(rows, 0.01, 0.02), 352),
                                ("fp8", lambda: api.fp8_pack(rows, 0.02), 576)):
        ms = timed_ms(fn, flush)
        moved = rows.numel() * rows.element_size() + rows.shape[0] * row_bytes
        results[name] = {"rows": rows.shape[0], "ms": ms, "rows_per_s": rows.shape[0] / ms * 1e3,
                         "gb_per_s": moved / ms / 1e6}
    return results


def bench_attention(api, ref, rows: torch.Tensor, flush: torch.Tensor, deadline: float) -> tuple[list[dict], bool]:
    """Median time of both kernels for every (heads, batch, T, BLOCK_T); returns (rows, truncated)."""
    nv_cache, nv_scales = api.nvfp4_pack(rows, *ref.calibrate_nvfp4_scales(rows[:CHECK_ROWS]))
    f8_cache, f8_scale = api.fp8_pack(rows, ref.calibrate_fp8_scale(rows[:CHECK_ROWS]))
    gen = torch.Generator(device=rows.device).manual_seed(1)
    out = []
    for heads in HEADS:
        for batch in BATCHES:
            for t in SELECTED:
                if time.monotonic() > deadline:
                    return out, True
                q = torch.randn(batch, heads, 576, device=rows.device, generator=gen).bfloat16()
                idx = torch.randint(0, rows.shape[0], (batch, t), device=rows.device, generator=gen, dtype=torch.int32)
                entry = {"heads": heads, "batch": batch, "selected": t}
                for block_t in BLOCK_TS:
                    nv_ms = timed_ms(partial(api.nvfp4_decode_attention, q, nv_cache, nv_scales, idx, SM_SCALE,
                                             block_t=block_t), flush)
                    f8_ms = timed_ms(partial(api.fp8_decode_attention, q, f8_cache, f8_scale, idx, SM_SCALE,
                                             block_t=block_t), flush)
                    entry[f"block_t_{block_t}"] = {"nvfp4_us": nv_ms * 1e3, "fp8_us": f8_ms * 1e3}
                nv_best = min(entry[f"block_t_{b}"]["nvfp4_us"] for b in BLOCK_TS)
                f8_best = min(entry[f"block_t_{b}"]["fp8_us"] for b in BLOCK_TS)
                entry.update(nvfp4_best_us=nv_best, fp8_best_us=f8_best, fp8_over_nvfp4=f8_best / nv_best,
                             nvfp4_kv_gb_per_s=batch * t * 352 / nv_best / 1e3,
                             fp8_kv_gb_per_s=batch * t * 576 / f8_best / 1e3,
                             splits=api.default_splits(batch, -(-heads // api.BLOCK_H), t, api.NVFP4_BLOCK_T,
                                                       rows.device))
                out.append(entry)
                print(f"H={heads:3d} B={batch:3d} T={t:5d}  nvfp4 {nv_best:8.1f} us  fp8 {f8_best:8.1f} us  "
                      f"fp8/nvfp4 {f8_best / nv_best:5.2f}", flush=True)
    return out, False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="JSON path (default $OUT/nvfp4_vs_fp8.json, else ./nvfp4_vs_fp8.json)")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("TRITON_INTERPRET=1 is set: unset it, this benchmark times compiled kernels on a GPU")
        return 2
    if not torch.cuda.is_available():
        print("no CUDA GPU visible: nothing to time (CPU correctness: pytest tests/unit/test_nvfp4_triton.py)")
        return 0
    import triton

    from kernels.nvfp4 import api, reference as ref

    torch.backends.cuda.matmul.allow_tf32 = False  # the torch reference must stay FP32
    started = time.monotonic()
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    result: dict = {"device": props.name, "sm_count": props.multi_processor_count,
                    "capability": f"{props.major}.{props.minor}", "torch": torch.__version__,
                    "triton": triton.__version__, "num_slots": NUM_SLOTS, "iters": ITERS, "block_ts": list(BLOCK_TS),
                    "row_bytes": {"nvfp4": 352, "fp8": 576}}
    path = out_path(args.out)
    status = 0
    try:
        rows = torch.randn(NUM_SLOTS, 576, device=dev, dtype=torch.bfloat16)
        flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=dev)
        result["correctness"] = correctness(api, ref, rows)
        print("correctness:", json.dumps(result["correctness"]), flush=True)
        result["pack"] = bench_pack(api, rows, flush)
        print("pack:", json.dumps(result["pack"]), flush=True)
        result["attention"], result["truncated"] = bench_attention(api, ref, rows, flush,
                                                                   started + TIME_BUDGET_S)
    except Exception:
        result["error"] = traceback.format_exc()
        print(result["error"], file=sys.stderr)
        status = 1
    result["wall_s"] = time.monotonic() - started
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path} ({result['wall_s']:.0f} s)")
    return status


if __name__ == "__main__":
    sys.exit(main())
