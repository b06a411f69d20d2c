"""Triton sparse MLA decode attention over NVFP4 rows (and the same kernel over all-FP8 rows, the baseline).

Grid (batch, head blocks, splits): each program walks its share of the index list in tiles of BLOCK_T, skips -1 (and
out-of-range) slots, dequantizes rows in registers and keeps an online softmax in FP32 (exp2 domain). Scores use
fp16 tensor-core dots: q is rounded to fp16 (exact for bf16 q with |q| in [2^-14, 65504)), the dequantized values
are exact in fp16 (E2M1 * E4M3 has at most 6 significant bits, |v| <= 2688), probabilities are rounded to fp16 for the
P @ V dot, and all accumulation is FP32. (bf16 dots are avoided: the interpreter multiplies bf16 bit patterns.) Each
split writes (acc, max, sum) and combine_kernel merges the splits (flash-decoding).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.nvfp4.triton_kernels import (
    LATENT_BLOCKS,
    LATENT_BYTES,
    LATENT_DIM,
    PAIRS_PER_BLOCK,
    ROPE_DIM,
    ROPE_OFFSET,
    SCALE_OFFSET,
    e2m1_decode,
    e4m3_decode,
)

ROW_DIM: tl.constexpr = tl.constexpr(576)
NEG_INF: tl.constexpr = tl.constexpr(float("-inf"))


@triton.jit
def online_softmax_step(s, valid, m_i, l_i):
    """One tile of scores s [H, T] (log2 domain): returns probabilities, the rescale of the old state, new max, sum."""
    s = tl.where(valid[None, :], s, NEG_INF)
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == NEG_INF, 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def load_slots(idx_ptr, b, num_idx, t0, end, num_slots, stride_cache, cache_ptr, BLOCK_T: tl.constexpr):
    """Index tile -> (valid mask [T], row pointers [T, 1]); invalid slots point at row 0 and are masked."""
    t = t0 + tl.arange(0, BLOCK_T)
    slot = tl.load(idx_ptr + b.to(tl.int64) * num_idx + t, mask=t < end, other=-1)
    valid = (slot >= 0) & (slot < num_slots)
    return valid, cache_ptr + tl.where(valid, slot, 0).to(tl.int64)[:, None] * stride_cache


@triton.jit
def store_split(acc_ptr, ml_ptr, b, sp, heads, h_ok, num_heads, m_i, l_i):
    """Workspace row of (batch, split, head) and the stored max / sum; returns the acc row pointers [H, 1]."""
    ws = (b * tl.num_programs(2) + sp) * num_heads + heads
    tl.store(ml_ptr + ws * 2, m_i, mask=h_ok)
    tl.store(ml_ptr + ws * 2 + 1, l_i, mask=h_ok)
    return acc_ptr + ws.to(tl.int64)[:, None] * LATENT_DIM


@triton.jit
def nvfp4_decode_kernel(q_ptr, cache_ptr, idx_ptr, acc_ptr, ml_ptr, num_heads, num_slots, num_idx, tokens_per_split,
                        stride_cache, latent_qk_scale, rope_qk_scale,
                        BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr):
    """Partial attention of one (batch, head block, split) over NVFP4 rows [S, 352]."""
    b = tl.program_id(0)
    sp = tl.program_id(2)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < num_heads
    j = tl.arange(0, LATENT_BYTES)
    blk = tl.arange(0, LATENT_BLOCKS)
    r = tl.arange(0, ROPE_DIM)
    q_row = q_ptr + (b * num_heads + heads).to(tl.int64)[:, None] * ROW_DIM
    q_even = tl.load(q_row + 2 * j[None, :], mask=h_ok[:, None], other=0.0).to(tl.float16)
    q_odd = tl.load(q_row + 2 * j[None, :] + 1, mask=h_ok[:, None], other=0.0).to(tl.float16)
    q_rope = tl.load(q_row + LATENT_DIM + r[None, :], mask=h_ok[:, None], other=0.0).to(tl.float16)
    m_i = tl.full((BLOCK_H,), NEG_INF, tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc_lo = tl.zeros((BLOCK_H, LATENT_BYTES), tl.float32)
    acc_hi = tl.zeros((BLOCK_H, LATENT_BYTES), tl.float32)
    start = sp * tokens_per_split
    end = tl.minimum(start + tokens_per_split, num_idx)
    for t0 in range(start, end, BLOCK_T):
        valid, row = load_slots(idx_ptr, b, num_idx, t0, end, num_slots, stride_cache, cache_ptr, BLOCK_T)
        vm = valid[:, None]
        byte = tl.load(row + j[None, :], mask=vm, other=0).to(tl.int32)
        scale = e4m3_decode(tl.load(row + SCALE_OFFSET + blk[None, :], mask=vm, other=0))
        scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (BLOCK_T, LATENT_BLOCKS, PAIRS_PER_BLOCK)),
                           (BLOCK_T, LATENT_BYTES))
        k_lo = e2m1_decode(byte & 0xF) * scale
        k_hi = e2m1_decode(byte >> 4) * scale
        rope = e4m3_decode(tl.load(row + ROPE_OFFSET + r[None, :], mask=vm, other=0))
        s = tl.dot(q_even, tl.trans(k_lo.to(tl.float16))) + tl.dot(q_odd, tl.trans(k_hi.to(tl.float16)))
        s = s * latent_qk_scale + tl.dot(q_rope, tl.trans(rope.to(tl.float16))) * rope_qk_scale
        p, alpha, m_i, l_i = online_softmax_step(s, valid, m_i, l_i)
        p16 = p.to(tl.float16)
        acc_lo = tl.dot(p16, k_lo.to(tl.float16), acc_lo * alpha[:, None])
        acc_hi = tl.dot(p16, k_hi.to(tl.float16), acc_hi * alpha[:, None])
    acc_row = store_split(acc_ptr, ml_ptr, b, sp, heads, h_ok, num_heads, m_i, l_i)
    tl.store(acc_row + 2 * j[None, :], acc_lo, mask=h_ok[:, None])
    tl.store(acc_row + 2 * j[None, :] + 1, acc_hi, mask=h_ok[:, None])


@triton.jit
def fp8_decode_kernel(q_ptr, cache_ptr, idx_ptr, acc_ptr, ml_ptr, num_heads, num_slots, num_idx, tokens_per_split,
                      stride_cache, qk_scale,
                      BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr):
    """Partial attention of one (batch, head block, split) over all-FP8 rows [S, 576] (one per-tensor scale)."""
    b = tl.program_id(0)
    sp = tl.program_id(2)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < num_heads
    d = tl.arange(0, LATENT_DIM)
    r = tl.arange(0, ROPE_DIM)
    q_row = q_ptr + (b * num_heads + heads).to(tl.int64)[:, None] * ROW_DIM
    q_lat = tl.load(q_row + d[None, :], mask=h_ok[:, None], other=0.0).to(tl.float16)
    q_rope = tl.load(q_row + LATENT_DIM + r[None, :], mask=h_ok[:, None], other=0.0).to(tl.float16)
    m_i = tl.full((BLOCK_H,), NEG_INF, tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, LATENT_DIM), tl.float32)
    start = sp * tokens_per_split
    end = tl.minimum(start + tokens_per_split, num_idx)
    for t0 in range(start, end, BLOCK_T):
        valid, row = load_slots(idx_ptr, b, num_idx, t0, end, num_slots, stride_cache, cache_ptr, BLOCK_T)
        vm = valid[:, None]
        k = e4m3_decode(tl.load(row + d[None, :], mask=vm, other=0))
        rope = e4m3_decode(tl.load(row + LATENT_DIM + r[None, :], mask=vm, other=0))
        s = tl.dot(q_lat, tl.trans(k.to(tl.float16))) + tl.dot(q_rope, tl.trans(rope.to(tl.float16)))
        p, alpha, m_i, l_i = online_softmax_step(s * qk_scale, valid, m_i, l_i)
        acc = tl.dot(p.to(tl.float16), k.to(tl.float16), acc * alpha[:, None])
    acc_row = store_split(acc_ptr, ml_ptr, b, sp, heads, h_ok, num_heads, m_i, l_i)
    tl.store(acc_row + d[None, :], acc, mask=h_ok[:, None])


@triton.jit
def combine_kernel(acc_ptr, ml_ptr, out_ptr, num_heads, num_splits, out_scale):
    """Merge the splits of one (batch, head): out = out_scale * sum_s w_s acc_s / sum_s w_s l_s; zeros if empty."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, LATENT_DIM)
    m_max = tl.full((), NEG_INF, tl.float32)
    for sp in range(0, num_splits):
        m_max = tl.maximum(m_max, tl.load(ml_ptr + ((b * num_splits + sp) * num_heads + h) * 2))
    m_use = tl.where(m_max == NEG_INF, 0.0, m_max)
    o = tl.zeros((LATENT_DIM,), tl.float32)
    denom = tl.zeros((), tl.float32)
    for sp in range(0, num_splits):
        ws = (b * num_splits + sp) * num_heads + h
        w = tl.exp2(tl.load(ml_ptr + ws * 2) - m_use)
        denom += w * tl.load(ml_ptr + ws * 2 + 1)
        o += w * tl.load(acc_ptr + ws.to(tl.int64) * LATENT_DIM + d)
    o = tl.where(denom > 0, o / tl.where(denom > 0, denom, 1.0), 0.0) * out_scale
    tl.store(out_ptr + (b * num_heads + h).to(tl.int64) * LATENT_DIM + d, o)
