"""NVFP4 / FP8 Triton kernels on CPU through the Triton interpreter, against the torch reference.

TRITON_INTERPRET only counts when a @triton.jit function is decorated, and triton.language's own jit functions (tl.max,
tl.sum) are decorated when triton is first imported. So this module imports triton and the kernels with the variable
set and restores it right after; the `api` fixture sets it again only while a test runs. If triton was already imported
without it (an earlier test module imported vLLM, say), the kernel tests skip and test_interpreter_suite_in_subprocess
runs this file in a fresh interpreter instead. test_kernels_compile_for_sm90_without_a_gpu compiles every kernel for
sm_90 in a subprocess (no GPU needed) to catch lowering errors the interpreter cannot see.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Justified skips: torch and triton come with the vllm extra that scripts/test always installs (so CI runs these);
# a bare checkout without them has nothing to run the kernels on.
torch = pytest.importorskip("torch", reason="the kernels take torch tensors; torch is part of the vllm extra")
if importlib.util.find_spec("triton") is None:  # justified: see above (no Triton, no kernel to run)
    pytest.skip("Triton is not installed in this environment (the kernels need it)", allow_module_level=True)

from kernels.nvfp4 import format as fmt, reference as ref  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SM_SCALE = 1 / 192 ** 0.5


def load_interpreted_api():
    """kernels.nvfp4.api with interpreted kernels, or None when triton was imported earlier without the interpreter."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(tl.max, InterpretedFunction):
            return None
        from kernels.nvfp4 import api as api_mod, triton_attention, triton_kernels

        if not isinstance(triton_kernels.nvfp4_pack_kernel, InterpretedFunction):
            importlib.reload(triton_kernels)
            importlib.reload(triton_attention)
        assert isinstance(triton_attention.nvfp4_decode_kernel, InterpretedFunction)
        return api_mod
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old


INTERPRETED_API = load_interpreted_api()


@pytest.fixture
def api(monkeypatch):
    """The interpreted launchers; TRITON_INTERPRET stays set while the test runs (triton imports lazily on launch)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if INTERPRETED_API is None:  # justified: test_interpreter_suite_in_subprocess runs these same tests instead
        pytest.skip("triton was imported in this process before TRITON_INTERPRET could be set; "
                    "test_interpreter_suite_in_subprocess runs these tests in a fresh process")
    return INTERPRETED_API


def edge_rows(gen: torch.Generator) -> torch.Tensor:
    """37 rows (not a multiple of the pack tile): random magnitudes plus rounding ties, zeros, huge and tiny blocks."""
    rows = torch.randn(37, fmt.ROW_DIM, generator=gen) * 10.0 ** torch.randint(-3, 4, (37, 1), generator=gen)
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    rows[0, :16] = torch.cat([mids, -mids])  # block max 6 -> scale 1: every E2M1 tie, both signs
    rows[1, 16:32] = 0.0
    rows[1, 32:48] = -0.0
    rows[2, :256] *= 1e6  # saturates the block scale without a global scale
    rows[3, 256:512] *= 1e-9  # subnormal / zero block scales
    grid = ref.round_e4m3(torch.linspace(0, 448, 2000))
    ties = ((grid.unique()[1:] + grid.unique()[:-1]) / 2)[:64 * 5]
    rows[4:4 + len(ties) // 64, 512:] = ties[: len(ties) // 64 * 64].reshape(-1, 64)  # E4M3 ties in rope
    rows[9, 512:] = -0.0
    return rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_pack_is_bit_exact(api, dtype) -> None:
    rows = edge_rows(torch.Generator().manual_seed(10)).clamp(-6e4, 6e4).to(dtype)
    for gs, rs in [(None, None), ref.calibrate_nvfp4_scales(rows), (0.37, 3.1)]:
        want, want_scales = ref.pack_nvfp4(rows, gs, rs)
        got, got_scales = api.nvfp4_pack(rows, gs, rs)
        assert got_scales == want_scales
        diff = (got != want).nonzero()
        assert diff.numel() == 0, f"{len(diff)} bytes differ, first at {diff[:5].tolist()} (gs={gs})"


def test_unpack_is_bit_exact_on_every_byte_pattern(api) -> None:
    gen = torch.Generator().manual_seed(11)
    packed = torch.randint(0, 256, (40, fmt.NVFP4_ROW_BYTES), generator=gen, dtype=torch.uint8)
    packed[0, :256] = torch.arange(256, dtype=torch.uint8)  # every code pair
    packed[1, 256:] = torch.arange(96, dtype=torch.uint8) * 2 + 1
    fp8 = packed[:, fmt.SCALE_OFFSET:]
    fp8[(fp8 & 0x7F) == 0x7F] = 0x7E  # E4M3 NaN patterns are never written
    for scales in (fmt.Nvfp4Scales(), fmt.Nvfp4Scales(0.3, 2.5)):
        got = api.nvfp4_unpack(packed, scales)
        want = ref.unpack_nvfp4(packed, scales)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_fp8_pack_is_bit_exact(api) -> None:
    rows = edge_rows(torch.Generator().manual_seed(12))
    for scale in (None, ref.calibrate_fp8_scale(rows), 0.01):
        assert torch.equal(api.fp8_pack(rows, scale)[0], ref.pack_fp8(rows, scale)[0])


def attention_case(gen: torch.Generator, batch: int, heads: int, num_idx: int, slots: int, empty: float,
                   magnitude: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Latent rows with a few outlier channels, a bf16 query and indices with a fraction of -1 slots."""
    rows = torch.randn(slots, fmt.ROW_DIM, generator=gen)
    rows[:, torch.randint(0, 512, (6,), generator=gen)] *= 8.0
    q = (torch.randn(batch, heads, fmt.ROW_DIM, generator=gen) * 2).bfloat16()
    idx = torch.randint(0, slots, (batch, num_idx), generator=gen, dtype=torch.int32)
    idx[torch.rand(batch, num_idx, generator=gen) < empty] = -1
    return rows * magnitude, q, idx


