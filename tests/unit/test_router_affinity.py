"""services/router/affinity.py: when a session keeps its decode worker and why it is re-pinned (repin_reason,
AffinityLimits)."""

from __future__ import annotations

import pytest

from services.router.affinity import KEEP, AffinityLimits, repin_reason

W = "w"


def reason(live=(W,), eligible=(W,), breakers=(), excluded=(), kv_usage=0.0, queued=0,
           limits: AffinityLimits = AffinityLimits()) -> str | None:
    return repin_reason(W, live=set(live), eligible=set(eligible), open_breakers=set(breakers),
                        excluded=set(excluded), kv_usage=kv_usage, queued_prefill_tokens=queued, limits=limits)


def test_keep_is_none():
    assert KEEP is None


@pytest.mark.parametrize("situation, expected", [
    (dict(), KEEP),
    (dict(live=("other",)), "gone"),
    (dict(live=()), "gone"),
    (dict(breakers=(W,)), "breaker_open"),
    (dict(breakers=("other",)), KEEP),
    (dict(excluded=(W,)), "excluded"),
    (dict(excluded=("other",)), KEEP),
    (dict(eligible=()), "ineligible"),
    (dict(eligible=("other",)), "ineligible"),
    # KV usage: past the limit (0.95 by default), not at it
    (dict(kv_usage=0.95), KEEP),
    (dict(kv_usage=0.951), "overloaded"),
    (dict(kv_usage=1.2), "overloaded"),
    (dict(kv_usage=0.6, limits=AffinityLimits(max_kv_usage=0.5)), "overloaded"),
    (dict(kv_usage=0.5, limits=AffinityLimits(max_kv_usage=0.5)), KEEP),
    (dict(kv_usage=1.0, limits=AffinityLimits(max_kv_usage=1.0)), KEEP),
    # queued prefill: 0 means no limit
    (dict(queued=10**9), KEEP),
    (dict(queued=10**9, limits=AffinityLimits(max_queued_prefill_tokens=0)), KEEP),
    (dict(queued=4096, limits=AffinityLimits(max_queued_prefill_tokens=4096)), KEEP),
    (dict(queued=4097, limits=AffinityLimits(max_queued_prefill_tokens=4096)), "overloaded"),
    (dict(queued=1, limits=AffinityLimits(max_queued_prefill_tokens=1)), KEEP),
    (dict(queued=2, limits=AffinityLimits(max_queued_prefill_tokens=1)), "overloaded"),
])
def test_reason(situation, expected):
    assert reason(**situation) == expected


# Each row turns on everything from one rule down: the first rule that holds is the reason given.
EVERYTHING = dict(live=(), breakers=(W,), excluded=(W,), eligible=(), kv_usage=1.0, queued=10_000,
                  limits=AffinityLimits(max_kv_usage=0.9, max_queued_prefill_tokens=100))


@pytest.mark.parametrize("switched_off, expected", [
    ((), "gone"),
    (("live",), "breaker_open"),
    (("live", "breakers"), "excluded"),
    (("live", "breakers", "excluded"), "ineligible"),
    (("live", "breakers", "excluded", "eligible"), "overloaded"),  # by KV usage
    (("live", "breakers", "excluded", "eligible", "kv_usage"), "overloaded"),  # by queued prefill
    (("live", "breakers", "excluded", "eligible", "kv_usage", "queued"), KEEP),
])
def test_precedence(switched_off, expected):
    healthy = dict(live=(W,), breakers=(), excluded=(), eligible=(W,), kv_usage=0.0, queued=0)
    situation = {**EVERYTHING, **{k: healthy[k] for k in switched_off}}
    assert reason(**situation) == expected


def test_the_other_worker_being_down_does_not_matter():
    assert reason(live=(W, "x"), eligible=(W,), breakers=("x",), excluded=("x", "y")) == KEEP


def test_accepts_any_collections():
    assert repin_reason(W, live=[W], eligible=(W,), open_breakers=frozenset(), excluded=[], kv_usage=0.0,
                        queued_prefill_tokens=0, limits=AffinityLimits()) == KEEP
    assert repin_reason(W, live={W: object()}, eligible=[W], open_breakers=[W], excluded=(), kv_usage=0.0,
                        queued_prefill_tokens=0, limits=AffinityLimits()) == "breaker_open"


def test_limits_defaults():
    assert AffinityLimits() == AffinityLimits(max_kv_usage=0.95, max_queued_prefill_tokens=0)


@pytest.mark.parametrize("kwargs", [
    dict(max_kv_usage=0.0),
    dict(max_kv_usage=-0.5),
    dict(max_kv_usage=1.01),
    dict(max_queued_prefill_tokens=-1),
])
def test_limits_reject_bad_values(kwargs):
    with pytest.raises(AssertionError):
        AffinityLimits(**kwargs)


@pytest.mark.parametrize("kwargs", [
    dict(max_kv_usage=1.0),
    dict(max_kv_usage=0.01),
    dict(max_queued_prefill_tokens=0),
    dict(max_queued_prefill_tokens=1),
])
def test_limits_accept_good_values(kwargs):
    limits = AffinityLimits(**kwargs)
    for name, value in kwargs.items():
        assert getattr(limits, name) == value
