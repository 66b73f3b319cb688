"""What the decoding loop needs from the model: `DecodingBackend`, with two transports —
in-process (`orchestrator.local_backend`) and gRPC (`orchestrator.grpc_backend`).

Every method takes one call object from `workers.calls` and returns its result; every
stateful call names the position its caches must start from (the position rule,
`workers.sessions`), so calls are idempotent and there is no rollback call.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from hydra_jury.serving.errors import DeadlineExceeded
from hydra_jury.workers.calls import (
    DraftCall,
    DraftResult,
    HiddenStates,
    PrefillCall,
    ScoreCall,
    ScoreResult,
    UncertaintyCall,
    UncertaintyResult,
)

T = TypeVar("T")


@dataclass(frozen=True)
class ModelInfo:
    fingerprint: str  # sha256 of the checkpoint's hydra.json
    architecture: str
    head_names: tuple[str, ...]  # every `llm` head, in checkpoint order
    drafter_heads: tuple[str, ...]  # heads the trunk can draft with
    vocab_size: int
    context_length: int  # positions a session may reach (model and worker limits)
    eos_token_ids: tuple[int, ...]
    draft_model: str = ""  # the trunk's draft model, described ("": none)
    uncertainty_head: bool = False  # the trunk answers `uncertainty` calls


@dataclass
class ModelShare:
    """A round's model calls, batched with other sessions': the seconds it waited for
    them, and its share of their batches (`serving.cost_line.batch_shares`); and the
    CPU time of the round's own thread since the scope began."""

    waited: float = 0.0
    share: float = 0.0
    cpu_began: float = field(default_factory=time.thread_time)

    def cost(self, wall: float, cpu: float | None = None) -> float:
        """What a round of `wall` seconds (`cpu` of them on its thread's CPU; default:
        measured now) cost the server's throughput: its share of the batches instead
        of the whole batches it waited for, plus its own work outside them. That work is
        its CPU time, plus the rest of its time outside the model calls (hops, waits for
        the interpreter or a core held by other sessions) in the measure the round ran
        alone — share / waited: alone, that rest is its latency and counts in full; among
        many sessions it is their work, counted in theirs. Alone, the cost is the wall
        time; with no batched call, too."""
        if self.waited <= 0:
            return wall
        own = (time.thread_time() - self.cpu_began) if cpu is None else cpu
        outside = max(wall - self.waited, 0.0)
        own = min(own, outside)
        alone = min(self.share / self.waited, 1.0)
        return self.share + own + (outside - own) * alone


