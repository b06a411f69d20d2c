"""Drive a workload (loadtests/lib/workloads.py) through the edge over HTTP: streamed completions of token ids.

Every arrival becomes one ``POST /v1/completions`` with ``prompt`` as token ids, ``stream``,
``stream_options.include_usage`` and ``ignore_eos`` (exactly max_tokens come back), sent on its
session's own keep-alive HTTP/1.1 connection (a session's turns are sequential). The client is
lean, like loadtests/lib/sse_client.py: it parses the chunked framing and counts SSE events by a byte
search, and decodes JSON only for the usage chunk, so that the load generator's parsing does not
crowd the mesh out of this machine's cores.

Times: workload times are *simulated* seconds. An arrival at t is sent at t / clock_factor wall
seconds after the start, and a turn's completion is reported to the workload at (wall elapsed) *
clock_factor, so think times and staggering run on the engines' clock. Records are in wall
seconds from the start (multiply by the clock factor for simulated time).

Token ids: a workload draws ids from [0, vocab.size); they are mapped onto tokens that decode to
plain ASCII on their own (SafeVocab), so that every streamed token is one SSE event (the edge emits
nothing for a special token or half a UTF-8 character). The sim engine's output is a pure function
of the prompt and seed (services.worker.engines.sim.sim_token_ids); the driver recomputes it to
give the workload the exact output ids of each turn, so the next prompt extends the KV the engines
really cached.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from dataclasses import dataclass, field

import msgspec

from loadtests.lib.report import RequestRecord
from loadtests.lib.sse_client import read_chunks
from loadtests.lib.workloads import Arrival, Workload
from services.worker.engines.sim import sim_token_ids

CONTENT_EVENT = b'"finish_reason":null'  # every content event of a text_completion stream, and only those
USAGE_EVENT = b'data: {"id"'
IDLE_REOPEN_S = 4.0  # uvicorn closes keep-alive connections idle for 5 s


class SafeVocab:
    """Workload ids 0..size-1 <-> model token ids that decode to non-empty ASCII text on their own."""

    def __init__(self, tokenizer_path: str) -> None:
        from services.edge.tokenizer import ModelTokenizer

        tok = ModelTokenizer(tokenizer_path)
        special = set(tok.hf.all_special_ids)
        ids = []
        for i in range(tok.vocab_size):
            text = tok.decode([i]) if i not in special else ""
            if text and text.isascii() and text.isprintable():
                ids.append(i)
        self.ids = ids
        self.size = len(ids)
        self._index = {t: i for i, t in enumerate(ids)}

    def to_model(self, token_ids: list[int]) -> list[int]:
        ids = self.ids
        return [ids[t] for t in token_ids]

    def from_model(self, token_ids: list[int]) -> list[int]:
        index = self._index
        return [index[t] for t in token_ids]


@dataclass(slots=True)
class StreamResult:
    """One streamed response as the client saw it (perf_counter times)."""

    sent: float
    event_times: list[float] = field(default_factory=list)  # one per content event
    usage: dict | None = None
    error: str | None = None
    finish: float = math.nan


class Connection:
    """One keep-alive HTTP/1.1 connection to the edge, used by one session at a time."""

    def __init__(self, host: str, port: int, api_key: str) -> None:
        self.host, self.port = host, port
        self._head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {api_key}\r\n"
                      "Content-Type: application/json\r\nContent-Length: ").encode()
        self._streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self._idle_since = 0.0

    def close(self) -> None:
        if self._streams is not None:
            self._streams[1].close()
            self._streams = None

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self._streams is not None and time.perf_counter() - self._idle_since > IDLE_REOPEN_S:
            self.close()
        if self._streams is None:
            self._streams = await asyncio.open_connection(self.host, self.port, limit=1 << 20)
        return self._streams

    async def stream(self, body: bytes, timeout_s: float) -> StreamResult:
        request = self._head + str(len(body)).encode() + b"\r\n\r\n" + body
        result = StreamResult(time.perf_counter())
        try:
            async with asyncio.timeout(timeout_s):
                await self._exchange(request, result)
        except TimeoutError:
            result.error = "timeout"
        except (ConnectionError, asyncio.IncompleteReadError, ValueError) as exc:
            result.error = f"{type(exc).__name__}: {exc}"
        result.finish = time.perf_counter()
        if result.error is not None:
            self.close()
        else:
            self._idle_since = result.finish
        return result

    async def _exchange(self, request: bytes, result: StreamResult) -> None:
        reader, writer = await self._open()
        result.sent = time.perf_counter()
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        length = -1  # -1: chunked
        for line in head.lower().split(b"\r\n"):
            if line.startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        ok = head.startswith(b"HTTP/1.1 200")
        if length >= 0:
            body = await reader.readexactly(length)
            result.error = None if ok else f"{head[9:12].decode()} {body[:300].decode(errors='replace')}"
            return
        async for chunk in read_chunks(reader):  # one chunk per write of the edge
            if not ok:
                result.error = result.error or f"{head[9:12].decode()} {chunk[:300].decode(errors='replace')}"
                continue
            now = time.perf_counter()
            result.event_times.extend([now] * chunk.count(CONTENT_EVENT))
            if b'"error"' in chunk and result.error is None:
                result.error = "stream: " + chunk[:300].decode(errors="replace")
            at = chunk.find(b'"usage":{')
            if at >= 0:
                event = chunk[chunk.rfind(USAGE_EVENT, 0, at) + 6:chunk.find(b"\n\n", at)]
                result.usage = msgspec.json.decode(event)["usage"]


def token_times(event_times: list[float], num_tokens: int, stream_interval: int) -> list[float]:
    """One time per output token: the sim engine sends the first token alone, then stream_interval at a time,
    then the rest; if the events do not add up to that, the tokens are spread evenly over the events."""
    if not event_times or num_tokens <= 0:
        return []
    counts = [1] + [stream_interval] * ((num_tokens - 2) // stream_interval) if num_tokens > 1 else [1]
    if num_tokens > 1:
        counts.append(num_tokens - sum(counts))
    if len(counts) != len(event_times):
        n = len(event_times)
        counts = [num_tokens // n + (1 if i < num_tokens % n else 0) for i in range(n)]
    return [t for t, k in zip(event_times, counts, strict=True) for _ in range(k)]


class LiveDriver:
    """Runs a workload against the edge; ``run`` returns one RequestRecord per arrival (wall seconds)."""

    def __init__(self, host: str, port: int, api_key: str, model: str, workload: Workload, vocab: SafeVocab, *,
                 clock_factor: float, stream_interval: int = 1, seed: int = 0,
                 request_timeout_s: float = 300.0) -> None:
        self.host, self.port, self.api_key, self.model = host, port, api_key, model
        self.workload, self.vocab, self.clock_factor = workload, vocab, clock_factor
        self.stream_interval, self.seed, self.request_timeout_s = stream_interval, seed, request_timeout_s
        self.records: list[RequestRecord] = []
        self.lateness: list[float] = []  # wall seconds each request was sent after its due time
        self.in_flight = self.max_in_flight = 0
        self.max_concurrent_sessions = 0  # sessions that sent their first turn and have not ended
        self._num_sessions = self._num_started = 0
        self._failure: BaseException | None = None
        self._connections: dict[str | None, list[Connection]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._idle = asyncio.Event()
        self._t0 = 0.0

    async def run(self) -> list[RequestRecord]:
        self._t0 = time.perf_counter()
        for arrival in self.workload.start():
            self._spawn(arrival)
        self._num_sessions = self._active_sessions()
        while self._tasks and self._failure is None:
            self._idle.clear()
            await self._idle.wait()
        for pool in self._connections.values():
            for connection in pool:
                connection.close()
        if self._failure is not None:
            for task in self._tasks:
                task.cancel()
            raise self._failure
        return self.records

    def _active_sessions(self) -> int:
        return getattr(self.workload, "num_active_sessions", 0)

    def _spawn(self, arrival: Arrival) -> None:
        task = asyncio.get_running_loop().create_task(self._request(arrival))
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self._failure = task.exception()  # a driver bug: run() raises it
        if not self._tasks or self._failure is not None:
            self._idle.set()

    def _connection(self, session_id: str | None) -> Connection:
        pool = self._connections.setdefault(session_id, [])
        return pool.pop() if pool else Connection(self.host, self.port, self.api_key)

    async def _request(self, arrival: Arrival) -> None:
        due = self._t0 + arrival.t / self.clock_factor
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        prompt = self.vocab.to_model(arrival.prompt_token_ids)
        body = msgspec.json.encode({
            "model": self.model, "prompt": prompt, "max_tokens": arrival.max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, "seed": self.seed, "temperature": 0,
        })
        connection = self._connection(arrival.session_id)
        if arrival.session_id is not None and arrival.turn == 0:
            self._num_started += 1
            ended = self._num_sessions - self._active_sessions()
            self.max_concurrent_sessions = max(self.max_concurrent_sessions, self._num_started - ended)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        result = await connection.stream(body, self.request_timeout_s)
        self.in_flight -= 1
        self._connections[arrival.session_id].append(connection)
        self.lateness.append(max(0.0, result.sent - due))
        usage = result.usage or {}
        num_output = int(usage.get("completion_tokens", 0))
        error = result.error
        if error is None and num_output != arrival.max_tokens:
            error = f"short: {num_output} of {arrival.max_tokens} tokens ({len(result.event_times)} events)"
        t0 = self._t0
        times = [t - t0 for t in token_times(result.event_times, num_output, self.stream_interval)]
        self.records.append(RequestRecord(
            request_id=arrival.request_id, kind=arrival.kind, session_id=arrival.session_id,
            arrival_t=result.sent - t0, scheduled_t=None,
            first_token_t=times[0] if times else None, finish_t=result.finish - t0 if error is None else None,
            token_times=times, num_prompt_tokens=int(usage.get("prompt_tokens", len(prompt))),
            num_cached_tokens=int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)), error=error))
        output = [] if error else self.vocab.from_model(sim_token_ids(prompt, self.seed, num_output))
        now_sim = (time.perf_counter() - t0) * self.clock_factor
        for follow_up in self.workload.on_complete(arrival, output, now_sim):
            self._spawn(follow_up)


def rescale(records: list[RequestRecord], factor: float) -> list[RequestRecord]:
    """Copies of records with every time multiplied by ``factor`` (wall -> simulated seconds: the clock factor)."""
    def t(x: float | None) -> float | None:
        return None if x is None else x * factor

    return [dataclasses.replace(r, arrival_t=r.arrival_t * factor, scheduled_t=t(r.scheduled_t),
                                first_token_t=t(r.first_token_t), finish_t=t(r.finish_t),
                                token_times=[x * factor for x in r.token_times]) for r in records]


def peak_token_rate(records: list[RequestRecord], window_s: float = 10.0) -> float:
    """The most output tokens per second over any ``window_s`` of the run."""
    times = sorted(t for r in records for t in r.token_times)
    best, lo = 0, 0
    for hi, t in enumerate(times):
        while times[lo] < t - window_s:
            lo += 1
        best = max(best, hi - lo + 1)
    return best / window_s
