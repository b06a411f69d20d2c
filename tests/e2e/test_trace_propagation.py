"""Trace context on the bus with no exception: every message a request causes, on every subject, carries its trace.

The whole mesh runs in this process (admission, breaker, metering on a ledger, router, a prefill and a decode sim
worker, the edge) with spans kept in memory; a plain NATS connection hears every subject (``>``) while one
disaggregated request is served, and each message that names the request must carry a ``traceparent`` of the
request's trace (replies to inboxes, KV writes and JetStream publishes included)."""

from __future__ import annotations

import asyncio

import nats
import openai
import pytest

from infermesh.local import LocalMesh
from shared.subjects import Subjects
from shared.usage import ensure_usage_stream
from tests.utils import eventually

pytestmark = [pytest.mark.e2e]
KEY = "test-key"
SIM = dict(engine="sim", model="tiny", max_model_len=4096, sim_profile="gb200-glm53", sim_clock_factor=50.0,
           block_size=16)
SQLITE = pytest.mark.parametrize("ledger_url", ["sqlite"], indirect=True)


class Heard:
    """Every message on the server, as (subject, payload, headers, reply subject)."""

    def __init__(self) -> None:
        self.messages: list[tuple[str, bytes, dict[str, str], str]] = []

    async def on_message(self, msg) -> None:
        self.messages.append((msg.subject, msg.data, dict(msg.headers or {}), msg.reply))

    def naming(self, text: str) -> list[tuple[str, bytes, dict[str, str], str]]:
        needle = text.encode()
        return [m for m in self.messages if needle in m[1] or text in m[0]]

    def of_trace(self, trace_id: str) -> list[tuple[str, bytes, dict[str, str], str]]:
        return [m for m in self.messages if trace_id in m[2].get("traceparent", "")]


def untraced(messages: list[tuple[str, bytes, dict[str, str], str]], trace_id: str) -> list[str]:
    return sorted({subject for subject, _, headers, _ in messages if trace_id not in headers.get("traceparent", "")})


@SQLITE
async def test_every_message_a_request_causes_carries_its_trace(nats_url, namespace, tiny_model, ledger_url,
                                                                span_exporter):
    mesh = LocalMesh(nats_url, namespace, dev_key=KEY)
    heard, nc = Heard(), await nats.connect(nats_url)
    await nc.subscribe(">", cb=heard.on_message)
    try:
        await mesh.start_admission()
        await mesh.start_breaker()
        await mesh.start_metering(database_url=ledger_url, sync_s=0.2)
        await mesh.start_router()
        await mesh.start_worker(worker_id="prefill-0", role="prefill", model_path=str(tiny_model), **SIM)
        await mesh.start_worker(worker_id="decode-0", role="decode", model_path=str(tiny_model), **SIM)
        await mesh.start_edge(admission=True)
        await eventually(mesh.edge.mesh.is_ready, 20)
        client = openai.AsyncOpenAI(base_url=mesh.base_url, api_key=KEY, max_retries=0)
        span_exporter.clear()
        done = await client.completions.create(model="tiny", prompt=list(range(5, 400)), max_tokens=8, seed=3)
        request_id = done.id.removeprefix("cmpl-")
        edge_span = next(s for s in span_exporter.get_finished_spans()
                         if s.attributes.get("infermesh.request_id") == request_id and s.parent is None)
        trace_id = f"{edge_span.context.trace_id:032x}"
        ns = f"{namespace}."
        expected = {"admission.acquire", "admission.release", "router.route", "worker.prefill-0.generate",
                    "worker.decode-0.generate", "outcome.prefill-0", "outcome.decode-0", "usage"}

        def traced() -> set[str]:
            return {subject.removeprefix(ns) for subject, *_ in heard.of_trace(trace_id)}

        await eventually(lambda: expected <= traced(), 10)  # (the release follows the usage's ack)
        named = heard.naming(request_id)  # the request's own messages: streams, decisions, usage, ...
        assert len(named) >= 8 and not untraced(named, trace_id), untraced(named, trace_id)
        inboxes = {reply for *_, reply in heard.of_trace(trace_id) if reply.startswith("_INBOX.")}
        answers = [m for m in heard.messages if m[0] in inboxes  # replies to the request's requests, but for
                   and not m[1].startswith(b'{"stream":')]  # JetStream's PubAcks (the server writes those)
        assert len(answers) >= 2 and not untraced(answers, trace_id), untraced(answers, trace_id)
        bucket = Subjects(namespace).leases_bucket  # its lease's record, budget hold and their ends (not the
        leases = [m for m in heard.messages  # leader key): plain KV writes and deletes carry the trace too
                  if m[0].startswith((f"$KV.{bucket}.l-", f"$KV.{bucket}.h-"))]
        assert len(leases) >= 2, leases
        assert all(trace_id in headers.get("traceparent", "") for _, _, headers, _ in leases), leases
    finally:
        await nc.close()
        await mesh.stop()


