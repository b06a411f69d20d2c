"""What the migration benchmark found: each phase's streams against the undisturbed texts and the ledger's
rows, as JSON, a PNG and a markdown table.

Per phase (the same N requests each), over its streams:

| figure | rule |
|---|---|
| completed | the stream ended with ``finish_reason`` length and its usage chunk |
| errors | by kind: the API error's code (or its class) the client raised |
| hung | no end within the hard per-request limit (must be 0) |
| exact | the client's text equals the undisturbed phase's text of that request |
| hit | streams open on a worker when it was SIGKILLed (the router's decisions say where each one runs) |
| migrations | the ledger rows' ``migrations`` summed; ``migrated``: rows with one or more |
| billed once | exactly one ledger row, its completion tokens those the client was told (completed) or at least the |
|  | chunks it got (cut) |
| lost / doubled | no row / more than one row, or more completion tokens than the client was told |
| kill -> next token | from the SIGKILL to a hit stream's next chunk, at the client; ``gap``: its last chunk before |
|  | the kill to that next one |
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from dataclasses import asdict, dataclass, field
from itertools import pairwise
from pathlib import Path

from loadtests.lib.stats import percentile

PROGRESS_EVERY = 10  # the JSON keeps every 10th chunk time of each stream (the PNG's timelines)


@dataclass(slots=True)
class Seen:
    """What one client saw of one streamed request (times: monotonic seconds)."""

    index: int
    request_id: str = ""
    text: str = ""
    chunk_times: list[float] = field(default_factory=list)  # one per chunk with text
    finish_reason: str | None = None
    usage: dict | None = None  # the usage chunk: prompt_tokens, completion_tokens
    error: str = ""
    error_message: str = ""
    hung: bool = False
    deployment: str = ""  # the response's x-infermesh-deployment: where its first token came from
    ended: float | None = None  # when the client's stream ended (the last chunk, an error, the hang limit)

    def open_at(self, t: float) -> bool:
        """Still streaming at ``t``: it has a request id, and not every chunk it was to get came before."""
        return bool(self.request_id) and (self.finish_reason is None or self.chunk_times[-1] > t)


@dataclass(slots=True)
class Kill:
    """One SIGKILL: whom, when, what it hit, and the worker that replaced it."""

    worker_id: str
    at: float
    share: float  # its time into the phase, as a share of the undisturbed phase's duration
    hit: list[str]  # request ids open on the worker
    hit_before: int  # of those, streams an earlier kill of the phase had hit (a second migration)
    hit_chunks: list[int]  # the chunks each hit stream had got
    replacement: str
    replacement_live_s: float | None = None  # from the kill until the new worker is in the edge's directory


def _ms_figures(seconds: list[float]) -> dict[str, float | None]:
    if not seconds:
        return {"median_s": None, "max_s": None, "n": 0}
    return {"median_s": round(statistics.median(seconds), 3), "max_s": round(max(seconds), 3), "n": len(seconds)}


def _resumed(seen: Seen, at: float, until: float) -> tuple[float, float] | None:
    """(kill -> the resumed token, the gap around the kill) of a stream hit at ``at`` that went on. Chunks already
    on their way at the kill may come first: the stall is the longest gap between its chunks (the kill counting as
    one) that ends by ``until`` (the next kill that hits it: that stall is its own); the resumed token ends it. A stream
    with no chunk before the next kill resumes with its first chunk after this one. None if it was cut."""
    points = [at, *(t for t in seen.chunk_times if t > at)]
    if seen.error or seen.hung or len(points) < 2:
        return None
    gaps = [(a, b) for a, b in pairwise(points) if b <= until] or [(points[0], points[1])]
    start, end = max(gaps, key=lambda g: g[1] - g[0])
    if start == at:  # no chunk came between the kill and the stall: the gap starts at the last one before
        start = max((t for t in seen.chunk_times if t <= at), default=at)
    return end - at, end - start


def _next_hit(later: list[Kill], request_id: str) -> float:
    """When the next of the ``later`` kills hit this stream too (inf: none did)."""
    return min((k.at for k in later if request_id in k.hit), default=float("inf"))


def _billing(seen: list[Seen], rows: dict[str, list[dict]]) -> dict:
    """The ledger's rows against the clients: a completed stream's row has the completion tokens its client was
    told; a cut stream's row has at least as many as the chunks its client got (a chunk holds one token or more,
    a token may hold back text: chunks are a lower bound)."""
    once = lost = doubled = mismatched = 0
    for s in seen:
        if not s.request_id:
            continue  # failed before any chunk: nothing to bill
        billed = rows.get(s.request_id, [])
        if not billed:
            lost += 1
            continue
        completion = sum(r["completion_tokens"] for r in billed)
        told = s.usage["completion_tokens"] if s.usage else None
        if len(billed) > 1 or (told is not None and completion > told):
            doubled += 1
        elif (told is not None and completion != told) or (told is None and completion < len(s.chunk_times)):
            mismatched += 1
        else:
            once += 1
    mine = [r for s in seen for r in rows.get(s.request_id, [])]
    told_usage = [s for s in seen if s.usage]
    cut = [s for s in seen if s.error and s.request_id]
    return {"billed_once": once, "lost": lost, "doubled": doubled, "mismatched": mismatched,
            "usage_rows": len(mine),
            "told_completion_tokens": sum(s.usage["completion_tokens"] for s in told_usage),
            "billed_told_completion_tokens": sum(r["completion_tokens"] for s in told_usage
                                                 for r in rows.get(s.request_id, [])),
            "cut_streams": len(cut), "cut_billed": sum(1 for s in cut if s.request_id in rows),
            "cut_chunks": sum(len(s.chunk_times) for s in cut),
            "cut_billed_completion_tokens": sum(r["completion_tokens"] for s in cut
                                                for r in rows.get(s.request_id, [])),
            "migrations": sum(r["migrations"] for r in mine),
            "migrated_requests": sum(1 for r in mine if r["migrations"]),
            "max_migrations_per_request": max((r["migrations"] for r in mine), default=0),
            "migration_prefill_tokens": sum(r["migration_prefill_tokens"] for r in mine)}


def phase_report(name: str, seen: list[Seen], kills: list[Kill], rows: dict[str, list[dict]],
                 reference: dict[int, str], started: float, max_tokens: int) -> dict:
    """One phase's figures; ``reference`` maps a request's index to its undisturbed text."""
    by_id = {s.request_id: s for s in seen if s.request_id}
    per_kill, to_next, gaps = [], [], []
    for i, kill in enumerate(kills):
        mine = [(by_id[r], _next_hit(kills[i + 1:], r)) for r in kill.hit if r in by_id]
        followed = [f for f in (_resumed(s, kill.at, end) for s, end in mine) if f]
        cut = [s.ended - kill.at for s, end in mine if s.error and s.ended is not None and s.ended <= end]
        to_next += [f[0] for f in followed]
        gaps += [f[1] for f in followed]
        per_kill.append({"worker_id": kill.worker_id, "at_s": round(kill.at - started, 3),
                         "share": round(kill.share, 3), "hit": len(kill.hit), "hit_ids": kill.hit,
                         "hit_before": kill.hit_before,
                         "hit_chunks_median": statistics.median(kill.hit_chunks) if kill.hit_chunks else None,
                         "went_on": len(followed),
                         "kill_to_next_token": _ms_figures([f[0] for f in followed]),
                         "cut": len(cut), "kill_to_client_error": _ms_figures(cut),
                         "replacement": kill.replacement, "replacement_live_s": kill.replacement_live_s})
    intervals = [b - a for s in seen for a, b in pairwise(s.chunk_times)]
    exact = [s.index for s in seen if s.index in reference and s.text == reference[s.index]]
    prefix = [s for s in seen if s.error and s.index in reference and reference[s.index].startswith(s.text)]
    completed = [s for s in seen if s.finish_reason == "length" and s.usage and not s.error]
    return {
        "phase": name, "requests": len(seen), "completed": len(completed),
        "full_length": sum(1 for s in completed if s.usage["completion_tokens"] == max_tokens),
        "errors": dict(Counter(s.error for s in seen if s.error and not s.hung)),
        "hung": sum(1 for s in seen if s.hung),
        "exact": len(exact), "exact_pct": round(100.0 * len(exact) / len(seen), 1) if seen else 0.0,
        "not_exact": sorted(set(s.index for s in seen) - set(exact)),
        "cut_text_prefix_of_undisturbed": len(prefix),
        "hit": sum(len(k.hit) for k in kills), "kills": per_kill,
        **_billing(seen, rows),
        "kill_to_next_token": _ms_figures(to_next), "gap_around_kill": _ms_figures(gaps),
        "chunk_interval_p99_s": round(percentile(intervals, 99), 4) if intervals else None,
        "chunk_interval_max_s": round(max(intervals), 3) if intervals else None,
        "streams": [_stream_json(s, started) for s in seen],
    }


def _stream_json(s: Seen, started: float) -> dict:
    out = {k: v for k, v in asdict(s).items() if k not in ("text", "chunk_times", "ended")}
    out["ended_t"] = round(s.ended - started, 3) if s.ended is not None else None
    out["chunks"] = len(s.chunk_times)
    out["progress_t"] = [round(t - started, 3) for t in s.chunk_times[::PROGRESS_EVERY]]
    out["last_chunk_t"] = round(s.chunk_times[-1] - started, 3) if s.chunk_times else None
    return out


def overall(phases: list[dict]) -> dict:
    """The phases' counts summed (the kill figures stay per phase)."""
    keys = ("requests", "completed", "hung", "exact", "hit", "billed_once", "lost", "doubled", "mismatched",
            "usage_rows", "told_completion_tokens", "billed_told_completion_tokens", "cut_streams", "cut_billed",
            "cut_chunks", "cut_billed_completion_tokens", "migrations", "migrated_requests",
            "migration_prefill_tokens")
    total: dict = {"phase": "overall", **{k: sum(p[k] for p in phases) for k in keys}}
    total["errors"] = dict(sum((Counter(p["errors"]) for p in phases), Counter()))
    total["exact_pct"] = round(100.0 * total["exact"] / total["requests"], 1) if total["requests"] else 0.0
    return total


