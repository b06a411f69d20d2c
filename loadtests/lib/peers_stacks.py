"""The serving stacks the peers benchmark (loadtests/peers.py) puts side by side, all on the same vLLM CPU engine:

| stack     | processes                                                   | engine flags                           |
|-----------|-------------------------------------------------------------|----------------------------------------|
| vllm      | vLLM's own OpenAI server (API server + its engine core)     | ``EngineFlags`` as ``vllm serve`` args |
| litellm   | a LiteLLM proxy (its own virtualenv) in front of ``vllm``   | the same server                        |
| infermesh | the mesh ``infermesh up --engine vllm`` runs (UpMesh)        | ``EngineFlags`` through ``up``         |

Every stack serves the model as ``bench`` on 127.0.0.1 and says what CPU its serving processes have used
(``cpu_seconds``: per process, with its children). Both engines run on core 0 alone: their compute threads bound by
vLLM (``VLLM_CPU_OMP_THREADS_BIND``, as ``up`` binds worker 0's), every other thread of theirs by ``pin_engine``
once started; the front ends (and the load generator) float. Only one engine runs at a time:
the caller stops one stack's engine before it starts the other's.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from infermesh.processes import ProcessGroup
from loadtests.lib.up_mesh import KEY, MODEL, UpMesh
from shared.ports import free_port

LITELLM_VENV = Path.home() / ".cache" / "infermesh-bench" / "litellm-venv"
LITELLM_REQUIREMENT = "litellm[proxy]"
ENGINE_CORE = 0  # the core both engines' compute threads are bound to (up's worker 0)


@dataclass(slots=True, frozen=True)
class EngineFlags:
    """What both engines are given. max_num_seqs and max_num_batched_tokens are what vLLM CPU 0.32 resolves for the
    worker's AsyncLLM (SchedulerConfig defaults) and for ``vllm serve`` (its CPU server defaults) alike; they are
    passed to ``vllm serve`` explicitly so a vLLM upgrade that moves one default shows up as a difference here."""

    max_model_len: int = 2048
    kv_cache_gib: int = 1
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    dtype: str = "auto"  # as the worker (the checkpoint's: bfloat16 for both models)
    block_size: int = 128  # vLLM CPU's default, which the worker keeps

    def engine_env(self) -> dict[str, str]:
        return {"VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib), "VLLM_CPU_OMP_THREADS_BIND": str(ENGINE_CORE),
                "HF_HUB_OFFLINE": "1"}


def edge_chat_template(model_path: Path) -> str | None:
    """The chat template the mesh's edge renders for this model when it ships none; None: the model's own."""
    from services.edge.tokenizer import ModelTokenizer

    return ModelTokenizer(str(model_path)).chat_template


def _wait_http(url: str, group: ProcessGroup, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        dead = group.dead()
        if dead:
            raise RuntimeError(f"{what}: {dead[0].name} exited with {dead[0].popen.returncode}:\n{dead[0].tail(40)}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    tails = "\n".join(f"--- {c.name}\n{c.tail(30)}" for c in group.children)
    raise RuntimeError(f"{what}: not ready in {timeout_s:.0f} s\n{tails}")


def engine_processes(groups: list[ProcessGroup]) -> list:
    """The vLLM engine's own processes among the groups' descendants (psutil.Process): vLLM names them
    ``VLLM::EngineCore`` (the scheduler) and ``VLLM::Worker`` (the model runner)."""
    import psutil

    found = []
    for child in (c for group in groups for c in group.children):
        try:
            found += [p for p in psutil.Process(child.popen.pid).children(recursive=True)
                      if p.name().startswith("VLLM::")]
        except psutil.NoSuchProcess:
            pass
    return found


def pin_engine(groups: list[ProcessGroup], core: int = ENGINE_CORE) -> int:
    """Bind every thread of the engine's processes to ``core`` (what ``taskset -a -p`` does); threads they start
    later inherit it. vLLM binds only its compute threads (VLLM_CPU_OMP_THREADS_BIND); its scheduler process
    busy-polls the model runner and would otherwise take most of the other core. Returns the threads bound."""
    import psutil

    num_threads = 0
    for process in engine_processes(groups):
        try:
            for thread in process.threads():
                os.sched_setaffinity(thread.id, {core})
                num_threads += 1
        except (psutil.NoSuchProcess, ProcessLookupError):
            pass
    if not num_threads:
        raise RuntimeError("no vLLM engine process (VLLM::*) found to pin")
    return num_threads


def engine_cpu_seconds(groups: list[ProcessGroup]) -> float:
    """User+system CPU used so far by the engine's own processes: the rest of a stack's serving CPU is its front end
    (HTTP, tokenizing, detokenizing, and for the mesh, the bus and its services)."""
    import psutil

    total = 0.0
    for process in engine_processes(groups):
        try:
            times = process.cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return total


class _Spawned:
    """Processes this benchmark starts itself (not through ``up``): their CPU is counted as UpMesh counts a mesh's."""

    group: ProcessGroup
    cpu_seconds = UpMesh.cpu_seconds  # per child of self.group, with its descendants

    @property
    def groups(self) -> list[ProcessGroup]:
        return [self.group]

    def stop(self) -> None:
        self.group.stop(timeout_s=20.0)


