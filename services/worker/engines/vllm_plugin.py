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

A resumed seeded request (migration: the earlier tokens come back as part of the prompt) draws as if it
had not been interrupted. vLLM CPU's sampler (``TopKTopPSampler.forward_cpu``, the fused Gumbel-argmax
path on x86/ARM with ``use_fp64_gumbel`` off) takes exactly one draw from a seeded request's generator
per step it samples: ``torch.randint(0, 2**31, (1,), generator=gen)``, the seed of that step's noise. So
the engine passes the number of tokens already generated in ``extra_args[SEED_DRAWS_KEY]`` and the
generator, as it becomes rewindless, makes that many draws first (``advance``): the resumed request's
first token uses the draw the undisturbed one's token N used. Exact when neither request's prefill was
chunked; each chunked-prefill step takes one more draw (the discarded one above), so a resumed request
whose prompt + earlier tokens span more than one step (``max_num_batched_tokens``, or a busy batch), or an
original whose prompt did, draws from a shifted stream: still seeded, no longer the undisturbed rest.
Other samplers (CUDA's Philox ``exponential_`` per vocab row, fp64 Gumbel, RISC-V/POWER's native path)
are not advanced: a resumed seeded request there restarts its stream from the seed.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger("infermesh.worker.vllm.plugin")

SEED_DRAWS_KEY = "infermesh_seed_draws"  # SamplingParams.extra_args: draws a resumed request's generator skips


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


def advance(generator: torch.Generator, num_draws: int) -> None:
    """Take ``num_draws`` draws as vLLM CPU's sampler takes one per step (``forward_cpu``)."""
    for _ in range(num_draws):
        torch.randint(0, 2**31, (1,), generator=generator, dtype=torch.long)


def seed_draws(sampling_params: Any) -> int:
    """How many draws a request's generator skips (0 unless the engine resumed it)."""
    extra = getattr(sampling_params, "extra_args", None) or {}
    value = extra.get(SEED_DRAWS_KEY, 0)
    return value if isinstance(value, int) and value > 0 else 0


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
        if request.generator is not None and not isinstance(request.generator, RewindlessGenerator):
            request.generator = rewindless(request.generator)  # once: a preempted request comes back with it
            if isinstance(request.generator, RewindlessGenerator):
                advance(request.generator, seed_draws(request.sampling_params))
        return original(self, request)

    add_request._infermesh_rewindless = True  # type: ignore[attr-defined]
    InputBatch.add_request = add_request  # type: ignore[method-assign]
    log.debug("vLLM CPU: per-request generators are rewindless")
