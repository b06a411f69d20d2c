"""cluster_faults' figures: recovery of the completion rate after each kill, and its JSON, PNG and markdown."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

BACK_SHARE = 0.8  # recovered: completions per second back to this share of the rate before the first kill


def completions_per_s(outcomes, t0: float) -> Counter[int]:
    """Finished requests per whole second since ``t0`` (by when they ended)."""
    return Counter(int(o.ended - t0) for o in outcomes if not o.error and o.ended)


def recovery_s(outcomes, t0: float, kill_t: float, baseline_end_t: float, warm_up_s: float = 1.0) -> float | None:
    """Seconds from the kill to the end of the first whole second after it whose completions reach BACK_SHARE of
    the mean rate between ``warm_up_s`` and ``baseline_end_t``; None if none does."""
    rate = completions_per_s(outcomes, t0)
    seconds = range(int(warm_up_s), int(baseline_end_t))
    if not seconds:
        return None
    baseline = sum(rate[s] for s in seconds) / len(seconds)
    last = max(rate, default=0)
    for second in range(int(kill_t) + 1, last + 1):
        if rate[second] >= BACK_SHARE * baseline:
            return second + 1 - kill_t
    return None


def markdown(report: dict) -> str:
    head = ("| phase | requests | ok | client errors by kind | hung | shown usage | billed | lost | doubled "
            "| cut streams (billed) |\n|" + "---|" * 10 + "\n")
    rows = []
    for p in report["phases"]:
        errors = ", ".join(f"{kind} {n}" for kind, n in sorted(p["errors"].items())) or "none"
        rows.append(f"| {p['fault']} | {p['requests']} | {p['finished']} | {errors} | {p['hung']} | "
                    f"{p['shown_usage']} | {p['billed']} | {p['lost']} | {p['doubled']} | "
                    f"{p['cut_streams']} ({p['cut_streams'] - p['unbilled_cut_streams']}) |")
    kills = ["| kill | at (s) | first success after (s) | rate back to 80% after (s) |", "|---|---|---|---|"]
    for k in report["kills"]:
        def s(v: float | None) -> str:
            return "never" if v is None else f"{v:.1f}"
        at = f"{k['t']:.1f}" + (f" to {k['last_t']:.1f} (timed from the last)" if "last_t" in k else "")
        kills.append(f"| {k['what']} | {at} | {s(k['first_success_s'])} | {s(k['throughput_back_s'])} |")
    return (head + "\n".join(rows) + "\n\n" + "\n".join(kills) + "\n\n"
            f"Admission's leased tokens, sampled every 0.25 s: at most {report['max_leased_tokens']} of a capacity of "
            f"{report['capacity_tokens']}.\n")


def write_report(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "cluster_faults.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "table.md").write_text(markdown(report))  # (README.md quotes it)
    _plot(report, out / "cluster_faults.png")


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timeline = report["timeline"]
    end = int(max((o["ended"] for o in timeline), default=0)) + 1
    ok, failed = [0] * end, [0] * end
    for o in timeline:
        second = min(int(o["ended"]), end - 1)
        (failed if o["error"] else ok)[second] += 1
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    top.bar(range(end), ok, width=1.0, label="finished")
    top.bar(range(end), failed, width=1.0, bottom=ok, label="failed (the client retries)")
    top.set_ylabel("requests per second")
    samples = [s for s in report["samples"] if "leased_tokens" in s]
    bottom.plot([s["t"] for s in samples], [s["leased_tokens"] for s in samples], label="leased tokens")
    bottom.axhline(report["capacity_tokens"], color="gray", linestyle="--", label="admission's capacity")
    bottom.set_ylabel("tokens")
    bottom.set_xlabel("seconds")
    for axis in (top, bottom):
        for kill in report["kills"]:
            axis.axvline(kill["t"], color="red", linewidth=1)
        axis.legend(fontsize=8, loc="lower left")
    for kill in report["kills"]:
        top.text(kill["t"], top.get_ylim()[1] * 0.95, " " + kill["what"], color="red", fontsize=8, va="top")
    hosts = {"netns": "3 hosts (network namespaces)", "loopback": "one loopback"}.get(report.get("hosts", ""), "")
    fig.suptitle(f"A mesh on a 3-server NATS cluster, {hosts}: a server, then one replica of each service, "
                 "SIGKILLed")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
