"""The reasoning parser (services/edge/reasoning.py) and the engine's thought budget (engines/thinking.py)."""

from __future__ import annotations

import pytest

from services.edge.reasoning import (
    EFFORT_BUDGETS,
    ReasoningParser,
    ThoughtDelta,
    opens_thought,
    thought_budget,
    thought_tokens,
)
from services.edge.shapes.output import Output
from services.edge.tools import ContentDelta
from services.worker.engines.thinking import ThoughtBudget
from shared.schema import Thinking

# (the prompt opened the thought, the output text) -> (thought, answer)
CASES = [
    (True, "let me see</think>\n\nIt is 4.", "let me see", "It is 4."),
    (True, "no end: cut by max_tokens", "no end: cut by max_tokens", ""),
    (True, "</think>answer", "", "answer"),
    (True, "a < b and </thin k> is not it</think>ok", "a < b and </thin k> is not it", "ok"),
    (True, "one</think>two</think>three", "one", "two</think>three"),  # only the first closes it
    (False, "<think>hmm</think>\n\nyes", "hmm", "yes"),
    (False, "\n<think>hmm</think>yes", "hmm", "yes"),
    (False, "plain answer", "", "plain answer"),
    (False, "answer with <think> inside", "", "answer with <think> inside"),
    (False, "<thin", "", "<thin"),  # a partial tag at the end is text of the part it is in
    (True, "thought ends in a partial </thi", "thought ends in a partial </thi", ""),
    (False, "", "", ""),
]


def _run(inside: bool, chunks: list[str]) -> tuple[str, str]:
    parser = ReasoningParser(inside)
    pieces = [p for chunk in chunks for p in parser.feed(chunk)] + parser.finish()
    thought = "".join(p.text for p in pieces if isinstance(p, ThoughtDelta))
    answer = "".join(p for p in pieces if isinstance(p, str))
    assert (thought, answer) == (parser.thought, parser.answer)
    return thought, answer


@pytest.mark.parametrize(("inside", "text", "thought", "answer"), CASES)
def test_thought_and_answer_whole_and_streamed_alike(inside: bool, text: str, thought: str, answer: str) -> None:
    assert _run(inside, [text]) == (thought, answer)
    assert _run(inside, list(text)) == (thought, answer)  # one character a delta: tags split everywhere
    for cut in range(len(text)):
        assert _run(inside, [text[:cut], text[cut:]]) == (thought, answer)


def test_a_possible_tag_is_held_back_until_decided() -> None:
    parser = ReasoningParser(True)
    assert parser.feed("abc</th") == [ThoughtDelta("abc")]
    assert parser.feed("ink>") == []
    assert parser.feed("\n\nhi") == ["hi"]
    before = ReasoningParser(False)
    assert before.feed("  <thi") == []
    assert before.feed("nk>x") == [ThoughtDelta("x")]


@pytest.mark.parametrize(("tail", "opens"), [
    ("<|im_start|>assistant\n<think>\n", True),
    ("<|assistant|><think>", True),
    ("<|assistant|>\n<think></think>", False),  # GLM-4.5 with thinking off
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),  # Qwen3 with thinking off
    ("<|assistant|></think>", False),  # GLM-4.7 with thinking off
    ("<|im_start|>assistant\n", False),  # Qwen3: the model opens it itself
    ("<think>x</think> user: <think> said", False),
])
def test_whether_the_prompt_opened_the_thought(tail: str, opens: bool) -> None:
    assert opens_thought(tail) is opens


@pytest.mark.parametrize(("output", "inside", "start", "count"), [
    ([5, 6, 7, 99, 8], True, (), 4),  # up to and with </think> (99)
    ([5, 6, 7], True, (), 3),  # never closed: all of it
    ([98, 5, 99, 8, 9], False, (98,), 3),  # the model opened it
    ([5, 98, 99, 8], False, (98,), 0),  # no thought at the start: none
    ([5, 6], False, (), 0),
])
def test_thought_tokens(output: list[int], inside: bool, start: tuple[int, ...], count: int) -> None:
    assert thought_tokens(output, (99,), inside, start) == count


def test_thought_tokens_with_a_multi_token_end() -> None:
    assert thought_tokens([1, 2, 60, 61, 3], (60, 61), True) == 4
    assert thought_tokens([1, 60, 2, 60, 61], (60, 61), True) == 5


