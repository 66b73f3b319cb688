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
from hydra_jury.serving.batcher import CONTINUE, BatchLimits, CallBatcher
from hydra_jury.serving.model_thread import ModelThread
from hydra_jury.serving.servicer import BatchResults, WorkerServicer, batch_calls
from hydra_jury.serving.worker_service import ServiceOptions, WorkerServiceSpec
from hydra_jury.workers.calls import DraftResult
from hydra_jury.workers.errors import InvalidArgument
from hydra_jury.workers.trunk import Drafting, TrunkWorker


class TrunkServicer(WorkerServicer, internal_pb2_grpc.TrunkServicer):
    """`hydrajury.v1.Trunk`: requests → `TrunkWorker` calls on the model thread."""

    worker: TrunkWorker

    def __init__(
        self, worker: TrunkWorker, thread: ModelThread, batch_limits: BatchLimits | None = None
    ) -> None:
        super().__init__(worker, thread, batch_limits)
        # Concurrent prefills (one-pass checks included) of different sessions run as one
        # trunk forward. Draft calls (plain steps and head drafts) are stepped: each batch
        # runs one position of every session drafting — one trunk forward over all of
        # them, one forward per draft head — so a call joins at the step after it
        # arrives and leaves once its γ positions are done.
        self._prefills = self.batcher(
            "Prefill",
            lambda request: wire.prefill_call_from_pb(request),
            worker.prefill_batch,
            worker.prefill,
            lambda hidden: internal_pb2.TrunkPrefillResponse(hidden=wire.hidden_to_pb(hidden)),
            lambda request: max(1, len(request.tokens)),
        )
        self._drafting: dict[int, Drafting] = {}  # id(request) -> its call in progress
        self._drafts = self.batchers["Draft"] = CallBatcher(
            "TrunkServicer.Draft",
            thread,
            self._draft_step,
            lambda request: 1,  # one position per step
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

    def _draft_step(self, requests: list) -> list:
        """One batch of the Draft scheduler, on the model thread: the new calls start
        (each alone, so a bad one fails alone; a draft-model call runs whole), then one
        step of every call drafting. Each call's response once it is done, `CONTINUE`
        until then."""
        began = time.perf_counter_ns()
        outcomes: dict[int, Any] = {}
        for request in requests:
            if id(request) not in self._drafting:
                outcomes[id(request)] = self._begin_draft(request)
        drafting = [self._drafting[id(r)] for r in requests if id(r) in self._drafting]
        try:
            self.worker.draft_step(drafting)
        except Exception as error:
            self.worker.abandon(drafting)
            for request in requests:
                if self._drafting.pop(id(request), None) is not None:
                    outcomes[id(request)] = error
        forward_ns = time.perf_counter_ns() - began
        responses = []
        for request in requests:
            entry = self._drafting.get(id(request))
            if entry is not None and not entry.done:
                responses.append(CONTINUE)
                continue
            if entry is not None:
                del self._drafting[id(request)]
                try:
                    outcome = entry.result()
                except Exception as error:
                    outcome = error
            else:
                outcome = outcomes[id(request)]
            if isinstance(outcome, Exception):
                responses.append(outcome)
                continue
            response = wire.draft_result_to_pb(outcome.on_host())
            response.timings.forward_ns = forward_ns
            responses.append(response)
        return responses

    def _begin_draft(self, request) -> DraftResult | Exception | None:
        """Starts one call: its result when it ran whole, its error, or None once it is
        drafting."""
        try:
            call = wire.draft_call_from_pb(request)
            if any(entry.call.session == call.session for entry in self._drafting.values()):
                raise InvalidArgument(
                    f"session {call.session!r}: another draft call of it is still running"
                )
            (started,) = self.worker.begin_drafts([call])
        except Exception as error:
            return error
        if isinstance(started, Drafting):
            self._drafting[id(request)] = started
            return None
        return started


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
