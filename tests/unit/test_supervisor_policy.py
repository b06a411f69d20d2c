"""infermesh/restart_policy.py: when ``up`` restarts a dead process, on a fake clock."""

from __future__ import annotations

import pytest

from infermesh.restart_policy import Backoff, Phase, RestartPolicy

SIGKILL = -9


def crash_loop(policy: RestartPolicy, name: str, runs_s: list[float], start: float = 0.0):
    """Start ``name`` at ``start``; each run lasts runs_s[i], then it dies and is restarted when due.
    Returns the Restart decisions in order."""
    now, decisions = start, []
    policy.started(name, now)
    for run_s in runs_s:
        now += run_s
        decision = policy.exited(name, 1, now)
        decisions.append(decision)
        assert policy.due(decision.at - 0.001) == [] and policy.due(decision.at) == [name]
        now = decision.at
        policy.started(name, now)
    return decisions


@pytest.mark.parametrize("runs_s, delays, looping", [
    ([1.0], [0.5], [False]),
    ([1.0] * 8, [0.5, 1, 2, 4, 8, 16, 30, 30], [False] * 6 + [True, True]),  # doubling, capped at 30 s
    ([1.0, 1.0, 1.0, 30.0], [0.5, 1, 2, 0.5], [False] * 4),  # 30 s up resets the backoff
    ([1.0, 1.0, 29.9], [0.5, 1, 2], [False] * 3),  # just short of stable: still climbing
    ([100.0, 100.0], [0.5, 0.5], [False, False]),  # a rare crash after long runs always waits the least
    ([1.0] * 7 + [31.0, 1.0], [0.5, 1, 2, 4, 8, 16, 30, 0.5, 1], [False] * 6 + [True, False, False]),
])
def test_backoff_doubles_to_the_cap_and_resets_after_a_stable_run(runs_s, delays, looping):
    decisions = crash_loop(RestartPolicy(), "worker-0", runs_s)
    assert [d.delay_s for d in decisions] == delays
    assert [d.crash_looping for d in decisions] == looping
    assert [d.restarts for d in decisions] == list(range(1, len(runs_s) + 1))  # never reset


def test_a_crash_looping_process_is_retried_at_the_cap_forever():
    decisions = crash_loop(RestartPolicy(), "edge", [0.1] * 50)
    assert all(d.delay_s == 30 and d.crash_looping for d in decisions[6:])
    assert decisions[-1].restarts == 50 and decisions[-1].streak == 50


def test_the_decision_carries_how_it_ended_and_how_long_it_ran():
    policy = RestartPolicy()
    policy.started("worker-1", 10.0)
    decision = policy.exited("worker-1", SIGKILL, 22.5)
    assert (decision.name, decision.exit_code, decision.uptime_s, decision.at) == ("worker-1", SIGKILL, 12.5, 23.0)
    assert policy.phase("worker-1") is Phase.BACKOFF


def test_processes_back_off_independently_and_come_due_in_time_order():
    policy = RestartPolicy()
    for name in ("edge", "router", "worker-0"):
        policy.started(name, 0.0)
    crash_loop(policy, "router", [0.1] * 5, start=80.0)  # running again at 96 s, its next delay 16 s
    policy.exited("router", 1, 100.0)  # due at 116
    policy.exited("worker-0", SIGKILL, 100.2)  # first exit: due at 100.7
    policy.exited("edge", SIGKILL, 100.1)  # due at 100.6
    assert policy.next_due() == pytest.approx(100.6)
    assert policy.due(100.65) == ["edge"]
    assert policy.due(101.0) == ["edge", "worker-0"]  # still due until started
    policy.started("edge", 101.0)
    policy.started("worker-0", 101.0)
    assert policy.due(115.9) == [] and policy.due(116.0) == ["router"]
    assert policy.phase("edge") is Phase.RUNNING


def test_an_exit_seen_twice_is_scheduled_once():
    policy = RestartPolicy()
    policy.started("metering", 0.0)
    first = policy.exited("metering", 1, 1.0)
    assert policy.exited("metering", 1, 1.2) is None
    assert policy.next_due() == first.at


def test_nothing_restarts_once_the_mesh_is_stopping():
    policy = RestartPolicy()
    policy.started("nats", 0.0)
    policy.started("edge", 0.0)
    policy.exited("edge", 1, 1.0)
    policy.stop()  # Ctrl-C: the pending edge restart is dropped, the exits of the stop are ignored
    assert policy.exited("nats", -15, 1.1) is None
    assert policy.due(1000.0) == [] and policy.next_due() is None
    policy.started("late", 2.0)
    assert policy.phase("late") is Phase.STOPPED and policy.phase("nats") is Phase.STOPPED


def test_nothing_is_due_while_everything_runs():
    policy = RestartPolicy()
    policy.started("router", 0.0)
    assert policy.due(1e9) == [] and policy.next_due() is None and policy.phase("unknown") is None


@pytest.mark.parametrize("backoff, delays", [
    (Backoff(initial_s=1, factor=3, max_s=10), [1, 3, 9, 10, 10]),
    (Backoff(initial_s=2, factor=1, max_s=2), [2, 2, 2, 2, 2]),
])
def test_backoff_shape_is_configurable(backoff, delays):
    assert [backoff.delay_s(streak) for streak in range(1, 6)] == delays


def test_a_backoff_that_cannot_work_is_refused():
    with pytest.raises(AssertionError):
        Backoff(initial_s=5, max_s=1)
