"""OpenAI's Files API on the edge (``/v1/files``), over the ``<ns>_files`` object store (``shared/files.py``).

| route                             | answers                                                          |
|-----------------------------------|------------------------------------------------------------------|
| ``POST /v1/files``                | multipart ``file`` + ``purpose`` ("batch" only) -> the file      |
| ``GET /v1/files``                 | ``purpose``, ``limit`` (1..10000), ``after``, ``order`` -> a list |
| ``GET /v1/files/{id}``            | the file                                                         |
| ``DELETE /v1/files/{id}``         | ``{"id", "object": "file", "deleted": true}``                    |
| ``GET /v1/files/{id}/content``    | its bytes, streamed a stored chunk at a time                     |

The key is checked as on every endpoint (401); a file of another team is 404, as an unknown one. ``/v1/files``
is raw ASGI (as the hot endpoints of http.py), so an upload is bounded before and while it is read, never by the
chat body limit, and streams into the store (it never sits whole in memory):

| step             | bound                                                                  | else               |
|------------------|------------------------------------------------------------------------|--------------------|
| API key          | checked from the headers, before the body is read                      | 401, closed        |
| Content-Type     | ``multipart/form-data`` with a boundary                                | 400, closed        |
| Content-Length   | at most ``max_file_bytes`` + ``FORM_OVERHEAD``, checked before reading | 413, closed        |
| body, as it goes | the file at most ``max_file_bytes``, the rest ``FORM_OVERHEAD``        | 413, closed        |
| body, in time    | whole within ``file_upload_timeout_s``                                 | 408, closed        |
| the form         | valid multipart; ``purpose`` "batch" (refused as soon as it is read);  | 400 naming the     |
|                  | one ``file``, non-empty UTF-8 (its lines are the batch service's)      | param              |

| team quota       | the team's files with this one within ``team_file_bytes`` and           | 400                |
|                  | ``team_files``, held before a byte is stored (shared/file_quota.py)     | storage_quota_...  |
| the store        | the files store (all teams) not at its ``max_bytes``                    | 503, Retry-After   |

A refused or interrupted upload leaves no chunk in the store, and gives its hold on the quota back.
"""

from __future__ import annotations

import codecs
import logging
from functools import partial
from typing import Any, Awaitable, Callable
from urllib.parse import parse_qs

import msgspec
from litestar import Request, Response, delete, get
from litestar.handlers import asgi
from litestar.response import Stream
from litestar.types import Receive, Scope, Send
from multipart import MultipartError, MultipartSegment, PushMultipartParser, parse_options_header

from services.edge.config import EdgeConfig
from services.edge.http import ClientGone, JsonReply, body_chunks, error_reply, read_window
from services.edge.keys import Caller
from shared import errors
from shared.bus import Bus
from shared.file_quota import FileQuota, QuotaExceeded
from shared.files import (
    FileNotFound,
    FileOrder,
    FileStore,
    FileTooLarge,
    FileWriter,
    ensure_files_bucket,
    is_store_full,
)

log = logging.getLogger("infermesh.edge")
FORM_OVERHEAD = 64 << 10  # boundaries, part headers and the small fields around the file
MAX_FIELD_BYTES = 1024  # a form field other than the file (purpose, expires_after[...])
MAX_PARTS = 16
UPLOAD_PURPOSES = ("batch",)  # "batch_output" is written by the batch service, never uploaded
MAX_LIST_LIMIT = 10_000


def file_not_found(file_id: str) -> errors.ApiError:
    return errors.ApiError(404, f"No such File object: {file_id}", "invalid_request_error", "id", "not_found")


def _file_too_large(max_bytes: int) -> errors.ApiError:
    return errors.ApiError(413, f"The file is larger than the limit of {max_bytes} bytes.", "invalid_request_error",
                           "file", "file_too_large", {"Connection": "close"})


def quota_exceeded(exc: QuotaExceeded) -> errors.ApiError:
    """400 naming the quota, what the team uses of it, and how to free some."""
    if exc.kind == "files":
        usage = f"it has {exc.used} of its {exc.limit} files (uploads in progress count)"
    else:
        usage = f"its files take {exc.used} of its {exc.limit} bytes and this upload needs {exc.requested} more"
    return errors.ApiError(400, f"Your team's file storage quota is exceeded: {usage}. Delete files you no longer "
                           "need (GET /v1/files lists them, DELETE /v1/files/{file_id} frees their space) and upload "
                           "again.", "invalid_request_error", "file", "storage_quota_exceeded",
                           {"Connection": "close"})


def store_full() -> errors.ApiError:
    return errors.ApiError(503, "The file store is full; try again later.", "server_error", None, "storage_full",
                           {"Connection": "close", "Retry-After": "60"})


