"""The Starlette application of the HTTP API: `POST /v1/chat/completions`,
`POST /v1/completions`, `GET /v1/models`, `GET /health`.

Each request: its API key checked (the server's key file, `Authorization: Bearer KEY`),
its body read up to --limit-message-bytes (413 past it), parsed and translated
(`requests`), its choices run (`choices`) and answered whole or as server-sent events
(`responses`). A streamed answer's headers wait for the first committed round, so that
a refused request gets its status code and error body rather than a 200 stream that
fails. A client that disconnects — while the answer is computed, or mid-stream —
cancels its generations, which give their sessions back (and close the ones made for
them).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
from google.protobuf import json_format
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from hydra_jury.orchestrator.http_api.choices import Choices
from hydra_jury.orchestrator.http_api.errors import ApiError, api_error, invalid
from hydra_jury.orchestrator.http_api.requests import (
    REQUEST_HEADER,
    SESSION_HEADER,
    ChatBody,
    CompletionBody,
    parse_body,
    plan_request,
)
from hydra_jury.orchestrator.http_api.responses import (
    Chat,
    Chunks,
    Completion,
    Envelope,
    Format,
    response,
)
from hydra_jury.orchestrator.limits import RequestLimits
from hydra_jury.orchestrator.request_log import Call, log_failed_call
from hydra_jury.serving.api_keys import ApiKey
from hydra_jury.serving.auth import ApiKeyAuth, authenticate, refusal
from hydra_jury.serving.tracing import TracingMiddleware

if TYPE_CHECKING:  # the server module imports this one
    from hydra_jury.orchestrator.server import GenerationServicer

log = logging.getLogger("hydra_jury.http")
T = TypeVar("T")
Code = grpc.StatusCode


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


def openai_app(
    servicer: GenerationServicer,
    *,
    model: str,
    auth: ApiKeyAuth | None,
    limits: RequestLimits,
) -> Starlette:
    """The HTTP API over `servicer`, serving `model` (the name clients give), with the
    server's API keys (None: open) and request limits."""
    api = HttpApi(servicer, model, auth, limits)
    return Starlette(
        middleware=[Middleware(TracingMiddleware)],
        routes=[
            Route(Chat.path, api.chat_completions, methods=["POST"]),
            Route(Completion.path, api.completions, methods=["POST"]),
            Route("/v1/models", api.models, methods=["GET"]),
            Route("/health", api.health, methods=["GET"]),
        ],
        exception_handlers={
            ApiError: api.error_response,
            HTTPException: api.http_error_response,
            ClientGone: api.gone_response,
            # A bug: answered as INTERNAL, then raised again for the server to log.
            Exception: api.error_response,
        },
    )


