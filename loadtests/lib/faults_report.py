"""What the fault matrix found: client outcomes per fault against the ledger's rows, as JSON and a PNG.

Rules (per fault, over the requests that started while it ran):
- lost: a client was shown usage, the ledger has no row for that request;
- doubled: the ledger bills more completion tokens for a request than its client was shown;
- mismatched: the ledger's tokens differ from the client's in any other way;
- unbilled_cut_streams: a stream cut after content reached its client, with no row (generated, never billed);
- hung: no answer within the client's hang limit.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter, defaultdict
from pathlib import Path


async def ledger_rows(database_url: str, settle_s: float, limit_s: float = 180.0) -> dict[str, list[dict]]:
    """request id -> its usage rows, once the row count has not moved for ``settle_s``."""
    from sqlalchemy import text
    from sqlalchemy.ext.asyncio import create_async_engine

    engine = create_async_engine(database_url)
    query = text("SELECT request_id, attempt, prompt_tokens, cached_tokens, completion_tokens, status, "
                 "finish_reason FROM usage")
    try:
        last, stable_since, start = -1, time.monotonic(), time.monotonic()
        while time.monotonic() - start < limit_s:
            async with engine.connect() as conn:
                count = (await conn.execute(text("SELECT count(*) FROM usage"))).scalar_one()
            if count != last:
                last, stable_since = count, time.monotonic()
            elif time.monotonic() - stable_since >= settle_s:
                break
            await asyncio.sleep(0.5)
        async with engine.connect() as conn:
            rows = [dict(r._mapping) for r in await conn.execute(query)]
    finally:
        await engine.dispose()
    by_request: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        by_request[row["request_id"]].append(row)
    return dict(by_request)


def phase_report(phase: dict, rows: dict[str, list[dict]]) -> dict:
    outcomes = phase["outcomes"]
    shown = [o for o in outcomes if o.usage]
    lost = doubled = mismatched = 0
    for o in shown:
        billed = rows.get(o.request_id, [])
        if not billed:
            lost += 1
            continue
        completion = sum(r["completion_tokens"] for r in billed)
        prompt = sum(r["prompt_tokens"] for r in billed)
        if completion > o.usage["completion_tokens"] or len(billed) > 1:
            doubled += 1
        elif (completion, prompt) != (o.usage["completion_tokens"], o.usage["prompt_tokens"]):
            mismatched += 1
    cut = [o for o in outcomes if o.error and o.chunks > 0 and o.request_id]
    unbilled_cut = [o for o in cut if o.request_id not in rows]
    return {
        "fault": phase["fault"], "requests": len(outcomes), "finished": sum(1 for o in outcomes if not o.error),
        "errors": dict(Counter(o.error for o in outcomes if o.error)), "hung": sum(1 for o in outcomes if o.hung),
        "shown_usage": len(shown), "billed": sum(1 for o in shown if o.request_id in rows), "lost": lost,
        "doubled": doubled, "mismatched": mismatched, "cut_streams": len(cut),
        "unbilled_cut_streams": len(unbilled_cut), "first_success_s": phase["first_success_s"],
        "back_s": phase["back_s"],
    }


def write_report(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "faults.json").write_text(json.dumps(report, indent=2) + "\n")
    _plot(report["faults"], out / "faults.png")
    (out / "table.md").write_text(markdown_table(report["faults"]))


def markdown_table(faults: list[dict]) -> str:
    """One row per fault, for docs/results/faults.md."""
    head = ("| SIGKILLed | requests | ok | client errors by kind | hung | shown usage | billed | lost | doubled "
            "| cut streams (billed) | first success after (s) | back after (s) |\n|" + "---|" * 12 + "\n")

    def seconds(value: float | None) -> str:
        return "never" if value is None else f"{value:.1f}"

    rows = []
    for f in faults:
        errors = ", ".join(f"{kind} {n}" for kind, n in sorted(f["errors"].items())) or "none"
        billed_cut = f["cut_streams"] - f["unbilled_cut_streams"]
        rows.append(f"| {f['fault']} | {f['requests']} | {f['finished']} | {errors} | {f['hung']} | "
                    f"{f['shown_usage']} | {f['billed']} | {f['lost']} | {f['doubled']} | "
                    f"{f['cut_streams']} ({billed_cut}) | {seconds(f['first_success_s'])} | "
                    f"{seconds(f['back_s'])} |")
    return head + "\n".join(rows) + "\n"


def _plot(faults: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [f["fault"] for f in faults]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    kinds = sorted({k for f in faults for k in f["errors"]})
    bottom = [0] * len(faults)
    for kind in kinds:
        values = [f["errors"].get(kind, 0) for f in faults]
        left.bar(names, values, bottom=bottom, label=kind)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    for i, f in enumerate(faults):
        left.text(i, bottom[i], f"{f['finished']}/{f['requests']} ok\nlost {f['lost']} dbl {f['doubled']}\n"
                  f"hung {f['hung']}", ha="center", va="bottom", fontsize=7)
    left.set_ylim(0, max(bottom, default=0) * 1.4 + 1.5)  # room for the labels
    left.set_title("client errors by kind per fault (labels: ok, lost, doubled, hung)")
    left.set_ylabel("requests")
    if kinds:
        left.legend(fontsize=7)
    width = 0.4
    xs = range(len(faults))
    right.bar([x - width / 2 for x in xs], [f["first_success_s"] or 0 for f in faults], width,
              label="first success after the kill")
    right.bar([x + width / 2 for x in xs], [f["back_s"] or 0 for f in faults], width,
              label="process restarted, mesh ready")
    right.set_xticks(list(xs), names)
    right.set_ylabel("seconds")
    right.set_title("recovery")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
