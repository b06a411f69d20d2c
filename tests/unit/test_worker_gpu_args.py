"""A GPU worker's flags reach vLLM's engine arguments (deploy/k8s/overlays/gpu-fleet runs them; this CPU build
cannot start such an engine, so the mapping is what is checked), and a CPU worker's defaults add none."""

from __future__ import annotations

from services.worker.config import WorkerConfig
from services.worker.engines.vllm_engine import VllmEngineConfig, gpu_args
from shared.config import load_config


def _engine(argv: list[str]) -> VllmEngineConfig:
    config = load_config(WorkerConfig, argv=["--engine", "vllm", "--model", "glm", "--model-path", "/m", *argv],
                         env={})
    return VllmEngineConfig(**config.engine_options())


def test_the_gpu_fleets_flags_become_vllms_arguments():
    engine = _engine(["--role", "decode", "--kv-connector", "nixl", "--data-parallel-size", "4",
                      "--enable-expert-parallel", "--gpu-memory-utilization", "0.9", "--no-enforce-eager",
                      "--kv-buffer-device", "cuda", "--nixl-host", "10.0.0.7", "--kv-cache-dtype", "fp8"])
    assert gpu_args(engine) == {"data_parallel_size": 4, "enable_expert_parallel": True,
                                "gpu_memory_utilization": 0.9}
    assert (engine.enforce_eager, engine.kv_buffer_device, engine.nixl_host) == (False, "cuda", "10.0.0.7")
    assert engine.kv_cache_dtype == "fp8"
    assert gpu_args(_engine(["--tensor-parallel-size", "8"])) == {"tensor_parallel_size": 8}


def test_a_cpu_worker_asks_for_nothing_more():
    engine = _engine([])
    assert gpu_args(engine) == {} and engine.enforce_eager and engine.kv_buffer_device == "cpu"
