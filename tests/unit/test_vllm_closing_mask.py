"""The closing processor's bitmask -> logits step (pure torch): only the allowed tokens of one row survive."""

from __future__ import annotations

import torch

from services.worker.engines.vllm_closing import _apply_mask


def test_only_allowed_tokens_of_the_row_survive_incl_bit_31_and_a_padded_vocab():
    logits = torch.zeros(2, 70)
    mask = torch.zeros(1, 3, dtype=torch.int32)
    mask[0, 0] = (1 << 3) | -(1 << 31)  # tokens 3 and 31 (the sign bit)
    mask[0, 2] = (1 << 1) | (1 << 30)  # token 65, and 94: past this 70-token vocab
    _apply_mask(logits, 1, mask)
    assert [i for i in range(70) if logits[1, i] == 0] == [3, 31, 65]
    assert bool((logits[0] == 0).all())  # the other row is untouched
