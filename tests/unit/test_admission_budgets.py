"""Team budgets at admission (pure, on a fake clock): reserve the worst case, hold actual costs until the ledger
has them (never dropped by age), keep a dead edge's worst case until the ledger shows its usage or that none came."""

from __future__ import annotations

import pytest

from services.admission.budgets import FLOOR_SETTLE_S, NO_CHANGE, Budgets, HoldChanges, OverBudget, month_of
from shared.schema import BudgetHold, ModelPrice, PriceSheet, TeamSpend

NOW = 1_764_500_000.0  # 2025-11-30 UTC
PRICE = ModelPrice(input_micros=1_000_000, cached_input_micros=100_000, output_micros=4_000_000)  # $1 / $0.1 / $4


def book(budget_nano: int = 1_000_000, spent_nano: int = 0, through: int = 0) -> Budgets:
    budgets = Budgets()
    budgets.on_prices(PriceSheet({"m": PRICE}))
    budgets.on_spend(TeamSpend("t", month_of(NOW), budget_nano, spent_nano, through), NOW)
    return budgets


def ledger(budgets: Budgets, spent_nano: int, through: int, now: float = NOW, team: str = "t",
           budget_nano: int = 1_000_000) -> HoldChanges:
    """Metering publishes a team's record: the ledger has its spend through ``through``."""
    return budgets.on_spend(TeamSpend(team, month_of(now), budget_nano, spent_nano, through), now)


def test_worst_case_is_prompt_at_input_price_plus_max_tokens_at_output_price():
    assert book().worst_case_nano("m", 100, 50) == 100_000 + 200_000  # nano-USD
    assert book().worst_case_nano("unpriced", 100, 50) == 0


def test_reservations_count_until_the_budget_is_reached_then_over_budget():
    budgets = book(budget_nano=1_000_000)
    results = [budgets.admit(f"l{i}", "t", "m", 100, 50, NOW) for i in range(5)]
    assert results[:4] == [300_000] * 4  # 0, 0.3, 0.6, 0.9 committed < 1.0 at each admission
    assert isinstance(results[4], OverBudget) and "budget" in results[4].message
    assert budgets.committed_nano("t", NOW) == 1_200_000  # overshoot bounded by one request


def test_a_team_without_a_budget_is_never_refused():
    budgets = book(budget_nano=-1)
    assert all(budgets.admit(f"l{i}", "t", "m", 10_000, 10_000, NOW) > 0 for i in range(100))
    fresh = Budgets()
    assert fresh.admit("x", "unknown-team", "m", 1, 1, NOW) == 0


def test_release_turns_the_reservation_into_the_actual_cost_until_the_ledger_has_it():
    budgets = book(budget_nano=1_000_000, spent_nano=100_000, through=10)
    budgets.admit("l1", "t", "m", 100, 50, NOW)
    assert budgets.committed_nano("t", NOW) == 100_000 + 300_000
    changes = budgets.release("l1", "m", usage_seq=12, prompt=100, cached=60, completion=5)
    actual = 40 * 1_000 + 60 * 100 + 5 * 4_000
    assert changes == HoldChanges(put=(BudgetHold("l1", "t", actual, 12),))  # the service persists it
    assert budgets.committed_nano("t", NOW) == 100_000 + actual
    assert ledger(budgets, 100_000 + actual, 11) == NO_CHANGE  # ledger not there yet
    assert budgets.committed_nano("t", NOW) == 100_000 + 2 * actual  # counted twice: conservative, briefly
    assert ledger(budgets, 100_000 + actual, 12) == HoldChanges(gone=("l1",))
    assert budgets.committed_nano("t", NOW) == 100_000 + actual


def test_release_without_usage_gives_the_reservation_back():
    budgets = book()
    budgets.admit("l1", "t", "m", 100, 50, NOW)
    assert budgets.release("l1", "m", usage_seq=0, prompt=0, cached=0, completion=0) == NO_CHANGE
    assert budgets.committed_nano("t", NOW) == 0
    budgets.admit("l2", "t", "m", 100, 50, NOW)
    budgets.drop("l2")
    budgets.drop("l2")  # twice is harmless
    assert budgets.committed_nano("t", NOW) == 0


