"""loadtests/lib/fleet_sim.py: the offline discrete-event fleet on the sim engine's pure core."""

from __future__ import annotations

import dataclasses

import pytest

from loadtests.lib.fleet_sim import FleetConfig, FleetSim
from loadtests.lib.workloads import AgentSessions, Arrival
from services.worker.engines.cost_model import load_profile
from shared.prefix_hash import prompt_hashes

PROFILE = load_profile("gb200-glm53")


class Cost:
    """1 ms per prefill token + 10 ms per step; transfers 5 ms."""

    def step_time(self, prefills, decodes) -> float:
        return 0.010 + 0.001 * sum(n for n, _ in prefills)

    def transfer_time(self, num_tokens, block_size, layout) -> float:
        return 0.005

    def onload_time(self, num_tokens) -> float:
        return 0.0


class Fixed:
    """An open-loop list of arrivals."""

    def __init__(self, arrivals: list[Arrival]) -> None:
        self.arrivals, self.completed = arrivals, []

    def start(self) -> list[Arrival]:
        return list(self.arrivals)

    def on_complete(self, arrival, output_token_ids, t) -> list[Arrival]:
        self.completed.append((arrival.request_id, len(output_token_ids), t))
        return []

    @property
    def done(self) -> bool:
        return len(self.completed) == len(self.arrivals)


def config(**overrides) -> FleetConfig:
    options = dict(profile=PROFILE, num_workers=1, block_size=16, num_kv_blocks=256, max_num_batched_tokens=512,
                   max_num_seqs=16, cost=Cost)
    options.update(overrides)
    return FleetConfig(**options)


def arrival(i: int, t: float = 0.0, n: int = 100, max_tokens: int = 3, session: str | None = None) -> Arrival:
    return Arrival(t, f"r{i}", list(range(i * 1000, i * 1000 + n)), max_tokens, session)


def test_requests_arriving_together_share_the_first_step() -> None:
    result = FleetSim(config()).run(Fixed([arrival(0), arrival(1)]))
    first = {r.request_id: r.first_token_t for r in result.records}
    assert first["r0"] == first["r1"] == pytest.approx(0.010 + 0.001 * 200)


def test_tokens_and_timings_follow_the_cost_model() -> None:
    workload = Fixed([arrival(0, max_tokens=3)])
    (record,) = FleetSim(config()).run(workload).records
    prefill = 0.010 + 0.1
    assert record.token_times == pytest.approx([prefill, prefill + 0.010, prefill + 0.020])
    assert (record.scheduled_t, record.finish_t, record.error) == (0.0, record.token_times[-1], None)
    assert workload.completed == [("r0", 3, pytest.approx(prefill + 0.020))]


def test_disaggregated_request_is_prefilled_then_pulled_then_decoded() -> None:
    result = FleetSim(config(num_prefill=1)).run(Fixed([arrival(0, max_tokens=2)]))
    (record,) = result.records
    assert record.worker_id == "prefill-0>decode-0"
    prefill, pull, last_token = 0.010 + 0.1, 0.005, 0.010 + 0.001
    # the decode worker's first step only starts the pull (no compute); then it computes the last prompt token
    assert record.first_token_t == pytest.approx(prefill + pull + last_token)
    assert len(record.token_times) == 2


@pytest.mark.parametrize("policy, expected", [("round_robin", ["both-0", "both-1", "both-0", "both-1"]),
                                              ("session", ["both-0", "both-1", "both-0", "both-1"])])
def test_routing_policies(policy, expected) -> None:
    sessions = ["a", "b", "a", "b"]
    arrivals = [arrival(i, t=i * 10.0, session=s) for i, s in enumerate(sessions)]
    result = FleetSim(config(num_workers=2, policy=policy)).run(Fixed(arrivals))
    assert [r.worker_id for r in sorted(result.records, key=lambda r: r.arrival_t)] == expected


