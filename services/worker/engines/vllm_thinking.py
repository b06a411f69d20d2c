"""Thought budgets on the ``vllm`` engine: a V1 logits processor that closes a reasoning model's thought.

A request with ``SamplingParams.thinking`` carries it in ``extra_args[EXTRA_KEY]`` (``thinking_extra_args``):
the budget, the end-of-thought (and start) token ids, whether the prompt opened the thought, and for a migrated
request its earlier tokens (replayed into the budget: they are part of its prompt now). Per such request the
processor keeps a ``ThoughtBudget`` (thinking.py, the sim's too) in step with the request's output tokens and,
when it names a token, sets every other logit to -inf: greedy, random and seeded sampling all write it.

Why our own and not vLLM's ``thinking_token_budget``: vLLM's needs an engine-wide ``reasoning_config`` (one
start/end string for the whole engine, fixed at start), while the edge knows per request which model format and
whether the prompt already opened the thought; this needs nothing at engine start but the processor's name.

The processor runs after vLLM's grammar bitmask (vllm_closing.py's docstring has the order), so a forced token
must be one the grammar allows: the edge's grammars start with a free thought up to ``</think>``
(services/edge/tools/grammar.py ``with_thought``), which allows it there. The same pitfalls as the closing
processor apply and are handled the same way: the output lists handed over in ``BatchUpdate.added`` are live
references that may end in a ``-1`` placeholder under async scheduling, so the budget is synced in ``apply``
up to the first -1 (and nothing is forced while one is left); a preempted request comes back as a new ``added``
entry whose list already holds its earlier tokens, which the fresh budget replays.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch
from vllm.sampling_params import SamplingParams as VllmSampling
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from services.worker.engines.thinking import ThoughtBudget
from shared.schema import Thinking

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger("infermesh.worker.vllm.thinking")

EXTRA_KEY = "infermesh_thinking"  # SamplingParams.extra_args key carrying the request's Thinking
_FIELDS = {"budget": int, "end": list, "start": list, "open": bool, "resumed": list}


def thinking_extra_args(thinking: Thinking, resumed_token_ids: Sequence[int] = ()) -> dict[str, Any]:
    """extra_args handing ``thinking`` to the processor (``resumed_token_ids``: a migrated request's earlier
    tokens, which its budget has seen already)."""
    return {EXTRA_KEY: {"budget": thinking.budget, "end": list(thinking.end_token_ids),
                        "start": list(thinking.start_token_ids), "open": thinking.open,
                        "resumed": list(resumed_token_ids)}}


def _budget(spec: dict[str, Any]) -> ThoughtBudget:
    budget = ThoughtBudget(Thinking(spec["budget"], spec["end"], spec["start"], spec["open"]))
    for token in spec["resumed"]:
        budget.accept(token)
    return budget


@dataclass(slots=True)
class _Row:
    budget: ThoughtBudget
    output_ids: list[int]  # live reference to the request's output token ids
    num_seen: int = 0

    def sync(self) -> bool:
        """Feed the budget the tokens sampled since the last step; False while a -1 placeholder is left."""
        out = self.output_ids
        while self.num_seen < len(out):
            if out[self.num_seen] < 0:
                return False
            self.budget.accept(out[self.num_seen])
            self.num_seen += 1
        return True


class ThoughtBudgetLogitsProcessor(LogitsProcessor):
    """Write the end of a request's thought once its budget is spent."""

    @classmethod
    def validate_params(cls, sampling_params: VllmSampling) -> None:
        spec = (sampling_params.extra_args or {}).get(EXTRA_KEY)
        if spec is None:
            return
        if not isinstance(spec, dict) or any(not isinstance(spec.get(k), t) for k, t in _FIELDS.items()) \
                or not spec["end"] or spec["budget"] < 0 \
                or not all(isinstance(t, int) for t in (*spec["end"], *spec["start"], *spec["resumed"])):
            raise ValueError(f"extra_args[{EXTRA_KEY!r}] must be {{budget, end, start, open, resumed}}")

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        self._rows: dict[int, _Row] = {}

    def is_argmax_invariant(self) -> bool:
        return False  # it changes which token wins: before greedy argmax

    def _new_row(self, params: VllmSampling, _prompt: list[int] | None, output_ids: list[int]) -> _Row | None:
        """The request's row, or None. Never raises (process_dict_updates would stop half-way)."""
        spec = (params.extra_args or {}).get(EXTRA_KEY)
        if spec is None:
            return None
        try:
            return _Row(_budget(spec), output_ids)
        except Exception:  # validated before it got here: a bug, logged, the request thinks unbounded
            log.exception("thought budget: could not follow a request")
            return None

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self._rows, batch_update, self._new_row)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, row in self._rows.items():
            if not row.sync():
                continue
            forced = row.budget.forced()
            if forced is not None:
                logits[index].fill_(float("-inf"))
                logits[index, forced] = 0.0
        return logits
