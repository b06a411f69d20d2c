"""The suite runs on a data home of its own (tests/conftest.py), never on the user's."""

from __future__ import annotations

from pathlib import Path

from services.metering.db import database_url, default_sqlite_path


def test_the_embedded_ledger_of_the_suite_is_not_the_users_own():
    ledger = default_sqlite_path()
    assert not ledger.is_relative_to(Path.home() / ".local"), ledger
    assert str(ledger) in database_url()  # what up, metering and batch open when given no URL
