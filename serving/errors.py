"""The one map between the project's exceptions and gRPC status codes, both ways.

Server side (`status_for`): only typed errors are the client's business —
| exception | status |
| --- | --- |
| `InvalidArgument` (worker, request checks), `CodecError` (bad tensor) | INVALID_ARGUMENT |
| `Unauthenticated` (no API key, or one the server does not know) | UNAUTHENTICATED |
| `PositionError` (a cache position the service does not hold) | FAILED_PRECONDITION |
| `CapacityError` (sessions, tokens per session) | RESOURCE_EXHAUSTED |
| `SessionNotFound` (unknown or expired session) | NOT_FOUND |
| `SessionExists` (a chosen session id that is taken) | ALREADY_EXISTS |
| `SessionConflict` (busy with another generation, taken over, closed) | ABORTED |
| `ServiceUnavailable` (a dependency is down) | UNAVAILABLE |
| `DeadlineExceeded` | DEADLINE_EXCEEDED |
| `CallCancelled` | CANCELLED |
Anything else — a shape check, an index error, a bug — is INTERNAL, logged with its
traceback by the interceptor, and its detail never tells a client its input was wrong.

Client side (`error_from_status`): the status of an internal call becomes the same
exception again, naming the service, so the orchestrator reacts to it (re-prefill on
FAILED_PRECONDITION) and passes it on with the right code. An internal service's
INVALID_ARGUMENT is the orchestrator's own mistake (it checked the request before
calling), so it becomes `InternalServiceError`: INTERNAL for the public client.
"""

from __future__ import annotations

import grpc

from hydra_jury.protos.codec import CodecError
from hydra_jury.workers.errors import CapacityError, InvalidArgument, PositionError


class Unauthenticated(RuntimeError):
    """A call to a server that requires an API key came without a valid one."""


class ServiceUnavailable(RuntimeError):
    """An internal service this one depends on cannot be reached."""


class SessionNotFound(LookupError):
    """The session a client named does not exist (or expired)."""


class SessionExists(ValueError):
    """A client chose a session id that is already taken."""


class SessionConflict(RuntimeError):
    """Another writer has the session: it is generating, took it over, or closed it."""


class DeadlineExceeded(RuntimeError):
    """An internal call ran out of the client's deadline."""


class CallCancelled(RuntimeError):
    """An internal call was cancelled."""


class InternalServiceError(RuntimeError):
    """An internal service failed, or refused a call the orchestrator should never have
    sent: not the public client's fault."""


_STATUS_BY_ERROR: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (CodecError, grpc.StatusCode.INVALID_ARGUMENT),
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (PositionError, grpc.StatusCode.FAILED_PRECONDITION),
    (CapacityError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (SessionNotFound, grpc.StatusCode.NOT_FOUND),
    (SessionExists, grpc.StatusCode.ALREADY_EXISTS),
    (SessionConflict, grpc.StatusCode.ABORTED),
    (ServiceUnavailable, grpc.StatusCode.UNAVAILABLE),
    (DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
    (CallCancelled, grpc.StatusCode.CANCELLED),
)

# Internal statuses that are a dependency's condition rather than our bug. NOT_FOUND
# from a worker service means it does not hold the session: a position not held.
_ERROR_BY_STATUS: dict[grpc.StatusCode, type[Exception]] = {
    grpc.StatusCode.FAILED_PRECONDITION: PositionError,
    grpc.StatusCode.NOT_FOUND: PositionError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: CapacityError,
    grpc.StatusCode.UNAVAILABLE: ServiceUnavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: CallCancelled,
}


def status_for(error: BaseException) -> grpc.StatusCode:
    """The status code a server answers for `error` (INTERNAL for anything untyped)."""
    for error_type, code in _STATUS_BY_ERROR:
        if isinstance(error, error_type):
            return code
    return grpc.StatusCode.INTERNAL


def error_from_status(code: grpc.StatusCode, where: str, detail: str) -> Exception:
    """The exception for an internal call to `where` that failed with `code`."""
    error_type = _ERROR_BY_STATUS.get(code, InternalServiceError)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InternalServiceError(f"{where} refused a call: {detail}")
    if error_type is InternalServiceError:
        return InternalServiceError(f"{where} failed with {code.name}: {detail}")
    return error_type(f"{where}: {detail}" if detail else where)


# What a command reports as one line instead of a traceback: a bad checkpoint, option,
# source or address, a service that cannot be reached.
EXPECTED_FAILURES = (ValueError, KeyError, OSError, RuntimeError)


def failure_line(prog: str, error: BaseException) -> str:
    """ "PROG: error: MESSAGE" for an expected failure of a command."""
    message = error.args[0] if isinstance(error, KeyError) and error.args else error
    return f"{prog}: error: {message}"


def detail_for(error: BaseException) -> str:
    """The readable detail sent with a status: the message for typed errors, a generic
    line for INTERNAL (the traceback goes to the log, not to the client)."""
    if status_for(error) == grpc.StatusCode.INTERNAL and not isinstance(
        error, InternalServiceError
    ):
        return f"internal error ({type(error).__name__}); see the server log"
    return str(error) or type(error).__name__
