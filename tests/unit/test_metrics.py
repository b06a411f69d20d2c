"""shared/metrics.py: counters and gauges read at scrape time, the GenAI histograms and their exemplars, and the
small HTTP server (on a real socket)."""

from __future__ import annotations

import asyncio

from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families as text_families

from shared.metrics import GenAiServerMetrics, MetricsServer, exposition, service_registry


def samples(text: str, openmetrics: bool = False) -> dict[tuple[str, tuple], float]:
    parse = openmetrics_families if openmetrics else text_families
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in parse(text) for s in f.samples}


def test_stats_become_counters_with_a_kind_and_gauges_are_read_at_each_scrape():
    stats = {"granted": 3, "rejected:queue_full": 2, "rejected:too_large": 1}
    depth = {"tiny": 4.0}
    registry = service_registry("infermesh_x", lambda: stats, lambda: {"leader": 1.0, "queue_depth": depth})
    got = samples(exposition(registry)[0].decode())
    assert got[("infermesh_x_granted_total", (("kind", ""),))] == 3
    assert got[("infermesh_x_rejected_total", (("kind", "queue_full"),))] == 2
    assert got[("infermesh_x_queue_depth", (("of", "tiny"),))] == 4 and got[("infermesh_x_leader", ())] == 1
    stats["granted"], depth["tiny"] = 5, 0.0  # read again at the next scrape
    got = samples(exposition(registry)[0].decode())
    assert got[("infermesh_x_granted_total", (("kind", ""),))] == 5
    assert got[("infermesh_x_queue_depth", (("of", "tiny"),))] == 0


def test_genai_histograms_observe_ttft_and_time_per_output_token_with_the_trace_as_exemplar():
    registry = service_registry("infermesh_x", dict)
    genai = GenAiServerMetrics(registry)
    genai.observe(("tiny", "research"), duration_s=1.0, ttft_s=0.2, output_tokens=5, trace_id="ab" * 16)
    genai.observe(("tiny", "research"), duration_s=0.5, ttft_s=None, output_tokens=0)  # no token: duration only
    body, content_type = exposition(registry, "application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text")
    families = {f.name: f for f in openmetrics_families(body.decode())}
    labels = (("gen_ai_request_model", "tiny"), ("team", "research"))
    got = samples(body.decode(), openmetrics=True)
    assert got[("gen_ai_server_request_duration_seconds_count", labels)] == 2
    assert got[("gen_ai_server_time_to_first_token_seconds_count", labels)] == 1
    assert got[("gen_ai_server_time_per_output_token_seconds_sum", labels)] == 0.2  # (1.0 - 0.2) / 4
    exemplars = [s.exemplar for s in families["gen_ai_server_time_to_first_token_seconds"].samples if s.exemplar]
    assert [e.labels for e in exemplars] == [{"trace_id": "ab" * 16}] and exemplars[0].value == 0.2
    assert b"trace_id" not in exposition(registry)[0]  # the classic text format has no exemplars


async def _get(port: int, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    await writer.drain()
    reply = await reader.read()
    writer.close()
    return reply


async def test_the_server_answers_metrics_health_and_refuses_the_rest():
    healthy = [True]
    server = MetricsServer(service_registry("infermesh_x", lambda: {"lines": 7}), health=lambda: healthy[0],
                           header_timeout_s=0.2)
    port = await server.start()
    try:
        metrics = await _get(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert metrics.startswith(b"HTTP/1.1 200") and b'infermesh_x_lines_total{kind=""} 7.0' in metrics
        assert (await _get(port, b"GET /health HTTP/1.1\r\n\r\n")).startswith(b"HTTP/1.1 200")
        healthy[0] = False
        assert (await _get(port, b"GET /health HTTP/1.1\r\n\r\n")).startswith(b"HTTP/1.1 503")
        assert (await _get(port, b"POST /metrics HTTP/1.1\r\n\r\n")).startswith(b"HTTP/1.1 405")
        assert (await _get(port, b"GET /secrets HTTP/1.1\r\n\r\n")).startswith(b"HTTP/1.1 404")
        assert await _get(port, b"garbage that never ends") == b""  # dropped after the header timeout
        assert (await _get(port, b"GET /health HTTP/1.1\r\n\r\n")).startswith(b"HTTP/1.1 503")  # serves on
    finally:
        await server.stop()


async def test_a_taken_metrics_port_costs_the_metrics_not_the_service(caplog):
    from shared.config import BusConfig
    from shared.runner import _serve_metrics

    class Service:
        metrics = service_registry("infermesh_x", dict)

    taken = MetricsServer(service_registry("infermesh_y", dict))
    port = await taken.start()
    try:
        assert await _serve_metrics("x", BusConfig(metrics_port=port), Service()) is None
        assert "no metrics: cannot listen" in caplog.text
        served = await _serve_metrics("x", BusConfig(metrics_port=0), Service())
        assert served is not None and served.port not in (0, port)
        await served.stop()
        assert await _serve_metrics("x", BusConfig(), Service()) is None  # -1 (the default): none asked for
    finally:
        await taken.stop()
