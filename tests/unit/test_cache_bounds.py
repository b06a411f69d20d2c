"""loadtests/lib/cache_bounds.py (the pooled-LRU bound, the gap split), policy specs and replay's KV flags."""

from __future__ import annotations

import pytest

from loadtests.lib.cache_bounds import Replayed, gap_split, hit_bounds, infinite_cache_hits, prefix_cache_hits
from loadtests.lib.policy_spec import fleet_overrides
from loadtests.replay import fleet_config, parse_args
from services.router.policy import KvRoutingConfig
from services.router.scoring import CostWeights
from services.worker.engines.cost_model import load_profile
from services.worker.engines.poly_cost import DynamoPolynomialCost

B = 4


def request(t: float, prompt: list[int], finish: float | None = None, output: list[int] = ()) -> Replayed:
    return Replayed(t, finish, prompt, list(output))


def test_a_cache_big_enough_never_to_evict_is_the_infinite_cache() -> None:
    a, b = list(range(1, 13)), list(range(50, 62))
    requests = [request(0, a), request(1, b), request(2, a + [99]), request(3, b + [98])]
    assert prefix_cache_hits(requests, B, capacity_blocks=6) == infinite_cache_hits(requests, B) == (24, 50)


def test_a_pooled_lru_evicts_the_least_recently_used_prefix() -> None:
    a, b, c = list(range(1, 13)), list(range(50, 62)), list(range(70, 82))  # 3 blocks each
    # 6 blocks: a and b fill it; a's second turn refreshes a, so c evicts b, not a
    requests = [request(0, a), request(1, b), request(2, a + [99]), request(3, c), request(4, a + [97]),
                request(5, b + [98])]
    assert prefix_cache_hits(requests, B, capacity_blocks=6)[0] == 12 + 12 + 0
    assert infinite_cache_hits(requests, B)[0] == 3 * 12


def test_a_request_s_tail_is_evicted_before_its_head() -> None:
    a = list(range(1, 13))  # 3 blocks
    other = list(range(50, 54))  # 1 block: evicts one of a's blocks from a 3-block cache
    cached, _ = prefix_cache_hits([request(0, a), request(1, other), request(2, a + [99])], B, capacity_blocks=3)
    assert cached == 8  # a's first two blocks stayed; its tail block went


def test_the_last_prompt_token_is_always_computed_in_the_lru_too() -> None:
    a = list(range(1, 9))  # exactly 2 blocks: the second cannot hit (its last token is computed)
    cached, prompt = prefix_cache_hits([request(0, a), request(1, a)], B, capacity_blocks=10)
    assert (cached, prompt) == (4, 16)


def test_an_answer_enters_the_cache_at_finish() -> None:
    a = list(range(1, 7))  # 1 full block + 2 tokens
    turn2 = a + [40, 41, 42, 43]  # the answer (all but its last token) completes block 2
    requests = [request(0, a, finish=1.0, output=[40, 41, 42, 43]), request(2, turn2 + [7])]
    assert prefix_cache_hits(requests, B, capacity_blocks=10)[0] == 8


def test_gap_split_adds_up_to_the_gap() -> None:
    bounds = {"infinite_cache_hit_rate": 0.65, "pooled_lru_hit_rate": 0.55}
    split = gap_split(0.52, bounds)
    assert split["of_ceiling"] == pytest.approx(0.8)
    assert split["capacity_gap_pp"] == pytest.approx(10.0) and split["placement_gap_pp"] == pytest.approx(3.0)
    assert split["gap_pp"] == pytest.approx(split["capacity_gap_pp"] + split["placement_gap_pp"])


def test_hit_bounds_reports_both_rates() -> None:
    a = list(range(1, 13))
    bounds = hit_bounds([request(0, a), request(1, a + [99])], B, fleet_blocks=100)
    assert bounds["infinite_cache_hit_rate"] == bounds["pooled_lru_hit_rate"] == pytest.approx(12 / 25)


@pytest.mark.parametrize("spec, expected", [
    ("round_robin", {"policy": "round_robin"}),
    ("kv_aware", {"policy": "kv_aware", "kv_routing": None, "kv_bind_sessions": False}),
    ("kv_aware:decode=0.1", {"policy": "kv_aware", "kv_routing": KvRoutingConfig(weights=CostWeights(decode=0.1)),
                             "kv_bind_sessions": False}),
    ("kv_aware:prefill=2:kv_usage=4:temperature=0.5:bind",
     {"policy": "kv_aware", "kv_routing": KvRoutingConfig(weights=CostWeights(prefill=2, kv_usage=4), temperature=0.5),
      "kv_bind_sessions": True}),
])
def test_policy_specs_become_fleet_config_fields(spec: str, expected: dict) -> None:
    assert fleet_overrides(spec) == expected


@pytest.mark.parametrize("spec", ["random", "round_robin:decode=1", "kv_aware:decode", "kv_aware:speed=2"])
def test_a_bad_policy_spec_is_refused(spec: str) -> None:
    with pytest.raises(ValueError):
        fleet_overrides(spec)


def test_replay_kv_flags_set_each_worker_s_blocks_and_cost() -> None:
    args = parse_args(["trace", "--kv-tokens", "524288", "--block-size", "64", "--cost", "dynamo",
                       "--policies", "round_robin,kv_aware:decode=0.1"])
    config = fleet_config(args, load_profile("gb200-glm53"), 16, 0, "kv_aware:decode=0.1", "fp8", 0, "x")
    assert (config.block_size, config.num_kv_blocks, config.num_workers) == (64, 8192, 16)
    assert config.policy == "kv_aware" and config.kv_routing.weights.decode == 0.1
    assert isinstance(config.cost(), DynamoPolynomialCost)


@pytest.mark.parametrize("argv", [["trace", "--kv-tokens", "1000"],
                                  ["trace", "--kv-tokens", "1000", "--block-size", "64"],
                                  ["trace", "--policies", "kv_aware:nope=1"]])
def test_replay_refuses_inconsistent_flags(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)
