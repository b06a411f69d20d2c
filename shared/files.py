"""Files of OpenAI's Files API (``/v1/files``), kept in the JetStream object store ``<ns>_files``.

    store = await FileStore.open(bus)                        # the bucket exists (provision, or ensure_files_bucket)
    file = await store.put("research", "batch", "in.jsonl", data)   # FileObject, id file-<24 hex>
    file = await store.get("research", file.id)              # FileNotFound: unknown, deleted, or another team's
    page = await store.list("research", purpose="batch", limit=20, after=None, order="desc")   # FileList
    data = await store.content("research", file.id)          # bytes; chunks(): the same, a chunk at a time
    await store.delete("research", file.id)                  # FileDeleted
    writer = store.writer("research", "in.jsonl")            # an upload as it arrives (the edge's POST):
    await writer.write(part); ...; file = await writer.finish("batch")    # or await writer.abort()

The layout is nats' own object store (``nats object ls/get`` read it): one object per file, named by its id,

| subject                          | holds                                                                     |
|----------------------------------|---------------------------------------------------------------------------|
| ``$O.<bucket>.C.<nuid>``         | the file's bytes, in chunks of 128 KiB                                    |
| ``$O.<bucket>.M.<b64(file id)>`` | its ObjectInfo (JSON, a rollup: the last one is the truth); ``headers``:  |
|                                  | Infermesh-Team, -Purpose, -Filename, -Created-At, -Bytes (so a listing    |
|                                  | needs no database)                                                        |

Invariants: a file exists once its info is published, after every chunk (with their SHA-256), so no reader sees
half a file; a file of another team is "not found", never "forbidden" (no one learns which ids exist); a delete
publishes a deleted info, then purges the chunks; a write that fails or is aborted purges its chunks. File ids
start with the creation time in milliseconds (``new_file_id``), so the id order is the creation order:
``list`` sorts and pages by id (OpenAI's ``after`` cursor).

Quotas and listing (shared/file_ledger.py, shared/file_quota.py): each team has a usage record (its files' ids
and bytes, its uploads in progress) and an index (a FileObject per file) in the same stream. A write holds its
bytes in the team's record (compare-and-set) before it publishes them, so concurrent uploads on several edges
cannot pass ``FileQuota`` together (QuotaExceeded; ``batch_output`` is counted, never refused); a listing reads
the team's index only. Order of writes, so that a crash leaves the team's usage low rather than high: upload =
hold, chunks, info, index entry, commit; delete = uncount, deleted info, chunks purged, index entry purged. The
bucket's ``max_bytes`` (shared/storage_caps.py) bounds all teams together; when it is full, writes fail with
JetStream's ``maximum bytes exceeded`` (``is_store_full``) and every other stream keeps its own reserved room.

Who uses it: the edge (uploads, lists, reads and deletes for its callers) and the batch service (reads a job's
input, writes its ``batch_output``); on a locked bus both may write the bucket (``infermesh/bus_roles.py``).
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import secrets
import time
from typing import AsyncIterator, Callable, Literal

import msgspec
from msgspec import Struct
from nats.js.api import DeliverPolicy, DiscardPolicy, StorageType, StreamConfig
from nats.js.errors import APIError, BucketNotFoundError, NotFoundError
from nats.js.kv import MSG_ROLLUP_SUBJECT

from shared.batch_schema import MAX_BATCH_FILE_BYTES, MAX_FILE_ID, FilePurpose
from shared.bus import Bus
from shared.file_ledger import LAYOUT_METADATA, TeamLedger
from shared.file_quota import HOLD_S, FileQuota, commit, release, remove_file, reserve
from shared.replication import stream_replicas
from shared.storage_caps import store_caps
from shared.telemetry import traced

log = logging.getLogger("infermesh.files")

CHUNK_BYTES = 128 * 1024  # nats' default object chunk
MAX_FILENAME = 512
LIST_TIMEOUT_S = 10.0
FileOrder = Literal["asc", "desc"]
_HEADERS = ("Infermesh-Team", "Infermesh-Purpose", "Infermesh-Filename", "Infermesh-Created-At", "Infermesh-Bytes")
HOLD_STEP_BYTES = 8 << 20  # an upload of unknown length holds its quota this much at a time
STORE_FULL_CODES = (10077, 10023)  # JetStream: the stream's max_bytes, the server's max_file_store
DEFAULT_QUOTA = FileQuota()  # shared/file_quota.py's defaults (the edge's config sets its own)


class FileObject(Struct, frozen=True, kw_only=True):
    """One file as OpenAI describes it (``GET /v1/files/{id}``); the team it belongs to is not shown."""

    id: str  # file-<24+ hex>
    object: Literal["file"] = "file"
    bytes: int
    created_at: int  # unix seconds
    filename: str
    purpose: FilePurpose
    status: Literal["uploaded", "processed", "error"] = "processed"
    expires_at: int | None = None
    status_details: str | None = None


class FileList(Struct, frozen=True, kw_only=True):
    """A page of files in OpenAI's list shape (``GET /v1/files``)."""

    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(Struct, frozen=True, kw_only=True):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class FileNotFound(Exception):
    """No such file for this team (unknown, deleted, or another team's)."""

    def __init__(self, file_id: str) -> None:
        super().__init__(file_id)
        self.file_id = file_id


