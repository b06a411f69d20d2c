"""OrphanTracker on a fake clock: which edges a worker pings when, and which requests it aborts; the stream
subject parser that names a request's edge."""

from __future__ import annotations

import pytest

from services.worker.orphans import OrphanTracker
from shared.subjects import Subjects

GRACE = 10.0


def tracker_with(*requests: tuple[str, str], live: tuple[str, ...] = ()) -> OrphanTracker:
    tracker = OrphanTracker(GRACE)
    for edge_id in live:
        tracker.edge_live(edge_id)
    for request_id, edge_id in requests:
        tracker.track(request_id, edge_id, now=0.0)
    return tracker


def test_an_edge_in_the_bucket_is_never_pinged():
    tracker = tracker_with(("r1", "e1"), live=("e1",))
    assert tracker.due(1000.0) == []


def test_an_edge_that_leaves_the_bucket_is_pinged_at_once_and_its_requests_aborted_if_silent():
    tracker = tracker_with(("r1", "e1"), ("r2", "e1"), ("r3", "e2"), live=("e1", "e2"))
    tracker.edge_left("e1", now=5.0)
    assert tracker.due(5.0) == ["e1"]
    assert tracker.due(5.0) == []  # one ping in flight at a time
    assert tracker.silent("e1") == ["r1", "r2"]
    assert tracker.due(100.0) == [] and tracker.silent("e1") == []  # each request is handed out once


def test_an_edge_that_answers_is_pinged_again_a_grace_later_while_out_of_the_bucket():
    tracker = tracker_with(("r1", "e1"), live=("e1",))
    tracker.edge_left("e1", now=0.0)
    assert tracker.due(0.0) == ["e1"]
    tracker.answered("e1", now=1.0)
    assert tracker.due(1.0 + GRACE - 0.1) == []
    assert tracker.due(1.0 + GRACE) == ["e1"]


def test_an_edge_back_in_the_bucket_before_the_ping_fails_keeps_its_requests():
    tracker = tracker_with(("r1", "e1"), live=("e1",))
    tracker.edge_left("e1", now=0.0)
    assert tracker.due(0.0) == ["e1"]
    tracker.edge_live("e1")
    assert tracker.silent("e1") == []


@pytest.mark.parametrize("now, due", [(GRACE - 0.1, []), (GRACE, ["ghost"])])
def test_a_never_seen_edge_is_pinged_a_grace_after_its_first_request(now, due):
    tracker = tracker_with(("r1", "ghost"))
    assert tracker.due(now) == due


def test_an_edge_whose_requests_all_ended_is_forgotten():
    tracker = tracker_with(("r1", "e1"), live=("e1",))
    tracker.edge_left("e1", now=0.0)
    tracker.untrack("r1")
    assert tracker.due(0.0) == [] and tracker.edge_of("r1") is None


def test_a_new_request_of_an_abandoned_edge_is_not_pinged_for_again():
    tracker = tracker_with(("r1", "e1"), live=("e1",))
    tracker.edge_left("e1", now=0.0)
    tracker.due(0.0)
    assert tracker.silent("e1") == ["r1"]
    tracker.track("r2", "e1", now=1.0)
    assert tracker.due(1.0 + GRACE) == []
    tracker.untrack("r1")
    tracker.untrack("r2")
    tracker.track("r3", "e1", now=50.0)  # all its requests ended: a fresh start
    assert tracker.due(50.0 + GRACE) == ["e1"]


@pytest.mark.parametrize("subject, edge", [
    ("ns.stream.e1.r1", "e1"),
    ("ns.stream.e1.r1-prefill", "e1"),
    ("other.stream.e1.r1", None),  # another namespace
    ("ns.stream.e1", None),
    ("ns.stream..r1", None),
    ("ns.worker.e1.r1", None),
    ("_INBOX.abc.def", None),
    ("", None),
])
def test_the_edge_of_a_stream_subject(subject, edge):
    assert Subjects("ns").edge_of_stream(subject) == edge


def test_the_parser_inverts_the_stream_subject():
    s = Subjects("ns")
    assert s.edge_of_stream(s.stream("e7", "abc")) == "e7"


