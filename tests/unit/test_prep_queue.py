"""The fair, bounded prep queue (services/edge/prep_queue.py): order, caps, the per-team bucket, deadlines.

Times are a fake clock (plain floats); processes are indices.
"""

from __future__ import annotations

import pytest

from services.edge.prep_queue import BASE_COST, PrepQueue, QueueLimits, Rejected, Ticket

MIB = 1 << 20


def queue(workers: int = 2, **limits) -> PrepQueue:
    return PrepQueue(QueueLimits(**limits), workers)


def submit(q: PrepQueue, team: str, size: int, now: float = 0.0, preferred: int | None = None) -> Ticket:
    ticket = q.submit(team, size, now, preferred)
    assert isinstance(ticket, Ticket), ticket
    return ticket


def test_one_job_of_a_quiet_team_goes_before_the_queue_of_a_flooding_one():
    # the FIFO this replaces served team B's turn after all of A's (the review's finding 1)
    q = queue(workers=1, team_running=1)
    flood = [submit(q, "a", int(1.5 * MIB)) for _ in range(6)]
    assert q.dispatch([0]) == [flood[0]]
    turn = submit(q, "b", 80_000, now=0.1)
    q.finish(flood[0], 1.5, now=1.5)
    assert q.dispatch([0]) == [turn]


def test_big_jobs_and_small_jobs_share_by_bytes():
    # A's jobs are 4x B's: B gets about 4 jobs for each of A's while both are backlogged
    q = queue(workers=1, team_running=1, team_queued=32)
    for _ in range(4):
        submit(q, "a", 4 * MIB)
    for _ in range(16):
        submit(q, "b", MIB)
    order = []
    for _ in range(10):
        (ticket,) = q.dispatch([0])
        order.append(ticket.team)
        q.finish(ticket, 0.0, 0.0)
    assert order.count("b") == 8 and order.count("a") == 2


@pytest.mark.parametrize("team_running, idle, want", [
    (1, [0, 1, 2], 1),   # a team takes one process, however many are idle
    (2, [0, 1, 2], 2),
    (3, [0, 1], 2),      # and never more than are idle
])
def test_a_team_runs_at_most_its_share_of_processes(team_running, idle, want):
    q = queue(workers=3, team_running=team_running)
    for _ in range(4):
        submit(q, "a", MIB)
    assert len(q.dispatch(idle)) == want
    assert q.running("a") == want


def test_another_team_gets_the_process_the_first_may_not_use():
    q = queue(workers=2, team_running=1)
    submit(q, "a", MIB)
    submit(q, "a", MIB)
    b = submit(q, "b", 1000)
    started = q.dispatch([0, 1])
    assert [t.team for t in started] == ["a", "b"] and b.worker == 1


@pytest.mark.parametrize("limits, queued, size, reason", [
    ({"team_queued": 2}, [("a", 10), ("a", 10)], 10, "team_queue_full"),
    ({"total_queued": 2}, [("b", 10), ("c", 10)], 10, "queue_full"),
    ({"total_queued_bytes": 3 * MIB}, [("b", 2 * MIB)], 2 * MIB, "queue_full"),
])
def test_a_full_queue_rejects_with_a_reason_and_a_wait(limits, queued, size, reason):
    q = queue(**limits)
    for team, n in queued:
        submit(q, team, n)
    rejected = q.submit("a", size, 0.0)
    assert isinstance(rejected, Rejected) and rejected.reason == reason and rejected.retry_after_s >= 1


def test_the_bucket_of_prep_seconds_refills_at_the_rate():
    q = queue(rate_s=1.0, burst_s=4.0)
    assert q.check_rate("a", 0.0) is None
    q.charge("a", 6.0, now=0.0)  # a job measured 6 s: the bucket is 2 s in debt
    rejected = q.check_rate("a", 0.5)
    assert isinstance(rejected, Rejected) and rejected.reason == "team_rate_limited"
    assert rejected.retry_after_s == pytest.approx(1.5)
    assert q.check_rate("b", 0.5) is None  # another team's bucket is its own
    assert isinstance(q.submit("a", 10, 1.0), Rejected)
    assert q.check_rate("a", 2.0) is None  # paid back
    q.charge("a", 0.0, now=100.0)
    q.charge("a", 4.0, now=100.0)  # banked at most burst_s: 4 s of work empties it, no more
    assert q.check_rate("a", 100.0) is None and isinstance(q.submit("a", 10, 100.0), Ticket)


def test_a_queued_job_can_be_withdrawn_and_its_place_is_free():
    q = queue(team_queued=1)
    ticket = submit(q, "a", MIB)
    assert isinstance(q.submit("a", MIB, 0.0), Rejected)
    assert q.cancel(ticket) and not q.cancel(ticket)
    assert (q.queued, q.queued_bytes) == (0, 0)
    assert q.dispatch([0]) == []
    submit(q, "a", MIB)


def test_each_job_has_its_deadline_from_submission():
    q = queue(deadline_s=30.0)
    assert submit(q, "a", 10, now=5.0).deadline == 35.0


def test_a_job_whose_process_died_runs_again_first():
    q = queue(workers=1, team_running=1)
    first, second = submit(q, "a", 10), submit(q, "a", 10)
    assert q.dispatch([0]) == [first]
    q.requeue(first)
    assert q.running("a") == 0 and q.dispatch([0]) == [first]
    q.finish(first, 0.1, 0.1)
    assert q.dispatch([0]) == [second]


@pytest.mark.parametrize("preferred, idle, worker", [
    (1, [0, 1, 2], 1),  # its conversation's process, when free
    (1, [0, 2], 0),     # else any free one
    (None, [2], 2),
])
def test_a_job_prefers_its_process(preferred, idle, worker):
    q = queue(workers=3)
    ticket = submit(q, "a", 10, preferred=preferred)
    assert q.dispatch(idle) == [ticket] and ticket.worker == worker


def test_tiny_jobs_cost_something():
    q = queue(workers=1, team_running=1, team_queued=64)
    for _ in range(40):
        submit(q, "a", 0)
    big = submit(q, "b", 32 * BASE_COST)  # 33 tiny jobs' cost: it runs before most of A's tiny ones
    order = []
    while (started := q.dispatch([0])):
        order.append(started[0])
        q.finish(started[0], 0.0, 0.0)
    assert order.index(big) <= 34
