"""Launchers for the Triton kernels (GPU tensors; CPU tensors under TRITON_INTERPRET=1 for correctness checks)."""

from __future__ import annotations

import math

import torch
import triton

from kernels.nvfp4 import triton_attention as attn, triton_kernels as codec
from kernels.nvfp4.format import LATENT_DIM, NVFP4_ROW_BYTES, ROW_DIM, Nvfp4Scales
from kernels.nvfp4.reference import to_f32

PACK_BLOCK_ROWS = 8
FP8_PACK_BLOCK = 1024
BLOCK_H = 16
# Tile sizes without register spills on sm_90 at 8 warps (ptxas -v): the NVFP4 tile decodes more in registers.
NVFP4_BLOCK_T = 16
FP8_BLOCK_T = 32
ATTN_WARPS = 8
MAX_SPLITS = 64
SPLIT_WAVES = 2  # aim for this many programs per SM before splitting the index list further
LOG2E = 1.4426950408889634


def _rows(rows: torch.Tensor) -> torch.Tensor:
    if rows.dim() != 2 or rows.shape[1] != ROW_DIM:
        raise ValueError(f"expected rows [N, {ROW_DIM}], got {tuple(rows.shape)}")
    return rows if rows.stride(1) == 1 else rows.contiguous()


def nvfp4_pack(rows: torch.Tensor, global_scale: float | None = None,
               rope_scale: float | None = None) -> tuple[torch.Tensor, Nvfp4Scales]:
    """rows [N, 576] (fp16/bf16/fp32) -> (uint8 [N, 352], scales); bit-identical to reference.pack_nvfp4."""
    rows = _rows(rows)
    scales = Nvfp4Scales(to_f32(1.0 if global_scale is None else global_scale),
                         to_f32(1.0 if rope_scale is None else rope_scale))
    out = torch.empty(rows.shape[0], NVFP4_ROW_BYTES, dtype=torch.uint8, device=rows.device)
    grid = (triton.cdiv(rows.shape[0], PACK_BLOCK_ROWS),)
    codec.nvfp4_pack_kernel[grid](rows, out, rows.shape[0], rows.stride(0), out.stride(0), scales.global_scale,
                                  scales.rope_scale, BLOCK_R=PACK_BLOCK_ROWS)
    return out, scales


def nvfp4_unpack(packed: torch.Tensor, scales: Nvfp4Scales = Nvfp4Scales()) -> torch.Tensor:
    """uint8 [N, 352] -> FP32 [N, 576]; bit-identical to reference.unpack_nvfp4."""
    if packed.dim() != 2 or packed.shape[1] != NVFP4_ROW_BYTES or packed.stride(1) != 1:
        raise ValueError(f"expected contiguous rows [N, {NVFP4_ROW_BYTES}], got {tuple(packed.shape)}")
    out = torch.empty(packed.shape[0], ROW_DIM, dtype=torch.float32, device=packed.device)
    grid = (triton.cdiv(packed.shape[0], PACK_BLOCK_ROWS),)
    codec.nvfp4_unpack_kernel[grid](packed, out, packed.shape[0], packed.stride(0), out.stride(0),
                                    to_f32(scales.global_scale), to_f32(scales.rope_scale), BLOCK_R=PACK_BLOCK_ROWS)
    return out


def fp8_pack(rows: torch.Tensor, scale: float | None = None) -> tuple[torch.Tensor, float]:
    """rows [N, 576] -> (uint8 [N, 576] E4M3 of rows / scale, scale); bit-identical to reference.pack_fp8."""
    rows = _rows(rows).contiguous()
    scale = to_f32(1.0 if scale is None else scale)
    out = torch.empty(rows.shape, dtype=torch.uint8, device=rows.device)
    codec.fp8_pack_kernel[(triton.cdiv(rows.numel(), FP8_PACK_BLOCK),)](rows, out, rows.numel(), scale,
                                                                       BLOCK=FP8_PACK_BLOCK)
    return out, scale


def default_splits(batch: int, head_blocks: int, num_idx: int, block_t: int, device: torch.device) -> int:
    """How many pieces each index list is cut into: enough programs to fill the GPU, 1 off-GPU."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = math.ceil(SPLIT_WAVES * sms / max(1, batch * head_blocks))
    return max(1, min(want, MAX_SPLITS, triton.cdiv(max(num_idx, 1), block_t)))


def _decode(kernel, scalar_args: tuple, out_scale: float, q: torch.Tensor, cache: torch.Tensor,
            indices: torch.Tensor, num_splits: int | None, block_h: int, block_t: int) -> torch.Tensor:
    single = q.dim() == 2
    qb = (q[None] if single else q).contiguous()
    ib = (indices[None] if single else indices).to(torch.int32).contiguous()
    if qb.shape[-1] != ROW_DIM or ib.shape[0] != qb.shape[0] or cache.stride(1) != 1:
        raise ValueError("expected q [B, H, 576], indices [B, T] and a cache with contiguous rows")
    batch, heads, num_idx = qb.shape[0], qb.shape[1], ib.shape[1]
    head_blocks = triton.cdiv(heads, block_h)
    splits = num_splits or default_splits(batch, head_blocks, num_idx, block_t, q.device)
    per_split = triton.cdiv(triton.cdiv(max(num_idx, 1), splits), block_t) * block_t
    splits = triton.cdiv(max(num_idx, 1), per_split)
    acc = torch.empty(batch, splits, heads, LATENT_DIM, dtype=torch.float32, device=q.device)
    ml = torch.empty(batch, splits, heads, 2, dtype=torch.float32, device=q.device)
    kernel[(batch, head_blocks, splits)](qb, cache, ib, acc, ml, heads, cache.shape[0], num_idx, per_split,
                                         cache.stride(0), *scalar_args, BLOCK_H=block_h,
                                         BLOCK_T=block_t, num_warps=ATTN_WARPS)
    out = torch.empty(batch, heads, LATENT_DIM, dtype=torch.float32, device=q.device)
    attn.combine_kernel[(batch, heads)](acc, ml, out, heads, splits, out_scale)
    return out[0] if single else out


def nvfp4_decode_attention(q: torch.Tensor, cache: torch.Tensor, scales: Nvfp4Scales, indices: torch.Tensor,
                           sm_scale: float, num_splits: int | None = None, block_h: int = BLOCK_H,
                           block_t: int = NVFP4_BLOCK_T) -> torch.Tensor:
    """q [H, 576] or [B, H, 576], NVFP4 cache uint8 [S, 352], indices int [T] / [B, T] (-1 = empty)
    -> FP32 [.., 512]."""
    latent = to_f32(scales.global_scale * sm_scale * LOG2E)
    rope = to_f32(scales.rope_scale * sm_scale * LOG2E)
    return _decode(attn.nvfp4_decode_kernel, (latent, rope), to_f32(scales.global_scale), q, cache, indices,
                   num_splits, block_h, block_t)


def fp8_decode_attention(q: torch.Tensor, cache: torch.Tensor, scale: float, indices: torch.Tensor, sm_scale: float,
                         num_splits: int | None = None, block_h: int = BLOCK_H,
                         block_t: int = FP8_BLOCK_T) -> torch.Tensor:
    """The same attention over an all-FP8 cache uint8 [S, 576] with one per-tensor scale."""
    return _decode(attn.fp8_decode_kernel, (to_f32(scale * sm_scale * LOG2E),), to_f32(scale), q, cache, indices,
                   num_splits, block_h, block_t)
