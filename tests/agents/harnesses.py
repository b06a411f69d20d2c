"""The real coding-agent harnesses, headless, against a mesh: how each is configured and run, and the scripted
tool loop each one is driven through on the sim (services/worker/engines/sim_script.py).

The task is the same for all three, in each harness's own tools: read ``notes.txt``, run the command it names,
edit the file, answer. Every turn's prompt carries a marker the previous turn produced (the task, the file's
text, the command's output, the edit call), and the sim script's rule matching latest picks the next call::

    TASK-<h>-START (the user's task)     -> read notes.txt
    NOTE-<h>-CONTENT (the file's text)   -> run: echo RESULT-<h>-$((40+2))
    RESULT-<h>-42 (the command's output) -> edit notes.txt: "status: todo" -> "status: EDITED-<h>"
    EDITED-<h> (the edit call)           -> the final answer, FINAL-<h>

RESULT-<h>-42 exists only in the command's output (the call says $((40+2))): the turn after it proves the command
ran and its output reached the model. The versions here are the ones pinned in tests/agents/package.json.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

AGENTS_DIR = Path(__file__).resolve().parent
BIN = AGENTS_DIR / "node_modules" / ".bin"
HarnessName = Literal["claude-code", "codex", "opencode"]
NOTES = "notes.txt"


@dataclass(frozen=True)
class Run:
    """One headless harness run: its command, environment and folder."""

    argv: list[str]
    env: dict[str, str]
    cwd: Path


@dataclass(frozen=True)
class Harness:
    name: HarnessName
    tag: str  # the markers' infix
    binary: str
    version: str
    read: Callable[[str], tuple[str, dict[str, Any]]]  # path -> (tool, arguments)
    run: Callable[[str], tuple[str, dict[str, Any]]]  # command -> (tool, arguments)
    edit: Callable[[str, str, str], tuple[str, dict[str, Any]]]  # path, old, new -> (tool, arguments)
    configure: Callable[[Path, Path, str, str, str], Run]  # repo, home, base_url, key, model -> Run

    @property
    def path(self) -> Path:
        return BIN / self.binary

    def installed(self) -> bool:
        return self.path.exists()

    def task(self) -> str:
        return (f"TASK-{self.tag}-START: read {NOTES}, run the command it names, then change its status line "
                f"to done and tell me what the command printed.")

    def final_answer(self) -> str:
        return f"FINAL-{self.tag}: {NOTES} now says EDITED-{self.tag}; the command printed RESULT-{self.tag}-42."


def _claude(repo: Path, home: Path, base_url: str, key: str, model: str) -> Run:
    env = {"HOME": str(home), "ANTHROPIC_BASE_URL": base_url, "ANTHROPIC_AUTH_TOKEN": key,
           "ANTHROPIC_MODEL": model, "ANTHROPIC_DEFAULT_HAIKU_MODEL": model, "ANTHROPIC_SMALL_FAST_MODEL": model,
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1"}
    # --dangerously-skip-permissions is refused as root: the three tools are allowed by name instead
    argv = [str(BIN / "claude"), "-p", CLAUDE.task(), "--output-format", "json", "--max-turns", "8",
            "--allowedTools", "Read", "Bash", "Edit"]
    return Run(argv, env, repo)


def _codex(repo: Path, home: Path, base_url: str, key: str, model: str) -> Run:
    codex_home = home / ".codex"
    codex_home.mkdir(parents=True, exist_ok=True)
    (codex_home / "config.toml").write_text(codex_config(f"{base_url}/v1", model))
    env = {"HOME": str(home), "CODEX_HOME": str(codex_home), "INFERMESH_API_KEY": key}
    argv = [str(BIN / "codex"), "exec", "--skip-git-repo-check", "--sandbox", "workspace-write", CODEX.task()]
    return Run(argv, env, repo)


def codex_config(base_url: str, model: str) -> str:
    return (f'model = "{model}"\nmodel_provider = "infermesh"\n\n[model_providers.infermesh]\nname = "infermesh"\n'
            f'base_url = "{base_url}"\nenv_key = "INFERMESH_API_KEY"\nwire_api = "responses"\n')


def _opencode(repo: Path, home: Path, base_url: str, key: str, model: str) -> Run:
    (repo / "opencode.json").write_text(json.dumps(opencode_config(f"{base_url}/v1", key, model), indent=2))
    env = {"HOME": str(home), "OPENCODE_DISABLE_AUTOUPDATE": "1"}
    argv = [str(BIN / "opencode"), "run", "-m", f"infermesh/{model}", OPENCODE.task()]
    return Run(argv, env, repo)


def opencode_config(base_url: str, key: str, model: str) -> dict[str, Any]:
    # limit.output: else OpenCode asks for 32,000 output tokens
    return {"$schema": "https://opencode.ai/config.json", "provider": {"infermesh": {
        "npm": "@ai-sdk/openai-compatible", "name": "infermesh", "options": {"baseURL": base_url, "apiKey": key},
        "models": {model: {"name": model, "limit": {"context": 65536, "output": 1024}}}}}}


CLAUDE = Harness(
    "claude-code", "cc", "claude", "2.1.197",
    read=lambda path: ("Read", {"file_path": path}),
    run=lambda command: ("Bash", {"command": command}),
    edit=lambda path, old, new: ("Edit", {"file_path": path, "old_string": old, "new_string": new}),
    configure=_claude)
CODEX = Harness(
    "codex", "cx", "codex", "0.171.0",
    read=lambda path: ("exec_command", {"cmd": f"cat {path}"}),
    run=lambda command: ("exec_command", {"cmd": command}),
    # Codex edits through its apply_patch command, which it intercepts in a shell call and applies itself
    edit=lambda path, old, new: ("exec_command", {"cmd": (
        f"apply_patch <<'EOF'\n*** Begin Patch\n*** Update File: {path}\n@@\n-{old}\n+{new}\n*** End Patch\nEOF")}),
    configure=_codex)
OPENCODE = Harness(
    "opencode", "oc", "opencode", "1.18.33",
    read=lambda path: ("read", {"filePath": path}),
    run=lambda command: ("bash", {"command": command}),
    edit=lambda path, old, new: ("edit", {"filePath": path, "oldString": old, "newString": new}),
    configure=_opencode)
HARNESSES: dict[str, Harness] = {h.name: h for h in (CLAUDE, CODEX, OPENCODE)}


def notes_text(h: Harness) -> str:
    return f"NOTE-{h.tag}-CONTENT: run `echo RESULT-{h.tag}-$((40+2))` and report what it prints.\nstatus: todo\n"


def script_rules(h: Harness, repo: Path) -> list[dict[str, Any]]:
    """The sim script's rules for harness ``h`` working in ``repo`` (see the module's docstring)."""
    notes = str(repo / NOTES)

    def call(pattern: str, tool: tuple[str, dict[str, Any]]) -> dict[str, Any]:
        return {"pattern": pattern, "tool_calls": [{"name": tool[0], "arguments": tool[1]}]}

    return [call(f"TASK-{h.tag}-START", h.read(notes)),
            call(f"NOTE-{h.tag}-CONTENT", h.run(f"echo RESULT-{h.tag}-$((40+2))")),
            call(f"RESULT-{h.tag}-42", h.edit(notes, "status: todo", f"status: EDITED-{h.tag}")),
            {"pattern": f"EDITED-{h.tag}", "text": h.final_answer()}]


def write_script(path: Path, repos: dict[str, Path]) -> Path:
    """One script for every harness (their markers differ); the harnesses' other requests (titles) get "OK"."""
    rules = [rule for name, repo in repos.items() for rule in script_rules(HARNESSES[name], repo)]
    path.write_text(json.dumps({"rules": rules, "default": "OK"}, indent=1))
    return path


def scratch_repo(folder: Path, h: Harness) -> Path:
    """A fresh git repository with the task's notes committed."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    (folder / NOTES).write_text(notes_text(h))
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com"]
    subprocess.run([*git, "init", "-q"], cwd=folder, check=True)
    subprocess.run([*git, "add", NOTES], cwd=folder, check=True)
    subprocess.run([*git, "commit", "-qm", "notes"], cwd=folder, check=True)
    return folder


def run_harness(h: Harness, repo: Path, home: Path, base_url: str, key: str, model: str,
                timeout_s: float, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``h`` headless in ``repo`` with its own HOME; its environment is PATH, what it is configured with and
    ``extra_env``."""
    home.mkdir(parents=True, exist_ok=True)
    run = h.configure(repo, home, base_url, key, model)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "TERM": "dumb", **run.env,
           **(extra_env or {})}
    return subprocess.run(run.argv, cwd=run.cwd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=timeout_s)
