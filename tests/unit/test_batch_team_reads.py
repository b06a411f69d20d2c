"""The batch service's answers to a team's reads, their pure parts (services/batch/team_reads.py): who waits on
which job, a team's follows at once, the team taken from the subject, a job id checked, a record's revision."""

from __future__ import annotations

import pytest

from services.batch.team_reads import BadRead, JobWatches, TeamSlots, checked_job_id, revision_of, team_and_read
from shared.batch_schema import BatchJobRecord, BatchRequestCounts


def record(**fields) -> BatchJobRecord:
    return BatchJobRecord(id="batch_1", team="kappa", endpoint="/v1/chat/completions", input_file_id="f",
                          created_at=1, expires_at=2, **fields)


async def test_a_change_wakes_the_watchers_of_that_job_only_and_a_watch_ends_clean():
    watches = JobWatches()
    with watches.watch("kappa", "batch_1") as mine, watches.watch("lambda", "batch_1") as theirs:
        assert len(watches) == 2
        watches.changed("kappa", "batch_1")
        assert mine.is_set() and not theirs.is_set()  # the same job id of another team: not its change
        watches.wake_all()
        assert theirs.is_set()
    assert len(watches) == 0
    watches.changed("kappa", "batch_1")  # nobody waits: nothing to wake


@pytest.mark.parametrize("takes, gives_back, team, expected", [
    (["kappa"] * 2, [], "kappa", False),  # its two at once: a third is refused
    (["kappa"] * 2, [], "lambda", True),  # another team's follows are its own
    (["kappa"] * 2, ["kappa"], "kappa", True),  # one ended: room again
])
def test_a_team_follows_at_most_its_limit_at_once(takes, gives_back, team, expected):
    slots = TeamSlots(2)
    assert all(slots.take(t) for t in takes)
    for t in gives_back:
        slots.give_back(t)
    assert slots.take(team) is expected


def test_the_team_is_the_subjects_and_a_job_id_is_one_token():
    assert team_and_read("im.batch.team.kappa.follow") == ("kappa", "follow")
    assert checked_job_id("batch_1") == "batch_1"
    for bad in ("", "a.b", "x" * 65, "a b"):
        with pytest.raises(BadRead):
            checked_job_id(bad)


def test_a_revision_changes_with_the_record_and_none_has_none():
    assert revision_of(None) == ""
    assert revision_of(record()) == revision_of(record())
    assert revision_of(record(request_counts=BatchRequestCounts(total=2, completed=1))) != revision_of(record())

