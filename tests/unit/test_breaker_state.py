"""services/breaker/state.py: the breaker state machine on a fake clock."""

from __future__ import annotations

import pytest

from services.breaker.state import Breaker, BreakerPolicy, State

OK, FAIL = True, False


def run(steps, policy: BreakerPolicy = BreakerPolicy()) -> tuple[Breaker, list[tuple[float, str, str]]]:
    """Feed (time, what) steps: True/False outcomes, "tick", "lapse", ("probe", rid), ("out", rid, ok)."""
    breaker = Breaker("w", policy)
    moves = []
    for now, what in steps:
        if what == "tick":
            t = breaker.tick(now)
        elif what == "lapse":
            t = breaker.heartbeat_lapsed(now)
        elif isinstance(what, tuple) and what[0] == "probe":
            breaker.probe_taken(what[1], now)
            t = None
        elif isinstance(what, tuple):
            t = breaker.record(now, what[2], what[1])
        else:
            t = breaker.record(now, what)
        if t is not None:
            moves.append((now, t.new.value, t.reason))
    return breaker, moves


@pytest.mark.parametrize("outcomes, opened", [
    ([OK, FAIL, OK, FAIL, OK], None),  # 40% of 5
    ([FAIL, OK, FAIL, OK, FAIL], "error_rate"),  # 60% of 5
    ([FAIL, OK, FAIL, OK], None),  # 50%, but only 4 outcomes
    ([OK, OK, FAIL, FAIL, OK, FAIL], "error_rate"),  # 3 of 6 = 50%: opens at the threshold
    ([OK] * 20 + [FAIL] * 5, "consecutive_failures"),  # 20% of 25, but 5 in a row
    ([OK] * 20 + [FAIL] * 4 + [OK], None),
])
def test_closed_opens_on_error_rate_or_consecutive_failures(outcomes, opened):
    _, moves = run([(0.1 * i, ok) for i, ok in enumerate(outcomes)])
    assert moves == ([] if opened is None else [(pytest.approx(0.1 * (len(outcomes) - 1)), "open", opened)])


def test_the_window_forgets_outcomes_older_than_10_s():
    # 3 failures long ago, then 3 successes and 2 failures within the window: 40% of 5
    steps = [(0.0, FAIL), (1.0, FAIL), (2.0, FAIL), (20.0, OK), (21.0, OK), (22.0, OK), (23.0, FAIL), (24.0, FAIL)]
    breaker, moves = run(steps)
    assert moves == [] and breaker.error_rate(24.0) == pytest.approx(0.4)
    assert breaker.error_rate(40.0) == 0.0


def test_open_half_open_probe_and_close():
    steps = [(0, FAIL), (1, FAIL), (2, FAIL), (3, FAIL), (4, FAIL),  # opens at 4
             (5, "tick"), (8.9, "tick"),  # cool-down 5 s: still open
             (9, "tick"),  # half-open, period 1
             (9.5, ("out", "stale", False)),  # a request routed before: ignored
             (10, ("probe", "p1")), (10.1, ("probe", "p2")),  # one permit: p2 does not get it
             (11, ("out", "p2", False)),  # not the probe: ignored
             (12, ("out", "p1", True))]
    breaker, moves = run(steps)
    assert moves == [(4, "open", "consecutive_failures"), (9, "half_open", "cooldown"),
                     (12, "closed", "probe_succeeded")]
    assert breaker.period == 1 and breaker.state is State.CLOSED and breaker.probe_request_id == ""


def test_a_failed_probe_reopens_and_the_cool_down_restarts():
    steps = [(0, "lapse"), (5, "tick"), (6, ("probe", "p1")), (7, ("out", "p1", False)),
             (11.9, "tick"), (12, "tick"), (13, ("probe", "p2")), (14, ("out", "p2", True))]
    _, moves = run(steps)
    assert moves == [(0, "open", "heartbeat"), (5, "half_open", "cooldown"), (7, "open", "probe_failed"),
                     (12, "half_open", "cooldown"), (14, "closed", "probe_succeeded")]


def test_n_successes_take_n_periods_of_one_probe_each():
    policy = BreakerPolicy(close_after_successes=2)
    steps = [(0, "lapse"), (5, "tick"), (5.5, ("probe", "p1")), (6, ("out", "p1", True)),
             (6.5, ("out", "p1", True)),  # the same probe again: no longer this period's permit
             (7, ("probe", "p2")), (8, ("out", "p2", True))]
    breaker, moves = run(steps, policy)
    assert moves == [(0, "open", "heartbeat"), (5, "half_open", "cooldown"), (6, "half_open", "probe_succeeded"),
                     (8, "closed", "probe_succeeded")]
    assert breaker.period == 2


def test_an_unanswered_probe_lapses_into_open():
    policy = BreakerPolicy(probe_timeout_s=3)
    steps = [(0, "lapse"), (5, "tick"), (6, ("probe", "p1")), (8.9, "tick"), (9, "tick")]
    _, moves = run(steps, policy)
    assert moves[-1] == (9, "open", "probe_timeout")


def test_half_open_without_a_probe_taken_waits():
    _, moves = run([(0, "lapse"), (5, "tick"), (500, "tick")], BreakerPolicy(probe_timeout_s=3))
    assert moves == [(0, "open", "heartbeat"), (5, "half_open", "cooldown")]


def test_outcomes_while_open_change_nothing_and_a_lapse_while_open_is_not_a_new_transition():
    breaker, moves = run([(0, "lapse"), (1, FAIL), (2, OK), (3, "lapse")])
    assert moves == [(0, "open", "heartbeat")] and breaker.since == 0


def test_closing_forgets_the_old_window():
    steps = [(0, FAIL), (0.1, FAIL), (0.2, FAIL), (0.3, FAIL), (0.4, FAIL), (5.4, "tick"), (5.5, ("probe", "p")),
             (5.6, ("out", "p", True)), (5.7, FAIL), (5.8, OK), (5.9, OK), (6.0, OK)]
    breaker, moves = run(steps)
    assert [m[1] for m in moves] == ["open", "half_open", "closed"] and breaker.state is State.CLOSED


@pytest.mark.parametrize("kwargs", [dict(window_s=0), dict(min_requests=0), dict(error_rate=0),
                                    dict(error_rate=1.5), dict(consecutive_failures=0), dict(cooldown_s=-1),
                                    dict(close_after_successes=0), dict(probe_timeout_s=0)])
def test_policy_validation(kwargs):
    with pytest.raises(AssertionError):
        BreakerPolicy(**kwargs)
