"""A soak: many tool-call requests with varied schemas through one worker; no request may kill its engine.

Each request declares 1-4 tools: conformance-corpus tools (``corpus.py``, and ``corpus_unicode.py`` when it
exists), most of them mutated, seeded and deterministic, in ways that stress the grammar hooks (the edge's
grammar, vLLM's xgrammar matcher, our budget-aware closing processor):

    unicode    Hangul, CJK, emoji (ZWJ), RTL, combining marks in descriptions, enum and const values
    keys       the same in property names
    deep       the arguments nested in objects, as deep as the edge's schema-depth cap allows
    wide       10-40 more properties of every type
    enum       a long enum (20-100 values, some non-ASCII)
    pattern    string properties with regex patterns
    bounds     integers and numbers with (exclusive) bounds
    nullable   properties made ``[type, "null"]`` or ``anyOf [.., null]``
    recursive  a ``$defs`` linked list / tree through ``$ref``
    objects    an array of objects with item bounds
    combo      two or three of the above

and varies tool_choice (required / auto / named), parallel_tool_calls (true / false / absent), streaming
(with and without usage), max_tokens (a budget range: budget-aware closing is active often), temperature 0
and 1 with a seed. Tools are drawn to fit the model's context with max_tokens to spare (the tiny model has
2,048 positions), so the big mutations go with the small budgets. Every request stays within the edge's caps
(services/edge/README.md "Limits"). The official openai SDK sends them, a few at a time, to an in-process mesh (router,
one worker, one edge, its own nats-server). Each answer is one ``Outcome``; the engine is watched all along (the edge's
view of the registry, the worker's restart count) and probed at the end. JSON + PNG + markdown under --out.

    python -m loadtests.tool_soak --engine sim --requests 200
    flock /tmp/infermesh-vllm.lock python -m loadtests.tool_soak --engine vllm --requests 1000 --max-tokens 128 \
        --max-num-batched-tokens 8192
    python -m loadtests.tool_soak --show 3      # request 3's body, to send it again

Found with it: vLLM 0.32 on CPU dies (EngineDeadError, "CPU Generator does not use offset") on a request with a
seed and temperature > 0 whose prefill is chunked (another request's prompt took part of the step's token
budget): the model runner rewinds the request's torch.Generator with set_offset, which CPU generators lack.
With vLLM's default budget (2,048 here) a trial run of seed 0 died at request 3; a budget of concurrency x
context (--max-num-batched-tokens 8192) never chunks a prefill. docs/results/tool_soak/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import platform
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

import openai

from infermesh.local import LocalMesh
from infermesh.processes import nats_server_binary
from loadtests.lib.stats import percentile
from loadtests.lib.tool_soak_plan import Plan, Sizing, plan_requests
from loadtests.lib.tool_soak_shape import Outcome, classify, read_completion, read_stream
from shared.ports import free_port, wait_for_port

MODEL = "tiny"
# words of engine death in an error message: the worker failed its requests because its engine died
DEATH_WORDS = ("enginedead", "engine died", "left the mesh", "restarted", "restarting")


def sizing_of(model_path: str, context: int) -> Sizing:
    """Plans sized with the model's own tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return Sizing(context, lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"]))


def model_path_of(args: argparse.Namespace, workdir: Path) -> str:
    if args.model_path:
        return args.model_path
    from infermesh.models import make_tiny_llama

    return str(make_tiny_llama(workdir / "tiny-llama"))


async def start_mesh(nats_url: str, engine: str, model_path: str, tool_format: str, context: int,
                     max_num_batched_tokens: int = 0) -> LocalMesh:
    mesh = LocalMesh(nats_url, f"soak{uuid.uuid4().hex[:8]}")
    await mesh.start_router()
    if engine == "sim":
        await mesh.start_worker(worker_id="sim-0", engine="sim", model=MODEL, model_path=model_path,
                                max_model_len=context, block_size=16, num_kv_blocks=16384, sim_ttft_ms=0.5,
                                sim_itl_ms=0.0, heartbeat_ttl_s=60.0)
    else:
        await mesh.start_worker(worker_id="vllm-0", engine="vllm", model=MODEL, model_path=model_path,
                                max_model_len=context, cpu_core=0, heartbeat_ttl_s=60.0,
                                max_num_batched_tokens=max_num_batched_tokens)
    await mesh.start_edge(admission=False, tool_call_format=tool_format)
    deadline = time.monotonic() + 300
    while not mesh.edge.mesh.is_ready():
        assert time.monotonic() < deadline, "the mesh did not get ready"
        await asyncio.sleep(0.1)
    return mesh