class HttpApi:
    def __init__(
        self,
        servicer: GenerationServicer,
        model: str,
        auth: ApiKeyAuth | None,
        limits: RequestLimits,
    ) -> None:
        self.servicer, self.model, self.auth, self.limits = servicer, model, auth, limits
        self.running: set[asyncio.Task] = set()  # the choices' tasks
        self.started = int(time.time())  # the model's "created": when it began to be served

    # --- routes ------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        """SERVING, or NOT_SERVING (503) once the server drains: as gRPC health says."""
        if self.auth is not None and self.auth.protect_open_services:
            self._authenticate(request)
        if self.servicer.draining:
            return JSONResponse({"status": "NOT_SERVING"}, status_code=503)
        return JSONResponse({"status": "SERVING"})

    async def models(self, request: Request) -> Response:
        key = self._authenticate(request)
        self.servicer.count("/v1/models", key)
        model = {
            "id": self.model,
            "object": "model",
            "created": self.started,
            "owned_by": "hydra-jury",
            # What the gRPC API's Info says: heads, drafters, rules, limits, services.
            "hydra": json_format.MessageToDict(
                self.servicer.info(),
                preserving_proto_field_name=True,
                always_print_fields_with_no_presence=True,
            ),
        }
        return JSONResponse({"object": "list", "data": [model]})

    async def chat_completions(self, request: Request) -> Response:
        return await self._complete(request, Chat, ChatBody)

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, Completion, CompletionBody)

    # --- a completion --------------------------------------------------------------------

    async def _complete(
        self, request: Request, form: Format, body_type: type[ChatBody | CompletionBody]
    ) -> Response:
        key = self._authenticate(request)
        self.servicer.count(form.path, key)
        body = parse_body(await self._json(request), body_type)
        if body.model != self.model:
            raise ApiError(
                Code.NOT_FOUND,
                f"model {body.model!r} is not served here; this server serves "
                f"{self.model!r} (GET /v1/models)",
                param="model",
                code="model_not_found",
            )
        plan = plan_request(body, request.headers, self.limits)
        if plan.user is not None:
            log.info("HTTP request %s for user %r", plan.request_id, plan.user)
        fingerprint = self.servicer.backend.info.fingerprint
        envelope = Envelope(
            form.id_prefix + plan.request_id, int(time.time()), self.model, fingerprint[:16]
        )
        choices = Choices(
            self.servicer,
            plan.requests,
            key,
            Call.http(form.path, request.headers),
            keep_session=plan.keep_session,
            running=self.running,
        )
        rounds = choices.rounds()
        headers = {REQUEST_HEADER: plan.request_id}
        if not plan.stream:
            outputs = await self._unless_disconnected(request, _outputs(rounds, len(plan.requests)))
            if plan.keep_session:
                headers[SESSION_HEADER] = outputs[0].session
            return JSONResponse(response(form, envelope, plan, outputs), headers=headers)
        first = await self._unless_disconnected(request, anext(rounds))
        if plan.keep_session:
            headers[SESSION_HEADER] = first[1].session_id
        chunks = Chunks(form, envelope, plan)
        return StreamingResponse(
            self._events(chunks, first, rounds, choices),
            media_type="text/event-stream",
            headers={**headers, "Cache-Control": "no-cache"},
        )

    async def _events(
        self, chunks: Chunks, first: tuple[int, Any], rounds: AsyncIterator, choices: Choices
    ) -> AsyncIterator[str]:
        """The server-sent events of a streamed answer. An error after the first round
        ends the stream with an error event (its status is sent already); a disconnect
        cancels the iteration, and with it the generations."""
        try:
            yield _event(chunks.round(*first))
            async for index, committed in rounds:
                yield _event(chunks.round(index, committed))
            if chunks.plan.include_usage:
                yield _event(chunks.usage())
            yield "data: [DONE]\n\n"
        except Exception as error:
            reported = self._reported(error)
            self._count(reported)
            yield _event(reported.body())
        finally:
            choices.cancel()

    # --- helpers -----------------------------------------------------------------------

    def _authenticate(self, request: Request) -> ApiKey | None:
        """The request's API key (None on a server without keys); 401 without a valid
        one, counted as the gRPC API counts its refusals."""
        if self.auth is None:
            return None
        key, reason = authenticate(self.auth.keys, request.headers.getlist("authorization"))
        if key is None:
            self.servicer.metrics.observe_unauthenticated(reason)
            raise ApiError(Code.UNAUTHENTICATED, refusal(reason, "header"), code="invalid_api_key")
        return key

    async def _json(self, request: Request) -> dict[str, Any]:
        """The body, at most --limit-message-bytes of JSON object."""
        limit = self.limits.message_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise self._too_large(int(declared))
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise self._too_large(len(body))
        try:
            parsed = json.loads(body)
        except (ValueError, RecursionError) as error:  # a value nested past Python's stack
            raise invalid(f"the request body is not JSON: {error}", code="invalid_json") from None
        if not isinstance(parsed, dict):
            raise invalid("the request body must be a JSON object", code="invalid_json")
        return parsed

    def _too_large(self, size: int) -> ApiError:
        return ApiError(
            Code.RESOURCE_EXHAUSTED,
            self.limits.refusal("message_bytes", f"a request body of {size} bytes"),
            code="request_too_large",
            http_status=413,
        )

    async def _unless_disconnected(self, request: Request, work: Awaitable[T]) -> T:
        """`work`'s result; `ClientGone`, with `work` cancelled, when the client
        disconnects first (the body is read by now: what comes next is the disconnect)."""
        task = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not task.done():
                task.cancel()
        if not task.done() or task.cancelled():
            raise ClientGone()
        error = task.exception()
        if error is not None:
            raise self._reported(error) from None
        return task.result()

    @staticmethod
    def _reported(error: BaseException) -> ApiError:
        """A generation's `error` as the API reports it; a bug is logged with its
        traceback, as the gRPC API's error interceptor does."""
        reported = api_error(error)
        if reported.status == Code.INTERNAL and reported is not error:
            log.error("internal error in an HTTP request", exc_info=error)
        reported.generation_failed = True
        return reported

    def _count(self, error: ApiError) -> None:
        # A key's refusal was counted when it was made (observe_unauthenticated).
        if error.status != Code.UNAUTHENTICATED:
            self.servicer.metrics.errors.labels(error.status.name).inc()

    # --- exception handlers ------------------------------------------------------------

    async def error_response(self, request: Request, error: Exception) -> Response:
        """An `ApiError`'s answer; anything else escaping a route is a bug (INTERNAL,
        with a generic message; Starlette raises it again for the server's log)."""
        reported = api_error(error)
        self._count(reported)
        if not reported.generation_failed:
            _log_failed(request, reported)
        headers = {"WWW-Authenticate": "Bearer"} if reported.http_status == 401 else None
        return JSONResponse(reported.body(), status_code=reported.http_status, headers=headers)

    async def http_error_response(self, request: Request, error: Exception) -> Response:
        """Starlette's own refusals (no such path, a method the path does not take) in
        OpenAI's error form."""
        assert isinstance(error, HTTPException)
        found = error.status_code != 404
        status = Code.INVALID_ARGUMENT if found else Code.NOT_FOUND
        message = f"{request.method} {request.url.path}: {error.detail}"
        code = "method_not_allowed" if found else "not_found"
        reported = ApiError(status, message, code=code, http_status=error.status_code)
        _log_failed(request, reported)
        return JSONResponse(reported.body(), status_code=error.status_code)

    async def gone_response(self, request: Request, error: Exception) -> Response:
        log.info("client gone: %s %s cancelled", request.method, request.url.path)
        return Response(status_code=499)  # nobody reads it: the connection is closed


async def _outputs(rounds: AsyncIterator, choices: int) -> list:
    """Each choice's output, once every choice has finished."""
    outputs = [None] * choices
    async for index, committed in rounds:
        outputs[index] = committed.summary or outputs[index]
    return outputs


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


def _log_failed(request: Request, reported: ApiError) -> None:
    """The log line of a request refused before any generation (`log_failed_call`)."""
    trace = Call.http(request.url.path, request.headers).trace_id
    log_failed_call(request.url.path, reported.status, reported.message, trace)
