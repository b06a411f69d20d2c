"""Request workloads for the fleet simulator and the live load driver: what is sent, when, with which tokens.

A workload is a source of Arrivals. Open-loop arrivals (a trace, cold requests) are known up
front; closed-loop ones (the next turn of an agent session) come back from on_complete once the
previous request has finished. Token ids are synthetic but deterministic for a seed and shaped so
that prefix caching behaves as in the real workload: an agent turn extends its session's history
(after a system prompt that every session shares), and trace requests share token blocks exactly
where the trace's hash ids are equal.

Prompts are plain lists and large (an agent history reaches 140K tokens, ~40 bytes a token as
Python ints); the prompt lists handed out in Arrivals are shared with the workload: treat them as
read-only.
"""

from __future__ import annotations

import itertools
import json
import math
import operator
import random
import sys
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


@dataclass(slots=True)
class Arrival:
    """One request to send at time t (seconds from the start of the run)."""

    t: float
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    session_id: str | None = None  # the agent session; None for cold and trace requests
    kind: str = "turn"  # "turn" | "cold" | "trace"
    turn: int = 0


class Workload(Protocol):
    """A source of arrivals, driven by a simulator or a live load driver."""

    def start(self) -> list[Arrival]:
        """The arrivals known at t=0 (for an open-loop workload, all of them)."""

    def on_complete(self, arrival: Arrival, output_token_ids: list[int], t: float) -> list[Arrival]:
        """`arrival` finished (or failed: the output may be empty) at time t; returns its follow-up arrivals."""

    @property
    def done(self) -> bool:
        """No more arrivals will ever come."""


def random_tokens(rng: random.Random, count: int, vocab_size: int) -> list[int]:
    """`count` token ids drawn from [0, vocab_size) with `rng` (32 random bits each, reduced mod vocab_size)."""
    if count <= 0:
        return []
    words = array("I", rng.randbytes(4 * count))  # ~5x faster than rng.choices for 100K-token prompts
    if sys.byteorder == "big":
        words.byteswap()  # the same tokens on every machine
    return list(map(operator.mod, words, itertools.repeat(vocab_size)))


@dataclass(slots=True)
class _Session:
    """One agent session's state: its own random stream and the last prompt it sent."""

    session_id: str
    rng: random.Random
    prompt: list[int]
    turn: int = 0
    done: bool = False


