"""services/metering/poison.py: which failures are the messages' fault, and finding them in a refused batch."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import exc as sa_exc

from services.metering.ledger import Written
from services.metering.poison import Isolation, is_poison, sqlstate


class _DriverError(Exception):
    """As SQLAlchemy's asyncpg adapter raises: the asyncpg error (with its SQLSTATE) as the cause."""

    def __init__(self, state: str) -> None:
        super().__init__(f"sqlstate {state}")
        self.sqlstate = state


def _wrapped(state: str) -> sa_exc.DBAPIError:
    return sa_exc.DBAPIError("INSERT ...", None, _DriverError(state))


@pytest.mark.parametrize("error, poison", [
    (_wrapped("22001"), True),  # value too long for type character varying(16): the bug of issue 14
    (_wrapped("23514"), True),  # check violation
    (_wrapped("23502"), True),  # not null violation
    (sa_exc.IntegrityError("INSERT", None, Exception("CHECK constraint failed")), True),  # SQLite
    (sa_exc.DataError("INSERT", None, Exception("string or blob too big")), True),
    (OverflowError("Python int too large to convert to SQLite INTEGER"), True),
    (_wrapped("08006"), False),  # connection failure
    (_wrapped("40P01"), False),  # deadlock: retry
    (_wrapped("57P01"), False),  # admin shutdown
    (sa_exc.OperationalError("INSERT", None, Exception("database is locked")), False),
    (ConnectionRefusedError(111, "refused"), False),
    (asyncio.TimeoutError(), False),
    (RuntimeError("a bug"), False),
])
def test_only_the_messages_fault_is_poison(error, poison):
    assert is_poison(error) is poison


def test_the_sqlstate_is_found_through_the_wrapping():
    outer = _wrapped("22001")
    assert sqlstate(outer) == "22001"
    try:
        raise RuntimeError("outer") from outer
    except RuntimeError as chained:
        assert sqlstate(chained) == "22001"
    assert sqlstate(RuntimeError("none")) is None


class FakeLedger:
    """A write that refuses any part holding a poison item (as one transaction would), or fails transiently."""

    def __init__(self, poison: set[int], transient_failures: int = 0) -> None:
        self.poison = poison
        self.transient_failures = transient_failures
        self.rows: list[int] = []
        self.calls = 0

    async def write(self, part: list[int]) -> Written:
        self.calls += 1
        if self.transient_failures:
            self.transient_failures -= 1
            raise ConnectionResetError("connection reset by peer")
        if self.poison & set(part):
            raise _wrapped("22001")
        self.rows += part
        return Written(len(part), 0, {f"team{i % 2}" for i in part})


async def _run(job: Isolation[int], ledger: FakeLedger) -> int:
    transient = 0
    while not job.done:
        try:
            await job.step(ledger.write)
        except ConnectionResetError:
            transient += 1
    return transient


@pytest.mark.parametrize("poison", [set(), {0}, {99}, {17}, {3, 4}, {0, 50, 99}, set(range(0, 100, 7))])
async def test_every_good_message_is_written_once_and_every_poison_one_is_found(poison):
    batch = list(range(100))
    ledger = FakeLedger(poison)
    job = Isolation(batch)
    await _run(job, ledger)
    assert sorted(ledger.rows) == [i for i in batch if i not in poison]  # each good one once
    assert sorted(item for item, _ in job.poisoned) == sorted(poison)
    assert all(is_poison(error) for _, error in job.poisoned)
    assert job.written.inserted == 100 - len(poison)
    assert job.written.teams == {f"team{i % 2}" for i in batch if i not in poison}


async def test_one_poison_message_costs_about_log2_of_the_batch():
    ledger = FakeLedger({613})
    job = Isolation(list(range(1000)))
    await _run(job, ledger)
    assert ledger.calls <= 2 * 10 + 1 and job.splits == 10


async def test_a_transient_failure_raises_and_the_retry_resumes_where_it_stopped():
    ledger = FakeLedger({5}, transient_failures=0)
    job = Isolation(list(range(8)))
    await job.step(ledger.write)  # the whole batch: refused, split
    await job.step(ledger.write)  # 0..3: written
    assert ledger.rows == [0, 1, 2, 3]
    ledger.transient_failures = 2
    assert await _run(job, ledger) == 2  # the database went away twice: the step raised, nothing was lost
    assert sorted(ledger.rows) == [0, 1, 2, 3, 4, 6, 7] and [item for item, _ in job.poisoned] == [5]


async def test_an_empty_batch_is_done_at_once():
    assert Isolation([]).done
