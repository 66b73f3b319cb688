"""The one exception ⇄ status-code map, both ways."""

from __future__ import annotations

import grpc
import pytest

from hydra_jury.orchestrator.request import RequestError
from hydra_jury.protos.codec import CodecError
from hydra_jury.serving.errors import (
    CallCancelled,
    DeadlineExceeded,
    InternalServiceError,
    ServiceUnavailable,
    SessionNotFound,
    detail_for,
    error_from_status,
    status_for,
)
from hydra_jury.workers.errors import (
    CapacityError,
    InvalidArgument,
    PositionError,
    UnknownSessionError,
)

Code = grpc.StatusCode


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (InvalidArgument("gamma: must be in 1..16"), Code.INVALID_ARGUMENT),
        (RequestError("prompt is empty"), Code.INVALID_ARGUMENT),
        (CodecError("hidden: shape [2] does not match [*, 64]"), Code.INVALID_ARGUMENT),
        (PositionError("the trunk holds 3 positions"), Code.FAILED_PRECONDITION),
        (UnknownSessionError("unknown session 's'"), Code.FAILED_PRECONDITION),
        (CapacityError("all 2 sessions are in use"), Code.RESOURCE_EXHAUSTED),
        (SessionNotFound("no service holds session 's'"), Code.NOT_FOUND),
        (ServiceUnavailable("jury shard at x is unavailable"), Code.UNAVAILABLE),
        (DeadlineExceeded("the request's deadline passed"), Code.DEADLINE_EXCEEDED),
        (CallCancelled("trunk service was cancelled"), Code.CANCELLED),
        (InternalServiceError("jury shard at x refused a call"), Code.INTERNAL),
    ],
)
def test_typed_errors_have_their_status_and_keep_their_message(error, code):
    assert status_for(error) == code
    assert detail_for(error) == str(error)


@pytest.mark.parametrize(
    "error",
    [
        ValueError("must have 2 dimensions, got shape [3]"),
        IndexError("index 9 is out of bounds"),
        KeyError("head9"),
        RuntimeError("CUDA error"),
    ],
)
def test_anything_untyped_is_internal_and_its_message_stays_in_the_log(error):
    assert status_for(error) == Code.INTERNAL
    detail = detail_for(error)
    assert detail == f"internal error ({type(error).__name__}); see the server log"


@pytest.mark.parametrize(
    ("code", "error_type", "public_code"),
    [
        # A condition of a dependency keeps its meaning for the public client...
        (Code.FAILED_PRECONDITION, PositionError, Code.FAILED_PRECONDITION),
        (Code.NOT_FOUND, PositionError, Code.FAILED_PRECONDITION),  # not held: re-prefill
        (Code.RESOURCE_EXHAUSTED, CapacityError, Code.RESOURCE_EXHAUSTED),
        (Code.UNAVAILABLE, ServiceUnavailable, Code.UNAVAILABLE),
        (Code.DEADLINE_EXCEEDED, DeadlineExceeded, Code.DEADLINE_EXCEEDED),
        (Code.CANCELLED, CallCancelled, Code.CANCELLED),
        # ...an internal refusal or failure is INTERNAL, never the client's argument.
        (Code.INVALID_ARGUMENT, InternalServiceError, Code.INTERNAL),
        (Code.INTERNAL, InternalServiceError, Code.INTERNAL),
        (Code.UNKNOWN, InternalServiceError, Code.INTERNAL),
    ],
)
def test_an_internal_status_becomes_the_exception_again(code, error_type, public_code):
    error = error_from_status(code, "jury shard at 127.0.0.1:1 (Score)", "what went wrong")
    assert type(error) is error_type
    assert "jury shard at 127.0.0.1:1 (Score)" in str(error)
    assert "what went wrong" in str(error)
    assert status_for(error) == public_code
