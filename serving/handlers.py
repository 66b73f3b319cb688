"""Wrapping a gRPC method handler, for the servers' interceptors: the method runs inside
an async context manager made per call (the error interceptor's guard, the tracing
interceptor's span), a stream's items passing through it."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import grpc

# (request, context) -> the context manager the call runs in
Scope = Callable[[Any, grpc.aio.ServicerContext], AbstractAsyncContextManager]
Deserializer = Callable[[bytes], object] | None


def wrap_handler(
    handler: grpc.RpcMethodHandler,
    scope: Scope,
    deserializer: Callable[[Deserializer], Deserializer] = lambda given: given,
) -> grpc.RpcMethodHandler:
    """`handler` with its unary or server-streaming method run inside `scope(request,
    context)`, and its request deserializer replaced by `deserializer(the handler's)`;
    handlers of other kinds are returned as they are (the project has none)."""
    if handler.unary_unary is not None:
        inner = handler.unary_unary

        async def unary(request, context):
            async with scope(request, context):
                return await inner(request, context)

        return grpc.unary_unary_rpc_method_handler(
            unary,
            request_deserializer=deserializer(handler.request_deserializer),
            response_serializer=handler.response_serializer,
        )
    if handler.unary_stream is not None:
        inner_stream = handler.unary_stream

        async def stream(request, context):
            async with scope(request, context):
                async for item in inner_stream(request, context):
                    yield item

        return grpc.unary_stream_rpc_method_handler(
            stream,
            request_deserializer=deserializer(handler.request_deserializer),
            response_serializer=handler.response_serializer,
        )
    return handler
