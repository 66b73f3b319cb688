"""The decoding loop's backend over gRPC: one trunk and any number of jury shards, each
served by one or more replicas (`orchestrator.discovery`). The transport only: what the
replicas must agree on is `orchestrator.layout`, which replica holds a session's caches
`orchestrator.placement`, and the jury's result from its shards'
`orchestrator.shard_scores`.

Per round: one `Draft` call to the trunk and one `Score` call to every shard, the shards
called concurrently and their partial log-products added in shard order. Hidden states
travel from the trunk's response to the shards' requests as they came, without being
decoded. The loop is the same as in-process; only the transport differs.

With `pipeline_rounds` the loop may send the next round's draft ahead (`draft_ahead`): it
runs on a thread of this backend's pool, with the caller's deadline and trace context,
while the caller's thread waits for the shards' scores, so one round's two hops overlap
with the next round's.

A session's caches live on one replica of each component (`place`). When a placed
replica leaves (no longer ready, or UNAVAILABLE while another is ready), the session
moves: the call raises `PositionError`, and the loop re-prefills on the new replica from
the committed tokens, with the same output.

With `tls` (`serving.tls.ClientTls`) every channel is secure — none falls back to
plaintext — and verifies the replica's certificate against the CA, for the address's
host or the configured server name (Kubernetes discovery connects to pod IPs).

Each call carries the time left of the client's deadline (`call_scope`). A failed call
becomes the project's exception for its status (`serving.errors.error_from_status`),
naming the service: FAILED_PRECONDITION → `PositionError` (the loop re-prefills),
UNAVAILABLE → `ServiceUnavailable`, an internal INVALID_ARGUMENT → `InternalServiceError`
(the orchestrator checked the request; a refusal is its own bug, not the client's).
"""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc

from hydra_jury.orchestrator.backend import DecodingBackend, ModelShare
from hydra_jury.orchestrator.discovery import Discovery, StaticDiscovery
from hydra_jury.orchestrator.layout import Layout, LayoutError, check_layout
from hydra_jury.orchestrator.placement import Placements
from hydra_jury.orchestrator.shard_scores import combine_shard_scores
from hydra_jury.orchestrator.transport_stats import TransportStats
from hydra_jury.protos.codec import CodecError
from hydra_jury.protos.hydrajury.v1 import internal_pb2, internal_pb2_grpc
from hydra_jury.serving import internal_wire as wire
from hydra_jury.serving import tracing
from hydra_jury.serving.errors import (
    InternalServiceError,
    ServiceUnavailable,
    error_from_status,
)
from hydra_jury.serving.server import CHANNEL_OPTIONS
from hydra_jury.serving.tls import ClientTls, open_channel, unreachable_hint
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

# Drafts sent ahead in flight at once; more wait for a thread (still correct, later).
MAX_DRAFTS_AHEAD = 64


@dataclass
class _Replica:
    name: str  # "trunk service at HOST:PORT"
    address: str
    channel: grpc.Channel
    stub: Any
    info: Any  # its Info response
    component: str  # "trunk", "jury0", ...
    service: str  # the gRPC service's full name, "hydrajury.v1.Trunk"
    epoch: str = ""  # the latest epoch it answered with

    def call(self, method: str) -> tracing.ClientCall:
        """The client side of a call of `method` here (its trace span)."""
        return tracing.client_call(f"/{self.service}/{method}", self.component, self.address)


@dataclass
class _Component:
    name: str  # "trunk", "jury0", ...
    label: str  # "trunk service", "jury shard 0"
    stub_class: Any
    service: str  # the gRPC service's full name, "hydrajury.v1.Trunk"
    replicas: dict[str, _Replica] = field(default_factory=dict)  # connected, by address


def _service(name: str) -> str:
    return internal_pb2.DESCRIPTOR.services_by_name[name].full_name


