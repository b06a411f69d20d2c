"""LoopWatch on a fake clock: a loop that ran within max_stall_s is responsive, whatever its lag."""

from __future__ import annotations

import pytest

from shared.liveness import LoopWatch


@pytest.mark.parametrize("ticks, now, lag, responsive", [
    ([0.0], 0.0, 0.0, True),
    ([0.0], 10.0, 10.0, True),  # a 10 s grammar compile: busy, not hung
    ([0.0], 59.9, 59.9, True),
    ([0.0], 60.0, 60.0, False),  # stalled for max_stall_s: hung
    ([0.0, 55.0], 100.0, 45.0, True),  # it ran again at 55 s
    ([0.0, 5.0], 3.0, 0.0, True),  # a tick from the future (clock skew between threads) counts as no lag
])
def test_a_loop_is_responsive_while_it_ran_within_the_stall_limit(ticks, now, lag, responsive):
    watch = LoopWatch(max_stall_s=60.0, now=ticks[0])
    for t in ticks[1:]:
        watch.tick(t)
    assert watch.lag(now) == pytest.approx(lag)
    assert watch.responsive(now) is responsive


def test_a_stall_limit_must_be_positive():
    with pytest.raises(AssertionError):
        LoopWatch(max_stall_s=0, now=0.0)
