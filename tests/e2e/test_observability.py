"""What an operator sees of one request on ``infermesh up`` (each service its own process):

- its trace: every service exports over OTLP/HTTP, as it would to Jaeger or Phoenix, to a real OTLP receiver the
  test runs, and the test checks the tree: one trace id, every hop a child of the hop that sent it, each span
  with its attributes, durations that nest;
- its metrics: every service's ``/metrics`` (the ports ``infermesh up`` prints), scraped as Prometheus does
  (OpenMetrics), with the GenAI histograms moved and their exemplars naming the request's trace."""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families
from prometheus_client.parser import text_string_to_metric_families as text_families

from shared.ports import free_port
from tests.e2e.mesh_process import UpProcess
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan
from tests.utils import eventually

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
SERVER, CLIENT = 2, 3  # opentelemetry.proto.trace.v1.Span.SpanKind
EXPECTED = {"text_completion tiny", "admission.acquire", "admission.decide", "attempt", "router.route", "prefill",
            "decode", "kv.transfer", "engine.queue", "engine.prefill", "engine.decode", "usage.publish"}


def by_name(spans: list[ReceivedSpan]) -> dict[str, ReceivedSpan]:
    named: dict[str, ReceivedSpan] = {}
    for span in spans:
        assert span.name not in named or span.name.startswith("engine."), f"two {span.name} spans"
        named.setdefault(span.name, span)
    return named


def child_of(child: ReceivedSpan, parent: ReceivedSpan, nested: bool = True) -> None:
    assert child.parent_id == parent.span_id, f"{child.name} is not a child of {parent.name}"
    assert child.start_ns >= parent.start_ns, f"{child.name} starts before {parent.name}"
    if nested:
        assert child.end_ns <= parent.end_ns, f"{child.name} ends after {parent.name}"


def workers_spans(spans: list[ReceivedSpan], parent: ReceivedSpan) -> list[str]:
    return sorted(s.name for s in spans if s.parent_id == parent.span_id)


