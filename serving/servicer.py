"""What the trunk and jury servicers share: the worker and its model thread, the epoch,
the model description (built once), model calls with their timings and with protobuf
conversion off the event loop, batched calls (`serving.batcher`), limits, `Release`,
idle eviction and the service's metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol, Self, TypeVar

import grpc

from hydra_jury.hydra_model import HydraModel
from hydra_jury.protos.codec import dtype_name
from hydra_jury.protos.hydrajury.v1 import internal_pb2
from hydra_jury.serving.batcher import BatchLimits, CallBatcher, run_isolated
from hydra_jury.serving.metrics import ServiceMetrics
from hydra_jury.serving.model_thread import ModelThread
from hydra_jury.serving.server import new_epoch
from hydra_jury.workers.errors import CapacityError, InvalidArgument

log = logging.getLogger("hydra_jury.service")


class _Movable(Protocol):
    def on_host(self) -> Self: ...


Call = TypeVar("Call")
Result = TypeVar("Result", bound=_Movable | None)  # a worker result, hidden states or None
Response = TypeVar("Response")


def model_description_to_pb(
    model: HydraModel, context_length: int
) -> internal_pb2.ModelDescription:
    config = model.config
    return internal_pb2.ModelDescription(
        fingerprint=model.fingerprint,
        architecture=config.model_type,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        context_length=context_length,
        heads=[head.name for head in model.manifest.llm_heads],
        eos_token_ids=list(config.eos_token_ids),
        dtype=dtype_name(model.dtype),
    )


def _on_host(result: Any) -> Any:
    return None if result is None else result.on_host()


def rows_of(tensor: Any) -> int:
    """The first dimension of a `Tensor` message (its positions), for token budgets."""
    return tensor.shape[0] if tensor.shape else 1


class BatchResults(list):
    """A batch call's results, in order; moved to the host together."""

    def on_host(self) -> BatchResults:
        return BatchResults(result.on_host() for result in self)


def batch_calls(calls: list[Call]) -> list[Call]:
    """A batch request's calls; an empty batch is refused."""
    if not calls:
        raise InvalidArgument("calls: a batch needs at least one call")
    return calls


