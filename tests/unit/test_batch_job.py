"""services/batch/job.py: a batch job's lifecycle on a fake clock."""

from __future__ import annotations

import pytest

from services.batch.job import BatchJob, CancelRefused, Finalize, StatusChanged, StopDispatch
from shared.batch_schema import BatchJobRecord, BatchLineError, BatchRequestCounts

T0 = 1_000
DEADLINE = T0 + 86_400
OK, FAIL = True, False


def new_job() -> BatchJob:
    return BatchJob(BatchJobRecord(id="batch_1", team="t", endpoint="/v1/chat/completions", input_file_id="file_1",
                                   created_at=T0, expires_at=DEADLINE))


def summary(action) -> tuple:
    if isinstance(action, StatusChanged):
        return ("status", action.new, action.reason)
    if isinstance(action, StopDispatch):
        return ("stop", action.reason)
    if isinstance(action, Finalize):
        return ("finalize", action.reason, action.unfinished, action.error_code)
    assert isinstance(action, CancelRefused)
    return ("refused", action.status)


def run(steps, job: BatchJob | None = None) -> tuple[BatchJob, list[tuple]]:
    """Feed (time, step) pairs: ("valid", n), "invalid", ("start", i), ("end", i, ok), ("defer", i), "cancel",
    "fail" (the budget is spent), "tick", "done" (the files are written); returns the job and (time, *summary)
    for every action."""
    job = job or new_job()
    out = []
    for now, step in steps:
        name, *args = step if isinstance(step, tuple) else (step,)
        if name == "valid":
            actions = job.validated("m", args[0], now)
        elif name == "invalid":
            actions = job.invalid([BatchLineError("invalid_json_line", "not JSON", line=3)], now)
        elif name == "start":
            assert job.line_started(args[0]), f"line {args[0]} could not start at {now}"
            actions = []
        elif name == "end":
            actions = job.line_ended(args[0], args[1], now)
        elif name == "defer":
            actions = job.line_deferred(args[0], now)
        elif name == "cancel":
            actions = job.cancel(now)
        elif name == "fail":
            actions = job.fail(BatchLineError("insufficient_quota", "the month's budget is spent"), now)
        elif name == "tick":
            actions = job.tick(now)
        else:
            assert name == "done"
            actions = job.finalized("file_out", "file_err", now)
        out.extend((now, *summary(a)) for a in actions)
    return job, out


def counts(job: BatchJob) -> tuple[int, int, int]:
    c = job.record.request_counts
    return c.total, c.completed, c.failed


def test_a_job_runs_every_line_then_finalizes_and_completes():
    steps = [(T0 + 1, ("valid", 3)), (T0 + 2, ("start", 0)), (T0 + 2, ("start", 1)), (T0 + 2, ("start", 2)),
             (T0 + 5, ("end", 0, OK)), (T0 + 6, ("end", 2, FAIL)), (T0 + 7, ("end", 1, OK)), (T0 + 9, "done")]
    job, out = run(steps)
    assert out == [(T0 + 1, "status", "in_progress", "validated"),
                   (T0 + 7, "status", "finalizing", "all_lines_ended"), (T0 + 7, "finalize", "completed", (), None),
                   (T0 + 9, "status", "completed", "finalized")]
    r = job.record
    assert (r.status, r.model, r.in_progress_at, r.finalizing_at, r.completed_at) == ("completed", "m", T0 + 1,
                                                                                      T0 + 7, T0 + 9)
    assert (r.output_file_id, r.error_file_id, r.cancelled_at, r.expired_at) == ("file_out", "file_err", None, None)
    assert counts(job) == (3, 2, 1)