@pytest.fixture(scope="module")
async def served(nats_url, tiny_model, tmp_path_factory):
    """One disaggregated completion on ``infermesh up --pd 1:1`` (sim), traced to a receiver; the mesh stays up."""
    port = free_port()
    with OtlpReceiver() as otlp:
        up = UpProcess(["--engine", "sim", "--pd", "1:1", "--sim-profile", "gb200-glm53", "--sim-clock-factor", "20",
                        "--model", "tiny", "--model-path", str(tiny_model), "--nats-url", nats_url,
                        "--namespace", f"t{uuid.uuid4().hex[:8]}", "--http-port", str(port),
                        "--billing-port", str(free_port()), "--metrics-port-base", "0",
                        "--state-dir", str(tmp_path_factory.mktemp("observed"))],
                       env={"OTEL_EXPORTER_OTLP_ENDPOINT": otlp.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"})
        up.start(timeout_s=90)
        try:
            client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=up.key, max_retries=0)
            raw = await client.completions.with_raw_response.create(
                model="tiny", prompt=list(range(5, 400)), max_tokens=8, extra_headers={"x-session-id": "agent-7"})
            trace_id = raw.headers["traceparent"].split("-")[1]
            await eventually(lambda: EXPECTED <= {s.name for s in otlp.of_trace(trace_id)}, 20)
            yield {"raw": raw, "done": raw.parse(), "trace_id": trace_id, "otlp": otlp, "up": up}
        finally:
            assert up.stop() == 0


async def test_a_disaggregated_request_is_one_tree_across_every_service(served):
    raw, done, trace_id, otlp = served["raw"], served["done"], served["trace_id"], served["otlp"]
    spans = otlp.of_trace(trace_id)
    s = by_name(spans)
    edge, attempt, decode, prefill = s["text_completion tiny"], s["attempt"], s["decode"], s["prefill"]
    # the tree
    assert edge.parent_id == "" and edge.kind == SERVER and edge.service == "infermesh-edge"
    child_of(s["admission.acquire"], edge)
    child_of(s["admission.decide"], s["admission.acquire"])
    child_of(attempt, edge)
    child_of(s["router.route"], attempt)
    child_of(prefill, attempt, nested=False)  # (a worker's span ends once its stream's end is sent)
    child_of(decode, attempt, nested=False)
    child_of(s["kv.transfer"], decode)
    assert prefill.end_ns <= s["kv.transfer"].end_ns  # the pull follows the prefill's end
    assert workers_spans(spans, decode) == ["engine.decode", "engine.prefill", "engine.queue", "kv.transfer"]
    assert workers_spans(spans, prefill) == ["engine.decode", "engine.prefill", "engine.queue"]
    for phase in (p for p in spans if p.name.startswith("engine.")):
        parent = decode if phase.parent_id == decode.span_id else prefill
        child_of(phase, parent)
    child_of(s["usage.publish"], edge, nested=False)  # billed in the background, after the response
    # each service its own process, each span where it belongs
    services = {span.name: span.service for span in spans}
    assert services["admission.decide"] == "infermesh-admission" and services["router.route"] == "infermesh-router"
    assert services["prefill"].startswith("infermesh-worker") and services["decode"].startswith("infermesh-worker")
    # the attributes an operator reads
    request_id = done.id.removeprefix("cmpl-")
    assert edge.attributes["infermesh.request_id"] == request_id == raw.headers["x-request-id"]
    assert edge.attributes["gen_ai.operation.name"] == "text_completion"
    assert edge.attributes["gen_ai.usage.output_tokens"] == done.usage.completion_tokens == 8
    assert edge.attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert edge.attributes["infermesh.session_id"] == "agent-7"
    assert edge.attributes["http.response.status_code"] == 200
    assert {"first_token", "finish"} <= set(edge.events)
    assert s["admission.acquire"].attributes["infermesh.admission.outcome"] == "granted"
    assert s["admission.decide"].attributes["infermesh.admission.outcome"] == "granted"
    assert s["admission.decide"].attributes["infermesh.admission.queue_position"] == 0
    route = s["router.route"].attributes
    assert route["infermesh.worker_id"] == decode.attributes["infermesh.worker_id"]
    assert route["infermesh.prefill_worker_id"] == prefill.attributes["infermesh.worker_id"]
    assert route["infermesh.router.candidates"] >= 1 and route["infermesh.router.affinity"] == "none"
    assert "infermesh.router.cost" in route and route["infermesh.router.overlap_blocks"] == 0
    pull = s["kv.transfer"]
    assert pull.kind == CLIENT and pull.attributes["infermesh.kv_transfer.connector"] == "sim"
    assert pull.attributes["infermesh.kv_transfer.bytes"] > 0
    assert pull.attributes["infermesh.kv_transfer.descriptors"] > 0
    assert prefill.attributes["gen_ai.latency.time_in_model_prefill"] > 0  # 395 tokens computed there
    assert decode.attributes["gen_ai.latency.time_in_model_decode"] > 0  # 7 tokens after the first (uvloop: ms)
    for worker in (prefill, decode):
        assert worker.attributes["gen_ai.latency.time_in_queue"] >= 0
        assert worker.attributes["infermesh.engine.num_preemptions"] == 0
        assert "first_token" in worker.events and "finish" in worker.events
    assert s["usage.publish"].attributes["infermesh.billed"] is True


def metrics_ports(up: UpProcess) -> dict[str, int]:
    """The ports ``infermesh up`` printed: ``metrics  : http://127.0.0.1:<port>/metrics  (router-0 :9464, ...)``."""
    line = next(line for line in up.lines if line.strip().startswith("metrics"))
    return {name: int(port) for name, port in re.findall(r"([\w-]+) :(\d+)", line.split("(", 1)[1])}


async def scrape(port: int) -> dict[str, list]:
    """One scrape as Prometheus makes it (OpenMetrics, for the exemplars): metric family name -> samples."""
    async with httpx.AsyncClient() as http:
        reply = await http.get(f"http://127.0.0.1:{port}/metrics",
                               headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("application/openmetrics-text")
    return {family.name: family.samples for family in text_string_to_metric_families(reply.text)}


def value(samples: list, name: str, **labels: str) -> float:
    return sum(s.value for s in samples if s.name == name and labels.items() <= s.labels.items())


async def test_every_service_serves_metrics_and_the_genai_histograms_moved(served):
    ports = metrics_ports(served["up"])
    assert {"router-0", "breaker", "admission-0", "batch", "worker-prefill-0", "worker-decode-0"} <= set(ports)
    m = {name: await scrape(port) for name, port in ports.items() if name != "metering"}
    edges = [samples for name, samples in m.items() if name.startswith("edge")]  # (up runs 2, on one port)
    assert len(edges) >= 1

    def edge_total(family: str, **labels: str) -> float:
        return sum(value(e.get(family, []), f"{family}_count", **labels) for e in edges)

    assert edge_total("gen_ai_server_request_duration_seconds", gen_ai_request_model="tiny") >= 1
    exemplars = [s.exemplar.labels for e in edges for s in e["gen_ai_server_request_duration_seconds"]
                 if s.exemplar is not None]
    assert {"trace_id": served["trace_id"]} in exemplars  # from the histogram to the request's trace
    assert edge_total("gen_ai_server_time_to_first_token_seconds", gen_ai_request_model="tiny") >= 1
    assert edge_total("gen_ai_server_time_per_output_token_seconds") >= 1  # 8 tokens: 7 after the first
    decode = m["worker-decode-0"]
    assert value(decode["gen_ai_server_time_to_first_token_seconds"],
                 "gen_ai_server_time_to_first_token_seconds_count", gen_ai_request_model="tiny") >= 1
    assert value(decode["infermesh_worker_requests"], "infermesh_worker_requests_total", kind="finished") >= 1
    assert value(decode["infermesh_worker_kv_blocks"], "infermesh_worker_kv_blocks", of="total") > 0
    assert value(m["worker-prefill-0"]["infermesh_worker_requests"], "infermesh_worker_requests_total") >= 1
    prompt = {name: {kind: value(m[name]["infermesh_worker_prompt_tokens"], "infermesh_worker_prompt_tokens_total",
                                 kind=kind) for kind in ("computed", "cached", "transferred")}
              for name in ("worker-prefill-0", "worker-decode-0")}
    assert prompt["worker-prefill-0"] == {"computed": 395, "cached": 0, "transferred": 0}  # the prompt, there
    assert prompt["worker-decode-0"]["transferred"] >= 394 and prompt["worker-decode-0"]["computed"] <= 1
    def total(service: str, family: str, sample: str, **labels: str) -> float:  # over the service's replicas
        return sum(value(samples.get(family, []), sample, **labels) for name, samples in m.items()
                   if name.rstrip("0123456789-") == service)

    assert total("router", "infermesh_router_decisions", "infermesh_router_decisions_total") >= 1
    assert total("router", "infermesh_router_decision_seconds", "infermesh_router_decision_seconds_count") >= 1
    assert value(m["router-0"]["infermesh_router_workers_live"], "infermesh_router_workers_live") == 2
    assert total("admission", "infermesh_admission_granted", "infermesh_admission_granted_total") >= 1
    assert total("admission", "infermesh_admission_leader", "infermesh_admission_leader") == 1  # one leader
    assert value(m["breaker"]["infermesh_breaker_workers"], "infermesh_breaker_workers", of="closed") == 2
    assert "infermesh_batch_jobs_running" in m["batch"]
    async with httpx.AsyncClient() as http:  # the same port answers a health probe
        assert (await http.get(f"http://127.0.0.1:{ports['router-0']}/health")).status_code == 200


DASHBOARDS = Path(__file__).parents[2] / "deploy" / "grafana" / "dashboards"
LABELS = {"gen_ai_request_model"}  # (a label the queries group by, not a metric)


def dashboard_metrics() -> set[str]:
    """Every metric the committed Grafana dashboards query."""
    names = set()
    for path in DASHBOARDS.glob("*.json"):
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel["targets"]:
                names |= set(re.findall(r"\b(?:infermesh|gen_ai)_[a-z0-9_]+", target["expr"]))
    return names - LABELS


async def test_the_dashboards_query_what_the_services_export_and_up_wrote_the_scrape_targets(served):
    up = served["up"]
    ports = metrics_ports(up)
    exported: set[str] = set()
    async with httpx.AsyncClient() as http:
        for port in ports.values():
            text = (await http.get(f"http://127.0.0.1:{port}/metrics")).text  # (metering's: the classic format)
            exported |= {sample.name for family in text_families(text) for sample in family.samples}
    queried = dashboard_metrics()
    assert len(queried) >= 20 and not queried - exported, sorted(queried - exported)
    line = next(line for line in up.lines if "file_sd targets" in line)
    targets = json.loads(Path(line.split("targets:")[1].strip()).read_text())
    assert {t["labels"]["instance_name"]: int(t["targets"][0].rsplit(":", 1)[1]) for t in targets} == ports
