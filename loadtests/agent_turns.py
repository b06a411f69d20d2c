"""Agent turns cost their new tokens (issue 21.3): the edge's work per turn of an agent that re-sends its whole
history, against the history's length, with the incremental tokenizer (services/edge/incremental.py) and without
it, side by side in one process.

An agent conversation grows by about ``--turn-tokens`` (6K) tokens a turn (a reply and a new message) up to each
history length in ``--histories``; at each length, the next turn's request body goes through what the edge does
with it before routing, in the edge's own functions: ``prepare`` (the body parsed and validated, the chat template
rendered, tokenized), its result's pickling to and from the preparation process, the router block hashes
(``PrefixHashes``), the bus check and the generate request's encoding. Each is timed in CPU seconds
(``time.process_time``) on the first turn at or past that length, the cache warm from the turns before (as a
session's turns arrive); median over ``--rounds`` conversations. The same turns are run with the cache off (every
token tokenized: the path before). The tokenizer is Gemma 3 270M's (262K vocabulary) when ``./scripts/up`` has
converted it, else the tiny test model's.

    python -m loadtests.agent_turns --out docs/results/agent_turns
"""

from __future__ import annotations

import argparse
import json
import pickle
import random
import statistics
import sys
import time
from pathlib import Path

from loadtests.lib.bench_cli import conclude, parse
from services.edge.incremental import PrefixTokens
from services.edge.prep import PrepJob, crossed, prepare
from services.edge.tokenizer import ModelTokenizer
from shared import bus_limits, schema
from shared.prefix_hash import PrefixHashes
from shared.schema import GenerateRequest

GEMMA = Path.home() / ".cache/infermesh/models/gemma-3-270m"
WORDS = ("the router keeps a prefix index per worker and tier while admission leases capacity to each team "
         "def route(request): return min(workers, key=cost) # fallback when the breaker is open "
         "tool result: {\"status\": 200, \"files\": [\"a.py\", \"b.py\"]} naïve café 東京").split()


