"""A worker's record of its KV events: numbered batches, a replay buffer, and a mirror of every block held.

Pure (no I/O); the worker service publishes what ``record`` returns and answers replay and
snapshot requests from it, so an indexer (the KV-aware router) that sees a seq gap, or starts
late, catches up without the engine's help::

    batch = log.record(events)          # KvEventBatch(source_id, seq 1, 2, ..., ts, events)
    log.replay(after_seq=41)            # the batches 42.. still in the buffer; None if some fell out
    snap = log.snapshot()               # KvSnapshot(seq, blocks): the state after batch `seq`

The mirror follows the events, not the engine, so it works for any engine that emits them
(vLLM's ZMQ publisher, the sim's block pool). Each block is kept with its parent hash and
token ids per medium (GPU, CPU): what an indexer needs to rebuild its own chained hashes.
Applying the batches after ``snap.seq`` to a snapshot gives the current state.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque

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

    def replay(self, after_seq: int, max_tokens: int = 0) -> list[KvEventBatch] | None:
        """The batches numbered after ``after_seq``; None when some of them left the buffer (take a snapshot).

        With ``max_tokens``, only the first batches holding about that many token ids (at least one):
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
            size = sum(len(e.token_ids) for e in batch.events if isinstance(e, BlockStored))
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
