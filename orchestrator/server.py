"""The public `hydrajury.v1.Generation` service: a thin servicer over the session runner
(`orchestrator.sessions.runner`), on either backend — the gRPC backend
(`serve_orchestrator`: the split stack) or the in-process backend (`serve_embedded`: the
whole model in this process, for one machine). Sessions live in the given store (Redis).

The runner commits each round to the store before the servicer sends it; a client that
cancels stops the generation between rounds and gives the session back (its caches stay
for the next turn). A background task frees the caches of sessions whose TTL passed.

With API keys (`serving.auth`) every call runs with its key: the sessions it makes and
finds are that key's, and its generations stay within the key's limits
(`orchestrator.key_limits`).

With an HTTP address the same servicer also answers the OpenAI-compatible HTTP API
(`orchestrator.http_api`), in this process and event loop, through `generate`: the one
path of every generation, whichever API asked for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from hydra_jury.hydra_model import DraftModel, HydraModel
from hydra_jury.hydra_model.checkpoint import checkpoint_fingerprint, read_manifest
from hydra_jury.orchestrator.backend import DecodingBackend
from hydra_jury.orchestrator.convert import output_to_pb, request_from_pb, round_to_pb
from hydra_jury.orchestrator.discovery import Discovery
from hydra_jury.orchestrator.engine import Engine
from hydra_jury.orchestrator.grpc_backend import GrpcBackend, LayoutError
from hydra_jury.orchestrator.http_api.app import openai_app
from hydra_jury.orchestrator.key_limits import KeyLimiter
from hydra_jury.orchestrator.limits import DEFAULT_LIMITS, RequestLimits
from hydra_jury.orchestrator.local_backend import LocalBackend
from hydra_jury.orchestrator.metrics import OrchestratorMetrics
from hydra_jury.orchestrator.request import RequestError
from hydra_jury.orchestrator.request_log import Call, RequestLog, log_failed_call
from hydra_jury.orchestrator.sessions.runner import Committed, SessionRunner
from hydra_jury.orchestrator.sessions.store import SessionStore
from hydra_jury.poe import RULES
from hydra_jury.protos.hydrajury.v1 import generation_pb2, generation_pb2_grpc
from hydra_jury.serving.api_keys import ApiKey, KeyFile
from hydra_jury.serving.auth import ApiKeyAuth, current_key, refusal
from hydra_jury.serving.batcher import BatchLimits
from hydra_jury.serving.errors import detail_for
from hydra_jury.serving.http_server import HttpServer
from hydra_jury.serving.metrics import ServiceMetrics
from hydra_jury.serving.model_thread import ModelThread, start_model_thread
from hydra_jury.serving.server import GrpcServer, RunningServer
from hydra_jury.serving.tls import ClientTls, ServerTls
from hydra_jury.workers.calls import MAX_GAMMA
from hydra_jury.workers.sessions import SessionLimits

log = logging.getLogger("hydra_jury.orchestrator")
SERVICE_NAME = "hydrajury.v1.Generation"


def _deadline(context: grpc.aio.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


def request_digest(request: generation_pb2.GenerateRequest) -> str:
    """What a request id stands for: the request without its session and request ids."""
    plain = generation_pb2.GenerateRequest()
    plain.CopyFrom(request)
    plain.session_id, plain.request_id = "", ""
    return hashlib.sha256(plain.SerializeToString(deterministic=True)).hexdigest()


def _name(key: ApiKey | None) -> str:
    """The key name sessions are filed under ("" on a server without keys)."""
    return "" if key is None else key.name


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(
        self,
        backend: DecodingBackend,
        tokenizer,
        store: SessionStore,
        metrics: OrchestratorMetrics,
        *,
        max_concurrency: int = 32,
        request_limits: RequestLimits,
        api_keys: KeyFile | None = None,
    ) -> None:
        """`api_keys`: the server's keys, watched from `start_watching_keys` to `close`."""
        self.backend = backend
        self.metrics = metrics
        self.api_keys = api_keys
        self.key_limits = KeyLimiter(
            on_refused=lambda key, reason: metrics.key_refusals.labels(key.name, reason).inc()
        )
        self.runner = SessionRunner(
            Engine(backend, tokenizer, request_limits),
            store,
            max_concurrency=max_concurrency,
            observe=lambda event: metrics.session_events.labels(event).inc(),
        )
        self._sweeper: asyncio.Task | None = None

    def start_sweeping(self) -> None:
        """Frees the caches of expired sessions every quarter TTL (at most every 30 s),
        which tells the metrics whether the session store answers."""
        interval = min(30.0, max(0.2, self.runner.store.settings.ttl_s / 4))

        async def sweep_forever() -> None:
            while True:
                await asyncio.sleep(interval)
                try:
                    await self.runner.sweep()
                except Exception as error:  # Redis down: try again next time
                    self.metrics.session_store_up.set(0)
                    log.warning("session sweep failed: %s", error)
                else:
                    self.metrics.session_store_up.set(1)

        self._sweeper = asyncio.get_running_loop().create_task(sweep_forever())

    def start_watching_keys(self) -> None:
        """Reloads the key file on SIGHUP and when it changes, until `close`."""
        if self.api_keys is not None:
            self.api_keys.watch()

    async def close(self) -> None:
        """Stops the sweeper, the generation threads, then the backend (after the server
        stopped)."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        if self.api_keys is not None:
            await self.api_keys.stop_watching()
        await self.runner.close()
        await asyncio.to_thread(self.backend.close)

    async def drain(self, grace_s: float) -> None:
        """On shutdown: new generations are refused (UNAVAILABLE), running ones finish
        for up to `grace_s`, the rest end after their round, resumable elsewhere."""
        await self.runner.drain(grace_s)

    @property
    def draining(self) -> bool:
        """Whether the server is shutting down (new generations are refused)."""
        return self.runner.draining

    def count(self, rpc: str, key: ApiKey | None) -> None:
        """Counts a call to `rpc` (a gRPC method, or an HTTP API path) made with `key`."""
        self.metrics.requests.labels(rpc).inc()
        if key is not None:
            self.metrics.key_requests.labels(key.name, rpc).inc()

    def _called(self, rpc: str) -> ApiKey | None:
        """Counts the gRPC call; its API key (None on a server without keys)."""
        key = current_key()
        self.count(rpc, key)
        return key

    async def Info(self, request, context):
        self._called("Info")
        return self.info()

    def info(self) -> generation_pb2.GenerationInfoResponse:
        info = self.backend.info
        return generation_pb2.GenerationInfoResponse(
            model_fingerprint=info.fingerprint,
            architecture=info.architecture,
            heads=info.head_names,
            drafter_heads=info.drafter_heads,
            rules=RULES,
            max_gamma=MAX_GAMMA,
            context_length=info.context_length,
            trunk=self.backend.trunk_address,
            jury_shards=self.backend.jury_addresses,
            draft_model=info.draft_model,
            uncertainty_head=info.uncertainty_head,
        )

    async def CreateSession(self, request, context):
        key = self._called("CreateSession")
        session_id = await self.runner.create_session(request.session_id or None, _name(key))
        return generation_pb2.CreateSessionResponse(session_id=session_id)

    async def CloseSession(self, request, context):
        key = self._called("CloseSession")
        if not request.session_id:
            raise RequestError("session_id is empty")
        await self.runner.close_session(request.session_id, _name(key))
        return generation_pb2.CloseSessionResponse(closed=True)

    async def Generate(self, request, context):
        key = self._called("Generate")
        final = None
        call = Call.grpc("Generate", context)
        async for committed in self.generate(request, key, _deadline(context), call):
            final = committed.summary or final
        return output_to_pb(final)

    async def GenerateStream(self, request, context):
        key = self._called("GenerateStream")
        call = Call.grpc("GenerateStream", context)
        async for committed in self.generate(request, key, _deadline(context), call):
            message = round_to_pb(committed.round, committed.summary)
            message.session_id, message.request_id = committed.session_id, request.request_id
            yield message

    async def generate(
        self,
        request: generation_pb2.GenerateRequest,
        key: ApiKey | None,
        deadline: float | None,
        call: Call,
    ) -> AsyncIterator[Committed]:
        """The committed rounds of `request`, on the sessions of `key` and within its
        limits; `deadline`: a `time.monotonic()` value (None: none). Logs a line when it
        finishes or fails (`orchestrator.request_log`), for the API `call`."""
        logged = RequestLog.of(call, request, _name(key))
        try:
            with self.key_limits.generation(key) if key else contextlib.nullcontext():
                rounds = self._observed_rounds(request, deadline, _name(key))
                async with contextlib.aclosing(rounds):
                    async for committed in rounds:
                        logged.observe(committed)
                        if key is not None and not committed.replayed:  # a replay is free
                            self._spend(key, len(committed.round.tokens))
                        yield committed
        except BaseException as error:
            logged.failed(error)
            raise
        logged.finished()

    def _spend(self, key: ApiKey, tokens: int) -> None:
        self.key_limits.spend(key, tokens)
        self.metrics.key_tokens.labels(key.name).inc(tokens)

    async def _observed_rounds(self, request, deadline: float | None, key_name: str):
        """The committed rounds, with the request's metrics observed."""
        rounds = self.runner.generate(
            request_from_pb(request),
            session_id=request.session_id or None,
            request_id=request.request_id or None,
            digest=request_digest(request),
            deadline=deadline,
            key_name=key_name,
        )
        began = time.monotonic()
        emitted, first_at = 0, None
        self.metrics.active_sessions.inc()
        try:
            async for committed in rounds:
                item, now = committed.round, time.monotonic()
                if first_at is None and item.tokens:
                    first_at = now
                    self.metrics.ttft.observe(now - began)
                elif item.tokens and first_at is not None:
                    per_token = (now - first_at) / max(1, emitted + len(item.tokens) - 1)
                    self.metrics.tpot.observe(per_token)
                emitted += len(item.tokens)
                self.metrics.observe_round(item)
                if committed.summary is not None:
                    stats = committed.summary.stats
                    self.metrics.reused_tokens.inc(stats["reused_tokens"])
                    self.metrics.prefilled_tokens.inc(stats["prefilled_tokens"])
                yield committed
        finally:
            await rounds.aclose()
            self.metrics.active_sessions.dec()


