"""services/router/policy.py: least-loaded routing over the router's load view."""

from __future__ import annotations

from collections import Counter

import pytest

from services.router.policy import LeastLoadedPolicy, LoadView
from shared.schema import LoadSnapshot, RouteDecision, RouteRejected, RouteRequest, WorkerInfo


def worker(worker_id: str, role: str = "both", model: str = "m") -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role=role, model=model, engine="sim", block_size=16,
                      num_kv_blocks=100, max_model_len=1024, tokenizer="")


def snap(worker_id: str, running: int = 0, waiting: int = 0, seq: int = 1, ts: float = 1.0) -> LoadSnapshot:
    return LoadSnapshot(source_id=worker_id, seq=seq, ts=ts, num_running=running, num_waiting=waiting,
                        num_active_blocks=0, num_kv_blocks=100)


def request(model: str = "m", exclude: list[str] | None = None) -> RouteRequest:
    return RouteRequest(request_id="r", model=model, num_prompt_tokens=10, exclude_worker_ids=exclude or [])


def view(*snapshots: LoadSnapshot) -> LoadView:
    loads = LoadView()
    for s in snapshots:
        loads.observe(s)
    return loads


@pytest.mark.parametrize(
    "workers, req, code",
    [
        ([], request(), "model_not_found"),
        ([worker("a", model="other")], request(), "model_not_found"),
        ([worker("a", role="prefill"), worker("b", role="prefill")], request(), "no_capacity"),
        ([worker("a"), worker("b", role="decode")], request(exclude=["a", "b"]), "no_capacity"),
    ],
)
def test_rejected(workers, req, code):
    reply = LeastLoadedPolicy().route(req, workers, LoadView())
    assert isinstance(reply, RouteRejected)
    assert reply.code == code


@pytest.mark.parametrize(
    "workers, snapshots, req, chosen",
    [
        # least loaded wins; running and waiting both count
        ([worker("a"), worker("b"), worker("c")], [snap("a", 3), snap("b", 1), snap("c", 2)], request(), "b"),
        ([worker("a"), worker("b")], [snap("a", 1, 0), snap("b", 0, 2)], request(), "a"),
        # a worker without a snapshot counts as idle
        ([worker("a"), worker("b")], [snap("a", 1)], request(), "b"),
        # exclude list honoured even when the excluded worker is the least loaded
        ([worker("a"), worker("b")], [snap("a", 0), snap("b", 5)], request(exclude=["a"]), "b"),
        # prefill-only workers never serve; decode workers do
        ([worker("a", role="prefill"), worker("b", role="decode")], [snap("b", 9)], request(), "b"),
        # other models' workers are ignored
        ([worker("a", model="x"), worker("b")], [snap("b", 9)], request(), "b"),
    ],
)
def test_least_loaded_chosen(workers, snapshots, req, chosen):
    reply = LeastLoadedPolicy().route(req, workers, view(*snapshots))
    assert isinstance(reply, RouteDecision) and reply.worker_id == chosen


@pytest.mark.parametrize(
    "workers, snapshots, num_prompt, min_remote, decision",
    [
        # no prefill workers: aggregated
        ([worker("a"), worker("b", role="decode")], [snap("a", 1)], 10, 1, RouteDecision("b")),
        # a prefill pool: the least-loaded prefill worker computes the prompt
        ([worker("p1", role="prefill"), worker("p2", role="prefill"), worker("d", role="decode")],
         [snap("p1", 3), snap("p2", 1)], 10, 1, RouteDecision("d", prefill_worker_id="p2")),
        # short prompts skip the prefill hop
        ([worker("p1", role="prefill"), worker("d", role="decode")], [], 10, 64, RouteDecision("d")),
        ([worker("p1", role="prefill"), worker("d", role="decode")], [], 64, 64, RouteDecision("d", prefill_worker_id="p1")),
        # another model's prefill workers are not used
        ([worker("p1", role="prefill", model="x"), worker("d", role="decode")], [], 10, 1, RouteDecision("d")),
    ],
)
def test_prefill_worker_paired_when_the_model_has_a_prefill_pool(workers, snapshots, num_prompt, min_remote,
                                                                 decision):
    req = RouteRequest(request_id="r", model="m", num_prompt_tokens=num_prompt)
    assert LeastLoadedPolicy(min_remote_prefill_tokens=min_remote).route(req, workers, view(*snapshots)) == decision


