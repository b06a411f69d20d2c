"""The batch benchmark's figures: per run, their medians over runs against the issue's goals, and the report
(batch.json, batch.png, batch.md) written from them.

    ttft_ratio_p99   interactive TTFT p99 while the batch runs / alone          goal <= 1.2
    idle_use         batch lines/s / (capacity lines/s - interactive lines/s)   goal >= 0.8
    hit_rate         cached prompt tokens / prompt tokens of a prefix batch, prefix order and shuffled
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from loadtests.lib.stats import median_over, percentile, ratio

TTFT_GOAL, IDLE_GOAL = 1.2, 0.8


def ttft_figures(shots: list) -> dict:
    ttfts = [s.ttft_s for s in shots if s.ttft_s is not None]
    if not ttfts:
        return {"p50_ms": None, "p99_ms": None, "n": 0}
    return {"p50_ms": 1000 * percentile(ttfts, 50), "p99_ms": 1000 * percentile(ttfts, 99), "n": len(ttfts)}


def hit_rate(job: dict) -> dict:
    prompt = sum(p for p, _, _ in job["usage"])
    cached = sum(c for _, c, _ in job["usage"])
    return {"hit_rate": cached / prompt if prompt else 0.0, "prompt_tokens": prompt, "cached_tokens": cached,
            "lines": job["total"], "failed": job["failed"], "status": job["status"]}


def run_figures(capacity: dict, rate: float, alone_s: float, alone: list, mixed: dict, prefix: dict) -> dict:
    served = sum(1 for s in alone if not s.error) / alone_s
    idle = capacity["lines_per_s"] - served
    alone_ttft = ttft_figures(alone)
    return {
        "capacity": capacity, "interactive_rate": rate, "interactive_lines_per_s": served,
        "alone": {"ttft": alone_ttft, "requests": len(alone), "failed": sum(bool(s.error) for s in alone)},
        "mixed": mixed, "prefix": prefix,
        "ttft_ratio_p50": ratio(mixed["ttft"]["p50_ms"], alone_ttft["p50_ms"]),
        "ttft_ratio_p99": ratio(mixed["ttft"]["p99_ms"], alone_ttft["p99_ms"]),
        "idle_lines_per_s": idle, "idle_use": ratio(mixed["batch_lines_per_s"], idle),
        "hit_rate_prefix": prefix["prefix"]["hit_rate"], "hit_rate_shuffled": prefix["shuffled"]["hit_rate"],
    }


def failures(run: dict) -> int:
    """Everything that should not fail: interactive requests, probe requests, batch lines."""
    return (run["capacity"]["failed"] + run["alone"]["failed"] + run["mixed"]["failed"]
            + run["mixed"]["batch"]["failed"] + sum(p["failed"] for p in run["prefix"].values())
            + sum(p["status"] != "completed" for p in run["prefix"].values())
            + (run["mixed"]["batch"]["status"] != "completed"))


MEDIAN_KEYS = ("ttft_ratio_p50", "ttft_ratio_p99", "idle_use", "hit_rate_prefix", "hit_rate_shuffled",
               "idle_lines_per_s", "interactive_lines_per_s")


def summarize(args: argparse.Namespace, fleet: object, runs: list[dict], command: str) -> dict:
    flat = [{**r, "alone_p50": r["alone"]["ttft"]["p50_ms"], "alone_p99": r["alone"]["ttft"]["p99_ms"],
             "mixed_p50": r["mixed"]["ttft"]["p50_ms"], "mixed_p99": r["mixed"]["ttft"]["p99_ms"],
             "capacity_lines_per_s": r["capacity"]["lines_per_s"],
             "batch_lines_per_s": r["mixed"]["batch_lines_per_s"]} for r in runs]
    medians = median_over(flat, (*MEDIAN_KEYS, "alone_p50", "alone_p99", "mixed_p50", "mixed_p99",
                                 "capacity_lines_per_s", "batch_lines_per_s"))
    return {
        "command": command, "args": vars(args), "fleet": dataclasses.asdict(fleet), "runs": runs,
        "medians": medians, "failures": sum(failures(r) for r in runs),
        "goals": {"ttft_p99_within_1_2x": medians["ttft_ratio_p99"] <= TTFT_GOAL,
                  "idle_use_at_least_80pct": medians["idle_use"] >= IDLE_GOAL,
                  "prefix_beats_shuffled": medians["hit_rate_prefix"] > medians["hit_rate_shuffled"]},
    }


BEGIN, END = "<!-- figures: written by loadtests/lib/batch_report.py -->", "<!-- /figures -->"


def write_report(out: Path, report: dict) -> None:
    """JSON, PNG, and the markdown's figures; prose around the figures in an existing batch.md is kept."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "batch.json").write_text(json.dumps(report, indent=1, default=str))
    _plot(out / "batch.png", report)
    path, figures = out / "batch.md", markdown(report)
    text = path.read_text() if path.exists() else ""
    if BEGIN in text and END in text:
        text = text[:text.index(BEGIN)] + figures + text[text.index(END) + len(END):]
    else:
        text = f"# Batch on idle capacity (issue 17, point 4)\n\n{figures}\n"
    path.write_text(text)


