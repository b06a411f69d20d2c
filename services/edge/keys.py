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
from shared.kv_follower import KvFollower
from shared.schema import ApiKeyRecord

log = logging.getLogger("infermesh.edge")


@dataclass(frozen=True, slots=True)
class Caller:
    team: str
    key_prefix: str  # "" for a static key


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class KeyDirectory:
    """The edge's static keys, then every key in metering's bucket (``keys``: sha256 -> record, kept current)."""

    def __init__(self, bus: Bus | None, static: dict[str, str]) -> None:
        self.bus = bus
        self.static = static  # key -> team
        self._follower: KvFollower[ApiKeyRecord] | None = None
        self.keys: dict[str, ApiKeyRecord] = {}  # sha256 -> record
        if bus is not None:
            self._follower = KvFollower(bus, bus.subjects.api_keys_bucket, "api keys",
                                        lambda _key, data: schema.decode(data, ApiKeyRecord))
            self.keys = self._follower.values

    async def start(self) -> None:
        if self._follower is None:
            return
        try:
            await self._follower.start(10)
        except asyncio.TimeoutError:
            log.warning("api keys bucket not read within 10 s")

    async def stop(self) -> None:
        if self._follower is not None:
            await self._follower.stop()

    def caller(self, key: str) -> Caller | None:
        """The caller a key belongs to, None if it is unknown or revoked."""
        for known, team in self.static.items():
            if hmac.compare_digest(key.encode(), known.encode()):
                return Caller(team, "")
        record = self.keys.get(hash_key(key))  # a dict lookup by digest: no timing leak of the key itself
        return Caller(record.team, record.prefix) if record else None
