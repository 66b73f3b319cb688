"""The decoding loop's backend over gRPC: one trunk service and any number of jury shards.

Per round: one `Draft` call to the trunk and one `Score` call to every shard, the shards
called concurrently and their partial log-products added (`poe.combine_partials`, in
shard order, so the sum is deterministic). Hidden states travel from the trunk's
response to the shards' requests as they came, without being decoded. The loop is the
same as in-process; only the transport differs.

Each call carries the time left of the client's deadline (`call_scope`). A failed call
becomes the project's exception for its status (`serving.errors.error_from_status`),
naming the service: FAILED_PRECONDITION → `PositionError` (the loop re-prefills),
UNAVAILABLE → `ServiceUnavailable`, an internal INVALID_ARGUMENT → `InternalServiceError`
(the orchestrator checked the request; a refusal is its own bug, not the client's).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import torch

from orchestrator.backend import DecodingBackend, ModelInfo
from poe import combine_partials
from protos.codec import CodecError
from protos.hydrajury.v1 import internal_pb2, internal_pb2_grpc
from serving import internal_wire as wire
from serving.errors import (
    InternalServiceError,
    ServiceUnavailable,
    error_from_status,
)
from serving.server import CHANNEL_OPTIONS
from workers.calls import (
    DraftCall,
    DraftResult,
    JuryPrefillCall,
    PrefillCall,
    ScoreCall,
    ScoreResult,
)

Result = TypeVar("Result")


class LayoutError(ValueError):
    """Services that do not form one model: the message says what is wrong."""


@dataclass
class TransportStats:
    """Bytes and server-side time of internal calls, for benchmarks."""

    bytes_sent: int = 0
    bytes_received: int = 0
    server_ns: dict[str, int] = field(default_factory=lambda: {"draft": 0, "score": 0})
    client_ns: dict[str, int] = field(default_factory=lambda: {"draft": 0, "score": 0})


@dataclass
class _Service:
    name: str  # "trunk service at HOST:PORT"
    address: str
    channel: grpc.Channel
    stub: Any
    info: Any  # its Info response
    epoch: str = ""  # the latest epoch it answered with


class GrpcBackend(DecodingBackend):
    def __init__(
        self, trunk_address: str, jury_addresses: list[str], connect_timeout_s: float = 10.0
    ) -> None:
        if not jury_addresses:
            raise LayoutError("at least one jury shard address is needed")
        super().__init__()
        self.stats = TransportStats()
        self.trunk = self._connect(
            f"trunk service at {trunk_address}",
            trunk_address,
            internal_pb2_grpc.TrunkStub,
            connect_timeout_s,
        )
        self.shards = [
            self._connect(
                f"jury shard at {address}", address, internal_pb2_grpc.JuryStub, connect_timeout_s
            )
            for address in jury_addresses
        ]
        try:
            self.info = self._check_layout()
        except LayoutError:
            self.close()
            raise
        self.trunk_address = trunk_address
        self.jury_addresses = tuple(jury_addresses)

    def _connect(self, name: str, address: str, stub_class, timeout_s: float) -> _Service:
        channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        stub = stub_class(channel)
        try:
            info = stub.Info(internal_pb2.InfoRequest(), timeout=timeout_s, wait_for_ready=True)
        except grpc.RpcError as error:
            channel.close()
            raise ServiceUnavailable(f"{name} did not answer Info: {error.details()}") from None
        return _Service(name, address, channel, stub, info, info.epoch)

    def _check_layout(self) -> ModelInfo:
        model = self.trunk.info.model
        for shard in self.shards:
            if shard.info.model.fingerprint != model.fingerprint:
                raise LayoutError(
                    f"{shard.name} serves checkpoint {shard.info.model.fingerprint[:12]}"
                    f" but the {self.trunk.name} serves {model.fingerprint[:12]}: "
                    f"all services must load the same checkpoint"
                )
            if shard.info.model.dtype != model.dtype:
                raise LayoutError(
                    f"{shard.name} computes in {shard.info.model.dtype} but the "
                    f"{self.trunk.name} in {model.dtype}: start them with the same --dtype"
                )
        owners: dict[str, str] = {}
        for shard in self.shards:
            for head in shard.info.hosted_heads:
                if head in owners:
                    raise LayoutError(
                        f"head {head!r} is hosted by both the {owners[head]} and "
                        f"the {shard.name}: shards must host disjoint heads"
                    )
                owners[head] = shard.name
        missing = [head for head in model.heads if head not in owners]
        if missing:
            raise LayoutError(
                f"no jury shard hosts heads {missing}; together the shards must "
                f"host every llm head {list(model.heads)}"
            )
        limits = [
            self.trunk.info.limits.max_session_tokens,
            *(s.info.limits.max_session_tokens for s in self.shards),
        ]
        return ModelInfo(
            fingerprint=model.fingerprint,
            architecture=model.architecture,
            head_names=tuple(model.heads),
            drafter_heads=tuple(self.trunk.info.drafter_heads),
            vocab_size=model.vocab_size,
            context_length=min(model.context_length, *limits),
            eos_token_ids=tuple(model.eos_token_ids),
        )

    @property
    def replicas(self) -> dict[str, str]:
        names = ["trunk", *(f"jury{i}" for i in range(len(self.shards)))]
        return {
            name: f"{s.address}@{s.epoch}" for name, s in zip(names, self.services, strict=True)
        }

    @property
    def services(self) -> list[_Service]:
        return [self.trunk, *self.shards]

    def close(self) -> None:
        for service in self.services:
            service.channel.close()

    def _call_all(self, services: list[_Service], method: str, requests: list) -> list:
        """The same RPC on several services at once; responses in service order."""
        timeout = self.time_left()
        if len(services) == 1:  # a plain blocking call: no future to hand over
            (service,), (request,) = services, requests
            try:
                response = getattr(service.stub, method)(request, timeout=timeout)
            except grpc.RpcError as error:
                raise _translate(service, method, error) from None
            service.epoch = response.epoch
            return [response]
        futures = [
            getattr(s.stub, method).future(r, timeout=timeout)
            for s, r in zip(services, requests, strict=True)
        ]
        responses = []
        for service, future in zip(services, futures, strict=True):
            try:
                responses.append(future.result())
            except grpc.RpcError as error:
                for other in futures:
                    other.cancel()
                raise _translate(service, method, error) from None
            service.epoch = responses[-1].epoch
        return responses

    def prefill(self, call: PrefillCall) -> None:
        (response,) = self._call_all([self.trunk], "Prefill", [wire.prefill_call_to_pb(call)])
        hidden = wire.forwarded_hidden(response.hidden)
        request = wire.jury_prefill_call_to_pb(JuryPrefillCall(call.session, call.start, hidden))
        self._call_all(self.shards, "Prefill", [request] * len(self.shards))

    def draft(self, call: DraftCall) -> DraftResult:
        request = wire.draft_call_to_pb(call)
        began = time.perf_counter_ns()
        (response,) = self._call_all([self.trunk], "Draft", [request])
        self._account("draft", began, [request], [response])
        return _decoded(
            self.trunk, lambda: wire.draft_result_from_pb(response, call, self.info.vocab_size)
        )

    def score(self, call: ScoreCall) -> ScoreResult:
        requests = [wire.score_call_to_pb(call)] * len(self.shards)
        began = time.perf_counter_ns()
        responses = self._call_all(self.shards, "Score", requests)
        self._account("score", began, requests, responses)
        parts = [
            _decoded(
                shard, lambda r=response: wire.score_result_from_pb(r, call, self.info.vocab_size)
            )
            for shard, response in zip(self.shards, responses, strict=True)
        ]
        decision = None
        if call.with_decision:
            decision = combine_partials([part.decision_log_product for part in parts])
        voters = [voter for part in parts for voter in part.voters]
        # Votes in checkpoint order, whatever shard each juror sits on.
        order = sorted(range(len(voters)), key=lambda i: self.info.head_names.index(voters[i]))
        amateur = [part.amateur_logprobs for part in parts if part.amateur_logprobs is not None]
        return ScoreResult(
            combine_partials([part.log_product for part in parts]),
            decision,
            torch.cat([part.votes for part in parts], dim=1)[:, order],
            tuple(voters[i] for i in order),
            head_evaluations=sum(part.head_evaluations for part in parts),
            amateur_logprobs=amateur[0] if amateur else None,
        )

    def release(self, session: str) -> None:
        """Best effort on every service, without the request's deadline: a cancelled or
        failed request must still free its caches."""
        for service in self.services:
            # A service that is down holds nothing; idle eviction covers the rest.
            with suppress(grpc.RpcError):
                service.stub.Release(internal_pb2.ReleaseRequest(session=session), timeout=5)

    def close_session(self, session: str) -> bool:
        request = internal_pb2.ReleaseRequest(session=session)
        responses = self._call_all(self.services, "Release", [request] * len(self.services))
        return any(response.released for response in responses)

    def _account(self, phase: str, began_ns: int, requests: list, responses: list) -> None:
        stats = self.stats
        stats.client_ns[phase] += time.perf_counter_ns() - began_ns
        stats.server_ns[phase] += max(r.timings.total_ns for r in responses)
        stats.bytes_sent += sum(r.ByteSize() for r in requests)
        stats.bytes_received += sum(r.ByteSize() for r in responses)


def _decoded(service: _Service, decode: Callable[[], Result]) -> Result:
    """A response decoded; a malformed one is the service's fault, never the client's."""
    try:
        return decode()
    except CodecError as error:
        raise InternalServiceError(f"{service.name} sent a malformed response: {error}") from None


def _translate(service: _Service, method: str, error: grpc.RpcError) -> Exception:
    return error_from_status(error.code(), f"{service.name} ({method})", error.details() or "")
