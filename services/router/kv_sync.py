"""Keeping the index in step with each worker's KV event stream, pure: what to do with each batch.

Batches arrive numbered 1, 2, 3, ... per worker (``KvEventBatch.seq``). The tracker applies
them in order and says when the router must catch up from the worker::

    state       batch seq            action
    synced      last + 1             apply it
    synced      <= last              drop it (duplicate or late)
    synced      > last + 1           gap: hold it, ask the worker to replay after ``last``
    synced      1 while last > 1     the worker restarted: resync from a snapshot
    synced      load says kv_seq > last  the tail was lost (no later batch shows the gap): replay
    catching up any                  hold it until the replay or snapshot is in
    new worker  any                  hold it, bootstrap from a snapshot

After a snapshot taken at seq S (or a replay up to S), ``caught_up(S)`` hands back the held
batches after S, in order, to apply; a hole among them starts another catch-up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from shared.schema import KvEventBatch


class Action(Enum):
    APPLY = "apply"
    DROP = "drop"
    HOLD = "hold"  # a catch-up is under way
    REPLAY = "replay"  # gap: replay after ``last_seq``
    SNAPSHOT = "snapshot"  # new or restarted worker: load a snapshot


@dataclass(slots=True)
class _Stream:
    last_seq: int = 0
    catching_up: bool = True  # a new stream needs a snapshot first
    restarted: bool = False  # the worker restarted during the catch-up: a snapshot is due
    held: dict[int, KvEventBatch] = field(default_factory=dict)


class KvSyncTracker:
    def __init__(self, max_held: int = 4096) -> None:
        self._streams: dict[str, _Stream] = {}
        self.max_held = max_held
        self.num_gaps = 0
        self.num_restarts = 0

    def last_seq(self, worker_id: str) -> int:
        stream = self._streams.get(worker_id)
        return stream.last_seq if stream else 0

    def start(self, worker_id: str) -> Action:
        """A worker appeared (or reappeared): bootstrap it from a snapshot."""
        self._streams[worker_id] = _Stream()
        return Action.SNAPSHOT

    def forget(self, worker_id: str) -> None:
        self._streams.pop(worker_id, None)

    def on_batch(self, batch: KvEventBatch) -> Action:
        stream = self._streams.get(batch.source_id)
        if stream is None:
            self._streams[batch.source_id] = stream = _Stream()
            stream.held[batch.seq] = batch
            return Action.SNAPSHOT
        if stream.catching_up:
            if batch.seq == 1 and stream.last_seq > 1 and not stream.restarted:
                self.num_restarts += 1  # restarted while we were catching up: the snapshot must be a new one
                stream.restarted = True
                stream.held = {1: batch}
                return Action.SNAPSHOT
            if len(stream.held) < self.max_held:
                stream.held[batch.seq] = batch
            return Action.HOLD
        if batch.seq == stream.last_seq + 1:
            stream.last_seq = batch.seq
            return Action.APPLY
        if batch.seq == 1 and stream.last_seq > 1:
            self.num_restarts += 1
            self._streams[batch.source_id] = stream = _Stream()
            stream.held[batch.seq] = batch
            return Action.SNAPSHOT
        if batch.seq <= stream.last_seq:
            return Action.DROP
        self.num_gaps += 1
        stream.catching_up = True
        stream.held[batch.seq] = batch
        return Action.REPLAY

    def on_position(self, worker_id: str, seq: int) -> Action:
        """The worker says its last batch is ``seq`` (in its load snapshots): a tail we never got is a gap.

        A batch still on its way is harmless to replay: it comes back as a duplicate and is dropped.
        """
        stream = self._streams.get(worker_id)
        if stream is None or stream.catching_up or seq <= stream.last_seq:
            return Action.DROP
        self.num_gaps += 1
        stream.catching_up = True
        return Action.REPLAY

    def applied(self, worker_id: str, seq: int) -> None:
        """A replayed batch up to ``seq`` went into the index (during a catch-up)."""
        stream = self._streams[worker_id]
        stream.last_seq = max(stream.last_seq, seq)

    def caught_up(self, worker_id: str, seq: int, snapshot: bool = False) -> tuple[list[KvEventBatch], bool]:
        """The index holds the worker's state as of ``seq`` (a snapshot's, or the last replayed batch's):
        the held batches to apply next, in order, and whether they run without a hole (False: replay
        again after ``last_seq``). A snapshot sets the position even backwards (a restarted worker)."""
        stream = self._streams.get(worker_id)
        if stream is None:
            return [], True
        if snapshot:
            stream.restarted = False
        stream.last_seq = seq if snapshot else max(stream.last_seq, seq)
        ready: list[KvEventBatch] = []
        for held_seq in sorted(stream.held):
            if held_seq <= stream.last_seq:
                continue
            if held_seq != stream.last_seq + 1:
                stream.held = {s: b for s, b in stream.held.items() if s > stream.last_seq}
                return ready, False
            ready.append(stream.held[held_seq])
            stream.last_seq = held_seq
        stream.held.clear()
        stream.catching_up = False
        return ready, True

    def needs_snapshot(self, worker_id: str) -> bool:
        """The worker restarted during a catch-up that has not loaded a snapshot since."""
        stream = self._streams.get(worker_id)
        return stream is not None and stream.restarted

    def is_catching_up(self, worker_id: str) -> bool:
        stream = self._streams.get(worker_id)
        return stream is None or stream.catching_up