async def start_generation_server(
    backend: DecodingBackend,
    tokenizer,
    store: SessionStore,
    *,
    address: str,
    metrics_port: int | None,
    metrics_address: str,
    max_concurrency: int,
    request_limits: RequestLimits,
    tls: ServerTls | None = None,
    auth: ApiKeyAuth | None = None,
    http_listen: str | None = None,
    model: str,
    metrics: OrchestratorMetrics | None = None,
) -> RunningServer:
    """The Generation service over `backend`, started on `address` (port 0: any free;
    `tls`: a TLS port, else plaintext; `auth`: calls need an API key, else open), and
    with `http_listen` the HTTP API on that address too (TLS alike), serving `model`
    (--served-model-name, else the checkpoint's folder name). `metrics`: the server's,
    where the backend reports to the same registry."""
    metrics = metrics or OrchestratorMetrics()
    servicer = GenerationServicer(
        backend,
        tokenizer,
        store,
        metrics,
        max_concurrency=max_concurrency,
        request_limits=request_limits,
        api_keys=auth.keys if auth else None,
    )
    server = GrpcServer(
        lambda s: generation_pb2_grpc.add_GenerationServicer_to_server(servicer, s),
        [SERVICE_NAME],
        on_error=functools.partial(_failed, metrics),
        max_receive_bytes=request_limits.message_bytes,
        interceptors=_auth_interceptors(auth, metrics),
        credentials=tls.credentials() if tls else None,
    )
    http = None
    if http_listen is not None:
        app = openai_app(servicer, model=model, auth=auth, limits=request_limits)
        http = HttpServer(app, tls=tls)
    try:
        await store.ping()  # a clear error now rather than on the first request
        metrics.session_store_up.set(1)
        port = await server.start(address)
        if http is not None:
            try:
                await http.start(http_listen)
            except BaseException:
                await server.stop(0)
                raise
    except BaseException:
        await servicer.close()
        raise
    servicer.start_sweeping()
    servicer.start_watching_keys()
    bound_metrics = (
        metrics.serve(metrics_port, metrics_address) if metrics_port is not None else None
    )
    return RunningServer(server, port, servicer, bound_metrics, http)


