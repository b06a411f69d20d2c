"""services/admission/ledger.py: lease accounting, limits, the queue and weighted fair share, on a fake clock."""

from __future__ import annotations

from collections import Counter

import pytest

from services.admission.ledger import BATCH, INTERACTIVE, Grant, Ledger, PoolLimits, Reject, TeamLimits, Wait


def ledger(capacity: int = 100, teams: dict | None = None, ttl: float = 10.0, **pool) -> Ledger:
    return Ledger(PoolLimits(capacity, **pool), teams or {}, lease_ttl_s=ttl)


def ask(book: Ledger, ticket: str, tokens: int, team: str = "a", klass: str = INTERACTIVE, now: float = 0.0,
        deadline: float = 30.0):
    return book.acquire(now, ticket, team, klass, tokens, "edge-1", deadline)


@pytest.mark.parametrize("held, request_tokens, kwargs, outcome", [
    ([], 100, {}, Grant),  # exactly the capacity
    ([], 101, {}, "too_large"),
    ([60], 40, {}, Grant),
    ([60], 41, {}, Wait),
    ([], 10, dict(max_concurrency=1), Grant),
    ([10], 10, dict(max_concurrency=1), Wait),  # the pool's concurrency, not its tokens
    ([100], 1, dict(max_queue=0), "queue_full"),
    ([60], 40, dict(deadline=0.0), Grant),  # fits now: a request that will not wait is granted
    ([60], 41, dict(deadline=0.0), "queue_timeout"),  # no room now and it will not wait: answered at once
])
def test_acquire_grants_queues_or_rejects(held, request_tokens, kwargs, outcome):
    deadline = kwargs.pop("deadline", 30.0)
    book = ledger(**kwargs)
    for i, tokens in enumerate(held):
        assert isinstance(ask(book, f"h{i}", tokens), Grant)
    result = ask(book, "new", request_tokens, deadline=deadline)
    assert not isinstance(result, Reject) or not book.waiters  # a rejected request is never left queued
    if isinstance(outcome, str):
        assert isinstance(result, Reject) and result.code == outcome
    else:
        assert isinstance(result, outcome)


def test_release_returns_capacity_and_grants_the_waiter():
    book = ledger()
    ask(book, "l1", 70)
    assert isinstance(ask(book, "w1", 50), Wait)
    assert book.used_tokens == 70
    grants = book.release("l1", 1.0)
    assert [g.lease.lease_id for g in grants] == ["w1"] and book.used_tokens == 50
    assert book.release("l1", 1.0) == [] and book.release("nope", 1.0) == []  # idempotent


def test_a_lease_not_renewed_lapses_and_its_capacity_comes_back():
    book = ledger(ttl=5.0)
    ask(book, "l1", 60, now=0.0)
    ask(book, "l2", 40, now=0.0)
    assert book.renew("l2", 4.0).expires_at == 9.0
    assert isinstance(ask(book, "w", 30, now=4.5), Wait)
    grants, rejected = book.tick(5.0)  # l1 lapses at 5; l2 was renewed
    assert set(book.leases) == {"l2", "w"} and [g.lease.lease_id for g in grants] == ["w"] and not rejected
    assert book.renew("l1", 5.0) is None and book.used_tokens == 70


def test_a_waiter_past_its_deadline_is_rejected_with_retry_after():
    book = ledger()
    ask(book, "l1", 100)
    assert isinstance(ask(book, "w1", 10, deadline=2.0), Wait)
    grants, rejected = book.tick(2.0)
    assert grants == [] and [(w.ticket, r.code) for w, r in rejected] == [("w1", "queue_timeout")]
    assert rejected[0][1].retry_after_s >= 1 and book.waiters == []


@pytest.mark.parametrize("limits, asks, expected", [
    (TeamLimits(max_concurrency=2), [10, 10, 10], [Grant, Grant, "concurrency_limit"]),
    (TeamLimits(tokens_per_minute=50), [20, 20, 20], [Grant, Grant, "tokens_per_minute"]),
    (TeamLimits(tokens_per_minute=50), [60], ["tokens_per_minute"]),  # can never fit a minute
])
def test_team_limits(limits, asks, expected):
    book = ledger(teams={"a": limits})
    for i, (tokens, outcome) in enumerate(zip(asks, expected, strict=True)):
        result = ask(book, f"r{i}", tokens, now=float(i))
        if isinstance(outcome, str):
            assert isinstance(result, Reject) and result.code == outcome
        else:
            assert isinstance(result, outcome)


def test_tokens_per_minute_says_when_to_come_back():
    book = ledger(teams={"a": TeamLimits(tokens_per_minute=50)})
    ask(book, "r1", 30, now=0.0)
    ask(book, "r2", 20, now=10.0)
    result = ask(book, "r3", 25, now=20.0)
    assert isinstance(result, Reject) and result.retry_after_s == pytest.approx(40.0)  # r1 leaves the window at 60
    assert isinstance(ask(book, "r4", 25, now=60.0), Grant)