class GrpcBackend(DecodingBackend):
    def __init__(
        self,
        discovery: Discovery,
        connect_timeout_s: float = 10.0,
        tls: ClientTls | None = None,
        hop_delay_s: float = 0.0,
        pipeline_rounds: bool = False,
    ) -> None:
        """`hop_delay_s` (benchmarks): every call to the services waits this long, half
        before it is sent and half after its answer (the calls of one `_call_all`
        together, as they travel together), as if the services ran on other machines.
        `pipeline_rounds`: `draft_ahead` sends drafts ahead (else it declines)."""
        names = list(discovery.targets)
        if len(names) < 2:
            raise LayoutError("at least one jury shard address is needed")
        super().__init__()
        self.discovery = discovery
        self.stats = TransportStats()
        self.connect_timeout_s = connect_timeout_s
        self.tls = tls
        self.hop_delay_s = hop_delay_s
        # One thread per session with a draft in flight; idle threads are kept for reuse.
        self._ahead = (
            ThreadPoolExecutor(MAX_DRAFTS_AHEAD, "draft-ahead") if pipeline_rounds else None
        )
        self.trunk = _Component(
            "trunk", "trunk service", internal_pb2_grpc.TrunkStub, _service("Trunk")
        )
        self.shards = [
            _Component(name, f"jury shard {name[4:]}", internal_pb2_grpc.JuryStub, _service("Jury"))
            for name in names[1:]
        ]
        self._lock = threading.Lock()  # guards each component's replicas
        self._placements = Placements()
        try:
            try:
                discovery.wait_ready(connect_timeout_s)
            except TimeoutError as error:
                raise ServiceUnavailable(str(error)) from None
            first = {
                c.name: self._connect(c, discovery.ready(c.name)[0], checked=False)
                for c in self.components
            }
            # The first replicas define the layout; every later one is checked against it.
            self._layout: Layout = check_layout(
                first["trunk"], {shard.name: first[shard.name] for shard in self.shards}
            )
            self.info = self._layout.model
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
        address."""
        with self._lock:
            known = component.replicas.get(address)
        if known is not None:
            return known
        name = f"{component.label} at {address}"
        channel = open_channel(address, self.tls, CHANNEL_OPTIONS)
        stub = component.stub_class(channel)
        try:
            info = stub.Info(
                internal_pb2.InfoRequest(), timeout=self.connect_timeout_s, wait_for_ready=True
            )
        except grpc.RpcError as error:
            channel.close()
            hint = unreachable_hint(self.tls, "--internal-tls-ca")
            raise ServiceUnavailable(
                f"{name} did not answer Info: {error.details()}{hint}"
            ) from None
        replica = _Replica(
            name, address, channel, stub, info, component.name, component.service, info.epoch
        )
        if checked:
            try:
                self._layout.check_replica(component.name, replica)
            except LayoutError:
                channel.close()
                raise
        with self._lock:
            known = component.replicas.setdefault(address, replica)
        if known is not replica:
            channel.close()
        return known

    # --- placement -------------------------------------------------------------------

    def _address(self, component: _Component, cache: str, wanted: str = "") -> str:
        """The replica of `component` that holds (or will hold) the session's caches."""
        ready = self.discovery.ready(component.name)
        if not ready:
            raise ServiceUnavailable(
                f"no ready replica of the {component.label} "
                f"({self.discovery.targets[component.name]})"
            )
        return self._placements.address(component.name, cache, ready, wanted)

    def _replica(self, component: _Component, cache: str) -> _Replica:
        return self._connect(component, self._address(component, cache))

    def place(self, cache: str, stored: dict[str, str]) -> dict[str, str]:
        for component in self.components:
            wanted = stored.get(component.name, "").rpartition("@")[0]
            self._connect(component, self._address(component, cache, wanted))
        return self.placement(cache)

    def _placed_replicas(self, cache: str) -> dict[str, _Replica]:
        """The connected replicas the session's caches are placed on, by component."""
        placed = self._placements.placed(cache)
        with self._lock:
            return {
                c.name: c.replicas[placed[c.name]]
                for c in self.components
                if placed.get(c.name) in c.replicas
            }

    def placement(self, cache: str) -> dict[str, str]:
        return {
            name: f"{replica.address}@{replica.epoch}"
            for name, replica in self._placed_replicas(cache).items()
        }

    # --- calls -----------------------------------------------------------------------

    def close(self) -> None:
        if self._ahead is not None:
            self._ahead.shutdown(wait=False, cancel_futures=True)
        self.discovery.close()
        for component in self.components:
            for replica in component.replicas.values():
                replica.channel.close()

    def _call_all(self, targets: list[tuple[_Component, _Replica]], method: str, requests: list):
        """The same RPC on several replicas at once; responses in order (each way delayed
        by half the injected hop delay)."""
        if self.hop_delay_s:
            time.sleep(self.hop_delay_s / 2)
        responses = self._send_all(targets, method, requests)
        if self.hop_delay_s:
            time.sleep(self.hop_delay_s / 2)
        self._share_of(responses)
        return responses

    def _share_of(self, responses: list) -> None:
        """The calls' share of the services' batches, for the round that made them
        (`DecodingBackend.sharing`): the services' time on the calls (`total_ns`, the
        slowest replica's: they run side by side) is replaced by their share of it
        (`share_ns`); the hops stay what they took. Responses without timings (a
        service from before `share_ns`) leave the round's cost its time."""
        timings = [getattr(response, "timings", None) for response in responses]
        if not timings or any(t is None or t.share_ns <= 0 for t in timings):
            return
        total = max(t.total_ns for t in timings) / 1e9
        self._shared(total, max(t.share_ns for t in timings) / 1e9)

    def _send_all(self, targets: list[tuple[_Component, _Replica]], method: str, requests: list):
        timeout = self.time_left()
        if len(targets) == 1:  # a plain blocking call: no future to hand over
            ((component, replica),), (request,) = targets, requests
            traced = replica.call(method)
            try:
                response = getattr(replica.stub, method)(
                    request, timeout=timeout, metadata=traced.metadata
                )
            except grpc.RpcError as error:
                traced.finish(error.code())
                raise self._failed(component, replica, method, error, request) from None
            traced.finish(grpc.StatusCode.OK)
            replica.epoch = response.epoch
            return [response]
        futures = []
        for (_component, replica), request in zip(targets, requests, strict=True):
            traced = replica.call(method)
            future = getattr(replica.stub, method).future(
                request, timeout=timeout, metadata=traced.metadata
            )
            traced.finish_with(future)
            futures.append(future)
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
            # A batch is placed by its first call's session.
            session = request.calls[0].session if hasattr(request, "calls") else request.session
            self._placements.suspect(replica.address, component.name, session)
            return PositionError(f"{translated}; the session moves to another replica")
        return translated

    def _targets(self, components: list[_Component], cache: str):
        return [(c, self._replica(c, cache)) for c in components]

    def _trunk_prefill(self, call: PrefillCall) -> HiddenStates:
        """The tokens through the trunk; their hidden states, for the shards' prefill."""
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
        hidden = self._trunk_prefill(call)
        request = wire.jury_prefill_call_to_pb(
            JuryPrefillCall(call.session, call.start, hidden, call.heads)
        )
        shards = self._targets(self.shards, call.session)
        self._call_all(shards, "Prefill", [request] * len(self.shards))

    def draft(self, call: DraftCall) -> DraftResult:
        request = wire.draft_call_to_pb(call)
        targets = self._targets([self.trunk], call.session)
        began = time.perf_counter_ns()
        (response,) = self._call_all(targets, "Draft", [request])
        self.stats.record("draft", began, [request], [response])
        return _decoded(
            targets[0][1], lambda: wire.draft_result_from_pb(response, call, self.info.vocab_size)
        )

    @property
    def pipelines(self) -> bool:
        return self._ahead is not None

    def draft_ahead(self, call: DraftCall) -> Future[tuple[DraftResult, ModelShare]] | None:
        if self._ahead is None:
            return None
        deadline = getattr(self._scope, "deadline", None)
        context = contextvars.copy_context()  # the round's trace span is the call's parent
        try:
            return self._ahead.submit(context.run, self._draft_before, deadline, call)
        except RuntimeError:  # closing: the round makes its draft call itself
            return None

    def _draft_before(
        self, deadline: float | None, call: DraftCall
    ) -> tuple[DraftResult, ModelShare]:
        with self.call_scope(deadline), self.sharing() as share:
            return self.draft(call), share

    def uncertainty(self, session: str, call: UncertaintyCall) -> UncertaintyResult:
        targets = self._targets([self.trunk], session)
        (response,) = self._call_all(targets, "Uncertainty", [wire.uncertainty_call_to_pb(call)])
        return wire.uncertainty_result_from_pb(response)

    def score(self, call: ScoreCall) -> ScoreResult:
        requests = [wire.score_call_to_pb(call)] * len(self.shards)
        targets = self._targets(self.shards, call.session)
        began = time.perf_counter_ns()
        responses = self._call_all(targets, "Score", requests)
        self.stats.record("score", began, requests, responses)
        return self._jury_result(call, targets, responses)

    def score_batch(self, calls: list[ScoreCall]) -> list[ScoreResult]:
        # Every call of a batch goes where the first call's session is placed.
        request = internal_pb2.ScoreBatchRequest(calls=[wire.score_call_to_pb(c) for c in calls])
        requests = [request] * len(self.shards)
        targets = self._targets(self.shards, calls[0].session)
        began = time.perf_counter_ns()
        responses = self._call_all(targets, "ScoreBatch", requests)
        self.stats.record("score", began, requests, responses)
        for (_shard, replica), response in zip(targets, responses, strict=True):
            if len(response.results) != len(calls):
                raise InternalServiceError(
                    f"{replica.name} answered {len(response.results)} of {len(calls)} calls"
                )
        return [
            self._jury_result(call, targets, [response.results[i] for response in responses])
            for i, call in enumerate(calls)
        ]

    def _jury_result(self, call: ScoreCall, targets: list, responses: list) -> ScoreResult:
        """The whole jury's result of `call` from each shard's response."""
        parts = [
            _decoded(
                replica, lambda r=response: wire.score_result_from_pb(r, call, self.info.vocab_size)
            )
            for (_shard, replica), response in zip(targets, responses, strict=True)
        ]
        return combine_shard_scores(call, parts, self.info.head_names)

    def _holders(self, cache: str) -> list[_Replica]:
        """The replicas that may hold the session's caches: where it is placed, or —
        placed by another orchestrator, or before a restart — every ready replica."""
        placed = self._placements.forget(cache)
        holders = []
        for component in self.components:
            addresses = [placed[component.name]] if component.name in placed else None
            for address in addresses or self.discovery.ready(component.name):
                with suppress(ServiceUnavailable, LayoutError):
                    holders.append(self._connect(component, address))
        return holders

    def release(self, session: str) -> None:
        """Best effort on every holder, without the request's deadline: a cancelled or
        failed request must still free its caches. A service that is down holds
        nothing; idle eviction covers the rest."""
        request = internal_pb2.ReleaseRequest(session=session)
        _release_on(self._holders(session), request)

    def finish(self, session: str) -> None:
        """Tells the replicas that hold the session's caches that its generation ended.
        A hint: a replica that misses it reclaims the slot after its --reclaim-after-s
        instead."""
        request = internal_pb2.ReleaseRequest(session=session, keep_caches=True)
        _release_on(self._placed_replicas(session).values(), request)


def _release_on(replicas: Iterable[_Replica], request: internal_pb2.ReleaseRequest) -> None:
    """`request` to every replica at once (one slow replica delays the rest by nothing),
    best effort: a failure is left to the replica's own eviction."""
    pending = []
    for replica in replicas:
        traced = replica.call("Release")
        pending.append(replica.stub.Release.future(request, timeout=5, metadata=traced.metadata))
        traced.finish_with(pending[-1])
    for call in pending:
        with suppress(grpc.RpcError):
            call.result()


def _decoded(service: _Replica, decode: Callable[[], Result]) -> Result:
    """A response decoded; a malformed one is the service's fault, never the client's."""
    try:
        return decode()
    except CodecError as error:
        raise InternalServiceError(f"{service.name} sent a malformed response: {error}") from None


def _translate(service: _Replica, method: str, error: grpc.RpcError) -> Exception:
    return error_from_status(error.code(), f"{service.name} ({method})", error.details() or "")
