"""The peers benchmark's figures: per model and concurrency, each stack's medians over rounds, and each stack against
vLLM's own server as per-round ratios and differences (then their median over rounds), the goals checked, the
picture and a markdown table.

| figure                          | per round                                   | reported                  |
|---------------------------------|---------------------------------------------|---------------------------|
| ``<stack>.<metric>``            | the phase's TTFT/ITL percentile, tok/s, CPU | median over rounds        |
| ``vs_vllm.<stack>.tok_s_ratio`` | stack tok/s / vLLM tok/s, same round        | median over rounds        |
| ``vs_vllm.<stack>.added_*_ms``  | stack pXX - vLLM pXX, same round            | median over rounds        |
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from loadtests.lib.report import _json_safe
from loadtests.lib.stats import ratio

BASE = "vllm"
STACK_ORDER = ["vllm", "litellm", "infermesh"]
METRICS = {"ttft_p50_ms": ("ttft", "p50_ms"), "ttft_p99_ms": ("ttft", "p99_ms"),
           "itl_p50_ms": ("itl", "p50_ms"), "itl_p99_ms": ("itl", "p99_ms")}
THROUGHPUT_GOAL = 0.95  # infermesh's output tok/s at least this share of vLLM's own server's


def _median(values) -> float:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.median(finite) if finite else math.nan


def _flat(phase: dict) -> dict[str, float]:
    out = {name: phase[group][key] for name, (group, key) in METRICS.items()}
    out.update(output_tok_s=phase["output_tok_s"], cpu_ms_per_request=phase["cpu_ms_per_request_total"],
               engine_cpu_ms_per_request=phase["engine_cpu_ms_per_request"],
               front_cpu_ms_per_request=phase["cpu_ms_per_request_total"] - phase["engine_cpu_ms_per_request"])
    return out


def summary(concurrency: int, requests: int, rounds: list[dict[str, dict]]) -> dict:
    """``rounds``: per round, {stack: phase figures}. Medians per stack; per-round comparisons with vLLM's server."""
    stacks = [s for s in STACK_ORDER if all(s in r for r in rounds)]
    flat = [{s: _flat(r[s]) for s in stacks} for r in rounds]
    entry: dict = {"concurrency": concurrency, "requests_per_round": requests,
                   "stacks": {s: {k: _median(f[s][k] for f in flat) for k in flat[0][s]} for s in stacks},
                   "vs_vllm": {}}
    for stack in (s for s in stacks if s != BASE):
        entry["vs_vllm"][stack] = {
            "tok_s_ratio": _median(ratio(f[stack]["output_tok_s"], f[BASE]["output_tok_s"]) for f in flat),
            **{f"added_{m}": _median(f[stack][m] - f[BASE][m] for f in flat) for m in METRICS},
            "cpu_ratio": _median(ratio(f[stack]["cpu_ms_per_request"], f[BASE]["cpu_ms_per_request"]) for f in flat),
            "added_front_cpu_ms_per_request": _median(
                f[stack]["front_cpu_ms_per_request"] - f[BASE]["front_cpu_ms_per_request"] for f in flat),
        }
    entry["rounds"] = rounds
    return entry


def goals(results: dict[str, list[dict]]) -> dict:
    """Per model and concurrency: infermesh's tok/s >= 95% of vLLM's own server's; its added TTFT (p50) below
    LiteLLM's. None where a stack was not measured."""
    out: dict = {}
    for model, entries in results.items():
        for entry in entries:
            vs = entry["vs_vllm"]
            mesh, lite = vs.get("infermesh"), vs.get("litellm")
            out[f"{model}@{entry['concurrency']}"] = {
                "throughput_ratio": mesh["tok_s_ratio"] if mesh else None,
                "throughput_met": mesh["tok_s_ratio"] >= THROUGHPUT_GOAL if mesh else None,
                "added_ttft_p50_ms": {"infermesh": mesh["added_ttft_p50_ms"] if mesh else None,
                                      "litellm": lite["added_ttft_p50_ms"] if lite else None},
                "added_ttft_met": (mesh["added_ttft_p50_ms"] < lite["added_ttft_p50_ms"]) if mesh and lite else None,
            }
    return out


