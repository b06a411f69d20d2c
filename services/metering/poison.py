"""Poison usage messages: telling one that can never be written from a database that is away, and finding
such messages in a batch the database refused, so that the rest of the batch is written.

    job = Isolation(batch)                      # [(stream_seq, UsageEvent), ...]
    while not job.done:
        await retry_while_transient(lambda: job.step(write))   # write(part) -> Written; raises on failure
    job.written, job.poisoned                   # what went in; [(item, error)] for the dead-letter stream

| a write of a part fails with              | verdict    | the job                                        |
|-------------------------------------------|------------|------------------------------------------------|
| SQLSTATE class 22 (data) or 23 (integrity)| poison     | splits the part in halves; one message: poison |
| SQLAlchemy DataError / IntegrityError     | poison     | (SQLite's; Postgres's carry a SQLSTATE)        |
| ValueError, OverflowError (a row's value) | poison     |                                                |
| anything else: refused, reset, timeout,   | transient  | ``step`` raises; the part stays next, so a     |
| lock, deadlock, serialization, a bug      |            | retry resumes where it stopped                 |

Invariants: every item ends in exactly one of a written part (inserted or duplicate) or ``poisoned``;
a part is written at most once (parts written before a transient failure are not written again); a
batch with k poison messages among n costs about k * log2(n) extra transactions. The dedupe
duplicate never fails (``ON CONFLICT DO NOTHING``), so a redelivered message is never poison.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

from sqlalchemy import exc as sa_exc

from services.metering.ledger import Written

Item = TypeVar("Item")
POISON_SQLSTATE_CLASSES = ("22", "23")  # data exception, integrity constraint violation


def is_poison(error: BaseException) -> bool:
    """The write failed because of what was written (never because the database is away or busy)."""
    if isinstance(error, (sa_exc.DataError, sa_exc.IntegrityError, ValueError, OverflowError)):
        return True
    state = sqlstate(error)
    return state is not None and state[:2] in POISON_SQLSTATE_CLASSES


def sqlstate(error: BaseException) -> str | None:
    """The Postgres SQLSTATE behind ``error`` (SQLAlchemy wraps the driver's error, which wraps asyncpg's)."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [error]
    while todo:
        current = todo.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        state = getattr(current, "sqlstate", None) or getattr(current, "pgcode", None)
        if isinstance(state, str) and len(state) == 5:
            return state
        todo += [getattr(current, "orig", None), current.__cause__]
    return None


class Isolation(Generic[Item]):
    """One batch being written, split around its poison messages until every other message is in."""

    def __init__(self, batch: Sequence[Item]) -> None:
        self._parts: list[list[Item]] = [list(batch)] if batch else []  # a stack: the next part is last
        self.written = Written(0, 0, set())
        self.poisoned: list[tuple[Item, BaseException]] = []
        self.splits = 0

    @property
    def done(self) -> bool:
        return not self._parts

    async def step(self, write: Callable[[list[Item]], Awaitable[Written]]) -> None:
        """Write the next part. Raises (the part stays next) when the failure is not the messages' fault."""
        part = self._parts[-1]
        try:
            written = await write(part)
        except Exception as error:
            if not is_poison(error):
                raise
            self._parts.pop()
            if len(part) == 1:
                self.poisoned.append((part[0], error))
            else:
                middle = len(part) // 2
                self._parts += [part[middle:], part[:middle]]  # the first half is written first
                self.splits += 1
            return
        self._parts.pop()
        self.written = Written(self.written.inserted + written.inserted, self.written.duplicates + written.duplicates,
                               self.written.teams | written.teams, self.written.superseded + written.superseded)
