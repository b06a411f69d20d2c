"""Torch reference for NVFP4 / FP8 MLA KV rows and sparse decode attention over them (FP32 math throughout).

E4M3 rounding goes through torch's float8_e4m3fn (round-to-nearest-even, saturated at +-448 first); E2M1 rounding
uses the round-to-nearest-even midpoints of E2M1_VALUES. The Triton kernels reproduce these bits exactly.
"""

from __future__ import annotations

from typing import Callable

import torch

from kernels.nvfp4.format import (
    E2M1_MAX,
    E2M1_SIGN,
    E2M1_VALUES,
    E4M3_MAX,
    FP4_BLOCK,
    LATENT_BLOCKS,
    LATENT_DIM,
    NVFP4_ROW_BYTES,
    ROPE_OFFSET,
    ROW_DIM,
    SCALE_OFFSET,
    Nvfp4Scales,
)

# |v| above each midpoint moves one E2M1 code up; ">=" where the upper neighbour has the even code (ties to even).
E2M1_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def to_f32(value: float) -> float:
    """A Python float rounded to FP32, as the kernels receive scalar scales."""
    return float(torch.tensor(value, dtype=torch.float32))


def round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """FP32 values rounded to the nearest E4M3 value (saturating), as FP32."""
    return e4m3_bits(x).view(torch.float8_e4m3fn).float()


def e4m3_bits(x: torch.Tensor) -> torch.Tensor:
    """FP32 values rounded to E4M3 (saturating at +-448, sign of zero kept), as uint8 bit patterns."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def e4m3_decode(bits: torch.Tensor) -> torch.Tensor:
    """uint8 E4M3 bit patterns -> FP32."""
    return bits.view(torch.float8_e4m3fn).float()


def e2m1_encode(v: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
    """Scaled FP32 values -> E2M1 codes (int32, sign in bit 3, saturating at 6)."""
    a = v.abs()
    mag = torch.zeros_like(a, dtype=torch.int32)
    for mid, tie_up in E2M1_MIDPOINTS:
        mag += (a >= mid if tie_up else a > mid).to(torch.int32)
    return mag | (negative.to(torch.int32) * E2M1_SIGN)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (0..15) -> FP32."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=codes.device)
    return table[codes.long()]


def calibrate_nvfp4_scales(rows: torch.Tensor) -> Nvfp4Scales:
    """Per-tensor scales from the data: the largest latent block scale lands on E4M3's max, rope amax on 448."""
    latent_amax = float(rows[..., :LATENT_DIM].float().abs().amax()) if rows.numel() else 0.0
    rope_amax = float(rows[..., LATENT_DIM:].float().abs().amax()) if rows.numel() else 0.0
    gs = latent_amax / (E2M1_MAX * E4M3_MAX) if latent_amax > 0 else 1.0
    rs = rope_amax / E4M3_MAX if rope_amax > 0 else 1.0
    return Nvfp4Scales(to_f32(gs), to_f32(rs))


def pack_nvfp4(rows: torch.Tensor, global_scale: float | None = None,
               rope_scale: float | None = None) -> tuple[torch.Tensor, Nvfp4Scales]:
    """rows [N, 576] (fp16/bf16/fp32) -> (uint8 [N, 352], scales). None scales mean 1.0 (no per-tensor scaling)."""
    if rows.dim() != 2 or rows.shape[1] != ROW_DIM:
        raise ValueError(f"expected rows [N, {ROW_DIM}], got {tuple(rows.shape)}")
    scales = Nvfp4Scales(to_f32(1.0 if global_scale is None else global_scale),
                         to_f32(1.0 if rope_scale is None else rope_scale))
    x = rows.float()
    n = x.shape[0]
    gs = torch.tensor(scales.global_scale, dtype=torch.float32, device=x.device)
    rs = torch.tensor(scales.rope_scale, dtype=torch.float32, device=x.device)
    blocks = x[:, :LATENT_DIM].reshape(n, LATENT_BLOCKS, FP4_BLOCK)
    block_scale = round_e4m3(blocks.abs().amax(-1) / (gs * E2M1_MAX))
    denom = (block_scale * gs)[..., None]
    v = torch.where(denom > 0, blocks / torch.where(denom > 0, denom, torch.ones_like(denom)), torch.zeros_like(blocks))
    codes = e2m1_encode(v, torch.signbit(blocks)).reshape(n, LATENT_DIM)
    out = torch.empty(n, NVFP4_ROW_BYTES, dtype=torch.uint8, device=x.device)
    out[:, :SCALE_OFFSET] = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    out[:, SCALE_OFFSET:ROPE_OFFSET] = e4m3_bits(block_scale)
    out[:, ROPE_OFFSET:] = e4m3_bits(x[:, LATENT_DIM:] / rs)
    return out, scales


