"""NVIDIA Dynamo mocker's step-time polynomials as a drop-in step-time model for SimWorker.

A cross-check aid (loadtests/crosscheck.py): with this cost model our simulator and Dynamo's
engine simulator ("mocker", ``ai-dynamo-runtime`` 1.6.1) price every step alike, so what still
differs between the two comes from scheduling, caching and routing, not from the cost model.

Dynamo's default ``timing_model = {"type": "polynomial"}`` (times in ms; source: repository
``ai-dynamo/aisimulate``, ``crates/core/src/engine/common/perf_model.rs`` functions
``polynomial_prefill_time`` / ``polynomial_decode_time``, scaled in
``crates/core/src/engine/timing.rs`` and applied per pass in
``crates/core/src/engine/scheduler/vllm/core.rs`` ``execute_pass_internal``)::

    prefill_ms(N) = (4.209989e-07 * N^2 + 1.518344e-02 * N + 16.50142) / s     (0 when N == 0)
    decode_ms(A)  = max(-25.74 * p^2 + 54.01 * p + 5.74, 1.0) / (s * d),  p = min(A / C, 1)
    step_ms       = prefill_ms(N) + decode_ms(A)                            (decode: 0 without decodes)

* ``N``: new prompt tokens in the step. Dynamo computes it as
  ``n * (floor(sum isl / n) - floor(sum prefix / n))`` over the ``n`` prefill chunks of the step,
  where a chunk's ``isl`` is the tokens computed once it is done and ``prefix`` those computed
  before it (cached prefix or earlier chunks). That is the sum of the chunk sizes up to integer
  rounding; the rounding is reproduced here. Attention over the context is free.
* ``A``: the summed sequence lengths (prompt + tokens generated so far) of the requests that
  decode in the step; ``C`` = ``num_gpu_blocks * block_size`` of the worker. SimWorker passes a
  decode's ``num_computed_tokens``, which is one less than that sequence length (the newest token
  is not in the KV cache yet), so ``A = sum(context + 1)``. Checked against the 1.6.1 binary: a
  lone 1,024-token prompt's second token costs ``decode_ms(1025)``, its third ``decode_ms(1026)``.
* A request whose prompt completes in a step gets its first token at the end of that step with
  no decode cost of its own and is not counted in ``A`` (the 1.6.1 binary; SimWorker does the same:
  such a request is a prefill chunk of the step, not a decode).
* ``s`` = ``speedup_ratio``, ``d`` = ``decode_speedup_ratio`` (both 1 by default).

KV transfers and host-tier onloads cost nothing here (the mocker's aggregated workers have
neither); they are not used in the cross-check.
"""

from __future__ import annotations

from typing import Sequence

PREFILL_COEFFS = (4.209989e-07, 1.518344e-02, 16.50142)  # ms per N^2, per N, and per step
DECODE_COEFFS = (-25.74, 54.01, 5.74)  # ms per p^2, per p, and at p = 0
DECODE_FLOOR_MS = 1.0


def prefill_ms(num_new_tokens: int) -> float:
    """Dynamo's prefill time (ms, before speedup) of a step computing ``num_new_tokens`` prompt tokens."""
    if num_new_tokens <= 0:
        return 0.0
    a, b, c = PREFILL_COEFFS
    n = float(num_new_tokens)
    return a * n * n + b * n + c


def decode_ms(active_tokens: int, capacity_tokens: int) -> float:
    """Dynamo's decode time (ms, before speedup) at ``active_tokens`` of sequence over ``capacity_tokens`` of KV."""
    p = min(active_tokens / capacity_tokens, 1.0)
    a, b, c = DECODE_COEFFS
    return max(a * p * p + b * p + c, DECODE_FLOOR_MS)


def dynamo_prefill_tokens(prefills: Sequence[tuple[int, int]]) -> int:
    """``N`` as Dynamo computes it from (new tokens, context before them) chunks: integer means times count."""
    if not prefills:
        return 0
    n = len(prefills)
    isl = sum(new + context for new, context in prefills)
    prefix = sum(context for _, context in prefills)
    return n * (isl // n - prefix // n)


class DynamoPolynomialCost:
    """Step times (seconds) from Dynamo mocker's polynomials, for a worker holding ``num_kv_tokens`` of KV.

    Same interface as :class:`services.worker.engines.cost_model.CostModel` as SimWorker uses it.
    ``num_kv_tokens`` is Dynamo's ``C`` = ``num_gpu_blocks * block_size``.
    """

    __slots__ = ("capacity_tokens", "speedup_ratio", "decode_speedup_ratio")

    def __init__(self, num_kv_tokens: int, speedup_ratio: float = 1.0, decode_speedup_ratio: float = 1.0) -> None:
        assert num_kv_tokens > 0 and speedup_ratio > 0 and decode_speedup_ratio > 0
        self.capacity_tokens = num_kv_tokens
        self.speedup_ratio = speedup_ratio
        self.decode_speedup_ratio = decode_speedup_ratio

    def step_time(self, prefills: Sequence[tuple[int, int]], decode_contexts: Sequence[int]) -> float:
        """Seconds for one step: ``prefills`` as (new tokens, context before them), decodes by context length."""
        ms = prefill_ms(dynamo_prefill_tokens(prefills)) / self.speedup_ratio
        if decode_contexts:
            active = sum(decode_contexts) + len(decode_contexts)  # sequence length = context + the newest token
            ms += decode_ms(active, self.capacity_tokens) / (self.speedup_ratio * self.decode_speedup_ratio)
        return ms / 1000.0

    def transfer_time(self, num_tokens: int, block_size: int, layout: str) -> float:
        """KV pulls between workers are free (the mocker's aggregated workers never make them)."""
        return 0.0

    def onload_time(self, num_tokens: int) -> float:
        """Host-tier onloads are free (no host tier in the mocker's default config)."""
        return 0.0