def test_usage_already_in_the_ledger_is_not_held_again():
    budgets = book(through=50)
    budgets.admit("l1", "t", "m", 100, 50, NOW)
    assert budgets.release("l1", "m", usage_seq=40, prompt=100, cached=0, completion=50) == NO_CHANGE
    assert budgets.committed_nano("t", NOW) == 0


def test_a_hold_older_than_300_s_with_the_ledger_behind_still_counts():
    budgets = book(budget_nano=600_000, through=10)
    budgets.admit("l1", "t", "m", 100, 50, NOW)
    budgets.release("l1", "m", usage_seq=12, prompt=100, cached=0, completion=50)  # 300_000 held
    for later in (301.0, 3_600.0, 36_000.0):  # the ledger is away: its records stay behind
        assert ledger(budgets, 0, 11, NOW + later, budget_nano=600_000) == NO_CHANGE
        assert budgets.settle(NOW + later) == NO_CHANGE
        assert budgets.committed_nano("t", NOW + later) == 300_000
    budgets.admit("l2", "t", "m", 100, 50, NOW + 36_000)  # 300_000 + 300_000 reach the budget
    assert isinstance(budgets.admit("l3", "t", "m", 1, 1, NOW + 36_000), OverBudget)
    budgets.drop("l2")
    assert ledger(budgets, 300_000, 12, NOW + 36_001, budget_nano=600_000) == HoldChanges(gone=("l1",))
    assert budgets.committed_nano("t", NOW + 36_001) == 300_000  # once, from the ledger


def test_a_lapsed_lease_keeps_its_worst_case_until_the_ledger_shows_none_came():
    budgets = book(through=10)
    budgets.admit("l1", "t", "m", 100, 50, NOW)
    assert budgets.lapse("l1", last_usage_seq=20) == HoldChanges(put=(BudgetHold("l1", "t", 300_000, 20),))
    assert budgets.reserved_nano("l1") == 0 and budgets.held_nano("t") == 300_000
    assert ledger(budgets, 0, 19) == NO_CHANGE
    assert budgets.committed_nano("t", NOW) == 300_000
    assert ledger(budgets, 0, 20) == HoldChanges(gone=("l1",))  # complete through the lapse: no usage came
    assert budgets.committed_nano("t", NOW) == 0


def test_a_lapsed_lease_whose_usage_reached_the_ledger_counts_once():
    budgets = book(through=10)
    budgets.admit("l1", "t", "m", 100, 50, NOW)
    budgets.lapse("l1", last_usage_seq=20)  # the dead edge had published its usage at seq 15
    assert ledger(budgets, 120_000, 15) == NO_CHANGE  # in the spend, but the bound is not reached yet
    assert budgets.committed_nano("t", NOW) == 120_000 + 300_000  # counted twice: conservative, briefly
    ledger(budgets, 120_000, 20)
    assert budgets.committed_nano("t", NOW) == 120_000


def test_a_release_after_the_lease_lapsed_keeps_the_hold_until_its_usage_is_in():
    budgets = book()
    budgets.admit("l1", "t", "m", 100, 50, NOW)
    budgets.lapse("l1", last_usage_seq=20)
    assert budgets.release("l1", "m", 25, 100, 0, 50) == HoldChanges(put=(BudgetHold("l1", "t", 300_000, 25),))
    assert budgets.release("l1", "m", 0, 0, 0, 0) == NO_CHANGE
    assert ledger(budgets, 0, 20) == NO_CHANGE and budgets.held_nano("t") == 300_000
    assert ledger(budgets, 300_000, 25) == HoldChanges(gone=("l1",))


