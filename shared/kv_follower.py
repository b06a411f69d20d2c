"""Following a JetStream KV bucket: a decoded view of every key, kept current, across NATS restarts too.

    follower = KvFollower(bus, bus.subjects.breakers_bucket, "breakers", lambda _key, data: decode(data))
    follower.on_put.append(lambda key, value, revision: ...)    # and on_delete: (key) -> None
    await follower.start()    # returns once every key already in the bucket is delivered (TimeoutError past 5 s)
    follower.values           # key -> decoded value
    await follower.stop()     # nothing is delivered once stop() is called

| in the bucket                               | the follower                                                  |
|---------------------------------------------|---------------------------------------------------------------|
| a key's value (at start or later)           | ``values[key]``, then ``on_put(key, value, revision)``         |
| a value ``decode`` raises on                | logged; the key's old value stays                             |
| ``decode`` returns None                     | not ours: ignored                                             |
| delete, purge, TTL expiry (a marker)        | ``on_delete(key)``, for a key it holds                        |
| NATS reconnected (a restart, a network blip)| watches afresh: changed keys as puts, keys gone as deletes    |

Why watch afresh: nats-py's watcher notices a restarted server only after missed heartbeats (about 20 s) and
resumes by stream sequence, so a key that lapsed meanwhile, whose expiry marker is itself kept only 10 s
(``kv_cas.MARKER_TTL_S``), never left the view. A fresh watch reads each key's last value; a key not in it is gone.

Why not nats-py's end marker alone: it decides from the consumer's pending count read just after the watch
starts, which can be 0 while the first entry is still on its way; a snapshot that ended there forgot every
key. The snapshot ends at the entry the server sent with nothing more pending (its ``delta`` is 0), or at a
marker that came after an entry or for a bucket that is empty (``shared.kv_keys`` does the same for listings).

Why no ``wait_for`` around the watcher and a stopping flag: Python 3.11's ``asyncio.wait_for`` swallows a
cancel that lands just as its get completes, so a follower cancelled during a burst went on applying the
updates queued in nats-py's watcher (up to 255) while and after it stopped. This one reads the watcher as an
async iterator (a plain queue get: a cancel always lands) and checks the flag before each update.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from shared.bus import Bus
from shared.kv_cas import ensure_bucket

log = logging.getLogger(__name__)
T = TypeVar("T")
REOPEN_BACKOFF_S = (0.1, 2.0)  # first and longest wait between attempts to watch again


class KeyRevisions:
    """The last (revision, bytes) of every key a follower holds, and what a fresh snapshot changes. Pure.

    ``put`` says whether a value is news (a snapshot repeats the values a follower already holds);
    between ``begin_snapshot`` and ``end_snapshot`` it notes the keys seen, and ``end_snapshot`` returns the
    keys held that the snapshot lacked: they went while nobody watched."""

    def __init__(self) -> None:
        self._held: dict[str, tuple[int, bytes]] = {}
        self._unseen: set[str] | None = None  # during a snapshot: keys held and not in it so far

    def __contains__(self, key: str) -> bool:
        return key in self._held

    def begin_snapshot(self) -> None:
        self._unseen = set(self._held)

    def put(self, key: str, revision: int, data: bytes) -> bool:
        if self._unseen is not None:
            self._unseen.discard(key)
        if self._held.get(key) == (revision, data):
            return False
        self._held[key] = (revision, data)
        return True

    def delete(self, key: str) -> bool:
        if self._unseen is not None:
            self._unseen.discard(key)
        return self._held.pop(key, None) is not None

    @property
    def in_snapshot(self) -> bool:
        return self._unseen is not None

    def end_snapshot(self) -> list[str]:
        gone, self._unseen = sorted(self._unseen or ()), None
        for key in gone:
            del self._held[key]
        return gone


class KvFollower(Generic[T]):
    """One bucket's keys, decoded, in ``values``, with callbacks on each change; watched again after a reconnect."""

    def __init__(self, bus: Bus, bucket: str, what: str, decode: Callable[[str, bytes], T | None]) -> None:
        self.bus = bus
        self.bucket = bucket
        self.what = what  # for logs and the task's name: "registry", "api keys"
        self.values: dict[str, T] = {}
        self.on_put: list[Callable[[str, T, int], None]] = []
        self.on_delete: list[Callable[[str], None]] = []
        self.rewatches = 0  # fresh watches after a reconnect
        self._decode = decode
        self._revisions = KeyRevisions()
        self._watcher: Any = None
        self._task: asyncio.Task[None] | None = None
        self._interrupting: asyncio.Task[None] | None = None
        self._synced = asyncio.Event()
        self._stopping = False

    @property
    def synced(self) -> bool:
        """The keys that were in the bucket at start have all been delivered."""
        return self._synced.is_set()

    async def start(self, sync_timeout_s: float = 5.0) -> None:
        """Watch the bucket; return once its keys are delivered. Past ``sync_timeout_s`` raise TimeoutError (the
        follower goes on in the background: ``stop()`` it). A bucket that cannot be opened raises at once."""
        watcher = await self._open()
        self.bus.on_reconnected.append(self._on_reconnected)
        self._task = asyncio.create_task(self._follow(watcher), name=f"{self.what}-watch")
        await asyncio.wait_for(self._synced.wait(), sync_timeout_s)

    async def stop(self) -> None:
        self._stopping = True  # first: from here on nothing is delivered
        if self._on_reconnected in self.bus.on_reconnected:
            self.bus.on_reconnected.remove(self._on_reconnected)
        await self._stop_watcher()
        for task in (self._interrupting, self._task):
            if task is not None:
                task.cancel()
                await asyncio.wait([task], timeout=2)

    async def _open(self) -> Any:
        self._watcher = await self._watch_bucket()
        return self._watcher

    async def _watch_bucket(self) -> Any:
        """A fresh nats-py watcher of every key (the seam the unit tests fake)."""
        return await (await ensure_bucket(self.bus, self.bucket)).watchall()

    async def _follow(self, watcher: Any) -> None:
        while True:
            await self._read(watcher)
            if self._stopping:
                return
            watcher = await self._reopen()
            if watcher is None:
                return

    async def _read(self, watcher: Any) -> None:
        """Deliver one watcher's updates until it is stopped (by ``stop`` or a reconnect)."""
        self._revisions.begin_snapshot()
        delivered = 0
        async for entry in watcher:
            if self._stopping:
                return
            if entry is None:  # nats-py's end marker: early (and then alone) when its first entry is in flight
                if self._revisions.in_snapshot and (delivered or await self._bucket_is_empty()):
                    self._end_snapshot()
                continue
            delivered += 1
            if entry.operation in ("DEL", "PURGE") or not entry.value:
                if self._revisions.delete(entry.key):
                    self._forget(entry.key)
            else:
                self._put(entry.key, entry.value, entry.revision or 0)
            if entry.delta == 0 and self._revisions.in_snapshot:  # the server had nothing more for this watch
                self._end_snapshot()

    def _end_snapshot(self) -> None:
        for key in self._revisions.end_snapshot():
            self._forget(key)
        self._synced.set()

    async def _bucket_is_empty(self) -> bool:
        """Whether an end marker that came before any entry is true (see ``shared.kv_keys``)."""
        try:
            return (await (await ensure_bucket(self.bus, self.bucket)).status()).values == 0
        except Exception as exc:  # NATS away: the next watch (after the reconnect) takes the snapshot again
            log.debug("%s: cannot read the bucket's size: %s", self.what, exc)
            return False

    def _put(self, key: str, data: bytes, revision: int) -> None:
        if not self._revisions.put(key, revision, data):
            return  # a snapshot repeating what we hold
        try:
            value = self._decode(key, data)
        except Exception as exc:
            log.warning("bad %s record %s: %s", self.what, key[:16], exc)
            return
        if value is None:
            return
        self.values[key] = value
        for callback in self.on_put:
            self._call(callback, key, value, revision)

    def _forget(self, key: str) -> None:
        self.values.pop(key, None)
        for callback in self.on_delete:
            self._call(callback, key)

    def _call(self, callback: Callable[..., None], key: str, *args: Any) -> None:
        try:
            callback(key, *args)
        except Exception:  # one view's bug must not stop the watch every other update needs
            log.exception("%s callback failed for %s", self.what, key[:16])

    def _on_reconnected(self) -> None:
        """NATS is back: what nats-py's watcher would deliver now may be incomplete, so end it and watch afresh."""
        if not self._stopping and self._task is not None and not self._task.done():
            self._interrupting = asyncio.ensure_future(self._stop_watcher())

    async def _stop_watcher(self) -> None:
        watcher, self._watcher = self._watcher, None
        if watcher is None:
            return
        try:
            await watcher.stop()  # ends its iterator: _read returns
        except Exception as exc:  # the connection is closing: nothing more to watch
            log.debug("%s watcher stop: %s", self.what, exc)

    async def _reopen(self) -> Any:
        delay, longest = REOPEN_BACKOFF_S
        while not self._stopping:
            try:
                watcher = await self._open()
            except Exception as exc:  # JetStream still recovering its streams after a restart, say
                log.warning("%s: watching again failed (%s), retrying in %.1f s", self.what, exc, delay)
                await asyncio.sleep(delay)
                delay = min(2 * delay, longest)
                continue
            if self._stopping:  # stop() came while this watch was being opened
                await self._stop_watcher()
                return None
            self.rewatches += 1
            log.info("%s: watching the bucket afresh after NATS reconnected", self.what)
            return watcher
        return None