class AgentSessions:
    """N concurrent multi-turn agent sessions (closed loop), plus optional cold long prompts (open loop).

    Turn 0 of a session is the shared system prompt plus ~tokens_per_turn new tokens; each later
    turn is the previous prompt + the model's answer to it (as passed to on_complete) + ~tokens_per_turn
    new tokens (tool results, user input), sent a think time after the answer. A session ends when its
    next prompt would exceed full_history tokens, or after `turns` turns if given. `scale` multiplies
    every token count (system prompt, per-turn input, output, history cap, cold prompt), so the shape
    (turn count, cached fraction) is the same at any scale. The defaults give ~21 turns per session.

    Steady state (``steady_until_s``): the initial sessions join part-way through their history (a
    random share of it, uncached at first), and a session that ends before steady_until_s is replaced
    by a new one, so num_sessions stay active; measure after a warm-up of a few turns.

    Cold requests are fresh random prompts of cold_prompt_tokens arriving as a Poisson process at
    cold_rate_per_s: until cold_until_s if given (all emitted by start), else until every session is
    done. In the second case they are emitted on the fly, up to cold_lookahead_s ahead of the latest
    event, so one that falls in a longer gap between events is sent late, at the next event.
    """

    def __init__(self, num_sessions: int, *, turns: int | None = None, tokens_per_turn: int = 6000,
                 full_history: int = 140_000, scale: float = 1.0, think_time_s: float = 10.0,
                 output_tokens: int = 300, system_prompt_tokens: int = 3000, cold_rate_per_s: float = 0.0,
                 cold_prompt_tokens: int = 30_000, cold_until_s: float | None = None,
                 cold_lookahead_s: float = 30.0, vocab_size: int = 150_000, seed: int = 0,
                 stagger_s: float = 10.0, steady_until_s: float | None = None) -> None:
        assert num_sessions >= 0 and scale > 0 and vocab_size > 0
        assert turns is None or turns >= 1
        self.num_sessions, self.turns, self.seed, self.vocab_size = num_sessions, turns, seed, vocab_size
        self.num_tokens_per_turn = self._scaled(tokens_per_turn, scale)
        self.num_history_tokens = self._scaled(full_history, scale)
        self.num_output_tokens = self._scaled(output_tokens, scale)
        self.num_system_tokens = self._scaled(system_prompt_tokens, scale)
        self.num_cold_tokens = self._scaled(cold_prompt_tokens, scale)
        self.think_time_s, self.stagger_s = think_time_s, stagger_s
        self.steady_until_s = steady_until_s
        self._num_started = 0
        self._system: list[int] = []
        self.cold_rate_per_s, self.cold_until_s, self.cold_lookahead_s = cold_rate_per_s, cold_until_s, cold_lookahead_s
        self._sessions: dict[str, _Session] = {}
        self._num_active = 0
        self._started = False
        self._cold_rng = random.Random(f"{seed}:cold-times")
        self._num_cold = 0
        self._next_cold_t = self._cold_gap()

    @staticmethod
    def _scaled(num_tokens: int, scale: float) -> int:
        return max(1, round(num_tokens * scale))

    @property
    def done(self) -> bool:
        return self._started and self._num_active == 0

    @property
    def num_active_sessions(self) -> int:
        return self._num_active

    def start(self) -> list[Arrival]:
        assert not self._started, "start() is called once"
        self._started = True
        self._system = random_tokens(random.Random(f"{self.seed}:system"), self.num_system_tokens, self.vocab_size)
        arrivals = []
        for _ in range(self.num_sessions):
            arrivals.append(self._new_session(None))
        self._num_active = self.num_sessions
        if self.cold_until_s is not None:
            arrivals += self._emit_cold(self.cold_until_s, 0.0)
        elif self._num_active:
            arrivals += self._emit_cold(self.cold_lookahead_s, 0.0)
        return sorted(arrivals, key=lambda a: a.t)

    def _new_session(self, t: float | None) -> Arrival:
        """Session number n: at t=None one of the initial ones (staggered start and, with steady_until_s,
        already some turns into its history, so the run starts near steady state); else a replacement
        starting its first turn a think time after t."""
        i = self._num_started
        self._num_started += 1
        rng = random.Random(f"{self.seed}:session:{i}")
        prompt = self._system + random_tokens(rng, self._num_new_tokens(rng), self.vocab_size)
        if t is None:
            start = rng.uniform(0.0, self.stagger_s) if self.stagger_s > 0 else 0.0
            if self.steady_until_s is not None:  # join mid-session: history grown by a random number of turns
                room = max(0, self.num_history_tokens - len(prompt))
                grown = int(rng.uniform(0, 0.9) * room)
                prompt += random_tokens(rng, grown, self.vocab_size)
        else:
            start = t + (rng.expovariate(1.0 / self.think_time_s) if self.think_time_s > 0 else 0.0)
        session = _Session(f"s{i}", rng, prompt)
        self._sessions[session.session_id] = session
        return Arrival(start, f"s{i}-t0", prompt, self._max_tokens(rng), session.session_id, "turn", 0)

    def on_complete(self, arrival: Arrival, output_token_ids: list[int], t: float) -> list[Arrival]:
        arrivals = []
        session = self._sessions.get(arrival.session_id) if arrival.kind == "turn" else None
        if session is not None and not session.done and arrival.turn == session.turn:
            follow_up = self._next_turn(session, output_token_ids, t)
            if follow_up is None:
                session.done = True
                del self._sessions[session.session_id]  # its history is no longer needed
                if self.steady_until_s is not None and t < self.steady_until_s:
                    arrivals.append(self._new_session(t))  # keep num_sessions going
                else:
                    self._num_active -= 1
            else:
                arrivals.append(follow_up)
        if self.cold_until_s is None and self._num_active:
            arrivals += self._emit_cold(t + self.cold_lookahead_s, t)
        return arrivals

    def _next_turn(self, session: _Session, output_token_ids: list[int], t: float) -> Arrival | None:
        """The session's next turn after its answer came back at t, or None when the session is over."""
        rng = session.rng  # always the same draws, in the same order, whatever the answer was
        think_s = rng.expovariate(1.0 / self.think_time_s) if self.think_time_s > 0 else 0.0
        num_new = self._num_new_tokens(rng)
        new_tokens = random_tokens(rng, num_new, self.vocab_size)
        max_tokens = self._max_tokens(rng)
        if self.turns is not None and session.turn + 1 >= self.turns:
            return None
        if len(session.prompt) + len(output_token_ids) + num_new > self.num_history_tokens:
            return None
        prompt = list(session.prompt)
        prompt += output_token_ids
        prompt += new_tokens
        session.prompt, session.turn = prompt, session.turn + 1
        return Arrival(t + think_s, f"{session.session_id}-t{session.turn}", prompt, max_tokens,
                       session.session_id, "turn", session.turn)

    def _num_new_tokens(self, rng: random.Random) -> int:
        return max(1, round(self.num_tokens_per_turn * rng.uniform(0.75, 1.25)))

    def _max_tokens(self, rng: random.Random) -> int:
        """An output length around the mean: lognormal (sigma 0.5), capped at 4x the mean."""
        sigma = 0.5
        draw = rng.lognormvariate(math.log(self.num_output_tokens) - sigma * sigma / 2, sigma)
        return max(1, min(4 * self.num_output_tokens, round(draw)))

    def _cold_gap(self) -> float:
        return self._cold_rng.expovariate(self.cold_rate_per_s) if self.cold_rate_per_s > 0 else math.inf

    def _emit_cold(self, until: float, now: float) -> list[Arrival]:
        """Cold arrivals due up to `until` (and before cold_until_s), none earlier than `now`."""
        if self.cold_until_s is not None:
            until = min(until, self.cold_until_s)
        arrivals = []
        while self._next_cold_t <= until:
            i = self._num_cold
            rng = random.Random(f"{self.seed}:cold:{i}")
            prompt = random_tokens(rng, self.num_cold_tokens, self.vocab_size)
            arrivals.append(Arrival(max(self._next_cold_t, now), f"cold-{i}", prompt, self._max_tokens(rng),
                                    None, "cold", 0))
            self._num_cold += 1
            self._next_cold_t += self._cold_gap()
        return arrivals