class FileTooLarge(Exception):
    """A write passed the store's ``max_bytes``; the chunks written so far are purged by ``abort``."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(f"larger than {max_bytes} bytes")
        self.max_bytes = max_bytes


class _Info(Struct):
    """What this module reads of an object's info (nats' ObjectInfo JSON; other fields are ignored)."""

    name: str
    nuid: str = ""
    size: int = 0
    chunks: int = 0
    digest: str = ""
    deleted: bool = False
    headers: dict[str, list[str]] | None = None


_last_id_time = [0, 0]  # (ms, sequence within it) of the last id this process made


def new_file_id(now_s: float | None = None) -> str:
    """``file-`` + the time in ms (12 hex digits) + a sequence within the ms (4) + 8 random hex digits: the ids of
    one process sort as they were made (those of two processes made in one millisecond, either way)."""
    millis = int((time.time() if now_s is None else now_s) * 1000)
    last_ms, last_seq = _last_id_time
    seq = 0
    if millis <= last_ms:
        millis, seq = (last_ms, last_seq + 1) if last_seq < 0xFFFF else (last_ms + 1, 0)
    _last_id_time[:] = [millis, seq]
    return f"file-{millis:012x}{seq:04x}{secrets.token_hex(4)}"


def is_file_id(value: str) -> bool:
    hex_part = value[5:]
    return (value.startswith("file-") and 24 <= len(hex_part) and len(value) <= MAX_FILE_ID
            and all(c in "0123456789abcdef" for c in hex_part))


def _stream(bucket: str) -> str:
    return f"OBJ_{bucket}"


def _meta_subject(bucket: str, file_id: str) -> str:
    return f"$O.{bucket}.M.{base64.urlsafe_b64encode(file_id.encode()).decode()}"


def _file_of(data: bytes | None) -> tuple[_Info, str, FileObject] | None:
    """(info, team, file) from an object's info; None for a deleted object or one this module did not write."""
    try:
        info = msgspec.json.decode(data or b"{}", type=_Info)
    except msgspec.DecodeError:
        return None
    headers = info.headers or {}
    if info.deleted:
        return None
    try:
        team, purpose, filename, created_at, size = (headers[name][0] for name in _HEADERS)
        return info, team, FileObject(id=info.name, bytes=int(size), created_at=int(created_at), filename=filename,
                                purpose=purpose)  # type: ignore[arg-type]
    except (KeyError, IndexError, ValueError):
        return None