class RegistryWatch:
    """What the edge saw of the worker: every time it left the registry or came back as a new incarnation."""

    def __init__(self, mesh: LocalMesh, t0: float) -> None:
        self.events: list[dict] = []
        self._t0 = t0
        directory = mesh.edge.mesh.directory
        directory.on_removed.append(lambda worker_id: self._saw("left", worker_id))
        directory.on_restarted.append(lambda worker_id: self._saw("restarted", worker_id))

    def _saw(self, what: str, worker_id: str) -> None:
        self.events.append({"event": what, "worker_id": worker_id, "t_s": round(time.monotonic() - self._t0, 2)})


async def send(client: openai.AsyncOpenAI, plan: Plan, timeout_s: float) -> dict:
    """One request; its outcome, why, and how long it took."""
    t0 = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s):
            if plan.body.get("stream"):
                stream = await client.chat.completions.create(**plan.body)
                answer = await read_stream(stream, usage="stream_options" in plan.body)
            else:
                answer = read_completion(await client.chat.completions.create(**plan.body))
        outcome, why = classify(plan, answer)
    except TimeoutError:
        outcome, why = Outcome.HUNG, f"no answer within {timeout_s} s"
    except openai.APITimeoutError:
        outcome, why = Outcome.HUNG, "the SDK timed out"
    except openai.APIStatusError as exc:
        body = exc.body if isinstance(exc.body, dict) else {}
        code = body.get("code") or (body.get("error") or {}).get("code") or ""
        outcome, why = Outcome.HTTP_ERROR, f"{exc.status_code} {code}: {exc.message}"[:600]
    except openai.OpenAIError as exc:
        outcome, why = Outcome.SDK_ERROR, f"{type(exc).__name__}: {exc}"[:600]
    return {"i": plan.index, "outcome": outcome, "why": why, "elapsed_s": time.monotonic() - t0}


async def soak(client: openai.AsyncOpenAI, plans: list[Plan], concurrency: int, timeout_s: float,
               log_path: Path) -> list[dict]:
    """Every plan, ``concurrency`` at a time; each result also appended to ``log_path`` as it comes (a run
    killed before its report keeps them)."""
    gate = asyncio.Semaphore(concurrency)
    log_file = log_path.open("a")
    print(f"results as they come: {log_path}", flush=True)
    done = 0
    t0 = time.monotonic()

    async def one(plan: Plan) -> dict:
        nonlocal done
        async with gate:
            result = await send(client, plan, timeout_s)
        done += 1
        log_file.write(json.dumps({**result, "outcome": result["outcome"].value}, ensure_ascii=False) + "\n")
        log_file.flush()
        if done % 50 == 0 or done == len(plans):
            print(f"{done}/{len(plans)} in {time.monotonic() - t0:.0f} s", flush=True)
        return result

    try:
        return await asyncio.gather(*(one(plan) for plan in plans))
    finally:
        log_file.close()


async def probe(client: openai.AsyncOpenAI, n: int = 3) -> list[str]:
    """After the soak: plain tool-call requests that must be served (the engine is alive); their errors."""
    from tests.conformance.tool_calls.corpus import TOOLS

    errors = []
    for seed in range(n):
        try:
            await client.chat.completions.create(model=MODEL, tools=TOOLS[:2], tool_choice="required", seed=seed,
                                                 max_tokens=64, messages=[{"role": "user", "content": "weather?"}])
        except openai.OpenAIError as exc:
            errors.append(f"{type(exc).__name__}: {exc}"[:300])
    return errors


