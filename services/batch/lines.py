"""A batch's input file checked against OpenAI's rules before anything runs, and its output/error file lines.

Input: JSONL, one request a line, ``{"custom_id": str, "method": "POST", "url": <the batch's endpoint>,
"body": {...}}``. The file as a whole is refused (the job ends ``failed``, ``errors`` names the lines, 1-based) if

    code                         when
    file_too_large               more than MAX_BATCH_FILE_BYTES (checked before anything is parsed)
    empty_file                   no line at all (blank lines at the end are tolerated, anywhere else an error)
    too_many_lines               more than MAX_BATCH_LINES lines (the only error then, at the first line too many)
    invalid_json_line            a line is blank, not UTF-8, not JSON, or not a JSON object
    missing_required_parameter   custom_id, method, url, body or body.model is missing (``param`` names it)
    invalid_custom_id            custom_id not a string, empty, or longer than MAX_CUSTOM_ID characters
    duplicate_custom_id          a custom_id already used by an earlier line
    invalid_method               method is not "POST"
    invalid_url                  url is not the batch's endpoint
    invalid_body                 body is not an object, or body.model not a non-empty string
    mismatched_model             body.model differs from the first line's (one model per batch, as OpenAI)
    unsupported_value            body.stream is true, or body.n > 1 (a batch line has one, unstreamed, answer)

These codes read like OpenAI's (its docs list the error object's fields, not the codes of validation); at most
``max_errors`` are collected, then validation stops. The body is not checked further here: the edge validates it
when the line runs, and a bad body becomes that line's error, not the batch's.

Output: ``output_line`` is the line of an answered request (OpenAI puts a 2xx in the output file and any other
status in the error file, both in this shape); ``error_line`` is a request that got no HTTP answer (its batch
was cancelled or expired first: ``batch_cancelled`` / ``batch_expired``).
"""

from __future__ import annotations

import secrets
from typing import Any

import msgspec
from msgspec import Struct

from shared.batch_schema import MAX_BATCH_FILE_BYTES, MAX_BATCH_LINES, MAX_CUSTOM_ID, BatchLineError

MAX_ERRORS = 100


class BatchLine(Struct, frozen=True):
    """One validated request of the input file."""

    index: int  # 0-based; the file's line number is index + 1
    custom_id: str
    body: dict[str, Any]
    body_json: bytes  # the body re-encoded, as the edge receives it

    @property
    def model(self) -> str:
        return self.body["model"]


class _LineRejected(Exception):
    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


_decoder = msgspec.json.Decoder()


def parse_input(data: bytes, endpoint: str, max_errors: int = MAX_ERRORS) -> list[BatchLine] | list[BatchLineError]:
    """Check ``data`` (the uploaded file) as the input of a batch calling ``endpoint``: every line, in order, all
    for one model (``lines[0].model``), or else the errors (never an empty list: an empty file is an error)."""
    if len(data) > MAX_BATCH_FILE_BYTES:
        return _failed(BatchLineError("file_too_large", f"The file is {len(data)} bytes; a batch input file may "
                                      f"have at most {MAX_BATCH_FILE_BYTES}."))
    raw_lines = data.split(b"\n")
    while raw_lines and not raw_lines[-1].strip():
        raw_lines.pop()  # blank lines at the end (and the final newline)
    if not raw_lines:
        return _failed(BatchLineError("empty_file", "The file has no request in it."))
    if len(raw_lines) > MAX_BATCH_LINES:
        return _failed(BatchLineError("too_many_lines", f"The file has {len(raw_lines)} lines; a batch may have at "
                                      f"most {MAX_BATCH_LINES}.", line=MAX_BATCH_LINES + 1))
    errors: list[BatchLineError] = []
    lines: list[BatchLine] = []
    seen: set[str] = set()
    model = ""
    for index, raw in enumerate(raw_lines):
        if len(errors) >= max_errors:
            break
        try:
            line = _parse_line(index, raw, endpoint)
            if line.custom_id in seen:
                raise _LineRejected("duplicate_custom_id", f"The custom_id {line.custom_id!r} is used by an "
                                    "earlier line; each must be unique within the file.", "custom_id")
            if model and line.model != model:
                raise _LineRejected("mismatched_model", f"The model {line.model!r} differs from {model!r}, the "
                                    "first line's; every line of a batch must use the same model.", "body.model")
        except _LineRejected as exc:
            errors.append(BatchLineError(exc.code, exc.message, exc.param, index + 1))
            continue
        seen.add(line.custom_id)
        model = model or line.model
        lines.append(line)
    return errors[:max_errors] if errors else lines


