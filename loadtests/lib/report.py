"""Load-test results: per-request records, their summary figures, and a JSON + PNG + markdown report.

A RequestRecord is what a simulator or a live load driver saw of one request (times in seconds
on the run's clock). summarize() turns a list of them into the figures the docs quote (TTFT, ITL,
queue wait, per-user and per-GPU throughput, prefix hit rate); write_report() puts the summaries
of several configurations of one run side by side.
"""

from __future__ import annotations

import datetime
import json
import math
import statistics
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

from loadtests.lib.stats import percentile

PERCENTILES = (50, 90, 99)


@dataclass(slots=True)
class RequestRecord:
    """What was seen of one request; None times never happened (the request failed or is unfinished)."""

    request_id: str
    kind: str
    session_id: str | None
    arrival_t: float
    scheduled_t: float | None  # first time the engine scheduled any of it (queue wait = scheduled_t - arrival_t)
    first_token_t: float | None
    finish_t: float | None
    token_times: list[float] = field(default_factory=list)  # one per output token; ITL = their diffs
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    worker_id: str = ""
    error: str | None = None


def _percentiles_ms(name: str, seconds: list[float]) -> dict[str, float]:
    ms = [s * 1000.0 for s in seconds]
    return {f"{name}_p{q}_ms": percentile(ms, q) for q in PERCENTILES}


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else math.nan


def _latency_figures(records: list[RequestRecord]) -> dict[str, float]:
    """TTFT, ITL (pooled over every gap of every request), TPOT (each request's mean gap), queue wait and
    per-user rates. A rare long gap (a decode stalled behind a prefill chunk) barely moves pooled ITL
    percentiles but raises the TPOT of every request it hits."""
    ttft = [r.first_token_t - r.arrival_t for r in records if r.first_token_t is not None]
    itl = [b - a for r in records for a, b in pairwise(r.token_times)]
    queue = [r.scheduled_t - r.arrival_t for r in records if r.scheduled_t is not None]
    finished = [r for r in records if r.error is None and r.finish_t is not None and r.token_times]
    e2e = [len(r.token_times) / (r.finish_t - r.arrival_t) for r in finished if r.finish_t > r.arrival_t]
    decode = [(len(r.token_times) - 1) / (r.finish_t - r.first_token_t) for r in finished
              if len(r.token_times) > 1 and r.first_token_t is not None and r.finish_t > r.first_token_t]
    tpot = [(r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1) for r in records
            if len(r.token_times) > 1]
    return {**_percentiles_ms("ttft", ttft), **_percentiles_ms("itl", itl), **_percentiles_ms("tpot", tpot),
            **_percentiles_ms("queue_wait", queue),
            "user_e2e_tok_s_p50": percentile(e2e, 50), "user_e2e_tok_s_mean": _mean(e2e),
            "user_decode_tok_s_p50": percentile(decode, 50)}


def summarize(records: list[RequestRecord], *, num_gpus: int, duration_s: float | None = None,
              warmup_s: float = 0.0) -> dict:
    """The figures of one run.

    Latencies, per-user rates and the prefix hit rate cover the requests that arrived at or after
    warmup_s. Output tok/s per GPU is the output tokens emitted at or after warmup_s over duration_s
    (default: from max(warmup_s, first arrival) to the last finish) and num_gpus. Empty inputs give
    NaN figures.
    """
    assert num_gpus > 0
    measured = [r for r in records if r.arrival_t >= warmup_s]
    num_prompt = sum(r.num_prompt_tokens for r in measured)
    num_cached = sum(r.num_cached_tokens for r in measured)
    if duration_s is None:
        finishes = [r.finish_t for r in records if r.finish_t is not None]
        start = max([warmup_s, min(r.arrival_t for r in records)] if records else [warmup_s])
        duration_s = max(finishes) - start if finishes else math.nan
    num_window_tokens = sum(1 for r in records for t in r.token_times if t >= warmup_s)
    rate = num_window_tokens / duration_s / num_gpus if duration_s and duration_s > 0 else math.nan
    return {
        "requests": len(records),
        "measured": len(measured),
        "completed": sum(1 for r in records if r.error is None and r.finish_t is not None),
        "errors": sum(1 for r in records if r.error is not None),
        **_latency_figures(measured),
        "output_tok_s_per_gpu": rate,
        "prefix_hit_rate": num_cached / num_prompt if num_prompt else math.nan,
        "prompt_tokens": sum(r.num_prompt_tokens for r in records),
        "cached_tokens": sum(r.num_cached_tokens for r in records),
        "output_tokens": sum(len(r.token_times) for r in records),
        "duration_s": duration_s,
        "num_gpus": num_gpus,
        "warmup_s": warmup_s,
        "by_kind": {kind: _kind_figures([r for r in measured if r.kind == kind])
                    for kind in sorted({r.kind for r in measured})},
    }


def _kind_figures(records: list[RequestRecord]) -> dict:
    num_prompt = sum(r.num_prompt_tokens for r in records)
    ttft = [r.first_token_t - r.arrival_t for r in records if r.first_token_t is not None]
    return {"requests": len(records), "errors": sum(1 for r in records if r.error is not None),
            **_percentiles_ms("ttft", ttft),
            "prefix_hit_rate": sum(r.num_cached_tokens for r in records) / num_prompt if num_prompt else math.nan}


