"""The router's KV index, pure: which worker holds which prefix block, per tier (device, host).

Fed by the workers' KV events; asked ``find_matches(prompt hashes)`` -> cached prefix per worker.
Blocks are named by the router's own chained hash (``shared.prefix_hash``), recomputed from
the token ids in each BlockStored, so engine hash choices never leak in::

    worker w3, engine block size 32, router block size 16
    BlockStored(hashes=[e7], parent=e2, tokens=t[0:32], medium="GPU")
      e2 -> (r3, r4) known from an earlier event   =>  r5 = H(r4, t[0:16]), r6 = H(r5, t[16:32])
      e7 -> (r5, r6) kept for BlockRemoved and for e7's children
      holders[device][r5] |= 1 << slot(w3)          one int bitmask per block: AND walks a prompt

A chain's first block (no parent) starts from ``salt_root(model, lora, cache_salt)``: the
worker's model, the event's LoRA id and the tenant salt the worker attached. A block whose
parent the index never saw (lost events) cannot be named and is skipped (counted): recovery
(replay or snapshot) is the cure, never a guess.

``find_matches`` ANDs bitmasks along the prompt's hashes: a worker's device overlap is its
longest prefix held on the device; its host overlap is how much further the prefix goes with
host-tier blocks. With no host tier anywhere (the common case) it bisects instead of walking,
since engines keep a worker's device blocks prefix-closed: O(log(prompt blocks)) lookups per
distinct depth, independent of index size.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from shared.prefix_hash import DEFAULT_BLOCK_SIZE, chain, salt_root
from shared.schema import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent

DEVICE, HOST = 0, 1
HOST_MEDIA = frozenset({"CPU", "cpu", "HOST", "host", "DISK", "disk"})


def tier_of(medium: str | None) -> int:
    return HOST if medium in HOST_MEDIA else DEVICE


@dataclass(frozen=True, slots=True)
class Overlap:
    """A worker's cached prefix of one prompt, in router blocks."""

    device: int = 0
    host: int = 0

    @property
    def blocks(self) -> int:
        return self.device + self.host


@dataclass(slots=True)
class _Worker:
    slot: int
    model: str
    # per tier: engine hash -> its router hash (an int), or the router hashes of its sub-blocks (a tuple)
    blocks: tuple[dict[int, int | tuple[int, ...]], dict[int, int | tuple[int, ...]]] = field(
        default_factory=lambda: ({}, {}))
    # per tier: router hash -> how many more of this worker's engine blocks name it than the first (rare: the
    # engine hashes something the router does not see); the first is the worker's bit in the holders' mask
    extra: tuple[dict[int, int], dict[int, int]] = field(default_factory=lambda: ({}, {}))


def _router_hashes(value: int | tuple[int, ...]) -> tuple[int, ...]:
    return value if isinstance(value, tuple) else (value,)


