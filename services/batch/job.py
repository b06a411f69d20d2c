"""One batch job's lifecycle, pure: a state machine over validation, line outcomes, cancels and a clock.

    status       input                                      -> status       actions
    validating   validated(model, n)                        -> in_progress  StatusChanged
    validating   invalid(errors)                            -> failed       StatusChanged
    validating   cancel()                                   -> cancelling   StatusChanged, Finalize(cancelled, no lines)
    validating   tick(), deadline passed                    -> expired      StatusChanged          (no line ever ran)
    in_progress  line_ended(), the last line                -> finalizing   StatusChanged, Finalize(completed)
    in_progress  cancel()                                   -> cancelling   StatusChanged, StopDispatch,
                                                                            Finalize(cancelled) once none is in flight
    in_progress  tick(), deadline passed                    -> finalizing   StatusChanged, StopDispatch,
                                                                            Finalize(expired) once none is in
                                                                            flight (a line that ran is returned)
    cancelling   the last line in flight ends or is deferred   cancelling   Finalize(cancelled)
    cancelling   tick(), deadline passed, lines in flight      cancelling   Finalize(cancelled): no more waiting
    finalizing   tick(), deadline passed                       finalizing   none; the final status becomes expired
    any of those finalized(output, errors)                  -> completed | cancelled | expired  (the Finalize's reason)
    in_progress  fail(error) (the team's budget is spent)      in_progress  StopDispatch, Finalize(failed) once
                                                                            none is in flight; finalized -> failed
    cancelling   cancel()                                      cancelling   none (cancel is idempotent)
    finalizing | terminal  cancel()                            unchanged    CancelRefused (the edge answers 409)

Invariants:
- ``Finalize`` comes once. From then the job's outcome is frozen: a line reported after it is ignored. At the
  deadline the lines in flight are waited for (they ran and are billed, so they are returned), the others
  are not sent; a cancelling job past its deadline stops waiting. Its ``unfinished`` lines are
  the error file's ``batch_cancelled`` / ``batch_expired`` lines (OpenAI's behaviour) and count as failed.
- Each line is counted once: a line is pending, running or ended, and a second report of an ended line changes
  nothing. ``completed + failed <= total``, and ``== total`` from ``Finalize`` on.
- A cancel accepted before the deadline ends ``cancelled`` (the team decided first); past the deadline every
  other job that is not terminal ends ``expired``, even one whose files are being written (OpenAI: it did not
  complete within its window).
- Resumed (``BatchJob(record)`` of a record saved in_progress, cancelling or finalizing, after a restart): its
  counts start again from zero and are rebuilt by replaying ``line_ended`` for the lines with a result; nothing
  is in flight. Until its first ``tick`` it only counts: ``Finalize`` (if due: all lines ended, a cancel, a
  finalize the restart cut short) comes from that tick.
- Every status change sets its ``*_at`` (unix seconds, ``int(now)``) and comes back as ``StatusChanged`` for the
  service to publish on ``<ns>.batch.events.<team>.<job>``. Times are unix seconds (``now`` from any wall clock).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from msgspec.structs import replace

from shared.batch_schema import TERMINAL_STATUSES, BatchJobRecord, BatchLineError, BatchRequestCounts, BatchStatus

FinalReason = Literal["completed", "cancelled", "expired", "failed"]
UNFINISHED_CODES: dict[str, str] = {"cancelled": "batch_cancelled", "expired": "batch_expired",
                                    "failed": "batch_failed"}
UNFINISHED_MESSAGES: dict[str, str] = {"cancelled": "This request was not run: the batch was cancelled.",
                                       "expired": "This request was not run before the batch expired.",
                                       "failed": "This request was not run: the batch failed."}
_PENDING, _RUNNING, _ENDED = 0, 1, 2


@dataclass(frozen=True, slots=True)
class StatusChanged:
    """The job moved: publish ``record`` (it carries the new status and its ``*_at``)."""

    old: BatchStatus
    new: BatchStatus
    reason: str  # validated | invalid | all_lines_ended | cancel | deadline | finalized
    record: BatchJobRecord


@dataclass(frozen=True, slots=True)
class StopDispatch:
    """Send no more lines of this job (``Dispatcher.drop_job``)."""

    reason: Literal["cancelled", "expired", "failed"]


@dataclass(frozen=True, slots=True)
class Finalize:
    """Write the output and error files, then call ``finalized``: the outcome is frozen from here."""

    reason: FinalReason
    unfinished: tuple[int, ...]  # 0-based line indices never answered: error lines with ``error_code``
    error_code: str | None  # batch_cancelled | batch_expired; None when every line ended


@dataclass(frozen=True, slots=True)
class CancelRefused:
    """The job is past cancelling (finalizing or terminal): OpenAI answers 409 with this message."""

    status: BatchStatus
    message: str


Action = StatusChanged | StopDispatch | Finalize | CancelRefused


class BatchJob:
    """A job's status, counts and per-line progress; the service feeds it inputs and carries out its actions."""

    __slots__ = ("_record", "_lines", "_num_running", "_num_ended", "_final_reason", "_frozen", "_replaying")

    def __init__(self, record: BatchJobRecord) -> None:
        """A new job (validating), or one resumed from its saved record (see the module docstring)."""
        assert record.status not in TERMINAL_STATUSES, f"a {record.status} job has nothing left to do"
        self._record = record
        self._lines = bytearray()  # per line: _PENDING | _RUNNING | _ENDED
        self._num_running = 0
        self._num_ended = 0
        self._final_reason: FinalReason | None = "cancelled" if record.status == "cancelling" else None
        if record.status == "in_progress" and record.errors:  # it was failing (fail()) when it was saved
            self._final_reason = "failed"
        self._frozen = False  # Finalize sent
        self._replaying = record.status != "validating"  # resumed: no Finalize before the first tick
        if self._replaying:
            total = record.request_counts.total
            self._lines = bytearray(total)
            self._record = replace(record, request_counts=BatchRequestCounts(total=total))

    # ------------------------------------------------------------ queries
    @property
    def record(self) -> BatchJobRecord:
        return self._record

    @property
    def status(self) -> BatchStatus:
        return self._record.status

    @property
    def in_flight(self) -> int:
        return self._num_running

    @property
    def may_dispatch(self) -> bool:
        return self._record.status == "in_progress" and self._final_reason is None

    @property
    def needs_finalize(self) -> bool:
        """``Finalize`` was sent and ``finalized`` not called yet: the files are to be written."""
        return self._frozen and self._record.status not in TERMINAL_STATUSES

    @property
    def unfinished_code(self) -> str | None:
        """The error code of the lines that will never run (batch_cancelled | batch_expired), once decided."""
        return UNFINISHED_CODES.get(self._final_reason or "")

    @property
    def unfinished_message(self) -> str:
        return UNFINISHED_MESSAGES.get(self._final_reason or "", "")

    # ------------------------------------------------------------ inputs
    def validated(self, model: str, total_lines: int, now: float) -> list[Action]:
        """The input file passed validation: ``total_lines`` lines, all for ``model``."""
        if self.status != "validating":
            return []  # cancelled or expired while validating: the result comes too late
        self._lines = bytearray(total_lines)
        self._record = replace(self._record, model=model, request_counts=BatchRequestCounts(total=total_lines))
        return [self._move(now, "in_progress", "validated"), *self._maybe_finalize(now)]

    def invalid(self, errors: list[BatchLineError], now: float) -> list[Action]:
        """The input file failed validation: the job fails with ``errors`` and runs nothing."""
        assert errors, "a failed validation names at least one error"
        if self.status != "validating":
            return []
        self._record = replace(self._record, errors=list(errors))
        return [self._move(now, "failed", "invalid")]

    def line_started(self, index: int) -> bool:
        """Claim line ``index`` for sending; False: do not send it (dispatch stopped, or it already ran)."""
        if not self.may_dispatch or not 0 <= index < len(self._lines) or self._lines[index] != _PENDING:
            return False
        self._lines[index] = _RUNNING
        self._num_running += 1
        return True

    def line_deferred(self, index: int, now: float) -> list[Action]:
        """A started line came back unanswered (a 429): pending again, no longer in flight."""
        if self._frozen or not 0 <= index < len(self._lines) or self._lines[index] != _RUNNING:
            return []
        self._lines[index] = _PENDING
        self._num_running -= 1
        return self._maybe_finalize(now)

    def line_ended(self, index: int, ok: bool, now: float) -> list[Action]:
        """Line ``index`` got its answer (``ok``: a 2xx). A repeat, an unknown index or a late one is ignored."""
        if self._frozen or not 0 <= index < len(self._lines) or self._lines[index] == _ENDED:
            return []
        if self._lines[index] == _RUNNING:
            self._num_running -= 1
        self._lines[index] = _ENDED
        self._num_ended += 1
        counts = self._record.request_counts
        counts = replace(counts, completed=counts.completed + 1) if ok else replace(counts, failed=counts.failed + 1)
        self._record = replace(self._record, request_counts=counts)
        return self._maybe_finalize(now)

    def cancel(self, now: float) -> list[Action]:
        """The team cancels (``POST /v1/batches/{id}/cancel``)."""
        status = self.status
        if status == "cancelling":
            return []
        if status not in ("validating", "in_progress"):
            return [CancelRefused(status, f"Cannot cancel a batch with status '{status}'.")]
        self._final_reason = "cancelled"
        actions: list[Action] = [self._move(now, "cancelling", "cancel")]
        if status == "in_progress":
            actions.append(StopDispatch("cancelled"))
        return actions + self._maybe_finalize(now)

    def fail(self, error: BatchLineError, now: float) -> list[Action]:
        """The job cannot go on (the team's budget for the month is spent): no line is sent any more; once none
        is in flight the lines left are error lines (batch_failed) and ``finalized`` ends it failed with
        ``error``. Only an in_progress job that is not ending already can fail so."""
        if self.status != "in_progress" or self._final_reason is not None:
            return []
        self._final_reason = "failed"
        self._record = replace(self._record, errors=[error])
        return [StopDispatch("failed"), *self._maybe_finalize(now)]

    def tick(self, now: float) -> list[Action]:
        """Time passing: the completion window may have closed."""
        status, self._replaying = self.status, False
        if status in TERMINAL_STATUSES or now < self._record.expires_at:
            return self._maybe_finalize(now)  # a resumed cancelling or finalizing job
        if status == "validating":
            return [self._move(now, "expired", "deadline")]
        if status == "in_progress":
            self._final_reason = "expired"
            return [self._move(now, "finalizing", "deadline"), StopDispatch("expired"), *self._maybe_finalize(now)]
        if status == "finalizing":
            self._final_reason = "expired"  # its files are being written; only the final status changes
            return self._maybe_finalize(now)
        return [] if self._frozen else [self._freeze()]  # cancelling: stop waiting for the lines in flight

    def finalized(self, output_file_id: str | None, error_file_id: str | None, now: float) -> list[Action]:
        """The files of the ``Finalize`` are written (None: that file is empty, OpenAI leaves its id null)."""
        if not self._frozen or self.status in TERMINAL_STATUSES:
            return []
        assert self._final_reason is not None
        self._record = replace(self._record, output_file_id=output_file_id, error_file_id=error_file_id)
        return [self._move(now, self._final_reason, "finalized")]

    # ------------------------------------------------------------ moves
    def _maybe_finalize(self, now: float) -> list[Action]:
        if self._frozen or self._replaying or self.status in TERMINAL_STATUSES:
            return []
        if self.status == "in_progress" and self._final_reason is None and self._num_ended == len(self._lines):
            self._final_reason = "completed"
            return [self._move(now, "finalizing", "all_lines_ended"), self._freeze()]
        if self._final_reason in ("cancelled", "failed") or (self._final_reason == "expired" and self._num_running):
            return [self._freeze()] if self._num_running == 0 else []
        if self.status == "finalizing":  # resumed: the files were not written before the restart
            expired = self._num_ended < len(self._lines) or now >= self._record.expires_at
            self._final_reason = "expired" if expired or self._final_reason == "expired" else "completed"
            return [self._freeze()]
        return []

    def _freeze(self) -> Finalize:
        assert self._final_reason is not None
        unfinished = tuple(i for i, state in enumerate(self._lines) if state != _ENDED)
        counts = self._record.request_counts
        self._record = replace(self._record, request_counts=replace(counts, failed=counts.failed + len(unfinished)))
        self._frozen = True
        return Finalize(self._final_reason, unfinished, self.unfinished_code if unfinished else None)

    def _move(self, now: float, new: BatchStatus, reason: str) -> StatusChanged:
        old = self._record.status
        self._record = replace(self._record, status=new, **{f"{new}_at": int(now)})
        return StatusChanged(old, new, reason, self._record)
