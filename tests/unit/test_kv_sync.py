"""services/router/kv_sync.py: KvSyncTracker, what the router does with each worker's numbered KV event batches
(apply, drop, hold, replay after a gap, snapshot for a new or restarted worker) and catching up."""

from __future__ import annotations

import pytest

from services.router.kv_sync import Action, KvSyncTracker
from shared.schema import KvEventBatch

W = "w"
APPLY, DROP, HOLD, REPLAY, SNAPSHOT = Action.APPLY, Action.DROP, Action.HOLD, Action.REPLAY, Action.SNAPSHOT


def batch(seq: int, worker: str = W, ts: float | None = None) -> KvEventBatch:
    return KvEventBatch(source_id=worker, seq=seq, ts=float(seq) if ts is None else ts, events=[])


def run(tracker: KvSyncTracker, ops: list[tuple]) -> list:
    """Play ``ops`` on ``tracker`` and return what each gave back:

    ("b", seq)           on_batch         -> Action
    ("start",)           start            -> Action
    ("up", seq)          caught_up        -> ([seqs of the batches to apply], whole)
    ("applied", seq)     applied          -> None
    ("forget",)          forget           -> None
    """
    out = []
    for op, *args in ops:
        if op == "b":
            out.append(tracker.on_batch(batch(args[0])))
        elif op == "start":
            out.append(tracker.start(W))
        elif op == "up":
            ready, whole = tracker.caught_up(W, args[0])
            out.append(([b.seq for b in ready], whole))
        elif op == "applied":
            out.append(tracker.applied(W, args[0]))
        elif op == "forget":
            out.append(tracker.forget(W))
        else:
            raise ValueError(op)
    return out


SYNCED_AT_3 = [("start",), ("up", 3)]  # bootstrapped from a snapshot taken at batch 3
SYNCED_AT_3_OUT = [SNAPSHOT, ([], True)]