async def ensure_files_bucket(bus: Bus) -> None:
    """Create ``<ns>_files`` if it does not exist (admin's provisioning; an open bus's edge on start)."""
    bucket = bus.subjects.files_bucket
    try:
        await bus.js.object_store(bucket)
    except BucketNotFoundError:  # nats' object store stream (as create_object_store makes it), with our layout
        await bus.js.add_stream(StreamConfig(
            name=_stream(bucket), description="infermesh files (/v1/files)", subjects=[f"$O.{bucket}.C.>",
            f"$O.{bucket}.M.>"], max_bytes=store_caps().files, storage=StorageType.FILE, num_replicas=stream_replicas(),
            discard=DiscardPolicy.NEW, allow_rollup_hdrs=True, allow_direct=True, metadata=LAYOUT_METADATA))


def is_store_full(exc: BaseException) -> bool:
    """JetStream refused a write: the files store (or the whole server's storage) is full."""
    return isinstance(exc, APIError) and exc.err_code in STORE_FULL_CODES


class FileStore:
    """The files of every team in one bucket; each call names the team it acts for."""

    def __init__(self, bus: Bus, max_bytes: int = MAX_BATCH_FILE_BYTES, quota: FileQuota = DEFAULT_QUOTA,
                 hold_s: float = HOLD_S, clock: Callable[[], float] = time.time) -> None:
        self.bus = bus
        self.bucket = bus.subjects.files_bucket
        self.stream = _stream(self.bucket)
        self.max_bytes = max_bytes  # one file's
        self.quota, self.hold_s, self.clock = quota, hold_s, clock  # a team's files together
        self.ledger = TeamLedger(bus, self.bucket, scan=self._all)

    @classmethod
    async def open(cls, bus: Bus, max_bytes: int = MAX_BATCH_FILE_BYTES,
                   quota: FileQuota = DEFAULT_QUOTA) -> "FileStore":
        """The store over an existing bucket (BucketNotFoundError if it was never made)."""
        await bus.js.object_store(bus.subjects.files_bucket)
        return cls(bus, max_bytes, quota)

    # ------------------------------------------------------------ writes
    def writer(self, team: str, filename: str, expected_bytes: int = 0, enforce_quota: bool = True) -> "FileWriter":
        """An upload; ``expected_bytes`` (its declared length) is held at its first write, in one step."""
        return FileWriter(self, team, filename, expected_bytes, enforce_quota)

    async def put(self, team: str, purpose: FilePurpose, filename: str, data: bytes) -> FileObject:
        """Store ``data`` as a new file of ``team`` (FileTooLarge past ``max_bytes``, QuotaExceeded past the team's
        quota unless it is ``batch_output``: nothing kept)."""
        writer = self.writer(team, filename, len(data), enforce_quota=purpose != "batch_output")
        try:
            await writer.write(data)
            return await writer.finish(purpose)
        except BaseException:
            await writer.abort()
            raise

    async def delete(self, team: str, file_id: str) -> FileDeleted:
        info, _file = await self._find(team, file_id)
        await self.ledger.update(team, lambda usage: remove_file(usage, file_id))
        gone = {"name": file_id, "bucket": self.bucket, "nuid": info.nuid, "size": 0, "chunks": 0, "digest": "",
                "deleted": True, "mtime": ""}
        try:
            await self.bus.js.publish(_meta_subject(self.bucket, file_id), json.dumps(gone).encode(),
                                      headers=traced({"Nats-Rollup": MSG_ROLLUP_SUBJECT}))
        finally:
            await self._purge(info.nuid)
        await self.ledger.unindex(team, file_id)
        return FileDeleted(id=file_id)

    # ------------------------------------------------------------ reads
    async def get(self, team: str, file_id: str) -> FileObject:
        return (await self._find(team, file_id))[1]

    async def content(self, team: str, file_id: str) -> bytes:
        """The whole file (the batch service's input); ``chunks`` reads it without holding it all."""
        return b"".join([chunk async for chunk in self.chunks(team, file_id)])

    async def chunks(self, team: str, file_id: str) -> AsyncIterator[bytes]:
        """The file's bytes in order, one stored chunk at a time (a direct get each: no consumer, the reader's
        pace). FileNotFound before the first chunk; ValueError at the end if they do not match the digest."""
        info, _file = await self._find(team, file_id)
        subject, digest, seq = f"$O.{self.bucket}.C.{info.nuid}", hashlib.sha256(), 1
        for _ in range(info.chunks):
            msg = await self.bus.js.get_msg(self.stream, seq=seq, subject=subject, next=True, direct=True)
            data = msg.data or b""
            digest.update(data)
            seq = (msg.seq or seq) + 1
            yield data
        if info.digest and base64.urlsafe_b64encode(digest.digest()).decode() != info.digest.partition("=")[2]:
            raise ValueError(f"file {file_id}: its chunks do not match its digest")

    async def list(self, team: str, purpose: str | None = None, limit: int = 10_000, after: str | None = None,
                   order: FileOrder = "desc") -> FileList:
        """The team's files (of ``purpose``), newest first (``desc``) or oldest first, after the file ``after``."""
        files = [f for f in await self.ledger.listed(team) if purpose is None or f.purpose == purpose]
        files.sort(key=lambda f: f.id, reverse=order == "desc")
        if after is not None:
            files = [f for f in files if (f.id < after if order == "desc" else f.id > after)]
        page = files[:limit]
        return FileList(data=page, first_id=page[0].id if page else None, last_id=page[-1].id if page else None,
                        has_more=len(files) > limit)

    # ------------------------------------------------------------ internals
    async def _find(self, team: str, file_id: str) -> tuple[_Info, FileObject]:
        if not is_file_id(file_id):
            raise FileNotFound(file_id)
        try:
            msg = await self.bus.js.get_last_msg(self.stream, _meta_subject(self.bucket, file_id), direct=True)
        except NotFoundError:
            raise FileNotFound(file_id) from None
        found = _file_of(msg.data)
        if found is None or found[1] != team or found[2].id != file_id:
            raise FileNotFound(file_id)
        return found[0], found[2]

    async def _all(self) -> list[tuple[str, FileObject]]:
        """(team, file) of every live file: the last info of each object, read by one ordered consumer (what a
        bucket made before the index is indexed from, once per team)."""
        all_meta = f"$O.{self.bucket}.M.>"
        try:
            await self.bus.js.get_last_msg(self.stream, all_meta)
        except NotFoundError:
            return []
        sub = await self.bus.js.subscribe(all_meta, stream=self.stream, ordered_consumer=True,
                                          deliver_policy=DeliverPolicy.LAST_PER_SUBJECT)
        found: list[tuple[str, FileObject]] = []
        try:
            while True:
                msg = await sub.next_msg(timeout=LIST_TIMEOUT_S)
                file = _file_of(msg.data)
                if file is not None:
                    found.append(file[1:])
                if msg.metadata.num_pending == 0:
                    return found
        finally:
            await sub.unsubscribe()

    async def _purge(self, nuid: str) -> None:
        await self.bus.js.purge_stream(self.stream, subject=f"$O.{self.bucket}.C.{nuid}")