def assert_attention_close(got: torch.Tensor, want: torch.Tensor, rows: torch.Tensor) -> None:
    """fp16 probabilities in the P @ V dot: about 2^-11 of the largest value."""
    scale = float(rows[:, :512].abs().max())
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3 * scale)


ATTENTION_CASES = {
    "tile_remainder": dict(batch=1, heads=16, num_idx=45, slots=64, empty=0.2, splits=1),
    "masked_heads_splits": dict(batch=2, heads=20, num_idx=70, slots=90, empty=0.1, splits=3),
    "large_values_global_scale": dict(batch=1, heads=16, num_idx=33, slots=40, empty=0.0, splits=2, magnitude=300.0,
                                      calibrated=True),
    "small_values": dict(batch=1, heads=16, num_idx=40, slots=40, empty=0.3, splits=2, magnitude=1e-3),
    "t2048": dict(batch=1, heads=16, num_idx=2048, slots=3000, empty=0.1, splits=4, calibrated=True),
}


@pytest.mark.parametrize("kind", ["nvfp4", "fp8"])
@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_decode_attention_matches_reference(api, kind, case) -> None:
    cfg = dict(ATTENTION_CASES[case])
    splits, calibrated = cfg.pop("splits"), cfg.pop("calibrated", False)
    rows, q, idx = attention_case(torch.Generator().manual_seed(20 + list(ATTENTION_CASES).index(case)), **cfg)
    if kind == "nvfp4":
        scales = ref.calibrate_nvfp4_scales(rows) if calibrated else (None, None)
        cache, scales = ref.pack_nvfp4(rows, *scales)
        got = api.nvfp4_decode_attention(q, cache, scales, idx, SM_SCALE, num_splits=splits)
        want = ref.nvfp4_decode_attention(q, cache, scales, idx, SM_SCALE)
    else:
        cache, scale = ref.pack_fp8(rows, ref.calibrate_fp8_scale(rows) if calibrated else None)
        got = api.fp8_decode_attention(q, cache, scale, idx, SM_SCALE, num_splits=splits)
        want = ref.fp8_decode_attention(q, cache, scale, idx, SM_SCALE)
    assert got.shape == want.shape == (cfg["batch"], cfg["heads"], fmt.LATENT_DIM)
    assert bool(torch.isfinite(got).all())
    assert_attention_close(got, want, rows)


