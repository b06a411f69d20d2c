"""The usage outbox's file: ``<dir>/journal`` (appended, group-committed: one ``fdatasync`` for every record
buffered meanwhile) and ``<dir>/lock`` (``flock``: one edge at a time replays and appends a journal).

    journal = UsageJournal.open(Path("state/edge-0/usage-outbox"))   # raises JournalLocked if another edge has it
    await journal.start()
    entry = journal.outbox.open()
    journal.write(entry, "checkpoint", event)      # buffered: in the next group commit
    durable = await journal.commit(entry, "final", event)   # True once on disk; False if the write failed
    journal.write(entry, "retired")

A write that fails (disk full, I/O error) is logged loudly and its waiters are told (``commit`` returns False:
the edge keeps that usage in memory and publishes it anyway); the next commit rewrites the whole journal from
the outbox's entries (a failed append may have left a torn line). The directory must outlive the edge process:
a stable directory per edge slot (``infermesh up``: ``<state>/edge-<i>/usage-outbox``; docker-compose and
Kubernetes: a volume).
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
from pathlib import Path

from shared.schema import UsageEvent
from shared.usage_outbox import Outbox, RecordKind

log = logging.getLogger("infermesh.usage")


class JournalLocked(RuntimeError):
    """Another live process holds this usage outbox (two edges must never replay one journal)."""


class UsageJournal:
    def __init__(self, directory: Path, lock_fd: int) -> None:
        self.directory, self.path = directory, directory / "journal"
        self.outbox = Outbox()
        self.stats = {"commits": 0, "records": 0, "compactions": 0, "write_errors": 0, "torn": 0}
        self._lock_fd = lock_fd
        self._fd = -1
        self._buffer: list[bytes] = []
        self._waiters: list[asyncio.Future[bool]] = []
        self._wake = asyncio.Event()
        self._rewrite = False  # the last append failed: the next commit rewrites the journal whole
        self._task: asyncio.Task[None] | None = None

    @classmethod
    def open(cls, directory: Path) -> "UsageJournal":
        """Lock ``directory``'s journal for this process and load it (synchronous: at start, before serving)."""
        directory.mkdir(parents=True, exist_ok=True)
        lock_fd = os.open(directory / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock_fd)
            raise JournalLocked(f"the usage outbox {directory} is held by another process (an edge of the same "
                                f"slot still running?)") from None
        journal = cls(directory, lock_fd)
        data = journal.path.read_bytes() if journal.path.exists() else b""
        journal.stats["torn"] = journal.outbox.load(data)
        if journal.stats["torn"]:
            log.warning("usage outbox %s: %d unreadable records skipped (a torn write)", directory,
                        journal.stats["torn"])
        journal._fd = os.open(journal.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        journal._rewrite = bool(journal.stats["torn"])  # no append after a torn line
        return journal

    async def start(self) -> None:
        self._task = asyncio.create_task(self._commits(), name="usage-journal")

    async def stop(self) -> None:
        """Write what is buffered, then release the journal (and its lock) for the next edge of the slot."""
        if self._task is not None:
            if self._buffer:
                await self.flush()
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for fd in (self._fd, self._lock_fd):
            if fd >= 0:
                os.close(fd)
        self._fd = self._lock_fd = -1

    def write(self, entry: int, kind: RecordKind, event: UsageEvent | None = None) -> None:
        """Change ``entry`` in the outbox now and on disk at the next group commit (not awaited)."""
        line = self.outbox.retire(entry) if kind == "retired" else self.outbox.put(entry, kind, event)  # type: ignore[arg-type]
        if line is not None:
            self._buffer.append(line)
            self._wake.set()

    async def commit(self, entry: int, kind: RecordKind, event: UsageEvent | None = None) -> bool:
        """``write``, then wait for the group commit that puts it on disk: False if that write failed."""
        self.write(entry, kind, event)
        return await self.flush()

    async def flush(self) -> bool:
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self._wake.set()
        return await asyncio.shield(waiter)

    async def _commits(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            lines, waiters = self._buffer, self._waiters
            self._buffer, self._waiters = [], []
            rewrite = self._rewrite or self.outbox.should_compact()
            data = self.outbox.compacted() if rewrite else b"".join(lines)  # the outbox already holds the lines
            try:
                await asyncio.to_thread(self._replace if rewrite else self._append, data)
                self._rewrite, ok = False, True
                self.stats["commits"] += 1
                self.stats["records"] += len(lines)
                self.stats["compactions"] += rewrite
            except OSError as exc:
                self._rewrite, ok = True, False
                self.stats["write_errors"] += 1
                log.error("USAGE OUTBOX WRITE FAILED (%s): %s; %d records kept in memory only until the next "
                          "write succeeds (responses are still served; an edge killed meanwhile loses them)",
                          self.directory, exc, len(lines))
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(ok)

    def _append(self, data: bytes) -> None:
        if data:
            _write_all(self._fd, data)
            os.fdatasync(self._fd)

    def _replace(self, data: bytes) -> None:
        """The journal rewritten whole: a new file, synced, renamed over the old one, the directory synced."""
        tmp = self.directory / "journal.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            _write_all(fd, data)
            os.fdatasync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        dir_fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        old, self._fd = self._fd, os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        os.close(old)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