def test_an_invalid_file_fails_the_job_with_its_errors_and_nothing_runs():
    job, out = run([(T0 + 1, "invalid"), (T0 + 2, ("valid", 3)), (T0 + 3, "tick"), (DEADLINE, "tick")])
    assert out == [(T0 + 1, "status", "failed", "invalid")]
    assert job.record.failed_at == T0 + 1 and job.record.errors[0].line == 3 and not job.may_dispatch
    assert job.cancel(T0 + 4) == [CancelRefused("failed", "Cannot cancel a batch with status 'failed'.")]


def test_status_events_carry_the_record_as_it_is_after_the_move():
    job = new_job()
    (event,) = job.validated("m", 2, T0 + 1.9)
    assert event.old == "validating" and event.record.status == "in_progress" and event.record.in_progress_at == T0 + 1
    assert event.record is job.record


@pytest.mark.parametrize("reports, expected_counts", [
    ([("end", 0, OK), ("end", 0, OK)], (3, 1, 0)),  # the same line twice: counted once
    ([("end", 0, OK), ("end", 0, FAIL)], (3, 1, 0)),  # a later, different report of an ended line: ignored
    ([("end", 1, FAIL), ("end", 1, FAIL), ("end", 2, OK)], (3, 1, 1)),
    ([("end", 7, OK), ("end", -1, OK)], (3, 0, 0)),  # no such line
])
def test_line_reports_are_idempotent_per_line(reports, expected_counts):
    steps = [(T0, ("valid", 3)), (T0, ("start", 0)), (T0, ("start", 1)), (T0, ("start", 2))]
    job, out = run(steps + [(T0 + 1, r) for r in reports])
    assert counts(job) == expected_counts and job.status == "in_progress"
    assert job.in_flight == 3 - sum(expected_counts[1:])


def test_a_duplicate_report_of_the_last_line_does_not_finalize_twice():
    job, out = run([(T0, ("valid", 1)), (T0, ("start", 0)), (T0 + 1, ("end", 0, OK)), (T0 + 2, ("end", 0, OK)),
                    (T0 + 3, "done"), (T0 + 4, "done"), (T0 + 5, ("end", 0, FAIL))])
    assert [o[1:3] for o in out] == [("status", "in_progress"), ("status", "finalizing"), ("finalize", "completed"),
                                     ("status", "completed")]
    assert counts(job) == (1, 1, 0)


def test_a_line_starts_once_and_only_while_dispatch_is_allowed():
    job = new_job()
    assert not job.line_started(0)  # still validating
    job.validated("m", 2, T0)
    assert job.line_started(0) and not job.line_started(0) and job.in_flight == 1
    job.line_ended(0, OK, T0)
    assert not job.line_started(0)  # already answered
    job.cancel(T0)
    assert not job.line_started(1) and not job.may_dispatch


def test_a_deferred_line_is_no_longer_in_flight_and_may_start_again():
    job, _ = run([(T0, ("valid", 2)), (T0, ("start", 0)), (T0 + 1, ("defer", 0))])
    assert job.in_flight == 0 and job.line_started(0) and job.in_flight == 1


def test_cancel_in_progress_waits_for_the_lines_in_flight_then_reports_the_rest_cancelled():
    steps = [(T0, ("valid", 4)), (T0, ("start", 0)), (T0, ("start", 1)), (T0 + 1, ("end", 0, OK)),
             (T0 + 2, "cancel"), (T0 + 3, ("end", 1, FAIL)), (T0 + 4, "done")]
    job, out = run(steps)
    assert out[1:] == [(T0 + 2, "status", "cancelling", "cancel"), (T0 + 2, "stop", "cancelled"),
                       (T0 + 3, "finalize", "cancelled", (2, 3), "batch_cancelled"),
                       (T0 + 4, "status", "cancelled", "finalized")]
    assert counts(job) == (4, 1, 3)  # 1 failed answer + 2 never sent
    assert (job.record.cancelling_at, job.record.cancelled_at, job.record.completed_at) == (T0 + 2, T0 + 4, None)


