"""EdgeApi._engine_sampling: context-length rules and what reaches the engine."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from services.edge import errors
from services.edge.api import EdgeApi
from services.edge.config import EdgeConfig
from services.edge.protocol import Sampling

TOKENIZER = SimpleNamespace(stop_token_ids=[1, 106])


def _sampling(max_tokens: int | None, **overrides) -> Sampling:
    base = dict(max_tokens=max_tokens, temperature=0.7, top_p=0.9, seed=5, stop=[], presence_penalty=0.0,
                frequency_penalty=0.0)
    base.update(overrides)
    return Sampling(**base)


@pytest.fixture
def api() -> EdgeApi:
    return EdgeApi(EdgeConfig(), mesh=None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "num_prompt, max_tokens, max_len, expected",
    [
        (10, None, 100, 90),   # no max_tokens: the rest of the context
        (10, 90, 100, 90),     # exactly fits
        (10, 5, 100, 5),
        (99, None, 100, 1),
    ],
)
def test_max_tokens_fits_the_context(api, num_prompt, max_tokens, max_len, expected):
    params = api._engine_sampling(_sampling(max_tokens), num_prompt, max_len, TOKENIZER)
    assert params.max_tokens == expected


@pytest.mark.parametrize("num_prompt, max_tokens", [(100, None), (150, None), (10, 91), (60, 60)])
def test_over_the_context_is_context_length_exceeded(api, num_prompt, max_tokens):
    with pytest.raises(errors.ApiError) as exc:
        api._engine_sampling(_sampling(max_tokens), num_prompt, 100, TOKENIZER)
    assert (exc.value.status, exc.value.code) == (400, "context_length_exceeded")
    assert "maximum context length is 100 tokens" in exc.value.message


def test_sampling_options_and_stop_tokens_reach_the_engine(api):
    params = api._engine_sampling(_sampling(8, presence_penalty=0.5, frequency_penalty=-0.25), 4, 100, TOKENIZER)
    assert (params.temperature, params.top_p, params.seed) == (0.7, 0.9, 5)
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -0.25)
    assert params.stop_token_ids == [1, 106] and not params.ignore_eos
    ignoring = api._engine_sampling(_sampling(8, ignore_eos=True), 4, 100, TOKENIZER)
    assert ignoring.ignore_eos and ignoring.stop_token_ids == []  # the model's stop tokens (EOS among them) too
