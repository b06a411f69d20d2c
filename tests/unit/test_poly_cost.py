"""DynamoPolynomialCost: Dynamo mocker's step-time polynomials, checked on figures measured on its 1.6.1 binary."""

from __future__ import annotations

import pytest

from services.worker.engines.block_pool import fast_hash_block
from services.worker.engines.poly_cost import (
    DynamoPolynomialCost,
    decode_ms,
    dynamo_prefill_tokens,
    prefill_ms,
)
from services.worker.engines.scheduler import SimRequest
from services.worker.engines.sim_worker import SimWorker, SimWorkerConfig

C = 16384 * 64  # Dynamo's default capacity: 16,384 blocks of 64 tokens


def test_lone_prompt_prefill() -> None:
    cost = DynamoPolynomialCost(C)
    assert cost.step_time([(1024, 0)], []) * 1000 == pytest.approx(32.490712, abs=1e-6)
    assert prefill_ms(8192) == pytest.approx(169.136918, abs=1e-6)
    assert prefill_ms(0) == 0.0
    assert cost.step_time([], []) == 0.0


def test_decode_at_empty_and_full_occupancy() -> None:
    assert decode_ms(0, C) == pytest.approx(5.74)
    assert decode_ms(C, C) == pytest.approx(34.01)
    assert decode_ms(3 * C, C) == pytest.approx(34.01)  # p is capped at 1
    assert decode_ms(C // 4, C) == pytest.approx(17.63375)
    # 1,024-token prompt decoding alone at 64 x 16,384: its sequence is 1,025 tokens long.
    assert DynamoPolynomialCost(C).step_time([], [1024]) * 1000 == pytest.approx(decode_ms(1025, C))
    assert decode_ms(1025, C) == pytest.approx(5.79, abs=0.005)


def test_decode_sequence_lengths_match_dynamo_binary() -> None:
    # Measured on ai-dynamo-runtime 1.6.1 with 64 blocks of 64 tokens: 1,024-token prompt,
    # second token after 17.643792 ms, third after 17.653832 ms.
    cost = DynamoPolynomialCost(64 * 64)
    assert cost.step_time([], [1024]) * 1000 == pytest.approx(17.643792, abs=1e-6)
    assert cost.step_time([], [1025]) * 1000 == pytest.approx(17.653832, abs=1e-6)
    # Two decoders (sequences 1,027 and 302) at 1,024 x 64: 6.824680 ms measured.
    assert DynamoPolynomialCost(1024 * 64).step_time([], [1026, 301]) * 1000 == pytest.approx(6.824680, abs=1e-6)


def test_mixed_step_adds_prefill_and_decode() -> None:
    cost = DynamoPolynomialCost(1024 * 64)
    ms = cost.step_time([(301, 0)], [1025]) * 1000
    assert ms == pytest.approx(prefill_ms(301) + decode_ms(1026, 1024 * 64))


def test_prefill_tokens_use_dynamos_integer_means() -> None:
    assert dynamo_prefill_tokens([(1024, 0), (2048, 0)]) == 3072
    # 476 new after a 1,024-token cached prefix and 301 fresh: 2 * (900 - 512) = 776, not 777
    # (measured: both TTFTs 28.537285 ms = prefill_ms(776)).
    assert dynamo_prefill_tokens([(476, 1024), (301, 0)]) == 776
    assert prefill_ms(776) == pytest.approx(28.537285, abs=1e-6)
    assert dynamo_prefill_tokens([]) == 0


def test_speedup_ratios() -> None:
    cost = DynamoPolynomialCost(C, speedup_ratio=2.0, decode_speedup_ratio=4.0)
    assert cost.step_time([(1024, 0)], [1000]) * 1000 == pytest.approx(prefill_ms(1024) / 2 + decode_ms(1001, C) / 8)
    assert cost.transfer_time(1000, 64, "BLHNC") == 0.0
    assert cost.onload_time(1000) == 0.0


def test_sim_worker_timeline_matches_dynamo() -> None:
    """A lone 1,024-token prompt on SimWorker: TTFT = prefill_ms(1024), then decode_ms(1025), decode_ms(1026)."""
    worker = SimWorker(SimWorkerConfig("w", None, block_size=64, num_kv_blocks=64, max_num_batched_tokens=8192,
                                       max_num_seqs=256, hasher=fast_hash_block), DynamoPolynomialCost(64 * 64))
    worker.add(SimRequest("r", list(range(1024)), 3))
    now, times = 0.0, []
    while (step := worker.begin_step(now)) is not None:
        now += step.duration_s
        worker.end_step(step, now)
        times.append(now * 1000)
    assert times == pytest.approx([32.490712, 32.490712 + 17.643792, 32.490712 + 17.643792 + 17.653832], abs=1e-5)
