"""Tracing with OpenTelemetry: one trace per request across the orchestrator, the trunk
and every jury shard, exported over OTLP/gRPC.

On when an endpoint is set: `--otlp-endpoint URL`, else the standard
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or `OTEL_EXPORTER_OTLP_ENDPOINT`; off whatever is
set when `OTEL_SDK_DISABLED=true`. The SDK reads the rest of the standard variables
itself: the sampler (`OTEL_TRACES_SAMPLER`, `OTEL_TRACES_SAMPLER_ARG`; default: every
trace, or as the caller's `traceparent` says), `OTEL_SERVICE_NAME` (default: the
process's role, `hydra-jury-orchestrator`, `-trunk`, `-jury`, `-server`),
`OTEL_RESOURCE_ATTRIBUTES`, and the batch processor's `OTEL_BSP_*`. Off, nothing here
runs but a flag test per call: no interceptor, no metadata, no-op spans.

The W3C `traceparent` travels in gRPC metadata (and HTTP headers): a server span per
public or internal RPC (`TracingInterceptor`) continues the caller's trace, and each
internal call (`client_call`) carries its span to the service it calls. A span records
ids, options and counts, never a prompt, an output's text or an API key.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import urllib.parse
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager, nullcontext
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from hydra_jury.serving.handlers import wrap_handler

log = logging.getLogger("hydra_jury.tracing")
ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
DISABLED_VARIABLE = "OTEL_SDK_DISABLED"
SERVICE_NAME_VARIABLE = "OTEL_SERVICE_NAME"
# The RPCs worth a span: the project's own services (not health checks or reflection,
# which probes call every few seconds).
TRACED_SERVICES = "/hydrajury."

tracer = trace.get_tracer("hydra_jury")
_enabled = False
_NO_SPAN = nullcontext()


def enabled() -> bool:
    """Whether this process exports traces (`configure_tracing` found an endpoint)."""
    return _enabled


def tracing_endpoint(flag: str | None) -> str | None:
    """The OTLP endpoint of `--otlp-endpoint` (`flag`), else of the standard variables;
    None when tracing is off. ValueError for a URL that is not http:// or https:// (the
    scheme says whether the exporter's channel is TLS)."""
    if os.environ.get(DISABLED_VARIABLE, "").strip().lower() == "true":
        return None
    endpoint = flag or next((os.environ[v] for v in ENDPOINT_VARIABLES if os.environ.get(v)), None)
    if endpoint is None:
        return None
    parsed = urllib.parse.urlparse(endpoint)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        source = "--otlp-endpoint" if flag else "the OTEL_EXPORTER_OTLP_*ENDPOINT variable"
        raise ValueError(
            f"{source}: {endpoint!r} is not an OTLP/gRPC endpoint URL; give "
            "http://HOST:PORT (plaintext) or https://HOST:PORT (TLS), e.g. "
            "http://otel-collector:4317"
        )
    return endpoint


def configure_tracing(
    service: str, flag: str | None, attributes: Mapping[str, Any] | None = None
) -> bool:
    """Exports this process's spans to the OTLP endpoint (`tracing_endpoint(flag)`), as
    `service` unless `OTEL_SERVICE_NAME` names it, with resource `attributes`; returns
    whether tracing is on. Spans are batched and sent by a thread of their own; the
    provider flushes them when the process exits."""
    global _enabled
    endpoint = tracing_endpoint(flag)
    if endpoint is None:
        return False
    # Imported here: a process that does not trace never loads the SDK and the exporter.
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = process_resource(service, attributes)
    provider = TracerProvider(resource=resource)
    # The flag's URL is the exporter's; without it the exporter reads the variables
    # itself (the traces-only one first), with their headers and certificate settings.
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=flag or None)))
    trace.set_tracer_provider(provider)
    _enabled = True
    log.info(
        "tracing to %s as %s (sampler %s)",
        endpoint,
        resource.attributes[SERVICE_NAME],
        provider.sampler.get_description(),
    )
    return True


def process_resource(service: str, attributes: Mapping[str, Any] | None = None):
    """The process's resource: `attributes`, `OTEL_RESOURCE_ATTRIBUTES`, and the service
    name `OTEL_SERVICE_NAME` gives, else `service`."""
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource

    # The attributes given to `Resource.create` override the environment's, so the
    # default name is given only when the environment names none.
    resource = Resource.create(dict(attributes or {}))
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: service}))
    return resource


# --- the current span -------------------------------------------------------------------


def annotate(**attributes: Any) -> None:
    """Sets `hydra.NAME` attributes on the current span (None values are left out)."""
    if _enabled:
        describe(trace.get_current_span(), **attributes)


def current_span() -> Span | None:
    """The current span when it is recorded (None: tracing off, or not sampled)."""
    if not _enabled:
        return None
    span = trace.get_current_span()
    return span if span.is_recording() else None


def describe(span: Span | None, **attributes: Any) -> None:
    """Sets `hydra.NAME` attributes on `span` (None: nothing to do)."""
    if span is not None and span.is_recording():
        span.set_attributes(_attributes(attributes))


def current_trace_id() -> str | None:
    """The current span's trace id (32 hex digits); None outside a recorded trace."""
    context = trace.get_current_span().get_span_context()
    return format(context.trace_id, "032x") if context.is_valid else None