def test_cancel_with_nothing_in_flight_finalizes_at_once():
    _, out = run([(T0, ("valid", 2)), (T0 + 1, "cancel")])
    assert out[1:] == [(T0 + 1, "status", "cancelling", "cancel"), (T0 + 1, "stop", "cancelled"),
                       (T0 + 1, "finalize", "cancelled", (0, 1), "batch_cancelled")]


def test_cancelling_finalizes_when_its_last_line_in_flight_is_deferred():
    _, out = run([(T0, ("valid", 2)), (T0, ("start", 0)), (T0 + 1, "cancel"), (T0 + 2, ("defer", 0))])
    assert out[-1] == (T0 + 2, "finalize", "cancelled", (0, 1), "batch_cancelled")


def test_cancel_while_validating_ends_cancelled_with_no_lines_and_ignores_the_late_validation():
    job, out = run([(T0 + 1, "cancel"), (T0 + 2, ("valid", 5)), (T0 + 3, "done")])
    assert out == [(T0 + 1, "status", "cancelling", "cancel"), (T0 + 1, "finalize", "cancelled", (), None),
                   (T0 + 3, "status", "cancelled", "finalized")]
    assert counts(job) == (0, 0, 0)


@pytest.mark.parametrize("order, final, final_counts", [
    # the last line's answer lands first: the job is finalizing, the cancel is refused, it completes
    (["end", "cancel"], "completed", (2, 2, 0)),
    # the cancel lands first: it waits for that line, whose answer is kept, and ends cancelled
    (["cancel", "end"], "cancelled", (2, 2, 0)),
])
def test_cancel_racing_the_last_line(order, final, final_counts):
    job, out = run([(T0, ("valid", 2)), (T0, ("start", 0)), (T0, ("start", 1)), (T0 + 1, ("end", 0, OK))])
    step = {"end": ("end", 1, OK), "cancel": "cancel"}
    _, more = run([(T0 + 2, step[order[0]]), (T0 + 3, step[order[1]]), (T0 + 4, "done")], job)
    assert job.status == final and counts(job) == final_counts
    if final == "completed":
        assert (T0 + 3, "refused", "finalizing") in more
    else:
        assert (T0 + 3, "finalize", "cancelled", (), None) in more


def test_cancel_twice_is_one_cancel():
    job, out = run([(T0, ("valid", 2)), (T0, ("start", 0)), (T0 + 1, "cancel"), (T0 + 2, "cancel")])
    assert [o for o in out if o[0] == T0 + 2] == [] and job.record.cancelling_at == T0 + 1


@pytest.mark.parametrize("final_steps, status", [
    ([(T0 + 1, ("end", 0, OK)), (T0 + 2, "done")], "completed"),
    ([(T0 + 1, "cancel"), (T0 + 2, ("end", 0, OK)), (T0 + 3, "done")], "cancelled"),
    ([(DEADLINE, "tick"), (DEADLINE + 1, ("end", 0, OK)), (DEADLINE + 2, "done")], "expired"),
])
def test_cancel_after_the_job_ended_is_refused_and_changes_nothing(final_steps, status):
    job, _ = run([(T0, ("valid", 1)), (T0, ("start", 0))] + final_steps)
    before = job.record
    assert job.status == status
    assert job.cancel(DEADLINE + 5) == [CancelRefused(status, f"Cannot cancel a batch with status '{status}'.")]
    assert job.record is before


def test_the_deadline_in_progress_stops_dispatch_waits_for_the_lines_in_flight_and_expires_with_partial_output():
    steps = [(T0, ("valid", 3)), (T0, ("start", 0)), (T0, ("start", 1)), (T0 + 1, ("end", 0, OK)),
             (DEADLINE - 1, "tick"), (DEADLINE, "tick"), (DEADLINE + 1, ("end", 1, OK)), (DEADLINE + 2, "done")]
    job, out = run(steps)
    assert out[1:] == [(DEADLINE, "status", "finalizing", "deadline"), (DEADLINE, "stop", "expired"),
                       (DEADLINE + 1, "finalize", "expired", (2,), "batch_expired"),
                       (DEADLINE + 2, "status", "expired", "finalized")]
    assert counts(job) == (3, 2, 1)  # line 1 ran (and is billed): it is returned; line 2 never ran
    assert (job.record.expired_at, job.record.completed_at, job.in_flight) == (DEADLINE + 2, None, 0)


