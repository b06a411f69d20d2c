"""Which cut answers of a tool soak had no chance: the call its grammar forces is longer than max_tokens.

A ``cut`` answer (finish_reason length with the last call unfinished) is a failure of budget-aware
closing only if the budget could hold a complete call. This computes, per request, the tokens the
closing policy takes from the first token to the end of a call (``ConstrainedDecoder.closing_length``
on the request's own grammar, built as the edge builds it, on the model's tokenizer): the shortest
call the (greedy) policy knows. Below that budget closing cannot promise a finished call
(``cut_short``; a sampler may still stumble on a shorter path); a cut at a budget at or above it is a
closing miss (``cut_with_room``).

    python -m loadtests.tool_soak_budget docs/results/tool_soak/chunked/tool_soak_vllm_hermes.json

reclassifies a report's cut answers (the requests are rebuilt from its seed, as the soak made them) and
writes the split into the report's JSON and markdown.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from loadtests.lib.tool_soak_plan import Plan, plan_requests

MODEL = "tiny"


def call_length(plan: Plan, fmt: str, grammars: Any) -> int:
    """Tokens the closing policy takes from the start to a finished call under ``plan``'s grammar."""
    from services.edge.tools import build_constraint, validate_tools
    from shared.schema import Structured

    body = plan.body
    tools = validate_tools(body["tools"], body.get("tool_choice"), body.get("parallel_tool_calls"))
    constraint = build_constraint(fmt, tools)
    assert constraint is not None
    stop = [grammars.tokenizer.eos_token_id]
    decoder = grammars.decoder(Structured(constraint.kind, constraint.spec, 0), body.get("max_tokens") or 512, stop)
    return decoder.closing_length(limit=4096)


def reclassify(report: dict[str, Any], model_path: str) -> dict[str, int]:
    """The cut answers of ``report`` split into cut_short / cut; returns the counts (the report is updated)."""
    from loadtests.tool_soak import sizing_of
    from services.worker.engines.grammar import GrammarCache

    plans = plan_requests(report["num_requests"], report["seed"], tuple(report["max_tokens"]), MODEL,
                          sizing_of(model_path, report["context"]))
    grammars = GrammarCache(model_path)
    counts: Counter[str] = Counter()
    for result in report["results"]:
        if result["outcome"] != "cut":
            continue
        plan = plans[result["i"]]
        needed = call_length(plan, report["tool_call_format"], grammars)
        result["call_tokens"] = needed
        result["cut_kind"] = "cut_short" if plan.body["max_tokens"] < needed else "cut"
        counts[result["cut_kind"]] += 1
    report["summary"]["cut_split"] = {"cut_short": counts["cut_short"], "cut_with_room": counts["cut"]}
    report["definitions"]["cut_split"] = (
        "cut answers split by the request's shortest call (tokens the closing policy takes from the first token "
        "to a finished call): cut_short = max_tokens below it (the greedy policy cannot promise a call there; a "
        "sampler may still find a shorter path), cut_with_room = max_tokens at or above it (a closing miss)")
    return dict(counts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report", help="a tool_soak JSON report")
    parser.add_argument("--model-path", default="", help="the model's tokenizer (default: the tiny test model)")
    args = parser.parse_args()
    path = Path(args.report)
    report = json.loads(path.read_text())
    model_path = args.model_path
    if not model_path:
        from infermesh.models import make_tiny_llama

        model_path = str(make_tiny_llama(Path(tempfile.mkdtemp(prefix="soak-budget-")) / "tiny-llama"))
    reclassify(report, model_path)
    split = report["summary"]["cut_split"]
    path.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    md = path.with_suffix(".md")
    if md.exists():
        text = md.read_text().split("\n\nCut answers by budget:")[0].rstrip("\n")
        md.write_text(text + f"\n\nCut answers by budget: {split['cut_short']} with max_tokens below the shortest call "
                      f"budget-aware closing knows for their grammar (it cannot promise a call there), "
                      f"{split['cut_with_room']} with room for it "
                      f"(`python -m loadtests.tool_soak_budget {path}`).\n")
    print(json.dumps(split))


if __name__ == "__main__":
    main()
