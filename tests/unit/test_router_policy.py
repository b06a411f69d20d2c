"""services/router/policy.py: the KV-aware policy (filters, affinity, cost, pick, prefill pairing) and least-loaded."""

from __future__ import annotations

from collections import Counter

import pytest

from services.router.affinity import AffinityLimits
from services.router.index import PrefixIndex
from services.router.policy import KvAwarePolicy, KvRoutingConfig, LeastLoadedPolicy, RouteView
from services.router.scoring import CostWeights, LoadView
from shared.prefix_hash import prompt_hashes
from shared.schema import BlockStored, LoadSnapshot, RouteDecision, RouteRejected, RouteRequest, WorkerInfo

BS = 16
NOW = 1000.0


def worker(worker_id: str, role: str = "both", model: str = "m", block_size: int = BS, kv_dtype: str = "auto",
           num_kv_blocks: int = 1000, kv_layout: str = "LBHNC", kv_connector: str = "sim") -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role=role, model=model, engine="sim", block_size=block_size,
                      num_kv_blocks=num_kv_blocks, max_model_len=100_000, tokenizer="", kv_dtype=kv_dtype, ts=NOW,
                      kv_layout=kv_layout, kv_connector=kv_connector)


def snap(worker_id: str, running: int = 0, waiting: int = 0, blocks: int = 0, prefill: int = 0, seq: int = 1,
         ts: float = 1.0) -> LoadSnapshot:
    return LoadSnapshot(source_id=worker_id, seq=seq, ts=ts, num_running=running, num_waiting=waiting,
                        num_active_blocks=blocks, num_kv_blocks=1000, num_prefill_tokens=prefill)


def loads(*snapshots: LoadSnapshot) -> LoadView:
    view = LoadView()
    for s in snapshots:
        view.observe(s)
    return view


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def request(prompt: list[int] | int = 64, rid: str = "r", session: str | None = None,
            exclude: list[str] | None = None, model: str = "m", salt: str | None = None) -> RouteRequest:
    ids = tokens(prompt) if isinstance(prompt, int) else prompt
    return RouteRequest(rid, model, len(ids), session, exclude or [], prompt_hashes(ids, model, None, salt, BS), BS)


def cached(index: PrefixIndex, worker_id: str, ids: list[int], medium: str = "GPU", salt: str | None = None) -> None:
    """``worker_id`` holds the full blocks of ``ids`` (engine hashes made up: 1000*slot + i)."""
    n = len(ids) // BS
    base = 1_000_000 * (index.workers().index(worker_id) + 1) + (0 if medium == "GPU" else 500_000)
    index.apply(worker_id, [BlockStored([base + i for i in range(n)], None, ids[:n * BS], BS, medium=medium,
                                        cache_salt=salt)])


def setup(*workers: WorkerInfo, weights: CostWeights = CostWeights(), **config) -> tuple[KvAwarePolicy, list]:
    index = PrefixIndex(BS)
    for w in workers:
        index.add_worker(w.worker_id, w.model)
    return KvAwarePolicy(index, KvRoutingConfig(weights=weights, **config)), list(workers)


def route(policy, workers, req, view_loads=None, bound=None, open_breakers=frozenset()):
    return policy.route(req, RouteView(workers, view_loads or LoadView(), NOW, frozenset(open_breakers)), bound)


# ------------------------------------------------------------ rejections and filters
@pytest.mark.parametrize("policy_kind", ["kv", "ll"])
@pytest.mark.parametrize("workers, req, breakers, code", [
    ([], request(), (), "model_not_found"),
    ([worker("a", model="other")], request(), (), "model_not_found"),
    ([worker("a", role="prefill")], request(), (), "no_capacity"),
    ([worker("a"), worker("b", role="decode")], request(exclude=["a", "b"]), (), "no_capacity"),
    ([worker("a"), worker("b")], request(), ("a", "b"), "no_capacity"),  # every breaker open
])
def test_rejected(policy_kind, workers, req, breakers, code):
    policy = setup(*workers)[0] if policy_kind == "kv" else LeastLoadedPolicy()
    plan = route(policy, workers, req, open_breakers=breakers)
    assert isinstance(plan.reply, RouteRejected) and plan.reply.code == code


