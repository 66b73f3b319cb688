"""The Generation API's log line per generation: when it finishes, or fails, one line
with its ids (request, session, the API key's name, its trace: the server span's when
tracing is on, else the one its caller's `traceparent` header names), its status, token
counts and duration, never its prompt or text. With `--log-format json` the fields are
keys of the line (`serving.logs`), so a log pipeline can join a request's line to its
trace and its session. The same ids and counts go on the request's span.

A call that fails without a generation's line (refused before it began: a missing API
key, a body that is not JSON, a failed CreateSession or CloseSession) gets one line too
(`log_failed_call`), with its method, status, detail and trace id."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field

import grpc

from hydra_jury.orchestrator.sessions.runner import Committed
from hydra_jury.protos.hydrajury.v1 import generation_pb2
from hydra_jury.serving.errors import detail_for, status_for
from hydra_jury.serving.logs import trace_id
from hydra_jury.serving.tracing import annotate, current_trace_id

log = logging.getLogger("hydra_jury.requests")
TRACEPARENT = "traceparent"  # the W3C Trace Context header, gRPC metadata alike
_NOT_ON_THE_SPAN = ("rpc", "key_name", "trace_id", "detail")
# Whether the call in this context logged a generation's line (its failure is in it).
_generation_logged: ContextVar[bool] = ContextVar("generation_logged", default=False)


@dataclass(frozen=True)
class Call:
    """The API call a generation serves: its method (a gRPC method, or an HTTP API path)
    and its trace id: the current span's when tracing is on, else its `traceparent`
    header's (None: neither, or the header is not valid)."""

    rpc: str
    trace_id: str | None = None

    @classmethod
    def grpc(cls, rpc: str, context: grpc.aio.ServicerContext) -> Call:
        metadata = dict(context.invocation_metadata() or ())
        return cls(rpc, current_trace_id() or trace_id(metadata.get(TRACEPARENT)))

    @classmethod
    def http(cls, path: str, headers: Mapping[str, str]) -> Call:
        """`headers`: the HTTP request's (case-insensitive, as Starlette's are)."""
        return cls(path, current_trace_id() or trace_id(headers.get(TRACEPARENT)))


@dataclass
class RequestLog:
    """One generation's line, its counts gathered round by round (`observe`), written
    once by `finished` or `failed`."""

    call: Call
    request_id: str | None
    session_id: str | None
    key_name: str | None  # None on a server without API keys
    prompt_tokens: int | None = None  # known from the summary, on the last round
    generated_tokens: int = 0
    rounds: int = 0
    began: float = field(default_factory=time.monotonic)

    @classmethod
    def of(cls, call: Call, request: generation_pb2.GenerateRequest, key_name: str) -> RequestLog:
        return cls(call, request.request_id or None, request.session_id or None, key_name or None)

    def observe(self, committed: Committed) -> None:
        self.session_id = committed.session_id
        self.rounds += 1
        self.generated_tokens += len(committed.round.tokens)
        if committed.summary is not None:
            self.prompt_tokens = committed.summary.prompt_tokens
            self.request_id = committed.summary.request_id or self.request_id

    def finished(self) -> None:
        self._write(grpc.StatusCode.OK, None)

    def failed(self, error: BaseException) -> None:
        """`error` ended the generation: a refusal or failure, or the caller going away
        (cancelled, or the rounds closed before their end)."""
        if isinstance(error, asyncio.CancelledError | GeneratorExit):
            code, detail = grpc.StatusCode.CANCELLED, "cancelled by the caller"
        else:
            code, detail = status_for(error), detail_for(error)
        self._write(code, detail)

    def _write(self, code: grpc.StatusCode, detail: str | None) -> None:
        _generation_logged.set(True)
        fields = {
            "rpc": self.call.rpc,
            "status": code.name,
            "request_id": self.request_id,
            "session_id": self.session_id,
            "key_name": self.key_name,
            "trace_id": self.call.trace_id,
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "rounds": self.rounds,
            "duration_s": round(time.monotonic() - self.began, 4),
        }
        if detail is not None:
            fields["detail"] = detail
        # Not the detail: a refusal's detail may quote what the client sent.
        annotate(**{k: v for k, v in fields.items() if k not in _NOT_ON_THE_SPAN})
        outcome = "finished OK" if detail is None else f"failed {code.name}: {detail}"
        log.log(
            _level(code),
            "%s %s (request %s, session %s, key %s, trace %s): %s prompt and %d generated "
            "tokens in %d rounds, %.3f s",
            fields["rpc"],
            outcome,
            *(fields[name] for name in ("request_id", "session_id", "key_name", "trace_id")),
            *(fields[name] for name in ("prompt_tokens", "generated_tokens", "rounds")),
            fields["duration_s"],
            extra=fields,
        )


def log_failed_call(rpc: str, code: grpc.StatusCode, detail: str, trace: str | None = None) -> None:
    """One line for a failed call of `rpc` (a gRPC method, or an HTTP API path), unless
    its generation's line told of the failure already; `trace`: its trace id when the
    caller knows it (default: the current span's)."""
    if _generation_logged.get():
        return
    fields = {
        "rpc": rpc,
        "status": code.name,
        "detail": detail,
        "request_id": None,
        "session_id": None,
        "trace_id": trace or current_trace_id(),
    }
    log.log(
        _level(code),
        "%s failed %s: %s (trace %s)",
        rpc,
        code.name,
        detail,
        fields["trace_id"],
        extra=fields,
    )


def _level(code: grpc.StatusCode) -> int:
    """A line's level: INFO when the call finished, ERROR for a bug (INTERNAL), else
    WARNING (a refusal, a failed service, the caller going away)."""
    if code == grpc.StatusCode.OK:
        return logging.INFO
    return logging.ERROR if code == grpc.StatusCode.INTERNAL else logging.WARNING