def summarize(plans: list[Plan], results: list[dict]) -> dict:
    outcomes = Counter(r["outcome"].value for r in results)
    http = Counter(r["why"].split(":")[0] for r in results if r["outcome"] is Outcome.HTTP_ERROR)
    by_kind: dict[str, Counter] = {}
    by_choice: dict[str, Counter] = {}
    for plan, r in zip(plans, results, strict=True):
        for kind in plan.kinds:
            by_kind.setdefault(kind, Counter())[r["outcome"].value] += 1
        by_choice.setdefault(plan.label, Counter())[r["outcome"].value] += 1
    examples: dict[str, list] = {}
    for plan, r in zip(plans, results, strict=True):
        if r["outcome"] not in (Outcome.OK_VALID, Outcome.OK_TEXT):
            kept = examples.setdefault(r["outcome"].value, [])
            if len(kept) < 4:
                kept.append({"i": plan.index, "why": r["why"], "kinds": plan.kinds, "request": plan.brief()})
    deaths = [r for r in results if any(w in r["why"].lower() for w in DEATH_WORDS)]
    elapsed = [r["elapsed_s"] for r in results]
    return {
        "outcomes": {o.value: outcomes.get(o.value, 0) for o in Outcome},
        "http_errors": dict(http), "engine_death_errors": len(deaths),
        "by_mutation": {k: dict(v) for k, v in sorted(by_kind.items())},
        "by_request_kind": {k: dict(v) for k, v in sorted(by_choice.items())},
        "latency_s": ({f"p{q}": round(percentile(elapsed, q), 3) for q in (50, 90, 99)}
                      | {"max": round(max(elapsed), 3)}),
        "examples": examples,
    }


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"ok_valid": "#1b9e77", "ok_text": "#66a61e", "cut": "#e6ab02", "invalid": "#d95f02",
              "unparseable": "#e7298a", "http_error": "#7570b3", "sdk_error": "#a6761d", "hung": "#000000",
              "not_openai_shaped": "#666666"}
    outcomes = report["summary"]["outcomes"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.4), gridspec_kw={"width_ratios": [1, 1.6]})
    names = list(outcomes)
    bars = left.bar(range(len(names)), [outcomes[n] for n in names], color=[colors[n] for n in names])
    left.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=8)
    left.set_ylabel("responses")
    left.set_ylim(0, max(outcomes.values()) * 1.15 + 1)
    left.set_title(f"outcomes of {report['num_requests']} requests", fontsize=10)
    for bar, n in zip(bars, names, strict=True):
        left.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), str(outcomes[n]), ha="center", va="bottom",
                  fontsize=8)
    kinds = report["summary"]["by_mutation"]
    bottom = [0.0] * len(kinds)
    for name in names:
        shares = [100.0 * counts.get(name, 0) / max(sum(counts.values()), 1) for counts in kinds.values()]
        right.bar(range(len(kinds)), shares, bottom=bottom, color=colors[name], label=name)
        bottom = [b + s for b, s in zip(bottom, shares, strict=True)]
    right.set_xticks(range(len(kinds)), list(kinds), rotation=35, ha="right", fontsize=8)
    right.set_ylabel("% of the requests with a tool so mutated")
    right.set_ylim(0, 100)
    right.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    right.set_title("outcome by schema mutation", fontsize=10)
    health = report["engine"]
    fig.suptitle(f"tool soak, {report['engine_kind']} engine, {report['tool_call_format']} format, "
                 f"max_tokens {report['max_tokens'][0]}..{report['max_tokens'][1]}: engine restarts "
                 f"{health['restarts']}, registry departures {len(health['registry_events'])}, "
                 f"still serving {health['serving_at_end']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown(report: dict) -> str:
    s, e = report["summary"], report["engine"]
    lines = [f"# Tool-call soak: {report['engine_kind']} engine, {report['tool_call_format']} format", "",
             "```", report["command"], "```", "",
             f"{report['num_requests']} requests, concurrency {report['concurrency']}, max_tokens "
             f"{report['max_tokens'][0]}..{report['max_tokens'][1]}, seed {report['seed']}, in "
             f"{report['elapsed_s']:.0f} s (latency p50 {s['latency_s']['p50']} s, p99 {s['latency_s']['p99']} s, "
             f"max {s['latency_s']['max']} s).", "",
             "| outcome | responses |", "|---|---|"]
    lines += [f"| {name} | {count} |" for name, count in s["outcomes"].items()]
    lines += ["", f"HTTP errors: {s['http_errors'] or 'none'}.", "",
              f"Engine: restarts {e['restarts']}, registry departures {len(e['registry_events'])}, errors naming "
              f"an engine death {s['engine_death_errors']}, still registered and serving at the end: "
              f"{e['serving_at_end']}, probe requests after the soak failed: {len(e['probe_errors'])}; "
              f"requests budget-aware closing took over: {e.get('closing_activations', 'not counted')}.", "",
              f"![outcomes]({Path(report['png']).name})", ""]
    return "\n".join(lines)


async def run(args: argparse.Namespace, nats_url: str | None = None) -> dict:
    """The whole soak on ``nats_url`` (default: a nats-server of its own); the report."""
    workdir = Path(tempfile.mkdtemp(prefix="tool-soak-"))
    model_path = model_path_of(args, workdir)
    nats = None
    if nats_url is None:
        port = free_port()
        nats = subprocess.Popen([nats_server_binary(), "-js", "-a", "127.0.0.1", "-p", str(port), "-sd",
                                 str(workdir / "nats")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        assert wait_for_port(port, 10), "nats-server did not start"
        nats_url = f"nats://127.0.0.1:{port}"
    plans = plan_requests(args.requests, args.seed, (args.min_tokens, args.max_tokens), MODEL,
                          sizing_of(model_path, args.context))
    try:
        mesh = await start_mesh(nats_url, args.engine, model_path, args.format, args.context,
                                args.max_num_batched_tokens)
        try:
            client = openai.AsyncOpenAI(base_url=mesh.base_url, api_key=mesh.dev_key, max_retries=0,
                                        timeout=args.timeout_s + 30)
            t0 = time.monotonic()
            watch = RegistryWatch(mesh, t0)
            results = await soak(client, plans, args.concurrency, args.timeout_s, workdir / "results.jsonl")
            elapsed = time.monotonic() - t0
            probe_errors = await probe(client)
            worker = mesh.workers[0]
            registered = any(w.worker_id == worker.worker_id for w in mesh.edge.mesh.directory.live())
            engine = {"restarts": worker.restarts.restarts, "gave_up": worker.fatal.is_set(),
                      "registry_events": watch.events, "probe_errors": probe_errors,
                      "serving_at_end": bool(worker.serving and registered and not probe_errors),
                      "closing_activations": worker.engine.num_closings}
            await client.close()
        finally:
            await mesh.stop()
    finally:
        if nats is not None:
            nats.terminate()
            nats.wait(10)
    return {
        "command": "python -m loadtests.tool_soak " + " ".join(sys.argv[1:]),
        "engine_kind": args.engine, "tool_call_format": args.format,
        "model": args.model_path or "tiny random-weight Llama (infermesh.models.make_tiny_llama)",
        "num_requests": len(plans), "concurrency": args.concurrency, "seed": args.seed,
        "max_tokens": [args.min_tokens, args.max_tokens], "context": args.context,
        "max_num_batched_tokens": args.max_num_batched_tokens, "timeout_s": args.timeout_s,
        "elapsed_s": round(elapsed, 1), "requests_per_s": round(len(plans) / elapsed, 2),
        "definitions": {o.value: o.meaning for o in Outcome},
        "machine": {"python": platform.python_version(), "platform": platform.platform()},
        "engine": engine, "summary": summarize(plans, results),
        "results": [{"i": r["i"], "outcome": r["outcome"].value, "elapsed_s": round(r["elapsed_s"], 3)}
                    for r in results],
    }


def write(report: dict, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"tool_soak_{report['engine_kind']}_{report['tool_call_format']}"
    report["png"] = str(stem.with_suffix(".png"))
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    plot(report, stem.with_suffix(".png"))
    stem.with_suffix(".md").write_text(markdown(report))
    return stem


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=["sim", "vllm"], default="sim")
    parser.add_argument("--model-path", default="", help="the model (vllm) / tokenizer (sim); default: a tiny "
                                                         "random Llama made now")
    parser.add_argument("--format", choices=["hermes", "glm"], default="hermes", help="the edge's tool-call format")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-tokens", type=int, default=16, help="max_tokens is drawn from min..max")
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--context", type=int, default=2048, help="the engine's max_model_len (the tiny model's "
                                                                    "positions); prompts are sized to fit")
    parser.add_argument("--max-num-batched-tokens", type=int, default=0,
                        help="the vLLM worker's per-step token budget (0: vLLM's); at least concurrency x context "
                             "means no prefill is ever chunked (vLLM CPU dies on a chunked seeded random request)")
    parser.add_argument("--timeout-s", type=float, default=180.0, help="per request; no answer by then: hung")
    parser.add_argument("--out", default="docs/results/tool_soak")
    parser.add_argument("--show", type=int, default=None, metavar="I", help="print request I's body and exit")
    args = parser.parse_args(argv)
    assert 0 < args.min_tokens <= args.max_tokens and args.requests > 0 and args.concurrency > 0
    return args


def cli() -> None:
    args = parse_args()
    for name in ("httpx", "httpx2"):  # a line per request
        logging.getLogger(name).setLevel(logging.WARNING)
    if args.show is not None:  # one request's body, to reproduce it
        model_path = model_path_of(args, Path(tempfile.mkdtemp(prefix="tool-soak-")))
        plan = plan_requests(args.show + 1, args.seed, (args.min_tokens, args.max_tokens), MODEL,
                             sizing_of(model_path, args.context))[args.show]
        print(json.dumps(plan.body, indent=1, ensure_ascii=False))
        return
    report = asyncio.run(run(args))
    stem = write(report, Path(args.out))
    print(json.dumps(report["summary"]["outcomes"]), json.dumps(report["engine"])[:500])
    print(f"wrote {stem}.json, .png and .md")


if __name__ == "__main__":
    cli()