def test_the_ledger_floor_clears_a_hold_once_it_has_settled():
    budgets = book(through=10)
    budgets.admit("l1", "t", "m", 100, 50, NOW)
    budgets.lapse("l1", last_usage_seq=20)
    ledger(budgets, 5_000, 30, team="other")  # metering synced every team at 30; "t" had nothing new
    assert budgets.settle(NOW + FLOOR_SETTLE_S - 0.1) == NO_CHANGE  # the rest of that sync may be in flight
    assert budgets.held_nano("t") == 300_000
    assert budgets.settle(NOW + FLOOR_SETTLE_S) == HoldChanges(gone=("l1",))
    assert budgets.committed_nano("t", NOW) == 0
    budgets.admit("l2", "t", "m", 100, 50, NOW)
    assert budgets.release("l2", "m", 29, 100, 0, 50) == NO_CHANGE  # under the floor: the ledger has it


def test_a_replica_that_never_ticks_keeps_only_the_floor_it_has_not_settled():
    budgets = book()
    for i in range(1, 1_001):  # a standby hears every record; only the leader calls settle
        ledger(budgets, 0, i, NOW + i, team=f"team-{i % 7}")
    assert len(budgets._floor_seen) <= FLOOR_SETTLE_S + 1


def test_a_new_leader_restores_holds_and_drops_those_the_ledger_passed():
    budgets = book(budget_nano=500_000, through=10)
    budgets.admit("l1", "t", "m", 100, 50, NOW)
    budgets.release("l1", "m", 12, 100, 0, 50)
    budgets.forget_leader_state()  # deposed: the next leader reads the bucket
    assert budgets.committed_nano("t", NOW) == 0
    assert budgets.restore_hold(BudgetHold("l1", "t", 300_000, 12)) == NO_CHANGE
    assert budgets.restore_hold(BudgetHold("l0", "t", 900_000, 9)) == HoldChanges(gone=("l0",))  # already ledgered
    assert budgets.committed_nano("t", NOW) == 300_000
    budgets.restore_reservation("l2", "t", 200_000)
    assert isinstance(budgets.admit("l3", "t", "m", 1, 1, NOW), OverBudget)  # holds + reservations reach it


def test_teams_without_a_budget_and_free_requests_keep_no_holds():
    budgets = book(budget_nano=-1)
    budgets.admit("l1", "t", "m", 100, 50, NOW)
    assert budgets.release("l1", "m", 12, 100, 0, 50) == NO_CHANGE  # never refused: nothing to protect
    budgets = book()
    budgets.admit("l2", "t", "unpriced", 100, 50, NOW)
    assert budgets.release("l2", "unpriced", 12, 100, 0, 50) == NO_CHANGE
    assert budgets.lapse("unknown", 12) == NO_CHANGE


def test_last_months_spend_does_not_count_this_month():
    budgets = Budgets()
    budgets.on_prices(PriceSheet({"m": PRICE}))
    budgets.on_spend(TeamSpend("t", "1999-01", 1_000_000, 5_000_000, 0), NOW)
    assert budgets.committed_nano("t", NOW) == 0
    assert budgets.admit("l1", "t", "m", 100, 50, NOW) == 300_000


def test_a_new_leader_restores_reservations_from_lease_records():
    budgets = book(budget_nano=500_000)
    budgets.admit("l1", "t", "m", 100, 50, NOW)
    budgets.forget_leader_state()
    assert budgets.committed_nano("t", NOW) == 0 and budgets.reserved_nano("l1") == 0
    budgets.restore_reservation("l1", "t", 300_000)
    assert budgets.reserved_nano("l1") == 300_000
    assert isinstance(budgets.admit("l2", "t", "m", 100, 50, NOW), int)
    assert isinstance(budgets.admit("l3", "t", "m", 100, 50, NOW), OverBudget)


@pytest.mark.parametrize("now,month", [(0.0, "1970-01"), (NOW, "2025-11"), (1_767_225_599.0, "2025-12")])
def test_month_is_utc(now, month):
    assert month_of(now) == month