def write_report(report: dict, out: Path, stem: str = "migration", extra_md: str = "") -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    _plot(report, out / f"{stem}.png")
    (out / "table.md").write_text(markdown_tables(report) + extra_md)


def _seconds(figures: dict) -> str:
    if not figures["n"]:
        return "-"
    return f"{figures['median_s']:.2f} / {figures['max_s']:.2f}"


def markdown_tables(report: dict) -> str:
    """One row per phase and the overall row, then one row per kill."""
    head = ("| phase | requests | completed | client errors by kind | hung | text = undisturbed | hit by kills "
            "| migrations (requests) | usage rows | billed once | lost | doubled | completion tokens billed / told "
            "(completed) | cut streams: billed, tokens billed / chunks got | migration prefill tokens "
            "| kill -> next token, median / max (s) |\n|" + "---|" * 16 + "\n")
    rows = []
    for p in [*report["phases"], report["overall"]]:
        errors = ", ".join(f"{kind} {n}" for kind, n in sorted(p["errors"].items())) or "none"
        kill = _seconds(p["kill_to_next_token"]) if "kill_to_next_token" in p else ""
        cut = (f"{p['cut_streams']}: {p['cut_billed']}, {p['cut_billed_completion_tokens']} / {p['cut_chunks']}"
               if p["cut_streams"] else "0")
        rows.append(f"| {p['phase']} | {p['requests']} | {p['completed']} | {errors} | {p['hung']} | "
                    f"{p['exact']} ({p['exact_pct']:.0f}%) | {p['hit']} | {p['migrations']} "
                    f"({p['migrated_requests']}) | {p['usage_rows']} | {p['billed_once']} | {p['lost']} | "
                    f"{p['doubled']} | {p['billed_told_completion_tokens']} / {p['told_completion_tokens']} | "
                    f"{cut} | {p['migration_prefill_tokens']} | {kill} |")
    kills_head = ("\n| phase | kill | SIGKILLed | at (s) | share of the undisturbed duration | streams hit "
                  "(hit before) | their chunks so far, median | went on | kill -> next token, median / max (s) "
                  "| cut | kill -> client error, median / max (s) | replaced by (live after, s) |\n|" + "---|" * 12
                  + "\n")
    kill_rows = []
    for p in report["phases"]:
        for i, k in enumerate(p["kills"], 1):
            live = "never" if k["replacement_live_s"] is None else f"{k['replacement_live_s']:.1f}"
            kill_rows.append(f"| {p['phase']} | {i} | {k['worker_id']} | {k['at_s']:.1f} | {100 * k['share']:.0f}% "
                             f"| {k['hit']} ({k['hit_before']}) | {k['hit_chunks_median']:.0f} | {k['went_on']} | "
                             f"{_seconds(k['kill_to_next_token'])} | {k['cut']} | "
                             f"{_seconds(k['kill_to_client_error'])} | {k['replacement']} ({live}) |")
    return head + "\n".join(rows) + "\n" + (kills_head + "\n".join(kill_rows) + "\n" if kill_rows else "")


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = report["phases"]
    disturbed = [p for p in phases if p["kills"]]
    fig, axes = plt.subplots(1, len(disturbed) + 1, figsize=(5.5 * (len(disturbed) + 1), 4.5))
    for ax, p in zip(axes, disturbed, strict=False):  # the last axes are the outcome bars
        hit = {r for k in p["kills"] for r in k["hit_ids"]}
        for s in p["streams"]:
            if not s["chunks"]:
                continue
            xs = [*s["progress_t"], s["last_chunk_t"]]
            ys = [*(i * PROGRESS_EVERY + 1 for i in range(len(s["progress_t"]))), s["chunks"]]
            cut = bool(s["error"] or s["hung"])
            colour = "tab:red" if cut else "tab:orange" if s["request_id"] in hit else "tab:blue"
            ax.plot(xs, ys, color=colour, linewidth=0.8, alpha=0.8, zorder=3 if cut else 2)
            if cut:
                ax.plot(xs[-1], ys[-1], "x", color="tab:red", zorder=4)
        for k in p["kills"]:
            ax.axvline(k["at_s"], color="black", linestyle="--", linewidth=0.8)
            ax.text(k["at_s"], 5, f" kill {k['worker_id']}", fontsize=7, rotation=90, va="bottom")
        ax.set_title(f"{p['phase']}: chunks per stream (orange: hit and went on; red x: cut)", fontsize=9)
        ax.set_xlabel("seconds since the phase started")
        ax.set_ylabel("chunks received")
    ax = axes[-1]
    names = [p["phase"] for p in phases]
    exact = [p["exact"] for p in phases]
    other_ok = [p["completed"] - p["exact"] if p["completed"] > p["exact"] else 0 for p in phases]
    errors = [sum(p["errors"].values()) for p in phases]
    hung = [p["hung"] for p in phases]
    bottom = [0] * len(phases)
    for values, label, colour in ((exact, "text = undisturbed", "tab:green"), (other_ok, "completed, other text",
                                  "tab:olive"), (errors, "client error", "tab:red"), (hung, "hung", "black")):
        ax.bar(names, values, bottom=bottom, label=label, color=colour)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    for i, p in enumerate(phases):
        served = "".join(f"\nserved by {d}: {n}" for d, n in sorted(p.get("served_by", {}).items()))
        ax.text(i, bottom[i], f"migrations {p['migrations']}\nrows {p['usage_rows']}/{p['requests']}{served}",
                ha="center", va="bottom", fontsize=7)
    ax.set_ylim(0, max(bottom, default=0) * 1.6 + 1)
    ax.set_ylabel("streams")
    ax.set_title("outcome per phase", fontsize=9)
    ax.legend(fontsize=7, loc="upper center", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
