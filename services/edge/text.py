"""Pure text handling on the edge: incremental detokenization and stop strings.

Both are used identically for streamed and non-streamed responses, which is why
the concatenated stream always equals the non-streamed text.
"""

from __future__ import annotations

from typing import Protocol, Sequence


class Decoder(Protocol):
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without splitting UTF-8 characters.

    It re-decodes a short window (from ``prefix_offset``) and emits only what is new
    past ``read_offset``; a trailing U+FFFD means a multi-byte character is still
    incomplete, so the text is held until the next token completes it.
    """

    def __init__(self, tokenizer: Decoder, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self.token_ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def push(self, token_ids: Sequence[int]) -> str:
        self.token_ids.extend(token_ids)
        ids = self.token_ids
        prefix_text = self._tok.decode(ids[self._prefix_offset:self._read_offset], skip_special_tokens=self._skip)
        new_text = self._tok.decode(ids[self._prefix_offset:], skip_special_tokens=self._skip)
        if new_text.endswith("\ufffd") or len(new_text) <= len(prefix_text):
            return ""
        delta = new_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
        return delta

    def flush(self) -> str:
        """Text still held at the end of generation (an incomplete character stays as U+FFFD)."""
        ids = self.token_ids
        prefix_text = self._tok.decode(ids[self._prefix_offset:self._read_offset], skip_special_tokens=self._skip)
        new_text = self._tok.decode(ids[self._prefix_offset:], skip_special_tokens=self._skip)
        self._prefix_offset = self._read_offset = len(ids)
        return new_text[len(prefix_text):] if len(new_text) > len(prefix_text) else ""


class StopStringMatcher:
    """Finds the first stop string in generated text, holding back text that may start one.

    ``feed`` returns the text safe to emit now and whether a stop string was hit;
    on a hit the returned text ends just before the stop string (OpenAI excludes it).
    """

    def __init__(self, stop: Sequence[str]) -> None:
        self._stop = [s for s in stop if s]
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self._pending = ""
        self.stopped = False
        self.matched = ""  # the stop string that was hit (Anthropic's stop_sequence)

    def feed(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self._stop:
            return text, False
        buffer = self._pending + text
        hits = [(i, s) for i, s in ((buffer.find(s), s) for s in self._stop) if i >= 0]
        if hits:
            at, self.matched = min(hits, key=lambda hit: hit[0])
            self.stopped = True
            self._pending = ""
            return buffer[:at], True
        cut = max(0, len(buffer) - self._holdback)
        self._pending = buffer[cut:]
        return buffer[:cut], False

    def flush(self) -> str:
        pending, self._pending = self._pending, ""
        return "" if self.stopped else pending