@pytest.mark.parametrize("kind", ["nvfp4", "fp8"])
def test_empty_slots_contribute_nothing(api, kind) -> None:
    rows, q, idx = attention_case(torch.Generator().manual_seed(13), batch=3, heads=16, num_idx=40, slots=50,
                                  empty=0.0)
    idx[0] = -1  # every slot empty
    idx[1, :35] = -1  # only the last tile has entries: the earlier splits see empty slots only
    cache, scale = ref.pack_nvfp4(rows) if kind == "nvfp4" else ref.pack_fp8(rows)
    run = api.nvfp4_decode_attention if kind == "nvfp4" else api.fp8_decode_attention
    out = run(q, cache, scale, idx, SM_SCALE, num_splits=4)
    assert torch.equal(out[0], torch.zeros(16, fmt.LATENT_DIM))
    kept = run(q[1], cache, scale, idx[1, 35:], SM_SCALE)
    assert_attention_close(out[1], kept, rows)
    assert_attention_close(out[2], run(q[2], cache, scale, idx[2], SM_SCALE), rows)
    no_idx = run(q[0], cache, scale, torch.empty(0, dtype=torch.int32), SM_SCALE)
    assert torch.equal(no_idx, torch.zeros(16, fmt.LATENT_DIM))


def test_gpu_bench_logic_runs_on_cpu(api, monkeypatch) -> None:
    """kernels/bench/nvfp4_vs_fp8.py on tiny sizes, with a wall-clock stand-in for the CUDA-event timer."""
    from kernels.bench import nvfp4_vs_fp8 as bench

    sizes = dict(CHECK_ROWS=48, CHECK_T=40, BATCHES=(1, 2), SELECTED=(24,), HEADS=(16,), BLOCK_TS=(16,))
    for name, value in sizes.items():
        monkeypatch.setattr(bench, name, value)
    monkeypatch.setattr(bench, "timed_ms", lambda fn, flush: (fn(), 1.0)[1])
    rows = torch.randn(64, fmt.ROW_DIM, generator=torch.Generator().manual_seed(14)).bfloat16()
    check = bench.correctness(api, ref, rows)
    assert check["nvfp4_pack_bytes_differing"] == 0 and check["fp8_pack_bytes_differing"] == 0
    assert check["nvfp4_unpack_bit_exact"]
    assert all(e["rel_err"] < 1e-3 for e in check["attention_vs_reference"].values()), check
    assert set(bench.bench_pack(api, rows, None)) == {"nvfp4", "fp8"}
    table, truncated = bench.bench_attention(api, ref, rows, None, deadline=float("inf"))
    assert not truncated and [(e["batch"], e["selected"]) for e in table] == [(1, 24), (2, 24)]
    assert table[0]["fp8_over_nvfp4"] == 1.0 and table[0]["splits"] == 1


def test_kernels_compile_for_sm90_without_a_gpu() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    run = subprocess.run([sys.executable, "-m", "kernels.nvfp4.compile_check"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads(run.stdout)
    assert set(results) == {"nvfp4_decode", "fp8_decode", "combine", "nvfp4_pack", "nvfp4_unpack", "fp8_pack"}
    for name in ("nvfp4_decode", "fp8_decode"):
        assert results[name].get("spill_store_bytes", 0) == 0, results[name]


def test_interpreter_suite_in_subprocess() -> None:
    if INTERPRETED_API is not None:  # justified: exactly one of the two paths runs the kernel tests
        pytest.skip("the interpreter tests ran in this process")
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                          "not compile_for_sm90 and not in_subprocess"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-5000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-2000:]
