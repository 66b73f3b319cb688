"""The in-process transport of the decoding loop: the trunk and jury workers in this
process, sharing one loaded model's weights."""

from __future__ import annotations

from hydra_model import HydraModel
from orchestrator.backend import DecodingBackend, ModelInfo
from workers.calls import (
    DraftCall,
    DraftResult,
    JuryPrefillCall,
    PrefillCall,
    ScoreCall,
    ScoreResult,
)
from workers.jury import JuryWorker
from workers.sessions import SessionLimits
from workers.trunk import TrunkWorker


class LocalBackend(DecodingBackend):
    def __init__(
        self,
        model: HydraModel,
        *,
        drafter_heads: list[str] | None = None,
        limits: SessionLimits | None = None,
    ) -> None:
        self.trunk = TrunkWorker(model, drafter_heads=drafter_heads, limits=limits)
        self.jury = JuryWorker(model, limits=limits)
        config = model.config
        self.info = ModelInfo(
            head_names=tuple(model.head_names),
            drafter_heads=tuple(self.trunk.drafters),
            vocab_size=config.vocab_size,
            context_length=self.trunk.max_session_tokens,
            eos_token_ids=config.eos_token_ids,
        )

    def prefill(self, call: PrefillCall) -> None:
        hidden = self.trunk.prefill(call)
        self.jury.prefill(JuryPrefillCall(call.session, call.start, hidden))

    # The loop's maths runs on the host, on [γ, V] tensors, as it does over gRPC; the
    # hidden states stay on the model's device for the jury.
    def draft(self, call: DraftCall) -> DraftResult:
        return self.trunk.draft(call).on_host()

    def score(self, call: ScoreCall) -> ScoreResult:
        return self.jury.score(call).on_host()

    def release(self, session: str) -> None:
        self.trunk.release(session)
        self.jury.release(session)
