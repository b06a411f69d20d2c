"""Every live key of a JetStream KV bucket, without nats-py's empty-listing race.

    names = await live_keys(kv)      # [] only when the bucket holds no live key

nats-py's ``KeyValue.keys()`` decides "no more keys" from the watch consumer's pending count read right
after the consumer is created. The server answers that request on another path than it delivers
messages, so the count can be 0 while the bucket's only message is still on its way to the client:
``keys()`` then raises ``NoKeysError`` for a bucket that has keys (seen in CI on a loaded machine). A
new admission leader that took that for "no leases" would forget every held lease.

Here the end of the listing is known from the server's side instead: the bucket's last stream
sequence, read before watching, and each delivered entry's own pending count (its ``delta``).
"""

from __future__ import annotations

import asyncio

from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.kv import KV_DEL, KV_PURGE, KeyValue

LISTING_TIMEOUT_S = 5.0


class KeyListingTimeout(Exception):
    """The bucket held messages but the watch delivered none of the last ones in time."""


async def live_keys(kv: KeyValue, timeout_s: float = LISTING_TIMEOUT_S) -> list[str]:
    """The keys whose latest revision is a value (not a delete, purge or expiry marker), in revision order."""
    status = await kv.status()
    state = status.stream_info.state
    if state.messages == 0:
        return []
    watcher = await kv.watchall(meta_only=True)
    live: dict[str, None] = {}
    try:
        while True:
            try:
                entry = await watcher.updates(timeout=timeout_s)
            except NatsTimeoutError:
                if (await kv.status()).values == 0:  # everything expired meanwhile
                    return []
                raise KeyListingTimeout(f"listing {status.bucket}: no entry in {timeout_s:.0f} s") from None
            if entry is None:  # nats-py's own end marker, which may come too early: not trusted
                continue
            if entry.operation in (KV_DEL, KV_PURGE):
                live.pop(entry.key, None)
            else:
                live[entry.key] = None
            if entry.delta == 0 or entry.revision >= state.last_seq:
                return list(live)
    finally:
        await asyncio.shield(watcher.stop())
