"""The trunk service: `hydrajury.v1.Trunk` over a `TrunkWorker`.

The servicer is thin: each RPC builds the worker's call from the request
(`serving.internal_wire`, decoded off the event loop), runs the worker on the model
thread, and encodes the result back, with the epoch and timings. Every check lives in
the call (`workers.calls`) or the worker, so a bad request never opens a session.
"""

from __future__ import annotations

import time
from typing import Any

from hydra_jury.hydra_model import DraftModel, HydraModel
from hydra_jury.protos.hydrajury.v1 import internal_pb2, internal_pb2_grpc
from hydra_jury.serving import internal_wire as wire
from hydra_jury.serving.batcher import BatchLimits, CallBatcher
from hydra_jury.serving.draft_scheduler import DraftScheduler
from hydra_jury.serving.model_thread import ModelThread
from hydra_jury.serving.servicer import BatchResults, WorkerServicer, batch_calls
from hydra_jury.serving.worker_service import ServiceOptions, WorkerServiceSpec
from hydra_jury.workers.calls import DraftResult
from hydra_jury.workers.trunk import TrunkWorker


class TrunkServicer(WorkerServicer, internal_pb2_grpc.TrunkServicer):
    """`hydrajury.v1.Trunk`: requests → `TrunkWorker` calls on the model thread."""

    worker: TrunkWorker

    def __init__(
        self, worker: TrunkWorker, thread: ModelThread, batch_limits: BatchLimits | None = None
    ) -> None:
        super().__init__(worker, thread, batch_limits)
        # Concurrent prefills of different sessions run as one trunk forward. Draft calls
        # (plain steps, one-pass checks and head drafts) are stepped by the draft
        # scheduler: each batch of the Draft batcher runs one step of every session
        # drafting (a one-pass check's pending token and outside drafts are its one
        # step), so a call joins at the step after it arrives and leaves once its γ
        # steps are done.
        self._prefills = self.batcher(
            "Prefill",
            lambda request: wire.prefill_call_from_pb(request),
            worker.prefill_batch,
            worker.prefill,
            lambda hidden: internal_pb2.TrunkPrefillResponse(hidden=wire.hidden_to_pb(hidden)),
            lambda request: max(1, len(request.tokens)),
            recurring=False,
        )
        self.draft_scheduler: DraftScheduler[internal_pb2.DraftRequest] = DraftScheduler(worker)
        self._drafts = self.batchers["Draft"] = CallBatcher(
            "TrunkServicer.Draft",
            thread,
            self._draft_batch,
            # One position per step; a one-pass check's step, its pending token and drafts.
            lambda request: 1 + len(request.outside_drafts),
            self.batch_limits,
            self.metrics.observer("Draft"),
        )

    async def Info(self, request, context) -> internal_pb2.TrunkInfoResponse:
        return internal_pb2.TrunkInfoResponse(
            model=self.model_description,
            drafter_heads=self.worker.drafters,
            limits=self.limits_to_pb(),
            epoch=self.epoch,
            draft_model=self.worker.draft_model.description if self.worker.draft_model else "",
            uncertainty_head=self.worker.uncertainty_head is not None,
        )

    async def Uncertainty(self, request, context) -> internal_pb2.UncertaintyResponse:
        return await self.call_model(
            lambda: wire.uncertainty_call_from_pb(request),
            self.worker.uncertainty,
            wire.uncertainty_result_to_pb,
        )

    async def Prefill(self, request, context) -> internal_pb2.TrunkPrefillResponse:
        self.worker.sessions.check_room(request.session, request.start)  # not behind a queue
        chunks = wire.prefill_chunks(request, self.batch_limits.prefill_chunk)
        if len(chunks) > 1:  # the whole call checked first: no chunk after the first fails
            self.worker.check_prefill(wire.prefill_call_from_pb(request))
        return await self.call_batched(self._prefills, chunks, wire.joined_prefill_responses)

    async def PrefillBatch(self, request, context) -> internal_pb2.TrunkPrefillBatchResponse:
        return await self.call_model(
            lambda: batch_calls([wire.prefill_call_from_pb(call) for call in request.calls]),
            lambda calls: BatchResults(self.worker.prefill_batch(calls)),
            lambda results: internal_pb2.TrunkPrefillBatchResponse(
                results=[
                    internal_pb2.TrunkPrefillResponse(hidden=wire.hidden_to_pb(hidden))
                    for hidden in results
                ]
            ),
        )

    async def Draft(self, request, context) -> internal_pb2.DraftResponse:
        return await self.call_batched(self._drafts, [request])

    def _draft_batch(self, requests: list[internal_pb2.DraftRequest]) -> list:
        """One batch of the Draft batcher, on the model thread: a step of the scheduler,
        each request's outcome encoded (`CONTINUE` and errors as they are)."""
        began = time.perf_counter_ns()
        outcomes = self.draft_scheduler.run(requests, wire.draft_call_from_pb)
        forward_ns = time.perf_counter_ns() - began
        return [_draft_response(outcome, forward_ns) for outcome in outcomes]


def _draft_response(outcome: DraftResult | Exception | object, forward_ns: int) -> Any:
    if not isinstance(outcome, DraftResult):  # CONTINUE, or the call's error
        return outcome
    response = wire.draft_result_to_pb(outcome.on_host())
    response.timings.forward_ns = forward_ns
    return response


def _build_servicer(
    model: HydraModel, heads: list[str], options: ServiceOptions, thread: ModelThread
) -> TrunkServicer:
    draft_model = None
    if options.draft_model:
        draft_model = DraftModel.load(
            options.draft_model, dtype=options.dtype, device=options.device
        )
    worker = TrunkWorker(model, drafter_heads=heads, draft_model=draft_model, limits=options.limits)
    return TrunkServicer(worker, thread, options.batch_limits)


TRUNK_SERVICE = WorkerServiceSpec(
    name="trunk service",
    service_name=internal_pb2.DESCRIPTOR.services_by_name["Trunk"].full_name,
    default_port=50051,
    description="Serve a Hydra checkpoint's trunk and drafter heads (hydrajury.v1.Trunk) "
    "to the orchestrator.",
    heads_option="--drafter-heads",
    heads_help="heads the trunk may draft with (default: every llm head)",
    load_trunk=True,
    build_servicer=_build_servicer,
    add_servicer=internal_pb2_grpc.add_TrunkServicer_to_server,
    hosts_draft_model=True,
)
