"""The aio server every hydra-jury process runs: one error interceptor, health checking,
reflection, the epoch and graceful shutdown.

Shutdown (`RunningServer.stop`, on SIGTERM or SIGINT): health turns NOT_SERVING at once;
a servicer that drains (`Drainable`: the Generation servicer) refuses new work and lets
its running work finish for the grace, ending what is left resumably; then the server
(and its HTTP listener, if it has one) stops accepting calls, lets the in-flight ones
finish for what is left of the grace, cancels the rest, and the servicer closes."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from hydra_jury.serving import tracing
from hydra_jury.serving.errors import detail_for, status_for
from hydra_jury.serving.handlers import wrap_handler
from hydra_jury.workers.errors import InvalidArgument

log = logging.getLogger("hydra_jury")

MESSAGE_LIMIT = 256 * 1024 * 1024  # draft distributions of large vocabularies
RECEIVE_LIMIT_OPTION = "grpc.max_receive_message_length"
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MESSAGE_LIMIT),
    (RECEIVE_LIMIT_OPTION, MESSAGE_LIMIT),
]
SERVER_OPTIONS = [
    # gRPC binds with SO_REUSEPORT by default: a second server started on a port in use
    # would silently share it, each call going to either one's caches. Refuse instead.
    ("grpc.so_reuseport", 0),
    *CHANNEL_OPTIONS,
]
# Told of each call that failed: its full method, its exception, the status code it
# gets and its context.
OnError = Callable[[str, Exception, grpc.StatusCode, grpc.aio.ServicerContext], None]
# After a drain, how long the statuses of the calls it ended may take to reach their
# clients before the server cancels what is still in flight.
STATUS_FLUSH_S = 1.0


def bind(
    server: grpc.aio.Server, address: str, credentials: grpc.ServerCredentials | None = None
) -> int:
    """Adds the port `address` (port 0: any free one), TLS with `credentials`; returns the
    port. OSError when it cannot bind (gRPC raises a bare RuntimeError, "Failed to bind
    to address ...", the reason — a port in use, say — in its log only)."""
    try:
        if credentials is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, credentials)
    except RuntimeError as error:
        raise OSError(str(error)) from None


def server_options(max_receive_bytes: int) -> list[tuple[str, int]]:
    """`SERVER_OPTIONS` with the largest message the server accepts set to
    `max_receive_bytes` (a larger one is refused with RESOURCE_EXHAUSTED by gRPC)."""
    return [
        (name, max_receive_bytes if name == RECEIVE_LIMIT_OPTION else value)
        for name, value in SERVER_OPTIONS
    ]


class _Undecodable:
    """A request whose bytes are not a message of its type: decoded into this instead of
    raising, since gRPC answers an exception of the decoder with UNKNOWN, and refused
    before the method runs (found by tests/test_fuzz.py)."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _tolerant(deserializer: Callable[[bytes], object] | None) -> Callable[[bytes], object] | None:
    if deserializer is None:
        return None

    def deserialize(data: bytes) -> object:
        try:
            return deserializer(data)
        except Exception as error:  # DecodeError: corrupt bytes, or a string not UTF-8
            return _Undecodable(error)

    return deserialize


def _decoded(request: object) -> None:
    if isinstance(request, _Undecodable):
        raise InvalidArgument(f"the request is not a valid message of its type: {request.error}")


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Turns an exception escaping any RPC into its status code (`serving.errors`) and a
    readable detail; an untyped one is a bug, logged with its traceback. A request that
    cannot be decoded is INVALID_ARGUMENT."""

    def __init__(self, on_error: OnError | None = None) -> None:
        self.on_error = on_error

    async def _abort(self, method: str, context, error: Exception) -> None:
        code = status_for(error)
        if code == grpc.StatusCode.INTERNAL:
            log.error("internal error in %s", method, exc_info=error)
        if self.on_error is not None:
            self.on_error(method, error, code, context)
        await context.abort(code, detail_for(error))

    @asynccontextmanager
    async def _guard(self, method: str, request, context) -> AsyncIterator[None]:
        try:
            _decoded(request)
            yield
        except grpc.aio.AbortError:
            raise
        except Exception as error:
            await self._abort(method, context, error)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        return wrap_handler(
            handler,
            lambda request, context: self._guard(method, request, context),
            deserializer=_tolerant,
        )


