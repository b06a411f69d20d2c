"""The router's own chained block hashes: what the edge hashes a prompt with and the router indexes.

Engines name their blocks with hashes of their own choosing (vLLM: sha256 or a per-process
seed; the sim: blake2b with its extra keys). The router never relies on them: it recomputes
a chain from the token ids it sees in KV events, and the edge computes the same chain for a
prompt, so a prompt block and a cached block match exactly when their whole prefixes match::

    root       = blake2b-64(model, lora, cache_salt)         one per (model, LoRA, tenant salt)
    digest(b)  = fmix64(sum_k tokens[k] * R[k])             R: fixed odd 64-bit constants, one per position
    hash[i]    = hash[i-1] * P + digest(block i)            P: a fixed odd constant; all mod 2**64

Tokens are taken as uint32. The chain is linear in the digests, so a whole prompt's hashes are
one vectorized pass (``hash[i] = P**i * (P * root + sum_j digest_j * P**-j)``: a cumulative sum),
about 4 ns a token with numpy instead of ~36 ns with a blake2b call per block; short inputs take a
plain-Python path with the same result. The salt enters through the root, and because ``P**i`` is
odd (invertible), two roots never give the same hash for the same tokens: tenants with different
``cache_salt`` never match each other's blocks, as the engine (which salts its first block) never
shares them. Not a cryptographic hash: a client who crafts tokens to collide with another prompt's
chain only misroutes its own request (the engine checks its own hashes before it reuses a block).
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from operator import mul

import numpy as np

DEFAULT_BLOCK_SIZE = 16
_SEP = "\x1f"
_MASK = (1 << 64) - 1
_P = 0x9E3779B97F4A7C15  # the chain's multiplier (odd)
_C1, _C2 = 0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53  # murmur3's fmix64
_NUMPY_FROM_BLOCKS = 8  # below this many blocks the plain-Python path is faster (measured here)


def salt_root(model: str, lora: str | int | None = None, cache_salt: str | None = None) -> int:
    """The parent of a chain's first block: the model, the LoRA adapter and the tenant's salt."""
    key = _SEP.join((model, "" if lora is None else str(lora), cache_salt or ""))
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


def _position_multipliers(count: int) -> list[int]:
    """R[0..count): splitmix64's sequence from a fixed seed, made odd."""
    out, state = [], 0x243F6A8885A308D3
    for _ in range(count):
        state = (state + 0x9E3779B97F4A7C15) & _MASK
        z = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        out.append((z ^ (z >> 31)) | 1)
    return out


