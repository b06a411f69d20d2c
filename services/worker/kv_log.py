"""A worker's record of its KV events: numbered batches, a replay buffer, and a mirror of every block held.

Pure (no I/O); the worker service publishes what ``record`` returns and answers replay and
snapshot requests from it, so an indexer (the KV-aware router) that sees a seq gap, or starts
late, catches up without the engine's help::

    batch = log.record(events)          # KvEventBatch(source_id, seq 1, 2, ..., ts, events)
    batches = log.record_bounded(events, max_ids)  # the same, in batches of at most ~max_ids ids each
    log.replay(after_seq=41)            # the batches 42.. still in the buffer; None if some fell out
    snap = log.snapshot()               # KvSnapshot(seq, blocks): the state after batch `seq`

The mirror follows the events, not the engine, so it works for any engine that emits them
(vLLM's ZMQ publisher, the sim's block pool). Each block is kept with its parent hash and
token ids per medium (GPU, CPU): what an indexer needs to rebuild its own chained hashes.
Applying the batches after ``snap.seq`` to a snapshot gives the current state.

A batch must fit one NATS message: a long prompt's prefill stores thousands of blocks at once (a 256K-token
prompt: 256K token ids), so ``record_bounded`` splits what the engine reported into batches of at most about
``max_ids`` ids (token ids and block hashes), a long BlockStored or BlockRemoved into consecutive parts (each
part's parent is the previous part's last block: applied in order, the same chain).
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque

import msgspec

from shared.schema import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, KvEventBatch, KvSnapshot

DEFAULT_MEDIUM = "GPU"


class KvEventLog:
    def __init__(self, source_id: str, capacity: int = 1024) -> None:
        assert capacity > 0
        self.source_id = source_id
        self.seq = 0
        self._recent: deque[KvEventBatch] = deque(maxlen=capacity)
        # medium -> block hash -> (parent hash, token ids, block size, lora id, cache salt), in storage order
        self._blocks: dict[str, OrderedDict[int, tuple[int | None, list[int], int, int | None, str | None]]] = {}

    def record(self, events: list[KvEvent]) -> KvEventBatch:
        """Number a batch of events, keep it for replay and apply it to the mirror."""
        self.seq += 1
        batch = KvEventBatch(self.source_id, self.seq, time.time(), events)
        self._recent.append(batch)
        for event in events:
            self._apply(event)
        return batch

    def record_bounded(self, events: list[KvEvent], max_ids: int) -> list[KvEventBatch]:
        """``record`` in as many batches as keep each to about ``max_ids`` ids."""
        return [self.record(group) for group in split_events(events, max_ids)]

    def replay(self, after_seq: int, max_tokens: int = 0) -> list[KvEventBatch] | None:
        """The batches numbered after ``after_seq``; None when some of them left the buffer (take a snapshot).

        With ``max_tokens``, only the first batches holding about that many ids (token ids and block hashes; at
        least one batch):
        the caller asks again after the last one it got (a NATS message has a size limit).
        """
        if after_seq >= self.seq:
            return []
        oldest = self._recent[0].seq if self._recent else self.seq + 1
        if after_seq + 1 < oldest:
            return None
        batches, num_tokens = [], 0
        for batch in self._recent:
            if batch.seq <= after_seq:
                continue
            size = sum(_num_ids(e) for e in batch.events)
            if batches and max_tokens and num_tokens + size > max_tokens:
                break
            batches.append(batch)
            num_tokens += size
        return batches

    def snapshot(self) -> KvSnapshot:
        """Every block held now, one single-block BlockStored each, as of batch ``seq``."""
        blocks = [BlockStored([block_hash], parent, tokens, size, lora, medium, salt)
                  for medium, held in self._blocks.items()
                  for block_hash, (parent, tokens, size, lora, salt) in held.items()]
        return KvSnapshot(self.source_id, self.seq, time.time(), blocks)

    def num_blocks(self, medium: str = DEFAULT_MEDIUM) -> int:
        return len(self._blocks.get(medium, ()))

    def _apply(self, event: KvEvent) -> None:
        if isinstance(event, BlockStored):
            held = self._blocks.setdefault(event.medium or DEFAULT_MEDIUM, OrderedDict())
            parent, size = event.parent_block_hash, event.block_size
            for i, block_hash in enumerate(event.block_hashes):
                held[block_hash] = (parent, event.token_ids[i * size:(i + 1) * size], size, event.lora_id,
                                    event.cache_salt)
                parent = block_hash
        elif isinstance(event, BlockRemoved):
            held = self._blocks.get(event.medium or DEFAULT_MEDIUM)
            for block_hash in event.block_hashes:
                if held is not None:
                    held.pop(block_hash, None)
        elif isinstance(event, AllBlocksCleared):
            self._blocks.clear()


def split_events(events: list[KvEvent], max_ids: int) -> list[list[KvEvent]]:
    """``events`` in order, in groups of at most about ``max_ids`` ids each (one group for no events)."""
    assert max_ids > 0
    groups: list[list[KvEvent]] = [[]]
    size = 0
    for event in events:
        for part in _parts(event, max_ids):
            num_ids = _num_ids(part)
            if groups[-1] and size + num_ids > max_ids:
                groups.append([])
                size = 0
            groups[-1].append(part)
            size += num_ids
    return groups


def _parts(event: KvEvent, max_ids: int) -> list[KvEvent]:
    if isinstance(event, BlockStored):
        per_part = max(1, max_ids // (event.block_size + 1))
        if len(event.block_hashes) <= per_part:
            return [event]
        parts, parent, size = [], event.parent_block_hash, event.block_size
        for start in range(0, len(event.block_hashes), per_part):
            hashes = event.block_hashes[start:start + per_part]
            parts.append(msgspec.structs.replace(event, block_hashes=hashes, parent_block_hash=parent,
                                                 token_ids=event.token_ids[start * size:(start + len(hashes)) * size]))
            parent = hashes[-1]
        return parts
    if isinstance(event, BlockRemoved) and len(event.block_hashes) > max_ids:
        return [msgspec.structs.replace(event, block_hashes=event.block_hashes[start:start + max_ids])
                for start in range(0, len(event.block_hashes), max_ids)]
    return [event]


def _num_ids(event: KvEvent) -> int:
    if isinstance(event, BlockStored):
        return len(event.block_hashes) + len(event.token_ids)
    if isinstance(event, BlockRemoved):
        return len(event.block_hashes)
    return 1
