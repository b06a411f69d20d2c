"""shared/errors.py: OpenAI-shaped errors."""

from __future__ import annotations

import msgspec
import pytest

from shared import errors


@pytest.mark.parametrize(
    "error, status, type_, code, param, message_has",
    [
        (errors.invalid_request("bad thing", param="top_p", code="c"), 400, "invalid_request_error", "c", "top_p",
         "bad thing"),
        (errors.invalid_request("bad thing"), 400, "invalid_request_error", None, None, "bad thing"),
        (errors.invalid_api_key(), 401, "authentication_error", "invalid_api_key", None, "API key"),
        (errors.model_not_found("gpt-x"), 404, "invalid_request_error", "model_not_found", "model", "`gpt-x`"),
        (errors.context_length_exceeded(100, 90, 20), 400, "invalid_request_error", "context_length_exceeded",
         "messages", "110 tokens (90 in the prompt, 20 for the completion)"),
        (errors.context_length_exceeded(100, 120, None), 400, "invalid_request_error", "context_length_exceeded",
         "messages", "prompt has 120 tokens"),
        (errors.service_unavailable("busy"), 503, "server_error", "service_unavailable", None, "busy"),
        (errors.service_unavailable("no workers", code="no_capacity", retry_after_s=5), 503, "server_error",
         "no_capacity", None, "no workers"),
        (errors.engine_failed("boom"), 502, "server_error", "engine_error", None, "boom"),
    ],
)
def test_error_factories(error, status, type_, code, param, message_has):
    assert isinstance(error, errors.ApiError)
    assert (error.status, error.type, error.code, error.param) == (status, type_, code, param)
    assert message_has in error.message
    body = {"error": {"message": error.message, "type": type_, "param": param, "code": code}}
    assert error.body() == body
    assert msgspec.json.decode(error.json()) == body


@pytest.mark.parametrize(
    "error, headers",
    [
        (errors.service_unavailable("busy"), {"Retry-After": "1"}),
        (errors.service_unavailable("busy", retry_after_s=7), {"Retry-After": "7"}),
        (errors.invalid_request("x"), {}),
        (errors.engine_failed("x"), {}),
    ],
)
def test_error_headers(error, headers):
    assert error.headers == headers