class DecodingBackend(ABC):
    info: ModelInfo
    trunk_address: str  # where the trunk runs ("in-process" for the local backend)
    jury_addresses: tuple[str, ...]  # the jury shards (none in-process)

    def __init__(self) -> None:
        self._scope = threading.local()

    @abstractmethod
    def place(self, cache: str, stored: dict[str, str]) -> dict[str, str]:
        """Chooses where the caches named `cache` live: the replicas in `stored` (a
        session record's placement) while they are ready, else the least loaded.
        Returns the placement as component -> "address@epoch"; when it differs from
        `stored`, the caches are not there (moved, restarted) and must be prefilled."""

    @abstractmethod
    def placement(self, cache: str) -> dict[str, str]:
        """Where the caches named `cache` live now (after the calls so far)."""

    @contextmanager
    def call_scope(self, deadline: float | None) -> Iterator[None]:
        """Calls made by this thread inside the scope stop at `deadline` (a
        `time.monotonic()` value; None: no deadline)."""
        self._scope.deadline = deadline
        try:
            yield
        finally:
            self._scope.deadline = None

    @contextmanager
    def sharing(self) -> Iterator[ModelShare]:
        """What this thread's model calls inside the scope cost (`ModelShare`), where
        the backend batches them with other sessions' (the single-process server);
        elsewhere the share stays empty and a round's cost is its time."""
        share = ModelShare()
        self._scope.share = share
        try:
            yield share
        finally:
            self._scope.share = None

    def _shared(self, waited: float, share: float) -> None:
        """A batched call of this thread: `waited` seconds for it, `share` of its batches."""
        current = getattr(self._scope, "share", None)
        if current is not None:
            current.waited += waited
            current.share += share

    def time_left(self) -> float | None:
        """Seconds to the deadline of this thread's scope (None: no deadline); raises
        `DeadlineExceeded` once it has passed."""
        deadline = getattr(self._scope, "deadline", None)
        if deadline is None:
            return None
        left = deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded("the request's deadline passed during generation")
        return left

    # Whether the loop's own maths on each generation thread must run on that thread
    # alone. A backend whose model runs in this process on a thread of its own asks for
    # it: one OpenMP team per generation thread beside the model's would hold more
    # threads than there are cores, and libgomp then wakes its threads for every
    # parallel region instead of keeping them spinning (`serving.model_thread`).
    loop_on_one_thread: bool = False

    def run_round(self, function: Callable[..., T], *args: Any) -> T:
        """Runs one step of the loop (its model calls and its maths). Here by default; a
        backend whose compute has a thread of its own runs it there, so that the loop's
        tensor maths and the model share one set of CPU threads."""
        return function(*args)

    @abstractmethod
    def prefill(self, call: PrefillCall) -> None:
        """Processes the tokens in the trunk and the jury."""

    @abstractmethod
    def trunk_forward_batch(self, calls: list[PrefillCall]) -> list[HiddenStates]:
        """Several sessions' tokens through the trunk in one batched forward (the beams
        of a beam search); their hidden states, in order."""

    @abstractmethod
    def score_batch(self, calls: list[ScoreCall]) -> list[ScoreResult]:
        """Several sessions' score calls in one batched forward of every shard; the
        results, in order, as `score` gives them."""

    @abstractmethod
    def draft(self, call: DraftCall) -> DraftResult:
        """γ trunk + draft-head steps from the pending token (`workers.trunk`). The
        result's tensors are on the host; its hidden states are an opaque handle."""

    @property
    def pipelines(self) -> bool:
        """Whether `draft_ahead` may take a call at all (when not, a round does not even
        make the call it would send)."""
        return False

    def draft_ahead(self, call: DraftCall) -> Future[tuple[DraftResult, ModelShare]] | None:
        """Starts `call` so that it runs while this thread makes its next calls (pipelined
        rounds: the next round's draft beside this round's score), or None where this
        backend does not pipeline rounds (the default). The future gives the result and
        what the call cost (`ModelShare`, for `count_ahead`). The caller waits for the
        future before it calls the trunk about the session again: the position rule
        holds only for one call of a session at a time."""
        return None

    def count_ahead(self, share: ModelShare) -> None:
        """Counts a call sent ahead in the scope of the round that uses its result
        (`sharing`): what it cost is that round's, though it ran before the round began."""
        self._shared(share.waited, share.share)

    @abstractmethod
    def score(self, call: ScoreCall) -> ScoreResult:
        """The whole jury's log-product (the shards' partials added) and votes, in
        checkpoint order, on the host."""

    @abstractmethod
    def uncertainty(self, session: str, call: UncertaintyCall) -> UncertaintyResult:
        """The uncertainty head's verdict on a finished answer (stateless; `session`
        only routes it, to the trunk replica that holds the session)."""

    @abstractmethod
    def release(self, session: str) -> None:
        """Frees the session's caches everywhere (best effort)."""

    @abstractmethod
    def finish(self, session: str) -> None:
        """The generation on the session's caches ended: the services keep them for the
        conversation's next turn, but give their slots to the first new sessions that
        need them (best effort; `workers.sessions`)."""

    @abstractmethod
    def close(self) -> None:
        """Releases what the backend holds (connections, threads)."""