def _auth_interceptors(
    auth: ApiKeyAuth | None, metrics: OrchestratorMetrics
) -> list[grpc.aio.ServerInterceptor]:
    """The key check, if the server has keys; says either way in the log (by key name)."""
    if auth is None:
        log.warning("no --api-keys: the Generation API is open to any client")
        return []
    names = auth.keys.keys.names
    log.info(
        "the Generation API requires an API key: %d keys from %s (%s)%s",
        len(names),
        auth.keys.path,
        ", ".join(names),
        "; health checks and reflection too" if auth.protect_open_services else "",
    )

    def refused(reason: str, method: str) -> None:
        metrics.observe_unauthenticated(reason)
        log_failed_call(_rpc(method), grpc.StatusCode.UNAUTHENTICATED, refusal(reason))

    return [auth.interceptor(on_refused=refused)]


def _failed(
    metrics: OrchestratorMetrics,
    method: str,
    error: Exception,
    code: grpc.StatusCode,
    context: grpc.aio.ServicerContext,
) -> None:
    """A call that failed: counted, and logged unless its generation's line was."""
    metrics.errors.labels(code.name).inc()
    call = Call.grpc(_rpc(method), context)
    log_failed_call(call.rpc, code, detail_for(error), call.trace_id)


def _rpc(method: str) -> str:
    """ "/hydrajury.v1.Generation/Generate" → "Generate", as the requests metric names it."""
    return method.rsplit("/", 1)[-1]


