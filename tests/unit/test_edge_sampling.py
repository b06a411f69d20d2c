"""engine_sampling (the edge's request preparation): context-length rules and what reaches the engine."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from services.edge.prep import engine_sampling
from services.edge.protocol import Sampling
from shared import errors

TOKENIZER = SimpleNamespace(stop_token_ids=[1, 106])


def _sampling(max_tokens: int | None, **overrides) -> Sampling:
    base = dict(max_tokens=max_tokens, temperature=0.7, top_p=0.9, seed=5, stop=[], presence_penalty=0.0,
                frequency_penalty=0.0)
    base.update(overrides)
    return Sampling(**base)


@pytest.mark.parametrize(
    "num_prompt, max_tokens, max_len, expected",
    [
        (10, None, 100, 90),   # no max_tokens: the rest of the context
        (10, 90, 100, 90),     # exactly fits
        (10, 5, 100, 5),
        (99, None, 100, 1),
    ],
)
def test_max_tokens_fits_the_context(num_prompt, max_tokens, max_len, expected):
    params = engine_sampling(_sampling(max_tokens), num_prompt, max_len, TOKENIZER.stop_token_ids)
    assert params.max_tokens == expected


@pytest.mark.parametrize("num_prompt, max_tokens", [(100, None), (150, None), (10, 91), (60, 60)])
def test_over_the_context_is_context_length_exceeded(num_prompt, max_tokens):
    with pytest.raises(errors.ApiError) as exc:
        engine_sampling(_sampling(max_tokens), num_prompt, 100, TOKENIZER.stop_token_ids)
    assert (exc.value.status, exc.value.code) == (400, "context_length_exceeded")
    assert "maximum context length is 100 tokens" in exc.value.message


def test_sampling_options_and_stop_tokens_reach_the_engine():
    params = engine_sampling(_sampling(8, presence_penalty=0.5, frequency_penalty=-0.25), 4, 100,
                             TOKENIZER.stop_token_ids)
    assert (params.temperature, params.top_p, params.seed) == (0.7, 0.9, 5)
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -0.25)
    assert params.stop_token_ids == [1, 106] and not params.ignore_eos
    ignoring = engine_sampling(_sampling(8, ignore_eos=True), 4, 100, TOKENIZER.stop_token_ids)
    assert ignoring.ignore_eos and ignoring.stop_token_ids == []  # the model's stop tokens (EOS among them) too
