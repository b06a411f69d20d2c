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
    load_publish_s: float = 0.5
    # engine options
    block_size: int = 0  # 0: the engine default (sim 16, vLLM CPU 128)
    num_kv_blocks: int = 8192
    max_model_len: int = 8192
    sim_ttft_ms: float = 20.0
    sim_itl_ms: float = 10.0
    sim_prefill_us_per_token: float = 0.0
    kv_cache_gib: float = 1.0
    kv_cache_dtype: str = "auto"
    cpu_core: int = -1  # pin the vLLM engine's threads to this core (-1: leave as is)

    def __post_init__(self) -> None:
        assert self.role in ("both", "prefill", "decode"), f"role must be both|prefill|decode, not {self.role!r}"
        assert self.engine in ("sim", "vllm"), f"engine must be sim|vllm, not {self.engine!r}"
        assert self.heartbeat_ttl_s > self.heartbeat_s > 0, "heartbeat_ttl_s must exceed heartbeat_s"

    def engine_options(self) -> dict[str, object]:
        if self.engine == "sim":
            return dict(
                model=self.model, tokenizer=self.model_path, block_size=self.block_size or 16,
                num_kv_blocks=self.num_kv_blocks, max_model_len=self.max_model_len,
                ttft_ms=self.sim_ttft_ms, itl_ms=self.sim_itl_ms,
                prefill_us_per_token=self.sim_prefill_us_per_token,
            )
        return dict(
            model=self.model, model_path=self.model_path, block_size=self.block_size,
            max_model_len=self.max_model_len, kv_cache_gib=self.kv_cache_gib,
            kv_cache_dtype=self.kv_cache_dtype, cpu_core=self.cpu_core,
        )