def _json_safe(value):
    """NaN and infinities become null, so the file is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


# (title, y label, [(summary key, bar label)], multiplier) for each panel of the PNG
PANELS = [
    ("TTFT", "time to first token (ms)", [(f"ttft_p{q}_ms", f"p{q}") for q in PERCENTILES], 1.0),
    ("ITL / TPOT", "inter-token latency (ms)", [(f"itl_p{q}_ms", f"ITL p{q}") for q in PERCENTILES]
     + [(f"tpot_p{q}_ms", f"TPOT p{q}") for q in (50, 90)], 1.0),
    ("Queue wait", "arrival to first scheduled (ms)", [("queue_wait_p50_ms", "p50"), ("queue_wait_p90_ms", "p90")],
     1.0),
    ("Per-user throughput", "output tok/s per request",
     [("user_e2e_tok_s_p50", "end-to-end p50"), ("user_e2e_tok_s_mean", "end-to-end mean"),
      ("user_decode_tok_s_p50", "decode p50")], 1.0),
    ("Fleet throughput", "output tok/s per GPU", [("output_tok_s_per_gpu", "")], 1.0),
    ("Prefix cache", "prompt tokens from cache (%)", [("prefix_hit_rate", "hit rate")], 100.0),
]


def _fmt(value: float) -> str:
    if not math.isfinite(value):
        return "n/a"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.1f}" if abs(value) >= 10 else f"{value:.2f}"


def plot(configs: dict[str, dict], path: Path, title: str) -> None:
    """One figure, one bar-chart panel per figure family, one bar colour per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(configs)
    colors = plt.get_cmap("tab10").colors
    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))
    width = 0.8 / max(1, len(labels))
    for ax, (panel_title, ylabel, keys, mult) in zip(axes.flat, PANELS, strict=True):
        for j, label in enumerate(labels):
            values = [configs[label].get(key, math.nan) for key, _ in keys]
            values = [v * mult if v is not None and math.isfinite(v) else math.nan for v in values]
            xs = [i + (j - (len(labels) - 1) / 2) * width for i in range(len(keys))]
            bars = ax.bar(xs, [0.0 if math.isnan(v) else v for v in values], width,
                          color=colors[j % len(colors)], label=label)
            ax.bar_label(bars, labels=[_fmt(v) for v in values], fontsize=7, padding=2)
        ax.set_xticks(range(len(keys)), [name for _, name in keys])
        ax.set_title(panel_title)
        ax.set_ylabel(ylabel)
        ax.margins(y=0.15)
    handles, names = axes.flat[0].get_legend_handles_labels()
    ncol = min(len(names), 3) or 1  # long labels: at most three per legend row, so none is cut off
    rows = -(-len(names) // ncol)
    fig.legend(handles, names, loc="lower center", ncol=ncol, frameon=False)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.03 + 0.03 * rows, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(path_stem: Path, *, title: str, command: str, configs: dict[str, dict],
                 notes: dict | None = None) -> None:
    """Write <stem>.json (title, command, created, configs: {label: summary}, notes) and <stem>.png."""
    path_stem = Path(path_stem)
    path_stem.parent.mkdir(parents=True, exist_ok=True)
    report = {"title": title, "command": command,
              "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "configs": configs, "notes": notes or {}}
    json_path = path_stem.parent / (path_stem.name + ".json")
    json_path.write_text(json.dumps(_json_safe(report), indent=2, allow_nan=False) + "\n")
    plot(configs, path_stem.parent / (path_stem.name + ".png"), title)


# (column header, summary key, multiplier) of the markdown table
TABLE_COLUMNS = [
    ("requests", "requests", 1.0), ("errors", "errors", 1.0),
    ("TTFT p50 ms", "ttft_p50_ms", 1.0), ("TTFT p99 ms", "ttft_p99_ms", 1.0),
    ("ITL p50 ms", "itl_p50_ms", 1.0), ("ITL p90 ms", "itl_p90_ms", 1.0),
    ("ITL p99 ms", "itl_p99_ms", 1.0), ("TPOT p90 ms", "tpot_p90_ms", 1.0),
    ("queue p50 ms", "queue_wait_p50_ms", 1.0), ("user tok/s p50", "user_e2e_tok_s_p50", 1.0),
    ("out tok/s/GPU", "output_tok_s_per_gpu", 1.0), ("prefix hit %", "prefix_hit_rate", 100.0),
]


def write_markdown_table(configs: dict[str, dict]) -> str:
    """A markdown table of the main figures, one row per configuration."""
    lines = ["| config | " + " | ".join(h for h, _, _ in TABLE_COLUMNS) + " |",
             "|---|" + "---:|" * len(TABLE_COLUMNS)]
    for label, summary in configs.items():
        cells = []
        for _, key, mult in TABLE_COLUMNS:
            value = summary.get(key)
            if isinstance(value, int) and mult == 1.0:
                cells.append(str(value))
            else:
                cells.append(_fmt(value * mult if value is not None else math.nan))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
