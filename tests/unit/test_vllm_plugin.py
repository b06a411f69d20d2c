"""services/worker/engines/vllm_plugin.py: a CPU generator that vLLM may rewind without raising."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")


def test_a_rewindless_generator_keeps_the_state_and_ignores_offsets() -> None:
    from services.worker.engines.vllm_plugin import RewindlessGenerator, rewindless

    plain = torch.Generator(device="cpu").manual_seed(7)
    with pytest.raises(RuntimeError, match="does not use offset"):  # what killed vLLM CPU's engine
        plain.set_offset(plain.get_offset() - 4)
    copy = rewindless(plain)
    assert isinstance(copy, RewindlessGenerator) and rewindless(copy) is copy
    copy.set_offset(copy.get_offset() - 4)
    assert torch.equal(torch.rand(4, generator=copy), torch.rand(4, generator=plain))  # the same draws


def test_the_plugin_is_registered_and_patches_the_input_batch_once() -> None:
    from importlib.metadata import entry_points

    from vllm.v1.worker.gpu_input_batch import InputBatch

    from services.worker.engines.vllm_plugin import patch_input_batch

    plugins = {e.value for e in entry_points(group="vllm.general_plugins")}
    assert "services.worker.engines.vllm_plugin:register" in plugins
    patch_input_batch()
    patched = InputBatch.add_request
    patch_input_batch()
    assert InputBatch.add_request is patched and patched._infermesh_rewindless