def _plot(path: Path, report: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, m = report["runs"], report["medians"]
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(13, 4))
    for x, key in enumerate(("alone_p50", "mixed_p50", "alone_p99", "mixed_p99")):
        phase, q = key.split("_")
        values = [r[phase]["ttft"][f"{q}_ms"] for r in runs]
        left.bar(x, m[key], color="#8ab" if phase == "alone" else "#c74", width=0.6)
        left.scatter([x] * len(values), values, color="k", s=10, zorder=3)
    left.set_xticks(range(4), ["p50\nalone", "p50\n+ batch", "p99\nalone", "p99\n+ batch"])
    left.set_ylabel("interactive TTFT, ms")
    left.set_title(f"p99 with batch / alone = {m['ttft_ratio_p99']:.2f} (goal <= 1.2)")
    names = ["capacity", "interactive", "idle", "batch got"]
    values = [m["capacity_lines_per_s"], m["interactive_lines_per_s"], m["idle_lines_per_s"], m["batch_lines_per_s"]]
    middle.bar(names, values, color=["#999", "#8ab", "#ddd", "#c74"])
    middle.set_ylabel("lines/s (the batch's shape)")
    middle.set_title(f"batch / idle capacity = {m['idle_use']:.0%} (goal >= 80%)")
    for x, key in enumerate(("hit_rate_prefix", "hit_rate_shuffled")):
        right.bar(x, m[key], color="#5a5" if x == 0 else "#aaa", width=0.6)
        right.scatter([x] * len(runs), [r[key] for r in runs], color="k", s=10, zorder=3)
    right.set_xticks([0, 1], ["prefix order", "shuffled"])
    right.set_ylabel("cached / prompt tokens")
    right.set_ylim(0, 1)
    right.set_title("prefix hit rate, same fleet")
    fig.suptitle(f"Batch on idle capacity: medians of {len(runs)} runs (dots: each run)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _f(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def markdown(report: dict) -> str:
    """The command, the figures per run and their medians, the goals: the generated part of batch.md."""
    m, runs, a = report["medians"], report["runs"], report["args"]
    rows = ["| run | capacity lines/s | interactive lines/s | TTFT p50 alone / + batch ms | TTFT p99 alone / + batch ms"
            " | p99 ratio | batch lines/s | of idle | hit rate prefix / shuffled |", "|---|" + "---:|" * 8]
    for i, r in enumerate(runs):
        rows.append(f"| {i} | {r['capacity']['lines_per_s']:.1f} | {r['interactive_lines_per_s']:.1f} "
                    f"| {_f(r['alone']['ttft']['p50_ms'])} / {_f(r['mixed']['ttft']['p50_ms'])} "
                    f"| {_f(r['alone']['ttft']['p99_ms'])} / {_f(r['mixed']['ttft']['p99_ms'])} "
                    f"| {_f(r['ttft_ratio_p99'], '.2f')} | {r['mixed']['batch_lines_per_s']:.1f} "
                    f"| {r['idle_use']:.0%} | {r['hit_rate_prefix']:.1%} / {r['hit_rate_shuffled']:.1%} |")
    rows.append(f"| **median** | {m['capacity_lines_per_s']:.1f} | {m['interactive_lines_per_s']:.1f} "
                f"| {m['alone_p50']:.1f} / {m['mixed_p50']:.1f} | {m['alone_p99']:.1f} / {m['mixed_p99']:.1f} "
                f"| **{m['ttft_ratio_p99']:.2f}** | {m['batch_lines_per_s']:.1f} | **{m['idle_use']:.0%}** "
                f"| **{m['hit_rate_prefix']:.1%} / {m['hit_rate_shuffled']:.1%}** |")
    g = report["goals"]
    goals = [f"- interactive TTFT p99 with the batch / alone: {m['ttft_ratio_p99']:.2f} (p50 "
             f"{m['ttft_ratio_p50']:.2f}); goal <= 1.2: **{'met' if g['ttft_p99_within_1_2x'] else 'missed'}**",
             f"- the batch's share of the idle capacity: {m['idle_use']:.0%}; goal >= 80%: "
             f"**{'met' if g['idle_use_at_least_80pct'] else 'missed'}**",
             f"- prefix hit rate, prefix order vs shuffled: {m['hit_rate_prefix']:.1%} vs "
             f"{m['hit_rate_shuffled']:.1%} ({a['prefixes']} prefixes of {a['prefix_tokens']} tokens x "
             f"{a['questions']} questions of {a['question_tokens']}; at most "
             f"{a['prefix_tokens'] / (a['prefix_tokens'] + a['question_tokens']):.0%} of a prompt can hit)",
             f"- failures (interactive, probe, batch lines, jobs not completed): {report['failures']}"]
    return "\n".join([BEGIN, f"Command: `{report['command']}`", "", "\n".join(rows), "", "\n".join(goals), END])
