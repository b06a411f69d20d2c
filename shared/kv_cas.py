"""Compare-and-set on JetStream KV keys, with an optional per-key TTL (nats-py's ``update`` takes none).

    data, revision = await get_last(bus, bucket, key)       # (None, r) when absent, deleted or expired
    revision = await cas_put(bus, bucket, key, data, revision, ttl_s=600)   # CasConflict if it moved

A write names the revision it replaces (``Nats-Expected-Last-Subject-Sequence``; 0 for a key never
written, else the revision of its delete or expiry marker), so of two writers exactly one wins.
The bucket must allow per-message TTLs (``limit_marker_ttl``) when ``ttl_s`` is given.
"""

from __future__ import annotations

import math

from nats.js.api import KeyValueConfig
from nats.js.errors import APIError, BucketNotFoundError, NotFoundError
from nats.js.kv import KeyValue

from shared.bus import Bus
from shared.replication import stream_replicas
from shared.storage_caps import store_caps
from shared.telemetry import traced

WRONG_LAST_SEQUENCE = 10071  # JetStream's error code for a failed expected-last-sequence check
MARKER_TTL_S = 10


class CasConflict(Exception):
    """Another writer moved the key first."""


async def ensure_bucket(bus: Bus, bucket: str) -> KeyValue:
    """The bucket's handle, creating it if needed (history 1, per-key TTLs allowed, expiry markers kept, its
    ``max_bytes`` reserved: shared/storage_caps.py)."""
    try:
        return await bus.js.key_value(bucket)
    except BucketNotFoundError:
        return await bus.js.create_key_value(KeyValueConfig(bucket=bucket, history=1, limit_marker_ttl=MARKER_TTL_S,
                                                             replicas=stream_replicas(),
                                                             max_bytes=store_caps().kv_bucket))


async def get_last(bus: Bus, bucket: str, key: str) -> tuple[bytes | None, int]:
    data, revision, _ = await get_last_with_headers(bus, bucket, key)
    return data, revision


async def get_last_with_headers(bus: Bus, bucket: str, key: str) -> tuple[bytes | None, int, dict[str, str]]:
    """As ``get_last``, with the headers its last write carried (those of a delete or expiry marker if gone)."""
    try:
        msg = await bus.js.get_last_msg(f"KV_{bucket}", f"$KV.{bucket}.{key}")
    except NotFoundError:
        return None, 0, {}
    headers = msg.headers or {}
    if not msg.data or headers.get("KV-Operation") in ("DEL", "PURGE") or "Nats-Marker-Reason" in headers:
        return None, msg.seq or 0, headers
    return msg.data, msg.seq or 0, headers


async def traced_put(bus: Bus, bucket: str, key: str, data: bytes) -> int:
    """An unconditional write, as nats-py's ``kv.put``, carrying the current trace (``kv.put`` sends no headers)."""
    return (await bus.js.publish(f"$KV.{bucket}.{key}", data, headers=traced())).seq


async def traced_delete(bus: Bus, bucket: str, key: str, marker_ttl_s: float | None = None) -> int:
    """A delete marker, as nats-py's ``kv.delete`` writes it (``KV-Operation: DEL``), carrying the current trace.
    ``marker_ttl_s``: the marker itself expires then (``Nats-TTL``), leaving nothing of the key: a bucket whose
    keys are each used once (a lease) would otherwise keep one marker per key for good, up to its ``max_bytes``
    (then every write is refused)."""
    headers = traced({"KV-Operation": "DEL"}) or {}
    if marker_ttl_s is not None:
        headers["Nats-TTL"] = f"{max(1, math.ceil(marker_ttl_s))}s"
    return (await bus.js.publish(f"$KV.{bucket}.{key}", b"", headers=headers)).seq


async def cas_put(bus: Bus, bucket: str, key: str, data: bytes, revision: int, ttl_s: float | None = None,
                  extra_headers: dict[str, str] | None = None) -> int:
    headers = traced({**(extra_headers or {}), "Nats-Expected-Last-Subject-Sequence": str(revision)}) or {}
    if ttl_s is not None:
        headers["Nats-TTL"] = f"{max(1, math.ceil(ttl_s))}s"
    try:
        ack = await bus.js.publish(f"$KV.{bucket}.{key}", data, headers=headers)
    except APIError as exc:
        if exc.err_code == WRONG_LAST_SEQUENCE:
            raise CasConflict(key) from exc
        raise
    return ack.seq