# ---------------------------------------------------------------- requests that ended just before their edge died
def test_a_request_that_ended_is_dropped_once_its_edge_beats_settle_s_later():
    tracker = tracker_with(("r1", "e1"), live=("e1",))
    assert tracker.ended("r1", "report-r1", now=10.0) is False
    tracker.edge_beat("e1", now=10.0 + tracker.settle_s - 0.1)
    assert tracker.num_ended() == 1  # not yet: the edge may still die before its usage is out
    tracker.edge_beat("e1", now=10.0 + tracker.settle_s)
    assert tracker.num_ended() == 0
    tracker.edge_left("e1", now=20.0)
    assert tracker.due(20.0) == []  # nothing of it left to bill: no ping


def test_a_request_that_ended_before_its_edge_died_is_reported_when_the_edge_is_found_silent():
    """The edge died between the end message and its usage publish: 40 tokens end in 0.4 s, its key lapses 5 s
    later. Before, such a request was billed by nobody."""
    tracker = tracker_with(("r1", "e1"), ("r2", "e1"), live=("e1",))
    tracker.ended("r1", "report-r1", now=1.0)
    tracker.edge_left("e1", now=6.0)  # no beat since the end
    assert tracker.due(6.0) == ["e1"]
    assert tracker.silent("e1") == ["r2"]  # the running one is aborted (and reported when it ends)
    assert tracker.take_ended("e1") == ["report-r1"] and tracker.take_ended("e1") == []
    assert tracker.ended("r2", "report-r2", now=7.0) is True  # its edge is known dead: report at once


def test_an_edge_holding_usage_it_has_not_published_proves_nothing_until_it_has():
    """The usage stream lost its leader with its NATS server: the edge beats on while its usage waits (seconds).
    Seen in the cluster test: the worker took such beats as billing, the edge was then SIGKILLed, and a stream it
    had cut after tokens was billed by nobody."""
    tracker = tracker_with(("r1", "e1"), ("r2", "e1"), live=("e1",))
    tracker.ended("r1", "report-r1", now=1.0)
    tracker.edge_beat("e1", now=10.0, usage_pending=3)  # long after the end, but usage not in the stream yet
    tracker.answered("e1", now=11.0, usage_pending=1)  # a pong says the same
    assert tracker.num_ended() == 1
    tracker.edge_left("e1", now=12.0)  # then it died
    assert tracker.due(12.0) == ["e1"] and tracker.silent("e1") == ["r2"]
    assert tracker.take_ended("e1") == ["report-r1"]  # reported: a surviving edge bills it (once: its dedupe id)

    settled = tracker_with(("r3", "e2"), live=("e2",))
    settled.ended("r3", "report-r3", now=1.0)
    settled.edge_beat("e2", now=10.0, usage_pending=2)
    settled.edge_beat("e2", now=11.0, usage_pending=0)  # its usage is out: now the edge's beat proves billing
    assert settled.num_ended() == 0


def test_an_edge_with_only_ended_requests_is_pinged_when_it_leaves_and_forgotten_when_it_answers():
    tracker = tracker_with(("r1", "e1"), live=("e1",))
    tracker.ended("r1", "report-r1", now=1.0)
    tracker.edge_left("e1", now=2.0)
    assert tracker.due(2.0) == ["e1"]
    tracker.answered("e1", now=2.0 + tracker.settle_s)  # alive after the end: it billed it itself
    assert tracker.num_ended() == 0 and tracker.due(100.0) == []


def test_a_ping_that_failed_is_retried_and_proves_nothing():
    tracker = tracker_with(("r1", "e1"), live=("e1",))
    tracker.ended("r1", "report-r1", now=1.0)
    tracker.edge_left("e1", now=2.0)
    assert tracker.due(2.0) == ["e1"]
    tracker.probe_failed("e1", retry_at=3.0 + tracker.settle_s)  # e.g. the connection closed mid-request
    assert tracker.num_ended() == 1  # not a sign of life
    assert tracker.due(3.0 + tracker.settle_s) == ["e1"]
