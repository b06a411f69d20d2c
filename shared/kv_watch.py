"""Following a JetStream KV bucket: every put and delete, in order, and the moment the history is read."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


async def follow(watcher: Any, what: str, on_put: Callable[[str, bytes, int], None],
                 on_delete: Callable[[str], None], on_synced: Callable[[], None],
                 stopping: Callable[[], bool] = lambda: False) -> None:
    """Feed a KV watcher's updates to callbacks until it is stopped (or ``stopping()``).

    ``on_put(key, value, revision)``; ``on_delete(key)`` for deletes, purges and TTL expiries;
    ``on_synced()`` once the existing keys have been delivered (the watcher's None marker).
    Transient watch errors are logged and retried.
    """
    while not stopping():
        try:
            entry = await watcher.updates(timeout=3600)
        except asyncio.TimeoutError:
            continue
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("%s watch error: %s", what, exc)
            await asyncio.sleep(0.2)
            continue
        if entry is None:
            on_synced()
            continue
        if stopping() or not hasattr(entry, "operation"):
            return  # the watcher was stopped
        if entry.operation in ("DEL", "PURGE") or not entry.value:
            on_delete(entry.key)
        else:
            on_put(entry.key, entry.value, entry.revision or 0)