def unpack_nvfp4(packed: torch.Tensor, scales: Nvfp4Scales = Nvfp4Scales()) -> torch.Tensor:
    """uint8 [..., 352] -> FP32 [..., 576]: latent = (code * block_scale) * global_scale, rope = e4m3 * rope_scale."""
    lead = packed.shape[:-1]
    packed = packed.reshape(-1, NVFP4_ROW_BYTES)
    n = packed.shape[0]
    byte = packed[:, :SCALE_OFFSET].to(torch.int32)
    codes = torch.stack((byte & 0xF, byte >> 4), dim=-1).reshape(n, LATENT_BLOCKS, FP4_BLOCK)
    block_scale = e4m3_decode(packed[:, SCALE_OFFSET:ROPE_OFFSET].contiguous())
    gs = torch.tensor(scales.global_scale, dtype=torch.float32, device=packed.device)
    rs = torch.tensor(scales.rope_scale, dtype=torch.float32, device=packed.device)
    latent = (e2m1_decode(codes) * block_scale[..., None]) * gs
    rope = e4m3_decode(packed[:, ROPE_OFFSET:].contiguous()) * rs
    return torch.cat((latent.reshape(n, LATENT_DIM), rope), dim=1).reshape(*lead, ROW_DIM)


def calibrate_fp8_scale(rows: torch.Tensor) -> float:
    """Per-tensor FP8 scale that maps the amax onto 448 (1.0 for an all-zero tensor)."""
    amax = float(rows.float().abs().amax()) if rows.numel() else 0.0
    return to_f32(amax / E4M3_MAX if amax > 0 else 1.0)


def pack_fp8(rows: torch.Tensor, scale: float | None = None) -> tuple[torch.Tensor, float]:
    """rows [N, 576] -> (uint8 [N, 576] E4M3 of rows / scale, scale); None means 1.0 (vLLM's default k_scale)."""
    scale = to_f32(1.0 if scale is None else scale)
    s = torch.tensor(scale, dtype=torch.float32, device=rows.device)
    return e4m3_bits(rows.float() / s), scale


def unpack_fp8(packed: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """uint8 [..., 576] E4M3 -> FP32 values * scale."""
    return e4m3_decode(packed.contiguous()) * torch.tensor(scale, dtype=torch.float32, device=packed.device)


def _gather(indices: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = indices.long()
    if bool((idx >= num_slots).any()) or bool((idx < -1).any()):
        raise ValueError(f"indices must be -1 (empty) or in [0, {num_slots})")
    return idx.clamp(min=0), idx >= 0


def attend(q: torch.Tensor, k: torch.Tensor, valid: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """q [B, H, 576], gathered rows k [B, T, 576] (FP32), valid [B, T] -> FP32 [B, H, 512]; no valid rows -> zeros."""
    s = torch.einsum("bhd,btd->bht", q.float(), k.float()) * sm_scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(s - m)
    denom = p.sum(-1, keepdim=True)
    out = torch.einsum("bht,btd->bhd", p, k[..., :LATENT_DIM].float())
    return torch.where(denom > 0, out / torch.where(denom > 0, denom, torch.ones_like(denom)), torch.zeros_like(out))


def _batched(q: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    if q.dim() == 2:
        return q[None], indices[None], True
    return q, indices, False


def _sparse_attention(q: torch.Tensor, num_slots: int, rows: Callable[[torch.Tensor], torch.Tensor],
                      indices: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """Gather the selected rows (``rows(slot ids)`` -> float [.., 576]) and attend; batched or not."""
    qb, ib, single = _batched(q, indices)
    idx, valid = _gather(ib, num_slots)
    out = attend(qb, rows(idx), valid, sm_scale)
    return out[0] if single else out


def decode_attention(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """Sparse MLA decode over a dense float cache kv [S, 576]: q [H, 576] + indices [T] (or batched [B, ...])."""
    return _sparse_attention(q, kv.shape[0], lambda idx: kv[idx].float(), indices, sm_scale)


def nvfp4_decode_attention(q: torch.Tensor, cache: torch.Tensor, scales: Nvfp4Scales, indices: torch.Tensor,
                           sm_scale: float) -> torch.Tensor:
    """Same as decode_attention over an NVFP4 cache uint8 [S, 352] (rows dequantized after the gather)."""
    return _sparse_attention(q, cache.shape[0], lambda idx: unpack_nvfp4(cache[idx], scales), indices, sm_scale)


def fp8_decode_attention(q: torch.Tensor, cache: torch.Tensor, scale: float, indices: torch.Tensor,
                         sm_scale: float) -> torch.Tensor:
    """Same as decode_attention over an FP8 cache uint8 [S, 576] with one per-tensor scale."""
    return _sparse_attention(q, cache.shape[0], lambda idx: unpack_fp8(cache[idx], scale), indices, sm_scale)
