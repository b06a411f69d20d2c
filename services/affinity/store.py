"""Session bindings in a JetStream KV bucket: per-key idle TTL, compare-and-set writes.

Every write names the revision it replaces (``Nats-Expected-Last-Subject-Sequence``; 0 or the
expiry marker's revision for a new key), so of two replicas binding one session at once exactly
one wins; the loser reads the winner's binding and uses it. Each write carries ``Nats-TTL``:
a session idle for the TTL lapses and its next turn is routed afresh. Keys are a hash of the
session id (ids from headers may hold characters KV keys do not allow).
"""

from __future__ import annotations

import hashlib
import time

from nats.js.api import KeyValueConfig
from nats.js.errors import APIError, BucketNotFoundError, NotFoundError

from shared import schema
from shared.bus import Bus
from shared.schema import SessionBinding

WRONG_LAST_SEQUENCE = 10071  # JetStream's error code for a failed expected-last-sequence check
MARKER_TTL_S = 10


class BindingConflict(Exception):
    """Another replica wrote the binding first."""


def session_key(session_id: str) -> str:
    return "s-" + hashlib.blake2b(session_id.encode(), digest_size=16).hexdigest()


class SessionStore:
    def __init__(self, bus: Bus, idle_ttl_s: float = 600.0) -> None:
        assert idle_ttl_s >= 1
        self._bus = bus
        self._bucket = bus.subjects.sessions_bucket
        self._stream = f"KV_{self._bucket}"
        self._ttl = f"{int(idle_ttl_s)}s"
        self.idle_ttl_s = idle_ttl_s

    async def start(self) -> None:
        try:
            await self._bus.js.key_value(self._bucket)
        except BucketNotFoundError:
            await self._bus.js.create_key_value(KeyValueConfig(bucket=self._bucket, history=1,
                                                               limit_marker_ttl=MARKER_TTL_S))

    async def get(self, session_id: str) -> tuple[SessionBinding | None, int]:
        """The session's binding and its revision; (None, revision to replace) when unbound."""
        try:
            msg = await self._bus.js.get_last_msg(self._stream, f"$KV.{self._bucket}.{session_key(session_id)}")
        except NotFoundError:
            return None, 0
        headers = msg.headers or {}
        if not msg.data or headers.get("KV-Operation") in ("DEL", "PURGE") or "Nats-Marker-Reason" in headers:
            return None, msg.seq or 0
        return schema.decode(msg.data, SessionBinding), msg.seq or 0

    async def put(self, binding: SessionBinding, revision: int) -> int:
        """Write ``binding`` if the key is still at ``revision``; its new revision. Raises BindingConflict."""
        subject = f"$KV.{self._bucket}.{session_key(binding.session_id)}"
        headers = {"Nats-Expected-Last-Subject-Sequence": str(revision), "Nats-TTL": self._ttl}
        stamped = SessionBinding(binding.session_id, binding.worker_id, binding.bound_at, binding.repins,
                                 binding.reason, time.time())
        try:
            ack = await self._bus.js.publish(subject, schema.encode(stamped), headers=headers)
        except APIError as exc:
            if exc.err_code == WRONG_LAST_SEQUENCE:
                raise BindingConflict(binding.session_id) from exc
            raise
        return ack.seq