def test_excluded_prefill_worker_is_not_paired():
    workers = [worker("p1", role="prefill"), worker("d", role="decode")]
    assert LeastLoadedPolicy().route(request(exclude=["p1"]), workers, LoadView()) == RouteDecision("d")


def test_ties_spread_round_robin():
    policy = LeastLoadedPolicy()
    workers = [worker("c"), worker("a"), worker("b")]
    # a fresh (all idle) view each time: only the tie-break decides
    picks = [policy.route(request(), workers, LoadView()).worker_id for _ in range(6)]
    assert picks == ["a", "b", "c", "a", "b", "c"]


def test_repeated_calls_share_one_view_evenly():
    policy, loads = LeastLoadedPolicy(), LoadView()
    workers = [worker("a"), worker("b"), worker("c")]
    picks = Counter(policy.route(request(), workers, loads).worker_id for _ in range(9))
    assert picks == {"a": 3, "b": 3, "c": 3}


def test_routed_since_snapshot_counts_until_next_snapshot():
    policy, loads = LeastLoadedPolicy(), view(snap("a", 0), snap("b", 2))
    workers = [worker("a"), worker("b")]
    assert [policy.route(request(), workers, loads).worker_id for _ in range(2)] == ["a", "a"]
    assert loads.routed_since_snapshot == {"a": 2, "b": 0}
    assert loads.num_requests("a") == 2
    loads.observe(snap("a", 0, seq=2, ts=2.0))  # a's fresh snapshot supersedes the guesses
    assert loads.routed_since_snapshot["a"] == 0
    assert policy.route(request(), workers, loads).worker_id == "a"


@pytest.mark.parametrize(
    "second, applied",
    [
        (snap("a", 7, seq=1, ts=1.0), False),  # duplicate
        (snap("a", 7, seq=0, ts=0.5), False),  # stale: lower seq and ts
        (snap("a", 7, seq=2, ts=2.0), True),
        (snap("a", 7, seq=0, ts=2.0), True),  # a restarted worker: seq reset, newer ts
        (snap("a", 7, seq=2, ts=0.5), True),
    ],
)
def test_observe_ignores_stale_snapshots(second, applied):
    loads = view(snap("a", 1, seq=1, ts=1.0))
    loads.routed("a")
    loads.observe(second)
    assert loads.num_requests("a") == (7 if applied else 2)


def test_forget_drops_a_worker():
    loads = view(snap("a", 4), snap("b", 1))
    loads.routed("a")
    loads.forget("a")
    loads.forget("never-seen")
    assert "a" not in loads.snapshots and "a" not in loads.routed_since_snapshot
    assert loads.num_requests("a") == 0
    assert loads.num_requests("b") == 1


def test_idle_decode_and_prefill_pools_each_spread_over_all_their_workers():
    # regression: one tie-break counter served both picks of a route, advancing by 2 per request,
    # so each pool with an even number of tied workers only ever got every other worker
    policy = LeastLoadedPolicy()
    workers = [worker(f"d{i}", role="decode") for i in range(4)] + [worker(f"p{i}", role="prefill") for i in range(4)]
    decisions = [policy.route(request(), workers, LoadView()) for _ in range(8)]
    assert Counter(d.worker_id for d in decisions) == {f"d{i}": 2 for i in range(4)}
    assert Counter(d.prefill_worker_id for d in decisions) == {f"p{i}": 2 for i in range(4)}
