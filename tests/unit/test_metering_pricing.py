"""Pricing, daily sums, key diffs and lag quantiles (pure parts of metering)."""

from __future__ import annotations

import datetime as dt

import msgspec

from services.metering.ledger import daily_sums, usage_row
from services.metering.metrics import LagWindow, prometheus_text
from services.metering.pricing import PriceBook
from services.metering.sync import diff_keys
from shared.schema import ApiKeyRecord, ModelPrice, PriceSheet, UsageEvent

OLD = ModelPrice(1_000_000, 500_000, 2_000_000)
NEW = ModelPrice(3_000_000, 300_000, 9_000_000)


def test_cost_is_exact_nano_usd_rounded_once_per_request():
    assert OLD.cost_nano(1_000_000, 0, 0) == 1_000_000_000  # 1M input tokens at $1
    assert OLD.cost_nano(10, 4, 3) == (6 * 1_000_000 + 4 * 500_000 + 3 * 2_000_000 + 500) // 1000
    assert ModelPrice(1, 1, 1).cost_nano(1, 0, 0) == 0 and ModelPrice(500, 0, 0).cost_nano(1, 0, 0) == 1


def test_the_price_in_effect_when_the_request_arrived_applies():
    book = PriceBook([("m", 200.0, NEW), ("m", 100.0, OLD)])
    assert book.price("m", 99.9) is None and book.cost_nano("m", 50.0, 10, 0, 10) == 0
    assert book.price("m", 100.0) == OLD and book.price("m", 199.0) == OLD
    assert book.price("m", 200.0) == NEW and book.price("m", 1e12) == NEW
    assert book.savings_nano("m", 150.0, 1000) == (1000 * 500_000 + 500) // 1000
    assert book.sheet(150.0) == PriceSheet({"m": OLD}, 150.0) and book.sheet(50.0).prices == {}
    assert PriceSheet({"m": OLD}).cost_nano("other", 5, 0, 5) == 0


def event(request_id: str, model: str, at: float, key: str = "k1", team: str = "t") -> UsageEvent:
    return UsageEvent(request_id, 0, team, key, model, "finished", "stop", 100, 40, 10, 5.0, 50.0, "w", "", "", at)


def test_daily_sums_group_by_team_utc_day_model_and_key():
    book = PriceBook([("m", 0.0, OLD)])
    day1 = dt.datetime(2026, 11, 29, 23, 59, tzinfo=dt.timezone.utc).timestamp()
    day2 = day1 + 120
    rows = [usage_row(i + 1, e, book) for i, e in enumerate([
        event("a", "m", day1), event("b", "m", day1), event("c", "m", day2), event("d", "m", day2, key="k2"),
        event("e", "x", day2)])]
    sums = {(s["day"].isoformat(), s["model"], s["key_prefix"]): s for s in daily_sums(rows, book)}
    assert set(sums) == {("2026-11-29", "m", "k1"), ("2026-11-30", "m", "k1"), ("2026-11-30", "m", "k2"),
                         ("2026-11-30", "x", "k1")}
    first = sums[("2026-11-29", "m", "k1")]
    assert (first["requests"], first["prompt_tokens"], first["cached_tokens"], first["completion_tokens"]) == (
        2, 200, 80, 20)
    assert first["cost_nano"] == 2 * OLD.cost_nano(100, 40, 10)
    assert first["savings_nano"] == 2 * book.savings_nano("m", day1, 40)
    assert sums[("2026-11-30", "x", "k1")]["cost_nano"] == 0  # an unpriced model is free, and still counted
    assert rows[2]["stream_seq"] == 3 and rows[0]["created_at"].tzinfo is not None


def test_daily_sums_keep_migrations_apart_from_the_billed_counts():
    book = PriceBook([("m", 0.0, OLD)])
    at = dt.datetime(2026, 11, 29, 12, tzinfo=dt.timezone.utc).timestamp()
    moved = msgspec.structs.replace(event("a", "m", at), migrations=2, migration_prefill_tokens=900)
    rows = [usage_row(1, moved, book), usage_row(2, event("b", "m", at), book)]
    (total,) = daily_sums(rows, book)
    assert (total["requests"], total["migrations"], total["migration_prefill_tokens"]) == (2, 2, 900)
    # billed as the client saw it: the recomputed prefill is in neither the prompt tokens nor the cost
    assert (total["prompt_tokens"], total["cost_nano"]) == (200, 2 * OLD.cost_nano(100, 40, 10))


def test_key_diff_puts_new_and_changed_and_deletes_revoked():
    a, b, c = ApiKeyRecord("im-a", "t"), ApiKeyRecord("im-b", "t"), ApiKeyRecord("im-c", "u", True)
    puts, deletes = diff_keys({"ha": a, "hb": b}, {"ha": a, "hb": ApiKeyRecord("im-b", "t", True), "hc": c})
    assert puts == {"hb": ApiKeyRecord("im-b", "t", True), "hc": c} and deletes == []
    puts, deletes = diff_keys({"ha": a, "hb": b}, {"hb": b})
    assert puts == {} and deletes == ["ha"]


