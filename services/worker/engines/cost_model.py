"""Step time of a simulated engine from a hardware/model profile: a roofline per step.

Pure functions of a :class:`Profile` (data in ``profiles/*.toml``; every constant there
says where it comes from). One engine step runs a batch of prefill chunks and decodes:

    compute  = 2 * active_params * batched_tokens                         (dense + active experts)
             + layers * sum over new tokens of
                 attention_flops_per_pair * keys attended (<= sparse_topk when sparse)
               + indexer_flops_per_pair * all previous tokens             (DSA's indexer scores every key)
    memory   = weight_bytes_per_step
             + layers * sum over decodes of
                 kv_row_bytes[dtype] * keys attended + indexer_bytes_per_token * context
    step     = step_overhead + max(compute / (peak_flops * prefill_mfu),
                                   memory  / (hbm_bytes_per_s * hbm_efficiency))

Prefill-heavy steps are compute bound, decode-only steps memory bound; a mixed step
pays the larger of the two, as a fused batch does. KV moves between workers at
``bytes / link_bytes_per_s + descriptors * descriptor_overhead_s``, where the descriptor
count follows the cache layout (see :func:`num_descriptors`).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from kernels.kv_layout import (
    LAYOUTS as LAYOUTS,  # re-exported: the layouts the sim knows
    scattered_descriptor_count,
)

PROFILES_DIR = Path(__file__).with_name("profiles")


@dataclass(slots=True, frozen=True)
class Profile:
    name: str
    description: str
    peak_flops: float
    prefill_mfu: float
    hbm_bytes_per_s: float
    hbm_efficiency: float
    step_overhead_s: float
    link_bytes_per_s: float
    descriptor_overhead_s: float
    host_link_bytes_per_s: float
    num_layers: int
    active_params: float
    weight_bytes_per_step: float
    kv_row_bytes: dict[str, int]
    indexer_bytes_per_token: int
    attention_flops_per_pair: float
    indexer_flops_per_pair: float
    sparse_topk: int  # 0: dense attention
    kv_budget_bytes: float
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    host_kv_budget_bytes: float = 0.0
    # Output-layer parameters run once per request per step (for the token it samples), when
    # active_params leaves them out: they matter for small models with large vocabularies.
    lm_head_params: float = 0.0

    @classmethod
    def from_toml(cls, text: str) -> Profile:
        data = tomllib.loads(text)
        fields = {"name": data["name"], "description": data.get("description", "")}
        for section in ("hardware", "model", "cache"):
            fields.update(data[section])
        return cls(**fields)

    def kv_bytes_per_token(self, kv_dtype: str) -> int:
        """Bytes of KV cache one token takes over all layers (indexer keys included)."""
        if kv_dtype not in self.kv_row_bytes:
            raise ValueError(f"profile {self.name} has no KV dtype {kv_dtype!r} (has {sorted(self.kv_row_bytes)})")
        return self.num_layers * (self.kv_row_bytes[kv_dtype] + self.indexer_bytes_per_token)

    def num_kv_blocks(self, kv_dtype: str, block_size: int | None = None) -> int:
        """Device KV blocks that fit the profile's KV budget."""
        return int(self.kv_budget_bytes // (self.kv_bytes_per_token(kv_dtype) * (block_size or self.block_size)))

    def num_host_kv_blocks(self, kv_dtype: str, block_size: int | None = None) -> int:
        return int(self.host_kv_budget_bytes // (self.kv_bytes_per_token(kv_dtype) * (block_size or self.block_size)))


def load_profile(name_or_path: str) -> Profile:
    """A profile by name (``profiles/<name>.toml``) or by path to a TOML file."""
    path = Path(name_or_path)
    if not path.suffix:
        path = PROFILES_DIR / f"{name_or_path}.toml"
    if not path.exists():
        known = ", ".join(sorted(p.stem for p in PROFILES_DIR.glob("*.toml")))
        raise ValueError(f"unknown sim profile {name_or_path!r} (known: {known})")
    return Profile.from_toml(path.read_text())


def _sum_min(start: int, count: int, cap: int) -> int:
    """sum(min(p, cap) for p in range(start + 1, start + count + 1)); cap 0 means no cap."""
    if count <= 0:
        return 0
    lo, hi = start + 1, start + count
    if cap <= 0 or hi <= cap:
        return (lo + hi) * count // 2
    if lo > cap:
        return cap * count
    return (lo + cap) * (cap - lo + 1) // 2 + cap * (hi - cap)


class CostModel:
    """Step and transfer times (seconds) for one profile and KV dtype."""

    __slots__ = ("profile", "kv_dtype", "_row", "_kv_token_bytes", "_flops_rate", "_bytes_rate")

    def __init__(self, profile: Profile, kv_dtype: str = "fp8") -> None:
        self.profile = profile
        self.kv_dtype = kv_dtype
        self._kv_token_bytes = profile.kv_bytes_per_token(kv_dtype)
        self._row = profile.kv_row_bytes[kv_dtype]
        self._flops_rate = profile.peak_flops * profile.prefill_mfu
        self._bytes_rate = profile.hbm_bytes_per_s * profile.hbm_efficiency

    def prefill_flops(self, num_new_tokens: int, num_context_tokens: int) -> float:
        """FLOPs to compute ``num_new_tokens`` after ``num_context_tokens`` already in the cache."""
        p = self.profile
        pairs_attended = _sum_min(num_context_tokens, num_new_tokens, p.sparse_topk)
        pairs_indexed = _sum_min(num_context_tokens, num_new_tokens, 0) if p.indexer_flops_per_pair else 0
        return (2.0 * p.active_params * num_new_tokens
                + p.num_layers * (p.attention_flops_per_pair * pairs_attended
                                  + p.indexer_flops_per_pair * pairs_indexed))

    def decode_bytes(self, context_len: int) -> float:
        """KV bytes one decode step reads for a request with ``context_len`` cached tokens."""
        p = self.profile
        attended = min(context_len, p.sparse_topk) if p.sparse_topk else context_len
        return p.num_layers * (self._row * attended + p.indexer_bytes_per_token * context_len)

    def step_work(self, prefills: Sequence[tuple[int, int]], decode_contexts: Sequence[int]) -> tuple[float, float]:
        """(FLOPs, bytes read) of one step: ``prefills`` as (new tokens, context before them), decodes by context."""
        p = self.profile
        flops = sum(self.prefill_flops(n, c) for n, c in prefills)
        flops += sum(self.prefill_flops(1, c) for c in decode_contexts)
        flops += 2.0 * p.lm_head_params * (len(prefills) + len(decode_contexts))
        memory = p.weight_bytes_per_step + sum(self.decode_bytes(c) for c in decode_contexts)
        return flops, memory

    def step_time(self, prefills: Sequence[tuple[int, int]], decode_contexts: Sequence[int]) -> float:
        """Seconds for one step: overhead + the larger of its compute and memory times."""
        if not prefills and not decode_contexts:
            return 0.0
        flops, memory = self.step_work(prefills, decode_contexts)
        return self.profile.step_overhead_s + max(flops / self._flops_rate, memory / self._bytes_rate)

    def kv_bytes(self, num_tokens: int) -> float:
        return float(num_tokens * self._kv_token_bytes)

    def transfer_time(self, num_tokens: int, block_size: int, layout: str) -> float:
        """Seconds to pull ``num_tokens`` of KV from another worker (bytes over the link + per-descriptor cost)."""
        if num_tokens <= 0:
            return 0.0
        p = self.profile
        descriptors = num_descriptors(-(-num_tokens // block_size), p.num_layers, layout)
        return self.kv_bytes(num_tokens) / p.link_bytes_per_s + descriptors * p.descriptor_overhead_s

    def transfer_size(self, num_tokens: int, block_size: int, layout: str) -> tuple[int, int]:
        """(bytes, descriptors) of pulling ``num_tokens`` of KV: what ``transfer_time`` charges for."""
        if num_tokens <= 0:
            return 0, 0
        blocks = -(-num_tokens // block_size)
        return int(self.kv_bytes(num_tokens)), num_descriptors(blocks, self.profile.num_layers, layout)

    def onload_time(self, num_tokens: int) -> float:
        """Seconds to copy ``num_tokens`` of KV from the host tier back to the device."""
        if num_tokens <= 0 or not self.profile.host_link_bytes_per_s:
            return 0.0
        return self.kv_bytes(num_tokens) / self.profile.host_link_bytes_per_s


def num_descriptors(num_blocks: int, num_layers: int, layout: str) -> int:
    """Transfer descriptors for ``num_blocks`` scattered blocks of a paged KV cache.

    Layer-major (LBHNC, vLLM's default: one tensor per layer, blocks inside it) keeps a
    block's layers apart, so every (block, layer) is its own region. Block-major (BLHNC:
    all layers of a block side by side) makes each block one region. Blocks are assumed
    not adjacent to each other (a busy pool scatters them): this is the count
    kernels/kv_layout's planner gives for such blocks (it merges runs that are adjacent on
    both sides, which only ever lowers it; tests/unit/test_cost_model.py checks the two agree).
    """
    return scattered_descriptor_count(num_blocks, num_layers, layout)
