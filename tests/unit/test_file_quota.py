"""A team's file quota (shared/file_quota.py): holds, commits, releases and deletes on a fake clock."""

from __future__ import annotations

import pytest

from shared.file_quota import FileQuota, Hold, QuotaExceeded, TeamUsage, commit, release, remove_file, reserve

QUOTA = FileQuota(max_bytes=100, max_files=2)
T0 = 1_000.0


def test_an_upload_that_fits_is_held_then_committed_as_a_file():
    usage = reserve(TeamUsage(), QUOTA, "up-1", 40, T0, hold_s=10)
    assert usage.holds == {"up-1": Hold(40, T0 + 10)} and (usage.used_bytes(), usage.used_files()) == (40, 1)
    usage = reserve(usage, QUOTA, "up-1", 20, T0 + 5, hold_s=10)  # it grows: one file still, renewed
    assert usage.holds == {"up-1": Hold(60, T0 + 15)} and usage.used_files() == 1
    usage = commit(usage, "up-1", "file-a", 55)
    assert (usage.files, usage.holds, usage.used_bytes()) == ({"file-a": 55}, {}, 55)


@pytest.mark.parametrize("usage, upload, more, kind, used", [
    (TeamUsage({"file-a": 90}), "up-1", 11, "bytes", 90),               # the bytes would pass 100
    (TeamUsage({"file-a": 10, "file-b": 10}), "up-1", 1, "files", 2),   # a third file
    (TeamUsage({}, {"up-0": Hold(95, T0 + 1)}), "up-1", 6, "bytes", 95),  # another upload's hold counts
    (TeamUsage({"file-a": 10}, {"up-0": Hold(1, T0 + 1)}), "up-1", 1, "files", 2),    # and is a file
])
def test_what_would_pass_the_quota_is_refused_naming_it_and_nothing_changes(usage, upload, more, kind, used):
    with pytest.raises(QuotaExceeded) as refused:
        reserve(usage, QUOTA, upload, more, T0)
    assert (refused.value.kind, refused.value.used, refused.value.requested) == (kind, used, more if kind == "bytes"
                                                                                 else 1)
    assert refused.value.limit == (100 if kind == "bytes" else 2)


def test_a_hold_past_its_time_counts_no_more_an_edge_that_died_mid_upload_holds_nothing():
    usage = TeamUsage({"file-a": 10}, {"dead-edge": Hold(90, T0 + 1)})
    with pytest.raises(QuotaExceeded):
        reserve(usage, QUOTA, "up-1", 50, T0)
    usage = reserve(usage, QUOTA, "up-1", 50, T0 + 1)  # the dead upload's hold ended at T0 + 1
    assert set(usage.holds) == {"up-1"} and usage.used_bytes() == 60


def test_batch_output_is_counted_but_never_refused():
    usage = reserve(TeamUsage({"file-a": 100, "file-b": 0}), QUOTA, "out", 30, T0, enforce=False)
    assert (usage.used_bytes(), usage.used_files()) == (130, 3)


def test_release_and_delete_give_the_room_back_and_doing_either_twice_counts_once():
    usage = reserve(TeamUsage({"file-a": 60}), QUOTA, "up-1", 40, T0)
    usage = release(release(usage, "up-1"), "up-1")
    assert usage.holds == {} and usage.used_bytes() == 60
    usage = remove_file(remove_file(usage, "file-a"), "file-a")
    assert usage.files == {}
    usage = commit(commit(reserve(usage, QUOTA, "up-2", 70, T0), "up-2", "file-c", 70), "up-2", "file-c", 70)
    assert (usage.used_bytes(), usage.used_files()) == (70, 1)


def test_an_upload_of_unknown_length_holds_a_step_ahead_only_where_it_fits():
    usage = reserve(TeamUsage({"file-a": 70}), QUOTA, "up-1", 5, T0, wanted_bytes=20)
    assert usage.holds["up-1"].bytes == 20  # a step ahead
    usage = reserve(usage, QUOTA, "up-1", 5, T0, wanted_bytes=20)
    assert usage.holds["up-1"].bytes == 30  # the room left, not the step
    with pytest.raises(QuotaExceeded):
        reserve(usage, QUOTA, "up-1", 1, T0, wanted_bytes=20)
