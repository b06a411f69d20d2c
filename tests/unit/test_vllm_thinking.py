"""The vLLM thought-budget processor's request handling (engines/vllm_thinking.py), without an engine."""

from __future__ import annotations

import pytest
import torch

from services.worker.engines import vllm_thinking
from shared.schema import Thinking


def _params(extra: dict):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=8, extra_args=extra)


def test_extra_args_round_trip_and_bad_ones_are_refused() -> None:
    extra = vllm_thinking.thinking_extra_args(Thinking(2, [99], [98], True), [5])
    vllm_thinking.ThoughtBudgetLogitsProcessor.validate_params(_params(extra))
    for bad in ({"budget": -1}, {"end": []}, {"open": "yes"}, {"resumed": ["x"]}):
        spec = {**extra[vllm_thinking.EXTRA_KEY], **bad}
        with pytest.raises(ValueError):
            vllm_thinking.ThoughtBudgetLogitsProcessor.validate_params(_params({vllm_thinking.EXTRA_KEY: spec}))


def test_a_row_forces_the_end_once_its_tokens_are_known() -> None:
    """A resumed request's earlier tokens count; a -1 placeholder (async scheduling) forces nothing yet."""
    processor = vllm_thinking.ThoughtBudgetLogitsProcessor.__new__(vllm_thinking.ThoughtBudgetLogitsProcessor)
    output: list[int] = []
    extra = vllm_thinking.thinking_extra_args(Thinking(2, [9], open=True), [1])
    processor._rows = {0: processor._new_row(_params(extra), None, output)}
    logits = torch.zeros(1, 12)
    assert torch.equal(processor.apply(logits.clone()), logits)  # 1 of 2 spent: free
    output.append(-1)
    assert torch.equal(processor.apply(logits.clone()), logits)  # the second not known yet
    output[-1] = 3
    forced = processor.apply(logits.clone())
    assert forced[0, 9] == 0 and torch.isinf(forced[0, :9]).all() and torch.isinf(forced[0, 10:]).all()
    output.append(9)
    assert torch.equal(processor.apply(logits.clone()), logits)  # closed: free again
