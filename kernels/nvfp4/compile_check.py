"""Compile every NVFP4 / FP8 Triton kernel for a GPU target without a GPU (Triton's bundled LLVM + ptxas).

    python -m kernels.nvfp4.compile_check [--arch 90]

Prints JSON (per kernel: shared memory, and registers / spill bytes from `ptxas -v` when the bundled ptxas can read the
PTX) and exits 1 if any kernel fails to compile. It catches lowering errors the CPU interpreter never sees.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # the kernels must be JIT functions, not interpreted ones

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kernels.nvfp4 import api, triton_attention as attn, triton_kernels as codec  # noqa: E402

DECODE_SIG = {"q_ptr": "*bf16", "cache_ptr": "*u8", "idx_ptr": "*i32", "acc_ptr": "*fp32", "ml_ptr": "*fp32",
              "num_heads": "i32", "num_slots": "i32", "num_idx": "i32", "tokens_per_split": "i32",
              "stride_cache": "i32"}
ROWS_SIG = {"n_rows": "i32", "stride_x": "i32", "stride_out": "i32", "global_scale": "fp32", "rope_scale": "fp32"}
TILES = {"BLOCK_H": api.BLOCK_H}
KERNELS = (
    ("nvfp4_decode", attn.nvfp4_decode_kernel,
     {**DECODE_SIG, "latent_qk_scale": "fp32", "rope_qk_scale": "fp32"}, {**TILES, "BLOCK_T": api.NVFP4_BLOCK_T},
     api.ATTN_WARPS),
    ("fp8_decode", attn.fp8_decode_kernel, {**DECODE_SIG, "qk_scale": "fp32"}, {**TILES, "BLOCK_T": api.FP8_BLOCK_T},
     api.ATTN_WARPS),
    ("combine", attn.combine_kernel, {"acc_ptr": "*fp32", "ml_ptr": "*fp32", "out_ptr": "*fp32", "num_heads": "i32",
                                      "num_splits": "i32", "out_scale": "fp32"}, {}, 4),
    ("nvfp4_pack", codec.nvfp4_pack_kernel, {"x_ptr": "*bf16", "out_ptr": "*u8", **ROWS_SIG},
     {"BLOCK_R": api.PACK_BLOCK_ROWS}, 4),
    ("nvfp4_unpack", codec.nvfp4_unpack_kernel,
     {"p_ptr": "*u8", "out_ptr": "*fp32", **{k.replace("_x", "_p"): v for k, v in ROWS_SIG.items()}},
     {"BLOCK_R": api.PACK_BLOCK_ROWS}, 4),
    ("fp8_pack", codec.fp8_pack_kernel, {"x_ptr": "*bf16", "out_ptr": "*u8", "n_elems": "i32", "scale": "fp32"},
     {"BLOCK": api.FP8_PACK_BLOCK}, 4),
)


def ptxas_info(ptx: str, arch: int) -> dict:
    """Registers and spill bytes from the bundled ptxas (empty when no bundled ptxas accepts this PTX version)."""
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        for name in ("ptxas-blackwell", "ptxas"):
            exe = os.path.join(bin_dir, name)
            if not os.path.exists(exe):
                continue
            run = subprocess.run([exe, "-v", "--gpu-name", f"sm_{arch}a", path, "-o", path + ".cubin"],
                                 capture_output=True, text=True)
            if run.returncode == 0:
                regs = re.search(r"Used (\d+) registers", run.stderr)
                spills = re.search(r"(\d+) bytes spill stores", run.stderr)
                return {"registers": int(regs.group(1)) if regs else None,
                        "spill_store_bytes": int(spills.group(1)) if spills else None}
    return {}


def check(arch: int) -> dict:
    """Compile each kernel; returns {name: info or {"error": ...}}."""
    target = GPUTarget("cuda", arch, 32)
    results = {}
    for name, fn, sig, consts, warps in KERNELS:
        signature = {**sig, **{k: "constexpr" for k in consts}}
        try:
            kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=consts), target=target,
                                    options={"num_warps": warps})
            results[name] = {"shared_bytes": kernel.metadata.shared, "num_warps": warps, **consts,
                             **ptxas_info(kernel.asm["ptx"], arch)}
        except Exception as exc:  # report every kernel, not just the first failure
            results[name] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90)
    results = check(parser.parse_args().arch)
    print(json.dumps(results, indent=1))
    return 1 if any("error" in r for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
