"""Worker configuration (env INFERMESH_*, flags --*)."""

from __future__ import annotations

from dataclasses import dataclass

from shared.config import BusConfig


@dataclass(slots=True)
class WorkerConfig(BusConfig):
    """A worker: one engine in one role on the bus."""

    worker_id: str = ""
    role: str = "both"
    engine: str = "sim"
    model: str = "sim-model"
    model_path: str = ""  # weights folder (vllm) / tokenizer folder (sim)
    heartbeat_s: float = 1.0
    heartbeat_ttl_s: float = 3.0
    # the event loop blocked this long means hung, not busy: heartbeats stop (shared/liveness.py)
    max_loop_stall_s: float = 60.0
    # orphans (services/worker/orphans.py): a request's edge that left the edges bucket, or was never in it this
    # long after its request came, is pinged; no answer within edge_probe_timeout_s -> its requests are aborted
    unseen_edge_grace_s: float = 10.0
    edge_probe_timeout_s: float = 2.0
    load_publish_s: float = 0.5
    load_min_interval_s: float = 0.005  # load changes closer than this are published together
    # engine options
    block_size: int = 0  # 0: the engine default (sim 16, vLLM CPU 128)
    num_kv_blocks: int = 0  # sim: 0 = the profile's budget (fixed timings: 8192)
    max_model_len: int = 8192
    sim_ttft_ms: float = 20.0  # fixed timings, when no sim_profile is set
    sim_itl_ms: float = 10.0
    sim_prefill_us_per_token: float = 0.0
    sim_profile: str = ""  # a step-time profile (services/worker/engines/profiles/<name>.toml)
    sim_clock_factor: float = 1.0  # simulated seconds per real second
    sim_stream_interval: int = 1  # tokens per streamed message (coalescing)
    sim_kv_layout: str = "BLHNC"
    sim_host_kv_blocks: int = 0
    sim_fail_rate: float = 0.0  # fault injection: this share of requests fail before their first token
    sim_script: str = ""  # a JSON file of scripted answers (engines/sim_script.py): the prompt picks the answer
    max_num_batched_tokens: int = 0  # per-step prompt-token budget (0: engine/profile default)
    max_num_seqs: int = 0
    num_engines: int = 1  # sim only: engines (workers <worker_id>-<i>) sharing this process
    kv_cache_gib: float = 1.0
    kv_cache_dtype: str = "auto"
    cpu_core: int = -1  # pin the vLLM engine's threads to this core (-1: leave as is)
    kv_connector: str = ""  # vllm: "nixl" to hand KV to / take KV from other workers (prefill/decode roles)
    nixl_port: int = 0  # vllm: the NIXL side channel's port (0: a free one)
    engine_nice: int = 10  # vllm: nice value of the engine core processes (the control plane runs first)
    # vllm on GPUs (deploy/k8s/overlays/gpu-fleet); the defaults are what a CPU engine runs
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    gpu_memory_utilization: float = 0.0  # 0: vLLM's default
    enforce_eager: bool = True  # False: capture CUDA graphs
    kv_buffer_device: str = "cpu"  # vllm + nixl: where KV is read and written ("cuda" on GPUs)
    nixl_host: str = "127.0.0.1"  # vllm + nixl: the address peers reach this engine's NIXL side channel on

    def __post_init__(self) -> None:
        assert self.role in ("both", "prefill", "decode"), f"role must be both|prefill|decode, not {self.role!r}"
        assert self.engine in ("sim", "vllm"), f"engine must be sim|vllm, not {self.engine!r}"
        assert self.heartbeat_ttl_s > self.heartbeat_s > 0, "heartbeat_ttl_s must exceed heartbeat_s"
        assert self.max_loop_stall_s > 0, "max_loop_stall_s must be positive"
        assert self.unseen_edge_grace_s > 0 and self.edge_probe_timeout_s > 0
        assert self.num_engines >= 1 and (self.num_engines == 1 or self.engine == "sim"), \
            "num_engines > 1 is for the sim engine only"
        assert self.kv_connector in ("", "nixl"), f"kv_connector must be nixl or empty, not {self.kv_connector!r}"
        assert self.engine != "vllm" or self.role == "both" or self.kv_connector == "nixl", \
            f"a vllm worker in role {self.role} exchanges KV with its peers: it needs --kv-connector nixl"

    def engine_options(self) -> dict[str, object]:
        if self.engine == "sim":
            return dict(
                model=self.model, tokenizer=self.model_path, worker_id=self.worker_id, role=self.role,
                profile=self.sim_profile, clock_factor=self.sim_clock_factor,
                stream_interval=self.sim_stream_interval, kv_layout=self.sim_kv_layout,
                kv_dtype=self.kv_cache_dtype if self.kv_cache_dtype != "auto" else "fp8",
                # with a profile, 0 means: as the profile says
                block_size=self.block_size, num_kv_blocks=self.num_kv_blocks,
                host_kv_blocks=self.sim_host_kv_blocks, max_num_batched_tokens=self.max_num_batched_tokens,
                max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len,
                ttft_ms=self.sim_ttft_ms, itl_ms=self.sim_itl_ms,
                prefill_us_per_token=self.sim_prefill_us_per_token, fail_rate=self.sim_fail_rate,
                script=self.sim_script,
            )
        return dict(
            model=self.model, model_path=self.model_path, block_size=self.block_size,
            max_model_len=self.max_model_len, kv_cache_gib=self.kv_cache_gib,
            kv_cache_dtype=self.kv_cache_dtype, cpu_core=self.cpu_core, worker_id=self.worker_id,
            kv_connector=self.kv_connector, nixl_port=self.nixl_port,
            max_num_batched_tokens=self.max_num_batched_tokens, engine_nice=self.engine_nice,
            tensor_parallel_size=self.tensor_parallel_size, data_parallel_size=self.data_parallel_size,
            enable_expert_parallel=self.enable_expert_parallel, gpu_memory_utilization=self.gpu_memory_utilization,
            enforce_eager=self.enforce_eager, kv_buffer_device=self.kv_buffer_device, nixl_host=self.nixl_host,
        )
