"""Client authentication: the server interceptor that checks each call's API key, and
the client side that sends one (`with_api_key`).

A call carries its key as `authorization: Bearer KEY` metadata. The interceptor looks it
up in the server's `KeyFile` (`serving.api_keys`) and either refuses the call —
UNAUTHENTICATED, with a detail saying what was wrong and never echoing a key — or runs
it with the key in `current_key()`. Health checks and reflection stay open unless
`protect_open_services`: Kubernetes' gRPC probes cannot send metadata.

The key reaches the servicer through a context variable set by the interceptor rather
than by the servicer reading the metadata again: the key is then looked up once, in
one place, and a servicer method cannot forget the check.
"""

from __future__ import annotations

import contextvars
from collections import namedtuple
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import grpc
from grpc_health.v1 import health
from grpc_reflection.v1alpha import reflection

from hydra_jury.serving.api_keys import ApiKey, KeyFile, KeyLimits
from hydra_jury.serving.errors import Unauthenticated, detail_for, status_for

METADATA_KEY = "authorization"
SCHEME = "Bearer"
# Services callers reach without a key unless told otherwise (health: the probes).
OPEN_SERVICES = frozenset(
    {health.SERVICE_NAME, reflection.SERVICE_NAME, "grpc.reflection.v1.ServerReflection"}
)

# Why a call was refused (the unauthenticated-calls metric's reasons).
MISSING = "missing"  # no authorization metadata
MALFORMED = "malformed"  # not "Bearer KEY", or more than one
UNKNOWN = "unknown"  # a key the file does not hold (or no longer does)

_current_key: contextvars.ContextVar[ApiKey | None] = contextvars.ContextVar(
    "hydra_jury_api_key", default=None
)


def current_key() -> ApiKey | None:
    """The key of the call being served (None on a server without keys)."""
    return _current_key.get()


def bearer_metadata(key: str) -> tuple[tuple[str, str], ...]:
    """The metadata that authenticates a call with `key`."""
    return ((METADATA_KEY, f"{SCHEME} {key}"),)


class _CallDetails(
    namedtuple(
        "_CallDetails",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),
    grpc.ClientCallDetails,
):
    """A call's details with other metadata (grpc gives no way to change them in place)."""