def test_stale_heartbeat_breaker_and_excluded_workers_are_never_chosen():
    stale = WorkerInfo(worker_id="stale", role="both", model="m", engine="sim", block_size=BS, num_kv_blocks=1000,
                       max_model_len=100_000, tokenizer="", ts=NOW - 60)
    policy, workers = setup(worker("a"), worker("b"), worker("c"), stale)
    for i in range(50):
        plan = route(policy, workers, request(rid=f"r{i}", exclude=["b"]), open_breakers={"c"})
        assert plan.reply.worker_id == "a"


def test_when_every_heartbeat_went_stale_together_the_registry_failed_and_the_workers_still_serve():
    """The workers bucket had no leader for seconds after its NATS server was SIGKILLed: every worker's heartbeat
    went stale at once while every worker served. The router answered no_capacity to all (10 s in the cluster
    test); it now routes among them, still minding breakers and exclusions. One fresh worker is preferred."""
    def stale(worker_id: str) -> WorkerInfo:
        return WorkerInfo(worker_id=worker_id, role="both", model="m", engine="sim", block_size=BS,
                          num_kv_blocks=1000, max_model_len=100_000, tokenizer="", ts=NOW - 60)

    for policy in (setup()[0], LeastLoadedPolicy()):
        workers = [stale("a"), stale("b"), stale("c")]
        chosen = {route(policy, workers, request(rid=f"r{i}", exclude=["b"]), open_breakers={"c"}).reply.worker_id
                  for i in range(20)}
        assert chosen == {"a"}, policy.name
        assert {route(policy, [stale("a"), worker("b")], request(rid=f"r{i}")).reply.worker_id
                for i in range(20)} == {"b"}, policy.name


# ------------------------------------------------------------ prefix overlap decides
def test_a_cached_prefix_wins_over_an_idle_worker():
    policy, workers = setup(worker("a"), worker("b"), worker("c"))
    prompt = tokens(32 * BS)
    cached(policy.index, "b", prompt[:30 * BS])
    plan = route(policy, workers, request(prompt), loads(snap("b", running=2, blocks=4)))
    assert plan.reply == RouteDecision("b", num_cached_tokens_expected=30 * BS)
    assert plan.prefill_tokens == 2 * BS and plan.prompt_tokens == 32 * BS


def test_load_outweighs_a_short_overlap():
    policy, workers = setup(worker("a"), worker("b"))
    prompt = tokens(8 * BS)
    cached(policy.index, "b", prompt[:2 * BS])
    # b saves 2 blocks of prefill but holds 50 more active blocks than a
    plan = route(policy, workers, request(prompt), loads(snap("b", blocks=50)))
    assert plan.reply.worker_id == "a" and plan.reply.num_cached_tokens_expected == 0


@pytest.mark.parametrize("host_weight, chosen", [(0.75, "dev"), (1.0, "dev"), (0.0, "dev")])
def test_device_overlap_beats_the_same_overlap_on_the_host_tier(host_weight, chosen):
    policy, workers = setup(worker("dev"), worker("host"), weights=CostWeights(host_overlap=host_weight))
    prompt = tokens(10 * BS)
    cached(policy.index, "dev", prompt[:6 * BS])
    cached(policy.index, "host", prompt[:6 * BS], medium="CPU")
    costs = route(policy, workers, request(prompt)).costs
    assert costs["host"] - costs["dev"] == pytest.approx(6 * (1 - host_weight))
    if host_weight < 1.0:
        assert route(policy, workers, request(prompt)).reply.worker_id == chosen


def test_salted_blocks_match_only_the_same_salt():
    policy, workers = setup(worker("a"), worker("b"))
    prompt = tokens(8 * BS)
    cached(policy.index, "a", prompt, salt="tenant-1")
    assert route(policy, workers, request(prompt, salt="tenant-1")).reply.num_cached_tokens_expected == 8 * BS
    for salt in (None, "tenant-2"):
        assert route(policy, workers, request(prompt, salt=salt)).reply.num_cached_tokens_expected == 0


def test_hashes_at_another_block_size_are_ignored_not_misread():
    policy, workers = setup(worker("a"), worker("b"))
    prompt = tokens(8 * BS)
    cached(policy.index, "a", prompt)
    req = RouteRequest("r", "m", len(prompt), block_hashes=prompt_hashes(prompt, "m", block_size=32), block_size=32)
    assert route(policy, workers, req).reply.num_cached_tokens_expected == 0


