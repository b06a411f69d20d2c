"""Engines behind one interface (see base.Engine): ``sim`` and ``vllm``."""

from __future__ import annotations

from services.worker.engines.base import Engine, EngineLoad, EngineOutput, EngineRequestError, EngineSpec

__all__ = ["Engine", "EngineLoad", "EngineOutput", "EngineRequestError", "EngineSpec", "create_engine"]


def create_engine(kind: str, **options: object) -> Engine:
    """Build an engine by name; vLLM is imported only when asked for (it is heavy)."""
    if kind == "sim":
        from services.worker.engines.sim import SimEngine, SimEngineConfig

        return SimEngine(SimEngineConfig(**options))  # type: ignore[arg-type]
    if kind == "vllm":
        from services.worker.engines.vllm_engine import VllmEngine, VllmEngineConfig

        return VllmEngine(VllmEngineConfig(**options))  # type: ignore[arg-type]
    raise ValueError(f"unknown engine {kind!r} (expected 'sim' or 'vllm')")
