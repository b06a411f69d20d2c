"""services/worker/engines/cost_model.py: roofline step times, KV sizes, transfers by layout."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from kernels.kv_layout import KVRegion, plan_transfer, scattered_placement
from services.worker.engines.cost_model import LAYOUTS, PROFILES_DIR, CostModel, _sum_min, load_profile, num_descriptors

GB200 = load_profile("gb200-glm53")


@pytest.mark.parametrize("start, count, cap", [(0, 10, 0), (0, 10, 4), (3, 5, 4), (10, 5, 4), (2, 7, 5), (0, 0, 3),
                                               (4, 1, 4), (3, 1, 4), (100, 3000, 2048)])
def test_sum_min_matches_brute_force(start, count, cap) -> None:
    expected = sum(min(p, cap) if cap else p for p in range(start + 1, start + count + 1))
    assert _sum_min(start, count, cap) == expected


@pytest.mark.parametrize("name", sorted(p.stem for p in PROFILES_DIR.glob("*.toml")))
def test_every_profile_loads_with_sane_constants(name) -> None:
    p = load_profile(name)
    assert p.name == name
    assert p.peak_flops > 0 and 0 < p.prefill_mfu <= 1 and 0 < p.hbm_efficiency <= 1
    assert p.num_kv_blocks(next(iter(p.kv_row_bytes))) > 0
    assert p.max_num_batched_tokens > 0 and p.max_num_seqs > 0


def test_unknown_profile_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="gb200-glm53"):
        load_profile("tpu-v9")


def test_gb200_kv_rows_and_capacity() -> None:
    assert GB200.kv_row_bytes["nvfp4"] == 352 and GB200.kv_row_bytes["fp8"] == 576
    assert GB200.kv_bytes_per_token("fp8") == 78 * (576 + 132)
    fp8 = GB200.num_kv_blocks("fp8") * GB200.block_size
    nvfp4 = GB200.num_kv_blocks("nvfp4") * GB200.block_size
    assert fp8 == pytest.approx(1.09e6, rel=0.01)  # the calibration point
    assert nvfp4 / fp8 == pytest.approx(708 / 484, rel=0.01)
    with pytest.raises(ValueError, match="nvfp4"):
        load_profile("h200-glm53").kv_bytes_per_token("nvfp4")


def test_decode_is_memory_bound_and_sparse_attention_caps_kv_reads() -> None:
    cm = CostModel(GB200, "fp8")
    p = GB200
    base = p.step_overhead_s + p.weight_bytes_per_step / (p.hbm_bytes_per_s * p.hbm_efficiency)
    assert cm.step_time([], [1]) == pytest.approx(base, rel=1e-3)
    # beyond top-k only the indexer keys grow with the context
    assert cm.decode_bytes(10_000) - cm.decode_bytes(5_000) == pytest.approx(78 * 132 * 5_000)
    assert cm.decode_bytes(1_000) - cm.decode_bytes(500) == pytest.approx(78 * (576 + 132) * 500)
    dense = CostModel(dataclasses.replace(GB200, sparse_topk=0), "fp8")
    assert dense.decode_bytes(10_000) == pytest.approx(78 * (576 + 132) * 10_000)
    assert cm.step_time([], [50_000] * 64) > cm.step_time([], [50_000] * 8) > cm.step_time([], [1])


def test_prefill_is_compute_bound_and_grows_with_context() -> None:
    cm = CostModel(GB200, "fp8")
    p = GB200
    flops = 2 * p.active_params * 8192 + 78 * (p.attention_flops_per_pair * _sum_min(0, 8192, 2048)
                                               + p.indexer_flops_per_pair * _sum_min(0, 8192, 0))
    assert cm.prefill_flops(8192, 0) == pytest.approx(flops)
    assert cm.step_time([(8192, 0)], []) == pytest.approx(p.step_overhead_s + flops / (p.peak_flops * p.prefill_mfu))
    assert cm.step_time([(4096, 100_000)], []) > cm.step_time([(4096, 0)], [])
    # a mixed step pays the larger of compute and memory, not the sum
    mixed = cm.step_time([(8192, 0)], [1000] * 16)
    assert mixed < cm.step_time([(8192, 0)], []) + cm.step_time([], [1000] * 16)
    assert cm.step_time([], []) == 0.0


@pytest.mark.parametrize("num_blocks, layers", [(1, 78), (3125, 78), (10, 18)])
def test_block_major_layout_needs_one_descriptor_per_block(num_blocks, layers) -> None:
    assert num_descriptors(num_blocks, layers, "BLHNC") == num_blocks
    assert num_descriptors(num_blocks, layers, "LBHNC") == num_blocks * layers
    with pytest.raises(ValueError):
        num_descriptors(1, 1, "HND")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("num_blocks, layers, block_size", [(1, 78, 64), (200, 78, 64), (37, 18, 128)])
def test_num_descriptors_is_the_planners_count_for_scattered_blocks(layout, num_blocks, layers, block_size) -> None:
    """The sim's count is what kernels/kv_layout plans for blocks no two of which are adjacent on both sides."""
    region = KVRegion(layout, num_blocks=4 * num_blocks, num_layers=layers, block_size=block_size, head_bytes=576)
    src = 4 * np.arange(num_blocks)[::-1]  # every fourth block, listed backwards
    dst = scattered_placement(num_blocks, 4 * num_blocks, seed=1)[1]
    assert num_descriptors(num_blocks, layers, layout) == len(plan_transfer(region, region, src, dst))
    assert num_descriptors(num_blocks, layers, layout) >= len(plan_transfer(region, region, range(num_blocks),
                                                                            range(num_blocks)))


