"""A mesh for the agent harnesses: ``infermesh up`` (sim with the scripted tool loop, or vLLM CPU) as users run it,
a recording proxy in front of its edge, and one headless run of a harness in a scratch repository of its own.

Shared by tests/e2e/test_agent_harnesses*.py and ``python -m tests.agents.record``."""

from __future__ import annotations

import shutil
import sqlite3
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from subprocess import CompletedProcess
from typing import Iterator, Literal

from shared.ports import free_port
from tests.agents.harnesses import HARNESSES, Harness, run_harness, scratch_repo, write_script
from tests.agents.proxy import Exchange, RecordingProxy
from tests.e2e.mesh_process import UpProcess

MODEL = "tiny"
# Claude Code's first request is ~46K tokens of the tiny model's small vocabulary (its system prompt and 24 tools);
# the context must also stay under the sim's KV pool (8,192 blocks of 16), since Codex asks for no max_output_tokens
# (its turns may then take the whole context)
SIM_MAX_MODEL_LEN = 100_000


@dataclass
class AgentRun:
    harness: Harness
    repo: Path
    home: Path
    process: CompletedProcess[str]
    exchanges: list[Exchange]  # what the harness sent, in order, with the edge's answers
    seconds: float


@dataclass
class AgentMesh:
    up: UpProcess
    proxy: RecordingProxy
    root: Path  # scratch repositories and homes: <root>/<harness>/{repo,home}
    ledger: Path

    def run(self, harness: Harness, timeout_s: float = 300, env: dict[str, str] | None = None) -> AgentRun:
        """Run ``harness`` headless through the proxy in a fresh repository (the one the sim script names), with
        ``env`` over its own environment."""
        repo = scratch_repo(self.root / harness.name / "repo", harness)
        home = self.root / harness.name / "home"
        shutil.rmtree(home, ignore_errors=True)
        first = len(self.proxy.exchanges)
        started = time.monotonic()
        process = run_harness(harness, repo, home, self.proxy.url, self.up.key, MODEL, timeout_s, env)
        return AgentRun(harness, repo, home, process, self.proxy.exchanges[first:], time.monotonic() - started)

    def billed(self, request_ids: list[str]) -> dict[str, int]:
        """How many ledger rows each of ``request_ids`` has (ids with none left out)."""
        with sqlite3.connect(self.ledger) as db:
            marks = ",".join("?" * len(request_ids))
            return dict(db.execute(f"SELECT request_id, COUNT(*) FROM usage WHERE request_id IN ({marks}) "
                                   "GROUP BY request_id", request_ids).fetchall())

    def completion_tokens(self, request_ids: list[str]) -> dict[str, int]:
        """The output tokens the ledger billed each request (the engine's own count)."""
        with sqlite3.connect(self.ledger) as db:
            marks = ",".join("?" * len(request_ids))
            return dict(db.execute(f"SELECT request_id, SUM(completion_tokens) FROM usage WHERE request_id IN "
                                   f"({marks}) GROUP BY request_id", request_ids).fetchall())

    def trajectories(self, request_ids: list[str]) -> set[str | None]:
        with sqlite3.connect(self.ledger) as db:
            marks = ",".join("?" * len(request_ids))
            return {row[0] for row in db.execute(f"SELECT trajectory FROM usage WHERE request_id IN ({marks})",
                                                 request_ids)}


@contextmanager
def agent_mesh(root: Path, model_path: Path, engine: Literal["sim", "vllm"], nats_url: str = "",
               max_model_len: int = SIM_MAX_MODEL_LEN) -> Iterator[AgentMesh]:
    """``infermesh up --engine <engine>`` with its own ports, ledger (SQLite) and, on the sim, the script that
    drives every harness's tool loop; a recording proxy in front. Checks the mesh stops cleanly."""
    root.mkdir(parents=True, exist_ok=True)
    ledger = root / "ledger.db"
    port = free_port()
    argv = ["--engine", engine, "--model", MODEL, "--model-path", str(model_path), "--http-port", str(port),
            "--billing-port", str(free_port()), "--metrics-port-base", "0", "--max-model-len", str(max_model_len),
            "--namespace", f"a{uuid.uuid4().hex[:8]}", "--state-dir", str(root / "state"),
            "--database-url", f"sqlite+aiosqlite:///{ledger}"]
    if nats_url:
        argv += ["--nats-url", nats_url]
    if engine == "sim":
        script = write_script(root / "script.json", {name: root / name / "repo" for name in HARNESSES})
        argv += ["--sim-script", str(script), "--sim-ttft-ms", "5", "--sim-itl-ms", "1"]
    up = UpProcess(argv)
    up.start(timeout_s=300 if engine == "vllm" else 90)
    proxy = RecordingProxy(f"http://127.0.0.1:{port}").start()
    try:
        yield AgentMesh(up, proxy, root, ledger)
    finally:
        proxy.stop()
        assert up.stop() == 0


def wait_billed(mesh: AgentMesh, request_ids: list[str], timeout_s: float = 30) -> dict[str, int]:
    """The ledger rows per request once every one of ``request_ids`` has some (metering writes them async)."""
    deadline = time.monotonic() + timeout_s
    while True:
        billed = mesh.billed(request_ids)
        if len(billed) == len(set(request_ids)) or time.monotonic() > deadline:
            return billed
        time.sleep(0.2)
