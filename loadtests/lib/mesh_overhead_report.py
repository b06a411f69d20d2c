"""The mesh overhead benchmark's figures: per concurrency, medians over rounds of (edge - direct) for TTFT and
inter-token latency, CPU per request of every process, and with tracing on beside off, what tracing costs."""

from __future__ import annotations

import statistics
from pathlib import Path

PLAIN, TRACED = "edge", "edge_traced"


def _median(values) -> float:
    return statistics.median(list(values))


def edge_cpu(cpu_ms: dict[str, float]) -> float:
    """CPU per request of the edges (``edge-0``, ``edge-1``, ...) together."""
    return sum(v for name, v in cpu_ms.items() if name == "edge" or name.startswith("edge-"))


def summary(concurrency: int, requests: int, rounds: list[dict], edges: list[str]) -> dict:
    entry: dict = {"concurrency": concurrency, "requests_per_round": requests, "rounds": rounds}
    for q in ("p50", "p99"):
        entry[f"direct_ttft_{q}_ms"] = _median(r["direct"]["ttft"][f"{q}_ms"] for r in rounds)
        entry[f"direct_itl_{q}_ms"] = _median(r["direct"]["itl"][f"{q}_ms"] for r in rounds)
    for edge in edges:
        for metric in ("ttft", "itl"):
            for q in ("p50", "p99"):
                entry[f"{edge}_{metric}_{q}_ms"] = _median(r[edge][metric][f"{q}_ms"] for r in rounds)
                entry[f"{edge}_{metric}_overhead_{q}_ms"] = _median(
                    r[edge][metric][f"{q}_ms"] - r["direct"][metric][f"{q}_ms"] for r in rounds)
        names = rounds[0][edge]["cpu_ms_per_request"]
        entry[f"{edge}_cpu_ms_per_request"] = {
            name: _median(r[edge]["cpu_ms_per_request"].get(name, 0.0) for r in rounds) for name in names}
        entry[f"{edge}_edges_cpu_ms_per_request"] = _median(edge_cpu(r[edge]["cpu_ms_per_request"]) for r in rounds)
    if TRACED in edges:  # per round, side by side: the traced edges' CPU over the plain ones'
        entry["tracing_edge_cpu_ratio"] = _median(
            edge_cpu(r[TRACED]["cpu_ms_per_request"]) / edge_cpu(r[PLAIN]["cpu_ms_per_request"]) for r in rounds)
        entry["tracing_ttft_added_p50_ms"] = _median(
            r[TRACED]["ttft"]["p50_ms"] - r[PLAIN]["ttft"]["p50_ms"] for r in rounds)
    return entry


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    edges = [e for e in (PLAIN, TRACED) if f"{e}_ttft_overhead_p50_ms" in rows[0]]
    fig, (ttft, itl) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / (2 * len(edges))
    for i, edge in enumerate(edges):
        label = "tracing on" if edge == TRACED else ("tracing off" if len(edges) > 1 else "")
        for j, q in enumerate(("p50", "p99")):
            offset = (2 * i + j - len(edges) + 0.5) * width
            for axis, metric in ((ttft, "ttft"), (itl, "itl")):
                axis.bar([k + offset for k in range(len(rows))], [r[f"{edge}_{metric}_overhead_{q}_ms"] for r in rows],
                         width, label=f"{q} {label}".strip())
    ttft.axhline(3.0, color="gray", linestyle="--", linewidth=1, label="goal p50 @16: 3 ms")
    itl.axhline(1.0, color="gray", linestyle="--", linewidth=1, label="goal p99: 1 ms")
    for axis, what in ((ttft, "TTFT"), (itl, "inter-token latency")):
        axis.set_xticks(range(len(rows)), [str(r["concurrency"]) for r in rows])
        axis.set_xlabel("concurrent streams")
        axis.set_ylabel(f"edge {what} - direct (ms)")
        axis.legend(fontsize=8)
    fig.suptitle(f"infermesh overhead on the full path (sim engine, median of {report['rounds']} rounds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
