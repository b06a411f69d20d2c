"""The usage outbox: its pure core (entries and journal records, replay, compaction; the checkpoint clock on a
fake clock) and its file (group commit, the slot lock, a torn last write, a failed write)."""

from __future__ import annotations

import asyncio
import os

import pytest

from shared import usage_journal
from shared.schema import UsageEvent
from shared.usage_journal import JournalLocked, UsageJournal
from shared.usage_outbox import CheckpointClock, Outbox


def event(request_id: str, completion: int, status: str = "finished") -> UsageEvent:
    reason = "stop" if status == "finished" else "abort"
    return UsageEvent(request_id, 0, "t", "", "m", status, reason, 10, 0, completion, 1.0, 2.0, "w-1")  # type: ignore[arg-type]


class Recording(Outbox):
    """An Outbox that keeps the lines it handed out (the journal file, without a file)."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[bytes] = []

    def put(self, entry, kind, event):  # type: ignore[no-untyped-def]
        return self._keep(super().put(entry, kind, event))

    def retire(self, entry):  # type: ignore[no-untyped-def]
        return self._keep(super().retire(entry))

    def _keep(self, line: bytes | None) -> bytes | None:
        if line is not None:
            self.lines.append(line)
        return line


def replayed(outbox: Recording) -> list[tuple[int, str, int]]:
    """What a restarted edge would publish from ``outbox``'s journal: (entry, kind, completion tokens)."""
    fresh = Outbox()
    fresh.load(b"".join(outbox.lines))
    return [(r.id, r.kind, r.event.completion_tokens) for r in fresh.live()]  # type: ignore[union-attr]


@pytest.mark.parametrize("steps, expected", [
    ([], []),
    ([("checkpoint", 1)], [("checkpoint", 1)]),  # killed mid-stream: billed what it had delivered
    ([("checkpoint", 1), ("checkpoint", 7)], [("checkpoint", 7)]),  # the latest checkpoint
    ([("checkpoint", 7), ("final", 9)], [("final", 9)]),  # killed after the end, before the ack
    ([("final", 9), ("checkpoint", 3)], [("final", 9)]),  # a final is last: a late checkpoint changes nothing
    ([("checkpoint", 7), ("final", 9), ("retired", 0)], []),  # acknowledged by JetStream: nothing to replay
    ([("checkpoint", 7), ("retired", 0)], []),  # not billable (a preempted batch line): retired unpublished
])
def test_what_a_restarted_edge_replays(steps, expected):
    outbox = Recording()
    entry = outbox.open()
    for kind, completion in steps:
        if kind == "retired":
            outbox.retire(entry)
        else:
            outbox.put(entry, kind, event("r", completion))
    assert replayed(outbox) == [(entry, kind, completion) for kind, completion in expected]


def test_entries_keep_their_ids_across_restarts_and_new_ones_never_reuse_them():
    outbox = Recording()
    first, second = outbox.open(), outbox.open()
    outbox.put(first, "final", event("a", 1))
    outbox.put(second, "final", event("b", 2))
    outbox.retire(second)
    restarted = Outbox()
    restarted.load(b"".join(outbox.lines))
    assert [r.id for r in restarted.live()] == [first]
    assert restarted.open() > second  # a retired id is never handed out again
    assert restarted.retire(first) is not None  # the replayed entry is retired by id once published


def test_a_torn_last_line_is_skipped_and_the_rest_is_replayed():
    outbox = Recording()
    entry = outbox.open()
    outbox.put(entry, "final", event("a", 4))
    torn = outbox.lines[0] + outbox.lines[0][:20]  # the edge died mid-write
    restarted = Outbox()
    assert restarted.load(torn) == 1
    assert [r.event.request_id for r in restarted.live()] == ["a"]  # type: ignore[union-attr]


def test_compaction_is_due_once_dead_records_outnumber_live_ones_and_keeps_the_live_ones():
    outbox = Outbox()
    live = outbox.open()
    outbox.put(live, "checkpoint", event("live", 1))
    for i in range(5000):
        entry = outbox.open()
        outbox.put(entry, "final", event(f"r{i}", 1))
        outbox.retire(entry)
        if outbox.should_compact():
            break
    assert outbox.should_compact()
    data = outbox.compacted()
    assert not outbox.should_compact()
    restarted = Outbox()
    restarted.load(data)
    assert [r.event.request_id for r in restarted.live()] == ["live"]  # type: ignore[union-attr]


@pytest.mark.parametrize("times, due", [
    ([0.0], [True]),  # the first token
    ([0.0, 0.1, 0.49], [True, False, False]),
    ([0.0, 0.5, 0.6, 1.0], [True, True, False, True]),  # at most every interval, from the last checkpoint
    ([0.0, 3.0], [True, True]),  # a stall, then a token: at once
])
def test_the_checkpoint_clock(times, due):
    clock = CheckpointClock(interval_s=0.5)
    assert [clock.due(now) for now in times] == due


# ------------------------------------------------------------------ the file

async def test_concurrent_finals_share_one_fsync_and_survive_a_reopen(tmp_path, monkeypatch):
    syncs: list[int] = []
    real = os.fdatasync
    monkeypatch.setattr(usage_journal.os, "fdatasync", lambda fd: (syncs.append(fd), real(fd)))
    journal = UsageJournal.open(tmp_path)
    await journal.start()
    entries = [journal.outbox.open() for _ in range(50)]
    assert all(await asyncio.gather(*(journal.commit(e, "final", event(f"r{e}", e)) for e in entries)))
    assert len(syncs) <= 2  # one group commit (two if the first flush began before the rest were queued)
    journal.write(entries[0], "retired")
    await journal.stop()
    reopened = UsageJournal.open(tmp_path)
    assert [r.id for r in reopened.outbox.live()] == entries[1:]
    await reopened.stop()


async def test_one_journal_is_held_by_one_edge_at_a_time(tmp_path):
    journal = UsageJournal.open(tmp_path)
    with pytest.raises(JournalLocked):
        UsageJournal.open(tmp_path)  # two edges of one slot would replay its usage twice
    await journal.stop()
    await UsageJournal.open(tmp_path).stop()  # released: the slot's next edge takes it


async def test_a_failed_write_is_reported_and_the_next_commit_rewrites_the_journal_whole(tmp_path, monkeypatch):
    journal = UsageJournal.open(tmp_path)
    await journal.start()
    real = os.fdatasync
    failing = {"left": 1}

    def disk_full(fd: int) -> None:
        if failing["left"]:
            failing["left"] -= 1
            raise OSError(28, "No space left on device")
        real(fd)

    monkeypatch.setattr(usage_journal.os, "fdatasync", disk_full)
    first, second = journal.outbox.open(), journal.outbox.open()
    assert not await journal.commit(first, "final", event("a", 1))  # the response is served, its usage kept in memory
    assert await journal.commit(second, "final", event("b", 2))
    assert journal.stats["write_errors"] == 1 and journal.stats["compactions"] == 1
    await journal.stop()
    reopened = UsageJournal.open(tmp_path)
    assert [r.event.request_id for r in reopened.outbox.live()] == ["a", "b"]  # type: ignore[union-attr]
    assert reopened.stats["torn"] == 0
    await reopened.stop()