def test_the_deadline_with_nothing_in_flight_finalizes_at_once():
    steps = [(T0, ("valid", 2)), (T0, ("start", 0)), (T0 + 1, ("end", 0, OK)), (DEADLINE, "tick")]
    _, out = run(steps)
    assert out[-1] == (DEADLINE, "finalize", "expired", (1,), "batch_expired")


def test_the_deadline_while_finalizing_makes_the_final_status_expired():
    steps = [(T0, ("valid", 1)), (T0, ("start", 0)), (DEADLINE - 5, ("end", 0, OK)), (DEADLINE, "tick"),
             (DEADLINE + 1, "tick"), (DEADLINE + 3, "done")]
    job, out = run(steps)
    assert [o[1:3] for o in out] == [("status", "in_progress"), ("status", "finalizing"), ("finalize", "completed"),
                                     ("status", "expired")]
    assert counts(job) == (1, 1, 0) and job.record.finalizing_at == DEADLINE - 5


def test_the_deadline_while_validating_expires_the_job_at_once():
    job, out = run([(DEADLINE + 7, "tick"), (DEADLINE + 8, ("valid", 2)), (DEADLINE + 9, "done")])
    assert out == [(DEADLINE + 7, "status", "expired", "deadline")] and job.record.expired_at == DEADLINE + 7


def test_the_deadline_while_cancelling_stops_waiting_for_the_lines_in_flight():
    steps = [(T0, ("valid", 2)), (T0, ("start", 0)), (DEADLINE - 1, "cancel"), (DEADLINE, "tick"),
             (DEADLINE + 1, "tick"), (DEADLINE + 2, ("end", 0, OK)), (DEADLINE + 3, "done")]
    job, out = run(steps)
    assert out[3:] == [(DEADLINE, "finalize", "cancelled", (0, 1), "batch_cancelled"),
                       (DEADLINE + 3, "status", "cancelled", "finalized")]
    assert counts(job) == (2, 0, 2)


def test_a_job_of_no_lines_goes_straight_to_finalizing():
    _, out = run([(T0, ("valid", 0))])
    assert [o[1:3] for o in out] == [("status", "in_progress"), ("status", "finalizing"), ("finalize", "completed")]


def test_finalized_before_finalize_is_ignored():
    job, out = run([(T0, ("valid", 2)), (T0 + 1, "done")])
    assert job.status == "in_progress" and len(out) == 1


def test_needs_finalize_and_the_unfinished_code_follow_the_finalize():
    job, _ = run([(T0, ("valid", 2)), (T0, ("start", 0))])
    assert not job.needs_finalize and job.unfinished_code is None
    run([(T0 + 1, "cancel")], job)
    assert not job.needs_finalize and job.unfinished_code == "batch_cancelled"  # line 0 still in flight
    run([(T0 + 2, ("end", 0, OK))], job)
    assert job.needs_finalize and "cancelled" in job.unfinished_message
    run([(T0 + 3, "done")], job)
    assert not job.needs_finalize


def saved(status: str, total: int, **fields) -> BatchJobRecord:
    return BatchJobRecord(id="batch_1", team="t", endpoint="/v1/chat/completions", input_file_id="file_1",
                          created_at=T0, expires_at=DEADLINE, status=status, model="m", in_progress_at=T0,
                          request_counts=BatchRequestCounts(total=total, completed=1, failed=1), **fields)


