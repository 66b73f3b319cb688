"""The decoding loop's backend over gRPC: one trunk and any number of jury shards, each
served by one or more replicas (`orchestrator.discovery`).

Per round: one `Draft` call to the trunk and one `Score` call to every shard, the shards
called concurrently and their partial log-products added (`poe.combine_partials`, in
shard order, so the sum is deterministic). Hidden states travel from the trunk's
response to the shards' requests as they came, without being decoded. The loop is the
same as in-process; only the transport differs.

Placement: a session's caches live on one replica of each component. A new session goes
to the least loaded ready replica (sessions placed by this orchestrator); a session
whose record names replicas that are still ready goes back to them (`place`). When a
placed replica leaves (no longer ready, or UNAVAILABLE while another is ready), the
session moves: the call raises `PositionError`, and the loop re-prefills on the new
replica from the committed tokens, with the same output.

Each call carries the time left of the client's deadline (`call_scope`). A failed call
becomes the project's exception for its status (`serving.errors.error_from_status`),
naming the service: FAILED_PRECONDITION → `PositionError` (the loop re-prefills),
UNAVAILABLE → `ServiceUnavailable`, an internal INVALID_ARGUMENT → `InternalServiceError`
(the orchestrator checked the request; a refusal is its own bug, not the client's).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import torch

from hydra_jury.orchestrator.backend import DecodingBackend, ModelInfo
from hydra_jury.orchestrator.discovery import Discovery, StaticDiscovery
from hydra_jury.poe import combine_partials
from hydra_jury.protos.codec import CodecError
from hydra_jury.protos.hydrajury.v1 import internal_pb2, internal_pb2_grpc
from hydra_jury.serving import internal_wire as wire
from hydra_jury.serving.errors import (
    InternalServiceError,
    ServiceUnavailable,
    error_from_status,
)
from hydra_jury.serving.server import CHANNEL_OPTIONS
from hydra_jury.workers.calls import (
    DraftCall,
    DraftResult,
    HiddenStates,
    JuryPrefillCall,
    PrefillCall,
    ScoreCall,
    ScoreResult,
    UncertaintyCall,
    UncertaintyResult,
)
from hydra_jury.workers.errors import PositionError

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
class _Replica:
    name: str  # "trunk service at HOST:PORT"
    address: str
    channel: grpc.Channel
    stub: Any
    info: Any  # its Info response
    epoch: str = ""  # the latest epoch it answered with


@dataclass
class _Component:
    name: str  # "trunk", "jury0", ...
    label: str  # "trunk service", "jury shard 0"
    stub_class: Any
    replicas: dict[str, _Replica] = field(default_factory=dict)  # connected, by address
    heads: tuple[str, ...] = ()  # a shard's heads, as its first replica hosts them


# A replica that failed a call is avoided for new placements this long, while the
# discovery catches up.
SUSPECT_S = 10.0


class GrpcBackend(DecodingBackend):
    def __init__(self, discovery: Discovery, connect_timeout_s: float = 10.0) -> None:
        names = list(discovery.targets)
        if len(names) < 2:
            raise LayoutError("at least one jury shard address is needed")
        super().__init__()
        self.discovery = discovery
        self.stats = TransportStats()
        self.connect_timeout_s = connect_timeout_s
        self.trunk = _Component("trunk", "trunk service", internal_pb2_grpc.TrunkStub)
        self.shards = [
            _Component(name, f"jury shard {name[4:]}", internal_pb2_grpc.JuryStub)
            for name in names[1:]
        ]
        self._lock = threading.Lock()
        self._placements: dict[str, dict[str, str]] = {}  # cache id -> component -> address
        self._suspects: dict[str, float] = {}  # address -> until when it is avoided
        try:
            try:
                discovery.wait_ready(connect_timeout_s)
            except TimeoutError as error:
                raise ServiceUnavailable(str(error)) from None
            first = {
                c.name: self._connect(c, discovery.ready(c.name)[0], checked=False)
                for c in self.components
            }
            self.info = self._check_layout(first)
        except BaseException:
            self.close()
            raise
        self.trunk_address = discovery.targets["trunk"]
        self.jury_addresses = tuple(discovery.targets[s.name] for s in self.shards)

    @classmethod
    def static(cls, trunk: str, jury: list[str], connect_timeout_s: float = 10.0) -> GrpcBackend:
        """Over fixed addresses: one replica per component."""
        return cls(StaticDiscovery(trunk, jury), connect_timeout_s)

    @property
    def components(self) -> list[_Component]:
        return [self.trunk, *self.shards]

    def _connect(self, component: _Component, address: str, checked: bool = True) -> _Replica:
        """A replica, connected and (`checked`) checked against the layout, once per
        address; the first replicas define the layout (`_check_layout`)."""
        with self._lock:
            known = component.replicas.get(address)
        if known is not None:
            return known
        name = f"{component.label} at {address}"
        channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        stub = component.stub_class(channel)
        try:
            info = stub.Info(
                internal_pb2.InfoRequest(), timeout=self.connect_timeout_s, wait_for_ready=True
            )
        except grpc.RpcError as error:
            channel.close()
            raise ServiceUnavailable(f"{name} did not answer Info: {error.details()}") from None
        replica = _Replica(name, address, channel, stub, info, info.epoch)
        if checked:
            try:
                self._check_replica(component, replica)
            except LayoutError:
                channel.close()
                raise
        with self._lock:
            known = component.replicas.setdefault(address, replica)
        if known is not replica:
            channel.close()
        return known

    def _check_replica(self, component: _Component, replica: _Replica) -> None:
        """A replica that joined later: the same checkpoint, dtype and (a shard) heads."""
        model = replica.info.model
        if model.fingerprint != self.info.fingerprint:
            raise LayoutError(
                f"{replica.name} serves checkpoint {model.fingerprint[:12]}, not "
                f"{self.info.fingerprint[:12]}"
            )
        if model.dtype != self.trunk_dtype:
            raise LayoutError(f"{replica.name} computes in {model.dtype}, not {self.trunk_dtype}")
        if component is not self.trunk and tuple(replica.info.hosted_heads) != component.heads:
            raise LayoutError(
                f"{replica.name} hosts heads {list(replica.info.hosted_heads)}, but its shard "
                f"serves {list(component.heads)}"
            )

    def _check_layout(self, first: dict[str, _Replica]) -> ModelInfo:
        trunk = first["trunk"]
        model = trunk.info.model
        self.trunk_dtype = model.dtype
        shards = [first[shard.name] for shard in self.shards]
        for shard in shards:
            if shard.info.model.fingerprint != model.fingerprint:
                raise LayoutError(
                    f"{shard.name} serves checkpoint {shard.info.model.fingerprint[:12]}"
                    f" but the {trunk.name} serves {model.fingerprint[:12]}: "
                    f"all services must load the same checkpoint"
                )
            if shard.info.model.dtype != model.dtype:
                raise LayoutError(
                    f"{shard.name} computes in {shard.info.model.dtype} but the "
                    f"{trunk.name} in {model.dtype}: start them with the same --dtype"
                )
        owners: dict[str, str] = {}
        for component, shard in zip(self.shards, shards, strict=True):
            component.heads = tuple(shard.info.hosted_heads)
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
        limits = [trunk.info.limits.max_session_tokens]
        limits += [s.info.limits.max_session_tokens for s in shards]
        return ModelInfo(
            fingerprint=model.fingerprint,
            architecture=model.architecture,
            head_names=tuple(model.heads),
            drafter_heads=tuple(trunk.info.drafter_heads),
            vocab_size=model.vocab_size,
            context_length=min(model.context_length, *limits),
            eos_token_ids=tuple(model.eos_token_ids),
            draft_model=trunk.info.draft_model,
            uncertainty_head=trunk.info.uncertainty_head,
        )

    # --- placement -------------------------------------------------------------------

    def _address(self, component: _Component, cache: str, wanted: str = "") -> str:
        """The replica of `component` that holds (or will hold) the session's caches."""
        ready = self.discovery.ready(component.name)
        if not ready:
            raise ServiceUnavailable(
                f"no ready replica of the {component.label} "
                f"({self.discovery.targets[component.name]})"
            )
        with self._lock:
            placement = self._placements.setdefault(cache, {})
            address = placement.get(component.name) or wanted
            if address not in ready:
                now = time.monotonic()
                healthy = [a for a in ready if self._suspects.get(a, 0.0) < now] or ready
                load = {a: 0 for a in healthy}
                for placed in self._placements.values():
                    if placed.get(component.name) in load:
                        load[placed[component.name]] += 1
                address = min(healthy, key=lambda a: (load[a], a))
            placement[component.name] = address
        return address

    def _replica(self, component: _Component, cache: str) -> _Replica:
        return self._connect(component, self._address(component, cache))

    def place(self, cache: str, stored: dict[str, str]) -> dict[str, str]:
        for component in self.components:
            wanted = stored.get(component.name, "").rpartition("@")[0]
            self._connect(component, self._address(component, cache, wanted))
        return self.placement(cache)

    def placement(self, cache: str) -> dict[str, str]:
        with self._lock:
            placed = dict(self._placements.get(cache, {}))
            return {
                c.name: f"{placed[c.name]}@{c.replicas[placed[c.name]].epoch}"
                for c in self.components
                if placed.get(c.name) in c.replicas
            }

    def _forget(self, cache: str) -> dict[str, str]:
        with self._lock:
            return self._placements.pop(cache, {})

    # --- calls -----------------------------------------------------------------------

    def close(self) -> None:
        self.discovery.close()
        for component in self.components:
            for replica in component.replicas.values():
                replica.channel.close()

    def _call_all(self, targets: list[tuple[_Component, _Replica]], method: str, requests: list):
        """The same RPC on several replicas at once; responses in order."""
        timeout = self.time_left()
        if len(targets) == 1:  # a plain blocking call: no future to hand over
            ((component, replica),), (request,) = targets, requests
            try:
                response = getattr(replica.stub, method)(request, timeout=timeout)
            except grpc.RpcError as error:
                raise self._failed(component, replica, method, error, request) from None
            replica.epoch = response.epoch
            return [response]
        futures = [
            getattr(replica.stub, method).future(request, timeout=timeout)
            for (_component, replica), request in zip(targets, requests, strict=True)
        ]
        responses = []
        for (component, replica), future, request in zip(targets, futures, requests, strict=True):
            try:
                responses.append(future.result())
            except grpc.RpcError as error:
                for other in futures:
                    other.cancel()
                raise self._failed(component, replica, method, error, request) from None
            replica.epoch = responses[-1].epoch
        return responses

    def _failed(
        self, component: _Component, replica: _Replica, method: str, error: grpc.RpcError, request
    ) -> Exception:
        """The exception for a failed call. A replica that is down while the component
        has another ready one: the session moves there (a position not held, so the
        loop re-prefills) instead of failing the request."""
        translated = _translate(replica, method, error)
        others = [a for a in self.discovery.ready(component.name) if a != replica.address]
        if isinstance(translated, ServiceUnavailable) and others:
            with self._lock:
                self._suspects[replica.address] = time.monotonic() + SUSPECT_S
                # A batch is placed by its first call's session.
                session = request.calls[0].session if hasattr(request, "calls") else request.session
                placement = self._placements.get(session, {})
                if placement.get(component.name) == replica.address:
                    del placement[component.name]
            return PositionError(f"{translated}; the session moves to another replica")
        return translated

    def _targets(self, components: list[_Component], cache: str):
        return [(c, self._replica(c, cache)) for c in components]

    def trunk_forward(self, call: PrefillCall) -> HiddenStates:
        trunk = self._targets([self.trunk], call.session)
        (response,) = self._call_all(trunk, "Prefill", [wire.prefill_call_to_pb(call)])
        return wire.forwarded_hidden(response.hidden)

    def trunk_forward_batch(self, calls: list[PrefillCall]) -> list[HiddenStates]:
        # Every call of a batch goes where the first call's session is placed.
        trunk = self._targets([self.trunk], calls[0].session)
        request = internal_pb2.TrunkPrefillBatchRequest(
            calls=[wire.prefill_call_to_pb(call) for call in calls]
        )
        (response,) = self._call_all(trunk, "PrefillBatch", [request])
        if len(response.results) != len(calls):
            raise InternalServiceError(
                f"{trunk[0][1].name} answered {len(response.results)} of {len(calls)} calls"
            )
        return [wire.forwarded_hidden(result.hidden) for result in response.results]

    def prefill(self, call: PrefillCall) -> None:
        hidden = self.trunk_forward(call)
        request = wire.jury_prefill_call_to_pb(JuryPrefillCall(call.session, call.start, hidden))
        shards = self._targets(self.shards, call.session)
        self._call_all(shards, "Prefill", [request] * len(self.shards))

    def draft(self, call: DraftCall) -> DraftResult:
        request = wire.draft_call_to_pb(call)
        targets = self._targets([self.trunk], call.session)
        began = time.perf_counter_ns()
        (response,) = self._call_all(targets, "Draft", [request])
        self._account("draft", began, [request], [response])
        return _decoded(
            targets[0][1], lambda: wire.draft_result_from_pb(response, call, self.info.vocab_size)
        )

    def uncertainty(self, session: str, call: UncertaintyCall) -> UncertaintyResult:
        targets = self._targets([self.trunk], session)
        (response,) = self._call_all(targets, "Uncertainty", [wire.uncertainty_call_to_pb(call)])
        return wire.uncertainty_result_from_pb(response)

    def score(self, call: ScoreCall) -> ScoreResult:
        requests = [wire.score_call_to_pb(call)] * len(self.shards)
        targets = self._targets(self.shards, call.session)
        began = time.perf_counter_ns()
        responses = self._call_all(targets, "Score", requests)
        self._account("score", began, requests, responses)
        return self._combined(call, targets, responses)

    def score_batch(self, calls: list[ScoreCall]) -> list[ScoreResult]:
        # Every call of a batch goes where the first call's session is placed.
        request = internal_pb2.ScoreBatchRequest(calls=[wire.score_call_to_pb(c) for c in calls])
        requests = [request] * len(self.shards)
        targets = self._targets(self.shards, calls[0].session)
        began = time.perf_counter_ns()
        responses = self._call_all(targets, "ScoreBatch", requests)
        self._account("score", began, requests, responses)
        for (_shard, replica), response in zip(targets, responses, strict=True):
            if len(response.results) != len(calls):
                raise InternalServiceError(
                    f"{replica.name} answered {len(response.results)} of {len(calls)} calls"
                )
        return [
            self._combined(call, targets, [response.results[i] for response in responses])
            for i, call in enumerate(calls)
        ]

    def _combined(self, call: ScoreCall, targets: list, responses: list) -> ScoreResult:
        """The whole jury's result of `call` from each shard's response."""
        parts = [
            _decoded(
                replica, lambda r=response: wire.score_result_from_pb(r, call, self.info.vocab_size)
            )
            for (_shard, replica), response in zip(targets, responses, strict=True)
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

    def _holders(self, cache: str) -> list[_Replica]:
        """The replicas that may hold the session's caches: where it is placed, or —
        placed by another orchestrator, or before a restart — every ready replica."""
        placed = self._forget(cache)
        holders = []
        for component in self.components:
            addresses = [placed[component.name]] if component.name in placed else None
            for address in addresses or self.discovery.ready(component.name):
                with suppress(ServiceUnavailable, LayoutError):
                    holders.append(self._connect(component, address))
        return holders

    def release(self, session: str) -> None:
        """Best effort on every holder, without the request's deadline: a cancelled or
        failed request must still free its caches."""
        request = internal_pb2.ReleaseRequest(session=session)
        for replica in self._holders(session):
            # A service that is down holds nothing; idle eviction covers the rest.
            with suppress(grpc.RpcError):
                replica.stub.Release(request, timeout=5)

    def finish(self, session: str) -> None:
        """Tells the replicas that hold the session's caches, all at once, that its
        generation ended. A hint: a replica that misses it reclaims the slot after its
        --reclaim-after-s instead."""
        request = internal_pb2.ReleaseRequest(session=session, keep_caches=True)
        with self._lock:
            placed = dict(self._placements.get(session, {}))
            replicas = [
                c.replicas[placed[c.name]]
                for c in self.components
                if placed.get(c.name) in c.replicas
            ]
        pending = [replica.stub.Release.future(request, timeout=5) for replica in replicas]
        for call in pending:
            with suppress(grpc.RpcError):
                call.result()

    def _account(self, phase: str, began_ns: int, requests: list, responses: list) -> None:
        stats = self.stats
        stats.client_ns[phase] += time.perf_counter_ns() - began_ns
        stats.server_ns[phase] += max(r.timings.total_ns for r in responses)
        stats.bytes_sent += sum(r.ByteSize() for r in requests)
        stats.bytes_received += sum(r.ByteSize() for r in responses)


def _decoded(service: _Replica, decode: Callable[[], Result]) -> Result:
    """A response decoded; a malformed one is the service's fault, never the client's."""
    try:
        return decode()
    except CodecError as error:
        raise InternalServiceError(f"{service.name} sent a malformed response: {error}") from None


def _translate(service: _Replica, method: str, error: grpc.RpcError) -> Exception:
    return error_from_status(error.code(), f"{service.name} ({method})", error.details() or "")
