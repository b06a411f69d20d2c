"""A pure KV block pool with prefix caching, modelled on vLLM v1's block pool and KV cache manager.

No I/O, no asyncio: the ``sim`` engine's scheduler calls it, drains its KV events and
publishes them. Every full block is named by a chained hash, so a block's hash stands
for the whole prefix up to and including it::

    tokens   [t0 .. t15][t16 .. t31][t32 .. t40]       block_size = 16
    hashes    h0 = H(None, t0..15)  h1 = H(h0, t16..31)  (partial block: no hash)

    request "a" block table [3, 7, 9]     ref counts: 3 -> 2, 7 -> 2, 9 -> 1, 12 -> 1
    request "b" block table [3, 7, 12]    hash_to_block_id: h0 -> 3, h1 -> 7, ...

    free blocks = uncached  [0, 1, 2, ...]          taken first, nothing to lose
                + evictable  5(h4) -> 8(h5) -> ...   cached, ref 0; evicted head first (BlockRemoved)

Free blocks that still hold a cached block stay findable until they are reused:
``allocate`` takes them back out of the evictable queue on a prefix hit. A request's
blocks are freed tail first, so its prefix is the last to be evicted. Unlike vLLM (one
free queue), uncached free blocks are used before any cached block is evicted, and a
block that fills with a hash already cached elsewhere is not cached a second time.
``extra`` enters every block's hash, not only the first; the sim engine passes ``(cache_salt,)``
for a salted request (``()`` otherwise), and the salt rides on its BlockStored events so the
router can start its own salted chain (``shared.prefix_hash``).

Optional host-DRAM tier (``host_num_blocks > 0``), an LRU of hashes only (inclusive, write-back):

* Eviction writes back: a cached device block evicted to make room is announced
  BlockRemoved(medium) then, if its hash is new to the host, BlockStored(medium="CPU") with its
  parent hash and tokens (a full host first drops its LRU hash, BlockRemoved(medium="CPU")); a
  hash already on the host is only moved to its MRU end, with no event.
* Lookup walks the chain block by block, device first, then host; it stops at the first hash on
  neither (same cap: the last token is always computed). ``find_cached_prefix`` counts both tiers.
* ``allocate`` keeps device hits as today; every host hit takes a fresh device block (counted as
  a new block for capacity), is cached there and announced BlockStored(medium) in the same run as
  the blocks computed after it. The host keeps its copy and moves it to its MRU end first, so
  write-backs in the same call can still push it out (announced): the load reuses the prompt's
  tokens, never the host entry. ``host_hit_tokens`` is what the simulator charges a copy for.
* ``reset`` clears both tiers with one AllBlocksCleared (vLLM's event has no medium).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec

from shared.schema import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent

_encoder = msgspec.msgpack.Encoder()
HOST_MEDIUM = "CPU"  # the host tier's ``medium`` in KV events
Hasher = Callable[[int | None, Sequence[int], tuple], int]  # hash_block's signature: (parent, tokens, extra)


def hash_block(parent_hash: int | None, token_ids: Sequence[int], extra: tuple = ()) -> int:
    """The 64-bit chained hash of one full block (deterministic across processes, unlike ``hash``)."""
    data = _encoder.encode((parent_hash, list(token_ids), list(extra)))
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def fast_hash_block(parent_hash: int | None, token_ids: Sequence[int], extra: tuple = ()) -> int:
    """A 64-bit chained hash from the built-in ``hash``, for the offline simulator only.

    Fast, but not stable across processes (``PYTHONHASHSEED``), so never for anything a router mirrors.
    """
    return hash((parent_hash, tuple(token_ids), extra)) & 0xFFFF_FFFF_FFFF_FFFF


def block_hashes(token_ids: Sequence[int], block_size: int, extra: tuple = (),
                 hasher: Hasher = hash_block) -> list[int]:
    """The chained hashes of the full blocks of ``token_ids`` (a trailing partial block has none)."""
    hashes: list[int] = []
    parent: int | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hasher(parent, token_ids[start:start + block_size], extra)
        hashes.append(parent)
    return hashes


def salt_of(extra: tuple) -> str | None:
    """The cache salt in a sim request's ``extra`` (``(cache_salt,)`` or ``()``)."""
    return extra[0] if extra else None


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class _Request:
    block_ids: list[int]
    num_tokens: int
    extra: tuple
    last_hash: int | None = None  # hash of the last full block (caching on only)
    tail_token_ids: list[int] = field(default_factory=list)  # tokens of the partial last block
    host_hit_tokens: int = 0  # cached tokens loaded from the host tier


