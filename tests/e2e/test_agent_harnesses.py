"""The real coding agents (Claude Code, Codex CLI, OpenCode; pinned in tests/agents/package.json) headless against
``infermesh up --engine sim``: each runs a multi-turn tool task (read a file, run a command, edit the file, answer)
in a scratch git repository with a HOME of its own. The harnesses' requests are real; the model's choices come
from a sim script (tests/agents/harnesses.py), so the tool loop runs the same way every time.

One mesh for the module, the three harnesses one after the other through a recording proxy."""

from __future__ import annotations

import json

import pytest

from tests.agents.harnesses import CLAUDE, CODEX, HARNESSES, NOTES, OPENCODE, Harness
from tests.agents.session import AgentMesh, AgentRun, agent_mesh, wait_billed

# pytest's own limit above the harness's (150 s) plus the mesh's start (90 s) that the first test pays
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]
GENERATE_PATHS = ("/v1/messages", "/v1/chat/completions", "/v1/responses")
# the header each harness names its run with (services/edge/sessions.py): the ledger's trajectory must be it
SESSION_HEADER = {CLAUDE.name: "x-claude-code-session-id", CODEX.name: "session-id", OPENCODE.name: "x-session-id"}


@pytest.fixture(scope="module")
def mesh(nats_url, tiny_model, tmp_path_factory):
    # justified skip: the harnesses come from npm (tests/agents/package.json), which ./scripts/test installs and
    # whose failure fails the run; only a machine without npm, where scripts/test says so, lands here
    if not any(h.installed() for h in HARNESSES.values()):
        pytest.skip("no agent harness installed in tests/agents/node_modules (./scripts/test runs npm install there)")
    with agent_mesh(tmp_path_factory.mktemp("agents"), tiny_model, "sim", nats_url) as mesh:
        yield {"up": mesh.up, "mesh": mesh}


def run_harness(mesh: dict, harness: Harness) -> tuple[AgentMesh, AgentRun]:
    # justified skip: the harnesses come from npm (tests/agents/package.json), which ./scripts/test installs and
    # whose failure fails the run; only a machine without npm, where scripts/test says so, lands here
    if not harness.installed():
        pytest.skip(f"{harness.binary} is not installed in tests/agents/node_modules (npm install there)")
    agents: AgentMesh = mesh["mesh"]
    return agents, agents.run(harness, timeout_s=150)


def generate_requests(run: AgentRun) -> list:
    return [e for e in run.exchanges if e.method == "POST" and e.path.split("?")[0] in GENERATE_PATHS]


def check_tool_loop(agents: AgentMesh, run: AgentRun) -> None:
    h = run.harness
    process = run.process
    output = f"exit {process.returncode}\nstdout:\n{process.stdout[-3000:]}\nstderr:\n{process.stderr[-3000:]}"
    assert run.process.returncode == 0, output
    assert h.final_answer() in run.process.stdout, output
    # the edit happened, in the file, through the harness's own tool
    assert (run.repo / NOTES).read_text().splitlines()[-1] == f"status: EDITED-{h.tag}", output
    requests = generate_requests(run)
    assert all(e.status == 200 for e in requests), [(e.path, e.status, e.response[:300]) for e in requests]
    # the command ran: its output (never written in the call, which says $((40+2))) reached the model
    saw_output = [i for i, e in enumerate(requests) if f"RESULT-{h.tag}-42".encode() in e.body]
    assert saw_output, "the command's output never reached a request"
    assert any(b"EDITED-" + h.tag.encode() in e.body for e in requests[saw_output[0]:]), "no turn after the edit"
    assert len(requests) >= 4, [e.path for e in requests]  # task, file, output, edit result: four model turns
    # the ledger billed each request once, all under the harness's one trajectory
    ids = [e.request_id for e in requests]
    assert all(ids) and len(set(ids)) == len(ids)
    billed = wait_billed(agents, ids)
    assert billed == {rid: 1 for rid in ids}, billed
    assert all(agents.completion_tokens(ids).values()), agents.completion_tokens(ids)
    sent = {e.headers.get(SESSION_HEADER[h.name]) for e in requests}
    assert len(sent) == 1 and None not in sent and "" not in sent, sent
    assert agents.trajectories(ids) == sent
    print(f"{h.name} {h.version}: {len(requests)} requests, {run.seconds:.1f} s")


def test_claude_code_reads_runs_edits_and_answers(mesh):
    agents, run = run_harness(mesh, CLAUDE)
    check_tool_loop(agents, run)
    result = json.loads(run.process.stdout)
    assert result["subtype"] == "success" and not result["is_error"] and result["num_turns"] >= 4, result
    first = generate_requests(run)[0]
    assert first.path.startswith("/v1/messages") and first.content_type.startswith("text/event-stream")


def test_codex_reads_runs_edits_and_answers(mesh):
    agents, run = run_harness(mesh, CODEX)
    check_tool_loop(agents, run)
    assert "apply patch" in run.process.stderr or "apply_patch" in run.process.stderr, run.process.stderr[-2000:]
    assert all(e.path == "/v1/responses" for e in generate_requests(run))


def test_opencode_reads_runs_edits_and_answers(mesh):
    agents, run = run_harness(mesh, OPENCODE)
    check_tool_loop(agents, run)
    assert all(e.path == "/v1/chat/completions" for e in generate_requests(run))
