"""How much JetStream storage each stream, bucket and object store of a namespace may hold: one setting.

``INFERMESH_STORE_BYTES`` (default 16 GiB) is the file storage one namespace may use; it is read here and nowhere
else. Every stream infermesh creates gets ``max_bytes`` = its share of it (``store_caps``), and the server's
``max_file_store`` is that total plus headroom (``max_file_store``). JetStream reserves a stream's ``max_bytes``
against ``max_file_store`` when the stream is created (it refuses one that does not fit: err 10047), so with every
stream capped, no stream can take another's room: when the files store is full (its writes fail with err 10077),
usage publishes and lease writes still have theirs (tests/integration/test_storage_caps.py checks it on a real
nats-server). A stream with no ``max_bytes`` would break that: it can fill the unreserved room and then every
write fails (err 10023), so every stream the mesh makes has one.

| stream or bucket                           | share | at 16 GiB  | when full                                    |
|--------------------------------------------|-------|------------|----------------------------------------------|
| ``OBJ_<ns>_files`` (/v1/files)             | 50 %  | 8 GiB      | uploads refused (503); per-team quotas first |
| ``<ns>_batch_results``                     | 20 %  | 3.2 GiB    | new results refused (30 days kept)           |
| ``<ns>_batch_submit``                      | 5 %   | 819 MiB    | new submissions refused (the client told)    |
| ``<ns>_batch_events``                      | 2 %   | 328 MiB    | job record changes refused                   |
| ``<ns>_usage``                             | 10 %  | 1.6 GiB    | new usage refused: kept in the edges' outbox |
| ``<ns>_usage_dlq``                         | 2 %   | 328 MiB    | new dead letters refused (metering retries)  |
| ``<ns>_orphans``                           | 3 %   | 492 MiB    | new reports refused (the worker keeps them)  |
| each KV bucket (8: workers, leases, ...)   | 1 %   | 164 MiB    | writes refused                               |

Every stream refuses new messages when full (``discard: new``), never dropping its oldest: nothing unread (usage,
a report, a result) is evicted by a flood of something else; its age limit still expires old ones. A namespace's
streams are created once; one that exists keeps its own limits (an operator changes them with
``nats stream edit --max-bytes``). The test suite sets a small budget (tests/conftest.py): every test namespace
on its shared server reserves its own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

ENV = "INFERMESH_STORE_BYTES"
DEFAULT_STORE_BYTES = 16 << 30
MIN_STORE_BYTES = 16 << 20  # below this a KV bucket's share could not hold a few records
HEADROOM = 1.25  # max_file_store over the namespace's total: nats' own metadata, an operator's streams


@dataclass(frozen=True, slots=True)
class StoreCaps:
    """``max_bytes`` of each stream kind of one namespace."""

    files: int
    batch_results: int
    batch_submit: int
    batch_events: int
    usage: int
    usage_dead_letters: int
    orphans: int
    kv_bucket: int  # each of bus_roles.buckets()

    def total(self, kv_buckets: int = 8) -> int:
        return (self.files + self.batch_results + self.batch_submit + self.batch_events + self.usage
                + self.usage_dead_letters + self.orphans + kv_buckets * self.kv_bucket)


def store_bytes(env: Mapping[str, str] | None = None) -> int:
    env = os.environ if env is None else env
    text = env.get(ENV, "").strip()
    if not text:
        return DEFAULT_STORE_BYTES
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{ENV} must be a whole number of bytes, not {text!r}") from None
    if value < MIN_STORE_BYTES:
        raise ValueError(f"{ENV} must be at least {MIN_STORE_BYTES} bytes, not {value}")
    return value


def store_caps(env: Mapping[str, str] | None = None) -> StoreCaps:
    total = store_bytes(env)

    def share(percent: int) -> int:
        return total * percent // 100

    return StoreCaps(files=share(50), batch_results=share(20), batch_submit=share(5), batch_events=share(2),
                     usage=share(10), usage_dead_letters=share(2), orphans=share(3), kv_bucket=share(1))


def max_file_store(env: Mapping[str, str] | None = None, namespaces: int = 1) -> int:
    """The server's ``jetstream.max_file_store``: every namespace's caps, and headroom."""
    return int(store_caps(env).total() * namespaces * HEADROOM)
