"""services/edge/text.py: incremental detokenization and stop strings."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from services.edge.text import IncrementalDetokenizer, StopStringMatcher

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "héllo wörld ✓ 日本 😀",
    "😀😀 ✓✓ 日本語のテキスト",
    "mixed: café, naïve, Ελληνικά, emoji 🎉 end",
]


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    from infermesh.models import make_tiny_llama

    path = make_tiny_llama(tmp_path_factory.mktemp("text-tok") / "tiny-llama")
    return AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("chunk", [1, 2, 3])
@pytest.mark.parametrize("text", TEXTS)
def test_detokenizer_stream_equals_full_decode(tokenizer, text, chunk):
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(detok.flush())
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert all("\ufffd" not in d for d in deltas)  # never a split character
    assert detok.token_ids == ids


def test_detokenizer_holds_incomplete_character_until_completed(tokenizer):
    ids = tokenizer.encode("😀", add_special_tokens=False)
    assert len(ids) > 1  # the byte-level tokenizer splits the 4-byte emoji
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.push([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.push(ids[-1:]) == "😀"
    assert detok.flush() == ""


def test_detokenizer_flush_returns_held_incomplete_text(tokenizer):
    ids = tokenizer.encode("ab😀", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    emitted = "".join(detok.push([i]) for i in ids[:-1])
    assert emitted == "ab"
    assert detok.flush().endswith("\ufffd")


@pytest.mark.parametrize(
    "stop, feeds, expected_text, expected_stopped",
    [
        ([], ["hello ", "world"], "hello world", False),
        (["END"], ["no stop ", "here at all"], "no stop here at all", False),
        (["END"], ["before END after"], "before ", True),
        (["\n\n", "STOP", "x"], ["aaa STOP bb x cc\n\n"], "aaa ", True),  # earliest wins
        (["x", "STOP"], ["aaa STOP bb x"], "aaa ", True),  # earliest wins, whatever the list order
        (["STOP"], ["abc ST", "O", "P tail"], "abc ", True),  # split across feeds
        (["STOP"], ["S", "T", "O", "P"], "", True),
        (["STOP"], ["STOP and more"], "", True),  # at the very start
        (["STOP"], ["abc ST"], "abc ST", False),  # held back, then flushed
        (["STOP"], ["abc STO", "Xyz"], "abc STOXyz", False),
        (["", "ab"], ["xxab"], "xx", True),  # empty stop strings are ignored
        ([""], ["text"], "text", False),
    ],
)
def test_stop_matcher(stop, feeds, expected_text, expected_stopped):
    matcher = StopStringMatcher(stop)
    out, stopped = [], False
    for text in feeds:
        emitted, stopped = matcher.feed(text)
        out.append(emitted)
    out.append(matcher.flush())
    assert "".join(out) == expected_text
    assert stopped is expected_stopped and matcher.stopped is expected_stopped


@pytest.mark.parametrize(
    "stop, feeds, emitted_now",
    [
        (["STOP"], ["abcdef"], ["abc"]),  # the last len(stop)-1 chars could start a stop string
        (["STOP"], ["abcdef", "gh"], ["abc", "de"]),
        (["x"], ["abc", "def"], ["abc", "def"]),  # a one-char stop holds nothing back
        (["STOP", "ab"], ["12345"], ["12"]),  # hold back for the longest stop string
    ],
)
def test_stop_matcher_holds_back_longest_stop_minus_one_chars(stop, feeds, emitted_now):
    matcher = StopStringMatcher(stop)
    assert [matcher.feed(t)[0] for t in feeds] == emitted_now


def test_stop_matcher_drops_text_after_hit():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("keep STOP drop") == ("keep ", True)
    assert matcher.feed("more text") == ("", True)
    assert matcher.flush() == ""
