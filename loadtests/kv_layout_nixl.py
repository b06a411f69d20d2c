"""KV layout vs NIXL transfer time: LBHNC (layer-major) against BLHNC (block-major), real NIXL, two processes.

A target process (the prefill side) registers a KV pool and serves its NIXL metadata; this
process (the decode side) READs the KV of one long request from it with descriptors from
kernels/kv_layout's planner, at several block sizes, for both layouts, with the request's
blocks scattered in pools twice its size (seeded permutations, independently on each side)
and, for reference, contiguous on both sides. GLM-5.3's real KV (78 layers x 576 B FP8 MLA
rows x 200K tokens, ~9 GB) does not fit here, so two scaled configurations bracket it:

* ``counts``: 200K tokens, 78 layers, 32 B rows: the real model's descriptor counts exactly,
  each descriptor 18x smaller than the real one.
* ``sizes``: 16,384 tokens, 78 layers, 576 B rows: the real model's descriptor sizes exactly,
  8.2% of its descriptors (time scales linearly in blocks, as bytes and descriptors both do).

Usage: python -m loadtests.kv_layout_nixl --reps 7 --max-reps 21 --out docs/results/kv_layout
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from importlib import metadata
from pathlib import Path

import numpy as np

from kernels.kv_layout import LAYOUTS, KVRegion, plan_transfer, scattered_placement
from kernels.kv_layout.fit import fit_transfer_model
from kernels.kv_layout.nixl_io import NixlReader, NixlTarget, check_landed

REAL = {"model": "GLM-5.3", "num_layers": 78, "row_bytes": 576, "tokens": 200_000}
CONFIGS = {
    "counts": {"tokens": 200_000, "row_bytes": 32},
    "sizes": {"tokens": 16_384, "row_bytes": 576},
}
BLOCK_SIZES = (16, 32, 64, 128, 256, 512, 1024)
PLACEMENTS = ("scattered", "contiguous")


def placement(kind: str, blocks: int, pool: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    if kind == "scattered":
        return scattered_placement(blocks, pool, seed)
    return np.arange(blocks), np.arange(pool - blocks, pool)  # one run on each side, at different places


def real_counts(block_sizes, pool_factor: int, seed: int) -> dict[str, dict[str, int]]:
    """Descriptor counts of the real model's request (row size does not change them)."""
    out = {}
    for bs in block_sizes:
        blocks = -(-REAL["tokens"] // bs)
        sb, db = scattered_placement(blocks, pool_factor * blocks, seed)
        counts = {lay: len(plan_transfer(r, r, sb, db)) for lay in LAYOUTS
                  for r in [KVRegion(lay, pool_factor * blocks, REAL["num_layers"], bs, REAL["row_bytes"])]}
        out[str(bs)] = {**counts, "blocks": blocks, "ratio": counts["LBHNC"] / counts["BLHNC"]}
    return out


def _spread(times: list[float]) -> float:
    """Interquartile range over the median."""
    q1, q2, q3 = statistics.quantiles(times, n=4)
    return (q3 - q1) / q2


def run_config(name: str, cfg: dict, args: argparse.Namespace) -> list[dict]:
    layers, row, tokens = REAL["num_layers"], cfg["row_bytes"], cfg["tokens"]
    pools = {bs: args.pool_factor * -(-tokens // bs) for bs in args.block_sizes}
    nbytes = max(pools[bs] * bs * layers * row for bs in args.block_sizes)
    print(f"[{name}] {tokens} tokens x {layers} layers x {row} B, region {nbytes / 2**30:.2f} GiB per side",
          flush=True)
    rows = []
    pt = args.progress_thread
    with NixlTarget(nbytes, progress_thread=pt) as target, \
            NixlReader(nbytes, telemetry=True, progress_thread=pt) as reader:
        reader.connect(target)
        for bs in args.block_sizes:
            blocks = -(-tokens // bs)
            for kind in args.placements:
                ids = placement(kind, blocks, pools[bs], args.seed)
                cases = []
                for layout in LAYOUTS:  # prepare, warm up and check both layouts, then alternate their reps
                    region = KVRegion(layout, pools[bs], layers, bs, row)
                    plan = plan_transfer(region, region, *ids)
                    t0 = time.perf_counter()
                    handle = reader.prepare(plan)
                    prep_s = time.perf_counter() - t0
                    reader.buf[:] = 0
                    reader.run(handle)
                    checked = check_landed(plan, reader.buf, region.slab_bytes)
                    cases.append((layout, plan, handle, prep_s, checked, []))
                rounds = 0  # alternate the layouts; on a busy host add rounds while either spread stays wide
                while rounds < args.reps or (rounds < args.max_reps and max(_spread(c[5]) for c in cases) > 0.25):
                    for case in cases:
                        case[5].append(reader.run(case[2]))
                    rounds += 1
                for layout, plan, handle, prep_s, checked, times in cases:
                    tele = reader.telemetry(handle)
                    handle.release()
                    med = statistics.median(times)
                    rows.append({"config": name, "block_size": bs, "layout": layout, "placement": kind,
                                 "blocks": blocks, "descriptors": len(plan), "nixl_desc_count": tele["desc_count"],
                                 "bytes": plan.nbytes, "checked_bytes": checked, "prep_s": prep_s,
                                 "times_s": times, "median_s": med, "min_s": min(times),
                                 "gb_per_s": plan.nbytes / med / 1e9})
                    print(f"[{name}] bs={bs:5d} {layout} {kind:10s} desc={len(plan):8d} median={med * 1e3:9.2f} ms "
                          f"min={min(times) * 1e3:9.2f} ms {plan.nbytes / med / 1e9:6.2f} GB/s "
                          f"prep={prep_s * 1e3:.1f} ms", flush=True)
    return rows


def ratios(rows: list[dict]) -> list[dict]:
    by = {(r["config"], r["block_size"], r["placement"], r["layout"]): r for r in rows}
    out = []
    for (cfg, bs, kind, layout), lb in by.items():
        bl = by.get((cfg, bs, kind, "BLHNC"))
        if layout == "LBHNC" and bl:
            out.append({"config": cfg, "block_size": bs, "placement": kind,
                        "desc_ratio": lb["descriptors"] / bl["descriptors"],
                        "time_ratio": lb["median_s"] / bl["median_s"],
                        "blhnc_time_saving": 1 - bl["median_s"] / lb["median_s"]})
    return out


def fits(rows: list[dict]) -> dict:
    def fit(sel, key="median_s"):
        return fit_transfer_model([r["bytes"] for r in sel], [r["descriptors"] for r in sel], [r[key] for r in sel])
    out = {"all": fit(rows), "all, minima": fit(rows, "min_s")}
    for cfg in sorted({r["config"] for r in rows}):
        out[cfg] = fit([r for r in rows if r["config"] == cfg])
    return out


def predictions(real: dict, rows: list[dict], fitted, gb200) -> dict:
    """The real model's 200K-token READ: from the fit on this host, scaled up from the ``sizes`` runs (bytes and
    descriptors both grow with the block count), and on GB200 with the sim profile's link and overhead."""
    from kernels.kv_layout.fit import TransferFit

    nbytes = REAL["tokens"] * REAL["num_layers"] * REAL["row_bytes"]
    sizes = {(r["block_size"], r["layout"]): r for r in rows
             if r["config"] == "sizes" and r["placement"] == "scattered"}
    gb = {"profile": TransferFit(gb200.descriptor_overhead_s, gb200.link_bytes_per_s, 0, 0, 0),
          "measured_overhead": TransferFit(fitted.overhead_s, gb200.link_bytes_per_s, 0, 0, 0)}
    out = {}
    for bs, c in real.items():
        p = {"descriptors": {lay: c[lay] for lay in LAYOUTS},
             "host_fit_s": {lay: fitted.predict(nbytes, c[lay]) for lay in LAYOUTS},
             "gb200_profile_s": {lay: gb["profile"].predict(nbytes, c[lay]) for lay in LAYOUTS},
             "gb200_measured_overhead_s": {lay: gb["measured_overhead"].predict(nbytes, c[lay]) for lay in LAYOUTS}}
        if all((int(bs), lay) in sizes for lay in LAYOUTS):
            p["host_scaled_from_sizes_s"] = {lay: sizes[int(bs), lay]["median_s"] * c["blocks"]
                                             / sizes[int(bs), lay]["blocks"] for lay in LAYOUTS}
        for key in [k for k in p if k.endswith("_s")]:
            p[key]["blhnc_saving"] = 1 - p[key]["BLHNC"] / p[key]["LBHNC"]
        out[bs] = p
    return out


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 2, figsize=(12, 9))
    real = report["real_model"]["descriptors"]
    bss = [int(b) for b in real]
    for lay, mk in zip(LAYOUTS, "os", strict=True):
        ax[0, 0].plot(bss, [real[str(b)][lay] for b in bss], marker=mk, label=lay)
    ax[0, 0].set(xscale="log", yscale="log", xlabel="block size (tokens)", ylabel="descriptors",
                 title="GLM-5.3, 200K tokens scattered: descriptors per transfer")
    colors = iter(plt.rcParams["axes.prop_cycle"].by_key()["color"])
    for cfg in sorted({r["config"] for r in report["results"]}):
        for lay in LAYOUTS:
            color = next(colors)
            for kind, ls, mk in zip(PLACEMENTS, ("-", ":"), "o^", strict=True):
                sel = [r for r in report["results"] if (r["config"], r["layout"], r["placement"]) == (cfg, lay, kind)]
                if not sel:
                    continue
                x, lbl = [r["block_size"] for r in sel], f"{cfg} {lay} {kind}"
                ax[0, 1].plot(x, [r["median_s"] * 1e3 for r in sel], color=color, ls=ls, marker=mk, label=lbl)
                ax[1, 0].plot(x, [r["gb_per_s"] for r in sel], color=color, ls=ls, marker=mk, label=lbl)
    ax[0, 1].set(xscale="log", yscale="log", xlabel="block size (tokens)", ylabel="median READ time (ms)",
                 title="NIXL READ time (median)")
    ax[1, 0].set(xscale="log", xlabel="block size (tokens)", ylabel="GB/s", title="Achieved bandwidth")
    for cfg in sorted({r["config"] for r in report["ratios"]}):
        sel = [r for r in report["ratios"] if r["config"] == cfg and r["placement"] == "scattered"]
        ax[1, 1].plot([r["block_size"] for r in sel], [r["time_ratio"] for r in sel], marker="o",
                      label=f"{cfg}: time LBHNC / BLHNC")
    ax[1, 1].axhline(1.0, color="grey", lw=0.8)
    ax[1, 1].set(xscale="log", xlabel="block size (tokens)", ylabel="ratio", title="Scattered: LBHNC / BLHNC time")
    for a in ax.flat:
        a.grid(True, which="both", alpha=0.3)
        a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _ms(s: float) -> str:
    return f"{s * 1e3:,.1f}"


def write_md(rep: dict, path: Path) -> None:
    """The generated results page: command, set-up, measured table, fit, real-model figures (README.md discusses)."""
    fit = rep["fit"]["all"]
    lines = ["# KV layout vs NIXL transfer: LBHNC (layer-major) vs BLHNC (block-major)", "",
             "    " + rep["command"], "",
             f"Run {rep['date']}, {rep['wall_s']:.0f} s; {rep['machine']['cpus']} CPUs shared with other work "
             f"(load average "
             f"{rep['machine']['loadavg_before'][0]:.1f} before, {rep['machine']['loadavg_after'][0]:.1f} after); NIXL "
             f"{rep['machine']['nixl']}, UCX_TLS {rep['machine']['UCX_TLS']}, progress threads "
             f"{'on' if rep['machine']['nixl_progress_thread'] else 'off'}; medians of "
             f"{min(len(r['times_s']) for r in rep['results'])}-{max(len(r['times_s']) for r in rep['results'])} READs "
             "(the two layouts alternating; more rounds while a spread stayed over 25%) after a warm-up READ "
             "whose every (block, layer) slab was checked in place.", "",
             "## Measured (READ of one request, pools twice the request, scattered = seeded permutations)", "",
             "| config | block | desc LBHNC | desc BLHNC | LBHNC ms | BLHNC ms | LBHNC GB/s | BLHNC GB/s "
             "| time LB/BL | BLHNC vs LBHNC time | contiguous LB / BL ms |", "|" + "---|" * 11]
    by = {(r["config"], r["block_size"], r["layout"], r["placement"]): r for r in rep["results"]}
    for (cfg, bs, lay, kind), lb in by.items():
        if lay != "LBHNC" or kind != "scattered" or (cfg, bs, "BLHNC", kind) not in by:
            continue
        bl = by[cfg, bs, "BLHNC", kind]
        cont = [by.get((cfg, bs, x, "contiguous")) for x in LAYOUTS]
        cont_s = " / ".join(_ms(c["median_s"]) for c in cont) if all(cont) else "-"
        lines.append(f"| {cfg} | {bs} | {lb['descriptors']:,} | {bl['descriptors']:,} | {_ms(lb['median_s'])} | "
                     f"{_ms(bl['median_s'])} | {lb['gb_per_s']:.2f} | {bl['gb_per_s']:.2f} | "
                     f"{lb['median_s'] / bl['median_s']:.2f} | {bl['median_s'] / lb['median_s'] - 1:+.0%} | {cont_s} |")
    lines += ["", "## Fit: time = bytes / bandwidth + descriptors x overhead (relative least squares, all points)", "",
              "| points | overhead per descriptor | bandwidth | RMS rel. error | max rel. error |",
              "|---|---|---|---|---|"]
    for name, f in rep["fit"].items():
        lines.append(f"| {name} ({f['points']}) | {f['overhead_s'] * 1e6:.2f} us | "
                     f"{f['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s | {f['rms_rel_err']:.0%} | {f['max_rel_err']:.0%} |")
    lines += ["", f"## GLM-5.3, 200K tokens ({rep['real_model']['kv_bytes'] / 1e9:.2f} GB of FP8 MLA KV), scattered",
              "", "Times as LBHNC / BLHNC ms (BLHNC's change).", "",
              "| block | desc LBHNC | desc BLHNC | ratio | this host, fit | this host, `sizes` runs scaled up "
              "| GB200, sim profile | GB200 link, overhead measured here |",
              "|" + "---|" * 8]

    def cell(p: dict | None) -> str:
        return "-" if p is None else f"{_ms(p['LBHNC'])} / {_ms(p['BLHNC'])} ({-p['blhnc_saving']:+.0%})"

    for bs, p in rep["real_model_predictions"].items():
        d = p["descriptors"]
        lines.append(f"| {bs} | {d['LBHNC']:,} | {d['BLHNC']:,} | {d['LBHNC'] / d['BLHNC']:.0f} | "
                     f"{cell(p['host_fit_s'])} | {cell(p.get('host_scaled_from_sizes_s'))} | "
                     f"{cell(p['gb200_profile_s'])} | {cell(p['gb200_measured_overhead_s'])} |")
    lines += ["", f"Fitted on this host: **{fit['overhead_s'] * 1e6:.2f} us per descriptor, "
              f"{fit['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s**. Figures: `kv_layout_nixl.png`; every number: "
              "`kv_layout_nixl.json`.", ""]
    path.write_text("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--block-sizes", nargs="+", type=int, default=list(BLOCK_SIZES))
    ap.add_argument("--placements", nargs="+", default=list(PLACEMENTS), choices=PLACEMENTS)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--max-reps", type=int, default=15, help="reps allowed while the times stay spread (IQR > 25%%)")
    ap.add_argument("--pool-factor", type=int, default=2, help="pool blocks per request block")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--progress-thread", action="store_true",
                    help="give each NIXL agent its progress thread (off: the reader's polls drive UCX)")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every config's tokens (smoke runs)")
    ap.add_argument("--out", type=Path, default=Path("docs/results/kv_layout"))
    args = ap.parse_args()
    from services.worker.engines.cost_model import load_profile

    gb200 = load_profile("gb200-glm53")
    started, load_before = time.time(), os.getloadavg()
    rows = []
    for name in args.configs:
        cfg = dict(CONFIGS[name], tokens=max(1, int(CONFIGS[name]["tokens"] * args.scale)))
        rows += run_config(name, cfg, args)
    real = real_counts(args.block_sizes, args.pool_factor, args.seed)
    fitted = fits(rows)
    report = {
        "command": "python -m loadtests.kv_layout_nixl " + " ".join(sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "wall_s": time.time() - started,
        "machine": {"cpus": os.cpu_count(), "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
                    "platform": platform.platform(), "nixl": metadata.version("nixl"),
                    "UCX_TLS": os.environ.get("UCX_TLS", "(unset: UCX picks)"), "memory": "DRAM, loopback",
                    "nixl_progress_thread": args.progress_thread},
        "real_model": {**REAL, "kv_bytes": REAL["tokens"] * REAL["num_layers"] * REAL["row_bytes"],
                       "pool_factor": args.pool_factor, "descriptors": real},
        "configs": {n: dict(CONFIGS[n], num_layers=REAL["num_layers"]) for n in args.configs},
        "results": rows,
        "ratios": ratios(rows),
        "fit": {k: v.as_dict() for k, v in fitted.items()},
        "real_model_predictions": predictions(real, rows, fitted["all"], gb200),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kv_layout_nixl.json").write_text(json.dumps(report, indent=1))
    plot(report, args.out / "kv_layout_nixl.png")
    write_md(report, args.out / "kv_layout_nixl.md")
    print(json.dumps(report["fit"], indent=1))


if __name__ == "__main__":
    main()