def test_pending_load_spreads_a_burst_of_cold_requests():
    policy, workers = setup(*(worker(w) for w in "abcd"))
    view_loads = LoadView()
    picks = Counter()
    for i in range(40):
        plan = route(policy, workers, request(tokens(4 * BS, start=100 * i), rid=f"r{i}"), view_loads)
        view_loads.routed(plan.reply.worker_id, plan.prefill_tokens, plan.prompt_tokens)  # as the service does
        picks[plan.reply.worker_id] += 1
    assert picks == {"a": 10, "b": 10, "c": 10, "d": 10}


def test_same_view_same_decision_for_every_replica():
    ws = [worker(f"w{i}") for i in range(8)]
    replicas = [setup(*ws, temperature=t)[0] for t in (0.0, 0.0)] + [setup(*ws, temperature=0.5)[0] for _ in (0, 1)]
    for i in range(100):
        a, b, c, d = (route(p, ws, request(rid=f"r{i}")).reply.worker_id for p in replicas)
        assert a == b and c == d


def test_softmax_temperature_spreads_ties_and_favours_low_cost():
    ws = [worker("cheap"), worker("dear")]
    policy = setup(*ws, temperature=1.0)[0]
    picks = Counter(route(policy, ws, request(rid=f"r{i}"), loads(snap("dear", blocks=40))).reply.worker_id
                    for i in range(400))
    assert picks["cheap"] > picks["dear"] > 0


# ------------------------------------------------------------ session affinity
def test_a_bound_session_stays_even_when_another_worker_is_cheaper():
    policy, workers = setup(worker("a"), worker("b"))
    plan = route(policy, workers, request(session="s"), loads(snap("a", blocks=30)), bound="a")
    assert plan.reply.worker_id == "a" and plan.sticky and plan.repin_reason is None


@pytest.mark.parametrize("bound, breakers, exclude, snapshot, reason", [
    ("gone", (), [], snap("a", blocks=5), "gone"),
    ("a", ("a",), [], None, "breaker_open"),
    ("a", (), ["a"], None, "excluded"),
    ("a", (), [], snap("a", blocks=990), "overloaded"),  # 99% KV usage > 95%
])
def test_a_bound_session_is_repinned_with_a_reason(bound, breakers, exclude, snapshot, reason):
    policy, workers = setup(worker("a"), worker("b"))
    plan = route(policy, workers, request(session="s", exclude=exclude), loads(snapshot) if snapshot else None,
                 bound=bound, open_breakers=breakers)
    assert plan.reply.worker_id == "b" and not plan.sticky and plan.repin_reason == reason


def test_queued_prefill_limit_repins_when_set():
    ws = [worker("a"), worker("b")]
    busy = loads(snap("a", prefill=5000))
    assert route(setup(*ws)[0], ws, request(session="s"), busy, bound="a").reply.worker_id == "a"
    limited = setup(*ws, affinity=AffinityLimits(max_queued_prefill_tokens=4096))[0]
    assert route(limited, ws, request(session="s"), busy, bound="a").repin_reason == "overloaded"


# ------------------------------------------------------------ prefill pool (disaggregated)
def test_prefill_worker_is_the_cheapest_compatible_one():
    ws = [worker("d", role="decode"), worker("p-far", role="prefill"), worker("p-near", role="prefill"),
          worker("p-fp8", role="prefill", kv_dtype="fp8"), worker("p-bs32", role="prefill", block_size=32)]
    policy = setup(*ws)[0]
    prompt = tokens(20 * BS)
    cached(policy.index, "p-near", prompt[:12 * BS])
    cached(policy.index, "p-fp8", prompt)  # holds it all, but its KV cannot go to d
    cached(policy.index, "p-bs32", prompt)
    for i in range(20):
        plan = route(policy, ws, request(prompt, rid=f"r{i}"))
        assert plan.reply == RouteDecision("d", 0, prefill_worker_id="p-near")
        assert plan.prefill_tokens == 0  # the decoder computes nothing


