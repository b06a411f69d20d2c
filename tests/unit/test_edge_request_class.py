"""Request classes are granted, not claimed (services/edge/api.py, issue 38 point 4): ``batch`` (idle capacity
only, preempted for interactive traffic) is the batch service's lines'; a client's ``X-Request-Class`` only labels
its request. A preempted run is unbilled only when it is a batch line's (the line runs again, billed once)."""

from __future__ import annotations

import asyncio

import pytest

from services.edge.api import EdgeApi, _Bill
from services.edge.batch_lines import line_request
from services.edge.http import HttpRequest
from services.edge.keys import Caller
from shared import errors
from shared.batch_schema import BatchLineRequest


def http(headers: dict[str, str]) -> HttpRequest:
    return HttpRequest("POST", "/v1/completions", headers, b"{}", Caller("t", "sk-1"))


@pytest.mark.parametrize(("headers", "klass"), [
    ({}, "interactive"),
    ({"x-request-class": "interactive"}, "interactive"),
    ({"x-request-class": "batch"}, "interactive"),  # claimed by a client: a label only
])
def test_a_clients_header_never_makes_a_batch_request(headers, klass):
    assert EdgeApi._request_class(http(headers)) == klass


def test_an_unknown_class_is_still_a_400_naming_the_header():
    with pytest.raises(errors.ApiError) as caught:
        EdgeApi._request_class(http({"x-request-class": "urgent"}))
    assert caught.value.status == 400 and caught.value.param == "X-Request-Class"


def test_a_batch_line_is_batch_class():
    line = BatchLineRequest(job_id="batch_j", team="t", line_index=3, request_id="batch_j_3",
                            endpoint="/v1/completions", body=b"{}")
    assert EdgeApi._request_class(line_request(line)) == "batch"


@pytest.mark.parametrize(("batch_id", "preempted", "billable"), [
    ("", False, True), ("", True, True),  # a preempted stream that is not a batch line: billed what it got
    ("batch_j", False, True), ("batch_j", True, False),  # a preempted line's run: it runs again, billed once
])
async def test_only_a_batch_lines_preempted_run_goes_unbilled(batch_id, preempted, billable):
    bill = _Bill("r1", Caller("t", "sk-1"), "m", 0.0, None, asyncio.get_running_loop().create_future(),
                 lambda: None, "", batch_id, preempted)
    assert bill.billable is billable