class BlockPool:
    """Fixed-size KV blocks with ref counts, a chained-hash prefix cache, an LRU of evictable blocks
    and an optional host tier of evicted hashes."""

    __slots__ = ("num_blocks", "block_size", "enable_prefix_caching", "medium", "hasher", "host_num_blocks",
                 "_ref_counts", "_block_id_to_hash", "_block_id_to_content", "_hash_to_block_id",
                 "_uncached_free_ids", "_evictable_ids", "_host_hashes", "_requests", "_events", "record_events")

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 medium: str = "GPU", hasher: Hasher = hash_block, host_num_blocks: int = 0,
                 record_events: bool = True) -> None:
        assert num_blocks > 0 and block_size > 0 and host_num_blocks >= 0
        assert not host_num_blocks or medium != HOST_MEDIUM, "the host tier needs a device medium other than CPU"
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.medium = medium
        self.hasher = hasher
        self.host_num_blocks = host_num_blocks
        self.record_events = record_events  # off in the offline simulator, which never reads them
        self._ref_counts = [0] * num_blocks
        self._block_id_to_hash: list[int | None] = [None] * num_blocks
        # (parent hash, tokens, salt) of each cached block, kept only with a host tier, to announce its write-back
        self._block_id_to_content: list[tuple[int | None, list[int], str | None] | None] = [None] * num_blocks
        self._hash_to_block_id: dict[int, int] = {}
        self._uncached_free_ids = list(range(num_blocks - 1, -1, -1))  # a stack: block 0 is taken first
        self._evictable_ids: OrderedDict[int, None] = OrderedDict()  # head = least recently freed
        self._host_hashes: OrderedDict[int, None] = OrderedDict()  # head = least recently used
        self._requests: dict[str, _Request] = {}
        self._events: list[KvEvent] = []

    # ------------------------------------------------------------ accounting
    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds, evictable cached blocks included."""
        return len(self._uncached_free_ids) + len(self._evictable_ids)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one running request."""
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        """The fraction of blocks in use, 0..1."""
        return self.num_used_blocks / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks findable by hash, in use or evictable."""
        return len(self._hash_to_block_id)

    def cached_hashes(self) -> set[int]:
        """A snapshot of every cached block hash on the device."""
        return set(self._hash_to_block_id)

    @property
    def num_host_cached_blocks(self) -> int:
        """Hashes held by the host tier."""
        return len(self._host_hashes)

    def host_cached_hashes(self) -> set[int]:
        """A snapshot of every block hash in the host tier."""
        return set(self._host_hashes)

    def host_hit_tokens(self, request_id: str) -> int:
        """How many of a running request's cached tokens ``allocate`` loaded from the host tier."""
        return self._requests[request_id].host_hit_tokens

    def block_ids(self, request_id: str) -> list[int]:
        """A copy of a running request's block table."""
        return list(self._requests[request_id].block_ids)

    def drain_events(self) -> list[KvEvent]:
        """Return the KV events recorded since the last drain, oldest first, and forget them."""
        events, self._events = self._events, []
        return events

    # ------------------------------------------------------------ per request
    def find_cached_prefix(self, token_ids: Sequence[int], extra: tuple = ()) -> int:
        """The number of leading tokens covered by cached full blocks (either tier), leaving the last token to
        compute."""
        return len(self._find_cached_blocks(token_ids, extra)[0]) * self.block_size

    def find_cached_prefix_by_tier(self, token_ids: Sequence[int], extra: tuple = ()) -> tuple[int, int]:
        """``find_cached_prefix`` split into (tokens on the device, tokens on the host tier)."""
        _, hit_ids = self._find_cached_blocks(token_ids, extra)
        num_host = hit_ids.count(None)
        return (len(hit_ids) - num_host) * self.block_size, num_host * self.block_size

    def can_allocate(self, token_ids: Sequence[int], extra: tuple = (), headroom: int = 0) -> bool:
        """Whether ``allocate`` would succeed for this prompt now and leave ``headroom`` blocks free."""
        _, hit_ids = self._find_cached_blocks(token_ids, extra)
        return self._num_blocks_short(len(token_ids), hit_ids) + headroom <= 0

    def allocate(self, request_id: str, token_ids: Sequence[int], extra: tuple = ()) -> int | None:
        """Give a new request blocks for its prompt, reusing cached prefix blocks; the number of cached tokens, or
        None."""
        assert request_id not in self._requests, f"request {request_id!r} already allocated"
        assert len(token_ids) > 0
        hashes, hit_ids = self._find_cached_blocks(token_ids, extra)
        if self._num_blocks_short(len(token_ids), hit_ids) > 0:
            return None
        size = self.block_size
        for block_hash, block_id in zip(hashes, hit_ids, strict=True):
            if block_id is None:
                self._host_hashes.move_to_end(block_hash)
            else:
                self._touch(block_id)
        # Host hits get fresh blocks; _fill_blocks caches them from the prompt's tokens and the walk's hashes.
        block_ids = [self._take_free_block() if block_id is None else block_id for block_id in hit_ids]
        block_ids += [self._take_free_block() for _ in range(_cdiv(len(token_ids), size) - len(hit_ids))]
        num_device = hit_ids.index(None) if None in hit_ids else len(hit_ids)  # the device-only prefix
        request = _Request(block_ids=block_ids, num_tokens=len(token_ids), extra=extra,
                           last_hash=hashes[num_device - 1] if num_device else None,
                           host_hit_tokens=hit_ids.count(None) * size)
        self._requests[request_id] = request
        self._fill_blocks(request, num_device, list(token_ids[num_device * size:]), hashes[num_device:])
        return len(hashes) * size

    def append_tokens(self, request_id: str, new_token_ids: Sequence[int]) -> bool:
        """Grow a running request by decoded tokens, taking blocks as needed; False (nothing changed) if too few
        free."""
        request = self._requests[request_id]
        num_tokens = request.num_tokens + len(new_token_ids)
        num_new_blocks = _cdiv(num_tokens, self.block_size) - len(request.block_ids)
        if num_new_blocks > self.num_free_blocks:
            return False
        request.block_ids.extend(self._take_free_block() for _ in range(num_new_blocks))
        first_index = request.num_tokens // self.block_size
        request.num_tokens = num_tokens
        self._fill_blocks(request, first_index, request.tail_token_ids + list(new_token_ids))
        return True

    def free(self, request_id: str) -> None:
        """Release a request's blocks tail first; cached ones stay findable until evicted (unknown ids are ignored)."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        for block_id in reversed(request.block_ids):
            self._ref_counts[block_id] -= 1
            assert self._ref_counts[block_id] >= 0
            if self._ref_counts[block_id] == 0:
                if self._block_id_to_hash[block_id] is None:
                    self._uncached_free_ids.append(block_id)
                else:
                    self._evictable_ids[block_id] = None

    def reset(self) -> bool:
        """Drop every cached hash, host tier included, when no request is running; False (nothing changed) otherwise."""
        if self._requests:
            return False
        assert len(self._evictable_ids) == len(self._hash_to_block_id)
        for block_id in self._evictable_ids:
            self._block_id_to_hash[block_id] = None
            self._block_id_to_content[block_id] = None
            self._uncached_free_ids.append(block_id)
        self._evictable_ids.clear()
        self._hash_to_block_id.clear()
        self._host_hashes.clear()
        if self.enable_prefix_caching and self.record_events:
            self._events.append(AllBlocksCleared())
        return True

    # ------------------------------------------------------------ internals
    def _find_cached_blocks(self, token_ids: Sequence[int], extra: tuple) -> tuple[list[int], list[int | None]]:
        """The hashes of the longest cached prefix (capped below the last token) and, per block, its
        device block id, or None where the hit is in the host tier."""
        hashes: list[int] = []
        hit_ids: list[int | None] = []
        if not self.enable_prefix_caching:
            return hashes, hit_ids
        parent: int | None = None
        size = self.block_size
        for start in range(0, (len(token_ids) - 1) // size * size, size):
            parent = self.hasher(parent, token_ids[start:start + size], extra)
            block_id = self._hash_to_block_id.get(parent)
            if block_id is None and parent not in self._host_hashes:
                break
            hashes.append(parent)
            hit_ids.append(block_id)
        return hashes, hit_ids

    def _num_blocks_short(self, num_tokens: int, hit_ids: list[int | None]) -> int:
        # Evictable hit blocks count as free but are taken by the hit itself, not available for new data;
        # host hits need fresh blocks like new data.
        device_ids = [block_id for block_id in hit_ids if block_id is not None]
        num_evictable_hits = sum(1 for block_id in device_ids if self._ref_counts[block_id] == 0)
        num_new_blocks = _cdiv(num_tokens, self.block_size) - len(device_ids)
        return num_new_blocks - (self.num_free_blocks - num_evictable_hits)

    def _touch(self, block_id: int) -> None:
        if self._ref_counts[block_id] == 0:
            del self._evictable_ids[block_id]
        self._ref_counts[block_id] += 1

    def _take_free_block(self) -> int:
        """Pop an uncached free block, else evict the least recently freed cached one."""
        if self._uncached_free_ids:
            block_id = self._uncached_free_ids.pop()
        else:
            block_id, _ = self._evictable_ids.popitem(last=False)
            block_hash = self._block_id_to_hash[block_id]
            assert block_hash is not None
            del self._hash_to_block_id[block_hash]
            self._block_id_to_hash[block_id] = None
            if self.record_events:
                self._events.append(BlockRemoved(block_hashes=[block_hash], medium=self.medium))
            if self.host_num_blocks:
                content, self._block_id_to_content[block_id] = self._block_id_to_content[block_id], None
                assert content is not None or not self.record_events
                self._write_back(block_hash, *(content or (None, [], None)))
        assert self._ref_counts[block_id] == 0
        self._ref_counts[block_id] = 1
        return block_id

    def _write_back(self, block_hash: int, parent_hash: int | None, token_ids: list[int], salt: str | None) -> None:
        """Copy an evicted device block's hash into the host tier, dropping the host's LRU hash if full."""
        if block_hash in self._host_hashes:
            self._host_hashes.move_to_end(block_hash)
            return
        if len(self._host_hashes) >= self.host_num_blocks:
            dropped, _ = self._host_hashes.popitem(last=False)
            if self.record_events:
                self._events.append(BlockRemoved(block_hashes=[dropped], medium=HOST_MEDIUM))
        self._host_hashes[block_hash] = None
        if self.record_events:
            self._events.append(BlockStored(block_hashes=[block_hash], parent_block_hash=parent_hash,
                                            token_ids=token_ids, block_size=self.block_size, lora_id=None,
                                            medium=HOST_MEDIUM, cache_salt=salt))

    def _fill_blocks(self, request: _Request, first_index: int, token_ids: list[int],
                     known_hashes: Sequence[int] = ()) -> None:
        """Cache the blocks that ``token_ids`` (starting at block ``first_index``) fill, one BlockStored per run;
        the hashes of the first of them may be given (host hits)."""
        if not self.enable_prefix_caching:
            return
        size = self.block_size
        num_full = len(token_ids) // size
        run_start = 0  # index into token_ids' blocks where the current run of newly stored blocks starts
        run_parent, run_hashes = request.last_hash, []
        for i in range(num_full):
            block_tokens = token_ids[i * size:(i + 1) * size]
            block_hash = (known_hashes[i] if i < len(known_hashes)
                          else self.hasher(request.last_hash, block_tokens, request.extra))
            block_id = request.block_ids[first_index + i]
            if block_hash in self._hash_to_block_id:  # another block holds it: keep that one, announce nothing
                self._flush_stored(run_parent, run_hashes, token_ids[run_start * size:i * size], request.extra)
                run_start, run_parent, run_hashes = i + 1, block_hash, []
            else:
                self._hash_to_block_id[block_hash] = block_id
                self._block_id_to_hash[block_id] = block_hash
                if self.host_num_blocks and self.record_events:
                    self._block_id_to_content[block_id] = (request.last_hash, block_tokens, salt_of(request.extra))
                run_hashes.append(block_hash)
            request.last_hash = block_hash
        self._flush_stored(run_parent, run_hashes, token_ids[run_start * size:num_full * size], request.extra)
        request.tail_token_ids = token_ids[num_full * size:]

    def _flush_stored(self, parent_hash: int | None, hashes: list[int], token_ids: list[int], extra: tuple) -> None:
        if hashes and self.record_events:
            self._events.append(BlockStored(block_hashes=hashes, parent_block_hash=parent_hash, token_ids=token_ids,
                                            block_size=self.block_size, lora_id=None, medium=self.medium,
                                            cache_salt=salt_of(extra)))
