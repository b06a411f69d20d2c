"""services/batch/lines.py InputScanner: the input rules over a file fed a chunk at a time give what parse_input
gives over the whole file, wherever the chunks are cut, and each valid line's place in the file."""

from __future__ import annotations

import msgspec
import pytest

from services.batch.dispatch import PrefixTrie, prefix_order
from services.batch.lines import InputScanner, parse_input, sendable_line

URL = "/v1/chat/completions"


def line(custom_id: str, model: str = "m", **body) -> bytes:
    return msgspec.json.encode({"custom_id": custom_id, "method": "POST", "url": URL,
                                "body": {"model": model, **body}})


def scanned(data: bytes, size: int):
    scanner = InputScanner(URL, max_errors=5)
    lines = []
    for start in range(0, len(data), size):
        lines += scanner.feed(data[start:start + size])
    return scanner, lines + scanner.finish()


FILES = {
    "valid": b"\n".join([line("a"), line("b", messages=[{"role": "user", "content": "hi \u00e9"}]), line("c")]),
    "final newline and blank lines at the end": line("a") + b"\n" + line("b") + b"\r\n\n \n\n",
    "a blank line inside": line("a") + b"\n\n" + line("b") + b"\n",
    "errors": b"\n".join([line("a"), b"not json", line("a"), line("b", model="other"), b"[1]", line("c")]),
    "more errors than kept": b"\n".join([b"x"] * 9 + [line("a")]),
    "empty": b"\n \n",
}


@pytest.mark.parametrize("size", [1, 7, 64, 1 << 20])
@pytest.mark.parametrize("name", FILES)
def test_chunked_scanning_is_parse_input(name, size):
    data = FILES[name]
    scanner, lines = scanned(data, size)
    expected = parse_input(data, URL, max_errors=5)
    assert (scanner.errors() or [s.line for s in lines]) == expected
    for found, start, end in lines:  # each valid line is where the scanner says, and reads back as sent
        again = sendable_line(found.index, data[start:end])
        assert again.custom_id == found.custom_id and msgspec.json.decode(again.body_json) == found.body


def test_lines_past_the_limit_are_counted_not_kept(monkeypatch):
    from services.batch import lines as lines_module

    monkeypatch.setattr(lines_module, "MAX_BATCH_LINES", 2)
    scanner, lines = scanned(b"\n".join(line(f"l{i}") for i in range(4)), 10)
    assert len(lines) == 2
    (error,) = scanner.errors()
    assert error.code == "too_many_lines" and "4 lines" in error.message and error.line == 3


def test_the_trie_a_text_at_a_time_is_prefix_order():
    texts = ["ab" * 100, "zz", "ab" * 100 + "x", "zz", "ab" * 40]
    trie = PrefixTrie(block=8, depth=4)
    paths = [trie.path(text) for text in texts]
    assert sorted(range(len(texts)), key=paths.__getitem__) == prefix_order(texts, 8, 4)
    assert paths[1] is paths[3]  # an equal path is kept once