def _message(rng: random.Random, role: str, num_words: int) -> dict:
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randrange(5, 25))) for _ in range(num_words // 15 + 1)]
    return {"role": role, "content": "\n".join(lines)}


def _turn_cost(tokenizer: ModelTokenizer, hasher: PrefixHashes, body: bytes, model: str) -> dict[str, float]:
    """CPU seconds of each part of the edge's work on one turn's body."""
    parts: dict[str, float] = {}
    start = time.process_time()
    prepared = prepare(PrepJob("chat", body, tokenizer.path, 1 << 21), tokenizer)
    parts["prepare"] = time.process_time() - start
    start = time.process_time()  # a long body is prepared in a worker process: its result comes back pickled
    prepared = pickle.loads(pickle.dumps(crossed(prepared)))
    parts["transfer"] = time.process_time() - start
    start = time.process_time()
    hashes = hasher.hashes(prepared.prompt_ids, model, None, None, 16)
    parts["hash"] = time.process_time() - start
    start = time.process_time()
    bus_limits.generate_request_bytes(len(prepared.prompt_ids), tokenizer.vocab_size - 1,
                                      len(schema.encode(prepared.params)))
    schema.encode(GenerateRequest("r", model, prepared.prompt_ids, prepared.params))
    parts["encode"] = time.process_time() - start
    parts["total"] = sum(parts.values())
    parts["prompt_tokens"] = len(prepared.prompt_ids)
    parts["blocks"] = len(hashes)
    return parts


def run(args: argparse.Namespace) -> dict:
    path = str(GEMMA) if GEMMA.exists() and not args.tiny else _tiny()
    results: dict[str, list[dict]] = {}
    for mode in ("incremental", "whole"):
        samples: dict[int, list[dict]] = {history: [] for history in args.histories}
        for round_ in range(args.rounds):  # a new conversation (and fresh caches) each round
            tokenizer, hasher = ModelTokenizer(path), PrefixHashes()
            if mode == "whole":  # every token tokenized and hashed, as before
                cache = tokenizer.prefix_tokens
                tokenizer.prefix_tokens = PrefixTokens(cache._encode_batch, (), ())
                hasher = PrefixHashes(max_entries=0)
            for history, cost in _one_conversation(tokenizer, hasher, args, random.Random(args.seed + round_)):
                samples[history].append(cost)
        rows = []
        for history, costs in samples.items():
            row = {"history": history, "prompt_tokens": int(statistics.median(c["prompt_tokens"] for c in costs))}
            row |= {k: statistics.median(c[k] for c in costs) * 1e3
                    for k in ("prepare", "transfer", "hash", "encode", "total")}
            rows.append(row)
            print(f"agent_turns: {mode} {row['prompt_tokens']} tokens: {row['total']:.1f} ms "
                  f"(prepare {row['prepare']:.1f}, transfer {row['transfer']:.1f}, hash {row['hash']:.1f}, "
                  f"encode {row['encode']:.1f})", file=sys.stderr, flush=True)
        results[mode] = rows
    base = results["incremental"][0]["total"]
    return {"command": "python -m loadtests.agent_turns " + " ".join(args.argv), "tokenizer": Path(path).name,
            "turn_tokens": args.turn_tokens, "rounds": args.rounds, "results": results,
            "incremental_vs_first": [r["total"] / base for r in results["incremental"]],
            "whole_vs_incremental": [w["total"] / i["total"]
                                     for w, i in zip(results["whole"], results["incremental"], strict=True)]}


def _one_conversation(tokenizer: ModelTokenizer, hasher: PrefixHashes, args: argparse.Namespace,
                      rng: random.Random):
    """(history length, the cost of the first turn at or past it), for each length, as the conversation grows."""
    conversation = [_message(rng, "system", 1000), _message(rng, "user", 200)]
    words = max(1, int(args.turn_tokens / 2 / 2.4))  # ~2.4 tokens a word of these (Gemma)
    pending = sorted(args.histories)
    while pending:
        body = json.dumps({"model": "m", "messages": conversation, "max_tokens": 256}).encode()
        cost = _turn_cost(tokenizer, hasher, body, "m")
        while pending and cost["prompt_tokens"] >= pending[0]:
            yield pending.pop(0), cost
        conversation += [_message(rng, "assistant", words), _message(rng, "user", words)]


def _tiny() -> str:
    import tempfile

    from infermesh.models import make_tiny_llama
    return str(make_tiny_llama(Path(tempfile.mkdtemp(prefix="im-agent-turns-")) / "tiny"))


def write_report(report: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    (out / "agent_turns.json").write_text(json.dumps(report, indent=1) + "\n")
    fig, axis = plt.subplots(figsize=(8, 4.5))
    for mode, style in (("incremental", "o-"), ("whole", "s--")):
        rows = report["results"][mode]
        axis.plot([r["prompt_tokens"] / 1000 for r in rows], [r["total"] for r in rows], style, label=mode)
    axis.set_xlabel("history (K tokens)")
    axis.set_ylabel("edge CPU per turn (ms)")
    axis.set_yscale("log")
    axis.legend()
    axis.set_title(f"An agent turn's edge work ({report['tokenizer']} tokenizer)")
    fig.tight_layout()
    fig.savefig(out / "agent_turns.png", dpi=110)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--histories", type=int, nargs="+", default=[8_000, 16_000, 32_000, 64_000, 128_000, 200_000])
    parser.add_argument("--turn-tokens", type=int, default=6_000)
    parser.add_argument("--rounds", type=int, default=5, help="conversations (the median of each length's turns)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--tiny", action="store_true", help="the tiny test model's tokenizer even if Gemma's is there")
    parser.add_argument("--out", default="")
    args = parse(parser, argv)
    return conclude(run(args), args.out, write_report)


if __name__ == "__main__":
    main()