class _Tables:
    """R for a block size, and P**i, P**-i for i < n, grown on demand (numpy, uint64)."""

    def __init__(self) -> None:
        self.multipliers: dict[int, tuple[list[int], np.ndarray]] = {}
        self.powers = np.ones(1, dtype=np.uint64)
        self.inverse_powers = np.ones(1, dtype=np.uint64)

    def for_block(self, block_size: int) -> tuple[list[int], np.ndarray]:
        found = self.multipliers.get(block_size)
        if found is None:
            rs = _position_multipliers(block_size)
            found = self.multipliers[block_size] = (rs, np.array(rs, dtype=np.uint64))
        return found

    def powers_upto(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        have = len(self.powers)
        if have < n:
            size = max(n, 2 * have, 1024)
            steps = np.arange(size, dtype=np.uint64)
            self.powers = _pow(_P, steps)
            self.inverse_powers = _pow(pow(_P, -1, 1 << 64), steps)
        return self.powers, self.inverse_powers


def _pow(base: int, exponents: np.ndarray) -> np.ndarray:
    """base ** e mod 2**64 for every e, by square and multiply over the exponents' bits."""
    out, square, e = np.ones(len(exponents), dtype=np.uint64), base, exponents.copy()
    while e.any():
        odd = (e & np.uint64(1)).astype(bool)
        out[odd] *= np.uint64(square)
        square = square * square & _MASK
        e >>= np.uint64(1)
    return out


_TABLES = _Tables()


def _as_uint32(token_ids: Sequence[int] | bytes) -> np.ndarray:
    if isinstance(token_ids, bytes | bytearray | memoryview):
        return np.frombuffer(token_ids, dtype="<u4")
    if isinstance(token_ids, array) and token_ids.typecode in "IiLl" and token_ids.itemsize == 4:
        return np.frombuffer(token_ids, dtype=np.uint32)  # native order: the values are what count
    try:  # a list through array("I"): ~20x faster than numpy's own conversion of a list
        return np.frombuffer(array("I", token_ids), dtype=np.uint32)
    except OverflowError:  # negative ids (or ids past uint32): taken modulo 2**32
        return np.asarray(token_ids, dtype=np.int64).astype(np.uint32)


def _fmix(x: np.ndarray) -> np.ndarray:
    x ^= x >> np.uint64(33)
    x *= np.uint64(_C1)
    x ^= x >> np.uint64(33)
    x *= np.uint64(_C2)
    x ^= x >> np.uint64(33)
    return x


def _chain_numpy(parent: int, tokens: np.ndarray, blocks: int, block_size: int) -> list[int]:
    _, rs = _TABLES.for_block(block_size)
    powers, inverse = _TABLES.powers_upto(blocks + 1)
    digests = _fmix(tokens[:blocks * block_size].reshape(blocks, block_size).astype(np.uint64) @ rs)
    sums = np.cumsum(digests * inverse[:blocks], dtype=np.uint64)
    sums += np.uint64(parent * _P & _MASK)
    return (powers[:blocks] * sums).tolist()


def _chain_python(parent: int, tokens: Sequence[int], blocks: int, block_size: int) -> list[int]:
    rs, _ = _TABLES.for_block(block_size)
    hashes = []
    for start in range(0, blocks * block_size, block_size):
        x = sum(map(mul, tokens[start:start + block_size], rs)) & _MASK
        x ^= x >> 33
        x = x * _C1 & _MASK
        x ^= x >> 33
        x = x * _C2 & _MASK
        parent = (parent * _P + (x ^ (x >> 33))) & _MASK
        hashes.append(parent)
    return hashes


def chain(parent: int, token_ids: Sequence[int] | bytes, block_size: int = DEFAULT_BLOCK_SIZE) -> list[int]:
    """The chained hashes of the full blocks of ``token_ids`` after ``parent`` (a partial tail has none);
    ``token_ids`` may also be little-endian uint32 bytes."""
    is_bytes = isinstance(token_ids, bytes | bytearray | memoryview)
    blocks = (len(token_ids) // 4 if is_bytes else len(token_ids)) // block_size
    if blocks >= _NUMPY_FROM_BLOCKS or is_bytes:
        return _chain_numpy(parent, _as_uint32(token_ids), blocks, block_size) if blocks else []
    if blocks and min(token_ids[:blocks * block_size]) < 0:
        token_ids = [t & 0xFFFFFFFF for t in token_ids[:blocks * block_size]]
    return _chain_python(parent, token_ids, blocks, block_size)


def _tokens_bytes(token_ids: Sequence[int]) -> bytes:
    """Little-endian uint32s, whatever the machine's byte order (what ``PrefixHashes`` keeps and compares)."""
    try:
        packed = array("I", token_ids)
    except OverflowError:  # negative ids: as uint32, as ``chain`` takes them
        return _as_uint32(token_ids).astype("<u4").tobytes()
    if packed.itemsize != 4:
        return _as_uint32(token_ids).astype("<u4").tobytes()
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


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
            hashes = chain(salt_root(model, lora, cache_salt), data, block_size)
        else:
            self._entries.move_to_end(best)
            earlier = self._entries[best][2][:reused]
            hashes = earlier + chain(earlier[-1], data[reused * 4 * block_size:], block_size)
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
