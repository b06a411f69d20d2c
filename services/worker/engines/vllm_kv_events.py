"""Bridge from vLLM's ZMQ KV-event publisher to infermesh's KvEvent structs.

vLLM publishes multipart frames ``(topic, 8-byte big-endian seq, msgpack KVEventBatch)``.
Given a concrete ``tcp://host:port`` endpoint vLLM *connects*, so this subscriber binds
(see ../shared/docs/PROBES.md). Block hashes arrive as ints or bytes depending on vLLM's
settings; both become 64-bit ints (the router recomputes its own hashes from token ids,
so these only need to be stable ids for matching BlockRemoved to BlockStored).
"""

from __future__ import annotations

import logging
from typing import Any, AsyncIterator

import msgspec
from msgspec import Struct

from shared.schema import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent

log = logging.getLogger("infermesh.worker.vllm")
TOPIC = "kv"
_MASK64 = (1 << 64) - 1


class _Stored(Struct, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[list[Any] | None] | None = None  # per block: LoRA name, mm pairs, cache salt, embeds digests


class _Removed(Struct, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None = None


class _Cleared(Struct, tag="AllBlocksCleared"):
    pass


class _Batch(Struct, array_like=True):
    ts: float
    events: list[_Stored | _Removed | _Cleared]
    data_parallel_rank: int | None = None


_decoder = msgspec.msgpack.Decoder(_Batch)


def _as_int(block_hash: int | bytes) -> int:
    return block_hash & _MASK64 if isinstance(block_hash, int) else int.from_bytes(block_hash, "big") & _MASK64


def cache_salt_of(event: _Stored) -> str | None:
    """The tenant salt of a chain's first block, read from vLLM's per-block extra keys.

    vLLM salts only the first block of a prompt; its extra keys list, untagged and in order, the
    LoRA name (when set), (mm id, offset) pairs, the cache salt, prompt-embeds digests (bytes).
    """
    if event.parent_block_hash is not None or not event.extra_keys or not event.extra_keys[0]:
        return None
    strings = [key for key in event.extra_keys[0] if isinstance(key, str)]
    if event.lora_name is not None and strings and strings[0] == event.lora_name:
        strings = strings[1:]
    return strings[0] if strings else None


def convert_batch(payload: bytes) -> list[KvEvent]:
    """One vLLM KVEventBatch payload -> infermesh KvEvents, in order."""
    events: list[KvEvent] = []
    for event in _decoder.decode(payload).events:
        if isinstance(event, _Stored):
            parent = None if event.parent_block_hash is None else _as_int(event.parent_block_hash)
            events.append(BlockStored([_as_int(h) for h in event.block_hashes], parent, event.token_ids,
                                      event.block_size, event.lora_id, event.medium, cache_salt_of(event)))
        elif isinstance(event, _Removed):
            events.append(BlockRemoved([_as_int(h) for h in event.block_hashes], event.medium))
        else:
            events.append(AllBlocksCleared())
    return events


class KvEventSubscriber:
    """Binds a ZMQ SUB socket that one vLLM engine connects to; yields converted batches."""

    def __init__(self) -> None:
        import zmq
        import zmq.asyncio

        self._context = zmq.asyncio.Context.instance()
        self._socket = self._context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        port = self._socket.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.last_seq = -1

    async def batches(self) -> AsyncIterator[list[KvEvent]]:
        while True:
            _topic, seq_bytes, payload = await self._socket.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if self.last_seq >= 0 and seq != self.last_seq + 1:
                log.warning("vLLM KV events %d..%d lost", self.last_seq + 1, seq - 1)
            self.last_seq = seq
            try:
                yield convert_batch(payload)
            except msgspec.DecodeError:
                log.warning("undecodable vLLM KV event batch (seq %d)", seq)

    def close(self) -> None:
        self._socket.close(linger=0)