PANELS = [("TTFT p50 (ms)", "ttft_p50_ms"), ("TTFT p99 (ms)", "ttft_p99_ms"), ("ITL p50 (ms)", "itl_p50_ms"),
          ("ITL p99 (ms)", "itl_p99_ms"), ("output tokens/s", "output_tok_s"),
          ("CPU per request (ms; solid: outside the engine)", "cpu_ms_per_request")]


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [m for m, entries in report["results"].items() if entries]
    num_cols = 3  # two rows of panels per model
    fig, axes = plt.subplots(2 * len(models), num_cols, figsize=(15, 7.5 * len(models)), squeeze=False)
    colors = dict(zip(STACK_ORDER, plt.get_cmap("tab10").colors, strict=False))
    for m, model in enumerate(models):
        entries = report["results"][model]
        stacks = [s for s in STACK_ORDER if s in entries[0]["stacks"]]
        width = 0.8 / len(stacks)
        panels = axes[2 * m:2 * m + 2].flat
        for ax, (title, key) in zip(panels, PANELS, strict=True):
            for j, stack in enumerate(stacks):
                xs = [i + (j - (len(stacks) - 1) / 2) * width for i in range(len(entries))]
                values = [e["stacks"][stack][key] for e in entries]
                solid = key != "cpu_ms_per_request"
                ax.bar(xs, values, width, color=colors[stack], alpha=1.0 if solid else 0.35,
                       label=stack if key == "ttft_p50_ms" else None)
                if not solid:
                    ax.bar(xs, [e["stacks"][stack]["front_cpu_ms_per_request"] for e in entries], width,
                           color=colors[stack])
            ax.set_xticks(range(len(entries)), [str(e["concurrency"]) for e in entries])
            ax.set_xlabel("concurrent streams")
            ax.set_title(f"{model}: {title}", fontsize=10)
        axes[2 * m][0].legend(fontsize=8)
    fig.suptitle(f"The same vLLM CPU engine behind vLLM's own server, LiteLLM's proxy and infermesh "
                 f"(median of {report['rounds']} rounds, {report['max_tokens']} tokens a request)")
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.03 / len(models)))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def markdown(report: dict) -> str:
    lines = [f"    {report['command']}", ""]
    for model, entries in report["results"].items():
        lines += [f"### {model}", "", "| streams | stack | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | tok/s | "
                  "CPU ms/req (outside engine) | tok/s vs vLLM | added TTFT p50 |", "|" + "---:|" * 10]
        for entry in entries:
            for stack, figures in entry["stacks"].items():
                vs = entry["vs_vllm"].get(stack, {})
                lines.append(
                    f"| {entry['concurrency']} | {stack} | {figures['ttft_p50_ms']:.1f} | {figures['ttft_p99_ms']:.1f} "
                    f"| {figures['itl_p50_ms']:.1f} | {figures['itl_p99_ms']:.1f} | {figures['output_tok_s']:.0f} | "
                    f"{figures['cpu_ms_per_request']:.0f} ({figures['front_cpu_ms_per_request']:.0f}) | "
                    + (f"{vs['tok_s_ratio']:.3f} | {vs['added_ttft_p50_ms']:+.1f} |" if vs else "1 | 0 |"))
        lines.append("")
    return "\n".join(lines) + "\n"


def write(report: dict, out: Path) -> None:
    import json

    out.mkdir(parents=True, exist_ok=True)
    (out / "peers.json").write_text(json.dumps(_json_safe(report), indent=1, allow_nan=False) + "\n")
    (out / "peers.md").write_text(markdown(report))
    if any(report["results"].values()):
        plot(report, out / "peers.png")
