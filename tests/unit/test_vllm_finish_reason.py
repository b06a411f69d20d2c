"""vLLM's finish reasons as the worker passes them on (services/worker/engines/vllm_engine.py)."""

import pytest

from services.worker.engines.vllm_engine import EngineFinishedWithError, finish_reason


@pytest.mark.parametrize(("vllm_reason", "ours"), [
    ("stop", "stop"), (None, "stop"), ("length", "length"), ("abort", "abort"), ("repetition", "stop")])
def test_a_finished_request_keeps_its_reason(vllm_reason, ours):
    assert finish_reason(vllm_reason) == ours


def test_a_request_vllm_finished_with_an_error_fails_instead_of_ending_empty():
    """A grammar xgrammar could not compile (Claude Code's tools once) finished with vLLM's ``error`` reason and
    0 tokens, and the worker passed it on as ``stop``: the client saw a complete, empty answer."""
    with pytest.raises(EngineFinishedWithError, match="grammar"):
        finish_reason("error")
