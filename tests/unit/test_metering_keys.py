"""API keys, team names and USD amounts: the pure parts of the ledger's admin."""

from __future__ import annotations

import hashlib
import re
from decimal import Decimal

import pytest

from services.metering.admin import AdminError, check_month, micros_to_usd, usd_to_micros
from services.metering.keys import hash_key, key_prefix, new_key, valid_team_name


def test_a_new_key_has_the_documented_shape_and_its_hash_and_prefix_follow_from_it():
    key, prefix, key_hash = new_key()
    assert re.fullmatch(r"im-[A-Za-z0-9_-]{40}", key)
    assert prefix == key[:11] and len(prefix) == 11 and prefix.startswith("im-")
    assert key_hash == hashlib.sha256(key.encode()).hexdigest() == hash_key(key)
    assert len(key_hash) == 64 and key_prefix(key) == prefix


def test_keys_are_random():
    keys = {new_key()[0] for _ in range(200)}
    prefixes = {key[:11] for key in keys}
    assert len(keys) == 200 and len(prefixes) == 200


def test_hash_key_is_sha256_hex():
    assert hash_key("a") == "ca978112ca1bbdcafac231b39a23dc4da786eff8147c4e72b9807785afee48bb"


@pytest.mark.parametrize("name", ["a", "team-1", "Team_2", "x" * 64, "0"])
def test_valid_team_names(name):
    assert valid_team_name(name)


@pytest.mark.parametrize("name", ["", "x" * 65, "a b", "a.b", "é", "a/b", "a*", None, 3])
def test_invalid_team_names(name):
    assert not valid_team_name(name)


@pytest.mark.parametrize("amount, micros", [
    ("0", 0), ("1", 1_000_000), ("0.15", 150_000), ("2.500000", 2_500_000), ("0.000001", 1),
    (Decimal("12.345678"), 12_345_678), (3, 3_000_000), (" 7.5 ", 7_500_000), ("1.50000000", 1_500_000),
])
def test_usd_amounts_become_exact_micros(amount, micros):
    assert usd_to_micros(amount) == micros


@pytest.mark.parametrize("amount, message", [
    ("0.0000001", "more than 6 decimals"), ("-1", "negative"), ("abc", "not a number"),
    ("NaN", "not a finite number"), ("Infinity", "not a finite number"), (0.1, "decimal string"),
    ("1e30", "too large"),
])
def test_bad_usd_amounts_are_refused_with_a_reason(amount, message):
    with pytest.raises(AdminError, match=message):
        usd_to_micros(amount, "input price")


def test_micros_print_as_the_shortest_exact_decimal():
    assert [micros_to_usd(m) for m in (0, 1, 150_000, 2_000_000, 12_345_678)] == \
        ["0", "0.000001", "0.15", "2", "12.345678"]


def test_months():
    assert check_month("2025-01") == "2025-01" and check_month("*") == "*"
    for bad in ("2025-13", "2025-1", "25-01", "2025-00", ""):
        with pytest.raises(AdminError, match="bad month"):
            check_month(bad)
    with pytest.raises(AdminError, match="bad month"):
        check_month("*", allow_any=False)
