"""The public `hydrajury.v1.Generation` service: a thin servicer over the engine running
on the gRPC backend.

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

from orchestrator.convert import output_to_pb, request_from_pb, round_to_pb
from orchestrator.engine import Engine, Generation
from orchestrator.grpc_backend import GrpcBackend
from orchestrator.metrics import OrchestratorMetrics
from orchestrator.request import RequestError
from poe import RULES
from protos.hydrajury.v1 import generation_pb2, generation_pb2_grpc
from serving.errors import SessionNotFound
from serving.server import GrpcServer
from workers.calls import MAX_GAMMA

log = logging.getLogger("hydra_jury.orchestrator")
SERVICE_NAME = "hydrajury.v1.Generation"


def _deadline(context: grpc.aio.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(
        self,
        backend: GrpcBackend,
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

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    async def Info(self, request, context):
        info = self.backend.info
        self.metrics.requests.labels("Info").inc()
        return generation_pb2.GenerationInfoResponse(
            model_fingerprint=self.backend.fingerprint,
            architecture=self.backend.trunk.info.model.architecture,
            heads=info.head_names,
            drafter_heads=info.drafter_heads,
            rules=RULES,
            max_gamma=MAX_GAMMA,
            context_length=info.context_length,
            trunk=self.backend.trunk.address,
            jury_shards=[shard.address for shard in self.backend.shards],
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
):
    """Connects to the services (checking their layout), starts the Generation server.
    Returns (server, port, servicer, metrics_port or None)."""
    from hydra_model.checkpoint import checkpoint_fingerprint, read_manifest
    from orchestrator.grpc_backend import LayoutError

    read_manifest(checkpoint)  # a clear error for a wrong --checkpoint, before connecting
    loop = asyncio.get_running_loop()
    backend = await loop.run_in_executor(None, lambda: GrpcBackend(trunk, jury, connect_timeout_s))
    manifest_fingerprint = checkpoint_fingerprint(checkpoint)
    if manifest_fingerprint != backend.fingerprint:
        backend.close()
        raise LayoutError(
            f"{checkpoint} is not the checkpoint the services serve (fingerprint "
            f"{manifest_fingerprint[:12]} against {backend.fingerprint[:12]})"
        )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    metrics = OrchestratorMetrics()
    servicer = GenerationServicer(backend, tokenizer, metrics, max_concurrency=max_concurrency)
    server = GrpcServer(
        lambda s: generation_pb2_grpc.add_GenerationServicer_to_server(servicer, s),
        [SERVICE_NAME],
        on_error=lambda method, code: metrics.errors.labels(code.name).inc(),
    )
    port = await server.start(address)
    bound_metrics = (
        metrics.serve(metrics_port, metrics_address) if metrics_port is not None else None
    )
    return server, port, servicer, bound_metrics
