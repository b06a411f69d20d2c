"""Continuous-batching scheduler for the simulated engine, pure (no clock, no I/O).

One step:

    batch = scheduler.schedule()                  # decodes first, then prefill chunks, FCFS
    ... the engine "runs" the batch (its cost model turns the batch into a step time) ...
    finished = scheduler.postprocess(batch, sample)   # append sampled tokens, finish, free

Policy, as in vLLM v1: running requests in decode get one token each first; then
running requests still in prefill continue in chunks; then waiting requests are admitted
first-come-first-served while the per-step token budget (``max_num_batched_tokens``) and
``max_num_seqs`` allow and the block pool can hold their prompt (a request at the head
that does not fit blocks the queue). A decode that needs a new block when none is free
preempts the most recently admitted running request (recompute: its blocks are freed and
it returns to the front of the waiting queue). With priorities (vLLM's "priority" policy:
lower goes first), the waiting queue is ordered by priority, then arrival, and the victim
is the newest running request of the lowest priority; a waiting request never preempts.
A preempted request is readmitted only when a block stays free after it (as Dynamo's mocker
does): readmitted into an exactly full pool, it would be preempted again by the next decode,
over and over.

A request whose KV a prefill worker computed (``remote_kv``, the decode side of a
disaggregated pair) is admitted like any other, but instead of prefilling it starts a
transfer of the prompt tokens not already cached here (``batch.transfers``) and is
skipped until ``kv_arrived``; then, as in vLLM's NIXL connector, only its last prompt
token is computed locally, which yields its first output token.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from services.worker.engines.block_pool import BlockPool


@dataclass(slots=True, eq=False)
class SimRequest:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    extra: tuple = ()
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    finish_reason: str | None = None
    remote_kv: bool = False  # the prompt's KV is pulled from a prefill worker instead of computed here
    receiving: bool = False  # admitted, its KV transfer still in flight: not scheduled until kv_arrived()
    arrival_t: float = 0.0
    priority: int = 0  # lower goes first (vLLM's priority policy): interactive 0, batch 1 (base.ENGINE_PRIORITY)
    scheduled_t: float | None = None  # first time any of it ran (queue wait = scheduled_t - arrival_t)
    token_times: list[float] = field(default_factory=list)
    kv_pull_t: float | None = None  # when its (latest) KV pull started, and for how long and how many tokens
    kv_pull_s: float = 0.0
    kv_pull_tokens: int = 0

    @property
    def token_ids(self) -> list[int]:
        """What must be in the KV cache to continue: the prompt, then all but the newest output token."""
        return self.prompt_token_ids + self.output_token_ids[:-1]

    @property
    def num_tokens_to_prefill(self) -> int:
        """len(token_ids) when resumed after preemption, else the prompt length (no list built: this is hot)."""
        return len(self.prompt_token_ids) + max(len(self.output_token_ids) - 1, 0)

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.num_tokens_to_prefill


@dataclass(slots=True)
class ScheduledBatch:
    prefills: list[tuple[SimRequest, int]] = field(default_factory=list)  # (request, tokens this step)
    decodes: list[SimRequest] = field(default_factory=list)
    preempted: list[SimRequest] = field(default_factory=list)
    transfers: list[tuple[SimRequest, int]] = field(default_factory=list)  # (request, tokens to pull) started now

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.prefills) + len(self.decodes)


class Scheduler:
    def __init__(self, pool: BlockPool, max_num_batched_tokens: int, max_num_seqs: int) -> None:
        assert max_num_batched_tokens > 0 and max_num_seqs > 0
        self.pool = pool
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []  # in admission order

    def add(self, request: SimRequest) -> None:
        """Queue a request; one that could never fit in the pool alone is refused (ValueError)."""
        assert request.prompt_token_ids and request.max_tokens > 0
        num_tokens = len(request.prompt_token_ids) + request.max_tokens - 1  # the last token needs no KV
        if -(-num_tokens // self.pool.block_size) > self.pool.num_blocks:
            raise ValueError(f"request {request.request_id} needs {num_tokens} tokens of KV; the pool holds "
                             f"{self.pool.num_blocks * self.pool.block_size}")
        self._enqueue(request, front=False)

    def _enqueue(self, request: SimRequest, front: bool) -> None:
        """Into the waiting queue behind every request of a higher priority (lower value) and ahead of every lower
        one; within its priority last (new) or first (preempted: it goes on before newer ones)."""
        queue, i = self.waiting, len(self.waiting)
        if front:
            i = next((k for k, r in enumerate(queue) if r.priority >= request.priority), i)
        else:
            while i > 0 and queue[i - 1].priority > request.priority:
                i -= 1
        queue.insert(i, request)

    def abort(self, request_id: str) -> SimRequest | None:
        """Drop a request wherever it is; returns it (finish_reason "abort") or None if unknown."""
        for queue in (self.waiting, self.running):
            for request in queue:
                if request.request_id == request_id:
                    queue.remove(request)
                    self.pool.free(request_id)
                    request.finish_reason = "abort"
                    return request
        return None

    # ------------------------------------------------------------ schedule
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        self._schedule_decodes(batch)
        budget = self.max_num_batched_tokens - len(batch.decodes)
        for request in self.running:
            if budget == 0:
                break
            if request.is_prefilling and not request.receiving:
                chunk = min(request.num_tokens_to_prefill - request.num_computed_tokens, budget)
                batch.prefills.append((request, chunk))
                budget -= chunk
        self._admit_waiting(batch, budget)
        return batch

    def _schedule_decodes(self, batch: ScheduledBatch) -> None:
        for request in list(self.running):
            if len(batch.decodes) == self.max_num_batched_tokens:
                return
            if request.is_prefilling or request.receiving or request not in self.running:
                continue  # still prefilling, or preempted earlier in this loop
            while not self.pool.append_tokens(request.request_id, request.output_token_ids[-1:]):
                victim = max(reversed(self.running), key=lambda r: r.priority)  # lowest priority, newest of it
                self._preempt(victim, batch)
                if victim is request:
                    break
            else:
                batch.decodes.append(request)

    def _preempt(self, request: SimRequest, batch: ScheduledBatch) -> None:
        self.running.remove(request)
        request.receiving = False
        if request in batch.decodes:
            batch.decodes.remove(request)
        self.pool.free(request.request_id)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        batch.preempted.append(request)
        self._enqueue(request, front=True)

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if request in batch.preempted:
                break  # not again in the step that preempted it
            if (request.output_token_ids and self.running
                    and not self.pool.can_allocate(request.token_ids, request.extra, headroom=1)):
                break  # readmitted into a full pool, it would be the next decode's victim again
            num_cached = self.pool.allocate(request.request_id, request.token_ids, request.extra)
            if num_cached is None:
                break  # first-come-first-served: the head waits for blocks
            self.waiting.popleft()
            self.running.append(request)
            request.num_computed_tokens = num_cached
            if not request.output_token_ids:
                request.num_cached_tokens = num_cached
            if request.remote_kv and not request.output_token_ids:
                num_to_pull = request.num_tokens_to_prefill - 1 - num_cached
                if num_to_pull > 0:
                    request.receiving = True
                    request.num_computed_tokens += num_to_pull
                    batch.transfers.append((request, num_to_pull))
                    continue
            chunk = min(request.num_tokens_to_prefill - num_cached, budget)
            batch.prefills.append((request, chunk))
            budget -= chunk

    def kv_arrived(self, request: SimRequest) -> None:
        """A transfer started by ``schedule`` completed: the request runs from the next step on."""
        request.receiving = False

    # ------------------------------------------------------------ after the step
    def postprocess(self, batch: ScheduledBatch, sample: Callable[[SimRequest], int]) -> list[SimRequest]:
        """Advance every scheduled request, sample where a token is due; return the finished ones."""
        finished = []
        for request, chunk in batch.prefills:
            if request.finish_reason is not None:
                continue  # aborted while the step ran
            request.num_computed_tokens += chunk
            if not request.is_prefilling and not request.output_token_ids:
                self._emit(request, sample(request), finished)
        for request in batch.decodes:
            if request.finish_reason is not None:
                continue
            request.num_computed_tokens += 1
            self._emit(request, sample(request), finished)
        return finished

    def _emit(self, request: SimRequest, token: int, finished: list[SimRequest]) -> None:
        request.output_token_ids.append(token)
        if token in request.stop_token_ids:
            request.finish_reason = "stop"
        elif len(request.output_token_ids) >= request.max_tokens:
            request.finish_reason = "length"
        else:
            return
        self.running.remove(request)
        self.pool.free(request.request_id)
        finished.append(request)
