"""services/worker/engines/sim_worker.py: steps priced by the cost model, roles, KV pulls, host onloads."""

from __future__ import annotations

import dataclasses

import pytest

from services.worker.engines.cost_model import CostModel, load_profile
from services.worker.engines.scheduler import SimRequest
from services.worker.engines.sim_worker import SimWorker, SimWorkerConfig

PROFILE = load_profile("gb200-glm53")


def worker(role: str = "both", **overrides) -> SimWorker:
    options = dict(block_size=16, num_kv_blocks=64, host_kv_blocks=0, max_num_batched_tokens=64, max_num_seqs=8)
    options.update(overrides)
    return SimWorker(SimWorkerConfig("w", PROFILE, role, **options))


def run(w: SimWorker, now: float = 0.0) -> tuple[float, list[tuple[SimRequest, int]]]:
    """Run steps until idle: (end time, every (request, token) produced)."""
    produced = []
    while (step := w.begin_step(now)) is not None:
        assert not step.transfers
        now += step.duration_s
        produced += w.end_step(step, now)
    return now, produced


def test_steps_cost_what_the_cost_model_says_and_stamp_tokens() -> None:
    w = worker()
    request = SimRequest("a", list(range(100)), 3, arrival_t=0.0)
    w.add(request, seed=1)
    cost = CostModel(PROFILE, "fp8")
    step = w.begin_step(0.0)
    assert step.duration_s == pytest.approx(cost.step_time([(64, 0)], []))  # the 64-token budget: one chunk
    w.end_step(step, step.duration_s)
    step2 = w.begin_step(step.duration_s)
    assert step2.duration_s == pytest.approx(cost.step_time([(36, 64)], []))
    end, produced = step.duration_s + step2.duration_s, w.end_step(step2, step.duration_s + step2.duration_s)
    assert [r.request_id for r, _ in produced] == ["a"] and request.token_times == [end]
    end, produced = run(w, end)
    assert request.finish_reason == "length" and len(request.token_times) == 3
    assert request.scheduled_t == 0.0 and request.token_times[-1] == pytest.approx(end)


def test_same_prompt_and_seed_same_tokens_across_workers() -> None:
    outputs = []
    for seed in (7, 7, 8):
        w = worker()
        w.add(SimRequest("a", list(range(50)), 10), seed=seed)
        outputs.append([t for _, t in run(w)[1]])
    assert outputs[0] == outputs[1] != outputs[2]
    assert set(outputs[0]) <= set(range(50))


def test_prefill_role_makes_one_token_and_hands_over() -> None:
    w = worker("prefill")
    request = SimRequest("a", list(range(40)), 100)
    w.add(request)
    _, produced = run(w)
    assert len(produced) == 1 and request.finish_reason == "remote"
    assert w.load().num_running == 0


@pytest.mark.parametrize("layout", ["BLHNC", "LBHNC"])
def test_decode_role_pulls_uncached_kv_then_computes_the_last_token(layout) -> None:
    w = worker("decode", kv_layout=layout)
    prompt = list(range(100))
    w.add(SimRequest("warm", prompt[:48] + [999], 1))  # caches 3 blocks (48 tokens) locally
    run(w)
    request = SimRequest("a", prompt, 4, remote_kv=True)
    w.add(request)
    step = w.begin_step(1.0)
    assert step.duration_s == 0.0 and len(step.transfers) == 1
    pulled, seconds, epoch = step.transfers[0]
    expected = CostModel(PROFILE, "fp8").transfer_time(100 - 1 - 48, 16, layout)
    assert pulled is request and seconds == pytest.approx(expected)
    w.end_step(step, 1.0)
    assert w.begin_step(1.0) is None  # nothing to run while the KV is in flight
    w.kv_ready(request, epoch + 1)  # a stale completion is ignored
    assert w.begin_step(1.0) is None
    w.kv_ready(request, epoch)
    step = w.begin_step(1.0 + seconds)
    assert step.batch.prefills == [(request, 1)]  # only the last prompt token is computed here
    w.end_step(step, 2.0)
    _, produced = run(w, 2.0)
    assert request.finish_reason == "length" and len(request.output_token_ids) == 4
    assert request.num_cached_tokens == 48