class WorkerServicer:
    """The base of the trunk and jury servicers. A worker has `model`, `sessions`,
    `max_session_tokens`, `release(session)` and `finish(session)`."""

    def __init__(
        self, worker: Any, thread: ModelThread, batch_limits: BatchLimits | None = None
    ) -> None:
        self.worker = worker
        self.thread = thread
        self.batch_limits = batch_limits or BatchLimits()
        self.batchers: dict[str, CallBatcher] = {}
        self.metrics = ServiceMetrics()
        self.metrics.sessions.watch(worker.sessions)
        self.epoch = new_epoch()
        # Built once: `Info` never re-reads the checkpoint.
        self.model_description = model_description_to_pb(worker.model, worker.max_session_tokens)
        self.dtype = self.model_description.dtype
        self.hidden_size = self.model_description.hidden_size
        self._evictor: asyncio.Task | None = None

    def count_refusal(
        self,
        method: str,
        error: Exception,
        code: grpc.StatusCode,
        context: grpc.aio.ServicerContext,
    ) -> None:
        """Counts a call the worker refused for want of capacity, by its reason (the
        admission queue counts its own refusals); the server's `OnError`."""
        if isinstance(error, CapacityError) and error.reason is not None:
            self.metrics.refused.labels(method.rpartition("/")[2], error.reason).inc()

    def listening_detail(self) -> str:
        """What follows "listening on HOST:PORT" in the start-up line."""
        return ""

    async def call_model(
        self,
        decode: Callable[[], Call],
        function: Callable[[Call], Result],
        encode: Callable[[Result], Response],
    ) -> Response:
        """Builds the call (`decode`, from the request), runs `function(call)` and
        encodes its result (`encode`), all in one trip to the model thread: tensors are
        never converted on the event loop, and a call costs one thread hop. The response
        carries the epoch and the timings: `forward_ns` is the worker call, including the
        copy of its outputs to the host (so on a GPU it waits for the device),
        `total_ns` the whole handler, `share_ns` its time on the model thread (a call
        that runs alone costs the service all of it)."""
        began_ns = time.perf_counter_ns()

        def run() -> tuple[Response, int, int]:
            started = time.perf_counter_ns()
            call = decode()
            began = time.perf_counter_ns()
            result = function(call)
            if result is not None:  # a result, or hidden states: tensors to the host
                result = result.on_host()
            forward_ns = time.perf_counter_ns() - began
            response = encode(result)
            return response, forward_ns, time.perf_counter_ns() - started

        response, forward_ns, share_ns = await self.thread.run(run)
        response.epoch = self.epoch
        response.timings.forward_ns = forward_ns
        response.timings.total_ns = time.perf_counter_ns() - began_ns
        response.timings.share_ns = max(1, share_ns)
        return response

    def batcher(
        self,
        rpc: str,
        decode: Callable[[Any], Call],
        run_batch: Callable[[list[Call]], list[Result]],
        run_one: Callable[[Call], Result],
        encode: Callable[[Result], Response],
        size: Callable[[Any], int],
        recurring: bool = True,
    ) -> CallBatcher:
        """A batcher for the requests of `rpc`: each batch is decoded, run (a call that
        fails alone fails alone) and encoded in one trip to the model thread.
        `recurring`: whether each session makes such a call every round
        (`CallBatcher`)."""

        def handle(requests: list) -> list:
            decoded = []
            for request in requests:
                try:
                    decoded.append(decode(request))
                except Exception as error:
                    decoded.append(error)
            calls = [call for call in decoded if not isinstance(call, Exception)]
            began = time.perf_counter_ns()
            results = iter(
                run_isolated(
                    calls,
                    lambda batch: [_on_host(result) for result in run_batch(batch)],
                    lambda call: _on_host(run_one(call)),
                )
                if calls
                else []
            )
            forward_ns = time.perf_counter_ns() - began
            responses = []
            for call in decoded:
                result = call if isinstance(call, Exception) else next(results)
                if isinstance(result, Exception):
                    responses.append(result)
                    continue
                response = encode(result)
                response.timings.forward_ns = forward_ns
                responses.append(response)
            return responses

        batcher = CallBatcher(
            f"{type(self).__name__}.{rpc}",
            self.thread,
            handle,
            size,
            self.batch_limits,
            self.metrics.observer(rpc),
            recurring,
        )
        self.batchers[rpc] = batcher
        return batcher

    async def call_batched(
        self,
        batcher: CallBatcher,
        requests: list[Any],
        join: Callable[[list[Any]], Any] = lambda responses: responses[0],
    ) -> Any:
        """The response to a request sent as `requests` (one, or the chunks of a long
        prefill, each in its own batch after the one before): their responses joined,
        with the epoch and the timings (`forward_ns`: the worker calls of their
        batches; `share_ns`: the call's share of them, `CallBatcher.submit_shared`)."""
        began_ns = time.perf_counter_ns()
        outcomes = [await batcher.submit_shared(request) for request in requests]
        responses = [response for response, _ in outcomes]
        response = join(responses)
        response.epoch = self.epoch
        response.timings.forward_ns = sum(part.timings.forward_ns for part in responses)
        response.timings.total_ns = time.perf_counter_ns() - began_ns
        response.timings.share_ns = max(1, round(1e9 * sum(share for _, share in outcomes)))
        return response

    def limits_to_pb(self) -> internal_pb2.ServiceLimits:
        sessions = self.worker.sessions
        return internal_pb2.ServiceLimits(
            max_sessions=sessions.max_sessions,
            max_session_tokens=self.worker.max_session_tokens,
            active_sessions=len(sessions),
            idle_timeout_s=sessions.idle_timeout_s or 0.0,
        )

    async def Release(  # the RPC, the same in both services
        self, request: internal_pb2.ReleaseRequest, context: Any = None
    ) -> internal_pb2.ReleaseResponse:
        if not request.session:
            raise InvalidArgument("session: a non-empty session id is required")
        self.thread.session_left(request.session)  # its batches stop waiting for it
        end = self.worker.finish if request.keep_caches else self.worker.release
        held = await self.thread.run(end, request.session)
        return internal_pb2.ReleaseResponse(released=held, epoch=self.epoch)

    def start_idle_eviction(self) -> None:
        """Evicts idle sessions every so often (nothing to do without an idle timeout).
        Sessions are also evicted when a new one needs room; this frees their memory
        and keeps `active_sessions` honest."""
        timeout = self.worker.sessions.idle_timeout_s
        if timeout is None or self._evictor is not None:
            return
        interval = min(max(timeout / 4, 0.01), 30.0)
        self._evictor = asyncio.create_task(self._evict_idle_forever(interval))

    async def _evict_idle_forever(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                evicted = await self.thread.run(self.worker.sessions.evict_idle)
            except Exception:
                log.exception("idle eviction failed")
                continue
            if evicted:
                log.info("evicted %d idle sessions", len(evicted))

    async def close(self) -> None:
        """Stops idle eviction and the model thread (after the server has stopped)."""
        if self._evictor is not None:
            self._evictor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._evictor
            self._evictor = None
        await asyncio.to_thread(self.thread.shutdown)