def new_epoch() -> str:
    """A random id per process start: a changed epoch tells callers the caches are gone."""
    return uuid.uuid4().hex[:16]


class GrpcServer:
    """An aio server with the error interceptor, health checking and reflection.

    `add_servicers(server)` registers the service implementations; `service_names` are
    their full names (for health and reflection). `interceptors` run after the error
    interceptor (so what they raise gets its status code too); with `credentials` the
    port is TLS, else plaintext. `max_receive_bytes`: the largest request message (the
    public port's is small; the internal services' carry hidden states)."""

    def __init__(
        self,
        add_servicers: Callable[[grpc.aio.Server], None],
        service_names: Iterable[str],
        *,
        on_error: OnError | None = None,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
        credentials: grpc.ServerCredentials | None = None,
        max_receive_bytes: int = MESSAGE_LIMIT,
    ) -> None:
        self.server = grpc.aio.server(
            # Tracing outermost: its span covers the whole call, refusals included.
            interceptors=[*tracing.interceptors(), ErrorInterceptor(on_error), *interceptors],
            options=server_options(max_receive_bytes),
        )
        self.credentials = credentials
        add_servicers(self.server)
        self.service_names = list(service_names)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            [*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server
        )
        self.port = 0

    async def start(self, address: str) -> int:
        """Binds (port 0 picks a free one), starts, and reports SERVING; returns the port."""
        self.port = bind(self.server, address, self.credentials)
        await self.server.start()
        for name in ["", *self.service_names]:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        return self.port

    async def report_not_serving(self) -> None:
        """Health NOT_SERVING for the server and every service: probes and load
        balancers stop sending calls here."""
        for name in ["", *self.service_names]:
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stops accepting, lets in-flight calls finish for `grace_s`, then cancels them."""
        await self.report_not_serving()
        await self.server.stop(grace_s)


async def wait_for_signal() -> None:
    """Returns on the first SIGTERM or SIGINT."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


class Closable(Protocol):
    async def close(self) -> None: ...


@runtime_checkable
class Drainable(Protocol):
    async def drain(self, grace_s: float) -> None:
        """Refuses new work, lets running work finish for up to `grace_s`, then ends the
        rest so that it can be resumed elsewhere; returns once it has ended."""


class Listener(Protocol):
    """Another port serving the same servicer (the HTTP API), stopped with the server."""

    address: str  # HOST:PORT
    scheme: str  # "http", "https"

    async def stop(self, grace_s: float) -> None: ...


@dataclass
class RunningServer:
    """A started server, the servicer behind it (closed after the server stops) and
    where it listens."""

    server: GrpcServer
    port: int
    servicer: Closable
    metrics_port: int | None = None  # None: no metrics served
    http: Listener | None = None  # the HTTP API, when the server has one

    async def stop(self, grace_s: float = 0.0) -> None:
        """Shuts down gracefully within about `grace_s` (see the module's docstring)."""
        began = time.monotonic()
        await self.server.report_not_serving()
        left = grace_s
        if isinstance(self.servicer, Drainable):
            await self.servicer.drain(grace_s)
            left = max(STATUS_FLUSH_S, grace_s - (time.monotonic() - began))
        listeners = [self.server.stop(left)]
        if self.http is not None:
            listeners.append(self.http.stop(left))
        await asyncio.gather(*listeners)
        await self.servicer.close()

    async def serve_until_signal(
        self, name: str, listen: str, grace_s: float, detail: str = ""
    ) -> None:
        """Prints "NAME listening on HOST:PORT[DETAIL]" to stderr (the line launchers
        wait for), serves until SIGTERM or SIGINT, then stops gracefully."""
        host = listen.rsplit(":", 1)[0]
        if self.http is not None:
            detail += f", HTTP API on {self.http.scheme}://{self.http.address}"
        if self.metrics_port is not None:
            detail += f", metrics on port {self.metrics_port}"
        print(f"{name} listening on {host}:{self.port}{detail}", file=sys.stderr, flush=True)
        await wait_for_signal()
        log.info("%s shutting down (grace %.1f s)", name, grace_s)
        await self.stop(grace_s)
        log.info("%s stopped", name)
