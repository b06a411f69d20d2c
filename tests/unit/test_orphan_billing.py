"""Signed billing contexts and the usage an orphan report becomes: forged, unsigned or moved contexts are
never billed; a signed one bills exactly what the dead edge would have."""

from __future__ import annotations

import msgspec
import pytest

from services.edge.orphans import OrphanBiller, orphan_usage_event, sign, verify
from shared import schema
from shared.schema import BillingContext, OrphanUsage, SignedBilling

SECRET = b"s" * 32
CONTEXT = BillingContext(request_id="req1", attempt=1, team="alpha", key_prefix="im-AbCd", model="tiny",
                         request_class="interactive", worker_id="w1", trace_id="t" * 32, created_at=1000.0)


def report(billing: SignedBilling | None, request_id: str = "req1-a1", **counts: object) -> OrphanUsage:
    values = dict(num_prompt_tokens=20, num_cached_tokens=4, num_output_tokens=37, ttft_ms=12.5, ts=1003.0)
    values.update(counts)
    return OrphanUsage(worker_id="w1", edge_id="e-dead", request_id=request_id, billing=billing, **values)


def biller() -> OrphanBiller:
    return OrphanBiller(bus=None, secret=SECRET, usage=None)  # type: ignore[arg-type]  # judge does no I/O


def test_a_signed_context_verifies_for_its_request_only():
    signed = sign(SECRET, "req1-a1", CONTEXT)
    assert verify(SECRET, "req1-a1", signed) == CONTEXT
    assert verify(SECRET, "req2", signed) is None  # moved onto another request
    assert verify(b"x" * 32, "req1-a1", signed) is None  # another mesh's secret
    assert verify(b"", "req1-a1", signed) is None


def test_a_changed_context_fails_its_signature():
    signed = sign(SECRET, "req1-a1", CONTEXT)
    other_team = schema.encode(msgspec.structs.replace(CONTEXT, team="beta"))
    assert verify(SECRET, "req1-a1", SignedBilling(other_team, signed.signature)) is None


def test_a_report_becomes_the_usage_the_dead_edge_would_have_published():
    event = orphan_usage_event(report(None), CONTEXT)
    assert (event.request_id, event.attempt, event.team, event.key_prefix, event.model) == (
        "req1", 1, "alpha", "im-AbCd", "tiny")
    assert (event.status, event.finish_reason) == ("cancelled", "abort")
    assert (event.prompt_tokens, event.cached_tokens, event.completion_tokens) == (20, 4, 37)
    assert event.duration_ms == pytest.approx(3000.0) and event.created_at == 1000.0
    assert event.worker_id == "w1" and event.trace_id == "t" * 32


def test_after_a_remote_prefill_the_prefills_cache_hits_are_billed_not_the_decoders():
    context = msgspec.structs.replace(CONTEXT, prefill_worker_id="p1", prefill_cached_tokens=16)
    event = orphan_usage_event(report(None, num_cached_tokens=0), context)
    assert (event.cached_tokens, event.prefill_worker_id) == (16, "p1")


def test_an_orphaned_prefill_bills_its_prompt_and_no_completion():
    event = orphan_usage_event(report(None, remote_decode=True, num_output_tokens=1), CONTEXT)
    assert (event.prompt_tokens, event.cached_tokens, event.completion_tokens) == (20, 4, 0)


@pytest.mark.parametrize("data, counter", [
    (b"\x00garbage", "undecodable"),
    (schema.encode(report(None)), "unsigned"),
    (schema.encode(report(SignedBilling(schema.encode(CONTEXT), b"\x00" * 32))), "forged"),
    (schema.encode(report(sign(SECRET, "another-request", CONTEXT))), "forged"),
    (schema.encode(report(sign(SECRET, "req1-a1", CONTEXT), num_output_tokens=2**40)), "undecodable"),
])
def test_reports_that_must_not_be_billed_are_counted(data, counter):
    judge = biller()
    assert judge.judge(data) is None
    assert judge.stats[counter] == 1


def test_a_signed_report_is_billed():
    judge = biller()
    event = judge.judge(schema.encode(report(sign(SECRET, "req1-a1", CONTEXT))))
    assert event is not None and event.completion_tokens == 37
    assert sum(judge.stats.values()) == 0
