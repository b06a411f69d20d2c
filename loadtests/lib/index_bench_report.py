"""loadtests/index_bench.py's report: medians over repetitions, the markdown table and the figure."""

from __future__ import annotations

import statistics
from pathlib import Path


def median_run(runs: list[dict]) -> dict:
    """Median over repetitions of every figure (RSS from the first: later ones reuse freed memory)."""
    med = lambda key: statistics.median(r[key] for r in runs)  # noqa: E731
    sizes = runs[0]["find_matches"]
    out = {"ingest_s": med("ingest_s"), "events_per_s": med("events_per_s"), "blocks_per_s": med("blocks_per_s"),
           "rss_growth_mb": runs[0]["rss_growth_mb"]}
    for timing in ("find_matches", "hash_find", "route"):
        if timing in runs[0]:
            out[timing] = {s: {k: statistics.median(r[timing][s][k] for r in runs) for k in runs[0][timing][s]
                               if k != "n"} for s in sizes}
    return out


TIMINGS = {"hash_find": "the prompt's hashes + find_matches", "route": "whole decision: hashes + KvAwarePolicy.route"}


def markdown(result: dict) -> str:
    sizes = [t // result["block_size"] for t in result["prompt_tokens"]]
    rows = ["| index | ingest blocks/s | ingest events/s | RSS growth MB | "
            + " | ".join(f"{t // 1024}K p50 / p99 us" for t in result["prompt_tokens"]) + " |",
            "|---|---:|---:|---:|" + "---:|" * len(sizes)]
    for name, r in result["indexes"].items():
        fm = [f"{r['find_matches'][s]['p50_us']:,.0f} / {r['find_matches'][s]['p99_us']:,.0f}" for s in sizes]
        rows.append(f"| {name}: find_matches | {r['blocks_per_s']:,.0f} | {r['events_per_s']:,.0f} | "
                    f"{r['rss_growth_mb']:,.0f} | " + " | ".join(fm) + " |")
    for timing, label in TIMINGS.items():
        for name, r in result["indexes"].items():
            if timing in r:
                rows.append(f"| {name}: {label} | | | | " + " | ".join(
                    f"{r[timing][s]['p50_us']:,.0f} / {r[timing][s]['p99_us']:,.0f}" for s in sizes) + " |")
    rows += ["", "Decisions per second, one process (1 / mean time):", "",
             "| index | " + " | ".join(f"{t // 1024}K" for t in result["prompt_tokens"]) + " |",
             "|---|" + "---:|" * len(sizes)]
    for timing, label in TIMINGS.items():
        for name, r in result["indexes"].items():
            if timing in r:
                rows.append(f"| {name}: {label} | " + " | ".join(
                    f"{1e6 / r[timing][s]['mean_us']:,.0f}" for s in sizes) + " |")
    return "\n".join(rows) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = plt.get_cmap("tab10").colors
    series = {name: r for name, r in result["indexes"].items()}
    for name, r in result["indexes"].items():
        for timing, label in TIMINGS.items():  # drawn in the latency panel only
            if timing in r:
                series[f"{name.split()[0]}: {label}"] = {"find_matches": r[timing]}
    fig, axes = plt.subplots(1, 3, figsize=(16, 5))
    ticks = [f"{t // 1024}K p{q}" for t in result["prompt_tokens"] for q in (50, 99)]
    panels = [("Event ingest", "blocks/s", lambda r: [r["blocks_per_s"]], [f"{result['blocks']:,}-block build"]),
              ("Lookup and decision latency", "microseconds (log)",
               lambda r: [r["find_matches"][t // result["block_size"]][f"p{q}_us"]
                          for t in result["prompt_tokens"] for q in (50, 99)], ticks),
              ("Memory", "RSS growth (MB)", lambda r: [r["rss_growth_mb"]], ["full index"])]
    for ax, (title, ylabel, values, ticks) in zip(axes, panels, strict=True):
        names = [n for n in series if "blocks_per_s" in series[n] or title.startswith("Lookup")]
        width = 0.8 / len(names)
        for j, name in enumerate(names):
            xs = [i + (j - (len(names) - 1) / 2) * width for i in range(len(ticks))]
            vals = values(series[name])
            label = f"{name}: find_matches" if title.startswith("Lookup") and name in result["indexes"] else name
            bars = ax.bar(xs, vals, width, color=colors[j], label=label)
            ax.bar_label(bars, labels=[f"{v:,.0f}" for v in vals], fontsize=7, padding=2)
        ax.set_xticks(range(len(ticks)), ticks, fontsize=8)
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        if title.startswith("Lookup"):
            ax.set_yscale("log")
        ax.margins(y=0.15)
    axes[1].legend(fontsize=8)
    fig.suptitle(f"Router KV index: {result['workers']} workers, {result['blocks']:,} blocks held")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


