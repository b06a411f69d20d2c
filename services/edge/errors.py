"""What a client is told of the mesh's own failures: a stable message naming its request id, never the detail.

Exception text, worker ids, subjects and namespaces, file paths: the detail of a failure inside the mesh is for
its operators (the edge's log and the request's span, both under the request id), not for whoever sent the
request. A client gets the API's error shape (``shared/errors.py``: status, type, code, ``Retry-After``) with a
message that says what kind of thing failed and the request id to report, as OpenAI's own 5xx messages do.

The client's own mistakes are the exception: a 400's message names what to fix, and is the client's to read.
"""

from __future__ import annotations

import logging

from opentelemetry import trace

from shared import errors
from shared.schema import StreamErrorCode

log = logging.getLogger("infermesh.edge")

# a token stream's failure, as the client reads it (the code, also in the error body, says the same for programs)
STREAM_FAILURES: dict[StreamErrorCode, str] = {
    "engine_error": "The engine failed while generating the response.",
    "worker_unavailable": "The worker generating the response became unavailable.",
    "worker_shutdown": "The worker generating the response shut down.",
    "timeout": "The worker generating the response stopped answering.",
    "stream_gap": "The response's token stream lost messages.",
    "bad_message": "The response's token stream carried a message that could not be read.",
    "shutdown": "This server is shutting down.",
    "bad_request": "The engine refused the request.",
}


def reported(message: str, request_id: str) -> str:
    """``message``, then the request id to report (OpenAI's 5xx messages name theirs the same way)."""
    return f"{message} Retry the request; if the error persists, report its request ID {request_id}."


def stream_failure(code: StreamErrorCode, request_id: str) -> str:
    """What the client reads of a token stream that failed with ``code``."""
    return reported(STREAM_FAILURES.get(code, STREAM_FAILURES["engine_error"]), request_id)


def unavailable(what: str, code: str, detail: object, retry_after_s: int = 1) -> errors.ApiError:
    """503 ``code``: ``what`` (a part of the service, as a client may know it: "The router") is unavailable. The
    ``detail`` (an exception: its text names subjects, paths, hosts) goes to the log and the current span only."""
    hide(f"{what} is unavailable", detail)
    return errors.service_unavailable(f"{what} is unavailable; retry.", code, retry_after_s)


def hide(what: str, detail: object) -> None:
    """Keep ``detail`` for the operators: logged, and an event on the current span (the request's, where one is)."""
    log.warning("%s: %s", what, detail)
    span = trace.get_current_span()
    if span.is_recording():
        span.add_event("infermesh.internal_error", {"infermesh.error": what, "infermesh.error_detail": str(detail)})
