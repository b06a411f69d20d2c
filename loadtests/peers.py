r"""infermesh against the peers a user would pick instead (issue 21, point 2): the same vLLM CPU engine behind
(a) vLLM's own OpenAI server, (b) infermesh as ``infermesh up --engine vllm`` runs it (admission, breaker,
metering, routers, edges), (c) a LiteLLM proxy (installed on first use into its own virtualenv) in front of (a).

One engine runs at a time (2 cores): each round starts vLLM's server with the proxy in front of it, measures both,
stops them, then starts the mesh and measures it (every other round the mesh first, so drift and order hit all
stacks alike). Both engines get the same flags (loadtests/lib/peers_stacks.py: max model len, max num seqs,
batched tokens, dtype, block size, KV cache; every engine thread on core 0). At each concurrency every stack
gets the same closed-loop streaming chat requests (a fixed prompt set, ``ignore_eos``, the same ``max_tokens``)
from the same lean client; measured: TTFT and ITL p50/p99, output tokens/s, CPU per request of the stack's serving
processes (psutil over their process trees; the engine's part apart). Comparisons with vLLM's own server are
taken per round (ratio or difference) and reported as their median over rounds. Any failed request fails the run
(non-zero exit, the errors printed) after the report so far is written.

    python -m loadtests.peers --models tiny,gemma --concurrency 1 16 64 --rounds 3 --requests 16 tiny=64 \
        --out docs/results/peers
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

from loadtests.lib import peers_report
from loadtests.lib.bench_cli import conclude, parse
from loadtests.lib.peers_load import UsageSseClient, closed_loop
from loadtests.lib.peers_stacks import (
    ENGINE_CORE,
    EngineFlags,
    InfermeshStack,
    LiteLlmProxy,
    VllmServer,
    engine_cpu_seconds,
    ensure_litellm,
    litellm_version,
)

STACKS = ("vllm", "litellm", "infermesh")
REQUEST_TIMEOUT_S = 600.0
NOTES = [
    "vLLM's server: python -m vllm.entrypoints.openai.api_server with the engine flags, --scheduling-policy priority "
    "(as the worker's engine), --disable-log-stats, --disable-uvicorn-access-log.",
    "LiteLLM: litellm --config (hosted_vllm/ provider at vLLM's server, a master key, no database), --num_workers 1, "
    "LITELLM_LOG=ERROR (no access log).",
    "infermesh: the engine as up runs it: KV events over ZMQ, the budget-closing logits processor registered, "
    "xgrammar structured outputs, the engine processes at nice 10.",
    "Every thread of both engines is bound to core 0 (vLLM binds only its compute threads; its scheduler process "
    "busy-polls the model runner); front ends and the load generator float over both cores.",
    "CPU per request includes the engine's, about one core whenever it has a request (it busy-polls between steps, "
    "even at one stream; idle it uses none): front_cpu_ms_per_request (outside the engine) is what a stack adds.",
]


class RequestsFailed(SystemExit):
    pass


def prepare_model(name: str, root: Path) -> Path:
    from infermesh.models import make_tiny_llama, prepare_gemma

    if name == "tiny":
        return make_tiny_llama(root / "tiny")
    if name == "gemma":
        return prepare_gemma(progress=lambda m: print(f"gemma: {m}", file=sys.stderr, flush=True))
    raise SystemExit(f"unknown model {name!r}: tiny or gemma")


async def measure(stack, concurrency: int, per_stream: int, max_tokens: int) -> dict:
    """One phase on one stack: the load's figures and CPU per request of its processes (the engine's part apart)."""
    client = UsageSseClient("127.0.0.1", stack.port, "/v1/chat/completions", stack.api_key)
    before, engine_before = stack.cpu_seconds(), engine_cpu_seconds(stack.groups)
    load = await closed_loop(client, concurrency, per_stream, max_tokens, REQUEST_TIMEOUT_S)
    after, engine_after = stack.cpu_seconds(), engine_cpu_seconds(stack.groups)
    client.close()
    if load.failures:
        raise RequestsFailed(f"{stack.name}: {len(load.failures)} of {concurrency * per_stream} requests failed at "
                             f"{concurrency} streams:\n  " + "\n  ".join(load.failures[:10]))
    n = max(1, len(load.ttfts))
    cpu = {name: (after[name] - before.get(name, 0.0)) * 1000 / n for name in after}
    return {**load.figures(), "cpu_ms_per_request": cpu, "cpu_ms_per_request_total": sum(cpu.values()),
            "engine_cpu_ms_per_request": (engine_after - engine_before) * 1000 / n}


def streams_share(args: argparse.Namespace, model: str, concurrency: int) -> int:
    """Requests each stream sends in a phase: the model's request count shared out, at least 3."""
    return max(3, args.requests.get(model, args.requests["*"]) // concurrency)


def requests_option(values: list[str]) -> dict[str, int]:
    """``16`` (every model) and/or ``MODEL=N`` pairs -> {model or "*": requests}."""
    out = {"*": 16}
    for value in values:
        model, _, count = value.rpartition("=")
        if not count.isdigit() or int(count) < 1:
            raise SystemExit(f"--requests wants N or MODEL=N (N >= 1), not {value!r}")
        out[model or "*"] = int(count)
    return out


def _say(message: str) -> None:
    print(f"[peers {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


async def _start(stacks: list, timings: list[dict], model: str) -> None:
    for stack in stacks:
        began = time.monotonic()
        await asyncio.to_thread(stack.start)
        timings.append({"model": model, "stack": stack.name, "start_s": round(time.monotonic() - began, 1)})
        _say(f"{model}: {stack.name} ready in {timings[-1]['start_s']} s")


async def run_side(stacks: list, args: argparse.Namespace, model: str, rnd: int, phases: dict, timings: list) -> None:
    """Start the stacks (one engine among them), warm each up, measure each at every concurrency, stop them."""
    try:
        await _start(stacks, timings, model)
        for stack in stacks:  # the first requests of a process are slow (imports, allocations): not measured
            await measure(stack, min(4, max(args.concurrency)), 2, args.max_tokens)
        for concurrency in args.concurrency:
            per_stream = streams_share(args, model, concurrency)
            for stack in (stacks if rnd % 2 == 0 else stacks[::-1]):
                began = time.monotonic()
                phase = await measure(stack, concurrency, per_stream, args.max_tokens)
                phase["phase_s"] = round(time.monotonic() - began, 1)
                phases.setdefault(concurrency, [{} for _ in range(args.rounds)])[rnd][stack.name] = phase
                _say(f"{model} round {rnd + 1} {stack.name} @{concurrency}: TTFT p50 {phase['ttft']['p50_ms']:.1f} "
                     f"ms, ITL p50 {phase['itl']['p50_ms']:.1f} ms, {phase['output_tok_s']:.0f} tok/s, "
                     f"{phase['cpu_ms_per_request_total']:.0f} ms CPU/request ({phase['phase_s']} s)")
    finally:
        for stack in reversed(stacks):
            await asyncio.to_thread(stack.stop)


def sides(args: argparse.Namespace, state: Path, model_path: Path, flags: EngineFlags) -> list[list]:
    """The round's two engines' stacks: vLLM's server (and the proxy in front of it), then the mesh."""
    server = VllmServer(state / "vllm", model_path, flags)
    front = [LiteLlmProxy(state / "litellm", server)] if "litellm" in args.stacks else []
    mesh = [InfermeshStack(state / "infermesh", model_path, flags)] if "infermesh" in args.stacks else []
    return [s for s in ([server, *front], mesh) if s]


async def run_model(model: str, args: argparse.Namespace, root: Path, report: dict) -> None:
    model_path = prepare_model(model, root)
    flags = EngineFlags(max_model_len=args.max_model_len)
    phases: dict[int, list[dict]] = {}
    report["models"][model] = {"model_path": str(model_path)}
    results = report["results"][model] = []
    try:
        for rnd in range(args.rounds):
            ordered = sides(args, root / f"{model}-r{rnd}", model_path, flags)
            for stacks in (ordered if rnd % 2 == 0 else ordered[::-1]):
                await run_side(stacks, args, model, rnd, phases, report["start_timings"])
    finally:  # what was measured so far goes in the report, also when a request failed
        for concurrency in args.concurrency:
            rounds = [r for r in phases.get(concurrency, []) if len(r) == len(args.stacks)]
            if rounds:
                per_stream = streams_share(args, model, concurrency)
                results.append(peers_report.summary(concurrency, concurrency * per_stream, rounds))


async def run(args: argparse.Namespace) -> dict:
    if "litellm" in args.stacks:
        ensure_litellm(_say)
    root = Path(tempfile.mkdtemp(prefix="infermesh-peers-"))
    flags = EngineFlags(max_model_len=args.max_model_len)
    report: dict = {
        "command": "python -m loadtests.peers " + " ".join(args.argv),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "stacks": args.stacks, "litellm_version": litellm_version() if "litellm" in args.stacks else None,
        "engine_flags": {**{k: getattr(flags, k) for k in flags.__slots__}, "enforce_eager": True,
                         "enable_prefix_caching": True, "engine_pinned_to_core": ENGINE_CORE},
        "notes": NOTES,
        "max_tokens": args.max_tokens, "rounds": args.rounds, "concurrency": args.concurrency,
        "requests": args.requests,
        "models": {}, "start_timings": [], "failed": None, "results": {},
    }
    began = time.monotonic()
    try:
        for model in args.models:
            await run_model(model, args, root, report)
    except RequestsFailed as failed:
        report["failed"] = str(failed)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        report["wall_s"] = round(time.monotonic() - began, 1)
        report["goals"] = peers_report.goals(report["results"])
    return report


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,gemma", help="comma-separated: tiny (made at run time), gemma")
    parser.add_argument("--stacks", default=",".join(STACKS), help="comma-separated, among vllm,litellm,infermesh "
                        "(vllm is always measured: the others are compared with it)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", nargs="+", default=["16", "tiny=64"], metavar="[MODEL=]N",
                        help="requests per stack, round and concurrency (at least 3 per stream): N for every model, "
                             "MODEL=N for one (a fast model needs more for phases of a few seconds)")
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens of every request (ignore_eos)")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--out", default="", help="a folder for peers.json, peers.md and peers.png")
    args = parse(parser, argv)
    args.models = [m for m in args.models.split(",") if m]
    args.requests = requests_option(args.requests)
    args.stacks = [s for s in STACKS if s in {*args.stacks.split(","), "vllm"}]
    report = conclude(asyncio.run(run(args)), args.out, peers_report.write)
    if report["failed"]:
        print(report["failed"], file=sys.stderr)
        raise SystemExit(1)
    return report


if __name__ == "__main__":
    main()
