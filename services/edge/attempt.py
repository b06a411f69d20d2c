"""One request's life at the edge, pure: its attempts on workers, a retry before the first token, token-exact
migration after it, and the one usage record it is billed. No I/O and no clock: ``mesh.py`` runs the actions it
gets back and feeds in what happened (the router's answer, stream messages, the client leaving) with the time.

    ROUTING --routed--> [PREFILLING --prefill ended or failed-->] STREAMING
    STREAMING --end message--> FINISHED          STREAMING --stop string--> STOPPING --abort drained--> FINISHED
    STREAMING --retryable error, no token sent yet, a retry left--> ROUTING (another worker)
    STREAMING --retryable error after tokens, a migration left--> ROUTING (migrating: prompt + the tokens so far,
                                                                  max_tokens reduced, the same sampling and seed)
    STREAMING --any error once max_tokens tokens were sent--> FINISHED ("length": only the end message was lost)
    STREAMING --any other error--> FAILED (no token sent: an API error, nothing billed) | BROKEN (billed what was sent)
    ROUTING --no worker--> FAILED, or BROKEN when migrating
    ROUTING/PREFILLING/STREAMING --client left--> CANCELLED (the abort's end message gives the final counts; routing
                                                  a migration: the tokens sent)
    STOPPING --client left--> STOPPING (the text is whole: the abort already being drained finishes it)

The usage record (``Usage``) is settled once: at FINISHED, BROKEN or FAILED, or once a cancelled request's abort
was drained. The client's usage is one request whatever the migrations; what the migrated-to workers recomputed
(the prompt and the tokens so far) is ``migration_prefill_tokens``, platform cost.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Union

import msgspec

from services.edge.errors import stream_failure
from services.edge.text import IncrementalDetokenizer, StopStringMatcher
from shared import errors
from shared.schema import (
    BillingContext,
    GenerateRequest,
    RouteDecision,
    RouteRequest,
    SamplingParams,
    StreamEnd,
    StreamError,
    StreamMessage,
    TokenChunk,
    UsageStatus,
)

# stream errors another worker may not repeat: a retry before the first token, a migration after it
RETRYABLE = frozenset({"worker_unavailable", "worker_shutdown", "stream_gap", "timeout", "engine_error",
                       "bad_message"})


class Phase(str, Enum):
    ROUTING = "routing"
    PREFILLING = "prefilling"
    STREAMING = "streaming"
    STOPPING = "stopping"  # a stop string ended the text: the abort's end message is awaited (cached tokens)
    FINISHED = "finished"
    FAILED = "failed"  # before any token reached the client
    BROKEN = "broken"  # after tokens reached the client
    CANCELLED = "cancelled"


TERMINAL = frozenset({Phase.FINISHED, Phase.FAILED, Phase.BROKEN, Phase.CANCELLED})


class StreamBroken(Exception):
    """The stream failed after tokens reached the client and could not move on: the response is cut. Its text is
    the client's (``services/edge/errors.py``: what kind of thing failed, the request id); ``detail`` (the stream
    errors, with worker ids and the engine's exception text) is for the log and the trace."""

    def __init__(self, message: str, detail: str = "") -> None:
        super().__init__(message)
        self.detail = detail


@dataclass(frozen=True, slots=True)
class Usage:
    """What the request is billed, once it is known: the counts the client was told (or the engine reported)."""

    status: UsageStatus
    finish_reason: str
    attempt: int
    worker_id: str
    prefill_worker_id: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_ms: float
    migrations: int = 0
    migration_prefill_tokens: int = 0
    deployment: str = ""  # where the first token came from (x-infermesh-deployment)
    stop_sequence: str = ""  # the stop string that ended the text ("" when none did)


@dataclass(frozen=True, slots=True)
class Limits:
    retries: int = 1  # attempts on another worker before the first token
    migrations: int = 3  # moves to another worker after it (0: the stream is cut when its worker fails)