def test_lag_window_quantiles_forget_old_samples():
    window = LagWindow(window_s=10)
    for i in range(100):
        window.add(i / 1000, now=1000.0)
    window.add(5.0, now=980.0)  # too old by the time we ask
    q = window.quantiles(now=1005.0)
    assert (q["p50"], q["p99"], q["count"]) == (0.05, 0.099, 100)
    assert window.quantiles(now=2000.0)["count"] == 0
    text = prometheus_text({"inserted": 7}, q, pending=3, db_up=False)
    assert 'infermesh_metering_usage_total{result="inserted"} 7' in text
    assert "infermesh_metering_consumer_pending 3" in text and "infermesh_metering_database_up 0" in text


# ---------------------------------------------------------------- batch lines (issue 17)

def test_a_batch_line_costs_half_by_default_rounded_once_after_the_discount():
    assert OLD.batch_percent == 50
    assert OLD.cost_nano(1_000_000, 0, 0, batch=True) == 500_000_000  # 1M input tokens at $1, halved
    assert OLD.cost_nano(10, 4, 3, batch=True) == OLD.cost_nano(10, 4, 3) // 2 == 7_000
    # one token at 999 micro-USD per 1M is 999 pico-USD: 1 nano interactive, 499.5 pico (0 nano) in a batch;
    # at 1,000 it is 500 pico in a batch, which rounds half up to 1 nano: the discount is applied before rounding
    assert ModelPrice(999, 0, 0).cost_nano(1, 0, 0) == 1 and ModelPrice(999, 0, 0).cost_nano(1, 0, 0, batch=True) == 0
    assert ModelPrice(1_000, 0, 0).cost_nano(1, 0, 0, batch=True) == 1  # 500 pico: half up


def test_the_batch_percentage_is_per_price_and_exact():
    quarter = ModelPrice(1_000_000, 500_000, 2_000_000, batch_percent=25)
    assert quarter.cost_nano(4_000, 0, 0, batch=True) == 1_000_000  # $1 per 1M: 4,000 tokens are $0.004; 25% of it
    full = ModelPrice(1_000_000, 0, 0, 100)
    assert full.cost_nano(7, 0, 0, batch=True) == full.cost_nano(7, 0, 0) == 7_000
    assert ModelPrice(1_000_000, 0, 0, 0).cost_nano(7, 0, 5, batch=True) == 0
    book = PriceBook([("m", 0.0, quarter)])
    assert book.cost_nano("m", 1.0, 4_000, 0, 0, batch=True) == 1_000_000
    assert book.cost_nano("m", 1.0, 4_000, 0, 0) == 4_000_000
    assert book.savings_nano("m", 1.0, 1_000, batch=True) == 125_000  # 1,000 cached tokens x $0.5 per 1M saved, 25%
    assert book.cost_nano("unpriced", 1.0, 10, 0, 10, batch=True) == 0


def test_a_price_without_a_batch_percentage_decodes_as_half_and_a_bad_one_fails():
    old_wire = msgspec.msgpack.encode({"input_micros": 1, "cached_input_micros": 1, "output_micros": 1})
    assert msgspec.msgpack.decode(old_wire, type=ModelPrice).batch_percent == 50  # a publisher before issue 17
    bad = msgspec.msgpack.encode({"input_micros": 1, "cached_input_micros": 1, "output_micros": 1,
                                  "batch_percent": 101})
    try:
        msgspec.msgpack.decode(bad, type=ModelPrice)
    except msgspec.ValidationError:
        pass
    else:
        raise AssertionError("a batch percentage over 100 decoded")


def test_daily_sums_count_batch_lines_apart_within_the_totals():
    book = PriceBook([("m", 0.0, OLD)])
    at = dt.datetime(2026, 11, 29, 12, tzinfo=dt.timezone.utc).timestamp()
    line = msgspec.structs.replace(event("a", "m", at), batch_id="batch_1")
    rows = [usage_row(1, line, book), usage_row(2, event("b", "m", at), book)]
    assert rows[0]["batch_id"] == "batch_1" and rows[1]["batch_id"] == ""
    assert rows[0]["cost_nano"] == OLD.cost_nano(100, 40, 10, batch=True) == OLD.cost_nano(100, 40, 10) // 2
    (total,) = daily_sums(rows, book)
    assert (total["requests"], total["batch_requests"]) == (2, 1)
    assert total["cost_nano"] == rows[0]["cost_nano"] + rows[1]["cost_nano"]
    assert total["batch_cost_nano"] == rows[0]["cost_nano"]
    assert total["savings_nano"] == book.savings_nano("m", at, 40) + book.savings_nano("m", at, 40, batch=True)