@pytest.mark.parametrize("status, replayed, tick_at, expected, final_counts", [
    # in progress: replayed lines are counted again from zero, the rest run; nothing finalizes before the tick
    ("in_progress", [(0, OK), (1, FAIL)], T0 + 9, [], (3, 1, 1)),
    ("in_progress", [(0, OK), (1, FAIL), (2, OK)], T0 + 9,
     [("status", "finalizing", "all_lines_ended"), ("finalize", "completed", (), None)], (3, 2, 1)),
    ("in_progress", [(0, OK)], DEADLINE,
     [("status", "finalizing", "deadline"), ("stop", "expired"), ("finalize", "expired", (1, 2), "batch_expired")],
     (3, 1, 2)),
    # cancelling: nothing is in flight in the new process, so the tick finalizes it
    ("cancelling", [(0, OK)], T0 + 9, [("finalize", "cancelled", (1, 2), "batch_cancelled")], (3, 1, 2)),
    # finalizing cut short by the restart: finalize again, completed if every line had ended in time
    ("finalizing", [(0, OK), (1, OK), (2, FAIL)], T0 + 9, [("finalize", "completed", (), None)], (3, 2, 1)),
    ("finalizing", [(0, OK)], T0 + 9, [("finalize", "expired", (1, 2), "batch_expired")], (3, 1, 2)),
])
def test_a_resumed_job_rebuilds_its_counts_from_the_replayed_lines(status, replayed, tick_at, expected, final_counts):
    job = BatchJob(saved(status, 3))
    assert counts(job) == (3, 0, 0) and job.in_flight == 0
    _, out = run([(T0 + 5, ("end", i, ok)) for i, ok in replayed], job)
    assert out == []
    _, out = run([(tick_at, "tick")], job)
    assert [o[1:] for o in out] == expected and counts(job) == final_counts


def test_a_resumed_in_progress_job_runs_only_the_lines_without_a_result():
    job = BatchJob(saved("in_progress", 2))
    job.line_ended(0, OK, T0 + 5)
    assert not job.line_started(0) and job.line_started(1)


def test_a_terminal_job_cannot_be_resumed():
    with pytest.raises(AssertionError):
        BatchJob(saved("completed", 1))


def test_a_spent_budget_stops_dispatch_waits_for_the_lines_in_flight_then_fails_the_job():
    job, out = run([(T0, ("valid", 4)), (T0 + 1, ("start", 0)), (T0 + 1, ("start", 1)), (T0 + 2, ("end", 0, OK)),
                    (T0 + 3, "fail"), (T0 + 4, ("end", 1, OK)), (T0 + 5, "done")])
    assert out[1:] == [(T0 + 3, "stop", "failed"), (T0 + 4, "finalize", "failed", (2, 3), "batch_failed"),
                       (T0 + 5, "status", "failed", "finalized")]
    assert job.record.failed_at == T0 + 5 and [e.code for e in job.record.errors] == ["insufficient_quota"]
    assert counts(job) == (4, 2, 2) and not job.line_started(2)
    assert job.fail(BatchLineError("x", "again"), T0 + 6) == []  # ended: nothing more


def test_a_second_failure_or_one_after_a_cancel_changes_nothing():
    job, out = run([(T0, ("valid", 2)), (T0 + 1, ("start", 0)), (T0 + 2, "cancel"), (T0 + 3, "fail")])
    assert [a[1:3] for a in out] == [("status", "in_progress"), ("status", "cancelling"), ("stop", "cancelled")]
    assert job.record.errors == []


def test_a_job_saved_while_failing_resumes_failing():
    job, _ = run([(T0, ("valid", 2)), (T0 + 1, ("start", 0)), (T0 + 2, "fail")])
    resumed = BatchJob(job.record)
    assert not resumed.may_dispatch
    resumed.line_ended(0, OK, T0 + 3)
    assert [summary(a) for a in resumed.tick(T0 + 4)] == [("finalize", "failed", (1,), "batch_failed")]
