"""The trunk service: `hydrajury.v1.Trunk` over a `TrunkWorker`.

The servicer is thin. Each RPC builds a plain call from the request (`*Call.from_pb`,
every field checked against the model before any compute, so a bad request never
allocates a session), runs the worker on the model thread, and turns the result back
into a response (`*_to_pb`). Hidden states travel in the model's dtype (the dtype in
`ModelDescription`), distributions as float32.

Every response carries the service's epoch; responses of model calls carry timings:
`forward_ns` is the worker call on the model thread, including the copy of its outputs
to the host (so on a GPU it waits for the device), `total_ns` the whole handler.

The pieces both worker services share live in `protos.worker_servicer`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from hydra_model import HydraModel
from poe import SamplingParams
from poe.randomness import MAX_SEED
from protos.codec import tensor_to_pb
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
from trunk_service.worker import MAX_GAMMA, DraftResult, TrunkWorker

log = logging.getLogger("hydra_jury.trunk")
T = TypeVar("T")

SERVICE_NAME = internal_pb2.DESCRIPTOR.services_by_name["Trunk"].full_name


def token_ids(field: str, values: Sequence[int], vocab_size: int) -> torch.Tensor:
    """Token ids [T] long, at least one, each in [0, vocab_size)."""
    tokens = torch.tensor(list(values), dtype=torch.long)
    if len(tokens) == 0:
        raise ValueError(f"{field}: at least one token is required")
    outside = tokens[(tokens < 0) | (tokens >= vocab_size)]
    if len(outside):
        raise ValueError(
            f"{field}: token id {int(outside[0])} is outside the vocabulary [0, {vocab_size})"
        )
    return tokens


def sampling_from_pb(message: tensor_pb2.SamplingParams, vocab_size: int) -> SamplingParams:
    sampling = SamplingParams(
        temperature=message.temperature,
        top_k=message.top_k,
        top_p=message.top_p,
        min_p=message.min_p,
    )
    try:
        sampling.validate(vocab_size)
    except ValueError as error:
        raise ValueError(f"sampling: {error}") from None
    return sampling


@dataclass(frozen=True)
class PrefillCall:
    session: str
    start: int
    tokens: torch.Tensor  # [T] long

    @classmethod
    def from_pb(cls, request: internal_pb2.TrunkPrefillRequest, vocab_size: int) -> PrefillCall:
        return cls(
            require_session(request.session),
            request.start,
            token_ids("tokens", request.tokens, vocab_size),
        )


@dataclass(frozen=True)
class DraftCall:
    session: str
    start: int
    pending: int
    gamma: int
    draft_head: str | None  # None: one trunk step, no drafting
    sampling: SamplingParams
    seed: int
    with_decision: bool

    @classmethod
    def from_pb(
        cls, request: internal_pb2.DraftRequest, vocab_size: int, drafters: Sequence[str]
    ) -> DraftCall:
        if not 1 <= request.gamma <= MAX_GAMMA:
            raise ValueError(f"gamma: must be in 1..{MAX_GAMMA}, got {request.gamma}")
        draft_head = request.draft_head or None
        if draft_head is None and request.gamma != 1:
            raise ValueError(
                f"gamma: must be 1 without a draft_head (one trunk step), got {request.gamma}"
            )
        if draft_head is not None and draft_head not in drafters:
            raise ValueError(
                f"draft_head: {draft_head!r} is not a drafter of this service; "
                f"drafters: {list(drafters)}"
            )
        if request.seed >= MAX_SEED:
            raise ValueError(f"seed: must be below 2**63, got {request.seed}")
        if request.HasField("sampling"):
            sampling = sampling_from_pb(request.sampling, vocab_size)
        elif draft_head is None:
            sampling = SamplingParams()  # unused: nothing is drafted
        else:
            raise ValueError("sampling: required when a draft_head is given")
        return cls(
            require_session(request.session),
            request.start,
            int(token_ids("pending_token", [request.pending_token], vocab_size)[0]),
            request.gamma,
            draft_head,
            sampling,
            request.seed,
            request.with_decision,
        )


def draft_to_pb(result: DraftResult) -> internal_pb2.DraftResponse:
    def distribution(logprobs: torch.Tensor | None) -> tensor_pb2.Tensor | None:
        return None if logprobs is None else tensor_to_pb(logprobs.float())

    return internal_pb2.DraftResponse(
        tokens=result.tokens.tolist(),
        logprobs=distribution(result.logprobs),
        decision_logprobs=distribution(result.decision_logprobs),
        hidden=tensor_to_pb(result.hidden),
        trunk_steps=result.trunk_steps,
        head_evaluations=result.head_evaluations,
    )


class TrunkServicer(WorkerServicer, internal_pb2_grpc.TrunkServicer):
    """`hydrajury.v1.Trunk`: requests → `TrunkWorker` calls on the model thread."""

    def __init__(self, worker: TrunkWorker) -> None:
        super().__init__(worker, "trunk-model")
        self.vocab_size = worker.model.config.vocab_size

    async def Info(self, request, context) -> internal_pb2.TrunkInfoResponse:
        return internal_pb2.TrunkInfoResponse(
            model=model_description_to_pb(self.worker.model, self.worker.max_session_tokens),
            drafter_heads=self.worker.drafters,
            limits=self.limits_to_pb(),
            epoch=self.epoch,
        )

    async def Prefill(self, request, context) -> internal_pb2.TrunkPrefillResponse:
        began = time.perf_counter_ns()
        call = PrefillCall.from_pb(request, self.vocab_size)
        hidden, forward_ns = await self.run_timed(
            self.worker.prefill, call.session, call.start, call.tokens
        )
        response = internal_pb2.TrunkPrefillResponse(hidden=tensor_to_pb(hidden))
        return self.stamp(response, began, forward_ns)

    async def Draft(self, request, context) -> internal_pb2.DraftResponse:
        began = time.perf_counter_ns()
        call = DraftCall.from_pb(request, self.vocab_size, self.worker.drafters)
        result, forward_ns = await self.run_timed(
            self.worker.draft,
            call.session,
            call.start,
            call.pending,
            call.gamma,
            call.draft_head,
            call.sampling,
            call.seed,
            call.with_decision,
        )
        return self.stamp(draft_to_pb(result), began, forward_ns)


async def serve_trunk(
    checkpoint: str | Path,
    *,
    address: str = "127.0.0.1:0",
    drafter_heads: Sequence[str] | None = None,
    max_sessions: int = 16,
    max_session_tokens: int = 4096,
    idle_timeout_s: float | None = None,
    dtype: str | None = None,
    device: str = "cpu",
) -> tuple[GrpcServer, int, TrunkServicer]:
    """Loads the trunk and the drafter heads (default: every `llm` head), and starts the
    service on `address` (port 0 picks a free one). Stop it with `server.stop(grace)`
    and then `servicer.close()`."""
    limits = worker_limits(max_sessions, max_session_tokens, idle_timeout_s)
    drafters = llm_heads_in_order(checkpoint, drafter_heads, "drafter heads")
    model = await asyncio.to_thread(
        HydraModel.load, checkpoint, dtype=dtype, device=device, heads=drafters
    )
    worker = TrunkWorker(model, drafter_heads=drafters, **limits)
    servicer = TrunkServicer(worker)
    server, port = await start_server(
        servicer, internal_pb2_grpc.add_TrunkServicer_to_server, SERVICE_NAME, address
    )
    log.info(
        "trunk service: %s, drafters %s, %d sessions of %d tokens, port %d",
        checkpoint,
        ",".join(drafters),
        max_sessions,
        worker.max_session_tokens,
        port,
    )
    return server, port, servicer
