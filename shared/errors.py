"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

from __future__ import annotations

import math
from typing import Any

import msgspec


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def json(self) -> bytes:
        return msgspec.json.encode(self.body())


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)


def invalid_api_key() -> ApiError:
    return ApiError(401, "Incorrect API key provided. Pass it as 'Authorization: Bearer <key>'.",
                    "authentication_error", None, "invalid_api_key")


def model_not_found(model: str) -> ApiError:
    return ApiError(404, f"The model `{model}` does not exist or you do not have access to it.",
                    "invalid_request_error", "model", "model_not_found")


def context_length_exceeded(max_len: int, num_prompt: int, num_completion: int | None) -> ApiError:
    if num_completion is None:
        detail = f"your prompt has {num_prompt} tokens, leaving no room for a completion"
    else:
        detail = (f"you requested {num_prompt + num_completion} tokens "
                  f"({num_prompt} in the prompt, {num_completion} for the completion)")
    return ApiError(400, f"This model's maximum context length is {max_len} tokens. However, {detail}. "
                    "Please reduce the length of the prompt or the completion.",
                    "invalid_request_error", "messages", "context_length_exceeded")


def prompt_too_large_for_bus(num_prompt: int, need_bytes: int, limit_bytes: int, param: str) -> ApiError:
    return ApiError(400, f"The prompt's {num_prompt} tokens take {need_bytes} bytes on the mesh's bus, over its limit "
                    f"of {limit_bytes} bytes (the NATS server's max_payload). Please reduce the length of the prompt, "
                    "or raise max_payload on the NATS servers.", "invalid_request_error", param, "prompt_too_large")


def service_unavailable(message: str, code: str = "service_unavailable", retry_after_s: int = 1) -> ApiError:
    return ApiError(503, message, "server_error", None, code, {"Retry-After": str(retry_after_s)})


def engine_failed(message: str) -> ApiError:
    return ApiError(502, message, "server_error", None, "engine_error")


def rate_limited(message: str, retry_after_s: float, code: str = "rate_limit_exceeded") -> ApiError:
    """429 in OpenAI's shape, with a whole-second Retry-After (at least 1)."""
    return ApiError(429, message, "requests", None, code, {"Retry-After": str(max(1, math.ceil(retry_after_s)))})


class PoolFull(ApiError):
    """429: the model's pool has no room (now, or within the request's wait). Another deployment may have it."""


def pool_full(message: str, retry_after_s: float) -> PoolFull:
    error = rate_limited(f"Rate limit reached: {message}", retry_after_s)
    return PoolFull(error.status, error.message, error.type, error.param, error.code, error.headers)


def preempted() -> ApiError:
    """429: admission took a batch-class request's capacity back for interactive traffic (nothing is billed)."""
    return rate_limited("The request was preempted: its capacity was taken back for interactive traffic, and "
                        "nothing was billed for it. Send it again.", 1.0, "preempted")


def insufficient_quota(message: str) -> ApiError:
    """429 as OpenAI sends it when the account's quota is spent (not retryable by waiting seconds)."""
    return ApiError(429, f"You exceeded your current quota: {message}", "insufficient_quota", None,
                    "insufficient_quota")


def unrecognized_argument(name: str) -> ApiError:
    """OpenAI's answer to a body field it does not know (``logit_bias`` here, a typo anywhere)."""
    return ApiError(400, f"Unrecognized request argument supplied: {name}", "invalid_request_error", name,
                    "unrecognized_argument")


def body_too_large(limit: int) -> ApiError:
    return ApiError(413, f"The request body is larger than the limit of {limit} bytes.", "invalid_request_error",
                    None, "request_too_large", {"Connection": "close"})


def request_timeout(what: str, timeout_s: float) -> ApiError:
    """408: the client took longer than ``timeout_s`` to send ``what``; the connection is closed."""
    return ApiError(408, f"The request {what} did not arrive within {timeout_s:g} s.", "invalid_request_error",
                    None, "request_timeout", {"Connection": "close"})
