"""The in-process transport of the decoding loop: the trunk and jury workers in this
process, sharing one loaded model's weights.

Standalone (the CLI's `generate --local`, tests, benchmarks) the loop calls the workers
on its own thread. In a server, where several requests run the loop on threads of their
own, pass a `ModelThread`: every worker call then runs there, one at a time, so the
workers need no locks and all compute shares one OpenMP thread team.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from hydra_jury.hydra_model import DraftModel, HydraModel
from hydra_jury.orchestrator.backend import DecodingBackend, ModelInfo
from hydra_jury.serving.errors import InternalServiceError
from hydra_jury.serving.model_thread import ModelThread
from hydra_jury.serving.server import new_epoch
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
    ) -> None:
        super().__init__()
        self.trunk = TrunkWorker(
            model, drafter_heads=drafter_heads, draft_model=draft_model, limits=limits
        )
        self.jury = JuryWorker(model, limits=limits)
        self._thread = thread
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

    def run_round(self, function: Callable[..., T], *args) -> T:
        """On the model thread when there is one (a call from it runs at once)."""
        if self._thread is None:
            return function(*args)
        return self._thread.call(function, *args)

    def _run(self, function: Callable[..., T], *args) -> T:
        self.time_left()  # raises once the request's deadline has passed
        try:
            return self.run_round(function, *args)
        except InvalidArgument as error:
            # The loop checked the request before calling: a worker refusing a call is
            # the loop's bug, never the client's argument (as over gRPC).
            raise InternalServiceError(f"the in-process workers refused a call: {error}") from None

    def prefill(self, call: PrefillCall) -> None:
        self._run(self._prefill, call)

    def _prefill(self, call: PrefillCall) -> None:
        hidden = self.trunk.prefill(call)
        self.jury.prefill(JuryPrefillCall(call.session, call.start, hidden, call.heads))

    def trunk_forward(self, call: PrefillCall) -> HiddenStates:
        return self._run(self.trunk.prefill, call)

    def trunk_forward_batch(self, calls: list[PrefillCall]) -> list[HiddenStates]:
        return self._run(self.trunk.prefill_batch, calls)

    def score_batch(self, calls: list[ScoreCall]) -> list[ScoreResult]:
        return self._run(lambda: [result.on_host() for result in self.jury.score_batch(calls)])

    # The loop's maths runs on the host, on [γ, V] tensors, as it does over gRPC; the
    # hidden states stay on the model's device for the jury.
    def draft(self, call: DraftCall) -> DraftResult:
        return self._run(lambda: self.trunk.draft(call).on_host())

    def score(self, call: ScoreCall) -> ScoreResult:
        return self._run(lambda: self.jury.score(call).on_host())

    def uncertainty(self, session: str, call: UncertaintyCall) -> UncertaintyResult:
        return self._run(self.trunk.uncertainty, call)

    def release(self, session: str) -> None:
        # Without the deadline: a cancelled or failed request must still free its caches.
        self.run_round(self._release_everywhere, session)

    def _release_everywhere(self, session: str) -> None:
        self.trunk.release(session)
        self.jury.release(session)

    def finish(self, session: str) -> None:
        self.run_round(self._finish_everywhere, session)

    def _finish_everywhere(self, session: str) -> None:
        self.trunk.finish(session)
        self.jury.finish(session)

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown()
