"""services/worker/engine_restart.py: when a worker starts a fresh engine after its engine died, on a fake clock."""

from __future__ import annotations

import pytest

from services.worker.engine_restart import EnginePhase, EngineRestartPolicy, RestartBackoff

# events: ("died" | "failed" | "started", at); expected: the next start time each failure returns (None: give up)
CASES = {
    "a death restarts at once": ([("died", 100.0)], [100.0]),
    "failed starts back off 1 s, 2 s, then give up": (
        [("died", 100.0), ("failed", 110.0), ("failed", 121.0), ("failed", 133.0)], [100.0, 111.0, 123.0, None]),
    "a start that works ends the streak after a stable run": (
        [("died", 100.0), ("failed", 110.0), ("started", 121.0), ("died", 181.0)], [100.0, 111.0, 181.0]),
    "an engine that dies right after its start is crash-looping": (
        [("died", 100.0), ("started", 110.0), ("died", 115.0), ("started", 125.0), ("died", 126.0),
         ("started", 136.0), ("died", 137.0)], [100.0, 116.0, 128.0, None]),
    "one death a stable run after the last never gives up": (
        [("died", 100.0), ("started", 110.0), ("died", 170.0), ("started", 180.0), ("died", 240.0)],
        [100.0, 170.0, 240.0]),
}


@pytest.mark.parametrize("events, expected", CASES.values(), ids=CASES.keys())
def test_restart_times_follow_the_streak(events, expected):
    policy = EngineRestartPolicy(RestartBackoff(max_tries=3, initial_s=1.0, factor=2.0, stable_s=60.0),
                                 started_at=0.0)
    decisions = []
    for event, at in events:
        if event == "died":
            decisions.append(policy.died(at))
        elif event == "failed":
            decisions.append(policy.start_failed(at))
        else:
            policy.started(at)
    assert decisions == expected
    assert policy.phase is (EnginePhase.GAVE_UP if expected[-1] is None else EnginePhase.RESTARTING)


def test_the_delay_is_capped():
    backoff = RestartBackoff(max_tries=10, initial_s=1.0, factor=2.0, max_s=5.0)
    assert [backoff.delay_s(n) for n in range(1, 7)] == [0.0, 1.0, 2.0, 4.0, 5.0, 5.0]


def test_restarts_are_counted_and_the_phase_follows():
    policy = EngineRestartPolicy(started_at=0.0)
    assert policy.phase is EnginePhase.SERVING
    policy.died(500.0)
    assert policy.phase is EnginePhase.RESTARTING
    policy.started(520.0)
    assert (policy.phase, policy.restarts) == (EnginePhase.SERVING, 1)


def test_inputs_out_of_order_are_bugs():
    policy = EngineRestartPolicy()
    with pytest.raises(AssertionError):
        policy.started(1.0)  # serving already
    with pytest.raises(AssertionError):
        policy.start_failed(1.0)
