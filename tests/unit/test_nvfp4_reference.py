"""NVFP4 MLA KV rows: format constants, the torch reference codec and the reference sparse decode attention."""

from __future__ import annotations

import itertools
import math

import pytest

torch = pytest.importorskip("torch", reason="the NVFP4 reference is torch code; torch is part of the vllm extra")

from kernels.nvfp4 import format as fmt, reference as ref  # noqa: E402

E2M1_GRID = torch.tensor(fmt.E2M1_VALUES)


def all_e4m3_values() -> torch.Tensor:
    """Every finite non-negative E4M3 value, from the format definition (not from torch's float8 type)."""
    subnormal = [m * 2.0 ** -9 for m in range(8)]
    normal = [(1 + m / 8) * 2.0 ** (e - 7) for e in range(1, 16) for m in range(8) if (e, m) != (15, 7)]
    return torch.tensor(subnormal + normal, dtype=torch.float64)


def nearest_even(a: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Index of the nearest grid value; ties go to the even index (even mantissa), saturating at the top."""
    a = a.double().clamp(max=float(grid[-1]))
    dist = (a[:, None] - grid[None, :].double()).abs()
    best = dist.min(dim=1, keepdim=True).values
    ties = (dist == best) & (torch.arange(len(grid))[None, :] % 2 == 0)
    first = dist.argmin(dim=1)
    return torch.where(ties.any(dim=1), ties.double().argmax(dim=1), first)


def test_row_is_352_bytes_for_576_values() -> None:
    assert (fmt.LATENT_DIM, fmt.ROPE_DIM, fmt.ROW_DIM) == (512, 64, 576)
    assert (fmt.SCALE_OFFSET, fmt.ROPE_OFFSET, fmt.NVFP4_ROW_BYTES) == (256, 288, 352)
    assert fmt.row_bytes("bf16") == 1152 and fmt.row_bytes("fp8") == 576 and fmt.row_bytes("nvfp4") == 352
    assert fmt.capacity_ratio("nvfp4", "fp8") == pytest.approx(576 / 352)
    packed, _ = ref.pack_nvfp4(torch.randn(3, fmt.ROW_DIM, dtype=torch.bfloat16))
    assert packed.dtype == torch.uint8 and tuple(packed.shape) == (3, 352)


def test_byte_layout() -> None:
    row = torch.zeros(1, fmt.ROW_DIM)
    row[0, 0], row[0, 1] = 1.5, -6.0  # block 0: amax 6 -> scale 1.0
    row[0, 16 + 3] = 3.0  # block 1: amax 3 -> scale 0.5; 3 / 0.5 = 6 -> code 7
    row[0, 511] = -0.25  # block 31: scale e4m3(0.25 / 6) = 0.04297; -0.25 / scale = -5.8 -> code 15
    row[0, 512], row[0, 575] = 2.0, -448.0
    packed, _ = ref.pack_nvfp4(row)
    p = packed[0].tolist()
    assert p[0] == (3 | (0xF << 4))  # 1.5 = code 3 (low nibble), -6 = sign | code 7 (high nibble)
    assert p[9] == (7 << 4)  # value 19 = odd member of pair 9: 3.0 / 0.5 = 6 -> code 7, high nibble
    assert p[255] >> 4 == 0xF and p[255] & 0xF == 0
    scale_bytes = p[256:288]
    assert scale_bytes[0] == 0x38 and scale_bytes[1] == 0x30  # E4M3 1.0 and 0.5
    assert all(b == 0 for b in scale_bytes[2:31])
    assert scale_bytes[31] == int(ref.e4m3_bits(torch.tensor([0.25 / 6])))
    assert p[288] == 0x40 and p[351] == 0xFE  # E4M3 2.0 and -448
    assert sum(p[289:351]) == 0


def test_e4m3_rounding_matches_the_format_definition() -> None:
    grid = all_e4m3_values()
    mids = (grid[1:] + grid[:-1]) / 2
    probe = torch.cat([grid, mids, mids * (1 + 2 ** -20), mids * (1 - 2 ** -20), torch.rand(2000) * 500,
                       torch.tensor([460.0, 1e6, 2.0 ** -11, 2.0 ** -10, 3 * 2.0 ** -11])]).float()
    want = grid[nearest_even(probe, grid)].float()
    assert torch.equal(ref.round_e4m3(probe), want)
    assert torch.equal(ref.round_e4m3(-probe), -want)
    assert int(ref.e4m3_bits(torch.tensor([-0.0]))) == 0x80 and int(ref.e4m3_bits(torch.tensor([-1e-6]))) == 0x80


def test_e2m1_rounding_is_nearest_even() -> None:
    mids = (E2M1_GRID[1:] + E2M1_GRID[:-1]) / 2
    probe = torch.cat([E2M1_GRID, mids, mids + 1e-4, mids - 1e-4, torch.rand(1000) * 7, torch.tensor([6.5, 100.0])])
    codes = ref.e2m1_encode(probe, torch.zeros_like(probe, dtype=torch.bool))
    assert torch.equal(codes.long(), nearest_even(probe, E2M1_GRID))
    neg = ref.e2m1_encode(-probe, torch.ones_like(probe, dtype=torch.bool))
    assert torch.equal(ref.e2m1_decode(neg), -ref.e2m1_decode(codes))


def representable_rows(n: int, gen: torch.Generator) -> torch.Tensor:
    """Rows NVFP4 stores exactly: block max is +-6 * scale with a power-of-two scale, rope on the E4M3 grid."""
    codes = torch.randint(0, 16, (n, fmt.LATENT_BLOCKS, fmt.FP4_BLOCK), generator=gen)
    codes[:, :, 0] = 7 + 8 * torch.randint(0, 2, (n, fmt.LATENT_BLOCKS), generator=gen)  # the block max is 6
    scale = 2.0 ** torch.randint(-8, 8, (n, fmt.LATENT_BLOCKS, 1), generator=gen).float()
    latent = (ref.e2m1_decode(codes) * scale).reshape(n, fmt.LATENT_DIM)
    rope = ref.round_e4m3(torch.randn(n, fmt.ROPE_DIM, generator=gen) * 10)
    return torch.cat([latent, rope], dim=1)


def test_representable_rows_round_trip_exactly() -> None:
    rows = representable_rows(20, torch.Generator().manual_seed(1))
    packed, scales = ref.pack_nvfp4(rows)
    assert torch.equal(ref.unpack_nvfp4(packed, scales), rows)
    packed2, scales2 = ref.pack_nvfp4(rows * 4, global_scale=4.0, rope_scale=4.0)
    assert torch.equal(packed2, packed) and torch.equal(ref.unpack_nvfp4(packed2, scales2), rows * 4)


def test_round_trip_error_bounds_and_zero_blocks() -> None:
    gen = torch.Generator().manual_seed(2)
    rows = torch.randn(64, fmt.ROW_DIM, generator=gen)
    rows[3, 32:48] = 0.0
    packed, scales = ref.pack_nvfp4(rows)
    back = ref.unpack_nvfp4(packed, scales)
    assert int(packed[3, fmt.SCALE_OFFSET + 2]) == 0 and torch.equal(back[3, 32:48], torch.zeros(16))
    blocks = rows[:, :512].reshape(64, 32, 16)
    err = (back[:, :512].reshape(64, 32, 16) - blocks).abs()
    # half an E2M1 step at the top (1.0 of 6) times the block scale, which E4M3 rounds up by at most 1/16
    assert bool((err <= blocks.abs().amax(-1, keepdim=True) / 6 * (1 + 1 / 16) + 1e-7).all())
    assert bool(((back[:, 512:] - rows[:, 512:]).abs() <= rows[:, 512:].abs() / 16 + 2.0 ** -10).all())
    rel = float((back - rows).norm() / rows.norm())
    assert 0.03 < rel < 0.15


def test_global_scale_keeps_large_and_small_tensors_accurate() -> None:
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(32, fmt.ROW_DIM, generator=gen)
    for magnitude in (1e4, 1e-5):
        rows = base * magnitude
        plain = ref.unpack_nvfp4(*ref.pack_nvfp4(rows))
        scaled = ref.unpack_nvfp4(*ref.pack_nvfp4(rows, *ref.calibrate_nvfp4_scales(rows)))
        rel_plain = float((plain - rows).norm() / rows.norm())
        rel_scaled = float((scaled - rows).norm() / rows.norm())
        assert rel_scaled < 0.15 < rel_plain, (magnitude, rel_scaled, rel_plain)


def test_fp8_rows() -> None:
    gen = torch.Generator().manual_seed(4)
    rows = torch.randn(16, fmt.ROW_DIM, generator=gen) * 30
    packed, scale = ref.pack_fp8(rows, ref.calibrate_fp8_scale(rows))
    assert packed.shape == rows.shape and packed.dtype == torch.uint8
    back = ref.unpack_fp8(packed, scale)
    assert bool(((back - rows).abs() <= rows.abs() / 16 + scale * 2.0 ** -10).all())
    assert float(back.abs().max()) == pytest.approx(float(rows.abs().max()), rel=1e-6)


def naive_attention(q: torch.Tensor, kv: torch.Tensor, indices: list[int], sm_scale: float) -> torch.Tensor:
    """Float64 loop over the valid positions only."""
    keep = [i for i in indices if i >= 0]
    if not keep:
        return torch.zeros(q.shape[0], fmt.LATENT_DIM, dtype=torch.float64)
    k = kv[keep].double()
    p = torch.softmax(q.double() @ k.T * sm_scale, dim=-1)
    return p @ k[:, : fmt.LATENT_DIM]


def test_reference_attention_matches_naive_and_skips_empty_slots() -> None:
    gen = torch.Generator().manual_seed(5)
    kv = torch.randn(50, fmt.ROW_DIM, generator=gen)
    q = torch.randn(4, fmt.ROW_DIM, generator=gen).bfloat16()
    idx = torch.randint(0, 50, (40,), generator=gen, dtype=torch.int32)
    idx[::3] = -1
    sm = 1 / math.sqrt(192)
    out = ref.decode_attention(q, kv, idx, sm)
    assert out.dtype == torch.float32 and tuple(out.shape) == (4, 512)
    torch.testing.assert_close(out.double(), naive_attention(q, kv, idx.tolist(), sm), rtol=1e-5, atol=1e-5)
    dropped = ref.decode_attention(q, kv, idx[idx >= 0], sm)
    torch.testing.assert_close(out, dropped, rtol=1e-6, atol=1e-6)


def test_reference_attention_all_empty_is_zero_and_bad_index_raises() -> None:
    kv = torch.randn(8, fmt.ROW_DIM)
    q = torch.randn(2, 3, fmt.ROW_DIM)
    empty = torch.full((2, 5), -1, dtype=torch.int32)
    assert torch.equal(ref.decode_attention(q, kv, empty, 0.1), torch.zeros(2, 3, 512))
    mixed = torch.tensor([[-1, -1, -1, -1, -1], [0, 1, -1, 2, 7]], dtype=torch.int32)
    out = ref.decode_attention(q, kv, mixed, 0.1)
    assert torch.equal(out[0], torch.zeros(3, 512)) and bool(out[1].abs().sum() > 0)
    torch.testing.assert_close(out[1], ref.decode_attention(q[1], kv, mixed[1], 0.1))
    with pytest.raises(ValueError):
        ref.decode_attention(q, kv, torch.full((2, 5), 8, dtype=torch.int32), 0.1)


def test_quantized_attention_references_agree_with_dequantized_rows() -> None:
    gen = torch.Generator().manual_seed(6)
    rows = torch.randn(30, fmt.ROW_DIM, generator=gen)
    q = torch.randn(3, fmt.ROW_DIM, generator=gen)
    idx = torch.tensor([5, -1, 29, 0, 5], dtype=torch.int32)
    for (gs, rs), fp8_scale in itertools.product([(None, None), ref.calibrate_nvfp4_scales(rows)], [None, 0.01]):
        packed, scales = ref.pack_nvfp4(rows, gs, rs)
        want = ref.decode_attention(q, ref.unpack_nvfp4(packed, scales), idx, 0.2)
        assert torch.equal(ref.nvfp4_decode_attention(q, packed, scales, idx, 0.2), want)
        f8, s8 = ref.pack_fp8(rows, fp8_scale)
        want8 = ref.decode_attention(q, ref.unpack_fp8(f8, s8), idx, 0.2)
        assert torch.equal(ref.fp8_decode_attention(q, f8, s8, idx, 0.2), want8)


def test_gpu_bench_exits_cleanly_without_a_gpu(monkeypatch, tmp_path, capsys) -> None:
    from kernels.bench import nvfp4_vs_fp8 as bench

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--out", str(tmp_path / "r.json")]) == 0
    assert "no CUDA GPU" in capsys.readouterr().out and not (tmp_path / "r.json").exists()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert bench.main([]) == 2
