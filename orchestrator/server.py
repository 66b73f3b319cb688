"""The public `hydrajury.v1.Generation` service: a thin servicer over the engine, on
either backend — the gRPC backend (`serve_orchestrator`: the split stack) or the
in-process backend (`serve_embedded`: the whole model in this process, for one machine).

The engine loop is synchronous; each request runs it in a worker thread (its internal
calls block on the network, not on compute), so requests proceed concurrently. Streams
hand rounds to the event loop through a queue; a client that cancels sets a flag the
worker checks between rounds, and closing the generation releases its caches on every
service.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from hydra_model import HydraModel
from hydra_model.checkpoint import checkpoint_fingerprint, read_manifest
from orchestrator.backend import DecodingBackend
from orchestrator.convert import output_to_pb, request_from_pb, round_to_pb
from orchestrator.engine import Engine, Generation
from orchestrator.grpc_backend import GrpcBackend, LayoutError
from orchestrator.local_backend import LocalBackend
from orchestrator.metrics import OrchestratorMetrics
from orchestrator.request import RequestError
from poe import RULES
from protos.hydrajury.v1 import generation_pb2, generation_pb2_grpc
from serving.errors import SessionNotFound
from serving.model_thread import ModelThread, start_model_thread
from serving.server import GrpcServer, RunningServer
from workers.calls import MAX_GAMMA
from workers.sessions import SessionLimits

log = logging.getLogger("hydra_jury.orchestrator")
SERVICE_NAME = "hydrajury.v1.Generation"


def _deadline(context: grpc.aio.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(
        self,
        backend: DecodingBackend,
        tokenizer,
        metrics: OrchestratorMetrics,
        *,
        max_concurrency: int = 32,
    ) -> None:
        self.engine = Engine(backend, tokenizer)
        self.backend = backend
        self.metrics = metrics
        self._pool = ThreadPoolExecutor(
            max_workers=max_concurrency, thread_name_prefix="generation"
        )

    async def close(self) -> None:
        """Stops the generation threads, then the backend (after the server stopped)."""
        await asyncio.to_thread(self._pool.shutdown, wait=True, cancel_futures=True)
        await asyncio.to_thread(self.backend.close)

    async def Info(self, request, context):
        info = self.backend.info
        self.metrics.requests.labels("Info").inc()
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
        )

    async def CloseSession(self, request, context):
        self.metrics.requests.labels("CloseSession").inc()
        if not request.session_id:
            raise RequestError("session_id is empty")
        loop = asyncio.get_running_loop()
        closed = await loop.run_in_executor(
            self._pool, self.backend.close_session, request.session_id
        )
        if not closed:
            raise SessionNotFound(f"no service holds session {request.session_id!r}")
        return generation_pb2.CloseSessionResponse(closed=True)

    async def Generate(self, request, context):
        self.metrics.requests.labels("Generate").inc()
        final = None
        async for _output, summary in self._rounds(request, context):
            final = summary if summary is not None else final
        return output_to_pb(final)

    async def GenerateStream(self, request, context):
        self.metrics.requests.labels("GenerateStream").inc()
        async for output, summary in self._rounds(request, context):
            yield round_to_pb(output, summary)

    async def _rounds(self, request, context):
        """(round, summary on the last round) as the worker thread commits them."""
        loop = asyncio.get_running_loop()
        generation_request = request_from_pb(request)
        generation: Generation = await loop.run_in_executor(
            self._pool, self.engine.start, generation_request, request.session_id or None
        )
        queue: asyncio.Queue = asyncio.Queue()
        stop = threading.Event()
        deadline = _deadline(context)
        began = time.monotonic()

        def put(item) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        def produce() -> None:
            try:
                with self.backend.call_scope(deadline):
                    for output in generation:
                        summary = generation.result() if output.finish_reason else None
                        put(("round", output, summary))
                        if stop.is_set():
                            break
            except Exception as error:
                put(("error", error, None))
            finally:
                generation.close()  # releases the caches on every service
                put(("end", None, None))

        self.metrics.active_sessions.inc()
        loop.run_in_executor(self._pool, produce)
        emitted, first_at = 0, None
        try:
            while True:
                kind, item, summary = await queue.get()
                if kind == "error":
                    raise item
                if kind == "end":
                    break
                now = time.monotonic()
                if first_at is None and item.tokens:
                    first_at = now
                    self.metrics.ttft.observe(now - began)
                elif item.tokens and first_at is not None:
                    per_token = (now - first_at) / max(1, emitted + len(item.tokens) - 1)
                    self.metrics.tpot.observe(per_token)
                emitted += len(item.tokens)
                self.metrics.observe_round(item)
                yield item, summary
        finally:
            # Finished, failed or cancelled by the client: stop the worker between rounds.
            stop.set()
            self.metrics.active_sessions.dec()


async def start_generation_server(
    backend: DecodingBackend,
    tokenizer,
    *,
    address: str,
    metrics_port: int | None,
    metrics_address: str,
    max_concurrency: int,
) -> RunningServer:
    """The Generation service over `backend`, started on `address` (port 0: any free)."""
    metrics = OrchestratorMetrics()
    servicer = GenerationServicer(backend, tokenizer, metrics, max_concurrency=max_concurrency)
    server = GrpcServer(
        lambda s: generation_pb2_grpc.add_GenerationServicer_to_server(servicer, s),
        [SERVICE_NAME],
        on_error=lambda method, code: metrics.errors.labels(code.name).inc(),
    )
    try:
        port = await server.start(address)
    except BaseException:
        await servicer.close()
        raise
    bound_metrics = (
        metrics.serve(metrics_port, metrics_address) if metrics_port is not None else None
    )
    return RunningServer(server, port, servicer, bound_metrics)


async def serve_orchestrator(
    *,
    checkpoint: str,
    trunk: str,
    jury: list[str],
    address: str = "127.0.0.1:0",
    metrics_port: int | None = None,
    metrics_address: str = "127.0.0.1",
    max_concurrency: int = 32,
    connect_timeout_s: float = 30.0,
) -> RunningServer:
    """The split stack's orchestrator: connects to the services (checking their layout)
    and starts the Generation server."""
    read_manifest(checkpoint)  # a clear error for a wrong --checkpoint, before connecting
    backend = await asyncio.to_thread(GrpcBackend, trunk, jury, connect_timeout_s)
    manifest_fingerprint = checkpoint_fingerprint(checkpoint)
    if manifest_fingerprint != backend.info.fingerprint:
        backend.close()
        raise LayoutError(
            f"{checkpoint} is not the checkpoint the services serve (fingerprint "
            f"{manifest_fingerprint[:12]} against {backend.info.fingerprint[:12]})"
        )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    return await start_generation_server(
        backend,
        tokenizer,
        address=address,
        metrics_port=metrics_port,
        metrics_address=metrics_address,
        max_concurrency=max_concurrency,
    )


async def serve_embedded(
    *,
    checkpoint: str,
    address: str = "127.0.0.1:0",
    limits: SessionLimits | None = None,
    dtype: str | None = None,
    device: str = "cpu",
    metrics_port: int | None = None,
    metrics_address: str = "127.0.0.1",
    max_concurrency: int = 32,
) -> RunningServer:
    """The single-process server: the whole model loaded here, the same Generation
    service over the in-process backend. All compute runs on one model thread."""

    def build(thread: ModelThread) -> tuple[HydraModel, LocalBackend]:
        model = HydraModel.load(checkpoint, dtype=dtype, device=device)
        return model, LocalBackend(model, limits=limits, thread=thread)

    # Loaded and built on the model thread: one OpenMP team (see serving.model_thread).
    model, backend = await start_model_thread("model", build)
    return await start_generation_server(
        backend,
        model.load_tokenizer(),
        address=address,
        metrics_port=metrics_port,
        metrics_address=metrics_address,
        max_concurrency=max_concurrency,
    )
