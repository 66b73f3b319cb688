"""The decoding loop's backend over gRPC: one trunk service and any number of jury shards.

Per round: one `Draft` call to the trunk and one `Score` call to every shard, the shards
called concurrently and their partial log-products added (in shard order, so the sum is
deterministic). Hidden states travel from the trunk's response to the shards' requests
as they came, without being decoded. The loop is the same as in-process; only the
transport differs.

Each call carries the time left of the client's deadline (`call_scope`). Status codes
of the services become the project's exceptions: UNAVAILABLE → `ServiceUnavailable`
naming the service, FAILED_PRECONDITION / NOT_FOUND → `PositionError` (the loop
re-prefills), RESOURCE_EXHAUSTED → `CapacityError`, INVALID_ARGUMENT → `ValueError`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field

import grpc
import torch

from hydra_model.sessions import CapacityError, PositionError
from jury_service.worker import ScoreResult
from orchestrator.backend import DecodingBackend, ModelInfo
from poe import SamplingParams
from protos.codec import tensor_from_pb
from protos.hydrajury.v1 import internal_pb2, internal_pb2_grpc, tensor_pb2
from protos.serving import CHANNEL_OPTIONS, DeadlineExceeded, ServiceUnavailable
from trunk_service.worker import DraftResult


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
    stub: object
    info: object


class GrpcBackend(DecodingBackend):
    def __init__(
        self, trunk_address: str, jury_addresses: list[str], connect_timeout_s: float = 10.0
    ) -> None:
        if not jury_addresses:
            raise LayoutError("at least one jury shard address is needed")
        self._scope = threading.local()
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

    def _connect(self, name: str, address: str, stub_class, timeout_s: float) -> _Service:
        channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        stub = stub_class(channel)
        try:
            info = stub.Info(internal_pb2.InfoRequest(), timeout=timeout_s, wait_for_ready=True)
        except grpc.RpcError as error:
            channel.close()
            raise ServiceUnavailable(f"{name} did not answer Info: {error.details()}") from None
        return _Service(name, address, channel, stub, info)

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
            head_names=tuple(model.heads),
            drafter_heads=tuple(self.trunk.info.drafter_heads),
            vocab_size=model.vocab_size,
            hidden_size=model.hidden_size,
            context_length=min(model.context_length, *limits),
            eos_token_ids=tuple(model.eos_token_ids),
        )

    @property
    def fingerprint(self) -> str:
        return self.trunk.info.model.fingerprint

    @property
    def services(self) -> list[_Service]:
        return [self.trunk, *self.shards]

    def close(self) -> None:
        for service in self.services:
            service.channel.close()

    @contextmanager
    def call_scope(self, deadline: float | None) -> Iterator[None]:
        """Internal calls made by this thread inside the scope stop at `deadline`
        (a `time.monotonic()` value; None: no deadline)."""
        self._scope.deadline = deadline
        try:
            yield
        finally:
            self._scope.deadline = None

    def _timeout(self) -> float | None:
        deadline = getattr(self._scope, "deadline", None)
        if deadline is None:
            return None
        left = deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded("the request's deadline passed during generation")
        return left

    def _call(self, service: _Service, method: str, request):
        try:
            return getattr(service.stub, method)(request, timeout=self._timeout())
        except grpc.RpcError as error:
            raise _translate(service, method, error) from None

    def _call_all(self, services: list[_Service], method: str, requests: list) -> list:
        """The same RPC on several services at once; results in service order."""
        timeout = self._timeout()
        futures = [
            getattr(s.stub, method).future(r, timeout=timeout)
            for s, r in zip(services, requests, strict=True)
        ]
        results = []
        for service, future in zip(services, futures, strict=True):
            try:
                results.append(future.result())
            except grpc.RpcError as error:
                for other in futures:
                    other.cancel()
                raise _translate(service, method, error) from None
        return results

    def prefill(self, session: str, start: int, tokens: torch.Tensor) -> None:
        response = self._call(
            self.trunk,
            "Prefill",
            internal_pb2.TrunkPrefillRequest(session=session, start=start, tokens=tokens.tolist()),
        )
        self._call_all(
            self.shards,
            "Prefill",
            [internal_pb2.JuryPrefillRequest(session=session, start=start, hidden=response.hidden)]
            * len(self.shards),
        )

    def draft(
        self,
        session,
        start,
        pending,
        gamma,
        draft_head,
        sampling: SamplingParams,
        seed,
        with_decision,
    ) -> DraftResult:
        request = internal_pb2.DraftRequest(
            session=session,
            start=start,
            pending_token=pending,
            gamma=gamma,
            draft_head=draft_head or "",
            seed=seed,
            with_decision=with_decision,
            sampling=tensor_pb2.SamplingParams(
                temperature=sampling.temperature,
                top_k=sampling.top_k,
                top_p=sampling.top_p,
                min_p=sampling.min_p,
            ),
        )
        began = time.perf_counter_ns()
        response = self._call(self.trunk, "Draft", request)
        self._account("draft", began, [request], [response])
        vocab = self.info.vocab_size
        rows = len(response.tokens)
        logprobs = decision = None
        if draft_head is not None:
            logprobs = tensor_from_pb(
                response.logprobs, name="logprobs", dtypes=["float32"], shape=[rows, vocab]
            )
            if with_decision:
                decision = tensor_from_pb(
                    response.decision_logprobs,
                    name="decision_logprobs",
                    dtypes=["float32"],
                    shape=[rows, vocab],
                )
        # The hidden states stay a message: they go on to the shards as they are.
        return DraftResult(
            torch.tensor(list(response.tokens), dtype=torch.long),
            logprobs,
            decision,
            response.hidden,
            trunk_steps=response.trunk_steps,
            head_evaluations=response.head_evaluations,
        )

    def score(
        self, session, start, hidden: tensor_pb2.Tensor, jury, temperature, beta, with_decision
    ) -> ScoreResult:
        requests = [
            internal_pb2.ScoreRequest(
                session=session,
                start=start,
                hidden=hidden,
                jury=jury,
                temperature=temperature,
                beta=beta,
                with_decision=with_decision,
            )
        ] * len(self.shards)
        began = time.perf_counter_ns()
        responses = self._call_all(self.shards, "Score", requests)
        self._account("score", began, requests, responses)
        rows, vocab = hidden.shape[0], self.info.vocab_size
        log_product = decision = None
        votes, voters, evaluations = [], [], 0
        for response in responses:
            partial = tensor_from_pb(
                response.log_product, name="log_product", dtypes=["float32"], shape=[rows, vocab]
            )
            log_product = partial if log_product is None else log_product + partial
            if with_decision:
                part = tensor_from_pb(
                    response.decision_log_product,
                    name="decision_log_product",
                    dtypes=["float32"],
                    shape=[rows, vocab],
                )
                decision = part if decision is None else decision + part
            votes.append(
                tensor_from_pb(
                    response.votes,
                    name="votes",
                    dtypes=["int64"],
                    shape=[rows, len(response.voters)],
                )
            )
            voters += list(response.voters)
            evaluations += response.head_evaluations
        # Votes in checkpoint order, whatever shard each juror sits on.
        order = sorted(range(len(voters)), key=lambda i: self.info.head_names.index(voters[i]))
        all_votes = torch.cat(votes, dim=1)[:, order]
        return ScoreResult(
            log_product,
            decision,
            all_votes,
            [voters[i] for i in order],
            head_evaluations=evaluations,
        )

    def release(self, session: str) -> None:
        """Best effort on every service, without the request's deadline: a cancelled or
        failed request must still free its caches."""
        for service in self.services:
            # A service that is down holds nothing; idle eviction covers the rest.
            with suppress(grpc.RpcError):
                service.stub.Release(internal_pb2.ReleaseRequest(session=session), timeout=5)

    def close_session(self, session: str) -> bool:
        released = False
        for service in self.services:
            response = self._call(service, "Release", internal_pb2.ReleaseRequest(session=session))
            released |= response.released
        return released

    def _account(self, phase: str, began_ns: int, requests: list, responses: list) -> None:
        stats = self.stats
        stats.client_ns[phase] += time.perf_counter_ns() - began_ns
        stats.server_ns[phase] += max(r.timings.total_ns for r in responses)
        stats.bytes_sent += sum(r.ByteSize() for r in requests)
        stats.bytes_received += sum(r.ByteSize() for r in responses)


def _translate(service: _Service, method: str, error: grpc.RpcError) -> Exception:
    code, detail = error.code(), error.details() or ""
    where = f"{service.name} ({method})"
    if code == grpc.StatusCode.UNAVAILABLE:
        return ServiceUnavailable(f"{where} is unavailable: {detail}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceeded(f"{where} did not answer within the request's deadline")
    if code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND):
        return PositionError(f"{where}: {detail}")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return CapacityError(f"{where}: {detail}")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return ValueError(f"{where}: {detail}")
    if code == grpc.StatusCode.CANCELLED:
        return RuntimeError(f"{where} was cancelled")
    return RuntimeError(f"{where} failed with {code.name}: {detail}")