# ---------------------------------------------------------------- actions
@dataclass(frozen=True, slots=True)
class Route:
    request: RouteRequest  # answer with routed() or route_failed()


@dataclass(frozen=True, slots=True)
class Send:
    """Open ``request.request_id``'s stream from ``worker_id`` and send it; ``billing`` is signed into it."""

    worker_id: str
    request: GenerateRequest
    billing: BillingContext
    prefill: bool = False  # the prefill half: its messages go to the machine as the prefill's


@dataclass(frozen=True, slots=True)
class Emit:
    text: str


@dataclass(frozen=True, slots=True)
class Report:
    """An attempt's outcome on a worker, for its breaker."""

    worker_id: str
    stream_id: str
    ok: bool
    kind: str = ""
    ttft_ms: float = 0.0


@dataclass(frozen=True, slots=True)
class Abort:
    """Abort the stream on its worker. ``drain``: keep reading it, shortly, and feed its end message in.
    ``superseded``: another attempt carries the request on, and bills it: the worker never reports this one
    as an orphan's (were the edge to die, its counts are in the new attempt's)."""

    worker_id: str
    stream_id: str
    drain: bool = False
    superseded: bool = False


@dataclass(frozen=True, slots=True)
class Close:
    stream_id: str


@dataclass(frozen=True, slots=True)
class Finish:
    usage: Usage


@dataclass(frozen=True, slots=True)
class Fail:
    error: Exception  # an ApiError before the first token, StreamBroken after


@dataclass(frozen=True, slots=True)
class Settle:
    usage: Usage | None  # None: nothing billable


Action = Union[Route, Send, Emit, Report, Abort, Close, Finish, Fail, Settle]


@dataclass(slots=True)
class _Attempt:
    index: int
    stream_id: str
    worker_id: str = ""
    prefill_worker_id: str = ""
    prefill_cached: int | None = None  # a remote prefill's cache hits: the cached count billed
    sent_at: float = 0.0
    num_output: int = 0  # tokens this attempt produced
    deployment: str = ""


