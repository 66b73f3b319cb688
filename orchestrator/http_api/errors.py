"""Errors of the HTTP API, written as OpenAI's API writes them —
`{"error": {"message", "type", "param", "code"}}` — with an HTTP status.

Every error has the gRPC status code the gRPC API would answer (`serving.errors`, the
one exception ⇄ status map), and its HTTP status follows from that code as google.rpc's
codes map to HTTP (what gRPC gateways answer): a client of either API sees the same
failure, with the same detail."""

from __future__ import annotations

from typing import Any

import grpc

from hydra_jury.serving.errors import detail_for, status_for

Code = grpc.StatusCode

# gRPC status code → (HTTP status, OpenAI's error type).
HTTP_STATUS: dict[grpc.StatusCode, tuple[int, str]] = {
    Code.INVALID_ARGUMENT: (400, "invalid_request_error"),
    Code.FAILED_PRECONDITION: (400, "invalid_request_error"),
    Code.OUT_OF_RANGE: (400, "invalid_request_error"),
    Code.UNAUTHENTICATED: (401, "authentication_error"),
    Code.PERMISSION_DENIED: (403, "permission_error"),
    Code.NOT_FOUND: (404, "not_found_error"),
    Code.ALREADY_EXISTS: (409, "conflict_error"),
    Code.ABORTED: (409, "conflict_error"),
    Code.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    Code.CANCELLED: (499, "cancelled_error"),
    Code.UNAVAILABLE: (503, "service_unavailable_error"),
    Code.DEADLINE_EXCEEDED: (504, "timeout_error"),
}
INTERNAL = (500, "server_error")


class ApiError(Exception):
    """A failed request: its gRPC status code, a readable message, the request field it
    concerns (`param`) and OpenAI's machine-readable `code` (default: the gRPC code's
    name); `http_status` where HTTP has a more precise one than the code's."""

    def __init__(
        self,
        status: grpc.StatusCode,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        http_status: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code = code or status.name.lower()
        default_status, self.type = HTTP_STATUS.get(status, INTERNAL)
        self.http_status = http_status or default_status
        # A generation's failure: its own log line told of it (`request_log`).
        self.generation_failed = False

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def invalid(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    """A request the HTTP layer refuses (400), before anything runs."""
    return ApiError(Code.INVALID_ARGUMENT, message, param=param, code=code)


def api_error(error: BaseException) -> ApiError:
    """The error of a generation that failed with `error` (as the gRPC API reports it:
    INTERNAL with a generic message for anything untyped)."""
    if isinstance(error, ApiError):
        return error
    return ApiError(status_for(error), detail_for(error))