class FileWriter:
    """One file on its way in: ``write`` its bytes as they come (published in 128 KiB chunks, so an upload never
    sits whole in memory), then ``finish`` (the file exists) or ``abort`` (its chunks are purged)."""

    def __init__(self, store: FileStore, team: str, filename: str, expected_bytes: int = 0,
                 enforce_quota: bool = True) -> None:
        self.store = store
        self.team = team
        self.filename = filename[:MAX_FILENAME]
        self.file_id = new_file_id()
        self.nuid = secrets.token_hex(11)
        self.num_bytes = 0
        self.num_chunks = 0
        self.held = 0  # bytes of the team's quota this upload holds (its usage record's hold, named by nuid)
        self.expected_bytes = min(expected_bytes, store.max_bytes)
        self.enforce_quota = enforce_quota
        self._subject = f"$O.{store.bucket}.C.{self.nuid}"
        self._digest = hashlib.sha256()
        self._pending = bytearray()

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        """Add ``data``; FileTooLarge once the file would pass the store's ``max_bytes``."""
        if self.num_bytes + len(data) > self.store.max_bytes:
            raise FileTooLarge(self.store.max_bytes)
        await self._hold(self.num_bytes + len(data))
        self.num_bytes += len(data)
        view = memoryview(data)
        if self._pending:  # top the pending chunk up first
            take = CHUNK_BYTES - len(self._pending)
            self._pending += view[:take]
            view = view[take:]
            if len(self._pending) < CHUNK_BYTES:
                return
            await self._publish(bytes(self._pending))
            self._pending.clear()
        while len(view) >= CHUNK_BYTES:
            await self._publish(bytes(view[:CHUNK_BYTES]))
            view = view[CHUNK_BYTES:]
        self._pending += view

    async def finish(self, purpose: FilePurpose, created_at: int | None = None) -> FileObject:
        """Publish the last chunk and the file's info: from now on it is listed and read."""
        if self._pending:
            await self._publish(bytes(self._pending))
            self._pending.clear()
        file = FileObject(id=self.file_id, bytes=self.num_bytes, filename=self.filename, purpose=purpose,
                          created_at=int(time.time()) if created_at is None else created_at)
        values = (self.team, purpose, file.filename, str(file.created_at), str(file.bytes))
        info = {"name": self.file_id, "bucket": self.store.bucket, "nuid": self.nuid, "size": self.num_bytes,
                "chunks": self.num_chunks, "mtime": _rfc3339(file.created_at),
                "digest": "SHA-256=" + base64.urlsafe_b64encode(self._digest.digest()).decode(),
                "headers": {name: [value] for name, value in zip(_HEADERS, values, strict=True)},
                "options": {"max_chunk_size": CHUNK_BYTES}}
        await self.store.bus.js.publish(_meta_subject(self.store.bucket, self.file_id), json.dumps(info).encode(),
                                        headers=traced({"Nats-Rollup": MSG_ROLLUP_SUBJECT}))
        await self.store.ledger.index(self.team, file)
        await self.store.ledger.update(self.team, lambda usage: commit(usage, self.nuid, file.id, file.bytes))
        self.held = 0
        return file

    async def abort(self) -> None:
        """Purge whatever was written and give its hold back (a failed or refused upload leaves nothing behind)."""
        self._pending.clear()
        try:
            if self.num_bytes:  # a chunk whose publish failed may still have landed
                await self.store._purge(self.nuid)
            if self.held:
                await self.store.ledger.update(self.team, lambda usage: release(usage, self.nuid))
        except Exception:  # justified: the caller is already failing; a leftover chunk costs space, a hold expires
            log.warning("file %s: its %d chunks or its hold were not cleared", self.file_id, self.num_chunks,
                        exc_info=True)

    async def _hold(self, total: int) -> None:
        """Hold at least ``total`` bytes of the team's quota before they are stored (a step or the declared length
        at a time; QuotaExceeded, nothing held, when they do not fit)."""
        if total <= self.held:
            return
        store, needed = self.store, max(total, self.expected_bytes) - self.held
        # past its declared length (or with none), an upload holds a step ahead: one CAS per step, not per chunk
        wanted = 0 if total <= self.expected_bytes else min(self.held + HOLD_STEP_BYTES, store.max_bytes) - self.held
        usage = await store.ledger.update(self.team, lambda usage: reserve(
            usage, store.quota, self.nuid, needed, store.clock(), store.hold_s, self.enforce_quota, wanted))
        self.held = usage.holds[self.nuid].bytes

    async def _publish(self, chunk: bytes) -> None:
        self._digest.update(chunk)
        await self.store.bus.js.publish(self._subject, chunk, headers=traced())
        self.num_chunks += 1


def _rfc3339(unix_s: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(unix_s))
