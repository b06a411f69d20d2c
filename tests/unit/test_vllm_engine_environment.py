"""The vLLM engine sets its processes' environment (core pinning, KV space, NIXL side channel) only while it
starts them: a second engine started in the same process must not inherit the first one's core or port."""

from __future__ import annotations

import os

from services.worker.engines.vllm_engine import _environment


def test_values_hold_inside_and_the_environment_is_restored_after(monkeypatch):
    monkeypatch.setenv("IM_TEST_PRESENT", "before")
    monkeypatch.delenv("IM_TEST_ABSENT", raising=False)
    with _environment({"IM_TEST_PRESENT": "during", "IM_TEST_ABSENT": "1"}):
        assert os.environ["IM_TEST_PRESENT"] == "during" and os.environ["IM_TEST_ABSENT"] == "1"
    assert os.environ["IM_TEST_PRESENT"] == "before" and "IM_TEST_ABSENT" not in os.environ


def test_restored_even_when_the_start_fails(monkeypatch):
    monkeypatch.delenv("IM_TEST_ABSENT", raising=False)
    try:
        with _environment({"IM_TEST_ABSENT": "1"}):
            raise RuntimeError("engine failed to start")
    except RuntimeError:
        pass
    assert "IM_TEST_ABSENT" not in os.environ
