"""A recording HTTP proxy between an agent harness and the edge: every request is kept (method, path, headers,
body) with its response's status, ``x-request-id`` and whether it streamed; responses pass through as they come
(SSE included: each chunk is forwarded as soon as the edge sends it).

Stdlib only and threaded, so a test starts it beside ``infermesh up`` and reads ``exchanges`` afterwards."""

from __future__ import annotations

import http.client
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-authorization",
              "proxy-connection", "content-length", "host", "accept-encoding"}


@dataclass
class Exchange:
    method: str
    path: str
    headers: dict[str, str]  # as sent, names lower-cased
    body: bytes
    status: int = 0
    request_id: str = ""  # the edge's x-request-id
    content_type: str = ""
    response: bytes = b""
    client_left: bool = False  # the client closed the connection before the response ended


@dataclass
class RecordingProxy:
    upstream: str  # http://host:port
    exchanges: list[Exchange] = field(default_factory=list)
    _server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> RecordingProxy:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:  # quiet: the test reads exchanges
                pass

            def do_GET(self) -> None:
                proxy._forward(self)

            do_POST = do_DELETE = do_PUT = do_GET

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def _forward(self, handler: BaseHTTPRequestHandler) -> None:
        length = int(handler.headers.get("content-length") or 0)
        body = handler.rfile.read(length) if length else b""
        headers = {name.lower(): value for name, value in handler.headers.items()}
        exchange = Exchange(handler.command, handler.path, headers, body)
        self.exchanges.append(exchange)
        target = urlsplit(self.upstream)
        upstream = http.client.HTTPConnection(target.hostname, target.port, timeout=600)
        sent = {k: v for k, v in headers.items() if k not in HOP_BY_HOP}
        upstream.request(handler.command, handler.path, body=body or None, headers=sent)
        reply = upstream.getresponse()
        exchange.status = reply.status
        exchange.request_id = reply.getheader("x-request-id") or ""
        exchange.content_type = reply.getheader("content-type") or ""
        handler.send_response(reply.status)
        for name, value in reply.getheaders():
            if name.lower() not in HOP_BY_HOP:
                handler.send_header(name, value)
        handler.send_header("transfer-encoding", "chunked")
        handler.send_header("connection", "close")
        handler.end_headers()
        chunks = []
        try:
            while chunk := reply.read1(65536):
                chunks.append(chunk)
                handler.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                handler.wfile.flush()
            handler.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):  # the harness hung up (e.g. a title it no longer needs):
            exchange.client_left = True  # closing upstream below aborts the request at the edge, as a direct one
        finally:
            handler.close_connection = True
            exchange.response = b"".join(chunks)
            upstream.close()