def test_host_profile_takes_the_measured_nixl_constants() -> None:
    """cpu-gemma3-270m's link and per-descriptor cost are the fit in docs/results/kv_layout (real NIXL here)."""
    report = json.loads((Path(__file__).parents[2] / "docs/results/kv_layout/kv_layout_nixl.json").read_text())
    fit = report["fit"]["all"]
    cpu = load_profile("cpu-gemma3-270m")
    assert cpu.descriptor_overhead_s == pytest.approx(fit["overhead_s"], rel=0.01)
    assert cpu.link_bytes_per_s == pytest.approx(fit["bandwidth_bytes_per_s"], rel=0.01)


def test_transfer_time_is_bytes_over_link_plus_descriptors() -> None:
    cm = CostModel(GB200, "fp8")
    p = GB200
    tokens = 200_000
    blocks = -(-tokens // 64)
    wire = tokens * p.kv_bytes_per_token("fp8") / p.link_bytes_per_s
    assert cm.transfer_time(tokens, 64, "BLHNC") == pytest.approx(wire + blocks * p.descriptor_overhead_s)
    assert cm.transfer_time(tokens, 64, "LBHNC") == pytest.approx(wire + blocks * 78 * p.descriptor_overhead_s)
    assert cm.transfer_time(tokens, 16, "BLHNC") > cm.transfer_time(tokens, 64, "BLHNC")
    assert cm.transfer_time(0, 64, "LBHNC") == 0.0
    assert CostModel(GB200, "nvfp4").transfer_time(tokens, 64, "BLHNC") < cm.transfer_time(tokens, 64, "BLHNC")


def test_lm_head_runs_once_per_request_per_step() -> None:
    cpu = load_profile("cpu-gemma3-270m")
    assert cpu.lm_head_params > 0 and GB200.lm_head_params == 0  # GLM's head is inside its active params
    cm = CostModel(cpu, "bf16")
    without = CostModel(dataclasses.replace(cpu, lm_head_params=0.0), "bf16")
    for prefills, decodes, requests in [([], [100], 1), ([], [100] * 16, 16), ([(512, 0)], [100, 100], 3)]:
        flops, _ = cm.step_work(prefills, decodes)
        base, _ = without.step_work(prefills, decodes)
        assert flops - base == pytest.approx(2 * cpu.lm_head_params * requests)
    # on this CPU decode is compute bound: a bigger batch costs more, as measured (127 ms -> 1.2 s at 16)
    assert cm.step_time([], [160] * 16) > 5 * cm.step_time([], [160])


@pytest.mark.parametrize("name", ["gb200-glm53", "h200-glm53"])
def test_glm_profiles_row_bytes_are_the_kernels_formats(name):
    """The sim's KV capacity for GLM-5.3 uses the bytes per MLA row that kernels/nvfp4 packs (576 values: BF16 1152,
    FP8 576, NVFP4 352 = 256 E2M1 bytes + 32 E4M3 scales + 64 FP8 rope values)."""
    from kernels.nvfp4.format import ROW_BYTES

    profile = load_profile(name)
    assert profile.kv_row_bytes == {dtype: ROW_BYTES[dtype] for dtype in profile.kv_row_bytes}