class PrefixIndex:
    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        assert block_size > 0
        self.block_size = block_size
        self._workers: dict[str, _Worker] = {}
        self._slot_owner: list[str | None] = []
        self._holders: tuple[dict[int, int], dict[int, int]] = ({}, {})  # per tier: router hash -> slot bitmask
        self.num_skipped_blocks = 0  # parent unknown or block size not a multiple of ours

    # ------------------------------------------------------------ workers
    def add_worker(self, worker_id: str, model: str) -> None:
        if worker_id in self._workers:
            self._workers[worker_id].model = model
            return
        try:
            slot = self._slot_owner.index(None)
            self._slot_owner[slot] = worker_id
        except ValueError:
            slot = len(self._slot_owner)
            self._slot_owner.append(worker_id)
        self._workers[worker_id] = _Worker(slot, model)

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker and every block it held."""
        worker = self._workers.pop(worker_id, None)
        if worker is None:
            return
        self._clear(worker)
        self._slot_owner[worker.slot] = None

    def workers(self) -> list[str]:
        return list(self._workers)

    def num_blocks(self, worker_id: str | None = None, tier: int | None = None) -> int:
        """Engine blocks indexed (of one worker, one tier, or all)."""
        workers = [self._workers[worker_id]] if worker_id is not None else self._workers.values()
        tiers = (DEVICE, HOST) if tier is None else (tier,)
        return sum(len(w.blocks[t]) for w in workers for t in tiers)

    # ------------------------------------------------------------ events
    def apply(self, worker_id: str, events: Iterable[KvEvent]) -> None:
        worker = self._workers.get(worker_id)
        if worker is None:
            raise KeyError(f"unknown worker {worker_id!r}: add_worker first")
        for event in events:
            if isinstance(event, BlockStored):
                self._store(worker, event)
            elif isinstance(event, BlockRemoved):
                self._remove(worker, tier_of(event.medium), event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self._clear(worker)

    def load_blocks(self, worker_id: str, blocks: list[BlockStored]) -> None:
        """Apply a snapshot's blocks in any order: each pass stores those whose parent is named already.

        A block whose parent is in the snapshot waits for it; one whose parent is not (or never gets
        named) is skipped and counted, as in ``apply``.
        """
        worker = self._workers[worker_id]
        in_snapshot = {h for b in blocks for h in b.block_hashes}

        def waits(block: BlockStored) -> bool:
            parent = block.parent_block_hash
            return parent is not None and parent in in_snapshot and not self._knows(worker, parent)

        pending = blocks
        while pending:
            later = [b for b in pending if waits(b)]
            if len(later) == len(pending):
                break  # a cycle or parents that cannot be named: skip them
            for block in pending:
                if not waits(block):
                    self._store(worker, block)
            pending = later
        self.num_skipped_blocks += sum(len(b.block_hashes) for b in pending)

    @staticmethod
    def _knows(worker: _Worker, engine_hash: int) -> bool:
        return engine_hash in worker.blocks[DEVICE] or engine_hash in worker.blocks[HOST]

    def clear_worker(self, worker_id: str) -> None:
        """Drop a worker's blocks but keep the worker (before loading a snapshot)."""
        worker = self._workers.get(worker_id)
        if worker is not None:
            self._clear(worker)

    def _store(self, worker: _Worker, event: BlockStored) -> None:
        size, ours = event.block_size, self.block_size
        if size % ours or len(event.token_ids) < size * len(event.block_hashes):
            self.num_skipped_blocks += len(event.block_hashes)
            return
        if event.parent_block_hash is None:
            parent = salt_root(worker.model, event.lora_id, event.cache_salt)
        else:
            known = worker.blocks[DEVICE].get(event.parent_block_hash)
            if known is None:
                known = worker.blocks[HOST].get(event.parent_block_hash)
                if known is None:
                    self.num_skipped_blocks += len(event.block_hashes)
                    return
            parent = known[-1] if isinstance(known, tuple) else known
        routed = chain(parent, event.token_ids[:size * len(event.block_hashes)], ours)
        tier = tier_of(event.medium)
        blocks, extra, holders = worker.blocks[tier], worker.extra[tier], self._holders[tier]
        bit = 1 << worker.slot
        per_block = size // ours
        if per_block == 1 and self._store_new_chain(blocks, extra, holders, bit, event.block_hashes, routed):
            return
        for i, engine_hash in enumerate(event.block_hashes):
            if engine_hash in blocks:
                continue  # already held (a replay overlapping a snapshot): idempotent
            if per_block == 1:
                named = blocks[engine_hash] = routed[i]
                subs: tuple[int, ...] = (named,)
            else:
                subs = blocks[engine_hash] = tuple(routed[i * per_block:(i + 1) * per_block])
            for router_hash in subs:
                mask = holders.get(router_hash, 0)
                if not mask:
                    holders[router_hash] = bit  # one int object for the event, not one per block
                elif mask & bit:
                    extra[router_hash] = extra.get(router_hash, 0) + 1
                else:
                    holders[router_hash] = mask | bit

    @staticmethod
    def _store_new_chain(blocks: dict, extra: dict[int, int], holders: dict[int, int], bit: int,
                         engine_hashes: list[int], routed: list[int]) -> bool:
        """The common case at C speed, one engine block per router block: none of the event's blocks is held by
        this worker yet and its router hashes are distinct. False (nothing done) otherwise."""
        if not blocks.keys().isdisjoint(engine_hashes) or len(set(routed)) != len(routed):
            return False
        blocks.update(zip(engine_hashes, routed, strict=True))
        held = [router_hash for router_hash in routed if router_hash in holders]
        if not held:
            holders.update(dict.fromkeys(routed, bit))
            return True
        holders.update(dict.fromkeys([router_hash for router_hash in routed if router_hash not in holders], bit))
        for router_hash in held:
            mask = holders[router_hash]
            if mask & bit:  # another of this worker's engine blocks names it
                extra[router_hash] = extra.get(router_hash, 0) + 1
            else:
                holders[router_hash] = mask | bit
        return True

    def _remove(self, worker: _Worker, tier: int, engine_hashes: Sequence[int]) -> None:
        blocks, extra, holders = worker.blocks[tier], worker.extra[tier], self._holders[tier]
        keep = ~(1 << worker.slot)
        for engine_hash in engine_hashes:
            named = blocks.pop(engine_hash, None)
            if named is None:
                continue
            for router_hash in _router_hashes(named):
                more = extra.get(router_hash)
                if more:  # another of this worker's engine blocks still names it
                    if more == 1:
                        del extra[router_hash]
                    else:
                        extra[router_hash] = more - 1
                    continue
                mask = holders[router_hash] & keep
                if mask:
                    holders[router_hash] = mask
                else:
                    del holders[router_hash]

    def _clear(self, worker: _Worker) -> None:
        keep = ~(1 << worker.slot)
        for tier in (DEVICE, HOST):
            holders = self._holders[tier]
            for named in worker.blocks[tier].values():
                for router_hash in _router_hashes(named):
                    mask = holders.get(router_hash, 0) & keep
                    if mask:
                        holders[router_hash] = mask
                    else:
                        holders.pop(router_hash, None)
            worker.blocks[tier].clear()
            worker.extra[tier].clear()

    # ------------------------------------------------------------ queries
    def find_matches(self, hashes: Sequence[int]) -> dict[str, Overlap]:
        """Each worker's cached prefix of a prompt given as router hashes (workers with none are left out)."""
        if not hashes:
            return {}
        if not self._holders[HOST]:
            return self._find_on_device(hashes)
        device_get, host_get = self._holders[DEVICE].get, self._holders[HOST].get
        device_depth: dict[int, int] = {}
        any_depth: dict[int, int] = {}
        device_active = any_active = 0
        depth = 0
        for depth, router_hash in enumerate(hashes):
            on_device = device_get(router_hash, 0)
            held = on_device | host_get(router_hash, 0)
            if depth == 0:
                device_active, any_active = on_device, held
            else:
                still = device_active & on_device
                if still != device_active:
                    _record(device_active & ~still, depth, device_depth)
                    device_active = still
                still = any_active & held
                if still != any_active:
                    _record(any_active & ~still, depth, any_depth)
                    any_active = still
            if not any_active:
                break
        else:
            depth = len(hashes)
        _record(device_active, depth, device_depth)
        _record(any_active, depth, any_depth)
        owners = self._slot_owner
        return {owners[slot]: Overlap(device_depth.get(slot, 0), total - device_depth.get(slot, 0))  # type: ignore[misc]
                for slot, total in any_depth.items() if total}


    def _find_on_device(self, hashes: Sequence[int]) -> dict[str, Overlap]:
        """find_matches when no worker has a host tier: the hot path, a bisection.

        Engines keep a worker's blocks prefix-closed on the device (a block is cached only after its
        parent, and a request frees its blocks tail first, so descendants are evicted before their
        ancestors): a worker holding block i holds blocks 0..i, and the workers holding block i are a
        shrinking set as i grows. So the walk looks up the last block, and where some workers hold the
        first but not the last, halves that range until it finds where each of them stops: about
        log2(prompt blocks) lookups per distinct depth, not one per block. In a 1M-block index each
        lookup is a cache miss or three; a 32K-token prompt over 64 workers takes a few dozen.
        """
        get = self._holders[DEVICE].get
        first = get(hashes[0], 0)
        if not first:
            return {}
        last = len(hashes) - 1
        through = first & get(hashes[last], 0) if last else first
        depth_of: dict[int, int] = {}
        _record(through, last + 1, depth_of)
        ranges = [(0, last, first, through)]  # (lo, hi, workers holding lo, those of them holding hi)
        while ranges:
            lo, hi, at_lo, at_hi = ranges.pop()
            if at_lo == at_hi:
                continue
            if hi == lo + 1:
                _record(at_lo & ~at_hi, hi, depth_of)
                continue
            mid = (lo + hi) // 2
            at_mid = (at_lo & get(hashes[mid], 0)) | at_hi  # kept monotone whatever the index holds
            ranges.append((lo, mid, at_lo, at_mid))
            ranges.append((mid, hi, at_mid, at_hi))
        owners, overlap = self._slot_owner, _device_overlap
        return {owners[slot]: overlap(d) for slot, d in depth_of.items()}  # type: ignore[misc]


_DEVICE_OVERLAPS: dict[int, Overlap] = {}


def _device_overlap(depth: int) -> Overlap:
    """Overlap(depth, 0), made once per depth (a decision over 64 workers would otherwise build 64)."""
    found = _DEVICE_OVERLAPS.get(depth)
    if found is None:
        found = _DEVICE_OVERLAPS[depth] = Overlap(depth, 0)
    return found


def _record(mask: int, depth: int, into: dict[int, int]) -> None:
    while mask:
        low = mask & -mask
        into[low.bit_length() - 1] = depth
        mask ^= low
