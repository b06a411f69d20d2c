"""Reasoning models on the edge: the thought (``<think>...</think>``) apart from the answer. Pure, no I/O.

GLM-4.5+/5, Qwen3 and DeepSeek-R1 write a thought before they answer. The parser is chosen per model like the
tool-call format (``--reasoning-parser``, ``--reasoning-parsers model=qwen3``; config.py). All three formats use
``<think>`` / ``</think>``; what differs between their templates is whether the generation prompt already opens
the thought (DeepSeek-R1, Qwen3-Thinking-2507, GLM with thinking on: the output starts inside it) or the model
opens it itself (Qwen3). vLLM's parsers guess that from the format; here the rendered prompt says it
(``opens_thought``), so one parser serves all three.

``ReasoningParser(inside)``: ``feed(text) -> list[ThoughtDelta | str]`` per detokenized delta (a ``str`` is
answer text), ``finish()`` at the end. Text that may still become a tag is held back until it is decided, so
the deltas of a stream concatenate to exactly what a whole response gets. Rules (vLLM's conventions):
- the thought opens only at the start of the output (after whitespace); a later ``<think>`` is answer text;
- the first ``</think>`` ends it; the answer is what follows, its leading newlines dropped (templates write
  ``</think>\\n\\n``);
- an output that ends inside the thought (cut by max_tokens) is all thought and no answer.

``thought_tokens(output_ids, end_ids, inside, start_ids)``: how many of the output tokens the thought took (the
tags included), for ``reasoning_tokens`` in usage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence, get_args

ReasoningFormat = Literal["deepseek_r1", "qwen3", "glm45"]
REASONING_FORMATS: tuple[str, ...] = get_args(ReasoningFormat)
THINK_START, THINK_END = "<think>", "</think>"
TAGS: dict[str, tuple[str, str]] = {fmt: (THINK_START, THINK_END) for fmt in REASONING_FORMATS}


@dataclass(frozen=True, slots=True)
class ThoughtDelta:
    text: str


Piece = ThoughtDelta | str  # a piece of the thought, or of the answer


def opens_thought(prompt_tail: str, start: str = THINK_START, end: str = THINK_END) -> bool:
    """Whether a prompt ending in ``prompt_tail`` leaves the model inside a thought: its generation prompt
    wrote ``<think>`` (and no ``</think>`` after it: ``<think></think>`` is thinking turned off)."""
    at = prompt_tail.rfind(start)
    return at >= 0 and end not in prompt_tail[at:] and not prompt_tail[at + len(start):].strip()


# reasoning_effort (chat), reasoning.effort (Responses), output_config.effort (Anthropic) -> the thought budget in
# tokens: None leaves the thought unbounded (max_tokens still bounds it); 0 turns thinking off
EFFORT_BUDGETS: dict[str, int | None] = {"none": 0, "minimal": 0, "low": 1024, "medium": 4096, "high": 16384,
                                         "xhigh": None, "max": None}


def thought_budget(effort: str | None, budget_tokens: int | None, enable_thinking: bool | None) -> int | None:
    """A request's thought budget: thinking turned off is 0; an explicit budget wins over an effort."""
    if enable_thinking is False:
        return 0
    if budget_tokens is not None:
        return budget_tokens
    return EFFORT_BUDGETS.get(effort) if effort is not None else None


@dataclass(frozen=True, slots=True)
class ReasoningSetup:
    """What a request's response needs to separate its thought (made by preparation, picklable)."""

    format: str
    inside: bool  # the prompt opened the thought
    start_ids: tuple[int, ...]  # the tokens of <think>, </think> (reasoning_tokens counts through them)
    end_ids: tuple[int, ...]
    include: bool = True  # the response shows the thought (vLLM's include_reasoning)

    def parser(self) -> ReasoningParser:
        start, end = TAGS[self.format]
        return ReasoningParser(self.inside, start, end, self.include)

    def count(self, output_ids: Sequence[int]) -> int:
        return thought_tokens(output_ids, self.end_ids, self.inside, self.start_ids)


class ReasoningParser:
    """Splits a model's output text into thought and answer, incrementally (module docstring). ``include``
    False: the thought is taken out of the answer but not shown. ``tokens``: the thought's token count, set
    once the output is complete (``ReasoningSetup.count``)."""

    def __init__(self, inside: bool, start: str = THINK_START, end: str = THINK_END, include: bool = True) -> None:
        self.start, self.end = start, end
        self.include = include
        self.tokens = 0
        # before: the output may still open a thought; thought: inside it; answer: past it (or never one)
        self.state: Literal["before", "thought", "answer"] = "thought" if inside else "before"
        self._held = ""
        self._strip_newlines = False  # the answer's leading newlines (after </think>) are not the answer
        self.thought = ""
        self.answer = ""

    def feed(self, text: str) -> list[Piece]:
        self._held += text
        out: list[Piece] = []
        while self._held:
            if not self._step(out):
                break
        return out

    def finish(self) -> list[Piece]:
        """What is still held: a partial tag is text of the part it is in."""
        held, self._held = self._held, ""
        if not held:
            return []
        if self.state == "thought":
            return self._emit([], ThoughtDelta(held))
        if self.state == "before":
            self.state = "answer"
        return self._answer([], held)

    def _step(self, out: list[Piece]) -> bool:
        """Consume what can be decided of the held text; False when the rest must wait for more."""
        held = self._held
        if self.state == "before":
            body = held.lstrip()
            if self.start.startswith(body):  # whitespace, or a part of <think>: undecided yet
                return False
            if body.startswith(self.start):
                self.state, self._held = "thought", body[len(self.start):]
                return True
            self.state = "answer"
            return True
        if self.state == "thought":
            at = held.find(self.end)
            if at >= 0:
                self._emit(out, ThoughtDelta(held[:at]))
                self.state, self._held, self._strip_newlines = "answer", held[at + len(self.end):], True
                return True
            keep = _partial_suffix(held, self.end)
            self._emit(out, ThoughtDelta(held[:len(held) - keep]))
            self._held = held[len(held) - keep:]
            return False
        self._held = ""
        self._answer(out, held)
        return False

    def _answer(self, out: list[Piece], text: str) -> list[Piece]:
        if self._strip_newlines:
            text = text.lstrip("\n")
            if not text:
                return out
            self._strip_newlines = False
        return self._emit(out, text)

    def _emit(self, out: list[Piece], piece: Piece) -> list[Piece]:
        if isinstance(piece, ThoughtDelta):
            if piece.text:
                self.thought += piece.text
                out.append(piece)
        elif piece:
            self.answer += piece
            out.append(piece)
        return out


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (held back: it may become the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def thought_tokens(output_ids: Sequence[int], end_ids: Sequence[int], inside: bool,
                   start_ids: Sequence[int] = ()) -> int:
    """How many output tokens the thought took, its tags included: up to the end of the first ``end_ids``; all
    of them when it never closed. 0 when the output opened none (``inside`` False and no leading ``start_ids``)."""
    if not end_ids:
        return 0
    if not inside and (not start_ids or list(output_ids[:len(start_ids)]) != list(start_ids)):
        return 0
    n = len(end_ids)
    for i in range(len(output_ids) - n + 1):
        if output_ids[i] == end_ids[0] and list(output_ids[i:i + n]) == list(end_ids):
            return i + n
    return len(output_ids)