@pytest.mark.parametrize("incompatible", [
    dict(block_size=2 * BS), dict(kv_dtype="fp8"), dict(kv_layout="BLHNC"), dict(kv_connector="nixl"),
    dict(kv_connector=""),
])
def test_an_incompatible_prefill_worker_is_never_chosen(incompatible):
    """Whatever it holds and however idle it is, a prefill worker whose KV the decoder cannot take (other block
    size, KV dtype, layout or connector) is never paired; with no compatible one the decoder prefills itself."""
    ws = [worker("d", role="decode"), worker("p-other", role="prefill", **incompatible)]
    policy = setup(*ws)[0]
    prompt = tokens(20 * BS)
    cached(policy.index, "p-other", prompt)
    busy = loads(snap("d", running=8, prefill=4096))
    for i in range(50):
        assert route(policy, ws, request(prompt, rid=f"r{i}"), busy).reply == RouteDecision("d", 0)
        assert LeastLoadedPolicy().route(request(prompt, rid=f"r{i}"), RouteView(ws, busy, NOW)).reply == \
            RouteDecision("d")


@pytest.mark.parametrize("cached_blocks, min_remote, remote", [
    (0, 1, True), (20, 1, False),  # all cached on the decoder: no hop
    (14, 128, False), (12, 128, True),  # 96 uncached < 128: local; 128 uncached: remote
])
def test_conditional_disaggregation(cached_blocks, min_remote, remote):
    ws = [worker("d", role="decode"), worker("p", role="prefill")]
    policy = setup(*ws, min_remote_prefill_tokens=min_remote)[0]
    prompt = tokens(20 * BS)
    if cached_blocks:
        cached(policy.index, "d", prompt[:cached_blocks * BS])
    plan = route(policy, ws, request(prompt))
    assert plan.reply.prefill_worker_id == ("p" if remote else "")


# ------------------------------------------------------------ least-loaded
@pytest.mark.parametrize("workers, snapshots, req, chosen", [
    ([worker("a"), worker("b"), worker("c")], [snap("a", 3), snap("b", 1), snap("c", 2)], request(), "b"),
    ([worker("a"), worker("b")], [snap("a", 1, 0), snap("b", 0, 2)], request(), "a"),
    ([worker("a"), worker("b")], [snap("a", 1)], request(), "b"),  # no snapshot: idle
    ([worker("a"), worker("b")], [snap("a", 0), snap("b", 5)], request(exclude=["a"]), "b"),
    ([worker("a", role="prefill"), worker("b", role="decode")], [snap("b", 9)], request(), "b"),
    ([worker("a", model="x"), worker("b")], [snap("b", 9)], request(), "b"),
])
def test_least_loaded_chosen(workers, snapshots, req, chosen):
    assert LeastLoadedPolicy().route(req, RouteView(workers, loads(*snapshots), NOW)).reply.worker_id == chosen


def test_least_loaded_pairs_the_least_loaded_compatible_prefill_worker():
    ws = [worker("p1", role="prefill"), worker("p2", role="prefill"), worker("p3", role="prefill", kv_dtype="fp8"),
          worker("d", role="decode")]
    plan = LeastLoadedPolicy().route(request(), RouteView(ws, loads(snap("p1", 3), snap("p2", 1)), NOW))
    assert plan.reply == RouteDecision("d", prefill_worker_id="p2")
    short = LeastLoadedPolicy(min_remote_prefill_tokens=100).route(request(64), RouteView(ws, LoadView(), NOW))
    assert short.reply == RouteDecision("d")


def test_least_loaded_ties_spread_over_request_ids():
    ws = [worker(f"d{i}", role="decode") for i in range(4)] + [worker(f"p{i}", role="prefill") for i in range(4)]
    plans = [LeastLoadedPolicy().route(request(rid=f"r{i}"), RouteView(ws, LoadView(), NOW)) for i in range(400)]
    assert set(Counter(p.reply.worker_id for p in plans)) == {f"d{i}" for i in range(4)}
    assert set(Counter(p.reply.prefill_worker_id for p in plans)) == {f"p{i}" for i in range(4)}


def full_worker(worker_id: str, seqs: int) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role="both", model="m", engine="sim", block_size=BS, num_kv_blocks=1000,
                      max_model_len=100_000, tokenizer="", max_num_seqs=seqs, ts=NOW)


@pytest.mark.parametrize("running, session, chosen", [
    (2, False, "b"),  # a at its 2 seqs: a new placement goes where it starts now, cache or not
    (1, False, "a"),  # room on a: its cache wins
    (2, True, "a"),  # a bound session waits for its full worker (its cache is worth more)
])
def test_a_worker_running_all_it_can_gets_no_new_placements(running, session, chosen):
    ws = [full_worker("a", 2), full_worker("b", 2)]
    policy = setup(*ws)[0]
    prompt = tokens(12 * BS)
    cached(policy.index, "a", prompt)
    plan = route(policy, ws, request(prompt, session="s" if session else None), loads(snap("a", running=running)),
                 bound="a" if session else None)
    assert plan.reply.worker_id == chosen


