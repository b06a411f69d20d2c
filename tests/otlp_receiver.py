"""A real OTLP/HTTP trace receiver for tests: what the services' exporters send to a collector, decoded.

It listens on ``/v1/traces`` (protobuf, optionally gzip: the OTLP exporter's defaults), as Jaeger, Phoenix or an
OpenTelemetry collector would, and keeps every span it receives with the name of the service that sent it."""

from __future__ import annotations

import gzip
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root span
    kind: int  # opentelemetry.proto.trace.v1.Span.SpanKind
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: tuple[str, ...]
    status: int  # 0 unset, 1 ok, 2 error
    links: tuple[str, ...] = ()  # the span ids it links to

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def decode(body: bytes) -> list[ReceivedSpan]:
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    spans = []
    for resource_spans in request.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for s in scope_spans.spans:
                spans.append(ReceivedSpan(
                    resource.get("service.name", ""), s.name, s.trace_id.hex(), s.span_id.hex(),
                    s.parent_span_id.hex(), s.kind, s.start_time_unix_nano, s.end_time_unix_nano,
                    {a.key: _value(a.value) for a in s.attributes}, tuple(e.name for e in s.events), s.status.code,
                    tuple(link.span_id.hex() for link in s.links)))
    return spans


class OtlpReceiver:
    """``with OtlpReceiver() as otlp: ... otlp.endpoint``: spans land in ``otlp.spans``. With ``keep_spans=False``
    (a benchmark's sink) it only counts the exports and their bytes."""

    def __init__(self, keep_spans: bool = True) -> None:
        self.spans: list[ReceivedSpan] = []
        self.requests = self.bytes_received = 0
        lock, spans, receiver = threading.Lock(), self.spans, self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                received = decode(body) if receiver.keep_spans else []
                with lock:
                    spans.extend(received)
                    receiver.requests += 1
                    receiver.bytes_received += len(body)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.keep_spans = keep_spans
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        """What ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set to (the exporter appends ``/v1/traces``)."""
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def of_trace(self, trace_id: str) -> list[ReceivedSpan]:
        return [s for s in list(self.spans) if s.trace_id == trace_id]

    def __enter__(self) -> "OtlpReceiver":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.shutdown()
        self._server.server_close()
