"""The jury service: `hydrajury.v1.Jury` over a `JuryWorker` hosting some of the heads.

Thin, like the trunk service (whose shared pieces it uses): each RPC builds a plain call
from the request (`*Call.from_pb`, checked before any compute), runs the worker on the
model thread and encodes the result (`score_to_pb`), with the epoch and timings.

Hidden states must arrive in the service's dtype, the `dtype` of its `ModelDescription`
(the trunk sends its own, so a trunk and jury loaded with the same dtype agree). Any
other dtype is INVALID_ARGUMENT rather than a silent conversion: a caller that pairs
services of different dtypes converts, knowingly, before sending.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from hydra_model import HydraModel
from jury_service.worker import JuryWorker, ScoreResult
from protos.codec import DTYPE_NAMES, optional_tensor_to_pb, tensor_from_pb, tensor_to_pb
from protos.hydrajury.v1 import internal_pb2, internal_pb2_grpc, tensor_pb2
from protos.serving import GrpcServer
from protos.worker_servicer import (
    WorkerServicer,
    llm_heads_in_order,
    model_description_to_pb,
    require_session,
    start_server,
    worker_limits,
)

log = logging.getLogger("hydra_jury.jury")

SERVICE_NAME = internal_pb2.DESCRIPTOR.services_by_name["Jury"].full_name
MAX_BETA = 100.0


def hidden_from_pb(message: tensor_pb2.Tensor, model: HydraModel) -> torch.Tensor:
    """Hidden states [T ≥ 1, hidden_size] in the service's dtype, on the host."""
    hidden = tensor_from_pb(
        message,
        name="hidden",
        dtypes=[DTYPE_NAMES[model.dtype]],
        shape=[None, model.config.hidden_size],
    )
    if len(hidden) == 0:
        raise ValueError("hidden: at least one position is required")
    return hidden


def jurors(names: Sequence[str], all_heads: Sequence[str]) -> list[str]:
    unknown = [name for name in names if name not in all_heads]
    if unknown:
        raise ValueError(f"jury: unknown heads {unknown}; the checkpoint has {list(all_heads)}")
    if len(set(names)) != len(names):
        raise ValueError(f"jury: a head is named twice in {list(names)}")
    return list(names)


@dataclass(frozen=True)
class PrefillCall:
    session: str
    start: int
    hidden: torch.Tensor  # [T, D]

    @classmethod
    def from_pb(cls, request: internal_pb2.JuryPrefillRequest, model: HydraModel) -> PrefillCall:
        return cls(
            require_session(request.session),
            request.start,
            hidden_from_pb(request.hidden, model),
        )


@dataclass(frozen=True)
class ScoreCall:
    session: str
    start: int
    hidden: torch.Tensor  # [γ, D]
    jury: list[str]
    temperature: float
    beta: float
    with_decision: bool

    @classmethod
    def from_pb(
        cls, request: internal_pb2.ScoreRequest, model: HydraModel, all_heads: Sequence[str]
    ) -> ScoreCall:
        if not (math.isfinite(request.temperature) and request.temperature >= 0):
            raise ValueError(
                f"temperature: must be finite and >= 0 (0 = greedy), got {request.temperature}"
            )
        if not (math.isfinite(request.beta) and 0 < request.beta <= MAX_BETA):
            raise ValueError(f"beta: must be in (0, {MAX_BETA:g}], got {request.beta}")
        return cls(
            require_session(request.session),
            request.start,
            hidden_from_pb(request.hidden, model),
            jurors(request.jury, all_heads),
            request.temperature,
            request.beta,
            request.with_decision,
        )


def score_to_pb(result: ScoreResult) -> internal_pb2.ScoreResponse:
    decision = result.decision_log_product
    return internal_pb2.ScoreResponse(
        log_product=tensor_to_pb(result.log_product.float()),
        decision_log_product=optional_tensor_to_pb(None if decision is None else decision.float()),
        votes=tensor_to_pb(result.votes.long()),
        voters=result.voters,
        head_evaluations=result.head_evaluations,
    )


class JuryServicer(WorkerServicer, internal_pb2_grpc.JuryServicer):
    """`hydrajury.v1.Jury`: requests → `JuryWorker` calls on the model thread."""

    def __init__(self, worker: JuryWorker) -> None:
        super().__init__(worker, "jury-model")

    async def Info(self, request, context) -> internal_pb2.JuryInfoResponse:
        return internal_pb2.JuryInfoResponse(
            model=model_description_to_pb(self.worker.model, self.worker.max_session_tokens),
            hosted_heads=self.worker.hosted,
            limits=self.limits_to_pb(),
            epoch=self.epoch,
        )

    async def Prefill(self, request, context) -> internal_pb2.JuryPrefillResponse:
        began = time.perf_counter_ns()
        call = PrefillCall.from_pb(request, self.worker.model)
        _, forward_ns = await self.run_timed(
            self.worker.prefill, call.session, call.start, call.hidden
        )
        return self.stamp(internal_pb2.JuryPrefillResponse(), began, forward_ns)

    async def Score(self, request, context) -> internal_pb2.ScoreResponse:
        began = time.perf_counter_ns()
        call = ScoreCall.from_pb(request, self.worker.model, self.worker.all_heads)
        result, forward_ns = await self.run_timed(
            self.worker.score,
            call.session,
            call.start,
            call.hidden,
            call.jury,
            call.temperature,
            call.beta,
            call.with_decision,
        )
        return self.stamp(score_to_pb(result), began, forward_ns)


async def serve_jury(
    checkpoint: str | Path,
    *,
    address: str = "127.0.0.1:0",
    heads: Sequence[str] | None = None,
    max_sessions: int = 16,
    max_session_tokens: int = 4096,
    idle_timeout_s: float | None = None,
    dtype: str | None = None,
    device: str = "cpu",
) -> tuple[GrpcServer, int, JuryServicer]:
    """Loads the hosted heads (default: every `llm` head; no trunk) and starts the
    service on `address` (port 0 picks a free one). Stop it with `server.stop(grace)`
    and then `servicer.close()`."""
    limits = worker_limits(max_sessions, max_session_tokens, idle_timeout_s)
    hosted = llm_heads_in_order(checkpoint, heads, "heads")
    model = await asyncio.to_thread(
        HydraModel.load, checkpoint, dtype=dtype, device=device, heads=hosted, load_trunk=False
    )
    worker = JuryWorker(model, **limits)
    servicer = JuryServicer(worker)
    server, port = await start_server(
        servicer, internal_pb2_grpc.add_JuryServicer_to_server, SERVICE_NAME, address
    )
    log.info(
        "jury service: %s, heads %s, %d sessions of %d tokens, port %d",
        checkpoint,
        ",".join(hosted),
        max_sessions,
        worker.max_session_tokens,
        port,
    )
    return server, port, servicer
