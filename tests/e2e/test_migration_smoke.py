"""The migration benchmark (loadtests/migration.py), small: 4 streams, one SIGKILL at a third of the way, with
migration on and in the control (``X-Infermesh-Max-Migrations: 0``)."""

from __future__ import annotations

import pytest

from loadtests import migration

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
REQUESTS = 4


async def test_a_worker_killed_under_four_streams_leaves_them_whole_and_cuts_the_controls(nats_url):
    args = migration.parse_args(["--requests", str(REQUESTS), "--kill-at", "0.33", "--nats-url", nats_url])
    report = await migration.main_async(args)
    undisturbed, migrated, control = report["phases"]

    assert migration.failures(report) == []
    assert [p["hung"] for p in report["phases"]] == [0, 0, 0]
    assert undisturbed["completed"] == undisturbed["full_length"] == REQUESTS
    assert migrated["errors"] == {} and migrated["completed"] == REQUESTS
    assert migrated["exact"] == REQUESTS  # token-exact: each text is the undisturbed one
    (kill,) = migrated["kills"]
    assert kill["hit"] >= 1 and kill["went_on"] == kill["hit"]
    assert migrated["migrations"] == migrated["migrated_requests"] == kill["hit"]
    assert migrated["migration_prefill_tokens"] > 0
    for phase in report["phases"]:  # one usage row a request, with the tokens its client was told
        assert phase["usage_rows"] == phase["billed_once"] == REQUESTS
        assert phase["billed_told_completion_tokens"] == phase["told_completion_tokens"]
    (cut,) = control["kills"]
    assert sum(control["errors"].values()) == control["cut_streams"] == cut["cut"] == cut["hit"] >= 1  # all cut
    assert control["cut_text_prefix_of_undisturbed"] == cut["hit"] and control["migrations"] == 0