def test_a_request_that_never_fits_is_an_error_and_the_session_goes_on() -> None:
    workload = Fixed([arrival(0, n=256 * 16 + 1), arrival(1, t=1.0)])
    records = {r.request_id: r for r in FleetSim(config()).run(workload).records}
    assert records["r0"].error.startswith("too_long") and records["r1"].error is None
    assert [c[0] for c in workload.completed] == ["r0", "r1"]


def test_closed_loop_agent_sessions_run_every_turn_and_hit_the_cache() -> None:
    workload = AgentSessions(3, turns=4, scale=0.01, think_time_s=1.0, seed=3)
    result = FleetSim(config(num_workers=2, policy="session", num_kv_blocks=4096)).run(workload)
    assert workload.done and len(result.records) == 12
    assert all(r.error is None and r.finish_t is not None for r in result.records)
    later = [r for r in result.records if not r.request_id.endswith("-t0")]
    assert sum(r.num_cached_tokens for r in later) / sum(r.num_prompt_tokens for r in later) > 0.5


def test_dp_ranks_in_lockstep_wait_for_the_slowest_rank() -> None:
    # two prefill-heavy requests on two ranks: alone, the short one finishes its prefill early;
    # in one DP group both ranks' steps last as long as the long prompt's
    arrivals = [arrival(0, n=400, max_tokens=2), arrival(1, n=40, max_tokens=2)]
    alone = {r.request_id: r
             for r in FleetSim(config(num_workers=2, policy="round_robin")).run(Fixed(arrivals)).records}
    grouped = {r.request_id: r for r in FleetSim(config(num_workers=2, policy="round_robin", decode_dp_group=2))
               .run(Fixed(list(arrivals))).records}
    assert alone["r1"].first_token_t == pytest.approx(0.010 + 0.040)
    assert grouped["r1"].first_token_t == pytest.approx(0.010 + 0.400) == grouped["r0"].first_token_t
    assert grouped["r1"].token_times[1] - grouped["r1"].token_times[0] == pytest.approx(0.010)


def test_sessions_stay_on_their_prefill_worker_under_ordinary_load() -> None:
    # regression: the re-pin slack was 8 units for every pool, so prefill sessions (load in queued
    # tokens) bounced between prefill workers and lost their cached prefixes
    arrivals = []
    for turn in range(3):
        order = [0, 1, 2, 3] if turn == 0 else [0, 2, 1, 3]  # s2 arrives while its worker still prefills s0
        for i, s in enumerate(order):
            arrivals.append(Arrival(turn * 5.0 + i * 0.001, f"s{s}-t{turn}", list(range(s * 10_000, s * 10_000 + 300)),
                                    2, f"s{s}"))
    sim = FleetSim(config(num_workers=2, num_prefill=2, policy="session"))
    result = sim.run(Fixed(arrivals))
    prefill_of = {}
    for r in result.records:
        prefill_of.setdefault(r.session_id, set()).add(r.worker_id.split(">")[0])
    assert all(len(workers) == 1 for workers in prefill_of.values()) and sim.prefill_router.num_repins == 0