class VllmServer(_Spawned):
    """``python -m vllm.entrypoints.openai.api_server`` (what ``vllm serve`` runs; vllm-cpu's console script cannot
    find its distribution). Access logs and stats logging off: the peer at its leanest."""

    name = "vllm"
    api_key = KEY  # ignored: the server runs without --api-key

    def __init__(self, state: Path, model_path: Path, flags: EngineFlags, port: int = 0) -> None:
        self.group = ProcessGroup(state / "logs")
        self.port = port or free_port()
        self.argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1",
                     "--port", str(self.port), "--model", str(model_path), "--served-model-name", MODEL,
                     "--enforce-eager", "--max-model-len", str(flags.max_model_len), "--dtype", flags.dtype,
                     "--block-size", str(flags.block_size), "--max-num-seqs", str(flags.max_num_seqs),
                     "--max-num-batched-tokens", str(flags.max_num_batched_tokens), "--enable-prefix-caching",
                     "--scheduling-policy", "priority",  # as the worker's engine (all requests here: priority 0)
                     "--disable-log-stats", "--disable-uvicorn-access-log"]
        self.env = flags.engine_env()
        template = edge_chat_template(model_path)
        if template:  # a model without a template of its own (Gemma here): the one the mesh's edge applies
            (state / "chat_template.jinja").parent.mkdir(parents=True, exist_ok=True)
            (state / "chat_template.jinja").write_text(template)
            self.argv += ["--chat-template", str(state / "chat_template.jinja")]

    def start(self, timeout_s: float = 300.0) -> None:
        self.group.spawn("vllm-server", self.argv, self.env)
        _wait_http(f"http://127.0.0.1:{self.port}/v1/models", self.group, timeout_s, "vLLM's server")
        pin_engine(self.groups)


def litellm_installed() -> bool:
    return (LITELLM_VENV / ".installed").is_file()


def ensure_litellm(progress: Callable[[str], object] = print) -> Path:
    """LiteLLM's proxy in a virtualenv of its own (its pins must not touch the project's); made once."""
    binary = LITELLM_VENV / "bin" / "litellm"
    if litellm_installed():
        return binary
    progress(f"installing {LITELLM_REQUIREMENT} into {LITELLM_VENV} (once; a minute or two)")
    LITELLM_VENV.parent.mkdir(parents=True, exist_ok=True)
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--clear", str(LITELLM_VENV)], check=True)
    log = LITELLM_VENV.parent / "litellm-install.log"
    with open(log, "wb") as out:
        done = subprocess.run([str(LITELLM_VENV / "bin" / "python"), "-m", "pip", "install", "-q",
                               LITELLM_REQUIREMENT], stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise RuntimeError(f"pip install {LITELLM_REQUIREMENT} failed:\n{log.read_text(errors='replace')[-3000:]}")
    version = subprocess.run([str(LITELLM_VENV / "bin" / "python"), "-c",
                              "import importlib.metadata as m; print(m.version('litellm'))"],
                             check=True, capture_output=True, text=True).stdout.strip()
    (LITELLM_VENV / ".installed").write_text(version + "\n")
    return binary


def litellm_version() -> str:
    return (LITELLM_VENV / ".installed").read_text().strip() if litellm_installed() else ""


class LiteLlmProxy(_Spawned):
    """LiteLLM's proxy (``litellm --config``), one worker, no database, in front of a running VllmServer; its CPU
    counts the proxy's and the server's processes together."""

    name = "litellm"

    def __init__(self, state: Path, upstream: VllmServer) -> None:
        self.group = ProcessGroup(state / "logs")
        self.upstream = upstream
        self.port = free_port()
        # it refuses to start without one; with no database it checks the key against this alone
        self.api_key = f"sk-{secrets.token_hex(24)}"
        self.config = state / "litellm.yaml"
        state.mkdir(parents=True, exist_ok=True)
        # YAML is a superset of JSON: no YAML writer needed here
        self.config.write_text(json.dumps({
            "model_list": [{"model_name": MODEL, "litellm_params": {
                "model": f"hosted_vllm/{MODEL}", "api_base": f"http://127.0.0.1:{upstream.port}/v1",
                "api_key": "none"}}],
            "litellm_settings": {"telemetry": False, "drop_params": False, "set_verbose": False},
            "general_settings": {"master_key": self.api_key},
        }, indent=1))

    def start(self, timeout_s: float = 180.0) -> None:
        env = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_TELEMETRY": "False", "LITELLM_LOG": "ERROR",
               "NO_DOCS": "True"}
        self.group.spawn("litellm", [str(ensure_litellm()), "--config", str(self.config), "--host", "127.0.0.1",
                                     "--port", str(self.port), "--num_workers", "1"], env)
        _wait_http(f"http://127.0.0.1:{self.port}/health/liveliness", self.group, timeout_s, "LiteLLM's proxy")

    @property
    def groups(self) -> list[ProcessGroup]:
        return [self.group, self.upstream.group]

    def cpu_seconds(self) -> dict[str, float]:
        return {**_Spawned.cpu_seconds(self), **self.upstream.cpu_seconds()}


class InfermeshStack:
    """The mesh as ``infermesh up --engine vllm --workers 1`` runs it (admission, breaker, metering, batch, routers,
    edges; loadtests/lib/up_mesh.py), its one worker's engine given the same EngineFlags."""

    name = "infermesh"
    api_key = KEY  # the mesh's dev key

    def __init__(self, state: Path, model_path: Path, flags: EngineFlags) -> None:
        self.mesh = UpMesh(state, model_path, 0.0, 0.0, max_model_len=flags.max_model_len,
                           kv_cache_gib=float(flags.kv_cache_gib))
        # UpMesh starts the sim engine; the same mesh on vLLM differs only in these (worker-0: --cpu-core 0)
        self.mesh.options.engine = "vllm"
        self.mesh.options.ready_timeout_s = 300.0

    @property
    def port(self) -> int:
        return self.mesh.port

    def start(self) -> None:
        self.mesh.start()
        pin_engine(self.groups)

    @property
    def groups(self) -> list[ProcessGroup]:
        return [self.mesh.group]

    def cpu_seconds(self) -> dict[str, float]:
        return self.mesh.cpu_seconds()

    def stop(self) -> None:
        self.mesh.stop()