class _Form:
    """An upload's multipart body, parsed as it arrives: the ``file`` part goes straight into a FileWriter."""

    def __init__(self, store: FileStore, team: str, boundary: str, expected_bytes: int = 0) -> None:
        self.store, self.team, self.expected_bytes = store, team, expected_bytes
        self.parser = PushMultipartParser(boundary, max_segment_count=MAX_PARTS)
        self.fields: dict[str, bytearray] = {}
        self.writer: FileWriter | None = None
        self._part: MultipartSegment | None = None
        self._utf8 = codecs.getincrementaldecoder("utf-8")()

    async def feed(self, chunk: bytes) -> None:
        """Parse a piece of the body (b"": its end)."""
        try:
            for event in self.parser.parse(chunk):
                await self._on(event)
        except MultipartError as exc:
            raise errors.invalid_request(f"The multipart/form-data body could not be read: {exc}") from None
        except UnicodeDecodeError:
            raise errors.invalid_request("The file must be UTF-8 encoded JSONL.", "file") from None
        except FileTooLarge as exc:
            raise _file_too_large(exc.max_bytes) from None
        except QuotaExceeded as exc:
            raise quota_exceeded(exc) from None
        except Exception as exc:
            if is_store_full(exc):
                raise store_full() from None
            raise

    async def _on(self, event: MultipartSegment | bytes | None) -> None:
        if isinstance(event, MultipartSegment):
            self._part = event
            if event.name == "file":
                if self.writer is not None or event.filename is None:
                    raise errors.invalid_request("Expected one file upload in the 'file' field.", "file")
                self.writer = self.store.writer(self.team, event.filename, self.expected_bytes)
            elif event.name not in self.fields:
                self.fields[event.name] = bytearray()
        elif event is None:  # the part ended
            if self._part is not None and self._part.name == "file":
                self._utf8.decode(b"", final=True)
            elif self._part is not None and self._part.name == "purpose":
                self.purpose()  # a wrong purpose stops the upload before the file is read
            self._part = None
        elif self._part is not None and self._part.name == "file":
            assert self.writer is not None
            self._utf8.decode(event)
            await self.writer.write(event)
        elif self._part is not None:
            field = self.fields[self._part.name]
            field += event
            if len(field) > MAX_FIELD_BYTES:
                raise errors.invalid_request(f"'{self._part.name}' is longer than {MAX_FIELD_BYTES} bytes.",
                                             self._part.name)

    def purpose(self) -> str:
        raw = self.fields.get("purpose")
        if raw is None:
            raise errors.invalid_request("Missing required parameter: 'purpose'.", "purpose")
        purpose = raw.decode("utf-8", "replace")
        if purpose not in UPLOAD_PURPOSES:
            raise errors.invalid_request(f"Invalid value for 'purpose': {purpose!r}. Files can be uploaded here for "
                                         f"purpose {' or '.join(repr(p) for p in UPLOAD_PURPOSES)} only.", "purpose",
                                         "invalid_value")
        return purpose

    async def finish(self) -> Any:
        """The stored file, once the body ended and the form is whole and valid."""
        await self.feed(b"")
        if not self.parser.closed:
            raise errors.invalid_request("The multipart/form-data body ended early.")
        purpose = self.purpose()
        if self.writer is None:
            raise errors.invalid_request("Missing required parameter: 'file'.", "file")
        if self.writer.num_bytes == 0:
            raise errors.invalid_request("The file is empty.", "file")
        try:
            return await self.writer.finish(purpose)  # type: ignore[arg-type]
        except Exception as exc:
            if is_store_full(exc):
                raise store_full() from None
            raise

    async def abort(self) -> None:
        if self.writer is not None:
            await self.writer.abort()


