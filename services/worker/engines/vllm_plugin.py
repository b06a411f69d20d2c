"""infermesh's vLLM general plugin: loaded by vLLM in every process it starts, before any request
(entry point ``vllm.general_plugins`` -> ``register`` in pyproject.toml; loaded again per process, so
``register`` is idempotent).

vLLM CPU 0.32: a seeded request whose prefill is chunked kills the engine. After a step in which a
request computed only part of its prompt, the model runner discards the token sampled for it and
rewinds the request's generator (``gen.set_offset(gen.get_offset() - 4)`` in
``GPUModelRunner._bookkeeping_sync``, written for CUDA's Philox generator). A CPU ``torch.Generator``
has no offset: ``RuntimeError: CPU Generator does not use offset``, the step raises, EngineCore dies,
and every request in flight with it. Any client can send such a request (a ``seed`` and a prompt
longer than what one step computes, or one admitted beside others); the tool soak found it.

The fix: on the CPU platform a request's generator becomes a ``RewindlessGenerator`` as it enters the
input batch: the same state, an offset that reads 0 and ignores being set. The discarded draw is then
not rewound, so a seeded request whose prefill was chunked draws differently from one whose prefill
was not (the same request chunked the same way still repeats token for token).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger("infermesh.worker.vllm.plugin")


class RewindlessGenerator(torch.Generator):
    """A CPU generator whose offset (a Philox notion) reads 0 and ignores being set."""

    def get_offset(self) -> int:
        return 0

    def set_offset(self, offset: int) -> RewindlessGenerator:
        return self


def rewindless(generator: torch.Generator) -> torch.Generator:
    """``generator`` as a RewindlessGenerator with its state, when it is a plain CPU one."""
    if isinstance(generator, RewindlessGenerator) or generator.device.type != "cpu":
        return generator
    copy = RewindlessGenerator(device="cpu")
    copy.set_state(generator.get_state())
    return copy


def register() -> None:
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        patch_input_batch()


def patch_input_batch() -> None:
    from vllm.v1.worker.gpu_input_batch import InputBatch

    original = InputBatch.add_request
    if getattr(original, "_infermesh_rewindless", False):
        return

    def add_request(self: Any, request: Any) -> Any:
        if request.generator is not None:
            request.generator = rewindless(request.generator)
        return original(self, request)

    add_request._infermesh_rewindless = True  # type: ignore[attr-defined]
    InputBatch.add_request = add_request  # type: ignore[method-assign]
    log.debug("vLLM CPU: per-request generators are rewindless")
