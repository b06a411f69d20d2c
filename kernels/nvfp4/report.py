"""Accuracy of NVFP4 vs FP8 MLA KV rows: round-trip error and sparse decode attention error vs an FP16 cache.

    python -m kernels.nvfp4.report [--out docs/results/nvfp4] [--seeds 5]

Synthetic but shaped like an MLA cache: the latent channels are Gaussian with log-normal per-channel spreads and a few
outlier channels (x10), rope channels Gaussian with a wider spread; the absorbed bf16 query gives random keys scores of
std 1.5 and one selected key per head a +6 boost (so softmax is neither uniform nor one-hot). Runs the torch reference,
which the Triton kernels reproduce (tests/unit/test_nvfp4_triton.py). Writes accuracy.json, accuracy.md and
accuracy.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from kernels.nvfp4 import format as fmt, reference as ref

NUM_SLOTS = 4096
NUM_HEADS = 64
SELECTED = (256, 1024, 2048)
OUTLIER_CHANNELS = 8
OUTLIER_GAIN = 10.0
ROPE_STD = 2.0
QUERY_SCORE_STD = 1.5  # std of q.k * sm_scale for a random key
QUERY_KEY_BOOST = 6.0  # score added to one selected key per head
SM_SCALE = 1 / 192 ** 0.5  # DeepSeek-style MLA softmax scale (qk head dim 128 + 64)
COMMAND = "python -m kernels.nvfp4.report"


def make_cache_rows(gen: torch.Generator) -> torch.Tensor:
    """FP32 rows [NUM_SLOTS, 576] with per-channel spreads and outlier latent channels."""
    spread = torch.exp(0.5 * torch.randn(fmt.LATENT_DIM, generator=gen))
    spread[torch.randperm(fmt.LATENT_DIM, generator=gen)[:OUTLIER_CHANNELS]] *= OUTLIER_GAIN
    latent = torch.randn(NUM_SLOTS, fmt.LATENT_DIM, generator=gen) * spread
    rope = torch.randn(NUM_SLOTS, fmt.ROPE_DIM, generator=gen) * ROPE_STD
    return torch.cat([latent, rope], dim=1)


def make_query(rows: torch.Tensor, indices: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """bf16 [H, 576]: random scores of std QUERY_SCORE_STD, plus QUERY_KEY_BOOST on one selected key per head."""
    key_norm = float(rows.norm(dim=1).square().mean().sqrt())
    q = torch.randn(NUM_HEADS, fmt.ROW_DIM, generator=gen) * QUERY_SCORE_STD / (key_norm * SM_SCALE)
    keys = rows[indices[torch.randint(0, len(indices), (NUM_HEADS,), generator=gen)].long()]
    q = q + QUERY_KEY_BOOST * keys / (keys.norm(dim=1, keepdim=True) ** 2 * SM_SCALE)
    return q.bfloat16()


def rel(x: torch.Tensor, want: torch.Tensor) -> float:
    return float((x.double() - want.double()).norm() / want.double().norm())


def caches(rows16: torch.Tensor) -> dict[str, tuple]:
    """Each KV format: (dequantized rows for the round trip, attention function)."""
    rows = rows16.float()
    nv_gs, nv_gs_scales = ref.pack_nvfp4(rows16, *ref.calibrate_nvfp4_scales(rows))
    nv_plain, nv_plain_scales = ref.pack_nvfp4(rows16)
    f8, f8_scale = ref.pack_fp8(rows16, ref.calibrate_fp8_scale(rows))
    f8_one, _ = ref.pack_fp8(rows16)
    return {
        "bf16": (rows16.bfloat16().float(),
                 lambda q, i: ref.decode_attention(q, rows16.bfloat16().float(), i, SM_SCALE)),
        "fp8 (per-tensor scale)": (ref.unpack_fp8(f8, f8_scale),
                                   lambda q, i: ref.fp8_decode_attention(q, f8, f8_scale, i, SM_SCALE)),
        "fp8 (scale 1.0)": (ref.unpack_fp8(f8_one, 1.0), lambda q, i: ref.fp8_decode_attention(q, f8_one, 1.0, i,
                                                                                              SM_SCALE)),
        "nvfp4 (global scale)": (ref.unpack_nvfp4(nv_gs, nv_gs_scales),
                                 lambda q, i: ref.nvfp4_decode_attention(q, nv_gs, nv_gs_scales, i, SM_SCALE)),
        "nvfp4 (no global scale)": (ref.unpack_nvfp4(nv_plain, nv_plain_scales),
                                    lambda q, i: ref.nvfp4_decode_attention(q, nv_plain, nv_plain_scales, i,
                                                                            SM_SCALE)),
    }


def run(seeds: int) -> dict:
    """Median (and max) relative errors over the seeds, per format."""
    round_trip: dict[str, dict[str, list[float]]] = {}
    attention: dict[str, dict[int, list[float]]] = {}
    for seed in range(seeds):
        gen = torch.Generator().manual_seed(seed)
        rows16 = make_cache_rows(gen).half()
        want_rows = rows16.float()
        formats = caches(rows16)
        for name, (back, _) in formats.items():
            parts = round_trip.setdefault(name, {"row": [], "latent": [], "rope": []})
            parts["row"].append(rel(back, want_rows))
            parts["latent"].append(rel(back[:, :fmt.LATENT_DIM], want_rows[:, :fmt.LATENT_DIM]))
            parts["rope"].append(rel(back[:, fmt.LATENT_DIM:], want_rows[:, fmt.LATENT_DIM:]))
        for t in SELECTED:
            idx = torch.randperm(NUM_SLOTS, generator=gen)[:t].to(torch.int32)
            q = make_query(want_rows, idx, gen)
            base = ref.decode_attention(q, want_rows, idx, SM_SCALE)
            for name, (_, attend) in formats.items():
                attention.setdefault(name, {}).setdefault(t, []).append(rel(attend(q, idx), base))
    summary = lambda xs: {"median": statistics.median(xs), "max": max(xs)}  # noqa: E731
    return {
        "round_trip_rel_error": {n: {k: summary(v) for k, v in parts.items()} for n, parts in round_trip.items()},
        "attention_rel_error_vs_fp16": {n: {str(t): summary(v) for t, v in by_t.items()}
                                        for n, by_t in attention.items()},
    }


def bytes_table() -> dict:
    return {kind: {"bytes_per_row": fmt.row_bytes(kind), "tokens_vs_bf16": fmt.capacity_ratio(kind, "bf16"),
                   "tokens_vs_fp8": fmt.capacity_ratio(kind, "fp8")} for kind in ("bf16", "fp8", "nvfp4")}


def write_markdown(result: dict, path: Path) -> None:
    cfg = result["config"]
    lines = ["# NVFP4 vs FP8 KV rows for MLA (576 values per token): accuracy", "", f"Command: `{cfg['command']}`", "",
             f"Synthetic MLA cache ({cfg['num_slots']} rows, {cfg['outlier_channels']} outlier latent channels x"
             f"{cfg['outlier_gain']:g}, rope std {cfg['rope_std']:g}), {cfg['num_heads']} heads, absorbed bf16 query,"
             f" sm_scale 1/sqrt(192), random-key score std {cfg['query_score_std']:g} and one key per head boosted by"
             f" +{cfg['query_key_boost']:g}, {cfg['seeds']} seeds; medians (max in brackets). Baseline: the FP16 cache."
             " Torch reference (the Triton kernels match it: bit-exact codec, attention within fp16-probability"
             " rounding).", "", "## Bytes per row and cache capacity", "",
             "| format | bytes / row | tokens vs BF16 | tokens vs FP8 |", "|---|---:|---:|---:|"]
    for kind, b in result["bytes"].items():
        lines.append(f"| {kind} | {b['bytes_per_row']} | {b['tokens_vs_bf16']:.2f}x | {b['tokens_vs_fp8']:.2f}x |")
    lines += ["", "## Round-trip relative error (||x' - x|| / ||x||)", "",
              "| format | row | latent (512) | rope (64) |",
              "|---|---:|---:|---:|"]
    for name, parts in result["round_trip_rel_error"].items():
        cells = " | ".join(f"{parts[k]['median']:.2e} [{parts[k]['max']:.2e}]" for k in ("row", "latent", "rope"))
        lines.append(f"| {name} | {cells} |")
    ts = list(SELECTED)
    lines += ["", "## Decode attention output relative error vs FP16 KV", "",
              "| format | " + " | ".join(f"T = {t}" for t in ts) + " |", "|---|" + "---:|" * len(ts)]
    for name, by_t in result["attention_rel_error_vs_fp16"].items():
        cells = " | ".join(f"{by_t[str(t)]['median']:.2e} [{by_t[str(t)]['max']:.2e}]" for t in ts)
        lines.append(f"| {name} | {cells} |")
    nv = result["attention_rel_error_vs_fp16"]["nvfp4 (global scale)"][str(ts[-1])]["median"]
    f8 = result["attention_rel_error_vs_fp16"]["fp8 (per-tensor scale)"][str(ts[-1])]["median"]
    lines += ["", f"At T = {ts[-1]}, NVFP4 rows cost {nv / f8:.1f}x the attention error of FP8 rows for"
              f" {fmt.capacity_ratio('nvfp4', 'fp8'):.2f}x the cached tokens per byte.", ""]
    path.write_text("\n".join(lines))


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_b, ax_a) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [1, 2]})
    kinds = list(result["bytes"])
    ax_b.bar(kinds, [result["bytes"][k]["bytes_per_row"] for k in kinds], color=["grey", "tab:blue", "tab:orange"])
    for i, k in enumerate(kinds):
        ax_b.text(i, result["bytes"][k]["bytes_per_row"], f"{result['bytes'][k]['tokens_vs_bf16']:.2f}x tokens",
                  ha="center", va="bottom", fontsize=8)
    ax_b.set(ylabel="bytes per 576-value row", title="KV row size")
    ts = list(SELECTED)
    names = list(result["attention_rel_error_vs_fp16"])
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        med = [result["attention_rel_error_vs_fp16"][name][str(t)]["median"] for t in ts]
        ax_a.bar([j + i * width for j in range(len(ts))], med, width, label=name)
    ax_a.set_xticks([j + 0.4 - width / 2 for j in range(len(ts))], [f"T = {t}" for t in ts])
    ax_a.set(yscale="log", ylim=(1e-3, 1.0), ylabel="relative error vs FP16 KV (median)",
             title="decode attention output error")
    ax_a.legend(fontsize=8, loc="upper center", ncol=3)
    ax_a.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/results/nvfp4")
    ap.add_argument("--seeds", type=int, default=5)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"config": {"command": COMMAND, "seeds": args.seeds, "num_slots": NUM_SLOTS, "num_heads": NUM_HEADS,
                         "selected": list(SELECTED), "outlier_channels": OUTLIER_CHANNELS,
                         "outlier_gain": OUTLIER_GAIN, "rope_std": ROPE_STD, "query_score_std": QUERY_SCORE_STD,
                         "query_key_boost": QUERY_KEY_BOOST,
                         "sm_scale": SM_SCALE},
              "bytes": bytes_table(), **run(args.seeds)}
    (out / "accuracy.json").write_text(json.dumps(result, indent=2) + "\n")
    write_markdown(result, out / "accuracy.md")
    plot(result, out / "accuracy.png")
    return result


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
