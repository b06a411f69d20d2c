"""loadtests/lib/migration_report.py: a hit stream's stall and resumed token, and billing against the clients."""

from __future__ import annotations

import pytest

from loadtests.lib.migration_report import Kill, Seen, markdown_tables, overall, phase_report

TEXT = "abcdefgh"


def stream(index: int, times: list[float], *, error: str = "", told: int | None = None) -> Seen:
    return Seen(index, f"r{index}", TEXT[:len(times)], times, None if error else "length",
                None if told is None else {"prompt_tokens": 3, "completion_tokens": told}, error,
                ended=times[-1] + (0.5 if error else 0.0))  # a cut stream's error comes 0.5 s after its last chunk


def row(request_id: str, completion: int, migrations: int = 0) -> dict:
    return {"request_id": request_id, "completion_tokens": completion, "migrations": migrations,
            "migration_prefill_tokens": 10 * migrations}


@pytest.mark.parametrize(("times", "median_s", "gap_s"), [
    ([1.0, 1.1, 3.0, 3.1], 1.0, 1.9),  # killed at 2.0: the next chunk ends the stall
    ([1.0, 2.05, 4.0, 4.1], 2.0, 1.95),  # one chunk on its way at the kill comes first: the stall is after it
])
def test_the_resumed_token_ends_the_longest_gap_after_the_kill(times, median_s, gap_s):
    seen = [stream(0, times, told=len(times))]
    kill = Kill("w0", 2.0, 0.5, ["r0"], 0, [2], "w1")
    report = phase_report("migration", seen, [kill], {"r0": [row("r0", len(times), 1)]}, {0: TEXT[:4]}, 0.0, 4)
    assert report["kill_to_next_token"]["median_s"] == pytest.approx(median_s)
    assert report["gap_around_kill"]["median_s"] == pytest.approx(gap_s)
    assert report["exact"] == 1 and report["migrations"] == 1 and report["billed_once"] == 1


def test_a_second_kills_stall_is_its_own():
    """Killed at 2.0 (resumed at 3.0) and again at 3.2 (resumed at 5.0): each kill has its own stall."""
    times = [1.9, 3.0, 3.1, 5.0, 5.1]
    kills = [Kill("w0", 2.0, 0.3, ["r0"], 0, [1], "w1"), Kill("w1", 3.2, 0.6, ["r0"], 1, [3], "w2")]
    report = phase_report("migration", [stream(0, times, told=5)], kills, {"r0": [row("r0", 5, 2)]}, {}, 0.0, 5)
    first, second = report["kills"]
    assert first["kill_to_next_token"]["max_s"] == pytest.approx(1.0)
    assert second["kill_to_next_token"]["max_s"] == pytest.approx(1.8)
    assert report["gap_around_kill"]["max_s"] == pytest.approx(1.9)  # 3.1 -> 5.0


def test_rows_are_billed_once_lost_doubled_or_short():
    seen = [stream(0, [0.1, 0.2], told=2), stream(1, [0.1, 0.2], told=2), stream(2, [0.1, 0.2], told=2),
            stream(3, [0.1, 0.2, 0.3], error="engine_error"), stream(4, [0.1, 0.2, 0.3], error="engine_error")]
    rows = {"r0": [row("r0", 2)], "r2": [row("r2", 2), row("r2", 2)], "r3": [row("r3", 4)], "r4": [row("r4", 2)]}
    kill = Kill("w0", 0.25, 0.5, ["r3", "r4"], 0, [2, 2], "w1")
    report = phase_report("control", seen, [kill], rows, {i: TEXT for i in range(5)}, 0.0, 2)
    assert (report["billed_once"], report["lost"], report["doubled"], report["mismatched"]) == (2, 1, 1, 1)
    assert report["errors"] == {"engine_error": 2} and report["kills"][0]["went_on"] == 0  # cut: no resumed token
    assert report["kills"][0]["cut"] == 2 and report["kills"][0]["kill_to_client_error"]["max_s"] == pytest.approx(0.55)
    assert report["cut_streams"] == 2 and report["cut_text_prefix_of_undisturbed"] == 2
    total = overall([report, report])
    assert total["requests"] == 10 and total["errors"] == {"engine_error": 4}
    tables = markdown_tables({"phases": [report], "overall": total})
    assert "| control | 1 | w0 |" in tables and "| overall | 10 |" in tables