def test_host_tier_hit_is_charged_an_onload() -> None:
    w = worker(num_kv_blocks=8, host_kv_blocks=32)
    a = list(range(100, 196))  # 6 blocks
    w.add(SimRequest("a", a + [1], 1))
    run(w)
    w.add(SimRequest("b", list(range(500, 596)) + [1], 1))  # evicts a's blocks to the host tier
    run(w)
    request = SimRequest("c", a + [2, 3], 1)
    w.add(request)
    step = w.begin_step(0.0)
    cost = CostModel(PROFILE, "fp8")
    assert request.num_cached_tokens == 96 and w.pool.host_hit_tokens("c") > 0
    onload = cost.onload_time(w.pool.host_hit_tokens("c"))
    assert onload > 0 and step.duration_s == pytest.approx(cost.step_time([(2, 96)], []) + onload)


def test_without_a_profile_a_cost_object_is_required() -> None:
    config = SimWorkerConfig("w", None, block_size=16, num_kv_blocks=8, max_num_batched_tokens=8, max_num_seqs=2)
    with pytest.raises(AssertionError):
        SimWorker(config)
    assert SimWorker(config, CostModel(PROFILE)).pool.num_blocks == 8
    sized = SimWorkerConfig("w", PROFILE, kv_dtype="nvfp4")
    assert sized.num_kv_blocks == PROFILE.num_kv_blocks("nvfp4") and sized.block_size == PROFILE.block_size
    assert dataclasses.replace(sized, num_kv_blocks=5).num_kv_blocks == 5


class _BrokenDecoder:
    """A grammar decoder whose closing raises on its third token (as xgrammar's jump-forward once did)."""

    stop_token_ids = [1]

    def __init__(self) -> None:
        self.num_calls = 0

    def forced_token(self, remaining: int) -> int:
        self.num_calls += 1
        if self.num_calls == 3:
            raise UnicodeDecodeError("utf-8", b"\xea", 0, 1, "unexpected end of data")
        return 7

    def accept(self, token: int) -> None:
        pass


def test_a_failing_grammar_fails_its_request_alone() -> None:
    """Before: the exception left end_step, so the sim engine's step loop died and every request hung."""
    w = worker()
    broken = SimRequest("broken", list(range(20)), 8, frozenset({1}), arrival_t=0.0)
    healthy = SimRequest("healthy", list(range(30, 50)), 8, arrival_t=0.0)
    w.add(broken, seed=1, decoder=_BrokenDecoder())  # type: ignore[arg-type]
    w.add(healthy, seed=1)
    _, produced = run(w)
    assert healthy.finish_reason == "length" and len(healthy.output_token_ids) == 8
    assert broken.finish_reason == "abort"
    assert [t for r, t in produced if r is broken] == [7, 7]  # the tokens before the failure, not after
    [(request, error)] = w.take_failed()
    assert request is broken and error.startswith("UnicodeDecodeError") and w.take_failed() == []
    assert all(r is not broken for r in (*w.scheduler.running, *w.scheduler.waiting))


@pytest.mark.parametrize("cut", [1, 7, 19])
def test_a_resumed_request_goes_on_as_the_undisturbed_one(cut: int) -> None:
    """Migration: another worker given the prompt + the first ``cut`` tokens makes exactly the rest."""
    prompt = list(range(40, 90))
    w = worker()
    w.add(SimRequest("a", prompt, 20), seed=5)
    whole = [t for _, t in run(w)[1]]
    other = worker()
    resumed = SimRequest("b", prompt + whole[:cut], 20 - cut)
    other.add(resumed, seed=5, resumed=cut)
    assert [t for _, t in run(other)[1]] == whole[cut:]
    assert resumed.finish_reason == "length"


@pytest.mark.parametrize("cut", [2, 4, 5, 11])
def test_a_thought_budget_closes_the_thought_and_a_resumed_request_replays_it(cut: int) -> None:
    """The sim writes </think> (999) after 4 thought tokens, in place of a draw: the draws after it are the ones the
    request would have made; a migrated request (cut before, at or after the close) makes exactly the rest."""
    from services.worker.engines.thinking import ThoughtBudget
    from shared.schema import Thinking

    prompt, thinking = list(range(40, 90)), Thinking(4, [999], open=True)
    plain, thought = worker(), worker()
    plain.add(SimRequest("a", prompt, 15), seed=5)
    thought.add(SimRequest("a", prompt, 16), seed=5, thought=ThoughtBudget(thinking))
    draws = [t for _, t in run(plain)[1]]
    whole = [t for _, t in run(thought)[1]]
    assert whole == draws[:4] + [999] + draws[4:]
    other = worker()
    resumed = SimRequest("b", prompt + whole[:cut], 16 - cut)
    other.add(resumed, seed=5, resumed=cut, thought=ThoughtBudget(thinking))
    assert [t for _, t in run(other)[1]] == whole[cut:]
