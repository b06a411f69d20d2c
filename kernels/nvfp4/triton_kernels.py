"""Triton codec for NVFP4 / FP8 MLA KV rows: E4M3 / E2M1 helpers and the pack / unpack kernels.

E4M3 encoding is integer bit math on the FP32 pattern (exact round-to-nearest-even, no float8 casts: the interpreter's
fp32 -> float8e4nv cast is wrong); decoding uses the native float8e4nv -> fp32 conversion. Divisions that decide
rounding use div_rn, so the GPU bits match the torch reference (reference.py) as well as the interpreter's.
"""

from __future__ import annotations

import triton
import triton.language as tl

E4M3_MAX: tl.constexpr = tl.constexpr(448.0)
E2M1_MAX: tl.constexpr = tl.constexpr(6.0)
LATENT_DIM: tl.constexpr = tl.constexpr(512)
ROPE_DIM: tl.constexpr = tl.constexpr(64)
LATENT_BYTES: tl.constexpr = tl.constexpr(256)
LATENT_BLOCKS: tl.constexpr = tl.constexpr(32)
PAIRS_PER_BLOCK: tl.constexpr = tl.constexpr(8)
SCALE_OFFSET: tl.constexpr = tl.constexpr(256)
ROPE_OFFSET: tl.constexpr = tl.constexpr(288)


@triton.jit
def round_e4m3(x):
    """FP32 -> nearest E4M3 value as FP32 (ties to even, saturating at 448, sign of zero kept)."""
    negative = x.to(tl.int32, bitcast=True) < 0
    a = tl.minimum(tl.abs(x), E4M3_MAX)
    bits = a.to(tl.int32, bitcast=True)
    biased = (bits >> 23) & 0xFF
    exponent = tl.maximum(biased, 1) - 127
    significand = (bits & 0x7FFFFF) | tl.where(biased > 0, 0x800000, 0)
    kept = tl.maximum(exponent, -6)  # below 2^-6 E4M3 is subnormal: a fixed step of 2^-9
    drop = tl.minimum(20 + kept - exponent, 25)
    half = tl.full(drop.shape, 1, tl.int32) << (drop - 1)
    q = (significand + half - 1 + ((significand >> drop) & 1)) >> drop
    step = ((kept - 3 + 127) << 23).to(tl.float32, bitcast=True)
    r = q.to(tl.float32) * step
    return tl.where(negative, -r, r)


@triton.jit
def e4m3_bits(r):
    """An FP32 value already on the E4M3 grid (round_e4m3 output) -> its E4M3 bit pattern (int32 0..255)."""
    bits = r.to(tl.int32, bitcast=True)
    a = tl.abs(r)
    abits = a.to(tl.int32, bitcast=True)
    biased = (abits >> 23) & 0xFF
    normal = ((biased - 120) << 3) | ((abits >> 20) & 7)
    subnormal = (a * 512.0).to(tl.int32)
    return tl.where(biased >= 121, normal, subnormal) | ((bits >> 24) & 0x80)


@triton.jit
def e4m3_decode(u):
    """E4M3 bit patterns (any integer type, 0..255) -> FP32."""
    return u.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def e2m1_encode(v, x):
    """Scaled FP32 values v -> E2M1 codes (int32, ties to even, saturating at 6); the sign comes from x's sign bit."""
    a = tl.abs(v)
    mag = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
    mag += (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32)
    return mag | ((x.to(tl.int32, bitcast=True) >> 28) & 0x8)


