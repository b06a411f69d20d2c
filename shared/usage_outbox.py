"""The edge's usage outbox, pure: which usage is not yet in the usage stream, as its journal records it.

Each billable response is an *entry* (an id, unique within the journal's life, restarts included). While a
stream runs, its entry holds a **checkpoint** (what was delivered so far, billed as a cancelled request were the
edge to die); once the response ended it holds the **final** usage, written (and fsynced, by
``shared/usage_journal.py``) before the response's last byte is sent; once JetStream acknowledged the usage
publish the entry is **retired**. The journal is one record a line (``OutboxRecord`` as JSON):

| record                   | effect on the entry                                                      |
|--------------------------|--------------------------------------------------------------------------|
| checkpoint (id, event)   | holds ``event``, unless it already holds a final (a final is last)        |
| final (id, event)        | holds ``event`` for good                                                 |
| retired (id)             | gone: its usage is in the stream (or was not billable)                   |

On start the edge replays every entry the journal still holds (``live``): each is published once more; the
stream's ``Nats-Msg-Id`` and the ledger's unique (request_id, attempt) make one already published harmless.
A torn last line (the edge died mid-write) is skipped. ``compacted`` rewrites the journal as its live entries
once it holds many more dead records than live ones.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import msgspec

from shared.schema import UsageEvent

log = logging.getLogger("infermesh.usage")
RecordKind = Literal["checkpoint", "final", "retired"]
COMPACT_MIN_DEAD = 4096  # dead records before a compaction is worth it
COMPACT_DEAD_PER_LIVE = 4  # ... and at least this many dead records per live entry
CHECKPOINT_INTERVAL_S = 0.5  # a stream's delivered usage is recorded at its first token, then at most this often


class OutboxRecord(msgspec.Struct, frozen=True, omit_defaults=True):
    id: int
    kind: RecordKind
    event: UsageEvent | None = None


_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder(OutboxRecord).decode


def record_line(record: OutboxRecord) -> bytes:
    return _encode(record) + b"\n"


class Outbox:
    """The live entries and the journal records that change them. No I/O: ``put``/``retire`` return the line
    to append (None: nothing changes), ``load`` reads a journal's bytes."""

    def __init__(self) -> None:
        self.entries: dict[int, OutboxRecord] = {}  # id -> its latest checkpoint or its final
        self.next_id = 1
        self.dead = 0  # records in the journal that no longer describe a live entry
        self._open: set[int] = set()  # entries opened and not retired (a checkpoint is taken only for these)

    def load(self, data: bytes) -> int:
        """Apply a journal's records; returns how many lines could not be read (a torn last write)."""
        bad = 0
        for line in data.split(b"\n"):
            if not line.strip():
                continue
            try:
                record = _decode(line)
            except (msgspec.DecodeError, msgspec.ValidationError):
                bad += 1
                continue
            self.next_id = max(self.next_id, record.id + 1)
            self._apply(record, loading=True)
        return bad

    def open(self) -> int:
        entry = self.next_id
        self.next_id += 1
        self._open.add(entry)
        return entry

    def put(self, entry: int, kind: RecordKind, event: UsageEvent) -> bytes | None:
        assert kind != "retired"
        if entry not in self._open or (kind == "checkpoint" and self.is_final(entry)):
            return None
        return self._change(OutboxRecord(entry, kind, event))

    def retire(self, entry: int) -> bytes | None:
        if entry not in self._open:
            return None
        return self._change(OutboxRecord(entry, "retired"))

    def is_final(self, entry: int) -> bool:
        record = self.entries.get(entry)
        return record is not None and record.kind == "final"

    def live(self) -> list[OutboxRecord]:
        """The entries to replay on start, oldest first."""
        return [self.entries[entry] for entry in sorted(self.entries)]

    def should_compact(self) -> bool:
        return self.dead >= COMPACT_MIN_DEAD and self.dead >= COMPACT_DEAD_PER_LIVE * len(self.entries)

    def compacted(self) -> bytes:
        """The journal rewritten as its live entries (its dead records forgotten)."""
        self.dead = 0
        return b"".join(record_line(record) for record in self.live())

    def _change(self, record: OutboxRecord) -> bytes:
        self._apply(record, loading=False)
        return record_line(record)

    def _apply(self, record: OutboxRecord, loading: bool) -> None:
        had = record.id in self.entries
        if record.kind == "retired":
            self.entries.pop(record.id, None)
            self._open.discard(record.id)
            self.dead += 1 + had  # the retire record and the entry's own
            return
        if record.kind == "checkpoint" and self.is_final(record.id):
            self.dead += 1
            return
        self.entries[record.id] = record
        self.dead += had
        if loading:
            self._open.add(record.id)


@dataclass(slots=True)
class CheckpointClock:
    """When a running stream's delivered usage is recorded next: at its first token, then every ``interval_s``
    (an edge killed mid-stream is billed what it delivered up to its last checkpoint)."""

    interval_s: float = CHECKPOINT_INTERVAL_S
    last_at: float | None = None

    def due(self, now: float) -> bool:
        if self.last_at is not None and now - self.last_at < self.interval_s:
            return False
        self.last_at = now
        return True