@pytest.mark.parametrize("ops, expected, last, catching_up, gaps, restarts", [
    pytest.param(  # a batch from a worker never seen: bootstrap, hold what comes meanwhile
        [("b", 1), ("b", 2), ("b", 3), ("up", 0), ("b", 4), ("b", 4), ("b", 2)],
        [SNAPSHOT, HOLD, HOLD, ([1, 2, 3], True), APPLY, DROP, DROP], 4, False, 0, 0, id="new-worker-by-batch"),
    pytest.param(  # the snapshot already covers some held batches
        [("b", 1), ("b", 2), ("b", 3), ("b", 4), ("up", 2), ("b", 5)],
        [SNAPSHOT, HOLD, HOLD, HOLD, ([3, 4], True), APPLY], 5, False, 0, 0, id="snapshot-covers-some-held"),
    pytest.param(  # the snapshot covers them all
        [("b", 1), ("b", 2), ("up", 5), ("b", 4), ("b", 6)],
        [SNAPSHOT, HOLD, ([], True), DROP, APPLY], 6, False, 0, 0, id="snapshot-covers-all-held"),
    pytest.param(  # first seen mid-stream
        [("b", 7), ("b", 8), ("up", 6), ("b", 9)],
        [SNAPSHOT, HOLD, ([7, 8], True), APPLY], 9, False, 0, 0, id="first-seen-mid-stream"),
    pytest.param(  # start() (the registry saw it first), then batches while the snapshot loads
        [("start",), ("b", 1), ("b", 2), ("up", 0), ("b", 3)],
        [SNAPSHOT, HOLD, HOLD, ([1, 2], True), APPLY], 3, False, 0, 0, id="started"),
    pytest.param(
        [("start",)], [SNAPSHOT], 0, True, 0, 0, id="started-not-caught-up"),
    pytest.param(  # in order
        SYNCED_AT_3 + [("b", 4), ("b", 5), ("b", 6)],
        SYNCED_AT_3_OUT + [APPLY, APPLY, APPLY], 6, False, 0, 0, id="in-order"),
    pytest.param(  # duplicates and late batches (but a seq 1 reads as a restart: see "restart")
        SYNCED_AT_3 + [("b", 4), ("b", 4), ("b", 3), ("b", 2), ("b", 5)],
        SYNCED_AT_3_OUT + [APPLY, DROP, DROP, DROP, APPLY], 5, False, 0, 0, id="duplicates"),
    pytest.param(  # a gap: replay after 4, hold meanwhile, then the held batches follow the replayed ones
        SYNCED_AT_3 + [("b", 4), ("b", 6), ("b", 7), ("applied", 5), ("up", 5), ("b", 8)],
        SYNCED_AT_3_OUT + [APPLY, REPLAY, HOLD, None, ([6, 7], True), APPLY], 8, False, 1, 0, id="gap-replay"),
    pytest.param(  # the replay reached past what was held
        SYNCED_AT_3 + [("b", 5), ("b", 6), ("applied", 4), ("applied", 5), ("applied", 6), ("applied", 7),
                       ("up", 7), ("b", 8)],
        SYNCED_AT_3_OUT + [REPLAY, HOLD, None, None, None, None, ([], True), APPLY], 8, False, 1, 0,
        id="replay-past-held"),
    pytest.param(  # still catching up: every batch held, even duplicates
        SYNCED_AT_3 + [("b", 5), ("b", 3), ("b", 6)],
        SYNCED_AT_3_OUT + [REPLAY, HOLD, HOLD], 3, True, 1, 0, id="hold-while-catching-up"),
    pytest.param(  # a seq 1 while catching up: the worker restarted, so only a new snapshot will do
        SYNCED_AT_3 + [("b", 5), ("b", 1), ("b", 2)],
        SYNCED_AT_3_OUT + [REPLAY, SNAPSHOT, HOLD], 3, True, 1, 1, id="restart-while-catching-up"),
    pytest.param(  # two gaps
        SYNCED_AT_3 + [("b", 5), ("up", 4), ("b", 7), ("up", 6), ("b", 8)],
        SYNCED_AT_3_OUT + [REPLAY, ([5], True), REPLAY, ([7], True), APPLY], 8, False, 2, 0, id="two-gaps"),
    pytest.param(  # the worker restarted: its numbering starts over
        SYNCED_AT_3 + [("b", 4), ("b", 1), ("b", 2), ("up", 1), ("b", 3)],
        SYNCED_AT_3_OUT + [APPLY, SNAPSHOT, HOLD, ([2], True), APPLY], 3, False, 0, 1, id="restart"),
    pytest.param(  # seq 1 again right after seq 1: a duplicate, not a restart
        [("start",), ("up", 0), ("b", 1), ("b", 1)],
        [SNAPSHOT, ([], True), APPLY, DROP], 1, False, 0, 0, id="seq-1-duplicate"),
    pytest.param(  # a hole among the held batches: another catch-up, then the rest
        [("start",), ("b", 1), ("b", 3), ("b", 4), ("up", 0), ("b", 5), ("applied", 2), ("up", 2), ("b", 6)],
        [SNAPSHOT, HOLD, HOLD, HOLD, ([1], False), HOLD, None, ([3, 4, 5], True), APPLY], 6, False, 0, 0,
        id="hole-among-held"),
    pytest.param(  # a hole right away: nothing ready
        [("start",), ("b", 3), ("up", 1)],
        [SNAPSHOT, HOLD, ([], False)], 1, True, 0, 0, id="hole-first"),
    pytest.param(  # held batches out of order come back in order
        [("start",), ("b", 3), ("b", 1), ("b", 2), ("up", 0)],
        [SNAPSHOT, HOLD, HOLD, HOLD, ([1, 2, 3], True)], 3, False, 0, 0, id="held-out-of-order"),
    pytest.param(  # a held duplicate comes back once
        [("b", 1), ("b", 2), ("b", 2), ("up", 0)],
        [SNAPSHOT, HOLD, HOLD, ([1, 2], True)], 2, False, 0, 0, id="held-duplicate"),
    pytest.param(  # forget: the next batch bootstraps again
        SYNCED_AT_3 + [("b", 4), ("forget",), ("b", 5), ("up", 4)],
        SYNCED_AT_3_OUT + [APPLY, None, SNAPSHOT, ([5], True)], 5, False, 0, 0, id="forget"),
    pytest.param(  # start again on a known worker: back to a snapshot
        SYNCED_AT_3 + [("b", 4), ("start",), ("b", 5), ("up", 4)],
        SYNCED_AT_3_OUT + [APPLY, SNAPSHOT, HOLD, ([5], True)], 5, False, 0, 0, id="restart-by-start"),
])
def test_sequences(ops, expected, last, catching_up, gaps, restarts):
    tracker = KvSyncTracker()
    assert run(tracker, ops) == expected
    assert tracker.last_seq(W) == last
    assert tracker.is_catching_up(W) is catching_up
    assert (tracker.num_gaps, tracker.num_restarts) == (gaps, restarts)


def test_caught_up_hands_back_the_held_batches_themselves():
    tracker = KvSyncTracker()
    held = [batch(1, ts=10.0), batch(2, ts=20.0)]
    assert tracker.on_batch(held[0]) is SNAPSHOT and tracker.on_batch(held[1]) is HOLD
    ready, whole = tracker.caught_up(W, 0)
    assert whole is True and ready == held and ready[0] is held[0] and ready[1] is held[1]
    assert tracker.caught_up(W, 2) == ([], True)  # handed back once


