"""A response's text as its shapes see it: the thought apart (reasoning.py), the answer through the tool-call parser.

``Output(parser, thinker)``: ``feed(text)`` per detokenized delta and ``finish(finish_reason)`` at the end give
``ThoughtDelta`` / ``ContentDelta`` / ``ToolCallDelta`` pieces in order; every shape (chat, Messages, Responses)
turns the same pieces into its wire form, streamed or whole, so the two always agree. A thought the request
asked not to see (``include_reasoning: false``) is taken out and not sent.
"""

from __future__ import annotations

from services.edge.reasoning import ReasoningParser, ThoughtDelta
from services.edge.tools import ContentDelta, Result, ToolCallParser
from services.edge.tools.parser import Delta

Piece = ThoughtDelta | Delta


class Output:
    def __init__(self, parser: ToolCallParser | None, thinker: ReasoningParser | None = None) -> None:
        self.parser = parser
        self.thinker = thinker

    @property
    def thought(self) -> str | None:
        """The whole thought shown (None: none, or not to be shown)."""
        if self.thinker is None or not self.thinker.include:
            return None
        return self.thinker.thought or None

    @property
    def reasoning_tokens(self) -> int:
        return self.thinker.tokens if self.thinker is not None else 0

    def feed(self, text: str) -> list[Piece]:
        if self.thinker is None:
            return self._answer(text)
        return self._split(self.thinker.feed(text))

    def finish(self, finish_reason: str) -> tuple[list[Piece], Result | None, str]:
        """The last pieces, the tool-call parser's result (None without tools), and the finish reason."""
        pieces = self._split(self.thinker.finish()) if self.thinker is not None else []
        if self.parser is None:
            return pieces, None, finish_reason
        deltas, result = self.parser.finish(finish_reason)
        return pieces + list(deltas), result, result.finish_reason

    def _split(self, parts: list[ThoughtDelta | str]) -> list[Piece]:
        out: list[Piece] = []
        for part in parts:
            if isinstance(part, ThoughtDelta):
                if self.thinker is not None and self.thinker.include:
                    out.append(part)
            else:
                out += self._answer(part)
        return out

    def _answer(self, text: str) -> list[Piece]:
        if self.parser is None:
            return [ContentDelta(text)] if text else []
        return list(self.parser.feed(text))