def test_interactive_goes_before_batch_and_batch_only_takes_idle_capacity():
    book = ledger(batch_share=0.8, preempt_batch=False)
    assert isinstance(ask(book, "b1", 80, klass=BATCH), Grant)
    assert isinstance(ask(book, "b2", 10, klass=BATCH), Wait)  # past 80% of the pool
    assert isinstance(ask(book, "i1", 20), Grant)  # interactive may use the rest
    assert isinstance(ask(book, "i2", 30), Wait)
    grants = book.release("b1", 1.0)
    # the interactive waiter first, though it came later; then batch, into what is still idle
    assert [g.lease.lease_id for g in grants] == ["i2", "b2"] and book.waiters == []


def test_an_interactive_request_revokes_the_newest_batch_leases_as_few_as_make_it_fit():
    book = ledger(batch_share=1.0)
    for ticket in ("b1", "b2", "b3"):
        assert isinstance(ask(book, ticket, 30, team="batchers", klass=BATCH), Grant)
    assert isinstance(ask(book, "i1", 50), Grant)  # 10 free: b3 and b2 go, b1 stays
    assert [lease.lease_id for lease in book.revocations] == ["b3", "b2"]
    assert sorted(book.leases) == ["b1", "i1"] and sorted(book.revoked) == ["b2", "b3"]
    assert book.used_tokens == 80 and book.team_usage("batchers") == (1, 30)
    assert isinstance(ask(book, "b4", 10, team="batchers", klass=BATCH), Grant)  # what is idle, batch may take


@pytest.mark.parametrize("held, pool, request_tokens, klass, revoked", [
    ([(INTERACTIVE, 60), (BATCH, 30)], {}, 50, INTERACTIVE, []),  # even every batch lease would not make room
    ([(BATCH, 60), (BATCH, 30)], dict(preempt_batch=False), 50, INTERACTIVE, []),  # preemption off
    ([(BATCH, 60), (BATCH, 30)], {}, 50, BATCH, []),  # batch never preempts batch
    ([(BATCH, 10), (BATCH, 10)], dict(max_concurrency=2), 10, INTERACTIVE, ["h1"]),  # a request slot, not tokens
    ([(BATCH, 45), (INTERACTIVE, 10), (BATCH, 40)], {}, 50, INTERACTIVE, ["h0"]),  # h2 was not needed after all
    ([(BATCH, 20), (BATCH, 30), (BATCH, 30)], {}, 60, INTERACTIVE, ["h2", "h1"]),  # newest first, both needed
    ([(BATCH, 60), (BATCH, 30)], dict(deadline=0.0), 50, INTERACTIVE, []),  # it will not wait: no preemption
])
def test_who_is_revoked(held, pool, request_tokens, klass, revoked):
    deadline = pool.pop("deadline", 30.0)
    book = ledger(batch_share=1.0, **pool)
    for i, (held_class, tokens) in enumerate(held):
        assert isinstance(ask(book, f"h{i}", tokens, klass=held_class), Grant)
    result = ask(book, "new", request_tokens, klass=klass, deadline=deadline)
    assert isinstance(result, Grant if revoked else (Reject if deadline == 0.0 else Wait))
    assert [lease.lease_id for lease in book.revocations] == revoked and sorted(book.revoked) == sorted(revoked)


def test_a_revoked_lease_holds_no_capacity_and_ends_as_any_lease_does():
    book = ledger(batch_share=1.0, ttl=5.0)
    ask(book, "b1", 60, klass=BATCH)
    ask(book, "b2", 40, klass=BATCH)
    ask(book, "i1", 40)  # revokes b2
    assert book.renew("b2", 2.0).expires_at == 7.0  # its holder renews it until its request has ended
    book.renew("i1", 2.0)
    assert book.release("b2", 3.0) == [] and book.used_tokens == 100 and "b2" not in book.revoked
    ask(book, "i2", 60, now=3.0)  # revokes b1, which is never renewed: it lapses
    assert [lease.lease_id for lease in book.revocations] == ["b2", "b1"]
    assert book.expired(5.0) == ["b1"] and book.expired(4.9) == []
    book.tick(5.0)
    assert book.revoked == {} and book.used_tokens == 100 and sorted(book.leases) == ["i1", "i2"]


def test_a_revoked_lease_does_not_count_against_its_teams_tokens_per_minute():
    book = ledger(batch_share=1.0, teams={"bulk": TeamLimits(tokens_per_minute=100)})
    assert isinstance(ask(book, "b1", 60, team="bulk", klass=BATCH), Grant)
    assert isinstance(ask(book, "i1", 80, team="other"), Grant)  # revokes b1
    book.release("b1", 1.0)
    again = ask(book, "b1-again", 60, team="bulk", klass=BATCH, now=1.0)  # the line sent again: its minute is free
    assert not isinstance(again, Reject)


