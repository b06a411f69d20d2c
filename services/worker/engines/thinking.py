"""A reasoning model's thought budget, enforced by the engine (pure; the sim and the vLLM processor drive it).

``ThoughtBudget(Thinking)`` follows a request's output tokens (``accept``) and names the token it must write next
(``forced``): once the thought took ``budget`` tokens, the end-of-thought tokens in order; the model then goes on
with its answer. A thought starts at the first output token when the prompt opened it (``open``), else when the
output starts with ``start_token_ids``; only that first thought is budgeted (an answer may mention the tags).
The model closing its thought itself (``end_token_ids`` in the output) ends the budget's part too.
"""

from __future__ import annotations

from typing import Literal

from shared.schema import Thinking

Phase = Literal["before", "thought", "closing", "after"]


class ThoughtBudget:
    def __init__(self, thinking: Thinking) -> None:
        self.budget = thinking.budget
        self.start = list(thinking.start_token_ids)
        self.end = list(thinking.end_token_ids)
        assert self.end, "a thought budget needs the end-of-thought tokens"
        self.phase: Phase = "before"
        self.spent = 0  # thought tokens so far (the opening tag not counted)
        self.num_forced = 0  # tokens this budget wrote
        self._output: list[int] = []
        self._pending: list[int] = []  # the end tokens still to write
        if thinking.open:
            self._enter()
        elif not self.start:
            self.phase = "after"

    def forced(self) -> int | None:
        """The token the engine must write next, or None (the model samples freely)."""
        return self._pending[0] if self._pending else None

    def accept(self, token: int) -> None:
        self._output.append(token)
        if self.phase == "closing":
            if self._pending and token == self._pending[0]:
                self._pending.pop(0)
                self.num_forced += 1
            if not self._pending:
                self.phase = "after"
            return
        if self.phase == "before":
            if self._output == self.start[:len(self._output)]:
                if len(self._output) == len(self.start):
                    self._enter()
            else:
                self.phase = "after"
            return
        if self.phase == "thought":
            if self._output[-len(self.end):] == self.end:
                self.phase = "after"  # the model closed it itself
                return
            self.spent += 1
            if self.spent >= self.budget:
                self._close()

    def _enter(self) -> None:
        self.phase = "thought"
        if self.budget <= 0:
            self._close()

    def _close(self) -> None:
        """Write the end tags, less what of them the model already wrote (a partial tag it had begun)."""
        self.phase = "closing"
        for n in range(len(self.end) - 1, 0, -1):
            if self._output[-n:] == self.end[:n]:
                self._pending = self.end[n:]
                return
        self._pending = list(self.end)
