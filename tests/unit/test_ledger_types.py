"""The ledger's usage columns and the UsageEvent wire type share one definition: what decodes fits the table.
So do the batch_jobs columns and BatchJobRecord (shared/batch_schema.py).

(The migrations are held to the models by tests/integration/test_ledger_db.py, on both databases.)
"""

from __future__ import annotations

import re
from typing import get_args

import msgspec
import pytest

from services.metering.ledger import usage_row
from services.metering.models import BatchJob, Usage
from services.metering.pricing import PriceBook
from shared import batch_schema, schema
from shared.batch_schema import BatchEndpoint, BatchJobRecord, BatchSource, BatchStatus, CompletionWindow
from shared.schema import MAX_KEY_PREFIX, StreamErrorCode, UsageEvent, UsageFinishReason, UsageStatus

COLUMNS = Usage.__table__.columns
CLOSED = {"status": UsageStatus, "finish_reason": UsageFinishReason}


JOB_COLUMNS = BatchJob.__table__.columns
JOB_CLOSED = {"status": BatchStatus, "endpoint": BatchEndpoint, "completion_window": CompletionWindow,
              "source": BatchSource}


def _checked_members(column: str, table=Usage.__table__) -> set[str]:
    (check,) = [c for c in table.constraints if getattr(c, "name", "") == f"ck_{table.name}_{column}"]
    return set(re.findall(r"'([^']*)'", str(check.sqltext)))


@pytest.mark.parametrize("column", CLOSED)
def test_every_member_of_a_closed_set_fits_its_column_and_its_check(column):
    members = get_args(CLOSED[column])
    assert members and max(map(len, members)) <= COLUMNS[column].type.length
    assert _checked_members(column) == set(members)


@pytest.mark.parametrize("column", JOB_CLOSED)
def test_every_member_of_a_batch_jobs_closed_set_fits_its_column_and_its_check(column):
    members = get_args(JOB_CLOSED[column])
    assert members and max(map(len, members)) <= JOB_COLUMNS[column].type.length
    assert _checked_members(column, BatchJob.__table__) == set(members)


def test_the_revision_writes_out_the_batch_closed_sets_as_the_types_have_them():
    """A member added to a Literal later needs a revision of its own; until then, this fails."""
    import importlib.util

    from services.metering.db import MIGRATIONS_DIR

    spec = importlib.util.spec_from_file_location("rev0005", MIGRATIONS_DIR / "versions" / "0005_batch_jobs.py")
    revision = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(revision)
    assert {column: set(members) for column, members in revision.CLOSED.items()} == \
        {column: set(get_args(kind)) for column, kind in JOB_CLOSED.items()}
    assert (revision.MAX_BATCH_ID, revision.MAX_FILE_ID, revision.MAX_SUBMIT_ID) == (
        batch_schema.MAX_BATCH_ID, batch_schema.MAX_FILE_ID, batch_schema.MAX_SUBMIT_ID)


def test_every_bounded_field_of_a_job_record_is_as_long_as_its_column():
    info = msgspec.inspect.type_info(BatchJobRecord)
    bounds = {f.name: f.type.max_length for f in info.fields
              if isinstance(f.type, msgspec.inspect.StrType) and f.type.max_length is not None}
    assert bounds == {"id": batch_schema.MAX_BATCH_ID, "input_file_id": batch_schema.MAX_FILE_ID,
                      "key_prefix": MAX_KEY_PREFIX}  # batch_schema cannot import schema's constant: held equal here
    for name, length in bounds.items():
        assert JOB_COLUMNS[name].type.length == length, name
    assert JOB_COLUMNS["submit_id"].type.length == batch_schema.MAX_SUBMIT_ID
    assert JOB_COLUMNS["output_file_id"].type.length == JOB_COLUMNS["error_file_id"].type.length == \
        batch_schema.MAX_FILE_ID
    assert COLUMNS["batch_id"].type.length == batch_schema.MAX_BATCH_ID


def test_worker_unavailable_the_18_character_reason_is_a_billable_finish_reason():
    assert "worker_unavailable" in get_args(UsageFinishReason)
    assert len("worker_unavailable") == 18 <= COLUMNS["finish_reason"].type.length


def test_every_stream_error_code_can_end_a_billed_attempt():
    assert set(get_args(StreamErrorCode)) <= set(get_args(UsageFinishReason))
    assert set(get_args(schema.FinishReason)) <= set(get_args(UsageFinishReason))


def _bounds() -> dict[str, int]:
    """The max_length of every bounded string field of UsageEvent, from msgspec's own view of the type."""
    info = msgspec.inspect.type_info(UsageEvent)
    return {f.name: f.type.max_length for f in info.fields
            if isinstance(f.type, msgspec.inspect.StrType) and f.type.max_length is not None}


def test_every_string_field_is_bounded_exactly_as_long_as_its_column():
    bounds = _bounds()
    strings = {name for name, column in COLUMNS.items() if getattr(column.type, "length", None)} - set(CLOSED)
    assert set(bounds) == strings
    for name, length in bounds.items():
        assert COLUMNS[name].type.length == length, name


def _event(**changes) -> UsageEvent:
    base = UsageEvent("r1", 0, "alpha", "im-abc", "m", "failed", "worker_unavailable", 10, 0, 5, 1.0, 2.0, "w1",
                      created_at=1.7e9)
    return msgspec.structs.replace(base, **changes)


@pytest.mark.parametrize("changes", [
    {"finish_reason": "tool_calls"}, {"status": "done"}, {"request_id": "r" * 65}, {"team": "t" * 65},
    {"worker_id": "w" * 129}, {"trace_id": "f" * 33}, {"batch_id": "b" * 65}, {"completion_tokens": -1},
    {"prompt_tokens": 2**31}, {"created_at": 1e300},
], ids=lambda c: next(iter(c)))
def test_a_value_the_ledger_cannot_hold_fails_validation(changes):
    with pytest.raises(msgspec.ValidationError):
        schema.decode(schema.encode(_event(**changes)), UsageEvent)


def test_a_value_at_every_bound_decodes():
    event = _event(request_id="r" * 64, team="t" * 64, key_prefix="k" * 32, model="m" * 256, worker_id="w" * 128,
                   prefill_worker_id="p" * 128, trace_id="f" * 32, prompt_tokens=2**31 - 1, batch_id="b" * 64)
    assert schema.decode(schema.encode(event), UsageEvent) == event


def test_every_field_of_the_usage_event_is_a_column_the_ledger_writes():
    """A field added to the wire type without a column (and a revision) is lost in the ledger: fail here."""
    assert set(UsageEvent.__struct_fields__) <= set(COLUMNS.keys())
    event = _event(prefill_worker_id="p1", trace_id="f" * 32, migrations=2, migration_prefill_tokens=1_234,
                   deployment="east", batch_id="batch_abc")
    row = usage_row(7, event, PriceBook([]))
    assert {name: row[name] for name in UsageEvent.__struct_fields__ if name != "created_at"} == \
        {name: getattr(event, name) for name in UsageEvent.__struct_fields__ if name != "created_at"}
    assert row["created_at"].timestamp() == event.created_at