class FilesApi:
    """The routes of ``/v1/files``: the caller from the key, the file from the store, OpenAI's shapes."""

    def __init__(self, config: EdgeConfig, bus: Bus, authenticate: Callable[[str | None], Caller]) -> None:
        self.config = config
        self.bus = bus
        self.authenticate = authenticate
        self._store: FileStore | None = None

    async def store(self) -> FileStore:
        """The store, opened on first use (an open bus's edge makes the bucket; a locked one's was provisioned)."""
        if self._store is None:
            await ensure_files_bucket(self.bus)
            quota = FileQuota(self.config.team_file_bytes, self.config.team_files)
            self._store = FileStore(self.bus, self.config.max_file_bytes, quota,
                                    hold_s=self.config.file_upload_timeout_s + 60)
        return self._store

    def route_handlers(self) -> list[Any]:
        @asgi("/v1/files", copy_scope=False)
        async def files(scope: Scope, receive: Receive, send: Send) -> None:
            await self.serve(scope, receive, send)  # type: ignore[arg-type]

        @get("/v1/files/{file_id:str}")
        async def retrieve_file(request: Request, file_id: str) -> Response[bytes]:
            caller, store = self.authenticate(request.headers.get("authorization")), await self.store()
            return _json(await _found(store.get(caller.team, file_id), file_id))

        @delete("/v1/files/{file_id:str}", status_code=200)
        async def delete_file(request: Request, file_id: str) -> Response[bytes]:
            caller, store = self.authenticate(request.headers.get("authorization")), await self.store()
            return _json(await _found(store.delete(caller.team, file_id), file_id))

        @get("/v1/files/{file_id:str}/content")
        async def file_content(request: Request, file_id: str) -> Stream:
            caller, store = self.authenticate(request.headers.get("authorization")), await self.store()
            file = await _found(store.get(caller.team, file_id), file_id)
            return Stream(store.chunks(caller.team, file_id), media_type="application/octet-stream",
                          headers={"content-length": str(file.bytes)})

        return [files, retrieve_file, delete_file, file_content]

    # ------------------------------------------------------------ /v1/files (raw ASGI: GET lists, POST uploads)
    async def serve(self, scope: dict[str, Any], receive: Callable[[], Awaitable[dict[str, Any]]],
                    send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if scope["method"] == "POST":
            await self._upload(headers, receive, send)
            return
        try:
            if scope["method"] != "GET":
                raise errors.ApiError(405, f"Method {scope['method']} not allowed; use GET or POST.",
                                      "invalid_request_error", None, "method_not_allowed")
            caller = self.authenticate(headers.get("authorization"))
            purpose, limit, after, order = _list_params(scope.get("query_string", b""))
            page = await (await self.store()).list(caller.team, purpose, limit, after, order)
            reply = JsonReply(200, msgspec.json.encode(page))
        except errors.ApiError as exc:
            reply = error_reply(exc, close=scope["method"] != "GET")
        await _send_json(send, reply)

    async def _upload(self, headers: dict[str, str], receive: Callable[[], Awaitable[dict[str, Any]]],
                      send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        form: _Form | None = None
        read_all = False
        try:
            caller = self.authenticate(headers.get("authorization"))
            boundary = _boundary(headers.get("content-type", ""))
            max_body = self.config.max_file_bytes + FORM_OVERHEAD
            declared = headers.get("content-length", "").strip()
            if declared.isdigit() and int(declared) > max_body:
                raise _file_too_large(self.config.max_file_bytes)
            expected = max(0, int(declared) - FORM_OVERHEAD) if declared.isdigit() else 0  # held at once
            form = _Form(await self.store(), caller.team, boundary, expected)
            await self._read(form, receive, max_body)
            read_all = True
            reply = JsonReply(200, msgspec.json.encode(await form.finish()))
        except ClientGone:
            if form is not None:
                await form.abort()
            return
        except errors.ApiError as exc:
            if form is not None:
                await form.abort()
            reply = error_reply(exc, close=not read_all)
        except BaseException:
            if form is not None:
                await form.abort()
            raise
        await _send_json(send, reply)

    async def _read(self, form: _Form, receive: Callable[[], Awaitable[dict[str, Any]]], max_body: int) -> None:
        """Feed the body to the form as it arrives, within the size and the time an upload may take."""
        too_large = partial(_file_too_large, self.config.max_file_bytes)
        async with read_window(self.config.file_upload_timeout_s):
            async for chunk in body_chunks(receive, max_body, too_large):
                if chunk:
                    await form.feed(chunk)


def _boundary(content_type: str) -> str:
    kind, options = parse_options_header(content_type)
    if kind != "multipart/form-data" or not options.get("boundary"):
        raise errors.invalid_request("The body must be multipart/form-data (with a boundary), carrying 'file' and "
                                     "'purpose'.")
    return options["boundary"]


def _list_params(query: bytes) -> tuple[str | None, int, str | None, FileOrder]:
    params = {name: values[-1] for name, values in parse_qs(query.decode("latin-1"), keep_blank_values=True).items()}
    limit = params.get("limit", str(MAX_LIST_LIMIT))
    if not limit.isdigit() or not 1 <= int(limit) <= MAX_LIST_LIMIT:
        raise errors.invalid_request(f"Invalid 'limit': {limit!r}; it must be an integer from 1 to {MAX_LIST_LIMIT}.",
                                     "limit", "invalid_value")
    order = params.get("order", "desc")
    if order not in ("asc", "desc"):
        raise errors.invalid_request(f"Invalid 'order': {order!r}; use 'asc' or 'desc'.", "order", "invalid_value")
    return params.get("purpose") or None, int(limit), params.get("after") or None, order  # type: ignore[return-value]


async def _found(call: Awaitable[Any], file_id: str) -> Any:
    try:
        return await call
    except FileNotFound:
        raise file_not_found(file_id) from None


def _json(value: Any) -> Response[bytes]:
    return Response(msgspec.json.encode(value), media_type="application/json")


async def _send_json(send: Callable[[dict[str, Any]], Awaitable[None]], reply: JsonReply) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(reply.body)).encode()),
               *((k.lower().encode(), v.encode()) for k, v in (reply.headers or {}).items())]
    await send({"type": "http.response.start", "status": reply.status, "headers": headers})
    await send({"type": "http.response.body", "body": reply.body, "more_body": False})