def span(name: str, **attributes: Any):
    """A child span of the current one, current inside the block, with `hydra.NAME`
    attributes; its status is an error if the block raises. With tracing off, a shared
    empty block: OpenTelemetry's no-op spans still attach and detach a context, about
    20 µs a span on the AMD test machine, and a round opens four."""
    if not _enabled:
        return _NO_SPAN
    return tracer.start_as_current_span(name, attributes=_attributes(attributes))


def spanned(name: str) -> Callable[[Callable], Callable]:
    """Decorator: every call of the function runs inside `span(name)` (whether tracing is
    on is read at each call, not when the module defining the function is imported)."""

    def decorate(function: Callable) -> Callable:
        if asyncio.iscoroutinefunction(function):

            @functools.wraps(function)
            async def traced_coroutine(*args, **kwargs):
                with span(name):
                    return await function(*args, **kwargs)

            return traced_coroutine

        @functools.wraps(function)
        def traced(*args, **kwargs):
            with span(name):
                return function(*args, **kwargs)

        return traced

    return decorate


def context() -> otel_context.Context:
    """The current trace context, to continue in another task or thread (`attached`)."""
    return otel_context.get_current()


@contextmanager
def attached(context: otel_context.Context | None) -> Iterator[None]:
    """`context` is current inside the block (None: nothing changes)."""
    if context is None:
        yield
        return
    token = otel_context.attach(context)
    try:
        yield
    finally:
        otel_context.detach(token)


def _attributes(values: Mapping[str, Any]) -> dict[str, Any]:
    return {
        f"hydra.{name}": list(value) if isinstance(value, tuple) else value
        for name, value in values.items()
        if value is not None
    }


# --- gRPC -------------------------------------------------------------------------------


def _rpc_attributes(full_method: str) -> tuple[str, dict[str, str]]:
    """ "/pkg.Service/Method" → ("pkg.Service/Method", its rpc.* attributes)."""
    name = full_method.lstrip("/")
    service, _, method = name.partition("/")
    return name, {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method}


def _end(span: Span, code: grpc.StatusCode) -> None:
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code != grpc.StatusCode.OK:
        span.set_status(Status(StatusCode.ERROR, code.name))
    span.end()


class ClientCall:
    """An internal RPC's client span: `metadata` carries it to the service; `finish`
    ends it with the call's status (from any thread, once)."""

    def __init__(self, full_method: str, component: str, address: str) -> None:
        name, attributes = _rpc_attributes(full_method)
        attributes.update({"server.address": address, "hydra.component": component})
        self.span = tracer.start_span(name, kind=SpanKind.CLIENT, attributes=attributes)
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(self.span))
        self.metadata = tuple(carrier.items())

    def finish(self, code: grpc.StatusCode) -> None:
        _end(self.span, code)

    def finish_with(self, future: grpc.Future) -> None:
        """Ends the span when `future` (the call) completes."""

        def done(call: grpc.Future) -> None:
            self.finish(call.code() if not call.cancelled() else grpc.StatusCode.CANCELLED)

        future.add_done_callback(done)


class _Untraced:
    metadata = None

    def finish(self, code: grpc.StatusCode) -> None:
        pass

    def finish_with(self, future: grpc.Future) -> None:
        pass


_UNTRACED = _Untraced()


def client_call(full_method: str, component: str, address: str) -> ClientCall | _Untraced:
    """The client side of one internal call to `component` at `address`."""
    return ClientCall(full_method, component, address) if _enabled else _UNTRACED


class TracingInterceptor(grpc.aio.ServerInterceptor):
    """A server span for each call of the project's services, the caller's `traceparent`
    its parent, current while the method runs, ended with the call's status code."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(TRACED_SERVICES):
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        return wrap_handler(handler, lambda request, context: _served(method, metadata, context))


@asynccontextmanager
async def _served(
    full_method: str, metadata: Mapping[str, str], context: grpc.aio.ServicerContext
) -> AsyncIterator[None]:
    name, attributes = _rpc_attributes(full_method)
    parent = propagate.extract(metadata)
    span = tracer.start_span(name, parent, SpanKind.SERVER, attributes)
    token = otel_context.attach(trace.set_span_in_context(span, parent))
    code = grpc.StatusCode.OK
    try:
        yield
    except grpc.aio.AbortError:
        code = context.code() or grpc.StatusCode.UNKNOWN
        raise
    except (asyncio.CancelledError, GeneratorExit):
        code = grpc.StatusCode.CANCELLED
        raise
    except BaseException:
        code = grpc.StatusCode.UNKNOWN
        raise
    finally:
        otel_context.detach(token)
        _end(span, code)


def interceptors() -> list[grpc.aio.ServerInterceptor]:
    """The tracing interceptor when tracing is on (none when off: no cost)."""
    return [TracingInterceptor()] if _enabled else []


# --- HTTP -------------------------------------------------------------------------------


class TracingMiddleware:
    """An ASGI middleware: a server span per HTTP API request (paths under /v1/; not the
    probes' /health), continuing the `traceparent` header's trace, current while the
    application answers (streamed bodies included)."""

    def __init__(self, app: Callable) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if not _enabled or scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        parent = propagate.extract(headers)
        attributes = {"http.request.method": scope["method"], "url.path": scope["path"]}
        name = f"{scope['method']} {scope['path']}"
        with tracer.start_as_current_span(name, parent, SpanKind.SERVER, attributes) as span:

            async def sending(message) -> None:
                if message["type"] == "http.response.start":
                    status = message["status"]
                    span.set_attribute("http.response.status_code", status)
                    if status >= 500:
                        span.set_status(Status(StatusCode.ERROR))
                await send(message)

            await self.app(scope, receive, sending)