@dataclass(slots=True, frozen=True)
class TraceRow:
    """One line of a Mooncake trace: arrival in ms, token counts, and one hash id per block of input."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


class MooncakeTrace:
    """Open-loop replay of a Mooncake-format JSONL trace (timestamp ms, input/output length, hash_ids).

    Each hash id stands for one block of block_tokens input tokens; equal hash ids become equal
    token blocks, different ones different (random) blocks, so that any smaller block size also sees
    exactly the trace's sharing. A prompt is input_length tokens: its blocks in order, the last one
    partial; where the hash ids cover fewer tokens than input_length, the rest is tokens unique to
    the request. Arrivals are at (timestamp - first timestamp) / 1000 * time_scale.
    """

    def __init__(self, path: str | Path, *, block_tokens: int = 512, time_scale: float = 1.0,
                 limit: int | None = None, vocab_size: int = 150_000,
                 output_tokens_override: int | None = None) -> None:
        assert block_tokens > 0 and time_scale >= 0 and vocab_size > 0
        self.path, self.block_tokens, self.time_scale = Path(path), block_tokens, time_scale
        self.vocab_size, self.output_tokens_override = vocab_size, output_tokens_override
        self.rows = self.read(self.path, limit)
        self._started = False

    @staticmethod
    def read(path: Path, limit: int | None = None) -> list[TraceRow]:
        rows = []
        with open(path) as f:
            for line in f:
                if limit is not None and len(rows) >= limit:
                    break
                if not line.strip():
                    continue
                d = json.loads(line)
                rows.append(TraceRow(float(d["timestamp"]), int(d["input_length"]), int(d["output_length"]),
                                     tuple(int(h) for h in d.get("hash_ids", ()))))
        return rows

    @property
    def done(self) -> bool:
        return self._started

    def start(self) -> list[Arrival]:
        assert not self._started, "start() is called once"
        self._started = True
        t0 = min((row.timestamp_ms for row in self.rows), default=0.0)
        hash_to_block: dict[int, list[int]] = {}  # only while building: the prompts hold the tokens after
        arrivals = []
        for i, row in enumerate(self.rows):
            max_tokens = self.output_tokens_override or row.output_length
            arrivals.append(Arrival((row.timestamp_ms - t0) / 1000.0 * self.time_scale, f"trace-{i}",
                                    self.prompt_token_ids(i, row, hash_to_block), max(1, max_tokens),
                                    None, "trace", 0))
        arrivals.sort(key=lambda a: a.t)
        return arrivals

    def on_complete(self, arrival: Arrival, output_token_ids: list[int], t: float) -> list[Arrival]:
        return []

    def prompt_token_ids(self, index: int, row: TraceRow, hash_to_block: dict[int, list[int]] | None = None
                         ) -> list[int]:
        """The prompt of trace line `index`: max(1, input_length) tokens built from its hash ids."""
        num_tokens = max(1, row.input_length)
        cache = {} if hash_to_block is None else hash_to_block
        prompt: list[int] = []
        for h in row.hash_ids:
            if len(prompt) >= num_tokens:
                break
            block = cache.get(h)
            if block is None:
                block = cache[h] = self.block_token_ids(h)
            prompt += block
        if len(prompt) > num_tokens:
            del prompt[num_tokens:]
        elif len(prompt) < num_tokens:
            rng = random.Random(f"mooncake-unique:{index}")
            prompt += random_tokens(rng, num_tokens - len(prompt), self.vocab_size)
        return prompt

    def block_token_ids(self, hash_id: int) -> list[int]:
        """The block_tokens token ids that hash id `hash_id` stands for."""
        return random_tokens(random.Random(f"mooncake-block:{hash_id}"), self.block_tokens, self.vocab_size)

    def stats(self) -> dict:
        """Request count, duration (s, after time_scale), mean input/output tokens, and the ideal block
        hit rate: the fraction of blocks whose hash id appeared earlier in the trace (an infinite cache)."""
        seen: set[int] = set()
        num_blocks = num_repeated = 0
        for row in self.rows:
            for h in row.hash_ids:
                num_blocks += 1
                if h in seen:
                    num_repeated += 1
                else:
                    seen.add(h)
        n = len(self.rows)
        stamps = [row.timestamp_ms for row in self.rows]
        return {
            "count": n,
            "duration_s": (max(stamps) - min(stamps)) / 1000.0 * self.time_scale if stamps else 0.0,
            "mean_input_tokens": sum(r.input_length for r in self.rows) / n if n else math.nan,
            "mean_output_tokens": sum(r.output_length for r in self.rows) / n if n else math.nan,
            "num_blocks": num_blocks,
            "num_unique_blocks": len(seen),
            "ideal_block_hit_rate": num_repeated / num_blocks if num_blocks else math.nan,
        }