@pytest.mark.parametrize(("effort", "budget", "enabled", "expected"), [
    (None, None, None, None), ("low", None, None, 1024), ("medium", None, None, 4096), ("high", None, None, 16384),
    ("xhigh", None, None, None), ("max", None, None, None), ("none", None, None, 0), ("minimal", None, None, 0),
    ("high", 50, None, 50), (None, 0, None, 0), ("high", 50, False, 0), (None, None, True, None),
])
def test_thought_budget(effort: str | None, budget: int | None, enabled: bool | None, expected: int | None) -> None:
    assert thought_budget(effort, budget, enabled) == expected
    assert effort is None or effort in EFFORT_BUDGETS


def test_output_sends_the_answer_through_the_tool_parser_and_can_hide_the_thought() -> None:
    shown = Output(None, ReasoningParser(True))
    assert shown.feed("hm</think>ok") == [ThoughtDelta("hm"), ContentDelta("ok")]
    assert shown.thought == "hm"
    hidden = Output(None, ReasoningParser(True, include=False))
    assert hidden.feed("hm</think>ok") == [ContentDelta("ok")]
    assert hidden.thought is None


# ------------------------------------------------------------ the engine's budget
END, START = [99], [98]


def _generate(budget: ThoughtBudget, model: list[int]) -> list[int]:
    """What the engine writes when the model would write ``model`` token by token (forced tokens replace draws)."""
    out: list[int] = []
    draws = iter(model)
    while len(out) < len(model):
        forced = budget.forced()
        token = forced if forced is not None else next(draws)
        budget.accept(token)
        out.append(token)
    return out


@pytest.mark.parametrize(("thinking", "model", "written"), [
    (Thinking(3, END, open=True), [1, 2, 3, 4, 5, 6], [1, 2, 3, 99, 4, 5]),
    (Thinking(0, END, open=True), [1, 2, 3], [99, 1, 2]),
    (Thinking(5, END, open=True), [1, 99, 2, 3, 4, 5, 6, 7], [1, 99, 2, 3, 4, 5, 6, 7]),  # closed in time
    (Thinking(2, END, START), [98, 1, 2, 3, 4], [98, 1, 2, 99, 3]),  # the model opened it
    (Thinking(2, END, START), [1, 2, 3, 4, 5], [1, 2, 3, 4, 5]),  # no thought: nothing to close
    (Thinking(1, END, open=True), [1, 2, 99, 3, 4, 5], [1, 99, 2, 99, 3, 4]),  # only the first thought
    (Thinking(2, [60, 61], open=True), [1, 2, 3, 4, 5], [1, 2, 60, 61, 3]),
    (Thinking(2, [60, 61], open=True), [1, 60, 7, 8, 9], [1, 60, 61, 7, 8]),  # finishes a begun end tag
])
def test_the_budget_closes_the_thought(thinking: Thinking, model: list[int], written: list[int]) -> None:
    assert _generate(ThoughtBudget(thinking), model) == written


def test_a_closed_budget_counts_what_it_forced() -> None:
    budget = ThoughtBudget(Thinking(1, [60, 61], open=True))
    _generate(budget, [1, 2, 3, 4])
    assert (budget.phase, budget.num_forced, budget.spent) == ("after", 2, 1)


def test_a_tag_the_tokenizer_marks_special_stays_in_the_text(tiny_model, tmp_path) -> None:
    """Detokenizing skips special tokens, but not the tags the parsers read (GLM's tool tags are special; a
    thought's may be): else the thought would never end."""
    from transformers import AutoTokenizer

    from services.edge.tokenizer import ModelTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_model)
    hf.add_special_tokens({"additional_special_tokens": ["<think>", "</think>", "<|assistant|>"]})
    hf.save_pretrained(tmp_path)
    tokenizer = ModelTokenizer(str(tmp_path))
    ids = tokenizer.encode("<|assistant|>ab</think>cd", add_special_tokens=False)
    assert tokenizer.decode(ids) == "ab</think>cd"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|assistant|>ab</think>cd"
    parser = ReasoningParser(True)
    assert parser.feed(tokenizer.decode(ids)) + parser.finish() == [ThoughtDelta("ab"), "cd"]
