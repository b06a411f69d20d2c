"""NVFP4 KV-cache rows for MLA (576 values -> 352 bytes): format, torch reference, Triton kernels (see README)."""

from kernels.nvfp4.format import NVFP4_ROW_BYTES, ROW_DIM, Nvfp4Scales, capacity_ratio, row_bytes

__all__ = ["NVFP4_ROW_BYTES", "ROW_DIM", "Nvfp4Scales", "capacity_ratio", "row_bytes"]
