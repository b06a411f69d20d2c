"""loadtests/fleet_sim.py: the offline discrete-event fleet on the sim engine's pure core."""

from __future__ import annotations

import pytest

from loadtests.fleet_sim import FleetConfig, FleetSim
from loadtests.workloads import AgentSessions, Arrival
from services.worker.engines.cost_model import load_profile

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
    alone = {r.request_id: r for r in FleetSim(config(num_workers=2, policy="round_robin")).run(Fixed(arrivals)).records}
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