def _failed(error: BatchLineError) -> list[BatchLineError]:
    return [error]


def _parse_line(index: int, raw: bytes, endpoint: str) -> BatchLine:
    raw = raw.rstrip(b"\r")
    if not raw.strip():
        raise _LineRejected("invalid_json_line", "The line is blank; only the end of the file may have blank lines.")
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        raise _LineRejected("invalid_json_line", "The line is not valid UTF-8.") from None
    try:
        obj = _decoder.decode(raw)
    except msgspec.DecodeError as exc:
        raise _LineRejected("invalid_json_line", f"The line is not valid JSON: {exc}.") from None
    if not isinstance(obj, dict):
        raise _LineRejected("invalid_json_line", "The line is not a JSON object.")
    for name in ("custom_id", "method", "url", "body"):
        if name not in obj:
            raise _LineRejected("missing_required_parameter", f"The line has no {name!r}.", name)
    custom_id, body = obj["custom_id"], obj["body"]
    if not isinstance(custom_id, str) or not 0 < len(custom_id) <= MAX_CUSTOM_ID:
        raise _LineRejected("invalid_custom_id", f"custom_id must be a string of 1 to {MAX_CUSTOM_ID} characters.",
                            "custom_id")
    if obj["method"] != "POST":
        raise _LineRejected("invalid_method", f"method must be 'POST', not {obj['method']!r}.", "method")
    if obj["url"] != endpoint:
        raise _LineRejected("invalid_url", f"url must be the batch's endpoint {endpoint!r}, not {obj['url']!r}.",
                            "url")
    if not isinstance(body, dict):
        raise _LineRejected("invalid_body", "body must be a JSON object.", "body")
    _check_body(body)
    return BatchLine(index, custom_id, body, msgspec.json.encode(body))


def _check_body(body: dict[str, Any]) -> None:
    if "model" not in body:
        raise _LineRejected("missing_required_parameter", "The body has no 'model'.", "body.model")
    if not isinstance(body["model"], str) or not body["model"]:
        raise _LineRejected("invalid_body", "body.model must be a non-empty string.", "body.model")
    if body.get("stream") is True:
        raise _LineRejected("unsupported_value", "A batch line cannot stream: set 'stream' to false or leave it "
                            "out.", "body.stream")
    n = body.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and n > 1:
        raise _LineRejected("unsupported_value", f"A batch line has one answer: 'n' must be 1, not {n}.", "body.n")


# ---------------------------------------------------------------- output and error files
def new_line_id() -> str:
    return f"batch_req_{secrets.token_hex(12)}"


class _Response(Struct):
    status_code: int
    request_id: str
    body: Any  # msgspec.Raw (the edge's bytes, not decoded again) or a dict


class _Error(Struct):
    code: str
    message: str


class _OutputLine(Struct, omit_defaults=False):
    id: str
    custom_id: str
    response: _Response | None
    error: _Error | None


def output_line(custom_id: str, status_code: int, request_id: str, body: bytes | dict[str, Any],
                line_id: str | None = None) -> bytes:
    """The file line of an answered request; ``body`` as the JSON bytes the edge returned, or a dict."""
    raw = msgspec.Raw(body) if isinstance(body, bytes) else body
    line = _OutputLine(line_id or new_line_id(), custom_id, _Response(status_code, request_id, raw), None)
    return msgspec.json.encode(line) + b"\n"


def error_line(custom_id: str, code: str, message: str, line_id: str | None = None) -> bytes:
    """The error-file line of a request that got no answer (``batch_cancelled``, ``batch_expired``)."""
    return msgspec.json.encode(_OutputLine(line_id or new_line_id(), custom_id, None, _Error(code, message))) + b"\n"
