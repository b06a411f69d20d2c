"""Who a bearer key belongs to, without a database query: the edge follows metering's api-keys bucket.

Metering keeps ``<ns>_api_keys`` in step with the ledger (key: the SHA-256 of an API key; value:
its team, visible prefix and admin flag); a revoked key's entry is deleted, which reaches every
edge's watcher within milliseconds. Static keys from the edge's own config (the operator's dev key,
``--api-keys``) are checked first, in constant time.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
from dataclasses import dataclass

from shared import schema
from shared.bus import Bus
from shared.kv_cas import ensure_bucket
from shared.kv_watch import follow
from shared.schema import ApiKeyRecord

log = logging.getLogger("infermesh.edge")


@dataclass(frozen=True, slots=True)
class Caller:
    team: str
    key_prefix: str  # "" for a static key


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class KeyDirectory:
    def __init__(self, bus: Bus | None, static: dict[str, str]) -> None:
        self.bus = bus
        self.static = static  # key -> team
        self.keys: dict[str, ApiKeyRecord] = {}  # sha256 -> record
        self._watcher: object = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self.bus is None:
            return
        kv = await ensure_bucket(self.bus, self.bus.subjects.api_keys_bucket)
        self._watcher = await kv.watchall()
        synced = asyncio.Event()
        self._task = asyncio.create_task(follow(self._watcher, "api keys", self._on_put, self._on_delete, synced.set),
                                         name="api-keys-watch")
        try:
            await asyncio.wait_for(synced.wait(), 10)
        except asyncio.TimeoutError:
            log.warning("api keys bucket not read within 10 s")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._watcher.stop()  # type: ignore[attr-defined]
            except Exception:
                pass

    def _on_put(self, key: str, value: bytes, _revision: int) -> None:
        try:
            self.keys[key] = schema.decode(value, ApiKeyRecord)
        except Exception as exc:
            log.warning("bad api key record %s: %s", key[:8], exc)

    def _on_delete(self, key: str) -> None:
        self.keys.pop(key, None)

    def caller(self, key: str) -> Caller | None:
        """The caller a key belongs to, None if it is unknown or revoked."""
        for known, team in self.static.items():
            if hmac.compare_digest(key.encode(), known.encode()):
                return Caller(team, "")
        record = self.keys.get(hash_key(key))  # a dict lookup by digest: no timing leak of the key itself
        return Caller(record.team, record.prefix) if record else None