async def serve_orchestrator(
    *,
    checkpoint: str,
    discovery: Discovery,
    store: SessionStore,
    address: str = "127.0.0.1:0",
    metrics_port: int | None = None,
    metrics_address: str = "127.0.0.1",
    max_concurrency: int = 32,
    request_limits: RequestLimits = DEFAULT_LIMITS,
    connect_timeout_s: float = 30.0,
    hop_delay_s: float = 0.0,
    pipeline_rounds: bool = False,
    tls: ServerTls | None = None,
    internal_tls: ClientTls | None = None,
    auth: ApiKeyAuth | None = None,
    http_listen: str | None = None,
    served_model_name: str | None = None,
) -> RunningServer:
    """The split stack's orchestrator: connects to the services (checking their layout;
    over TLS with `internal_tls`) and starts the Generation server (a TLS port with
    `tls`; API keys required with `auth`; the HTTP API too on `http_listen`;
    `hop_delay_s`: every call to a service delayed this long, for benchmarks;
    `pipeline_rounds`: speculative head rounds send the next round's draft ahead)."""
    read_manifest(checkpoint)  # a clear error for a wrong --checkpoint, before connecting
    backend = await asyncio.to_thread(
        GrpcBackend, discovery, connect_timeout_s, internal_tls, hop_delay_s, pipeline_rounds
    )
    manifest_fingerprint = checkpoint_fingerprint(checkpoint)
    if manifest_fingerprint != backend.info.fingerprint:
        backend.close()
        raise LayoutError(
            f"{checkpoint} is not the checkpoint the services serve (fingerprint "
            f"{manifest_fingerprint[:12]} against {backend.info.fingerprint[:12]})"
        )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    running = await start_generation_server(
        backend,
        tokenizer,
        store,
        address=address,
        metrics_port=metrics_port,
        metrics_address=metrics_address,
        max_concurrency=max_concurrency,
        request_limits=request_limits,
        tls=tls,
        auth=auth,
        http_listen=http_listen,
        model=served_model_name or model_name(checkpoint),
    )
    running.servicer.metrics.watch_replicas(discovery)
    return running


def model_name(checkpoint: str) -> str:
    """The name the HTTP API serves a checkpoint under: its folder's name."""
    return Path(checkpoint).resolve().name


async def serve_embedded(
    *,
    checkpoint: str,
    store: SessionStore,
    address: str = "127.0.0.1:0",
    limits: SessionLimits | None = None,
    dtype: str | None = None,
    device: str = "cpu",
    draft_model: str | None = None,
    metrics_port: int | None = None,
    metrics_address: str = "127.0.0.1",
    max_concurrency: int = 32,
    request_limits: RequestLimits = DEFAULT_LIMITS,
    tls: ServerTls | None = None,
    auth: ApiKeyAuth | None = None,
    http_listen: str | None = None,
    served_model_name: str | None = None,
    batch_limits: BatchLimits | None = None,
) -> RunningServer:
    """The single-process server: the whole model loaded here, the same Generation
    service over the in-process backend. All compute runs on one model thread, and the
    model calls of concurrent generations are batched within `batch_limits` (the
    services' defaults when None), as the split services batch them. `draft_model`: a
    Hydra checkpoint used as the draft model (drafter "model"); `auth`: API keys
    required; `http_listen`: the HTTP API on that address too."""
    metrics = OrchestratorMetrics()
    # The batches, waits, refusals and session slots on the same /metrics as the rest.
    batch_metrics = ServiceMetrics(metrics.registry)

    def build(thread: ModelThread) -> tuple[HydraModel, LocalBackend]:
        model = HydraModel.load(checkpoint, dtype=dtype, device=device)
        draft = None
        if draft_model:
            draft = DraftModel.load(draft_model, dtype=dtype, device=device)
        backend = LocalBackend(
            model,
            draft_model=draft,
            limits=limits,
            thread=thread,
            batching=batch_limits or BatchLimits(),
            batch_metrics=batch_metrics,
        )
        return model, backend

    # Loaded and built on the model thread: one OpenMP team (see serving.model_thread).
    model, backend = await start_model_thread("model", build)
    running = await start_generation_server(
        backend,
        model.load_tokenizer(),
        store,
        address=address,
        metrics_port=metrics_port,
        metrics_address=metrics_address,
        max_concurrency=max_concurrency,
        request_limits=request_limits,
        tls=tls,
        auth=auth,
        http_listen=http_listen,
        model=served_model_name or model_name(checkpoint),
        metrics=metrics,
    )
    batch_metrics.sessions.watch(backend.trunk.sessions)
    return running
