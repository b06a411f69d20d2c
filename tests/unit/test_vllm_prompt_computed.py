"""The prompt tokens a vLLM worker reports computed (services/worker/engines/vllm_engine.py, issue 38 point 7): a
request aborted before vLLM sent anything of it (its prefill had not completed) computed none of its prompt."""

import pytest

from services.worker.engines.vllm_engine import prompt_computed


@pytest.mark.parametrize(("num_output", "reason", "computed"), [
    (0, "abort", 0),  # aborted in the queue, or mid-prefill: vLLM's frontend saw no output of it
    (1, "abort", 100),  # its first token came: the prompt was computed
    (7, "stop", 100), (3, "length", 100),
    (0, "stop", 100),  # ended otherwise than aborted: the prompt ran (a prefill handed off, an empty answer)
])
def test_the_prompt_counts_once_vllm_produced_from_it(num_output, reason, computed):
    assert prompt_computed(100, num_output, reason) == computed