def test_when_every_worker_is_full_the_cost_still_decides():
    ws = [full_worker("a", 1), full_worker("b", 1)]
    policy = setup(*ws)[0]
    prompt = tokens(12 * BS)
    cached(policy.index, "b", prompt)
    plan = route(policy, ws, request(prompt), loads(snap("a", running=1), snap("b", running=1)))
    assert plan.reply.worker_id == "b"


# ------------------------------------------------------------ the hot loops written out inline
@pytest.mark.parametrize("seed", range(5))
def test_the_inline_costs_equal_worker_cost_and_the_inline_filters_equal_scoring_filters(seed):
    import random

    from services.router import policy as policy_module, scoring
    from services.router.index import Overlap

    rng = random.Random(seed)
    workers = [worker(f"w{i}", role=rng.choice(["both", "decode", "prefill"]), model=rng.choice(["m", "m", "x"]),
                      num_kv_blocks=rng.choice([0, 500, 1000])) for i in range(24)]
    workers = [w if rng.random() < 0.7 else type(w)(**{**{f: getattr(w, f) for f in w.__struct_fields__},
                                                        "ts": NOW - rng.choice([1.0, 60.0])}) for w in workers]
    weights = CostWeights(prefill=rng.uniform(0, 2), decode=rng.uniform(0, 2), kv_usage=rng.uniform(0, 3),
                          host_overlap=rng.uniform(0, 1))
    policy, _ = setup(*workers, weights=weights)
    view_loads = loads(*[snap(w.worker_id, blocks=rng.randrange(900), prefill=rng.randrange(5000))
                         for w in workers if rng.random() < 0.8])
    matches = {w.worker_id: Overlap(rng.randrange(40), rng.randrange(10)) for w in workers if rng.random() < 0.5}
    blocks = rng.randrange(1, 50)
    got = policy._costs(workers, blocks, matches, view_loads)
    for w in workers:
        queued, active = view_loads.figures(w)
        capacity = w.num_kv_blocks * w.block_size
        assert got[w.worker_id] == pytest.approx(scoring.worker_cost(
            weights, blocks, matches.get(w.worker_id, Overlap()), queued, active,
            active / capacity if capacity else 0.0, BS), rel=1e-12, abs=1e-12)

    req = request(exclude=[w.worker_id for w in workers if rng.random() < 0.2])
    breakers = frozenset(w.worker_id for w in workers if rng.random() < 0.2)
    view = RouteView(workers, view_loads, NOW, breakers)
    for roles in (("both", "decode"), ("prefill",)):
        filters = [scoring.for_model(req.model), scoring.in_roles(roles), scoring.breaker_allows(breakers),
                   scoring.not_excluded(req.exclude_worker_ids)]
        fresh = scoring.apply_filters(workers, [scoring.heartbeat_fresh(NOW), *filters])
        assert policy_module._eligible(req, view, roles) == (fresh or scoring.apply_filters(workers, filters))


def test_the_deployed_weights_keep_a_long_history_on_its_busy_worker():
    # docs/results/kv_routing's example: 567 prompt blocks, 536 cached on "a", which holds 1,064 active blocks;
    # "b" is idle with only the system prompt. Dynamo's form (decode 1) moves the history and recomputes it.
    from services.router.config import RouterConfig

    a, b = worker("a", num_kv_blocks=4000), worker("b", num_kv_blocks=4000)
    prompt = tokens(567 * BS)
    view_loads = loads(snap("a", running=2, blocks=1064), snap("b"))
    chosen = {}
    for name, routing in (("deployed", RouterConfig().routing()), ("dynamo", KvRoutingConfig(CostWeights(1, 1)))):
        index = PrefixIndex(BS)
        for w in (a, b):
            index.add_worker(w.worker_id, w.model)
        cached(index, "a", prompt[:536 * BS])
        cached(index, "b", prompt[:18 * BS])
        plan = route(KvAwarePolicy(index, routing), [a, b], request(prompt), view_loads)
        chosen[name] = plan.reply.worker_id
    assert chosen == {"deployed": "a", "dynamo": "b"}
