"""Where and when a request is prepared: inline on the event loop, or in a prep process through the fair queue.

``PrepPool.run`` prepares ``job`` (prep.py's ``prepare``)

- inline for bodies up to ``inline_bytes`` whose tool / response_format schemas (if any) were prepared before
  (the common agent turn: cheaper than a hop, well under a millisecond);
- otherwise in one of ``processes`` prep processes (prep_workers.py), in the order prep_queue.py's fair queue
  gives: per team fair, bounded, each job with a deadline. A job prefers the process its conversation's earlier
  turns went to (where its incremental-tokenizer cache is).

Both ways spend the team's prep-seconds bucket (prep_queue.py): a team over its rate gets 429 before any work.
A process that dies under a job is replaced and the job runs once more on the new one (a job that kills it twice
gets 503 ``prep_unavailable``); one running past its job's deadline is killed and replaced (504 ``prep_timeout``);
a job still queued at its deadline gets 503 ``prep_busy``.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import pickle
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from services.edge.prep import Failure, Prepared, PrepJob, prepare, worker_main
from services.edge.prep_queue import PrepQueue, QueueLimits, Rejected, Rejection, Ticket
from services.edge.prep_workers import WorkerDied, WorkerProcess
from services.edge.tools.validate import remember_checked
from shared import errors

log = logging.getLogger("infermesh.edge")
KNOWN_REQUESTS = 4096  # distinct (tools, response_format) bodies remembered as prepared
AFFINITY_BYTES = 4096  # a conversation's turns start alike: their first bytes pick the process they prefer
REJECTIONS: dict[Rejection, str] = {
    "team_rate_limited": "Rate limit reached for request preparation: your team used its share of the edge's "
                         "preparation time (count_tokens included).",
    "team_queue_full": "Rate limit reached for request preparation: your team has too many requests waiting "
                       "to be prepared.",
    "queue_full": "Rate limit reached for request preparation: the edge has too many requests waiting to be prepared.",
}


def rejected_error(rejected: Rejected) -> errors.ApiError:
    return errors.rate_limited(REJECTIONS[rejected.reason], rejected.retry_after_s)


def prep_timeout(deadline_s: float) -> errors.ApiError:
    return errors.ApiError(504, f"Preparing the request took longer than {deadline_s:g} s; send a smaller request.",
                           "server_error", None, "prep_timeout")


class PrepPool:
    """Runs ``prepare`` inline or in prep processes (see the module docstring for which and why)."""

    def __init__(self, processes: int, inline_bytes: int, limits: QueueLimits | None = None) -> None:
        self.processes = processes
        self.inline_bytes = inline_bytes
        self.queue = PrepQueue(limits or QueueLimits(), processes)
        self._known: OrderedDict[bytes, None] = OrderedDict()  # schema-bearing requests prepared before
        self._workers: list[WorkerProcess | None] = [None] * processes  # None: not started (or being replaced)
        self._busy: set[int] = set()
        self._waiting: dict[int, tuple[bytes, asyncio.Future[Prepared | Failure]]] = {}  # ticket id -> job, result
        self._retried: set[int] = set()  # tickets whose process died under them once
        self._tokenizers: set[str] = set()  # what a new process preloads
        self._threads = ThreadPoolExecutor(2 * processes + 1, thread_name_prefix="prep-pipe")  # pipes, starts, reaps
        self._tasks: set[asyncio.Task[None]] = set()
        self._starting: asyncio.Task[None] | None = None
        self.num_inline = 0
        self.num_offloaded = 0

    def is_inline(self, job: PrepJob, schema_key: bytes | None) -> bool:
        if self.processes == 0:
            return True
        return len(job.body) <= self.inline_bytes and (schema_key is None or schema_key in self._known)

    async def run(self, job: PrepJob, tokenizer: Any, schema_key: bytes | None = None) -> Prepared:
        """``job`` prepared; ApiError: the body's own (400, ...), or 429 / 503 / 504 from the limits above."""
        if self.is_inline(job, schema_key):
            prepared = self._run_inline(job, tokenizer)
        else:
            self.num_offloaded += 1
            result = await self._offload(job)
            if isinstance(result, Failure):
                raise result.error()
            prepared = result
            remember_checked(prepared.checked_schemas)  # the next inline run skips those checks
        if schema_key is not None:
            self._known[schema_key] = None
            if len(self._known) > KNOWN_REQUESTS:
                self._known.popitem(last=False)
        return prepared

    def _run_inline(self, job: PrepJob, tokenizer: Any) -> Prepared:
        rejected = self.queue.check_rate(job.team, time.monotonic())
        if rejected is not None:
            raise rejected_error(rejected)
        self.num_inline += 1
        started = time.monotonic()
        try:
            return prepare(job, tokenizer)
        finally:
            now = time.monotonic()
            self.queue.charge(job.team, now - started, now)

    async def _offload(self, job: PrepJob) -> Prepared | Failure:
        """``job`` prepared in a prep process, in its turn; 429 at once when its team or the queue is full."""
        ticket = self.queue.submit(job.team, len(job.body) + len(job.context), time.monotonic(), self._prefers(job))
        if isinstance(ticket, Rejected):
            raise rejected_error(ticket)
        if job.tokenizer_path is not None:
            self._tokenizers.add(job.tokenizer_path)
        done: asyncio.Future[Prepared | Failure] = asyncio.get_running_loop().create_future()
        self._waiting[ticket.id] = (pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL), done)
        try:
            self._dispatch()
            if not await _done_within(done, ticket.deadline - time.monotonic()) and self._withdraw(ticket):
                raise errors.service_unavailable("The edge is busy preparing other requests; retry.", "prep_busy")
            return await done  # running: its process answers, or is killed, by the deadline
        finally:
            self._withdraw(ticket)  # its client left while it was queued

    def _withdraw(self, ticket: Ticket) -> bool:
        """Take a queued ticket out (False: it is running or ended)."""
        if not self.queue.cancel(ticket):
            return False
        self._waiting.pop(ticket.id, None)
        return True

    def _prefers(self, job: PrepJob) -> int:
        digest = hashlib.blake2b(job.team.encode() + b"\0" + job.body[:AFFINITY_BYTES], digest_size=8).digest()
        return int.from_bytes(digest, "little") % self.processes

    def _dispatch(self) -> None:
        """Give the idle processes their next jobs (starting the processes on first use)."""
        if self._starting is None:
            self._starting = self._spawn(self._start_all())
            self._starting.add_done_callback(_log_failure)
            return
        idle = [i for i, w in enumerate(self._workers) if w is not None and i not in self._busy]
        for ticket in self.queue.dispatch(idle):
            assert ticket.worker is not None
            self._busy.add(ticket.worker)
            self._spawn(self._execute(ticket, ticket.worker))

    async def _execute(self, ticket: Ticket, index: int) -> None:
        """Run ``ticket``'s job on process ``index``; answer its waiter; replace the process if it died or was
        killed (a job it died under runs once more, first in the queue)."""
        worker = self._workers[index]
        assert worker is not None
        payload, done = self._waiting.pop(ticket.id, (b"", None))
        started = time.monotonic()
        outcome: Prepared | Failure | errors.ApiError | None = None  # None: its process died, run it again
        alive = True
        if done is not None and not done.done():  # (else its client left while it was handed over)
            outcome, alive = await self._call(ticket, worker, payload)
        if outcome is None:
            self._retried.add(ticket.id)
            self._waiting[ticket.id] = (payload, done)  # type: ignore[assignment]
            self.queue.requeue(ticket)
        else:
            self._retried.discard(ticket.id)
            now = time.monotonic()
            self.queue.finish(ticket, now - started, now)
            if done is not None and not done.done():
                done.set_exception(outcome) if isinstance(outcome, errors.ApiError) else done.set_result(outcome)
        self._busy.discard(index)
        if alive:
            self._dispatch()
        else:
            await self._replace(index, worker)

    async def _call(self, ticket: Ticket, worker: WorkerProcess,
                    payload: bytes) -> tuple[Prepared | Failure | errors.ApiError | None, bool]:
        """The job's result (None: the process died, and the job may run again) and whether the process lives."""
        call = asyncio.get_running_loop().run_in_executor(self._threads, worker.call, payload)
        call.add_done_callback(lambda f: f.cancelled() or f.exception())  # (read below, or not at all if killed)
        if not await _done_within(call, ticket.deadline - time.monotonic()):
            log.warning("prep process %d ran past a job's deadline: killed and replaced", worker.index)
            worker.kill()
            return prep_timeout(self.queue.limits.deadline_s), False
        try:
            return pickle.loads(call.result()), True
        except WorkerDied:
            log.warning("prep process %d died under a job; starting another", worker.index)
            if ticket.id in self._retried:
                return errors.service_unavailable("Request preparation is unavailable; retry.",
                                                  "prep_unavailable"), False
            return None, False

    async def _replace(self, index: int, worker: WorkerProcess) -> None:
        self._workers[index] = None
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._threads, worker.close)
        self._workers[index] = await loop.run_in_executor(self._threads, self._new_worker, index)
        self._dispatch()

    async def _start_all(self) -> None:
        loop = asyncio.get_running_loop()
        started = await asyncio.gather(*(loop.run_in_executor(self._threads, self._new_worker, i)
                                         for i in range(self.processes)))
        self._workers = list(started)
        self._dispatch()

    def _new_worker(self, index: int) -> WorkerProcess:
        return WorkerProcess(index, worker_main, sorted(self._tokenizers))

    def _spawn(self, work: Any) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def pids(self) -> list[int]:
        """The running prep processes' ids (for tests and operators)."""
        return [w.pid for w in self._workers if w is not None and w.pid is not None]

    def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for worker in self._workers:
            if worker is not None:
                worker.kill()
        self._workers = [None] * self.processes
        self._threads.shutdown(wait=False, cancel_futures=True)


async def _done_within(future: asyncio.Future[Any], timeout_s: float) -> bool:
    """Whether ``future`` is done within ``timeout_s`` (never cancels it)."""
    if not future.done() and timeout_s > 0:
        await asyncio.wait({future}, timeout=timeout_s)
    return future.done()


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("the prep processes could not start", exc_info=task.exception())
