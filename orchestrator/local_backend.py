"""The in-process transport of the decoding loop: the trunk and jury workers in this
process, sharing one loaded model's weights.

Standalone (the CLI's `generate --local`, tests, benchmarks) the loop calls the workers
on its own thread. In a server, where several requests run the loop on threads of their
own, pass a `ModelThread`: every worker call then runs there, one at a time, so the
workers need no locks and all compute shares one OpenMP thread team. With `batching` as
well (the single-process server), the calls of concurrent generations are batched as the
split services batch them (`serving.worker_batchers`): each generation's round runs on its
own thread, and its model calls join one forward with the other sessions' on the model
thread. Without it a whole round runs on the model thread, one round at a time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

from hydra_jury.hydra_model import DraftModel, HydraModel
from hydra_jury.orchestrator.backend import DecodingBackend, ModelInfo, ModelShare
from hydra_jury.serving.batcher import BatchLimits
from hydra_jury.serving.errors import CallCancelled, DeadlineExceeded, InternalServiceError
from hydra_jury.serving.metrics import ServiceMetrics
from hydra_jury.serving.model_thread import ModelThread
from hydra_jury.serving.server import new_epoch
from hydra_jury.serving.worker_batchers import WorkerBatchers
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
from hydra_jury.workers.errors import InvalidArgument
from hydra_jury.workers.jury import JuryWorker
from hydra_jury.workers.sessions import SessionLimits
from hydra_jury.workers.trunk import TrunkWorker

T = TypeVar("T")


class LocalBackend(DecodingBackend):
    trunk_address = "in-process"
    jury_addresses = ()

    def __init__(
        self,
        model: HydraModel,
        *,
        drafter_heads: list[str] | None = None,
        draft_model: DraftModel | None = None,
        limits: SessionLimits | None = None,
        thread: ModelThread | None = None,
        batching: BatchLimits | None = None,
        batch_metrics: ServiceMetrics | None = None,
    ) -> None:
        """`batching` (with `thread`): batch the calls of concurrent generations within
        these limits, reporting to `batch_metrics`."""
        super().__init__()
        self.trunk = TrunkWorker(
            model, drafter_heads=drafter_heads, draft_model=draft_model, limits=limits
        )
        self.jury = JuryWorker(model, limits=limits)
        self._thread = thread
        self.batchers = None
        if batching is not None:
            if thread is None:
                raise ValueError("batching needs a model thread")
            self.batchers = WorkerBatchers(self.trunk, self.jury, thread, batching, batch_metrics)
        self._epoch = new_epoch()
        config = model.config
        self.info = ModelInfo(
            fingerprint=model.fingerprint,
            architecture=config.model_type,
            head_names=tuple(model.head_names),
            drafter_heads=tuple(self.trunk.drafters),
            vocab_size=config.vocab_size,
            context_length=self.trunk.max_session_tokens,
            eos_token_ids=config.eos_token_ids,
            draft_model=draft_model.description if draft_model is not None else "",
            uncertainty_head=self.trunk.uncertainty_head is not None,
        )

    def place(self, cache: str, stored: dict[str, str]) -> dict[str, str]:
        return self.placement(cache)

    def placement(self, cache: str) -> dict[str, str]:
        return {"workers": f"in-process@{self._epoch}"}

    @property
    def loop_on_one_thread(self) -> bool:
        """Batched, the rounds' maths run beside the model thread."""
        return self.batchers is not None

    def run_round(self, function: Callable[..., T], *args) -> T:
        """On the model thread when there is one and calls are not batched (a call from
        it runs at once); batched, here, its model calls joining other sessions'."""
        if self.batchers is not None:
            return function(*args)
        return self._on_model_thread(function, *args)

    def _on_model_thread(self, function: Callable[..., T], *args) -> T:
        if self._thread is None:
            return function(*args)
        return self._thread.call(function, *args)

    def _run(self, function: Callable[..., T], *args) -> T:
        self.time_left()  # raises once the request's deadline has passed
        try:
            return self._on_model_thread(function, *args)
        except InvalidArgument as error:
            raise _refused(error) from None

    def _batched(self, rpc: str, calls: list[Any]) -> list[Any]:
        """Each call's result from the batcher of `rpc` (submitted together, so that they
        may share a batch), within the request's deadline."""
        began = time.perf_counter()
        futures = [self.batchers.submit(rpc, call) for call in calls]
        try:
            outcomes = [self._wait(future) for future in futures]
            self._shared(time.perf_counter() - began, sum(share for _, share in outcomes))
            return [result for result, _ in outcomes]
        finally:
            for future in futures:
                future.cancel()  # (a no-op once done) nothing left queued for a caller gone

    def _wait(self, future: Future) -> Any:
        try:
            return future.result(timeout=self.time_left())
        except FutureTimeout:
            raise DeadlineExceeded("the request's deadline passed during generation") from None
        except CancelledError:
            raise CallCancelled("the call was cancelled") from None
        except InvalidArgument as error:
            raise _refused(error) from None

    def prefill(self, call: PrefillCall) -> None:
        if self.batchers is None:
            self._run(self._prefill, call)
            return
        try:
            chunks = self.batchers.chunks(call)
        except InvalidArgument as error:
            raise _refused(error) from None
        for chunk in chunks:  # each in its own batch, after the one before
            self._batched("Prefill", [chunk])

    def _prefill(self, call: PrefillCall) -> None:
        hidden = self.trunk.prefill(call)
        self.jury.prefill(JuryPrefillCall(call.session, call.start, hidden, call.heads))

    def trunk_forward_batch(self, calls: list[PrefillCall]) -> list[HiddenStates]:
        if self.batchers is not None:
            return self._batched("TrunkForward", calls)
        return self._run(self.trunk.prefill_batch, calls)

    # The loop's maths runs on the host, on [γ, V] tensors, as it does over gRPC; the
    # hidden states stay on the model's device for the jury.
    def score_batch(self, calls: list[ScoreCall]) -> list[ScoreResult]:
        if self.batchers is not None:
            return self._batched("Score", calls)
        return self._run(lambda: [result.on_host() for result in self.jury.score_batch(calls)])

    def draft(self, call: DraftCall) -> DraftResult:
        if self.batchers is not None:
            return self._batched("Draft", [call])[0]
        return self._run(lambda: self.trunk.draft(call).on_host())

    @property
    def pipelines(self) -> bool:
        return self.batchers is not None

    def draft_ahead(self, call: DraftCall) -> Future[tuple[DraftResult, ModelShare]] | None:
        """Batched (the single-process server), a plain step's `call` (or a one-pass
        check's of drafts made outside) goes to the Draft batcher now and runs with the
        other sessions' steps while this thread goes on; else None. Not a head draft:
        sent before the verdict, it would be wasted work whenever a draft token is
        rejected, and in one process it has no jury on other cores to overlap with — the
        model thread is the same."""
        if self.batchers is None or call.draft_head is not None or call.draft_model:
            return None
        started = threading.Event()
        sent = time.perf_counter()
        submitted = self.batchers.submit("Draft", call, started)
        result: Future[tuple[DraftResult, ModelShare]] = Future()

        def done(future: Future) -> None:
            if future.cancelled():
                result.cancel()
            elif future.exception() is not None:
                result.set_exception(future.exception())
            else:
                draft, share = future.result()
                result.set_result((draft, ModelShare(time.perf_counter() - sent, share)))

        submitted.add_done_callback(done)
        # This round's metrics, commit and stream wait (at most a batch window) until the
        # step has gone to the model thread. Done at once, they hold the interpreter
        # while the other sessions, drawing their tokens, are still on their way to the
        # same batch, and the model waits for the last of them; done after, they run
        # beside the step's native code. (8 sessions of `serve`, 2-core AMD EPYC, taken
        # turn about on one server: the step began 6.6-8 ms after the last Score batch
        # instead of 7.3-10.5, and 1.011x and 1.036x the tokens/s in two runs; one
        # session 1.005x.)
        started.wait(self.batchers.limits.window_s)
        return result

    def score(self, call: ScoreCall) -> ScoreResult:
        return self.score_batch([call])[0]

    def uncertainty(self, session: str, call: UncertaintyCall) -> UncertaintyResult:
        return self._run(self.trunk.uncertainty, call)

    def release(self, session: str) -> None:
        self._left(session)
        # Without the deadline: a cancelled or failed request must still free its caches.
        self._on_model_thread(self._release_everywhere, session)

    def _left(self, session: str) -> None:
        """The batches stop waiting for the session's next call: its generation ended."""
        if self.batchers is not None:
            self.batchers.left(session)

    def _release_everywhere(self, session: str) -> None:
        self.trunk.release(session)
        self.jury.release(session)

    def finish(self, session: str) -> None:
        self._left(session)
        self._on_model_thread(self._finish_everywhere, session)

    def _finish_everywhere(self, session: str) -> None:
        self.trunk.finish(session)
        self.jury.finish(session)

    def close(self) -> None:
        if self.batchers is not None:
            self.batchers.close()
        if self._thread is not None:
            self._thread.shutdown()


def _refused(error: InvalidArgument) -> InternalServiceError:
    # The loop checked the request before calling: a worker refusing a call is the
    # loop's bug, never the client's argument (as over gRPC).
    return InternalServiceError(f"the in-process workers refused a call: {error}")
