"""Stored responses of OpenAI's Responses API on the wire: the edge asks metering, which keeps them in the ledger.

    edge --ResponsesApiRequest--> <ns>.responses.api.<operation> (any metering replica) --> ResponsesApiReply

| operation     | the edge sends                  | metering answers                                              |
|---------------|---------------------------------|---------------------------------------------------------------|
| ``store``     | ``record`` (a finished response)| ok once the row is committed (twice is once: the id is the key)|
| ``get``       | ``response_id``                 | ``response``: the response object, JSON                        |
| ``input_items``| ``response_id``                | ``items``: that request's own input items, JSON                |
| ``context``   | ``response_id``                 | ``items``: the conversation it ends, oldest first: every       |
|               |                                 | response's input items then its output, along the chain of     |
|               |                                 | ``previous_response_id`` (what a request continuing it sees)   |
| ``delete``    | ``response_id``                 | ok                                                             |

A response of another team, an expired one (past the retention metering keeps) and a deleted one are the same
404 (no one learns which ids exist). Errors come back as OpenAI's (``error_status`` and the rest) for the edge
to raise as they are.
"""

from __future__ import annotations

from typing import Literal

from msgspec import Struct

ResponsesOperation = Literal["store", "get", "input_items", "context", "delete"]
OPERATIONS: tuple[ResponsesOperation, ...] = ("store", "get", "input_items", "context", "delete")
MAX_RESPONSE_ID = 64  # resp_<32 hex> is 37
MAX_CHAIN = 10_000  # responses along one chain of previous_response_id, at most


class StoredResponse(Struct, frozen=True, kw_only=True):
    """A finished response as it is kept: the object a GET answers and what its request sent."""

    id: str
    team: str
    created_at: float  # unix seconds (the response's own created_at)
    previous_response_id: str | None = None
    response: bytes  # the response object, JSON
    input_items: bytes  # the request's own input items (ids given), JSON list


class ResponsesApiRequest(Struct, frozen=True, kw_only=True):
    team: str
    response_id: str = ""
    record: StoredResponse | None = None  # store


class ResponsesApiReply(Struct, frozen=True, kw_only=True):
    response: bytes = b""  # get
    items: bytes = b""  # input_items, context
    error_status: int = 0
    error_message: str = ""
    error_param: str | None = None
    error_code: str | None = None