async def test_a_retried_request_is_one_trace_with_an_attempt_span_per_try(nats_url, namespace, tiny_model,
                                                                            span_exporter):
    """A worker that fails every request before its first token: the edge tries the other, in the same trace."""
    mesh = LocalMesh(nats_url, namespace, dev_key=KEY)
    try:
        await mesh.start_router()
        await mesh.start_worker(worker_id="bad", engine="sim", model="tiny", model_path=str(tiny_model),
                                sim_fail_rate=1.0, sim_ttft_ms=5, sim_itl_ms=1)
        await mesh.start_worker(worker_id="good", engine="sim", model="tiny", model_path=str(tiny_model),
                                sim_ttft_ms=5, sim_itl_ms=1)
        edge = await mesh.start_edge()
        await ensure_usage_stream(edge.mesh.bus)  # (no metering here: the usage is published, not retried for long)
        await eventually(mesh.edge.mesh.is_ready, 20)
        client = openai.AsyncOpenAI(base_url=mesh.base_url, api_key=KEY, max_retries=0)
        for i in range(40):  # until the router first picks the failing worker for one (each pick is a coin)
            span_exporter.clear()
            done = await client.completions.create(model="tiny", prompt=[5, 6, 7 + i], max_tokens=3)
            await eventually(lambda: any(s.name == "text_completion tiny"
                                         for s in span_exporter.get_finished_spans()), 5)
            trace_ids = {s.context.trace_id for s in span_exporter.get_finished_spans()
                         if s.attributes.get("infermesh.request_id") == done.id.removeprefix("cmpl-")}
            attempts = sorted((s for s in span_exporter.get_finished_spans()
                               if s.name == "attempt" and s.context.trace_id in trace_ids),
                              key=lambda s: s.attributes["infermesh.attempt"])
            if len(attempts) > 1:
                break
        else:
            pytest.fail("the router never picked the failing worker in 40 requests")
        edge = next(s for s in span_exporter.get_finished_spans() if s.name == "text_completion tiny"
                    and s.attributes.get("infermesh.request_id") == done.id.removeprefix("cmpl-"))
        spans = [s for s in span_exporter.get_finished_spans() if s.context.trace_id == edge.context.trace_id]
        assert done.usage.completion_tokens == 3 and len(attempts) == 2
        first, second = attempts
        assert first.parent.span_id == second.parent.span_id == edge.context.span_id
        assert first.attributes["infermesh.worker_id"] == "bad"
        assert first.attributes["infermesh.attempt.reason"] == "first" and not first.status.is_ok
        assert second.status.is_unset
        assert second.attributes["infermesh.attempt.reason"] == "retry"
        assert second.attributes["infermesh.attempt.failed_worker_id"] == "bad"
        assert second.attributes["infermesh.worker_id"] == "good"
        generates = {s.attributes["infermesh.worker_id"]: s for s in spans if s.name == "generate"}
        assert generates["bad"].parent.span_id == first.context.span_id
        assert generates["good"].parent.span_id == second.context.span_id
        assert first.end_time <= second.start_time  # one try after the other
        assert [s.name for s in spans].count("router.route") == 2  # one per attempt, in the one trace
    finally:
        await mesh.stop()


