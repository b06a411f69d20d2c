"""One real turn of each agent harness (Claude Code, Codex CLI, OpenCode) on ``infermesh up --engine vllm`` (vLLM
CPU, the tiny random model made at test time): the harness's first request, its ~20K-token system prompt and tools
included, is accepted, prefilled and streamed by a real engine, and the harness exits cleanly with the model's
answer. The answers are noise (random weights); the turn is what is checked. One mesh for the module.

The model is the tiny random Llama with two changes, both made here: its tokenizer is trained on the harnesses'
recorded requests too (tests/fixtures/agents; ~8K tokens), so their prompts take about as many tokens as in a real
model's large vocabulary (Claude Code's first request ~18K instead of ~46K in the 1,536-token vocabulary: on
vLLM CPU a 46K-token prefill took minutes), and it says 100K positions (RoPE runs past its 2,048; the weights
are random anyway)."""

from __future__ import annotations

import json

import pytest

from infermesh.models import make_tiny_llama
from tests.agents.fixtures import load_fixtures
from tests.agents.harnesses import CLAUDE, CODEX, HARNESSES, OPENCODE, Harness
from tests.agents.session import AgentMesh, AgentRun, agent_mesh, wait_billed
from tests.e2e.test_agent_harnesses import generate_requests

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.slow]
MAX_MODEL_LEN = 100_000
# answers short enough for a CPU engine: Claude Code's max_tokens, OpenCode's limit.output (opencode.json);
# Codex sends none (the edge allows up to the context; the random model's end-of-text token ends it first)
ENV = {"CLAUDE_CODE_MAX_OUTPUT_TOKENS": "64"}


@pytest.fixture(scope="module")
def mesh(nats_url, tmp_path_factory):
    pytest.importorskip("vllm")  # justified: vLLM comes with the vllm extra ./scripts/test always installs
    # justified skip: the harnesses come from npm (tests/agents/package.json), which ./scripts/test installs and
    # whose failure fails the run; only a machine without npm, where scripts/test says so, lands here
    if not any(h.installed() for h in HARNESSES.values()):
        pytest.skip("no agent harness installed in tests/agents/node_modules (./scripts/test runs npm install there)")
    root = tmp_path_factory.mktemp("agents-vllm")
    texts = [json.dumps(fixture["body"], ensure_ascii=False) for fixture in load_fixtures() if fixture["body"]]
    model = make_tiny_llama(root / "tiny-agents", extra_corpus=texts, vocab_size=8192,
                            max_position_embeddings=MAX_MODEL_LEN)
    with agent_mesh(root, model, "vllm", nats_url, max_model_len=MAX_MODEL_LEN) as agents:
        yield {"up": agents.up, "mesh": agents}


def one_turn(mesh: dict, harness: Harness, exit_codes: tuple[int, ...] = (0,)) -> AgentRun:
    # justified skip: the harnesses come from npm (tests/agents/package.json), which ./scripts/test installs and
    # whose failure fails the run; only a machine without npm, where scripts/test says so, lands here
    if not harness.installed():
        pytest.skip(f"{harness.binary} is not installed in tests/agents/node_modules (npm install there)")
    agents: AgentMesh = mesh["mesh"]
    run = agents.run(harness, timeout_s=400, env=ENV)
    process = run.process
    output = f"exit {process.returncode}\nstdout:\n{process.stdout[-3000:]}\nstderr:\n{process.stderr[-3000:]}"
    assert process.returncode in exit_codes, output
    requests = generate_requests(run)
    assert requests and all(e.status == 200 for e in requests), [(e.path, e.status, e.response[:300])
                                                                 for e in requests]
    assert all(e.content_type.startswith("text/event-stream") for e in requests)
    ids = [e.request_id for e in requests]
    assert wait_billed(agents, ids) == {rid: 1 for rid in ids}
    # the engine really answered: a request that ends with no token at all (as when vLLM fails to compile the
    # request's grammar and finishes it empty) is no turn
    produced = agents.completion_tokens(ids)
    assert any(produced.values()), (produced, [e.response[-600:] for e in requests])
    print(f"{harness.name} {harness.version} on vLLM: {len(requests)} requests, {run.seconds:.1f} s")
    return run


def test_claude_code_turn_on_vllm(mesh):
    """The random model rarely ends its answer (1 token in ~8K is the end of text) before Claude Code's 64-token
    limit: Claude Code then reports the answer as over its output maximum and exits 1. Either way the turn is
    whole: the answer reached Claude Code, which read it to its end (``stop_reason: max_tokens``)."""
    run = one_turn(mesh, CLAUDE, exit_codes=(0, 1))
    result = json.loads(run.process.stdout)
    assert result["type"] == "result" and result["num_turns"] == 1, result
    if result["is_error"]:
        assert "exceeded the 64 output token maximum" in result["result"], result
        assert b'"stop_reason":"max_tokens"' in generate_requests(run)[0].response


def test_codex_turn_on_vllm(mesh):
    one_turn(mesh, CODEX)


def test_opencode_turn_on_vllm(mesh):
    one_turn(mesh, OPENCODE)
