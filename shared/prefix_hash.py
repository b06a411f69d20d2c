"""The router's own chained block hashes: what the edge hashes a prompt with and the router indexes.

Engines name their blocks with hashes of their own choosing (vLLM: sha256 or a per-process
seed; the sim: blake2b with its extra keys). The router never relies on them: it recomputes
a chain from the token ids it sees in KV events, and the edge computes the same chain for a
prompt, so a prompt block and a cached block match exactly when their whole prefixes match::

    root       = H(model, lora, cache_salt)                 one per (model, LoRA, tenant salt)
    hash[0]    = H(root,    tokens[0:B])
    hash[i]    = H(hash[i-1], tokens[i*B:(i+1)*B])          B = the router's block size

The salt enters through the root, so it reaches every block of the chain: two tenants with
different ``cache_salt`` never match each other's blocks, the way the engine (which salts
the first block) never shares them. blake2b over little-endian int32 tokens: stable across
processes, Python versions and machines (unlike ``hash``), about 1 ms for 16K tokens.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections import OrderedDict
from collections.abc import Sequence

DEFAULT_BLOCK_SIZE = 16
_SEP = "\x1f"


def salt_root(model: str, lora: str | int | None = None, cache_salt: str | None = None) -> int:
    """The parent of a chain's first block: the model, the LoRA adapter and the tenant's salt."""
    key = _SEP.join((model, "" if lora is None else str(lora), cache_salt or ""))
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


def _tokens_bytes(token_ids: Sequence[int]) -> bytes:
    """Little-endian int32s, whatever the machine's byte order."""
    if array("i").itemsize != 4 or array("I").itemsize != 4:
        return struct.pack(f"<{len(token_ids)}i", *token_ids)
    try:
        packed = array("I", token_ids)  # the same bytes for ids in [0, 2**31), and twice as fast to make as "i"
    except OverflowError:
        packed = array("i", token_ids)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def chain(parent: int, token_ids: Sequence[int], block_size: int = DEFAULT_BLOCK_SIZE) -> list[int]:
    """The chained hashes of the full blocks of ``token_ids`` after ``parent`` (a partial tail has none)."""
    return _chain_bytes(parent, _tokens_bytes(token_ids), block_size)


def _chain_bytes(parent: int, data: bytes, block_size: int) -> list[int]:
    """``chain`` over tokens already packed by ``_tokens_bytes``."""
    width = 4 * block_size
    hashes: list[int] = []
    blake2b, from_bytes = hashlib.blake2b, int.from_bytes
    for start in range(0, len(data) - width + 1, width):
        digest = blake2b(parent.to_bytes(8, "little") + data[start:start + width], digest_size=8).digest()
        parent = from_bytes(digest, "little")
        hashes.append(parent)
    return hashes


def prompt_hashes(token_ids: Sequence[int], model: str, lora: str | int | None = None,
                  cache_salt: str | None = None, block_size: int = DEFAULT_BLOCK_SIZE) -> list[int]:
    """The router hashes of a prompt's full blocks."""
    return chain(salt_root(model, lora, cache_salt), token_ids, block_size)


def shared_prefix(a: Sequence, b: Sequence, chunk: int = 1 << 16) -> int:
    """How many leading items (characters, bytes) ``a`` and ``b`` share, compared a chunk at a time at C speed."""
    limit, start = min(len(a), len(b)), 0
    while start < limit and a[start:start + chunk] == b[start:start + chunk]:
        start += chunk
    low, high = min(start, limit), min(start + chunk, limit)  # they part in [low, high]
    while low < high:
        middle = (low + high + 1) // 2
        if a[low:middle] == b[low:middle]:
            low = middle
        else:
            high = middle - 1
    return low


class PrefixHashes:
    """``prompt_hashes`` for prompts that repeat most of an earlier one (an agent's next turn): the blocks they
    share take the earlier prompt's hashes, only the rest is hashed. The same chain, always: a block's hash is a
    function of the tokens up to its end, and shared blocks are identical token for token. At most
    ``max_entries`` prompts and ``max_tokens`` tokens kept, the least recently used dropped first."""

    PROBE_BYTES = 4096

    def __init__(self, max_entries: int = 64, max_tokens: int = 8 << 20, min_tokens: int = 1024) -> None:
        """``min_tokens``: a shorter prompt is hashed whole and not kept (it costs little, and keeping every short
        chat request would push the long agent histories out)."""
        self.max_entries, self.max_tokens, self.min_tokens = max_entries, max_tokens, min_tokens
        self._entries: OrderedDict[int, tuple[tuple, bytes, list[int]]] = OrderedDict()  # (chain key, tokens, hashes)
        self._next_key = 0
        self.num_tokens = 0
        self.num_reused = 0  # blocks whose hashes were taken from an earlier prompt

    def hashes(self, token_ids: Sequence[int], model: str, lora: str | int | None = None,
               cache_salt: str | None = None, block_size: int = DEFAULT_BLOCK_SIZE) -> list[int]:
        if len(token_ids) < self.min_tokens:
            return prompt_hashes(token_ids, model, lora, cache_salt, block_size)
        chain_key, data = (model, lora, cache_salt, block_size), _tokens_bytes(token_ids)
        best, reused = None, 0
        for key, (other_key, other, _hashes) in self._entries.items():
            probe = min(self.PROBE_BYTES, len(other), len(data))
            if other_key == chain_key and other[:probe] == data[:probe]:
                blocks = shared_prefix(other, data) // (4 * block_size)
                if best is None or blocks > reused:
                    best, reused = key, blocks
        if best is None or reused == 0:
            hashes = _chain_bytes(salt_root(model, lora, cache_salt), data, block_size)
        else:
            self._entries.move_to_end(best)
            earlier = self._entries[best][2][:reused]
            hashes = earlier + _chain_bytes(earlier[-1], data[reused * 4 * block_size:], block_size)
            self.num_reused += reused
        self._remember(chain_key, data, hashes, best if reused * 4 * block_size >= len(data) // 2 else None)
        return hashes

    def _remember(self, chain_key: tuple, data: bytes, hashes: list[int], replaced: int | None) -> None:
        if replaced is not None:  # the new prompt continues that one: it takes its place
            self.num_tokens -= len(self._entries.pop(replaced)[1]) // 4
        if len(data) // 4 <= self.max_tokens:
            self._entries[self._next_key] = (chain_key, data, hashes)
            self._next_key += 1
            self.num_tokens += len(data) // 4
        while self._entries and (len(self._entries) > self.max_entries or self.num_tokens > self.max_tokens):
            self.num_tokens -= len(self._entries.popitem(last=False)[1][1]) // 4
