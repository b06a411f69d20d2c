"""OpenAI's Batch API on the edge: ``/v1/batches`` create, retrieve, list, cancel, answered by the batch service.

The edge authenticates the key (a team sees only its own jobs) and asks the batch service over the bus
(``<ns>.batch.api.<operation>``: BatchApiRequest -> BatchApiReply); the service owns the jobs (ledger database)
and validates everything. The answer is OpenAI's batch object:

    {"id", "object": "batch", "endpoint", "errors", "input_file_id", "completion_window", "status",
     "output_file_id", "error_file_id", "created_at", "in_progress_at", "expires_at", "finalizing_at",
     "completed_at", "failed_at", "expired_at", "cancelling_at", "cancelled_at", "request_counts", "metadata"}
"""

from __future__ import annotations

from typing import Any, Callable

import msgspec
from litestar import Request, Response, get, post

from services.edge.errors import unavailable
from shared import errors
from shared.batch_schema import BatchApiReply, BatchApiRequest, BatchJobRecord
from shared.bus import Bus, BusError

API_TIMEOUT_S = 30.0  # a create reads and checks the whole input file


def batch_object(job: BatchJobRecord) -> dict[str, Any]:
    """The job as OpenAI's API shows a batch."""
    record = msgspec.to_builtins(job)
    errors_list = ({"object": "list", "data": record["errors"]} if job.errors else None)
    return {"id": job.id, "object": "batch", "endpoint": job.endpoint, "errors": errors_list,
            "input_file_id": job.input_file_id, "completion_window": job.completion_window, "status": job.status,
            "output_file_id": job.output_file_id, "error_file_id": job.error_file_id,
            "created_at": job.created_at, "in_progress_at": job.in_progress_at, "expires_at": job.expires_at,
            "finalizing_at": job.finalizing_at, "completed_at": job.completed_at, "failed_at": job.failed_at,
            "expired_at": job.expired_at, "cancelling_at": job.cancelling_at, "cancelled_at": job.cancelled_at,
            "request_counts": record["request_counts"], "metadata": job.metadata}


def _raise_if_error(reply: BatchApiReply) -> None:
    if reply.error_status:
        kind = "invalid_request_error" if reply.error_status < 500 else "server_error"
        raise errors.ApiError(reply.error_status, reply.error_message, kind, reply.error_param, reply.error_code)


async def ask(bus: Bus, operation: str, request: BatchApiRequest) -> BatchApiReply:
    try:
        reply = await bus.request(bus.subjects.batch_api(operation), request, BatchApiReply, timeout=API_TIMEOUT_S)
    except BusError as exc:
        raise unavailable("The batch service", "batch_unavailable", exc) from exc
    _raise_if_error(reply)
    return reply


def _json(body: dict[str, Any], status: int = 200) -> Response[bytes]:
    return Response(msgspec.json.encode(body), status_code=status, media_type="application/json")


def _create_request(team: str, raw: bytes) -> BatchApiRequest:
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise errors.invalid_request(f"The request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise errors.invalid_request("The request body must be a JSON object.")
    unknown = sorted(set(body) - {"input_file_id", "endpoint", "completion_window", "metadata"})
    if unknown:
        raise errors.unrecognized_argument(unknown[0])
    for name in ("input_file_id", "endpoint", "completion_window"):
        if not isinstance(body.get(name), str):
            raise errors.invalid_request(f"Missing required parameter: '{name}'.", name, "missing_required_parameter")
    metadata = body.get("metadata")
    if metadata is not None and not (isinstance(metadata, dict)
                                     and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise errors.invalid_request("metadata must be an object of string keys and string values.", "metadata")
    return BatchApiRequest(team=team, input_file_id=body["input_file_id"], endpoint=body["endpoint"],
                           completion_window=body["completion_window"], metadata=metadata)


def _limit(value: str | None) -> int:
    if value is None:
        return 20
    if not value.isdigit() or not 1 <= int(value) <= 100:
        raise errors.invalid_request("limit must be a whole number from 1 to 100.", "limit")
    return int(value)


def batch_routes(bus: Bus, authenticate: Callable[[str | None], Any]) -> list[Any]:
    """The four routes, bound to the local deployment's bus and the edge's key check."""

    def team_of(request: Request) -> str:
        return authenticate(request.headers.get("authorization")).team

    @post("/v1/batches")
    async def create_batch(request: Request) -> Response[bytes]:
        caller = authenticate(request.headers.get("authorization"))
        create = msgspec.structs.replace(_create_request(caller.team, await request.body()),
                                         key_prefix=caller.key_prefix)
        reply = await ask(bus, "create", create)
        assert reply.job is not None
        return _json(batch_object(reply.job))

    @get("/v1/batches")
    async def list_batches(request: Request) -> Response[bytes]:
        team = team_of(request)
        reply = await ask(bus, "list", BatchApiRequest(team=team, after=request.query_params.get("after") or "",
                                                        limit=_limit(request.query_params.get("limit"))))
        data = [batch_object(job) for job in reply.jobs]
        return _json({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                      "last_id": data[-1]["id"] if data else None, "has_more": reply.has_more})

    @get("/v1/batches/{batch_id:str}")
    async def retrieve_batch(request: Request, batch_id: str) -> Response[bytes]:
        reply = await ask(bus, "retrieve", BatchApiRequest(team=team_of(request), job_id=batch_id))
        assert reply.job is not None
        return _json(batch_object(reply.job))

    @post("/v1/batches/{batch_id:str}/cancel")
    async def cancel_batch(request: Request, batch_id: str) -> Response[bytes]:
        reply = await ask(bus, "cancel", BatchApiRequest(team=team_of(request), job_id=batch_id))
        assert reply.job is not None
        return _json(batch_object(reply.job))

    return [create_batch, list_batches, retrieve_batch, cancel_batch]
