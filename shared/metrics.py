"""Prometheus metrics of a service, and the small HTTP server that serves them (``/metrics``, ``/health``).

Every service keeps a ``CollectorRegistry`` of its own (several services share a process in tests and in
``infermesh.local``): OpenTelemetry's GenAI server histograms where requests are served (their Prometheus names:
``gen_ai_server_request_duration_seconds``, ``gen_ai_server_time_to_first_token_seconds``,
``gen_ai_server_time_per_output_token_seconds``), whose exemplars carry the request's trace id, and the service's
own counters (its ``stats``) and gauges, read at scrape time. Exemplars travel in the OpenMetrics format, which
Prometheus asks for (``Accept: application/openmetrics-text``); the classic text format leaves them out.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Histogram, generate_latest as text_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.openmetrics.exposition import (
    CONTENT_TYPE_LATEST as OPENMETRICS,
    generate_latest as openmetrics_latest,
)
from prometheus_client.registry import Collector

log = logging.getLogger("infermesh.metrics")
TEXT = "text/plain; version=0.0.4; charset=utf-8"
# OpenTelemetry's advised buckets for the GenAI server metrics (semantic conventions, gen-ai-metrics)
DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class GenAiServerMetrics:
    """The GenAI server histograms, labelled by model (and team where it is known)."""

    def __init__(self, registry: CollectorRegistry, labels: tuple[str, ...] = ("gen_ai_request_model", "team")):
        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=registry)

        self.labels = labels
        self.duration = histogram("gen_ai_server_request_duration_seconds",
                                  "GenAI server request duration (arrival to the last token)", DURATION_BUCKETS)
        self.ttft = histogram("gen_ai_server_time_to_first_token_seconds",
                              "Time to generate the first token", TTFT_BUCKETS)
        self.tpot = histogram("gen_ai_server_time_per_output_token_seconds",
                              "Time per output token after the first", TPOT_BUCKETS)

    def observe(self, label_values: tuple[str, ...], duration_s: float, ttft_s: float | None, output_tokens: int,
                trace_id: str = "") -> None:
        exemplar = {"trace_id": trace_id} if trace_id else None
        self.duration.labels(*label_values).observe(duration_s, exemplar)
        if ttft_s is None:
            return
        self.ttft.labels(*label_values).observe(ttft_s, exemplar)
        if output_tokens > 1:
            self.tpot.labels(*label_values).observe(max(duration_s - ttft_s, 0.0) / (output_tokens - 1), exemplar)


class StatsCollector(Collector):
    """A service's counters (its ``stats``), read at scrape time: ``name`` becomes
    ``<prefix>_name_total``, ``name:kind`` the same counter with label ``kind``."""

    def __init__(self, prefix: str, stats: Callable[[], Mapping[str, int | float]], known: tuple[str, ...] = ()):
        self.prefix, self.stats, self.known = prefix, stats, known  # known: exported at 0 before they count

    def collect(self) -> Iterable[Metric]:
        families: dict[str, CounterMetricFamily] = {}
        stats = {**{name: 0 for name in self.known}, **self.stats()}
        for key, value in sorted(stats.items()):
            name, _, kind = key.partition(":")
            metric = f"{self.prefix}_{_safe(name)}"
            family = families.get(metric)
            if family is None:
                family = families[metric] = CounterMetricFamily(metric, f"{name} (counter)", labels=["kind"])
            family.add_metric([kind], float(value))
        yield from families.values()


Gauges = Callable[[], Mapping[str, float | Mapping[str, float]]]


class GaugesCollector(Collector):
    """A service's gauges, read at scrape time: name -> value, or name -> {label value: value} (label ``of``)."""

    def __init__(self, prefix: str, gauges: Gauges) -> None:
        self.prefix, self.gauges = prefix, gauges

    def collect(self) -> Iterable[Metric]:
        for name, value in sorted(self.gauges().items()):
            metric = f"{self.prefix}_{_safe(name)}"
            if isinstance(value, Mapping):
                family = GaugeMetricFamily(metric, name, labels=["of"])
                for label, v in sorted(value.items()):
                    family.add_metric([label], float(v))
                yield family
            else:
                yield GaugeMetricFamily(metric, name, value=float(value))


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c == "_" else "_" for c in name)


def exposition(registry: CollectorRegistry, accept: str = "") -> tuple[bytes, str]:
    """The registry in the format asked for: OpenMetrics (with exemplars) when ``accept`` names it."""
    if "application/openmetrics-text" in accept:
        return openmetrics_latest(registry), OPENMETRICS
    return text_latest(registry), TEXT


class MetricsServer:
    """``GET /metrics`` (the registry) and ``GET /health`` on a port of their own, for a service with no HTTP."""

    def __init__(self, registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0,
                 health: Callable[[], bool] = lambda: True, header_timeout_s: float = 5.0) -> None:
        self.registry, self.host, self.port, self.health = registry, host, port, health
        self.header_timeout_s = header_timeout_s  # a client that never ends its request is dropped after it
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.header_timeout_s)
            lines = head.decode("latin-1").split("\r\n")
            method, path, *_ = lines[0].split(" ") + ["", ""]
            headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
            status, body, content_type = self._answer(method, path.split("?")[0], headers.get("accept", ""))
            writer.write(f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
                         "Connection: close\r\n\r\n".encode() + body)
            await writer.drain()
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        except Exception:
            log.exception("metrics request failed")
        finally:
            writer.close()

    def _answer(self, method: str, path: str, accept: str) -> tuple[str, bytes, str]:
        if method != "GET":
            return "405 Method Not Allowed", b"GET only\n", "text/plain"
        if path == "/metrics":
            body, content_type = exposition(self.registry, accept)
            return "200 OK", body, content_type
        if path in ("/health", "/ready"):
            ok = self.health()
            return ("200 OK" if ok else "503 Service Unavailable"), (b'{"status":"ok"}' if ok else
                                                                     b'{"status":"unhealthy"}'), "application/json"
        return "404 Not Found", b"not found\n", "text/plain"


def service_registry(prefix: str, stats: Callable[[], Mapping[str, int | float]], gauges: Gauges | None = None,
                     known: tuple[str, ...] = ()) -> CollectorRegistry:
    """A service's own registry: its counters (``known`` ones exported at 0 from the start, so dashboards and
    alerts find them) and gauges, read at each scrape."""
    registry = CollectorRegistry()
    registry.register(StatsCollector(prefix, stats, known))
    if gauges is not None:
        registry.register(GaugesCollector(prefix, gauges))
    return registry