# ---------------------------------------------------------------- kv_aware: the live router's KvAwarePolicy
@pytest.mark.parametrize("block_size", [16, 64])  # the router's blocks are 16 tokens: engine blocks of 64 are 4 each
def test_kv_aware_sends_a_repeated_long_prefix_to_the_worker_that_cached_it(block_size) -> None:
    prefix = list(range(50_000, 50_800))  # 800 tokens
    arrivals = [Arrival(0.0, "first", prefix + [1, 2, 3], 3)]
    # unrelated traffic in between, then the prefix comes back three times
    arrivals += [arrival(i, t=1.0 + 0.001 * i, n=300) for i in range(1, 4)]
    arrivals += [Arrival(5.0 * k, f"again-{k}", prefix + [k] * 40, 3) for k in (1, 2, 3)]
    sim = FleetSim(config(num_workers=4, policy="kv_aware", block_size=block_size, num_kv_blocks=4096 // block_size))
    records = {r.request_id: r for r in sim.run(Fixed(arrivals)).records}
    first = records["first"].worker_id  # by chance alone, all three would land there 1 time in 64
    for k in (1, 2, 3):
        again = records[f"again-{k}"]
        assert again.worker_id == first
        assert again.num_cached_tokens >= 800 // block_size * block_size > 0
        assert sim.kv_router.expected_cached[again.request_id] >= again.num_cached_tokens
    index = sim.kv_router.index
    assert index.num_skipped_blocks == 0 and index.num_blocks(first) > 0


def test_kv_aware_index_follows_evictions() -> None:
    # one worker, a pool of 16 blocks: the second prompt evicts the first, and the index must say so
    sim = FleetSim(config(policy="kv_aware", num_kv_blocks=16))
    sim.run(Fixed([arrival(0, n=200, max_tokens=2), arrival(1, t=1.0, n=200, max_tokens=2)]))
    pool, index = sim.decoders[0].pool, sim.kv_router.index
    assert index.num_blocks("both-0") == pool.num_cached_blocks > 0
    for tokens in (list(range(0, 200)), list(range(1000, 1200))):
        in_pool = pool.find_cached_prefix(tokens + [7]) // 16  # one more token, so the last-token cap does not bite
        in_index = index.find_matches(prompt_hashes(tokens, "sim-model")).get("both-0")
        assert (in_index.device if in_index else 0) == in_pool
    assert pool.find_cached_prefix(list(range(0, 200)) + [7]) < 200 // 16 * 16  # the first prompt was evicted


class Anonymous:
    """Agent sessions whose requests carry no session id: only the prompts can keep a session together."""

    def __init__(self, inner: AgentSessions) -> None:
        self.inner, self._originals = inner, {}

    def _strip(self, arrivals: list[Arrival]) -> list[Arrival]:
        self._originals.update((a.request_id, a) for a in arrivals)
        return [dataclasses.replace(a, session_id=None) for a in arrivals]

    def start(self) -> list[Arrival]:
        return self._strip(self.inner.start())

    def on_complete(self, arrival, output_token_ids, t) -> list[Arrival]:
        return self._strip(self.inner.on_complete(self._originals[arrival.request_id], output_token_ids, t))

    @property
    def done(self) -> bool:
        return self.inner.done


def _hit_rate(policy: str) -> float:
    workload = AgentSessions(8, turns=8, scale=0.01, think_time_s=1.0, seed=5, stagger_s=2.0)
    result = FleetSim(config(num_workers=4, policy=policy, num_kv_blocks=64)).run(Anonymous(workload))
    assert workload.done and all(r.error is None for r in result.records)
    later = [r for r in result.records if not r.request_id.endswith("-t0")]
    return sum(r.num_cached_tokens for r in later) / sum(r.num_prompt_tokens for r in later)


def test_kv_aware_beats_round_robin_on_sessions_that_do_not_fit_every_worker() -> None:
    # 8 sessions of up to ~580 tokens on 4 workers of 1024 tokens of KV: a quarter of them fit a worker,
    # all of them do not, so round robin (every session on every worker) keeps evicting. Without session ids,
    # kv_aware cannot stick sessions by key: only its prefix index can.
    kv, rr = _hit_rate("kv_aware"), _hit_rate("round_robin")
    assert kv > rr + 0.15, (kv, rr)


def test_kv_aware_disaggregated_names_a_prefill_worker_and_the_decoder_keeps_the_prefix() -> None:
    prefix = list(range(60_000, 60_640))  # 640 tokens, 40 blocks
    arrivals = [Arrival(5.0 * k, f"p{k}", prefix + [k] * 20, 2) for k in range(3)]
    sim = FleetSim(config(num_workers=2, num_prefill=2, policy="kv_aware"))
    records = sorted(sim.run(Fixed(arrivals)).records, key=lambda r: r.arrival_t)
    assert all(r.error is None and ">" in r.worker_id for r in records)  # prefilled remotely, then decoded
    decoders = {r.worker_id.split(">")[1] for r in records}
    prefillers = {r.worker_id.split(">")[0] for r in records}
    assert len(decoders) == len(prefillers) == 1  # both sides go back to the worker holding the prefix
    assert all(r.num_cached_tokens >= 640 for r in records[1:])
