"""A resumed request on the vLLM engine: the closing processor's grammar replay (vllm_closing._replay), the
extra_args it reads (validate_params), and the seeded generator's skipped draws (vllm_plugin.advance)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("vllm")

from vllm.sampling_params import SamplingParams as VllmSampling  # noqa: E402

from services.worker.engines.grammar import GrammarCache  # noqa: E402
from services.worker.engines.vllm_closing import (  # noqa: E402
    BudgetClosingLogitsProcessor,
    ReplayRejected,
    _replay,
    closing_extra_args,
    structured_outputs_params,
)
from services.worker.engines.vllm_plugin import SEED_DRAWS_KEY, advance, seed_draws  # noqa: E402
from shared.schema import Structured  # noqa: E402

SCHEMA = Structured("json_schema", json.dumps({"type": "object", "properties": {"a": {"enum": ["x", "y"]}},
                                               "required": ["a"], "additionalProperties": False}))


@pytest.fixture(scope="module")
def cache(tiny_model) -> GrammarCache:
    return GrammarCache(str(tiny_model), vocab_size=1120)  # its JSON separators: (", ", ": ")


def _ids(cache: GrammarCache, text: str) -> list[int]:
    return cache.tokenizer(text, add_special_tokens=False)["input_ids"]


def test_replayed_tokens_bring_the_decoder_to_where_the_stream_was(cache):
    decoder = cache.decoder(SCHEMA, 16)
    _replay(decoder, _ids(cache, '{"a": '))
    assert not decoder.is_terminated() and decoder.num_accepted == len(_ids(cache, '{"a": '))


@pytest.mark.parametrize("text,match", [("hello", "is not allowed by the grammar"),
                                        ('{"a": "x"}', "nothing is left to generate")])
def test_a_replay_the_grammar_refuses_is_rejected(cache, text, match):
    tokens = _ids(cache, text)
    if match.startswith("nothing"):
        tokens = [*tokens, cache.tokenizer.eos_token_id]  # the grammar ends with its stop token
    with pytest.raises(ReplayRejected, match=match):
        _replay(cache.decoder(SCHEMA, 16), tokens)


def test_a_resumed_request_takes_the_grammar_from_extra_args_only():
    resumed = VllmSampling(max_tokens=4, extra_args=closing_extra_args(SCHEMA, "r", [1, 2]))
    BudgetClosingLogitsProcessor.validate_params(resumed)
    both = VllmSampling(max_tokens=4, structured_outputs=structured_outputs_params(SCHEMA),
                        extra_args=closing_extra_args(SCHEMA, "r", [1, 2]))
    with pytest.raises(ValueError, match="takes no structured_outputs"):
        BudgetClosingLogitsProcessor.validate_params(both)
    with pytest.raises(ValueError, match="needs structured_outputs"):
        BudgetClosingLogitsProcessor.validate_params(VllmSampling(max_tokens=4, extra_args=closing_extra_args(SCHEMA)))


def test_advancing_a_generator_skips_the_draws_of_the_earlier_steps():
    def draw(generator):  # what vLLM CPU's sampler draws per step (forward_cpu)
        return torch.randint(0, 2**31, (1,), generator=generator, dtype=torch.long).item()

    undisturbed = torch.Generator().manual_seed(5)
    draws = [draw(undisturbed) for _ in range(8)]
    resumed = torch.Generator().manual_seed(5)
    advance(resumed, seed_draws(VllmSampling(seed=5, extra_args={SEED_DRAWS_KEY: 5})))
    assert [draw(resumed) for _ in range(3)] == draws[5:]
    assert seed_draws(VllmSampling(seed=5)) == 0