async def test_admission_spans_say_granted_queued_with_position_or_rejected(nats_url, namespace, tiny_model,
                                                                           span_exporter):
    """One request at a time, two may wait: the first is granted, the next two queue (0 and 1 ahead of them), the
    fourth is refused; the admission leader's spans say so with the reason (queue_full), the edge's with the
    error code its client got (rate_limit_exceeded)."""
    mesh = LocalMesh(nats_url, namespace, dev_key=KEY)
    try:
        admission = await mesh.start_admission(concurrency_per_worker=1, max_queue=2)
        await mesh.start_router()
        await mesh.start_worker(worker_id="slow", engine="sim", model="tiny", model_path=str(tiny_model),
                                sim_ttft_ms=5, sim_itl_ms=40)
        edge = await mesh.start_edge(admission=True)
        await ensure_usage_stream(edge.mesh.bus)
        await eventually(mesh.edge.mesh.is_ready, 20)
        await eventually(lambda: admission.leadership.is_leader, 10)
        client = openai.AsyncOpenAI(base_url=mesh.base_url, api_key=KEY, max_retries=0)
        span_exporter.clear()
        calls = []
        for i, (stat, count) in enumerate((("granted", 1), ("queued", 1), ("queued", 2))):
            calls.append(asyncio.create_task(client.completions.create(model="tiny", prompt=[5, 6, i], max_tokens=5)))
            await eventually(lambda stat=stat, count=count: admission.stats[stat] >= count, 5)
        with pytest.raises(openai.RateLimitError):
            await client.completions.create(model="tiny", prompt=[5, 6, 9], max_tokens=5)
        assert all(done.choices[0].finish_reason in ("stop", "length") for done in await asyncio.gather(*calls))

        def named(name: str) -> list:
            return sorted((s for s in span_exporter.get_finished_spans() if s.name == name), key=lambda s: s.start_time)

        await eventually(lambda: len(named("admission.acquire")) == 4, 5)
        decided = [(s.attributes["infermesh.admission.outcome"], s.attributes["infermesh.admission.queue_position"])
                   for s in named("admission.decide")]
        assert decided == [("granted", 0), ("queued", 0), ("queued", 1), ("queue_full", 0)]
        acquired = named("admission.acquire")
        outcomes = [s.attributes["infermesh.admission.outcome"] for s in acquired]
        assert outcomes == ["granted"] * 3 + ["rate_limit_exceeded"]
        assert not acquired[3].status.is_ok and acquired[2].attributes["infermesh.admission.wait_s"] > 0.1
        for decide, acquire in zip(named("admission.decide"), acquired, strict=True):
            assert decide.parent.span_id == acquire.context.span_id  # the leader's span below the edge's
    finally:
        await mesh.stop()


@pytest.mark.parametrize("stream", [False, True])
async def test_a_request_whose_worker_dies_mid_generation_is_an_error_span_and_names_its_trace(
        nats_url, namespace, tiny_model, span_exporter, stream):
    """The worker serving it stops after its first tokens (no migration): the edge's request span is an error
    (engine_error; a stream keeps the 200 it sent), and a whole response's 502 names the request and its trace."""
    mesh = LocalMesh(nats_url, namespace, dev_key=KEY)
    try:
        await mesh.start_router()
        worker = await mesh.start_worker(worker_id="doomed", engine="sim", model="tiny", model_path=str(tiny_model),
                                         sim_ttft_ms=5, sim_itl_ms=20)
        edge = await mesh.start_edge()
        await ensure_usage_stream(edge.mesh.bus)
        await eventually(mesh.edge.mesh.is_ready, 20)
        client = openai.AsyncOpenAI(base_url=mesh.base_url, api_key=KEY, max_retries=0)
        span_exporter.clear()
        ask = dict(model="tiny", prompt=[3, 4, 5], max_tokens=200, extra_body={"ignore_eos": True},
                   extra_headers={"X-Infermesh-Max-Migrations": "0"})
        if stream:
            with pytest.raises(openai.APIError):
                async for chunk in await client.completions.create(stream=True, **ask):
                    if chunk.choices and chunk.choices[0].text and worker in mesh.workers:
                        mesh.workers.remove(worker)
                        await worker.stop()
        else:
            call = asyncio.create_task(client.completions.create(**ask))
            # its KV grew past the prompt's block: tokens were generated, so it dies mid-generation
            await eventually(lambda: worker.load_snapshot().num_active_blocks >= 2, 10)
            mesh.workers.remove(worker)
            await worker.stop()
            with pytest.raises(openai.APIStatusError) as failed:
                await call
            response = failed.value.response
            assert response.status_code == 502 and response.headers["x-request-id"]
            trace_id = response.headers["traceparent"].split("-")[1]
        await eventually(lambda: any(s.name == "text_completion tiny" for s in span_exporter.get_finished_spans()), 5)
        edge_span = next(s for s in span_exporter.get_finished_spans() if s.name == "text_completion tiny")
        assert not edge_span.status.is_ok and edge_span.attributes["error.type"] == "engine_error"
        assert edge_span.attributes["http.response.status_code"] == (200 if stream else 502)
        if not stream:
            assert f"{edge_span.context.trace_id:032x}" == trace_id
    finally:
        await mesh.stop()