def test_applied_during_a_catch_up_moves_last_seq_and_never_back():
    tracker = KvSyncTracker()
    run(tracker, SYNCED_AT_3 + [("b", 6)])
    assert tracker.last_seq(W) == 3 and tracker.is_catching_up(W)
    tracker.applied(W, 4)
    assert tracker.last_seq(W) == 4
    tracker.applied(W, 2)  # never backwards
    assert tracker.last_seq(W) == 4
    tracker.applied(W, 5)
    assert tracker.is_catching_up(W)  # applied alone does not end the catch-up
    assert run(tracker, [("up", 5)]) == [([6], True)]
    assert tracker.last_seq(W) == 6 and not tracker.is_catching_up(W)


def test_caught_up_never_moves_last_seq_back():
    tracker = KvSyncTracker()
    run(tracker, SYNCED_AT_3 + [("b", 4), ("b", 5), ("b", 7)])
    assert tracker.caught_up(W, 2) == ([], False)  # 6 still missing
    assert tracker.last_seq(W) == 5


def test_max_held_bounds_the_held_batches():
    tracker = KvSyncTracker(max_held=2)
    assert run(tracker, [("start",), ("b", 1), ("b", 2), ("b", 3), ("b", 4)]) == [SNAPSHOT, HOLD, HOLD, HOLD, HOLD]
    # 3 and 4 were not kept: the two held come back, and the next batch finds the gap
    assert run(tracker, [("up", 0)]) == [([1, 2], True)]
    assert tracker.last_seq(W) == 2
    assert run(tracker, [("b", 5)]) == [REPLAY]
    assert tracker.num_gaps == 1


def test_max_held_dropping_a_needed_batch_is_a_hole():
    tracker = KvSyncTracker(max_held=2)
    run(tracker, [("start",), ("b", 3), ("b", 4), ("b", 2)])  # 2 arrives when the buffer is full
    assert run(tracker, [("up", 1)]) == [([], False)]
    assert run(tracker, [("applied", 2), ("up", 2)]) == [None, ([3, 4], True)]


def test_workers_are_tracked_apart():
    tracker = KvSyncTracker()
    assert tracker.on_batch(batch(1, "a")) is SNAPSHOT
    assert tracker.on_batch(batch(5, "b")) is SNAPSHOT
    assert [b.seq for b in tracker.caught_up("a", 0)[0]] == [1]
    assert tracker.on_batch(batch(2, "a")) is APPLY
    assert tracker.on_batch(batch(6, "b")) is HOLD  # b is still catching up
    assert (tracker.last_seq("a"), tracker.last_seq("b")) == (2, 0)
    assert (tracker.is_catching_up("a"), tracker.is_catching_up("b")) == (False, True)
    tracker.forget("a")
    assert (tracker.last_seq("a"), tracker.is_catching_up("a"), tracker.last_seq("b")) == (0, True, 0)


def test_unknown_worker():
    tracker = KvSyncTracker()
    assert tracker.last_seq("x") == 0
    assert tracker.is_catching_up("x") is True
    assert tracker.caught_up("x", 5) == ([], True)
    tracker.forget("x")  # no-op
    with pytest.raises(KeyError):
        tracker.applied("x", 1)
    assert tracker.on_batch(batch(1, "x")) is SNAPSHOT  # caught_up on an unknown worker created nothing


def test_default_max_held():
    assert KvSyncTracker().max_held == 4096


def test_a_snapshot_sets_the_position_even_backwards():
    # a worker restarted during a catch-up: its new snapshot (seq 2) replaces our position (seq 9)
    tracker = KvSyncTracker()
    tracker.start("w")
    tracker.caught_up("w", 9, snapshot=True)
    assert tracker.on_batch(batch(11, "w")) is Action.REPLAY
    assert tracker.on_batch(batch(1, "w")) is Action.SNAPSHOT and tracker.needs_snapshot("w")
    tracker.on_batch(batch(2, "w"))
    tracker.on_batch(batch(3, "w"))
    ready, whole = tracker.caught_up("w", 2, snapshot=True)
    assert [b.seq for b in ready] == [3] and whole and tracker.last_seq("w") == 3
    assert not tracker.needs_snapshot("w") and tracker.on_batch(batch(4, "w")) is Action.APPLY


def test_a_lost_tail_is_found_from_the_workers_position():
    # the last batch was lost and no later one shows the gap: the load snapshot's kv_seq does
    tracker = KvSyncTracker()
    tracker.start("w")
    tracker.caught_up("w", 0, snapshot=True)
    assert tracker.on_batch(batch(1, "w")) is Action.APPLY
    assert tracker.on_position("w", 1) is Action.DROP  # up to date
    assert tracker.on_position("w", 3) is Action.REPLAY and tracker.num_gaps == 1
    assert tracker.on_position("w", 3) is Action.DROP  # already catching up
    assert tracker.on_batch(batch(2, "w")) is Action.HOLD
    ready, whole = tracker.caught_up("w", 3)
    assert ready == [] and whole and tracker.on_batch(batch(2, "w")) is Action.DROP
    assert tracker.on_position("unknown", 5) is Action.DROP
