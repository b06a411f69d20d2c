"""Runs the lines of the jobs in progress on idle capacity: I/O around the pure job (job.py) and dispatcher
(dispatch.py).

    unfinished job (store) --resume--> read its results back (streams.py): lines already ended are skipped
    dispatcher.next(free slots), while still_leader() --> the line read from its input's spool (input.py) -->
        BatchLineRequest on <ns>.batch.line (any edge) --> BatchLineReply
        200 / 4xx (not 429)      the line ended: its result on the results stream (once per line), counted
        429 rate limit, 503      capacity is busy: the line waits (retry_s, doubling to retry_max_s), then again
        429 preempted            admission took its capacity back for interactive traffic: again at once (its
                                 lease is asked for anew and queues behind interactive); not a try, not billed
        429 insufficient_quota   the team's budget is spent: the job fails with that error
        5xx, no edge, timeout    tried again up to max_line_tries, then an error line
    job.tick: deadline passed or cancel asked --> no more dispatch; once nothing is in flight the lines left are
        error lines (batch_expired / batch_cancelled), the output and error files are written, the job ends

Every change of a job's state is saved (the ledger database is the truth across replicas) and published on
``<ns>.batch.events.<team>.<job>``; progress counts are saved at most every ``tick_s``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import msgspec

from services.batch import tracing
from services.batch.config import BatchConfig
from services.batch.dispatch import Dispatcher
from services.batch.input import JobInput
from services.batch.job import Action, BatchJob, CancelRefused, Finalize, StopDispatch
from services.batch.lines import BatchLine, error_line, output_line
from services.batch.streams import publish_result, read_results
from shared.batch_schema import BatchJobRecord, BatchLineError, BatchLineReply, BatchLineRequest, BatchLineResult
from shared.bus import Bus, BusError
from shared.files import FileStore
from shared.tasks import cancel_and_wait

log = logging.getLogger("infermesh.batch")
RETRY_STATUSES = (429, 503)


@dataclass(slots=True)
class JobRun:
    """One job in progress on this replica: its state machine, its input (lines read when sent), what is in flight."""

    job: BatchJob
    input: JobInput
    in_flight: set[int] = field(default_factory=set)
    tries: dict[int, int] = field(default_factory=dict)
    unfinished: frozenset[int] = frozenset()  # the Finalize's lines never answered: error lines, whatever comes
    dirty: bool = False  # counts changed since the last save


def line_request_id(job_id: str, index: int) -> str:
    """The line's id for good: its billing key (the ledger keeps one row per batch line, whatever its runs)."""
    return f"{job_id}_{index}"


def line_run_id(line_id: str) -> str:
    """One run's own request id (its streams, its worker's engine): runs of a line may overlap (a line timeout, a
    preemption's drain, a leader change), and two requests of one id would collide in every per-id map."""
    return f"{line_id}_r{uuid.uuid4().hex[:10]}"


