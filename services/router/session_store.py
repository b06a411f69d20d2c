"""Session bindings in a JetStream KV bucket: per-key idle TTL, compare-and-set writes.

Every write names the revision it replaces (``Nats-Expected-Last-Subject-Sequence``; 0 or the
expiry marker's revision for a new key), so of two replicas binding one session at once exactly
one wins; the loser reads the winner's binding and uses it. Each write carries ``Nats-TTL``:
a session idle for the TTL lapses and its next turn is routed afresh. Keys are a hash of the
team and the session id (ids from headers may hold characters KV keys do not allow): a session is its
team's, so a tenant that names another team's session id binds a session of its own, never moves theirs.
"""

from __future__ import annotations

import hashlib
import time

from shared import schema
from shared.bus import Bus
from shared.kv_cas import CasConflict, cas_put, ensure_bucket, get_last
from shared.schema import SessionBinding

BindingConflict = CasConflict  # another replica wrote the binding first


def session_key(session_id: str, team: str = "") -> str:
    scoped = f"{len(team)}:{team}{session_id}"  # length-prefixed: no two (team, id) pairs make one string
    return "s-" + hashlib.blake2b(scoped.encode(), digest_size=16).hexdigest()


class SessionStore:
    def __init__(self, bus: Bus, idle_ttl_s: float = 600.0) -> None:
        assert idle_ttl_s >= 1
        self._bus = bus
        self._bucket = bus.subjects.sessions_bucket
        self.idle_ttl_s = idle_ttl_s

    async def start(self) -> None:
        await ensure_bucket(self._bus, self._bucket)

    async def get(self, session_id: str, team: str = "") -> tuple[SessionBinding | None, int]:
        """``team``'s session's binding and its revision; (None, revision to replace) when unbound."""
        data, revision = await get_last(self._bus, self._bucket, session_key(session_id, team))
        return (schema.decode(data, SessionBinding) if data else None), revision

    async def put(self, binding: SessionBinding, revision: int) -> int:
        """Write ``binding`` if the key is still at ``revision``; its new revision. Raises BindingConflict."""
        stamped = SessionBinding(binding.session_id, binding.worker_id, binding.bound_at, binding.repins,
                                 binding.reason, time.time(), binding.team)
        return await cas_put(self._bus, self._bucket, session_key(binding.session_id, binding.team),
                             schema.encode(stamped), revision, self.idle_ttl_s)
