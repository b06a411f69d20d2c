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

``InputScanner`` applies these rules a chunk at a time (the batch service streams a file through it off the event
loop, input.py), keeping only what the rules need (the custom ids seen, the first model, the errors);
``parse_input`` is the same over a whole file in memory.

These codes read like OpenAI's (its docs list the error object's fields, not the codes of validation); at most
``max_errors`` are collected, then validation stops. The body is not checked further here: the edge validates it
when the line runs, and a bad body becomes that line's error, not the batch's.

Output: ``output_line`` is the line of an answered request (OpenAI puts a 2xx in the output file and any other
status in the error file, both in this shape); ``error_line`` is a request that got no HTTP answer (its batch
was cancelled or expired first: ``batch_cancelled`` / ``batch_expired``).
"""

from __future__ import annotations

import secrets
from typing import Any, NamedTuple

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


class _Sendable(Struct):
    custom_id: str
    body: msgspec.Raw


_decoder = msgspec.json.Decoder()
_sendable = msgspec.json.Decoder(_Sendable)


class ScannedLine(NamedTuple):
    """A valid line and where it lies in the file: bytes ``start`` to ``end`` (without its newline)."""

    line: BatchLine
    start: int
    end: int


class InputScanner:
    """The input rules over a file fed a chunk at a time, pure. ``feed`` and ``finish`` return the valid lines each
    completes (a line is complete at its newline, or at the end); ``errors`` then says whether the file as a whole
    is refused. Memory: the custom ids seen and the line being cut, never the file."""

    def __init__(self, endpoint: str, max_errors: int = MAX_ERRORS) -> None:
        self.endpoint, self.max_errors = endpoint, max_errors
        self.model = ""
        self.num_bytes = 0
        self._errors: list[BatchLineError] = []
        self._seen: set[str] = set()
        self._partial = b""  # the line being cut (no newline yet)
        self._offset = 0  # where it starts in the file
        self._next_index = 0
        self._last_request = -1  # the index of the last line that is not blank
        self._blanks: list[int] = []  # blank lines not yet known to be at the end (the first max_errors of them)

    @property
    def num_lines(self) -> int:
        """The file's lines so far, blank lines at the end not counted."""
        return self._last_request + 1

    def feed(self, chunk: bytes) -> list[ScannedLine]:
        self.num_bytes += len(chunk)
        pieces = (self._partial + chunk).split(b"\n")
        self._partial = pieces.pop()
        scanned = []
        for raw in pieces:
            line = self._line(raw, self._offset)
            self._offset += len(raw) + 1
            if line is not None:
                scanned.append(line)
        return scanned

    def finish(self) -> list[ScannedLine]:
        """The end of the file: its last line, if it has no final newline."""
        raw, self._partial = self._partial, b""
        line = self._line(raw, self._offset) if raw else None
        return [] if line is None else [line]

    def errors(self) -> list[BatchLineError]:
        """Why the whole file is refused, after ``finish`` ([]: it is valid, ``num_lines`` lines for ``model``)."""
        if self.num_bytes > MAX_BATCH_FILE_BYTES:
            return too_large(self.num_bytes)
        if not self.num_lines:
            return _failed(BatchLineError("empty_file", "The file has no request in it."))
        if self.num_lines > MAX_BATCH_LINES:
            return _failed(BatchLineError("too_many_lines", f"The file has {self.num_lines} lines; a batch may have "
                                          f"at most {MAX_BATCH_LINES}.", line=MAX_BATCH_LINES + 1))
        return self._errors[:self.max_errors]

    def _line(self, raw: bytes, start: int) -> ScannedLine | None:
        index, self._next_index = self._next_index, self._next_index + 1
        if not raw.strip():  # an error unless only blank lines follow it
            if len(self._blanks) < self.max_errors:
                self._blanks.append(index)
            return None
        self._last_request = index
        for blank in self._blanks:
            self._reject(index, _LineRejected("invalid_json_line", "The line is blank; only the end of the file "
                                              "may have blank lines."), blank)
        self._blanks.clear()
        if index >= MAX_BATCH_LINES or len(self._errors) >= self.max_errors:
            return None  # refused already: lines are only counted from here
        try:
            line = _parse_line(index, raw, self.endpoint)
            if line.custom_id in self._seen:
                raise _LineRejected("duplicate_custom_id", f"The custom_id {line.custom_id!r} is used by an "
                                    "earlier line; each must be unique within the file.", "custom_id")
            if self.model and line.model != self.model:
                raise _LineRejected("mismatched_model", f"The model {line.model!r} differs from {self.model!r}, the "
                                    "first line's; every line of a batch must use the same model.", "body.model")
        except _LineRejected as exc:
            self._reject(index, exc)
            return None
        self._seen.add(line.custom_id)
        self.model = self.model or line.model
        return ScannedLine(line, start, start + len(raw))

    def _reject(self, _index: int, exc: _LineRejected, at: int | None = None) -> None:
        if len(self._errors) < self.max_errors:
            self._errors.append(BatchLineError(exc.code, exc.message, exc.param, (_index if at is None else at) + 1))


def parse_input(data: bytes, endpoint: str, max_errors: int = MAX_ERRORS) -> list[BatchLine] | list[BatchLineError]:
    """Check ``data`` (the uploaded file) as the input of a batch calling ``endpoint``: every line, in order, all
    for one model (``lines[0].model``), or else the errors (never an empty list: an empty file is an error)."""
    if len(data) > MAX_BATCH_FILE_BYTES:  # checked before anything is parsed
        return too_large(len(data))
    scanner = InputScanner(endpoint, max_errors)
    scanned = scanner.feed(data) + scanner.finish()
    return scanner.errors() or [line for line, _start, _end in scanned]


def _failed(error: BatchLineError) -> list[BatchLineError]:
    return [error]


def too_large(num_bytes: int) -> list[BatchLineError]:
    """The errors of a file of ``num_bytes`` over MAX_BATCH_FILE_BYTES (known from its size: nothing is read)."""
    return _failed(BatchLineError("file_too_large", f"The file is {num_bytes} bytes; a batch input file may have "
                                  f"at most {MAX_BATCH_FILE_BYTES}."))


def sendable_line(index: int, raw: bytes) -> BatchLine:
    """A line validated before, read back to be sent: its body is sent as the file has it (not re-encoded)."""
    sent = _sendable.decode(raw)
    return BatchLine(index, sent.custom_id, _decoder.decode(sent.body), bytes(sent.body))


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