class Runner:
    def __init__(self, bus: Bus, files: FileStore, config: BatchConfig,
                 save: Callable[[BatchJobRecord], Awaitable[BatchJobRecord]],
                 still_leader: Callable[[], bool] = lambda: True) -> None:
        self.bus, self.files, self.config, self.save = bus, files, config, save
        self.still_leader = still_leader  # checked before each dispatch: a deposed leader sends nothing more
        self.runs: dict[str, JobRun] = {}
        self.dispatcher = Dispatcher(config.dispatch_order)
        self.stats = {"lines_sent": 0, "lines_ok": 0, "lines_failed": 0, "retried": 0, "preempted": 0}
        self._tasks: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._running = False  # the loop runs while set: on Python 3.11 wait_for can swallow a cancel

    # ------------------------------------------------------------ jobs in
    async def add(self, job: BatchJob, job_input: JobInput) -> None:
        """A job to run (new, or resumed after a restart: lines with a result already are not run again)."""
        record = job.record
        ended = await read_results(self.bus, record.team, record.id)
        for index, result in ended.items():
            job.line_ended(index, result.ok, time.time())
        run = JobRun(job, job_input)
        self.runs[record.id] = run
        paths = job_input.take_paths()
        todo = [index for index in range(len(job_input)) if index not in ended]
        self.dispatcher.add_paths(record.id, record.expires_at, record.created_at, todo, [paths[i] for i in todo])
        await self._saved(run)
        self._wake.set()

    def cancel(self, job_id: str, now: float) -> tuple[BatchJobRecord, str] | None:
        """Cancel a job this replica runs: no line is sent any more; it ends once those in flight have. The job
        and "" , or why it cannot be cancelled (it is finalizing); None: not a job this replica runs."""
        run = self.runs.get(job_id)
        if run is None:
            return None
        actions = run.job.cancel(now)
        refused = next((a.message for a in actions if isinstance(a, CancelRefused)), "")
        self._carry_out(run, [a for a in actions if not isinstance(a, CancelRefused)])
        self._wake.set()
        return run.job.record, refused

    def _carry_out(self, run: JobRun, actions: list[Action]) -> None:
        """The job's actions that are the runner's: a stop of its dispatch, and a change to save."""
        for action in actions:
            if isinstance(action, StopDispatch):
                self.dispatcher.drop_job(run.job.record.id)
            elif isinstance(action, Finalize):
                run.unfinished = frozenset(action.unfinished)
        if actions:
            run.dirty = True

    # ------------------------------------------------------------ the loop
    async def start(self) -> None:
        self._running = True
        self._loop_task = asyncio.create_task(self._loop(), name="batch-runner")

    async def stop(self) -> None:
        self._running = False
        self._wake.set()
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.wait([self._loop_task], timeout=5)
        await cancel_and_wait(*self._tasks)
        for run in self.runs.values():
            run.input.close()

    async def _loop(self) -> None:
        while self._running:
            try:
                await self._step(time.time())
            except Exception:  # a database or bus hiccup: the next step tries again
                log.exception("batch runner step failed")
            try:
                await asyncio.wait_for(self._wake.wait(), self.config.tick_s)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()

    async def _step(self, now: float) -> None:
        for run in list(self.runs.values()):
            self._carry_out(run, run.job.tick(now))  # its deadline may have passed: nothing more is sent
        free = self.config.max_in_flight - sum(len(r.in_flight) for r in self.runs.values())
        if not self.still_leader():  # its key may have lapsed: another replica may be sending these lines
            free = 0  # (no await between this check and the sends below)
        for job_id, index in self.dispatcher.next(max(0, free), now):
            run = self.runs.get(job_id)
            if run is None or not run.job.line_started(index):  # cancelled, expired, or it ran already
                continue
            run.in_flight.add(index)
            self._spawn(self._read_and_run(run, index))
        for run in list(self.runs.values()):
            if run.job.needs_finalize and not run.in_flight:
                await self._finalize(run, now)
            elif run.dirty:
                await self._saved(run)

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------ one line
    async def _read_and_run(self, run: JobRun, index: int) -> None:
        try:
            line = await run.input.read(index)
        except Exception:  # the spool unreadable (its disk): the line waits, as one refused for capacity
            log.exception("batch %s: line %d could not be read back", run.job.record.id, index)
            run.in_flight.discard(index)
            self._carry_out(run, run.job.line_deferred(index, time.time()))
            if run.job.may_dispatch:
                self.dispatcher.defer(run.job.record.id, index, time.time() + self.config.retry_max_s)
            self._wake.set()
            return
        await self._run_line(run, line)

    async def _run_line(self, run: JobRun, line: BatchLine) -> None:
        record = run.job.record
        request = BatchLineRequest(job_id=record.id, team=record.team, key_prefix=record.key_prefix,
                                   line_index=line.index, request_id=line_request_id(record.id, line.index),
                                   run_id=line_run_id(line_request_id(record.id, line.index)),
                                   endpoint=record.endpoint, body=line.body_json)
        self.stats["lines_sent"] += 1
        try:
            with tracing.line_span(record, line.index, line.custom_id) as span:
                try:
                    reply = await self.bus.request(self.bus.subjects.batch_line, request, BatchLineReply,
                                                   timeout=self.config.line_timeout_s)
                except BusError as exc:  # no edge, or none answered in time (its edge died): try again
                    reply = BatchLineReply(503, msgspec.json.encode({"error": {"message": str(exc)}}), "")
                if span is not None:
                    span.set_attributes({"http.response.status_code": reply.status_code,
                                         "infermesh.request_id": reply.request_id,
                                         "infermesh.batch.try": run.tries.get(line.index, 0) + 1})
            await self._answered(run, line, reply)
        finally:
            run.in_flight.discard(line.index)
            self._wake.set()

    async def _answered(self, run: JobRun, line: BatchLine, reply: BatchLineReply) -> None:
        job_id, now = run.job.record.id, time.time()
        if reply.status_code == 429 and _code(reply.body) == "insufficient_quota":  # the month's budget is spent
            error = BatchLineError("insufficient_quota", f"The team's budget is spent: {_message(reply.body)}")
            self._carry_out(run, [*run.job.fail(error, now), *run.job.line_deferred(line.index, now)])
            return
        if reply.status_code == 429 and _code(reply.body) == "preempted":  # interactive took its capacity back
            self._carry_out(run, run.job.line_deferred(line.index, now))
            if run.job.may_dispatch:  # again at once, not a try: admission queues it until batch has room
                self.dispatcher.requeue(job_id, line.index)
                self.stats["preempted"] += 1
            return
        tries = run.tries.get(line.index, 0) + 1
        run.tries[line.index] = tries
        retry = reply.status_code in RETRY_STATUSES or (reply.status_code >= 500 and tries < self.config.max_line_tries)
        if retry:  # pending again: sent after a backoff, or (cancelled, expired meanwhile) never
            self._carry_out(run, run.job.line_deferred(line.index, now))
            if run.job.may_dispatch:
                backoff = min(self.config.retry_max_s, self.config.retry_s * 2 ** min(tries - 1, 10))
                self.dispatcher.defer(job_id, line.index, now + max(backoff, reply.retry_after_s))
                self.stats["retried"] += 1
            return
        result = BatchLineResult(job_id=job_id, line_index=line.index, custom_id=line.custom_id,
                                 request_id=reply.request_id, status_code=reply.status_code, body=reply.body)
        await publish_result(self.bus, run.job.record.team, result)
        self._carry_out(run, run.job.line_ended(line.index, result.ok, now))
        self.stats["lines_ok" if result.ok else "lines_failed"] += 1
        run.dirty = True

    # ------------------------------------------------------------ the end of a job
    async def _finalize(self, run: JobRun, now: float) -> None:
        """Lines never run become error lines (why: the job's end), then the files, then the final status."""
        record = run.job.record
        await self._saved(run)
        results = await read_results(self.bus, record.team, record.id)
        reason = run.job.unfinished_code or "batch_failed"
        for index in sorted(run.unfinished):  # as the job counted them: a late answer of one is not output
            result = BatchLineResult(job_id=record.id, line_index=index, custom_id=run.input.custom_ids[index],
                                     error_code=reason, error_message=run.job.unfinished_message)
            await publish_result(self.bus, record.team, result)  # kept if none came before (first wins)
            results[index] = result
        output, errors_out = bytearray(), bytearray()
        for index in sorted(results):
            result = results[index]
            if result.ok:
                output += output_line(result.custom_id, result.status_code, result.request_id,
                                      msgspec.json.decode(result.body))
            elif result.status_code:
                errors_out += output_line(result.custom_id, result.status_code, result.request_id,
                                          msgspec.json.decode(result.body))
            else:
                errors_out += error_line(result.custom_id, result.error_code, result.error_message)
        output_id = (await self.files.put(record.team, "batch_output", f"{record.id}_output.jsonl",
                                          bytes(output))).id if output else None
        error_id = (await self.files.put(record.team, "batch_output", f"{record.id}_error.jsonl",
                                         bytes(errors_out))).id if errors_out else None
        self._carry_out(run, run.job.finalized(output_id, error_id, time.time()))
        await self._saved(run)
        tracing.record_job(run.job.record, time.time())
        del self.runs[record.id]
        run.input.close()
        self.dispatcher.drop_job(record.id)
        log.info("batch %s of %s: %s (%s)", record.id, record.team, run.job.record.status,
                 run.job.record.request_counts)

    async def _saved(self, run: JobRun) -> None:
        await self.save(run.job.record)
        run.dirty = False


def _error(body: bytes) -> dict:
    try:
        decoded = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return {}
    error = decoded.get("error") if isinstance(decoded, dict) else None
    return error if isinstance(error, dict) else {}


def _code(body: bytes) -> str:
    return str(_error(body).get("code") or "")


def _message(body: bytes) -> str:
    return str(_error(body).get("message") or "")