@triton.jit
def e2m1_decode(c):
    """E2M1 codes (int32 0..15) -> FP32, built as IEEE bits: 0 / 0.5 for exponent 0, else 2^(e-1) * (1 + m/2)."""
    e = (c >> 1) & 3
    m = c & 1
    bits = tl.where(e == 0, m * 0x3F000000, ((e + 126) << 23) | (m << 22))
    return (bits | ((c & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def nvfp4_pack_kernel(x_ptr, out_ptr, n_rows, stride_x, stride_out, global_scale, rope_scale,
                      BLOCK_R: tl.constexpr):
    """Rows [N, 576] -> NVFP4 rows [N, 352]; BLOCK_R rows per program."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    blk = tl.arange(0, LATENT_BLOCKS)
    pair = tl.arange(0, PAIRS_PER_BLOCK)
    m3 = row_ok[:, None, None]
    x_row = x_ptr + rows.to(tl.int64)[:, None, None] * stride_x
    even = x_row + blk[None, :, None] * 16 + pair[None, None, :] * 2
    xe = tl.load(even, mask=m3, other=0.0).to(tl.float32)
    xo = tl.load(even + 1, mask=m3, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(xe), axis=2), tl.max(tl.abs(xo), axis=2))
    scale = round_e4m3(tl.math.div_rn(amax, global_scale * E2M1_MAX))
    denom = (scale * global_scale)[:, :, None]
    safe = tl.where(denom > 0, denom, 1.0)
    ce = e2m1_encode(tl.where(denom > 0, tl.math.div_rn(xe, safe), 0.0), xe)
    co = e2m1_encode(tl.where(denom > 0, tl.math.div_rn(xo, safe), 0.0), xo)
    o_row = out_ptr + rows.to(tl.int64) * stride_out
    byte_ptr = o_row[:, None, None] + blk[None, :, None] * PAIRS_PER_BLOCK + pair[None, None, :]
    tl.store(byte_ptr, (ce | (co << 4)).to(tl.uint8), mask=m3)
    tl.store(o_row[:, None] + SCALE_OFFSET + blk[None, :], e4m3_bits(scale).to(tl.uint8), mask=row_ok[:, None])
    r = tl.arange(0, ROPE_DIM)
    x_rope = x_ptr + rows.to(tl.int64)[:, None] * stride_x + LATENT_DIM + r[None, :]
    xr = tl.load(x_rope, mask=row_ok[:, None], other=0.0).to(tl.float32)
    rope = e4m3_bits(round_e4m3(tl.math.div_rn(xr, rope_scale)))
    tl.store(o_row[:, None] + ROPE_OFFSET + r[None, :], rope.to(tl.uint8), mask=row_ok[:, None])


@triton.jit
def nvfp4_unpack_kernel(p_ptr, out_ptr, n_rows, stride_p, stride_out, global_scale, rope_scale,
                        BLOCK_R: tl.constexpr):
    """NVFP4 rows [N, 352] -> FP32 [N, 576]: latent = (code * block_scale) * global_scale, rope = e4m3 * rope_scale."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    blk = tl.arange(0, LATENT_BLOCKS)
    pair = tl.arange(0, PAIRS_PER_BLOCK)
    m3 = row_ok[:, None, None]
    p_row = p_ptr + rows.to(tl.int64) * stride_p
    byte = tl.load(p_row[:, None, None] + blk[None, :, None] * PAIRS_PER_BLOCK + pair[None, None, :],
                   mask=m3, other=0).to(tl.int32)
    scale = e4m3_decode(tl.load(p_row[:, None] + SCALE_OFFSET + blk[None, :], mask=row_ok[:, None], other=0))
    lo = (e2m1_decode(byte & 0xF) * scale[:, :, None]) * global_scale
    hi = (e2m1_decode(byte >> 4) * scale[:, :, None]) * global_scale
    o_row = out_ptr + rows.to(tl.int64) * stride_out
    even = o_row[:, None, None] + blk[None, :, None] * 16 + pair[None, None, :] * 2
    tl.store(even, lo, mask=m3)
    tl.store(even + 1, hi, mask=m3)
    r = tl.arange(0, ROPE_DIM)
    rope = e4m3_decode(tl.load(p_row[:, None] + ROPE_OFFSET + r[None, :], mask=row_ok[:, None], other=0))
    tl.store(o_row[:, None] + LATENT_DIM + r[None, :], rope * rope_scale, mask=row_ok[:, None])


@triton.jit
def fp8_pack_kernel(x_ptr, out_ptr, n_elems, scale, BLOCK: tl.constexpr):
    """Flat values -> E4M3 bits of value / scale (the all-FP8 row, vLLM's fp8 KV with a per-tensor scale)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n_elems
    x = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, e4m3_bits(round_e4m3(tl.math.div_rn(x, scale))).to(tl.uint8), mask=ok)