@dataclass(slots=True)
class RequestRun:
    request_id: str
    model: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    routing: RouteRequest
    text: IncrementalDetokenizer
    stops: StopStringMatcher
    billing: BillingContext
    cache_salt: str | None = None
    limits: Limits = field(default_factory=Limits)
    phase: Phase = Phase.ROUTING
    output: list[int] = field(default_factory=list)  # every token the client was sent, across attempts
    excluded: list[str] = field(default_factory=list)  # workers that failed this request
    first_failure: errors.ApiError | None = None
    broke_with: tuple[str, str] = ("", "")  # the stream error that made the last migration (code, what)
    migrations: int = 0
    migration_prefill_tokens: int = 0
    ttft_ms: float = 0.0
    route_s: float = 0.0  # time spent waiting for the router's answers (every attempt's)
    usage: Usage | None = None
    settled: bool = False
    draining_prefill: bool = False  # the client left during the remote prefill: its stream is drained
    lease_deployment: str = ""  # the deployment that granted the request's lease: asked first
    deployment: str = ""  # the deployment of the attempt that sent the first token
    attempt: _Attempt = field(init=False)

    def __post_init__(self) -> None:
        self.attempt = _Attempt(0, self.request_id)

    @property
    def stream_id(self) -> str:
        """The stream whose messages the machine awaits now."""
        prefill = self.phase is Phase.PREFILLING or (self.phase is Phase.CANCELLED and self.draining_prefill)
        return f"{self.attempt.stream_id}-prefill" if prefill else self.attempt.stream_id

    def usage_so_far(self) -> Usage | None:
        """The usage as seen now (settled or not): billed if a cancelled request's final counts never come."""
        return self.usage

    # ------------------------------------------------------------ inputs
    def start(self) -> list[Action]:
        return [Route(self._routing())]

    def routed(self, decision: RouteDecision, now: float, deployment: str = "") -> list[Action]:
        assert self.phase is Phase.ROUTING
        a = self.attempt
        a.worker_id, a.sent_at, a.deployment = decision.worker_id, now, deployment
        if decision.prefill_worker_id and not self.output:  # a migration prefills on its new worker
            a.prefill_worker_id = decision.prefill_worker_id
            self.phase = Phase.PREFILLING
            prefill_id = f"{a.stream_id}-prefill"  # no dots: the id ends a subject
            request = GenerateRequest(prefill_id, self.model, self.prompt_token_ids,
                                      msgspec.structs.replace(self.sampling, max_tokens=1), cache_salt=self.cache_salt,
                                      remote_decode=True, request_class=self.billing.request_class)
            return [Send(a.prefill_worker_id, request, self._context(None), prefill=True)]
        return self._send(None)

    def route_failed(self, error: errors.ApiError) -> list[Action]:
        assert self.phase is Phase.ROUTING
        if self.output:
            code, why = self.broke_with
            return self._break(code, f"{why}; no other worker could take the stream over ({error.message})")
        if self.first_failure is not None and error.code == "no_capacity":  # nowhere else to go
            error = self.first_failure
        return self._fail(error)

    def message(self, message: StreamMessage, now: float) -> list[Action]:
        if self.phase is Phase.PREFILLING:
            return self._on_prefill(message)
        if self.phase is Phase.STREAMING:
            if isinstance(message, TokenChunk):
                return self._on_tokens(message.token_ids, now)
            if isinstance(message, StreamEnd):
                return self._on_end(message)
            return self._on_error(message)
        if self.phase is Phase.STOPPING and not isinstance(message, TokenChunk):
            end = message if isinstance(message, StreamEnd) else None
            self.phase = Phase.FINISHED
            return [Close(self.attempt.stream_id), *self._finish("stop", end)]
        if self.phase is Phase.CANCELLED and not self.settled and not isinstance(message, TokenChunk):
            return self._drained(message if isinstance(message, StreamEnd) else None)
        return []  # tokens after a stop string or a cancellation: the end message decides

    def client_left(self) -> list[Action]:
        """The client went away (or the request was cancelled): abort and drain what was running."""
        if self.phase in TERMINAL:
            return []
        if self.phase is Phase.STOPPING:  # the text is whole and its abort is being drained: that finishes it
            self.usage = self._usage("finished", "stop", self.attempt.prefill_cached or 0)
            return []
        phase, self.phase = self.phase, Phase.CANCELLED
        if phase is Phase.ROUTING:  # no worker has it: nothing more was computed (a migration's tokens were sent)
            return [Settle(self._settle(self._usage("cancelled", "abort", 0) if self.output else None))]
        a = self.attempt
        if phase is Phase.PREFILLING:
            self.draining_prefill = True
            return [Abort(a.prefill_worker_id, f"{a.stream_id}-prefill", drain=True)]
        if self.output:  # billed even if the end message never comes
            self.usage = self._usage("cancelled", "abort", a.prefill_cached or 0)
        return [Abort(a.worker_id, a.stream_id, drain=True)]

    # ------------------------------------------------------------ transitions
    def _on_prefill(self, message: StreamMessage) -> list[Action]:
        a = self.attempt
        prefill_id = f"{a.stream_id}-prefill"
        if isinstance(message, TokenChunk):
            return []
        self.phase = Phase.ROUTING  # _send moves it on
        if isinstance(message, StreamEnd):
            handle = message.kv_transfer
            return [Report(a.prefill_worker_id, prefill_id, True), Close(prefill_id),
                    *self._send(message if handle is not None else None)]
        if message.code == "bad_request":
            return [Close(prefill_id), *self._fail(errors.invalid_request(message.message))]
        # the prefill failed: the decode worker computes the prompt itself
        return [Report(a.prefill_worker_id, prefill_id, False, message.code), Close(prefill_id), *self._send(None)]

    def _send(self, prefilled: StreamEnd | None) -> list[Action]:
        a = self.attempt
        self.phase = Phase.STREAMING
        kv = prefilled.kv_transfer if prefilled is not None else None
        a.prefill_cached = prefilled.num_cached_tokens if prefilled is not None else None
        if self.output:
            self.migrations += 1
            self.migration_prefill_tokens += len(self.prompt_token_ids) + len(self.output)
        sampling = msgspec.structs.replace(self.sampling, max_tokens=self.sampling.max_tokens - len(self.output))
        request = GenerateRequest(a.stream_id, self.model, self.prompt_token_ids, sampling, attempt=a.index,
                                  kv_transfer=kv, cache_salt=self.cache_salt, output_token_ids=list(self.output),
                                  request_class=self.billing.request_class)
        return [Send(a.worker_id, request, self._context(a.prefill_cached))]

    def _on_tokens(self, token_ids: list[int], now: float) -> list[Action]:
        a = self.attempt
        if not self.output:
            self.ttft_ms = 1000 * (now - a.sent_at)
            self.deployment = a.deployment
        a.num_output += len(token_ids)
        self.output.extend(token_ids)
        text, hit = self.stops.feed(self.text.push(token_ids))
        actions: list[Action] = [Emit(text)] if text else []
        if hit:
            self.phase = Phase.STOPPING
            actions += [Report(a.worker_id, a.stream_id, True, "", self._attempt_ttft()),
                        Abort(a.worker_id, a.stream_id, drain=True)]
        return actions

    def _on_end(self, end: StreamEnd) -> list[Action]:
        a = self.attempt
        self.phase = Phase.FINISHED
        text, hit = self._flush()
        actions: list[Action] = [Report(a.worker_id, a.stream_id, True, "", self._attempt_ttft()), Close(a.stream_id)]
        return actions + text + self._finish("stop" if hit else end.finish_reason, end)

    def _flush(self) -> tuple[list[Action], bool]:
        """The text held back (a partial character, a possible stop string) once no token follows; a stop hit."""
        text, hit = self.stops.feed(self.text.flush())
        text += "" if hit else self.stops.flush()
        return ([Emit(text)] if text else []), hit

    def _on_error(self, error: StreamError) -> list[Action]:
        a = self.attempt
        actions: list[Action] = [Abort(a.worker_id, a.stream_id), Close(a.stream_id)]  # a no-op if it ended
        if error.code != "bad_request":  # the client's fault, not the worker's
            actions.insert(0, Report(a.worker_id, a.stream_id, False, "broken" if a.num_output else error.code))
        retryable = error.code in RETRYABLE
        if not self.output:
            api_error = _api_error(error, self.request_id)
            if retryable and a.index < self.limits.retries:
                self.first_failure = self.first_failure or api_error
                return self._next_attempt(actions)
            return actions + self._fail(api_error)
        if len(self.output) >= self.sampling.max_tokens:  # every token was sent, only the end was lost
            self.phase = Phase.FINISHED
            text, hit = self._flush()
            return actions + text + self._finish("stop" if hit else "length", None)
        if retryable and self.migrations < self.limits.migrations:
            self.broke_with = (error.code, f"{error.code}: {error.message}")
            return self._next_attempt(actions)
        why = f"{error.code}: {error.message}"
        if retryable and self.limits.migrations:
            why += f" (the migration limit of {self.limits.migrations} is reached)"
        return actions + self._break(error.code, why)

    def _next_attempt(self, actions: list[Action]) -> list[Action]:
        """The failed attempt's actions, its abort marked superseded, then routing the next attempt."""
        actions = [dataclasses.replace(x, superseded=True) if isinstance(x, Abort) else x for x in actions]
        self.excluded.append(self.attempt.worker_id)
        index = self.attempt.index + 1
        self.attempt = _Attempt(index, f"{self.request_id}-a{index}")  # a fresh stream subject
        self.phase = Phase.ROUTING
        return [*actions, Route(self._routing())]

    def _drained(self, end: StreamEnd | None) -> list[Action]:
        """A cancelled request's abort drained: the engine's end message (None: none came in time) settles it.

        Before the first token the end message decides: the prompt the engine reports computing is billed (none if
        it never ran it), or the whole prompt a prefill worker already computed; without an end message, nothing is.
        A remote prefill's one token was never the client's: no completion tokens."""
        a = self.attempt
        stream_id = f"{a.stream_id}-prefill" if self.draining_prefill else a.stream_id
        usage = self.usage
        if end is not None:
            status, reason = ("cancelled", "abort") if usage is None else (usage.status, usage.finish_reason)
            completion = len(self.output) if self.draining_prefill else max(len(self.output), end.num_output_tokens)
            prompt = len(self.prompt_token_ids)
            if usage is None and a.prefill_cached is None:  # only what this engine computed of it
                prompt = min(end.num_prompt_tokens, prompt)
            usage = Usage(status, reason, a.index, a.worker_id, a.prefill_worker_id,  # type: ignore[arg-type]
                          prompt, _cached(a.prefill_cached, end.num_cached_tokens, prompt), completion,
                          self.ttft_ms, self.migrations, self.migration_prefill_tokens, self.deployment)
        return [Close(stream_id), Settle(self._settle(usage))]

    # ------------------------------------------------------------ endings
    def _finish(self, reason: str, end: StreamEnd | None) -> list[Action]:
        a = self.attempt
        cached = _cached(a.prefill_cached, end.num_cached_tokens if end else 0, len(self.prompt_token_ids))
        usage = self._settle(dataclasses.replace(self._usage("finished", reason, cached),
                                                 stop_sequence=self.stops.matched))
        return [Settle(usage), Finish(usage)]

    def _break(self, code: str, why: str) -> list[Action]:
        self.phase = Phase.BROKEN
        usage = self._usage("failed", code, self.attempt.prefill_cached or 0)
        return [Settle(self._settle(usage)), Fail(StreamBroken(stream_failure(code, self.request_id), why))]

    def _fail(self, error: errors.ApiError) -> list[Action]:
        self.phase = Phase.FAILED
        return [Settle(self._settle(None)), Fail(error)]

    def _settle(self, usage: Usage | None) -> Usage | None:
        assert not self.settled, "a request's usage is settled once"
        self.settled, self.usage = True, usage
        return usage

    def _usage(self, status: UsageStatus, reason: str, cached: int) -> Usage:
        a = self.attempt
        return Usage(status, reason, a.index, a.worker_id, a.prefill_worker_id, len(self.prompt_token_ids), cached,
                     len(self.output), self.ttft_ms, self.migrations, self.migration_prefill_tokens, self.deployment)

    def _attempt_ttft(self) -> float:
        return self.ttft_ms if self.attempt.num_output == len(self.output) else 0.0

    def _routing(self) -> RouteRequest:
        return msgspec.structs.replace(self.routing, request_id=self.attempt.stream_id,
                                       exclude_worker_ids=list(self.excluded))

    def _context(self, prefill_cached: int | None) -> BillingContext:
        a = self.attempt
        return msgspec.structs.replace(self.billing, attempt=a.index, worker_id=a.worker_id,
                                       prefill_worker_id=a.prefill_worker_id, prefill_cached_tokens=prefill_cached,
                                       migrations=self.migrations,
                                       migration_prefill_tokens=self.migration_prefill_tokens)


def _cached(prefill_cached: int | None, decode_cached: int, prompt_tokens: int) -> int:
    """Prompt tokens served from cache: the prefill worker's count when it computed the prompt."""
    return min(decode_cached if prefill_cached is None else prefill_cached, prompt_tokens)


def _api_error(error: StreamError, request_id: str) -> errors.ApiError:
    """What the client is told of a stream error before its first token: the worker's message only where it is
    about the request (bad_request); otherwise a stable one (the mesh logs the error's detail: mesh.py)."""
    if error.code == "bad_request":
        return errors.invalid_request(error.message)
    if error.code in RETRYABLE:
        return errors.service_unavailable(stream_failure(error.code, request_id), error.code)
    return errors.engine_failed(stream_failure(error.code, request_id))