class _SendsKey(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    def __init__(self, key: str) -> None:
        self.metadata = bearer_metadata(key)

    def _with_key(self, details: grpc.ClientCallDetails) -> _CallDetails:
        return _CallDetails(
            details.method,
            details.timeout,
            (*(details.metadata or ()), *self.metadata),
            details.credentials,
            details.wait_for_ready,
            details.compression,
        )

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._with_key(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._with_key(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._with_key(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._with_key(client_call_details), request_iterator)


def with_api_key(channel: grpc.Channel, key: str | None) -> grpc.Channel:
    """`channel`, sending `key` with every call (unchanged without a key)."""
    return channel if not key else grpc.intercept_channel(channel, _SendsKey(key))


def _presented_key(values: list[str | bytes]) -> tuple[str, str]:
    """(the key presented, "") or ("", why it cannot be one)."""
    if not values:
        return "", MISSING
    if len(values) > 1 or not isinstance(values[0], str):
        return "", MALFORMED
    scheme, _, key = values[0].partition(" ")
    if scheme.lower() != SCHEME.lower() or not key.strip():
        return "", MALFORMED
    return key.strip(), ""


def authenticate(keys: KeyFile, values: list[str | bytes]) -> tuple[ApiKey | None, str]:
    """The key a call presents as `values`, every value of its authorization metadata
    (gRPC) or header (HTTP): (the key, "") or (None, why not: MISSING, MALFORMED,
    UNKNOWN)."""
    presented, why = _presented_key(values)
    key = keys.keys.find(presented) if presented else None
    return key, "" if key is not None else why or UNKNOWN


def refusal(reason: str, carrier: str = "metadata") -> str:
    """The detail of a refusal for `reason`; `carrier` names what carries the key
    ("metadata" in gRPC, "header" in HTTP)."""
    name = METADATA_KEY if carrier == "metadata" else METADATA_KEY.capitalize()
    return {
        MISSING: f"this server requires an API key: send the {carrier} '{name}: {SCHEME} <key>'",
        MALFORMED: f"the '{name}' {carrier} must be one value, '{SCHEME} <key>'",
        UNKNOWN: "the API key is not valid on this server",
    }[reason]


@dataclass(frozen=True)
class ApiKeyAuth:
    """A server's client authentication: its keys, and whether health checks and
    reflection need one too."""

    keys: KeyFile
    protect_open_services: bool = False

    def interceptor(self, on_refused: Callable[[str, str], None]) -> ApiKeyInterceptor:
        return ApiKeyInterceptor(
            self.keys, protect_open_services=self.protect_open_services, on_refused=on_refused
        )


class AuthSettings(Protocol):
    """What a server's settings say about authentication: the parsed flags, or the
    orchestrator's configuration (`orchestrator.flags.add_api_key_flags`)."""

    api_keys: str | None  # the key file; None: open to any client
    auth_health: bool | None
    max_concurrent_per_key: int | None
    tokens_per_minute_per_key: int | None


def auth_from(settings: AuthSettings) -> ApiKeyAuth | None:
    """The authentication `settings` ask for, None for an open server. The key file is
    read now, so that a bad one stops the server before it loads anything. A default
    limit of 0 is no limit, as on a key's line."""
    limits = {
        "--max-concurrent-per-key": settings.max_concurrent_per_key,
        "--tokens-per-minute-per-key": settings.tokens_per_minute_per_key,
    }
    for flag, value in limits.items():
        if value is not None and value < 0:
            raise ValueError(f"{flag} must be 0 (no limit) or more, got {value}")
    defaults = KeyLimits(
        max_concurrent=settings.max_concurrent_per_key or None,
        tokens_per_minute=settings.tokens_per_minute_per_key or None,
    )
    protect_open_services = bool(settings.auth_health)
    if settings.api_keys is None:
        given = [flag for flag, value in limits.items() if value]
        given += ["--auth-health"] if protect_open_services else []
        if given:
            raise ValueError(f"{' and '.join(given)} need API keys: give --api-keys FILE too")
        return None
    return ApiKeyAuth(KeyFile(settings.api_keys, defaults), protect_open_services)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Runs each call of a protected service with its key in `current_key()`, or
    refuses it (`on_refused` is told why — missing, malformed, unknown — and the full
    method refused)."""

    def __init__(
        self,
        keys: KeyFile,
        *,
        protect_open_services: bool = False,
        on_refused: Callable[[str, str], None] = lambda reason, method: None,
    ) -> None:
        self.keys = keys
        self.open_services = frozenset() if protect_open_services else OPEN_SERVICES
        self.on_refused = on_refused

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        service = handler_call_details.method.split("/")[1]
        if handler is None or service in self.open_services:
            return handler
        metadata = handler_call_details.invocation_metadata or ()
        key, reason = authenticate(
            self.keys, [value for name, value in metadata if name == METADATA_KEY]
        )
        if key is None:

            async def refuse(context: grpc.aio.ServicerContext) -> None:
                self.on_refused(reason, handler_call_details.method)
                error = Unauthenticated(refusal(reason))
                await context.abort(status_for(error), detail_for(error))

            return _run_first(handler, refuse)

        async def authenticated(_context: grpc.aio.ServicerContext) -> None:
            _current_key.set(key)

        return _run_first(handler, authenticated)


def _run_first(
    handler: grpc.RpcMethodHandler,
    first: Callable[[grpc.aio.ServicerContext], Awaitable[None]],
) -> grpc.RpcMethodHandler:
    """`handler` with `first(context)` awaited in the call's own task before its
    behaviour (so a context variable it sets is the behaviour's), for every kind of
    method: refusing by aborting works for streaming requests too, which the error
    interceptor does not wrap."""
    for kind, make_handler in (
        ("unary_unary", grpc.unary_unary_rpc_method_handler),
        ("unary_stream", grpc.unary_stream_rpc_method_handler),
        ("stream_unary", grpc.stream_unary_rpc_method_handler),
        ("stream_stream", grpc.stream_stream_rpc_method_handler),
    ):
        inner = getattr(handler, kind)
        if inner is None:
            continue
        if kind.endswith("_stream"):

            async def behaviour(request, context, inner=inner):
                await first(context)
                async for item in inner(request, context):
                    yield item

        else:

            async def behaviour(request, context, inner=inner):
                await first(context)
                return await inner(request, context)

        return make_handler(
            behaviour,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
    return handler
