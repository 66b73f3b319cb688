"""The jury service: `hydrajury.v1.Jury` over a `JuryWorker` hosting some of the heads.

Thin, like the trunk service: each RPC builds the worker's call from the request
(`serving.internal_wire`), runs the worker on the model thread and encodes the result,
with the epoch and timings.

Hidden states must arrive in the service's dtype, the `dtype` of its `ModelDescription`
(the trunk sends its own, so a trunk and jury loaded with the same dtype agree). Any
other dtype is INVALID_ARGUMENT rather than a silent conversion: a caller that pairs
services of different dtypes converts, knowingly, before sending.
"""

from __future__ import annotations

from hydra_jury.hydra_model import HydraModel
from hydra_jury.protos.hydrajury.v1 import internal_pb2, internal_pb2_grpc
from hydra_jury.serving import internal_wire as wire
from hydra_jury.serving.batcher import BatchLimits
from hydra_jury.serving.model_thread import ModelThread
from hydra_jury.serving.servicer import BatchResults, WorkerServicer, batch_calls, rows_of
from hydra_jury.serving.worker_service import ServiceOptions, WorkerServiceSpec
from hydra_jury.workers.jury import JuryWorker
from hydra_jury.workers.sessions import check_capacity


class JuryServicer(WorkerServicer, internal_pb2_grpc.JuryServicer):
    """`hydrajury.v1.Jury`: requests → `JuryWorker` calls on the model thread."""

    worker: JuryWorker

    def __init__(
        self, worker: JuryWorker, thread: ModelThread, batch_limits: BatchLimits | None = None
    ) -> None:
        super().__init__(worker, thread, batch_limits)
        # Concurrent calls of different sessions run as one forward of the hosted heads.
        self._prefills = self.batcher(
            "Prefill",
            lambda request: wire.jury_prefill_call_from_pb(request, self.dtype, self.hidden_size),
            worker.prefill_batch,
            worker.prefill,
            lambda _: internal_pb2.JuryPrefillResponse(),
            lambda request: rows_of(request.hidden),
            recurring=False,
        )
        self._scores = self.batcher(
            "Score",
            lambda request: wire.score_call_from_pb(request, self.dtype, self.hidden_size),
            worker.score_batch,
            worker.score,
            lambda result: wire.score_result_to_pb(result),
            lambda request: rows_of(request.hidden),
        )

    def listening_detail(self) -> str:
        return f" (heads {','.join(self.worker.hosted)})"

    async def Info(self, request, context) -> internal_pb2.JuryInfoResponse:
        return internal_pb2.JuryInfoResponse(
            model=self.model_description,
            hosted_heads=self.worker.hosted,
            limits=self.limits_to_pb(),
            epoch=self.epoch,
        )

    async def Prefill(self, request, context) -> internal_pb2.JuryPrefillResponse:
        chunks = wire.jury_prefill_chunks(request, self.batch_limits.prefill_chunk)
        if len(chunks) > 1:  # the whole call checked first: no chunk after the first fails
            check_capacity(request.start + rows_of(request.hidden), self.worker.max_session_tokens)
        return await self.call_batched(self._prefills, chunks)

    async def Score(self, request, context) -> internal_pb2.ScoreResponse:
        return await self.call_batched(self._scores, [request])

    async def ScoreBatch(self, request, context) -> internal_pb2.ScoreBatchResponse:
        return await self.call_model(
            lambda: batch_calls(
                [
                    wire.score_call_from_pb(call, self.dtype, self.hidden_size)
                    for call in request.calls
                ]
            ),
            lambda calls: BatchResults(self.worker.score_batch(calls)),
            lambda results: internal_pb2.ScoreBatchResponse(
                results=[wire.score_result_to_pb(result) for result in results]
            ),
        )


def _build_servicer(
    model: HydraModel, heads: list[str], options: ServiceOptions, thread: ModelThread
) -> JuryServicer:
    return JuryServicer(JuryWorker(model, limits=options.limits), thread, options.batch_limits)


JURY_SERVICE = WorkerServiceSpec(
    name="jury service",
    service_name=internal_pb2.DESCRIPTOR.services_by_name["Jury"].full_name,
    default_port=50061,
    description="Serve some heads of a Hydra checkpoint as a jury shard "
    "(hydrajury.v1.Jury); shards host disjoint head sets.",
    heads_option="--heads",
    heads_help="heads this shard hosts (default: every llm head)",
    load_trunk=False,
    build_servicer=_build_servicer,
    add_servicer=internal_pb2_grpc.add_JuryServicer_to_server,
    shares_host_turn=True,
)
