"""Team budgets at admission (pure): reserve the worst case, hold actual costs until the ledger has them."""

from __future__ import annotations

import pytest

from services.admission.budgets import UNPOSTED_TTL_S, Budgets, OverBudget, month_of
from shared.schema import ModelPrice, PriceSheet, TeamSpend

NOW = 1_764_500_000.0  # 2025-11-30 UTC
PRICE = ModelPrice(input_micros=1_000_000, cached_input_micros=100_000, output_micros=4_000_000)  # $1 / $0.1 / $4


def book(budget_nano: int = 1_000_000, spent_nano: int = 0, through: int = 0) -> Budgets:
    budgets = Budgets()
    budgets.on_prices(PriceSheet({"m": PRICE}))
    budgets.on_spend(TeamSpend("t", month_of(NOW), budget_nano, spent_nano, through))
    return budgets


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
    budgets.release("l1", "m", usage_seq=12, prompt=100, cached=60, completion=5, now=NOW)
    actual = 40 * 1_000 + 60 * 100 + 5 * 4_000
    assert budgets.committed_nano("t", NOW) == 100_000 + actual
    budgets.on_spend(TeamSpend("t", month_of(NOW), 1_000_000, 100_000 + actual, 11))  # ledger not there yet
    assert budgets.committed_nano("t", NOW) == 100_000 + 2 * actual  # counted twice: conservative, briefly
    budgets.on_spend(TeamSpend("t", month_of(NOW), 1_000_000, 100_000 + actual, 12))
    assert budgets.committed_nano("t", NOW) == 100_000 + actual


def test_release_without_usage_gives_the_reservation_back():
    budgets = book()
    budgets.admit("l1", "t", "m", 100, 50, NOW)
    budgets.release("l1", "m", usage_seq=0, prompt=0, cached=0, completion=0, now=NOW)
    assert budgets.committed_nano("t", NOW) == 0
    budgets.admit("l2", "t", "m", 100, 50, NOW)
    budgets.drop("l2")
    budgets.drop("l2")  # twice is harmless
    assert budgets.committed_nano("t", NOW) == 0


def test_usage_already_in_the_ledger_is_not_held_again():
    budgets = book(through=50)
    budgets.admit("l1", "t", "m", 100, 50, NOW)
    budgets.release("l1", "m", usage_seq=40, prompt=100, cached=0, completion=50, now=NOW)
    assert budgets.committed_nano("t", NOW) == 0


def test_a_lost_usage_message_stops_being_held_after_the_ttl():
    budgets = book()
    budgets.admit("l1", "t", "m", 100, 50, NOW)
    budgets.release("l1", "m", usage_seq=99, prompt=100, cached=0, completion=50, now=NOW)
    budgets.expire(NOW + UNPOSTED_TTL_S - 1)
    assert budgets.committed_nano("t", NOW) == 300_000
    budgets.expire(NOW + UNPOSTED_TTL_S + 1)
    assert budgets.committed_nano("t", NOW) == 0


def test_last_months_spend_does_not_count_this_month():
    budgets = Budgets()
    budgets.on_prices(PriceSheet({"m": PRICE}))
    budgets.on_spend(TeamSpend("t", "1999-01", 1_000_000, 5_000_000, 0))
    assert budgets.committed_nano("t", NOW) == 0
    assert budgets.admit("l1", "t", "m", 100, 50, NOW) == 300_000


def test_a_new_leader_restores_reservations_from_lease_records():
    budgets = book(budget_nano=500_000)
    budgets.admit("l1", "t", "m", 100, 50, NOW)
    budgets.clear_leases()
    assert budgets.committed_nano("t", NOW) == 0 and budgets.reserved_nano("l1") == 0
    budgets.hold("l1", "t", 300_000)
    assert budgets.reserved_nano("l1") == 300_000
    assert isinstance(budgets.admit("l2", "t", "m", 100, 50, NOW), int)
    assert isinstance(budgets.admit("l3", "t", "m", 100, 50, NOW), OverBudget)


@pytest.mark.parametrize("now,month", [(0.0, "1970-01"), (NOW, "2025-11"), (1_767_225_599.0, "2025-12")])
def test_month_is_utc(now, month):
    assert month_of(now) == month
