"""The worker's Prometheus metrics (``--metrics-port``): the GenAI server histograms of what this engine served
(by model; the team is the edge's to know), its load (running, waiting, KV blocks), where prompt tokens came from
(computed, cached, pulled over NIXL) and its counters."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from shared.metrics import GenAiServerMetrics, service_registry

if TYPE_CHECKING:
    from services.worker.service import WorkerService


def worker_metrics(worker: "WorkerService") -> tuple[CollectorRegistry, GenAiServerMetrics]:
    def counters() -> dict[str, int]:
        figures = {"requests:finished": worker._num_finished, "requests:aborted": worker._num_aborted,
                   "engine_restarts": worker.restarts.restarts}
        prompt = worker.engine.load().prompt_tokens
        if prompt is not None:  # where prompt tokens came from: prefilled here, prefix-cache hits, pulled from a peer
            figures.update({"prompt_tokens:computed": prompt.computed, "prompt_tokens:cached": prompt.cached,
                            "prompt_tokens:transferred": prompt.transferred})
        return figures

    def gauges() -> dict[str, float | dict[str, float]]:
        load = worker.engine.load()
        return {"running": load.num_running, "waiting": load.num_waiting, "serving": float(worker.serving),
                "kv_blocks": {"used": load.num_active_blocks, "total": load.num_kv_blocks},
                "kv_usage": load.num_active_blocks / load.num_kv_blocks if load.num_kv_blocks else 0.0}

    registry = service_registry("infermesh_worker", counters, gauges)
    return registry, GenAiServerMetrics(registry, ("gen_ai_request_model",))