def test_a_queued_interactive_request_revokes_when_capacity_frees():
    book = ledger(batch_share=1.0)
    ask(book, "i0", 60)
    ask(book, "b1", 40, klass=BATCH)
    assert isinstance(ask(book, "i1", 70), Wait) and book.revocations == []  # 60 + 70 > 100 even without b1
    grants = book.release("i0", 1.0)
    assert [g.lease.lease_id for g in grants] == ["i1"] and [lease.lease_id for lease in book.revocations] == ["b1"]


def test_a_full_queue_drops_its_newest_batch_waiter_for_an_interactive_one():
    book = ledger(max_queue=2)
    ask(book, "hold", 100)
    ask(book, "b1", 10, klass=BATCH)
    ask(book, "b2", 10, klass=BATCH)
    assert isinstance(ask(book, "b3", 10, klass=BATCH), Reject)
    assert isinstance(ask(book, "i1", 10), Wait)
    assert [w.ticket for w in book.bumped] == ["b2"] and [w.ticket for w in book.waiters] == ["b1", "i1"]


def test_weighted_fair_share_holds_the_pool_2_to_1():
    book = ledger(capacity=90, teams={"gold": TeamLimits(weight=2.0), "silver": TeamLimits(weight=1.0)})
    served, n, now = Counter(), 0, 0.0
    for team in ("gold", "silver"):  # both keep 30 requests waiting
        for _ in range(30):
            n += 1
            ask(book, f"{team}-{n}", 10, team=team, deadline=1e9)
    for _ in range(300):  # the oldest lease finishes, the next waiter is granted, its team asks again
        now += 1.0
        oldest = min(book.leases.values(), key=lambda lease: lease.expires_at)
        for grant in book.release(oldest.lease_id, now):
            served[grant.lease.team] += 1
            n += 1
            ask(book, f"{grant.lease.team}-{n}", 10, team=grant.lease.team, now=now, deadline=1e9)
    assert served["gold"] / served["silver"] == pytest.approx(2.0, rel=0.1)
    assert book.team_usage("gold")[1] == 2 * book.team_usage("silver")[1]


def test_a_head_that_does_not_fit_blocks_its_class():
    book = ledger()
    ask(book, "hold", 90)
    ask(book, "big", 50)
    assert isinstance(ask(book, "small", 5), Wait)  # would fit, but must not pass the big one
    assert book.release("hold", 1.0)[0].lease.lease_id == "big"


def test_set_pool_and_restore():
    book = ledger(capacity=50)
    ask(book, "l1", 50)
    assert isinstance(ask(book, "w", 40), Wait)
    assert [g.lease.lease_id for g in book.set_pool(PoolLimits(100), 1.0)] == ["w"]  # a worker joined
    fresh = ledger(capacity=100)
    for lease in book.leases.values():
        fresh.restore(lease)
        fresh.restore(lease)  # twice: counted once
    assert fresh.used_tokens == 90 and fresh.team_usage("a") == (2, 90)
    assert isinstance(ask(fresh, "x", 11), Wait)  # a restarted ledger never over-admits


def test_cancel_removes_a_waiter():
    book = ledger()
    ask(book, "hold", 100)
    ask(book, "w", 10)
    assert book.cancel("w") and not book.cancel("w") and book.release("hold", 1.0) == []


def test_a_gone_holders_leases_lapse_at_the_next_tick_and_no_one_elses():
    book = ledger(ttl=10.0)
    book.acquire(0.0, "mine", "a", INTERACTIVE, 50, "edge-dead", 30.0)
    book.acquire(0.0, "mine-batch", "a", BATCH, 20, "edge-dead", 30.0)
    book.acquire(0.0, "theirs", "a", INTERACTIVE, 30, "edge-alive", 30.0)
    assert isinstance(book.acquire(1.0, "waiter", "b", INTERACTIVE, 40, "edge-alive", 30.0), Wait)
    assert sorted(book.lapse_holder("edge-dead", 2.0)) == ["mine", "mine-batch"]
    assert book.lapse_holder("edge-dead", 2.0) == []  # already lapsing: not counted twice
    assert sorted(book.expired(2.0)) == ["mine", "mine-batch"]
    grants, _ = book.tick(2.0)  # long before their TTL (10 s)
    assert [g.lease.lease_id for g in grants] == ["waiter"]
    assert set(book.leases) == {"theirs", "waiter"} and book.used_tokens == 70


def test_a_holder_found_alive_after_all_renews_what_was_lapsing():
    book = ledger(ttl=10.0)
    book.acquire(0.0, "l1", "a", INTERACTIVE, 50, "edge-slow", 30.0)
    book.lapse_holder("edge-slow", 2.0)
    assert book.renew("l1", 2.0).expires_at == 12.0  # its renewal came before the tick: it holds on
    book.tick(2.0)
    assert set(book.leases) == {"l1"}
