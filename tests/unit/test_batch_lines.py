"""services/batch/lines.py: the input file's validation, and the output and error file lines."""

from __future__ import annotations

import json

import msgspec
import pytest

from services.batch import lines as lines_mod
from services.batch.lines import BatchLine, error_line, output_line, parse_input
from shared.batch_schema import MAX_CUSTOM_ID, BatchLineError

CHAT = "/v1/chat/completions"


def line(custom_id="r1", *, method="POST", url=CHAT, model="m", drop=(), **body) -> bytes:
    obj = {"custom_id": custom_id, "method": method, "url": url,
           "body": {"model": model, "messages": [{"role": "user", "content": "hi"}], **body}}
    for key in drop:
        if key.startswith("body."):
            del obj["body"][key[5:]]
        else:
            del obj[key]
    return json.dumps(obj).encode()


def errors_of(data: bytes, endpoint: str = CHAT) -> list[tuple[str, int | None, str | None]]:
    parsed = parse_input(data, endpoint)
    assert parsed, "never an empty list"
    if isinstance(parsed[0], BatchLine):
        return []
    assert all(isinstance(e, BatchLineError) for e in parsed)
    return [(e.code, e.line, e.param) for e in parsed]


def test_a_valid_file_gives_its_lines_in_order_with_the_bodies_re_encoded():
    data = line("a") + b"\n" + line("b", temperature=0.5) + b"\r\n" + line("c") + b"\n\n  \n"
    parsed = parse_input(data, CHAT)
    assert [(x.index, x.custom_id, x.model) for x in parsed] == [(0, "a", "m"), (1, "b", "m"), (2, "c", "m")]
    assert parsed[1].body["temperature"] == 0.5
    assert msgspec.json.decode(parsed[1].body_json) == parsed[1].body


@pytest.mark.parametrize("data, expected", [
    (b"", [("empty_file", None, None)]),
    (b"\n\n \n", [("empty_file", None, None)]),
    (line("a") + b"\n\n" + line("b"), [("invalid_json_line", 2, None)]),  # blank in the middle
    (line("a") + b"\n{not json\n", [("invalid_json_line", 2, None)]),
    (b'"a string"\n' + line("a"), [("invalid_json_line", 1, None)]),
    (b"[1, 2]", [("invalid_json_line", 1, None)]),
    (line("a") + b"\n" + b'{"custom_id": "\xff\xfe"}', [("invalid_json_line", 2, None)]),  # not UTF-8
    (line(drop=("custom_id",)), [("missing_required_parameter", 1, "custom_id")]),
    (line(drop=("method",)), [("missing_required_parameter", 1, "method")]),
    (line(drop=("url",)), [("missing_required_parameter", 1, "url")]),
    (line(drop=("body",)), [("missing_required_parameter", 1, "body")]),
    (line(drop=("body.model",)), [("missing_required_parameter", 1, "body.model")]),
    (line(""), [("invalid_custom_id", 1, "custom_id")]),
    (line(7), [("invalid_custom_id", 1, "custom_id")]),
    (line("x" * (MAX_CUSTOM_ID + 1)), [("invalid_custom_id", 1, "custom_id")]),
    (line(method="GET"), [("invalid_method", 1, "method")]),
    (line(url="/v1/completions"), [("invalid_url", 1, "url")]),
    (line(model=""), [("invalid_body", 1, "body.model")]),
    (line(model=["m"]), [("invalid_body", 1, "body.model")]),
    (b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": []}',
     [("invalid_body", 1, "body")]),
    (line(stream=True), [("unsupported_value", 1, "body.stream")]),
    (line(n=2), [("unsupported_value", 1, "body.n")]),
    (line("a") + b"\n" + line("b") + b"\n" + line("a"), [("duplicate_custom_id", 3, "custom_id")]),
    (line("a") + b"\n" + line("b", model="other"), [("mismatched_model", 2, "body.model")]),
])
def test_an_invalid_file_is_refused_with_the_line_and_code(data, expected):
    assert errors_of(data) == expected


@pytest.mark.parametrize("body", [dict(stream=False), dict(n=1), dict(n="two"), dict(bogus_field=1),
                                  dict(messages="not a list")])
def test_the_body_is_not_validated_deeply_here_only_stream_and_n(body):
    assert errors_of(line(**body)) == []  # the edge checks the body when the line runs


def test_the_url_must_be_the_batch_endpoint_whichever_it_is():
    data = line(url="/v1/completions")
    assert errors_of(data, "/v1/completions") == [] and errors_of(data, CHAT) == [("invalid_url", 1, "url")]


def test_every_bad_line_is_reported_up_to_the_cap():
    data = b"\n".join([b"{"] * 5 + [line("a")])
    assert [e[1] for e in errors_of(data)] == [1, 2, 3, 4, 5]
    capped = errors_of(b"\n".join([b"{"] * 300))
    assert len(capped) == 100 and capped[-1][1] == 100


def test_a_rejected_line_does_not_claim_its_custom_id_nor_set_the_model():
    data = line("a", model="x", stream=True) + b"\n" + line("a", model="y")
    assert errors_of(data) == [("unsupported_value", 1, "body.stream")]


def test_too_many_lines_and_too_many_bytes(monkeypatch):
    monkeypatch.setattr(lines_mod, "MAX_BATCH_LINES", 3)
    data = b"\n".join(line(f"r{i}") for i in range(4))
    assert errors_of(data) == [("too_many_lines", 4, None)]
    assert errors_of(b"\n".join(line(f"r{i}") for i in range(3))) == []
    monkeypatch.setattr(lines_mod, "MAX_BATCH_FILE_BYTES", 100)
    assert errors_of(line("a") + b" " * 100) == [("file_too_large", None, None)]


def test_output_line_has_openais_shape():
    out = output_line("r1", 200, "req_9", b'{"id": "chatcmpl-1", "choices": []}', line_id="batch_req_1")
    assert out.endswith(b"\n") and out.count(b"\n") == 1
    assert json.loads(out) == {"id": "batch_req_1", "custom_id": "r1", "error": None,
                               "response": {"status_code": 200, "request_id": "req_9",
                                            "body": {"id": "chatcmpl-1", "choices": []}}}
    as_dict = output_line("r2", 400, "req_8", {"error": {"code": "bad"}}, line_id="batch_req_2")
    assert json.loads(as_dict)["response"]["body"] == {"error": {"code": "bad"}}


def test_error_line_has_openais_shape_and_fresh_ids():
    a = error_line("r1", "batch_expired", "This line was not run before the batch expired.")
    b = error_line("r1", "x", "y")
    assert json.loads(a) == {"id": json.loads(a)["id"], "custom_id": "r1", "response": None,
                             "error": {"code": "batch_expired", "message": "This line was not run before the batch "
                                                                          "expired."}}
    assert json.loads(a)["id"].startswith("batch_req_") and json.loads(a)["id"] != json.loads(b)["id"]
